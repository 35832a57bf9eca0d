"""The library behind a real PgBouncer in transaction pooling mode.

In transaction mode PgBouncer hands each transaction (and each statement outside one) to
whichever server connection is free, so nothing a client leaves on a session survives: not
asyncpg's named prepared statements (its statement cache, on by default), not LISTEN. With
``statement_cache_size=0`` asyncpg uses only the unnamed statement, parsed again in the same
Parse/Bind/Execute/Sync exchange that runs it, and the store keeps no session state (its
locks are transaction-scoped, its ``SET``s are ``SET LOCAL``, its pool runs no reset query).

PgBouncer is started by the tests (tests/support/pgbouncer.py) with fewer server connections
than the clients' pools hold, so clients really do share and swap them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import KeyReused, Store, StoreMisconfigured, StoreUnavailable, cli
from grpc_idempotency.cli_errors import report_store_error, store_error_status
from grpc_idempotency.consumer import Consumed, IdempotentConsumer
from grpc_idempotency.outbox import OutboxMessage, Relay
from grpc_idempotency.store.errors import prepared_statement_lost
from tests.support.ledger import RunningLedger, ledger_rows, metadata, running_ledger
from tests.support.pgbouncer import PgBouncer, free_port, running_pgbouncer
from tests.support.waiting import until
from tests.support.wire import Answer, call_raw

# What a store behind PgBouncer (before 1.21's max_prepared_statements) needs.
POOL_OPTIONS: dict[str, Any] = {"statement_cache_size": 0}
SERVER_CONNECTIONS = 4  # PgBouncer's pool; the stores below hold up to 16 client connections
WAIT_S = 20.0  # an upper bound for things that take milliseconds; never a pause
LISTENS = "SELECT $1::text IN (SELECT pg_listening_channels())"
POST = "/testsvc.v1.LedgerService/Post"
PHASED = "/testsvc.v1.LedgerService/PostPhased"


@pytest.fixture(scope="module")
def bouncer(pg_dsn: str) -> Iterator[PgBouncer]:
    with running_pgbouncer(pg_dsn, pool_size=SERVER_CONNECTIONS) as running:
        yield running


@pytest.fixture
async def bounced(bouncer: PgBouncer, store: Store) -> AsyncIterator[Store]:
    """A store whose pool goes through PgBouncer (``store``, direct, migrated the schema)."""
    through = await Store.connect(bouncer.dsn, min_size=1, max_size=16, **POOL_OPTIONS)
    try:
        yield through
    finally:
        await through.close()


@pytest.fixture
async def bounced_outbox(bouncer: PgBouncer, store: Store) -> AsyncIterator[Store]:
    """A store through PgBouncer on a fresh schema, migrated through PgBouncer too."""
    schema = "pgb_" + uuid.uuid4().hex[:12]
    through = await Store.connect(
        bouncer.dsn, schema=schema, min_size=1, max_size=8, migrate=True, **POOL_OPTIONS
    )
    try:
        yield through
    finally:
        await through.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await through.close()


# -- the cause ----------------------------------------------------------------------------------


async def test_transaction_pooling_loses_named_statements_and_keeps_unnamed_ones(
    pg_dsn: str,
) -> None:
    """Why asyncpg's defaults fail behind PgBouncer: a statement it prepared (and cached) on one
    server connection is executed later on another. Without the cache it works."""
    with running_pgbouncer(pg_dsn, pool_size=2) as small:
        cached = await asyncpg.connect(small.dsn)  # asyncpg's defaults
        uncached = await asyncpg.connect(small.dsn, **POOL_OPTIONS)
        holder = await asyncpg.connect(small.dsn, **POOL_OPTIONS)
        try:
            first = await cached.fetchval("SELECT pg_backend_pid()")  # __asyncpg_stmt_1__
            async with holder.transaction():
                # PgBouncer reuses idle server connections last in, first out: the holder's
                # transaction gets (and pins) the one the cached statement lives on.
                assert await holder.fetchval("SELECT pg_backend_pid()") == first
                with pytest.raises(
                    asyncpg.InvalidSQLStatementNameError,
                    match=r'prepared statement "__asyncpg_stmt_[0-9a-f]+__" does not exist',
                ):
                    await cached.fetchval("SELECT pg_backend_pid()")
                # Without the cache: another server connection, and it works, with parameters.
                assert await uncached.fetchval("SELECT pg_backend_pid()") != first
                assert await uncached.fetchval("SELECT $1::int + 1", 41) == 42
        finally:
            for conn in (cached, uncached, holder):
                await conn.close()


async def test_a_store_statement_failing_for_the_statement_cache_says_why_in_the_log(
    pg_dsn: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A store left with asyncpg's statement cache behind PgBouncer: its statements fail now and
    then (26000, 42P05), as a call lands on a server connection its cached statement is not on.
    The call's answer stays what it was; the log names the likely cause and the fix, where it
    said nothing about the store's own statements. Made to happen as in the test above: a
    statement cached on the one server connection that another client then pins."""
    # A store of its own below, so a limiter of its own (``Store.store_log``): another test's
    # failure in this minute does not silence this one.
    caplog.set_level(logging.ERROR, logger="grpc_idempotency.store")
    with running_pgbouncer(pg_dsn, pool_size=2) as small:
        cached = await Store.connect(small.dsn, min_size=1, max_size=1)  # asyncpg's defaults
        holder = await asyncpg.connect(small.dsn, **POOL_OPTIONS)
        try:
            async with running_ledger(cached) as ledger:
                run = uuid.uuid4().hex[:10]
                request = testsvc_pb2.PostRequest(account=f"pgb-{run}", amount=1)
                warm = await call_raw(ledger.channel, PHASED, request, metadata(f"pgb-{run}-1"))
                assert warm.code is grpc.StatusCode.OK, warm.details  # cached on one server
                assert not caplog.records
                async with holder.transaction():
                    await holder.fetchval("SELECT 1")  # pins that server (last in, first out)
                    failed = await call_raw(
                        ledger.channel, PHASED, request, metadata(f"pgb-{run}-2")
                    )
        finally:
            await holder.close()
            await cached.close()
    # Unchanged: the store's statement failed, retryable.
    assert failed.code is grpc.StatusCode.UNAVAILABLE, failed.details
    assert failed.details == "idempotency store unavailable while looking up a key (26000)"
    [record] = [r for r in caplog.records if "statement_cache_size=0" in r.getMessage()]
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert "while looking up a key (SQLSTATE 26000" in message, message
    assert "behind PgBouncer in transaction mode" in message, message
    assert "pass Store.connect(..., statement_cache_size=0)" in message, message


@pytest.mark.parametrize("command", [["purge"], ["inspect", "--scope", "s", "k"]])
async def test_a_command_failing_for_the_statement_cache_exits_2_naming_the_flag(
    pg_dsn: str, store: Store, command: list[str]
) -> None:
    """A command behind PgBouncer without --statement-cache-size 0 whose named statement meets
    one already on the server connection (42P05, as a previous run leaves it there) exits 2 and
    names the flag. It exited 1 ("unreachable, retry later") with asyncpg's hint cut off before
    its fix, and the store's log line naming the flag was left out of the CLI's output: a cron
    job retried for good. Made to happen at once: asyncpg's first statement name in a fresh
    process, prepared on the pooler's one server connection."""
    with running_pgbouncer(pg_dsn, pool_size=1) as single:
        squatter = await asyncpg.connect(single.dsn, **POOL_OPTIONS)
        try:
            await squatter.execute('PREPARE "__asyncpg_stmt_1__" AS SELECT 1')
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "grpc_idempotency.cli", *command,
                "--dsn", single.dsn, "--schema", store.schema,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
        finally:
            await squatter.close()
    assert "(42P05)" in err.decode(), err.decode()
    assert proc.returncode == 2, err.decode()
    assert "pass --statement-cache-size 0" in err.decode(), err.decode()


async def test_a_bind_that_does_not_fit_another_clients_statement_is_the_statement_cache(
    pg_dsn: str, store: Store, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """The statement cache's other failure behind PgBouncer: a cached statement executed on a
    server connection where another client has since prepared one of the same name (asyncpg
    numbers its statements alike on every connection) with other parameters. PostgreSQL refuses
    the Bind with 08P01, the SQLSTATE of PgBouncer's own failures: one of four concurrent
    migrate runs exited 1, "unavailable", a presumed outage, for good. Like 26000 and 42P05 it
    is logged naming the fix, is no outage, and a command exits 2 naming the flag. Made to
    happen at once: the store's statements, cached on the pooler's one server connection, are
    each prepared again there by another client with one parameter more."""
    caplog.set_level(logging.ERROR, logger="grpc_idempotency.store")
    with running_pgbouncer(pg_dsn, pool_size=1) as single:
        cached = await Store.connect(single.dsn, schema=store.schema, min_size=1, max_size=1)
        squatter = await asyncpg.connect(single.dsn, **POOL_OPTIONS)
        try:
            await cached.check_schema()  # its statements prepared and cached
            named = await squatter.fetch(
                "SELECT name, cardinality(parameter_types) AS n FROM pg_prepared_statements"
                " WHERE starts_with(name, '__asyncpg_')"
            )
            assert named, "the store's statements are on the one server connection"
            for name, n in named:
                types = ", ".join(["int"] * (n + 1))
                await squatter.execute(
                    f'DEALLOCATE "{name}"; PREPARE "{name}"({types}) AS SELECT 1'
                )
            with pytest.raises(StoreUnavailable) as raised:
                await cached.check_schema()
        finally:
            await squatter.close()
            await cached.close()
    err = raised.value
    cause = err.__cause__
    assert isinstance(cause, asyncpg.ProtocolViolationError), repr(cause)
    assert str(cause).startswith("bind message supplies "), str(cause)
    assert prepared_statement_lost(cause)
    assert not err.outage and not err.ambiguous, "the database answered"
    [record] = [r for r in caplog.records if "statement_cache_size=0" in r.getMessage()]
    assert "(SQLSTATE 08P01: bind message supplies" in record.getMessage(), record.getMessage()
    # What the CLI makes of it (migrate, purge, inspect...): exit 2, naming the flag.
    assert store_error_status(err) == 2
    report_store_error(err, single.dsn)
    assert "pass --statement-cache-size 0" in capsys.readouterr().err


async def test_a_bind_another_clients_statement_reads_as_other_types_is_the_statement_cache(
    pg_dsn: str, store: Store, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """As above, but the other client's statement of the same name has as many parameters, of
    other types: PostgreSQL reads the store's binary text as a bigint, bytes are left over, and
    it refuses the Bind with 22P03 ("incorrect binary data format in bind parameter 1"). Taken
    for a value the database refused, it was no hint and a command's exit 1, retried for good.
    Made to happen at once: each of the store's cached statements with parameters is prepared
    again on the pooler's one server connection with each text parameter a bigint."""
    caplog.set_level(logging.ERROR, logger="grpc_idempotency.store")
    with running_pgbouncer(pg_dsn, pool_size=1) as single:
        cached = await Store.connect(single.dsn, schema=store.schema, min_size=1, max_size=1)
        squatter = await asyncpg.connect(single.dsn, **POOL_OPTIONS)
        try:
            await cached.check_schema()  # its statements prepared and cached
            named = await squatter.fetch(
                "SELECT name, parameter_types::text[] AS types FROM pg_prepared_statements"
                " WHERE starts_with(name, '__asyncpg_') AND cardinality(parameter_types) > 0"
            )
            # to_regclass($1): the schema_migrations table's qualified name, more than 8 bytes.
            assert any("text" in types for _, types in named), named
            for name, types in named:
                others = ", ".join("bigint" if t == "text" else "text" for t in types)
                await squatter.execute(
                    f'DEALLOCATE "{name}"; PREPARE "{name}"({others}) AS SELECT true'
                )
            with pytest.raises(StoreUnavailable) as raised:
                await cached.check_schema()
        finally:
            await squatter.close()
            await cached.close()
    err = raised.value
    cause = err.__cause__
    assert isinstance(cause, asyncpg.InvalidBinaryRepresentationError), repr(cause)
    assert str(cause) == "incorrect binary data format in bind parameter 1", str(cause)
    assert prepared_statement_lost(cause)
    assert not err.outage and not err.ambiguous, "the database answered"
    [record] = [r for r in caplog.records if "statement_cache_size=0" in r.getMessage()]
    assert "(SQLSTATE 22P03: incorrect binary data format" in record.getMessage()
    assert store_error_status(err) == 2
    report_store_error(err, single.dsn)
    assert "pass --statement-cache-size 0" in capsys.readouterr().err


# -- migrations ---------------------------------------------------------------------------------


async def test_replicas_migrating_together_through_pgbouncer_apply_each_migration_once(
    pg_dsn: str, bouncer: PgBouncer
) -> None:
    """Replicas' init steps migrating at once through the pooler: their lock is taken inside
    each migration's transaction (a session's advisory lock would stay on whichever server
    connection took it, held by the next client there and never released), so they queue
    behind the runner at work, each migration is applied once, and every runner ends well."""
    from grpc_idempotency.store.migrations import _lock_id, applied_versions, available_migrations

    schema = "pgb_" + uuid.uuid4().hex[:12]
    runner = await asyncpg.connect(pg_dsn)  # the first runner, mid-migration
    replicas = SERVER_CONNECTIONS - 1  # each waits holding a server connection of PgBouncer's
    try:
        await runner.execute("BEGIN")
        await runner.execute("SELECT pg_advisory_xact_lock($1)", _lock_id(schema))
        starting = [
            asyncio.create_task(
                Store.connect(
                    bouncer.dsn, schema=schema, min_size=1, max_size=1, migrate=True, **POOL_OPTIONS
                )
            )
            for _ in range(replicas)
        ]

        async def all_waiting() -> bool:
            if any(t.done() for t in starting):
                return True  # for the assertion below to say what ended
            waiting = await runner.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND (classid::bigint << 32 | objid::bigint) = $1",
                _lock_id(schema),
            )
            return bool(waiting == replicas)

        await until("every replica to queue for the migration lock", all_waiting, WAIT_S)
        assert not any(t.done() for t in starting)
        await runner.execute("ROLLBACK")  # done (here: it applied nothing)
        stores = await asyncio.gather(*starting)
        try:
            versions = [m.version for m in available_migrations()]
            assert await applied_versions(runner, schema) == versions
            # Once each: a version applied twice would have failed its runner (already exists).
            assert await runner.fetchval(
                f'SELECT count(*) FROM "{schema}".schema_migrations'
            ) == len(versions)
            for store in stores:
                assert await store.check_schema() == frozenset(versions)
        finally:
            await runner.execute(f'DROP SCHEMA "{schema}" CASCADE')
            for store in stores:
                await store.close()
    finally:
        await runner.close()


# -- keyed calls --------------------------------------------------------------------------------


class Client:
    """Calls keyed methods, answering ABORTED/IDEMPOTENCY_KEY_IN_PROGRESS as a client should (the
    same key again after the pushback), and keeps every other failure."""

    def __init__(self, ledger: RunningLedger) -> None:
        self.channel = ledger.channel
        self.answers: dict[str, list[Answer]] = collections.defaultdict(list)
        self.failures: collections.Counter[str] = collections.Counter()
        self.examples: list[str] = []
        self.in_progress = 0

    async def call(self, method: str, key: str, request: testsvc_pb2.PostRequest) -> None:
        for _ in range(50):
            answer = await call_raw(
                self.channel, f"/testsvc.v1.LedgerService/{method}", request, metadata(key)
            )
            if answer.code is grpc.StatusCode.OK:
                self.answers[key].append(answer)
                return
            if (
                answer.code is grpc.StatusCode.ABORTED
                and answer.reason() == "IDEMPOTENCY_KEY_IN_PROGRESS"
            ):
                self.in_progress += 1
                # The server's pushback: the protocol's own backoff, not a guess.
                await asyncio.sleep((answer.retry_delay_ms() or 50) / 1000)
                continue
            self.failures[answer.code.name] += 1
            self.examples.append(f"{method} {key}: {answer.code.name}: {answer.details}")
            return
        self.failures["IN_PROGRESS_FOREVER"] += 1


async def test_keyed_calls_through_pgbouncer_run_once_and_replay_byte_identical(
    bounced: Store, store: Store
) -> None:
    run = uuid.uuid4().hex[:10]
    # (method, key, account): atomic (claim batched with BEGIN, complete with COMMIT) and phased
    # (claim committed on its own, final transaction later) methods.
    work = [("Post", f"pgb-{run}-a{i}", f"pgb-{run}-a{i}") for i in range(100)]
    work += [("PostPhased", f"pgb-{run}-p{i}", f"pgb-{run}-p{i}") for i in range(50)]
    async with running_ledger(bounced) as ledger:
        client = Client(ledger)
        in_flight = asyncio.Semaphore(24)

        async def duplicates(i: int, method: str, key: str, account: str) -> None:
            request = testsvc_pb2.PostRequest(account=account, amount=i + 1)
            async with in_flight:  # 2 or 3 attempts of the key at the same time
                copies = 3 if i % 5 == 0 else 2
                await asyncio.gather(*(client.call(method, key, request) for _ in range(copies)))

        await asyncio.gather(*(duplicates(i, *w) for i, w in enumerate(work)))
        assert bounced.pool.get_size() > SERVER_CONNECTIONS  # more clients than servers
        # A second wave: every key again (retries arriving after the first outcome).
        await asyncio.gather(
            *(
                client.call(m, k, testsvc_pb2.PostRequest(account=a, amount=i + 1))
                for i, (m, k, a) in enumerate(work)
            )
        )
        executions = ledger.service.executions

    # No UNKNOWN, no UNAVAILABLE, nothing else either; every call answered OK (ABORTED
    # IN_PROGRESS answers are retried with the same key, as clients do).
    assert not client.failures, (client.failures, client.examples[:5])
    assert sum(len(a) for a in client.answers.values()) == 2 * 150 + 30 + 150
    assert executions == len(work)  # each key's handler ran once...
    counts = await store.pool.fetch(
        "SELECT account, count(*) AS n FROM test_ledger.ledger WHERE account LIKE $1"
        " GROUP BY account",
        f"pgb-{run}-%",
    )
    assert {r["account"]: r["n"] for r in counts} == {a: 1 for _, _, a in work}  # ...and wrote once
    for _, key, _ in work:
        answers = client.answers[key]
        assert len({a.body for a in answers}) == 1, key  # replays are the original's bytes
        assert [a.replayed for a in answers].count(False) == 1, key  # one execution, rest replays


async def test_pgbouncer_killed_and_restarted_under_keyed_calls(pg_dsn: str, store: Store) -> None:
    """PgBouncer killed (kill -9) and started again on the same port with an atomic call inside
    its transaction and a phased call between its claim and its final transaction, the
    application's store untouched: the atomic call is UNAVAILABLE (its transaction died with the
    client connection) and its retry runs once; the phased call commits on a new connection and
    its retry replays. Both keys end completed, each effect written once."""
    port = free_port()
    with contextlib.ExitStack() as bouncers:
        first = bouncers.enter_context(running_pgbouncer(pg_dsn, pool_size=4, port=port))
        through = await Store.connect(first.dsn, min_size=4, max_size=8, **POOL_OPTIONS)
        try:
            async with running_ledger(through) as atomic, running_ledger(through) as phased:
                a_key, a_account = f"pgk-{uuid.uuid4().hex}", f"pgk-{uuid.uuid4().hex}"
                p_key, p_account = f"pgk-{uuid.uuid4().hex}", f"pgk-{uuid.uuid4().hex}"
                a_request = testsvc_pb2.PostRequest(account=a_account, amount=1, behaviour="hold")
                p_request = testsvc_pb2.PostRequest(account=p_account, amount=1, behaviour="wait")
                a_call = asyncio.ensure_future(
                    call_raw(atomic.channel, POST, a_request, metadata(a_key), 30)
                )
                p_call = asyncio.ensure_future(
                    call_raw(phased.channel, PHASED, p_request, metadata(p_key), 30)
                )
                await asyncio.wait_for(atomic.service.started.wait(), WAIT_S)
                await asyncio.wait_for(phased.service.started.wait(), WAIT_S)

                first.process.kill()
                first.process.wait()
                bouncers.close()
                bouncers.enter_context(running_pgbouncer(pg_dsn, pool_size=4, port=port))
                atomic.service.release.set()
                phased.service.release.set()
                a_first, p_first = await a_call, await p_call
                assert a_first.code is grpc.StatusCode.UNAVAILABLE, a_first.details
                assert a_first.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
                assert p_first.code is grpc.StatusCode.OK, p_first.details
                a_retry = await call_raw(atomic.channel, POST, a_request, metadata(a_key))
                p_retry = await call_raw(phased.channel, PHASED, p_request, metadata(p_key))
                assert a_retry.code is grpc.StatusCode.OK and not a_retry.replayed
                assert p_retry.code is grpc.StatusCode.OK and p_retry.replayed
                assert p_retry.body == p_first.body
        finally:
            await through.close(timeout=2)
    for account in (a_account, p_account):
        assert await ledger_rows(store, account) == 1
    states = await store.pool.fetch(
        "SELECT state FROM grpc_idempotency.records WHERE key = ANY($1)", [a_key, p_key]
    )
    assert [r["state"] for r in states] == ["completed"] * 2


@pytest.mark.parametrize(
    ("dsn_of", "refusal"),
    [
        # A DSN query parameter is a startup parameter: PgBouncer forwards only the few it
        # tracks (application_name, TimeZone, ...) and refuses the session for any other.
        (lambda b: b.dsn + "?statement_timeout=5000", "unsupported startup parameter"),
        (lambda b: b.dsn.rsplit("/", 1)[0] + "/no_such_db_here", "no such database"),
        (lambda b: b.dsn.replace("@", "_nobody@", 1), "authentication failed"),
    ],
    ids=["startup-parameter", "database", "user"],
)
async def test_pgbouncers_refusal_of_the_session_for_good_is_misconfigured_not_unavailable(
    bouncer: PgBouncer, dsn_of: Any, refusal: str
) -> None:
    """PgBouncer refuses a session's start-up with SQLSTATE 08P01 whatever the reason, where
    PostgreSQL says 42704 (a setting), 3D000 (a database) or 28xxx (a role), which the store
    reports as misconfigured (CLI exit 2): every connection fails alike until the DSN or the
    pooler's configuration changes. Behind PgBouncer the same mistakes were "unavailable"
    (retryable, an outage: exit 1), and a deploy step's migrate retried them for good."""
    with pytest.raises(StoreMisconfigured, match="misconfigured while connecting") as refused:
        await Store.connect(dsn_of(bouncer), min_size=1, max_size=2, **POOL_OPTIONS)
    assert refusal in str(refused.value.__cause__), refused.value.__cause__


async def test_a_probe_dsn_pgbouncer_refuses_for_good_is_refused_at_connect(
    pg_dsn: str, bouncer: PgBouncer
) -> None:
    """As the store's own DSN refused so (above), and as a probe_dsn PostgreSQL refuses: it was
    accepted with a warning that it "does not answer now", every probe then failed alike, and
    every ambiguous outage let fail-open methods run unclaimed."""
    probe_dsn = bouncer.dsn + "?statement_timeout=5000"
    with pytest.raises(StoreMisconfigured, match=r"probe_dsn: the pooler \(PgBouncer\) refused"):
        await Store.connect(pg_dsn, probe_dsn=probe_dsn, check_schema=False)


@pytest.mark.parametrize("failure", ["max_client_conn", "server-unreachable"])
async def test_pgbouncers_passing_failures_at_connection_stay_unavailable(
    pg_dsn: str, failure: str
) -> None:
    """PgBouncer sends its passing failures with the same 08P01 as its refusals for good: a
    client past max_client_conn, and a session whose start-up waited for a server PgBouncer
    cannot reach (query_wait_timeout in 1.18; "pgbouncer cannot connect to server" or "server
    login has been failing" in others). Taken for misconfigured (``connect_error`` matching
    every 08P01), a deploy step's migrate gave up (exit 2) on a pooler that recovers, a call's
    client was told not to retry (INTERNAL), and a fail-open method ran unclaimed with no
    check that the database was down. They stay a presumed outage: retryable, confirmed first."""
    async with contextlib.AsyncExitStack() as stack:
        if failure == "max_client_conn":
            bouncer = stack.enter_context(running_pgbouncer(pg_dsn, max_client_conn=1))
            held = await asyncpg.connect(bouncer.dsn, statement_cache_size=0)
            stack.push_async_callback(held.close)
        else:
            nowhere = f"postgresql://nobody@127.0.0.1:{free_port()}/nowhere"
            settings = {"query_wait_timeout": "1"}  # 1.18 waits that long for the server
            bouncer = stack.enter_context(running_pgbouncer(nowhere, settings=settings))
        with pytest.raises(StoreUnavailable, match="unavailable while connecting") as failed:
            await Store.connect(bouncer.dsn, min_size=1, max_size=2, **POOL_OPTIONS)
    cause = failed.value.__cause__
    assert type(failed.value) is StoreUnavailable, failed.value  # not StoreMisconfigured
    assert failed.value.outage and failed.value.ambiguous, failed.value
    assert getattr(cause, "sqlstate", None) == "08P01", repr(cause)
    if failure == "max_client_conn":
        assert "max_client_conn" in str(cause), cause


# -- consumers ----------------------------------------------------------------------------------

# What a delivery sets in its transaction (sql.begin, the mark, the commit's DO block), the token
# setting included: each must be back at the session's default for the next client.
SESSION_SETTINGS = (
    "SELECT pg_catalog.pg_backend_pid() AS pid,"
    " pg_catalog.current_setting('lock_timeout') AS lock_timeout,"
    " pg_catalog.current_setting('idle_in_transaction_session_timeout') AS idle_timeout,"
    " pg_catalog.current_setting('search_path') AS search_path,"
    " pg_catalog.current_setting('grpc_idempotency.consumer_mark', true) AS token"
)


async def test_a_consumer_through_pgbouncer_runs_each_message_once_and_leaves_no_settings(
    bouncer: PgBouncer, bounced: Store, store: Store
) -> None:
    """An IdempotentConsumer on a store behind PgBouncer (statement_cache_size=0): its mark is
    one simple-query batch whose lock_timeout and token are set_config(..., true), local to the
    transaction PgBouncer pins a server connection to. Processed, duplicate, another payload
    refused, a second replica's delivery waiting on the first's row then a duplicate, a failed
    effect releasing the mark, purge; then every server connection the deliveries ran on, taken
    by other clients, has the session's defaults (PgBouncer runs no reset query in transaction
    mode: a session-level SET would reach them)."""
    await store.pool.execute(
        "CREATE TABLE IF NOT EXISTS public.pgb_consumer_effects"
        " (consumer text NOT NULL, message_id text NOT NULL)"
    )
    name = f"pgb-{uuid.uuid4().hex[:10]}"
    # A bound unlike the default lock_timeout (0), so a leaked one would show.
    consumer = IdempotentConsumer(bounced, name, max_wait=timedelta(seconds=WAIT_S))
    replica = IdempotentConsumer(bounced, name, max_wait=timedelta(seconds=WAIT_S))
    servers: set[int] = set()  # the server connections (backends) the effects ran on
    inside: list[asyncpg.Record] = []
    entered, release = asyncio.Event(), asyncio.Event()  # the racing delivery's effect

    def effect(message_id: str, hold: asyncio.Event | None = None, fail: bool = False) -> Any:
        async def run(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO public.pgb_consumer_effects VALUES ($1, $2)", name, message_id
            )
            settings = await conn.fetchrow(SESSION_SETTINGS)
            servers.add(settings["pid"])
            inside.append(settings)
            if hold is not None:
                entered.set()
                await asyncio.wait_for(hold.wait(), WAIT_S)
            if fail:
                raise RuntimeError("the effect failed after writing")

        return run

    async def effects(message_id: str) -> int:
        count: int = await store.pool.fetchval(
            "SELECT count(*) FROM public.pgb_consumer_effects"
            " WHERE consumer = $1 AND message_id = $2",
            name,
            message_id,
        )
        return count

    async def must_not_run(conn: Any) -> None:
        raise AssertionError("a duplicate's effect ran")

    first_id, raced_id, failed_id = (f"{name}-{i}" for i in range(3))
    done = await consumer.process(first_id, effect(first_id), payload=b"one")
    assert done.outcome is Consumed.PROCESSED
    again = await replica.process(first_id, must_not_run, payload=b"one")
    assert again.outcome is Consumed.DUPLICATE
    with pytest.raises(KeyReused):
        await replica.process(first_id, must_not_run, payload=b"another")
    assert await effects(first_id) == 1

    # Two replicas: the second's mark waits on the first's uncommitted row (a lock wait on
    # another server connection) until the first commits, then sees the duplicate.
    first = asyncio.create_task(consumer.process(raced_id, effect(raced_id, hold=release)))
    await asyncio.wait_for(entered.wait(), WAIT_S)
    second = asyncio.create_task(replica.process(raced_id, must_not_run))

    async def waiting() -> int:
        count: int = await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND strpos(query, $1) > 0",
            f"'{raced_id}'",
        )
        return count

    await until("the second delivery to wait on the first's row", waiting, WAIT_S)
    assert not second.done()
    release.set()
    assert (await first).outcome is Consumed.PROCESSED
    assert (await second).outcome is Consumed.DUPLICATE
    assert await effects(raced_id) == 1

    # An effect that raises: its write and the mark roll back; the redelivery processes it.
    with pytest.raises(RuntimeError, match="the effect failed"):
        await consumer.process(failed_id, effect(failed_id, fail=True))
    assert await effects(failed_id) == 0 and not await consumer.is_processed(failed_id)
    assert (await replica.process(failed_id, effect(failed_id))).outcome is Consumed.PROCESSED
    assert await effects(failed_id) == 1

    # Inside the effect: the mark's token set, the session's lock_timeout back (the mark's bound
    # is for the mark only).
    direct = await store.pool.fetchrow(SESSION_SETTINGS)
    assert direct is not None
    for settings in inside:
        assert settings["lock_timeout"] == direct["lock_timeout"], settings
        assert len(settings["token"] or "") == 32, settings

    # Purge: the marks expired by the database's clock go, batch by batch.
    await store.pool.execute(
        "UPDATE grpc_idempotency.processed_messages"
        " SET expires_at = clock_timestamp() - interval '1 second' WHERE consumer = $1",
        name,
    )
    assert await consumer.purge_processed(batch_size=2) == 3
    assert not await consumer.is_processed(first_id)
    assert (await replica.process(first_id, effect(first_id))).outcome is Consumed.PROCESSED

    # Every server connection at once, each pinned by a client of its own in a transaction:
    # none holds a delivery's transaction still, and none kept a setting of one.
    clients = [
        await asyncpg.connect(bouncer.dsn, **POOL_OPTIONS) for _ in range(SERVER_CONNECTIONS)
    ]
    try:
        seen = []
        for client in clients:
            await client.execute("BEGIN")
            seen.append(await asyncio.wait_for(client.fetchrow(SESSION_SETTINGS), WAIT_S))
        for client in clients:
            await client.execute("ROLLBACK")
    finally:
        for client in clients:
            await client.close()
    assert servers <= {s["pid"] for s in seen}, (servers, seen)
    for settings in seen:
        for setting in ("lock_timeout", "idle_timeout", "search_path"):
            assert settings[setting] == direct[setting], (setting, settings, direct)
        # A custom setting once set in a session reads '' after its transaction, not NULL.
        assert settings["token"] in (None, ""), settings


async def test_a_purge_through_pgbouncer_redone_past_a_held_row_leaves_no_lock_timeout(
    bouncer: PgBouncer, bounced_outbox: Store, store: Store
) -> None:
    """A records purge batch bounds its row-lock wait with ``SET LOCAL lock_timeout`` and, past
    it (a row the test holds), is redone skipping the row: through PgBouncer it finishes with
    the lock still held, and no server connection keeps the bound for the next client."""
    table = f'"{bounced_outbox.schema}".records'
    await store.pool.execute(
        f"INSERT INTO {table} (scope, key, method, fingerprint, state, fencing_token,"
        " locked_until, status_code, completed_at, expires_at, retention)"
        " SELECT 's', 'old-' || i, '/m', '\\x00', 'completed', 1, NULL, 0,"
        "  clock_timestamp() - interval '2 h',"
        "  clock_timestamp() - interval '1 h' + i * interval '1 ms', interval '1 h'"
        " FROM generate_series(1, 5) i"
    )
    direct = await store.pool.fetchrow(SESSION_SETTINGS)
    assert direct is not None
    async with store.pool.acquire() as holder, holder.transaction():
        await holder.execute(f"SELECT 1 FROM {table} WHERE key = 'old-3' FOR UPDATE")
        # Batches of 2: the first (old-1, old-2) commits under the bound, so a bound set for
        # the session, not the transaction, would stay on its server connection; the second
        # meets old-3, rolls back and is redone skipping it.
        assert await asyncio.wait_for(bounced_outbox.purge(batch_size=2), WAIT_S) == 4
    clients = [
        await asyncpg.connect(bouncer.dsn, **POOL_OPTIONS) for _ in range(SERVER_CONNECTIONS)
    ]
    try:
        seen = []
        for client in clients:
            await client.execute("BEGIN")
            seen.append(await asyncio.wait_for(client.fetchrow(SESSION_SETTINGS), WAIT_S))
        for client in clients:
            await client.execute("ROLLBACK")
    finally:
        for client in clients:
            await client.close()
    for settings in seen:
        assert settings["lock_timeout"] == direct["lock_timeout"], (settings, direct)


# -- relays -------------------------------------------------------------------------------------


class Receiver:
    def __init__(self, expect: int) -> None:
        self.delivered: collections.Counter[str] = collections.Counter()
        self.expect = expect
        self.all_in = asyncio.Event()

    async def deliver(self, message: OutboxMessage) -> None:
        self.delivered[message.key] += 1
        if len(self.delivered) >= self.expect:
            self.all_in.set()


async def enqueue(store: Store, count: int) -> list[str]:
    """``count`` keyed PostWithEvent calls through ``store`` (behind PgBouncer): one outbox row
    each, committed with the handler's write; returns the parent keys."""
    keys = [f"ev-{uuid.uuid4().hex}" for _ in range(count)]
    async with running_ledger(store) as ledger:
        client = Client(ledger)
        await asyncio.gather(
            *(
                client.call("PostWithEvent", k, testsvc_pb2.PostRequest(account=k, amount=1))
                for k in keys
            )
        )
    assert not client.failures, (client.failures, client.examples[:5])
    return keys


@contextlib.asynccontextmanager
async def running(relay: Relay) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def listeners(pg_dsn: str, channel: str) -> int:
    """Sessions listening on ``channel`` right now, on the server itself."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query = $1", f'LISTEN "{channel}"'
        )
        return count
    finally:
        await conn.close()


async def test_a_polling_relay_delivers_every_row_through_pgbouncer(
    pg_dsn: str, bounced_outbox: Store
) -> None:
    receiver = Receiver(expect=60)
    relay = Relay(bounced_outbox, receiver, listen=False, poll_interval=0.1, batch_size=25)
    assert relay.polling_only
    async with running(relay):
        keys = await enqueue(bounced_outbox, 60)
        await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)
        assert not relay.listening.is_set()
        assert await listeners(pg_dsn, relay.outbox.channel) == 0  # not even on a pooled server
    assert len(receiver.delivered) == 60 and set(receiver.delivered.values()) == {1}
    parents = await bounced_outbox.pool.fetch(
        f'SELECT parent_key, state FROM "{bounced_outbox.schema}".outbox'
    )
    assert {r["parent_key"]: r["state"] for r in parents} == {k: "sent" for k in keys}
    assert relay.stats.delivered == 60 and relay.listen_failure is None


async def test_a_relay_behind_pgbouncer_is_woken_through_its_direct_listen_dsn(
    pg_dsn: str, bounced_outbox: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="grpc_idempotency.outbox")
    receiver = Receiver(expect=20)
    relay = Relay(bounced_outbox, receiver, listen_dsn=pg_dsn, poll_interval=60)
    assert not relay.polling_only
    async with running(relay):
        await asyncio.wait_for(relay.listening.wait(), WAIT_S)

        async def idle() -> bool:  # its first batch (after LISTEN) is done: now it sleeps 60 s
            return relay.stats.batches >= 1

        await until("the relay's first batch", idle, timeout=WAIT_S)
        enqueued = time.monotonic()
        await enqueue(bounced_outbox, 20)  # committed through PgBouncer; NOTIFY at commit
        await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)
        assert time.monotonic() - enqueued < 5.0  # woken, not polled (60 s)
        assert relay.listening.is_set() and relay.listen_failure is None
        # Its check of listen_dsn: a NOTIFY sent through PgBouncer reached the direct session.
        await until("the listen_dsn check", lambda: "reaches the store's database" in caplog.text)
    assert len(receiver.delivered) == 20 and set(receiver.delivered.values()) == {1}
    assert "did not reach" not in caplog.text


async def test_a_relay_listening_through_pgbouncer_notices_and_falls_back_to_polling(
    pg_dsn: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """LISTEN on the store's pool, through PgBouncer: it lands on one of the two server
    connections and stays there. With that one held by another client, the relay's check runs
    on the other, finds no LISTEN, and the relay says so and goes on by polling."""
    schema = "pgb_" + uuid.uuid4().hex[:12]
    caplog.set_level(logging.WARNING, logger="grpc_idempotency.outbox")
    with running_pgbouncer(pg_dsn, pool_size=2) as small:
        outbox = await Store.connect(
            small.dsn, schema=schema, min_size=1, max_size=3, migrate=True, **POOL_OPTIONS
        )
        clients = [await asyncpg.connect(small.dsn, **POOL_OPTIONS) for _ in range(2)]
        receiver = Receiver(expect=10)
        relay = Relay(outbox, receiver, poll_interval=1.0)
        channel = relay.outbox.channel
        try:
            async with running(relay):
                await asyncio.wait_for(relay.listening.wait(), WAIT_S)
                # Both server connections, one each: which one holds the relay's LISTEN?
                held = [c.transaction() for c in clients]
                for tx in held:
                    await tx.start()
                on_it = [await c.fetchval(LISTENS, channel) for c in clients]
                assert sorted(on_it) == [False, True], on_it
                keep = held[on_it.index(True)]
                await held[on_it.index(False)].rollback()  # the relay's check runs there

                async def gave_up() -> bool:
                    return relay.polling_only

                await until(
                    "the relay to notice its LISTEN is not on its session", gave_up, timeout=WAIT_S
                )
                assert not relay.listening.is_set()
                await keep.rollback()
                await enqueue(outbox, 10)
                await asyncio.wait_for(receiver.all_in.wait(), WAIT_S)  # polled
        finally:
            for c in clients:
                await c.close()
            await outbox.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
            await outbox.close()
    assert "did not hold on its session" in (relay.listen_failure or "")
    assert "polling every 1s from now on" in caplog.text and "--listen-dsn" in caplog.text
    assert set(receiver.delivered.values()) == {1} and len(receiver.delivered) == 10


async def test_a_listen_dsn_through_pgbouncer_gets_the_poolers_warning_not_another_database(
    pg_dsn: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """listen_dsn through PgBouncer (the store direct): its LISTEN lands on one of the two server
    connections, which the test then holds, so the relay's NOTIFY is dropped there and its
    listen_dsn check's probe of the session runs on the other, which does not listen. The
    verdict is the pooler's at once, never "likely another database"."""
    caplog.set_level(logging.WARNING, logger="grpc_idempotency.outbox")
    with running_pgbouncer(pg_dsn, pool_size=2) as small:
        clients = [await asyncpg.connect(small.dsn, **POOL_OPTIONS) for _ in range(2)]
        try:
            held = [c.transaction() for c in clients]
            await held[0].start()  # one server connection busy: LISTEN goes to the other
            listening = asyncio.Event()
            relay = Relay(
                store,
                Receiver(expect=1),
                listen_dsn=small.dsn,
                poll_interval=3.0,  # the check waits 3 s for its NOTIFY: time to hold its server
                on_listening=listening.set,
            )
            async with running(relay):
                await asyncio.wait_for(listening.wait(), WAIT_S)
                await held[1].start()  # the LISTEN's server connection, from the other client
                assert await clients[1].fetchval(LISTENS, relay.outbox.channel)
                await held[0].rollback()  # the probe runs on this one

                async def gave_up() -> bool:
                    return relay.polling_only

                await until("the pooler's verdict", gave_up, timeout=WAIT_S)
                # Given up at once, its LISTEN session let go: not kept a poll_interval longer.
                assert not relay.listening.is_set()
                await held[1].rollback()
        finally:
            for c in clients:
                await c.close()
    assert "listen_dsn goes through a pooler" in (relay.listen_failure or "")
    assert "did not reach" not in caplog.text


async def test_a_lone_client_behind_pgbouncer_is_warned_of_by_the_relays_notify_round_trip(
    pg_dsn: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """PgBouncer with one server connection: every client gets the one holding the relay's
    LISTEN, so asked, the session listens; the NOTIFY a commit sends there reaches the client
    holding it then (the sender), never the relay. Its periodic NOTIFY round trip (no start-up
    check without listen_dsn) warns, once, naming the pooler; the relay goes on listening and
    polling. Direct, the same round trip is heard and says nothing."""
    schema = "pgb_" + uuid.uuid4().hex[:12]
    caplog.set_level(logging.DEBUG, logger="grpc_idempotency.outbox")
    unheard = "did not reach its LISTEN session"
    with running_pgbouncer(pg_dsn, pool_size=1) as lone:
        outbox = await Store.connect(
            lone.dsn, schema=schema, min_size=1, max_size=2, migrate=True, **POOL_OPTIONS
        )
        direct = await Store.connect(pg_dsn, schema=schema, min_size=1, max_size=2)
        try:
            relay = Relay(outbox, Receiver(expect=1), poll_interval=0.05, name="lone")
            async with running(relay):
                await until("the round trip's warning", lambda: unheard in caplog.text, WAIT_S)
                first = relay._check_token

                def unheard_again() -> bool:  # the next round trip, unheard too: no warning
                    latest = relay._check_token
                    return (
                        latest != first
                        and relay._unheard is not None
                        and relay._unheard[0] == latest
                    )

                await until("a second round trip, unheard", unheard_again, WAIT_S)
                assert relay.listening.is_set() and relay.listen_failure is None
            assert caplog.text.count(unheard) == 1, caplog.text
            assert "relay lone: a NOTIFY sent through the store's pool" in caplog.text
            assert "pooler in transaction mode (PgBouncer?)" in caplog.text

            caplog.clear()
            listening: list[float] = []
            relay = Relay(
                direct,
                Receiver(expect=1),
                poll_interval=0.05,
                name="direct",
                on_listening=lambda: listening.append(time.time()),
            )
            async with running(relay):
                heard = "relay direct: its LISTEN session hears the store's NOTIFY"
                await until("the direct relay's round trip", lambda: heard in caplog.text, WAIT_S)
            assert "did not reach" not in caplog.text and relay._unheard is None
            # Every 6th poll_interval, not at every one (each waits for its NOTIFY).
            heard_at = next(r.created for r in caplog.records if r.getMessage() == heard)
            assert heard_at - listening[0] >= 5 * 0.05, heard_at - listening[0]
        finally:
            await direct.close()
            await outbox.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
            await outbox.close()


async def test_the_relay_command_runs_behind_pgbouncer(
    bounced_outbox: Store, store: Store, bouncer: PgBouncer
) -> None:
    """``grpc-idempotency relay --statement-cache-size 0 --no-listen`` through PgBouncer,
    delivering to a keyed gRPC receiver: every row, once."""
    async with running_ledger(store) as receiver:  # the receiver's own store: direct
        accounts = [f"cli-{uuid.uuid4().hex}" for _ in range(10)]
        await bounced_outbox.pool.execute(
            f"""INSERT INTO "{bounced_outbox.schema}".outbox
                    (scope, key, step, parent_key, method, payload_type, payload)
                SELECT 'tenant:tenant-a', a, 'entry-posted.v1', a, '/x.Y/Z',
                       'testsvc.v1.PostRequest', p
                FROM unnest($1::text[], $2::bytea[]) AS t(a, p)""",
            accounts,
            [testsvc_pb2.PostRequest(account=a, amount=3).SerializeToString() for a in accounts],
        )
        args = [
            sys.executable, "-m", "grpc_idempotency.cli", "relay",
            "--dsn", bouncer.dsn, "--schema", bounced_outbox.schema,
            "--statement-cache-size", "0", "--no-listen", "--poll-interval", "0.1",
            "--grpc-target", receiver.address, "--method", "/testsvc.v1.LedgerService/Post",
            "--scope-header", "x-tenant-id", "--name", "cli-relay",
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            seen: list[str] = []  # its log lines (stderr) come first
            while not (seen and seen[-1].startswith("relay cli-relay ready")):
                line = await asyncio.wait_for(proc.stdout.readline(), WAIT_S)
                assert line, f"the relay command ended before it was ready: {seen}"
                seen.append(line.decode())
            assert seen[-1].startswith("relay cli-relay ready: polling every 0.1s,"), seen

            async def all_sent() -> bool:
                n: int = await store.pool.fetchval(
                    f"""SELECT count(*) FROM "{bounced_outbox.schema}".outbox
                        WHERE state = 'sent'"""
                )
                return n == len(accounts)

            await until("the relay command to deliver every row", all_sent, timeout=WAIT_S)
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), WAIT_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, out.decode()
        assert "stopped: delivered 10," in out.decode(), out.decode()
        for account in accounts:
            assert await ledger_rows(store, account) == 1


def test_relay_wake_up_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="listen_dsn"):
        Relay(object(), object(), listen=False, listen_dsn="postgresql://x")  # type: ignore[arg-type]
    with pytest.raises(SystemExit) as exited:
        cli.main(
            [
                "relay", "--dsn", "postgresql://x", "--grpc-target", "x:1", "--method", "/a.B/C",
                "--no-listen", "--listen-dsn", "postgresql://y",
            ]
        )  # fmt: skip
    assert exited.value.code == 2
    assert "--listen-dsn: not allowed with argument --no-listen" in capsys.readouterr().err
