"""A real PgBouncer in front of the test PostgreSQL, for tests of the library behind a pooler.

``running_pgbouncer(upstream_dsn)`` writes its own ini and auth files in a temporary directory,
starts ``pgbouncer`` on a free loopback port (transaction pooling by default), waits until it
accepts connections and stops it at the end. The upstream is reached the way ``upstream_dsn``
says: a unix-socket directory (the embedded PostgreSQL's default) or host and port.

PgBouncer refuses to run as root: as root it is started with ``-u USER``, the owner of the
upstream's socket directory (the only account that may open the socket), else ``nobody``.
A missing binary is installed with apt-get when we are root and apt-get exists; otherwise the
fixture fails and says how to install it (the tests are not skipped).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

START_TIMEOUT_S = 15.0
INSTALL_HINT = (
    "the PgBouncer tests need the pgbouncer binary: install it with"
    " `sudo apt-get install -y pgbouncer` (Debian/Ubuntu), `sudo dnf install pgbouncer`"
    " (Fedora/RHEL) or `brew install pgbouncer` (macOS), or put it on PATH"
)


@dataclass(frozen=True)
class Upstream:
    """Where PgBouncer connects: host is an address or a unix-socket directory."""

    host: str
    port: int
    user: str
    password: str | None
    database: str


def parse_dsn(dsn: str) -> Upstream:
    """Host, port, user, password and database of a ``postgresql://`` DSN (libpq's defaults)."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"not a postgresql:// DSN: {dsn!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    host = query.get("host") or unquote(parts.hostname or "") or "/var/run/postgresql"
    port = int(query.get("port") or parts.port or 5432)
    user = query.get("user") or unquote(parts.username or "") or pwd.getpwuid(os.getuid()).pw_name
    password = query.get("password") or (unquote(parts.password) if parts.password else None)
    database = query.get("dbname") or unquote(parts.path.lstrip("/")) or user
    return Upstream(host, port, user, password, database)


def pgbouncer_binary() -> str:
    """The pgbouncer executable, installed first with apt-get when missing and we may."""
    found = _find()
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "pgbouncer"],
        ):
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}\n"
                    + INSTALL_HINT
                )
        found = _find()
        if found:
            return found
    raise RuntimeError(INSTALL_HINT)


def _version(binary: str) -> tuple[int, ...]:
    """PgBouncer's version, e.g. (1, 18, 0) from "PgBouncer 1.18.0"."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x) for x in match.groups(default="0")) if match else (0,)


def _find() -> str | None:
    # Debian puts it in /usr/sbin, which is not on an unprivileged user's PATH.
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    return shutil.which("pgbouncer", path=path)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_as(upstream: Upstream) -> pwd.struct_passwd | None:
    """The account to drop to (root only): whoever may open the upstream's unix socket."""
    if os.geteuid() != 0:
        return None
    if upstream.host.startswith("/"):
        owner = pwd.getpwuid(os.stat(upstream.host).st_uid)
        if owner.pw_uid != 0:
            return owner
    return pwd.getpwnam("nobody")


def _quote(value: str) -> str:
    """A value for pgbouncer's [databases] connection string (libpq-style quoting)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass
class PgBouncer:
    port: int
    upstream: Upstream
    directory: Path
    process: subprocess.Popen[bytes]

    @property
    def dsn(self) -> str:
        """The DSN of the pooled database through PgBouncer (same user and database name)."""
        user = quote(self.upstream.user, safe="")
        return f"postgresql://{user}@127.0.0.1:{self.port}/{quote(self.upstream.database)}"

    def log(self) -> str:
        try:
            return (self.directory / "pgbouncer.log").read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"


@contextlib.contextmanager
def running_pgbouncer(
    upstream_dsn: str,
    *,
    pool_mode: str = "transaction",
    pool_size: int = 3,
    max_client_conn: int = 200,
    settings: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[PgBouncer]:
    """Starts PgBouncer in front of ``upstream_dsn`` and stops it when the block ends.

    ``pool_size`` server connections at most (``default_pool_size`` and ``max_db_connections``),
    so that more clients than that share them; ``settings`` adds or overrides [pgbouncer] keys.
    ``port``: listen there (a PgBouncer restarted where its clients' DSN points), else on a free
    port.
    """
    binary = pgbouncer_binary()
    upstream = parse_dsn(upstream_dsn)
    account = _run_as(upstream)
    directory = Path(tempfile.mkdtemp(prefix="gi-pgbouncer-"))
    server = f"host={_quote(upstream.host)} port={upstream.port} dbname={_quote(upstream.database)}"
    server += f" user={_quote(upstream.user)}"
    if upstream.password:
        server += f" password={_quote(upstream.password)}"
    port = free_port() if port is None else port
    config = {
        "listen_addr": "127.0.0.1",
        "listen_port": str(port),
        "unix_socket_dir": "",  # TCP only: no socket file in a shared directory
        "auth_type": "trust",  # the user must still be listed in auth_file
        "auth_file": str(directory / "userlist.txt"),
        "pool_mode": pool_mode,
        "default_pool_size": str(pool_size),
        "max_db_connections": str(pool_size),
        "min_pool_size": "0",
        "reserve_pool_size": "0",
        "max_client_conn": str(max_client_conn),
        "server_reset_query": "DISCARD ALL",
        "server_reset_query_always": "0",
        "ignore_startup_parameters": "",
        "logfile": str(directory / "pgbouncer.log"),
        "pidfile": "",
        "log_connections": "0",
        "log_disconnections": "0",
        "stats_period": "3600",
    }
    if _version(binary) >= (1, 21):
        # 1.21 and later prepare statements themselves (1.24 by default): the tests of what
        # transaction pooling does to a client's named statements need the classic behaviour.
        config["max_prepared_statements"] = "0"
    config.update(settings or {})
    (directory / "userlist.txt").write_text(f'"{upstream.user}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        f"[databases]\n{upstream.database} = {server}\n\n[pgbouncer]\n"
        + "".join(f"{k} = {v}\n" for k, v in config.items())
    )
    command = [binary, str(directory / "pgbouncer.ini")]
    if account is not None:
        for path in (directory, *directory.iterdir()):
            os.chown(path, account.pw_uid, account.pw_gid)
        command[1:1] = ["-u", account.pw_name]
    stderr = open(directory / "stderr.log", "wb")  # noqa: SIM115  (closed below)
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, cwd=directory
    )
    bouncer = PgBouncer(port, upstream, directory, process)
    try:
        _wait_until_accepting(bouncer)
        yield bouncer
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        stderr.close()
        shutil.rmtree(directory, ignore_errors=True)


def _wait_until_accepting(bouncer: PgBouncer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        code = bouncer.process.poll()
        if code is not None:
            output = (bouncer.directory / "stderr.log").read_text(errors="replace")
            raise RuntimeError(f"pgbouncer exited with {code} at start:\n{output}\n{bouncer.log()}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", bouncer.port), timeout=1),
        ):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"pgbouncer did not listen within {START_TIMEOUT_S}s:\n{bouncer.log()}"
            )
        time.sleep(0.01)
