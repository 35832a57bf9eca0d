"""Every way a delivery to an ``IdempotentConsumer`` ends, counted as the interceptor's calls
are: one ``grpc_idempotency.consumer.messages`` count and one
``grpc_idempotency.consumer.process.duration`` sample per ``process`` / ``process_call`` (never
none, never two), one span, each with the consumer's name and the outcome. One table: each row
runs its deliveries under a consumer name of its own and says what each must be counted as."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, StatusCode

from grpc_idempotency import (
    KEY_HEADER,
    HandlerDatabaseError,
    KeyInvalid,
    KeyReused,
    Store,
    StoreUnavailable,
    Telemetry,
)
from grpc_idempotency.consumer import (
    Consumed,
    ConsumerOutcome,
    IdempotentConsumer,
    MessageInProgress,
)
from tests.integration.test_telemetry import _RaisingProcessor, _telemetry
from tests.integration.test_telemetry_outcomes import _metrics
from tests.support.broken_telemetry import RaisingMeterProvider
from tests.support.ledger import fresh
from tests.support.otel import attributes
from tests.support.waiting import until
from tests.support.wire import call_raw

NAME = "grpc_idempotency.consumer.name"
OUTCOME = "grpc_idempotency.consumer.outcome"
MESSAGE_ID = "grpc_idempotency.consumer.message_id"
RECORD = "/consumer_telemetry.Receiver/Record"

# (outcome, the message id on its span or None, the exception type it ended with or None)
Ended = list[tuple[str, str | None, str | None]]


@dataclass
class Env:
    store: Store
    telemetry: Telemetry
    consumer: IdempotentConsumer  # named for the row
    channel: grpc.aio.Channel  # to a method that consumes with the row's consumer's process_call
    receiving: list[IdempotentConsumer]  # the consumer that method uses: set by the row
    effect_spans: list[int]  # the span ids current in the effects that ran


def _effect(env: Env) -> Callable[[Any], Awaitable[None]]:
    async def effect(conn: Any) -> None:
        env.effect_spans.append(trace.get_current_span().get_span_context().span_id)
        await conn.execute("SELECT 1")

    return effect


class _Held:
    """An effect that holds its transaction open until released."""

    def __init__(self) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def __call__(self, conn: Any) -> None:
        self.entered.set()
        await self.release.wait()


async def processed_then_duplicate(env: Env) -> Ended:
    message_id = fresh()
    first = await env.consumer.process(message_id, _effect(env))
    again = await env.consumer.process(message_id, _effect(env))
    assert (first.outcome, again.outcome) == (Consumed.PROCESSED, Consumed.DUPLICATE)
    return [("processed", message_id, None), ("duplicate", message_id, None)]


async def payload_reused(env: Env) -> Ended:
    message_id = fresh()
    await env.consumer.process(message_id, _effect(env), payload=b"one")
    with pytest.raises(KeyReused):
        await env.consumer.process(message_id, _effect(env), payload=b"two")
    return [("processed", message_id, None), ("mismatch", message_id, "KeyReused")]


async def in_progress_elsewhere(env: Env) -> Ended:
    """Given up on while another delivery holds the id: in this process (its wait's timeout)
    and in another (max_wait=0: a 1 ms lock wait on the row)."""
    message_id, held = fresh(), _Held()
    replica = IdempotentConsumer(
        env.store, env.consumer.name, max_wait=timedelta(0), telemetry=env.telemetry
    )
    first = asyncio.create_task(env.consumer.process(message_id, held))
    await held.entered.wait()
    try:
        for waiter, timeout in ((env.consumer, 0.0), (replica, None)):
            with pytest.raises(MessageInProgress):
                await waiter.process(message_id, _effect(env), timeout=timeout)
    finally:
        held.release.set()
    assert (await first).outcome is Consumed.PROCESSED
    busy = ("conflict", message_id, "MessageInProgress")
    return [busy, busy, ("processed", message_id, None)]


async def effect_raises(env: Env) -> Ended:
    """The effect's exception, a library error of its own too (a nested consumer's), and one
    it caught from a failed statement (HandlerDatabaseError at the commit): nothing marked."""
    ended: Ended = []
    for error in (RuntimeError("effect failed"), KeyReused("a nested consumer's")):

        async def failing(conn: Any, error: Exception = error) -> None:
            raise error

        message_id = fresh()
        with pytest.raises(type(error)):
            await env.consumer.process(message_id, failing)
        ended.append(("released", message_id, type(error).__name__))

    async def caught(conn: Any) -> None:
        with contextlib.suppress(Exception):
            await conn.execute("SELECT 1/0")

    message_id = fresh()
    with pytest.raises(HandlerDatabaseError):
        await env.consumer.process(message_id, caught)
    return [*ended, ("released", message_id, "HandlerDatabaseError")]


async def cancelled(env: Env) -> Ended:
    message_id, held = fresh(), _Held()
    delivery = asyncio.create_task(env.consumer.process(message_id, held))
    await held.entered.wait()
    delivery.cancel()
    with pytest.raises(asyncio.CancelledError):
        await delivery
    return [("released", message_id, "CancelledError")]


async def cancelled_while_waiting(env: Env) -> Ended:
    """Cancelled while another delivery of the id runs in this process: "conflict" (the id was
    busy), as the server counts a caller that left while waiting on another attempt; it was
    "released", the label of an effect that failed, though no effect had run."""
    message_id, held = fresh(), _Held()
    first = asyncio.create_task(env.consumer.process(message_id, held))
    await held.entered.wait()
    waiter = asyncio.create_task(env.consumer.process(message_id, _effect(env)))
    # One turn of the loop runs the waiter to its first await, the wait on the first delivery
    # (nothing before it awaits): cancelled there, not before it started.
    await asyncio.sleep(0)
    assert not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    held.release.set()
    assert (await first).outcome is Consumed.PROCESSED
    return [("conflict", message_id, "CancelledError"), ("processed", message_id, None)]


async def cancelled_while_waiting_on_another_process(env: Env) -> Ended:
    """Cancelled while another process's delivery of the id holds its row (a replica: a
    consumer of its own, whose deliveries this one's do not know of): "conflict", as above, not
    "released". The mark waits on the row in a statement of its own, after one that does not
    wait (lock_timeout 1ms): cancelled in that one, the wait is told from the statement's own
    time."""
    message_id, held = fresh(), _Held()
    replica = IdempotentConsumer(
        env.store, env.consumer.name, max_wait=timedelta(seconds=30), telemetry=env.telemetry
    )
    first = asyncio.create_task(env.consumer.process(message_id, held))
    await held.entered.wait()
    waiter = asyncio.create_task(replica.process(message_id, _effect(env)))

    async def waiting_on_the_row() -> bool:
        # The mark's statement waiting on the row's lock with the consumer's wait (not 1ms).
        found: bool = await env.store.pool.fetchval(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_stat_activity WHERE wait_event_type ="
            " 'Lock' AND strpos(query, $1) > 0 AND strpos(query, $2) = 0)",
            message_id,
            "'1ms'",
        )
        return found

    await until("the replica's mark waiting on the row", waiting_on_the_row)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    held.release.set()
    assert (await first).outcome is Consumed.PROCESSED
    return [("conflict", message_id, "CancelledError"), ("processed", message_id, None)]


async def cancelled_waiting_for_a_connection(env: Env) -> Ended:
    """Cancelled while its mark waits for a pooled connection (every one in use), no other
    delivery of the id anywhere: "released", the delivery's own time, not "conflict" (which
    only a wait on the id's row, here or in another process, is)."""
    message_id = fresh()
    pool = env.store.pool
    held = [await pool.acquire() for _ in range(pool.get_max_size())]
    try:
        delivery = asyncio.create_task(env.consumer.process(message_id, _effect(env)))
        # Registered as running here just before its mark asks the pool for a connection.
        await until("the delivery's mark", lambda: message_id in env.consumer._running)
        delivery.cancel()
        with pytest.raises(asyncio.CancelledError):
            await delivery
    finally:
        for conn in held:
            await pool.release(conn)
    return [("released", message_id, "CancelledError")]


async def expired_mark_taken_over(env: Env) -> Ended:
    """A delivery past the id's retention runs the effect again, over the expired mark:
    "reprocessed" (counted "processed" as a new id was, though the effect ran a second time),
    while ``process`` says ``PROCESSED`` as before. Only once it committed: a takeover whose
    effect raised is "released", one whose commit failed "unavailable" (nothing marked either
    time: the mark stays expired for the next)."""
    message_id = fresh()
    await env.consumer.process(message_id, _effect(env))
    await env.store.pool.execute(
        f"UPDATE {env.store.schema}.processed_messages"
        " SET expires_at = clock_timestamp() - interval '1 second'"
        " WHERE consumer = $1 AND message_id = $2",
        env.consumer.name,
        message_id,
    )

    async def failing(conn: Any) -> None:
        raise RuntimeError("effect failed")

    async def ends_its_transaction(conn: Any) -> None:
        # The mark rolled back under the commit, which refuses it (StoreUnavailable).
        await conn.execute("ROLLBACK; BEGIN")

    with pytest.raises(RuntimeError):
        await env.consumer.process(message_id, failing)
    with pytest.raises(StoreUnavailable):
        await env.consumer.process(message_id, ends_its_transaction)
    again = await env.consumer.process(message_id, _effect(env))
    assert again.outcome is Consumed.PROCESSED
    return [
        ("processed", message_id, None),
        ("released", message_id, "RuntimeError"),
        ("unavailable", message_id, "StoreUnavailable"),
        ("reprocessed", message_id, None),
    ]


async def store_failed(env: Env) -> Ended:
    """The effect's connection lost under it (its backend terminated), and a mark the database
    refuses (a schema never migrated): StoreUnavailable, nothing marked."""

    async def lose_the_connection(conn: Any) -> None:
        await conn.execute("SELECT pg_catalog.pg_terminate_backend(pg_catalog.pg_backend_pid())")

    lost = fresh()
    with pytest.raises(StoreUnavailable):
        await env.consumer.process(lost, lose_the_connection)
    unmigrated = IdempotentConsumer(
        Store(env.store.pool, schema="no_such_schema"), env.consumer.name, telemetry=env.telemetry
    )
    refused = fresh()
    with pytest.raises(StoreUnavailable):
        await unmigrated.process(refused, _effect(env))
    return [
        ("unavailable", lost, "StoreUnavailable"),
        ("unavailable", refused, "StoreMisconfigured"),  # a StoreUnavailable
    ]


async def rejected(env: Env) -> Ended:
    """Refused before the store is asked: no message id on the span (a malformed one might not
    even be exportable), whatever was valid of it."""
    with pytest.raises(KeyInvalid):
        await env.consumer.process("", _effect(env))
    with pytest.raises(ValueError, match="timeout"):
        await env.consumer.process(fresh(), _effect(env), timeout=-1)
    return [("rejected", None, "KeyInvalid"), ("rejected", None, "ValueError")]


async def over_grpc(env: Env) -> Ended:
    """``process_call``: one count and one span per call, not one more for the ``process`` it
    runs; a library error counted as itself, not as the AbortError that answers it."""
    env.receiving.append(env.consumer)
    key, reused = fresh(), fresh()
    ok = await call_raw(env.channel, RECORD, _Raw(), ((KEY_HEADER, key),))
    again = await call_raw(env.channel, RECORD, _Raw(), ((KEY_HEADER, key),))
    missing = await call_raw(env.channel, RECORD, _Raw(), ())
    first = await call_raw(env.channel, RECORD, _Raw(b"one"), ((KEY_HEADER, reused),))
    other = await call_raw(env.channel, RECORD, _Raw(b"two"), ((KEY_HEADER, reused),))
    assert [ok.body, again.body, first.body] == [b"processed", b"duplicate", b"processed"]
    assert missing.code is grpc.StatusCode.INVALID_ARGUMENT
    assert other.code is grpc.StatusCode.FAILED_PRECONDITION
    return [
        ("processed", key, None),
        ("duplicate", key, None),
        ("rejected", None, "KeyMissing"),
        ("processed", reused, None),
        ("mismatch", reused, "KeyReused"),
    ]


ROWS: list[Callable[[Env], Awaitable[Ended]]] = [
    processed_then_duplicate,
    payload_reused,
    in_progress_elsewhere,
    effect_raises,
    cancelled,
    cancelled_while_waiting,
    cancelled_while_waiting_on_another_process,
    cancelled_waiting_for_a_connection,
    expired_mark_taken_over,
    store_failed,
    rejected,
    over_grpc,
]


class _Raw:
    """A request that is already bytes (call_raw serializes with SerializeToString)."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[grpc.aio.Channel, list[IdempotentConsumer]]]:
    """A raw-bytes method that consumes each call with the last consumer in the list, its
    body (if any) as the delivery's payload."""
    receiving: list[IdempotentConsumer] = []

    async def record(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        async def effect(conn: Any) -> None:
            await conn.execute("SELECT 1")

        result = await receiving[-1].process_call(context, effect, payload=request or None)
        return result.outcome.value.encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "consumer_telemetry.Receiver",
                {"Record": grpc.unary_unary_rpc_method_handler(record)},
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, receiving
    finally:
        await channel.close(None)
        await server.stop(None)


def _counts(reader: InMemoryMetricReader, name: str) -> Counter[tuple[str, str]]:
    """``name``'s counts (a counter's value, a histogram's samples) by (consumer, outcome)."""
    found: Counter[tuple[str, str]] = Counter()
    for p in _metrics(reader, name):
        label = (str(attributes(p)[NAME]), str(attributes(p)[OUTCOME]))
        assert set(attributes(p)) == {NAME, OUTCOME}  # never the message id: unbounded
        found[label] += int(p.count if isinstance(p, HistogramDataPoint) else p.value)
    return found


async def test_each_way_a_delivery_ends_is_counted_once_with_its_outcome(
    store: Store, receiver: tuple[grpc.aio.Channel, list[IdempotentConsumer]]
) -> None:
    telemetry, spans, reader = _telemetry(record_key=True)
    channel, receiving = receiver
    effect_spans: list[int] = []
    expected: dict[str, Ended] = {}
    for row in ROWS:
        consumer = IdempotentConsumer(store, fresh(row.__name__), telemetry=telemetry)
        env = Env(store, telemetry, consumer, channel, receiving, effect_spans)
        expected[consumer.name] = await row(env)

    want = Counter((name, outcome) for name, ended in expected.items() for outcome, _, _ in ended)
    # Every outcome has its row: one added without a row fails here.
    assert {outcome for _, outcome in want} == {o.value for o in ConsumerOutcome}
    await until("every span ended", lambda: len(spans.get_finished_spans()) >= want.total())
    assert _counts(reader, "grpc_idempotency.consumer.messages") == want
    assert _counts(reader, "grpc_idempotency.consumer.process.duration") == want
    seconds = sum(p.sum for p in _metrics(reader, "grpc_idempotency.consumer.process.duration"))
    assert 0 < seconds < 30  # seconds, not milliseconds

    finished = spans.get_finished_spans()
    got = Counter(
        (
            str(attributes(s)[NAME]),
            str(attributes(s)[OUTCOME]),
            cast(str | None, attributes(s).get(MESSAGE_ID)),
            s.status.description,
        )
        for s in finished
    )
    assert got == Counter(
        (
            name,
            outcome,
            message_id,
            # An error span when the effect or the store failed, naming what was raised.
            f"{outcome} ({error})" if outcome in ("released", "unavailable") else None,
        )
        for name, ended in expected.items()
        for outcome, message_id, error in ended
    )
    for span in finished:
        assert span.name == f"grpc_idempotency process {attributes(span)[NAME]!s}"
        assert span.kind is SpanKind.INTERNAL
        failed = attributes(span)[OUTCOME] in ("released", "unavailable")
        assert span.status.status_code is (StatusCode.ERROR if failed else StatusCode.UNSET)
    # The effect runs inside its delivery's span: its database spans nest there.
    processed = {
        s.context.span_id
        for s in finished
        if attributes(s)[OUTCOME] in ("processed", "reprocessed")
    }
    assert effect_spans and set(effect_spans) <= processed


async def test_the_message_id_is_kept_off_spans_unless_asked_and_broken_telemetry_changes_nothing(
    store: Store,
) -> None:
    telemetry, spans, _ = _telemetry()  # record_key=False
    consumer = IdempotentConsumer(store, fresh("private"), telemetry=telemetry)
    await consumer.process(fresh(), lambda conn: conn.execute("SELECT 1"))
    (span,) = spans.get_finished_spans()
    assert attributes(span)[OUTCOME] == "processed" and MESSAGE_ID not in attributes(span)

    # A span processor raising as spans start and end, and instruments raising: logged, and the
    # deliveries end as without telemetry.
    for where in ("start", "end"):
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(_RaisingProcessor(where))
        broken = Telemetry(tracer_provider=tracer_provider, meter_provider=RaisingMeterProvider())
        consumer = IdempotentConsumer(store, fresh("broken"), telemetry=broken)
        message_id = fresh()
        first = await consumer.process(message_id, lambda conn: conn.execute("SELECT 1"))
        again = await consumer.process(message_id, lambda conn: conn.execute("SELECT 1"))
        assert (first.outcome, again.outcome) == (Consumed.PROCESSED, Consumed.DUPLICATE)

        async def failing(conn: Any) -> None:
            raise LookupError("the effect's own")

        with pytest.raises(LookupError, match="the effect's own"):
            await consumer.process(fresh(), failing)
