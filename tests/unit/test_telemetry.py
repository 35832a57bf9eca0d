"""Telemetry without a server: the status recorded for a cancelled handler."""

from __future__ import annotations

import pytest

from grpc_idempotency.core.codes import Code
from grpc_idempotency.telemetry import cancellation_code


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
