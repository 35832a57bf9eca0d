"""The RPC conventions a Telemetry follows: semconv 1.37's by default, their successors or both
when ``OTEL_SEMCONV_STABILITY_OPT_IN`` asks, on spans and metric labels alike (the real SDK,
in memory, no server)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.lifecycle import CallOutcome
from grpc_idempotency.telemetry import Telemetry
from tests.support.otel import attributes

if TYPE_CHECKING:
    # Typing only: opentelemetry-api 1.16, the lowest supported, has no AnyValue.
    from opentelemetry.util.types import AnyValue

# The variable, spelled out: its name is what applications set, not ours to change.
SEMCONV_OPT_IN_ENV = "OTEL_SEMCONV_STABILITY_OPT_IN"
METHOD = "/testsvc.v1.LedgerService/Post"

OLD = {
    "rpc.system": "grpc",
    "rpc.service": "testsvc.v1.LedgerService",
    "rpc.method": "Post",
}
NEW = {"rpc.system.name": "grpc", "rpc.method": "testsvc.v1.LedgerService/Post"}
OLD_OK, OLD_UNKNOWN = {"rpc.grpc.status_code": 0}, {"rpc.grpc.status_code": 2}
NEW_OK = {"rpc.response.status_code": "OK"}
NEW_UNKNOWN = {"rpc.response.status_code": "UNKNOWN", "error.type": "UNKNOWN"}
# In both: rpc.method is one key, and takes the new (fully-qualified) form.
DUP = {**OLD, **NEW}

DEFAULT = (OLD, OLD_OK, OLD_UNKNOWN)
STABLE = (NEW, NEW_OK, NEW_UNKNOWN)
BOTH = (DUP, {**OLD_OK, **NEW_OK}, {**OLD_UNKNOWN, **NEW_UNKNOWN})


def _recorded(
    monkeypatch: pytest.MonkeyPatch, opt_in: str | None
) -> tuple[list[Mapping[str, AnyValue]], list[Mapping[str, AnyValue]]]:
    """The attributes of two calls' spans (OK, then UNKNOWN) and of their ``calls`` and
    ``call.duration`` points, with the variable set to ``opt_in`` (None: unset) as the
    Telemetry is made, and set to something else afterwards (read once, not per call)."""
    if opt_in is None:
        monkeypatch.delenv(SEMCONV_OPT_IN_ENV, raising=False)
    else:
        monkeypatch.setenv(SEMCONV_OPT_IN_ENV, opt_in)
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    telemetry = Telemetry(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
    monkeypatch.setenv(SEMCONV_OPT_IN_ENV, "rpc" if opt_in is None else "")
    for code in (Code.OK, Code.UNKNOWN):
        with telemetry.span(METHOD) as span:
            telemetry.record(span, METHOD, CallOutcome.EXECUTED, 0.01, code=code)
    spans = [attributes(s) for s in exporter.get_finished_spans()]
    assert [s.name for s in exporter.get_finished_spans()] == [
        "grpc_idempotency testsvc.v1.LedgerService/Post"
    ] * 2  # the span's name does not change with the conventions
    data = cast(MetricsData, reader.get_metrics_data())
    points = {
        m.name: sorted(
            (attributes(p) for p in m.data.data_points),
            # The OK call's point first, as its span is.
            key=lambda a: (
                "UNKNOWN" in (a.get("rpc.response.status_code"), a.get("error.type"))
                or a.get("rpc.grpc.status_code") == 2
            ),
        )
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert points["grpc_idempotency.calls"] == points["grpc_idempotency.call.duration"]
    return spans, points["grpc_idempotency.calls"]


@pytest.mark.parametrize(
    ("opt_in", "expected"),
    [
        (None, DEFAULT),
        ("rpc", STABLE),
        ("rpc/dup", BOTH),
        ("http,rpc/dup", BOTH),  # a list shared with other domains
        ("database/dup, rpc ,http", STABLE),  # whitespace around a token is no matter
        ("rpc,rpc/dup", BOTH),  # dup wins over rpc, in either order
        ("rpc/dup,rpc", BOTH),
        ("http/dup,database", DEFAULT),  # other domains only
        # Malformed or unknown: the default, as opentelemetry-instrumentation reads its own.
        ("", DEFAULT),
        ("RPC", DEFAULT),
        ("rpc/DUP", DEFAULT),
        ("rpc;http", DEFAULT),
        ("rpc/old", DEFAULT),
        ("rpcs,grpc", DEFAULT),
        (" , ,", DEFAULT),
        ("rpc /dup", DEFAULT),  # whitespace inside a token is not ignored
        ("\trpc\n", STABLE),  # any whitespace around one is
    ],
)
def test_spans_and_metric_labels_follow_the_conventions_opted_in_to(
    monkeypatch: pytest.MonkeyPatch,
    opt_in: str | None,
    expected: tuple[dict[str, object], dict[str, object], dict[str, object]],
) -> None:
    rpc, ok, unknown = expected
    spans, points = _recorded(monkeypatch, opt_in)
    outcome = {"grpc_idempotency.outcome": "executed"}
    # Exactly these: nothing of the other conventions leaks in (rpc.service under "rpc", say).
    assert [dict(s) for s in spans] == [{**rpc, **ok, **outcome}, {**rpc, **unknown, **outcome}]
    assert [dict(p) for p in points] == [{**rpc, **ok, **outcome}, {**rpc, **unknown, **outcome}]


def test_a_call_run_without_its_store_is_counted_with_the_methods_new_attributes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SEMCONV_OPT_IN_ENV, "rpc")
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    telemetry.count_bypassed(METHOD)
    data = cast(MetricsData, reader.get_metrics_data())
    (point,) = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "grpc_idempotency.bypassed"
        for p in m.data.data_points
    ]
    assert dict(attributes(point)) == NEW
