"""What a database failure means for a call, by SQLSTATE (no database here)."""

from __future__ import annotations

import ssl
from urllib.parse import urlsplit

import asyncpg
import pytest

from grpc_idempotency.core.db_failures import Failure, classify, outage, presumed_outage
from grpc_idempotency.core.errors import StoreMisconfigured, StoreUnavailable
from grpc_idempotency.store.dsn_files import dsn_where
from grpc_idempotency.store.errors import (
    StoreLog,
    connect_error,
    dsn_unusable,
    prepared_statement_lost,
    purge_refused,
    store_error,
)


@pytest.mark.parametrize(
    ("sqlstate", "failure"),
    [
        (None, Failure.UNAVAILABLE),  # a socket error, a closed connection: no SQLSTATE
        ("", Failure.UNAVAILABLE),
        ("08006", Failure.UNAVAILABLE),  # connection_failure
        ("57P01", Failure.UNAVAILABLE),  # admin_shutdown: failover, restart
        ("57P03", Failure.UNAVAILABLE),  # cannot_connect_now: starting up
        ("57014", Failure.UNAVAILABLE),  # query_canceled: statement_timeout
        ("53300", Failure.UNAVAILABLE),  # too_many_connections
        ("25P03", Failure.UNAVAILABLE),  # idle_in_transaction_session_timeout
        ("25P04", Failure.UNAVAILABLE),  # transaction_timeout (PostgreSQL 17)
        ("58030", Failure.UNAVAILABLE),  # io_error: class 58, system error
        ("XX000", Failure.UNAVAILABLE),  # internal_error: class XX
        ("25006", Failure.UNAVAILABLE),  # read_only_sql_transaction: a replica after failover
        ("40001", Failure.CONFLICT),  # serialization_failure
        ("40P01", Failure.CONFLICT),  # deadlock_detected
        ("55P03", Failure.CONFLICT),  # lock_not_available
        ("42P01", Failure.MISCONFIGURED),  # undefined_table: not migrated
        ("42703", Failure.MISCONFIGURED),  # undefined_column: migrations partly run
        ("42883", Failure.MISCONFIGURED),  # undefined_function
        ("3F000", Failure.MISCONFIGURED),  # invalid_schema_name
        ("3D000", Failure.MISCONFIGURED),  # invalid_catalog_name
        ("42501", Failure.MISCONFIGURED),  # insufficient_privilege
        ("28000", Failure.MISCONFIGURED),  # invalid_authorization_specification
        ("28P01", Failure.MISCONFIGURED),  # invalid_password
        ("23505", Failure.OTHER),  # unique_violation: a handler's bug, not the store's
        ("22P02", Failure.OTHER),
        ("GI001", Failure.OTHER),  # the store's own codes are handled where they are raised
    ],
)
def test_classify(sqlstate: str | None, failure: Failure) -> None:
    assert classify(sqlstate) is failure


@pytest.mark.parametrize(
    ("sqlstate", "down"),
    [
        (None, True),  # a socket error, a closed connection, a statement never answered
        ("", True),
        ("08006", True),  # connection_failure
        ("08001", True),  # sqlclient_unable_to_establish_sqlconnection
        ("57P01", True),  # admin_shutdown: failover, restart
        ("57P02", True),  # crash_shutdown
        ("57P03", True),  # cannot_connect_now: starting up
        ("53300", True),  # too_many_connections
        ("25006", True),  # read_only_sql_transaction: a replica after failover
        # The database is up and holds the records: a fail-open method must not run unclaimed.
        ("57014", False),  # query_canceled: statement_timeout, a cancel request
        ("55P03", False),  # lock_not_available: lock_timeout
        ("40001", False),  # serialization_failure
        ("40P01", False),  # deadlock_detected
        ("25P03", False),  # idle_in_transaction_session_timeout: the session, not the server
        ("25P04", False),  # transaction_timeout: the session too
        ("53100", False),  # disk_full: it answers
        ("23505", False),
        ("42P01", False),  # misconfigured: decided apart (StoreMisconfigured)
    ],
)
def test_outage(sqlstate: str | None, down: bool) -> None:
    assert outage(sqlstate) is down


def _raised_in(module: str, exc: BaseException) -> BaseException:
    """``exc`` as raised by code of ``module`` (its frame on the traceback, as asyncpg's)."""
    namespace: dict[str, object] = {"__name__": module}
    exec("def boom(exc):\n    raise exc\n", namespace)
    try:
        namespace["boom"](exc)  # type: ignore[operator]
    except BaseException as raised:
        return raised
    raise AssertionError("not raised")


def test_what_makes_a_dsn_unusable() -> None:
    parsing = "asyncpg.connect_utils"
    # int() of a "port" that is a piece of the password: the DSN.
    assert dsn_unusable(_raised_in(parsing, ValueError("invalid literal for int()")))
    assert dsn_unusable(asyncpg.ClientConfigurationError("sslmode is not valid"))
    # A certificate that fails verify-full is a ValueError raised there too, and no DSN error:
    # it was reported as DsnUnusable (not retryable, "percent-encode the password").
    assert not dsn_unusable(
        _raised_in(parsing, ssl.SSLCertVerificationError("certificate verify failed"))
    )
    assert not dsn_unusable(_raised_in(parsing, ConnectionRefusedError()))
    # A ValueError of the caller's own, raised elsewhere (min_size > max_size).
    assert not dsn_unusable(_raised_in("asyncpg.pool", ValueError("min_size")))


def test_a_poolers_error_is_a_presumed_outage_to_be_confirmed() -> None:
    """PgBouncer's own errors (08P01: query_wait_timeout on a busy pool, a failing server
    login) say nothing certain of the database; asyncpg 0.32 raises them as the connection's
    end (08003) caused by the error read, asyncpg 0.30 as the connection's end alone. A
    connection closed in the middle of an operation says as little. A fail-open method
    confirms such an outage first; a database shutting down says so (57P01: certain)."""
    assert presumed_outage("08P01") and outage("08P01")
    assert presumed_outage("08003") and outage("08003")
    assert not presumed_outage("08006") and not presumed_outage(None)
    assert not presumed_outage("57P01") and outage("57P01")
    lost = asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")
    lost.__cause__ = asyncpg.ProtocolViolationError("query_wait_timeout")
    pooler = store_error(lost, "claiming a key", store=StoreLog())
    assert pooler.outage and pooler.ambiguous
    closed = store_error(
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        "claiming a key",
        store=StoreLog(),
    )
    assert closed.outage and closed.ambiguous  # asyncpg 0.30's form of the pooler's error
    shutdown = store_error(
        asyncpg.AdminShutdownError("terminating connection"), "claiming a key", store=StoreLog()
    )
    assert shutdown.outage and not shutdown.ambiguous
    reset = store_error(
        ConnectionResetError(104, "Connection reset by peer"), "claiming a key", store=StoreLog()
    )
    assert reset.outage and not reset.ambiguous


@pytest.mark.parametrize(
    ("said", "for_good"),
    [
        # Its refusals of the session for good, as its versions word them (older ones
        # capitalised), and 1.18's forwarding of the server's refusal of its own login (newer
        # versions forward that with the server's SQLSTATE, 28P01, and repeat it cached).
        ("unsupported startup parameter: statement_timeout", True),
        ("Unsupported startup parameter: search_path", True),
        ("unsupported startup parameter in options: jit", True),
        ("no such database: shop", True),
        ("No such database: shop", True),
        ("no such user", True),  # auth_query found no row
        ("No such user: app", True),
        ("password authentication failed", True),
        ("SASL authentication failed", True),
        ('password authentication failed for user "app"', True),
        (
            "server login has been failing, cached error: password authentication failed for"
            ' user "app" (server_login_retry)',
            True,
        ),
        # Its passing failures, and a server's passing refusal of its login, also 08P01.
        ("query_wait_timeout", False),
        ("no more connections allowed (max_client_conn)", False),
        ("pgbouncer cannot connect to server", False),
        ("server login has been failing, try again later (server_login_retry)", False),
        ("server login has been failing, cached error: connect failed (server_login_retry)", False),
        ("client_login_timeout (server down)", False),
        ('database "shop" is disabled', False),
        ("database does not allow connections: shop", False),
        ("the database system is starting up", False),
        ("sorry, too many clients already", False),
    ],
)
def test_pgbouncers_refusals_for_good_are_told_from_its_passing_failures(
    said: str, for_good: bool
) -> None:
    """PgBouncer sends every failure of its own as 08P01, and its text alone tells a refusal
    that stays until the DSN or its configuration changes (misconfigured: not retryable) from
    one that passes (a presumed outage: retryable, confirmed before a fail-open method runs
    unclaimed). tests/integration/test_pgbouncer.py meets both with the PgBouncer installed;
    these are the wordings of the others."""
    error = connect_error(asyncpg.ProtocolViolationError(said), "claiming a key", store=StoreLog())
    if for_good:
        assert isinstance(error, StoreMisconfigured), error
    else:
        assert type(error) is StoreUnavailable, error
        assert error.outage and error.ambiguous, error


def _splits(url: str) -> bool:
    try:
        urlsplit(url)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    ("dsn", "options", "named"),
    [
        (
            "postgresql://app:s3cret@db.internal:6432/orders?sslmode=require",
            {},
            "db.internal:6432/orders",
        ),
        (
            "postgresql://app@/orders?host=/run/pg&port=5433&password=s3cret",
            {},
            "/run/pg:5433/orders",
        ),
        ("postgresql://app:s3cret@db/orders", {"port": 5433, "database": "o2"}, "db:5433/o2"),
        ("postgresql://app:pw@x@db/orders", {}, "?/?"),  # in doubt: pieces of the password
        ("postgresql://db/ord%0aers", {}, "db/ord\\ners"),
        ("postgresql://app:s3cret@[::1]/orders", {"port": 5433}, "[::1]:5433/orders"),
        # asyncpg's port= wins over the DSN's hosts' own ports.
        ("postgresql://app:s3cret@db:6432/orders", {"port": 5433}, "db:5433/orders"),
        # Python 3.13's urlsplit (and so asyncpg's urlparse) refuses brackets after a host list's
        # first host ("Invalid IPv6 URL"): a DSN no store connects with there, its pieces "?".
        (
            "postgresql://app:s3cret@a:1,[::1]:2/orders",
            {"port": "5433"},
            "a,[::1]:5433/orders" if _splits("postgresql://a:1,[::1]:2/") else "?:5433/?",
        ),
        ("postgresql://app:s3cret@db/?dbname=orders", {}, "db/orders"),
        ("postgresql://app:s3cret@/orders", {"host": ["a", "b"], "port": 5433}, "a,b:5433/orders"),
        # Not a URL at all (key=value text, which asyncpg refuses): no piece of it, though a
        # "://" in its password made it split.
        ("host=db password=se://cret dbname=x", {}, "?/?"),
        ("mysql://app:s3cret@db/orders", {}, "?/?"),
        # Left to the driver's defaults: "/orders" named no server at all.
        ("postgresql://app:s3cret@/orders", {}, "(default host)/orders"),
        ("postgresql://db?port=5433", {}, "db:5433/(default database)"),
        (None, {"port": 5433}, "(default host):5433/(default database)"),
    ],
)
def test_a_store_is_named_in_the_log_by_its_server_and_database_never_its_secrets(
    dsn: str, options: dict[str, object], named: str
) -> None:
    assert dsn_where(dsn, options) == named


def test_a_store_logs_each_of_its_problems_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """Per problem (a SQLSTATE, a driver failure's type), not per kind of line: the second
    problem of a store is not held back behind its first. A store of no known address adds
    nothing to the line."""
    store = StoreLog("db:5432/orders, schema s")
    store.name_shards(("one",))
    assert store.label == " [shard 'one': db:5432/orders, schema s]"
    assert StoreLog().label == ""
    caplog.set_level("ERROR", logger="grpc_idempotency.store")
    unmigrated, no_schema = asyncpg.UndefinedTableError("x"), asyncpg.InvalidSchemaNameError("y")
    for exc in (unmigrated, no_schema, unmigrated, ValueError("a"), KeyError("b"), KeyError("c")):
        store_error(exc, "claiming a key", store=store)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert all("[shard 'one': db:5432/orders, schema s]" in line for line in said), said


def test_a_bind_misfit_is_the_statement_cache_and_poolers_own_08p01_stays_an_outage() -> None:
    """PostgreSQL refuses a Bind that does not fit the statement of that name on the server
    connection with 08P01 (tests/integration/test_pgbouncer.py makes one through PgBouncer):
    asyncpg's statement cache meeting another client's statement, not an outage. PgBouncer's
    own errors come with the same 08P01 and stay presumed outages; so does a misfit of a
    statement that is not one of asyncpg's cached ones (the unnamed statement)."""
    lost = [
        'bind message supplies 0 parameters, but prepared statement "__asyncpg_stmt_2__"'
        " requires 1",
        "bind message has 3 result formats but query has 2 columns",
    ]
    for said in lost:
        exc = asyncpg.ProtocolViolationError(said)
        assert prepared_statement_lost(exc), said
        error = store_error(exc, "migrating", store=StoreLog())
        assert not error.outage and not error.ambiguous, said
    pooler = [
        "query_wait_timeout",
        "server login has been failing, try again later (server_login_retry)",
        "no more connections allowed (max_client_conn)",
        'bind message supplies 0 parameters, but prepared statement "" requires 1',
        "bind message has 2 parameter formats but 1 parameters",
    ]
    for said in pooler:
        exc = asyncpg.ProtocolViolationError(said)
        assert not prepared_statement_lost(exc), said
        error = store_error(exc, "migrating", store=StoreLog())
        assert error.outage and error.ambiguous, said


def test_a_bind_left_unread_is_the_statement_cache_not_a_refused_value() -> None:
    """22P03 with exec_bind_message's own message (postgres.c: the parameter's receive function
    left bytes unread) is a Bind on another client's statement of the same name, with other
    parameter types (tests/integration/test_pgbouncer.py makes one through PgBouncer): the store
    binds only its own values, through codecs that write what the declared type reads. A
    receive function's own 22P03 refusals of a value stay the value's."""
    exc = asyncpg.InvalidBinaryRepresentationError(
        "incorrect binary data format in bind parameter 3"
    )
    assert prepared_statement_lost(exc)
    error = store_error(exc, "claiming a key", store=StoreLog())
    assert not error.outage and not error.ambiguous
    assert purge_refused(exc, "purging records") is None  # store_error's, with its hint
    for said in [
        'invalid sign in external "numeric" value',
        "incorrect binary data format in bind parameter 3 of statement x",
        "incorrect binary data format",
    ]:
        assert not prepared_statement_lost(asyncpg.InvalidBinaryRepresentationError(said)), said


def test_only_a_refusal_of_the_purges_statement_is_misconfigured() -> None:
    """A trigger's RAISE and an application's foreign key refuse every retry: misconfigured.
    A race, a lock timeout, an outage, a statement cancelled, a statement cache lost behind
    PgBouncer (26000, 42P05: SQLSTATEs classify reads as OTHER) or no answer at all stay
    ``store_error``'s (None): taken for misconfigured, a CLI purge exited 2 for good."""
    refused = purge_refused(asyncpg.RaiseError("record old-3 is\nkept"), "purging records")
    assert isinstance(refused, StoreMisconfigured)
    assert "SQLSTATE P0001: record old-3 is kept)" in str(refused), refused
    assert isinstance(
        purge_refused(asyncpg.ForeignKeyViolationError("fk"), "purging"), StoreMisconfigured
    )
    for exc in (
        asyncpg.SerializationError("x"),
        asyncpg.TransactionIntegrityConstraintViolationError("x"),
        asyncpg.StatementCompletionUnknownError("x"),
        asyncpg.SnapshotTooOldError("x"),
        asyncpg.LockNotAvailableError("x"),
        asyncpg.AdminShutdownError("x"),
        asyncpg.QueryCanceledError("x"),
        asyncpg.UndefinedTableError("x"),  # store_error's own misconfigured, with its hint
        asyncpg.InvalidSQLStatementNameError("x"),
        asyncpg.DuplicatePreparedStatementError("x"),
        asyncpg.ConnectionDoesNotExistError("x"),
        TimeoutError(),
    ):
        assert purge_refused(exc, "purging records") is None, exc
