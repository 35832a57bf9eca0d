"""gRPC status codes as plain numbers, so core/ can decide without importing grpc.

The numbers are google.rpc.Code's; drivers translate with ``grpc.StatusCode``.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


# Errors that a retry of the same request would get again: recorded and replayed like a response.
DEFAULT_RECORDED_ERRORS: frozenset[Code] = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.ALREADY_EXISTS,
        Code.FAILED_PRECONDITION,
        Code.OUT_OF_RANGE,
    }
)

# Codes that may never be recorded: they say the attempt did not finish, so recording them would
# turn a transient failure into a permanent answer for the key.
NEVER_RECORDED: frozenset[Code] = frozenset(
    {
        Code.UNAVAILABLE,
        Code.DEADLINE_EXCEEDED,
        Code.RESOURCE_EXHAUSTED,
        Code.ABORTED,
        Code.INTERNAL,
        Code.UNKNOWN,
        Code.CANCELLED,
    }
)
