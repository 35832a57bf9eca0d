"""OpenTelemetry spans and metrics, through opentelemetry-api only.

With no SDK installed (or none configured) the API's no-op providers make this nearly free.
One span per keyed call, ``grpc_idempotency <method>``, with attribute
``grpc_idempotency.outcome``; a counter ``grpc_idempotency.calls`` and a histogram
``grpc_idempotency.call.duration`` (seconds), both labelled by ``rpc.method`` and outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

from opentelemetry import metrics, trace

from grpc_idempotency.core.lifecycle import CallOutcome

OUTCOME = "grpc_idempotency.outcome"
METHOD = "rpc.method"

try:
    _VERSION = version("grpc-idempotency")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    _VERSION = "0"


class Telemetry:
    """The span, counters and histogram of keyed calls (opentelemetry-api only; the SDK, if
    configured, exports them). Pass your own providers to ``IdempotencyInterceptor(telemetry=)``."""

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self.tracer = trace.get_tracer("grpc_idempotency", _VERSION, tracer_provider)
        meter = metrics.get_meter("grpc_idempotency", _VERSION, meter_provider)
        self.calls = meter.create_counter(
            "grpc_idempotency.calls", unit="{call}", description="Keyed calls by outcome"
        )
        self.duration = meter.create_histogram(
            "grpc_idempotency.call.duration",
            unit="s",
            description="Time spent in keyed calls, handler included",
        )
        self.bypassed = meter.create_counter(
            "grpc_idempotency.bypassed",
            unit="{call}",
            description="Calls run without deduplication (fail-open while the store was down)",
        )

    @contextmanager
    def span(self, method: str) -> Iterator[trace.Span]:
        with self.tracer.start_as_current_span(
            f"grpc_idempotency {method}",
            kind=trace.SpanKind.INTERNAL,
            attributes={METHOD: method},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span

    def record(self, span: trace.Span, method: str, outcome: CallOutcome, seconds: float) -> None:
        span.set_attribute(OUTCOME, outcome.value)
        attributes = {METHOD: method, OUTCOME: outcome.value}
        self.calls.add(1, attributes)
        self.duration.record(seconds, attributes)
