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
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store, Telemetry
from grpc_idempotency.testing import EmbeddedPostgres
from tests.support.broken_telemetry import RaisingMeterProvider
from tests.support.ledger import fresh, metadata, running_ledger
from tests.support.otel import attributes
from tests.support.waiting import until

POST = "/testsvc.v1.LedgerService/Post"
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
    (span,) = spans.get_finished_spans()
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
        finally:
            await down.close(timeout=1)
    (span,) = spans.get_finished_spans()
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
