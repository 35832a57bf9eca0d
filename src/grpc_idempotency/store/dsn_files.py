"""Which file a DSN names that the driver cannot use (its certificate, key or CRL), whether a DSN
is text the driver can send, and whether a DSN splits unambiguously: shared by ``Store.connect``
and the command-line tools, so both name the file, never a piece of the password."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from grpc_idempotency.core.log_text import loggable

NOT_UTF8 = (
    "not valid UTF-8 (a byte such as 0xff, from the command line or the environment):"
    " PostgreSQL takes UTF-8 text only"
)


def not_utf8(dsn: object) -> bool:
    """Whether ``dsn`` is text that cannot be encoded as UTF-8: a byte that is not UTF-8 in argv
    or the environment reaches Python surrogate-escaped. asyncpg parses such a DSN, then fails
    encoding its startup message once connected, as a closed connection: a failure to retry
    that can never succeed."""
    if not isinstance(dsn, str):
        return False
    try:
        dsn.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


HOLDS_NUL = (
    "it holds a NUL character (raw or percent-encoded as %00): PostgreSQL text cannot hold one"
)


def holds_nul(dsn: object) -> bool:
    """Whether ``dsn`` holds a NUL character, raw or as ``%00`` (a URL's user, password,
    database or option decodes it). PostgreSQL's startup message is NUL-terminated strings: it
    refused one there with a protocol violation (08P01), read as an outage to retry."""
    return isinstance(dsn, str) and ("\x00" in dsn or "%00" in dsn)


def unsendable(dsn: object) -> str | None:
    """Why the driver cannot send ``dsn`` to PostgreSQL (``NOT_UTF8``, ``HOLDS_NUL``), if it
    cannot: a failure that retrying never ends."""
    if not_utf8(dsn):
        return NOT_UTF8
    if holds_nul(dsn):
        return HOLDS_NUL
    return None


def at_in_user_info(dsn: object) -> bool:
    """Whether a URL ``dsn``'s authority holds more than one ``@``: an unencoded one in the
    password (or the user). asyncpg ends the user info at the first ``@``, so it connected to
    the rest of the password "@" the host, a name that does not resolve: an outage to retry,
    naming a host the DSN does not mean."""
    if not isinstance(dsn, str):
        return False
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return False  # the driver's own parsing refuses it
    return parts.netloc.count("@") > 1


def in_doubt(dsn: str, parts: SplitResult) -> bool:
    """Whether ``dsn`` may have been split inside its password: more than one ``@`` in the
    authority (``urlsplit`` splits at the last, asyncpg at the first), an ``@`` after the
    authority, a fragment (meaningless to PostgreSQL: a ``#`` in a password), or a port that
    is not a number (a password whose ``/`` or ``?`` ended the authority early: ``user:pass``
    read as host:port)."""
    if "#" in dsn or "@" in parts.path or "@" in parts.query or parts.netloc.count("@") > 1:
        return True
    hosts = parts.netloc.rpartition("@")[2]
    for spec in hosts.split(","):
        port = spec.rpartition("]")[2] if spec.startswith("[") else spec
        _, colon, port = port.rpartition(":")
        if colon and port and not port.isdigit():
            return True
    return False


# The files asyncpg reads while parsing a DSN, in its order: the parameter, else the variable.
DSN_FILES = (
    ("sslrootcert", "PGSSLROOTCERT"),
    ("sslcrl", "PGSSLCRL"),
    ("sslcert", "PGSSLCERT"),
    ("sslkey", "PGSSLKEY"),
)


def unusable_file(dsn: str) -> str | None:
    """The first certificate, key or CRL file ``dsn`` names (or a PGSSL* variable does) that
    cannot be opened or loaded, as ``sslrootcert PATH: why``; ``None`` if all can, or if the
    DSN does not split unambiguously (its "query" may be a piece of the password). The driver's
    own error names no file, only "No such file or directory", and has to stay unshown anyway.
    Found by trying each file again: it is what the driver does with them."""
    if "://" not in dsn:
        return None
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return None
    if in_doubt(dsn, parts):
        return None
    query = dict(parse_qsl(parts.query))  # the last of a repeated parameter wins, as in asyncpg
    named: dict[str, tuple[str, str]] = {}  # parameter: (its label in the message, the path)
    for param, variable in DSN_FILES:
        if query.get(param):
            named[param] = (param, query[param])
        elif os.environ.get(variable):
            named[param] = (variable, os.environ[variable])
    for label, path in named.values():
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            return f"{label} {path}: {err.strerror or err}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for param in ("sslrootcert", "sslcrl", "sslcert"):
        if param not in named:
            continue
        label, path = named[param]
        try:
            if param == "sslcert":
                key = named["sslkey"][1] if "sslkey" in named else None
                context.load_cert_chain(path, key, query.get("sslpassword", ""))
            else:
                context.load_verify_locations(cafile=path)
        except OSError as err:  # ssl.SSLError: not PEM, or a key that does not match
            return f"{label} {path}: {err.strerror or err}"
    return None


# What the driver connects to when neither the DSN nor a keyword argument says: libpq's
# environment (PGHOST, PGDATABASE), else a local socket or localhost, and the user's name. Not
# looked up here, where it could differ from what the driver resolves; worded so that no host
# or database can be taken for it.
DEFAULT_HOST = "(default host)"
DEFAULT_DATABASE = "(default database)"


def dsn_where(dsn: object, options: Mapping[str, object] | None = None) -> str:
    """Where ``dsn`` connects, as ``host:port/database``, for naming a store in the log: never
    the user, the password or a query parameter (``password=``, an ``sslpassword``). The
    connection's keyword arguments (``host``, ``port``, ``database``; asyncpg's, which win over
    the DSN's) replace the DSN's pieces. Nothing is looked up (PGHOST, PGPORT, PGDATABASE):
    a host or database that neither names is ``DEFAULT_HOST`` or ``DEFAULT_DATABASE`` (it was
    left out, and ``/orders`` named no server at all), a port left out is the default one. A
    DSN that does not split unambiguously, or is no ``postgres(ql)://`` URL, gives ``?`` for its
    server and database (either may be a piece of the password). The command-line tools name a
    store by it too."""
    options = options or {}
    hosts = database = ""
    port: object = ""
    if isinstance(dsn, str) and dsn:
        try:
            parts: SplitResult | None = urlsplit(dsn)
        except ValueError:
            parts = None
        # Only a URL asyncpg takes splits into pieces: key=value text with "://" in its
        # password split as a URL whose "path" was all of it, the password included.
        if (
            parts is None
            or parts.scheme not in ("postgres", "postgresql")
            or "://" not in dsn
            or in_doubt(dsn, parts)
        ):
            hosts, database = "?", "?"
        else:
            query = dict(parse_qsl(parts.query))
            hosts = unquote(parts.netloc.rpartition("@")[2]) or query.get("host", "")
            port = query.get("port", "")
            database = (
                unquote(parts.path.lstrip("/")) or query.get("dbname") or query.get("database", "")
            )
    host = options.get("host")
    if isinstance(host, str | list | tuple) and host:
        hosts = ",".join(map(str, host)) if isinstance(host, list | tuple) else host
    if isinstance(options.get("port"), int | str):
        port = options["port"]
        if not isinstance(host, str | list | tuple) or not host:
            # asyncpg's port= wins over a port in the DSN's host list too (``db:6432``): named
            # with it, the line named a port the store never connected to.
            hosts = ",".join(map(_without_port, hosts.split(",")))
    if isinstance(options.get("database"), str):
        database = str(options["database"])
    hosts, database = hosts or DEFAULT_HOST, database or DEFAULT_DATABASE
    if port and ":" not in hosts.rpartition("]")[2]:
        hosts = f"{hosts}:{port}"
    # Escaped: a percent-decoded %0a would add a line to the log.
    return loggable(f"{hosts}/{database}")


def _without_port(hostspec: str) -> str:
    """A host of a DSN's host list without its ``:port``: an IPv6 address keeps its brackets,
    a Unix socket's directory has no port."""
    if hostspec.startswith("["):
        return hostspec.partition("]")[0] + "]" if "]" in hostspec else hostspec
    if hostspec.startswith("/"):
        return hostspec
    return hostspec.partition(":")[0]
