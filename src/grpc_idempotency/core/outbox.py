"""Outbox decisions: which step a message belongs to, and how deliveries are retried.

A message enqueued by a keyed handler is keyed by the child key of a declared outbox step, so a
re-run of the handler (a retry, a takeover) enqueues nothing new, and every delivery of it carries
the same key for the receiver to dedupe. Delivery is at least once: a failed delivery waits an
exponentially growing, jittered delay; after ``max_attempts`` the row is parked as a dead letter
so that one poison message does not hold up the rest.

A claim can also end with no outcome at all: the relay died (kill -9, OOM) or stalled past its
lease while delivering. Such a *lost claim* is not a failed delivery and is counted apart from
them, because it says nothing about which row of the batch was at fault. A row whose previous
claim was lost is claimed alone (the store sees to that), so every lost claim after the first is
its own doing: ``max_attempts`` of those in a row (after the first) park it without delivering
it again (its delivery is presumed to kill relays), and the rows that shared its first batch are
charged nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from grpc_idempotency.core.errors import StepUndeclared
from grpc_idempotency.core.keys import (
    MAX_STEP_NAME_LENGTH,
    STEP_NAME,
    child_key,
    step_base,
    step_name_problem,
)
from grpc_idempotency.core.log_text import code_point, unsafe_character
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.propagation import as_of
from grpc_idempotency.core.retry import backoff_ceiling_s
from grpc_idempotency.core.seconds import checked_seconds


def outbox_step(
    method: str, steps: tuple[Step, ...], name: str, started_at: datetime | None
) -> Step:
    """The declared outbox step ``name`` (or, for an operation begun before it replaced an
    earlier version, that version); ``StepUndeclared`` if ``method`` declares no such step.
    As for a call's step (``propagation.choose_step``), a retired version named stands for its
    name's active version, and one with no active version keys only the operations begun
    before its retirement."""
    outbox = [s for s in steps if s.outbox]
    step = next((s for s in outbox if s.name == name), None)
    if step is not None and not step.active:
        # Code not yet moved to the new version: refused, it failed every retry of an operation
        # begun before the retirement (which the new version's name keys with this one anyway,
        # as_of) with StepUndeclared, where a call naming its retired step went on.
        step = next(
            (s for s in outbox if s.active and step_base(s.name) == step_base(step.name)), step
        )
        if step.retired_at is not None and started_at is not None and started_at >= step.retired_at:
            # Retired for good and the operation began after: a version of its name added
            # later would key this operation's retry with another key (choose_step's reason).
            raise StepUndeclared(
                f"{method} enqueues outbox step {name!r}, but it was retired at"
                f" {step.retired_at.isoformat()}, before this operation began, and no active"
                " version of its name replaces it"
            )
    if step is None:
        declared = [s.name for s in outbox if s.active]
        problem = step_name_problem(name)
        if problem is not None:
            # As choose_step: quoted whole, a name past gRPC's metadata limit made the error's
            # own grpc-message too long (RESOURCE_EXHAUSTED), and "add steps: { name: ... }"
            # advised a declaration compile_policy refuses.
            raise StepUndeclared(
                f"{method} enqueues an outbox step, but {problem}; its declared outbox steps"
                f" are {declared}"
            )
        raise StepUndeclared(
            f"{method} enqueues outbox step {name!r}, but its declared outbox steps are"
            f' {declared}: add steps: {{ name: "{name}" outbox: true }} to its options'
        )
    return as_of(step, outbox, started_at)


def message_key(scope: str, parent_key: str, step: Step) -> str:
    return child_key(scope, parent_key, step.name)


def relay_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a relay, or ``None``: the one rule for ``Relay(name=...)`` and
    ``grpc-idempotency relay --name``, so that neither takes a name the other refuses.

    The name is stored in ``claimed_by`` (PostgreSQL refuses a lone surrogate, which no encoding
    to the database takes, and NUL: every claim failed, read as the store being down) and shown
    bare in the relay's log lines and the command's ``ready``/``stopped`` lines, which a
    supervisor reads: a newline split them, an ESC sequence rewrote the terminal. So it holds
    none of the characters a scope may not hold (``log_text.is_unsafe``: NUL is a control).
    Letters of any script, spaces and ZWNJ/ZWJ are taken; so is any length. The empty name is
    no problem here: both take it for "no name given" (host:pid:random)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as err:
        # Bytes that were not UTF-8 (an argument, an environment variable), surrogate-escaped.
        return (
            "a relay name is valid UTF-8, and this one is not: it holds"
            f" {code_point(name[err.start])}, a lone surrogate (from bytes that were not UTF-8)"
        )
    unsafe = unsafe_character(name)
    if unsafe is not None:
        # Named by code point, the name not quoted: it is what would disturb the terminal.
        return (
            "a relay name holds no control, line-separator or format character, and this one"
            f" holds {code_point(unsafe)}: give one line of visible text"
        )
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRoutes:
    """The outbox steps one relay delivers (``Relay(steps=...)``, ``relay --step``): the steps
    in ``names`` exactly, and every version of the steps in ``bases``. A relay that delivers
    to one receiver must never claim another receiver's rows: the payload of one step would be
    sent to a method expecting another's, which protobuf often parses anyway, and a wrong
    receiver's OK marked the row sent, lost for its own receiver. The store's SQL holds the
    same rule (``OutboxStatements``); ``matches`` is it, in Python."""

    names: tuple[str, ...]
    """Full step names (``receipt-email.v1``): that version only."""
    bases: tuple[str, ...]
    """Step names without their version (``receipt-email``): every version, so that a version
    bump (``.v2``) does not leave the new rows to no relay."""

    def matches(self, step: str) -> bool:
        return step in self.names or step_base(step) in self.bases


def step_routes(steps: object) -> StepRoutes | None:
    """``Relay(steps=...)`` read and checked: ``None`` (every step) stays ``None``; otherwise a
    non-empty collection of selectors, each a step name (``receipt-email.v1``: that version)
    or one without its version (``receipt-email``: every version). ``TypeError`` or
    ``ValueError`` names the first selector at fault."""
    if steps is None or isinstance(steps, StepRoutes):
        return steps  # another relay's ``relay.steps``, checked when it was made
    if isinstance(steps, str | bytes) or not isinstance(steps, Iterable):
        # A single name given bare was read as its characters, each refused for a reason
        # that said nothing of the mistake.
        raise TypeError(
            "steps must be None (every step) or a collection of step names, e.g."
            f" ['receipt-email.v1'], not {_quoted(steps)}"
        )
    selectors = list(steps)  # read once: a generator read by a check would leave nothing
    if not selectors:
        # An empty list is no routing at all: a relay claiming nothing would look healthy
        # while its rows piled up; every step is None.
        raise ValueError("steps is empty: give at least one step, or None for every step")
    names: list[str] = []
    bases: list[str] = []
    for selector in selectors:
        if not isinstance(selector, str):
            raise TypeError(f"steps: a step selector is a str, not {_quoted(selector)}")
        if "." in selector:
            problem = step_name_problem(selector)
            if problem is not None:
                raise ValueError(f"steps: {problem}")
            if selector not in names:
                names.append(selector)
            continue
        # Without a version: a step's name as its versions share it (core.keys.step_base), so
        # exactly what a step name allows before ".vN".
        longest = MAX_STEP_NAME_LENGTH - len(".v1")  # no longer one has a version that fits
        if STEP_NAME.fullmatch(selector + ".v1") is None or len(selector) > longest:
            raise ValueError(
                f"steps: {_quoted(selector)} is neither a step name (name.vN) nor a step's name"
                f" without its version ([a-z][a-z0-9-]*, at most {longest} characters)"
            )
        if selector not in bases:
            bases.append(selector)
    return StepRoutes(names=tuple(names), bases=tuple(bases))


def _quoted(value: object) -> str:
    """``repr(value)``, cut short: an error quoting a huge argument whole is unreadable."""
    text = repr(value)
    return text if len(text) <= 60 else text[:50] + "..."


@dataclass(frozen=True, kw_only=True, slots=True)
class DeliveryPolicy:
    """How a relay retries a failed delivery: exponential backoff from ``initial_backoff_s``
    (growing by ``multiplier`` per failure) up to ``max_backoff_s``, each delay between half and
    all of that (jittered), then a dead letter after ``max_attempts`` failed deliveries; also
    after ``max_attempts`` claims of the row alone in a row that ended with no recorded outcome,
    besides the first such claim, its batch's (see the module's docstring). Checked when made:
    ``ValueError`` names the first setting out of range."""

    max_attempts: int = 10
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 300.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        # TypeError for a wrong type, as every other setting's (True was taken for 1).
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"max_attempts must be a whole number, not {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts}")
        # Capped: the database adds the backoff to its clock, and past the cap it overflows
        # (22008): the failure was never recorded (the row stayed claimed with failures=0).
        checked_seconds("initial_backoff_s", self.initial_backoff_s, positive=True)
        checked_seconds("max_backoff_s", self.max_backoff_s, positive=True)
        if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, int | float):
            raise TypeError(f"multiplier must be a number, not {self.multiplier!r}")
        if not self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"max_backoff_s must be at least initial_backoff_s ({self.initial_backoff_s:g}),"
                f" not {self.max_backoff_s!r}"
            )
        # 10**400 is taken (finite): backoff_ceiling_s caps what its power overflows to.
        if not 1 <= self.multiplier < math.inf:
            raise ValueError(f"multiplier must be a number >= 1, not {self.multiplier!r}")

    def after_failure(self, attempts: int, jitter: float) -> float | None:
        """Seconds until the next delivery after ``attempts`` failed ones, or ``None``: park the
        row as a dead letter. ``jitter`` in [0, 1) spreads retries (half fixed, half random)."""
        if attempts >= self.max_attempts:
            return None
        ceiling = backoff_ceiling_s(
            attempts, self.initial_backoff_s, self.multiplier, self.max_backoff_s
        )
        return ceiling * (0.5 + jitter / 2)

    def parks_unrecorded(self, lost_claims: int) -> bool:
        """Whether a row whose last ``lost_claims`` claims in a row ended with no recorded
        outcome is parked without being delivered again: its delivery is presumed to kill (or
        stall) the relays that try it. The first of those claims may have been a batch's, lost
        by any of its rows; the others delivered it alone. So ``max_attempts`` of those alone:
        a batch-mate of a crasher is never parked for the batch's lost claim."""
        return lost_claims > self.max_attempts
