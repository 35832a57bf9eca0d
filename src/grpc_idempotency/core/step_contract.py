"""Step names as a contract: what changed between two versions of the declared steps, and
whether the change can re-execute work that is already in flight.

A child key is derived from the parent's scoped key and the *step name* (``keys.child_key``), not
from the method or the target. So, for an operation that already ran a step and is re-run later
(a retry after a transient failure, a takeover after a crash), the name is what makes the
downstream service recognise the effect as already done:

- a step that is renamed, removed, or whose version changes gives its effect a new child key: the
  downstream service sees a new operation and executes the effect again;
- a step whose ``call`` target changes under the same name reuses a child key for a *different*
  effect: the new target may replay nothing, or recognise a key it never issued;
- a keyed method that disappears while it still declares steps drops the declaration that its
  in-flight operations (up to its retention's worth) depend on.

A deliberate change is made by keeping the old step declared with ``retired_at`` set: operations
begun before ``retired_at`` keep the old step's child key on every attempt, operations begun
after it use the replacement (``propagation.as_of``), and the retired step may be removed once
``retired_at + retention`` has passed, when no operation that could have used it is replayable
any more.

The replacement is found from the declaration alone: a newer version of the same name, or, for a
retired step whose name has no active version left (a rename), the only active step on the same
target. That second rule must never guess, so this check refuses the declarations on which it
would: a rename onto a target that several active steps call (which one took the effect over?),
a step retired next to a step that was already there (it would be read as renamed to it), and a
step added next to a rename still within its retention (the rename would stop being followed).

Pure: plain data in (method path -> retention and steps, and the current time), findings out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from grpc_idempotency.core.policy import Step, normalize_method


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
    METHOD_REMOVED = "keyed method removed"
    RENAME_ONTO_SHARED_TARGET = "step renamed onto a target other steps call"
    RETIREMENT_READ_AS_RENAME = "retired step would be read as renamed"
    RENAME_NO_LONGER_FOLLOWED = "renamed step no longer followed"
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
        Change.METHOD_REMOVED,
        Change.RENAME_ONTO_SHARED_TARGET,
        Change.RETIREMENT_READ_AS_RENAME,
        Change.RENAME_NO_LONGER_FOLLOWED,
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
    return None if step.retired_at is None else _aware(step.retired_at) + retention


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _live(step: Step, retention: timedelta, now: datetime) -> bool:
    """Still part of the contract: active, or retired less than ``retention`` ago."""
    until = removable_from(step, retention)
    return until is None or now < until


def _by_name(steps: tuple[Step, ...]) -> dict[str, Step]:
    named: dict[str, Step] = {}
    for s in steps:
        named.setdefault(s.name, s)  # a duplicate is the linter's business; the first one counts
    return named


def _base(name: str) -> str:
    """The name without its version: "charge-card.v2" -> "charge-card"."""
    head, sep, version = name.rpartition(".v")
    return head if sep and version.isdigit() else name


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
    # Active steps that appeared, to pair with active steps that vanished (renames, new versions).
    unpaired = [s for name, s in new.items() if name not in old and s.active]
    paired: set[str] = set()

    for name, was in old.items():
        if name in new:
            findings.extend(_compare_step(path, was, new[name], retention, now))
        elif not was.active:
            findings.append(_retired_step_removed(path, was, retention, now))
        else:
            finding = _active_step_gone(path, was, unpaired, before, after, retention, now)
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
    findings.extend(_renames_followed(path, before, after, retention, now))
    return findings


@dataclass(frozen=True, slots=True)
class _Gone:
    finding: Finding
    step_after: str | None


def _active_step_gone(
    path: str,
    was: Step,
    unpaired: list[Step],
    before: MethodSteps,
    after: MethodSteps,
    retention: timedelta,
    now: datetime,
) -> _Gone:
    """An active step is no longer declared: a new version, a rename, or a removal."""
    name = was.name
    change = Change.STEP_VERSION_CHANGED
    successor = _pick(unpaired, lambda s: _base(s.name) == _base(name))
    if successor is None:
        change = Change.STEP_RENAMED
        successor = _pick(unpaired, lambda s: _target(s) == _target(was))
    if successor is None:
        what = f"step {name} ({_effect(was)}) was removed"
        change = Change.STEP_REMOVED
        runs = "the effect again, under any new step's child key,"
    else:
        verb = "changed version to" if change is Change.STEP_VERSION_CHANGED else "was renamed to"
        what = (
            f"step {name} ({_effect(was)}) {verb} {successor.name} ({_effect(successor)})"
            " without retiring the old name"
        )
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
        fix=_retire_fix(was, before, after, retention, now),
    )
    return _Gone(finding, successor.name if successor is not None else None)


def _retire_fix(
    was: Step, before: MethodSteps, after: MethodSteps, retention: timedelta, now: datetime
) -> str:
    """How to stop using the active step ``was`` (absent from ``after``) safely: declare it
    again, retired now, unless the runtime would then misread it (see the module's docstring)."""
    retire = (
        f"declare the old step again, retired: {_declaration(was, retire_at=now)}; it can be"
        f" deleted from {_ts(now + retention)} (retired_at + {_span(retention)})"
    )
    if _base(was.name) in _live_bases(was, after.steps):
        return retire  # a new version of the same name follows it
    peers = [s for s in _peers(was, after.steps) if s.active]
    established = _active_bases(before.steps)
    fresh = [s.name for s in peers if _base(s.name) not in established]
    if len(peers) > 1 and fresh:
        return _bump_fix(was, fresh, now)
    if len(peers) == 1 and not fresh:
        return f"{retire}; and {_tie_fix(peers[0], now)}"
    return retire


def _bump_fix(was: Step, fresh: list[str], now: datetime) -> str:
    bumped = Step(
        name=f"{_base(was.name)}.v{_next_version(was.name)}", call=was.call, outbox=was.outbox
    )
    return (
        "a rename onto a target called by several steps cannot be followed: keep the old name"
        f" and bump its version instead, {_declaration(was, retire_at=now)}"
        f" {_declaration(bumped)}, in place of {fresh}"
        " (if those are effects of their own, add them in a change of their own)"
    )


def _tie_fix(sole: Step, when: datetime) -> str:
    bumped = Step(
        name=f"{_base(sole.name)}.v{_next_version(sole.name)}", call=sole.call, outbox=sole.outbox
    )
    return (
        f"since {sole.name} is then the only active step {_effect(sole)}, which would be read as"
        f" its new name, retire {sole.name} at the same instant for a new version of it:"
        f" {_declaration(sole, retire_at=when)} {_declaration(bumped)} (on a tie the same name"
        f" wins, so operations begun earlier keep {sole.name} and later ones use {bumped.name})"
    )


def _peers(step: Step, steps: tuple[Step, ...]) -> list[Step]:
    """The steps of ``steps`` with the same target as ``step`` (``step`` included, if there)."""
    return [s for s in steps if _target(s) == _target(step) and bool(s.call) == bool(step.call)]


def _live_bases(step: Step, steps: tuple[Step, ...]) -> set[str]:
    """The names (without version) that ``propagation.as_of`` counts as still active for
    ``step``: the method's active steps for a call step, its active outbox steps for an outbox
    step (as the client and the outbox look them up)."""
    return _active_bases(steps if step.call else tuple(s for s in steps if s.outbox))


def _active_bases(steps: tuple[Step, ...]) -> set[str]:
    return {_base(s.name) for s in steps if s.active}


def _followed(steps: tuple[Step, ...]) -> dict[str, str]:
    """The renames ``propagation.as_of`` follows: retired step name -> the only active step on
    its target, for retired steps whose name has no active version any more."""
    followed: dict[str, str] = {}
    for s in _by_name(steps).values():
        if s.active or _base(s.name) in _live_bases(s, steps):
            continue
        active = [p for p in _peers(s, steps) if p.active]
        if len(active) == 1:
            followed[s.name] = active[0].name
    return followed


def _renames_followed(
    path: str, before: MethodSteps, after: MethodSteps, retention: timedelta, now: datetime
) -> list[Finding]:
    """Retired steps of ``after`` that the runtime would take for renamed to the wrong step, or
    could not follow (see the module's docstring)."""
    was_followed, follows = _followed(before.steps), _followed(after.steps)
    established = _active_bases(before.steps)
    old = _by_name(before.steps)
    findings: list[Finding] = []
    for gone in _by_name(after.steps).values():
        if gone.active or not _live(gone, retention, now):
            continue  # past its retention, no operation that used it can be re-run
        if _base(gone.name) in _live_bases(gone, after.steps):
            continue  # a version bump: followed by name
        assert gone.retired_at is not None
        peers = [s for s in _peers(gone, after.steps) if s.active]
        earlier = was_followed.get(gone.name)
        until = _ts(removable_from(gone, retention))
        why_rerun = (
            f"an operation begun before {_ts(gone.retired_at)} (retention {_span(retention)})"
            f" that already ran {gone.name} and is retried, or taken over after a crash,"
        )
        sole = follows.get(gone.name)
        if sole is not None:
            if earlier is not None and _base(earlier) == _base(sole):
                continue  # the same rename as before (perhaps onto a newer version)
            if _base(sole) not in established:
                continue  # a rename onto a new name: what as_of follows
            tied = any(
                _base(s.name) == _base(sole)
                and s.retired_at is not None
                and _aware(s.retired_at) == _aware(gone.retired_at)
                for s in _peers(gone, after.steps)
            )
            if tied:
                continue  # retired together with a version of its neighbour: the name wins
            step = next(s for s in peers if s.name == sole)
            if gone.name not in old:
                fix = f"do not declare {gone.name}: no operation can have used it"
            elif old[gone.name].active:
                fix = _tie_fix(step, gone.retired_at)
            else:
                fix = (
                    f"remove {gone.name} first, once its retention has passed ({until}), then"
                    " make this change"
                )
            findings.append(
                Finding(
                    change=Change.RETIREMENT_READ_AS_RENAME,
                    method=path,
                    step=gone.name,
                    what=(
                        f"retired step {gone.name} ({_effect(gone)}) would be read as an earlier"
                        f" name of {sole}, which was already declared and is now the only active"
                        f" step that {_effect(step)}"
                    ),
                    why=(
                        "a retired step whose name has no active version is taken for renamed to"
                        f" the only active step on its target: {why_rerun} would key {sole}'s"
                        f" effect with {gone.name}'s child key, so the downstream service answers"
                        f" it with {gone.name}'s outcome (or refuses the key as reused) and"
                        f" {sole}'s effect is not done"
                    ),
                    fix=fix,
                )
            )
        elif len(peers) > 1:
            names = [s.name for s in peers]
            if earlier is not None:
                findings.append(
                    Finding(
                        change=Change.RENAME_NO_LONGER_FOLLOWED,
                        method=path,
                        step=gone.name,
                        what=(
                            f"retired step {gone.name}, renamed to {earlier}, can no longer be"
                            f" followed: {_target(gone)} now has several active steps {names}"
                        ),
                        why=(
                            f"{why_rerun} would use {earlier}'s child key instead of"
                            f" {gone.name}'s and run the effect a second time"
                        ),
                        fix=(
                            f"add the other steps on {_target(gone)} once {gone.name} can be"
                            f" removed ({until})"
                        ),
                    )
                )
                continue
            fresh = [s.name for s in peers if _base(s.name) not in established]
            # Only a step in use until now can have been renamed (one added retired never was).
            if gone.name in old and old[gone.name].active and fresh:
                findings.append(
                    Finding(
                        change=Change.RENAME_ONTO_SHARED_TARGET,
                        method=path,
                        step=gone.name,
                        what=(
                            f"step {gone.name} ({_effect(gone)}) retired while {fresh} started"
                            f" to call the same target, which several active steps {names} call"
                        ),
                        why=(
                            "a rename is followed only onto the only active step on its target;"
                            f" here it could be any of {names}, so {why_rerun} would run the"
                            " effect again under a new child key"
                        ),
                        fix=_bump_fix(gone, fresh, gone.retired_at),
                    )
                )
    return findings


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
    path: str, was: Step, step: Step, retention: timedelta, now: datetime
) -> list[Finding]:
    """The same name in both: a changed target, a retirement, a reinstatement."""
    name = step.name

    def found(change: Change, what: str, why: str = "", fix: str = "") -> list[Finding]:
        return [Finding(change=change, method=path, step=name, what=what, why=why, fix=fix)]

    if step.active and _target(was) != _target(step) and _live(was, retention, now):
        return found(
            Change.STEP_TARGET_CHANGED,
            f"step {name} changed target under the same name: it {_effect(was)}, now it"
            f" {_effect(step)}",
            why=(
                "the child key stays the same while the effect changes: an operation in flight"
                f" that already ran {name} against {_target(was)} sends the same child key to"
                f" {_target(step)}, which has no record of it and executes its effect; the"
                " reverse can replay an outcome that belongs to another effect"
            ),
            fix=(
                f"declare a new step (e.g. {_base(name)}.v{_next_version(name)}) for the new"
                f" target and keep the old one declared as retired,"
                f" {_declaration(was, retire_at=now)}"
            ),
        )
    if was.active and step.active:
        return []
    if step.active:
        return found(Change.STEP_REINSTATED, f"retired step {name} is active again")
    until = removable_from(step, retention)
    assert until is not None and step.retired_at is not None
    if was.active:
        retired = found(
            Change.STEP_RETIRED,
            f"step {name} retired at {_ts(step.retired_at)}; it can be removed from {_ts(until)}",
        )
        if until > now:
            return retired
        return retired + found(
            Change.RETIREMENT_BACKDATED,
            f"step {name} is retired in this change, but retired_at + retention"
            f" ({_span(retention)}) is already past, so the next change could delete it at once;"
            f" set retired_at to when this change ships, e.g. {_declaration(was, retire_at=now)}",
        )
    assert was.retired_at is not None
    notes: list[Finding] = []
    if _aware(step.retired_at) < _aware(was.retired_at):
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


def _pick(candidates: list[Step], match: Callable[[Step], bool]) -> Step | None:
    for i, s in enumerate(candidates):
        if match(s):
            return candidates.pop(i)
    return None


def _next_version(name: str) -> int:
    _, sep, version = name.rpartition(".v")
    return int(version) + 1 if sep and version.isdigit() else 2


def _declaration(step: Step, *, retire_at: datetime | None = None) -> str:
    """The proto text of ``step``, retired at ``retire_at`` when given."""
    what = f'call: "{step.call}"' if step.call else "outbox: true"
    when = retire_at if retire_at is not None else step.retired_at
    retired = f" retired_at: {{ seconds: {int(_aware(when).timestamp())} }}" if when else ""
    return f'steps: {{ name: "{step.name}" {what}{retired} }}'


def _ts(t: datetime | None) -> str:
    if t is None:
        return "-"
    return _aware(t).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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
