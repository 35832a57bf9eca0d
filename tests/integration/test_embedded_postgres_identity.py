"""EmbeddedPostgres knows its postmaster by more than the pid in postmaster.pid: a stale file
whose pid now belongs to an unrelated process of the same account (pids are reused: 32768 on
many machines) is neither taken for a running server nor sent a stopping signal; and run as
root without the kill capability (CAP_KILL, dropped in some containers), where no signal to the
server's account is allowed, the owner and its watchdog still stop the server they started."""

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

import pytest

from grpc_idempotency.testing import EmbeddedPostgres, embedded
from grpc_idempotency.testing._postmaster import (
    alive,
    clean_up,
    postmaster,
    read_pid_file,
    stop_server,
)
from tests.support.postgres_answers import answers
from tests.support.waiting import until

PORT = 5432  # EmbeddedPostgres's socket name without a tcp_port
DEADLINE_S = 30.0


@pytest.fixture
def parent_dir() -> Iterator[Path]:
    # Under the system temp dir, not pytest's tmp_path: as root, the server account must be
    # able to reach it, and pytest's base dir is private to its user.
    parent = Path(tempfile.mkdtemp(prefix="gi-identity-test-"))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(params=["sleep", "postgres"])
def unrelated(
    request: pytest.FixtureRequest, parent_dir: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this account that is no server of ours: ``sleep``, or ``sleep`` run
    under the name ``postgres`` (its command name is then postgres, as another cluster's
    process that took the pid would be)."""
    program = shutil.which("sleep")
    assert program is not None
    if request.param == "postgres":
        bin_dir = parent_dir / "bin"
        bin_dir.mkdir()
        (bin_dir / "postgres").symlink_to(program)
        program = str(bin_dir / "postgres")
    process = subprocess.Popen([program, "60"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _stale_pid_file(data_dir: Path, pid: int, socket_dir: Path) -> None:
    # As the server writes it: pid, data dir, start time, port, socket dir, listen address,
    # shared memory key, status.
    (data_dir / "postmaster.pid").write_text(
        f"{pid}\n{data_dir}\n1700000000\n{PORT}\n{socket_dir}\n\n  5432001   0\nready   \n"
    )


def test_a_reused_pid_is_no_server_and_gets_no_signal(
    parent_dir: Path, unrelated: subprocess.Popen[bytes]
) -> None:
    """The postmaster died without its owner's knowing (the OOM killer's SIGKILL) and its pid
    went to an unrelated process: it was taken for the running server, and stop(), close() and
    the watchdog sent it SIGINT (SIGQUIT for the watchdog's own data dir)."""
    data_dir, socket_dir = parent_dir / "data", parent_dir / "socket"
    data_dir.mkdir()
    socket_dir.mkdir()
    _stale_pid_file(data_dir, unrelated.pid, socket_dir)
    assert postmaster(data_dir, socket_dir, PORT) is None
    assert stop_server(data_dir, socket_dir, PORT, "fast") is None
    clean_up(data_dir, socket_dir, PORT, (data_dir, socket_dir), "immediate")
    assert unrelated.poll() is None, "a stopping signal reached an unrelated process"
    assert not data_dir.exists() and not socket_dir.exists()


async def test_a_stale_pid_file_naming_a_reused_pid_is_started_over(
    parent_dir: Path, unrelated: subprocess.Popen[bytes]
) -> None:
    """Its own server gone, an instance whose postmaster.pid names a process that took the pid
    said ``running`` and start() returned the DSN of no server; another instance on the data
    directory refused to start, "another PostgreSQL server is already running". That one is
    not told by the socket dir, and still refuses (as postgres itself does: a live pid is a
    running server, whatever program it seems to run here, see the pid namespace test below),
    but says which file to delete if no server runs there, and leaves it in place."""
    data_dir = parent_dir / "pgdata"
    with EmbeddedPostgres(data_dir, durable=False) as pg:
        pg.stop()
        _stale_pid_file(data_dir, unrelated.pid, pg._socket_dir)
        assert not pg.running
        pg.start()
        assert pg.running and await answers(pg.dsn)
        pg.stop()
        assert not pg.running
        assert unrelated.poll() is None, "a stopping signal reached an unrelated process"
    # A later instance (a new socket dir) finds the same stale file.
    _stale_pid_file(data_dir, unrelated.pid, parent_dir / "an-earlier-socket-dir")
    stale = (data_dir / "postmaster.pid").read_text()
    later = EmbeddedPostgres(data_dir, durable=False)
    try:
        with pytest.raises(RuntimeError, match="another PostgreSQL server") as refused:
            later.start()
        assert str(data_dir / "postmaster.pid") in str(refused.value)
        assert (data_dir / "postmaster.pid").read_text() == stale
    finally:
        later.close()
    assert unrelated.poll() is None, "a stopping signal reached an unrelated process"


# Run without CAP_KILL, the child starts a server and stops it, starts it again and prints what
# it owns, then waits to be killed: its watchdog (without CAP_KILL too) is to stop the server.
NO_CAP_KILL_CHILD = textwrap.dedent(
    """
    import json, signal
    from grpc_idempotency.testing import EmbeddedPostgres

    def postmaster_pid(pg):
        return int((pg._data_dir / "postmaster.pid").read_text().splitlines()[0])

    pg = EmbeddedPostgres(durable=False)
    pg.start()
    first = postmaster_pid(pg)
    pg.stop()
    pg.start()
    owned = {
        "first": first,
        "pid": postmaster_pid(pg),
        "watchdog": pg._watchdog.pid,
        "data_dir": str(pg._data_dir),
        "socket_dir": str(pg._socket_dir),
    }
    print(json.dumps(owned), flush=True)
    while True:
        signal.pause()
    """
)


def _spawn_without_cap_kill(setpriv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [setpriv, "--bounding-set=-kill", "--", sys.executable, "-c", NO_CAP_KILL_CHILD],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


async def test_as_root_without_cap_kill_the_owner_and_the_watchdog_stop_the_server() -> None:
    """Root without CAP_KILL may not signal the server's account: stop() took the
    PermissionError for a server already gone (another account's pid) and returned with the
    server running, and the watchdog deleted the directories under a server it left running."""
    if os.geteuid() != 0:
        pytest.skip("the server runs as this account: its signals need no capability")
    setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) drops CAP_KILL: not found")
    child = _spawn_without_cap_kill(setpriv)
    owned: dict[str, object] = {}
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # bounded: the child either prints or exits (EOF)
        assert line, f"the child exited before its server started (exit {child.wait(30)})"
        owned = json.loads(line)
        first, pid, watchdog = (int(str(owned[key])) for key in ("first", "pid", "watchdog"))
        await until("the first postmaster to be gone", lambda: not alive(first), DEADLINE_S)
        assert alive(pid)
        child.kill()
        assert child.wait(30) == -signal.SIGKILL
        await until("the postmaster to be gone", lambda: not alive(pid), DEADLINE_S)
        await until("the watchdog to exit", lambda: not alive(watchdog), DEADLINE_S)
        data_dir = Path(str(owned["data_dir"]))
        await until("the data dir to be removed", lambda: not data_dir.exists(), DEADLINE_S)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        for key in ("first", "pid", "watchdog"):
            if key in owned and alive(int(str(owned[key]))):
                os.kill(int(str(owned[key])), signal.SIGKILL)
        if owned:
            dirs = (Path(str(owned["data_dir"])), Path(str(owned["socket_dir"])))
            clean_up(dirs[0], dirs[1], PORT, dirs, "immediate")


def _pid_namespaces(unshare: str) -> bool:
    return subprocess.run([unshare, "--pid", "--fork", "true"], check=False).returncode == 0


def _spawn_in_namespaces(unshare: list[str], postgres: list[str]) -> subprocess.Popen[bytes]:
    as_server = embedded._load_runtime().as_server
    return subprocess.Popen([*unshare, *as_server, *postgres], stderr=subprocess.DEVNULL)


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_a_live_server_in_another_pid_namespace_keeps_its_postmaster_pid(
    parent_dir: Path,
) -> None:
    """A server in another pid namespace (a container sharing the volume) writes a pid that
    here is some other program's (its pid 1 is this namespace's init): that program is no
    proof the server is gone. Its postmaster.pid was deleted and a second server started on the
    live server's data directory (its own IPC namespace hides its shared memory, PostgreSQL's
    other interlock)."""
    unshare = shutil.which("unshare") or shutil.which("unshare", path="/usr/bin:/bin")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare (util-linux) for a pid namespace")
    if not _pid_namespaces(unshare):
        pytest.skip("no pid namespaces here (no CAP_SYS_ADMIN)")
    data_dir, socket_dir = parent_dir / "pgdata", parent_dir / "socket"
    with EmbeddedPostgres(data_dir, durable=False):
        pass  # initdb
    rt = embedded._load_runtime()
    socket_dir.mkdir()
    if rt.uid is not None and rt.gid is not None:
        os.chown(socket_dir, rt.uid, rt.gid)
    postgres = [str(rt.bin_dir / "postgres"), "-D", str(data_dir), "-c", "fsync=off"]
    postgres += ["-c", f"unix_socket_directories={socket_dir}", "-c", "listen_addresses="]
    # No --mount-proc: it makes a mount namespace whose root propagation a chroot (CI's other
    # Pythons) cannot change; the server needs no /proc of its own to write pid 1.
    inner = _spawn_in_namespaces([unshare, "--pid", "--ipc", "--fork"], postgres)

    def ready() -> list[str] | None:
        lines = read_pid_file(data_dir)
        return lines if lines is not None and lines[-1].strip() == "ready" else None

    try:
        lines = await until("the other namespace's server to be ready", ready, DEADLINE_S)
        assert int(lines[0]) not in _children(inner.pid)  # its pid here is another
        later = EmbeddedPostgres(data_dir, durable=False)
        try:
            with pytest.raises(RuntimeError, match="another PostgreSQL server"):
                later.start()
        finally:
            later.close()
        assert (data_dir / "postmaster.pid").read_text().splitlines() == lines
    finally:
        # Its postmaster is the namespace's init: the namespace ends with it.
        for server in _children(inner.pid) if inner.poll() is None else []:
            os.kill(server, signal.SIGQUIT)
        inner.wait(DEADLINE_S)
