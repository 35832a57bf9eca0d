"""What the OpenTelemetry SDK recorded in memory, typed as the tests read it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import DataPointT
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.util.types import AnyValue


def attributes(item: ReadableSpan | DataPointT) -> Mapping[str, AnyValue]:
    """A finished span's or a data point's attributes. The SDK always sets them (a span's are an
    empty mapping at least); they are typed Optional only as the API's ``Attributes`` are."""
    return cast("Mapping[str, AnyValue]", item.attributes)
