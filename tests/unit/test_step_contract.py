"""The step contract: which changes of declared steps can re-execute in-flight work."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.step_contract import (
    Change,
    Contract,
    MethodSteps,
    check_contract,
    removable_from,
)

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)
HOUR = timedelta(hours=1)
PLACE = "/shop.v1.Orders/Place"
CANCEL = "/shop.v1.Orders/Cancel"
CHARGE = "pay.v1.Payments/Charge"
EMAIL = "mail.v1.Mailer/Send"


def call(name: str, target: str = CHARGE, retired: datetime | None = None) -> Step:
    return Step(name=name, call=target, retired_at=retired)


def outbox(name: str, retired: datetime | None = None) -> Step:
    return Step(name=name, outbox=True, retired_at=retired)


def place(*steps: Step, retention: timedelta = DAY) -> dict[str, MethodSteps]:
    return {PLACE: MethodSteps(retention=retention, steps=steps)}


def changes(old: Contract, new: Contract, now: datetime = NOW) -> list[tuple[Change, str | None]]:
    return [(f.change, f.step) for f in check_contract(old, new, now=now).findings]


# (id, old, new, expected (change, step) findings in order, contract holds?)
CASES: list[tuple[str, Contract, Contract, list[tuple[Change, str | None]], bool]] = [
    ("unchanged", place(call("charge.v1")), place(call("charge.v1")), [], True),
    (
        "step added",
        place(call("charge.v1")),
        place(call("charge.v1"), call("email.v1", EMAIL)),
        [(Change.STEP_ADDED, "email.v1")],
        True,
    ),
    (
        "step removed",
        place(call("charge.v1"), call("email.v1", EMAIL)),
        place(call("charge.v1")),
        [(Change.STEP_REMOVED, "email.v1")],
        False,
    ),
    (
        "step renamed (same target)",
        place(call("charge.v1")),
        place(call("take-payment.v1")),
        [(Change.STEP_RENAMED, "charge.v1")],
        False,
    ),
    (
        "outbox step renamed",
        place(outbox("order-created.v1")),
        place(outbox("order-placed.v1")),
        [(Change.STEP_RENAMED, "order-created.v1")],
        False,
    ),
    (
        "version bump without retirement",
        place(call("charge.v1")),
        place(call("charge.v2")),
        [(Change.STEP_VERSION_CHANGED, "charge.v1")],
        False,
    ),
    (
        "version bump and new target",
        place(call("charge.v1")),
        place(call("charge.v2", "pay.v2.Payments/Charge")),
        [(Change.STEP_VERSION_CHANGED, "charge.v1")],
        False,
    ),
    (
        "version bump with the old version retired",
        place(call("charge.v1")),
        place(call("charge.v1", retired=NOW), call("charge.v2")),
        [(Change.STEP_RETIRED, "charge.v1"), (Change.STEP_ADDED, "charge.v2")],
        True,
    ),
    (
        "step retired, no successor",
        place(call("charge.v1"), call("email.v1", EMAIL)),
        place(call("charge.v1"), call("email.v1", EMAIL, retired=NOW - HOUR)),
        [(Change.STEP_RETIRED, "email.v1")],
        True,
    ),
    (
        "retired step removed too early",
        place(call("charge.v1", retired=NOW - 23 * HOUR), call("charge.v2")),
        place(call("charge.v2")),
        [(Change.RETIRED_STEP_REMOVED_EARLY, "charge.v1")],
        False,
    ),
    (
        "retired step removed one second too early",
        place(call("charge.v1", retired=NOW - DAY + timedelta(seconds=1))),
        place(),
        [(Change.RETIRED_STEP_REMOVED_EARLY, "charge.v1")],
        False,
    ),
    (
        "retired step removed exactly when its retention ends",
        place(call("charge.v1", retired=NOW - DAY), call("charge.v2")),
        place(call("charge.v2")),
        [(Change.RETIRED_STEP_REMOVED, "charge.v1")],
        True,
    ),
    (
        "the longer of the two retentions applies",
        place(call("charge.v1", retired=NOW - 36 * HOUR), retention=DAY),
        place(retention=2 * DAY),
        [(Change.RETIRED_STEP_REMOVED_EARLY, "charge.v1")],
        False,
    ),
    (
        "call target changed under the same name",
        place(call("charge.v1")),
        place(call("charge.v1", "pay.v2.Payments/Charge")),
        [(Change.STEP_TARGET_CHANGED, "charge.v1")],
        False,
    ),
    (
        "call step became an outbox step",
        place(call("email.v1", EMAIL)),
        place(outbox("email.v1")),
        [(Change.STEP_TARGET_CHANGED, "email.v1")],
        False,
    ),
    (
        "a leading slash is not a new target",
        place(call("charge.v1", CHARGE)),
        place(call("charge.v1", "/" + CHARGE)),
        [],
        True,
    ),
    (
        "a retired step's target does not matter",
        place(call("charge.v1", retired=NOW - HOUR)),
        place(call("charge.v1", "x.v1.Other/Do", retired=NOW - HOUR)),
        [],
        True,
    ),
    (
        "retired step still declared past its window",
        place(call("charge.v1", retired=NOW - 2 * DAY)),
        place(call("charge.v1", retired=NOW - 2 * DAY)),
        [(Change.RETIRED_STEP_REMOVABLE, "charge.v1")],
        True,
    ),
    (
        "retired step reinstated",
        place(call("charge.v1", retired=NOW - HOUR)),
        place(call("charge.v1")),
        [(Change.STEP_REINSTATED, "charge.v1")],
        True,
    ),
    (
        "reinstated within its window with another target",
        place(call("charge.v1", retired=NOW - HOUR)),
        place(call("charge.v1", "pay.v2.Payments/Charge")),
        [(Change.STEP_TARGET_CHANGED, "charge.v1")],
        False,
    ),
    (
        "retirement backdated past the window (noted, not failed)",
        place(call("charge.v1")),
        place(call("charge.v1", retired=NOW - 3 * DAY)),
        [(Change.STEP_RETIRED, "charge.v1"), (Change.RETIREMENT_BACKDATED, "charge.v1")],
        True,
    ),
    (
        "retired_at moved earlier",
        place(call("charge.v1", retired=NOW - HOUR)),
        place(call("charge.v1", retired=NOW - 2 * HOUR)),
        [(Change.RETIREMENT_BACKDATED, "charge.v1")],
        True,
    ),
    (
        "step added already retired does not pair with a removed one",
        place(call("charge.v1")),
        place(call("charge.v2", retired=NOW)),
        [(Change.STEP_REMOVED, "charge.v1"), (Change.STEP_ADDED, "charge.v2")],
        False,
    ),
    (
        "a version bump pairs before a same-target rename",
        place(call("charge.v1"), call("refund.v1")),
        place(call("refund.v2"), call("charge.v2")),
        [(Change.STEP_VERSION_CHANGED, "charge.v1"), (Change.STEP_VERSION_CHANGED, "refund.v1")],
        False,
    ),
    (
        "rename with the old name retired, alone on its target",
        place(call("charge.v1"), call("email.v1", EMAIL)),
        place(call("charge.v1", retired=NOW), call("take-payment.v1"), call("email.v1", EMAIL)),
        [(Change.STEP_RETIRED, "charge.v1"), (Change.STEP_ADDED, "take-payment.v1")],
        True,
    ),
    (
        "rename with the old name retired, onto a target other steps call",
        place(call("charge.v1"), call("refund.v1")),
        place(call("charge.v1", retired=NOW), call("refund.v1"), call("take-payment.v1")),
        [
            (Change.STEP_RETIRED, "charge.v1"),
            (Change.STEP_ADDED, "take-payment.v1"),
            (Change.RENAME_ONTO_SHARED_TARGET, "charge.v1"),
        ],
        False,
    ),
    (
        "a rename, then a new version of the new name",
        place(call("charge.v1", retired=NOW - HOUR), call("take-payment.v1")),
        place(
            call("charge.v1", retired=NOW - HOUR),
            call("take-payment.v1", retired=NOW),
            call("take-payment.v2"),
        ),
        [(Change.STEP_RETIRED, "take-payment.v1"), (Change.STEP_ADDED, "take-payment.v2")],
        True,
    ),
    (
        "step retired next to one that stays alone on the target",
        place(call("charge.v1"), call("refund.v1")),
        place(call("charge.v1"), call("refund.v1", retired=NOW)),
        [(Change.STEP_RETIRED, "refund.v1"), (Change.RETIREMENT_READ_AS_RENAME, "refund.v1")],
        False,
    ),
    (
        "the same, with the neighbour given a new version at the same instant",
        place(call("charge.v1"), call("refund.v1")),
        place(call("charge.v1", retired=NOW), call("charge.v2"), call("refund.v1", retired=NOW)),
        [
            (Change.STEP_RETIRED, "charge.v1"),
            (Change.STEP_RETIRED, "refund.v1"),
            (Change.STEP_ADDED, "charge.v2"),
        ],
        True,
    ),
    (
        "step retired next to several that stay",
        place(call("charge.v1"), call("refund.v1"), call("hold.v1")),
        place(call("charge.v1"), call("refund.v1", retired=NOW), call("hold.v1")),
        [(Change.STEP_RETIRED, "refund.v1")],
        True,
    ),
    (
        "a step added next to a rename still within its retention",
        place(call("charge.v1", retired=NOW - HOUR), call("take-payment.v1")),
        place(call("charge.v1", retired=NOW - HOUR), call("take-payment.v1"), call("hold.v1")),
        [(Change.STEP_ADDED, "hold.v1"), (Change.RENAME_NO_LONGER_FOLLOWED, "charge.v1")],
        False,
    ),
    (
        "a step added next to a rename past its retention",
        place(call("charge.v1", retired=NOW - 2 * DAY), call("take-payment.v1")),
        place(call("charge.v1", retired=NOW - 2 * DAY), call("take-payment.v1"), call("hold.v1")),
        [(Change.RETIRED_STEP_REMOVABLE, "charge.v1"), (Change.STEP_ADDED, "hold.v1")],
        True,
    ),
    (
        "keyed method added",
        {},
        place(call("charge.v1")),
        [(Change.METHOD_ADDED, None)],
        True,
    ),
    (
        "keyed method removed with active steps",
        place(call("charge.v1")),
        {},
        [(Change.METHOD_REMOVED, None)],
        False,
    ),
    (
        "keyed method removed with a step retired within the retention",
        place(call("charge.v1", retired=NOW - HOUR)),
        {},
        [(Change.METHOD_REMOVED, None)],
        False,
    ),
    (
        "keyed method removed after its steps' retirement windows",
        place(call("charge.v1", retired=NOW - 2 * DAY)),
        {},
        [(Change.METHOD_REMOVED_SAFELY, None)],
        True,
    ),
    (
        "keyed method without steps removed",
        place(),
        {},
        [(Change.METHOD_REMOVED_SAFELY, None)],
        True,
    ),
    (
        "methods are reported in path order",
        {
            PLACE: MethodSteps(retention=DAY, steps=(call("a.v1"),)),
            CANCEL: MethodSteps(retention=DAY),
        },
        {
            PLACE: MethodSteps(retention=DAY),
            CANCEL: MethodSteps(retention=DAY, steps=(call("b.v1"),)),
        },
        [(Change.STEP_ADDED, "b.v1"), (Change.STEP_REMOVED, "a.v1")],
        False,
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "expected", "ok"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_contract(
    old: Contract, new: Contract, expected: list[tuple[Change, str | None]], ok: bool
) -> None:
    report = check_contract(old, new, now=NOW)
    assert [(f.change, f.step) for f in report.findings] == expected
    assert report.ok is ok
    for f in report.findings:
        assert f.breaking is f.change.breaking
        assert bool(f.why) is f.breaking and bool(f.fix) is f.breaking, f
        assert f.what


def test_a_rename_explains_itself() -> None:
    (f,) = check_contract(
        place(call("charge.v1")), place(call("take-payment.v1")), now=NOW
    ).findings
    assert f.method == PLACE
    assert "charge.v1" in f.what and "take-payment.v1" in f.what and CHARGE in f.what
    assert "new child key" in f.why and "1d" in f.why
    # The fix is the line to paste back: the old step, retired now.
    seconds = int(NOW.timestamp())
    assert (
        f'steps: {{ name: "charge.v1" call: "{CHARGE}" retired_at: {{ seconds: {seconds} }} }}'
        in f.fix
    )
    assert "2026-06-02T12:00:00Z" in f.fix


def test_the_fix_printed_for_a_change_passes_the_check() -> None:
    """What check-steps prints as the fix is a declaration that passes check-steps, and that
    propagation.as_of follows (tests/unit/test_propagation.py)."""
    seconds = int(NOW.timestamp())

    # A rename onto a target no other step calls: keep the old name, retired.
    (f,) = check_contract(
        place(call("charge.v1")), place(call("take-payment.v1")), now=NOW
    ).breaking
    assert f.change is Change.STEP_RENAMED
    assert (
        f'steps: {{ name: "charge.v1" call: "{CHARGE}" retired_at: {{ seconds: {seconds} }} }}'
        in f.fix
    )
    assert "bump" not in f.fix
    fixed = place(call("charge.v1", retired=NOW), call("take-payment.v1"))
    assert check_contract(place(call("charge.v1")), fixed, now=NOW).ok

    # A rename onto a target other steps call: keep the old name, with a new version.
    old = place(call("charge.v1"), call("refund.v1"))
    (f,) = check_contract(old, place(call("take-payment.v1"), call("refund.v1")), now=NOW).breaking
    assert f.change is Change.STEP_RENAMED
    assert "rename onto a target called by several steps" in f.fix
    assert "keep the old name and bump its version instead" in f.fix
    assert 'steps: { name: "charge.v2"' in f.fix
    fixed = place(call("charge.v1", retired=NOW), call("charge.v2"), call("refund.v1"))
    assert check_contract(old, fixed, now=NOW).ok

    # A step removed next to one that stays alone on the target: retire both at once, the
    # one staying for a new version of itself.
    (f,) = check_contract(old, place(call("charge.v1")), now=NOW).breaking
    assert f.change is Change.STEP_REMOVED
    assert (
        f'steps: {{ name: "refund.v1" call: "{CHARGE}" retired_at: {{ seconds: {seconds} }} }}'
        in f.fix
    )
    assert (
        f'steps: {{ name: "charge.v1" call: "{CHARGE}" retired_at: {{ seconds: {seconds} }} }}'
        in f.fix
    )
    assert 'steps: { name: "charge.v2"' in f.fix
    fixed = place(call("charge.v1", retired=NOW), call("charge.v2"), call("refund.v1", retired=NOW))
    assert check_contract(old, fixed, now=NOW).ok

    # Retiring it alone is what the runtime would misread.
    (f,) = check_contract(
        old, place(call("charge.v1"), call("refund.v1", retired=NOW)), now=NOW
    ).breaking
    assert f.change is Change.RETIREMENT_READ_AS_RENAME
    assert "charge.v1" in f.what and 'steps: { name: "charge.v2"' in f.fix


def test_an_early_removal_says_when_it_becomes_allowed() -> None:
    old = place(call("charge.v1", retired=NOW - 20 * HOUR), retention=DAY)
    (f,) = check_contract(old, place(), now=NOW).findings
    assert f.change is Change.RETIRED_STEP_REMOVED_EARLY
    assert "2026-06-01T16:00:00Z" in f.what and "4h from now" in f.what


def test_now_must_be_aware() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        check_contract({}, {}, now=datetime(2026, 1, 1))


def test_naive_retired_at_is_read_as_utc() -> None:
    step = call("charge.v1", retired=datetime(2026, 6, 1, 0, 0))
    assert removable_from(step, DAY) == datetime(2026, 6, 2, tzinfo=UTC)
    assert removable_from(call("charge.v1"), DAY) is None


# Properties, over generated contracts.

names = st.from_regex(r"[a-z][a-z0-9-]{0,6}\.v[1-9]", fullmatch=True)
targets = st.sampled_from([CHARGE, EMAIL, "inv.v1.Stock/Reserve", None])
retentions = st.integers(min_value=1, max_value=30 * 86400).map(lambda s: timedelta(seconds=s))
offsets = st.integers(min_value=-60 * 86400, max_value=60 * 86400).map(
    lambda s: timedelta(seconds=s)
)


@st.composite
def steps(draw: st.DrawFn, *, retired: bool | None = None) -> Step:
    target = draw(targets)
    when = None
    if retired or (retired is None and draw(st.booleans())):
        when = NOW + draw(offsets)
    return Step(name=draw(names), call=target, outbox=target is None, retired_at=when)


def method_steps(
    *, retired: bool | None = None, min_size: int = 0
) -> st.SearchStrategy[MethodSteps]:
    return st.builds(
        MethodSteps,
        retention=retentions,
        steps=st.lists(
            steps(retired=retired), min_size=min_size, max_size=6, unique_by=lambda s: s.name
        ).map(tuple),
    )


paths = st.sampled_from([PLACE, CANCEL, "/shop.v1.Orders/Refund"])
contracts = st.dictionaries(paths, method_steps(), max_size=3)


@given(contracts, offsets)
def test_an_unchanged_contract_always_holds(contract: Contract, shift: timedelta) -> None:
    report = check_contract(contract, contract, now=NOW + shift)
    assert report.ok
    assert {f.change for f in report.findings} <= {Change.RETIRED_STEP_REMOVABLE}


# What the runtime's reading of renames (propagation.as_of) can make of an added or retired step.
RENAME_READING = {Change.RETIREMENT_READ_AS_RENAME, Change.RENAME_NO_LONGER_FOLLOWED}


@given(method_steps(), st.lists(steps(), max_size=4, unique_by=lambda s: s.name))
def test_adding_steps_never_breaks(before: MethodSteps, added: list[Step]) -> None:
    """Except where a step added next to a retired one changes how that one is read."""
    taken = {s.name for s in before.steps}
    fresh = tuple(s for s in added if s.name not in taken)
    after = replace(before, steps=before.steps + fresh)
    report = check_contract({PLACE: before}, {PLACE: after}, now=NOW)
    assert {f.change for f in report.breaking} <= RENAME_READING
    assert {f.step for f in report.findings if f.change is Change.STEP_ADDED} == {
        s.name for s in fresh
    }


@given(method_steps(retired=False, min_size=1), st.data())
def test_dropping_an_active_step_always_breaks(before: MethodSteps, data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(before.steps))
    replacement = data.draw(st.lists(steps(), max_size=2, unique_by=lambda s: s.name))
    kept = tuple(s for s in before.steps if s is not gone)
    fresh = tuple(s for s in replacement if s.name not in {k.name for k in before.steps})
    report = check_contract({PLACE: before}, {PLACE: replace(before, steps=kept + fresh)}, now=NOW)
    (f,) = [f for f in report.breaking if f.change not in RENAME_READING]
    assert f.step == gone.name
    assert f.change in (Change.STEP_REMOVED, Change.STEP_RENAMED, Change.STEP_VERSION_CHANGED)


@given(method_steps(retired=False), st.data())
def test_retiring_steps_at_any_later_time_never_breaks(
    before: MethodSteps, data: st.DataObject
) -> None:
    retire = data.draw(st.sets(st.sampled_from([s.name for s in before.steps or (call("x.v1"),)])))
    retire &= {s.name for s in before.steps}
    late = data.draw(st.integers(min_value=0, max_value=86400).map(lambda s: timedelta(seconds=s)))
    after = replace(
        before,
        steps=tuple(
            replace(s, retired_at=NOW + late) if s.name in retire else s for s in before.steps
        ),
    )
    report = check_contract({PLACE: before}, {PLACE: after}, now=NOW)
    # Except a step retired next to one that stays alone on its target: it would be read as
    # renamed to it.
    for f in report.breaking:
        assert f.change is Change.RETIREMENT_READ_AS_RENAME and f.step in retire, f
    assert {f.step for f in report.findings if f.change is Change.STEP_RETIRED} == retire


@given(steps(retired=True), retentions, offsets)
def test_a_retired_step_may_go_exactly_when_its_retention_has_passed(
    step: Step, retention: timedelta, shift: timedelta
) -> None:
    now = NOW + shift
    before = {PLACE: MethodSteps(retention=retention, steps=(step,))}
    report = check_contract(before, {PLACE: MethodSteps(retention=retention)}, now=now)
    assert step.retired_at is not None
    assert report.ok is (now >= step.retired_at + retention)
    (f,) = report.findings
    assert f.change is (
        Change.RETIRED_STEP_REMOVED if report.ok else Change.RETIRED_STEP_REMOVED_EARLY
    )


@given(contracts, contracts, offsets)
def test_every_breaking_finding_explains_itself(
    old: Contract, new: Contract, shift: timedelta
) -> None:
    report = check_contract(old, new, now=NOW + shift)
    assert report.ok is (not report.breaking)
    for f in report.findings:
        assert f.method in old or f.method in new
        assert f.what and (bool(f.why) and bool(f.fix)) is f.breaking
    # Deterministic, and ordered by method path.
    assert check_contract(old, new, now=NOW + shift) == report
    methods = [f.method for f in report.findings]
    assert methods == sorted(methods)
