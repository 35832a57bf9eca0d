"""OpenTelemetry spans and metrics, through opentelemetry-api only, following the RPC semantic
conventions.

With no SDK installed (or none configured) the API's no-op providers make this nearly free.
One span per keyed call, ``grpc_idempotency <service>/<method>`` (kind INTERNAL: it sits inside
the gRPC server span that instrumentation such as opentelemetry-instrumentation-grpc makes), with
``rpc.system`` = ``grpc``, ``rpc.service`` (``pkg.Service``), ``rpc.method`` (``Method``, no
slash), ``rpc.grpc.status_code`` (the answer's code, an int) and ``grpc_idempotency.outcome``:
the RPC conventions of semconv 1.37, the default. ``OTEL_SEMCONV_STABILITY_OPT_IN`` (read when a
``Telemetry`` is made; a comma-separated list shared with other domains) opts in to their
successors: with ``rpc``, ``rpc.system.name`` = ``grpc``, ``rpc.method`` = ``pkg.Service/Method``
and ``rpc.response.status_code`` (the code's name, ``OK``), plus ``error.type`` (the code's name)
for a server-side failure; with ``rpc/dup`` (which wins over ``rpc``), both sets, where
``rpc.method``, one key in both, takes the new form. The span's status is ERROR when the
answer is a server-side failure (UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL,
UNAVAILABLE, DATA_LOSS: a store that is down or misconfigured among them), unset otherwise, as
the conventions ask of a server. The idempotency key and the scope can
identify a customer: they become span attributes (``grpc_idempotency.key``,
``grpc_idempotency.scope``) only when ``Telemetry(record_key=True, record_scope=True)`` asks, and
never metric labels.

Metrics: a counter ``grpc_idempotency.calls`` and a histogram ``grpc_idempotency.call.duration``
(seconds; bucket boundaries ``DURATION_BUCKETS_S``, 1 ms to 10 s, advised to the SDK with
opentelemetry-api 1.30 or later), both labelled by the span's RPC attributes (``error.type``
included) and the outcome; a counter ``grpc_idempotency.bypassed`` for fail-open calls,
labelled by the method's.

An ``IdempotentConsumer``'s deliveries: one span per ``process`` / ``process_call``,
``grpc_idempotency process <consumer>`` (kind INTERNAL, around the effect, whose database spans
nest in it), with ``grpc_idempotency.consumer.name`` and ``grpc_idempotency.consumer.outcome``
(``ConsumerOutcome``), its status ERROR when the effect or the store failed (``released``,
``unavailable``); the message id (``grpc_idempotency.consumer.message_id``) only with
``record_key``. A counter ``grpc_idempotency.consumer.messages`` and a histogram
``grpc_idempotency.consumer.process.duration`` (seconds, the same buckets), both labelled by the
consumer's name and the outcome.

The outbox: a message enqueued while a span is current keeps that span's context (injected with
the global propagator, W3C by default: ``trace_carrier``), and the relay's span for each
delivery attempt, ``grpc_idempotency deliver <step>`` (kind PRODUCER), links to it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NamedTuple, TypeVar

from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import Status, StatusCode

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.consumer import ConsumerOutcome
from grpc_idempotency.core.lifecycle import CallOutcome
from grpc_idempotency.log_tracebacks import library_logger

OUTCOME = "grpc_idempotency.outcome"
KEY = "grpc_idempotency.key"
SCOPE = "grpc_idempotency.scope"
SYSTEM = "rpc.system"
SERVICE = "rpc.service"
METHOD = "rpc.method"
STATUS_CODE = "rpc.grpc.status_code"
# Their successors (semantic-conventions after 1.37; docs/non-normative/rpc-migration.md there).
SYSTEM_NAME = "rpc.system.name"
RESPONSE_STATUS_CODE = "rpc.response.status_code"
ERROR_TYPE = "error.type"
CONSUMER = "grpc_idempotency.consumer.name"
CONSUMER_OUTCOME = "grpc_idempotency.consumer.outcome"
MESSAGE_ID = "grpc_idempotency.consumer.message_id"

# A delivery whose effect or store failed: nothing marked, the message not acknowledged.
CONSUMER_ERRORS = frozenset({ConsumerOutcome.RELEASED, ConsumerOutcome.UNAVAILABLE})

# What the RPC conventions count as a server's error (the client's mistakes are not).
SERVER_ERRORS = frozenset(
    {
        Code.UNKNOWN,
        Code.DEADLINE_EXCEEDED,
        Code.UNIMPLEMENTED,
        Code.INTERNAL,
        Code.UNAVAILABLE,
        Code.DATA_LOSS,
    }
)

DURATION_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
"""Bucket boundaries of ``grpc_idempotency.call.duration``, in seconds: the RPC and HTTP
conventions' duration buckets, with 1 and 2.5 ms below them for replays. An advisory: a view
configured in the SDK takes precedence."""

_NO_TRACING = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
# The span of a call or delivery while no tracer provider is set: none at all (``tracing``).
_NO_SPAN = nullcontext(trace.INVALID_SPAN)
# The variable through which opentelemetry-api loads a global tracer provider (its
# ``opentelemetry.environment_variables.OTEL_PYTHON_TRACER_PROVIDER``).
TRACER_PROVIDER_ENV = "OTEL_PYTHON_TRACER_PROVIDER"
METER_PROVIDER_ENV = "OTEL_PYTHON_METER_PROVIDER"
_T = TypeVar("_T")


def provider_from_env(variable: str, make: Callable[[], _T]) -> _T:
    """``make()``, whose global provider the API may load from the entry point ``variable``
    names: one that no installed package provides failed the interceptor's construction with the
    API's bare ``StopIteration``, naming neither the variable nor its value."""
    try:
        return make()
    except StopIteration:
        raise ValueError(
            f"{variable}={os.environ.get(variable, '')!r} names no installed provider (an"
            f" opentelemetry_{variable.removeprefix('OTEL_PYTHON_').lower()} entry point):"
            " install the package that provides it, or unset the variable"
        ) from None


try:
    _VERSION = version("grpc-idempotency")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    _VERSION = "0"


DEADLINE_SLACK_S = 0.05
"""A handler cancelled with less time left than this was cancelled by its deadline: the
client's own deadline, which cancels the call from its side, runs out up to the headers' one-way
trip earlier than the server's copy of it."""

log = library_logger("grpc_idempotency.telemetry")
# A broken exporter fails on every call: its failures are logged once a minute, not per call.
_FAILURE_LOG_INTERVAL_S = 60.0


def cancellation_code(time_remaining: float | None) -> Code:
    """The status the client sees of a call whose handler grpc.aio cancelled, given the
    seconds the call had left (None: no deadline). grpc.aio cancels the handler alike when the
    client cancels (CANCELLED) and when the deadline passes (DEADLINE_EXCEEDED)."""
    if time_remaining is not None and time_remaining < DEADLINE_SLACK_S:
        return Code.DEADLINE_EXCEEDED
    return Code.CANCELLED


SEMCONV_OPT_IN_ENV = "OTEL_SEMCONV_STABILITY_OPT_IN"


class RpcConventions(NamedTuple):
    """Which RPC conventions a ``Telemetry`` emits: those of semconv 1.37 (``old``), their
    successors (``new``), or both."""

    old: bool
    new: bool


DEFAULT_CONVENTIONS = RpcConventions(old=True, new=False)


def rpc_conventions(opt_in: str | None) -> RpcConventions:
    """The RPC conventions ``OTEL_SEMCONV_STABILITY_OPT_IN`` = ``opt_in`` asks for: ``rpc``
    the new only, ``rpc/dup`` both (over ``rpc`` if both are listed), anything else the old.
    Tokens are matched exactly, whitespace around them aside, as opentelemetry-instrumentation
    matches its own (``http``, ``database``): a value that switched only some of an
    application's instrumentations would split its telemetry across two sets of names. Other
    domains' tokens are expected in the list, so an unknown one is no error."""
    tokens = {token.strip() for token in (opt_in or "").split(",")}
    if "rpc/dup" in tokens:
        return RpcConventions(old=True, new=True)
    if "rpc" in tokens:
        return RpcConventions(old=False, new=True)
    return DEFAULT_CONVENTIONS


def rpc_attributes(
    method: str, conventions: RpcConventions = DEFAULT_CONVENTIONS
) -> dict[str, str]:
    """The RPC attributes of a gRPC method path (``/pkg.Service/Method`` or
    ``pkg.Service/Method``): ``rpc.system``, ``rpc.service`` and ``rpc.method`` = ``Method``
    (old); ``rpc.system.name`` and ``rpc.method`` = ``pkg.Service/Method`` (new). Both: one
    ``rpc.method``, the new one, which names the service too (``rpc.service`` still does)."""
    service, _, name = method.lstrip("/").rpartition("/")
    attributes: dict[str, str] = {}
    if conventions.old:
        attributes.update({SYSTEM: "grpc", SERVICE: service, METHOD: name})
    if conventions.new:
        attributes.update({SYSTEM_NAME: "grpc", METHOD: f"{service}/{name}"})
    return attributes


def status_attributes(code: Code, conventions: RpcConventions) -> dict[str, str | int]:
    """The attributes of the answer's status: ``rpc.grpc.status_code`` (an int, old);
    ``rpc.response.status_code`` (its name), and ``error.type`` (the same name) for a
    server-side failure (new), as the gRPC conventions' server span has them."""
    attributes: dict[str, str | int] = {}
    if conventions.old:
        attributes[STATUS_CODE] = int(code)
    if conventions.new:
        attributes[RESPONSE_STATUS_CODE] = code.name
        if code in SERVER_ERRORS:
            attributes[ERROR_TYPE] = code.name
    return attributes


def _duration_histogram(meter: metrics.Meter, name: str, description: str) -> metrics.Histogram:
    unit = "s"
    # Without buckets of its own the SDK uses (0, 5, 10, ..., 10000), made for milliseconds:
    # every call of under 5 s would land in one bucket. A dict, not the keyword itself, so
    # that this type-checks against the oldest API we support too.
    advisory: dict[str, Any] = {"explicit_bucket_boundaries_advisory": DURATION_BUCKETS_S}
    try:
        return meter.create_histogram(name, unit=unit, description=description, **advisory)
    except TypeError:
        # opentelemetry-api before 1.30 has no advisory (our floor is older): the SDK's
        # buckets then, unless a view sets others.
        return meter.create_histogram(name, unit=unit, description=description)


def tracing(*, own_tracer: bool, env_provider: bool) -> bool:
    """Whether spans are recorded: a provider was given (``own_tracer``), or one was set
    globally. ``env_provider``: whether ``OTEL_PYTHON_TRACER_PROVIDER`` was set when the caller
    was made."""
    if own_tracer:
        return True
    # Asked on every call. With no global provider set (the API's module global still None)
    # and none named in the environment, the answer is no, without get_tracer_provider(), which
    # probes os.environ each time (~1 us). Once a provider is set it cannot be replaced.
    if env_provider is False and getattr(trace, "_TRACER_PROVIDER", False) is None:
        return False
    return not isinstance(trace.get_tracer_provider(), _NO_TRACING)


_carrier_failed_at: float | None = None

CARRIER_MAX_CHARS = 16384
"""The longest carrier (its JSON text) an outbox row keeps. W3C's own limits give about 8 KiB
of baggage and a tracestate of 32 members; a propagator that writes more (a bug, or an
application's own) would make every row that large, so the message goes without its trace."""


def trace_carrier() -> str | None:
    """The current span's context as the global propagator writes it (W3C ``traceparent`` and
    ``tracestate`` by default, or whatever propagator the application configured; never its
    ``baggage``), a JSON
    object, for an outbox row; ``None`` with no valid span context: tracing off costs one
    context look-up. Never raises: a propagator that fails, or writes what is no header (a value
    that is not a str, or holds a NUL) or more than ``CARRIER_MAX_CHARS``, is logged (once a
    minute) and the message is enqueued without its trace, as telemetry never changes a call."""
    global _carrier_failed_at
    try:
        if not trace.get_current_span().get_span_context().is_valid:
            return None
        carrier: dict[str, Any] = {}
        propagate.inject(carrier)
        # Baggage is the application's (user ids, tenant names) and the relay links to the span
        # without restoring it: stored, it only sat in the row until purged, copied from every
        # call. The default propagator writes it beside the trace context.
        carrier.pop("baggage", None)
        if not carrier:
            return None  # a propagator that writes nothing ("none")
        for name, value in carrier.items():
            # Header values, as the extracting side reads them back. A NUL, or a lone
            # surrogate, is JSON PostgreSQL's jsonb refuses: the INSERT, and the call, failed.
            if not (isinstance(name, str) and isinstance(value, str)) or "\x00" in name + value:
                raise ValueError(f"the propagator wrote a {type(value).__name__}, not a header")
            (name + value).encode()  # UnicodeEncodeError on a lone surrogate
        text = json.dumps(carrier, separators=(",", ":"), sort_keys=True)
        if len(text) > CARRIER_MAX_CHARS:
            raise ValueError(f"the carrier is {len(text)} characters, over {CARRIER_MAX_CHARS}")
        return text
    except Exception:
        now = time.monotonic()
        if _carrier_failed_at is None or now - _carrier_failed_at >= _FAILURE_LOG_INTERVAL_S:
            _carrier_failed_at = now
            log.warning(
                "telemetry failed injecting the trace context of an outbox message; it is"
                " enqueued without it",
                exc_info=True,
            )
        return None


def linked_context(carrier: object) -> trace.SpanContext | None:
    """The span context ``trace_carrier`` stored (extracted with the global propagator), if it
    holds a valid one: the link of a delivery's span. ``carrier``: the JSON text, or the object
    it decodes to. Raises on a carrier it cannot read (the caller guards it)."""
    if carrier is None:
        return None
    if isinstance(carrier, str):
        carrier = json.loads(carrier)
    if not isinstance(carrier, dict):
        return None
    found = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return found if found.is_valid else None


class Telemetry:
    """The span, counters and histogram of keyed calls (opentelemetry-api only; the SDK, if
    configured, exports them). Pass your own providers to ``IdempotencyInterceptor(telemetry=)``.

    ``record_key`` / ``record_scope``: put the idempotency key / the scope on each span (off by
    default: both can identify a customer). The RPC conventions its spans and metrics follow
    are read from ``OTEL_SEMCONV_STABILITY_OPT_IN`` here, once (``rpc_conventions``)."""

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        record_key: bool = False,
        record_scope: bool = False,
    ) -> None:
        for flag, value in (("record_key", record_key), ("record_scope", record_scope)):
            # Truth-tested per span: record_key="no" put every key (a customer's) on the spans.
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, not {value!r}")
        # Checked here: another object (a Tracer for its provider, a module) was a bare
        # AttributeError ("no attribute 'get_tracer'") naming no argument.
        for name, provider, method in (
            ("tracer_provider", tracer_provider, "get_tracer"),
            ("meter_provider", meter_provider, "get_meter"),
        ):
            if provider is not None and not callable(getattr(provider, method, None)):
                raise TypeError(
                    f"{name} must be an OpenTelemetry {name.split('_')[0].capitalize()}Provider"
                    f" or None, not {provider!r}"
                )
        self.tracer = provider_from_env(
            TRACER_PROVIDER_ENV,
            lambda: trace.get_tracer("grpc_idempotency", _VERSION, tracer_provider),
        )
        self._own_tracer = tracer_provider is not None
        self._env_provider = TRACER_PROVIDER_ENV in os.environ
        self.record_key = record_key
        self.record_scope = record_scope
        # Read once: every call's attributes come from what is computed from it (per method,
        # per code), never from the environment again.
        self.conventions = rpc_conventions(os.environ.get(SEMCONV_OPT_IN_ENV))
        self._attributes: dict[str, dict[str, str]] = {}
        self._span_names: dict[str, str] = {}
        self._status = {code: status_attributes(code, self.conventions) for code in Code}
        self._failures: dict[str, float] = {}
        self._labels: dict[tuple[str, Code, CallOutcome], dict[str, str | int]] = {}
        meter = provider_from_env(
            METER_PROVIDER_ENV,
            lambda: metrics.get_meter("grpc_idempotency", _VERSION, meter_provider),
        )
        self.calls = meter.create_counter(
            "grpc_idempotency.calls", unit="{call}", description="Keyed calls by outcome"
        )
        self.duration = _duration_histogram(
            meter, "grpc_idempotency.call.duration", "Time spent in keyed calls, handler included"
        )
        self.bypassed = meter.create_counter(
            "grpc_idempotency.bypassed",
            unit="{call}",
            description="Calls run without deduplication (fail-open while the store was down)",
        )
        self.messages = meter.create_counter(
            "grpc_idempotency.consumer.messages",
            unit="{message}",
            description="Deliveries to idempotent consumers by outcome",
        )
        self.process_duration = _duration_histogram(
            meter,
            "grpc_idempotency.consumer.process.duration",
            "Time spent in idempotent consumers' process calls, effect and waits included",
        )
        self._consumer_labels: dict[tuple[str, ConsumerOutcome], dict[str, str]] = {}

    def attributes(self, method: str) -> dict[str, str]:
        """The method's RPC attributes (computed once per method)."""
        found = self._attributes.get(method)
        if found is None:
            found = self._attributes[method] = rpc_attributes(method, self.conventions)
        return found

    def span_name(self, method: str) -> str:
        """``grpc_idempotency <pkg.Service>/<Method>``, whichever conventions the attributes
        follow (computed once per method)."""
        found = self._span_names.get(method)
        if found is None:
            service, _, name = method.lstrip("/").rpartition("/")
            found = self._span_names[method] = f"grpc_idempotency {service}/{name}"
        return found

    def tracing(self) -> bool:
        """Whether spans are recorded: a provider was given, or one was set globally. Until an
        SDK sets one, the API's spans record nothing, and making them (a context attached and
        detached per call) was measured at 5-10% of the server's CPU per keyed call."""
        return tracing(own_tracer=self._own_tracer, env_provider=self._env_provider)

    def span(self, method: str) -> AbstractContextManager[trace.Span]:
        """The call's span. The SDK calls span processors (exporters) unguarded: one that raised
        as the span started failed every keyed call before its handler ran, and one that raised
        as it ended answered UNKNOWN for a write that had committed, replays included. Failures
        of the span's start and end are logged here and never change the call; what the block
        raises goes through untouched."""
        if not self.tracing():
            return _NO_SPAN
        return self._span(self.span_name(method), self.attributes(method))

    def consumer_span(self, consumer: str) -> AbstractContextManager[trace.Span]:
        """An ``IdempotentConsumer`` delivery's span, guarded as ``span``'s is."""
        if not self.tracing():
            return _NO_SPAN
        return self._span(f"grpc_idempotency process {consumer}", {CONSUMER: consumer})

    @contextmanager
    def _span(self, name: str, attributes: dict[str, str]) -> Iterator[trace.Span]:
        try:
            current = self.tracer.start_as_current_span(
                name,
                kind=trace.SpanKind.INTERNAL,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            )
            span = current.__enter__()
        except Exception:
            self.failed("starting a span")
            yield trace.INVALID_SPAN
            return
        try:
            yield span
        except BaseException as exc:
            try:
                current.__exit__(type(exc), exc, exc.__traceback__)
            except BaseException as raised:
                if raised is not exc:
                    self.failed("ending a span")
            raise
        try:
            current.__exit__(None, None, None)
        except Exception:
            self.failed("ending a span")

    def count_bypassed(self, method: str) -> None:
        """Counts a call run without its store (fail-open)."""
        try:
            self.bypassed.add(1, self.attributes(method))
        except Exception:
            self.failed("counting a call run without its store")

    def failed(self, doing: str) -> None:
        """Logs a failure of OpenTelemetry (a span processor, exporter or metric reader that
        raised) at most once a minute per kind; telemetry never changes a call's answer."""
        now = time.monotonic()
        last = self._failures.get(doing)
        if last is not None and now - last < _FAILURE_LOG_INTERVAL_S:
            return
        self._failures[doing] = now
        log.warning("telemetry failed %s; the call goes on without it", doing, exc_info=True)

    def record(
        self,
        span: trace.Span,
        method: str,
        outcome: CallOutcome,
        seconds: float,
        *,
        code: Code = Code.OK,
        key: str | None = None,
        scope: str | None = None,
    ) -> None:
        try:
            self._record(span, method, outcome, seconds, code=code, key=key, scope=scope)
        except Exception:
            self.failed("recording a call")

    def _record(
        self,
        span: trace.Span,
        method: str,
        outcome: CallOutcome,
        seconds: float,
        *,
        code: Code,
        key: str | None,
        scope: str | None,
    ) -> None:
        if span.is_recording():
            span.set_attribute(OUTCOME, outcome.value)
            span.set_attributes(self._status[code])
            if code in SERVER_ERRORS:
                span.set_status(Status(StatusCode.ERROR, f"{code.name} ({outcome.value})"))
            if self.record_key and key is not None:
                span.set_attribute(KEY, key)
            if self.record_scope and scope is not None:
                span.set_attribute(SCOPE, scope)
        # Bounded (methods x codes x outcomes) and built once each: this runs on every call.
        labels = self._labels.get((method, code, outcome))
        if labels is None:
            labels = {**self.attributes(method), **self._status[code], OUTCOME: outcome.value}
            self._labels[(method, code, outcome)] = labels
        self.calls.add(1, labels)
        self.duration.record(seconds, labels)

    def record_consumed(
        self,
        span: trace.Span,
        consumer: str,
        outcome: ConsumerOutcome,
        seconds: float,
        *,
        message_id: str | None,
        error: str | None,
    ) -> None:
        """Counts one delivery to ``consumer`` and sets its span's outcome; ``error``: the name
        of the exception it ended with. What OpenTelemetry raises is logged, never raised: the
        delivery's outcome is the consumer's, not its telemetry's."""
        try:
            if span.is_recording():
                span.set_attribute(CONSUMER_OUTCOME, outcome.value)
                if outcome in CONSUMER_ERRORS:
                    why = outcome.value if error is None else f"{outcome.value} ({error})"
                    span.set_status(Status(StatusCode.ERROR, why))
                if self.record_key and message_id is not None:
                    span.set_attribute(MESSAGE_ID, message_id)
            # Bounded (consumers x outcomes) and built once each.
            labels = self._consumer_labels.get((consumer, outcome))
            if labels is None:
                labels = {CONSUMER: consumer, CONSUMER_OUTCOME: outcome.value}
                self._consumer_labels[(consumer, outcome)] = labels
            self.messages.add(1, labels)
            self.process_duration.record(seconds, labels)
        except Exception:
            self.failed("recording a delivery")
