"""When and how long to wait before retrying a keyed call. Pure; the client drives it.

Retrying a keyed call is safe by construction: the key belongs to the operation, so every attempt
is the same operation and the server runs it at most once. What is left to decide is *when*: a
server that answered ABORTED / IDEMPOTENCY_KEY_IN_PROGRESS says how long the first attempt may
still take (``RetryInfo`` or ``grpc-retry-pushback-ms``), and that hint wins over backoff.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import (
    KeyInvalid,
    KeyMissing,
    KeyReused,
    OutboxKeyReused,
    RequestInvalid,
    ResponseTooLarge,
)
from grpc_idempotency.core.seconds import MAX_DURATION_MS, checked_seconds

RETRYABLE: frozenset[Code] = frozenset({Code.UNAVAILABLE, Code.ABORTED, Code.DEADLINE_EXCEEDED})

FINAL_REASONS: frozenset[str] = frozenset(
    error.reason
    for error in (
        KeyReused,
        OutboxKeyReused,
        KeyInvalid,
        KeyMissing,
        RequestInvalid,
        ResponseTooLarge,
    )
)
"""The library's answers that every attempt of an operation gets alike: its key was used for
another request (or its outbox step, still kept, for another message), its key or request is
malformed, or its answer was too large to record (recorded so, and replayed). Each attempt
carries the same key and request, so none is retried, whatever ``retryable`` holds (a policy
retrying FAILED_PRECONDITION or INVALID_ARGUMENT, for a service's own transient states, retried
them ``max_attempts`` times with backoff, then raised the same error)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How ``Operation.call`` retries one operation (always with its key): up to ``max_attempts``,
    on the ``retryable`` codes, waiting as the server asks or else with jittered backoff."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    retryable: frozenset[Code] = field(default=RETRYABLE)
    """The codes to retry: ``Code`` members, their numbers, or ``grpc.StatusCode`` members."""
    max_pushback_s: float = 60.0
    """The longest server pushback (``grpc-retry-pushback-ms`` / ``RetryInfo``) waited out. A
    server (or a proxy) asking for a longer wait stops the retries: the last error is raised at
    once, its trailers carrying the pushback, for the caller to retry the operation (same key)
    when it sees fit. Not waited out: a client coroutine slept as long as any server said ("10
    hours"), holding its caller and whatever it held, with no deadline (outside a handler) to
    end it. Not cut to this bound either: retrying sooner than the server asked is what
    pushback exists to prevent (gRFC A6 honours it exactly, bounded by the call's deadline).
    This library's servers ask for at most 2 s."""
    total_timeout_s: float | None = None
    """The longest ``Operation.call`` takes, all attempts and waits included (``None``: no
    bound but ``max_attempts``). No attempt starts once it is spent; each attempt's timeout is
    at most the time left (the call's ``timeout=`` is per attempt); a backoff or pushback that
    would end at or past it stops the retries, the last error raised at once (as one beyond
    ``max_pushback_s`` is). An attempt the bound cuts short ends with its own DEADLINE_EXCEEDED.
    Without it a caller outside a handler (whose deadline bounds the retries there) waited up to
    ``max_attempts`` times the timeout plus every wait, and could not say "a second at most"
    (google.api_core's ``Retry(timeout=)``, gRPC's call deadline over its own retries). Inside a
    handler the earlier of the two bounds applies."""

    def __post_init__(self) -> None:
        retryable: object = self.retryable
        if isinstance(retryable, str | bytes) or not isinstance(retryable, Iterable):
            # One code (Code, grpc.StatusCode, a name): not iterable, or a str read letter by
            # letter; either way an error that did not say what was wrong.
            one = isinstance(retryable, int | str | enum.Enum)  # Code, grpc.StatusCode, 14
            hint = f": retryable=frozenset({{{retryable!r}}})" if one else ""
            raise ValueError(f"retryable is a set of status codes, not {retryable!r}{hint}")
        # grpc.StatusCode members compared unequal to every Code: such a policy never retried.
        object.__setattr__(self, "retryable", frozenset(map(_code, retryable)))
        # TypeError for a wrong type, as every other setting's (a str or None raised a bare
        # comparison error naming no field; True was 1). Capped: 10**400 (below math.inf) was a
        # bare OverflowError at the first retry, 1e30 slept for ever, and gRPC's deadline
        # overflows past about 7e9 s from now (every attempt DEADLINE_EXCEEDED at once).
        checked_seconds("initial_backoff_s", self.initial_backoff_s, positive=True)
        checked_seconds("max_backoff_s", self.max_backoff_s, positive=True)
        if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, int | float):
            raise TypeError(f"multiplier must be a number, not {self.multiplier!r}")
        # A whole number, as DeliveryPolicy's: NaN compares false both ways and inf is never
        # reached (delay_s retried for ever), a str failed a raw comparison, True meant 1.
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise TypeError(f"max_attempts must be a whole number, not {attempts!r}")
        if attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {attempts!r}")
        if not self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"max_backoff_s must be at least initial_backoff_s ({self.initial_backoff_s:g}),"
                f" not {self.max_backoff_s!r}"
            )
        if not 1 <= self.multiplier < math.inf:
            raise ValueError("multiplier must be at least 1, and finite")
        # NaN: every pushback was waited out, however long; past the cap, as a backoff's.
        checked_seconds("max_pushback_s", self.max_pushback_s)
        # NaN: never spent (no bound at all); 0 spent before the first attempt.
        checked_seconds("total_timeout_s", self.total_timeout_s, positive=True, or_none=True)

    def delay_s(
        self,
        *,
        attempt: int,
        code: Code,
        retry_after_ms: int | None,
        jitter: float,
        reason: str | None = None,
        time_left_s: float | None = None,
        replayed: bool = False,
    ) -> float | None:
        """Seconds to wait before attempt ``attempt + 1`` (attempts count from 1), or ``None``
        to stop: no attempts left, a code not retried, an answer of ``FINAL_REASONS``
        (``reason``: the library's ``ErrorInfo.reason``, if any), a pushback that is negative
        (gRPC's "do not retry") or beyond ``max_pushback_s``, or a wait that would end at or
        past the call's deadline (``time_left_s``: the seconds left before it, if it has one;
        ``call_deadline``). ``jitter`` is a random number in [0, 1): full jitter on the
        backoff.

        ``replayed``: the error is a replay of a recorded outcome (the marker in its initial
        metadata, ``wire.carries_replay_marker``), never retried whatever its code: the key's
        record answers every later attempt with the same error, so a retry only spent attempts
        and backoff (a policy retrying NOT_FOUND or FAILED_PRECONDITION, a service's transient
        states, ran out ``max_attempts`` against an error recorded by the first)."""
        if (
            replayed
            or attempt >= self.max_attempts
            or code not in self.retryable
            or reason in FINAL_REASONS
        ):
            return None
        if retry_after_ms is not None:
            if retry_after_ms < 0:
                return None  # the server says: do not retry
            # Past the longest bound first, compared as ints (``MAX_DURATION_MS``): divided, an
            # int of 309 digits or more was an OverflowError in place of a decision. Not one
            # from the wire (gRPC's C-core reads the pushback trailer as an int64, anything
            # larger reaching Python as -2**63, malformed; a RetryInfo tops out near 1e22 ms):
            # the guard is for direct callers, as this method is public and takes any int.
            # Then in seconds, as the bound is given: in milliseconds, ``max_pushback_s * 1000``
            # rounds (1.001 s is 1000.9999999999999 ms), which refused a pushback of exactly
            # the bound.
            if retry_after_ms > MAX_DURATION_MS or retry_after_ms / 1000 > self.max_pushback_s:
                return None  # longer than this caller waits: its error, now (max_pushback_s)
            delay = retry_after_ms / 1000
        else:
            delay = (
                backoff_ceiling_s(
                    attempt, self.initial_backoff_s, self.multiplier, self.max_backoff_s
                )
                * jitter
            )
        if time_left_s is not None and delay >= time_left_s:
            # The next attempt could only begin with no time left, to fail DEADLINE_EXCEEDED
            # (retryable) at once: the last error now, its trailers intact, rather than a sleep
            # that ends in an error the server never gave.
            return None
        return delay


def call_deadline(
    *, started_at: float, total_timeout_s: float | None, handler_deadline: float | None
) -> float | None:
    """When a call begun at ``started_at`` must be over, on the same clock: the earlier of its
    retry policy's ``total_timeout_s`` from then and the deadline of the handler it is made in
    (if either), or ``None``."""
    budget = None if total_timeout_s is None else started_at + total_timeout_s
    bounds = [bound for bound in (budget, handler_deadline) if bound is not None]
    return min(bounds) if bounds else None


def attempt_timeout_s(timeout: float | None, deadline: float | None, now: float) -> float | None:
    """An attempt's gRPC timeout: the per-attempt ``timeout``, at most the time left before
    ``deadline`` (0 once it is spent: the attempt fails DEADLINE_EXCEEDED at once)."""
    if deadline is None:
        return timeout
    left = max(0.0, deadline - now)
    return left if timeout is None else min(timeout, left)


def _code(code: object) -> Code:
    if isinstance(code, Code):
        return code
    number = getattr(code, "value", code)  # grpc.StatusCode's value is (number, name)
    if isinstance(number, tuple) and number:
        number = number[0]
    if isinstance(number, int) and not isinstance(number, bool):
        try:
            return Code(number)
        except ValueError:
            pass
    raise ValueError(f"retryable: {code!r} is not a gRPC status code")


def backoff_ceiling_s(attempt: int, initial_s: float, multiplier: float, max_s: float) -> float:
    """``min(max_s, initial_s * multiplier ** (attempt - 1))`` for any number of attempts: the
    power overflows a float (OverflowError) past about a thousand of them. In floats: an int
    multiplier would make an exact power, a huge number to build (and OverflowError only when
    multiplied by ``initial_s``)."""
    try:
        return min(max_s, initial_s * float(multiplier) ** max(attempt - 1, 0))
    except OverflowError:
        return max_s


def service_config(methods: list[str], *, max_attempts: int = 5) -> dict[str, object]:
    """gRPC's channel service config retrying UNAVAILABLE and ABORTED on ``methods``
    ("/pkg.Service/Method"), which must be methods whose key is required: safe because every
    call that runs carries a key (the server refuses one without, INVALID_ARGUMENT, which is
    not retried) and each attempt carries the same key. gRPC caps attempts at 5 (more is read
    as 5) and honours the server's ``grpc-retry-pushback-ms``; ``max_attempts=1`` is no retry
    policy at all (gRPC's own config has no way to say one attempt: a policy needs at least 2).

    Never a method whose key is optional: gRPC's retry policy cannot see whether a call carries
    a key, and one without runs undeduplicated. An UNAVAILABLE after it ran (its answer lost on
    the way back, a commit whose fate is unknown, a downstream's UNAVAILABLE passed on) had
    gRPC run the write a second time, unseen by the caller. Such a method's keyed calls are
    retried with their key by ``Operation.call`` (``RetryPolicy``)."""
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be a whole number of at least 1, not {max_attempts!r}")
    names = []
    for method in sorted(set(methods)):
        service, _, name = method.lstrip("/").partition("/")
        names.append({"service": service, "method": name})
    if not names or max_attempts == 1:
        return {}
    return {
        "methodConfig": [
            {
                "name": names,
                "retryPolicy": {
                    "maxAttempts": min(5, max_attempts),
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"],
                },
            }
        ]
    }
