"""Which key an outgoing call carries. Pure decisions; the client interceptor carries them out.

In order:
1. the caller set ``idempotency-key`` itself (an ``Operation``): keep it;
2. the call is made while serving a keyed call: the child key of the declared step whose
   ``call`` is the target method (or of the step the handler named), derived from the parent's
   scope, key and the step name (``keys.child_key``). A keyed target with no declared step is
   an error *before anything is sent*: a fresh random key there would re-execute the downstream
   effect on every retry of the parent, which is the bug this library exists to prevent. A
   target the parent declares a step for is keyed by it even if its descriptor (on the
   caller's side) has no idempotency option: the declaration says the call is an effect;
3. an operation is active in the caller's context: its key;
4. the target is keyed (its method has the idempotency option, a key required or optional)
   and none of the above applies: a fresh key for this call, which gRPC's transparent retries
   then resend unchanged;
5. the target is not keyed (a read): nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from grpc_idempotency.core.errors import StepAmbiguous, StepReused, StepUndeclared
from grpc_idempotency.core.keys import (
    MAX_STEP_NAME_LENGTH,
    child_key,
    step_base,
    step_name_problem,
)
from grpc_idempotency.core.policy import Step, normalize_method


class KeySource(enum.Enum):
    EXPLICIT = "explicit"
    CHILD = "child"
    OPERATION = "operation"
    MINTED = "minted"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Parent:
    """The keyed call being served, as far as propagation needs it."""

    method: str
    scope: str
    key: str
    steps: tuple[Step, ...]
    started_at: datetime | None = None
    """When the operation began (this attempt, or the one it took over); ``None``: unknown."""


@dataclass(frozen=True, slots=True)
class KeyChoice:
    source: KeySource
    key: str | None = None
    step: str | None = None


def choose_step(parent: Parent, target: str, named: str | None) -> Step:
    """The step keying a call to ``target``: the one named (a retired version named standing
    for its name's active version; one with no active version only for an operation begun
    before its retirement), else the only active step calling it; then, for an operation begun
    before an earlier version of that step was retired, that earlier version (``as_of``)."""
    target = normalize_method(target)
    calling = [s for s in parent.steps if s.call and normalize_method(s.call) == target]
    active = [s for s in calling if s.active]
    if named is not None:
        chosen = next((s for s in calling if s.name == named), None)
        if chosen is None and len(named) > MAX_STEP_NAME_LENGTH:
            # Quoted whole, a name past gRPC's metadata limit (8 KiB) made the error's own
            # grpc-message too long: the caller was answered RESOURCE_EXHAUSTED instead. No
            # such name is declared (``policy.compile_policy`` refuses it).
            raise StepUndeclared(
                f"{parent.method} names a step for a call to {target}, but"
                f" {step_name_problem(named)}; its declared steps calling {target} are"
                f" {[s.name for s in calling]}"
            )
        if chosen is None:
            raise StepUndeclared(
                f"{parent.method} names step {named!r} for a call to {target}, but its declared"
                f" steps calling {target} are {[s.name for s in calling]}"
            )
        if not chosen.active:
            # A retired version named (code not yet moved to the new one) stands for its name's
            # active version, which as_of then takes back to the version the operation used:
            # used as is, it keyed an operation begun before an earlier version's retirement
            # with its own child key where the attempts naming the active version used the
            # earlier one (one operation, two child keys, the effect run twice), and went on
            # keying operations begun after its retirement. Without an active version (a step
            # retired for good) it is used as is, for the operations begun before its
            # retirement only (below).
            chosen = next(
                (s for s in active if step_base(s.name) == step_base(chosen.name)), chosen
            )
        if (
            chosen.retired_at is not None
            and parent.started_at is not None
            and parent.started_at >= chosen.retired_at
        ):
            # Retired for good (no active version) and the operation began after: it keyed
            # such an operation with its child key, and a version of its name added later
            # (check-steps sees nothing in flight to rekey for a new version) keyed the same
            # operation's retry with that version's (the effect run twice). A retired step
            # keys only the operations begun before its retirement (as_of); for a later one
            # it is not declared, as for a call naming no step.
            raise StepUndeclared(
                f"{parent.method} names step {named!r} for a call to {target}, but it was"
                f" retired at {chosen.retired_at.isoformat()}, before this operation began,"
                " and no active version of its name calls the target"
            )
    elif not active and calling:
        # Not the retired step, though it may still key this operation: unnamed, the call
        # would move to any step with another name added on the target later (a name is not
        # followed), keying an operation that ran the retired step with another child key.
        raise StepUndeclared(
            f"{parent.method} calls keyed method {target} without naming a step, and every"
            f" step it declares calling it is retired ({[s.name for s in calling]}): name the"
            " retired step with step(...) or step= for an operation begun before its"
            " retirement, or stop making the call"
        )
    elif not active:
        raise StepUndeclared(
            f"{parent.method} calls keyed method {target} without a declared step: add"
            f' steps: {{ name: "<what>.v1" call: "{target.lstrip("/")}" }} to its'
            " (grpc_idempotency.v1.method) option"
        )
    elif len(active) > 1:
        raise StepAmbiguous(
            f"{parent.method} declares several steps calling {target}"
            f" ({[s.name for s in active]}); name one with step(...) or step= on the call"
        )
    else:
        chosen = active[0]
    return as_of(chosen, calling, parent.started_at)


def as_of(step: Step, calling: Sequence[Step], started_at: datetime | None) -> Step:
    """The version of ``step`` that an operation begun at ``started_at`` used: an operation
    begun before ``charge-card.v1`` was retired for ``charge-card.v2`` may already have run v1,
    and v2's child key would run the effect a second time, so it keeps v1, on every attempt
    (the server gives each attempt its operation's start). ``started_at`` ``None`` (no start
    known) uses the step as declared.

    Only versions of the same name are followed: a step's name is its identity. A retired step
    with another name on the same target may be a step renamed or a step simply dropped next to
    one that was there all along, and the declaration cannot tell which: reading it as a rename
    would key the other step's effect with the retired step's child key (its outcome replayed,
    the effect never done). ``check-steps`` fails a rename instead (``step_contract``).

    A step retired for good (no active version: ``choose_step`` uses it for an operation begun
    before its retirement) is followed back the same way, to the versions retired before it:
    an operation begun before an earlier version's retirement ran that one, and the last
    version's child key, named on its retry, ran the effect again. For an operation begun after
    its own retirement it is itself."""
    if started_at is None:
        return step
    if step.retired_at is not None and not started_at < step.retired_at:
        return step
    earlier = [
        s
        for s in calling
        if s.retired_at is not None
        and step_base(s.name) == step_base(step.name)
        and started_at < s.retired_at
        and (step.retired_at is None or s.name == step.name or s.retired_at < step.retired_at)
    ]
    return min(earlier, key=lambda s: s.retired_at or started_at) if earlier else step


CLOCK_TRUST = timedelta(days=1)
"""How far an application server's clock is trusted to be from the database's: an atomic
attempt whose clock reads further than this from every declared step's retirement takes its
operation's start from its own clock (``start_decides``)."""


def start_decides(steps: Sequence[Step], now: datetime) -> bool:
    """Whether an atomic attempt's operation start must be read from the database rather than
    from this process's clock ``now``: some step's retirement is within ``CLOCK_TRUST`` of it,
    so a replica's clock seconds or minutes off the database's keyed the operation with another
    version of a step than its record's start (the database's now()) says it used, the version
    ``inspect`` and a phased takeover go by. Far from every retirement (or with none) the two
    clocks choose alike, and the atomic path saves the round trip."""
    return any(s.retired_at is not None and abs(s.retired_at - now) <= CLOCK_TRUST for s in steps)


def declares_step(parent: Parent, target: str) -> bool:
    """Whether ``parent`` declares a step calling ``target``, active or retired. Such a target is
    keyed by that step whatever its descriptor says on the caller's side: the caller may have an
    older descriptor, or the target may be keyed only by its own server's ``MethodOverride``;
    sent unkeyed, an optional-key target would run again on every re-run of the parent. A step
    retired for good too: it keys the operations begun before its retirement when named, and an
    unnamed call is refused (``choose_step``), as for a target keyed by its descriptor; both went
    out unkeyed."""
    return steps_call(parent.steps, target)


def steps_call(steps: Sequence[Step], target: str) -> bool:
    """Whether one of ``steps`` (active or retired) calls ``target`` (``declares_step``)."""
    target = normalize_method(target)
    return any(s.call and normalize_method(s.call) == target for s in steps)


def choose_key(
    *,
    target: str,
    target_keyed: bool,
    explicit_key: str | None,
    parent: Parent | None,
    named_step: str | None,
    operation_key: str | None,
    mint: Sequence[str] | None = None,
    step_named_by_call: bool = False,
) -> KeyChoice:
    """``mint`` is a one-element sequence with a fresh key, used only when one is needed.
    ``step_named_by_call``: ``named_step`` came with the call itself (``step_metadata``), not
    from a ``step(...)`` block, which may hold reads too: made while serving a keyed call, the
    call is then that step's, whatever the target's descriptor says, and refused
    (``StepUndeclared``) if the parent declares no such step calling the target. Dropped, the
    name left the call unkeyed, and a target keyed on its own server ran again on every re-run
    of the parent."""
    if explicit_key is not None:
        return KeyChoice(KeySource.EXPLICIT, explicit_key)
    if not target_keyed and not (
        parent is not None
        and (declares_step(parent, target) or (step_named_by_call and named_step is not None))
    ):
        return KeyChoice(KeySource.NONE)
    if parent is not None:
        step = choose_step(parent, target, named_step)
        return KeyChoice(KeySource.CHILD, child_key(parent.scope, parent.key, step.name), step.name)
    if operation_key is not None:
        return KeyChoice(KeySource.OPERATION, operation_key)
    if mint:
        return KeyChoice(KeySource.MINTED, mint[0])
    raise ValueError("a keyed call needs a key and none was minted")


class StepCalls:
    """The steps one attempt of a handler has called, so that a step is one call.

    A second call of a step carries the same child key as the first: answered OK, the first
    made downstream record an outcome that the second is then replayed (a loop charging each
    line item charges once, silently) or, with another request, refused as a reused key. So a
    step is refused (``StepReused``) while its call is in flight and once it was answered OK.
    A call that failed leaves the step free: calling it again is a retry of the same call, with
    the same key, which is what downstream deduplicates. One instance per handler attempt: a
    re-run of the handler calls each step again, and is replayed."""

    __slots__ = ("_answered", "_in_flight")

    def __init__(self) -> None:
        self._in_flight: set[str] = set()
        self._answered: set[str] = set()

    def starting(self, method: str, step: str, target: str) -> None:
        """Raises ``StepReused`` if ``step`` may not be called now; else counts it in flight."""
        if step in self._answered or step in self._in_flight:
            when = "was answered OK" if step in self._answered else "is still in flight"
            raise StepReused(
                f"{method} called {target} as step {step!r} a second time, and its first call"
                f" {when}; a step is one call: its child key would have downstream replay the"
                " first answer (or refuse another request as a reused key). Declare a step for"
                " each call, or make one call that carries them all (a batch request)"
            )
        self._in_flight.add(step)

    def ended(self, step: str, *, ok: bool) -> None:
        """The call of ``step`` is over; ``ok``: it was answered with status OK."""
        self._in_flight.discard(step)
        if ok:
            self._answered.add(step)
