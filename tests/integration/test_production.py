"""Production configurations: a retention shorter than a slow handler, isolation levels other
than READ COMMITTED, the database ending a handler's session, database errors escaping a
handler, responses too large to store, a schema that was never migrated, and the interceptor
given to a sync ``grpc.server()``.

Each test here failed before the matching fix (see the README's "Running in production")."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypedDict, cast

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    DsnUnusable,
    IdempotencyInterceptor,
    Isolation,
    KeyRequirement,
    MethodOverride,
    StaticScope,
    Store,
    StoreMisconfigured,
)
from grpc_idempotency.client import Operation
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.store.errors import StoreLog, store_error
from grpc_idempotency.store.migrations import available_migrations
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import fresh, ledger_rows, metadata, running_ledger
from tests.support.relay import FORWARD, running_relay
from tests.support.waiting import until
from tests.support.wire import Answer, call_raw

POST = "/testsvc.v1.LedgerService/Post"
OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"
PHASED = "/testsvc.v1.LedgerService/PostPhased"
SHORT = "/testsvc.v1.LedgerService/PostShortLived"
SCOPE = "tenant:tenant-a"


def post(account: str, behaviour: str = "") -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=7, behaviour=behaviour)


def response(answer: Answer) -> testsvc_pb2.PostResponse:
    assert answer.body is not None, (answer.code, answer.details)
    return testsvc_pb2.PostResponse.FromString(answer.body)


async def stored(store: Store, key: str, schema: str = "grpc_idempotency") -> bool:
    found = await store.pool.fetchval(
        f"SELECT count(*) FROM {schema}.records WHERE scope = $1 AND key = $2", SCOPE, key
    )
    return bool(found)


async def completed(store: Store, key: str) -> bool:
    found = await store.pool.fetchval(
        "SELECT count(*) FROM grpc_idempotency.records"
        " WHERE scope = $1 AND key = $2 AND state = 'completed'",
        SCOPE,
        key,
    )
    return bool(found)


# -- 1. retention counts from completion too --------------------------------------------------


async def test_an_outcome_stays_replayable_for_its_retention_after_a_slow_completion(
    store: Store,
) -> None:
    """Retention counts from the claim (its index stays HOT), but a handler slower than its
    retention used to store an outcome that had already expired: the next retry ran again."""
    retention = timedelta(seconds=2)
    key, account = fresh(), fresh("acct")
    overrides = {SHORT: MethodOverride(retention=retention)}
    async with running_ledger(store, overrides=overrides) as ledger:
        first = asyncio.ensure_future(ledger.call(SHORT, post(account, "wait"), key))
        await ledger.service.started.wait()
        claimed_before = await store.pool.fetchval("SELECT clock_timestamp()")  # claim <= this

        async def retention_over() -> bool:
            passed = await store.pool.fetchval(
                "SELECT clock_timestamp() > $1::timestamptz + $2::interval",
                claimed_before,
                retention,
            )
            return bool(passed)

        # The handler is still running when the retention counted from its claim runs out.
        await until("the retention counted from the claim to pass", retention_over)
        ledger.service.release.set()
        answer = await first
        assert answer.code is grpc.StatusCode.OK
        await store.purge()  # housekeeping agrees: the outcome is not expired yet
        assert await stored(store, key)
        retry = await ledger.call(SHORT, post(account, "wait"), key)
        assert retry.replayed and retry.body == answer.body
        assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


# -- 2. isolation levels -----------------------------------------------------------------------


@pytest.fixture(params=["repeatable read", "serializable"])
async def strict_store(
    pg_dsn: str, store: Store, request: pytest.FixtureRequest
) -> AsyncIterator[Store]:
    """A store whose sessions default to a stricter isolation level, as a DBA may configure
    (``default_transaction_isolation``) for the whole database. (``store`` migrated it.)"""
    s = await Store.connect(
        pg_dsn,
        max_size=10,
        server_settings={
            "application_name": "grpc-idempotency",
            "default_transaction_isolation": request.param,
        },
    )
    yield s
    await s.close()


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_concurrent_duplicates_on_four_replicas_at_strict_isolation(
    strict_store: Store, method: str
) -> None:
    """At REPEATABLE READ or SERIALIZABLE a claim that loses to a concurrent one is a
    serialization failure (40001); it used to reach clients as UNAVAILABLE with the SQLSTATE.
    Now a lost claim is a lost race like any other (wait, then replay), and a handler's
    transaction that loses (SERIALIZABLE can fail any of them) is a retryable ABORTED with the
    key released. Clients retry ABORTED: after one more round every key ran exactly once."""
    keys = [(fresh(), fresh("acct")) for _ in range(30)]
    # PostPhased's lease (0.6 s) is the test service's short one: on a loaded machine (CI runs
    # four suites on two cores) a replica stalled that long was taken over, and its owner rightly
    # answered LEASE_LOST. A lease no stall reaches keeps this test on what it is about: the
    # isolation level's races.
    long_lease = {PHASED: MethodOverride(lease=timedelta(seconds=30))}
    async with (
        running_ledger(strict_store, overrides=long_lease) as a,
        running_ledger(strict_store, overrides=long_lease) as b,
        running_ledger(strict_store, overrides=long_lease) as c,
        running_ledger(strict_store, overrides=long_lease) as d,
    ):
        # Four replicas: duplicates within one replica wait on its local owner, so each key
        # gets up to four claims racing in the database.
        calls = [
            call_raw(replica.channel, method, post(account, "sleep:20"), metadata(key), timeout=20)
            for key, account in keys
            for replica in (a, b, c, d)
        ]
        answers = await asyncio.gather(*calls)
        codes = {answer.code for answer in answers}
        aborted = {x.reason() for x in answers if x.code is grpc.StatusCode.ABORTED}
        assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.ABORTED}, [
            (x.code, x.details) for x in answers if x.code is not grpc.StatusCode.OK
        ]
        assert aborted <= {"IDEMPOTENCY_KEY_IN_PROGRESS", "IDEMPOTENCY_TRANSACTION_CONFLICT"}
        retry = RetryPolicy(max_attempts=20, initial_backoff_s=0.01, max_backoff_s=0.2)
        finals = [
            await Operation(key).call(
                a.stub.Post if method == POST else a.stub.PostPhased,
                post(account, "sleep:20"),
                metadata=metadata(None),
                retry=retry,
                timeout=20,
            )
            for key, account in keys
        ]
    for i, (_, account) in enumerate(keys):
        assert await ledger_rows(strict_store, account) == 1
        bodies = {x.body for x in answers[4 * i : 4 * i + 4] if x.code is grpc.StatusCode.OK}
        bodies.add(finals[i].SerializeToString())
        assert len(bodies) == 1  # every OK answer of a key is the one execution's response


async def test_a_method_runs_at_the_isolation_it_declares(strict_store: Store) -> None:
    """Unset, the handler runs at the database's default (it used to be forced to READ
    COMMITTED silently); ``isolation`` (proto option or override) picks another."""
    default = await strict_store.pool.fetchval("SHOW default_transaction_isolation")
    overrides = {
        POST: MethodOverride(isolation=Isolation.SERIALIZABLE),
        PHASED: MethodOverride(isolation=Isolation.READ_COMMITTED),
    }
    async with running_ledger(strict_store, overrides=overrides) as ledger:
        seen = {}
        for method in (POST, PHASED, OPTIONAL):
            answer = await ledger.call(method, post(fresh("acct"), "isolation"), fresh())
            seen[method] = response(answer).isolation
        unkeyed = await ledger.call(OPTIONAL, post(fresh("acct"), "isolation"), None)
    assert seen == {POST: "serializable", PHASED: "read committed", OPTIONAL: default}
    assert response(unkeyed).isolation == default


@pytest.mark.parametrize(
    ("isolation", "seen_in_handler"),
    [
        (Isolation.READ_COMMITTED, "none"),
        (Isolation.REPEATABLE_READ, "in_progress"),
        (Isolation.SERIALIZABLE, "in_progress"),
    ],
)
async def test_an_atomic_record_is_written_once_at_completion_where_looking_is_safe(
    store: Store, isolation: Isolation, seen_in_handler: str
) -> None:
    """At READ COMMITTED the atomic claim only takes the lock and looks: the handler's own
    transaction holds no record yet, and the completion inserts the finished one (one heap
    write, no dead row version). At stricter levels the snapshot predates the lock, so the claim
    still writes its row first (migration 0008). Either way the record ends the same."""
    overrides = {POST: MethodOverride(isolation=isolation)}
    key, account = fresh(), fresh("acct")
    async with running_ledger(store, overrides=overrides) as ledger:
        first = await ledger.call(POST, post(account, "claim-row"), key)
        assert first.code is grpc.StatusCode.OK
        assert response(first).claim_row == seen_in_handler
        again = await ledger.call(POST, post(account, "claim-row"), key)
        assert again.replayed and again.body == first.body
    row = cast(
        "asyncpg.Record",
        await store.pool.fetchrow(
            "SELECT state, fencing_token, created_at, completed_at, expires_at, retention"
            " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
            "tenant:tenant-a",
            key,
        ),
    )  # not None: the call wrote it
    assert row["state"] == "completed" and row["fencing_token"] == 1
    assert row["created_at"] <= row["completed_at"]  # the claim's time, not the completion's
    # retention counts from the claim (clock_timestamp() read twice there: microseconds apart)
    assert abs(row["expires_at"] - (row["created_at"] + row["retention"])) < timedelta(seconds=1)
    assert await ledger_rows(store, account) == 1


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_a_serialization_failure_in_the_handler_is_a_retryable_abort(
    store: Store, method: str
) -> None:
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as ledger:
        lost = await ledger.call(method, post(account, "conflict"), key)
        assert lost.code is grpc.StatusCode.ABORTED
        assert lost.reason() == "IDEMPOTENCY_TRANSACTION_CONFLICT"
        assert await ledger_rows(store, account) == 0
        # The key was released (phased: its lease ended): the retry runs at once, and once.
        retry = await ledger.call(method, post(account, "conflict"), key)
        assert retry.code is grpc.StatusCode.OK and not retry.replayed
        assert ledger.service.executions == 2
    assert await ledger_rows(store, account) == 1


# -- 3. database errors escaping the handler ---------------------------------------------------


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_a_connection_lost_under_the_handler_is_unavailable_and_releases_the_key(
    store: Store, method: str
) -> None:
    """It used to answer UNKNOWN "Unexpected <class 'asyncpg...ConnectionDoesNotExistError'>",
    which no retry policy retries, with the driver's text."""
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as ledger:
        lost = await ledger.call(method, post(account, "kill-connection"), key)
        assert lost.code is grpc.StatusCode.UNAVAILABLE, (lost.code, lost.details)
        assert lost.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert "asyncpg" not in (lost.details or "") and "Unexpected" not in (lost.details or "")
        assert await ledger_rows(store, account) == 0
        retry = await ledger.call(method, post(account, "kill-connection"), key)
        assert retry.code is grpc.StatusCode.OK and not retry.replayed
    assert await ledger_rows(store, account) == 1


async def test_a_failed_statement_of_the_handler_is_internal_without_the_drivers_text(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as ledger:
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency.store"):
            failed = await ledger.call(POST, post(account, "table-missing"), key)
    assert failed.code is grpc.StatusCode.INTERNAL
    assert failed.reason() == "IDEMPOTENCY_HANDLER_DATABASE_ERROR"
    assert "42P01" in (failed.details or "") and "no_such_table" not in (failed.details or "")
    assert "no_such_table" in caplog.text  # the cause is in the server's log
    assert not await stored(store, key)  # released: nothing recorded
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize("method", [POST, PHASED, OPTIONAL])
@pytest.mark.parametrize(
    ("behaviour", "said", "logged"),
    [
        # A constraint checked only at COMMIT (DEFERRABLE INITIALLY DEFERRED) fails in the
        # library's commit: it was answered UNAVAILABLE "store unavailable (23505)", retryable,
        # blaming the store, and every retry ran the handler into the same wall.
        ("deferred-violation", "23505", "checked_at_commit_once"),
        # A failed statement whose error the handler caught aborted the call's transaction:
        # PostgreSQL answers its COMMIT with ROLLBACK, not an error. An unkeyed call
        # (OPTIONAL without a key) answered OK with nothing written; a keyed one UNAVAILABLE
        # "store unavailable (25P02)", blaming the store for the handler's bug.
        ("swallow", "aborted", "caught"),
    ],
)
async def test_a_handler_write_that_cannot_commit_is_the_handlers_error_never_ok(
    store: Store,
    method: str,
    behaviour: str,
    said: str,
    logged: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """INTERNAL, reason IDEMPOTENCY_HANDLER_DATABASE_ERROR (the driver's text in the log only);
    the key released, nothing recorded or written; a fixed handler then runs."""
    key = None if method == OPTIONAL else fresh()
    account = fresh("acct")
    async with running_ledger(store) as ledger:
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency.store"):
            failed = await ledger.call(method, post(account, behaviour), key)
        assert failed.code is grpc.StatusCode.INTERNAL, (failed.code, failed.details)
        assert failed.reason() == "IDEMPOTENCY_HANDLER_DATABASE_ERROR"
        assert said in (failed.details or "")
        assert "checked_at_commit" not in (failed.details or "")  # the driver's text stays home
        assert logged in caplog.text
        if key is not None:
            # Nothing completed (a phased claim stays, its lease ended); the key's second
            # attempt (the behaviour misbehaves on the first only) runs and commits.
            assert not await completed(store, key)
            retry = await ledger.call(method, post(account, behaviour), key)
            assert retry.code is grpc.StatusCode.OK and not retry.replayed
    assert await ledger_rows(store, account) == (0 if key is None else 1)


@pytest.mark.parametrize("method", [POST, PHASED, OPTIONAL])
@pytest.mark.parametrize("kind", ["nested-transaction", "concurrent"])
async def test_a_handler_misusing_its_live_connection_is_internal_not_a_store_outage(
    store: Store, method: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncpg refuses the misuse with an InterfaceError on a connection that is fine: it was
    answered UNAVAILABLE "store unavailable", retryable, on-call sent to the database, each
    retry into the same bug. INTERNAL, IDEMPOTENCY_HANDLER_DATABASE_ERROR, the key released."""
    key = None if method == OPTIONAL else fresh()
    account = fresh("acct")
    async with running_ledger(store) as ledger:
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency.store"):
            failed = await ledger.call(method, post(account, f"misuse:{kind}"), key)
        assert failed.code is grpc.StatusCode.INTERNAL, (failed.code, failed.details)
        assert failed.reason() == "IDEMPOTENCY_HANDLER_DATABASE_ERROR"
        assert "misused" in (failed.details or "") and "another operation" not in (
            failed.details or ""
        )
        assert "misused" in caplog.text
        if key is not None:
            assert not await completed(store, key)
            retry = await ledger.call(method, post(account, f"misuse:{kind}"), key)
            assert retry.code is grpc.StatusCode.OK and not retry.replayed, retry.details
    assert await ledger_rows(store, account) == (0 if key is None else 1)


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_a_lease_longer_than_postgresqls_timeouts_can_hold_still_claims(
    store: Store, method: str
) -> None:
    """Policies allow leases up to 36500 days; the claim's idle-in-transaction timeout is an int
    of milliseconds (about 24.8 days at most). A 30-day lease failed every claim (22023),
    answered as the store being down."""
    path = method.lstrip("/")
    overrides = {path: MethodOverride(lease=timedelta(days=30))}
    key, account = fresh(), fresh("acct")
    async with running_ledger(store, overrides=overrides) as ledger:
        first = await ledger.call(method, post(account), key)
        assert first.code is grpc.StatusCode.OK, first.details
        again = await ledger.call(method, post(account), key)
        assert again.replayed and again.body == first.body
    assert await ledger_rows(store, account) == 1


def test_a_store_statement_the_database_refuses_on_a_live_connection_is_no_outage() -> None:
    """SQLSTATE classes that say the store is up (a value it cannot hold, a constraint) do not
    let a fail-open method run unclaimed; unreachable and misconfigured stores do."""
    assert not store_error(
        asyncpg.InvalidParameterValueError("x"), "claiming", store=StoreLog()
    ).outage
    assert not store_error(
        asyncpg.DatetimeFieldOverflowError("x"), "claiming", store=StoreLog()
    ).outage
    assert store_error(asyncpg.CannotConnectNowError("x"), "claiming", store=StoreLog()).outage
    assert store_error(ConnectionRefusedError(), "claiming", store=StoreLog()).outage
    assert store_error(asyncpg.UndefinedTableError("x"), "claiming", store=StoreLog()).outage


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_abort_details_that_are_not_utf8_are_recorded_and_replayed_readably(
    store: Store, method: str
) -> None:
    """Details holding a lone surrogate (bytes decoded with errors="surrogateescape") cannot be
    encoded: the outcome's commit failed with a raw UnicodeEncodeError (UNKNOWN, the error's
    text to the client). The character is replaced; the recorded error replays."""
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as ledger:
        first = await ledger.call(method, post(account, "abort-surrogate"), key)
        assert first.code is grpc.StatusCode.FAILED_PRECONDITION, first.details
        assert first.details == "bad byte ? here"
        again = await ledger.call(method, post(account, "abort-surrogate"), key)
        assert again.code is grpc.StatusCode.FAILED_PRECONDITION and again.replayed
        assert again.details == first.details
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_an_abort_with_status_ok_is_unknown_and_records_nothing(
    store: Store, method: str
) -> None:
    """grpc's own servers answer an abort with OK as UNKNOWN. Taken as an OK outcome with no
    response, serializing None leaked a TypeError's text ("Unexpected <class 'TypeError'>")."""
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as ledger:
        for _ in range(2):  # nothing was recorded: the retry runs (and aborts) again
            answer = await ledger.call(method, post(account, "abort-ok"), key)
            assert answer.code is grpc.StatusCode.UNKNOWN, answer.details
            assert answer.details == "the handler aborted with status OK"
            assert not answer.replayed
        assert ledger.service.attempts[key] == 2
    assert await ledger_rows(store, account) == 0


class _PoolOptions(TypedDict, total=False):
    reset: None


@pytest.mark.parametrize("reset", ["default", "asyncpg's"])
async def test_the_pool_sends_no_reset_query_unless_asked(
    pg_dsn: str, store: Store, reset: str
) -> None:
    """A connection back in the store's pool is not reset (asyncpg's default reset, a round trip
    per call, undoes session state the library never sets, and its commit resets a handler's);
    `reset=None` asks for it again."""
    name = f"reset-{fresh()}"[:60]
    options: _PoolOptions = {} if reset == "default" else {"reset": None}
    pooled = await Store.connect(
        pg_dsn, min_size=1, max_size=1, server_settings={"application_name": name}, **options
    )
    try:
        async with running_ledger(pooled) as ledger:
            answer = await ledger.call(POST, post(fresh("acct")), fresh())
            assert answer.code is grpc.StatusCode.OK, answer.details
        last = await _last_query(pg_dsn, name)  # the pooled connection's last statement
    finally:
        await pooled.close()
    # The commit's own batch resets what a handler set on the session (sql.SESSION_RESET),
    # in the same round trip: the last statement is it, not a reset query after it.
    if reset == "default":
        assert last.rstrip().endswith("COMMIT"), last
    else:
        assert "pg_advisory_unlock_all" in last and not last.rstrip().endswith("COMMIT"), last


async def _last_query(dsn: str, application_name: str) -> str:
    watcher = await asyncpg.connect(dsn)
    try:
        last: str = await watcher.fetchval(
            "SELECT query FROM pg_stat_activity WHERE application_name = $1", application_name
        )
    finally:
        await watcher.close()
    return last


# -- 6. big responses --------------------------------------------------------------------------


async def test_a_response_over_max_response_bytes_is_a_recorded_error_and_nothing_commits(
    store: Store,
) -> None:
    """Over gRPC's 4 MiB receive limit such a response used to commit (the charge happened)
    and then fail RESOURCE_EXHAUSTED on every retry. Now nothing commits but the answer."""
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as ledger:
        first = await ledger.call(POST, post(account, "big:2000000"), key)
        assert first.code is grpc.StatusCode.FAILED_PRECONDITION
        assert first.reason() == "IDEMPOTENCY_RESPONSE_TOO_LARGE"
        assert "1048576" in (first.details or "")
        retry = await ledger.call(POST, post(account, "big:2000000"), key)
        assert retry.replayed and retry.code is grpc.StatusCode.FAILED_PRECONDITION
        assert retry.reason() == "IDEMPOTENCY_RESPONSE_TOO_LARGE"
        assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize("method", [POST, PHASED])
async def test_a_large_response_within_its_limit_is_stored_and_replayed_byte_for_byte(
    store: Store, method: str
) -> None:
    size = 6_000_000
    key, account = fresh(), fresh("acct")
    overrides = {method: MethodOverride(max_response_bytes=8 << 20)}
    async with running_ledger(store, overrides=overrides) as ledger:
        channel = grpc.aio.insecure_channel(
            ledger.address, options=[("grpc.max_receive_message_length", 16 << 20)]
        )
        async with channel:
            first = await call_raw(channel, method, post(account, f"big:{size}"), metadata(key))
            assert first.code is grpc.StatusCode.OK, (first.code, first.details)
            assert len(response(first).blob) >= size - 256
            retry = await call_raw(channel, method, post(account, f"big:{size}"), metadata(key))
            assert retry.replayed and retry.body == first.body
    assert await ledger_rows(store, account) == 1


async def test_a_large_response_travels_to_postgres_in_binary_not_as_hex_text(
    pg_dsn: str, store: Store
) -> None:
    """Inlined as a hex literal, a response cost twice its size on the wire (and more in the
    server's memory: a 50 MB response peaked at 447 MB); now large outcomes are bind
    parameters. Measured at a proxy in front of PostgreSQL."""
    size = 4_000_000
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    measured = await Store.connect(proxy.dsn, max_size=2)
    try:
        overrides = {POST: MethodOverride(max_response_bytes=8 << 20)}
        async with running_ledger(measured, overrides=overrides) as ledger:
            channel = grpc.aio.insecure_channel(
                ledger.address, options=[("grpc.max_receive_message_length", 16 << 20)]
            )
            async with channel:
                before = proxy.bytes_upstream
                answer = await call_raw(
                    channel, POST, post(fresh("acct"), f"big:{size}"), metadata(fresh())
                )
                sent = proxy.bytes_upstream - before
        assert answer.code is grpc.StatusCode.OK
        assert size <= sent < 1.2 * size, sent  # hex text would be more than 2 * size
    finally:
        await measured.close(timeout=1)
        await proxy.close()


# -- 7. schema not migrated --------------------------------------------------------------------


@pytest.mark.parametrize(
    "dsn",
    [
        "not a dsn",
        "mysql://app:s3cret@localhost/app",
        "postgresql://app:s3cret@localhost/app?sslmode=bogus",
        "postgresql://app:s3cr/et@localhost/app",  # the unencoded "/" makes "s3cr" the port
    ],
    ids=["garbage", "scheme", "sslmode", "slash-in-password"],
)
async def test_connect_refuses_a_dsn_the_driver_cannot_use_as_not_retryable(dsn: str) -> None:
    """It was StoreUnavailable (the retryable error: a start-up loop retried a typo forever) or
    the driver's raw ValueError quoting a piece of the password."""
    with pytest.raises(DsnUnusable) as refused:
        await Store.connect(dsn, check_schema=False)
    err = refused.value
    assert isinstance(err, StoreMisconfigured) and err.status_code is Code.INTERNAL
    assert err.__cause__ is None and err.__suppress_context__
    assert "s3cr" not in str(err) and "percent-encode" in str(err)


async def test_connect_leaves_its_own_argument_errors_alone(pg_dsn: str) -> None:
    with pytest.raises(ValueError, match="min_size") as refused:
        await Store.connect(pg_dsn, min_size=5, max_size=2)
    assert not isinstance(refused.value, DsnUnusable)
    # A negative acquire_timeout was clamped to 1 ms without a word.
    for bad in (-1.0, 0.0, float("nan"), float("inf"), 10**400):
        with pytest.raises(ValueError, match="acquire_timeout"):
            await Store.connect(pg_dsn, acquire_timeout=bad)


async def test_connect_refuses_a_schema_that_was_never_migrated(pg_dsn: str) -> None:
    schema = f"gi_never_{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreMisconfigured) as raised:
        await Store.connect(pg_dsn, schema=schema)
    assert "grpc-idempotency migrate" in str(raised.value) and schema in str(raised.value)


async def test_connect_names_the_migrations_missing_from_an_older_schema(pg_dsn: str) -> None:
    schema = f"gi_older_{uuid.uuid4().hex[:8]}"
    migrated = await Store.connect(pg_dsn, schema=schema, migrate=True)
    try:
        await migrated.pool.execute(f"DELETE FROM {schema}.schema_migrations WHERE version = 7")
        with pytest.raises(StoreMisconfigured, match=r"needs migrations \[7\]"):
            await Store.connect(pg_dsn, schema=schema)
        await (await Store.connect(pg_dsn, schema=schema, migrate=True)).close()
        await (await Store.connect(pg_dsn, schema=schema)).close()  # fixed by migrating
    finally:
        await migrated.pool.execute(f"DROP SCHEMA {schema} CASCADE")
        await migrated.close()


async def test_a_schema_at_0012_needs_0013_to_fence_on_the_operations_start(pg_dsn: str) -> None:
    """The phased final transaction calls verify_claim with the operation's start, an overload
    added by migration 0013: a server of this version refuses to start against a schema at 0012,
    where every phased call would fail, and migrating applies 0013 (and those after it)."""
    schema = f"gi_at_12_{uuid.uuid4().hex[:8]}"
    migrated = await Store.connect(pg_dsn, schema=schema, migrate=True)
    fenced = f"{schema}.verify_claim(text, text, bigint, bigint, timestamptz)"
    try:
        await migrated.pool.execute(
            f"DROP FUNCTION {fenced}; DELETE FROM {schema}.schema_migrations WHERE version >= 13"
        )
        later = [m.version for m in available_migrations() if m.version >= 13]
        with pytest.raises(
            StoreMisconfigured, match=rf"at version 12; .* needs migrations {re.escape(str(later))}"
        ):
            await Store.connect(pg_dsn, schema=schema)
        assert await migrated.migrate() == later
        assert await migrated.pool.fetchval("SELECT to_regprocedure($1) IS NOT NULL", fenced)
        await (await Store.connect(pg_dsn, schema=schema)).close()
    finally:
        await migrated.pool.execute(f"DROP SCHEMA {schema} CASCADE")
        await migrated.close()


async def test_a_permanent_store_error_is_logged_and_not_answered_as_retryable(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A store built without the check (or whose schema was dropped under it) used to answer
    every keyed call UNAVAILABLE (42P01), which clients retry forever, and log nothing."""
    unmigrated = Store(store.pool, schema=f"gi_nowhere_{uuid.uuid4().hex[:8]}")
    async with running_ledger(unmigrated) as ledger:
        with caplog.at_level(logging.ERROR, logger="grpc_idempotency.store"):
            answer = await ledger.call(POST, post(fresh("acct")), fresh())
        assert answer.code is grpc.StatusCode.INTERNAL
        assert answer.reason() == "IDEMPOTENCY_STORE_MISCONFIGURED"
        assert ledger.service.executions == 0
    assert "misconfigured" in caplog.text and "grpc-idempotency migrate" in caplog.text


async def test_an_optional_key_call_without_a_key_forwards_metadata_and_deadline(
    store: Store,
) -> None:
    """Forward made optional and called without a key runs unclaimed; its call to the ledger
    still carries the tenant header (forward_metadata) and the caller's deadline, as a keyed
    call's does. (It carried neither: the ledger refused it, UNAUTHENTICATED.)"""
    overrides = {FORWARD: MethodOverride(key=KeyRequirement.OPTIONAL)}
    account = fresh("acct")
    request = testsvc_pb2.ForwardRequest(account=account, mode="post")
    async with (
        running_ledger(store) as downstream,
        running_relay(store, downstream.address, overrides=overrides) as relay,
    ):
        answer = await relay.forward(request, None, timeout=3)
    assert answer.code is grpc.StatusCode.OK, answer.details
    assert downstream.service.tenants_seen == ["tenant-a"]
    (remaining,) = downstream.service.deadlines_seen
    # gRPC sends a deadline as a timeout rounded up to its units: a hair over 3 s can arrive.
    assert remaining is not None and 0 < remaining <= 3.05
    assert await ledger_rows(store, account) == 1


async def test_a_sync_grpc_server_refuses_each_call_clearly_and_keeps_serving(
    store: Store, caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder
) -> None:
    """The interceptor is grpc.aio's; a sync ``grpc.server`` accepts it all the same. It then
    refuses every call (UNKNOWN, gRPC's answer to an interceptor that raises) with a TypeError
    that says how to fix it, and makes no coroutine it would leave unawaited (a RuntimeWarning
    on every call). (The sync server got a coroutine where it expected a handler: its serving
    thread died of an AttributeError, and that call and every later one hung until their
    deadlines.)"""
    interceptor = IdempotencyInterceptor(store, services=[testsvc_pb2], scope=StaticScope("sync"))
    # The misuse on purpose: mypy refuses it, but grpc.server() checks nothing.
    server = grpc.server(ThreadPoolExecutor(max_workers=2), interceptors=[interceptor])  # type: ignore[list-item]
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(
        testsvc_pb2_grpc.LedgerServiceServicer(), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
            for _ in range(2):  # the second: the server still answers
                with pytest.raises(grpc.RpcError) as refused:
                    await asyncio.to_thread(
                        stub.Post, post(fresh("acct")), metadata=[("idempotency-key", fresh())],
                        timeout=10,
                    )  # fmt: skip
                assert refused.value.code() is grpc.StatusCode.UNKNOWN, refused.value
    finally:
        # Bounded: a sync server whose serving thread died never finishes stopping.
        server.stop(0).wait(10)
    assert (
        "TypeError: IdempotencyInterceptor is a grpc.aio server interceptor: add it to"
        " grpc.aio.server(interceptors=[...])" in caplog.text
    ), caplog.text

    def as_the_serving_thread_calls_it() -> None:  # no event loop running
        with pytest.raises(TypeError, match=r"grpc\.aio\.server\(interceptors="):
            interceptor.intercept_service(cast(Any, None), cast(Any, None)).close()

    await asyncio.to_thread(as_the_serving_thread_calls_it)
    # (Checked here: the log records above hold the server's errors, and their frames.)
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
