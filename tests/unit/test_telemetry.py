"""Telemetry without a server: the status recorded for a cancelled handler; the duration
histogram's buckets, in seconds (an advisory to the SDK), and an opentelemetry-api older than
the advisory (1.30) still working."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Any, cast

import pytest
from opentelemetry import metrics, propagate, trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from grpc_idempotency import IdempotentConsumer
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.lifecycle import CallOutcome
from grpc_idempotency.telemetry import (
    CARRIER_MAX_CHARS,
    DURATION_BUCKETS_S,
    Telemetry,
    cancellation_code,
    linked_context,
    trace_carrier,
)

METHOD = "/testsvc.v1.LedgerService/Post"


@pytest.mark.parametrize(
    ("time_remaining", "expected"),
    [
        (None, Code.CANCELLED),  # no deadline: only the client (or the server stopping) cancels
        (5.0, Code.CANCELLED),  # time left: the client cancelled
        (0.0, Code.DEADLINE_EXCEEDED),  # what grpc.aio reports once the deadline has passed
        (-0.2, Code.DEADLINE_EXCEEDED),
        (0.01, Code.DEADLINE_EXCEEDED),  # the client's deadline ran out a moment earlier
    ],
)
def test_a_cancelled_handler_is_recorded_with_what_the_client_sees(
    time_remaining: float | None, expected: Code
) -> None:
    assert cancellation_code(time_remaining) is expected


def _histogram_point(reader: InMemoryMetricReader) -> HistogramDataPoint:
    data = reader.get_metrics_data()
    assert data is not None
    (point,) = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "grpc_idempotency.call.duration"
        for p in m.data.data_points
    ]
    assert isinstance(point, HistogramDataPoint)
    return point


@pytest.mark.skipif(
    "explicit_bucket_boundaries_advisory"
    not in inspect.signature(metrics.Meter.create_histogram).parameters,
    reason="opentelemetry-api before 1.30 has no bucket advisory",
)
def test_the_duration_histogram_has_buckets_in_seconds() -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    # A replay takes milliseconds: the SDK's default buckets (0, 5, 10, ... 10000, made for
    # milliseconds) would put every call of under 5 s in one bucket.
    telemetry.record(trace.INVALID_SPAN, METHOD, CallOutcome.REPLAYED, 0.003)
    point = _histogram_point(reader)
    assert tuple(point.explicit_bounds) == DURATION_BUCKETS_S
    assert DURATION_BUCKETS_S[0] <= 0.001 and DURATION_BUCKETS_S[-1] >= 10
    assert list(DURATION_BUCKETS_S) == sorted(set(DURATION_BUCKETS_S))
    assert point.bucket_counts[DURATION_BUCKETS_S.index(0.005)] == 1  # (0.0025, 0.005]


class _MeterBefore130:
    """A meter of an opentelemetry-api before 1.30: create_histogram takes no advisory."""

    def __init__(self, meter: Any) -> None:
        self._meter = meter
        self.histograms: list[str] = []

    def create_counter(self, *args: Any, **kwargs: Any) -> Any:
        return self._meter.create_counter(*args, **kwargs)

    def create_histogram(self, name: str, unit: str = "", description: str = "") -> Any:
        self.histograms.append(name)
        return self._meter.create_histogram(name, unit=unit, description=description)


class _ProviderBefore130:
    def __init__(self, meter: _MeterBefore130) -> None:
        self.meter = meter

    def get_meter(self, *args: Any, **kwargs: Any) -> _MeterBefore130:
        return self.meter


def test_an_api_without_the_bucket_advisory_gets_the_histogram_without_it() -> None:
    reader = InMemoryMetricReader()
    old = _MeterBefore130(MeterProvider(metric_readers=[reader]).get_meter("x"))
    telemetry = Telemetry(meter_provider=_ProviderBefore130(old))  # type: ignore[arg-type]
    assert old.histograms == [
        "grpc_idempotency.call.duration",
        "grpc_idempotency.consumer.process.duration",
    ]
    telemetry.record(trace.INVALID_SPAN, METHOD, CallOutcome.EXECUTED, 0.2)
    assert _histogram_point(reader).count == 1


@pytest.mark.parametrize(
    ("variable", "group"),
    [
        ("OTEL_PYTHON_TRACER_PROVIDER", "opentelemetry_tracer_provider"),
        ("OTEL_PYTHON_METER_PROVIDER", "opentelemetry_meter_provider"),
    ],
)
def test_a_provider_named_in_the_environment_but_not_installed_is_named_in_the_error(
    variable: str, group: str
) -> None:
    # A process of its own: the API reads the variable only while no global provider is set.
    # Providers given are used as they are: the variable is not read for them.
    script = (
        "from opentelemetry import metrics, trace\n"
        "from grpc_idempotency.telemetry import Telemetry\n"
        "Telemetry(tracer_provider=trace.NoOpTracerProvider(),"
        " meter_provider=metrics.NoOpMeterProvider())\n"
        "print('given: made')\n"
        "Telemetry()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env[variable] = "not-installed"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (1, "given: made\n")
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: "), last
    assert f"{variable}='not-installed'" in last and f"an {group} entry point" in last
    # The ValueError alone, not chained to the API's StopIteration.
    assert "During handling of the above exception" not in done.stderr


class _CountingTracer:
    """Counts the spans asked for (it makes none)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start_as_current_span(self, name: str, **_: object) -> Any:
        self.started.append(name)
        raise AssertionError("no span should be made")


def test_a_consumer_delivery_makes_no_span_while_nothing_traces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As for the interceptor's calls: until a provider is set, a span (a context attached and
    detached) per message is CPU spent on nothing."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)  # no global provider set (yet)
    monkeypatch.delenv("OTEL_PYTHON_TRACER_PROVIDER", raising=False)
    telemetry = Telemetry()
    counting = _CountingTracer()
    telemetry.tracer = cast(trace.Tracer, counting)
    with telemetry.consumer_span("orders") as span:
        assert span is trace.INVALID_SPAN
    assert counting.started == []


def test_a_consumer_refuses_what_is_no_telemetry() -> None:
    with pytest.raises(TypeError, match="telemetry must be a Telemetry"):
        IdempotentConsumer(cast(Any, None), "orders", telemetry=cast(Any, object()))


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("tracer_provider", trace.get_tracer(__name__)),
        ("meter_provider", 5),
        ("record_key", "no"),  # truth-tested: "no" put every key on the spans
        ("record_scope", None),
    ],
)
def test_an_argument_of_the_wrong_type_is_refused_naming_it(argument: str, value: object) -> None:
    """A Tracer for its provider, or a number, was a bare AttributeError ("no attribute
    'get_tracer'") naming no argument."""
    with pytest.raises(TypeError, match=f"^{argument} must be "):
        Telemetry(**{argument: value})  # type: ignore[arg-type]


class _Writes(TextMapPropagator):
    """A propagator (an application may configure its own) that writes ``fields`` as they are."""

    def __init__(self, **fields: object) -> None:
        self._fields = fields

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        carrier.update(self._fields)

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        return context

    @property
    def fields(self) -> set[str]:
        return set(self._fields)


_TRACESTATE = "vendor1=a:b,vendor2=c;d"  # commas and the characters W3C allows in it


@pytest.mark.parametrize(
    ("propagator", "kept"),
    [
        (TraceContextTextMapPropagator(), True),
        # What jsonb refuses (a NUL; a lone surrogate): the INSERT failed, and the call with it.
        (_Writes(traceparent="00-\x00"), False),
        (_Writes(traceparent="\ud800"), False),
        (_Writes(traceparent=["00-1"]), False),  # not a header value
        (_Writes(traceparent="0" * (CARRIER_MAX_CHARS + 1)), False),  # every row that large
        (_Writes(), False),  # a propagator that writes nothing: NULL, not "{}"
    ],
)
def test_an_outbox_carrier_is_headers_of_bounded_size_or_none(
    propagator: TextMapPropagator, kept: bool
) -> None:
    """trace_carrier never raises; what it keeps reads back as the span it came from."""
    span = trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id=0x1234,
            span_id=0x5678,
            is_remote=False,
            trace_flags=trace.TraceFlags(1),
            trace_state=trace.TraceState.from_header([_TRACESTATE]),
        )
    )
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(propagator)
    try:
        with trace.use_span(span):
            carrier = trace_carrier()
        assert (carrier is not None) is kept
        if carrier is not None:
            linked = linked_context(json.loads(json.dumps(json.loads(carrier))))
            assert linked is not None
            assert (linked.trace_id, linked.span_id) == (0x1234, 0x5678)
            assert linked.trace_state.to_header() == _TRACESTATE
    finally:
        propagate.set_global_textmap(before)


def test_no_span_no_propagator_and_a_carrier_without_a_span_links_to_nothing() -> None:
    """Tracing off, an enqueue costs one context look-up: the propagator is never asked. A
    carrier that holds no span context (only baggage) gives no link, not an invalid one."""
    asked: list[object] = []

    class Counting(_Writes):
        def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
            asked.append(carrier)

    before = propagate.get_global_textmap()
    propagate.set_global_textmap(Counting())
    try:
        assert trace_carrier() is None
    finally:
        propagate.set_global_textmap(before)
    assert asked == []
    assert linked_context('{"baggage":"k=v"}') is None


def test_an_outbox_carrier_keeps_the_trace_context_and_never_the_baggage() -> None:
    """The default propagator writes baggage beside traceparent: the application's (user ids,
    tenants), which the relay never restores, so it is not copied into outbox rows."""
    from opentelemetry import baggage, context, trace

    from grpc_idempotency.telemetry import trace_carrier

    span = trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id=0x1234, span_id=0x5678, is_remote=False, trace_flags=trace.TraceFlags(1)
        )
    )
    token = context.attach(baggage.set_baggage("user.id", "alice", trace.set_span_in_context(span)))
    try:
        text = trace_carrier()
    finally:
        context.detach(token)
    assert text is not None
    carrier = json.loads(text)
    assert carrier["traceparent"].endswith("00000000000000000000000000001234-0000000000005678-01")
    assert "baggage" not in carrier and "alice" not in text
