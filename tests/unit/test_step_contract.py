"""The step contract: which changes of declared steps can re-execute in-flight work."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core.errors import StepUndeclared
from grpc_idempotency.core.keys import step_base
from grpc_idempotency.core.outbox import outbox_step
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.propagation import Parent, choose_step
from grpc_idempotency.core.step_contract import (
    Change,
    Contract,
    MethodSteps,
    Report,
    check_contract,
    removable_from,
)

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)
HOUR = timedelta(hours=1)
SECOND = timedelta(seconds=1)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
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


def base(name: str) -> str:
    return name.rpartition(".v")[0]


def _same_target(a: Step, b: Step) -> bool:
    return (a.call or "outbox").lstrip("/") == (b.call or "outbox").lstrip("/")


DECLARATION = re.compile(
    r'steps: \{ name: "([^"]+)" (?:call: "([^"]+)"|outbox: true)'
    r"(?: retired_at: \{ seconds: (-?\d+)(?: nanos: (\d+))? \})? \}"
)


def apply_fixes(after: MethodSteps, report: Report) -> MethodSteps:
    """``after`` with the fix of every breaking finding applied, as a user would: each step
    declaration the fix prints is declared (replacing one of the same name), and the step it
    says the declarations stand "in place of" is deleted."""
    declared = {s.name: s for s in after.steps}
    for f in report.breaking:
        assert f.change in FIXABLE, f
        printed = DECLARATION.findall(f.fix)
        assert printed, f.fix
        for name, target, seconds, nanos in printed:
            declared[name] = Step(
                name=name,
                call=target or None,
                outbox=not target,
                retired_at=EPOCH
                + timedelta(seconds=int(seconds), microseconds=int(nanos or 0) // 1000)
                if seconds
                else None,
            )
        instead = re.search(r"in place of ([^\s;,]+)", f.fix)
        if instead:
            declared.pop(instead.group(1))
        for gone in re.findall(r"delete ([^\s;,]+)", f.fix):
            declared.pop(gone, None)
    return replace(after, steps=tuple(declared.values()))


FIXABLE = {
    Change.STEP_REMOVED,
    Change.STEP_RENAMED,
    Change.STEP_VERSION_CHANGED,
    Change.RETIRED_STEP_REMOVED_EARLY,
    Change.RETIREMENT_POSTPONED_AFTER_THE_FACT,
    Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS,
    Change.OPERATIONS_REKEYED,
}


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
        place(call("charge.v1"), call("email.v1", EMAIL, retired=NOW)),
        [(Change.STEP_RETIRED, "email.v1")],
        True,
    ),
    # Operations begun in the last hour ran email.v1; their retries are refused it, and an
    # email.v2 added in a later change would key them with its child key (the email sent
    # twice) where that change's check cannot tell them from operations that never ran v1.
    (
        "step retired for good in the past",
        place(call("charge.v1"), call("email.v1", EMAIL)),
        place(call("charge.v1"), call("email.v1", EMAIL, retired=NOW - HOUR)),
        [
            (Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS, "email.v1"),
            (Change.STEP_RETIRED, "email.v1"),
        ],
        False,
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
        "the longer of the two retentions applies when it shrinks too",
        place(call("charge.v1", retired=NOW - 36 * HOUR), retention=2 * DAY),
        place(retention=DAY),
        [(Change.RETIRED_STEP_REMOVED_EARLY, "charge.v1")],
        False,
    ),
    (
        "keyed method removed exactly when its retired step's retention ends",
        place(call("charge.v1", retired=NOW - DAY)),
        {},
        [(Change.METHOD_REMOVED_SAFELY, None)],
        True,
    ),
    (
        "a retired step is removable exactly when its retention ends",
        place(call("charge.v1", retired=NOW - DAY), call("charge.v2")),
        place(call("charge.v1", retired=NOW - DAY), call("charge.v2")),
        [(Change.RETIRED_STEP_REMOVABLE, "charge.v1")],
        True,
    ),
    # No retired_at falls in the window: only the window's start shows these (and no named
    # call does, for the outbox).
    (
        "an outbox version declared retired ahead of the active one",
        place(outbox("event.v2")),
        place(outbox("event.v2"), outbox("event.v3", retired=NOW + DAY)),
        [(Change.STEP_ADDED, "event.v3"), (Change.OPERATIONS_REKEYED, "event.v2")],
        False,
    ),
    (
        "an outbox rollback with the retirement still ahead",
        place(outbox("event.v1", retired=NOW + DAY), outbox("event.v2")),
        place(outbox("event.v1"), outbox("event.v2", retired=NOW + DAY)),
        [
            (Change.STEP_REINSTATED, "event.v1"),
            (Change.STEP_RETIRED, "event.v2"),
            (Change.OPERATIONS_REKEYED, "event.v1"),
        ],
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
        "a retired step's target does not matter past its window",
        place(call("charge.v1", retired=NOW - 2 * DAY)),
        place(call("charge.v1", "x.v1.Other/Do", retired=NOW - 2 * DAY)),
        [(Change.RETIRED_STEP_REMOVABLE, "charge.v1")],
        True,
    ),
    (
        "a retired step's target changed within its window",
        place(call("charge.v1", retired=NOW - HOUR), call("charge.v2")),
        place(call("charge.v1", "x.v1.Other/Do", retired=NOW - HOUR), call("charge.v2")),
        [(Change.STEP_TARGET_CHANGED, "charge.v1")],
        False,
    ),
    (
        "a step retired and retargeted in one change",
        place(call("charge.v1")),
        place(call("charge.v1", "x.v1.Other/Do", retired=NOW), call("charge.v2")),
        [
            (Change.STEP_TARGET_CHANGED, "charge.v1"),
            (Change.STEP_RETIRED, "charge.v1"),
            (Change.STEP_ADDED, "charge.v2"),
        ],
        False,
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
        "retirement backdated past the window",
        place(call("charge.v1")),
        place(call("charge.v1", retired=NOW - 3 * DAY)),
        [
            (Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS, "charge.v1"),
            (Change.STEP_RETIRED, "charge.v1"),
            (Change.RETIREMENT_BACKDATED, "charge.v1"),
        ],
        False,
    ),
    (
        "retired_at moved later after it had passed",
        place(call("charge.v1", retired=NOW - 2 * HOUR), call("charge.v2")),
        place(call("charge.v1", retired=NOW + HOUR), call("charge.v2")),
        [(Change.RETIREMENT_POSTPONED_AFTER_THE_FACT, "charge.v1")],
        False,
    ),
    (
        "retired_at moved later but still past, after it had passed",
        place(call("charge.v1", retired=NOW - 2 * HOUR), call("charge.v2")),
        place(call("charge.v1", retired=NOW - HOUR), call("charge.v2")),
        [(Change.RETIREMENT_POSTPONED_AFTER_THE_FACT, "charge.v1")],
        False,
    ),
    (
        "retired_at moved later before it takes effect",
        place(call("charge.v1", retired=NOW + HOUR), call("charge.v2")),
        place(call("charge.v1", retired=NOW + 2 * HOUR), call("charge.v2")),
        [],
        True,
    ),
    (
        "retired_at moved later with no version following the step",
        place(call("charge.v1", retired=NOW - 2 * HOUR), call("refund.v1")),
        place(call("charge.v1", retired=NOW + HOUR), call("refund.v1")),
        [],
        True,
    ),
    (
        "retired_at moved later within what retention has already let go",
        place(call("charge.v1", retired=NOW - 3 * DAY), call("charge.v2")),
        place(call("charge.v1", retired=NOW - 2 * DAY), call("charge.v2")),
        [(Change.RETIRED_STEP_REMOVABLE, "charge.v1")],
        True,
    ),
    (
        "retired_at moved earlier",
        place(call("charge.v1", retired=NOW - HOUR)),
        place(call("charge.v1", retired=NOW - 2 * HOUR)),
        [
            (Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS, "charge.v1"),
            (Change.RETIREMENT_BACKDATED, "charge.v1"),
        ],
        False,
    ),
    (
        "a future retired_at moved earlier, still ahead",
        place(call("charge.v1", retired=NOW + 2 * HOUR)),
        place(call("charge.v1", retired=NOW + HOUR)),
        [(Change.RETIREMENT_BACKDATED, "charge.v1")],
        True,
    ),
    # Operations begun between the new retired_at and the old one (or now) ran charge.v1 with
    # its child key; this change keys their retries with charge.v2's, and the effect runs again.
    (
        "retired_at moved earlier with a version following the step",
        place(call("charge.v1", retired=NOW - HOUR), call("charge.v2")),
        place(call("charge.v1", retired=NOW - 2 * HOUR), call("charge.v2")),
        [
            (Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS, "charge.v1"),
            (Change.RETIREMENT_BACKDATED, "charge.v1"),
        ],
        False,
    ),
    (
        "version bumped with the old version retired in the past",
        place(call("charge.v1")),
        place(call("charge.v1", retired=NOW - HOUR), call("charge.v2")),
        [
            (Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS, "charge.v1"),
            (Change.STEP_RETIRED, "charge.v1"),
            (Change.STEP_ADDED, "charge.v2"),
        ],
        False,
    ),
    (
        "version bumped with the old version retired from now",
        place(call("charge.v1")),
        place(call("charge.v1", retired=NOW), call("charge.v2")),
        [(Change.STEP_RETIRED, "charge.v1"), (Change.STEP_ADDED, "charge.v2")],
        True,
    ),
    (
        "retired_at moved earlier where retention has let every operation go",
        place(call("charge.v1", retired=NOW - 3 * DAY), call("charge.v2")),
        place(call("charge.v1", retired=NOW - 4 * DAY), call("charge.v2")),
        [(Change.RETIREMENT_BACKDATED, "charge.v1"), (Change.RETIRED_STEP_REMOVABLE, "charge.v1")],
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
        "rename with the old name retired",
        place(call("charge.v1"), call("email.v1", EMAIL)),
        place(call("charge.v1", retired=NOW), call("take-payment.v1"), call("email.v1", EMAIL)),
        [(Change.STEP_RENAMED, "charge.v1")],
        False,
    ),
    (
        "rename with the old name retired, onto a target other steps call",
        place(call("charge.v1"), call("refund.v1")),
        place(call("charge.v1", retired=NOW), call("refund.v1"), call("take-payment.v1")),
        [(Change.STEP_RENAMED, "charge.v1")],
        False,
    ),
    (
        "outbox step renamed with the old name retired",
        place(outbox("order-created.v1")),
        place(outbox("order-created.v1", retired=NOW), outbox("order-placed.v1")),
        [(Change.STEP_RENAMED, "order-created.v1")],
        False,
    ),
    (
        "rename with a version of the old name moved to another target",
        place(call("charge.v1")),
        place(call("charge.v1", retired=NOW), call("charge.v2", EMAIL), call("take-payment.v1")),
        [(Change.STEP_RENAMED, "charge.v1"), (Change.STEP_ADDED, "charge.v2")],
        False,
    ),
    (
        "two steps retired and one new name: one rename, one retirement",
        place(call("charge.v1"), call("refund.v1")),
        place(call("charge.v1", retired=NOW), call("refund.v1", retired=NOW), call("take.v1")),
        [(Change.STEP_RENAMED, "charge.v1"), (Change.STEP_RETIRED, "refund.v1")],
        False,
    ),
    (
        "a retirement and a new name on another target",
        place(call("charge.v1"), call("email.v1", EMAIL)),
        place(call("charge.v1", retired=NOW), call("email.v1", EMAIL), call("notify.v1", EMAIL)),
        [(Change.STEP_RETIRED, "charge.v1"), (Change.STEP_ADDED, "notify.v1")],
        True,
    ),
    (
        "a version bump with a new step next to it",
        place(call("charge.v1")),
        place(call("charge.v1", retired=NOW), call("charge.v2"), call("hold.v1")),
        [
            (Change.STEP_RETIRED, "charge.v1"),
            (Change.STEP_ADDED, "charge.v2"),
            (Change.STEP_ADDED, "hold.v1"),
        ],
        True,
    ),
    (
        "a version bump next to an earlier retirement",
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
        # The reviewer's case: a step dropped next to one that was there all along.
        "step retired next to one that stays alone on the target",
        place(call("charge-deposit.v1"), call("charge-balance.v1")),
        place(call("charge-deposit.v1", retired=NOW), call("charge-balance.v1")),
        [(Change.STEP_RETIRED, "charge-deposit.v1")],
        True,
    ),
    (
        "step retired while the one staying gets a new version",
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
        "a step added next to an earlier retirement",
        place(call("charge.v1", retired=NOW - HOUR), call("take-payment.v1")),
        place(call("charge.v1", retired=NOW - HOUR), call("take-payment.v1"), call("hold.v1")),
        [(Change.STEP_ADDED, "hold.v1")],
        True,
    ),
    (
        # An unnamed call to Charge went to charge.v1, the only active step; it goes to hold.v1
        # now, so an operation begun earlier that ran charge.v1 is keyed with hold.v1's child
        # key on its retry: a rename onto a reinstated step.
        "a retired step reinstated while another is retired",
        place(call("charge.v1"), call("hold.v1", retired=NOW - HOUR)),
        place(call("charge.v1", retired=NOW), call("hold.v1")),
        [(Change.STEP_RENAMED, "charge.v1"), (Change.STEP_REINSTATED, "hold.v1")],
        False,
    ),
    (
        "a retired step reinstated on another target while another is retired",
        place(call("charge.v1"), call("hold.v1", EMAIL, retired=NOW - HOUR)),
        place(call("charge.v1", retired=NOW), call("hold.v1", EMAIL)),
        [(Change.STEP_RETIRED, "charge.v1"), (Change.STEP_REINSTATED, "hold.v1")],
        True,
    ),
    (
        # A rollback: in-flight operations begun before v1's retirement ran v1 and would be
        # keyed with v2, the retired version whose retired_at is still ahead of them.
        "a retired version active again and its successor retired",
        place(call("charge.v1", retired=NOW - 2 * HOUR), call("charge.v2")),
        place(call("charge.v1"), call("charge.v2", retired=NOW + DAY)),
        [
            (Change.STEP_REINSTATED, "charge.v1"),
            (Change.STEP_RETIRED, "charge.v2"),
            (Change.OPERATIONS_REKEYED, "charge.v1"),
        ],
        False,
    ),
    (
        "a retired version added next to the active one",
        place(call("charge.v2")),
        place(call("charge.v3", retired=NOW + DAY), call("charge.v2")),
        [(Change.STEP_ADDED, "charge.v3"), (Change.OPERATIONS_REKEYED, "charge.v2")],
        False,
    ),
    (
        "a rollback once the retired version's operations are past the retention",
        place(call("charge.v1", retired=NOW - 3 * DAY), call("charge.v2")),
        place(call("charge.v1"), call("charge.v2", retired=NOW + DAY)),
        [
            (Change.STEP_REINSTATED, "charge.v1"),
            (Change.STEP_RETIRED, "charge.v2"),
        ],
        True,
    ),
    (
        "two active versions of a name on one target, unchanged (calls name theirs)",
        place(call("charge.v1"), call("charge.v2")),
        place(call("charge.v1"), call("charge.v2")),
        [],
        True,
    ),
    (
        "a retention of 10,000 years, unchanged",
        place(call("charge.v1"), retention=timedelta(days=3_652_425)),
        place(call("charge.v1"), retention=timedelta(days=3_652_425)),
        [],
        True,
    ),
    (
        "retired at the earliest time there is, unchanged",
        place(call("charge.v1", retired=datetime.min.replace(tzinfo=UTC)), call("charge.v2")),
        place(call("charge.v1", retired=datetime.min.replace(tzinfo=UTC)), call("charge.v2")),
        [(Change.RETIRED_STEP_REMOVABLE, "charge.v1")],
        True,
    ),
    (
        "a naive retired_at (read as UTC), unchanged but for a step added elsewhere",
        place(call("charge.v1", retired=datetime(2026, 6, 1, 11, 0)), call("charge.v2")),
        place(
            call("charge.v1", retired=datetime(2026, 6, 1, 11, 0)),
            call("charge.v2"),
            call("mail.v1", "mail.v1.Mailer/Send"),
        ),
        [(Change.STEP_ADDED, "mail.v1")],
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
    assert "take-payment.v1's child key" in f.why and "1d" in f.why
    # The fix is the lines to paste: the old step, retired a day from now (still ahead when the
    # check runs again before the change ships), and a new version of it.
    seconds = int(NOW.timestamp()) + 86400
    assert (
        f'steps: {{ name: "charge.v1" call: "{CHARGE}" retired_at: {{ seconds: {seconds} }} }}'
        in f.fix
    )
    assert f'steps: {{ name: "charge.v2" call: "{CHARGE}" }}' in f.fix
    assert "2026-06-03T12:00:00Z" in f.fix


def test_a_rename_with_the_old_name_retired_fails_with_the_version_bump_as_its_fix() -> None:
    """Retiring the old name does not carry its child key over to a new name (a step's name is
    its identity; propagation.as_of follows versions of the same name only), so the rename
    fails, and the fix is the version bump, which passes."""
    old = place(call("charge.v1"), call("email.v1", EMAIL))
    renamed = place(
        call("charge.v1", retired=NOW - HOUR), call("take-payment.v1"), call("email.v1", EMAIL)
    )
    # The retirement an hour ago is a failure of its own (operations begun since ran charge.v1),
    # which the rename's fix, retiring a day from now, repairs too.
    f, backdated_too = check_contract(old, renamed, now=NOW).breaking
    assert backdated_too.change is Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS
    assert f.change is Change.STEP_RENAMED and f.step == "charge.v1"
    assert "take-payment.v1" in f.what and "retired at 2026-06-01T11:00:00Z" in f.what
    assert "a step's name is its identity" in f.why
    assert "run the effect again under take-payment.v1's child key" in f.why
    assert f.fix.startswith("keep the old name and bump its version instead: ")
    # Not the declared retirement, already past: a day from now.
    seconds = int(NOW.timestamp()) + 86400
    assert (
        f'steps: {{ name: "charge.v1" call: "{CHARGE}" retired_at: {{ seconds: {seconds} }} }}'
        f' steps: {{ name: "charge.v2" call: "{CHARGE}" }}, in place of take-payment.v1'
    ) in f.fix
    assert "add it in a change of its own" in f.fix
    bumped = place(call("charge.v1", retired=NOW), call("charge.v2"), call("email.v1", EMAIL))
    assert check_contract(old, bumped, now=NOW).ok
    # Retired an hour ago instead: operations begun in that hour ran charge.v1 (the contract
    # deployed then), and their retries would be keyed with charge.v2's child key.
    backdated = place(
        call("charge.v1", retired=NOW - HOUR), call("charge.v2"), call("email.v1", EMAIL)
    )
    (f,) = check_contract(old, backdated, now=NOW).breaking
    assert f.change is Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS
    # A different effect, added in a change of its own, passes too.
    added = place(
        call("charge.v1", retired=NOW),
        call("charge.v2"),
        call("email.v1", EMAIL),
        call("take-payment.v1"),
    )
    assert check_contract(bumped, added, now=NOW).ok


def test_a_step_retired_next_to_one_that_stays_is_a_contract_that_holds() -> None:
    """charge-deposit.v1 retired (dropped) next to charge-balance.v1, which was there all
    along, on the same target: nothing to fail, before or after the retirement, whether the
    change is checked or the contract against itself (the runtime keys each with its own name,
    tests/unit/test_propagation.py)."""
    t = NOW + HOUR
    standing = place(call("charge-deposit.v1", retired=t), call("charge-balance.v1"))
    for now in (NOW, t + HOUR):
        assert check_contract(standing, standing, now=now).ok
    before = place(call("charge-deposit.v1"), call("charge-balance.v1"))
    assert changes(before, standing) == [(Change.STEP_RETIRED, "charge-deposit.v1")]


def test_the_bumped_version_is_one_no_step_has() -> None:
    old = place(call("charge.v1"), call("charge.v2", EMAIL), call("charge.v3", retired=NOW - HOUR))
    new = place(call("charge.v2", EMAIL), call("charge.v3", retired=NOW - HOUR), call("take.v1"))
    (f,) = check_contract(old, new, now=NOW).breaking
    assert f.change is Change.STEP_RENAMED
    assert f'steps: {{ name: "charge.v4" call: "{CHARGE}" }}' in f.fix


@pytest.mark.parametrize(
    ("old", "new"),
    [c[1:3] for c in CASES if not c[4] and {change for change, _ in c[3]} <= FIXABLE],
    ids=[c[0] for c in CASES if not c[4] and {change for change, _ in c[3]} <= FIXABLE],
)
def test_the_fix_printed_for_a_change_passes_the_check(old: Contract, new: Contract) -> None:
    """What check-steps prints as the fix of each failure, applied, passes check-steps (the
    failures whose fix is a declaration to paste: not a changed target or a method gone)."""
    report = check_contract(old, new, now=NOW)
    fixed = {PLACE: apply_fixes(new[PLACE], report)}
    assert check_contract(old, fixed, now=NOW).ok, fixed


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
    *, retired: bool | None = None, min_size: int = 0, one_active_version: bool = False
) -> st.SearchStrategy[MethodSteps]:
    """``one_active_version``: no two active versions of a name on one target. With two (calls
    name theirs), retiring one makes ``propagation.as_of`` key an operation begun earlier that
    named the other with the retired one's key, and check-steps rightly fails it; the
    properties about routine changes hold for the usual contracts, one version at a time."""
    listed = st.lists(
        steps(retired=retired), min_size=min_size, max_size=6, unique_by=lambda s: s.name
    ).map(tuple)
    if one_active_version:
        listed = listed.filter(_one_active_version)
    return st.builds(MethodSteps, retention=retentions, steps=listed)


def _one_active_version(steps: tuple[Step, ...]) -> bool:
    active = [(step_base(s.name), s.call, s.outbox) for s in steps if s.active]
    return len(active) == len(set(active))


paths = st.sampled_from([PLACE, CANCEL, "/shop.v1.Orders/Refund"])
contracts = st.dictionaries(paths, method_steps(), max_size=3)


@given(contracts, offsets)
def test_an_unchanged_contract_always_holds(contract: Contract, shift: timedelta) -> None:
    report = check_contract(contract, contract, now=NOW + shift)
    assert report.ok
    assert {f.change for f in report.findings} <= {Change.RETIRED_STEP_REMOVABLE}


def _versioned(before: MethodSteps, added: Step) -> bool:
    """Whether ``added``, retired, is a retired version of a name active on the same target in
    ``before`` (or retired there later): adding it breaks (``test_adding_steps_never_breaks``)."""
    return any(
        step_base(s.name) == step_base(added.name)
        and s.call == added.call
        and (s.retired_at is None or (added.retired_at or s.retired_at) < s.retired_at)
        for s in before.steps
    )


@given(method_steps(), st.lists(steps(), max_size=4, unique_by=lambda s: s.name))
def test_adding_steps_never_breaks(before: MethodSteps, added: list[Step]) -> None:
    """Adding steps, except a retired version of a name active on the same target: that one
    would key operations begun before its retired_at (``propagation.as_of``), which ran the
    active version (the table's "a retired version added next to the active one"); or retired
    for good there, later than the one added, which ``as_of`` follows back to it too."""
    taken = {s.name for s in before.steps}
    fresh = tuple(
        s for s in added if s.name not in taken and (s.active or not _versioned(before, s))
    )
    after = replace(before, steps=before.steps + fresh)
    report = check_contract({PLACE: before}, {PLACE: after}, now=NOW)
    assert report.ok
    assert {f.step for f in report.findings if f.change is Change.STEP_ADDED} == {
        s.name for s in fresh
    }


@given(method_steps(retired=False, min_size=1), st.data())
def test_dropping_an_active_step_always_breaks(before: MethodSteps, data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(before.steps))
    replacement = data.draw(st.lists(steps(), max_size=2, unique_by=lambda s: s.name))
    kept = tuple(s for s in before.steps if s is not gone)
    # Not a retired version of a name still active on its target: adding one breaks on its own
    # (Hypothesis found b.v2 and a.v1 active, a.v1 dropped and a retired b.v1 added: two
    # breaking findings, both right).
    fresh = tuple(
        s
        for s in replacement
        if s.name not in {k.name for k in before.steps} and (s.active or not _versioned(before, s))
    )
    report = check_contract({PLACE: before}, {PLACE: replace(before, steps=kept + fresh)}, now=NOW)
    (f,) = report.breaking
    assert f.step == gone.name
    assert f.change in (Change.STEP_REMOVED, Change.STEP_RENAMED, Change.STEP_VERSION_CHANGED)


def test_dropping_a_step_while_adding_a_retired_version_of_another_breaks_twice() -> None:
    """The case Hypothesis found for the property above: both changes break, each on its own."""
    before = place(call("b.v2"), call("a.v1"))
    after = place(call("b.v2"), call("b.v1", retired=NOW + HOUR))
    report = check_contract(before, after, now=NOW)
    # The retired b.v1 would key operations begun before its retired_at, which ran b.v2.
    assert {(f.change, f.step) for f in report.breaking} == {
        (Change.STEP_REMOVED, "a.v1"),
        (Change.OPERATIONS_REKEYED, "b.v2"),
    }
    assert _versioned(before[PLACE], call("b.v1", retired=NOW + HOUR))


@given(method_steps(retired=False, one_active_version=True), st.data())
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
    assert report.ok
    assert {f.step for f in report.findings if f.change is Change.STEP_RETIRED} == retire


# One active version per name: with two (b.v1 and b.v2 calling one target), retiring b.v1 also
# re-keys operations begun earlier that named b.v2 (OPERATIONS_REKEYED, rightly: see
# method_steps), which is not what this property is about. Hypothesis found that contract
# rarely, and the test failed at random.
@given(method_steps(retired=False, min_size=1, one_active_version=True), st.data())
def test_a_rename_breaks_whether_or_not_the_old_name_is_kept_retired(
    before: MethodSteps, data: st.DataObject
) -> None:
    """An active step gone, retired or not, and a step with a name new to its target added: a
    rename, which fails, unless a version of the gone step's own name stays active on its target
    (then it is a retirement, which passes, or a removal, which fails as one)."""
    gone = data.draw(st.sampled_from(before.steps))
    retired = data.draw(st.booleans())
    on_target = [s for s in before.steps if s.active and _same_target(s, gone)]
    taken = {base(s.name) for s in before.steps}
    new_name = data.draw(names.filter(lambda n: base(n) not in taken))
    renamed = Step(name=new_name, call=gone.call, outbox=gone.outbox)
    kept = tuple(
        (replace(s, retired_at=NOW) if retired else None) if s is gone else s for s in before.steps
    )
    after = replace(before, steps=(*(s for s in kept if s is not None), renamed))
    report = check_contract({PLACE: before}, {PLACE: after}, now=NOW)
    followed = any(base(s.name) == base(gone.name) for s in on_target if s is not gone)
    found = [(f.change, f.step) for f in report.breaking]
    if not followed:
        assert found == [(Change.STEP_RENAMED, gone.name)]
    elif retired:
        assert found == []
    else:
        assert found == [(Change.STEP_REMOVED, gone.name)]


def test_a_name_keyed_anew_beside_another_names_breaking_change_is_found_too() -> None:
    """An old version declared retired beside the active one (b.v1 next to b.v2) keys the
    operations begun before its retirement with b.v1, which they never used; the backstop that
    finds it ran only when no other change was breaking, so with a step removed in the same
    change (d.v1) only the removal was reported, and its fix, applied, failed the check again.
    Found by ``test_the_fixes_printed_together_pass_the_check``."""
    names = ["a.v1", "b.v2", "c.v1", "d.v1"]
    before = MethodSteps(
        retention=timedelta(seconds=1), steps=tuple(Step(name=n, call=CHARGE) for n in names)
    )
    after = replace(
        before,
        steps=(*before.steps[:3], Step(name="b.v1", call=CHARGE, retired_at=NOW)),
    )
    report = check_contract({PLACE: before}, {PLACE: after}, now=NOW)
    found = {(f.change, f.step) for f in report.breaking}
    assert found == {(Change.STEP_REMOVED, "d.v1"), (Change.OPERATIONS_REKEYED, "b.v2")}
    fixed = apply_fixes(after, report)
    assert check_contract({PLACE: before}, {PLACE: fixed}, now=NOW).ok


@given(method_steps(one_active_version=True), st.data())
def test_the_fixes_printed_together_pass_the_check(
    before: MethodSteps, data: st.DataObject
) -> None:
    """Steps dropped, retired and added at random: what check-steps prints as the fixes, applied
    together, passes check-steps, or a second round of the fixes it then prints does. (A name
    with a breaking finding of its own is not run through the rekeying backstop as well: that
    backstop's fixes would clash with the finding's. Its rekeying, if any, is found once the
    finding is fixed: a tie of two versions' retirements behind a removed one, say. Seen once
    in some hundred runs of this test; never a third round.)"""
    fate = {
        s.name: data.draw(st.sampled_from(["keep", "drop", "retire"]), label=s.name)
        for s in before.steps
    }
    added = data.draw(st.lists(steps(), max_size=3, unique_by=lambda s: s.name))
    after = replace(
        before,
        steps=tuple(
            replace(s, retired_at=s.retired_at or NOW) if fate[s.name] == "retire" else s
            for s in before.steps
            if fate[s.name] != "drop"
        )
        + tuple(s for s in added if s.name not in fate),
    )
    report = check_contract({PLACE: before}, {PLACE: after}, now=NOW)
    fixed = apply_fixes(after, report)
    again = check_contract({PLACE: before}, {PLACE: fixed}, now=NOW)
    if not again.ok:
        assert all(f.change is Change.OPERATIONS_REKEYED for f in again.breaking), again
        fixed = apply_fixes(fixed, again)
    assert check_contract({PLACE: before}, {PLACE: fixed}, now=NOW).ok


def test_a_version_retired_for_good_at_the_instant_the_other_was_is_fixed_past_it() -> None:
    """a.v2 rolled back at NOW (retired), a.v1 active; the change retires a.v1 at NOW too. A
    version retired for good is followed back only to versions retired strictly before it, so
    operations begun before NOW, which ran a.v2, are keyed with a.v1. The fix printed kept a.v1
    retired at NOW, which was the change itself: it failed the check again. It now retires a.v1
    after a.v2, when the change ships."""
    before = MethodSteps(
        retention=timedelta(seconds=1),
        steps=(Step(name="a.v2", call=CHARGE, retired_at=NOW), Step(name="a.v1", call=CHARGE)),
    )
    after = replace(before, steps=(before.steps[0], Step(name="a.v1", call=CHARGE, retired_at=NOW)))
    report = check_contract({PLACE: before}, {PLACE: after}, now=NOW)
    assert [(f.change, f.step) for f in report.breaking] == [(Change.OPERATIONS_REKEYED, "a.v1")]
    fixed = apply_fixes(after, report)
    assert check_contract({PLACE: before}, {PLACE: fixed}, now=NOW).ok
    (a1,) = (s for s in fixed.steps if s.name == "a.v1")
    assert a1.retired_at is not None and a1.retired_at > NOW


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


def test_a_changed_targets_fix_names_a_version_not_declared_yet() -> None:
    """``charge.v2`` retired within its retention: the fix suggested ``charge.v2`` again, and
    applying it failed the check once more."""
    old = place(call("charge.v1"), call("charge.v2", retired=NOW - HOUR))
    new = place(call("charge.v1", "pay.v2.Payments/Charge"), call("charge.v2", retired=NOW - HOUR))
    (finding,) = [f for f in check_contract(old, new, now=NOW).findings if f.step == "charge.v1"]
    assert finding.change is Change.STEP_TARGET_CHANGED
    assert "charge.v3" in finding.fix and "charge.v2)" not in finding.fix


def test_dates_past_what_datetime_holds_saturate_instead_of_raising() -> None:
    """A retention near a Duration's largest, or a check run with --now near year 9999, raised
    OverflowError (a traceback from check-steps)."""
    huge = timedelta(days=3_000_000)
    old = place(call("charge.v1"), retention=huge)
    result = check_contract(old, place(retention=huge), now=NOW)
    assert [f.change for f in result.findings] == [Change.STEP_REMOVED]
    late = datetime(9999, 12, 31, tzinfo=UTC)
    assert check_contract(place(call("charge.v1")), place(), now=late).findings


def _step_for(steps: tuple[Step, ...], started_at: datetime) -> str:
    """The step an operation begun at ``started_at`` keys its call to CHARGE with, at runtime."""
    return choose_step(Parent(PLACE, "tenant", "k", steps, started_at), CHARGE, None).name


def test_a_step_retired_for_good_in_the_past_fails_where_its_next_version_could_not() -> None:
    """Two changes, each checked against the one before: charge.v1 retired for good an hour
    ago, then, a day later, a charge.v2 added. An operation begun half an hour ago ran charge.v1
    (the deployed contract had it active); after the second change its retry is keyed with
    charge.v2's child key, and the charge runs twice. The second change cannot see that: a
    retirement set ahead of its deploy refused charge.v1 to the operations begun after it, which
    never ran it, and v2 is their first charge. So the first change is the one that fails, and
    its fix makes the pair safe for every start."""
    began = NOW - HOUR / 2
    deployed = place(call("charge.v1"), call("refund.v1", EMAIL))
    retired = place(call("charge.v1", retired=NOW - HOUR), call("refund.v1", EMAIL))
    versioned = place(*retired[PLACE].steps, call("charge.v2"))
    assert _step_for(deployed[PLACE].steps, began) == "charge.v1"
    assert _step_for(versioned[PLACE].steps, began) == "charge.v2"
    with pytest.raises(StepUndeclared):  # in between, its retry is refused charge.v1
        choose_step(Parent(PLACE, "tenant", "k", retired[PLACE].steps, began), CHARGE, "charge.v1")
    assert check_contract(retired, versioned, now=NOW + DAY).ok  # nothing to see by then

    report = check_contract(deployed, retired, now=NOW)
    (f,) = report.breaking
    assert f.change is Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS and f.step == "charge.v1"
    assert "refused (StepUndeclared)" in f.why and "a version of the name added" in f.why
    fixed = {PLACE: apply_fixes(retired[PLACE], report)}
    assert check_contract(deployed, fixed, now=NOW).ok
    later = NOW + 2 * DAY
    then = place(*fixed[PLACE].steps, call("charge.v2"))
    assert check_contract(fixed, then, now=later).ok
    # Every operation begun before the fixed retirement (a day from now) ran charge.v1, and
    # keeps it; the ones begun after it never ran charge.v1, and charge.v2 is their first.
    for start in (began, NOW, NOW + DAY - SECOND):
        parent = Parent(PLACE, "tenant", "k", fixed[PLACE].steps, start)
        assert choose_step(parent, CHARGE, "charge.v1").name == "charge.v1"
        assert _step_for(then[PLACE].steps, start) == "charge.v1"
    assert _step_for(then[PLACE].steps, later - HOUR) == "charge.v2"


def test_a_live_retired_steps_new_target_is_a_failure_with_the_old_target_as_its_fix() -> None:
    """check-steps passed a change of a retired step's ``call`` while it was still live: the
    runtime finds retired steps by target, so an operation begun before the retirement, which
    ran charge.v1 against CHARGE, was retried as charge.v2 (a new child key: charged twice)."""
    retired = NOW - 2 * HOUR
    old = (call("charge.v1", retired=retired), call("charge.v2"))
    new = (call("charge.v1", "pay.v2.Payments/Charge", retired=retired), call("charge.v2"))
    begun = retired - HOUR
    assert (_step_for(old, begun), _step_for(new, begun)) == ("charge.v1", "charge.v2")
    report = check_contract(place(*old), place(*new), now=NOW)
    (f,) = report.breaking
    assert (f.change, f.step) == (Change.STEP_TARGET_CHANGED, "charge.v1")
    assert "retired step charge.v1 changed target" in f.what
    assert "executes the effect again" in f.why
    seconds = int(retired.timestamp())
    assert (
        f'steps: {{ name: "charge.v1" call: "{CHARGE}" retired_at: {{ seconds: {seconds} }} }}'
        in f.fix
    )
    assert "2026-06-02T10:00:00Z" in f.fix  # retired_at + 1d
    restored = place(call("charge.v1", retired=retired), call("charge.v2"))
    assert check_contract(place(*old), restored, now=NOW).ok


def test_a_retirement_moved_later_after_it_took_effect_fails() -> None:
    """check-steps passed a past retired_at moved later: an operation begun in between ran
    charge.v2, and its retry was keyed with charge.v1's child key (charged twice)."""
    was = NOW - 2 * HOUR
    old = (call("charge.v1", retired=was), call("charge.v2"))
    new = (call("charge.v1", retired=NOW + HOUR), call("charge.v2"))
    begun = was + timedelta(minutes=30)
    assert (_step_for(old, begun), _step_for(new, begun)) == ("charge.v2", "charge.v1")
    (f,) = check_contract(place(*old), place(*new), now=NOW).breaking
    assert (f.change, f.step) == (Change.RETIREMENT_POSTPONED_AFTER_THE_FACT, "charge.v1")
    assert "from 2026-06-01T10:00:00Z to 2026-06-01T13:00:00Z" in f.what
    assert "runs again" in f.why and "retention 1d" in f.why
    seconds = int(was.timestamp())
    assert f"retired_at: {{ seconds: {seconds} }}" in f.fix
    # Once the new retired_at has left the retention, no operation begun in between is
    # replayable any more.
    assert not check_contract(place(*old), place(*new), now=NOW + HOUR + DAY - SECOND).ok
    assert check_contract(place(*old), place(*new), now=NOW + HOUR + DAY).ok


@pytest.mark.parametrize("was", [NOW - HOUR, NOW + HOUR], ids=["passed", "ahead"])
def test_a_retirement_moved_into_the_past_is_fixed_by_keeping_it_as_it_was(was: datetime) -> None:
    """charge.v1's retired_at moved earlier, into the past: the fix printed the old retired_at
    (an hour ago, or an hour ahead) under "retire it no earlier than this change ships (a time
    still ahead when this check runs, here a day from now)". Followed as written, a day from
    now moved a retirement that had taken effect later (RETIREMENT_POSTPONED_AFTER_THE_FACT,
    with charge.v2 following it); the declaration was right, the text about it was not."""
    old = place(call("charge.v1", retired=was), call("charge.v2"))
    new = place(call("charge.v1", retired=NOW - 2 * HOUR), call("charge.v2"))
    report = check_contract(old, new, now=NOW)
    (f,) = report.breaking
    assert f.change is Change.RETIREMENT_BACKDATED_OVER_BEGUN_OPERATIONS
    assert "a day from now" not in f.fix and "keep retired_at as it was" in f.fix
    assert f"seconds: {int(was.timestamp())} " in f.fix
    assert check_contract(old, {PLACE: apply_fixes(new[PLACE], report)}, now=NOW).ok
    # What the text said, done: a retirement that had taken effect moved later.
    later = place(call("charge.v1", retired=NOW + DAY), call("charge.v2"))
    assert check_contract(old, later, now=NOW).ok is (was > NOW)


@pytest.mark.parametrize(
    "retired",
    [
        NOW - HOUR + timedelta(microseconds=500_001),
        datetime(1969, 12, 31, 23, 59, 59, 500_001, UTC),
        (NOW - HOUR + timedelta(microseconds=1)).replace(tzinfo=None),  # read as UTC
    ],
    ids=["fraction of a second", "before 1970", "naive"],
)
def test_a_printed_retired_at_is_the_declared_one_to_the_microsecond(retired: datetime) -> None:
    """A retired_at with a fraction of a second (``nanos``) was printed in a fix as whole
    seconds, truncated toward 1970 (``int(timestamp())``): "keep" it as printed moved the
    retirement earlier (or, before 1970, later), which fails the check again, as it should."""
    old = {
        PLACE: MethodSteps(
            retention=DAY * 30000, steps=(call("charge.v1", retired=retired), call("charge.v2"))
        )
    }
    new = {PLACE: replace(old[PLACE], steps=(call("charge.v2"),))}
    report = check_contract(old, new, now=NOW)
    (f,) = report.breaking
    assert f.change is Change.RETIRED_STEP_REMOVED_EARLY
    assert check_contract(old, {PLACE: apply_fixes(new[PLACE], report)}, now=NOW).ok, f.fix


def test_a_retired_version_added_before_one_retired_for_good_is_a_rekeying() -> None:
    """charge.v1 retired for good an hour ahead, and charge.v2 declared next to it, retired now
    (earlier): an operation begun before now, which ran charge.v1, is keyed with charge.v2 when
    its retry names charge.v1 (the runtime follows a version retired for good back to those
    retired before it, as_of). Next to an active charge.v1 the same addition fails as
    OPERATIONS_REKEYED; retired for good, check-steps passed it. Its fix passes."""
    old = place(call("charge.v1"))
    new = place(call("charge.v1", retired=NOW + HOUR), call("charge.v2", retired=NOW))
    began = NOW - HOUR / 2
    before = choose_step(Parent(PLACE, "tenant", "k", old[PLACE].steps, began), CHARGE, "charge.v1")
    after = choose_step(Parent(PLACE, "tenant", "k", new[PLACE].steps, began), CHARGE, "charge.v1")
    assert (before.name, after.name) == ("charge.v1", "charge.v2")
    report = check_contract(old, new, now=NOW)
    (f,) = report.breaking
    assert f.change is Change.OPERATIONS_REKEYED and f.step == "charge.v1"
    assert "keyed its call" in f.what and "charge.v2" in f.what
    fixed = {PLACE: apply_fixes(new[PLACE], report)}
    assert check_contract(old, fixed, now=NOW).ok
    assert [s.name for s in fixed[PLACE].steps] == ["charge.v1"]
    assert fixed[PLACE].steps[0].retired_at == NOW + HOUR


def test_a_step_reinstated_where_the_only_active_one_is_retired_is_a_rename() -> None:
    """charge.v1 the only active step on Charge, hold.v1 retired there; the change reinstates
    hold.v1 and retires charge.v1. An unnamed call of an operation begun before, which ran
    charge.v1, is keyed with hold.v1 on its retry, and the charge runs twice; check-steps passed
    it (a reinstatement was never a rename's successor). Its fix, applied, passes, and keeps
    every start on the step it used."""
    old = place(call("charge.v1"), call("hold.v1", retired=NOW - HOUR))
    new = place(call("charge.v1", retired=NOW), call("hold.v1"))
    began = NOW - HOUR / 2
    assert _step_for(old[PLACE].steps, began) == "charge.v1"
    assert _step_for(new[PLACE].steps, began) == "hold.v1"  # what the check now refuses
    report = check_contract(old, new, now=NOW)
    (f,) = report.breaking
    assert f.change is Change.STEP_RENAMED and "renamed to hold.v1" in f.what
    assert "keep hold.v1 retired as it was" in f.fix and "in place of" not in f.fix
    fixed = {PLACE: apply_fixes(new[PLACE], report)}
    assert check_contract(old, fixed, now=NOW).ok, fixed
    for start in (began, NOW - SECOND):  # begun before the retirement (now): charge.v1
        assert _step_for(fixed[PLACE].steps, start) == "charge.v1"
    assert _step_for(fixed[PLACE].steps, NOW + SECOND) == "charge.v2"


def test_an_outbox_version_added_before_one_retired_for_good_is_a_rekeying() -> None:
    """The outbox's case of the test above: a retired outbox version named in ``enqueue`` now
    stands as a call's does (``outbox.outbox_step``), so event.v2 declared next to event.v1,
    retired for good an hour ahead, keys the message of an operation begun before now, which
    enqueued event.v1, with event.v2's key on its retry: delivered twice, under two keys.
    check-steps read only calls naming their step, and passed it."""
    old = place(outbox("event.v1"))
    new = place(outbox("event.v1", retired=NOW + HOUR), outbox("event.v2", retired=NOW))
    began = NOW - HOUR / 2
    before = outbox_step(PLACE, old[PLACE].steps, "event.v1", began)
    after = outbox_step(PLACE, new[PLACE].steps, "event.v1", began)
    assert (before.name, after.name) == ("event.v1", "event.v2")
    report = check_contract(old, new, now=NOW)
    (f,) = report.breaking
    assert f.change is Change.OPERATIONS_REKEYED and f.step == "event.v1"
    assert "event.v2" in f.what
    fixed = {PLACE: apply_fixes(new[PLACE], report)}
    assert check_contract(old, fixed, now=NOW).ok
    assert [s.name for s in fixed[PLACE].steps] == ["event.v1"]
