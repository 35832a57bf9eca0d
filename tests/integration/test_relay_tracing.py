"""The relay's delivery spans: the trace of the handler that enqueued a message continues, by a
link, in the span of each delivery attempt (migration 0018 keeps the handler's context in the
row). With the real OpenTelemetry SDK, a real handler behind the interceptor, and a real relay."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    PermanentDeliveryError,
    Store,
    StoreUnavailable,
    Telemetry,
    current_call,
)
from grpc_idempotency.outbox import CallableSink, OutboxMessage, OutboxStore, Relay
from grpc_idempotency.telemetry import linked_context
from tests.support.ledger import TENANT, fresh, ledger_server, metadata, prepare, running_ledger
from tests.support.schemas import fresh_store
from tests.support.wire import call_raw

WITH_EVENT = "/testsvc.v1.LedgerService/PostWithEvent"
STEP = "entry-posted.v1"


@pytest.fixture
async def outbox(pg_dsn: str) -> AsyncIterator[Store]:
    """A store on a fresh schema: no other test's row reaches these relays."""
    async with fresh_store(pg_dsn, "trace", max_size=6) as store:
        await prepare(store)  # the handler's ledger table
        yield store


def _tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider, spans


async def _enqueue(store: Store, telemetry: Telemetry | None) -> str:
    """A keyed call whose handler enqueues its event; the outbox row's trace_context."""
    options: dict[str, Any] = {} if telemetry is None else {"telemetry": telemetry}
    key = fresh()
    async with running_ledger(store, **options) as ledger:
        answer = await ledger.call(WITH_EVENT, testsvc_pb2.PostRequest(account=fresh("a")), key)
    assert answer.code.name == "OK", answer.details
    stored: str | None = await store.pool.fetchval(
        f'SELECT trace_context::text FROM "{store.schema}".outbox WHERE parent_key = $1', key
    )
    return stored  # type: ignore[return-value]


def _deliveries(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == f"grpc_idempotency deliver {STEP}"]


async def test_a_delivery_span_links_to_the_handler_span_that_enqueued_the_message(
    outbox: Store,
) -> None:
    provider, spans = _tracing()
    stored = await _enqueue(outbox, Telemetry(tracer_provider=provider))
    (handler,) = [s for s in spans.get_finished_spans() if s.name.endswith("/PostWithEvent")]
    assert handler.context is not None
    assert "traceparent" in json.loads(stored)  # W3C, the global propagator's default

    current: list[trace.SpanContext] = []

    def record(message: OutboxMessage) -> None:
        current.append(trace.get_current_span().get_span_context())

    relay = Relay(outbox, CallableSink(record), tracer_provider=provider, listen=False)
    assert await relay.run_once() == 1
    (delivery,) = _deliveries(spans)
    assert delivery.kind is SpanKind.PRODUCER
    # Linked, not parented: a delivery can come long after the call, and again.
    assert delivery.parent is None
    assert delivery.context.trace_id != handler.context.trace_id
    (link,) = delivery.links
    assert (link.context.trace_id, link.context.span_id) == (
        handler.context.trace_id,
        handler.context.span_id,
    )
    row_id = await outbox.pool.fetchval(f'SELECT id FROM "{outbox.schema}".outbox')
    assert dict(delivery.attributes or {}) == {
        "grpc_idempotency.outbox.step": STEP,
        "grpc_idempotency.outbox.attempt": 1,
        "grpc_idempotency.outbox.row_id": row_id,
        "grpc_idempotency.outbox.outcome": "sent",
        # The messaging conventions of a span sending one message, to the step.
        "messaging.system": "grpc_idempotency",
        "messaging.operation.type": "send",
        "messaging.operation.name": "deliver",
        "messaging.destination.name": STEP,
    }
    assert delivery.status.status_code is StatusCode.UNSET
    # Current while the sink ran: an instrumented client's span nests in it.
    assert current == [delivery.context]


async def test_no_span_context_stores_null_and_a_failed_delivery_is_an_error_to_retry(
    outbox: Store,
) -> None:
    """A handler with no span (no telemetry, no global provider): the row's trace_context is
    NULL and the delivery's span links to nothing. The sink raises: ERROR naming the class,
    outcome retry."""
    assert await _enqueue(outbox, None) is None
    provider, spans = _tracing()

    def refuse(message: OutboxMessage) -> None:
        raise ConnectionResetError("receiver gone")

    relay = Relay(outbox, CallableSink(refuse), tracer_provider=provider, listen=False)
    assert await relay.run_once() == 0
    assert relay.stats.retried == 1
    (delivery,) = _deliveries(spans)
    assert delivery.links == ()
    assert (delivery.attributes or {})["grpc_idempotency.outbox.outcome"] == "retry"
    assert delivery.status.status_code is StatusCode.ERROR
    assert delivery.status.description == "retry (ConnectionResetError)"


class _RaisingTracerProvider(trace.TracerProvider):
    """A tracer provider (the API lets users bring their own) whose spans fail to start."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        class Tracer(trace.NoOpTracer):
            def start_span(self, *a: Any, **k: Any) -> trace.Span:
                raise RuntimeError("tracer bug")

        return Tracer()


async def test_a_tracer_that_raises_does_not_change_a_delivery(outbox: Store) -> None:
    provider, _ = _tracing()
    await _enqueue(outbox, Telemetry(tracer_provider=provider))  # a context to link to
    delivered: list[str] = []
    relay = Relay(
        outbox,
        CallableSink(lambda m: delivered.append(m.key)),
        tracer_provider=_RaisingTracerProvider(),
        listen=False,
    )
    assert await relay.run_once() == 1
    assert len(delivered) == 1 and relay.stats.delivered == 1
    state = await outbox.pool.fetchval(f'SELECT state FROM "{outbox.schema}".outbox')
    assert state == "sent"


def test_tracer_provider_is_checked() -> None:
    with pytest.raises(TypeError, match="tracer_provider must be an OpenTelemetry"):
        Relay(object(), CallableSink(print), tracer_provider=trace.get_tracer(__name__))  # type: ignore[arg-type]


async def test_a_batch_whose_outcomes_cannot_be_recorded_ends_its_spans_unrecorded(
    outbox: Store,
) -> None:
    """The database refuses the outcomes (here a constraint the sink adds): the rows are left
    to the lease, so their spans say "unrecorded", as RelayStats does, not "sent" or "retry";
    the failed delivery's span is an ERROR all the same."""
    await _enqueue(outbox, None)
    await _enqueue(outbox, None)
    provider, spans = _tracing()
    table = f'"{outbox.schema}".outbox'
    first: list[int] = []

    async def deliver(message: OutboxMessage) -> None:
        if not first:
            first.append(message.id)
            await outbox.pool.execute(
                f"ALTER TABLE {table} ADD CONSTRAINT no_sent CHECK (state <> 'sent') NOT VALID"
            )
            return
        raise ConnectionResetError("receiver gone")

    relay = Relay(outbox, CallableSink(deliver), tracer_provider=provider, listen=False)
    try:
        with pytest.raises(StoreUnavailable, match="marking outbox rows sent"):
            await relay.run_once()  # one batch: one row sent, one failed, neither recorded
    finally:
        await outbox.pool.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS no_sent")
    assert relay.stats.unrecorded == 2
    ended = {(d.attributes or {})["grpc_idempotency.outbox.row_id"]: d for d in _deliveries(spans)}
    assert len(ended) == 2
    for row_id, delivery in ended.items():
        assert (delivery.attributes or {})["grpc_idempotency.outbox.outcome"] == "unrecorded"
        if row_id in first:
            assert delivery.status.status_code is StatusCode.UNSET
        else:
            assert delivery.status.description == "unrecorded (ConnectionResetError)"


@pytest.mark.parametrize(
    ("failure", "failed"),
    [(ConnectionResetError("receiver gone"), "retry"), (PermanentDeliveryError("no"), "dead")],
)
async def test_a_delivery_whose_claim_was_taken_over_ends_its_span_unrecorded(
    outbox: Store, failure: Exception, failed: str
) -> None:
    """Two of four rows lose their claim while the sink runs (their lease expires and another
    relay claims them): the marks leave them out (fenced by attempts) and they are delivered
    again, so their spans say "unrecorded", as RelayStats counts them, not "sent" or
    "retry" (or "dead": a dead letter's mark is fenced too); the failed one's span is an ERROR
    all the same."""
    for _ in range(4):
        await _enqueue(outbox, None)
    table = f'"{outbox.schema}".outbox'
    ids = [r["id"] for r in await outbox.pool.fetch(f"SELECT id FROM {table} ORDER BY id")]
    kept_sent, lost_sent, kept_failed, lost_failed = ids
    lost = {lost_sent, lost_failed}
    provider, spans = _tracing()
    taken: list[int] = []
    takeover = asyncio.Lock()

    async def deliver(message: OutboxMessage) -> None:
        async with takeover:  # the first delivery in takes both rows over, before any mark
            if not taken:
                await outbox.pool.execute(
                    f"UPDATE {table} SET locked_until = clock_timestamp() - interval '1 s',"
                    " next_attempt_at = clock_timestamp() - interval '1 s'"
                    " WHERE id = ANY($1::bigint[])",
                    list(lost),
                )
                usurper = OutboxStore(outbox)
                for _ in lost:  # a lost row is claimed alone
                    (claimed,) = await usurper.claim(relay="usurper", limit=10, lease_s=30)
                    taken.append(claimed.id)
        if message.id in (kept_failed, lost_failed):
            raise failure

    relay = Relay(outbox, CallableSink(deliver), tracer_provider=provider, listen=False)
    assert await relay.run_once() == 1
    assert set(taken) == lost
    stats = relay.stats
    assert (stats.delivered, stats.retried + stats.dead, stats.unrecorded) == (1, 1, 2)
    ended = {(d.attributes or {})["grpc_idempotency.outbox.row_id"]: d for d in _deliveries(spans)}
    outcomes = {
        i: (d.attributes or {})["grpc_idempotency.outbox.outcome"] for i, d in ended.items()
    }
    assert outcomes == {
        kept_sent: "sent",
        lost_sent: "unrecorded",
        kept_failed: failed,
        lost_failed: "unrecorded",
    }
    assert ended[lost_sent].status.status_code is StatusCode.UNSET
    assert ended[lost_failed].status.description == f"unrecorded ({type(failure).__name__})"
    # The usurper's claims stand: the rows are pending under it, to be delivered again.
    rows = await outbox.pool.fetch(
        f"SELECT state, claimed_by, attempts FROM {table} WHERE id = ANY($1::bigint[])", list(lost)
    )
    assert [tuple(r) for r in rows] == [("pending", "usurper", 2)] * 2


async def test_a_sent_row_taken_over_ends_unrecorded_when_the_failures_cannot_be_recorded(
    outbox: Store,
) -> None:
    """The sent rows are marked, then the failures' mark fails (a constraint refusing their
    error): a sent row whose claim was taken over meanwhile still ends "unrecorded", as
    RelayStats counts it, not "sent" (its span's outcome was fixed only after both marks)."""
    await _enqueue(outbox, None)
    await _enqueue(outbox, None)
    table = f'"{outbox.schema}".outbox'
    lost, failed = [r["id"] for r in await outbox.pool.fetch(f"SELECT id FROM {table} ORDER BY id")]
    provider, spans = _tracing()
    taken = asyncio.Event()

    async def deliver(message: OutboxMessage) -> None:
        if message.id == lost:
            await outbox.pool.execute(
                f"UPDATE {table} SET locked_until = clock_timestamp() - interval '1 s',"
                " next_attempt_at = clock_timestamp() - interval '1 s' WHERE id = $1",
                lost,
            )
            (claimed,) = await OutboxStore(outbox).claim(relay="usurper", limit=10, lease_s=30)
            assert claimed.id == lost
            await outbox.pool.execute(
                f"ALTER TABLE {table} ADD CONSTRAINT no_gone"
                " CHECK (last_error NOT LIKE '%receiver gone%') NOT VALID"
            )
            taken.set()
            return
        await taken.wait()
        raise ConnectionResetError("receiver gone")

    relay = Relay(outbox, CallableSink(deliver), tracer_provider=provider, listen=False)
    try:
        with pytest.raises(StoreUnavailable, match="recording failed deliveries"):
            await relay.run_once()
    finally:
        await outbox.pool.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS no_gone")
    assert (relay.stats.delivered, relay.stats.unrecorded) == (0, 2)
    ended = {(d.attributes or {})["grpc_idempotency.outbox.row_id"]: d for d in _deliveries(spans)}
    outcomes = {
        i: (d.attributes or {})["grpc_idempotency.outbox.outcome"] for i, d in ended.items()
    }
    assert outcomes == {lost: "unrecorded", failed: "unrecorded"}


async def test_an_unreadable_carrier_and_a_relay_cancelled_mid_delivery(outbox: Store) -> None:
    """A carrier the propagator cannot read (edited by hand): the span goes without its link.
    The relay cancelled while the sink runs: the spans end once, not left open: the delivery
    still running "unrecorded" (its claim given back), and the one done already, whose span
    waited for the batch to record it, "sent" (the cancelled relay records it first)."""
    await _enqueue(outbox, None)
    await _enqueue(outbox, None)
    await outbox.pool.execute(
        f"""UPDATE "{outbox.schema}".outbox SET trace_context = '{{"traceparent": 5}}'"""
    )
    provider, spans = _tracing()
    entered, done = asyncio.Event(), asyncio.Event()

    async def hang(message: OutboxMessage) -> None:
        if done.is_set():
            entered.set()
            await asyncio.Event().wait()
        done.set()  # the first delivery returns at once

    relay = Relay(outbox, CallableSink(hang), tracer_provider=provider, listen=False)
    running = asyncio.create_task(relay.run_once())
    await asyncio.wait_for(entered.wait(), 10)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    ended = _deliveries(spans)
    assert len(ended) == 2
    outcomes = {
        (d.attributes or {})["grpc_idempotency.outbox.row_id"]: str(
            (d.attributes or {})["grpc_idempotency.outbox.outcome"]
        )
        for d in ended
    }
    assert all(delivery.links == () for delivery in ended)
    states = {
        r["id"]: r["state"]
        for r in await outbox.pool.fetch(f'SELECT id, state FROM "{outbox.schema}".outbox')
    }
    assert sorted(outcomes.values()) == ["sent", "unrecorded"], outcomes
    assert {states[i] for i, o in outcomes.items() if o == "sent"} == {"sent"}
    assert {states[i] for i, o in outcomes.items() if o == "unrecorded"} == {"pending"}


async def test_no_tracer_provider_no_span(outbox: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing records spans (no provider given, none set globally): the relay makes none."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.delenv("OTEL_PYTHON_TRACER_PROVIDER", raising=False)
    await _enqueue(outbox, None)
    started: list[OutboxMessage] = []
    monkeypatch.setattr(Relay, "_start_span", lambda self, message: started.append(message))
    relay = Relay(outbox, CallableSink(lambda m: None), listen=False)
    assert await relay.run_once() == 1
    assert started == []


class _SyncHandler(testsvc_pb2_grpc.LedgerServiceServicer):  # type: ignore[misc]
    """PostWithEvent as a sync (def) handler, enqueuing in a span of its own, on its thread."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        self.own: list[trace.SpanContext] = []

    def PostWithEvent(self, request: Any, context: Any) -> Any:
        event = testsvc_pb2.PostResponse(account=request.account)
        call = current_call()
        with self.tracer.start_as_current_span("the handler's own") as span:
            self.own.append(span.get_span_context())
            enqueued = call.enqueue(STEP, event)
        call.run(enqueued)  # run after its span ended: the context was read at the call
        return event


async def test_a_sync_handler_enqueues_with_the_span_current_on_its_thread(outbox: Store) -> None:
    """The context is read where the handler calls enqueue, on its worker thread: the span it
    made there, current then, not the interceptor's, current when the enqueue runs."""
    provider, _ = _tracing()
    service = _SyncHandler(provider.get_tracer(__name__))
    interceptor = IdempotencyInterceptor(
        outbox,
        services=[testsvc_pb2],
        scope=MetadataScope(TENANT),
        telemetry=Telemetry(tracer_provider=provider),
    )
    key = fresh()
    async with ledger_server(interceptor, service) as (channel, _):
        request = testsvc_pb2.PostRequest(account=fresh("a"))
        answer = await call_raw(channel, WITH_EVENT, request, metadata(key), timeout=5.0)
    assert answer.code.name == "OK", answer.details
    stored = await outbox.pool.fetchval(
        f'SELECT trace_context::text FROM "{outbox.schema}".outbox WHERE parent_key = $1', key
    )
    (own,) = service.own
    linked = linked_context(stored)
    assert linked is not None and (linked.trace_id, linked.span_id) == (
        own.trace_id,
        own.span_id,
    )
