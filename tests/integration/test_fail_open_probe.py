"""The check a fail-open method makes before running unclaimed on a client-side timeout
(``Store.answers``, a fresh connection's ``SELECT 1``), under the ways it was found to fail:

- callers share one probe, and it ran on the first caller's budget: a call with a few
  milliseconds left made every call joining it take a live database for a dead one;
- it took all of a short deadline's time left, so a real partition no longer failed open;
- a custom ``connect=`` raising, or taking the pool's keyword arguments, leaked UNKNOWN with
  Python's text (or could never answer);
- ``Store.close()`` during a probe left the call without a status;
- behind PgBouncer the probe queued behind other clients blocked on the lock: ``probe_dsn``
  sends it to the database itself;
- PgBouncer's own error for a client that waited past ``query_wait_timeout`` (08P01, a busy
  pool) was taken for a certain outage, with no probe at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import DsnUnusable, Store, StoreMisconfigured
from grpc_idempotency.store.postgres import PROBE_S
from tests.support.blackhole import BlackholeProxy
from tests.support.ledger import RunningLedger, fresh, prepare, records_locked, running_ledger
from tests.support.pgbouncer import running_pgbouncer
from tests.support.waiting import until

FAIL_OPEN = "/testsvc.v1.LedgerService/PostFailOpen"


def post(account: str) -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=1)


async def lock_waiters(db: asyncpg.Connection, count: int) -> None:
    """Returns once ``count`` sessions wait on a lock (PostgreSQL's own view of it; there is
    no event to wait on in another process)."""
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    async with asyncio.timeout(10):
        while await db.fetchval(waiting) < count:  # noqa: ASYNC110 (polls the server's state)
            await asyncio.sleep(0.01)


def schema() -> str:
    return f"probe_{uuid.uuid4().hex[:8]}"


async def migrated(dsn: str) -> str:
    """A new schema, migrated with the default command_timeout: the tests' 1 s is for the
    calls, and on a loaded CI machine a migration ran past it (StoreUnavailable at set-up)."""
    name = schema()
    await (await Store.connect(dsn, schema=name, migrate=True)).close()
    return name


@contextlib.asynccontextmanager
async def completed_then_locked(
    ledger: RunningLedger, db: asyncpg.Connection, schema: str
) -> AsyncIterator[str]:
    """A FAIL_OPEN call completed under a fresh key, then the records table locked by another
    session: yields the key."""
    key = fresh()
    done = await ledger.call(FAIL_OPEN, post("acct"), key)
    assert done.code is grpc.StatusCode.OK
    async with records_locked(db, schema):
        yield key


async def test_callers_sharing_a_probe_each_get_its_answer(
    pg_dsn: str, db: asyncpg.Connection
) -> None:
    store = await Store.connect(pg_dsn, schema=await migrated(pg_dsn), command_timeout=1)
    try:
        async with records_locked(db, store.schema):
            short, long_ = await asyncio.gather(store.answers(0.001), store.answers(2.0))
    finally:
        await store.close()
    assert not short  # its own wait ran out
    assert long_  # the shared probe ran on its own budget, not the first caller's


async def test_a_partition_fails_open_with_a_deadline_just_past_command_timeout(
    pg_dsn: str,
) -> None:
    """1 s of command_timeout, then a probe of half the 1.5 s left: the handler runs."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    store = await Store.connect(
        proxy.dsn, min_size=1, max_size=2, command_timeout=1, schema=await migrated(pg_dsn)
    )
    await prepare(store)
    try:
        async with running_ledger(store) as ledger:
            proxy.blackhole()
            answer = await ledger.call(FAIL_OPEN, post(fresh("a")), fresh(), timeout=2.5)
            assert answer.code is grpc.StatusCode.OK, answer
            assert ledger.service.executions == 1
    finally:
        store.pool.terminate()
        await proxy.close()


@contextlib.asynccontextmanager
async def _custom_connect_store(pg_dsn: str, connect: Any) -> AsyncIterator[Store]:
    """A store whose pool opens connections with ``connect``: a 1 s command_timeout (the probe's
    case), but 10 s to connect (a loaded CI machine took longer than 1 s)."""
    store = await Store.connect(
        pg_dsn,
        schema=await migrated(pg_dsn),
        max_size=2,
        command_timeout=1,
        connect=connect,
        timeout=10,
    )
    await prepare(store)
    try:
        yield store
    finally:
        await store.close()


async def test_a_custom_connect_failing_in_the_probe_is_no_answer(
    pg_dsn: str, db: asyncpg.Connection
) -> None:
    broken = False

    async def connect(*args: Any, **kwargs: Any) -> Any:  # e.g. fetches a token first
        if broken:
            raise RuntimeError("token service unreachable")
        return await asyncpg.connect(*args, **kwargs)

    async with (
        _custom_connect_store(pg_dsn, connect) as store,
        running_ledger(store, replay_cache=False) as ledger,
    ):
        broken = True
        async with records_locked(db, store.schema):
            answer = await ledger.call(FAIL_OPEN, post(fresh("a")), fresh(), timeout=None)
    assert answer.code is not grpc.StatusCode.UNKNOWN, answer
    assert "token" not in (answer.details or "")


async def test_a_custom_connect_is_called_as_the_pool_calls_it(
    pg_dsn: str, db: asyncpg.Connection
) -> None:
    async def connect(
        dsn: str, *, loop: Any, connection_class: Any, record_class: Any, **kwargs: Any
    ) -> Any:
        return await asyncpg.connect(
            dsn, connection_class=connection_class, record_class=record_class, **kwargs
        )

    async with (
        _custom_connect_store(pg_dsn, connect) as store,
        running_ledger(store, replay_cache=False) as ledger,
        completed_then_locked(ledger, db, store.schema) as key,
    ):
        again = await ledger.call(FAIL_OPEN, post("acct"), key, timeout=None)
    assert again.code is grpc.StatusCode.UNAVAILABLE, again
    assert ledger.service.executions == 1


async def test_closing_the_store_during_a_probe_still_answers_the_call(pg_dsn: str) -> None:
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    store = await Store.connect(
        proxy.dsn, min_size=1, max_size=2, command_timeout=1, schema=await migrated(pg_dsn)
    )
    await prepare(store)
    probing = asyncio.Event()
    answers = store.answers

    async def watched(timeout: float | None = None) -> bool:
        probing.set()
        return await answers(timeout)

    store.answers = watched  # type: ignore[method-assign]
    try:
        async with running_ledger(store) as ledger:
            proxy.blackhole()
            call = asyncio.ensure_future(
                ledger.call(FAIL_OPEN, post(fresh("a")), fresh(), timeout=None)
            )
            await asyncio.wait_for(probing.wait(), 10)
            await asyncio.sleep(0)  # into the shared probe
            await store.close(timeout=0.5)
            answer = await asyncio.wait_for(call, 10)  # it hung without a status
    finally:
        store.pool.terminate()
        await proxy.close()
    assert answer.code is not None
    assert answer.code is not grpc.StatusCode.UNKNOWN, answer


async def test_probe_dsn_is_where_the_probe_connects(pg_dsn: str, db: asyncpg.Connection) -> None:
    closed_port = "postgresql://postgres@127.0.0.1:1/postgres"
    store = await Store.connect(pg_dsn, schema=schema(), migrate=True, probe_dsn=closed_port)
    try:
        assert not await store.answers(2.0)
    finally:
        await store.close()


@pytest.mark.parametrize(
    "probe_dsn",
    [
        "postgresql://user:qqq/www@127.0.0.1:5432/db",  # an unencoded / in the password
        "postgresql://user:qqqwww@127.0.0.1:5432/db?sslmode=qqq",
        "postgresql://user:qqq@www@127.0.0.1:5432/db",  # an unencoded @
    ],
)
async def test_a_probe_dsn_the_driver_cannot_use_is_refused_at_connect_unquoted(
    pg_dsn: str, probe_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """It was accepted: every probe then failed, so every ambiguous outage (a table locked past
    the call's statements) let fail-open methods run unclaimed, and each probe logged the
    driver's text, a piece of the password in it (ValueError("invalid literal for int() with
    base 10: 'qqq'"))."""
    with (
        caplog.at_level(logging.DEBUG, logger="grpc_idempotency"),
        pytest.raises(DsnUnusable, match="probe_dsn") as raised,
    ):
        await Store.connect(pg_dsn, probe_dsn=probe_dsn, check_schema=False)
    assert "qqq" not in str(raised.value)
    # Not named by the store's own database, as Store.connect's other errors are: that is not
    # the DSN refused here, and would read as if it were.
    assert "schema grpc_idempotency]" not in str(raised.value), raised.value
    assert "qqq" not in caplog.text


async def test_a_probe_dsn_its_server_refuses_is_refused_at_connect(pg_dsn: str) -> None:
    """The server answers, and refuses the session (a database that does not exist): every
    probe failed the same, so every ambiguous outage let fail-open methods run unclaimed, as
    with a DSN the driver cannot parse; the vetting at connect only logged that the probe "does
    not answer now". The store's own DSN refused so is StoreMisconfigured at connect; so is
    this one."""
    probe_dsn = urlsplit(pg_dsn)._replace(path="/no_such_database_here").geturl()
    with pytest.raises(StoreMisconfigured, match="3D000"):
        await Store.connect(pg_dsn, probe_dsn=probe_dsn, check_schema=False)


async def test_behind_pgbouncer_a_direct_probe_keeps_a_locked_table_closed(
    pg_dsn: str, db: asyncpg.Connection
) -> None:
    """Another client of the same PgBouncer blocks on the migration's lock and holds its one
    server connection: a probe through the pooler queues behind it. Sent to the database itself
    (``probe_dsn``), it is answered, and the completed key is not run again."""
    with running_pgbouncer(pg_dsn, pool_size=1) as bouncer:
        store = await Store.connect(
            bouncer.dsn,
            schema=await migrated(pg_dsn),
            min_size=1,
            max_size=2,
            command_timeout=1,
            statement_cache_size=0,
            probe_dsn=pg_dsn,
        )
        await prepare(store)
        others = [await asyncpg.connect(bouncer.dsn, statement_cache_size=0)]
        try:
            async with running_ledger(store, replay_cache=False) as ledger:
                async with completed_then_locked(ledger, db, store.schema) as key:
                    blocked = [
                        asyncio.ensure_future(
                            other.fetchval(f'SELECT count(*) FROM "{store.schema}".records')
                        )
                        for other in others
                    ]
                    await lock_waiters(db, len(others))  # the pooler's server connection held
                    again = await ledger.call(FAIL_OPEN, post("acct"), key, timeout=None)
                await asyncio.gather(*blocked, return_exceptions=True)
        finally:
            for other in others:
                await other.close()
            await store.close()
    assert again.code is grpc.StatusCode.UNAVAILABLE, again
    assert ledger.service.executions == 1


async def test_the_probes_connect_is_bounded_by_the_probes_budget_not_the_pools(
    pg_dsn: str,
) -> None:
    """The pool's connects are bounded by its command_timeout (``timeout``, 1 s here); the
    probe's used that bound too, so a live database slower than that to accept a connection
    (CI's loaded machine, in test_fail_open_locked_table) read as down, and a completed key's
    handler ran again, unclaimed. The probe's budget bounds its connect: the connect's own
    timeout lies past it, so that the budget alone decides."""
    timeouts: list[float] = []

    async def connect(dsn: str, **kwargs: Any) -> Any:
        timeouts.append(kwargs["timeout"])
        return await asyncpg.connect(dsn, **{k: v for k, v in kwargs.items() if k != "loop"})

    store = await Store.connect(
        pg_dsn, schema=await migrated(pg_dsn), max_size=2, command_timeout=1, connect=connect
    )
    try:
        assert timeouts and set(timeouts) == {1}  # the pool's own connects
        timeouts.clear()
        assert await store.answers(1.5)
    finally:
        await store.close()
    [probes] = timeouts
    assert probes > PROBE_S


async def test_probe_timeout_is_how_long_a_live_database_may_take_to_answer(pg_dsn: str) -> None:
    """A live database that takes longer than the default 2 s to accept a connection (a
    saturated host) read as down, and a fail-open method ran a completed key again, unclaimed:
    ``probe_timeout`` is the operator's bound. The same slow database, probed by two stores at
    once: the default budget gives up on it, a budget of 10 s gets its answer; the connect's
    own timeout lies past each budget."""
    slow_s = PROBE_S + 0.5
    timeouts: list[float] = []
    probing = False

    async def connect(dsn: str, **kwargs: Any) -> Any:
        if probing:  # the pools' own connects are not slowed
            timeouts.append(kwargs["timeout"])
            await asyncio.sleep(slow_s)  # stands for a slow accept: the outcome needs no race
        return await asyncpg.connect(dsn, **{k: v for k, v in kwargs.items() if k != "loop"})

    name = await migrated(pg_dsn)
    default = await Store.connect(pg_dsn, schema=name, max_size=2, connect=connect)
    patient = await Store.connect(
        pg_dsn, schema=name, max_size=2, connect=connect, probe_timeout=10
    )
    try:
        probing = True
        started = asyncio.get_running_loop().time()
        impatient, answered = await asyncio.wait_for(
            asyncio.gather(default.answers(), patient.answers()), 30
        )
        took = asyncio.get_running_loop().time() - started
    finally:
        await default.close()
        await patient.close()
    assert not impatient
    assert answered
    assert took >= slow_s
    assert sorted(timeouts) == [PROBE_S + 1, 11]


async def test_probe_dsn_is_vetted_within_probe_timeout(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``Store.connect`` connects to ``probe_dsn`` once (``vet_dsn``): bounded by the probe's
    own budget, as every probe is, its connect's timeout past it, not by the default 2 s nor
    the pool's connect timeout. Here the database takes longer than ``probe_timeout`` to accept
    (far less than 2 s): not answered now, which is said, and the store opens all the same."""
    timeouts: list[float] = []

    async def connect(dsn: str, **kwargs: Any) -> Any:
        # The only connect: min_size=0 and no schema check open none of the pool's.
        timeouts.append(kwargs["timeout"])
        await asyncio.sleep(1)  # past the 0.1 s budget: its timer fires first, whatever the load
        return await asyncpg.connect(dsn, **{k: v for k, v in kwargs.items() if k != "loop"})

    with caplog.at_level(logging.WARNING, logger="grpc_idempotency.store"):
        store = await Store.connect(
            pg_dsn,
            min_size=0,
            check_schema=False,
            connect=connect,
            probe_dsn=pg_dsn,
            probe_timeout=0.1,
        )
    await store.close()
    assert timeouts == [pytest.approx(1.1)]  # the budget and the probe's slack, not 30 s
    assert "probe_dsn does not answer now" in caplog.text


async def test_a_call_waits_for_the_stores_probe_timeout_not_the_default(
    pg_dsn: str, db: asyncpg.Connection
) -> None:
    """The interceptor capped its wait for the probe at the default 2 s, whatever the store's
    budget: a slow but live database still read as down, and the completed key ran again. So
    for a call with a deadline (half its time left is the cap): a new key's call, at the same
    time (it shares the probe), would run unclaimed."""
    probing = False

    async def connect(dsn: str, **kwargs: Any) -> Any:
        if probing:
            await asyncio.sleep(PROBE_S + 0.5)  # a saturated host, slow to accept
        return await asyncpg.connect(dsn, **{k: v for k, v in kwargs.items() if k != "loop"})

    store = await Store.connect(
        pg_dsn,
        schema=await migrated(pg_dsn),
        max_size=2,
        command_timeout=1,
        connect=connect,
        probe_timeout=10,
    )
    await prepare(store)
    try:
        async with (
            running_ledger(store, replay_cache=False) as ledger,
            completed_then_locked(ledger, db, store.schema) as key,
        ):
            probing = True
            again, other = await asyncio.gather(
                ledger.call(FAIL_OPEN, post("acct"), key, timeout=None),
                ledger.call(FAIL_OPEN, post("acct"), fresh(), timeout=30),
            )
    finally:
        await store.close()
    for answer in (again, other):
        assert answer.code is grpc.StatusCode.UNAVAILABLE, answer
    assert ledger.service.executions == 1


async def test_a_partition_met_by_a_new_connection_fails_open_within_command_timeout(
    pg_dsn: str, db: asyncpg.Connection
) -> None:
    """The pool has no connection open when the partition starts: the call's connect hung in
    the handshake until the call's deadline (asyncpg's connect timeout is 60 s), so the call
    answered DEADLINE_EXCEEDED and a fail-open method never ran. ``command_timeout`` bounds a
    connect too, as it bounds a statement: the call fails open after it (and the probe)."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    name = f"new-conn-{uuid.uuid4().hex[:8]}"
    # Migrated first with the default timeout: a fresh schema's migrations under CI load ran
    # past this test's 1 s command_timeout, which is for the partition below.
    in_schema = schema()
    await (await Store.connect(pg_dsn, schema=in_schema, migrate=True)).close()
    store = await Store.connect(
        proxy.dsn,
        min_size=0,
        max_size=2,
        command_timeout=1,
        schema=in_schema,
        server_settings={"application_name": name},
    )
    await prepare(store)
    # The pool's connections end (a database restart would do the same): the call must open one.
    await db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", name
    )
    await until("the pool sees them closed", lambda: _all_closed(store))
    try:
        async with running_ledger(store) as ledger:
            proxy.blackhole()
            began = time.monotonic()
            answer = await ledger.call(FAIL_OPEN, post(fresh("a")), fresh(), timeout=20)
            took = time.monotonic() - began
    finally:
        store.pool.terminate()
        await proxy.close()
    assert answer.code is grpc.StatusCode.OK, answer
    assert ledger.service.executions == 1
    assert took < 10, took  # 1 s connect + at most 2 s of probe, far from the 20 s deadline


def _all_closed(store: Store) -> bool:
    # asyncpg has no public view of a pool's connections (nor its stubs of the private one)
    holders = store.pool._holders  # type: ignore[attr-defined]
    return all(h._con is None or h._con.is_closed() for h in holders)


async def test_behind_pgbouncer_a_query_wait_timeout_is_confirmed_before_failing_open(
    pg_dsn: str,
) -> None:
    """PgBouncer's pool is busy (its one server connection held by another client's
    transaction) past its ``query_wait_timeout``: PgBouncer ends the waiting client's
    connection with its own error, SQLSTATE 08P01, as it does for every failure of its own.
    That was taken for a certain outage, and a fail-open method ran a completed key again,
    unclaimed, with the database up and holding its outcome. A pooler's 08P01 says nothing
    certain of the database: the outage is confirmed first (``probe_dsn``: the database
    answers), and the call is UNAVAILABLE."""
    settings = {"query_wait_timeout": "1"}
    # Migrated on the database itself: through PgBouncer's one server connection, the
    # migrations and the pool's first connection queued for it past query_wait_timeout under CI
    # load (08P01 at start-up, before the test began).
    in_schema = schema()
    await (await Store.connect(pg_dsn, schema=in_schema, migrate=True)).close()
    with running_pgbouncer(pg_dsn, pool_size=1, settings=settings) as bouncer:
        store = await Store.connect(
            bouncer.dsn,
            schema=in_schema,
            min_size=1,
            max_size=2,
            statement_cache_size=0,
            probe_dsn=pg_dsn,
        )
        await prepare(store)
        holder = await asyncpg.connect(bouncer.dsn, statement_cache_size=0)
        try:
            async with running_ledger(store, replay_cache=False) as ledger:
                key = fresh()
                done = await ledger.call(FAIL_OPEN, post("acct"), key)
                assert done.code is grpc.StatusCode.OK, done.details
                # The pool's only server connection, pinned by a transaction left open.
                await holder.execute("BEGIN")
                await holder.fetchval("SELECT 1")
                again = await ledger.call(FAIL_OPEN, post("acct"), key, timeout=None)
        finally:
            await holder.close()
            await store.close()
    assert again.code is grpc.StatusCode.UNAVAILABLE, again
    assert again.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
    assert ledger.service.executions == 1
