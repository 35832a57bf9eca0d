"""Spans and metrics through opentelemetry-api; and the library working with no SDK at all."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store, Telemetry
from tests.support.ledger import fresh, running_ledger

POST = "/testsvc.v1.LedgerService/Post"


async def test_one_span_per_keyed_call_with_its_outcome(store: Store) -> None:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    telemetry = Telemetry(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
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

    outcomes = [s.attributes["grpc_idempotency.outcome"] for s in spans.get_finished_spans()]
    assert outcomes == ["executed", "replayed", "mismatch", "rejected", "released"]  # Peek: no span
    assert all(s.name == f"grpc_idempotency {POST}" for s in spans.get_finished_spans())

    data = reader.get_metrics_data()
    metrics = {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    counted = {
        dict(p.attributes)["grpc_idempotency.outcome"]: p.value
        for p in metrics["grpc_idempotency.calls"].data.data_points
    }
    assert counted == {"executed": 1, "replayed": 1, "mismatch": 1, "rejected": 1, "released": 1}
    histogram = metrics["grpc_idempotency.call.duration"].data.data_points
    assert sum(p.count for p in histogram) == 5
    assert metrics["grpc_idempotency.call.duration"].unit == "s"


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
    done = subprocess.run(
        [sys.executable, "-c", script, pg_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NO-SDK-OK" in done.stdout
