"""An EmbeddedPostgres instance's postmaster: found by its postmaster.pid, stopped by a signal,
and, run as a script, the watchdog that stops it when the instance's owner process dies.

Invariant: only the server an instance started is ever stopped, the one whose postmaster.pid
names the instance's socket directory (a fresh directory no other server uses) and port.

Invariant: the watchdog acts only on end of file on its pipe, whose write end only the owner
process holds (close-on-exec, and closed in a fork()'s child), so the kernel delivers it when
the owner ends, however it ends (SIGKILL included). ``close()`` and the finalizer stop the
server themselves and then kill the watchdog before they close their end: it never acts for a
live owner. Its cleanup is what the finalizer does, and is harmless once that has run.

Run as a script (``python -I -S _postmaster.py FD DATA_DIR SOCKET_DIR PORT [OWNED...]``), by
path and without ``site``, so it imports neither this package (grpc) nor site-packages: it
starts in the time of a bare interpreter, and only the standard library is imported here.
"""

from __future__ import annotations

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


def owned_by(lines: list[str], socket_dir: Path, port: int) -> bool:
    # postmaster.pid: line 4 is the port, line 5 the (first) socket directory.
    return lines[3:5] == [str(port), str(socket_dir)]


def postmaster(data_dir: Path, socket_dir: Path, port: int) -> list[str] | None:
    """Lines of postmaster.pid if its server process is alive and is the one listening in
    ``socket_dir`` on ``port`` (an instance's own), else None."""
    lines = read_pid_file(data_dir)
    if lines is None or not owned_by(lines, socket_dir, port):
        return None
    return lines if alive(int(lines[0])) else None


def stop_server(data_dir: Path, socket_dir: Path, port: int, mode: str) -> int | None:
    """Stop the server an instance started, if it runs, as ``pg_ctl stop --wait`` would:
    signal its postmaster and wait (up to ``_PG_CTL_WAIT_S``) for it to exit. None once it is
    gone, else the pid of the postmaster still running."""
    lines = postmaster(data_dir, socket_dir, port)
    if lines is None:
        return None
    pid = int(lines[0])
    sig = _STOP_SIGNALS[mode]
    # A PermissionError signalling it: the pid is another account's process, so the server is
    # gone (it runs as us, or we are root), its postmaster.pid left behind (the OOM killer's
    # SIGKILL) and the pid taken since. Left to escape, the watchdog died of it, and the
    # instance's directories stayed behind.
    deadline = time.monotonic() + _PG_CTL_WAIT_S
    try:
        # A pidfd pins the process: the signal and the wait cannot reach a later process
        # that reuses the pid, and the wait wakes when it exits, with no polling.
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None  # no pidfd (macOS, an old kernel or a sandbox): the pid and polling
    if pidfd is None:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return None
        while alive(pid):
            if time.monotonic() >= deadline:
                return pid
            time.sleep(0.01)
        return None
    try:
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except (ProcessLookupError, PermissionError):
            return None  # exited since postmaster.pid was read
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        # Readable once the process has exited, reaped or a zombie (``alive``'s "dead").
        while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if time.monotonic() >= deadline:
                return pid
        return None
    finally:
        os.close(pidfd)


def clean_up(
    data_dir: Path, socket_dir: Path, port: int, owned: tuple[Path, ...], mode: str
) -> None:
    """Stop an instance's server and delete the directories it created."""
    stop_server(data_dir, socket_dir, port, mode)
    for path in owned:
        shutil.rmtree(path, ignore_errors=True)


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
    clean_up(data_dir, socket_dir, port, owned, mode)


if __name__ == "__main__":
    watch(sys.argv[1:])
