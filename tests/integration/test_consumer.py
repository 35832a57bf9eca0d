"""The idempotent consumer on a real PostgreSQL: the effect and the mark of its message id commit
together, duplicates are acknowledged without effect, concurrent deliveries of one id run it once,
marks expire and are purged in batches, and database failures surface as StoreUnavailable."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import asyncpg
import grpc
import pytest

from grpc_idempotency import (
    KEY_HEADER,
    HandlerDatabaseError,
    KeyInvalid,
    KeyReused,
    Store,
    StoreUnavailable,
)
from grpc_idempotency.consumer import (
    Consumed,
    ConsumeResult,
    IdempotentConsumer,
    MessageInProgress,
    purge_processed,
)
from grpc_idempotency.store.consumer_store import MarkBusy, ProcessedMessages
from grpc_idempotency.store.postgres import ROLLBACK_TIMEOUT_S
from grpc_idempotency.store.sql import text_literal
from tests.integration.test_consumer_telemetry import _counts
from tests.integration.test_telemetry import _telemetry
from tests.support.blackhole import BlackholeProxy, store_behind_proxy
from tests.support.waiting import until
from tests.support.wire import call_raw

EFFECTS_SQL = """
CREATE SCHEMA IF NOT EXISTS consumer_test;
CREATE TABLE IF NOT EXISTS consumer_test.effects (
    id         bigserial PRIMARY KEY,
    consumer   text NOT NULL,
    message_id text NOT NULL,
    amount     bigint NOT NULL CHECK (amount >= 0)
);
CREATE TABLE IF NOT EXISTS consumer_test.checked_at_commit (
    message_id text CONSTRAINT checked_at_commit_once UNIQUE DEFERRABLE INITIALLY DEFERRED
);
"""
TABLE = "grpc_idempotency.processed_messages"
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
async def effects_table(store: Store) -> None:
    await store.pool.execute(EFFECTS_SQL)


@pytest.fixture
def consumer(store: Store, effects_table: None) -> IdempotentConsumer:
    return IdempotentConsumer(store, fresh("consumer"))


def fresh(prefix: str = "msg") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def write(consumer: IdempotentConsumer, message_id: str, amount: int = 1) -> Any:
    """An effect that records one row and returns its id."""

    async def effect(conn: Any) -> int:
        row_id: int = await conn.fetchval(
            "INSERT INTO consumer_test.effects (consumer, message_id, amount)"
            " VALUES ($1, $2, $3) RETURNING id",
            consumer.name,
            message_id,
            amount,
        )
        return row_id

    return effect


async def effect_rows(store: Store, consumer: IdempotentConsumer, message_id: str) -> int:
    count: int = await store.pool.fetchval(
        "SELECT count(*) FROM consumer_test.effects WHERE consumer = $1 AND message_id = $2",
        consumer.name,
        message_id,
    )
    return count


async def marks(store: Store, consumer: str) -> list[str]:
    rows = await store.pool.fetch(
        f"SELECT message_id FROM {TABLE} WHERE consumer = $1 ORDER BY message_id", consumer
    )
    return [r["message_id"] for r in rows]


async def waiting_on_a_lock(store: Store, timeout: float = 5.0) -> None:
    """Until some backend of the store waits on a lock (a duplicate blocked on the mark)."""

    async def waiting() -> int:
        count: int = await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%INSERT INTO %processed_messages%'"
        )
        return count

    await until("a delivery to wait on the marked row", waiting, timeout=timeout)


class Gate:
    """An effect that writes, then holds its transaction open until released."""

    def __init__(self, consumer: IdempotentConsumer, message_id: str) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.fail = False
        self.runs = 0
        self._write = write(consumer, message_id)

    async def __call__(self, conn: Any) -> int:
        self.runs += 1
        row_id: int = await self._write(conn)
        self.entered.set()
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the effect failed after writing")
        return row_id


async def held(
    consumer: IdempotentConsumer, message_id: str, *, fail: bool = False
) -> tuple[Gate, asyncio.Task[ConsumeResult[int]]]:
    """A delivery of ``message_id`` whose effect has written and now holds its transaction open
    until ``gate.release`` is set (then raises if ``fail``)."""
    gate = Gate(consumer, message_id)
    gate.fail = fail
    delivery = asyncio.create_task(consumer.process(message_id, gate))
    await gate.entered.wait()
    return gate, delivery


# --- one delivery at a time --------------------------------------------------------------------


async def test_a_new_message_runs_the_effect_and_a_repeat_is_a_duplicate(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()
    first = await consumer.process(message_id, write(consumer, message_id))
    assert first.outcome is Consumed.PROCESSED and not first.duplicate
    assert isinstance(first.value, int)
    assert await consumer.is_processed(message_id)

    ran: list[str] = []

    async def must_not_run(conn: Any) -> None:
        ran.append(message_id)

    again = await consumer.process(message_id, must_not_run)
    assert again == ConsumeResult(message_id, Consumed.DUPLICATE, None)
    assert again.duplicate and ran == []
    assert await effect_rows(store, consumer, message_id) == 1
    assert await marks(store, consumer.name) == [message_id]


async def test_the_mark_expires_after_the_retention(
    store: Store, consumer: IdempotentConsumer
) -> None:
    retention = timedelta(days=3)
    consumer = IdempotentConsumer(store, consumer.name, retention=retention)
    message_id = fresh()
    await consumer.process(message_id, write(consumer, message_id))
    lifetime = await store.pool.fetchval(
        f"SELECT expires_at - processed_at FROM {TABLE} WHERE consumer = $1 AND message_id = $2",
        consumer.name,
        message_id,
    )
    assert abs(lifetime - retention) < timedelta(seconds=1)


async def test_an_effect_slower_than_the_retention_commits_a_live_mark(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """Retention counts from the commit. It counted from the mark, made before the effect ran:
    an effect slower than the retention committed a mark that had already expired, and the
    very next redelivery ran the effect again."""
    retention = timedelta(seconds=2)
    consumer = IdempotentConsumer(store, consumer.name, retention=retention)
    message_id = fresh()
    seen_expired: list[Any] = []

    async def slow(conn: Any) -> int:
        # Runs until the database's clock is past the mark as first written (visible to the
        # effect's own transaction only).
        async def expired() -> Any:
            return await conn.fetchval(
                f"SELECT clock_timestamp() FROM {TABLE}"
                " WHERE consumer = $1 AND message_id = $2 AND expires_at <= clock_timestamp()",
                consumer.name,
                message_id,
            )

        seen_expired.append(await until("the first mark to expire", expired))
        written: int = await write(consumer, message_id)(conn)
        return written

    first = await consumer.process(message_id, slow)
    assert first.outcome is Consumed.PROCESSED
    row = cast(
        "asyncpg.Record",
        await store.pool.fetchrow(
            f"SELECT processed_at, expires_at FROM {TABLE} WHERE consumer = $1 AND message_id = $2",
            consumer.name,
            message_id,
        ),
    )  # not None: the call wrote it
    assert row["processed_at"] > seen_expired[0]
    # Two clock_timestamp() reads in one UPDATE: microseconds apart.
    assert abs(row["expires_at"] - row["processed_at"] - retention) < timedelta(milliseconds=10)
    assert await consumer.is_processed(message_id)
    again = await consumer.process(message_id, write(consumer, message_id))
    assert again.outcome is Consumed.DUPLICATE
    assert await effect_rows(store, consumer, message_id) == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"consumer": "c\x00"},
        {"batch_size": 2**63},
        # A TypeError of len() or of the pattern; a str batch size's of a comparison, and a
        # float one was sent as the LIMIT.
        {"consumer": b"ledger"},
        {"consumer": 5},
        {"batch_size": "5"},
        {"batch_size": 1.5},
        {"max_batches": "2"},
    ],
)
async def test_purging_with_arguments_postgresql_refuses_is_bad_input(
    store: Store, bad: dict[str, object]
) -> None:
    """They reached the database and came back as StoreUnavailable, an outage to retry."""
    with pytest.raises((KeyInvalid, ValueError, TypeError)):
        await purge_processed(store, **bad)  # type: ignore[arg-type]


async def test_a_failing_effect_rolls_back_its_writes_and_the_mark(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()

    async def fails(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        raise RuntimeError("downstream said no")

    with pytest.raises(RuntimeError, match="downstream said no"):
        await consumer.process(message_id, fails)
    assert await effect_rows(store, consumer, message_id) == 0
    assert not await consumer.is_processed(message_id)

    # The message was not acknowledged; its redelivery runs the effect.
    redelivered = await consumer.process(message_id, write(consumer, message_id))
    assert redelivered.outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == 1


async def test_an_effect_database_error_is_the_effects_own(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """A constraint the message violates is the message's problem (poison), not the store's: it
    propagates unchanged, for the caller to dead-letter it; nothing is marked."""
    message_id = fresh()
    with pytest.raises(asyncpg.CheckViolationError):
        await consumer.process(message_id, write(consumer, message_id, amount=-1))
    assert not await consumer.is_processed(message_id)
    assert await effect_rows(store, consumer, message_id) == 0


async def test_an_effect_that_catches_a_failed_statement_is_not_acknowledged(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """The caught error left the transaction aborted: PostgreSQL answers its COMMIT with
    ROLLBACK, not an error, and ``process`` used to return PROCESSED (acknowledge) with neither
    the effect nor the mark committed: the message was lost."""
    message_id = fresh()

    async def swallowing(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        with contextlib.suppress(asyncpg.CheckViolationError):
            await write(consumer, message_id, amount=-1)(conn)

    with pytest.raises(HandlerDatabaseError, match="aborted"):
        await consumer.process(message_id, swallowing)
    assert not await consumer.is_processed(message_id)
    assert await effect_rows(store, consumer, message_id) == 0
    # Redelivered, a fixed effect runs (its connection went back to the pool in good order).
    again = await consumer.process(message_id, write(consumer, message_id))
    assert again.outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == 1


async def test_a_constraint_checked_at_commit_is_the_effects_error_too(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """A constraint the effect violates fails only in the consumer's COMMIT when it is
    DEFERRABLE INITIALLY DEFERRED: still the message's problem, raised unchanged as when it
    fails at once, not ``StoreUnavailable`` (which says "retry later, the store is down")."""
    message_id = fresh()

    async def twice(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await conn.execute(
            "INSERT INTO consumer_test.checked_at_commit VALUES ($1), ($1)", message_id
        )

    with pytest.raises(asyncpg.UniqueViolationError):
        await consumer.process(message_id, twice)
    assert not await consumer.is_processed(message_id)
    assert await effect_rows(store, consumer, message_id) == 0


async def test_the_effect_may_nest_with_savepoints(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()

    async def nested(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await conn.execute("SAVEPOINT attempt")
        with pytest.raises(asyncpg.CheckViolationError):
            await write(consumer, message_id, amount=-5)(conn)
        await conn.execute("ROLLBACK TO SAVEPOINT attempt")

    assert (await consumer.process(message_id, nested)).outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == 1


async def test_an_effect_that_commits_by_itself_is_not_acknowledged(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()

    async def commits(conn: Any) -> None:
        await conn.execute("COMMIT")

    with pytest.raises(StoreUnavailable, match="ended the consumer's transaction"):
        await consumer.process(message_id, commits)


@pytest.mark.parametrize("marked", ["new", "expired"])
async def test_an_effect_that_rolls_back_and_begins_again_is_not_acknowledged(
    store: Store, consumer: IdempotentConsumer, marked: str
) -> None:
    """ROLLBACK; BEGIN (a helper "recovering" from an error) took the mark with the rollback,
    and the COMMIT then committed the new transaction: reported PROCESSED, and the next
    delivery ran the effect again. Over an expired mark the commit renewed it, so the message
    stayed marked without its effect."""
    message_id = fresh()
    if marked == "expired":
        await consumer.process(message_id, write(consumer, message_id))
        await store.pool.execute(
            f"UPDATE {TABLE} SET expires_at = clock_timestamp() - interval '1 second'"
            " WHERE consumer = $1 AND message_id = $2",
            consumer.name,
            message_id,
        )
    before = await effect_rows(store, consumer, message_id)

    async def recovers(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await conn.execute("ROLLBACK; BEGIN")
        await write(consumer, message_id)(conn)  # written in the effect's own transaction

    with pytest.raises(StoreUnavailable, match="ended the consumer's transaction"):
        await consumer.process(message_id, recovers)
    assert not await consumer.is_processed(message_id)
    assert await effect_rows(store, consumer, message_id) == before  # its writes rolled back
    again = await consumer.process(message_id, write(consumer, message_id))
    assert again.outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == before + 1


async def test_an_effect_that_writes_its_mark_inside_a_savepoint_is_acknowledged(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """A first version of the check above compared the mark row's xmin with the transaction's
    id: a row written inside a savepoint carries the savepoint's id, and a legitimate effect
    was told it had ended the transaction, its work rolled back."""
    message_id = fresh()

    async def touches_the_mark(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await conn.execute(
            f"SAVEPOINT s; UPDATE {TABLE} SET processed_at = clock_timestamp()"
            f" WHERE consumer = {text_literal(consumer.name)}"
            f" AND message_id = {text_literal(message_id)}; RELEASE SAVEPOINT s"
        )

    result = await consumer.process(message_id, touches_the_mark)
    assert result.outcome is Consumed.PROCESSED
    assert await consumer.is_processed(message_id)
    assert await effect_rows(store, consumer, message_id) == 1


async def test_an_effect_that_resets_its_settings_is_acknowledged(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """RESET ALL clears the mark's token (a transaction-local setting); the mark row written by
    this transaction still tells it is the mark's."""
    message_id = fresh()

    async def resets(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await conn.execute("RESET ALL")

    result = await consumer.process(message_id, resets)
    assert result.outcome is Consumed.PROCESSED and await consumer.is_processed(message_id)
    assert await effect_rows(store, consumer, message_id) == 1


async def test_an_effect_that_deletes_its_mark_is_not_acknowledged(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """Acknowledged with no mark, the redelivery ran the effect again."""
    message_id = fresh()

    async def deletes(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await conn.execute(
            f"DELETE FROM {TABLE} WHERE consumer = {text_literal(consumer.name)}"
            f" AND message_id = {text_literal(message_id)}"
        )

    with pytest.raises(StoreUnavailable, match="deleted its mark"):
        await consumer.process(message_id, deletes)
    assert not await consumer.is_processed(message_id)
    assert await effect_rows(store, consumer, message_id) == 0


async def test_an_effect_that_commits_and_begins_again_is_not_acknowledged(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()

    async def commits(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await conn.execute("COMMIT; BEGIN")
        await write(consumer, message_id)(conn)

    with pytest.raises(StoreUnavailable, match="ended the consumer's transaction"):
        await consumer.process(message_id, commits)
    # The mark committed with the first write (the effect's doing); the second rolled back.
    assert await effect_rows(store, consumer, message_id) == 1
    assert (await consumer.process(message_id, write(consumer, message_id))).duplicate


@pytest.mark.parametrize("message_id", ["$mark$", "a$mark$b$mark_$c", "$$"])
async def test_a_message_id_with_dollar_quotes_commits(
    store: Store, consumer: IdempotentConsumer, message_id: str
) -> None:
    """The commit's check is a dollar-quoted DO block holding the message id."""
    message_id += fresh()
    assert (await consumer.process(message_id, write(consumer, message_id))).outcome is (
        Consumed.PROCESSED
    )
    assert await consumer.is_processed(message_id)
    assert (await consumer.process(message_id, write(consumer, message_id))).duplicate


async def test_a_message_id_delivered_again_with_another_payload_is_refused(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """The same id under another payload (its key reused after the sender's retention, a sender's
    bug): answered DUPLICATE, the second message's effect (another order's ledger entry) was
    dropped without a word. Given the payload, the mark keeps its SHA-256 and the repeat is
    KeyReused (FAILED_PRECONDITION: a relay's GrpcSink parks it as a dead letter), nothing run."""
    message_id = fresh()
    first = await consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
    again = await consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
    assert (first.outcome, again.outcome) == (Consumed.PROCESSED, Consumed.DUPLICATE)
    with pytest.raises(KeyReused, match="another payload"):
        await consumer.process(message_id, write(consumer, message_id), payload=b"order-2")
    # Not given a payload, a delivery cannot tell: a duplicate, as before.
    assert (await consumer.process(message_id, write(consumer, message_id))).duplicate
    assert await effect_rows(store, consumer, message_id) == 1
    with pytest.raises(TypeError, match="payload must be bytes"):
        await consumer.process(fresh(), write(consumer, "x"), payload="order-1")  # type: ignore[arg-type]


async def test_a_mark_written_without_a_payload_compares_nothing(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """A mark with no digest (written by a delivery that gave no payload, or before migration
    0017) cannot tell another message from a repeat: a delivery given its payload is a
    duplicate, not refused as reused."""
    message_id = fresh()
    assert (
        await consumer.process(message_id, write(consumer, message_id))
    ).outcome is Consumed.PROCESSED
    again = await consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
    assert again.duplicate
    assert await effect_rows(store, consumer, message_id) == 1


async def test_an_expired_mark_taken_over_keeps_the_new_deliverys_payload(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """A mark past its retention is taken over by the next delivery of its id, another message:
    the mark then holds that message's digest (or none, given no payload), not the expired
    one's. Kept, the new message's own redelivery was refused as reused (a dead letter), and the
    old one's answered DUPLICATE."""
    message_id = fresh()
    await consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
    await expire(store, consumer, message_id)
    taken = await consumer.process(message_id, write(consumer, message_id), payload=b"order-2")
    assert taken.outcome is Consumed.PROCESSED
    assert (
        await consumer.process(message_id, write(consumer, message_id), payload=b"order-2")
    ).duplicate
    with pytest.raises(KeyReused):
        await consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
    # Taken over by a delivery without a payload: nothing is left to compare.
    await expire(store, consumer, message_id)
    assert (
        await consumer.process(message_id, write(consumer, message_id))
    ).outcome is Consumed.PROCESSED
    assert (
        await consumer.process(message_id, write(consumer, message_id), payload=b"order-3")
    ).duplicate
    assert await effect_rows(store, consumer, message_id) == 3


async def test_an_empty_payload_is_a_payload(store: Store, consumer: IdempotentConsumer) -> None:
    """b"" has a digest of its own: not "no payload given", which compares nothing."""
    message_id = fresh()
    await consumer.process(message_id, write(consumer, message_id), payload=b"")
    with pytest.raises(KeyReused):
        await consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
    assert (await consumer.process(message_id, write(consumer, message_id), payload=b"")).duplicate


async def test_consumers_are_separated_by_name(store: Store, effects_table: None) -> None:
    message_id = fresh()
    ledger = IdempotentConsumer(store, fresh("ledger"))
    analytics = IdempotentConsumer(store, fresh("analytics"))
    for consumer in (ledger, analytics, ledger, analytics):
        await consumer.process(message_id, write(consumer, message_id))
    assert await effect_rows(store, ledger, message_id) == 1
    assert await effect_rows(store, analytics, message_id) == 1


@pytest.mark.parametrize(
    "raised",
    [TimeoutError("the payment API took too long"), ConnectionRefusedError(111, "refused")],
    ids=["timeout", "refused"],
)
async def test_an_effects_own_network_error_is_raised_unchanged(
    store: Store, consumer: IdempotentConsumer, raised: Exception
) -> None:
    """The effect's call to another service failed, not the database: it was reported as the
    store being down (StoreUnavailable; UNAVAILABLE through process_call), and the caller's own
    ``except TimeoutError`` never ran."""
    message_id = fresh()

    async def effect(conn: Any) -> None:
        await conn.execute("SELECT 1")
        raise raised

    with pytest.raises(type(raised)) as caught:
        await consumer.process(message_id, effect)
    assert caught.value is raised
    assert not (await consumer.process(message_id, write(consumer, message_id))).duplicate


async def test_an_effects_own_error_raised_through_asyncpg_is_raised_unchanged(
    consumer: IdempotentConsumer,
) -> None:
    """A COPY whose source is the effect's (a missing file; another service's stream that
    resets) raises OSErrors from asyncpg's frames, on a healthy connection: they were reported
    as the store being down."""

    async def reset_stream() -> AsyncIterator[bytes]:
        yield b"1\n"
        raise ConnectionResetError(104, "the export service reset the connection")

    for source, raised in (
        ("/nonexistent/export.csv", FileNotFoundError),
        (reset_stream(), ConnectionResetError),
    ):

        async def effect(conn: Any, source: Any = source) -> None:
            await conn.execute("CREATE TEMP TABLE copied (x int) ON COMMIT DROP")
            await conn.copy_to_table("copied", source=source)

        with pytest.raises(raised):
            await consumer.process(fresh(), effect)


async def test_misusing_the_connection_is_the_effects_error_not_an_outage(
    consumer: IdempotentConsumer,
) -> None:
    """asyncpg refuses conn.transaction() inside the mark's transaction (InterfaceError): a
    programming error, which was reported as the store being down and retried until dead."""

    async def effect(conn: Any) -> None:
        async with conn.transaction():
            await conn.execute("SELECT 1")

    with pytest.raises(asyncpg.InterfaceError):
        await consumer.process(fresh(), effect)


def test_a_retention_the_database_cannot_add_is_refused_when_made(store: Store) -> None:
    """It overflowed the mark's timestamp (22008): every delivery failed as a store outage."""
    with pytest.raises(ValueError, match="at most 36500 days"):
        IdempotentConsumer(store, fresh("consumer"), retention=timedelta(days=999_999_999))


async def test_the_mark_transaction_carries_an_idle_timeout(
    store: Store, effects_table: None
) -> None:
    """README: every transaction the library opens carries one; the mark's had none."""
    consumer = IdempotentConsumer(store, fresh("consumer"), idle_timeout=timedelta(seconds=7))

    async def effect(conn: Any) -> str:
        setting: str = await conn.fetchval("SHOW idle_in_transaction_session_timeout")
        return setting

    assert (await consumer.process(fresh(), effect)).value == "7s"
    # The default is the server's lease; a longer one than PostgreSQL's int of milliseconds is
    # sent as its largest (a larger one failed the BEGIN with 22023, as if the store were down).
    assert (await IdempotentConsumer(store, fresh("c")).process(fresh(), effect)).value == "30s"
    longest = IdempotentConsumer(store, fresh("c"), idle_timeout=timedelta(days=36500))
    assert (await longest.process(fresh(), effect)).value == str(2**31 - 1) + "ms"


@pytest.mark.parametrize("timeout", [float("nan"), -1.0])
async def test_a_nan_or_negative_timeout_is_refused_before_anything_runs(
    store: Store, timeout: float
) -> None:
    """NaN compared false everywhere: on a busy pool, the wait for a connection never ended."""
    ran: list[str] = []

    async def effect(conn: Any) -> None:
        ran.append("ran")

    consumer = IdempotentConsumer(store, fresh("consumer"))
    with pytest.raises(
        ValueError, match=r"^timeout must be None or a number of seconds from 0, not"
    ):
        await consumer.process(fresh(), effect, timeout=timeout)
    assert ran == []
    # math.inf is no bound, as None, and so is 10**400 (below it: a bare OverflowError).
    assert not (await consumer.process(fresh(), effect, timeout=float("inf"))).duplicate
    assert not (await consumer.process(fresh(), effect, timeout=10**400)).duplicate
    assert ran == ["ran", "ran"]


async def test_a_timeout_or_effect_of_the_wrong_type_is_refused_before_anything_runs(
    store: Store,
) -> None:
    """A timedelta (the consumer's own settings are timedeltas) failed the bound's comparison with
    a bare "'>=' not supported"; an effect that cannot be called failed only inside the mark's
    transaction, a database round trip later, as "'NoneType' object is not callable"."""
    ran: list[str] = []

    async def effect(conn: Any) -> None:
        ran.append("ran")

    consumer = IdempotentConsumer(store, fresh("consumer"))
    message_id = fresh()
    with pytest.raises(TypeError, match=r"^timeout must be None or a number of seconds, not"):
        await consumer.process(message_id, effect, timeout=timedelta(seconds=5))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^timeout must be None or a number of seconds, not"):
        await consumer.process(message_id, effect, timeout=True)  # a bool is no number of seconds
    with pytest.raises(TypeError, match="effect must be an async function of the connection"):
        await consumer.process(message_id, None)  # type: ignore[arg-type]
    assert ran == [] and not await consumer.is_processed(message_id)


async def test_an_effect_returning_an_awaitable_that_is_no_coroutine_runs(
    consumer: IdempotentConsumer,
) -> None:
    """The plain-def refusal is for a value that cannot be awaited: a callable returning a task
    (any awaitable, not only a coroutine) ran before it, and still runs and commits (refusing
    what is no coroutine survived)."""
    message_id = fresh()
    work = write(consumer, message_id)

    def effect(conn: Any) -> Any:
        return asyncio.ensure_future(work(conn))

    result = await consumer.process(message_id, effect)
    assert not result.duplicate and isinstance(result.value, int)
    assert await consumer.is_processed(message_id)


async def test_an_effect_that_is_a_plain_def_is_refused_and_nothing_is_marked(
    store: Store,
) -> None:
    """A callable that is not async passed the callable check and failed inside the mark's
    transaction with a raw "object ... can't be used in 'await' expression"; now a TypeError
    naming effect, the mark rolled back, so a redelivery runs."""
    ran: list[str] = []

    def returns_a_value(conn: Any) -> int:
        ran.append("sync")
        return 1

    def returns_none(conn: Any) -> None:
        ran.append("sync")

    async def effect(conn: Any) -> None:
        ran.append("async")

    consumer = IdempotentConsumer(store, fresh("consumer"))
    message_id = fresh()
    for plain in (returns_a_value, returns_none):
        with pytest.raises(TypeError, match="effect must be an async function of the connection"):
            await consumer.process(message_id, plain)  # type: ignore[arg-type]
        assert not await consumer.is_processed(message_id)
    result = await consumer.process(message_id, effect)
    assert not result.duplicate and ran == ["sync", "sync", "async"]
    assert await consumer.is_processed(message_id)


@pytest.mark.parametrize(
    "idle_timeout",
    [timedelta(0), timedelta(microseconds=1), timedelta(milliseconds=99), timedelta(days=36501)],
    ids=["0", "1us", "99ms", "long"],
)
def test_an_idle_timeout_out_of_range_is_refused_when_made(
    store: Store, idle_timeout: timedelta
) -> None:
    """Under 100 ms (the floor of a method's lease, the same bound), PostgreSQL ended the
    delivery's session under any effect that awaited anything, on every redelivery."""
    with pytest.raises(ValueError, match="idle_timeout must be at least 100 ms"):
        IdempotentConsumer(store, fresh("consumer"), idle_timeout=idle_timeout)


async def test_an_effect_idle_past_the_idle_timeout_is_told_its_connection_was_lost(
    store: Store, effects_table: None
) -> None:
    """It was told it had ended the consumer's transaction itself (COMMIT or ROLLBACK)."""
    # 500 ms, not the 100 ms floor: the idle clock runs from the mark's statement to the
    # effect's write too, and a loaded CI machine could take 100 ms over that hop; PostgreSQL
    # then ended the session before the write, and the effect failed some other way.
    consumer = IdempotentConsumer(store, fresh("idle"), idle_timeout=timedelta(milliseconds=500))
    message_id = fresh()

    async def idles(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        pid = conn.get_server_pid()
        await until(
            "PostgreSQL to end the idle session",
            lambda: store.pool.fetchval(
                "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)", pid
            ),
        )

        def closed() -> bool:
            try:
                return bool(conn.is_closed())
            except asyncpg.InterfaceError:  # the pool detached the proxy of a lost connection
                return True

        await until("asyncpg to see the session gone", closed)

    with pytest.raises(StoreUnavailable, match="connection was lost while the effect"):
        await consumer.process(message_id, idles)
    assert await effect_rows(store, consumer, message_id) == 0
    assert not await consumer.is_processed(message_id)


async def test_a_frozen_replica_frees_its_message_after_the_idle_timeout(
    pg_dsn: str, store: Store, effects_table: None
) -> None:
    """A replica frozen (SIGSTOP: a GC pause, a VM migration) or cut off mid-effect kept the
    mark's row locked: every redelivery was MessageInProgress until TCP keepalive ended the
    session, hours later. Now PostgreSQL ends it after the idle timeout: its effect and mark roll
    back, a redelivery on another replica runs the effect, and the frozen one, thawed, cannot
    commit (nothing acknowledged there)."""
    name, message_id = fresh("frozen"), fresh()
    replica = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "tests.support.consumer_replica", pg_dsn, name, message_id, "500"],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )
    assert replica.stdin is not None and replica.stdout is not None
    try:
        entered = await asyncio.wait_for(replica.stdout.readline(), timeout=30)
        assert entered == b"entered\n"  # its effect's row written, its transaction open
        replica.send_signal(signal.SIGSTOP)
        # Waits on the frozen replica's row lock (max_wait) until PostgreSQL ends its session.
        other = IdempotentConsumer(store, name, max_wait=timedelta(seconds=20))
        result = await other.process(message_id, write(other, message_id))
        assert result.outcome is Consumed.PROCESSED
        assert await effect_rows(store, other, message_id) == 1  # the frozen one's rolled back

        replica.send_signal(signal.SIGCONT)
        replica.stdin.write(b"\n")  # its effect returns
        thawed = await asyncio.wait_for(replica.stdout.readline(), timeout=30)
        assert thawed == b"raised StoreUnavailable\n"
        assert await effect_rows(store, other, message_id) == 1
        assert (await other.process(message_id, write(other, message_id))).duplicate
    finally:
        with contextlib.suppress(ProcessLookupError):
            replica.send_signal(signal.SIGCONT)
            replica.kill()
        await replica.wait()


@pytest.mark.parametrize("marked", ["new", "expired"])
async def test_a_delivery_waiting_on_a_killed_replicas_mark_takes_it_over(
    pg_dsn: str, store: Store, effects_table: None, marked: str
) -> None:
    """A replica killed mid-effect (SIGKILL: its session ends, PostgreSQL rolls its effect and
    mark back) while a delivery of the id waits on its row: the waiting one runs the effect,
    counted as what the database held before the dead replica, told by the mark statement
    itself. A new id is "processed": a mark is never committed before its effect, so a dead
    replica leaves nothing to take over. An expired mark (the id processed before, past its
    retention), which the dead replica was taking over, is "reprocessed": the effect has now
    committed twice."""
    telemetry, _, reader = _telemetry()
    name, message_id = fresh("killed"), fresh()
    other = IdempotentConsumer(store, name, max_wait=timedelta(seconds=20), telemetry=telemetry)
    if marked == "expired":
        await other.process(message_id, write(other, message_id))
        await expire(store, other, message_id)
    # An idle timeout far past the test: only the kill ends the replica's session.
    replica = await asyncio.create_subprocess_exec(
        *[
            sys.executable,
            "-m",
            "tests.support.consumer_replica",
            pg_dsn,
            name,
            message_id,
            "60000",
        ],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )
    assert replica.stdout is not None
    try:
        entered = await asyncio.wait_for(replica.stdout.readline(), timeout=30)
        assert entered == b"entered\n"  # its mark taken and its effect's row written, uncommitted
        waiter = asyncio.create_task(other.process(message_id, write(other, message_id)))
        await waiting_on_a_lock(store)
        assert not waiter.done()
        replica.kill()
        await replica.wait()
        result = await asyncio.wait_for(waiter, timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            replica.kill()
        await replica.wait()
    assert result.outcome is Consumed.PROCESSED
    # The dead replica's row rolled back; the earlier delivery's (expired) committed.
    assert await effect_rows(store, other, message_id) == (1 if marked == "new" else 2)
    taken = "processed" if marked == "new" else "reprocessed"
    want = Counter({(name, taken): 1} | ({(name, "processed"): 1} if marked == "expired" else {}))
    assert _counts(reader, "grpc_idempotency.consumer.messages") == want


@pytest.mark.parametrize(
    "message_id",
    # 1024 four-byte characters overflowed the marks' index (a "store unavailable" error, so the
    # message came back forever); a lone surrogate raised a raw UnicodeEncodeError.
    ["", "x" * 1025, "nul\x00byte", "\U0001f600" * 1024, "lone \udcff"],
    ids=["empty", "1025-chars", "nul", "4096-bytes", "surrogate"],
)
async def test_malformed_message_ids_are_refused_before_the_database(
    consumer: IdempotentConsumer, message_id: str
) -> None:
    with pytest.raises(KeyInvalid):
        await consumer.process(message_id, write(consumer, message_id))


@pytest.mark.parametrize("message_id", [b"msg-1", 5, None], ids=["bytes", "int", "none"])
async def test_a_message_id_that_is_not_a_str_is_refused_as_such(
    consumer: IdempotentConsumer, message_id: object
) -> None:
    """Told "message id is empty", which it was not."""
    with pytest.raises(KeyInvalid, match="must be a str"):
        await consumer.process(message_id, write(consumer, "x"))  # type: ignore[arg-type]
    with pytest.raises(KeyInvalid, match="must be a str"):
        await consumer.is_processed(message_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [b"ledger", 5, None], ids=["bytes", "int", "none"])
def test_a_consumer_name_that_is_not_a_str_is_refused(store: Store, name: object) -> None:
    """bytes or an int raised a TypeError of len() or of the pattern."""
    with pytest.raises(ValueError, match="consumer name"):
        IdempotentConsumer(store, name)  # type: ignore[arg-type]


async def test_message_ids_are_data_not_sql(store: Store, consumer: IdempotentConsumer) -> None:
    """The mark is sent as literals (one round trip): quotes and backslashes stay data."""
    message_id = "it's \\' ); DROP TABLE x; --  ünïcode"
    await consumer.process(message_id, write(consumer, message_id))
    assert await marks(store, consumer.name) == [message_id]
    assert (await consumer.process(message_id, write(consumer, message_id))).duplicate


# --- concurrent deliveries of one id -----------------------------------------------------------


async def test_concurrent_deliveries_in_one_process_run_the_effect_once(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()
    gate = Gate(consumer, message_id)
    deliveries = [
        asyncio.create_task(consumer.process(message_id, gate, timeout=10)) for _ in range(20)
    ]
    await gate.entered.wait()
    await asyncio.sleep(0.05)  # the others are queued behind the running one
    assert not any(d.done() for d in deliveries)
    gate.release.set()
    results = await asyncio.gather(*deliveries)

    assert gate.runs == 1
    assert sorted(r.outcome.value for r in results) == ["duplicate"] * 19 + ["processed"]
    assert await effect_rows(store, consumer, message_id) == 1


async def test_a_duplicate_in_another_process_waits_on_the_row_then_sees_a_duplicate(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """Two consumer instances of one name stand for two replicas: the second delivery blocks on
    the first's uncommitted mark (a lock wait in PostgreSQL) and answers once it commits."""
    replica = IdempotentConsumer(store, consumer.name)
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    second = asyncio.create_task(replica.process(message_id, write(replica, message_id)))
    await waiting_on_a_lock(store)
    assert not second.done()
    gate.release.set()

    assert (await first).outcome is Consumed.PROCESSED
    assert (await second).outcome is Consumed.DUPLICATE
    assert await effect_rows(store, consumer, message_id) == 1


async def test_when_the_first_delivery_fails_the_waiting_one_runs_the_effect(
    store: Store, consumer: IdempotentConsumer
) -> None:
    replica = IdempotentConsumer(store, consumer.name)
    message_id = fresh()
    gate, first = await held(consumer, message_id, fail=True)
    second = asyncio.create_task(replica.process(message_id, write(replica, message_id)))
    await waiting_on_a_lock(store)
    gate.release.set()

    with pytest.raises(RuntimeError):
        await first
    assert (await second).outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == 1
    assert await consumer.is_processed(message_id)


@pytest.mark.parametrize("where", ["another process", "this process"])
async def test_the_wait_for_a_concurrent_delivery_is_bounded(
    store: Store, consumer: IdempotentConsumer, where: str
) -> None:
    waiter = IdempotentConsumer(store, consumer.name) if where == "another process" else consumer
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    try:
        started = time.monotonic()
        with pytest.raises(MessageInProgress) as raised:
            # max_wait is 5 s: the caller's timeout is the tighter bound here.
            await waiter.process(message_id, write(waiter, message_id), timeout=0.3)
        waited = time.monotonic() - started
        assert 0.25 < waited < 2.0, waited
        assert raised.value.retry_after_ms > 0
        assert not first.done()
    finally:
        gate.release.set()
    assert (await first).outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == 1


async def test_max_wait_bounds_a_duplicate_without_a_timeout(
    store: Store, consumer: IdempotentConsumer
) -> None:
    waiter = IdempotentConsumer(store, consumer.name, max_wait=timedelta(milliseconds=200))
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    try:
        with pytest.raises(MessageInProgress):
            await waiter.process(message_id, write(waiter, message_id))
    finally:
        gate.release.set()
    await first


async def test_a_duplicate_with_no_max_wait_gives_up_at_once(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """max_wait=0 is a lock_timeout of 1 ms: PostgreSQL reads 0 as no bound, and the duplicate
    waited on the concurrent delivery's row for as long as it ran."""
    waiter = IdempotentConsumer(store, consumer.name, max_wait=timedelta(0))
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    try:
        with pytest.raises(MessageInProgress):
            await asyncio.wait_for(waiter.process(message_id, write(waiter, message_id)), 5.0)
    finally:
        gate.release.set()
    assert (await first).outcome is Consumed.PROCESSED


async def test_the_effect_keeps_the_sessions_lock_timeout(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """The bound on the wait for a concurrent delivery applies to the mark only: the effect's own
    lock waits keep the session's setting."""
    message_id = fresh()
    consumer = IdempotentConsumer(store, consumer.name, max_wait=timedelta(milliseconds=250))
    session = await store.pool.fetchval("SHOW lock_timeout")

    async def show(conn: Any) -> str:
        setting: str = await conn.fetchval("SHOW lock_timeout")
        return setting

    result = await consumer.process(message_id, show)
    assert result.value == session != "250ms"


# --- retention and purging ---------------------------------------------------------------------


async def expire(store: Store, consumer: IdempotentConsumer, *message_ids: str) -> None:
    """Moves marks past their retention by the database's clock."""
    await store.pool.execute(
        f"UPDATE {TABLE} SET expires_at = clock_timestamp() - interval '1 second'"
        " WHERE consumer = $1 AND message_id = ANY($2::text[])",
        consumer.name,
        list(message_ids),
    )


async def test_an_expired_mark_is_treated_as_new_whether_or_not_purged(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()
    await consumer.process(message_id, write(consumer, message_id))
    await expire(store, consumer, message_id)
    assert not await consumer.is_processed(message_id)

    again = await consumer.process(message_id, write(consumer, message_id))
    assert again.outcome is Consumed.PROCESSED  # taken over: the mark is live again
    assert await effect_rows(store, consumer, message_id) == 2
    assert await consumer.is_processed(message_id)
    assert (await consumer.process(message_id, write(consumer, message_id))).duplicate


async def test_purge_deletes_expired_marks_in_bounded_batches(
    store: Store, effects_table: None
) -> None:
    consumer = IdempotentConsumer(store, fresh("purged"))
    other = IdempotentConsumer(store, fresh("other"))
    expired = [fresh() for _ in range(7)]
    live = [fresh() for _ in range(3)]
    for message_id in expired + live:
        await consumer.process(message_id, write(consumer, message_id))
    await other.process(expired[0], write(other, expired[0]))
    await expire(store, consumer, *expired)
    await expire(store, other, expired[0])

    assert await consumer.purge_processed(batch_size=3, max_batches=2) == 6
    assert len(await marks(store, consumer.name)) == 4  # one expired left, 3 live
    assert await consumer.purge_processed(batch_size=3) == 1
    assert await marks(store, consumer.name) == sorted(live)
    # Another consumer's expired marks are its own to purge.
    assert await marks(store, other.name) == [expired[0]]
    assert await purge_processed(store, batch_size=1000) >= 1
    assert await marks(store, other.name) == []
    with pytest.raises(ValueError):
        await consumer.purge_processed(batch_size=0)


async def test_purge_skips_a_mark_being_taken_over(
    store: Store, consumer: IdempotentConsumer
) -> None:
    message_id = fresh()
    await consumer.process(message_id, write(consumer, message_id))
    await expire(store, consumer, message_id)
    gate, takeover = await held(consumer, message_id)
    try:
        assert await consumer.purge_processed() == 0  # locked by the takeover: skipped
    finally:
        gate.release.set()
    assert (await takeover).outcome is Consumed.PROCESSED
    assert await consumer.is_processed(message_id)


# --- the store failing -------------------------------------------------------------------------


@pytest.fixture
async def own_store(pg_dsn: str) -> AsyncIterator[Store]:
    """A store with a pool of its own, whose connections a test can kill."""
    store = await Store.connect(pg_dsn, min_size=1, max_size=2, server_settings={
        "application_name": "consumer-kill-me"
    })  # fmt: skip
    try:
        yield store
    finally:
        await store.close()


async def kill_backends(store: Store) -> int:
    """Terminates the backends of ``own_store``, from ``store``'s pool."""
    killed: int = await store.pool.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE application_name = 'consumer-kill-me'"
    )
    return killed


async def test_a_connection_lost_under_the_effect_is_store_unavailable(
    store: Store, own_store: Store, effects_table: None
) -> None:
    consumer = IdempotentConsumer(own_store, fresh("killed"))
    message_id = fresh()

    async def killed_midway(conn: Any) -> None:
        await write(consumer, message_id)(conn)
        await store.pool.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
        await write(consumer, message_id)(conn)

    with pytest.raises(StoreUnavailable) as raised:
        await consumer.process(message_id, killed_midway)
    assert not isinstance(raised.value, asyncpg.PostgresError)
    assert await effect_rows(store, consumer, message_id) == 0
    assert not await IdempotentConsumer(store, consumer.name).is_processed(message_id)
    # The consumer recovers on a fresh connection.
    assert (await consumer.process(message_id, write(consumer, message_id))).outcome is (
        Consumed.PROCESSED
    )


@pytest.mark.parametrize("failing", ["timeout", "own-error"])
async def test_an_effect_failing_behind_a_partition_returns_in_time(
    pg_dsn: str, effects_table: None, failing: str
) -> None:
    """An effect's statement timed out on the wire (the link went dead): abandoning the mark sent
    ROLLBACK on that connection, which waits for the timed-out statement's cancellation to be
    confirmed: never, behind the partition. The connection is dropped instead (PostgreSQL rolls
    back when it notices), and the delivery fails at once as the store's failure."""
    proxy = BlackholeProxy(pg_dsn)
    await proxy.start()
    partitioned = await Store.connect(proxy.dsn, max_size=2)
    try:
        consumer = IdempotentConsumer(partitioned, fresh("partitioned"))

        async def cut_off(conn: Any) -> None:
            proxy.blackhole()
            if failing == "timeout":
                await conn.execute("SELECT 1", timeout=0.5)
            raise ValueError("the effect's own failure, as the link dies")

        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StoreUnavailable if failing == "timeout" else ValueError):
            await asyncio.wait_for(consumer.process(fresh(), cut_off), 20.0)
        # The ROLLBACK after the effect's own error is bounded (2 s): it took the pool's
        # command_timeout (30 s by default).
        assert loop.time() - began < 4.0
    finally:
        partitioned.pool.terminate()
        await proxy.close()


async def test_idle_connections_killed_in_the_pool_are_replaced(
    store: Store, own_store: Store, effects_table: None
) -> None:
    """A database restart, or an administrator, ends the pool's idle connections: a delivery
    that meets a dead one fails as StoreUnavailable (never asyncpg's error, nothing marked), and
    the redelivery gets a fresh connection."""
    consumer = IdempotentConsumer(own_store, fresh("restarted"))
    await own_store.ping()
    assert await kill_backends(store) >= 1
    message_id = fresh()
    try:
        result = await consumer.process(message_id, write(consumer, message_id))
    except StoreUnavailable:
        assert not await IdempotentConsumer(store, consumer.name).is_processed(message_id)
        result = await consumer.process(message_id, write(consumer, message_id))
    assert result.outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == 1


async def test_a_failing_mark_is_store_unavailable_and_nothing_runs(
    store: Store, effects_table: None
) -> None:
    """A schema without the consumer's table (never migrated): the mark fails in the database;
    the caller sees StoreUnavailable, not asyncpg's error, and the effect does not run."""
    consumer = IdempotentConsumer(Store(store.pool, schema="consumer_test"), fresh("unmigrated"))
    ran: list[int] = []

    async def effect(conn: Any) -> None:
        ran.append(1)

    with pytest.raises(StoreUnavailable, match="42P01") as raised:
        await consumer.process(fresh(), effect)
    assert isinstance(raised.value.__cause__, asyncpg.UndefinedTableError)
    assert ran == []
    with pytest.raises(StoreUnavailable):
        await consumer.is_processed(fresh())


async def test_an_unreachable_store_is_store_unavailable(effects_table: None) -> None:
    pool = await asyncpg.create_pool("postgresql://nobody@127.0.0.1:1/none", min_size=0, max_size=1)
    consumer = IdempotentConsumer(Store(pool), fresh("unreachable"))
    try:
        with pytest.raises(StoreUnavailable):
            await consumer.process(fresh(), write(consumer, "x"), timeout=2)
        with pytest.raises(StoreUnavailable):
            await consumer.purge_processed()
    finally:
        await pool.close()


async def test_a_cancelled_delivery_leaves_nothing_and_no_open_transaction(
    store: Store, own_store: Store, effects_table: None
) -> None:
    consumer = IdempotentConsumer(own_store, fresh("cancelled"))
    message_id = fresh()
    _, delivery = await held(consumer, message_id)
    delivery.cancel()
    with pytest.raises(asyncio.CancelledError):
        await delivery
    assert await effect_rows(store, consumer, message_id) == 0
    assert not await consumer.is_processed(message_id)

    async def no_open_transaction() -> bool:
        # The cancelled delivery's connection is dropped (PostgreSQL rolls back): its backend
        # leaves pg_stat_activity once it has read the end of the socket and exited, which on
        # a loaded machine can come a moment after the cancellation returned. A transaction
        # left open (the connection handed back to the pool mid-transaction) never goes.
        open_ones = await store.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'consumer-kill-me'"
            " AND state LIKE 'idle in transaction%'"
        )
        return bool(open_ones == 0)

    await until("the cancelled delivery's transaction to end", no_open_transaction)
    assert (await consumer.process(message_id, write(consumer, message_id))).outcome is (
        Consumed.PROCESSED
    )


async def test_a_duplicate_cancelled_while_its_marks_digest_is_read_gives_its_connection_back(
    pg_dsn: str, store: Store, effects_table: None
) -> None:
    """A duplicate given its payload reads the mark's digest in the mark's transaction, one more
    round trip: cancelled there (its caller gone), the transaction is abandoned as a cancelled
    one (the connection dropped) and the connection given back; kept, the pool's only
    connection was held for good."""
    async with store_behind_proxy(pg_dsn, pool=1) as (proxy, own):
        consumer = IdempotentConsumer(own, fresh("digest"))
        message_id = fresh()
        await consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
        proxy.hold_answers_after(b"SELECT fingerprint FROM")
        delivery = asyncio.ensure_future(
            consumer.process(message_id, write(consumer, message_id), payload=b"order-1")
        )
        await until("the digest's read to be held", lambda: proxy._holding)
        cancelled = time.monotonic()
        delivery.cancel()
        with pytest.raises(asyncio.CancelledError):
            await delivery
        # Dropped at once, not rolled back: a ROLLBACK would first wait for the interrupted
        # read's answer, here held (a dead link), until ROLLBACK_TIMEOUT_S.
        assert time.monotonic() - cancelled < ROLLBACK_TIMEOUT_S / 2
        proxy.deliver_answers()
        again = await consumer.process(
            message_id, write(consumer, message_id), payload=b"order-1", timeout=3
        )
        assert again.duplicate
    assert await effect_rows(store, consumer, message_id) == 1


# --- over gRPC: the message id is the call's idempotency-key -----------------------------------

RECORD = "/consumer_test.Receiver/Record"


@pytest.fixture
async def receiver(
    store: Store, effects_table: None
) -> AsyncIterator[tuple[grpc.aio.Channel, IdempotentConsumer, dict[str, Gate]]]:
    """An unkeyed gRPC method (raw bytes) that consumes each call with ``process_call``; a body
    of b"hold" holds the effect open on the gate registered for the call's key; one starting with
    b"order" is passed as the delivery's payload."""
    consumer = IdempotentConsumer(store, fresh("receiver"), max_wait=timedelta(milliseconds=300))
    gates: dict[str, Gate] = {}

    async def record(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        key = dict(context.invocation_metadata() or ()).get(KEY_HEADER, "")
        effect = gates[key] if request == b"hold" else write(consumer, key)
        payload = request if request.startswith(b"order") else None
        result = await consumer.process_call(context, effect, payload=payload)
        return result.outcome.value.encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "consumer_test.Receiver", {"Record": grpc.unary_unary_rpc_method_handler(record)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, consumer, gates
    finally:
        await channel.close(None)
        await server.stop(None)


class Raw:
    """A request that is already bytes (call_raw serializes with SerializeToString)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


async def test_process_call_dedupes_by_the_idempotency_key(
    store: Store, receiver: tuple[grpc.aio.Channel, IdempotentConsumer, dict[str, Gate]]
) -> None:
    channel, consumer, _ = receiver
    key = fresh()
    answers = [await call_raw(channel, RECORD, Raw(b""), ((KEY_HEADER, key),)) for _ in range(3)]
    assert [a.code for a in answers] == [grpc.StatusCode.OK] * 3
    assert [a.body for a in answers] == [b"processed", b"duplicate", b"duplicate"]
    assert await effect_rows(store, consumer, key) == 1


async def test_process_call_refuses_a_key_delivered_again_with_another_payload(
    store: Store, receiver: tuple[grpc.aio.Channel, IdempotentConsumer, dict[str, Gate]]
) -> None:
    channel, consumer, _ = receiver
    key = fresh()
    bodies = [b"order-1", b"order-1", b"order-2"]
    answers = [await call_raw(channel, RECORD, Raw(b), ((KEY_HEADER, key),)) for b in bodies]
    assert [a.code for a in answers] == [grpc.StatusCode.OK] * 2 + [
        grpc.StatusCode.FAILED_PRECONDITION
    ]
    assert answers[2].reason() == "IDEMPOTENCY_KEY_REUSED"
    assert await effect_rows(store, consumer, key) == 1


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [((), "IDEMPOTENCY_KEY_MISSING"), (((KEY_HEADER, "a b"),), "IDEMPOTENCY_KEY_INVALID")],
)
async def test_process_call_refuses_a_delivery_without_a_usable_key(
    receiver: tuple[grpc.aio.Channel, IdempotentConsumer, dict[str, Gate]],
    metadata: tuple[tuple[str, str], ...],
    reason: str,
) -> None:
    channel, _, _ = receiver
    answer = await call_raw(channel, RECORD, Raw(b""), metadata)
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT
    assert answer.reason() == reason


async def test_process_call_answers_aborted_while_another_delivery_runs(
    store: Store, receiver: tuple[grpc.aio.Channel, IdempotentConsumer, dict[str, Gate]]
) -> None:
    channel, consumer, gates = receiver
    key = fresh()
    gate = gates[key] = Gate(consumer, key)
    first = asyncio.create_task(call_raw(channel, RECORD, Raw(b"hold"), ((KEY_HEADER, key),)))
    await gate.entered.wait()
    try:
        busy = await call_raw(channel, RECORD, Raw(b""), ((KEY_HEADER, key),))
    finally:
        gate.release.set()
    assert busy.code is grpc.StatusCode.ABORTED
    assert busy.reason() == "IDEMPOTENCY_KEY_IN_PROGRESS"
    assert busy.retry_delay_ms() is not None and "grpc-retry-pushback-ms" in busy.trailing
    done = await first
    assert done.code is grpc.StatusCode.OK and done.body == b"processed"
    assert await effect_rows(store, consumer, key) == 1


# --- a failover or a restart: the pool's connections are all dead -----------------------------

FAILOVER_POOL = 4


@pytest.fixture
async def failing_over(
    pg_dsn: str, store: Store, effects_table: None
) -> AsyncIterator[tuple[BlackholeProxy, Store]]:
    """A store whose pool holds ``FAILOVER_POOL`` connections, all opened through a proxy that
    can fail over (``BlackholeProxy.fail_over``)."""
    async with store_behind_proxy(pg_dsn, pool=FAILOVER_POOL) as proxied:
        yield proxied


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_deliveries_after_a_failover_are_not_refused_for_the_pools_dead_connections(
    store: Store, failing_over: tuple[BlackholeProxy, Store], ended: bool
) -> None:
    """After a failover (or a restart) every connection the pool opened before is dead, and
    fails once when next used. The mark met them one delivery after another: each failed as
    StoreUnavailable (not acknowledged, redelivered) with the database up, as many deliveries
    as the pool had connections. Like the claim, the mark replaces the pool's connections and
    tries once more on a connection opened now (safe: a dead session's transaction rolled
    back)."""
    proxy, via = failing_over
    consumer = IdempotentConsumer(via, fresh("failover"))
    first = fresh()
    assert (await consumer.process(first, write(consumer, first))).outcome is Consumed.PROCESSED
    proxy.fail_over(ended=ended)
    message_ids = [fresh() for _ in range(FAILOVER_POOL)]
    outcomes: list[object] = []
    for message_id in message_ids:
        try:
            outcomes.append(
                (await consumer.process(message_id, write(consumer, message_id))).outcome
            )
        except StoreUnavailable as err:
            outcomes.append(err)
    assert outcomes == [Consumed.PROCESSED] * FAILOVER_POOL
    assert [await effect_rows(store, consumer, m) for m in message_ids] == [1] * FAILOVER_POOL
    # A duplicate after the failover is still one.
    assert (await consumer.process(first, write(consumer, first))).duplicate


@pytest.mark.parametrize("ended", [False, True], ids=["reset", "session-ended"])
async def test_is_processed_after_a_failover_is_answered(
    store: Store, failing_over: tuple[BlackholeProxy, Store], ended: bool
) -> None:
    """A look-up is a read: on a pooled connection a failover left dead it is tried again on
    one opened now, as the store's look-up of a key is; it raised StoreUnavailable, the
    database up."""
    proxy, via = failing_over
    consumer = IdempotentConsumer(via, fresh("failover"))
    message_id = fresh()
    await consumer.process(message_id, write(consumer, message_id))
    proxy.fail_over(ended=ended)
    assert await consumer.is_processed(message_id)
    assert not await consumer.is_processed(fresh())


async def test_a_read_only_database_is_store_unavailable_and_nothing_runs(
    pg_dsn: str, store: Store, effects_table: None
) -> None:
    """A standby reached after a failover, or a database set read-only: the mark writes, so it
    is refused (25006), an outage; the effect does not run, nothing is acknowledged, and a
    redelivery once the database takes writes runs it. A duplicate is not acknowledged either
    (its mark cannot be taken), which is safe: it is redelivered."""
    read_only = await Store.connect(
        pg_dsn, max_size=2, server_settings={"default_transaction_read_only": "on"}
    )
    try:
        name = fresh("read-only")
        done = fresh()
        writable = IdempotentConsumer(store, name)
        await writable.process(done, write(writable, done))
        consumer = IdempotentConsumer(read_only, name)
        ran: list[str] = []

        async def effect(conn: Any) -> None:
            ran.append("ran")

        for message_id in (fresh(), done):
            with pytest.raises(StoreUnavailable, match="25006") as raised:
                await consumer.process(message_id, effect)
            assert raised.value.outage
        assert ran == []
        assert await consumer.is_processed(done)  # a read: a standby answers it
    finally:
        await read_only.close()


async def test_a_replica_killed_mid_effect_leaves_its_message_to_a_redelivery(
    pg_dsn: str, store: Store, effects_table: None
) -> None:
    """kill -9 of a replica whose effect has written: its session ends with it, its effect and
    mark roll back, and a redelivery already waiting on the mark runs the effect, once."""
    name, message_id = fresh("killed"), fresh()
    replica = await asyncio.create_subprocess_exec(
        *[
            sys.executable,
            "-m",
            "tests.support.consumer_replica",
            pg_dsn,
            name,
            message_id,
            "30000",
        ],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )
    assert replica.stdout is not None
    try:
        entered = await asyncio.wait_for(replica.stdout.readline(), timeout=30)
        assert entered == b"entered\n"  # its effect's row written, its transaction open
        other = IdempotentConsumer(store, name, max_wait=timedelta(seconds=20))
        redelivery = asyncio.create_task(other.process(message_id, write(other, message_id)))
        await waiting_on_a_lock(store)
        replica.kill()  # SIGKILL
        await replica.wait()
        result = await asyncio.wait_for(redelivery, 20)
        assert result.outcome is Consumed.PROCESSED
        assert await effect_rows(store, other, message_id) == 1  # the killed one's rolled back
        assert (await other.process(message_id, write(other, message_id))).duplicate
    finally:
        with contextlib.suppress(ProcessLookupError):
            replica.kill()
        await replica.wait()


async def test_purge_processed_after_a_failover_is_not_refused_for_the_pools_dead_connections(
    store: Store, failing_over: tuple[BlackholeProxy, Store]
) -> None:
    proxy, via = failing_over
    consumer = IdempotentConsumer(via, fresh("failover"))
    message_id = fresh()
    await consumer.process(message_id, write(consumer, message_id))
    await expire(store, consumer, message_id)
    proxy.fail_over()
    assert await consumer.purge_processed() == 1
    assert await marks(store, consumer.name) == []


async def test_a_max_wait_longer_than_the_pools_command_timeout_is_waited_out(
    pg_dsn: str, store: Store, consumer: IdempotentConsumer
) -> None:
    """The mark's wait on a concurrent delivery is bounded by ``max_wait`` (lock_timeout); the
    statement's own timeout was the pool's ``command_timeout``, so past it a duplicate gave up
    as StoreUnavailable (a timeout: an ambiguous outage, its connection dropped) instead of
    waiting ``max_wait`` and answering MessageInProgress (or DUPLICATE, had the first committed
    meanwhile). The mark's statement now allows ``max_wait`` beyond ``command_timeout``."""
    short = await Store.connect(pg_dsn, max_size=2, command_timeout=0.5)
    try:
        message_id = fresh()
        gate, first = await held(consumer, message_id)
        other = IdempotentConsumer(short, consumer.name, max_wait=timedelta(seconds=1.5))
        try:
            with pytest.raises(MessageInProgress):
                await other.process(message_id, write(other, message_id))
        finally:
            gate.release.set()
        assert (await first).outcome is Consumed.PROCESSED
        assert (await other.process(message_id, write(other, message_id))).duplicate
        assert await effect_rows(store, consumer, message_id) == 1
    finally:
        await short.close()


async def test_the_mark_says_when_it_waits_on_another_transactions_row(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """``ProcessedMessages.mark(waiting=)``: told nothing for a free id, nor with no wait at
    all (wait_s 0: MarkBusy at once, its one statement's 1 ms being no wait of the consumer's),
    and True, then False once it has the row, for a row another transaction holds."""
    marks_ = ProcessedMessages(store)
    told: list[bool] = []
    bounds: dict[str, Any] = {"retention_s": 60.0, "idle_timeout_s": 60.0, "acquire_timeout": 10}
    free = await marks_.mark(consumer.name, fresh(), wait_s=5, waiting=told.append, **bounds)
    await free.abandon(None)
    assert told == []
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    try:
        with pytest.raises(MarkBusy):
            await marks_.mark(consumer.name, message_id, wait_s=0, waiting=told.append, **bounds)
        assert told == []
        marking = asyncio.create_task(
            marks_.mark(consumer.name, message_id, wait_s=30, waiting=told.append, **bounds)
        )
        # Told first: the probe itself waits its 1 ms on the row, which a poll may catch.
        await until("the mark told it waits", lambda: told)
        await waiting_on_a_lock(store)
        assert told == [True]
    finally:
        gate.release.set()
    assert (await first).outcome is Consumed.PROCESSED
    mark = await marking
    await mark.abandon(None)
    assert (mark.outcome, told) == (Consumed.DUPLICATE, [True, False])


async def test_the_mark_waits_on_the_row_on_its_probes_connection(
    pg_dsn: str, store: Store, consumer: IdempotentConsumer
) -> None:
    """The probe found the row held (55P03): the waiting statement goes on the probe's own
    connection, rolled back, not on one acquired again. Given back, the probe's connection went
    to a delivery queued for one (the pool exhausted), and the mark waited for a connection,
    told ``waiting(True)`` all along, though it waited on no row. The probe is held up (a
    ``LOCK TABLE`` queued behind the holder of the row, ahead of it) to read its backend's pid
    and queue a taker for the one connection before it fails."""
    name = f"probe-{uuid.uuid4().hex[:12]}"
    one = await Store.connect(
        pg_dsn, min_size=1, max_size=1, server_settings={"application_name": name}
    )
    admin = await asyncpg.connect(pg_dsn)
    locker = await asyncpg.connect(pg_dsn)
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    told: list[bool] = []
    taker: asyncio.Task[Any] | None = None
    marking: asyncio.Task[Any] | None = None
    table = f"{store.schema}.processed_messages"

    async def mark_waiting(event: str) -> int | None:
        pid: int | None = await admin.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
            " AND wait_event_type = 'Lock' AND wait_event = $2"
            " AND query LIKE '%INSERT INTO %processed_messages%'",
            name,
            event,
        )
        return pid

    try:
        locker_pid = locker.get_server_pid()
        await locker.execute("BEGIN")
        locking = asyncio.create_task(locker.execute(f"LOCK TABLE {table} IN SHARE MODE"))
        await until(
            "the LOCK TABLE queued behind the held row",
            lambda: admin.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                locker_pid,
            ),
        )
        marking = asyncio.create_task(
            ProcessedMessages(one).mark(
                consumer.name,
                message_id,
                retention_s=60.0,
                wait_s=30.0,
                idle_timeout_s=60.0,
                acquire_timeout=10,
                waiting=told.append,
            )
        )
        probe_pid = await until("the probe on the table's lock", lambda: mark_waiting("relation"))
        # Queued for the pool's one connection before the probe can fail: it runs to the
        # pool's queue in the loop's next turn, the probe's answer comes after the cancel's.
        taker = asyncio.ensure_future(one.pool.acquire())
        await admin.execute("SELECT pg_catalog.pg_cancel_backend($1)", locker_pid)
        with pytest.raises(asyncpg.QueryCanceledError):
            await locking
        await locker.execute("ROLLBACK")

        async def waiting_on_the_row() -> int | None:
            # Told first: the probe itself waits its 1 ms on the row too.
            return await mark_waiting("transactionid") if told else None

        row_pid = await until("the mark waiting on the held row", waiting_on_the_row, timeout=3)
        assert (row_pid, told, taker.done()) == (probe_pid, [True], False)
    finally:
        gate.release.set()
        with contextlib.suppress(Exception):
            await first
        if taker is not None:
            # Either holds the one connection the other waits for.
            if taker.done():
                await one.pool.release(taker.result())
            else:
                taker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await taker
        if marking is not None:
            with contextlib.suppress(Exception):
                await (await marking).abandon(None)
        await locker.close()
        await admin.close()
        await one.close()
    assert (await first).outcome is Consumed.PROCESSED
    assert told == [True, False]


async def test_the_marks_second_try_waits_only_what_is_left_of_max_wait(
    store: Store, consumer: IdempotentConsumer
) -> None:
    """A duplicate waiting on a concurrent delivery's row whose session ends under it (its
    backend terminated, a reset link) tries the mark once more on a new connection: that try
    waited the whole ``max_wait`` again, so the duplicate waited up to twice ``max_wait``, past
    the call's ``timeout`` too, which ``process`` promises never to exceed."""
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    other = IdempotentConsumer(store, consumer.name, max_wait=timedelta(seconds=3))
    try:
        started = time.monotonic()
        duplicate = asyncio.create_task(other.process(message_id, write(other, message_id)))
        await waiting_on_a_lock(store)
        await asyncio.sleep(2)  # two of its three seconds waited on the row
        ended = await store.pool.fetchval(
            "SELECT count(pg_catalog.pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO %processed_messages%'"
        )
        assert ended == 1
        with pytest.raises(MessageInProgress):
            await asyncio.wait_for(duplicate, 10)
        waited = time.monotonic() - started
        assert waited < 3 + 0.9, f"waited {waited:.1f}s, max_wait 3s"
    finally:
        gate.release.set()
    assert (await first).outcome is Consumed.PROCESSED
    assert await effect_rows(store, consumer, message_id) == 1


async def test_a_mark_cancelled_during_its_rollback_gives_its_connection_back(
    pg_dsn: str, store: Store, consumer: IdempotentConsumer
) -> None:
    """The mark's statement failed (the id's row held elsewhere: MarkBusy) and the mark is
    cancelled during the ROLLBACK that follows (its caller gone): ``_abandon`` drops the
    connection and re-raises, and the mark's own release after it never runs. The pool must
    still hand out its one connection (a connection terminated goes back to asyncpg's pool;
    had it not, each such cancellation shrank the pool by one for good)."""
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    try:
        async with store_behind_proxy(pg_dsn, pool=1) as (proxy, own):
            marks_ = ProcessedMessages(own)
            proxy.hold_answers_after(b"ROLLBACK")
            marking = asyncio.ensure_future(
                marks_.mark(
                    consumer.name,
                    message_id,
                    wait_s=0,
                    retention_s=60.0,
                    idle_timeout_s=60.0,
                    acquire_timeout=10,
                )
            )
            await until("the rollback's answer to be held", lambda: proxy._holding)
            marking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await marking
            proxy.deliver_answers()
            pool = own.pool
            await until("no connection in use", lambda: pool.get_size() == pool.get_idle_size())
            conn = await pool.acquire(timeout=2)  # the pool's only connection, free again
            await pool.release(conn)
    finally:
        gate.release.set()
    assert (await first).outcome is Consumed.PROCESSED


async def test_a_probe_failing_otherwise_than_busy_gives_its_connection_back(
    pg_dsn: str, consumer: IdempotentConsumer
) -> None:
    """Only a probe's 55P03 keeps its connection for the wait on the row: a probe that fails
    otherwise (here a retention PostgreSQL cannot add to now()) hands it back, or a pool of one was
    left with none."""
    one = await Store.connect(pg_dsn, min_size=1, max_size=1)
    try:
        marks = ProcessedMessages(one)
        with pytest.raises(StoreUnavailable):
            await marks.mark(
                consumer.name,
                fresh(),
                retention_s=1e300,
                wait_s=30.0,
                idle_timeout_s=60.0,
                acquire_timeout=1,
                waiting=lambda held: None,
            )
        assert one.pool.get_idle_size() == 1
    finally:
        await one.close()


@pytest.fixture
def probe_rollback_fails(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Arms ``mark_probe_rollback=error``: the ROLLBACK after a probe's 55P03 fails. The list
    holds the failpoints reached, in order."""
    from grpc_idempotency import failpoints
    from grpc_idempotency.core.failpoints import FailAction, Failpoint

    reached: list[str] = []
    hit = failpoints.hit

    async def recorded(name: str) -> None:
        reached.append(name)
        await hit(name)

    monkeypatch.setattr(failpoints, "_announced", True)  # no WARNING: armed on purpose
    monkeypatch.setattr(failpoints, "ENABLED", True)
    monkeypatch.setattr(failpoints, "_points", {"mark_probe_rollback": Failpoint(FailAction.ERROR)})
    monkeypatch.setattr(failpoints, "hit", recorded)
    return reached


async def test_a_probe_whose_rollback_fails_drops_its_connection_and_waits_on_another(
    pg_dsn: str, consumer: IdempotentConsumer, probe_rollback_fails: list[str]
) -> None:
    """The probe met the row held (55P03) and its ROLLBACK failed: the transaction's state is
    unknown, so the probe's connection is dropped, neither handed back to the pool nor kept for
    the wait (the wait then ran on a closed connection, failed, and the store replaced every
    connection of the pool as after a restart; kept unrolled back, it failed the delivery as
    StoreUnavailable). The wait goes on a connection acquired anew, and the duplicate is told
    so once its first delivery commits. A pool of two: the connection the probe did not use
    must be the one it was."""
    name = f"probe-rb-{uuid.uuid4().hex[:12]}"
    two = await Store.connect(
        pg_dsn, min_size=2, max_size=2, server_settings={"application_name": name}
    )
    admin = await asyncpg.connect(pg_dsn)
    message_id = fresh()
    gate, first = await held(consumer, message_id)
    told: list[bool] = []
    marking: asyncio.Task[Any] | None = None

    async def backends() -> set[int]:
        rows = await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1", name
        )
        return {row["pid"] for row in rows}

    try:
        before = await backends()
        assert len(before) == 2
        marking = asyncio.create_task(
            ProcessedMessages(two).mark(
                consumer.name,
                message_id,
                retention_s=60.0,
                wait_s=30.0,
                idle_timeout_s=60.0,
                acquire_timeout=10,
                waiting=told.append,
            )
        )

        async def waiting_on_the_row() -> int | None:
            pid: int | None = await admin.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
                " AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO %processed_messages%'",
                name,
            )
            return pid if told else None

        await until("the mark waiting on the held row", waiting_on_the_row)
        assert (told, probe_rollback_fails) == ([True], ["mark_probe_rollback"])
        # The probe's backend is gone, the other still there.
        assert len(before & await backends()) == 1
    finally:
        gate.release.set()
    try:
        assert (await first).outcome is Consumed.PROCESSED
        mark = await marking
        await mark.abandon(None)
        assert (mark.outcome, told) == (Consumed.DUPLICATE, [True, False])
        pool = two.pool
        # Nothing held. (The pool's size is 1 or 2 here: the wait may have taken the probe's
        # emptied slot, reconnecting it, or the other connection; asserting 2 failed under CI
        # load.)
        assert pool.get_idle_size() == pool.get_size()
        # Both connections taken (the emptied slot reconnects): the one the probe did not use
        # was not replaced.
        taken = [await pool.acquire(timeout=10) for _ in range(2)]
        pids = {conn.get_server_pid() for conn in taken}
        for conn in taken:
            await pool.release(conn)
        assert len(before & pids) == 1
    finally:
        await admin.close()
        await two.close()


async def test_the_probe_rollback_failpoint_is_the_probes_alone(
    store: Store, consumer: IdempotentConsumer, probe_rollback_fails: list[str]
) -> None:
    """``mark_probe_rollback`` stands for the probe's ROLLBACK only: a mark with no wait
    (wait_s 0, no probe) that meets the row held is MarkBusy, its ROLLBACK not the failpoint's
    (an armed ``error`` there would drop its connection, a probe's failure it never had)."""
    message_id = fresh()
    told: list[bool] = []
    gate, first = await held(consumer, message_id)
    try:
        with pytest.raises(MarkBusy):
            await ProcessedMessages(store).mark(
                consumer.name,
                message_id,
                retention_s=60.0,
                wait_s=0,
                idle_timeout_s=60.0,
                acquire_timeout=10,
                waiting=told.append,
            )
    finally:
        gate.release.set()
    assert (await first).outcome is Consumed.PROCESSED
    assert (told, probe_rollback_fails) == ([], [])


async def test_a_delivery_whose_probe_rollback_fails_runs_its_effect_once(
    store: Store, consumer: IdempotentConsumer, probe_rollback_fails: list[str]
) -> None:
    """Through the public API: the delivery waiting on a concurrent one whose effect then fails
    runs the effect itself, once, though its probe's ROLLBACK failed; no raw error escapes."""
    message_id = fresh()
    gate, first = await held(consumer, message_id, fail=True)
    # Another process's consumer, as it were: one of this one's waits for the first in-process.
    other = IdempotentConsumer(store, consumer.name)
    try:
        second = asyncio.create_task(other.process(message_id, write(other, message_id)))
        # Then the wait on the row, on a connection of its own: the probe's own 1 ms wait,
        # which a poll may catch, is over.
        await until("the probe's rollback to fail", lambda: probe_rollback_fails)
        await waiting_on_a_lock(store)
    finally:
        gate.release.set()
    with pytest.raises(RuntimeError, match="the effect failed after writing"):
        await first
    result = await second
    assert (result.outcome, result.duplicate) == (Consumed.PROCESSED, False)
    assert await effect_rows(store, consumer, message_id) == 1
