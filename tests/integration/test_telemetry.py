"""Spans and metrics through opentelemetry-api; and the library working with no SDK at all."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from typing import Any, cast

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Histogram, InMemoryMetricReader, MetricsData, Sum
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    Isolation,
    MetadataScope,
    MethodOverride,
    Store,
    Telemetry,
    current_call,
)
from grpc_idempotency.testing import EmbeddedPostgres
from tests.integration.test_contract_strengthened import RawBytes
from tests.support.broken_telemetry import RaisingMeterProvider
from tests.support.ledger import fresh, ledger_server, metadata, running_ledger
from tests.support.otel import attributes
from tests.support.waiting import until
from tests.support.wire import call_raw

POST = "/testsvc.v1.LedgerService/Post"
OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"
RPC = {"rpc.system": "grpc", "rpc.service": "testsvc.v1.LedgerService", "rpc.method": "Post"}


def _telemetry(**options: bool) -> tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    telemetry = Telemetry(
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
        **options,
    )
    return telemetry, spans, reader


async def test_one_span_per_keyed_call_with_its_outcome(store: Store) -> None:
    telemetry, spans, reader = _telemetry()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        key, account = fresh(), fresh("acct")
        request = testsvc_pb2.PostRequest(account=account)
        await ledger.call(POST, request, key)
        await ledger.call(POST, request, key)
        await ledger.call(POST, testsvc_pb2.PostRequest(account="other"), key)
        await ledger.call(POST, request, "bad key")
        await ledger.call(
            POST, testsvc_pb2.PostRequest(account=account, behaviour="raise"), fresh()
        )
        await ledger.call("/testsvc.v1.LedgerService/Peek", testsvc_pb2.PeekRequest(), None)

    finished = spans.get_finished_spans()
    outcomes = [attributes(s)["grpc_idempotency.outcome"] for s in finished]
    assert outcomes == ["executed", "replayed", "mismatch", "rejected", "released"]  # Peek: no span
    # The RPC semantic conventions: rpc.method is the method's own name, without any slash.
    assert all(s.name == "grpc_idempotency testsvc.v1.LedgerService/Post" for s in finished)
    assert all({k: attributes(s)[k] for k in RPC} == RPC for s in finished)
    codes = [attributes(s)["rpc.grpc.status_code"] for s in finished]
    assert codes == [0, 0, 9, 3, 2]  # OK, OK, FAILED_PRECONDITION, INVALID_ARGUMENT, UNKNOWN
    # Only the server's own failure (the handler raised: UNKNOWN) is an error span.
    assert [s.status.status_code for s in finished] == [StatusCode.UNSET] * 4 + [StatusCode.ERROR]
    # Key and scope can identify a customer: not recorded unless asked for.
    assert not any("grpc_idempotency.key" in attributes(s) for s in finished)
    assert not any("grpc_idempotency.scope" in attributes(s) for s in finished)

    data = cast(MetricsData, reader.get_metrics_data())  # None only if nothing was recorded
    metrics = {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    points = cast(Sum, metrics["grpc_idempotency.calls"].data).data_points
    counted = {dict(attributes(p))["grpc_idempotency.outcome"]: p.value for p in points}
    assert all({k: dict(attributes(p))[k] for k in RPC} == RPC for p in points)
    assert not any("grpc_idempotency.key" in dict(attributes(p)) for p in points)
    assert counted == {"executed": 1, "replayed": 1, "mismatch": 1, "rejected": 1, "released": 1}
    histogram = cast(Histogram, metrics["grpc_idempotency.call.duration"].data).data_points
    assert sum(p.count for p in histogram) == 5
    assert metrics["grpc_idempotency.call.duration"].unit == "s"


async def test_a_handler_that_overruns_the_deadline_is_recorded_as_deadline_exceeded(
    store: Store,
) -> None:
    # grpc.aio cancels the handler when the deadline passes, as when the client cancels; what
    # the client sees, and what telemetry must say, is DEADLINE_EXCEEDED.
    telemetry, spans, reader = _telemetry()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait")
        try:
            answer = await ledger.call(POST, request, fresh(), timeout=0.5)
            assert answer.code == grpc.StatusCode.DEADLINE_EXCEEDED
            (span,) = await until("the call's span", spans.get_finished_spans)
        finally:
            ledger.service.release.set()
    assert attributes(span)["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert span.status.status_code is StatusCode.ERROR
    data = cast(MetricsData, reader.get_metrics_data())  # None only if nothing was recorded
    (point,) = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "grpc_idempotency.calls"
        for p in m.data.data_points
    ]
    assert attributes(point)["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


async def test_a_call_the_client_cancels_is_recorded_as_cancelled(store: Store) -> None:
    telemetry, spans, _ = _telemetry()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait")
        stub = ledger.channel.unary_unary(
            POST, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
        )
        call = stub(request, metadata=metadata(fresh(), "tenant-a"), timeout=30)
        try:
            await ledger.service.started.wait()
            call.cancel()
            (span,) = await until("the call's span", spans.get_finished_spans)
        finally:
            ledger.service.release.set()
    assert attributes(span)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert span.status.status_code is StatusCode.UNSET


def test_works_without_the_opentelemetry_sdk(pg_dsn: str) -> None:
    """In a fresh interpreter where importing opentelemetry.sdk fails, a keyed call still runs
    (the API's no-op providers), and the library never imported the SDK."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        class NoSdk:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry.sdk" or name.startswith("opentelemetry.sdk."):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, NoSdk())
        import grpc
        from testsvc.v1 import testsvc_pb2
        from grpc_idempotency import Store
        from tests.support.ledger import running_ledger, metadata, fresh, prepare
        from tests.support.wire import call_raw

        async def main():
            store = await Store.connect(sys.argv[1], migrate=True)
            await prepare(store)
            async with running_ledger(store) as ledger:
                key = fresh()
                req = testsvc_pb2.PostRequest(account=fresh())
                a = await ledger.call("/testsvc.v1.LedgerService/Post", req, key)
                b = await ledger.call("/testsvc.v1.LedgerService/Post", req, key)
                assert a.code == grpc.StatusCode.OK and b.replayed, (a, b)
            await store.close()
            assert not any(m.startswith("opentelemetry.sdk") for m in sys.modules)
            print("NO-SDK-OK")

        asyncio.run(main())
        """
    )
    _run_script(script, pg_dsn, "NO-SDK-OK")


async def test_key_and_scope_are_span_attributes_when_asked_for(store: Store) -> None:
    telemetry, spans, _ = _telemetry(record_key=True, record_scope=True)
    key = fresh()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        await ledger.call(POST, testsvc_pb2.PostRequest(account=fresh("acct")), key)
        (span,) = await until("the call's span", spans.get_finished_spans)
    assert attributes(span)["grpc_idempotency.key"] == key
    assert attributes(span)["grpc_idempotency.scope"] == "tenant:tenant-a"


async def test_a_store_that_is_down_makes_an_error_span() -> None:
    telemetry, spans, _ = _telemetry()
    with EmbeddedPostgres(durable=False) as pg:  # a private server, to stop
        down = await Store.connect(pg.dsn, max_size=2, acquire_timeout=2, migrate=True)
        try:
            async with running_ledger(down, telemetry=telemetry) as ledger:
                pg.stop()
                request = testsvc_pb2.PostRequest(account=fresh())
                answer = await asyncio.wait_for(ledger.call(POST, request, fresh()), 20)
                assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
                # The span ends as the handler's task does, which may be after the client has
                # its answer (a busy machine): wait for it while the server still runs.
                (span,) = await until("the call's span", spans.get_finished_spans)
        finally:
            await down.close(timeout=1)
    assert attributes(span)["grpc_idempotency.outcome"] == "unavailable"
    assert attributes(span)["rpc.grpc.status_code"] == 14
    assert span.status.status_code is StatusCode.ERROR


def test_a_global_provider_set_after_the_server_started_gets_its_spans(pg_dsn: str) -> None:
    """Until an SDK sets a global provider no span is made (they would record nothing); one set
    later, while the server runs, gets the spans of the calls that follow."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from testsvc.v1 import testsvc_pb2
        from grpc_idempotency import Store
        from tests.support.ledger import running_ledger, fresh, prepare

        async def main():
            store = await Store.connect(sys.argv[1])
            await prepare(store)
            spans = InMemorySpanExporter()
            async with running_ledger(store) as ledger:
                req = testsvc_pb2.PostRequest(account=fresh())
                await ledger.call("/testsvc.v1.LedgerService/Post", req, fresh())
                provider = TracerProvider()
                provider.add_span_processor(SimpleSpanProcessor(spans))
                trace.set_tracer_provider(provider)
                await ledger.call("/testsvc.v1.LedgerService/Post", req, fresh())
            await store.close()
            names = [s.name for s in spans.get_finished_spans()]
            assert names == ["grpc_idempotency testsvc.v1.LedgerService/Post"], names
            print("LATE-PROVIDER-OK")

        asyncio.run(main())
        """
    )
    _run_script(script, pg_dsn, "LATE-PROVIDER-OK")


def _run_script(script: str, pg_dsn: str, marker: str) -> None:
    """Runs ``script`` in a fresh interpreter (global OpenTelemetry state of its own)."""
    done = subprocess.run(
        [sys.executable, "-c", script, pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker in done.stdout


class _RaisingProcessor(SpanProcessor):
    """A broken exporter: the SDK calls span processors without guarding them."""

    def __init__(self, where: str) -> None:
        self.where = where

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.where == "start":
            raise RuntimeError("exporter bug on start")

    def on_end(self, span: Any) -> None:
        if self.where == "end":
            raise RuntimeError("exporter bug on end")


@pytest.mark.parametrize("where", ["start", "end", "metrics"])
async def test_broken_telemetry_never_changes_an_answer(store: Store, where: str) -> None:
    """A span processor that raised as the span started failed every keyed call before its
    handler ran; one that raised as it ended answered UNKNOWN for a write that had committed,
    and for its replays. Telemetry failures are logged and the calls answered as without it."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(_RaisingProcessor(where))
    telemetry = Telemetry(
        tracer_provider=tracer_provider,
        meter_provider=RaisingMeterProvider() if where == "metrics" else None,
    )
    async with running_ledger(store, telemetry=telemetry) as ledger:
        key, account = fresh(), fresh("acct")
        request = testsvc_pb2.PostRequest(account=account)
        first = await ledger.call(POST, request, key)
        again = await ledger.call(POST, request, key)
        failed = await ledger.call(
            POST, testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="raise"), fresh()
        )
    assert first.code is grpc.StatusCode.OK and not first.replayed, first.details
    assert again.code is grpc.StatusCode.OK and again.replayed and again.body == first.body
    # The handler's own exception still reaches gRPC (UNKNOWN), not the exporter's.
    assert failed.code is grpc.StatusCode.UNKNOWN and "exporter" not in (failed.details or "")
    assert ledger.service.executions == 2


def _outcomes(reader: InMemoryMetricReader) -> dict[tuple[str, int], int]:
    """``grpc_idempotency.calls`` by (outcome, status code)."""
    data = cast(MetricsData, reader.get_metrics_data())  # None only if nothing was recorded
    return {
        (
            str(attributes(p)["grpc_idempotency.outcome"]),
            cast(int, attributes(p)["rpc.grpc.status_code"]),
        ): int(p.value)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "grpc_idempotency.calls"
        for p in cast(Sum, m.data).data_points
    }


class _WriteSkew(testsvc_pb2_grpc.LedgerServiceServicer):
    """Post at SERIALIZABLE: reads table ``a``, writes table ``b``, then waits for the test, which
    meanwhile commits the mirror image (reads ``b``, writes ``a``): the call's commit then fails
    with a serialization failure (40001), the first committer having won."""

    def __init__(self, a: str, b: str) -> None:
        self.a, self.b = a, b
        self.written = asyncio.Event()
        self.go = asyncio.Event()

    async def Post(self, request: Any, context: Any) -> Any:
        conn = current_call().connection
        await conn.fetchval(f"SELECT count(*) FROM {self.a}")
        await conn.execute(f"INSERT INTO {self.b} VALUES (1)")
        self.written.set()
        await self.go.wait()
        return testsvc_pb2.PostResponse(account=request.account)


async def test_a_commit_lost_to_a_serialization_failure_is_counted_released(
    store: Store, db: Any
) -> None:
    """The commit's serialization failure rolls back, releases the key and answers ABORTED
    (IDEMPOTENCY_TRANSACTION_CONFLICT): the outcome is "released", as for the same failure in
    the handler. It was counted "unavailable" (the store down), which pages the wrong people
    whenever SERIALIZABLE methods meet contention."""
    telemetry, spans, reader = _telemetry()
    a, b = (f"test_ledger.skew_{name}_{fresh('t').replace('-', '_')}" for name in "ab")
    await db.execute(f"CREATE TABLE {a} (v int); CREATE TABLE {b} (v int)")
    servicer = _WriteSkew(a, b)
    interceptor = IdempotencyInterceptor(
        store,
        services=[testsvc_pb2],
        overrides={POST.lstrip("/"): MethodOverride(isolation=Isolation.SERIALIZABLE)},
        scope=MetadataScope("x-tenant-id"),
        telemetry=telemetry,
        replay_cache=False,
    )
    try:
        async with ledger_server(interceptor, servicer) as (channel, _):
            key = fresh()
            call = asyncio.ensure_future(
                call_raw(channel, POST, testsvc_pb2.PostRequest(account="x"), metadata(key))
            )
            try:
                await asyncio.wait_for(servicer.written.wait(), 10)
                async with db.transaction(isolation="serializable"):
                    await db.fetchval(f"SELECT count(*) FROM {b}")
                    await db.execute(f"INSERT INTO {a} VALUES (1)")
            finally:
                servicer.go.set()
            answer = await call
    finally:
        await db.execute(f"DROP TABLE {a}; DROP TABLE {b}")
    assert answer.code is grpc.StatusCode.ABORTED, answer
    assert answer.reason() == "IDEMPOTENCY_TRANSACTION_CONFLICT"
    (span,) = spans.get_finished_spans()
    assert attributes(span)["grpc_idempotency.outcome"] == "released"
    assert _outcomes(reader) == {("released", grpc.StatusCode.ABORTED.value[0]): 1}
    assert await store.lookup("tenant:tenant-a", key) is None  # released: nothing kept


async def test_an_unkeyed_call_refused_for_a_store_that_is_down_is_counted_unavailable(
    pg_dsn: str, store: Store
) -> None:
    """An optional-key method called without a key while its store cannot be used is refused
    (UNAVAILABLE, fail closed) without running: the outcome is "unavailable", as with a key. It
    was counted "bypassed", which says the call ran without deduplication."""
    telemetry, spans, reader = _telemetry()
    closed = await Store.connect(pg_dsn, min_size=1, max_size=1)  # ``store`` migrated it
    await closed.close()  # a closing or closed store answers UNAVAILABLE, as one that is down
    async with running_ledger(closed, telemetry=telemetry) as ledger:
        request = testsvc_pb2.PostRequest(account=fresh("acct"))
        unkeyed = await ledger.call(OPTIONAL, request, None)
        keyed = await ledger.call(OPTIONAL, request, fresh())
    for answer in (unkeyed, keyed):
        assert answer.code is grpc.StatusCode.UNAVAILABLE, answer
        assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
    assert ledger.service.executions == 0
    outcomes = [attributes(s)["grpc_idempotency.outcome"] for s in spans.get_finished_spans()]
    assert outcomes == ["unavailable", "unavailable"]
    assert _outcomes(reader) == {("unavailable", grpc.StatusCode.UNAVAILABLE.value[0]): 2}


async def test_a_duplicate_its_client_cancels_while_it_waits_is_not_counted_rejected(
    store: Store,
) -> None:
    """A duplicate waiting on the key's attempt in progress, cancelled by its client, ends
    without an outcome because the key was busy: "conflict" with status CANCELLED, as one whose
    wait ran out is "conflict" with ABORTED. It was counted "rejected" (a malformed key or no
    scope, the client's mistake) and an operator looked for a client sending bad keys."""
    telemetry, spans, reader = _telemetry()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        key, request = fresh(), testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait")
        owner = asyncio.ensure_future(ledger.call(POST, request, key))
        try:
            await ledger.service.started.wait()
            stub = ledger.channel.unary_unary(
                POST, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
            )
            duplicate = stub(request, metadata=metadata(key, "tenant-a"), timeout=30)
            await until("the duplicate waiting", lambda: ledger.interceptor.waiting_calls == 1)
            duplicate.cancel()
            (span,) = await until("the duplicate's span", spans.get_finished_spans)
        finally:
            ledger.service.release.set()
        assert (await owner).code is grpc.StatusCode.OK
    assert attributes(span)["grpc_idempotency.outcome"] == "conflict"
    assert attributes(span)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert _outcomes(reader) == {
        ("conflict", grpc.StatusCode.CANCELLED.value[0]): 1,
        ("executed", grpc.StatusCode.OK.value[0]): 1,
    }


async def test_a_request_that_does_not_parse_is_counted_rejected(store: Store) -> None:
    """Bytes that are no request, refused INVALID_ARGUMENT before the key is read, are a keyed
    call refused before the store, as a malformed key is: one span and one count, "rejected".
    They were answered before the span began, so a client sending garbage was invisible."""
    telemetry, spans, reader = _telemetry()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        answer = await call_raw(ledger.channel, POST, RawBytes(b"\x0a\xff"), metadata(fresh()))
        (span,) = await until("the call's span", spans.get_finished_spans)
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
    assert answer.reason() == "IDEMPOTENCY_REQUEST_INVALID"
    assert ledger.service.executions == 0
    assert attributes(span)["grpc_idempotency.outcome"] == "rejected"
    assert _outcomes(reader) == {("rejected", grpc.StatusCode.INVALID_ARGUMENT.value[0]): 1}


async def test_a_call_its_client_cancels_during_the_claim_is_counted_released(
    store: Store, db: Any
) -> None:
    """A keyed call whose client leaves while its claim waits in the database (a slow or locked
    records table behind a client's deadline) keeps nothing and leaves the key free: "released",
    status CANCELLED. It was counted "rejected", the label of a malformed key or a missing scope,
    and an operator looked for a client sending bad keys instead of at the database."""
    telemetry, spans, reader = _telemetry()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        key, request = fresh(), testsvc_pb2.PostRequest(account=fresh("acct"))
        stub = ledger.channel.unary_unary(
            POST, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
        )
        async with db.transaction():
            await db.execute("LOCK TABLE grpc_idempotency.records IN ACCESS EXCLUSIVE MODE")
            holder = await db.fetchval("SELECT pg_backend_pid()")
            call = stub(request, metadata=metadata(key, "tenant-a"), timeout=30)

            async def claim_waiting() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT EXISTS (SELECT FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND $1 = ANY (pg_blocking_pids(pid)))",
                        holder,
                    )
                )

            await until("the claim waiting on the records table", claim_waiting)
            call.cancel()
            (span,) = await until("the call's span", spans.get_finished_spans)
        assert ledger.service.executions == 0
    assert attributes(span)["grpc_idempotency.outcome"] == "released"
    assert attributes(span)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert _outcomes(reader) == {("released", grpc.StatusCode.CANCELLED.value[0]): 1}
    assert await store.lookup("tenant:tenant-a", key) is None


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_the_handlers_spans_are_children_of_the_calls_span(store: Store, sync: bool) -> None:
    """The call's span is current while its handler runs, a sync one in its thread pool too:
    the handler's spans (and the gRPC instrumentation's spans of its outgoing calls) are its
    children, not siblings under the server span."""
    telemetry, spans, _ = _telemetry()
    tracer = telemetry.tracer

    def post(request: Any, context: Any) -> Any:
        with tracer.start_as_current_span("handler work"):
            return testsvc_pb2.PostResponse(account=request.account)

    class Servicer(testsvc_pb2_grpc.LedgerServiceServicer):
        async def Post(self, request: Any, context: Any) -> Any:
            return post(request, context)

    servicer = Servicer()
    if sync:
        servicer.Post = post  # type: ignore[method-assign]
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope("x-tenant-id"), telemetry=telemetry
    )
    async with ledger_server(interceptor, servicer) as (channel, _):
        answer = await call_raw(
            channel, POST, testsvc_pb2.PostRequest(account="x"), metadata(fresh())
        )
    assert answer.code is grpc.StatusCode.OK, answer
    child, call = spans.get_finished_spans()
    assert call.name == "grpc_idempotency testsvc.v1.LedgerService/Post"
    assert child.parent is not None and call.context is not None
    assert child.parent.span_id == call.context.span_id


async def test_the_newer_rpc_conventions_when_opted_in_reach_the_calls_span_and_metrics(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real server: the variable, read as the Telemetry is made, sets the attributes of
    the interceptor's spans and metric points (the unit tests cover every value)."""
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http, rpc")
    telemetry, spans, reader = _telemetry()
    async with running_ledger(store, telemetry=telemetry) as ledger:
        await ledger.call(POST, testsvc_pb2.PostRequest(account=fresh("acct")), fresh())
        raising = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="raise")
        await ledger.call(POST, raising, fresh())
        # A span ends as its handler's task does, maybe after the client has its answer.
        await until("both spans", lambda: len(spans.get_finished_spans()) == 2)
    rpc = {"rpc.system.name": "grpc", "rpc.method": "testsvc.v1.LedgerService/Post"}
    ok = {**rpc, "rpc.response.status_code": "OK"}
    failed = {**rpc, "rpc.response.status_code": "UNKNOWN", "error.type": "UNKNOWN"}
    found = [
        {k: v for k, v in attributes(s).items() if k.startswith(("rpc.", "error."))}
        for s in spans.get_finished_spans()
    ]
    assert sorted(found, key=len) == [ok, failed]
    data = cast(MetricsData, reader.get_metrics_data())
    (calls,) = [
        m
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "grpc_idempotency.calls"
    ]
    labels = [
        {k: v for k, v in attributes(p).items() if k != "grpc_idempotency.outcome"}
        for p in cast(Sum, calls.data).data_points
    ]
    assert sorted(labels, key=len) == [ok, failed]
