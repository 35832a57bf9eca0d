"""EmbeddedPostgres does not outlive an owner killed with SIGKILL (a CI timeout, the OOM killer,
an IDE's stop button): a real child process starts one and is killed, and its watchdog stops
the postmaster and deletes the temporary directories, also when the whole process group is
killed, and also while a fork()ed child of the owner lives on. A normal close() or exit ends
and reaps the watchdog, which does no cleanup of its own then. A server that outlives its stop
(the watchdog's or the owner's) keeps its directories, and stderr says so."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grpc_idempotency.testing import EmbeddedPostgres, _postmaster
from grpc_idempotency.testing._postmaster import alive, clean_up
from tests.support.waiting import until

# The child starts a server, prints what it owns, and waits to be killed (or exits at once).
CHILD = """
import json, os, signal, sys

from grpc_idempotency.testing import EmbeddedPostgres, _postmaster

mode, data_dir = sys.argv[1], sys.argv[2] or None
pg = EmbeddedPostgres(data_dir, durable=False)
pg.start()
watchdog = getattr(pg, "_watchdog", None)
owned = {
    "pid": int((pg._data_dir / "postmaster.pid").read_text().splitlines()[0]),
    "watchdog": None if watchdog is None else watchdog.pid,
    "data_dir": str(pg._data_dir),
    "socket_dir": str(pg._socket_dir),
    "forked": None,
}
if mode == "fork":
    forked = os.fork()
    if forked == 0:  # a child that never exec()s and outlives its parent
        while True:
            signal.pause()
    owned["forked"] = forked
print(json.dumps(owned), flush=True)
if mode != "exit":
    while True:
        signal.pause()
"""

PORT = 5432  # EmbeddedPostgres's socket name without a tcp_port
DEADLINE_S = 30.0


Owned = dict[str, Any]


def _start_child(
    mode: str, leftovers: list[Owned], data_dir: Path | None = None
) -> tuple[subprocess.Popen[str], Owned]:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), mode, str(data_dir or "")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, to kill as a CI timeout does
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # bounded: the child either prints or exits (EOF)
    assert line, f"the child exited before its server started (exit {child.wait(30)})"
    owned: Owned = json.loads(line)
    owned["child"] = child
    owned["temporary"] = data_dir is None
    leftovers.append(owned)
    return child, owned


@pytest.fixture
def leftovers() -> Iterator[list[Owned]]:
    """What the children owned: whatever a failing test leaves is stopped and deleted here."""
    owned: list[Owned] = []
    yield owned
    for o in owned:
        child = o["child"]
        if child.poll() is None:
            child.kill()
        child.wait()
        for pid in (o["forked"], o["watchdog"]):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        dirs = (Path(o["data_dir"]), Path(o["socket_dir"]))
        clean_up(dirs[0], dirs[1], PORT, dirs if o["temporary"] else dirs[1:], "immediate")


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    # Under the system temp dir, not pytest's tmp_path: as root, the server account must be
    # able to reach it, and pytest's base dir is private to its user.
    parent = Path(tempfile.mkdtemp(prefix="gi-watchdog-test-"))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _orphaned_watchdog(command: list[str], args: list[str]) -> tuple[int, str]:
    """Runs a watchdog (``command``, its pipe's read end, then ``args``) whose owner's end of
    the pipe is closed at once, as the owner's death closes it: its exit status and stderr."""
    read_end, write_end = os.pipe()
    watchdog = subprocess.Popen(
        [*command, str(read_end), *args],
        pass_fds=(read_end,),
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(read_end)
    os.close(write_end)  # the owner's end: the watchdog acts
    try:
        _, stderr = watchdog.communicate(timeout=DEADLINE_S)
    finally:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
    return watchdog.returncode, stderr


def _gone(path: str) -> bool:
    return not Path(path).exists()


_NOBODY = 65534


def test_a_pid_file_naming_another_accounts_process_still_removes_the_dirs() -> None:
    """The owner dies after its postmaster did (the OOM killer's SIGKILL), leaving
    postmaster.pid behind, and the pid is another account's process by then (reused: 32768 pids
    on many machines). The watchdog could not signal it, died of the PermissionError, and left
    the instance's directories behind. That process is no server of ours: they are deleted.

    Another account's process: pid 1's, the watchdog run as another account than its own."""
    as_other: tuple[str, ...] = ()
    uid = os.geteuid()
    if uid == 0:
        setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
        if setpriv is None:
            pytest.skip("as root, the watchdog runs as nobody through setpriv: not found")
        as_other = (setpriv, f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--")
        uid = _NOBODY
    if os.stat("/proc/1").st_uid == uid:
        pytest.skip("pid 1 is this account's: no other account's process to name")
    parent = Path(tempfile.mkdtemp(prefix="gi-watchdog-test-"))
    try:
        data_dir, socket_dir = parent / "data", parent / "socket"
        for path in (parent, data_dir, socket_dir):
            path.mkdir(exist_ok=True)
            os.chown(path, uid, -1)
        (data_dir / "postmaster.pid").write_text(
            f"1\n{data_dir}\n1700000000\n{PORT}\n{socket_dir}\nlocalhost\n"
        )
        args = [str(data_dir), str(socket_dir), str(PORT)]
        owned = [str(data_dir), str(socket_dir)]
        command = [*as_other, sys.executable, "-I", "-S", _postmaster.__file__]
        returncode, stderr = _orphaned_watchdog(command, [*args, *owned])
        assert returncode == 0, stderr
        assert not data_dir.exists() and not socket_dir.exists(), stderr
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.parametrize("kill", ["process", "process-group"])
@pytest.mark.parametrize("data_dir", ["temporary", "callers"])
async def test_sigkill_of_the_owner_stops_the_server_and_removes_its_dirs(
    kill: str, data_dir: str, reachable_dir: Path, leftovers: list[Owned]
) -> None:
    callers = reachable_dir / "pgdata" if data_dir == "callers" else None
    child, owned = _start_child("wait", leftovers, callers)
    assert alive(owned["pid"])
    if kill == "process":
        child.kill()
    else:
        os.killpg(child.pid, signal.SIGKILL)  # the watchdog has a session of its own
    assert child.wait(30) == -signal.SIGKILL
    await until("the postmaster to be gone", lambda: not alive(owned["pid"]), DEADLINE_S)
    await until("the socket dir to be removed", lambda: _gone(owned["socket_dir"]), DEADLINE_S)
    if callers is None:
        await until("the data dir to be removed", lambda: _gone(owned["data_dir"]), DEADLINE_S)
    await until("the watchdog to exit", lambda: not alive(owned["watchdog"]), DEADLINE_S)
    if callers is not None:
        # The caller's data directory is kept, shut down cleanly: it starts again as is.
        assert (callers / "PG_VERSION").exists()
        assert not (callers / "postmaster.pid").exists()
        with EmbeddedPostgres(callers, durable=False) as pg:
            assert pg.running


async def test_a_forked_child_that_lives_on_does_not_keep_the_server(
    leftovers: list[Owned],
) -> None:
    child, owned = _start_child("fork", leftovers)
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    await until("the postmaster to be gone", lambda: not alive(owned["pid"]), DEADLINE_S)
    await until("the data dir to be removed", lambda: _gone(owned["data_dir"]), DEADLINE_S)
    assert alive(owned["forked"]), "the fork()ed child was to outlive the cleanup"


def test_a_normal_exit_reaps_the_watchdog(leftovers: list[Owned]) -> None:
    child, owned = _start_child("exit", leftovers)
    assert child.wait(60) == 0
    # The finalizer killed and reaped it before the child ended: no zombie, no orphan that
    # cleans up after the exit.
    assert not Path(f"/proc/{owned['watchdog']}").exists()
    assert not alive(owned["pid"])
    assert _gone(owned["data_dir"]) and _gone(owned["socket_dir"])


def _watchdogs_of(pg: EmbeddedPostgres) -> list[int]:
    # The postmaster's command line names the socket dir too, not the watchdog's script.
    return _processes_naming("_postmaster.py", str(pg._socket_dir))


def _processes_naming(*texts: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue  # exited meanwhile
            if all(text.encode() in cmdline for text in texts):
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs procfs")
def test_close_ends_and_reaps_the_one_watchdog_of_an_instance() -> None:
    pg = EmbeddedPostgres(durable=False)
    try:
        pg.start()
        watchdog = pg._watchdog.pid
        assert watchdog is not None
        assert _watchdogs_of(pg) == [watchdog]
        pg.stop()
        pg.start()  # a restart keeps the instance's one watchdog
        assert _watchdogs_of(pg) == [watchdog]
    finally:
        pg.close()
    assert not Path(f"/proc/{watchdog}").exists(), "the watchdog outlived close() (or a zombie)"
    assert _watchdogs_of(pg) == []


FORKED_START = textwrap.dedent(
    """
    import os, sys
    from grpc_idempotency.testing import EmbeddedPostgres, _postmaster

    pg = EmbeddedPostgres(durable=False)
    pg.start()
    pg.stop()  # the server down, its watchdog still running
    watchdog, fd = pg._watchdog.pid, pg._watchdog._fd
    child = os.fork()
    if child == 0:
        # The at-fork hook closed the write end: its number may be another file's by now.
        os.dup2(os.open(os.devnull, os.O_RDONLY), fd)
        try:
            # What start() runs first (the rest, initdb and pg_ctl, is the owner's business).
            pg._watchdog.arm(pg._data_dir, pg._socket_dir, pg._port, pg._owned)
            pg._watchdog.disarm()
            os.fstat(fd)  # OSError (EBADF): the child closed someone else's file
        except BaseException as exc:
            print(f"child: {exc!r}", file=sys.stderr)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    alive = os.path.exists(f"/proc/{watchdog}")
    pg.start()  # the owner's instance is still whole
    same = pg._watchdog.pid == watchdog
    pg.close()
    print(os.waitstatus_to_exitcode(status), alive, same)
    """
)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs procfs")
def test_a_forked_child_arming_the_watchdog_leaves_the_owners_watchdog_and_files() -> None:
    """Arming (start()'s first step) in a fork()'s child took the owner's watchdog for its own:
    poll() of a process that is not its child read as exited, and the child closed the write
    end's number, which by then may be another of its files."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED_START], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True", "True"], done.stderr


# A stand-in for a postmaster that outlives its stop: a process of this account that ignores
# both stopping signals and whose arguments name the instance's socket directory, as pg_ctl
# starts the postmaster (``is_postmaster``'s proof that it is the instance's server).
UNSTOPPABLE = textwrap.dedent(
    """
    import signal, sys
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        signal.pause()
    """
)

# The watchdog as the owner starts it (-I -S, the module by path), its wait for the server cut
# from 60 s to a fraction of a second: a server that outlives it is reached at once.
SHORT_WAIT_WATCHDOG = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {directory!r})
    import _postmaster
    _postmaster._PG_CTL_WAIT_S = 0.2
    _postmaster.watch(sys.argv[1:])
    """
)


@pytest.fixture
def unstoppable_server() -> Iterator[Any]:
    """A factory: ``start(socket_dir)`` runs an ``UNSTOPPABLE`` server for that socket dir."""
    started: list[subprocess.Popen[str]] = []

    def start(socket_dir: Path) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", UNSTOPPABLE, f"unix_socket_directories={socket_dir}"]
        server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        started.append(server)
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        return server

    yield start
    for server in started:
        server.kill()
        server.wait()


def _pid_file(data_dir: Path, pid: int, socket_dir: Path) -> None:
    (data_dir / "postmaster.pid").write_text(
        f"{pid}\n{data_dir}\n1700000000\n{PORT}\n{socket_dir}\n\n  5432001   0\nready   \n"
    )


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs procfs")
@pytest.mark.parametrize("failure", ["not-in-time", "not-signalled"])
def test_a_server_the_watchdog_cannot_stop_keeps_its_dirs(
    failure: str, reachable_dir: Path, unstoppable_server: Any
) -> None:
    """The watchdog deleted the instance's directories also when the server outlived its stop
    (it ignored the signal past the wait, or the watchdog's account may not signal it): a
    running server's data directory, socket and pg_hba.conf deleted under it. It leaves them,
    says so on stderr with the pid and the paths, and exits 1.

    not-signalled: the server runs as this account, the watchdog as nobody (through setpriv,
    so as root only), which may not signal it (nor, being no root, have it signalled)."""
    as_other: tuple[str, ...] = ()
    if failure == "not-signalled":
        setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
        if os.geteuid() != 0 or setpriv is None:
            pytest.skip("needs root and setpriv to run the watchdog as another account")
        as_other = (setpriv, f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--")
    data_dir, socket_dir = reachable_dir / "data", reachable_dir / "socket"
    data_dir.mkdir(mode=0o755)
    socket_dir.mkdir(mode=0o700)
    (socket_dir / "pg_hba.conf").write_text("local all all trust\n")
    if as_other:
        # Its owned dirs are nobody's to delete: only the stop stands between them and rmtree.
        os.chown(reachable_dir, _NOBODY, -1)
        os.chown(socket_dir, _NOBODY, -1)
    server = unstoppable_server(socket_dir)
    _pid_file(data_dir, server.pid, socket_dir)
    args = [str(data_dir), str(socket_dir), str(PORT), str(data_dir), str(socket_dir)]
    script = SHORT_WAIT_WATCHDOG.format(directory=str(Path(_postmaster.__file__).parent))
    command = [*as_other, sys.executable, "-I", "-S", "-c", script]
    returncode, stderr = _orphaned_watchdog(command, args)
    assert server.poll() is None
    assert (data_dir / "postmaster.pid").exists(), stderr
    assert (socket_dir / "pg_hba.conf").exists(), stderr
    assert f"postmaster pid {server.pid}" in stderr
    assert str(data_dir) in stderr and str(socket_dir) in stderr
    assert returncode == 1, stderr


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs procfs")
def test_a_server_the_owner_cannot_stop_keeps_its_dirs(
    unstoppable_server: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """close() raises when the server outlives its stop, and keeps the directories; but the
    finalizer (garbage collection, interpreter exit, SIGTERM) then deleted them under the
    running server. It leaves them, says so on stderr, as the watchdog does, and leaves the
    watchdog armed: once the owner has ended and the server is gone, it deletes them."""
    monkeypatch.setattr(_postmaster, "_PG_CTL_WAIT_S", 0.2)
    pg = EmbeddedPostgres(durable=False)
    dirs = (pg._data_dir, pg._socket_dir)
    try:
        server = unstoppable_server(pg._socket_dir)
        _pid_file(pg._data_dir, server.pid, pg._socket_dir)
        pg._watchdog.arm(pg._data_dir, pg._socket_dir, pg._port, pg._owned)  # start()'s
        watchdog = pg._watchdog._proc
        assert watchdog is not None
        with pytest.raises(RuntimeError, match=f"pid {server.pid}"):
            pg.close()
        assert all(path.exists() for path in dirs)
        pg._finalizer()  # what garbage collection or interpreter exit runs
        assert server.poll() is None
        assert all(path.exists() for path in dirs)
        stderr = capsys.readouterr().err
        assert f"postmaster pid {server.pid}" in stderr
        assert all(str(path) in stderr for path in dirs)
        assert watchdog.poll() is None, "the finalizer ended the watchdog: no second try"
        server.kill()
        server.wait()
        pg._watchdog._close_write_end()  # as the owner's end does
        assert watchdog.wait(DEADLINE_S) == 0
        assert not any(path.exists() for path in dirs)
    finally:
        pg._watchdog.disarm()
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)
