"""OpenTelemetry parts that raise, as a broken exporter or meter does: the library must answer
calls (and deliver outbox rows) as if telemetry were not there."""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics


class RaisingInstrument:
    def add(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("meter bug")

    record = add


class RaisingMeterProvider(metrics.MeterProvider):
    """A meter provider (the API lets users bring their own) whose instruments raise."""

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        class Meter(metrics.NoOpMeter):
            def create_counter(self, *a: Any, **k: Any) -> Any:
                return RaisingInstrument()

            def create_histogram(self, *a: Any, **k: Any) -> Any:
                return RaisingInstrument()

        return Meter("broken")
