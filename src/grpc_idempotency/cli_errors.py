"""How the command-line tools report a database error: the message, its causes and where the
connection was going, never the password."""

from __future__ import annotations

import getpass
import os
import re
import sys
from collections.abc import Iterator
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from grpc_idempotency.core.errors import StoreUnavailable


def one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


_MASK = "***"
_PASSWORD_PARAM = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def safe_dsn(dsn: str) -> str:
    """``dsn`` with every password replaced by ``***``: the one in the URL's user info, any
    ``password``-like query parameter, and a ``password=`` of a keyword/value string."""
    if "://" not in dsn:
        return _PASSWORD_PARAM.sub(rf"\g<1>{_MASK}", dsn)
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "(a DSN that is not a valid URL)"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    netloc = f"{user}{colon and ':' + _MASK}{at}{hosts}"
    params = parse_qsl(parts.query, keep_blank_values=True)
    query = parts.query
    if any("password" in name.lower() for name, _ in params):
        masked = [(n, _MASK if "password" in n.lower() else v) for n, v in params]
        query = urlencode(masked, safe="/,:*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def dsn_target(dsn: str) -> str:
    """Where ``dsn`` connects, for an error message: the server (host:port, or the unix socket),
    the database and the user, with libpq's defaults (PGHOST, PGPORT, PGUSER, PGDATABASE, the OS
    user) where the DSN names none. Never the password."""
    try:
        parts = urlsplit(dsn)
        if parts.scheme not in ("postgres", "postgresql"):
            raise ValueError(dsn)
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
    return f'{", ".join(servers)}, database "{database}", user "{user}"'


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


def report_store_error(err: StoreUnavailable, dsn: str | None) -> None:
    lines = [f"grpc-idempotency: {err}"]
    lines += [f"  caused by {_describe(cause)}" for cause in _causes(err)]
    if dsn:
        lines.append(f"  database: {dsn_target(dsn)} ({safe_dsn(dsn)})")
    text = "\n".join(lines)
    if dsn:
        # Drivers do not echo passwords, but a message quoting the DSN itself would.
        text = text.replace(dsn, safe_dsn(dsn))
    print(text, file=sys.stderr)
