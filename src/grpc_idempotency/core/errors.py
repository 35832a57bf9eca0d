"""The exception tree of grpc-idempotency. Every error carries the gRPC status it maps to.

    IdempotencyError                     (status_code, reason)
    ├── PolicyError                      INTERNAL          IDEMPOTENCY_POLICY_INVALID (bad options)
    ├── KeyMissing                       INVALID_ARGUMENT  IDEMPOTENCY_KEY_MISSING
    ├── KeyInvalid                       INVALID_ARGUMENT  IDEMPOTENCY_KEY_INVALID
    ├── RequestInvalid                   INVALID_ARGUMENT  IDEMPOTENCY_REQUEST_INVALID
    ├── ScopeUnavailable                 UNAUTHENTICATED   IDEMPOTENCY_SCOPE_UNAVAILABLE
    ├── ScopeResolverFailed              INTERNAL          IDEMPOTENCY_SCOPE_RESOLVER_FAILED
    ├── KeyReused                        FAILED_PRECONDITION IDEMPOTENCY_KEY_REUSED
    ├── OutboxKeyReused                  FAILED_PRECONDITION IDEMPOTENCY_OUTBOX_KEY_REUSED
    ├── KeyInProgress                    ABORTED           IDEMPOTENCY_KEY_IN_PROGRESS (retry_after)
    │   └── MessageInProgress            (a consumer's concurrent delivery of the same message)
    ├── StoreUnavailable                 UNAVAILABLE       IDEMPOTENCY_STORE_UNAVAILABLE
    │   └── StoreMisconfigured           INTERNAL          IDEMPOTENCY_STORE_MISCONFIGURED
    │       └── DsnUnusable              (Store.connect: a DSN the driver cannot parse or use)
    ├── TransactionConflict              ABORTED           IDEMPOTENCY_TRANSACTION_CONFLICT
    ├── HandlerDatabaseError             INTERNAL          IDEMPOTENCY_HANDLER_DATABASE_ERROR
    ├── AbortInvalid                     INTERNAL          IDEMPOTENCY_ABORT_INVALID
    ├── ResponseTooLarge                 FAILED_PRECONDITION IDEMPOTENCY_RESPONSE_TOO_LARGE
    ├── LeaseLost                        ABORTED           IDEMPOTENCY_LEASE_LOST
    ├── StepUndeclared                   FAILED_PRECONDITION IDEMPOTENCY_STEP_UNDECLARED
    ├── StepAmbiguous                    FAILED_PRECONDITION IDEMPOTENCY_STEP_AMBIGUOUS
    ├── StepReused                       FAILED_PRECONDITION IDEMPOTENCY_STEP_REUSED
    ├── TransactionOpen                  FAILED_PRECONDITION IDEMPOTENCY_TRANSACTION_OPEN
    ├── DeliveryError                    UNAVAILABLE       IDEMPOTENCY_DELIVERY_FAILED (relay sinks)
    │   └── PermanentDeliveryError       FAILED_PRECONDITION IDEMPOTENCY_DELIVERY_REJECTED
    └── NotInIdempotentCall              FAILED_PRECONDITION (programming error: no current call)

Internal, never raised through the public API: ``core.lifecycle.IllegalTransition`` (a driver
bug), ``store.consumer_store.MarkBusy`` (becomes ``MessageInProgress``).

Lower-layer errors (asyncpg, OSError, grpc) are mapped to these at the boundary, ``raise ... from``.
"""

from __future__ import annotations

from typing import ClassVar

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.seconds import checked_seconds

ERROR_DOMAIN = "grpc-idempotency"


class IdempotencyError(Exception):
    """Base class. ``status_code`` and ``reason`` say how the error travels over gRPC."""

    status_code: ClassVar[Code] = Code.INTERNAL
    reason: ClassVar[str] = "IDEMPOTENCY_INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PolicyError(IdempotencyError):
    """Options on a method are invalid; raised when the policy is compiled: when the server
    (or client interceptor) is built, for the services it is given, else when the method is
    first called (its service found in the default descriptor pool then), after which the
    server answers every call of the method with it (INTERNAL). The client interceptor raises
    it too for a call of a streaming method that the serving method declares as a step."""

    status_code = Code.INTERNAL
    reason = "IDEMPOTENCY_POLICY_INVALID"


class KeyMissing(IdempotencyError):
    status_code = Code.INVALID_ARGUMENT
    reason = "IDEMPOTENCY_KEY_MISSING"


class KeyInvalid(IdempotencyError):
    status_code = Code.INVALID_ARGUMENT
    reason = "IDEMPOTENCY_KEY_INVALID"


class RequestInvalid(IdempotencyError):
    """The request's bytes are not a message of the method's request type; or a metadata entry
    of the call that its handler's calls pass on (``forward_metadata``, or its
    ``invocation_metadata()``) is one gRPC cannot send (a raw HTTP/2 client's value that is not
    printable ASCII)."""

    status_code = Code.INVALID_ARGUMENT
    reason = "IDEMPOTENCY_REQUEST_INVALID"


class ScopeUnavailable(IdempotencyError):
    """The scope resolver found no identity to file the key under."""

    status_code = Code.UNAUTHENTICATED
    reason = "IDEMPOTENCY_SCOPE_UNAVAILABLE"


class ScopeResolverFailed(IdempotencyError):
    """The scope resolver raised something other than the library's errors (``ScopeUnavailable``
    and the others are answered with their own status), or returned something other than a str:
    a bug on the server's side (logged there), not the caller's."""

    status_code = Code.INTERNAL
    reason = "IDEMPOTENCY_SCOPE_RESOLVER_FAILED"


class KeyReused(IdempotencyError):
    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_KEY_REUSED"


class OutboxKeyReused(IdempotencyError):
    """The outbox already holds a different message under this operation's step: the step was
    enqueued twice in one call with different messages, or the key was reused after its
    retention while the earlier operation's message is still kept (sent rows are kept for a
    while, pending and dead ones until dealt with). Enqueueing nothing would lose the message;
    the call fails instead, its writes rolled back, and nothing is recorded."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_OUTBOX_KEY_REUSED"


class KeyInProgress(IdempotencyError):
    status_code = Code.ABORTED
    reason = "IDEMPOTENCY_KEY_IN_PROGRESS"

    def __init__(self, message: str, *, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class StoreUnavailable(IdempotencyError):
    """The store could not serve this statement. ``outage``: whether that says the store is
    down or unusable (unreachable, gave up on the session, misconfigured), which lets a
    fail-open method run without it; ``False`` when the store is up and merely could not serve
    this call (every pooled connection busy for the whole acquire timeout, a statement of the
    library's failing on bad data): running the handler unclaimed then would re-run completed
    keys with their outcomes in the database.

    ``ambiguous``: the outage is only presumed, from a timeout the client side measured (a
    statement that got no answer in time, no pooled connection in time): a partition, or a
    live database whose records table is locked (a migration's ``LOCK TABLE``, an ``ALTER``
    queued behind a long transaction) with every pooled connection blocked on it. A fail-open
    method confirms such an outage (``Store.answers``) before running unclaimed."""

    status_code = Code.UNAVAILABLE
    reason = "IDEMPOTENCY_STORE_UNAVAILABLE"

    def __init__(self, message: str, *, outage: bool = True, ambiguous: bool = False) -> None:
        super().__init__(message)
        self.outage = outage
        self.ambiguous = outage and ambiguous
        self.store_label = ""
        """The store's name that ``Store.connect`` appended to ``message`` (`` [host:port/
        database, schema S]``), ``""`` if none: a report naming the database itself (the
        command line's) prints the message without it rather than say the database twice."""


class StoreMisconfigured(StoreUnavailable):
    """The store answers, but permanently wrongly: schema not migrated, no such database or
    schema, missing privileges, bad credentials. Not retryable: a retry gets the same answer
    until an operator acts, so it travels as INTERNAL (which clients do not retry) and is logged
    with its cause. A subclass of ``StoreUnavailable`` because the store cannot be used either
    way (a fail-open method runs without it)."""

    status_code = Code.INTERNAL
    reason = "IDEMPOTENCY_STORE_MISCONFIGURED"


class DsnUnusable(StoreMisconfigured):
    """``Store.connect``: the driver cannot parse or use the DSN (a bad scheme, port, sslmode, or
    an unencoded special character in the password that cut it elsewhere). Not retryable. The
    driver's message is not kept, not even as the cause: it can quote pieces of the password."""

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "the DSN cannot be parsed (or one of its parameters is invalid): percent-encode"
            " special characters in the password (/ as %2F, ? as %3F, # as %23, @ as %40, : as"
            " %3A, % as %25) and check the query parameters (sslmode=...); the driver's message"
            " is not shown, as it may quote part of the password"
        )


class TransactionConflict(IdempotencyError):
    """The call's transaction lost a serialization race (SQLSTATE 40001, a deadlock, a lock
    timeout) and was rolled back with everything it wrote; the key is released, so a retry runs
    it again. ABORTED is the status gRPC reserves for this and that retry policies retry."""

    status_code = Code.ABORTED
    reason = "IDEMPOTENCY_TRANSACTION_CONFLICT"


class HandlerDatabaseError(IdempotencyError):
    """A statement the handler ran on the call's connection failed and the handler did not
    handle it (a constraint, a missing table of its own, ...). The writes are rolled back and the
    key released; the driver's text stays in the server log instead of travelling to clients."""

    status_code = Code.INTERNAL
    reason = "IDEMPOTENCY_HANDLER_DATABASE_ERROR"


class AbortInvalid(IdempotencyError, ValueError):
    """A handler's ``context.abort()`` gave trailing metadata gRPC cannot send (a bad name, a
    str under a "-bin" name, a value that is not printable ASCII). Raised by the abort itself,
    before anything is recorded; the key is released. A ``ValueError`` too: bad arguments.
    Also raised by the handler's ``send_initial_metadata()`` given such entries."""

    status_code = Code.INTERNAL
    reason = "IDEMPOTENCY_ABORT_INVALID"


class ResponseTooLarge(IdempotencyError):
    """The handler's response is larger than the method's ``max_response_bytes``; or a recorded
    error's details, which cannot be cut as its message is (``wire.fitted_error``), are too large
    for that or for a client's trailers (``wire.MAX_ERROR_TRAILER_BYTES``). Recorded (and
    replayed) instead of it, with
    the handler's writes rolled back: an outcome too large to store, or for the client to
    receive, must not look like a failure that a retry could fix while the writes behind it had
    committed."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_RESPONSE_TOO_LARGE"


class LeaseLost(IdempotencyError):
    """Another attempt took the key over; this attempt's writes were not committed."""

    status_code = Code.ABORTED
    reason = "IDEMPOTENCY_LEASE_LOST"


class NotInIdempotentCall(IdempotencyError):
    """``current_call()`` was used outside a handler that the library is running."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_NO_CURRENT_CALL"


class StepUndeclared(IdempotencyError):
    """A handler called a keyed method for which its own method declares no step."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_STEP_UNDECLARED"


class StepAmbiguous(IdempotencyError):
    """Several declared steps call the target; the handler must name one."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_STEP_AMBIGUOUS"


class StepReused(IdempotencyError):
    """A handler called a step a second time in one attempt: while its first call was in flight,
    or after it was answered OK. A step is one call: the second carries the same child key, so
    downstream replays the first call's answer (the effect done once, the handler believing it
    done twice) or refuses a different request as a reused key."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_STEP_REUSED"


class TransactionOpen(IdempotencyError):
    """A phased handler called another service after opening its final transaction."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_TRANSACTION_OPEN"


class MessageInProgress(KeyInProgress):
    """Another delivery of the same message is being processed and did not finish within the
    wait: nothing ran, nothing is marked. Do not acknowledge; the message comes back later (over
    gRPC: ``ABORTED``, reason ``IDEMPOTENCY_KEY_IN_PROGRESS``, with a retry delay)."""


class DeliveryError(IdempotencyError):
    """A delivery failed; it is retried with backoff (any other exception from a sink is too).
    Its message becomes the row's ``last_error`` as it is. ``retry_after_s``: when the receiver
    asked to be tried again (its pushback); the relay waits at least that long, up to its
    policy's longest backoff."""

    status_code = Code.UNAVAILABLE
    reason = "IDEMPOTENCY_DELIVERY_FAILED"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        # Else the relay's batch failed computing the delay, its rows left for the lease.
        self.retry_after_s = checked_seconds("retry_after_s", retry_after_s, or_none=True)


class PermanentDeliveryError(DeliveryError):
    """Raised by a sink when retrying cannot help: the row is parked as a dead letter at once."""

    status_code = Code.FAILED_PRECONDITION
    reason = "IDEMPOTENCY_DELIVERY_REJECTED"
