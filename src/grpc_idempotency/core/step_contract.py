"""Step names as a contract: what changed between two versions of the declared steps, and
whether the change can re-execute work that is already in flight.

A child key is derived from the parent's scoped key and the *step name* (``keys.child_key``), not
from the method or the target. So, for an operation that already ran a step and is re-run later
(a retry after a transient failure, a takeover after a crash), the name is what makes the
downstream service recognise the effect as already done:

- a step that is renamed, removed, or whose version changes gives its effect a new child key: the
  downstream service sees a new operation and executes the effect again;
- a step whose ``call`` target changes under the same name reuses a child key for a *different*
  effect: the new target may replay nothing, or recognise a key it never issued. A retired step
  too, while it is live: the runtime finds it by its target, so retargeted it no longer keys the
  operations begun before its retirement;
- a ``retired_at`` that had passed and is moved later hands the operations begun in between,
  which ran the step's successor, the retired step's child key;
- a ``retired_at`` already past when it is set (or moved earlier) hands the operations begun
  since, which ran the step, its successor's child key; retired for good, the step is refused
  to them, and a version of its name added in a later change keys them with its own, where that
  change has no way to see it;
- a keyed method that disappears while it still declares steps drops the declaration that its
  in-flight operations (up to its retention's worth) depend on.

A deliberate change is made by keeping the old step declared with ``retired_at`` set: operations
begun before ``retired_at`` keep the old step's child key on every attempt, operations begun
after it use the replacement (``propagation.as_of``), and the retired step may be removed once
``retired_at + retention`` has passed, when no operation that could have used it is replayable
any more.

The replacement is a newer version of the same name, on the same target: a step's name is its
identity, and ``as_of`` follows nothing else. A retired step next to a step with another name
may be a step renamed or a step simply dropped next to one that was there all along; the
declaration cannot tell which, and reading the second as the first would key the remaining
step's effect with the dropped step's child key. So a *rename* -- an active step gone (removed
or retired) and, in the same change, an active step with a new name on its target (the same
``call``, or both outbox) -- fails whether or not the old name is kept retired; the fix is to
keep the old name and bump its version, and to add a step that really is a different effect in
a change of its own.

Pure: plain data in (method path -> retention and steps, and the current time), findings out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from grpc_idempotency.core.errors import StepAmbiguous, StepUndeclared
from grpc_idempotency.core.keys import step_base
from grpc_idempotency.core.outbox import outbox_step
from grpc_idempotency.core.policy import Step, normalize_method
from grpc_idempotency.core.propagation import Parent, as_of, choose_step


@dataclass(frozen=True, kw_only=True, slots=True)
class MethodSteps:
    """What the contract needs to know about one keyed method."""

    retention: timedelta
    steps: tuple[Step, ...] = ()


Contract = Mapping[str, MethodSteps]
"""Keyed methods by gRPC path ("/package.Service/Method")."""


class Change(enum.Enum):
    # Breaking: in-flight operations could execute a downstream effect again.
    STEP_REMOVED = "step removed"
    STEP_RENAMED = "step renamed"
    STEP_VERSION_CHANGED = "step version changed"
    STEP_TARGET_CHANGED = "step target changed"
    RETIRED_STEP_REMOVED_EARLY = "retired step removed too early"
    RETIREMENT_POSTPONED_AFTER_THE_FACT = "retirement postponed after it took effect"
    RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS = "retirement backdated over operations begun"
    OPERATIONS_REKEYED = "operations in flight keyed with another version"
    METHOD_REMOVED = "keyed method removed"
    # Fine.
    STEP_ADDED = "step added"
    STEP_RETIRED = "step retired"
    STEP_REINSTATED = "retired step reinstated"
    RETIRED_STEP_REMOVED = "retired step removed"
    RETIRED_STEP_REMOVABLE = "retired step can be removed"
    RETIREMENT_BACKDATED = "retirement backdated"
    METHOD_ADDED = "keyed method added"
    METHOD_REMOVED_SAFELY = "keyed method removed (no live steps)"

    @property
    def breaking(self) -> bool:
        return self in _BREAKING


_BREAKING = frozenset(
    {
        Change.STEP_REMOVED,
        Change.STEP_RENAMED,
        Change.STEP_VERSION_CHANGED,
        Change.STEP_TARGET_CHANGED,
        Change.RETIRED_STEP_REMOVED_EARLY,
        Change.RETIREMENT_POSTPONED_AFTER_THE_FACT,
        Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS,
        Change.OPERATIONS_REKEYED,
        Change.METHOD_REMOVED,
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    change: Change
    method: str
    step: str | None
    """The step concerned (the old name when a step was renamed); ``None`` for a method."""
    what: str
    """What happened, in one sentence."""
    why: str = ""
    """Why it matters (breaking findings)."""
    fix: str = ""
    """How to make the change safely (breaking findings)."""

    @property
    def breaking(self) -> bool:
        return self.change.breaking


@dataclass(frozen=True, slots=True)
class Report:
    findings: tuple[Finding, ...]
    methods_checked: int
    """Keyed methods in either contract."""

    @property
    def ok(self) -> bool:
        return not self.breaking

    @property
    def breaking(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.breaking)


def check_contract(old: Contract, new: Contract, *, now: datetime) -> Report:
    """Compare the steps declared in ``old`` (the baseline, e.g. main) with ``new``.

    ``now`` must be timezone-aware; it decides whether a retired step's ``retired_at + retention``
    has passed. Findings are ordered by method path, then by the old declaration order.
    """
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    findings: list[Finding] = []
    for path in sorted(set(old) | set(new)):
        before, after = old.get(path), new.get(path)
        if before is None:
            assert after is not None
            active = [s.name for s in after.steps if s.active]
            added = f"keyed method added with steps {active}" if active else "keyed method added"
            findings.append(
                Finding(
                    change=Change.METHOD_ADDED,
                    method=path,
                    step=None,
                    what=added,
                )
            )
        elif after is None:
            findings.extend(_method_removed(path, before, now))
        else:
            findings.extend(_compare_method(path, before, after, now))
    return Report(findings=tuple(findings), methods_checked=len(set(old) | set(new)))


def removable_from(step: Step, retention: timedelta) -> datetime | None:
    """When a retired step may be deleted from the declaration; ``None`` if it is active."""
    return None if step.retired_at is None else _plus(_aware(step.retired_at), retention)


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _aware_step(step: Step) -> Step:
    if step.retired_at is None or step.retired_at.tzinfo is not None:
        return step
    return replace(step, retired_at=_aware(step.retired_at))


def _live(step: Step, retention: timedelta, now: datetime) -> bool:
    """Still part of the contract: active, or retired less than ``retention`` ago."""
    until = removable_from(step, retention)
    return until is None or now < until


def _by_name(steps: tuple[Step, ...]) -> dict[str, Step]:
    named: dict[str, Step] = {}
    for s in steps:
        named.setdefault(s.name, s)  # a duplicate is the linter's business; the first one counts
    return named


def _target(step: Step) -> str:
    if step.call:
        return normalize_method(step.call).lstrip("/")
    return "the outbox" if step.outbox else "nothing"


def _effect(step: Step) -> str:
    return f"calls {_target(step)}" if step.call else f"enqueues in {_target(step)}"


def _method_removed(path: str, before: MethodSteps, now: datetime) -> list[Finding]:
    live = [s for s in before.steps if _live(s, before.retention, now)]
    if not live:
        return [
            Finding(
                change=Change.METHOD_REMOVED_SAFELY,
                method=path,
                step=None,
                what="keyed method removed; it had no active or recently retired steps",
            )
        ]
    names = [s.name for s in live]
    ends = [removable_from(s, before.retention) for s in live]
    latest = None if None in ends else max(e for e in ends if e is not None)
    return [
        Finding(
            change=Change.METHOD_REMOVED,
            method=path,
            step=None,
            what=(
                "keyed method removed, or it lost its (grpc_idempotency.v1.method) option, while"
                f" it still declared steps {names}"
            ),
            why=(
                "operations of this method started within its retention"
                f" ({_span(before.retention)}) may still be in flight and retried: if the option"
                " was dropped, a retry runs unkeyed and its downstream calls get fresh keys,"
                " executing these effects again; if the method was removed or moved, its"
                " clients' retries no longer reach the records that dedupe them"
            ),
            fix=(
                "keep the method and its option, and retire its steps first (set retired_at on"
                " each); remove the method once retired_at + retention has passed"
                + (f" (here: from {_ts(latest)})" if latest is not None else "")
            ),
        )
    ]


def _compare_method(
    path: str, before: MethodSteps, after: MethodSteps, now: datetime
) -> list[Finding]:
    # Records written under either retention may still be replayed: use the longer one.
    retention = max(before.retention, after.retention)
    old, new = _by_name(before.steps), _by_name(after.steps)
    findings: list[Finding] = []
    renamed = _renames(before, after)
    among = before.steps + after.steps  # versions already taken, for the fixes' new names
    # Active steps that appeared, to pair with active steps that vanished (new versions).
    taken = {s.name for s in renamed.values()}
    unpaired = [s for name, s in new.items() if name not in old and s.active and name not in taken]
    paired = set(taken)

    for name, was in old.items():
        if name in renamed:
            findings.append(_renamed(path, was, new.get(name), renamed[name], before, after, now))
            if name in new:  # retired: keep what else there is to say about it
                notes = _compare_step(path, was, new[name], retention, now, among, after.steps)
                findings.extend(f for f in notes if f.change is not Change.STEP_RETIRED)
        elif name in new:
            findings.extend(_compare_step(path, was, new[name], retention, now, among, after.steps))
        elif not was.active:
            findings.append(_retired_step_removed(path, was, retention, now))
        else:
            finding = _active_step_gone(path, was, unpaired, retention, now)
            if finding.step_after is not None:
                paired.add(finding.step_after)
            findings.append(finding.finding)

    for name, step in new.items():
        if name not in old and name not in paired:
            retired = "" if step.active else f" as retired at {_ts(step.retired_at)}"
            findings.append(
                Finding(
                    change=Change.STEP_ADDED,
                    method=path,
                    step=name,
                    what=f"step {name} ({_effect(step)}) added{retired}",
                )
            )
    # The backstop, for the names no rule above found breaking (those rules' fixes cover what
    # it would say about them). Run only when nothing was breaking, it missed a name keyed
    # anew next to another name's breaking change (an old version declared retired beside a
    # step removed): the fixes printed, applied, failed the check once more.
    broken = {step_base(f.step) for f in findings if f.breaking and f.step is not None}
    findings.extend(
        f
        for f in _rekeyed(path, before, after, retention, now, among)
        if f.step is None or step_base(f.step) not in broken
    )
    return findings


def _rekeyed_fix(
    was: Step,
    step: Step,
    before: MethodSteps,
    after: MethodSteps,
    now: datetime,
    among: tuple[Step, ...],
) -> str:
    """Keep the versions of the name on the target as they were; a different active version
    (a rollback) is declared as a new version, the old active one retired at ship time."""

    def versions(steps: tuple[Step, ...]) -> list[Step]:
        return [
            s for s in steps if _same_target(s, step) and step_base(s.name) == step_base(step.name)
        ]

    kept = [
        _declaration(s, retire_at=_ships(now) if s is was and step.name != was.name else None)
        for s in versions(before.steps)
    ]
    if step.name != was.name:
        new = Step(
            name=f"{step_base(step.name)}.v{_next_version(step.name, among)}",
            call=step.call,
            outbox=step.outbox,
        )
        kept.append(_declaration(new))
    previous = {s.name for s in versions(before.steps)}
    gone = [f"delete {s.name}" for s in versions(after.steps) if s.name not in previous]
    return (
        "keep the versions of the name as they were, and declare a changed effect as a new"
        " version: " + "; ".join(kept + gone)
    )


def _rekeyed(
    path: str,
    before: MethodSteps,
    after: MethodSteps,
    retention: timedelta,
    now: datetime,
    among: tuple[Step, ...],
) -> list[Finding]:
    """The backstop of the rules above, which name each kind of change: an operation begun
    at any time still within the retention keys its call with the version ``propagation.as_of``
    chose for it under the contract it began with, and must get the same one after the change.
    A retired version put back (a rollback: v1 active again, v2 retired) or a retired version
    declared next to the active one (v3 retired, v2 active) passed every rule, and in-flight
    operations were retried under a child key the downstream service had never seen.

    The version ``as_of`` chooses changes only at a retired_at, so it is compared just before
    and at each retired_at in the window (and at the window's start)."""
    start = _minus(now, retention)
    findings: list[Finding] = []
    for step in after.steps:
        if not step.active:
            continue
        # The same step if it was active (two active versions of a name on one target are
        # each named by the calls); else the active version of its name it takes over from,
        # one that is no longer active (one still active goes on keying its own calls).
        still_active = {s.name for s in after.steps if s.active}
        same = next((s for s in before.steps if s.name == step.name and s.active), None)
        was = same or next(
            (
                s
                for s in before.steps
                if s.active
                and s.name not in still_active
                and _same_target(s, step)
                and step_base(s.name) == step_base(step.name)
            ),
            None,
        )
        if was is None:
            continue  # a step new to its target: nothing in flight called it
        # Times read as UTC when naive, as everywhere in the contract (as_of compares them).
        calling_before = [_aware_step(s) for s in before.steps if _same_target(s, step)]
        calling_after = [_aware_step(s) for s in after.steps if _same_target(s, step)]
        was, step = _aware_step(was), _aware_step(step)
        times = {start}
        for s in calling_before + calling_after:
            if s.retired_at is not None:
                times.update({_minus(s.retired_at, timedelta(microseconds=1)), s.retired_at})
        for t in sorted(t for t in times if start <= t < now):
            used = as_of(was, calling_before, t).name
            keyed = as_of(step, calling_after, t).name
            if used == keyed:
                continue
            findings.append(
                Finding(
                    change=Change.OPERATIONS_REKEYED,
                    method=path,
                    step=step.name,
                    what=(
                        f"an operation begun at {_ts(t)} keyed its call to {_target(step)} with"
                        f" step {used}; after this change it is keyed with {keyed}"
                    ),
                    why=(
                        f"such an operation is still in flight (retention {_span(retention)}):"
                        f" retried, or taken over after a crash, it sends {_target(step)} a"
                        " child key that service has never seen, and the effect runs again"
                    ),
                    fix=_rekeyed_fix(was, step, before, after, now, among),
                )
            )
            break
    # One finding per name and target: its fix keeps all the versions as they were.
    done = {
        (step_base(s.name), _target(s)) for s in after.steps if s.name in {f.step for f in findings}
    }
    findings.extend(_rekeyed_named(path, before, after, retention, now, done))
    return findings


def _rekeyed_named(
    path: str,
    before: MethodSteps,
    after: MethodSteps,
    retention: timedelta,
    now: datetime,
    done: set[tuple[str, str]],
) -> list[Finding]:
    """``_rekeyed`` for a call naming its step, as the runtime keys it
    (``propagation.choose_step``; an enqueue, ``outbox.outbox_step``, alike): a step retired for
    good keys an operation begun before its retirement with itself or a version retired before
    it (``as_of``), and a retired version named stands for its name's active one, so a retired
    version declared in this change (retired earlier), or an active one added, took over such an
    operation's calls, which the rules above, reading active steps only, passed."""
    start = _minus(now, retention)
    findings: list[Finding] = []
    for step in after.steps:
        # Outbox steps too: a retired outbox version named in enqueue stands for its name's active
        # version as a call's step does (``outbox.outbox_step``), so it re-keys the same way.
        if not (step.call or step.outbox) or (step_base(step.name), _target(step)) in done:
            continue
        calling_before = [_aware_step(s) for s in before.steps if _same_target(s, step)]
        calling_after = [_aware_step(s) for s in after.steps if _same_target(s, step)]
        times = {start}
        for s in calling_before + calling_after:
            if s.retired_at is not None:
                times.update({_minus(s.retired_at, timedelta(microseconds=1)), s.retired_at})
        for t in sorted(t for t in times if start <= t < now):
            used = _named(calling_before, step, t)
            keyed = _named(calling_after, step, t)
            if used is None or keyed is None or used == keyed:
                continue
            previous = {
                s.name: s for s in calling_before if step_base(s.name) == step_base(step.name)
            }
            # Each as it was, but for the step's own retirement, made in this change (a version
            # added or a retired_at moved is what re-keyed the operation).
            kept = [
                _declaration(step, retire_at=_retired_after_the_others(step, previous, now))
                if s.name == step.name and s.active
                else _declaration(s)
                for s in previous.values()
            ]
            gone = [
                f"delete {s.name}"
                for s in calling_after
                if step_base(s.name) == step_base(step.name) and s.name not in previous
            ]
            findings.append(
                Finding(
                    change=Change.OPERATIONS_REKEYED,
                    method=path,
                    step=step.name,
                    what=(
                        f"an operation begun at {_ts(t)} keyed its call to {_target(step)} with"
                        f" step {used} when it named {step.name}; after this change it is keyed"
                        f" with {keyed}"
                    ),
                    why=(
                        f"such an operation is still in flight (retention {_span(retention)}):"
                        f" retried, or taken over after a crash, it sends {_target(step)} a"
                        " child key that service has never seen, and the effect runs again"
                    ),
                    fix=(
                        "keep the versions of the name as they were, and declare a changed"
                        " effect as a new version: " + "; ".join(kept + gone)
                    ),
                )
            )
            done.add((step_base(step.name), _target(step)))
            break
    return findings


def _named(calling: list[Step], step: Step, started_at: datetime) -> str | None:
    """The step a call naming ``step`` is keyed with, for an operation begun at ``started_at``
    (``None``: refused)."""
    parent = Parent(method="", scope="", key="", steps=tuple(calling), started_at=started_at)
    try:
        if not step.call:
            return outbox_step("", tuple(calling), step.name, started_at).name
        return choose_step(parent, step.call, step.name).name
    except (StepUndeclared, StepAmbiguous):
        return None


def _renames(before: MethodSteps, after: MethodSteps) -> dict[str, Step]:
    """The renames in the change from ``before`` to ``after``: old name -> the step with a new
    name that appeared on its target.

    A step is renamed when it was active and is gone (removed, or retired) with no active
    version of its name left on its target, while a step added active on that target has a
    name (without version) that no active step there had before. Each new name is the rename of
    one old step, the first in declaration order: the others gone with it are plain removals or
    retirements, and stay so once that rename is fixed (so every fix printed holds together)."""
    old, new = _by_name(before.steps), _by_name(after.steps)
    renamed: dict[str, Step] = {}
    for name, was in old.items():
        kept = new.get(name)
        if not was.active or (kept is not None and kept.active):
            continue
        on_target = [s for s in new.values() if s.active and _same_target(s, was)]
        if any(step_base(s.name) == step_base(name) for s in on_target):
            continue  # a new version of the same name follows it
        had = {step_base(s.name) for s in before.steps if s.active and _same_target(s, was)}
        taken = {s.name for s in renamed.values()}
        # A retired step made active again is as new to its target's calls as an added one: an
        # unnamed call that went to ``was`` goes to it now (the retired step was never chosen).
        fresh = [
            s
            for s in on_target
            if (s.name not in old or not old[s.name].active) and s.name not in taken
        ]
        successor = next((s for s in fresh if step_base(s.name) not in had), None)
        if successor is not None:
            renamed[name] = successor
    return renamed


def _renamed(
    path: str,
    was: Step,
    kept: Step | None,
    successor: Step,
    before: MethodSteps,
    after: MethodSteps,
    now: datetime,
) -> Finding:
    """``was`` renamed to ``successor``; ``kept``: the old name as declared after the change
    (retired), if it still is."""
    name = was.name
    retention = max(before.retention, after.retention)
    retired_at = kept.retired_at if kept is not None else None
    # Never a retirement already past: operations begun since ran the old name with its child
    # key, and the bump would key their retries with the new version's
    # (RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS).
    retire_at = _ships(now)
    if retired_at is not None and _aware(retired_at) >= now:
        retire_at = _aware(retired_at)
    bumped = Step(
        name=f"{step_base(name)}.v{_next_version(name, before.steps + after.steps)}",
        call=was.call,
        outbox=was.outbox,
    )
    # A successor that was declared retired before: keep it so (deleting it could be early).
    prior = next((p for p in before.steps if p.name == successor.name), None)
    instead = (
        f" in place of {successor.name}"
        if prior is None
        else f", and keep {successor.name} retired as it was, {_declaration(prior)}"
    )
    return Finding(
        change=Change.STEP_RENAMED,
        method=path,
        step=name,
        what=(
            f"step {name} ({_effect(was)}) was renamed to {successor.name}"
            f" ({_effect(successor)})"
            + (f", the old name kept, retired at {_ts(retired_at)}" if retired_at else "")
        ),
        why=(
            "a step's name is its identity: child keys are derived from it, and only a new"
            f" version of the same name is followed (an operation begun before {name} was retired"
            f" keeps {name}'s child key in place of a {step_base(name)}.vN's); a retired step"
            " next to a step with another name may as well have been dropped, so it is never read"
            f" as renamed. An operation still in flight (retention {_span(retention)}) that already"
            f" ran {name} and is retried, or taken over after a crash, would run the effect again"
            f" under {successor.name}'s child key, so the downstream service executes it a second"
            " time"
        ),
        fix=(
            "keep the old name and bump its version instead:"
            f" {_declaration(was, retire_at=retire_at)} {_declaration(bumped)},{instead};"
            f" operations begun before the retirement keep {name}, which can"
            f" be deleted from {_ts(_plus(_aware(retire_at), retention))} (retired_at +"
            f" {_span(retention)}). If {successor.name} really is a different effect, add it in"
            " a change of its own"
        ),
    )


@dataclass(frozen=True, slots=True)
class _Gone:
    finding: Finding
    step_after: str | None


def _active_step_gone(
    path: str, was: Step, unpaired: list[Step], retention: timedelta, now: datetime
) -> _Gone:
    """An active step is no longer declared, and not renamed (``_renames``): a new version, or a
    removal."""
    name = was.name
    successor = _pick(unpaired, lambda s: step_base(s.name) == step_base(name))
    if successor is None:
        what = f"step {name} ({_effect(was)}) was removed"
        change = Change.STEP_REMOVED
        runs = "the effect again, under any new step's child key,"
    else:
        what = (
            f"step {name} ({_effect(was)}) changed version to {successor.name}"
            f" ({_effect(successor)}) without retiring the old name"
        )
        change = Change.STEP_VERSION_CHANGED
        runs = f"{successor.name} under a new child key,"
    finding = Finding(
        change=change,
        method=path,
        step=name,
        what=what,
        why=(
            f"child keys are derived from step names: an operation still in flight (retention"
            f" {_span(retention)}) that already ran {name} and is retried, or taken over after a"
            f" crash, would run {runs} so the downstream service executes it a second time"
        ),
        fix=(
            f"declare the old step again, retired: {_declaration(was, retire_at=_ships(now))};"
            f" it can be deleted from {_ts(_plus(_ships(now), retention))} (retired_at +"
            f" {_span(retention)})"
        ),
    )
    return _Gone(finding, successor.name if successor is not None else None)


def _same_target(a: Step, b: Step) -> bool:
    """The same ``call`` (normalized), or both outbox steps."""
    return _target(a) == _target(b) and bool(a.call) == bool(b.call)


def _retired_step_removed(path: str, was: Step, retention: timedelta, now: datetime) -> Finding:
    until = removable_from(was, retention)
    assert until is not None
    if now >= until:
        return Finding(
            change=Change.RETIRED_STEP_REMOVED,
            method=path,
            step=was.name,
            what=(
                f"retired step {was.name} removed (retired at {_ts(was.retired_at)}; retention"
                f" {_span(retention)} passed at {_ts(until)})"
            ),
        )
    return Finding(
        change=Change.RETIRED_STEP_REMOVED_EARLY,
        method=path,
        step=was.name,
        what=(
            f"retired step {was.name} removed too early: retired at {_ts(was.retired_at)} with"
            f" retention {_span(retention)}, it must stay declared until {_ts(until)}"
            f" ({_span(until - now)} from now)"
        ),
        why=(
            "operations started before the retirement can be replayed or retried until then;"
            " the declaration records that their change of child key was deliberate"
        ),
        fix=f"keep {_declaration(was)} until {_ts(until)}, then remove it",
    )


def _compare_step(
    path: str,
    was: Step,
    step: Step,
    retention: timedelta,
    now: datetime,
    among: tuple[Step, ...],
    declared: tuple[Step, ...],
) -> list[Finding]:
    """The same name in both: a changed target, a retirement, a reinstatement, a retirement
    moved. ``declared``: the steps after the change."""
    name = step.name

    def found(change: Change, what: str, why: str = "", fix: str = "") -> list[Finding]:
        return [Finding(change=change, method=path, step=name, what=what, why=why, fix=fix)]

    # A retired step is followed by its target too (``propagation.choose_step`` reads the steps
    # calling the target): while it is live, retargeting it moves the operations begun before
    # its retirement to its successor's child key, and the effect runs again.
    retargeted: list[Finding] = []
    if _target(was) != _target(step) and _live(was, retention, now):
        if step.active:
            why = (
                "the child key stays the same while the effect changes: an operation in flight"
                f" that already ran {name} against {_target(was)} sends the same child key to"
                f" {_target(step)}, which has no record of it and executes its effect; the"
                " reverse can replay an outcome that belongs to another effect"
            )
            fix = (
                f"declare a new step (e.g. {step_base(name)}.v{_next_version(name, among)}) for the"
                f" new target and keep the old one declared as retired,"
                f" {_declaration(was, retire_at=_ships(now))}"
            )
        else:
            why = (
                f"an operation begun before {name} was retired keys its calls to {_target(was)}"
                f" with {name}'s child key on every attempt, and the step is found by its"
                f" target: declared on {_target(step)}, it no longer keys them, so one still in"
                f" flight (retention {_span(retention)}) that already ran {name} is retried"
                " under another step's child key, and the downstream service executes the"
                " effect again"
            )
            kept = Step(name=name, call=was.call, outbox=was.outbox, retired_at=step.retired_at)
            fix = (
                "keep the retired step's target until it can be deleted"
                f" ({_ts(removable_from(kept, retention))}): {_declaration(kept)}"
            )
        what = "step" if step.active else "retired step"
        retargeted = found(
            Change.STEP_TARGET_CHANGED,
            f"{what} {name} changed target under the same name: it {_effect(was)}, now it"
            f" {_effect(step)}",
            why=why,
            fix=fix,
        )
        if step.active:
            return retargeted
    if was.active and step.active:
        return []
    if step.active:
        return found(Change.STEP_REINSTATED, f"retired step {name} is active again")
    until = removable_from(step, retention)
    assert until is not None and step.retired_at is not None
    backdated: list[Finding] = []
    if _backdated_over_begun(was, step, retention, now):
        since = "it was active" if was.active else f"it was retired at {_ts(was.retired_at)}"
        ran = (
            f"operations begun since {_ts(step.retired_at)} ran {name} with its child key"
            " (the contract deployed then still keyed them with it); "
        )
        if _followed(step, declared):
            why = ran + (
                f"this change keys them with the step that follows {name} (a newer version of"
                f" its name), so one still in flight (retention {_span(retention)}) that is"
                " retried, or taken over after a crash, sends the downstream service a child key"
                " it has never seen, and the effect runs again"
            )
        else:
            # Retired for good: nothing is re-keyed yet, but a version of the name added in a
            # later change keys these operations with its child key, and that change cannot
            # tell them from the ones begun after a retirement that was not backdated (which
            # never ran the step: their calls were refused). This is the last change that sees
            # them.
            why = ran + (
                f"this change keys {name} only for operations begun before"
                f" {_ts(step.retired_at)}, so one still in flight (retention"
                f" {_span(retention)}) that is retried, or taken over after a crash, has its call"
                " refused (StepUndeclared); and a version of the name added in a later change"
                " keys it with that version's child key, which the downstream service has never"
                " seen, so the effect runs again, where that change's check has nothing to see"
            )
        backdated = found(
            Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS,
            f"step {name} is retired at {_ts(step.retired_at)}, already past, where {since}",
            why=why,
            # Retired already: the deployed retirement keyed these operations, and is kept (a
            # time later than it, once past, moves a retirement that has taken effect).
            fix=(
                "retire it no earlier than this change ships (a time still ahead when this"
                f" check runs, here a day from now): {_declaration(was, retire_at=_ships(now))}"
                if was.active
                else f"keep retired_at as it was: {_declaration(was)}"
            ),
        )
    if was.active:
        retired = (
            retargeted
            + backdated
            + found(
                Change.STEP_RETIRED,
                f"step {name} retired at {_ts(step.retired_at)};"
                f" it can be removed from {_ts(until)}",
            )
        )
        if until > now:
            return retired
        return retired + found(
            Change.RETIREMENT_BACKDATED,
            f"step {name} is retired in this change, but retired_at + retention"
            f" ({_span(retention)}) is already past, so the next change could delete it at once;"
            " set retired_at to when this change ships, e.g."
            f" {_declaration(was, retire_at=_ships(now))}",
        )
    assert was.retired_at is not None
    notes: list[Finding] = retargeted + backdated
    if _postponed_after_the_fact(was, step, declared, retention, now):
        notes += found(
            Change.RETIREMENT_POSTPONED_AFTER_THE_FACT,
            f"the retired_at of step {name} moved later, from {_ts(was.retired_at)} to"
            f" {_ts(step.retired_at)}, after the retirement took effect",
            why=(
                f"operations begun since {_ts(was.retired_at)} ran the step that follows {name}"
                f" (a newer version of its name) with that step's child key; an operation begun"
                f" before the new retired_at is keyed with {name}'s instead, so one still in"
                f" flight (retention {_span(retention)}) that is retried, or taken over after a"
                " crash, sends the downstream service a child key it has never seen, and the"
                " effect runs again"
            ),
            fix=(
                f"keep retired_at as it was, {_declaration(was)}; a retirement that has taken"
                " effect cannot be moved later (moving a future retired_at later is fine)"
            ),
        )
    elif _aware(step.retired_at) < _aware(was.retired_at):
        notes += found(
            Change.RETIREMENT_BACKDATED,
            f"the retired_at of step {name} moved earlier, from {_ts(was.retired_at)} to"
            f" {_ts(step.retired_at)}, which shortens its retirement window",
        )
    if until <= now:
        notes += found(
            Change.RETIRED_STEP_REMOVABLE,
            f"retired step {name} can now be removed (retired_at + {_span(retention)} passed at"
            f" {_ts(until)})",
        )
    return notes


def _postponed_after_the_fact(
    was: Step, step: Step, declared: tuple[Step, ...], retention: timedelta, now: datetime
) -> bool:
    """``step``'s retired_at is later than ``was``'s, which had passed by ``now``, some operation
    begun between the two may still be retried (begun within ``retention``), and an active
    version of the name follows the step on its target: ``propagation.as_of`` then keys such an
    operation, which ran the follower, with the retired step's child key instead."""
    assert was.retired_at is not None and step.retired_at is not None
    before, after = _aware(was.retired_at), _aware(step.retired_at)
    if not before <= now or not after > before:
        return False
    if after <= max(before, _minus(now, retention)):
        return False  # every operation begun in between is past its retention
    return _followed(step, declared)


def _backdated_over_begun(was: Step, step: Step, retention: timedelta, now: datetime) -> bool:
    """``step`` is retired at a moment already past and earlier than when ``was`` stopped keying
    operations with it (its own retired_at, or never for an active step), and some operation
    begun in between may still be retried (begun within ``retention``). Such an operation ran
    the step; ``propagation.as_of`` keys its retry with the step's follower (a newer version of
    its name) if there is one, and ``choose_step`` refuses the step for it if there is none, and
    a follower added later keys it with its own child key. The mirror of
    ``_postponed_after_the_fact``."""
    if step.retired_at is None:
        return False
    after = _aware(step.retired_at)
    before = now if was.retired_at is None else min(_aware(was.retired_at), now)
    if not after < before:
        return False
    return before > _minus(now, retention)  # else every operation begun in between is past it


def _followed(step: Step, declared: tuple[Step, ...]) -> bool:
    """An active version of ``step``'s name calls its target."""
    return any(
        s.active and step_base(s.name) == step_base(step.name) and _same_target(s, step)
        for s in declared
    )


SHIP_MARGIN = timedelta(days=1)
"""How far ahead of the check the retired_at in a suggested fix lies: a retirement must not be
past when the change ships (RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS), and the check runs
again on every push before then; "now" was past by the next run, so the fix it printed never
passed."""


def _ships(now: datetime) -> datetime:
    """A retired_at for a suggested fix: ``SHIP_MARGIN`` from ``now``, up to the whole hour."""
    ahead = _plus(now, SHIP_MARGIN)
    whole = ahead.replace(minute=0, second=0, microsecond=0)
    return whole if whole == ahead else _plus(whole, timedelta(hours=1))


def _pick(candidates: list[Step], match: Callable[[Step], bool]) -> Step | None:
    for i, s in enumerate(candidates):
        if match(s):
            return candidates.pop(i)
    return None


def _plus(moment: datetime, span: timedelta) -> datetime:
    """``moment + span``, the latest datetime where that is past it: a retention near a
    Duration's largest (10,000 years) or a ``--now`` near year 9999 raised OverflowError."""
    try:
        return moment + span
    except OverflowError:
        return datetime.max.replace(tzinfo=moment.tzinfo)


def _minus(moment: datetime, span: timedelta) -> datetime:
    """``moment - span``, saturating at the earliest datetime like ``_plus``."""
    try:
        return moment - span
    except OverflowError:
        return datetime.min.replace(tzinfo=moment.tzinfo)


def _next_version(name: str, among: tuple[Step, ...] = ()) -> int:
    """The version after ``name``'s, and after any other version of its name in ``among``."""
    versions = [_version(name)] + [
        _version(s.name) for s in among if step_base(s.name) == step_base(name)
    ]
    return max(versions) + 1


def _version(name: str) -> int:
    _, sep, version = name.rpartition(".v")
    return int(version) if sep and version.isdigit() else 1


def _retired_after_the_others(
    step: Step, versions: dict[str, Step], now: datetime
) -> datetime | None:
    """``step``'s retirement, unless it is not after every other version's in ``versions``:
    then when the change ships (or just after the last of them). A version retired for good
    is followed back only to versions retired strictly before it (``as_of``): retired at the
    instant another was (v2 rolled back to v1 at T, v1 now retired at T too), it took the
    operations begun before T from v2, and a fix keeping that instant was the change itself,
    failing the check again."""
    when = step.retired_at
    others = [
        _aware(s.retired_at)
        for s in versions.values()
        if s.name != step.name and s.retired_at is not None
    ]
    if when is None or not others or _aware(when) > max(others):
        return when
    return max(_ships(now), _plus(max(others), timedelta(seconds=1)))


def _declaration(step: Step, *, retire_at: datetime | None = None) -> str:
    """The proto text of ``step``, retired at ``retire_at`` when given."""
    what = f'call: "{step.call}"' if step.call else "outbox: true"
    when = retire_at if retire_at is not None else step.retired_at
    retired = f" retired_at: {_timestamp_text(when)}" if when else ""
    return f'steps: {{ name: "{step.name}" {what}{retired} }}'


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _timestamp_text(moment: datetime) -> str:
    """``moment`` as a Timestamp in proto text, to the microsecond it was read with: printed in
    whole seconds (``int(timestamp())``), a declared fraction was dropped, so a fix that said to
    keep a retired_at as it was moved it earlier (later before 1970), and failed the check."""
    since = _aware(moment) - _EPOCH
    seconds = since.days * 86400 + since.seconds  # floored, nanos >= 0: as Timestamp counts
    nanos = f" nanos: {since.microseconds * 1000}" if since.microseconds else ""
    return f"{{ seconds: {seconds}{nanos} }}"


def _ts(t: datetime | None) -> str:
    if t is None:
        return "-"
    try:
        t = _aware(t).astimezone(UTC)
    except OverflowError:  # a saturated date with an offset, at the calendar's end
        t = _aware(t).replace(tzinfo=UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _span(d: timedelta) -> str:
    """A compact duration: "1d", "1d12h", "30m", "1m30s"."""
    total = int(d.total_seconds())
    if total <= 0:
        return "0s" if total == 0 else "-" + _span(-d)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, total = divmod(total, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
