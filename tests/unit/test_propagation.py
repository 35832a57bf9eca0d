from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import StepAmbiguous, StepUndeclared
from grpc_idempotency.core.keys import child_key
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.propagation import (
    CLOCK_TRUST,
    KeySource,
    Parent,
    choose_key,
    choose_step,
    start_decides,
)
from grpc_idempotency.core.retry import RetryPolicy, service_config
from grpc_idempotency.core.wire import REPLAYED_METADATA, carries_replay_marker

PARENT = Parent(
    method="/checkout.v1.OrderService/PlaceOrder",
    scope="tenant:a",
    key="order-1",
    steps=(
        Step(name="charge-card.v1", call="checkout.v1.PaymentService/Charge"),
        Step(name="send-confirmation.v1", call="checkout.v1.NotificationService/SendEmail"),
        Step(name="send-receipt.v1", call="checkout.v1.NotificationService/SendEmail"),
        Step(name="order-created-event.v1", outbox=True),
    ),
)
CHARGE = "/checkout.v1.PaymentService/Charge"
EMAIL = "/checkout.v1.NotificationService/SendEmail"


def choose(**kw: object) -> object:
    args: dict[str, object] = {
        "target": CHARGE,
        "target_keyed": True,
        "explicit_key": None,
        "parent": None,
        "named_step": None,
        "operation_key": None,
        "mint": ["minted"],
    }
    args.update(kw)
    return choose_key(**args)  # type: ignore[arg-type]


def test_order_of_precedence() -> None:
    assert choose(explicit_key="mine", parent=PARENT, operation_key="op") == choose(
        explicit_key="mine"
    )
    assert choose(explicit_key="mine").source is KeySource.EXPLICIT  # type: ignore[attr-defined]
    child = choose(parent=PARENT, operation_key="op")
    assert child.source is KeySource.CHILD  # type: ignore[attr-defined]
    assert child.key == child_key("tenant:a", "order-1", "charge-card.v1")  # type: ignore[attr-defined]
    assert choose(operation_key="op").key == "op"  # type: ignore[attr-defined]
    assert choose().source is KeySource.MINTED  # type: ignore[attr-defined]
    read = "/checkout.v1.CatalogService/Get"  # unkeyed, and no step calls it
    assert choose(target_keyed=False, parent=PARENT, target=read).source is KeySource.NONE  # type: ignore[attr-defined]


def test_a_declared_step_keys_its_target_whatever_the_target_descriptor_says() -> None:
    """A target whose descriptor on the caller's side has no idempotency option (keyed only by
    its server's MethodOverride, or an older descriptor) went unkeyed even when the parent
    declares a step for it: an optional-key target then ran again on every re-run."""
    child = choose(parent=PARENT, target_keyed=False)
    assert child.source is KeySource.CHILD  # type: ignore[attr-defined]
    assert child.key == child_key("tenant:a", "order-1", "charge-card.v1")  # type: ignore[attr-defined]
    # Undeclared and unkeyed: a read, untouched; no parent: the descriptor decides.
    assert choose(parent=PARENT, target_keyed=False, target="/x.v1.S/Read").source is KeySource.NONE  # type: ignore[attr-defined]
    assert choose(target_keyed=False).source is KeySource.NONE  # type: ignore[attr-defined]


def test_a_step_named_by_the_call_itself_makes_it_a_step_call_whatever_the_target() -> None:
    """A call naming its step in its own metadata (a generated step wrapper) to a target the
    caller's descriptor does not key: its name was dropped and it went unkeyed. It is the
    named step's call, refused if the parent declares none such for the target. A name from a
    ``step(...)`` block (which may hold reads too) and a call made while serving no keyed call
    are unchanged."""
    read = "/x.v1.S/Read"
    with pytest.raises(StepUndeclared, match=r"names step 'peek\.v1'"):
        choose(
            parent=PARENT,
            target_keyed=False,
            target=read,
            named_step="peek.v1",
            step_named_by_call=True,
        )
    block = choose(parent=PARENT, target_keyed=False, target=read, named_step="peek.v1")
    assert block.source is KeySource.NONE  # type: ignore[attr-defined]
    alone = choose(target_keyed=False, named_step="peek.v1", step_named_by_call=True)
    assert alone.source is KeySource.NONE  # type: ignore[attr-defined]
    declared = choose(
        parent=PARENT,
        target_keyed=False,
        named_step="charge-card.v1",
        step_named_by_call=True,
    )
    assert declared.key == child_key("tenant:a", "order-1", "charge-card.v1")  # type: ignore[attr-defined]


def test_a_keyed_target_without_a_declared_step_is_refused() -> None:
    with pytest.raises(StepUndeclared, match="without a declared step") as caught:
        choose(parent=PARENT, target="/checkout.v1.LedgerService/Post")
    assert caught.value.status_code is Code.FAILED_PRECONDITION


def test_several_steps_on_one_target_need_a_name() -> None:
    with pytest.raises(StepAmbiguous):
        choose(parent=PARENT, target=EMAIL)
    receipt = choose(parent=PARENT, target=EMAIL, named_step="send-receipt.v1")
    assert receipt.step == "send-receipt.v1"  # type: ignore[attr-defined]
    with pytest.raises(StepUndeclared, match="names step"):
        choose(parent=PARENT, target=EMAIL, named_step="charge-card.v1")


def test_renaming_a_step_changes_the_child_key() -> None:
    """Step names are a contract: the child key is derived from them, so a renamed (or
    re-versioned) step gets a new key, and an operation in flight across the rename would run
    that downstream effect a second time. Rename only by adding a new version."""
    renamed = Parent(
        PARENT.method, PARENT.scope, PARENT.key, (Step(name="charge-card.v2", call=CHARGE),)
    )
    before = choose(parent=PARENT)
    after = choose(parent=renamed)
    assert before.key != after.key  # type: ignore[attr-defined]


@given(st.integers(min_value=1, max_value=10), st.floats(min_value=0, max_value=0.999))
def test_backoff_is_bounded_and_grows(attempt: int, jitter: float) -> None:
    policy = RetryPolicy(max_attempts=11, initial_backoff_s=0.1, max_backoff_s=2.0)
    delay = policy.delay_s(
        attempt=attempt, code=Code.UNAVAILABLE, retry_after_ms=None, jitter=jitter
    )
    assert delay is not None and 0 <= delay <= min(2.0, 0.1 * 2 ** (attempt - 1))


def test_backoff_stays_at_its_ceiling_however_many_attempts() -> None:
    """2.0 ** 1024 overflows a float: ``Operation.call`` raised OverflowError at attempt 1026."""
    policy = RetryPolicy(max_attempts=100_000, initial_backoff_s=0.1, max_backoff_s=2.0)
    for attempt in (1025, 1026, 99_999):
        delay = policy.delay_s(
            attempt=attempt, code=Code.UNAVAILABLE, retry_after_ms=None, jitter=0.5
        )
        assert delay == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        {"initial_backoff_s": float("nan")},
        {"max_backoff_s": float("inf")},
        # Below inf: a bare OverflowError at the first retry (10**400), or a sleep for ever.
        {"max_backoff_s": 10**400},
        {"max_backoff_s": 1e30},
        {"multiplier": float("nan")},
        {"multiplier": float("inf")},
        {"multiplier": 0.5},
        {"initial_backoff_s": 0},
        {"initial_backoff_s": 2.0, "max_backoff_s": 1.0},  # the ceiling below the first wait
        # One code, not a set: "'Code' object is not iterable"; a str was read letter by letter.
        {"retryable": Code.UNAVAILABLE},
        {"retryable": "UNAVAILABLE"},
        # bytes too: b"\x0e" was read byte by byte, as the code 14 (UNAVAILABLE).
        {"retryable": b"\x0e"},
    ],
)
def test_retry_policy_refuses_backoffs_that_are_not_numbers(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        RetryPolicy(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"initial_backoff_s": "0.1"},
        {"max_backoff_s": None},
        {"multiplier": "2"},
        {"initial_backoff_s": True},
    ],
)
def test_retry_policy_refuses_backoffs_of_the_wrong_type_with_a_type_error(
    bad: dict[str, object],
) -> None:
    """Raw comparison TypeErrors named no field ("'<' not supported between instances of 'int'
    and 'str'"), and True was one second; then a ValueError: now a TypeError, as every other
    setting of the wrong type, naming the field and the value."""
    name, value = next(iter(bad.items()))
    with pytest.raises(TypeError, match=rf"^{name} must be a number(| of seconds), not {value!r}$"):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_retryable_codes_may_be_given_as_grpc_status_codes_or_numbers() -> None:
    """grpc.StatusCode members compared unequal to every Code: a policy given them (the natural
    thing to pass in a gRPC client) silently never retried."""
    import grpc

    for codes in ({grpc.StatusCode.RESOURCE_EXHAUSTED}, {8}, {Code.RESOURCE_EXHAUSTED}):
        policy = RetryPolicy(retryable=frozenset(codes))  # type: ignore[arg-type]
        assert policy.retryable == {Code.RESOURCE_EXHAUSTED}
        delay = policy.delay_s(
            attempt=1, code=Code.RESOURCE_EXHAUSTED, retry_after_ms=None, jitter=0.5
        )
        assert delay is not None
    for bad in ("UNAVAILABLE", 99, True, None):
        with pytest.raises(ValueError, match="not a gRPC status code"):
            RetryPolicy(retryable=frozenset({bad}))  # type: ignore[arg-type]


def test_retry_decisions() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert policy.delay_s(attempt=1, code=Code.ABORTED, retry_after_ms=700, jitter=0.5) == 0.7
    assert policy.delay_s(attempt=1, code=Code.ABORTED, retry_after_ms=-1, jitter=0.5) is None
    assert policy.delay_s(attempt=3, code=Code.ABORTED, retry_after_ms=None, jitter=0.5) is None
    assert (
        policy.delay_s(attempt=1, code=Code.FAILED_PRECONDITION, retry_after_ms=None, jitter=0.5)
        is None
    )
    assert (
        policy.delay_s(attempt=1, code=Code.INVALID_ARGUMENT, retry_after_ms=10, jitter=0.5) is None
    )
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (Code.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED"),
        (Code.INVALID_ARGUMENT, "IDEMPOTENCY_KEY_INVALID"),
        (Code.INVALID_ARGUMENT, "IDEMPOTENCY_KEY_MISSING"),
        (Code.INVALID_ARGUMENT, "IDEMPOTENCY_REQUEST_INVALID"),
        # Both FAILED_PRECONDITION too: the outbox's step kept with another message (the key
        # reused past its retention) and a response too large, recorded and so replayed.
        (Code.FAILED_PRECONDITION, "IDEMPOTENCY_OUTBOX_KEY_REUSED"),
        (Code.FAILED_PRECONDITION, "IDEMPOTENCY_RESPONSE_TOO_LARGE"),
    ],
)
def test_an_answer_every_attempt_gets_alike_is_never_retried(code: Code, reason: str) -> None:
    """Named here, not read from FINAL_REASONS: a reason left out of it was retried
    ``max_attempts`` times by a policy retrying its code. Another reason of the code, or
    none, is retried as the policy says."""
    policy = RetryPolicy(retryable=frozenset({code}))
    assert (
        policy.delay_s(attempt=1, code=code, retry_after_ms=None, jitter=0.5, reason=reason) is None
    )
    for retried in ("IDEMPOTENCY_KEY_IN_PROGRESS", None):
        delay = policy.delay_s(
            attempt=1, code=code, retry_after_ms=None, jitter=0.5, reason=retried
        )
        assert delay is not None


def test_a_replayed_error_is_never_retried() -> None:
    """A replay of a recorded error is what every later attempt gets: retried, a policy
    retrying its code spent ``max_attempts`` and their backoff on the same answer. The same
    error not replayed (its first, executed answer) is retried as the policy says."""
    policy = RetryPolicy(retryable=frozenset({Code.NOT_FOUND}))
    answer = {"attempt": 1, "code": Code.NOT_FOUND, "retry_after_ms": None, "jitter": 0.5}
    assert policy.delay_s(**answer, replayed=True) is None  # type: ignore[arg-type]
    assert policy.delay_s(**answer, replayed=False) is not None  # type: ignore[arg-type]
    assert policy.delay_s(**answer) is not None  # type: ignore[arg-type]


def test_the_replay_marker_is_its_entry_not_its_name() -> None:
    """What ``Operation.call`` reads to stop retrying: the marker entry itself, among others,
    not any entry of its name (a server's "false" is not a replay) nor any other entry."""
    assert carries_replay_marker((("x-a", "1"), *REPLAYED_METADATA, ("x-b", "2")))
    for metadata in (None, (), (("x-a", "1"),), ((REPLAYED_METADATA[0][0], "false"),)):
        assert not carries_replay_marker(metadata), metadata


def test_a_nan_max_attempts_is_refused() -> None:
    """NaN compares false with everything: ``attempt >= max_attempts`` never held, and a
    policy made with it retried for ever (bounded only by a deadline, if the caller had one)."""
    with pytest.raises(TypeError, match=r"^max_attempts must be a whole number, not nan$"):
        RetryPolicy(max_attempts=float("nan"))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("inf"), 1e308, 2.5, True, "5", None])
def test_a_max_attempts_that_is_not_a_whole_number_is_refused(bad: object) -> None:
    """inf passed the NaN guard and retried for ever, as NaN had (1e308 alike, for any caller's
    lifetime); "5" and None raised a raw comparison TypeError; True meant one attempt.
    ``DeliveryPolicy`` refuses them all. A TypeError, as every other wrong type."""
    with pytest.raises(TypeError, match=r"^max_attempts must be a whole number, not"):
        RetryPolicy(max_attempts=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1])
def test_too_few_max_attempts_is_a_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match=f"^max_attempts must be at least 1, not {bad}$"):
        RetryPolicy(max_attempts=bad)


def test_service_config_shape() -> None:
    assert service_config([]) == {}
    config = service_config([CHARGE, CHARGE, EMAIL], max_attempts=9)
    (method,) = cast("list[dict[str, Any]]", config["methodConfig"])
    assert method["name"] == [
        {"service": "checkout.v1.NotificationService", "method": "SendEmail"},
        {"service": "checkout.v1.PaymentService", "method": "Charge"},
    ]
    assert method["retryPolicy"]["maxAttempts"] == 5  # gRPC's cap


@pytest.mark.parametrize("attempts", [2, 3, 5])
def test_service_config_asks_for_the_attempts_given(attempts: int) -> None:
    config = service_config([CHARGE], max_attempts=attempts)
    (method,) = cast("list[dict[str, Any]]", config["methodConfig"])
    assert method["retryPolicy"]["maxAttempts"] == attempts


def test_one_attempt_is_no_retry_policy_and_fewer_is_refused() -> None:
    """gRPC's retry policy needs maxAttempts >= 2: one attempt was read as two."""
    assert service_config([CHARGE], max_attempts=1) == {}
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="max_attempts"):
            service_config([CHARGE], max_attempts=bad)  # type: ignore[arg-type]


def test_a_retired_step_no_longer_keys_calls() -> None:
    from datetime import UTC, datetime

    retired = Step(name="charge-card.v1", call=CHARGE, retired_at=datetime(2026, 1, 1, tzinfo=UTC))
    current = Step(name="charge-card.v2", call=CHARGE)
    parent = Parent(PARENT.method, PARENT.scope, PARENT.key, (retired, current))
    choice = choose(parent=parent)
    assert choice.step == "charge-card.v2"  # type: ignore[attr-defined]
    only_retired = Parent(PARENT.method, PARENT.scope, PARENT.key, (retired,))
    with pytest.raises(StepUndeclared):
        choose(parent=only_retired)


def test_an_operation_begun_before_a_retirement_keeps_the_retired_step() -> None:
    """Retiring charge-card.v1 for v2 must not make a crashed-and-retried order charge again:
    an operation that began before the retirement (it may already have run v1) keeps v1's child
    key; operations begun after it use v2."""
    from datetime import UTC, datetime

    retired_at = datetime(2026, 6, 1, tzinfo=UTC)
    steps = (
        Step(name="charge-card.v1", call=CHARGE, retired_at=retired_at),
        Step(name="charge-card.v2", call=CHARGE),
    )

    def step_for(started_at: datetime | None) -> str:
        parent = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, started_at)
        return choose(parent=parent).step  # type: ignore[attr-defined,no-any-return]

    assert step_for(datetime(2026, 5, 31, tzinfo=UTC)) == "charge-card.v1"
    assert step_for(datetime(2026, 6, 2, tzinfo=UTC)) == "charge-card.v2"
    assert step_for(None) == "charge-card.v2"  # a new operation


def test_versions_map_per_step_and_named_active_steps_still_work() -> None:
    """debit.v1 retired for debit.v2, refund.v1 active, all on one target: an old operation's
    refund stays refund.v1, its debit maps back to debit.v1; a new operation uses debit.v2."""
    from datetime import UTC, datetime

    t1, t2 = datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 6, 1, tzinfo=UTC)
    steps = (
        Step(name="debit.v1", call=CHARGE, retired_at=t1),
        Step(name="debit.v2", call=CHARGE, retired_at=t2),
        Step(name="debit.v3", call=CHARGE),
        Step(name="refund.v1", call=CHARGE),
    )

    def step_for(named: str, started_at: datetime | None) -> str:
        parent = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, started_at)
        return choose(parent=parent, named_step=named).step  # type: ignore[attr-defined,no-any-return]

    before_t1, between, after = (
        datetime(2026, 2, 1, tzinfo=UTC),
        datetime(2026, 4, 1, tzinfo=UTC),
        datetime(2026, 7, 1, tzinfo=UTC),
    )
    assert step_for("debit.v3", before_t1) == "debit.v1"
    assert step_for("debit.v3", between) == "debit.v2"
    assert step_for("debit.v3", after) == "debit.v3"
    assert step_for("debit.v3", None) == "debit.v3"
    assert step_for("refund.v1", before_t1) == "refund.v1"
    with pytest.raises(StepAmbiguous):
        choose(parent=Parent(PARENT.method, PARENT.scope, PARENT.key, steps, before_t1))


def test_a_retired_version_named_keys_the_call_as_its_active_version_does() -> None:
    """debit.v1 retired at t1 for v2, v2 at t2 for v3, with refund.v1 on the same target (so
    calls name their step). An operation begun before t1 keys its debit with v1 when the
    handler names the active v3; named "debit.v2", the retired version was used as is (as_of
    maps only an active step back): debit.v2's child key for an operation whose attempts
    naming v3 use debit.v1's, and the debit ran twice. Whichever version is named, the
    operation's start decides, as for the active one; a step retired with no active version
    is used as is."""
    from datetime import UTC, datetime

    t1, t2 = datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 6, 1, tzinfo=UTC)
    steps = (
        Step(name="debit.v1", call=CHARGE, retired_at=t1),
        Step(name="debit.v2", call=CHARGE, retired_at=t2),
        Step(name="debit.v3", call=CHARGE),
        Step(name="refund.v1", call=CHARGE),
        Step(name="fee.v1", call=CHARGE, retired_at=t1),
    )
    expected = {
        datetime(2026, 2, 1, tzinfo=UTC): "debit.v1",
        datetime(2026, 4, 1, tzinfo=UTC): "debit.v2",
        datetime(2026, 7, 1, tzinfo=UTC): "debit.v3",
        None: "debit.v3",
    }
    for started_at, used in expected.items():
        parent = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, started_at)
        for named in ("debit.v1", "debit.v2", "debit.v3"):
            choice = choose(parent=parent, named_step=named)
            assert choice.step == used, (started_at, named)  # type: ignore[attr-defined]
            assert choice.key == child_key(PARENT.scope, PARENT.key, used)  # type: ignore[attr-defined]
        # Retired with no active version of its name: used as named, for an operation begun
        # before its retirement (or with no start known); refused for one begun after it.
        if started_at is None or started_at < t1:
            assert choose(parent=parent, named_step="fee.v1").step == "fee.v1"  # type: ignore[attr-defined]
        else:
            with pytest.raises(StepUndeclared, match="retired at"):
                choose(parent=parent, named_step="fee.v1")


def test_a_step_retired_next_to_another_is_not_read_as_renamed_to_it() -> None:
    """charge-deposit.v1 retired (dropped, not renamed) next to charge-balance.v1, which was
    there all along, both calling Payments/Charge: an operation begun before the retirement
    already charged both, and a takeover must key the balance with charge-balance.v1's own
    child key. When a retired step with no active version was read as an earlier name of the
    only active step on its target, it got charge-deposit.v1's key: the downstream service
    replayed the deposit's outcome and the balance was never charged."""
    from datetime import UTC, datetime, timedelta

    t = datetime(2030, 1, 1, tzinfo=UTC)
    steps = (
        Step(name="charge-deposit.v1", call=CHARGE, retired_at=t),
        Step(name="charge-balance.v1", call=CHARGE),
    )
    for started_at in (t - timedelta(minutes=5), t + timedelta(minutes=5), None):
        parent = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, started_at)
        choice = choose(parent=parent)
        assert choice.step == "charge-balance.v1", started_at  # type: ignore[attr-defined]
        assert choice.key == child_key(PARENT.scope, PARENT.key, "charge-balance.v1")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("steps", "named", "started"),
    [
        pytest.param(
            # A name is its identity: a retired step is never read as an earlier name of
            # another (check-steps fails a rename; the way to change a step is a new version).
            (("post.v1", 1), ("record.v1", None)),
            None,
            [(0, "record.v1"), (2, "record.v1")],
            id="another-name-is-not-followed",
        ),
        pytest.param(
            # The same with a version of the retired name active on another target.
            (("post.v1", 1), ("record.v1", None), ("post.v2@email", None)),
            None,
            [(0, "record.v1")],
            id="a-version-on-another-target-is-not-followed-here",
        ),
        pytest.param(
            # A version bump, then another: each operation keeps the version it began with.
            (("post.v1", 1), ("post.v2", 3), ("post.v3", None)),
            None,
            [(0, "post.v1"), (2, "post.v2"), (4, "post.v3")],
            id="versions-in-turn",
        ),
        pytest.param(
            # One step retired while its neighbour on the target gets a new version: each
            # follows its own name only.
            (("refund.v1", 2), ("debit.v1", 2), ("debit.v2", None)),
            None,
            [(0, "debit.v1"), (3, "debit.v2")],
            id="each-name-its-own-versions",
        ),
    ],
)
def test_which_step_an_old_operation_keeps(
    steps: tuple[tuple[str, int | None], ...],
    named: str | None,
    started: list[tuple[int, str]],
) -> None:
    """``steps``: (name, day retired or None), "@email" for the other target; ``started``: (day
    the operation began, the step it keeps)."""
    from datetime import UTC, datetime

    def at(day: int) -> datetime:
        return datetime(2026, 6, day + 1, tzinfo=UTC)

    declared = tuple(
        Step(
            name=name.partition("@")[0],
            call=EMAIL if name.endswith("@email") else CHARGE,
            retired_at=None if day is None else at(day),
        )
        for name, day in steps
    )
    for day, step_name in started:
        parent = Parent(PARENT.method, PARENT.scope, PARENT.key, declared, at(day))
        assert choose(parent=parent, named_step=named).step == step_name, day  # type: ignore[attr-defined]


def test_a_step_retired_for_good_named_after_its_retirement_is_refused() -> None:
    """fee.v1 retired at t1 with no active version of its name, and a later change adds fee.v2
    on the same target: check-steps passes that (nothing calls a step retired for good, so a new
    version has nothing in flight to rekey). Named by handler code, fee.v1 kept keying the
    operations begun after its retirement with its child key, and once fee.v2 was added, a retry
    of one of them naming fee.v1 was keyed with fee.v2's (the fee charged twice). A retired step
    keys only the operations begun before its retirement, as as_of says; a later one is refused,
    as an unnamed call to a target with no active step is."""
    from datetime import UTC, datetime, timedelta

    from grpc_idempotency.core.step_contract import MethodSteps, check_contract

    t1 = datetime(2026, 3, 1, tzinfo=UTC)
    now, begun = datetime(2026, 4, 1, tzinfo=UTC), datetime(2026, 3, 15, tzinfo=UTC)
    before = (Step(name="fee.v1", call=CHARGE, retired_at=t1), Step(name="debit.v1", call=CHARGE))
    after = (*before, Step(name="fee.v2", call=CHARGE))
    retention = timedelta(days=90)
    report = check_contract(
        {PARENT.method: MethodSteps(retention=retention, steps=before)},
        {PARENT.method: MethodSteps(retention=retention, steps=after)},
        now=now,
    )
    assert report.ok, report.breaking  # check-steps allows adding fee.v2
    used: list[str] = []
    for steps in (before, after):
        parent = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, begun)
        try:
            used.append(choose_step(parent, CHARGE, "fee.v1").name)
        except StepUndeclared:
            used.append("refused")
    # The retry after the change must not use a child key the first attempt did not.
    assert used[0] in ("refused", used[1]), used
    early = Parent(PARENT.method, PARENT.scope, PARENT.key, before, t1 - timedelta(days=1))
    assert choose_step(early, CHARGE, "fee.v1").name == "fee.v1"


def test_an_unnamed_call_to_a_target_whose_steps_are_all_retired_says_so() -> None:
    """fee.v1 retired for good on Payments/Charge: an unnamed call to it was told to add a step
    declaration, which it has. It is refused still (unnamed, a step with another name added on
    the target later would take the call over), with the way out: name the retired step, which
    keys the operations begun before its retirement."""
    from datetime import UTC, datetime, timedelta

    t1 = datetime(2026, 3, 1, tzinfo=UTC)
    steps = (Step(name="fee.v1", call=CHARGE, retired_at=t1),)
    parent = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, t1 - timedelta(days=1))
    with pytest.raises(StepUndeclared, match=r"every step it declares calling it is retired"):
        choose(parent=parent)
    assert choose(parent=parent, named_step="fee.v1").step == "fee.v1"  # type: ignore[attr-defined]


def test_a_named_step_retired_for_good_keys_its_target_whatever_its_descriptor_says() -> None:
    """fee.v1 retired for good; a retry of an operation begun before the retirement names it, as
    the refusal of an unnamed call says to. The target's descriptor on the caller's side has no
    idempotency option (keyed by its server's MethodOverride only): the call went out unkeyed,
    as a read, and an optional-key target ran the fee a second time (an unnamed call too, where
    a keyed target refuses it). A declared step keys its target whatever the descriptor says,
    retired or not."""
    from datetime import UTC, datetime, timedelta

    t1 = datetime(2026, 3, 1, tzinfo=UTC)
    steps = (Step(name="fee.v1", call=CHARGE, retired_at=t1),)
    early = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, t1 - timedelta(days=1))
    child = choose(parent=early, target_keyed=False, named_step="fee.v1")
    assert child.source is KeySource.CHILD  # type: ignore[attr-defined]
    assert child.key == child_key(PARENT.scope, PARENT.key, "fee.v1")  # type: ignore[attr-defined]
    late = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, t1 + timedelta(days=1))
    with pytest.raises(StepUndeclared, match="retired at"):  # begun after: refused, not unkeyed
        choose(parent=late, target_keyed=False, named_step="fee.v1")
    with pytest.raises(StepUndeclared, match="every step it declares calling it is retired"):
        choose(parent=early, target_keyed=False)
    # A target no step calls: the descriptor decides, as before.
    assert choose(parent=early, target_keyed=False, target="/x.v1.S/Read").source is KeySource.NONE  # type: ignore[attr-defined]


def test_a_version_retired_for_good_keys_an_earlier_operation_with_the_version_it_ran() -> None:
    """fee.v1 retired at t1 for fee.v2; then fee.v2 retired for good (at the change's ship
    time, which check-steps passes). An operation begun before t1 ran fee.v1 (as_of); its retry
    naming fee.v2, the one the code called last, was keyed with fee.v2's child key, which the
    downstream service has never seen, and the fee was charged twice. It keeps fee.v1."""
    from datetime import UTC, datetime, timedelta

    from grpc_idempotency.core.step_contract import MethodSteps, check_contract

    t1 = datetime(2026, 3, 1, tzinfo=UTC)
    now = t1 + timedelta(hours=1)
    v1 = Step(name="fee.v1", call=CHARGE, retired_at=t1)
    versioned = (v1, Step(name="fee.v2", call=CHARGE))
    retired = (v1, Step(name="fee.v2", call=CHARGE, retired_at=now))
    retention = timedelta(days=1)
    assert check_contract(
        {PARENT.method: MethodSteps(retention=retention, steps=versioned)},
        {PARENT.method: MethodSteps(retention=retention, steps=retired)},
        now=now,
    ).ok
    begun = t1 - timedelta(minutes=5)
    for steps in (versioned, retired):
        parent = Parent(PARENT.method, PARENT.scope, PARENT.key, steps, begun)
        assert choose_step(parent, CHARGE, "fee.v2").name == "fee.v1", steps
        assert choose_step(parent, CHARGE, "fee.v1").name == "fee.v1", steps
    # Begun in between, it ran fee.v2, and keeps it; named fee.v1, it is refused, as before.
    between = Parent(PARENT.method, PARENT.scope, PARENT.key, retired, t1 + timedelta(minutes=5))
    assert choose_step(between, CHARGE, "fee.v2").name == "fee.v2"
    with pytest.raises(StepUndeclared, match="retired at"):
        choose_step(between, CHARGE, "fee.v1")


def test_default_retryable_codes_are_the_documented_three() -> None:
    # README: the client retries UNAVAILABLE, ABORTED and DEADLINE_EXCEEDED by default.
    policy = RetryPolicy()
    assert policy.retryable == {Code.UNAVAILABLE, Code.ABORTED, Code.DEADLINE_EXCEEDED}
    for code in policy.retryable:
        assert policy.delay_s(attempt=1, code=code, retry_after_ms=None, jitter=0.5) is not None


def test_a_multiplier_of_one_is_a_constant_backoff() -> None:
    policy = RetryPolicy(multiplier=1.0, initial_backoff_s=0.2, max_backoff_s=5.0)
    delays = [
        policy.delay_s(attempt=a, code=Code.UNAVAILABLE, retry_after_ms=None, jitter=0.5)
        for a in (1, 2, 4)
    ]
    assert delays == [0.1, 0.1, 0.1]


def test_an_atomic_attempt_reads_its_start_only_within_clock_trust_of_a_retirement() -> None:
    """Within ``CLOCK_TRUST`` of a declared step's retirement, before or after it, a replica's
    clock may choose another version than the database's (``start_decides``); further away, or
    with no step retired, the two choose alike and the call saves the round trip."""
    now = datetime(2030, 1, 1, tzinfo=UTC)
    active = Step(name="e.v2", outbox=True)

    def retired(at: timedelta) -> Step:
        return Step(name="e.v1", outbox=True, retired_at=now + at)

    for at, reads in [
        (CLOCK_TRUST, True),
        (-CLOCK_TRUST, True),
        (timedelta(0), True),
        (CLOCK_TRUST + timedelta(microseconds=1), False),
        (-CLOCK_TRUST - timedelta(microseconds=1), False),
    ]:
        assert start_decides([active, retired(at)], now) is reads, at
    assert not start_decides([active], now)
    assert not start_decides([], now)


def test_a_set_is_suggested_only_for_one_code() -> None:
    with pytest.raises(ValueError, match=r"retryable=frozenset\(\{<Code.UNAVAILABLE"):
        RetryPolicy(retryable=Code.UNAVAILABLE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"not None$"):  # not "frozenset({None})"
        RetryPolicy(retryable=None)  # type: ignore[arg-type]
