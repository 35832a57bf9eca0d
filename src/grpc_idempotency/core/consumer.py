"""Idempotent consumer decisions: which message ids are acceptable, how long a duplicate waits,
and what marking a message id means.

Theory of operation (the driver is ``grpc_idempotency.consumer``):

- A consumer marks a message id in ``processed_messages`` **in the same transaction** as its
  effect, commits, and only then acknowledges. So either both the mark and the effect committed
  (every later delivery is a duplicate: acknowledged, no effect), or neither did (the message is
  not acknowledged, and a redelivery runs the effect).
- The mark is one statement, ``INSERT ... ON CONFLICT``, that returns whether this transaction
  now owns the id. A concurrent duplicate (another replica, or a second delivery racing the
  first) blocks on the uncommitted row: when the first commits it sees a duplicate, when the first
  rolls back it owns the id and runs the effect itself. That wait is bounded (``max_wait`` and the
  caller's own timeout); past it the duplicate gives up with ``MessageInProgress``, without effect
  and without acknowledging, and the message comes back later.
- A mark expires ``retention`` after it was committed (database clock), however long the
  effect took. An expired mark is treated as
  absent, exactly like an idempotency key past retention: a redelivery after that runs the effect
  again, and takes the expired row over in the same statement. Whether expired marks have been
  purged yet changes nothing. Choose a retention longer than any redelivery can arrive (the
  relay's retries, a dead letter retried by hand).
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from grpc_idempotency.core.errors import (
    KeyInvalid,
    KeyMissing,
    KeyReused,
    MessageInProgress,
    StoreUnavailable,
)
from grpc_idempotency.core.keys import key_from_metadata
from grpc_idempotency.core.policy import MAX_DURATION, MIN_LEASE
from grpc_idempotency.core.wire import KEY_HEADER

MAX_MESSAGE_ID_BYTES = 1024
MAX_CONSUMER_NAME_LENGTH = 255
_CONSUMER_NAME = re.compile(r"[\x21-\x7e]+")
# A lock_timeout of 0 means "wait forever" to PostgreSQL: never send less than a millisecond.
_MIN_WAIT_MS = 1


class Consumed(enum.Enum):
    """What ``IdempotentConsumer.process`` did with a delivery."""

    PROCESSED = "processed"
    """The effect ran and committed with the mark, in this call."""
    DUPLICATE = "duplicate"
    """The id was already marked: the effect did not run. Acknowledge the message."""


class ConsumerOutcome(enum.Enum):
    """How a delivery to ``IdempotentConsumer.process`` (or ``process_call``) ended: the span
    attribute and the metric label. The first three returned (``Consumed.PROCESSED``,
    ``DUPLICATE``, and ``PROCESSED`` over an expired mark); the others raised, nothing marked,
    the message not to be acknowledged."""

    PROCESSED = Consumed.PROCESSED.value
    DUPLICATE = Consumed.DUPLICATE.value
    # PROCESSED over an expired mark: the id was processed before, past its retention, and the
    # effect ran again (a retention shorter than redeliveries arrive, or a dead letter retried).
    REPROCESSED = "reprocessed"
    MISMATCH = "mismatch"  # a processed id delivered with another payload (KeyReused)
    # Another delivery of the id still ran past the wait (MessageInProgress), or this one was
    # cancelled while waiting for it in this process (the server's "conflict" of a caller that
    # left while waiting).
    CONFLICT = "conflict"
    # The effect raised (or caught a failed statement), or the delivery was cancelled (but for
    # a wait on another delivery in this process: CONFLICT).
    RELEASED = "released"
    UNAVAILABLE = "unavailable"  # StoreUnavailable: the store, or the effect's connection, failed
    REJECTED = "rejected"  # a missing or malformed id, or arguments refused before the store


def failed_outcome(error: BaseException, *, checked: bool) -> ConsumerOutcome:
    """The outcome of a delivery that raised ``error``; ``checked``: its id and arguments had
    been accepted (before that, whatever was raised refused them). What the effect raised is
    classified where the consumer catches it, not here: an effect may raise a library error of
    its own (a nested consumer's ``KeyReused``), which is still its failure."""
    if not checked:
        return ConsumerOutcome.REJECTED
    if isinstance(error, KeyReused):
        return ConsumerOutcome.MISMATCH
    if isinstance(error, MessageInProgress):
        return ConsumerOutcome.CONFLICT
    if isinstance(error, StoreUnavailable):
        return ConsumerOutcome.UNAVAILABLE
    return ConsumerOutcome.RELEASED


@dataclass(frozen=True, kw_only=True, slots=True)
class ConsumerPolicy:
    retention: timedelta = timedelta(days=7)
    """How long a processed message id is remembered (from when it was processed)."""
    max_wait: timedelta = timedelta(seconds=5)
    """How long a duplicate waits for a concurrent delivery of the same id to finish."""
    idle_timeout: timedelta = timedelta(seconds=30)
    """How long the mark's transaction may sit idle (the effect awaiting something that is not
    the database, or this process frozen or cut off) before PostgreSQL ends its session: the
    mark rolls back and a redelivery elsewhere runs the effect. The server's default lease."""

    def __post_init__(self) -> None:
        for name in ("retention", "max_wait", "idle_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta):
                # Seconds as a number (the relay takes its durations so) failed the comparisons
                # below with a bare TypeError that named neither the setting nor the fix.
                raise TypeError(
                    f"{name} must be a timedelta (timedelta(seconds=30)), not {value!r}"
                )
        if not timedelta(0) < self.retention <= MAX_DURATION:
            # Longer overflowed the mark's timestamp: every delivery failed as a store outage.
            raise ValueError(f"retention must be positive and at most {MAX_DURATION.days} days")
        if not timedelta(0) <= self.max_wait <= MAX_DURATION:
            raise ValueError(f"max_wait must be 0 to {MAX_DURATION.days} days")
        if not MIN_LEASE <= self.idle_timeout <= MAX_DURATION:
            # The floor of a method's lease, which is the same bound on a call's transaction:
            # shorter (a microsecond is 1 ms to PostgreSQL), PostgreSQL ended the session under
            # any effect that awaited anything, and each redelivery failed the same way.
            raise ValueError(
                f"idle_timeout must be at least {MIN_LEASE // timedelta(milliseconds=1)} ms and"
                f" at most {MAX_DURATION.days} days"
            )

    @property
    def retention_s(self) -> float:
        return self.retention.total_seconds()

    @property
    def idle_timeout_s(self) -> float:
        return self.idle_timeout.total_seconds()

    def wait_s(self, timeout: float | None) -> float:
        """How long a duplicate may wait: ``max_wait``, never past the caller's ``timeout``."""
        bound = self.max_wait.total_seconds()
        return bound if timeout is None else max(0.0, min(bound, timeout))


def validate_consumer_name(name: str) -> str:
    # Not a str (bytes, an int): refused as a bad name too, where len() or the pattern raised a
    # TypeError of its own.
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_CONSUMER_NAME_LENGTH
        or not _CONSUMER_NAME.fullmatch(name)
    ):
        raise ValueError(
            f"consumer name {name!r} must be 1-{MAX_CONSUMER_NAME_LENGTH} visible ASCII characters"
        )
    return name


def validate_message_id(message_id: str) -> str:
    """A message id is any text PostgreSQL can hold, 1..1024 bytes of UTF-8 (the unique index
    bounds an entry: 1024 four-byte characters overflowed it, a failure reported as the store
    being down, so the message came back forever); ``KeyInvalid`` else."""
    if not isinstance(message_id, str):
        # Said "empty" of bytes or an int that were not.
        raise KeyInvalid(f"message id must be a str, not {type(message_id).__name__}")
    if not message_id:
        raise KeyInvalid("message id is empty")
    try:
        size = len(message_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise KeyInvalid("message id is not valid Unicode (a lone surrogate)") from None
    if size > MAX_MESSAGE_ID_BYTES:
        raise KeyInvalid(f"message id is longer than {MAX_MESSAGE_ID_BYTES} bytes of UTF-8")
    if "\x00" in message_id:
        raise KeyInvalid("message id contains NUL")
    return message_id


def lock_timeout(wait_s: float) -> str:
    """The ``lock_timeout`` setting that bounds the wait on a concurrent delivery's row."""
    # An int of milliseconds in PostgreSQL (about 24.8 days at most): a longer max_wait failed
    # every delivery with 22023, reported as the store being unavailable.
    return f"{min(max(_MIN_WAIT_MS, round(wait_s * 1000)), 2**31 - 1)}ms"


def consumed(rows_marked: int) -> tuple[Consumed, bool]:
    """What the mark statement's row count means, and whether the id's mark was taken over: 1,
    this transaction owns a new id; 2, it owns the id by taking its expired mark over (the id
    was processed before, past its retention: the effect runs again); 0, the id is marked and
    live: a duplicate. (An expired mark already purged leaves no trace: a new id, 1.)"""
    return (Consumed.PROCESSED if rows_marked else Consumed.DUPLICATE), rows_marked == 2


def payload_fingerprint(payload: bytes | bytearray | memoryview | None) -> bytes | None:
    """What a mark keeps of a delivery's payload: its SHA-256 (``None``: no payload given)."""
    if payload is None:
        return None
    if not isinstance(payload, bytes | bytearray | memoryview):
        # A str or a protobuf message has no single byte form the next delivery would share.
        hint = ""
        if callable(getattr(payload, "SerializeToString", None)):
            # The README's payload=request, in a servicer added by the generated
            # add_*Servicer_to_server, hands the parsed request: the bare "not OrderCreated"
            # said nothing of how to get the bytes, and each delivery failed until parked.
            hint = (
                ": a parsed protobuf request; register the method with raw bytes as its request"
                " (grpc.unary_unary_rpc_method_handler without request_deserializer) and pass"
                " those, as the relay sent them"
            )
        raise TypeError(
            f"payload must be bytes (the message as delivered), not {type(payload).__name__}{hint}"
        )
    # A memoryview by its bytes: hashing it as a buffer refused a strided one (BufferError).
    return hashlib.sha256(
        payload.tobytes() if isinstance(payload, memoryview) else payload
    ).digest()


def payload_reused(message_id: str, kept: bytes | None, given: bytes | None) -> KeyReused | None:
    """A duplicate whose payload is not the marked one's: another message under a reused id,
    refused rather than acknowledged unrun. Either digest unknown: nothing to compare."""
    if kept is None or given is None or kept == given:
        return None
    return KeyReused(
        f"message {message_id!r} was processed with another payload: its id is reused by a"
        " different message (a sender's key reused after its retention?); nothing ran: park it"
        " as a dead letter"
    )


def in_progress(message_id: str, waited_s: float) -> MessageInProgress:
    # A hint, not a promise: the other delivery has been running for at least the wait.
    retry_ms = min(1000, max(50, round(waited_s * 500)))
    return MessageInProgress(
        f"message {message_id!r} is being processed by another delivery"
        f" (waited {waited_s:.3g} s); not acknowledged",
        retry_after_ms=retry_ms,
    )


def message_id_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The message id a gRPC delivery carries: its ``idempotency-key`` (the outbox relay sets it
    to the row's key). ``KeyMissing`` without one; ``KeyInvalid`` when malformed."""
    key = key_from_metadata(metadata)
    if key is None:
        raise KeyMissing(f"the delivery carries no {KEY_HEADER!r} to deduplicate it by")
    return key
