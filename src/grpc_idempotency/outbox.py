"""The outbox relay: delivers what keyed handlers enqueued, at least once, through sinks.

A handler enqueues a message with ``current_call().enqueue(step, message)`` in the transaction of
its business change; the message's key is the outbox step's child key, the same on every
delivery, so receivers dedupe on it. The relay:

- **claims** a batch of due pending rows (``FOR UPDATE SKIP LOCKED``) and gives them a lease, in a
  short transaction that commits before any delivery; several relays side by side never hold one
  row at the same time;
- **delivers** the batch concurrently through a ``Sink`` (``GrpcSink`` calls a unary method with
  the payload as the request and the key as ``idempotency-key``; ``CallableSink`` awaits a
  function), each delivery bounded by ``delivery_timeout`` (shorter than the lease);
- **marks** the delivered rows ``sent``; a failed delivery is retried after
  ``DeliveryPolicy.after_failure`` (exponential backoff with jitter) and, after
  ``policy.max_attempts`` or at once on ``PermanentDeliveryError``, parked as ``dead`` with its
  last error (``grpc-idempotency outbox dead|retry|purge-dead``);
- a relay that dies between delivering and marking leaves the row claimed: it is due again when
  the lease expires, and delivered again. Such a lost claim is not a failed delivery: the rows
  of the batch are each claimed and delivered **alone** next time, so a row whose delivery kills
  the relay takes no other row with it again, and only it counts lost claims; after
  ``policy.max_attempts`` of them alone in a row (besides its batch's) it is parked without
  another delivery;
- **wakes** on ``LISTEN <schema>_outbox`` (the outbox's insert trigger notifies it) on a
  connection of its own, reconnecting when it drops, and also polls every ``poll_interval``
  seconds (or sooner, when a retry falls due). LISTEN needs a session of its own: behind
  PgBouncer in transaction mode, give it a direct DSN (``listen_dsn=``) or poll only
  (``listen=False``); a LISTEN found not to hold on its session is given up for polling;
- **purges** rows sent more than ``sent_retention`` seconds ago, in bounded batches;
- is **routed** by step with ``steps=``: a relay claims only the rows of those outbox steps, so
  steps bound for different receivers each get a relay (and sink) of their own;
- **traces** each delivery attempt: a span ``grpc_idempotency deliver <step>`` (kind PRODUCER),
  current while the sink runs (an instrumented gRPC or broker client's span nests in it), linked
  to the span that was current when the handler enqueued the message (its context is kept in the
  row): a link, not a parent, as messaging tracing does, since a delivery may come long after
  and be one of many attempts.

    relay = Relay(store, GrpcSink(channel, "/billing.v1.Ledger/Record"))
    stop = asyncio.Event()
    await relay.run(stop)           # until stop is set; or relay.run_once() for one batch

Or from the command line: ``grpc-idempotency relay --dsn DSN --grpc-target HOST:PORT --method
/pkg.Svc/Method``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import math
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Status, StatusCode

from grpc_idempotency import failpoints
from grpc_idempotency.core.errors import (
    DeliveryError,
    PermanentDeliveryError,
    StoreUnavailable,
)
from grpc_idempotency.core.log_text import loggable
from grpc_idempotency.core.outbox import (
    DeliveryPolicy,
    StepRoutes,
    relay_name_problem,
    step_routes,
)
from grpc_idempotency.core.seconds import MAX_DURATION_MS, checked_seconds
from grpc_idempotency.core.wire import KEY_HEADER, LIBRARY_HEADERS, retry_after_ms, unsendable
from grpc_idempotency.log_tracebacks import library_logger
from grpc_idempotency.scope import tenant_header
from grpc_idempotency.store.dsn_files import dsn_where
from grpc_idempotency.store.outbox_store import (
    BIGINT_MAX,
    DeadLetter,
    Failure,
    Listener,
    OutboxMessage,
    OutboxStore,
    StateCount,
)
from grpc_idempotency.store.postgres import Store, one_store, vet_dsn
from grpc_idempotency.telemetry import (
    _VERSION,
    METER_PROVIDER_ENV,
    TRACER_PROVIDER_ENV,
    linked_context,
    provider_from_env,
    tracing,
)

__all__ = [
    "DEFAULT_PERMANENT_CODES",
    "CallableSink",
    "DeadLetter",
    "DeliveryError",
    "DeliveryPolicy",
    "GrpcSink",
    "OutboxMessage",
    "OutboxStore",
    "PermanentDeliveryError",
    "Relay",
    "RelayStats",
    "Sink",
    "StateCount",
    "forward_scope",
    "relay_channel_options",
]

log = library_logger("grpc_idempotency.outbox")
# A batch failing with no outage to explain it logs its traceback at most this often per kind of
# error: a bug that fails every batch logged one per poll (720 an hour at the default 5 s).
_TRACEBACK_EVERY_S = 60.0
_METER_LOG_S = 60.0
"""How often a meter (or tracer) that raises on every batch is logged."""

# A delivery span's attributes. The outcome is the metric's label, with the same values, and
# "unrecorded" for an attempt whose outcome is left to the lease (as ``RelayStats.unrecorded``).
OUTCOME = "grpc_idempotency.outbox.outcome"
STEP = "grpc_idempotency.outbox.step"
ATTEMPT = "grpc_idempotency.outbox.attempt"
ROW_ID = "grpc_idempotency.outbox.row_id"
# The messaging conventions' (semconv 1.37) attributes of a PRODUCER span that sends one
# message: the relay hands the row's message on ("send"; the span name keeps its documented
# form, "<system> deliver <step>"). The destination is the step, the outbox's unit of routing
# (``Relay(steps=...)``), declared and few: the sink's own target (a gRPC method, a topic) is
# its own instrumented client span's to tell. Not messaging.message.id: the message id is the
# row's key, recorded (as the consumer's message id) only where the user opts in to keys.
_MESSAGING = {
    "messaging.system": "grpc_idempotency",
    "messaging.operation.type": "send",
    "messaging.operation.name": "deliver",
}
MESSAGING_DESTINATION = "messaging.destination.name"

_LISTEN_CHECK = "grpc-idempotency:listen-check:"
"""The payload prefix of a relay's NOTIFY round trip (``Relay._check_listen_database``): woken
by it, relays (all of them share the channel) claim nothing."""
_LISTEN_CHECK_MIN_S = 1.0
_LISTEN_CHECK_MAX_S = 5.0
"""How long the check waits for its NOTIFY: ``poll_interval`` (what LISTEN saves over polling),
within these bounds. A healthy relay waits only as long as the NOTIFY takes (milliseconds)."""
_LISTEN_CHECK_EVERY = 6
"""A listening relay sends its NOTIFY round trip every this many ``poll_interval``s (30 s by
default), besides the one at each connection to ``listen_dsn``: asking the session whether it
listens (every ``poll_interval``) misses a pooler that hands a lone client back the server
connection holding its LISTEN, yet drops what arrives there between transactions."""
_LISTEN_CHECK_WARN_EVERY_S = 3600.0
"""A round trip unheard again, after one was heard, is warned of at most this often."""

_CANCEL_CLEANUP_S = 5.0
"""How long a relay cancelled mid-batch may take to record its batch and give back the claims
it did not deliver (``Relay._settle_cancelled``): a shutdown waits for it."""

_CLEANUPS: set[asyncio.Future[None]] = set()
"""The cleanups of cancelled relays (``Relay._settle_cancelled``) still running."""

# A relay's purge of sent rows deletes in batches of this many rows, at most this many batches
# at a turn, so that it never holds up deliveries for long.
_PURGE_BATCH = 1000
_PURGE_BATCHES = 10


@runtime_checkable
class Sink(Protocol):
    """Where messages go. ``deliver`` returns once the receiver has accepted the message; it is
    called concurrently for the messages of a batch, and again for a message whose earlier
    delivery failed or whose relay died before marking it: receivers dedupe on
    ``message.key``. Raising is a failed delivery (retried); ``PermanentDeliveryError`` parks
    the message as a dead letter."""

    async def deliver(self, message: OutboxMessage) -> None: ...


async def _accepted(result: object, what: str) -> None:
    """Waits for a delivery's ``result``: awaited if awaitable; ``None``, from a plain function,
    once it returned. Anything else (a broker client's future that is not awaitable, as
    kafka-python's ``send`` returns) may still fail: not taken for an accepted message, nor
    tried again (the function ran, and would send it again on every retry), but parked.

    An awaitable that gives an awaitable (an async ``send`` returning the future of the
    broker's acknowledgement, as aiokafka's does) is accepted once that one is done too: its
    future was dropped, the row marked sent once the message was queued, and a broker that
    then failed lost it for good."""
    if inspect.isawaitable(result):
        acknowledged = await result
        if isinstance(acknowledged, concurrent.futures.Future):
            # A blocking client's send handed to a thread pool (executor.submit): not
            # awaitable, it was taken for the message accepted while the send still ran, and
            # a send that then failed lost the message (its row marked sent).
            acknowledged = asyncio.wrap_future(acknowledged)
        if inspect.isawaitable(acknowledged):
            await acknowledged
    elif result is not None:
        raise PermanentDeliveryError(
            f"{what} returned {type(result).__name__}, not an awaitable: a plain function must"
            " return None once the message is accepted (wait for a future it returns)"
        )


class CallableSink:
    """A sink that awaits ``fn(message)``: a broker client, an HTTP call, a test's recorder.
    A future it gives (an async ``send`` returning the broker's acknowledgement, as aiokafka's
    does, or a thread pool's ``concurrent.futures.Future``) is awaited too: the message is
    accepted once that is done.
    A plain function (a broker client's blocking ``send``) is called, and its return (``None``)
    taken as the message accepted; it runs on the event loop, so it must be quick. One that
    returns something else, not awaitable (a future), parks the message as a dead letter."""

    def __init__(self, fn: Callable[[OutboxMessage], Awaitable[object] | object]) -> None:
        if not callable(fn):  # else every delivery failed until the message was a dead letter
            raise TypeError(f"CallableSink takes a function of the message, not {fn!r}")
        self._fn = fn

    async def deliver(self, message: OutboxMessage) -> None:
        # A plain function has delivered by the time it returns: awaiting its result raised
        # TypeError, a failed delivery, and the message went out again on every retry until it
        # was parked as a dead letter.
        await _accepted(self._fn(message), "CallableSink's function")


MetadataFor = Callable[[OutboxMessage], Iterable[tuple[str, str | bytes]]]

# A receiver behind IdempotencyInterceptor records these for the key and replays them to every
# retry (its DEFAULT_RECORDED_ERRORS), so retrying with the same key cannot change the answer.
# Not UNIMPLEMENTED: gRPC answers it for a method the server lacks before any interceptor runs,
# nothing is recorded, and in a rolling deploy the producer often ships before its consumer: the
# message was a dead letter at its first delivery, for an operator to retry by hand. Retried, it
# is delivered once the method is deployed; a misspelt method is parked after max_attempts.
DEFAULT_PERMANENT_CODES: frozenset[grpc.StatusCode] = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


def check_method(method: str) -> str:
    """``method`` if it is a gRPC method path, "/package.Service/Method"; else ``ValueError``."""
    if not isinstance(method, str):
        # None or bytes was a bare AttributeError ("no attribute 'split'").
        raise TypeError(f"method must be a str, /package.Service/Method, not {method!r}")
    parts = method.split("/")
    if len(parts) != 3 or parts[0] or not parts[1] or not parts[2]:
        raise ValueError(f"method must look like /package.Service/Method, not {method!r}")
    return method


def relay_channel_options(timeout: float | None = 10.0) -> list[tuple[str, int]]:
    """Options for a relay's channel (``grpc.aio.insecure_channel(target, options=...)``) whose
    deliveries get ``timeout`` seconds each (``GrpcSink(timeout=)``; ``None``: 10 s).

    Any response size is taken, and a connection whose receiver went silent is left for a new
    one within about one delivery's time: a ping goes out once half of ``timeout`` passes with
    nothing read during a delivery, and the connection is closed if the ping is not answered in
    the other half (half at least 1 s). No pings without calls: receivers' default policy
    counts those as abuse."""
    # Each delivery's half: the ping goes out at most that long after the call starts (when
    # nothing has been read for that long), and the connection is closed if it is not answered
    # within the other half. Not under 1 s: gRPC sends no more than a ping a second anyway.
    seconds = 10.0 if timeout is None else timeout
    half_ms = min(max(1000, round(seconds * 500)), 2**31 - 1)  # a C int of milliseconds
    return [
        # The response is dropped, of any size: refused over gRPC's default 4 MiB
        # (RESOURCE_EXHAUSTED, retried), a delivery the receiver had run and answered OK failed,
        # went out again on every retry, and its row ended a dead letter.
        ("grpc.max_receive_message_length", -1),
        # A connection whose receiver is gone without a word (its host down, state lost at a NAT
        # or load balancer on the way) stays READY without keepalive: every delivery went out
        # on it and failed DEADLINE_EXCEEDED, for as long as it lasted (over 100 s measured on
        # loopback), each a failure towards the row's dead letter, though a new connection
        # would reach a working receiver. A ping unanswered closes it; the next delivery
        # reconnects.
        ("grpc.keepalive_time_ms", half_ms),
        ("grpc.keepalive_timeout_ms", half_ms),
        # What bounds the wait for the ping's answer in gRPC core today (keepalive_timeout_ms,
        # set above for a gRPC that applies it, is not: grpc/grpc#39239); its default is 60 s.
        # It bounds every ping's answer, a BDP probe's too: half a deadline is ample for a peer
        # that is there.
        ("grpc.http2.ping_timeout_ms", half_ms),
        # Pings only while a delivery is in flight: a receiver's default policy (gRPC core's
        # and grpc-go's) counts pings on a connection without calls as abuse, enough of them
        # ending it (GOAWAY too_many_pings); and an idle relay has nothing to check: its next
        # delivery's own ping finds a dead connection.
        ("grpc.keepalive_permit_without_calls", 0),
    ]


class GrpcSink:
    """Calls the unary ``method`` (``/package.Service/Method``) on ``channel`` with the message's
    payload bytes as the request, unchanged (the method's request type should be the payload's
    ``payload_type``), and the message's key as ``idempotency-key`` metadata, so a receiver behind
    ``IdempotencyInterceptor`` runs each message once however often it is delivered.

    ``metadata_for(message)`` adds metadata per message (``forward_scope`` passes the enqueuing
    call's tenant on). A status in ``permanent_codes`` dead-letters the message at once; any
    other error, including a deadline of ``timeout`` seconds, is retried, no sooner than the
    receiver's pushback asks (``grpc-retry-pushback-ms`` or ``RetryInfo``, up to the policy's
    ``max_backoff_s``). The default,
    ``DEFAULT_PERMANENT_CODES``, holds the errors a keyed receiver records for the key;
    UNIMPLEMENTED (the receiver lacks the method: not deployed yet, or misspelt here) is retried
    with the relay's backoff until its ``DeliveryPolicy.max_attempts``. To park such a message
    at once: ``permanent_codes=DEFAULT_PERMANENT_CODES | {grpc.StatusCode.UNIMPLEMENTED}``.

    The response is dropped, but ``channel`` still refuses one over its receive limit (gRPC's
    default is 4 MiB) with RESOURCE_EXHAUSTED, a failed delivery of a message the receiver ran:
    give it ``options=[("grpc.max_receive_message_length", -1)]``, as the ``relay`` command does.
    Nor does a channel without keepalive leave a connection whose receiver went silent (its host
    gone, or the connection's state lost at a NAT or load balancer): every delivery goes out on
    it and fails DEADLINE_EXCEEDED, a failure towards the dead letter each, for as long as it
    stays open. ``relay_channel_options(timeout)`` gives both, as the ``relay`` command uses
    them: ``grpc.aio.insecure_channel(target, options=relay_channel_options(10.0))``.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        method: str,
        *,
        metadata_for: MetadataFor | None = None,
        timeout: float | None = 10.0,
        permanent_codes: Iterable[grpc.StatusCode] = DEFAULT_PERMANENT_CODES,
    ) -> None:
        check_method(method)
        if not isinstance(channel, grpc.aio.Channel):
            # A blocking channel's call (grpc.insecure_channel) ran on the event loop, froze it
            # (a server on it too) until answered, and gave bytes that could not be awaited:
            # each delivery reached the receiver and was recorded as failed, so the message
            # went out again on every retry and ended a dead letter, delivered.
            raise TypeError(
                "GrpcSink takes a grpc.aio channel (grpc.aio.insecure_channel or"
                f" grpc.aio.secure_channel), not {type(channel).__module__}."
                f"{type(channel).__qualname__}"
            )
        # Else each failed every delivery DEADLINE_EXCEEDED (gRPC's deadline overflows past
        # about 1e10 s), or matched no status: every rejection retried to the last attempt.
        checked_seconds("timeout", timeout, positive=True, or_none=True)
        if isinstance(permanent_codes, str | bytes) or not isinstance(permanent_codes, Iterable):
            raise TypeError(
                "permanent_codes must be a collection of grpc.StatusCode members"
                f" ({{grpc.StatusCode.NOT_FOUND}}), not {permanent_codes!r}"
            )
        # Read once, then checked: a generator read through by the check left nothing to keep.
        codes = frozenset(permanent_codes)
        if not all(isinstance(code, grpc.StatusCode) for code in codes):
            raise TypeError(
                "permanent_codes must be grpc.StatusCode members (grpc.StatusCode.NOT_FOUND),"
                f" not {sorted(map(repr, codes))}"
            )
        self.method = method
        self.metadata_for = metadata_for
        self.timeout = timeout
        self.permanent_codes = codes
        # No serializers: the request is the payload's bytes, the response is left as bytes.
        self._call: Any = channel.unary_unary(
            method, request_serializer=None, response_deserializer=None
        )

    def _metadata(
        self, metadata_for: MetadataFor, message: OutboxMessage
    ) -> list[tuple[str, str | bytes]]:
        """``metadata_for(message)``, checked: anything but (name, value) pairs, a str name and
        a str or bytes value, is the function's bug, the same on every try, so a dead letter at
        once that names it (``PermanentDeliveryError``), as metadata gRPC refuses is. It failed
        with the interpreter's words ("too many values to unpack") on every try until
        max_attempts; one pair returned bare, ``("ab", "cd")``, went out as headers a and c.
        What the function raises is left as it is: a failed delivery, retried (a look-up that
        failed), or a dead letter if it raised PermanentDeliveryError (``forward_scope``).
        Types are named, never values: a value may be a credential."""
        returned: object = metadata_for(message)
        shape = "(name, value) pairs, a str name and a str or bytes value,"
        if isinstance(returned, str | bytes | dict) or not isinstance(returned, Iterable):
            if isinstance(returned, dict):
                given = "a dict (pass list(d.items()))"
            else:
                given = type(returned).__name__
            raise PermanentDeliveryError(
                f"{self.method}: metadata_for must return {shape} not {given}"
            )
        extra = list(returned)
        for item in extra:
            if not isinstance(item, tuple | list) or len(item) != 2:
                what = f"an item {type(item).__name__}"
                if isinstance(item, tuple | list):
                    what += f" of {len(item)}"
                raise PermanentDeliveryError(
                    f"{self.method}: metadata_for must return {shape} not {what}"
                )
            name, value = item
            if not isinstance(name, str):
                raise PermanentDeliveryError(
                    f"{self.method}: metadata_for must return {shape} not a name"
                    f" {type(name).__name__}"
                )
            if not isinstance(value, str | bytes):
                raise PermanentDeliveryError(
                    f"{self.method}: metadata_for must return {shape} not a value"
                    f" {type(value).__name__} (header {name!r})"
                )
        return [(name, value) for name, value in extra]

    async def deliver(self, message: OutboxMessage) -> None:
        metadata: list[tuple[str, str | bytes]] = [(KEY_HEADER, message.key)]
        if self.metadata_for is not None:
            extra = self._metadata(self.metadata_for, message)
            own = sorted({name.lower() for name, _ in extra} & LIBRARY_HEADERS)
            if own:
                # The server would refuse the call (two keys, or the -bin form) on every try.
                raise PermanentDeliveryError(
                    f"{self.method}: metadata_for gave the library's own headers {own}:"
                    " the relay sends the row's key itself"
                )
            for name, value in extra:
                # gRPC refuses such metadata as the call starts, with an error of its own that
                # read as a failed delivery: retried until max_attempts, every time the same.
                problem = unsendable(name, value)
                if problem is not None:
                    raise PermanentDeliveryError(f"{self.method}: metadata_for gave {problem}")
            metadata.extend(extra)
        try:
            await self._call(message.payload, metadata=tuple(metadata), timeout=self.timeout)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            text = f"{self.method}: {code.name}: {err.details() or ''}"
            if code in self.permanent_codes:
                raise PermanentDeliveryError(text) from err
            # The receiver's pushback (a keyed one's for a key still in progress): retried on
            # the relay's backoff alone, it was tried sooner than asked, each early try another
            # failed delivery towards the dead letter. Malformed (-1) or none: the backoff.
            # Past the longest wait, that wait (the relay waits max_backoff_s at most anyway):
            # DeliveryError refused it, and the delivery failed as the library's ValueError,
            # the receiver's status and its pushback lost. From the wire the hint stays far
            # below a float's overflow (gRPC's C-core reads the trailer as an int64, anything
            # larger reaching Python as -2**63, malformed; a RetryInfo tops out near 1e22 ms):
            # the cap here is for the longest wait. Capping ints before dividing guards direct
            # callers (RetryPolicy.delay_s, a sink raising its own DeliveryError), not this.
            hint = retry_after_ms(err.trailing_metadata())
            retry_after = (
                min(hint, MAX_DURATION_MS) / 1000 if hint is not None and hint > 0 else None
            )
            raise DeliveryError(text, retry_after_s=retry_after) from err


def forward_scope(header: str = "x-tenant-id", *, prefix: str = "tenant:") -> MetadataFor:
    """``metadata_for`` passing the enqueuing call's scope on as ``header``, without ``prefix``:
    the counterpart of ``MetadataScope(header, prefix=prefix)`` on the receiving side. A message
    whose scope lacks the prefix, or is not printable ASCII (all a gRPC metadata value may be),
    cannot be delivered with it (``PermanentDeliveryError``: a dead letter at once, instead of
    failing on every try until then). A header no delivery could send (not a metadata name, the
    library's own, gRPC's own, a -bin one), or a prefix no scope can start with (holding a
    character no scope may hold, or too long), is a ``ValueError`` here, as ``MetadataScope``
    refuses them; a name in capitals is sent in lowercase, as ``MetadataScope`` reads it."""
    # Else every message was a dead letter at its first delivery (gRPC refuses the name).
    header = tenant_header(header, prefix, user="forward_scope")

    def metadata_for(message: OutboxMessage) -> list[tuple[str, str | bytes]]:
        if not message.scope.startswith(prefix) or len(message.scope) == len(prefix):
            raise PermanentDeliveryError(
                f"scope {message.scope!r} does not start with {prefix!r}: no {header} to send"
            )
        value = message.scope[len(prefix) :]
        if not (value.isascii() and value.isprintable()):
            raise PermanentDeliveryError(
                f"scope {message.scope!r}: {value!r} is not printable ASCII, which a gRPC"
                f" metadata value ({header}) must be"
            )
        return [(header, value)]

    return metadata_for


def _listen_failure(err: Exception) -> str:
    """What a LISTEN connection's failure says, for the log: never the driver's text about a
    DSN it cannot parse, which quotes pieces of it (of a password holding an unencoded / ? #)."""
    # Not ssl.SSLCertVerificationError, a ValueError and an OSError: a certificate that failed
    # verify-full, told as the DSN not parsing.
    if isinstance(err, (ValueError, IndexError, OverflowError)) and not isinstance(err, OSError):
        return "the listen DSN cannot be parsed: percent-encode special characters in its password"
    return f"{type(err).__name__}: {err}"


def _error_text(err: Exception) -> str:
    """A failed delivery's error, for its row's ``last_error``. Never raises: an exception
    whose ``__str__`` fails raised out of the delivery, and took its batch (the rows delivered
    too, sent again after the lease) and the relay down."""
    try:
        return str(err) if isinstance(err, DeliveryError) else f"{type(err).__name__}: {err}"
    except Exception:
        return f"{type(err).__name__} (its message could not be read)"


@dataclass(slots=True)
class RelayStats:
    """Counts since the relay was made."""

    batches: int = 0
    claimed: int = 0
    delivered: int = 0
    """Deliveries that succeeded and were marked sent."""
    retried: int = 0
    """Failed deliveries rescheduled."""
    dead: int = 0
    """Rows parked as dead letters."""
    unrecorded: int = 0
    """Outcomes not recorded: the claim was taken over meanwhile, or marking failed; such rows
    are delivered again when their lease expires."""
    released: int = 0
    """Claims given back undelivered, due again at once: the relay was cancelled mid-batch (or
    as its claim committed). ``claimed`` is the sum of these five."""
    purged: int = 0
    """Sent rows deleted after retention."""


@dataclass(frozen=True, slots=True)
class _Batch:
    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    alone: bool = False
    """A row claimed alone because its previous claim was lost: more may be due behind it."""

    def more_due(self, batch_size: int) -> bool:
        """Whether more rows are probably due now (claim again at once)."""
        return self.claimed >= batch_size or self.alone


_SENT = "sent"
_UNRECORDED = "unrecorded"


@dataclass(frozen=True, slots=True)
class _Failed:
    error: str
    permanent: bool
    retry_after_s: float | None = None
    kind: str | None = None
    """The class of the exception the delivery ended with, for its span's status."""


@dataclass(slots=True)
class _Attempt:
    """A delivery's outcome, and its span (``None``: not traced) with when the delivery ended:
    the span ends once the batch has recorded the outcome (or failed to), at that time."""

    outcome: str | _Failed
    span: trace.Span | None = None
    ended_ns: int = 0


_SETTINGS = frozenset(
    {
        "store",
        "sink",
        "policy",
        "batch_size",
        "lease",
        "poll_interval",
        "sent_retention",
        "purge_interval",
        "delivery_timeout",
        "outbox",
        "listen_dsn",
        "steps",
    }
)
"""``Relay``'s attributes that cannot be assigned once the relay is made."""


class Relay:
    """Delivers the outbox of ``store`` through ``sink``.

    - ``batch_size``: rows claimed at once, and delivered concurrently;
    - ``lease``: seconds a claim lasts; a relay that dies mid-batch leaves its rows to others for
      that long. ``delivery_timeout`` (default half the lease) bounds each delivery, so a batch is
      marked well within its lease;
    - ``poll_interval``: the longest the relay sleeps without a notification;
    - ``sent_retention``: sent rows older than this many seconds are purged (every
      ``purge_interval``); ``None`` keeps them;
    - ``name``: recorded as ``claimed_by`` and shown in the relay's log lines; unique per
      relay (``None`` or empty: host, pid, random). One line of visible text, as
      ``grpc-idempotency relay --name`` takes it (``core.outbox.relay_name_problem``);
    - ``listen``: wake on ``LISTEN/NOTIFY`` (default). ``False`` polls only, every
      ``poll_interval`` (and when a retry falls due): for a database reached only through a
      transaction pooler, where LISTEN cannot work;
    - ``listen_dsn``: LISTEN on a connection of its own to this DSN instead of on a connection
      of the store's pool. When the store's DSN goes through PgBouncer in transaction (or
      statement) mode, point this at PostgreSQL itself, or at a session-mode pool: a
      notification reaches only the session that listens, and a pooler hands each
      transaction to any server connection. Each time it connects, the relay checks that a
      NOTIFY sent through the store's pool reaches it (within ``poll_interval``, 1 to 5 s): if
      not (this DSN names another database, another shard's, on which the channel has the
      same name), it logs a warning naming both, and its rows are found by polling;
    - ``steps``: deliver only the rows of these outbox steps, for a relay whose sink is one
      receiver among several (``None``, the default: every row). A step name
      (``receipt-email.v1``) takes that version only; a name without its version
      (``receipt-email``) takes every version, so a ``.v2`` is not left to no relay. Relays
      with different ``steps`` share the outbox without taking each other's rows; a row whose
      step no relay names waits, pending. ``relay.steps`` holds them, read
      (``core.outbox.StepRoutes``).
    - ``meter_provider`` / ``tracer_provider``: where its counter and its delivery spans go (the
      global providers unless given). One span per delivery attempt, ``grpc_idempotency deliver
      <step>``, kind PRODUCER (it hands the message on; a gRPC sink's CLIENT span nests in it),
      with ``grpc_idempotency.outbox.step``, ``.attempt``, ``.row_id`` and ``.outcome`` (the
      counter's ``sent``, ``retry``, ``dead``, or ``unrecorded``: left to the lease, its claim
      taken over meanwhile or its outcome not recorded), the messaging conventions'
      ``messaging.system`` (``grpc_idempotency``), ``messaging.operation.type`` (``send``),
      ``messaging.operation.name`` (``deliver``) and ``messaging.destination.name`` (the
      step), status
      ERROR on a failed delivery naming the exception's class, and a link to the span that
      enqueued the message, if one was current. What OpenTelemetry raises never changes a
      delivery.

    Through a transaction pooler LISTEN fails silently: the relay would only poll, and the
    pooled server connection it ran on goes on receiving notifications that nobody reads. So
    the relay checks, every ``poll_interval``, that its session still listens; when it does not
    (the check ran on another server connection), it logs a warning, stops listening and polls.
    Every 6 poll intervals it also sends a NOTIFY through the store's pool and waits (1 to 5 s,
    apart from its deliveries) for it to arrive: a pooler that hands a lone client back the
    server connection holding its LISTEN passes the first check, yet drops the notifications.
    Unheard, it logs a warning once, and its rows are found by polling.
    """

    def __init__(
        self,
        store: Store,
        sink: Sink,
        *,
        policy: DeliveryPolicy = DeliveryPolicy(),  # noqa: B008  (frozen, immutable)
        batch_size: int = 100,
        lease: float = 30.0,
        poll_interval: float = 5.0,
        sent_retention: float | None = 86400.0,
        purge_interval: float = 60.0,
        delivery_timeout: float | None = None,
        name: str | None = None,
        rng: random.Random | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        on_listening: Callable[[], None] | None = None,
        listen: bool = True,
        listen_dsn: str | None = None,
        steps: Iterable[str] | StepRoutes | None = None,
    ) -> None:
        if not isinstance(listen, bool):
            # Truth-tested: listen="no" (from the environment) listened.
            raise TypeError(f"listen must be True or False, not {listen!r}")
        # Checked first, before the store: a malformed selector is the caller's to fix.
        routes = step_routes(steps)
        if name is not None:
            if not isinstance(name, str):
                raise TypeError(f"name must be a str or None, not {type(name).__name__}")
            # The command's --name rule: a newline in it forged log lines, and NUL or a lone
            # surrogate could not be stored in claimed_by (every claim read as an outage).
            problem = relay_name_problem(name)
            if problem is not None:
                raise ValueError(f"name: {problem}")
        if listen_dsn is not None and not listen:
            raise ValueError("listen_dsn is for listening: not with listen=False")
        if listen_dsn is not None and not isinstance(listen_dsn, str):
            # Else accepted, to fail only once the relay ran.
            raise TypeError(f"listen_dsn must be a str (a DSN) or None, not {listen_dsn!r}")
        # Compared raw, None, text or a timedelta was a bare "'<' not supported" naming no
        # setting; True was 1 s; a NaN poll_interval made the relay claim in a tight loop.
        for setting, value in (
            ("lease", lease),
            ("poll_interval", poll_interval),
            ("purge_interval", purge_interval),
        ):
            checked_seconds(setting, value, positive=True)
        checked_seconds("sent_retention", sent_retention, or_none=True)  # None: keep sent rows
        # None: half the lease.
        checked_seconds("delivery_timeout", delivery_timeout, positive=True, or_none=True)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            # TypeError, as the durations above and every other setting of the wrong type.
            raise TypeError(f"batch_size must be a whole number, not {batch_size!r}")
        if meter_provider is not None and not callable(getattr(meter_provider, "get_meter", None)):
            # Else a bare AttributeError ("no attribute 'get_meter'") out of the constructor.
            raise TypeError(
                "meter_provider must be an OpenTelemetry MeterProvider or None, not"
                f" {meter_provider!r}"
            )
        if tracer_provider is not None and not callable(
            getattr(tracer_provider, "get_tracer", None)
        ):
            # As meter_provider: else a bare AttributeError out of the constructor.
            raise TypeError(
                "tracer_provider must be an OpenTelemetry TracerProvider or None, not"
                f" {tracer_provider!r}"
            )
        if rng is not None and not callable(getattr(rng, "random", None)):
            # Else accepted, to fail at the first failed delivery (no attribute 'random').
            raise TypeError(f"rng must be a random.Random or None, not {rng!r}")
        if on_listening is not None and not callable(on_listening):
            # Else accepted, and its call failed (logged) each time LISTEN was established.
            raise TypeError(f"on_listening must be a function or None, not {on_listening!r}")
        if not 1 <= batch_size <= BIGINT_MAX:
            # Past bigint every claim failed (asyncpg's DataError), read as a store outage.
            raise ValueError(f"batch_size must be a whole number from 1 to {BIGINT_MAX}")
        if delivery_timeout is None:
            delivery_timeout = lease / 2
        if not 0 < delivery_timeout < lease:
            raise ValueError("delivery_timeout must be positive and shorter than the lease")
        # Each was accepted and failed only once rows were claimed: a function as the sink
        # failed every delivery (until each message was a dead letter); another policy took
        # run() down at its first batch.
        if not isinstance(sink, Sink):
            raise TypeError(
                f"sink must be a Sink (an object with async deliver(message)), not {sink!r}:"
                " wrap a function in CallableSink(fn)"
            )
        if not isinstance(policy, DeliveryPolicy):
            raise TypeError(f"policy must be a DeliveryPolicy, not {policy!r}")
        store = one_store(store, user="Relay", per_shard="run one Relay per shard's Store")
        if listen and listen_dsn is None and store.pool.get_max_size() < 2:
            # LISTEN would hold the pool's only connection, and every claim wait for it forever.
            raise ValueError(
                "a relay that listens on the store's pool needs max_size >= 2 (one connection"
                " holds the LISTEN); pass listen_dsn=, or listen=False to poll"
            )
        # Read-only once set (``__setattr__``, ``_SETTINGS``): checked here, together, and read
        # live while the relay runs.
        self.store: Final = store
        self.sink: Final = sink
        self.policy: Final = policy
        self.batch_size: Final = batch_size
        self.lease: Final = lease
        self.poll_interval: Final = poll_interval
        self.sent_retention: Final = sent_retention
        self.purge_interval: Final = purge_interval
        self.delivery_timeout: Final = delivery_timeout
        self._name = name or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.outbox: Final = OutboxStore(store)
        self.stats = RelayStats()
        self.listen_dsn: Final = listen_dsn
        self.steps: Final = routes
        """The steps whose rows this relay claims (``StepRoutes``), ``None``: every step."""
        self.listening = asyncio.Event()
        """Set while the relay holds its LISTEN connection (``run`` only)."""
        self._on_listening = on_listening
        """Called each time LISTEN is (re)established, before the next batch is claimed (when
        polling only, once, before the first batch): a process can report itself ready there
        without racing its first delivery. What it raises is logged; the relay goes on."""
        self._listen = listen
        self.listen_failure: str | None = None
        """Why the relay gave up LISTEN for polling (it did not hold on its session), if it
        did in its latest ``run()``: each run tries LISTEN again."""
        self._heard = asyncio.Event()
        """Set when the NOTIFY round trip's (``_check_token``) arrives
        (``_check_listen_database``)."""
        self._check_token = ""
        self._unheard: tuple[str, float] | None = None
        """The latest round trip, if its NOTIFY did not arrive in time (its payload, when it was
        sent): its arrival later is logged. Whether it is warned of is ``_warn_unheard``'s."""
        self._unheard_warned_at: float | None = None
        self._warn_unheard = True
        """Whether a round trip unheard is to be warned of (``_LISTEN_CHECK_WARN_EVERY_S`` after
        the last warning): not since one was, until one is heard."""
        self._random = rng or random.Random()
        self._traceback_logged: dict[type[BaseException], float] = {}
        self._wake = asyncio.Event()
        self._running = False
        # The interceptor's meter (its version too): one instrumentation scope, not two.
        meter = provider_from_env(
            METER_PROVIDER_ENV,
            lambda: metrics.get_meter("grpc_idempotency", _VERSION, meter_provider),
        )
        self._deliveries = meter.create_counter(
            "grpc_idempotency.outbox.deliveries",
            unit="{message}",
            description="Outbox deliveries by outcome: sent, retry, dead",
        )
        self._count_failed_at: float | None = None
        # The interceptor's tracer too; the global provider unless one is given.
        self._tracer = provider_from_env(
            TRACER_PROVIDER_ENV,
            lambda: trace.get_tracer("grpc_idempotency", _VERSION, tracer_provider),
        )
        self._own_tracer = tracer_provider is not None
        self._env_tracer = TRACER_PROVIDER_ENV in os.environ
        self._trace_failed_at: float | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # The settings were checked together when the relay was made (``delivery_timeout``
        # shorter than ``lease``, a positive ``batch_size``, a ``Sink``) and are read while it
        # runs: one changed afterwards skipped those checks (``relay.delivery_timeout = 2 *
        # relay.lease`` let a delivery outlast its claim, and the row go out twice at once).
        if name in _SETTINGS and name in self.__dict__:
            raise AttributeError(
                f"Relay.{name} is read-only: the relay checked it when it was made and reads"
                " it while it runs; make a new Relay with the setting"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        # Deleted, a setting could be assigned again past ``__setattr__``'s guard.
        if name in _SETTINGS:
            raise AttributeError(f"Relay.{name} is read-only: it cannot be deleted")
        object.__delattr__(self, name)

    @property
    def name(self) -> str:
        """The relay's name: its identity in the rows it claims (``claimed_by``), which its
        marks are fenced by. Read-only: assigned, it skipped the check ``Relay(name=...)``
        makes, and a rename while the relay runs left the rows it had claimed under the old
        name unmarkable (each delivered again once its lease ran out)."""
        return self._name

    # -- one batch -------------------------------------------------------------------------

    async def run_once(self) -> int:
        """Claims one batch of due rows, delivers it and records the outcomes; returns how many
        were delivered. Raises ``StoreUnavailable`` if the database fails (rows already claimed
        are delivered again once their lease expires)."""
        return (await self._batch()).delivered

    async def drain(self) -> int:
        """Runs batches until a claim finds nothing due; returns how many rows were delivered.
        Rows that failed wait for their retry and are not counted. (Not "until a batch is not
        full": a claim passes over rows whose last claim was lost, each taken alone later, so a
        short batch can leave some due.)"""
        total = 0
        while True:
            batch = await self._batch()
            total += batch.delivered
            if batch.claimed == 0:
                return total

    async def _claim(self) -> list[OutboxMessage]:
        messages = await self.outbox.claim(
            relay=self.name, limit=self.batch_size, lease_s=self.lease, steps=self.steps
        )
        if failpoints.ENABLED:
            # The claim committed, its rows not yet the relay's: where a cancel that lands as
            # the claim's answer comes back stands.
            await failpoints.hit("relay_after_claim")
        return messages

    async def _batch(self) -> _Batch:
        # Seen through when the relay is cancelled (a task of its own, shielded): a cancel
        # while the statement runs may come after PostgreSQL committed it, and the rows it
        # claimed, never seen, waited out the lease as lost claims. Given back instead; by
        # their claims (id, attempts), not "every row claimed by this name": a name given to
        # two relays (``name=``, ``--name``; nothing enforces it unique) gave back the rows the
        # other was delivering.
        claiming = asyncio.ensure_future(self._claim())
        try:
            messages = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            await self._outlast_cancel(self._give_back_claim(claiming))
            raise
        self.stats.batches += 1
        if not messages:
            return _Batch()
        self.stats.claimed += len(messages)
        delivering = [asyncio.ensure_future(self._attempt(m)) for m in messages]
        try:
            attempts = await asyncio.gather(*delivering)
        except asyncio.CancelledError:
            # gather has cancelled the deliveries still running, and waited for them.
            await self._settle_cancelled(messages, delivering)
            raise
        except BaseException:
            # The deliveries still running end their spans (unrecorded); those done had left
            # theirs to be ended here, with the batch.
            for done in delivering:
                if done.done() and not done.cancelled() and done.exception() is None:
                    self._end_span(done.result(), _UNRECORDED, None)
            raise
        # Every delivery ended: a cancel now cut the marks short (cancelled in PostgreSQL too),
        # and left delivered rows claimed, to go again after the lease as lost claims. So they
        # run on, shielded and bounded as a cancelled batch's cleanup; once (the outcomes, the
        # stats and the spans are recorded by that one task).
        recording = asyncio.ensure_future(self._record_ending_spans(messages, attempts))
        try:
            return await asyncio.shield(recording)
        except asyncio.CancelledError:
            await self._outlast_cancel(self._recorded_after_cancel(recording))
            raise

    async def _give_back_claim(self, claiming: asyncio.Future[list[OutboxMessage]]) -> None:
        """The relay was cancelled while claiming: gives back what the claim took, once it
        has (``_outlast_cancel``)."""
        try:
            messages = await claiming
        except Exception as err:
            log.warning(
                "relay %s: cancelled while claiming, and the claim failed (%s): rows it may"
                " have claimed are delivered again after their lease",
                self.name,
                err,
            )
            return
        self.stats.batches += 1
        if messages:
            self.stats.claimed += len(messages)
            await self._settle([], [(m.id, m.attempts) for m in messages])

    async def _recorded_after_cancel(self, recording: asyncio.Future[_Batch]) -> None:
        """The relay was cancelled while recording its batch: awaits the recording, and logs
        its failure (after a second cancel nobody else retrieves it)."""
        try:
            await recording
        except Exception as err:
            self._warn_unrecorded(f"({err})")

    async def _outlast_cancel(self, cleanup: Awaitable[None]) -> None:
        """Runs ``cleanup`` (which logs its own failure) after the relay was cancelled:
        shielded from a second cancel and bounded (``_CANCEL_CLEANUP_S``), so that a database
        that does not answer leaves the rows to their lease and never holds up a shutdown."""
        task = asyncio.ensure_future(cleanup)
        # The loop holds tasks weakly: after a second cancel this set is the cleanup's only
        # strong reference while it runs.
        _CLEANUPS.add(task)
        task.add_done_callback(_CLEANUPS.discard)
        try:
            async with asyncio.timeout(_CANCEL_CLEANUP_S):
                await asyncio.shield(task)
        except asyncio.CancelledError:
            raise  # cancelled again: the cleanup goes on while the loop runs
        except TimeoutError:
            task.cancel()
            self._warn_unrecorded(f"within {_CANCEL_CLEANUP_S:g}s")

    def _warn_unrecorded(self, why: str) -> None:
        """The one warning of a cancelled batch whose outcomes were not all recorded."""
        log.warning(
            "relay %s: cancelled mid-batch, and its outcomes could not be recorded %s:"
            " rows not recorded are delivered again after their lease",
            self.name,
            why,
        )

    async def _settle_cancelled(
        self, messages: list[OutboxMessage], delivering: Sequence[asyncio.Future[_Attempt]]
    ) -> None:
        """The relay was cancelled mid-batch (``task.cancel()`` in a server's shutdown hook,
        ``asyncio.run`` cancelling leftover tasks): records the outcomes of the deliveries that
        ended, and gives back the claims of those cut short, due again at once. Left claimed,
        the batch came back only after the lease, as a lost claim: a row in flight at
        ``max_attempts + 1`` such cancels in a row (a deploy each) was parked without a delivery
        ever failing, and the rows the receiver had accepted waited out the lease to go again.
        A relay killed outright (kill -9) cannot do this: its claims stay lost claims, which is
        what parks a row whose delivery kills relays; a cancel says nothing against the row.
        Shielded from a second cancel and bounded (``_CANCEL_CLEANUP_S``): a database that does
        not answer leaves the rows to their lease, as before, and never holds up a shutdown."""
        ended: list[tuple[OutboxMessage, _Attempt]] = []
        cut: list[tuple[int, int]] = []
        for message, done in zip(messages, delivering, strict=True):
            if done.done() and not done.cancelled() and done.exception() is None:
                ended.append((message, done.result()))
            else:
                cut.append((message.id, message.attempts))
        await self._outlast_cancel(self._settle(ended, cut))

    async def _settle(
        self, ended: list[tuple[OutboxMessage, _Attempt]], cut: list[tuple[int, int]]
    ) -> None:
        """Records the outcomes of the deliveries that ``ended`` and gives back the claims
        ``cut`` short. Its failure is logged here, not where it is awaited: after a second
        cancel nobody awaits it, and it was an exception never retrieved, the relay's warning
        unsaid."""
        released = 0
        try:
            if ended:
                await self._record_ending_spans([m for m, _ in ended], [a for _, a in ended])
            # After the marks: a release that cannot run leaves only undelivered rows claimed.
            released = await self.outbox.release(relay=self.name, claims=cut)
        except Exception as err:
            self._warn_unrecorded(f"({err})")
            return
        finally:
            # A claim not given back (taken over after its lease, or the release failed or ran
            # out of time) is left to the lease: unrecorded, so that the counts add up.
            self.stats.released += released
            self.stats.unrecorded += len(cut) - released
        log.info(
            "relay %s: cancelled mid-batch; %d claim(s) not delivered given back",
            self.name,
            released,
        )

    async def _record_ending_spans(
        self, messages: list[OutboxMessage], attempts: list[_Attempt]
    ) -> _Batch:
        """``_record``, then ends each delivery's span with its outcome."""
        # Each span ends (in finally) with its outcome once recorded: a batch whose outcomes
        # could not be recorded (the database down, the relay cancelled) leaves them to the
        # lease, "unrecorded", as RelayStats and the counter have it.
        decided = [_UNRECORDED] * len(attempts)
        recorded = [False, False]
        try:
            return await self._record(messages, attempts, decided, recorded)
        finally:
            recorded_sent, recorded_failed = recorded
            for attempt, outcome in zip(attempts, decided, strict=True):
                failed = attempt.outcome if isinstance(attempt.outcome, _Failed) else None
                if (outcome == _SENT and not recorded_sent) or (
                    failed is not None and not recorded_failed
                ):
                    outcome = _UNRECORDED
                self._end_span(attempt, outcome, failed)

    async def _record(
        self,
        messages: list[OutboxMessage],
        attempts: list[_Attempt],
        decided: list[str],
        recorded: list[bool],
    ) -> _Batch:
        """Records a batch's outcomes; ``decided`` gets each delivery's, ``recorded`` whether
        the sent rows, then the failed ones, were recorded."""
        alone = messages[0].lost_claims > 0  # the claim takes a lost row alone
        sent: list[tuple[int, int]] = []
        failures: list[Failure] = []
        for i, (message, attempt) in enumerate(zip(messages, attempts, strict=True)):
            outcome = attempt.outcome
            if isinstance(outcome, str):  # sent, or left to the lease (unrecorded)
                decided[i] = outcome
            if outcome == _SENT:
                sent.append((message.id, message.attempts))
            elif isinstance(outcome, _Failed):
                # Counted: failed deliveries on record, this one included; not the claims lost
                # with a relay that died delivering this row's batch.
                delay = (
                    None
                    if outcome.permanent
                    else self.policy.after_failure(message.failures + 1, self._random.random())
                )
                if delay is not None and outcome.retry_after_s is not None:
                    # As the receiver asked, up to the longest backoff: a hint of hours (a
                    # misconfigured receiver) cannot hold the row past the operator's bound.
                    asked = min(outcome.retry_after_s, self.policy.max_backoff_s)
                    delay = max(delay, asked)
                failures.append(
                    Failure(
                        id=message.id,
                        attempts=message.attempts,
                        delay_s=delay,
                        error=outcome.error,
                    )
                )
                decided[i] = "dead" if delay is None else "retry"
                # The error quotes the receiver's status message or the sink's exception:
                # escaped for the log (a newline forged lines), stored as it came.
                if delay is None:
                    log.warning(
                        "outbox row %d (%s, key %s) is a dead letter after %d claim(s): %s",
                        message.id,
                        message.step,
                        message.key,
                        message.attempts,
                        loggable(outcome.error),
                    )
                else:
                    log.info(
                        "outbox row %d: delivery %d failed, retrying in %.1fs: %s",
                        message.id,
                        message.attempts,
                        delay,
                        loggable(outcome.error),
                    )
        # An outcome that cannot be recorded (the database fails here) leaves the rows claimed:
        # they are delivered again when the lease expires. The rows marked sent before such a
        # failure are delivered all the same, and counted so.
        # A row the marks leave out was claimed again after its lease expired (the fencing on
        # its attempts): its outcome is not this relay's to record, and it is delivered again,
        # so its span ends unrecorded, as RelayStats.unrecorded counts it.
        delivered = retried = dead = 0
        try:
            marked = await self.outbox.mark_sent_ids(relay=self.name, claims=sent)
            delivered = len(marked)
            # Before the failures' mark: should it fail, the sent rows' spans end as recorded.
            for i, message in enumerate(messages):
                if decided[i] == _SENT and message.id not in marked:
                    decided[i] = _UNRECORDED
            recorded[0] = True
            states = await self.outbox.mark_failed_states(relay=self.name, failures=failures)
            dead = sum(1 for state in states.values() if state == "dead")
            retried = len(states) - dead
            recorded[1] = True
            for i, message in enumerate(messages):
                if decided[i] in ("retry", "dead") and message.id not in states:
                    decided[i] = _UNRECORDED
        finally:
            self.stats.unrecorded += len(messages) - delivered - retried - dead
            self.stats.delivered += delivered
            self.stats.retried += retried
            self.stats.dead += dead
            for outcome_name, count in (("sent", delivered), ("retry", retried), ("dead", dead)):
                if count:
                    self._count(outcome_name, count)
        return _Batch(
            claimed=len(messages), delivered=delivered, retried=retried, dead=dead, alone=alone
        )

    def _count(self, outcome: str, count: int) -> None:
        # A metric reader or exporter that raises must not fail a batch whose outcomes are
        # recorded (the relay would take the batch for lost and log it so).
        try:
            self._deliveries.add(count, {"grpc_idempotency.outbox.outcome": outcome})
        except Exception:
            # It fails every batch: logged once a minute, as the interceptor's telemetry is.
            now = time.monotonic()
            if self._count_failed_at is None or now - self._count_failed_at >= _METER_LOG_S:
                self._count_failed_at = now
                log.warning("telemetry failed counting deliveries", exc_info=True)

    async def _attempt(self, message: OutboxMessage) -> _Attempt:
        """Delivers ``message`` (``_deliver``) in its span, current while the sink runs: a gRPC
        or broker client's instrumented call nests in it. The span ends in ``_batch``, once the
        outcome is recorded (or could not be: unrecorded). No span while nothing records them
        (no provider set), and none when OpenTelemetry fails: a tracer, propagator or span
        processor that raises never changes a delivery."""
        span = (
            self._start_span(message)
            if tracing(own_tracer=self._own_tracer, env_provider=self._env_tracer)
            else None
        )
        if span is None:
            return _Attempt(await self._deliver(message))
        token = None
        try:
            token = otel_context.attach(trace.set_span_in_context(span))
        except Exception:
            self._trace_failed("making a delivery's span current")
        try:
            outcome = await self._deliver(message)
        except BaseException:
            # The relay is cancelled mid-delivery: its claim is given back (_settle_cancelled).
            self._end_span(_Attempt(_UNRECORDED, span, time.time_ns()), _UNRECORDED, None)
            raise
        finally:
            if token is not None:
                try:
                    otel_context.detach(token)
                except Exception:
                    self._trace_failed("ending a delivery's span")
        return _Attempt(outcome, span, time.time_ns())

    def _start_span(self, message: OutboxMessage) -> trace.Span | None:
        try:
            link = None
            try:
                link = linked_context(message.trace_context)
            except Exception:
                # A carrier the propagator cannot read (edited by hand, another propagator's):
                # the span goes without its link.
                self._trace_failed("reading an outbox message's trace context")
            return self._tracer.start_span(
                f"grpc_idempotency deliver {message.step}",
                kind=trace.SpanKind.PRODUCER,
                attributes={
                    STEP: message.step,
                    ATTEMPT: message.attempts,
                    ROW_ID: message.id,
                    **_MESSAGING,
                    MESSAGING_DESTINATION: message.step,
                },
                links=[trace.Link(link)] if link is not None else None,
                record_exception=False,
                set_status_on_exception=False,
            )
        except Exception:
            self._trace_failed("starting a delivery's span")
            return None

    def _end_span(self, attempt: _Attempt, outcome: str, failed: _Failed | None) -> None:
        """Ends ``attempt``'s span with ``outcome``; ERROR for a ``failed`` delivery (its outcome
        ``retry``, ``dead``, or ``unrecorded`` when that could not be recorded)."""
        span = attempt.span
        if span is None:
            return
        try:
            span.set_attribute(OUTCOME, outcome)
            if failed is not None:
                why = outcome if failed.kind is None else f"{outcome} ({failed.kind})"
                span.set_status(Status(StatusCode.ERROR, why))
            span.end(end_time=attempt.ended_ns)
        except Exception:
            self._trace_failed("ending a delivery's span")

    def _trace_failed(self, doing: str) -> None:
        # It fails every delivery: logged once a minute, as the interceptor's telemetry is.
        now = time.monotonic()
        if self._trace_failed_at is None or now - self._trace_failed_at >= _METER_LOG_S:
            self._trace_failed_at = now
            log.warning("telemetry failed %s; the delivery goes on", doing, exc_info=True)

    async def _deliver(self, message: OutboxMessage) -> str | _Failed:
        if self.policy.parks_unrecorded(message.lost_claims):
            # Its last claims all ended without an outcome, every one but the first with the
            # row alone in its batch: delivering it kills (or stalls) the relay. Park it rather
            # than let it kill relays forever.
            return _Failed(
                f"claimed {message.lost_claims} times in a row with no recorded outcome (does"
                " delivering it crash the relay?)",
                permanent=True,
            )
        bound = asyncio.timeout(self.delivery_timeout)
        try:
            async with bound:
                await _accepted(self.sink.deliver(message), "the sink's deliver")
        except PermanentDeliveryError as err:
            return _Failed(_error_text(err), permanent=True, kind=type(err).__name__)
        except TimeoutError as err:
            if not bound.expired():
                # The sink's own (a broker client's): recorded as the relay's timeout, which
                # never fired, it hid the sink's error.
                return _Failed(_error_text(err), permanent=False, kind=type(err).__name__)
            return _Failed(
                f"delivery timed out after {self.delivery_timeout:g}s",
                permanent=False,
                kind="TimeoutError",
            )
        except DeliveryError as err:
            # Read with care: a subclass that skipped DeliveryError.__init__, or set it to
            # something else, would otherwise fail the whole batch computing its delay.
            hint = getattr(err, "retry_after_s", None)
            if (
                isinstance(hint, bool)
                or not isinstance(hint, int | float)
                or not 0 < hint < math.inf  # NaN too: a delay PostgreSQL refuses (22008)
            ):
                hint = None
            return _Failed(
                _error_text(err), permanent=False, retry_after_s=hint, kind=type(err).__name__
            )
        except Exception as err:
            return _Failed(_error_text(err), permanent=False, kind=type(err).__name__)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the relay is being cancelled: _settle_cancelled gives the claim back
            # Nobody cancelled this task: the sink's call was (grpc.aio raises CancelledError
            # for a call whose channel closed). A failed delivery, recorded with its batch;
            # raised, it took run() down and left the batch's delivered rows to be sent again.
            return _Failed(
                "the delivery was cancelled (its channel closed?)",
                permanent=False,
                kind="CancelledError",
            )
        if failpoints.ENABLED:
            try:
                await failpoints.hit("relay_after_delivery")
            except failpoints.FailpointError:
                return _UNRECORDED  # as if marking failed: redelivered after the lease
        return _SENT

    @property
    def polling_only(self) -> bool:
        """Whether the relay wakes on its poll alone: ``listen=False``, or LISTEN given up."""
        return not self._listen or self.listen_failure is not None

    # -- running -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Delivers until ``stop`` is set (or the task is cancelled). A batch in flight when
        ``stop`` is set finishes and is recorded first; on cancellation the deliveries in
        flight are cut short, the outcomes of those done recorded and the others' claims given
        back, due again at once (within 5 s; else they are delivered again after the lease).
        Database outages are logged and waited out; so is any other failure of a batch or of a
        purge (a bug), logged with its traceback: the rows of a batch that failed are delivered
        again after their lease. A store closed under
        it (``store.close()``: stop the relay first) ends it with a ``RuntimeError`` saying so:
        it could never deliver again; once ``stop`` is set, it ends as stopped (a warning when a
        batch could not be recorded)."""
        if stop is not None and not (
            isinstance(stop, asyncio.Event)
            or (
                callable(getattr(stop, "is_set", None))
                and inspect.iscoroutinefunction(getattr(stop, "wait", None))
            )
        ):
            # A threading.Event's wait() blocks: awaited on the loop, it froze the whole loop
            # (a gRPC server on it too) until the event was set. Another async library's event
            # (is_set and an async wait, all the relay uses) stops it as an asyncio.Event does.
            raise TypeError(
                f"stop must be an asyncio.Event, not {type(stop).__name__} (from another thread:"
                " loop.call_soon_threadsafe(stop.set))"
            )
        if self._running:
            raise RuntimeError("this relay is already running")
        # Set before anything is awaited: a second run() while the first checks its listen_dsn
        # passed the test above, and both ran.
        self._running = True
        # Each run tries LISTEN afresh: kept, one run's verdict (a pooler that was then fixed)
        # left every later run() of this relay polling only.
        self.listen_failure = None
        stop = stop or asyncio.Event()
        helpers: list[asyncio.Task[None]] = []
        try:
            if self.listen_dsn is not None and self._listen:
                # Tried once first, as the CLI's --listen-dsn is: one the driver cannot use was
                # taken for one not reachable yet, and LISTEN failed over and over.
                application = {"application_name": "grpc-idempotency"}
                await vet_dsn("listen_dsn", self.listen_dsn, server_settings=application)
            failpoints.announce()  # a relay with failpoints armed says so when it starts
            helpers.append(asyncio.create_task(self._wake_on(stop), name=f"relay-stop {self.name}"))
            await self._start(stop, helpers)
            await self._deliver_until(stop)
        finally:
            # Cancelled during the start too (a supervisor's timeout while LISTEN cannot
            # connect): the helpers went on, the listener reconnecting for ever, and the relay
            # stayed "running".
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self._running = False

    async def _start(self, stop: asyncio.Event, helpers: list[asyncio.Task[None]]) -> None:
        """Starts the LISTEN loop (one of ``helpers`` then) and waits for it, or announces
        polling."""
        if self.polling_only:
            log.info("relay %s: polling every %gs (no LISTEN)", self.name, self.poll_interval)
            self._announce_listening()
        else:
            listener = asyncio.create_task(self._listen_loop(), name=f"relay-listen {self.name}")
            helpers.append(listener)
            # The first claim waits for the LISTEN (bounded, in case the database is down):
            # whoever waits for ``on_listening`` then knows that no delivery came before it (a
            # crash failpoint after the first delivery cannot swallow the ready line), and no
            # notification sent after it is missed.
            listening = asyncio.ensure_future(self.listening.wait())
            stopping = asyncio.ensure_future(stop.wait())  # a stop during a start-up outage
            try:
                await asyncio.wait(
                    [listening, listener, stopping],
                    timeout=max(self.poll_interval, 5.0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                listening.cancel()
                stopping.cancel()

    async def _deliver_until(self, stop: asyncio.Event) -> None:
        """Claims, delivers and records batches until ``stop`` is set."""
        loop = asyncio.get_running_loop()
        next_purge = loop.time()
        outage = 0
        while not stop.is_set():
            # Cleared before claiming: a notification that arrives during the batch wakes
            # the next wait at once.
            self._wake.clear()
            try:
                batch = await self._batch()
                wait = 0.0 if batch.more_due(self.batch_size) else await self._idle_wait(batch)
                outage = 0
            except StoreUnavailable as err:
                if self.store.closed and stop.is_set():
                    # Told to stop, and its store closed before run() returned (stop, then
                    # close, not waiting for run()): no error, but the batch's outcomes were
                    # not recorded, and its rows come back after their lease.
                    log.warning(
                        "relay %s: stopped; its store was closed before run() returned (await"
                        " run() before closing the store): rows claimed and not recorded are"
                        " delivered again after their lease",
                        self.name,
                    )
                    return
                if self.store.closed:
                    # Not an outage to wait out: it logged "idempotency store closed while ...;
                    # trying again" every poll interval for as long as the process lived, and
                    # delivered nothing.
                    raise RuntimeError(
                        f"relay {self.name}: its store was closed (store.close()) while it ran;"
                        " stop the relay (set the stop event of run(stop)) before closing its"
                        " store"
                    ) from err
                outage += 1
                wait = min(self.poll_interval, 0.1 * 2 ** min(outage, 8))
                log.warning("relay %s: %s; trying again in %.1fs", self.name, err, wait)
            except Exception as err:
                # No outage: a bug, or a driver's error the store does not map. Raised, it
                # stopped every delivery until someone restarted the relay (one run as a task of
                # a server's: until the server restarted). The batch's rows stay claimed and come
                # back after their lease, a row whose every batch fails alone, then parked
                # (lost claims), as when the relay dies; backed off as an outage, so that a
                # failure on every batch does not spin.
                outage += 1
                wait = min(self.poll_interval, 0.1 * 2 ** min(outage, 8))
                self._batch_failed(err, wait)
            if self.sent_retention is not None and loop.time() >= next_purge:
                # A purge that hit its cap left rows past retention: go on at the next turn
                # (between batches), else a relay sending more than the cap per interval (10,000
                # a minute by default) let sent rows pile up without bound.
                more = await self._purge(self.sent_retention)
                next_purge = loop.time() + (0.0 if more else self.purge_interval)
            if wait > 0 and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)

    def _batch_failed(self, err: Exception, wait: float) -> None:
        """Logs ``err``: its traceback once a minute per kind of error, one line (its text
        escaped) in between."""
        kind = type(err)
        now = time.monotonic()
        if now - self._traceback_logged.get(kind, -_TRACEBACK_EVERY_S) >= _TRACEBACK_EVERY_S:
            self._traceback_logged[kind] = now
            log.error(
                "relay %s: a batch failed; trying again in %.1fs", self.name, wait, exc_info=err
            )
            return
        log.warning(
            "relay %s: a batch failed again (%s: %s; its traceback is logged once a minute);"
            " trying again in %.1fs",
            self.name,
            kind.__name__,
            loggable(str(err)),
            wait,
        )

    async def _idle_wait(self, batch: _Batch) -> float:
        """How long to sleep after a batch that was not full: until the next row falls due (a
        retry), at most ``poll_interval``; notifications cut it short."""
        due = await self.outbox.next_due_in(steps=self.steps)
        if due is None:
            return self.poll_interval
        if due > 0:
            return min(due, self.poll_interval)
        # Due rows that this claim did not get: new ones (go again), or rows another relay was
        # claiming at that instant (its claim commits within milliseconds: do not spin).
        return 0.0 if batch.claimed else 0.05

    async def _wake_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake.set()

    async def _purge(self, retention: float) -> bool:
        """Deletes up to ``_PURGE_BATCHES`` batches of sent rows past ``retention``; whether it
        stopped at that cap (so more may be left)."""
        # Counted per committed batch, as Purger counts: counted from the return value, a purge
        # failing midway left the batches it had committed (they stay deleted) out of
        # stats.purged.
        try:
            purged = await self.outbox.purge_sent(
                older_than_s=retention,
                batch_size=_PURGE_BATCH,
                max_batches=_PURGE_BATCHES,
                on_batch=self._count_purged,
            )
        except StoreUnavailable as err:
            log.warning("relay %s: purging sent rows failed: %s", self.name, err)
            return False
        except Exception:
            # Housekeeping: a failure no outage explains (a bug) took the relay down with it,
            # and stopped the deliveries. Tried again at the next purge_interval.
            log.exception("relay %s: purging sent rows failed", self.name)
            return False
        if purged:
            log.info("relay %s: purged %d sent rows", self.name, purged)
        return purged >= _PURGE_BATCH * _PURGE_BATCHES

    def _count_purged(self, deleted: int) -> None:
        self.stats.purged += deleted

    # -- wake-ups ----------------------------------------------------------------------------

    def _notified(self, *args: object) -> None:
        payload = args[3] if len(args) > 3 else ""
        if isinstance(payload, str) and payload.startswith(_LISTEN_CHECK):
            # A relay's NOTIFY round trip (this one's, or another relay's on the database): no
            # row to deliver.
            if payload == self._check_token:
                self._heard.set()
            if self._unheard is not None and payload == self._unheard[0]:
                direct = self.listen_dsn is not None
                log.info(
                    "relay %s: %s NOTIFY arrived after all, %.1fs after it was sent: %s",
                    self.name,
                    "the listen_dsn check's" if direct else "its LISTEN check's",
                    time.monotonic() - self._unheard[1],
                    "listen_dsn reaches the store's database"
                    if direct
                    else "its LISTEN session hears the store's notifications",
                )
                self._unheard = None
                self._warn_unheard = True
            return
        self._wake.set()

    async def _listen_loop(self) -> None:
        """Holds a connection with ``LISTEN <schema>_outbox`` for as long as the relay runs, and
        replaces it when it drops (checked every ``poll_interval``). After each (re)connection
        the relay looks for due rows once: a notification sent while nobody listened is lost,
        and polling would otherwise find its row only later. Ends, leaving the relay to poll,
        when the LISTEN does not hold on its session (a transaction pooler); ends, waking the
        relay, when the store was closed (``_store_closed``)."""
        pause = 0.0
        while True:
            if pause:
                await asyncio.sleep(pause)
            listener: Listener | None = None
            try:
                listener = await self.outbox.listen(
                    self._notified,
                    dsn=self.listen_dsn,
                    connect_timeout=min(60.0, max(5.0, self.poll_interval)),
                )
                lost = listener.lost
                self.listening.set()
                self._announce_listening()
                self._wake.set()
                pause = 0.05
                # Once listening: a healthy relay's start waits for none of it.
                if self.listen_dsn is not None and not await self._check_listen_database(listener):
                    self._give_up_listening()
                    return
                turns = 0
                while not lost.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), self.poll_interval)
                    if lost.is_set():
                        break
                    turns += 1
                    # Now and then a NOTIFY round trip (in this task: deliveries never wait for
                    # it): PgBouncer in transaction mode hands a lone client the server
                    # connection that holds its LISTEN (the query below says it listens), and
                    # drops what arrives there between transactions. It asks that query too
                    # when unheard.
                    if turns % _LISTEN_CHECK_EVERY == 0:
                        if not await self._check_listen_database(listener):
                            self._give_up_listening()
                            return
                        continue
                    # A link that died silently (no FIN) shows up only when used; a LISTEN
                    # that went to a pooled server connection shows up as a session that is
                    # not listening.
                    if not await listener.still_listening(timeout=self.poll_interval):
                        self._give_up_listening()
                        return
                if self._store_closed():
                    return
                log.warning("relay %s: LISTEN connection lost; reconnecting", self.name)
            except Exception as err:  # database errors, and anything else: listen again
                if self._store_closed():
                    return
                log.warning(
                    "relay %s: LISTEN connection failed (%s); reconnecting",
                    self.name,
                    _listen_failure(err),
                )
                pause = min(max(pause * 2, 0.1), self.poll_interval)
            finally:
                self.listening.clear()
                if listener is not None:
                    await listener.close()

    async def _check_listen_database(self, listener: Listener) -> bool:
        """A NOTIFY round trip: warns when a NOTIFY with a payload of its own, sent through the
        store's pool, does not reach the LISTEN session in a bounded time. Run at each
        connection to ``listen_dsn``, and every ``_LISTEN_CHECK_EVERY`` poll intervals.
        The channel has the same name in every database (another shard's, a staging copy's), so
        a relay whose listen_dsn named another was woken for others' rows, found its own only by
        polling, and said nothing; and PgBouncer in transaction mode can hand a lone client back
        the server connection that holds its LISTEN (asked, the session listens) while it drops
        the notifications that arrive there between transactions.
        A warning only, never a refusal: a live database's notification can be late on a loaded
        host, and polling delivers everything anyway (its arrival later is logged). Warned of
        once, until a round trip is heard, and at most once an hour.
        No verdict when the store cannot send it in time (an outage, a busy pool), nor when the
        LISTEN session is ``lost`` before it arrives (its notifications are gone with it).
        Returns False when, unheard, the session is found not to listen at all (through a
        transaction pooler, on another server connection): the caller gives LISTEN up, with the
        pooler's warning."""
        lost = listener.lost
        direct = self.listen_dsn is not None
        what = "listen_dsn" if direct else "its LISTEN session"
        bound = min(_LISTEN_CHECK_MAX_S, max(_LISTEN_CHECK_MIN_S, self.poll_interval))
        heard = self._heard = asyncio.Event()
        token = self._check_token = f"{_LISTEN_CHECK}{secrets.token_hex(8)}"
        try:
            await self.outbox.notify_listeners(token, timeout=bound)
        except StoreUnavailable as err:
            log.debug("relay %s: %s not checked (%s)", self.name, what, err)
            return True
        sent = time.monotonic()  # the wait starts once it is sent: a busy pool is no verdict
        waits = [asyncio.ensure_future(heard.wait()), asyncio.ensure_future(lost.wait())]
        try:
            await asyncio.wait(waits, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if heard.is_set():
            if direct:
                log.debug("relay %s: listen_dsn reaches the store's database", self.name)
            else:
                log.debug("relay %s: its LISTEN session hears the store's NOTIFY", self.name)
            self._unheard = None
            self._warn_unheard = True
            return True
        if lost.is_set():
            # A session dropped mid-check never hears it, whichever database it is on: warned
            # of, a listen_dsn on the store's own database was called "likely another".
            log.debug("relay %s: %s not checked (its session was lost)", self.name, what)
            return True
        # A session that does not listen (through PgBouncer in transaction mode) hears nothing
        # either, whichever database it reaches: it was called "likely another database", and
        # the pooler's warning came a poll_interval later. One query to tell. Raising (a link
        # that died silently), it is a failed LISTEN connection: reconnected. Not always told:
        # PgBouncer hands a lone client the server connection that holds its LISTEN (it
        # listens) yet drops what arrives there between transactions (the warning names the
        # pooler then).
        if not await listener.still_listening(timeout=bound):
            return False
        now = time.monotonic()
        last = self._unheard_warned_at
        # Once, not at each reconnection nor at each round trip; again (an hour on) only after
        # one was heard in between. Not "the last one was warned of" (``_unheard``): unheard
        # again within the hour of a warning, its round trips were taken for warned ones, and
        # however long that lasted it was never said.
        if self._warn_unheard and (last is None or now - last >= _LISTEN_CHECK_WARN_EVERY_S):
            self._warn_unheard = False
            self._unheard_warned_at = now
            if direct:
                log.warning(
                    "relay %s: a NOTIFY sent through the store's pool (%s) did not reach the"
                    " LISTEN session on listen_dsn (%s) within %gs: listen_dsn is likely another"
                    " database (another shard's?), whose notifications wake this relay for rows"
                    " that are not its own, or a pooler in transaction mode (PgBouncer?), which"
                    " drops them; its own rows are found by polling, every %gs. Point listen_dsn"
                    " (--listen-dsn, GRPC_IDEMPOTENCY_LISTEN_DSN) at the store's own database, on"
                    " PostgreSQL itself or a session-mode pool.",
                    self.name,
                    self.store.store_log.where,
                    dsn_where(self.listen_dsn),
                    bound,
                    self.poll_interval,
                )
            else:
                # The LISTEN is on the store's own pool: the same database, so the pooler.
                log.warning(
                    "relay %s: a NOTIFY sent through the store's pool (%s) did not reach its"
                    " LISTEN session, on the same pool, within %gs: the store's DSN likely goes"
                    " through a pooler in transaction mode (PgBouncer?), which drops"
                    " notifications; its rows are found by polling, every %gs. Pass listen_dsn="
                    " (--listen-dsn, GRPC_IDEMPOTENCY_LISTEN_DSN) naming the store's own"
                    " database on PostgreSQL itself or a session-mode pool, or listen=False"
                    " (--no-listen) to poll without trying.",
                    self.name,
                    self.store.store_log.where,
                    bound,
                    self.poll_interval,
                )
        self._unheard = (token, sent)
        return True

    def _store_closed(self) -> bool:
        """Whether the store was closed (``Store.closed``); if so, the relay is woken to find it
        and end ``run()``. ``close()`` terminates the LISTEN connection after its timeout: it
        was reconnected, "LISTEN connection failed ...; reconnecting" logged again and again
        (no connection could come from a closed pool), until the next poll, a whole
        ``poll_interval`` later, found the store closed."""
        if not self.store.closed:
            return False
        self._wake.set()
        return True

    def _announce_listening(self) -> None:
        """Calls ``on_listening``. What it raises is the caller's bug, logged with its traceback:
        raised in the LISTEN loop it was taken for a failed connection, so the relay dropped a
        good LISTEN and reconnected for ever, calling it again each time; raised while polling
        it took the relay down before its first batch."""
        if self._on_listening is None:
            return
        try:
            self._on_listening()
        except Exception:
            log.exception("relay %s: on_listening raised; the relay goes on", self.name)

    def _give_up_listening(self) -> None:
        where = "listen_dsn" if self.listen_dsn is not None else "the store's DSN"
        self.listen_failure = (
            f"LISTEN {self.outbox.channel} did not hold on its session: {where} goes through a"
            " pooler in transaction or statement mode (PgBouncer?)"
        )
        log.warning(
            "relay %s: %s; polling every %gs from now on. Pass listen_dsn= (CLI --listen-dsn)"
            " naming PostgreSQL itself or a session-mode pool, or listen=False (--no-listen) to"
            " poll without trying.",
            self.name,
            self.listen_failure,
            self.poll_interval,
        )
