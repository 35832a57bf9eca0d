"""The exception tree of grpc-idempotency. Every error carries the gRPC status it maps to.

    IdempotencyError                     (status_code, reason)
    ├── PolicyError                      bad options, raised when a server starts; never on a call
    ├── KeyMissing                       INVALID_ARGUMENT  IDEMPOTENCY_KEY_MISSING
    ├── KeyInvalid                       INVALID_ARGUMENT  IDEMPOTENCY_KEY_INVALID
    ├── ScopeUnavailable                 UNAUTHENTICATED   IDEMPOTENCY_SCOPE_UNAVAILABLE
    ├── KeyReused                        FAILED_PRECONDITION IDEMPOTENCY_KEY_REUSED
    ├── KeyInProgress                    ABORTED           IDEMPOTENCY_KEY_IN_PROGRESS (retry_after)
    ├── StoreUnavailable                 UNAVAILABLE       IDEMPOTENCY_STORE_UNAVAILABLE
    ├── LeaseLost                        ABORTED           IDEMPOTENCY_LEASE_LOST
    └── NotInIdempotentCall              FAILED_PRECONDITION (programming error: no current call)

Lower-layer errors (asyncpg, OSError, grpc) are mapped to these at the boundary, ``raise ... from``.
"""

from __future__ import annotations

from typing import ClassVar

from grpc_idempotency.core.codes import Code

ERROR_DOMAIN = "grpc-idempotency"


class IdempotencyError(Exception):
    """Base class. ``status_code`` and ``reason`` say how the error travels over gRPC."""

    status_code: ClassVar[Code] = Code.INTERNAL
    reason: ClassVar[str] = "IDEMPOTENCY_INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PolicyError(IdempotencyError):
    """Options on a method are invalid; raised when the policy is compiled (server start)."""

    status_code = Code.INTERNAL
    reason = "IDEMPOTENCY_POLICY_INVALID"


class KeyMissing(IdempotencyError):
    status_code = Code.INVALID_ARGUMENT
    reason = "IDEMPOTENCY_KEY_MISSING"


class KeyInvalid(IdempotencyError):
    status_code = Code.INVALID_ARGUMENT
    reason = "IDEMPOTENCY_KEY_INVALID"


class ScopeUnavailable(IdempotencyError):
    """The scope resolver found no identity to file the key under."""

    status_code = Code.UNAUTHENTICATED
    reason = "IDEMPOTENCY_SCOPE_UNAVAILABLE"


class KeyReused(IdempotencyError):
    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_KEY_REUSED"


class KeyInProgress(IdempotencyError):
    status_code = Code.ABORTED
    reason = "IDEMPOTENCY_KEY_IN_PROGRESS"

    def __init__(self, message: str, *, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class StoreUnavailable(IdempotencyError):
    status_code = Code.UNAVAILABLE
    reason = "IDEMPOTENCY_STORE_UNAVAILABLE"


class LeaseLost(IdempotencyError):
    """Another attempt took the key over; this attempt's writes were not committed."""

    status_code = Code.ABORTED
    reason = "IDEMPOTENCY_LEASE_LOST"


class NotInIdempotentCall(IdempotencyError):
    """``current_call()`` was used outside a handler that the library is running."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_NO_CURRENT_CALL"
