"""gRPC status codes as plain numbers, so core/ can decide without importing grpc.

The numbers are google.rpc.Code's; drivers translate with ``grpc.StatusCode``.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """A gRPC status code by its google.rpc.Code number (``grpc.StatusCode`` without grpc)."""

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
