"""An EmbeddedPostgres instance's postmaster: found by its postmaster.pid, stopped by a signal,
and, run as a script, the watchdog that stops it when the instance's owner process dies.

Invariant: only the server an instance started is ever stopped, the one whose postmaster.pid
names the instance's socket directory (a fresh directory no other server uses) and port, and,
where there is procfs (Linux), only once the pid it names is proven to be that server: a process
of the data directory's owner whose command line has the instance's socket directory. The pid
of a postmaster that died unnoticed (the OOM killer's SIGKILL) is reused by any process, often
one of the same account, which ``kill(pid, 0)`` cannot tell from the server. Without procfs
(macOS) the pid is trusted, as ``pg_ctl`` trusts it.

Invariant: the watchdog acts only on end of file on its pipe, whose write end only the owner
process holds (close-on-exec, and closed in a fork()'s child), so the kernel delivers it when
the owner ends, however it ends (SIGKILL included). ``close()`` and the finalizer stop the
server themselves and then kill the watchdog before they close their end: it never acts for a
live owner. Its cleanup is what the finalizer does, and is harmless once that has run; a
finalizer whose server outlived its stop leaves it armed, to try again once the owner is gone.

Invariant: an instance's directories are deleted only once its server is gone (``clean_up``):
a server that did not stop, or could not be signalled, keeps them, and stderr names them.

Run as a script (``python -I -S _postmaster.py FD DATA_DIR SOCKET_DIR PORT [OWNED...]``), by
path and without ``site``, so it imports neither this package (grpc) nor site-packages: it
starts in the time of a bare interpreter, and only the standard library is imported here.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path

_PG_CTL_WAIT_S = 60
# pg_ctl stop's signals: fast shutdown (roll back, checkpoint, exit) and immediate (a crash).
_STOP_SIGNALS = {"fast": signal.SIGINT, "immediate": signal.SIGQUIT}
# Where util-linux puts setpriv and runuser, for a root whose PATH lacks the sbin directories.
_TOOL_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")
_SIGNAL_AS_TIMEOUT_S = 10


def read_pid_file(data_dir: Path) -> list[str] | None:
    """Lines of postmaster.pid (pid, data dir, start time, port, socket dir, ...)."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    # A single-user backend writes its pid negated; kill() of a pid <= 0 signals a whole
    # process group, or every process: such a file is never treated as a live server of ours.
    return lines if pid > 0 else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the liveness test of ``pg_ctl status`` and of postgres itself
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another account
    # A postmaster killed with SIGKILL has been reparented to init, which may reap it
    # late (~1 s in some sandboxes) or never (containers without an init): kill() still
    # finds the zombie.
    if not os.path.exists("/proc/self/stat"):
        return True  # no procfs (macOS): trust kill()
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[:1]
    except OSError:
        return False
    return state != ["Z"]


def _procfs() -> bool:
    return os.path.exists("/proc/self/stat")


def _real_ids(pid: int) -> tuple[int, int]:
    """The real uid and gid of ``pid`` (from its status: the owner of /proc/<pid> is root for a
    process that is not dumpable). OSError if there is no such process."""
    ids: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, values = line.partition(":")
        if name in ("Uid", "Gid"):
            ids[name] = int(values.split()[0])
    return ids["Uid"], ids["Gid"]


def is_postmaster(lines: list[str], data_dir: Path, socket_dir: Path) -> bool:
    """Whether the pid in postmaster.pid (``lines``, naming ``socket_dir``) is, alive, the
    postmaster an instance started on ``data_dir`` with ``socket_dir``: with procfs, a process
    of the account that owns the data directory (PostgreSQL runs as no other) whose arguments
    include ``unix_socket_directories=<socket_dir>``, as pg_ctl started it (the watchdog's
    arguments name the directory too, bare). Without procfs, any live process."""
    pid = int(lines[0])
    if not alive(pid):
        return False
    if not _procfs():
        return True  # macOS: kill() is all there is, as for pg_ctl
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        uid = _real_ids(pid)[0]
        owner = data_dir.stat().st_uid
    except (OSError, KeyError, ValueError, IndexError):
        return False  # exited meanwhile, or its data directory is gone: no server of ours
    return uid == owner and b"unix_socket_directories=" + os.fsencode(socket_dir) in argv


def owned_by(lines: list[str], socket_dir: Path, port: int) -> bool:
    # postmaster.pid: line 4 is the port, line 5 the (first) socket directory.
    return lines[3:5] == [str(port), str(socket_dir)]


def postmaster(data_dir: Path, socket_dir: Path, port: int) -> list[str] | None:
    """Lines of postmaster.pid if its server process is alive and is the one listening in
    ``socket_dir`` on ``port`` (an instance's own), else None."""
    lines = read_pid_file(data_dir)
    if lines is None or not owned_by(lines, socket_dir, port):
        return None
    return lines if is_postmaster(lines, data_dir, socket_dir) else None


def find_tool(name: str) -> str | None:
    """The absolute path of the program ``name``, on PATH or in ``_TOOL_DIRS``."""
    found = shutil.which(name)
    if found is not None:
        return os.path.abspath(found)  # subprocess spawns without fork() only for a path
    for directory in _TOOL_DIRS:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _signal_as_its_account(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid`` as the account it runs as, through setpriv (or runuser): how root
    without CAP_KILL (dropped in some containers) signals the server's account. Whether it was
    sent. The caller has proven ``pid`` to be the server (and pinned it with a pidfd): the
    pid is reused only if the server exits in the milliseconds before the kill."""
    if os.geteuid() != 0 or not _procfs():
        return False
    # Here, not at the top: the watchdog imports them only on this rare path.
    import pwd
    import subprocess

    try:
        uid, gid = _real_ids(pid)
    except (OSError, KeyError, ValueError, IndexError):
        return False
    kill = ["/bin/sh", "-c", 'kill -s "$1" "$2"', "sh", sig.name.removeprefix("SIG"), str(pid)]
    setpriv = find_tool("setpriv")
    if setpriv is not None:
        prefix = [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    else:
        runuser = find_tool("runuser")
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = None
        if runuser is None or name is None:
            return False
        prefix = [runuser, "-u", name, "--"]
    try:
        done = subprocess.run(
            [*prefix, *kill],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd="/",
            timeout=_SIGNAL_AS_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _send(pid: int, pidfd: int | None, sig: signal.Signals) -> bool | None:
    """Signal the proven server: True once sent, False if it has exited, None if this process
    may not signal it and cannot have it signalled."""
    try:
        if pidfd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return False  # exited since it was proven ours
    except PermissionError:
        if not _procfs() and os.geteuid() != 0:
            # No procfs to prove it ours, and the server runs as us: another account's process
            # took the pid (the server is gone).
            return False
        # Proven ours, its account the data directory's: root without CAP_KILL.
        if pidfd is not None and select.select([pidfd], [], [], 0)[0]:
            return False  # exited meanwhile: its pid may be another process's by now
        return True if _signal_as_its_account(pid, sig) else None
    return True


def stop_server(data_dir: Path, socket_dir: Path, port: int, mode: str) -> int | None:
    """Stop the server an instance started, if it runs, as ``pg_ctl stop --wait`` would:
    signal its postmaster and wait (up to ``_PG_CTL_WAIT_S``) for it to exit. None once it is
    gone (or when the pid is no server of ours), else the pid of the postmaster still running
    (it did not stop in time, or this process may not signal it)."""
    lines = read_pid_file(data_dir)
    if lines is None or not owned_by(lines, socket_dir, port):
        return None
    pid = int(lines[0])
    sig = _STOP_SIGNALS[mode]
    deadline = time.monotonic() + _PG_CTL_WAIT_S
    try:
        # A pidfd pins the process: opened before the identity check, it is the process
        # checked that the signal and the wait reach, never a later one that reuses the pid;
        # and the wait wakes when it exits, with no polling.
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):
        pidfd = None  # no pidfd (macOS, an old kernel or a sandbox): the pid and polling
    try:
        # Never signal a process not proven ours: the pid of a server that died unnoticed is
        # anyone's. Left to escape, an error here killed the watchdog before its cleanup.
        if not is_postmaster(lines, data_dir, socket_dir):
            return None
        sent = _send(pid, pidfd, sig)
        if sent is None:
            return pid
        if not sent:
            return None
        if pidfd is None:
            while alive(pid):
                if time.monotonic() >= deadline:
                    return pid
                time.sleep(0.01)
            return None
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        # Readable once the process has exited, reaped or a zombie (``alive``'s "dead").
        while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if time.monotonic() >= deadline:
                return pid
        return None
    finally:
        if pidfd is not None:
            os.close(pidfd)


def clean_up(
    data_dir: Path, socket_dir: Path, port: int, owned: tuple[Path, ...], mode: str
) -> bool:
    """Stop an instance's server, then delete the directories it created; whether it did.

    Only once the server is gone: one that did not stop in time, or that this process may not
    signal, keeps its directories, and stderr says so. Deleted under it, the data directory
    was lost to a server still writing it (and to whoever would stop it by hand and look at
    its log), and the socket directory took the server's socket and its pg_hba.conf: a leak
    that a message names is the lesser harm."""
    survivor = stop_server(data_dir, socket_dir, port, mode)
    if survivor is not None:
        _say_left_in_place(survivor, owned, mode)
        return False
    for path in owned:
        shutil.rmtree(path, ignore_errors=True)
    return True


def _say_left_in_place(pid: int, owned: tuple[Path, ...], mode: str) -> None:
    sig = _STOP_SIGNALS[mode]
    paths = ", ".join(map(str, owned))
    message = (
        f"EmbeddedPostgres: PostgreSQL (postmaster pid {pid}) did not stop within"
        f" {_PG_CTL_WAIT_S} s of {sig.name} ({mode} shutdown), or this process may not signal"
        f" it; its directories are left in place, not deleted under a running server: {paths}"
        f" (once it is stopped, e.g. kill -s {sig.name.removeprefix('SIG')} {pid}, delete"
        " them)\n"
    )
    # The watchdog's stderr is its dead owner's: maybe closed, or a pipe no one reads.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(message)
        sys.stderr.flush()


def watch(argv: list[str]) -> None:
    """The watchdog: wait for end of file on the pipe, then clean up after the dead owner."""
    # Terminals' signals are for the owner (its own session, start_new_session=True, already
    # keeps a Ctrl-C to its process group or a hangup from reaching this process).
    for name in ("SIGINT", "SIGHUP", "SIGTSTP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    fd = int(argv[0])
    data_dir, socket_dir = Path(argv[1]), Path(argv[2])
    port = int(argv[3])
    owned = tuple(Path(path) for path in argv[4:])
    while os.read(fd, 64):
        pass  # the owner never writes: only its end (EOF) counts
    # A data directory the instance created is deleted next: an immediate shutdown (a crash)
    # loses nothing. The caller's own one gets a fast shutdown, as close() would give it.
    mode = "immediate" if data_dir in owned else "fast"
    if not clean_up(data_dir, socket_dir, port, owned, mode):
        sys.exit(1)


if __name__ == "__main__":
    watch(sys.argv[1:])
