"""``core.inspection.children``: which declared steps an operation keys its effects with
(``in_effect``), as ``core.propagation.choose_step`` decides it for the operation's calls."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from grpc_idempotency.core.errors import StepUndeclared
from grpc_idempotency.core.inspection import Record, children
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.propagation import Parent, choose_step

RETIRED = datetime(2026, 6, 1, tzinfo=UTC)
METHOD = "/shop.v1.Orders/Place"
TARGET = "/shop.v1.Mail/Send"


def record(started: datetime) -> Record:
    return Record(
        scope="tenant:a",
        key="order-1",
        method=METHOD,
        state="completed",
        fingerprint=b"\x00",
        fencing_token=1,
        created_at=started,
        completed_at=started,
        expires_at=started + timedelta(days=1),
        locked_until=None,
        lease_remaining_s=None,
        expired=False,
        status_code=0,
        status_message="",
        status_details=None,
        response=b"",
        read_at=started,
    )


def test_a_step_retired_for_good_is_in_effect_for_the_operations_begun_before_its_retirement() -> (
    None
):
    """With no active version of its name, a retired call step named by the handler keys the
    operations begun before its retirement (``choose_step``); ``inspect`` said it was "not in
    effect for this operation" and left it out of ``missing`` when nothing was found."""
    steps = (Step(name="send-mail.v1", call=TARGET, retired_at=RETIRED),)
    before, after = RETIRED - timedelta(hours=1), RETIRED + timedelta(hours=1)

    parent = Parent(method=METHOD, scope="tenant:a", key="order-1", steps=steps, started_at=before)
    assert choose_step(parent, TARGET, "send-mail.v1").name == "send-mail.v1"
    (child,) = children(record(before), steps)
    assert child.in_effect is True

    later = Parent(method=METHOD, scope="tenant:a", key="order-1", steps=steps, started_at=after)
    with pytest.raises(StepUndeclared):
        choose_step(later, TARGET, "send-mail.v1")
    (child,) = children(record(after), steps)
    assert child.in_effect is False


def test_a_retired_version_with_an_active_one_is_in_effect_as_as_of_says() -> None:
    steps = (
        Step(name="send-mail.v1", call=TARGET, retired_at=RETIRED),
        Step(name="send-mail.v2", call=TARGET),
    )
    early = {c.step: c.in_effect for c in children(record(RETIRED - timedelta(hours=1)), steps)}
    late = {c.step: c.in_effect for c in children(record(RETIRED + timedelta(hours=1)), steps)}
    assert early == {"send-mail.v1": True, "send-mail.v2": False}
    assert late == {"send-mail.v1": False, "send-mail.v2": True}
