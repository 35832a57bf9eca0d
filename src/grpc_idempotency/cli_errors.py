"""How the command-line tools report a database error (the message, its causes and where the
connection was going, never the password) and an interruption (``run_command``: SIGINT or SIGTERM).

A DSN whose password holds an unencoded ``/``, ``?``, ``#`` or ``@`` is cut by URL parsing
elsewhere than its author meant: pieces of the password land in the host, port, path, query or
fragment, and the driver's parse errors quote them. So a DSN the driver refuses is reported with a
fixed message (``UnusableDsn``), never the driver's text, and a DSN that does not split
unambiguously is masked from ``://`` to its last ``@``."""

from __future__ import annotations

import asyncio
import getpass
import os
import re
import signal
import sys
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit, urlunsplit

import asyncpg

from grpc_idempotency.core.errors import DsnUnusable, StoreMisconfigured, StoreUnavailable
from grpc_idempotency.core.log_text import loggable
from grpc_idempotency.stop_signals import catchable
from grpc_idempotency.store.dsn_files import at_in_user_info, in_doubt, unsendable, unusable_file
from grpc_idempotency.store.errors import dsn_unusable, prepared_statement_lost, session_refused
from grpc_idempotency.store.postgres import DEFAULT_SCHEMA, Store
from grpc_idempotency.store.sql import schema_identifier

T = TypeVar("T")

# What stops a one-shot command. The relay installs its own handlers for both (a clean stop).
_STOPPING = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM stopped a command: its task was cancelled, so the statement on
    the wire was abandoned (PostgreSQL rolls back the open transaction; what committed before
    stays) and its connections closed. Exit status 128 + the signal, as a shell reports a
    process the signal killed: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__("interrupted" if signum == signal.SIGINT else "terminated")
        self.exit_status = 128 + signum


def run_command(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, stopped by SIGINT or SIGTERM alike: ``main``'s task is cancelled,
    its ``finally`` blocks close what it opened, and ``Interrupted`` is raised. asyncio.run
    alone handles SIGINT only, by raising KeyboardInterrupt after the task's CancelledError
    (a traceback of both), and SIGTERM killed the process without a word. A second signal
    cancels the clean-up too."""
    received: list[signal.Signals] = []

    async def stoppable() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def stop(signum: signal.Signals) -> None:
            received.append(signum)
            task.cancel()

        handled = catchable(_STOPPING)
        for signum in handled:
            loop.add_signal_handler(signum, stop, signum)
        try:
            return await main
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    try:
        return asyncio.run(stoppable())
    except KeyboardInterrupt:  # SIGINT after the handlers went (the relay's clean-up, say)
        raise Interrupted(signal.SIGINT) from None
    except (Exception, asyncio.CancelledError):
        # Whatever a cancelled task raised on its way out (a connection closed under a
        # statement), the user stopped it: that is what to report.
        if received:
            raise Interrupted(received[0]) from None
        raise


def printable(text: str) -> str:
    """``text`` with its control characters shown as escapes (``\\n``, ``\\x1b``), newlines
    included: stored text that a client or a downstream service chose (a recorded error's
    message, a delivery's last error) could otherwise add lines to an operator's output or,
    on a terminal, move the cursor and overwrite lines already printed. The same escapes as
    the library's log lines (``core.log_text``): line separators and bidi overrides too."""
    return loggable(text)


def one_line(text: str, limit: int = 160) -> str:
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


_MASK = "***"
# In a URL that does not split unambiguously: a password-like query parameter's value, up to
# the next "&name=" or the end (an "&" or "#" without a "name=" after it may be the password's).
_QUERY_PASSWORD = re.compile(r"([?&][^?&=#@/]*password[^?&=#@/]*=).*?(?=&[^&=#]+=|$)", re.I)
_PASSWORD_PARAM = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


_UNUSABLE_DSN = (
    "cannot parse {option} (or one of its parameters is invalid): percent-encode special"
    " characters in the password (/ as %2F, ? as %3F, # as %23, @ as %40, : as %3A, % as %25)"
    " and check the query parameters (sslmode=...); the driver's message is not shown, as it may"
    " quote part of the password"
)


class UnusableDsn(Exception):
    """The driver refused a DSN before connecting anywhere: not retryable (exit status 2).
    ``file_problem``: which file the DSN names failed, and why (``unusable_file``), if known."""

    def __init__(self, option: str = "--dsn", file_problem: str | None = None) -> None:
        self.file_problem = file_problem
        super().__init__(
            f"cannot use {option}: {file_problem}"
            if file_problem
            else _UNUSABLE_DSN.format(option=option)
        )


async def connect(dsn: str, **options: Any) -> Store:
    """``Store.connect(dsn, **options)``, raising ``UnusableDsn`` (without the driver's error as
    its cause or context, which quote the DSN's pieces) when the driver cannot parse or use the
    DSN."""
    # A bad schema name raises its own ValueError here, before any of the DSN's could.
    schema_identifier(options.get("schema", DEFAULT_SCHEMA))
    try:
        return await Store.connect(dsn, **options)
    except DsnUnusable:
        problem = unsendable(dsn) or unusable_file(dsn)
        raise UnusableDsn(file_problem=problem) from None


class DsnRefused(Exception):
    """The server refused for good the session of a DSN other than --dsn (the relay's
    --listen-dsn): no such database or role, a bad password. ``error`` is reported with that
    DSN's target, not --dsn's (exit status 2)."""

    def __init__(self, error: StoreMisconfigured, dsn: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.dsn = dsn


async def check_parses(dsn: str, option: str) -> None:
    """Raises ``UnusableDsn`` naming ``option`` if the driver cannot parse or use ``dsn``, by
    connecting once: for a DSN that is used later, over and over (the relay's --listen-dsn),
    where each failure would be logged with the driver's text; ``DsnRefused`` if the server
    refuses its session for good. A DSN that parses but does not reach its server passes: the
    relay keeps trying it."""
    if at_in_user_info(dsn):  # parses, but not as meant: it would be tried forever
        raise UnusableDsn(option, None)
    try:
        conn = await asyncpg.connect(dsn, timeout=5.0)
    except Exception as exc:
        if dsn_unusable(exc):
            raise UnusableDsn(option, unusable_file(dsn)) from None
        refused = session_refused(exc)
        if refused is not None:
            # Relay.run refused it too, but reported with --dsn's target: the line pointed at
            # the DSN that needed no fixing.
            error = StoreMisconfigured(f"{option}: {refused}")
            error.__cause__ = exc  # PostgreSQL's own words: "database ... does not exist"
            raise DsnRefused(error, dsn) from None
        return  # unreachable, refused, not yet: the caller retries it anyway
    await conn.close()


def safe_dsn(dsn: str) -> str:
    """``dsn`` with every password replaced by ``***``: the one in the URL's user info, any
    ``password``-like query parameter, and a ``password=`` of a keyword/value string. A URL
    that does not split unambiguously (``in_doubt``) is masked from ``://`` to its last ``@``,
    its fragment too."""
    if "://" not in dsn:
        return _PASSWORD_PARAM.sub(rf"\g<1>{_MASK}", dsn)
    try:
        parts: SplitResult | None = urlsplit(dsn)
    except ValueError:
        parts = None
    if parts is None or in_doubt(dsn, parts):
        scheme, _, rest = dsn.partition("://")
        # A query password goes first: an "@" in it (password=pw@tail) would be taken for the
        # end of the user info below, and the rest of the password shown.
        rest = _QUERY_PASSWORD.sub(rf"\g<1>{_MASK}", rest)
        _, at, after = rest.rpartition("@")
        if not at:
            return f"{scheme}://{_MASK}"
        after, hash_, _fragment = after.partition("#")
        where, question, query = after.partition("?")
        masked_query = _mask_query(query) if question else ""
        return f"{scheme}://{_MASK}@{where}{question}{masked_query}{hash_ and '#' + _MASK}"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    netloc = f"{user}{colon and ':' + _MASK}{at}{hosts}"
    masked = urlunsplit(parts._replace(netloc=netloc, query=_mask_query(parts.query)))
    if not netloc:
        # urlunsplit drops an empty authority: a unix socket's postgresql:///app?host=/run/pg
        # was shown as postgresql:/app?host=/run/pg, a DSN that is not the one given.
        masked = f"{parts.scheme}://{masked[len(parts.scheme) + 1 :]}"
    return masked


def _mask_query(query: str) -> str:
    """``query`` with the value of every ``password``-like parameter masked. A piece with no
    ``=`` right after such a parameter is taken for the rest of its value (an unencoded ``&``
    in the password: ``password=se&cret``) and masked with it; other pieces stay as written."""
    pieces: list[str] = []
    in_password = False
    for piece in query.split("&"):
        name, equals, _value = piece.partition("=")
        if in_password and not equals:
            continue  # the password's tail: already masked
        in_password = "password" in unquote(name).lower()
        pieces.append(f"{name}={_MASK}" if in_password else piece)
    return "&".join(pieces)


def dsn_target(dsn: str) -> str:
    """Where ``dsn`` connects, for an error message: the server (host:port, or the unix socket),
    the database and the user, with libpq's defaults (PGHOST, PGPORT, PGUSER, PGDATABASE, the OS
    user) where the DSN names none. Never the password, and no control character: the names
    are percent-decoded, and a ``%0a`` or ``%1b`` would add or rewrite lines of the message."""
    try:
        parts = urlsplit(dsn)
        if parts.scheme not in ("postgres", "postgresql"):
            raise ValueError(dsn)
        if in_doubt(dsn, parts):
            # Its host, port or database may be pieces of the password.
            return "(the DSN does not split unambiguously: percent-encode its password)"
        query = dict(parse_qsl(parts.query))
        userinfo, _, hostlist = parts.netloc.rpartition("@")
        user = (
            unquote(userinfo.partition(":")[0])
            or query.get("user")
            or os.environ.get("PGUSER")
            or getpass.getuser()
        )
        database = (
            unquote(parts.path.lstrip("/"))
            or query.get("dbname")
            or query.get("database")
            or os.environ.get("PGDATABASE")
            or user
        )
        default_port = query.get("port") or os.environ.get("PGPORT") or "5432"
        servers = [_server(spec, default_port) for spec in hostlist.split(",") if spec]
        if not servers:
            hosts = query.get("host") or os.environ.get("PGHOST")
            servers = [
                _server(host, default_port) for host in (hosts or "").split(",") if host
            ] or ["the default host (a local unix socket, else localhost)"]
    except ValueError:
        return "(the DSN is not a postgresql:// URL)"
    return printable(f'{", ".join(servers)}, database "{database}", user "{user}"')


def _server(spec: str, default_port: str) -> str:
    spec = unquote(spec)
    if spec.startswith("/"):  # a unix socket directory (in ?host=, or percent-encoded)
        return f"socket {spec.rstrip('/')}/.s.PGSQL.{default_port}"
    if spec.startswith("["):  # [IPv6]:port
        host, _, rest = spec.partition("]")
        return f"{host}]:{rest.lstrip(':') or default_port}"
    host, _, port = spec.partition(":")
    return f"{host}:{port or default_port}"


def _causes(err: BaseException) -> Iterator[BaseException]:
    """The exceptions behind ``err``: its ``__cause__`` chain (or unsuppressed context)."""
    seen = {id(err)}
    current: BaseException | None = err
    while current is not None:
        following = current.__cause__
        if following is None and not current.__suppress_context__:
            following = current.__context__
        if following is None or id(following) in seen:
            return
        seen.add(id(following))
        yield following
        current = following


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    for extra in ("detail", "hint"):  # asyncpg.PostgresError carries PostgreSQL's DETAIL, HINT
        value = getattr(exc, extra, None)
        if isinstance(value, str) and value:
            text += f" ({extra}: {value})"
    return one_line(text, limit=400)


def statement_cache_broken(err: StoreUnavailable) -> bool:
    """Whether ``err`` came of asyncpg's statement cache behind a transaction pooler (26000,
    42P05: a named statement missing from, or already on, the server connection PgBouncer gave;
    08P01 for a Bind that does not fit another client's statement of the same name there, 22P03
    for one whose parameters that statement reads as other types).
    The database answers; runs keep failing until the command gets --statement-cache-size 0:
    exit 2 (fix the command), not 1, which sent a cron job's retries round for good."""
    return any(prepared_statement_lost(cause) for cause in _causes(err))


def store_error_status(err: StoreUnavailable) -> int:
    """The exit status for a store error: 2 when a retry cannot help (misconfigured, or the
    statement cache behind PgBouncer), 1 when the store is unreachable (retry later)."""
    return 2 if isinstance(err, StoreMisconfigured) or statement_cache_broken(err) else 1


def report_store_error(
    err: StoreUnavailable, dsn: str | None, *, schema: str | None = None
) -> None:
    """Prints ``err``, its causes and, with ``dsn``, the database it was about (and ``schema``,
    the store's): in place of the store's name that ``Store.connect`` appended to the message,
    which said the database a second time, less fully."""
    message = str(err).removesuffix(err.store_label) if dsn else str(err)
    lines = [f"grpc-idempotency: {message}"]
    lines += [f"  caused by {_describe(cause)}" for cause in _causes(err)]
    if statement_cache_broken(err):
        # The store's log line naming this fix is an ERROR, which the CLI leaves to this report
        # (_ReportedByMain); asyncpg's own hint is cut off before its fix in the line above.
        lines.append(
            "  behind PgBouncer in transaction mode (before 1.21, or max_prepared_statements ="
            " 0) asyncpg's statement cache breaks: pass --statement-cache-size 0"
        )
    if dsn:
        where = dsn_target(dsn) if schema is None else f"{dsn_target(dsn)}, schema {schema}"
        lines.append(f"  database: {where} ({printable(safe_dsn(dsn))})")
    text = "\n".join(lines)
    if dsn:
        # Drivers do not echo passwords, but a message quoting the DSN itself would.
        text = text.replace(dsn, safe_dsn(dsn))
    print(text, file=sys.stderr)
