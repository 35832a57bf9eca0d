from __future__ import annotations

import itertools
import math

import pytest

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.failpoints import FailAction, parse_failpoints
from grpc_idempotency.core.lifecycle import (
    TRANSITIONS,
    Action,
    CallOutcome,
    Event,
    Finish,
    IllegalTransition,
    Outcome,
    Phase,
    State,
    Step,
    StoredRecord,
    begin_event,
    budget_event,
    claim_visible,
    cut_short_outcome,
    decide,
    downstream_decides,
    executed_outcome,
    final_store_failure,
    finish,
    given_up_outcome,
    look_event,
    outcome_bytes,
    poll_delay_ms,
    renewal_acquire_bound_s,
    renewal_bound_s,
    renewal_interval_s,
    renewal_spacing_s,
    retry_after_ms,
    store_down_event,
    transition,
    wait_budget_s,
)
from grpc_idempotency.core.wire import DEFAULT_RECORDED_ERRORS

FP = b"f" * 32
OTHER = b"o" * 32
DONE = Outcome(Code.OK, response=b"\x08\x01")


def record(
    state: State = State.COMPLETED,
    *,
    fp: bytes = FP,
    expired: bool = False,
    lease_expired: bool = False,
    remaining: int = 0,
) -> StoredRecord:
    return StoredRecord(
        fingerprint=fp,
        state=state,
        outcome=DONE if state is State.COMPLETED else None,
        expired=expired,
        lease_expired=lease_expired,
        lease_remaining_ms=remaining,
    )


@pytest.mark.parametrize(
    ("rec", "action", "takeover"),
    [
        (None, Action.CLAIM, False),
        (record(expired=True), Action.CLAIM, False),
        (record(expired=True, fp=OTHER), Action.CLAIM, False),
        (record(), Action.REPLAY, False),
        # As the store reports a completed record: no lock left, so its lease reads expired.
        (record(lease_expired=True), Action.REPLAY, False),
        (record(fp=OTHER), Action.MISMATCH, False),
        (record(State.IN_PROGRESS, remaining=900), Action.WAIT, False),
        (record(State.IN_PROGRESS, fp=OTHER, remaining=900), Action.MISMATCH, False),
        (record(State.IN_PROGRESS, lease_expired=True), Action.CLAIM, True),
        (record(State.IN_PROGRESS, fp=OTHER, lease_expired=True), Action.MISMATCH, False),
        # Past its retention and its lease: the same request continues the operation, another
        # one begins a new operation under the key (migration 0014).
        (record(State.IN_PROGRESS, expired=True, lease_expired=True), Action.CLAIM, True),
        (
            record(State.IN_PROGRESS, fp=OTHER, expired=True, lease_expired=True),
            Action.CLAIM,
            False,
        ),
    ],
)
def test_decide(rec: StoredRecord | None, action: Action, takeover: bool) -> None:
    decision = decide(rec, FP)
    assert decision.action is action
    assert decision.takeover is takeover
    if action is Action.REPLAY:
        assert decision.outcome == DONE
    if action is Action.WAIT:
        assert decision.retry_after_ms == 900


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (Code.OK, Finish.RECORD),
        (Code.INVALID_ARGUMENT, Finish.RECORD_ERROR),
        (Code.NOT_FOUND, Finish.RECORD_ERROR),
        (Code.ALREADY_EXISTS, Finish.RECORD_ERROR),
        (Code.FAILED_PRECONDITION, Finish.RECORD_ERROR),
        (Code.OUT_OF_RANGE, Finish.RECORD_ERROR),
        (Code.UNAVAILABLE, Finish.RELEASE),
        (Code.DEADLINE_EXCEEDED, Finish.RELEASE),
        (Code.RESOURCE_EXHAUSTED, Finish.RELEASE),
        (Code.ABORTED, Finish.RELEASE),
        (Code.INTERNAL, Finish.RELEASE),
        (Code.UNKNOWN, Finish.RELEASE),
        (Code.CANCELLED, Finish.RELEASE),
        (Code.PERMISSION_DENIED, Finish.RELEASE),
    ],
)
def test_finish_classifies_by_default_recorded_set(code: Code, expected: Finish) -> None:
    assert finish(code, DEFAULT_RECORDED_ERRORS) is expected


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (Code.OK, Finish.UNSETTLED),
        (Code.NOT_FOUND, Finish.UNSETTLED),  # a recorded error would be replayed just the same
        (Code.UNAVAILABLE, Finish.RELEASE),  # released anyway: its own answer stands
    ],
)
def test_finish_records_nothing_while_a_downstream_call_is_in_flight(
    code: Code, expected: Finish
) -> None:
    assert finish(code, DEFAULT_RECORDED_ERRORS, downstream_in_flight=True) is expected


_LEFT = ("lease_lost", "enqueue_unawaited", "downstream_refused", "downstream_in_flight")


@pytest.mark.parametrize(
    ("code", "left", "expected"),
    [
        # The lease lost wins over everything, whatever the status: nothing can be recorded.
        (Code.OK, _LEFT, Finish.LEASE_LOST),
        (Code.NOT_FOUND, _LEFT, Finish.LEASE_LOST),
        (Code.UNAVAILABLE, ("lease_lost",), Finish.LEASE_LOST),
        # OK: an enqueue never run to its end, then a refused call, then one in flight.
        (Code.OK, _LEFT[1:], Finish.ENQUEUE_UNAWAITED),
        (Code.OK, _LEFT[2:], Finish.DOWNSTREAM_REFUSED),
        (Code.OK, ("enqueue_unawaited", "downstream_in_flight"), Finish.ENQUEUE_UNAWAITED),
        (Code.OK, ("downstream_in_flight",), Finish.UNSETTLED),
        # An error answer commits none of the handler's writes: an enqueue or a refused call
        # lost nothing, so a recorded error is recorded, unless a call is still in flight.
        (Code.NOT_FOUND, _LEFT[1:3], Finish.RECORD_ERROR),
        (Code.NOT_FOUND, _LEFT[1:], Finish.UNSETTLED),
        (Code.UNAVAILABLE, _LEFT[1:], Finish.RELEASE),
    ],
)
def test_finish_decides_which_of_what_the_handler_left_behind_wins(
    code: Code, left: tuple[str, ...], expected: Finish
) -> None:
    flags = {name: name in left for name in _LEFT}
    assert finish(code, DEFAULT_RECORDED_ERRORS, **flags) is expected


@pytest.mark.parametrize("code", list(Code))
def test_a_lost_lease_overrides_every_answer_of_the_handler(code: Code) -> None:
    """Not only OK and a recorded error (neither can be recorded): an error that releases the
    key (UNAVAILABLE, PERMISSION_DENIED) is not the answer either. The operation is another
    attempt's, whose outcome a retry gets; the handler's error spoke of this attempt only."""
    assert finish(code, DEFAULT_RECORDED_ERRORS, lease_lost=True) is Finish.LEASE_LOST


@pytest.mark.parametrize("recorded", [DEFAULT_RECORDED_ERRORS, frozenset({Code.PERMISSION_DENIED})])
@pytest.mark.parametrize("code", list(Code))
def test_downstream_decides_exactly_where_finish_reads_what_was_left(
    code: Code, recorded: frozenset[Code]
) -> None:
    """The driver skips an atomic call's loop turn (in which a call object made last starts,
    and is refused or counted) where ``downstream_decides`` says no: there, neither must change
    what ``finish`` does; where it says yes, either does. With the method's own recorded set
    (an override), not the default's."""
    left = finish(code, recorded, downstream_refused=True, downstream_in_flight=True)
    changes = left is not finish(code, recorded)
    assert downstream_decides(code, recorded) is changes


def test_finish_respects_an_overridden_set() -> None:
    assert finish(Code.NOT_FOUND, frozenset({Code.PERMISSION_DENIED})) is Finish.RELEASE
    assert (
        finish(Code.PERMISSION_DENIED, frozenset({Code.PERMISSION_DENIED})) is Finish.RECORD_ERROR
    )


def test_wait_budget_is_bounded_by_deadline_and_max_wait() -> None:
    assert wait_budget_s(5.0, None) == 5.0
    assert wait_budget_s(5.0, 1.0) == pytest.approx(0.9)
    assert wait_budget_s(0.5, 10.0) == 0.5
    assert wait_budget_s(5.0, 0.01) == 0.0


def test_retry_hint_is_clamped() -> None:
    assert retry_after_ms(None) == 250
    assert retry_after_ms(10) == 50
    assert retry_after_ms(700) == 700
    assert retry_after_ms(60_000) == 2000
    # A lease with nothing left (the owner is gone or about to be): the default hint, not the
    # minimum, since a takeover's claim will take a moment.
    assert retry_after_ms(0) == 250
    assert retry_after_ms(-30) == 250


def test_polls_back_off_to_their_last_step_and_stay_there() -> None:
    delays = [poll_delay_ms(attempt) for attempt in range(12)]
    assert delays[:7] == [2, 5, 10, 20, 40, 80, 100]
    assert set(delays[7:]) == {100}


def test_outcome_bytes_counts_the_message_in_utf8_bytes() -> None:
    # max_response_bytes bounds what is stored: the message's bytes, not its characters.
    assert outcome_bytes(Outcome(Code.OK, response=b"\x08\x01")) == 2
    assert outcome_bytes(Outcome(Code.NOT_FOUND, "né €", details=b"abc")) == 3 + 7


def test_failpoint_specs() -> None:
    points = parse_failpoints(
        "after_claim=crash, before_commit=sleep:2000,after_commit_before_response=error,"
        "lease_renewal=stop"
    )
    assert points["after_claim"].action is FailAction.CRASH
    assert points["lease_renewal"].action is FailAction.STOP
    assert points["before_commit"].sleep_ms == 2000
    assert points["after_commit_before_response"].action is FailAction.ERROR
    assert parse_failpoints("") == {}
    for bad in (
        "nowhere=crash",
        "after_claim",
        "after_claim=explode",
        "after_claim=sleep:x",
        "after_claim=crash:1",
        "after_claim=stop:1",
        "after_claim=stop:",
        "after_claim=sleep:\u00b2",  # a digit to str.isdigit(), not to int()
        "after_claim=sleep:\u0663",  # ARABIC-INDIC DIGIT THREE
    ):
        with pytest.raises(ValueError, match="GRPC_IDEMPOTENCY_FAILPOINTS"):
            parse_failpoints(bad)


def test_a_stop_failpoint_is_refused_where_there_is_no_sigstop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows has no SIGSTOP: ``stop`` is refused when the variable is read, naming why, not
    when a request reaches the point."""
    from grpc_idempotency.core import failpoints

    monkeypatch.setattr(failpoints, "CAN_STOP", False)
    with pytest.raises(ValueError, match="POSIX only"):
        parse_failpoints("before_commit=stop")
    assert parse_failpoints("before_commit=sleep:1")["before_commit"].sleep_ms == 1


# -- the transition table ----------------------------------------------------------------------


def _walk(phase: Phase, *events: Event) -> list[Step]:
    steps = []
    for event in events:
        step, phase = transition(phase, event)
        steps.append(step)
    return steps


@pytest.mark.parametrize(
    ("events", "steps"),
    [
        # A new key: claimed straight away, no look-up.
        ([Event.UNSEEN_KEY, Event.CLAIM_WON], [Step.CLAIM, Step.EXECUTE]),
        # The blind claim lost (recorded): look why, then replay.
        (
            [Event.UNSEEN_KEY, Event.CLAIM_LOST, Event.COMPLETED],
            [Step.CLAIM, Step.LOOK_UP, Step.REPLAY],
        ),
        # A retry of a seen key: one look-up, replayed.
        ([Event.SEEN_KEY, Event.COMPLETED], [Step.LOOK_UP, Step.REPLAY]),
        ([Event.SEEN_KEY, Event.OTHER_REQUEST], [Step.LOOK_UP, Step.REFUSE]),
        # Running elsewhere: wait, poll again, then it has completed.
        (
            [Event.SEEN_KEY, Event.RUNNING, Event.BUDGET_LEFT, Event.SEEN_KEY, Event.COMPLETED],
            [Step.LOOK_UP, Step.WAIT, Step.SLEEP, Step.LOOK_UP, Step.REPLAY],
        ),
        (
            [Event.SEEN_KEY, Event.RUNNING, Event.BUDGET_SPENT],
            [Step.LOOK_UP, Step.WAIT, Step.ANSWER_IN_PROGRESS],
        ),
        # An abandoned claim is taken over; a lost race for it waits.
        (
            [Event.SEEN_KEY, Event.ABANDONED, Event.CLAIM_WON],
            [Step.LOOK_UP, Step.CLAIM, Step.EXECUTE],
        ),
        (
            [Event.SEEN_KEY, Event.ABANDONED, Event.CLAIM_LOST, Event.BUDGET_LEFT],
            [Step.LOOK_UP, Step.CLAIM, Step.WAIT, Step.SLEEP],
        ),
        # So does a lost race for a key with no live record.
        (
            [Event.SEEN_KEY, Event.NOTHING_LIVE, Event.CLAIM_LOST],
            [Step.LOOK_UP, Step.CLAIM, Step.WAIT],
        ),
        # The store down at any step that uses it.
        ([Event.UNSEEN_KEY, Event.STORE_DOWN_OPEN], [Step.CLAIM, Step.RUN_WITHOUT_STORE]),
        ([Event.SEEN_KEY, Event.STORE_DOWN_CLOSED], [Step.LOOK_UP, Step.ANSWER_UNAVAILABLE]),
        # Or its wait there ended with the call's deadline: no outage.
        (
            [Event.UNSEEN_KEY, Event.DEADLINE_SPENT],
            [Step.CLAIM, Step.ANSWER_DEADLINE_EXCEEDED],
        ),
        (
            [
                Event.SEEN_KEY,
                Event.RUNNING,
                Event.BUDGET_LEFT,
                Event.SEEN_KEY,
                Event.DEADLINE_SPENT,
            ],
            [Step.LOOK_UP, Step.WAIT, Step.SLEEP, Step.LOOK_UP, Step.ANSWER_DEADLINE_EXCEEDED],
        ),
    ],
)
def test_paths_through_the_table(events: list[Event], steps: list[Step]) -> None:
    assert _walk(Phase.FRESH, *events) == steps


def test_events_that_cannot_happen_are_refused_not_guessed() -> None:
    legal = {(phase, event) for phase, row in TRANSITIONS.items() for event in row}
    for phase in Phase:
        for event in Event:
            if (phase, event) in legal:
                continue
            with pytest.raises(IllegalTransition, match=event.name):
                transition(phase, event)
    # Nothing leaves the end states.
    assert Phase.DONE not in TRANSITIONS and Phase.EXECUTING not in TRANSITIONS


def test_events_from_what_the_driver_saw() -> None:
    assert begin_event(recently_seen=False, atomic=True) is Event.UNSEEN_KEY
    assert begin_event(recently_seen=True, atomic=True) is Event.SEEN_KEY
    assert begin_event(recently_seen=False, atomic=False) is Event.SEEN_KEY  # phased looks first
    assert look_event(None, FP) is Event.NOTHING_LIVE
    assert look_event(record(), FP) is Event.COMPLETED
    assert look_event(record(), OTHER) is Event.OTHER_REQUEST
    assert look_event(record(expired=True), OTHER) is Event.NOTHING_LIVE  # past retention: new
    assert look_event(record(State.IN_PROGRESS), FP) is Event.RUNNING
    assert look_event(record(State.IN_PROGRESS, lease_expired=True), FP) is Event.ABANDONED
    abandoned = record(State.IN_PROGRESS, expired=True, lease_expired=True)
    assert look_event(abandoned, FP) is Event.ABANDONED  # the operation continues
    assert look_event(abandoned, OTHER) is Event.NOTHING_LIVE  # past retention: new
    assert store_down_event(fail_open=True) is Event.STORE_DOWN_OPEN
    assert store_down_event(fail_open=False) is Event.STORE_DOWN_CLOSED
    assert store_down_event(fail_open=False, deadline_spent=True) is Event.DEADLINE_SPENT
    assert store_down_event(fail_open=True, deadline_spent=True) is Event.DEADLINE_SPENT
    # Ended with nothing kept: "conflict" after waiting on another attempt, else "released".
    assert given_up_outcome(waited=True) is CallOutcome.CONFLICT
    assert given_up_outcome(waited=False) is CallOutcome.RELEASED
    assert budget_event(now=5.0, wait_until=5.0) is Event.BUDGET_SPENT
    assert budget_event(now=4.9, wait_until=5.0) is Event.BUDGET_LEFT
    assert executed_outcome(Phase.TAKING_OVER) is CallOutcome.TAKEN_OVER
    assert executed_outcome(Phase.CLAIMING) is CallOutcome.EXECUTED
    assert executed_outcome(Phase.CLAIMING_BLIND) is CallOutcome.EXECUTED


def test_a_store_failure_at_the_end_is_the_deadlines_only_before_the_transaction_opened() -> None:
    # The final transaction's opening is bounded by the call's time left, as the claim is.
    assert final_store_failure(opened=False, deadline_spent=True) is Step.ANSWER_DEADLINE_EXCEEDED
    assert final_store_failure(opened=False, deadline_spent=False) is Step.ANSWER_UNAVAILABLE
    # The COMMIT by the store alone, and its fate may be unknown: the store's, whatever is left.
    assert final_store_failure(opened=True, deadline_spent=True) is Step.ANSWER_UNAVAILABLE
    assert final_store_failure(opened=True, deadline_spent=False) is Step.ANSWER_UNAVAILABLE


def test_a_call_cut_short_is_released_unless_its_commit_was_sent() -> None:
    assert cut_short_outcome(CallOutcome.EXECUTED, commit_sent=False) is CallOutcome.RELEASED
    # Sent, the COMMIT lands as a rule: counted as the attempt it is.
    assert cut_short_outcome(CallOutcome.EXECUTED, commit_sent=True) is CallOutcome.EXECUTED
    assert cut_short_outcome(CallOutcome.TAKEN_OVER, commit_sent=True) is CallOutcome.TAKEN_OVER


def _renewal_starts(lease_s: float, answers: list[float | None]) -> list[tuple[float, bool]]:
    """The lease keeper's schedule (``_LeaseKeeper._run``), on a simulated clock: when each
    renewal starts, and whether it renewed, given how each is answered: in that many seconds
    (renewed, if within its bound), ``None`` never (a dead connection: cut at its bound), or
    ``DOWN`` at once with an error (the database down)."""
    start, lease_until, spacing = 0.0, lease_s, renewal_interval_s(lease_s)
    now, schedule = 0.0, []
    for answer in answers:
        start = max(now, start + spacing)
        left = lease_until - start
        bound = renewal_bound_s(lease_s, left)
        renewed = answer is not None and 0 <= answer < bound
        now = start + (bound if answer is None or answer >= bound else max(answer, 0.0))
        schedule.append((start, renewed))
        if renewed:
            lease_until = start + lease_s
        spacing = renewal_spacing_s(lease_s, left, renewed=renewed)
    return schedule


DOWN = -1.0


@pytest.mark.parametrize("lease_s", [0.5, 3.0, 30.0, 3600.0])
def test_a_renewal_stuck_on_a_dead_connection_leaves_time_for_another(lease_s: float) -> None:
    # The first renewal never answers; the next, on a fresh connection, answers at once. It
    # must land before the lease runs out: bounded by a whole lease, the stuck one held the
    # keeper past the end, and the lease lapsed with the database reachable all along.
    schedule = _renewal_starts(lease_s, [None, 0.0])
    (first, stuck), (second, renewed) = schedule
    assert first == pytest.approx(lease_s / 3) and not stuck
    assert renewed and second < lease_s


@pytest.mark.parametrize("lease_s", [0.1, 0.5, 3.0, 30.0, 3600.0])
def test_renewals_during_an_outage_are_spaced_and_bounded(lease_s: float) -> None:
    # Every renewal fails at once (the database is down): no busy loop before the lease's end,
    # and a third of a lease apart after it, as before the outage.
    schedule = _renewal_starts(lease_s, [DOWN] * 40)
    starts = [start for start, _ in schedule]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(gap >= 0.05 - 1e-9 for gap in gaps)
    # Halving what is left: a few more tries than the three of a lease that goes well.
    assert sum(start < lease_s for start in starts) <= 3 + math.log2(lease_s / 0.05)
    late = [gap for a, gap in zip(starts, gaps, strict=False) if a >= lease_s]
    assert late and all(gap == pytest.approx(renewal_interval_s(lease_s)) for gap in late)


@pytest.mark.parametrize("lease_s", [0.5, 3.0, 30.0])
def test_after_renewals_refused_at_once_the_next_still_lands_in_the_lease(lease_s: float) -> None:
    # Two renewals fail at once (the database restarting), the third is answered: it must go
    # out before the lease runs out, so each failed try waits at most half of what is left.
    schedule = _renewal_starts(lease_s, [DOWN, DOWN, 0.0])
    assert [renewed for _, renewed in schedule] == [False, False, True]
    assert schedule[-1][0] < lease_s


def test_too_little_left_means_the_same_to_bound_acquire_and_spacing() -> None:
    # At exactly twice the floor there is no room for another try after this one: all three
    # fall back to the whole lease / the ordinary interval together.
    edge = 0.1
    assert renewal_bound_s(30.0, edge) == 30.0
    assert renewal_acquire_bound_s(30.0, edge) == 30.0
    assert renewal_spacing_s(30.0, edge, renewed=False) == renewal_interval_s(30.0)
    assert renewal_bound_s(30.0, edge + 0.01) == pytest.approx((edge + 0.01) / 2)
    assert renewal_acquire_bound_s(30.0, edge + 0.01) == pytest.approx(edge + 0.01)


def test_renewals_that_go_well_come_a_third_of_a_lease_apart() -> None:
    assert renewal_interval_s(30.0) == 10.0
    assert renewal_interval_s(0.1) == 0.05  # the floor
    schedule = _renewal_starts(30.0, [0.01] * 4)
    assert [start for start, _ in schedule] == pytest.approx([10.0, 20.0, 30.0, 40.0])
    assert all(renewed for _, renewed in schedule)
    assert renewal_bound_s(30.0, 20.0) == 10.0
    assert renewal_bound_s(30.0, 0.05) == 30.0  # nothing left for another try: a whole lease
    assert renewal_bound_s(30.0, -5.0) == 30.0  # ran out: still worth renewing, unless taken


def test_a_renewal_may_wait_for_its_connection_until_the_lease_runs_out() -> None:
    # Not half of what is left, as its statement: a connect given up is begun again no sooner.
    assert renewal_acquire_bound_s(30.0, 20.0) == 20.0
    assert renewal_acquire_bound_s(30.0, 0.05) == 30.0  # too little left: a whole lease
    assert renewal_acquire_bound_s(30.0, -5.0) == 30.0


@pytest.mark.parametrize(
    ("phased", "claiming", "visible"),
    [
        (True, Phase.CLAIMING, True),  # committed
        (True, Phase.TAKING_OVER, True),
        (False, Phase.CLAIMING, False),  # a new row, unseen until it commits
        (False, Phase.TAKING_OVER, True),  # the row taken over stays visible
        (False, Phase.CLAIMING_BLIND, True),  # may have taken one over, unseen
    ],
)
def test_which_won_claims_other_attempts_may_see(
    phased: bool, claiming: Phase, visible: bool
) -> None:
    assert claim_visible(phased=phased, claiming=claiming) is visible
