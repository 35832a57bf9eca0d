"""The wire contract of DESIGN.md, atomic mode: one test (at least) per row of the table."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    StaticScope,
    Store,
)
from grpc_idempotency.core.codes import Code
from tests.support.ledger import RunningLedger, fresh, ledger_rows, running_ledger
from tests.support.waiting import until
from tests.support.wire import call_raw
from tests.unit.test_policy import method_with

POST = "/testsvc.v1.LedgerService/Post"
SVC = "/testsvc.v1.LedgerService/"
PHASED = SVC + "PostPhased"
FAIL_OPEN = SVC + "PostFailOpen"


async def record_row(store: Store, scope: str, key: str) -> dict[str, object] | None:
    row = await store.pool.fetchrow(
        "SELECT * FROM grpc_idempotency.records WHERE scope = $1 AND key = $2", scope, key
    )
    return None if row is None else dict(row)


def post(account: str, amount: int = 10, behaviour: str = "") -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=amount, behaviour=behaviour)


async def test_method_without_option_passes_through_untouched(
    ledger: RunningLedger, store: Store
) -> None:
    key = fresh()
    answer = await ledger.call(SVC + "Peek", testsvc_pb2.PeekRequest(account="x"), key)
    assert answer.code is grpc.StatusCode.OK
    assert not answer.replayed
    assert await record_row(store, "tenant:tenant-a", key) is None


async def test_missing_key_on_required_method(ledger: RunningLedger, store: Store) -> None:
    account = fresh("acct")
    answer = await ledger.call(POST, post(account), None)
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT
    assert answer.reason() == "IDEMPOTENCY_KEY_MISSING"
    assert ledger.service.executions == 0
    assert await ledger_rows(store, account) == 0


async def test_new_key_executes_once_and_commits_with_the_outcome(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    answer = await ledger.call(POST, post(account), key)
    assert answer.code is grpc.StatusCode.OK and not answer.replayed
    assert await ledger_rows(store, account) == 1
    row = await record_row(store, "tenant:tenant-a", key)
    assert row is not None and row["state"] == "completed" and row["status_code"] == 0
    assert row["response"] == answer.body
    assert row["method"] == POST


async def test_completed_key_replays_identical_bytes(ledger: RunningLedger, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    first = await ledger.call(POST, post(account), key)
    second = await ledger.call(POST, post(account), key)
    third = await ledger.call(POST, post(account), key)
    assert first.body and second.body == first.body and third.body == first.body
    assert not first.replayed and second.replayed and third.replayed
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_excluded_fields_do_not_change_the_request(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    a = post(account)
    a.sent_at.seconds = 1
    b = post(account)
    b.sent_at.seconds = 2
    first = await ledger.call(POST, a, key)
    second = await ledger.call(POST, b, key)
    assert second.replayed and second.body == first.body
    assert await ledger_rows(store, account) == 1


async def test_same_key_with_mutated_payload_is_refused(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    await ledger.call(POST, post(account, 10), key)
    answer = await ledger.call(POST, post(account, 11), key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.reason() == "IDEMPOTENCY_KEY_REUSED"
    assert ledger.service.executions == 1
    assert await ledger_rows(store, account) == 1


async def test_same_key_on_another_method_is_refused(ledger: RunningLedger, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    await ledger.call(POST, post(account), key)
    answer = await ledger.call(SVC + "PostOptional", post(account), key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.reason() == "IDEMPOTENCY_KEY_REUSED"
    assert await ledger_rows(store, account) == 1


async def test_two_scopes_with_one_key_are_independent(ledger: RunningLedger, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    a = await ledger.call(POST, post(account), key, "tenant-a")
    b = await ledger.call(POST, post(account), key, "tenant-b")
    assert a.code is b.code is grpc.StatusCode.OK
    assert not a.replayed and not b.replayed
    assert a.body != b.body  # b never sees a's stored response
    # Even a mutated payload under tenant-b is its own operation, not a mismatch with tenant-a.
    c = await ledger.call(POST, post(account, 99), key, "tenant-c")
    assert c.code is grpc.StatusCode.OK
    assert await ledger_rows(store, account) == 3
    again = await ledger.call(POST, post(account), key, "tenant-b")
    assert again.replayed and again.body == b.body


def _raises(context: object) -> str:
    raise LookupError("no tenant claim in token eyJhbGciOi")


WIDE = "\U0001f600" * 1024  # 1024 characters, 4096 bytes: more than a record's index holds


@pytest.mark.parametrize(
    ("resolver", "code", "reason"),
    [
        (_raises, grpc.StatusCode.INTERNAL, "IDEMPOTENCY_SCOPE_RESOLVER_FAILED"),
        (lambda context: 42, grpc.StatusCode.INTERNAL, "IDEMPOTENCY_SCOPE_RESOLVER_FAILED"),
        (lambda context: b"tenant", grpc.StatusCode.INTERNAL, "IDEMPOTENCY_SCOPE_RESOLVER_FAILED"),
        (lambda context: "", grpc.StatusCode.UNAUTHENTICATED, "IDEMPOTENCY_SCOPE_UNAVAILABLE"),
        (lambda context: WIDE, grpc.StatusCode.UNAUTHENTICATED, "IDEMPOTENCY_SCOPE_UNAVAILABLE"),
        (
            lambda context: "t\udcff",
            grpc.StatusCode.UNAUTHENTICATED,
            "IDEMPOTENCY_SCOPE_UNAVAILABLE",
        ),
        (lambda context: "t\x00", grpc.StatusCode.UNAUTHENTICATED, "IDEMPOTENCY_SCOPE_UNAVAILABLE"),
        # Written to log lines and the tools' output, where a terminal acts on them, and sent
        # by forward_scope as a header gRPC refuses: a token's tenant claim, a certificate name.
        (
            lambda context: "t\nforged log line",
            grpc.StatusCode.UNAUTHENTICATED,
            "IDEMPOTENCY_SCOPE_UNAVAILABLE",
        ),
        (
            lambda context: "t\x9b2J",
            grpc.StatusCode.UNAUTHENTICATED,
            "IDEMPOTENCY_SCOPE_UNAVAILABLE",
        ),
        # A bidi override reorders what an operator reads (tenant:acme shown for tenant:emca).
        (
            lambda context: "tenant:\u202eemca",
            grpc.StatusCode.UNAUTHENTICATED,
            "IDEMPOTENCY_SCOPE_UNAVAILABLE",
        ),
    ],
    ids=[
        "raises",
        "int",
        "bytes",
        "empty",
        "4096-bytes",
        "surrogate",
        "nul",
        "newline",
        "c1-csi",
        "rlo",
    ],
)
@pytest.mark.parametrize("method", [POST, PHASED, FAIL_OPEN])
async def test_a_scope_resolver_that_fails_is_refused_before_the_handler(
    store: Store, resolver: Any, code: grpc.StatusCode, reason: str, method: str
) -> None:
    """A resolver's exception (its text may quote a token) or a result the store cannot hold is
    a library error before anything runs. They were UNKNOWN with the exception's text; the
    4096-byte scope ran an atomic handler, then failed at the record's index, and made a
    fail-open phased method run once per attempt."""
    async with running_ledger(store, scope=resolver) as ledger:
        key = fresh()
        for _ in range(2):
            answer = await ledger.call(method, post(fresh("acct")), key)
            assert (answer.code, answer.reason()) == (code, reason), answer.details
            assert "eyJ" not in (answer.details or "")
        assert ledger.service.executions == 0


async def test_a_failing_scope_resolver_is_logged_at_most_once_a_minute(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Callers may be able to make a resolver fail (a malformed token): a traceback per call
    would let them flood the server's log."""
    async with running_ledger(store, scope=_raises) as ledger:
        for _ in range(3):
            answer = await ledger.call(POST, post(fresh("acct")), fresh())
            assert answer.reason() == "IDEMPOTENCY_SCOPE_RESOLVER_FAILED"
    logged = [r for r in caplog.records if "scope resolver" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


async def _tenant_of(context: object) -> str:
    return "tenant:a"


_CLAIMS: dict[str, str] = {}


@pytest.mark.parametrize(
    ("resolve", "said"),
    [
        # A token's claim looked up with dict.get: None for a token without one.
        (lambda context: _CLAIMS.get("tenant"), "NoneType"),
        # An async lookup behind a plain function (a lambda, a partial of an async callable).
        (_tenant_of, "coroutine"),
    ],
    ids=["none", "coroutine"],
)
async def test_a_scope_resolver_returning_no_str_is_logged_at_most_once_a_minute(
    store: Store, caplog: pytest.LogCaptureFixture, resolve: Any, said: str
) -> None:
    """The server's bug, answered INTERNAL with no detail for the caller, as a resolver's
    exception is: the server's log must say what the resolver returned. It said nothing, and a
    coroutine returned was left unawaited (a RuntimeWarning at garbage collection, per call)."""
    returned: list[Any] = []

    def resolver(context: object) -> Any:
        returned.append(resolve(context))
        return returned[-1]

    async with running_ledger(store, scope=resolver) as ledger:
        for _ in range(3):
            answer = await ledger.call(POST, post(fresh("acct")), fresh())
            assert answer.code is grpc.StatusCode.INTERNAL
            assert answer.reason() == "IDEMPOTENCY_SCOPE_RESOLVER_FAILED"
        assert ledger.service.executions == 0
    logged = [r for r in caplog.records if "scope resolver" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert said in logged[0].getMessage()
    for value in returned:  # a coroutine closed: nothing left to await or to warn about
        assert not asyncio.iscoroutine(value) or inspect.getcoroutinestate(value) == "CORO_CLOSED"


def test_an_async_scope_resolver_is_refused_at_construction(store: Store) -> None:
    async def resolver(context: object) -> str:
        return "tenant"

    with pytest.raises(TypeError, match="plain"):
        IdempotencyInterceptor(store, scope=resolver)  # type: ignore[arg-type]  # on purpose
    with pytest.raises(ValueError, match="1-1024 bytes"):
        StaticScope("\U0001f600" * 300)


def test_a_resolver_class_given_instead_of_a_resolver_is_refused_at_construction(
    store: Store,
) -> None:
    """``scope=MetadataScope`` (the parentheses forgotten) is callable: each call built a
    resolver from its context and failed, every keyed call INTERNAL."""
    for resolver in (MetadataScope, StaticScope):
        with pytest.raises(TypeError, match=rf"{resolver.__name__}\(\.\.\.\)"):
            IdempotencyInterceptor(store, scope=resolver)  # type: ignore[arg-type]


async def test_an_unawaited_store_is_refused_at_construction(pg_dsn: str) -> None:
    """``IdempotencyInterceptor(Store.connect(dsn))``, the ``await`` forgotten: every call failed
    with UNKNOWN ("'coroutine' object has no attribute ..."), and the coroutine was reported
    never awaited. Refused when the interceptor is built, with the fix named."""
    pending = Store.connect(pg_dsn)
    with pytest.raises(TypeError, match=r"not a coroutine: await it \(store = await Store"):
        IdempotencyInterceptor(pending)  # type: ignore[arg-type]  # on purpose
    assert inspect.getcoroutinestate(pending) == "CORO_CLOSED"  # no "never awaited" warning


async def test_a_store_that_is_not_a_store_is_refused_at_construction(
    store: Store, pg_dsn: str
) -> None:
    """The store's asyncpg pool, or its DSN, was accepted: every keyed call then failed with
    UNKNOWN ("'Pool' object has no attribute ...")."""
    for wrong in (store.pool, pg_dsn, None):
        with pytest.raises(TypeError, match="store must be a Store or ShardedStores, not a"):
            IdempotencyInterceptor(wrong)  # type: ignore[arg-type]  # on purpose


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("herd_release", 8),
        ("telemetry", True),
        ("sync_executor", 4),
        ("replay_cache", 5000),
    ],
)
def test_an_option_of_the_wrong_type_is_refused_at_construction(
    store: Store, option: str, value: object
) -> None:
    """Accepted, ``herd_release=8`` answered every keyed call UNKNOWN after its write had
    committed ('int' object has no attribute 'per_batch'), ``telemetry=True`` every keyed call
    UNKNOWN, ``sync_executor=4`` every sync handler's call; ``replay_cache=5000`` (a size, say)
    was taken for True, the default cache."""
    with pytest.raises(TypeError, match=f"^{option} must be "):
        IdempotencyInterceptor(store, **{option: value})  # type: ignore[arg-type]


async def test_missing_scope_is_refused_before_the_store(ledger: RunningLedger) -> None:
    answer = await call_raw(ledger.channel, POST, post(fresh()), (("idempotency-key", fresh()),))
    assert answer.code is grpc.StatusCode.UNAUTHENTICATED
    assert answer.reason() == "IDEMPOTENCY_SCOPE_UNAVAILABLE"
    assert ledger.service.executions == 0


@pytest.mark.parametrize(
    "behaviour",
    [
        "NOT_FOUND",
        "INVALID_ARGUMENT",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "OUT_OF_RANGE",
        "set:NOT_FOUND",
        "rich",
        "rich-before",
        "int:5",
        "set-int:5",
    ],
)
async def test_deterministic_error_is_recorded_and_its_writes_rolled_back(
    ledger: RunningLedger, store: Store, behaviour: str
) -> None:
    key, account = fresh(), fresh("acct")
    first = await ledger.call(POST, post(account, behaviour=behaviour), key)
    assert first.code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN)
    assert await ledger_rows(store, account) == 0  # the handler wrote, and it was rolled back
    second = await ledger.call(POST, post(account, behaviour=behaviour), key)
    assert second.replayed
    assert (second.code, second.details) == (first.code, first.details)
    assert second.trailing.get("grpc-status-details-bin") == first.trailing.get(
        "grpc-status-details-bin"
    )
    assert ledger.service.executions == 1
    row = await record_row(store, "tenant:tenant-a", key)
    assert (
        row is not None
        and row["state"] == "completed"
        and row["status_code"] == first.code.value[0]
    )
    if behaviour.startswith("rich"):
        assert first.reason() == "ACCOUNT_MISSING"


async def test_a_methods_own_recorded_errors_replace_the_default_set(store: Store) -> None:
    """recorded_errors set for the method: NOT_FOUND only. INVALID_ARGUMENT (recorded by
    default) is then released and runs again; NOT_FOUND is recorded and replayed."""
    overrides = {POST.lstrip("/"): MethodOverride(recorded_errors={Code.NOT_FOUND})}
    account = fresh("acct")
    async with running_ledger(store, overrides=overrides) as ledger:
        released_key, recorded_key = fresh(), fresh()
        for _ in range(2):
            invalid = await ledger.call(
                POST, post(account, behaviour="INVALID_ARGUMENT"), released_key
            )
            assert invalid.code is grpc.StatusCode.INVALID_ARGUMENT and not invalid.replayed
        assert ledger.service.attempts[released_key] == 2
        first = await ledger.call(POST, post(account, behaviour="NOT_FOUND"), recorded_key)
        again = await ledger.call(POST, post(account, behaviour="NOT_FOUND"), recorded_key)
        assert first.code is grpc.StatusCode.NOT_FOUND and not first.replayed
        assert again.code is grpc.StatusCode.NOT_FOUND and again.replayed
        assert ledger.service.attempts[recorded_key] == 1
    assert await record_row(store, "tenant:tenant-a", released_key) is None
    assert await ledger_rows(store, account) == 0


@pytest.mark.parametrize(
    "behaviour",
    [
        "UNAVAILABLE",
        "RESOURCE_EXHAUSTED",
        "ABORTED",
        "INTERNAL",
        "UNKNOWN",
        "raise",
        "set:UNAVAILABLE",
        "int:14",
        "set-int:14",
    ],
)
async def test_transient_error_releases_the_claim(
    ledger: RunningLedger, store: Store, behaviour: str
) -> None:
    key, account = fresh(), fresh("acct")
    first = await ledger.call(POST, post(account, behaviour=behaviour), key)
    assert first.code is not grpc.StatusCode.OK
    assert await ledger_rows(store, account) == 0
    assert await record_row(store, "tenant:tenant-a", key) is None
    # The retry runs the handler again (here it succeeds: same fingerprint, so the payload is the
    # same; the behaviour field is what fails, so retry a fresh account under a fresh key).
    again = await ledger.call(POST, post(account, behaviour=behaviour), key)
    assert again.code is first.code and not again.replayed
    assert ledger.service.executions == 2


async def test_cancelled_call_releases_the_claim(ledger: RunningLedger, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    # 1 s: the handler must have begun (its claim made) before the deadline, which a loaded CI
    # machine could take 0.3 s over; the deadline still ends it asleep.
    answer = await ledger.call(POST, post(account, behaviour="sleep:2000"), key, timeout=1.0)
    assert answer.code is grpc.StatusCode.DEADLINE_EXCEEDED

    # The server notices the deadline, cancels the handler and rolls the claim back.
    async def released() -> bool:
        return (
            ledger.service.executions == 1
            and await record_row(store, "tenant:tenant-a", key) is None
        )

    await until("the cancelled call's claim to be rolled back", released)
    retry = await ledger.call(POST, post(account, behaviour="sleep:0"), fresh())
    assert retry.code is grpc.StatusCode.OK
    assert await ledger_rows(store, account) == 1  # only the second, fresh operation wrote


async def test_key_past_retention_is_treated_as_new(ledger: RunningLedger, store: Store) -> None:
    key, account = fresh(), fresh("acct")
    method = SVC + "PostShortLived"  # retention 0.3 s
    first = await ledger.call(method, post(account), key)
    replay = await ledger.call(method, post(account), key)
    assert replay.replayed and replay.body == first.body

    # Wait for the database's clock, not ours, to pass the record's expiry: the later of
    # expires_at (retention from the claim) and retention from the completion, which comes
    # later when the machine is slow.
    async def expired() -> bool:
        past: bool = await store.pool.fetchval(
            "SELECT GREATEST(expires_at, completed_at + retention) <= clock_timestamp()"
            " FROM grpc_idempotency.records"
            " WHERE scope = $1 AND key = $2",
            "tenant:tenant-a",
            key,
        )
        return past

    await until("the record to pass its expires_at", expired)
    again = await ledger.call(method, post(account), key)
    assert again.code is grpc.StatusCode.OK and not again.replayed
    assert again.body != first.body
    assert await ledger_rows(store, account) == 2
    row = await record_row(store, "tenant:tenant-a", key)
    assert row is not None and row["fencing_token"] == 2  # the expired row was taken over in place


async def test_expired_record_with_another_payload_is_a_new_operation(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    await ledger.call(POST, post(account, 1), key)
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET expires_at = clock_timestamp() - interval '1 second',"
        " retention = interval '0'"
        " WHERE scope = $1 AND key = $2",
        "tenant:tenant-a",
        key,
    )
    # Another replica: the first one's replay cache cannot know that the record was aged by hand
    # (with real time it drops the outcome when the record expires: test_replay_cache.py).
    async with running_ledger(store) as replica:
        answer = await replica.call(POST, post(account, 2), key)
    assert answer.code is grpc.StatusCode.OK and not answer.replayed
    assert await ledger_rows(store, account) == 2


async def _plant_in_progress(
    store: Store, key: str, request: testsvc_pb2.PostRequest, lease_s: float
) -> None:
    """An in-progress claim committed by some other attempt (as phased mode leaves one)."""
    from grpc_idempotency.core.fingerprint import Fingerprinter

    fingerprint = Fingerprinter.for_method(POST, testsvc_pb2.PostRequest.DESCRIPTOR)(request)
    await store.pool.execute(
        "INSERT INTO grpc_idempotency.records (scope, key, method, fingerprint, state, fencing_token,"
        " locked_until, expires_at) VALUES ($1, $2, $3, $4, 'in_progress', 7,"
        " clock_timestamp() + make_interval(secs => $5), clock_timestamp() + interval '1 hour')",
        "tenant:tenant-a",
        key,
        POST,
        fingerprint,
        lease_s,
    )


async def test_in_progress_claim_with_expired_lease_is_taken_over(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    await _plant_in_progress(store, key, post(account), lease_s=-1)
    answer = await ledger.call(POST, post(account), key)
    assert answer.code is grpc.StatusCode.OK and not answer.replayed
    row = await record_row(store, "tenant:tenant-a", key)
    assert row is not None and row["state"] == "completed" and row["fencing_token"] == 8
    assert await ledger_rows(store, account) == 1


async def test_in_progress_claim_with_another_fingerprint_is_a_mismatch(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    await _plant_in_progress(store, key, post(account, 1), lease_s=-1)
    answer = await ledger.call(POST, post(account, 2), key)
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.reason() == "IDEMPOTENCY_KEY_REUSED"
    assert ledger.service.executions == 0


async def test_live_claim_elsewhere_ends_in_aborted_with_retry_info(store: Store) -> None:
    key, account = fresh(), fresh("acct")
    await _plant_in_progress(store, key, post(account), lease_s=30)
    # The wait is ended by max_wait, far from the deadline. Ended by a 0.5 s deadline, the
    # answer left 100 ms before it (lifecycle.ANSWER_MARGIN_S), and on two loaded cores the
    # client's deadline now and then won that race: DEADLINE_EXCEEDED, with no retry info.
    overrides = {POST[1:]: MethodOverride(max_wait=timedelta(seconds=0.4))}
    async with running_ledger(store, overrides=overrides) as ledger:
        answer = await ledger.call(POST, post(account), key, timeout=10)
    assert answer.code is grpc.StatusCode.ABORTED
    assert answer.reason() == "IDEMPOTENCY_KEY_IN_PROGRESS"
    assert answer.initial == {}  # nothing sent before the error: gRPC's own retries stay possible
    delay = answer.retry_delay_ms()
    assert delay is not None and 50 <= delay <= 2000
    assert answer.trailing["grpc-retry-pushback-ms"] == str(delay)
    assert ledger.service.executions == 0


async def test_optional_key(ledger: RunningLedger, store: Store) -> None:
    account = fresh("acct")
    method = SVC + "PostOptional"
    a = await ledger.call(method, post(account), None)
    b = await ledger.call(method, post(account), None)
    assert a.code is b.code is grpc.StatusCode.OK
    assert await ledger_rows(store, account) == 2  # no key: no deduplication, each call commits
    failed = await ledger.call(method, post(account, behaviour="NOT_FOUND"), None)
    assert failed.code is grpc.StatusCode.NOT_FOUND
    assert await ledger_rows(store, account) == 2  # an error rolls the unkeyed call back
    key = fresh()
    c = await ledger.call(method, post(account), key)
    d = await ledger.call(method, post(account), key)
    assert d.replayed and d.body == c.body
    assert await ledger_rows(store, account) == 3


async def test_an_unkeyed_response_that_cannot_be_serialized_commits_nothing(
    ledger: RunningLedger, store: Store
) -> None:
    """An optional-key method called without a key whose handler wrote, then returned what
    gRPC cannot serialize (None): the call fails, and so must its transaction, as with a key.
    Serialized only after the commit, the write stood while the client was answered UNKNOWN,
    and each retry (no key: nothing to dedupe on) wrote it again."""
    account = fresh("acct")
    method = SVC + "PostOptional"
    for key in (fresh(), None):
        answer = await ledger.call(method, post(account, behaviour="return-none"), key)
        assert answer.code is grpc.StatusCode.UNKNOWN, answer
        assert await ledger_rows(store, account) == 0, f"key={key}"


async def test_sync_handler_is_offloaded_and_deduplicated(
    ledger: RunningLedger, store: Store
) -> None:
    key, account = fresh(), fresh("acct")
    method = SVC + "PostSync"
    blocked = asyncio.ensure_future(ledger.call(method, post(account, behaviour="block"), key))
    assert await asyncio.to_thread(ledger.service.sync_started.wait, 10)
    # The sync handler is blocked on a thread; the event loop still serves other calls.
    peek = await ledger.call(SVC + "Peek", testsvc_pb2.PeekRequest(account=account), None)
    assert peek.code is grpc.StatusCode.OK
    ledger.service.sync_release.set()
    first = await blocked
    assert first.code is grpc.StatusCode.OK
    again = await ledger.call(method, post(account, behaviour="block"), key)
    assert again.replayed and again.body == first.body
    assert await ledger_rows(store, account) == 1
    err_key = fresh()
    e1 = await ledger.call(method, post(account, behaviour="NOT_FOUND"), err_key)
    e2 = await ledger.call(method, post(account, behaviour="NOT_FOUND"), err_key)
    assert e1.code is e2.code is grpc.StatusCode.NOT_FOUND and e2.replayed
    assert await ledger_rows(store, account) == 1


async def test_current_call_outside_a_handler_is_a_clear_error() -> None:
    from grpc_idempotency import NotInIdempotentCall, current_call

    with pytest.raises(NotInIdempotentCall):
        current_call()


@pytest.mark.parametrize("behaviour", ["commit", "commit-then:NOT_FOUND"])
async def test_a_handler_that_ends_the_transaction_itself_gets_no_success(
    ledger: RunningLedger, store: Store, behaviour: str
) -> None:
    """The outcome cannot be stored with the writes any more: the call must not report success
    (or a recorded error) as if it had been, nor anything a client retries (the writes committed
    with the handler's COMMIT would be made again): INTERNAL, reason
    IDEMPOTENCY_HANDLER_DATABASE_ERROR (tests/integration/test_handler_ends_transaction.py)."""
    key, account = fresh(), fresh("acct")
    answer = await ledger.call(POST, post(account, behaviour=behaviour), key)
    assert answer.code is grpc.StatusCode.INTERNAL
    assert answer.reason() == "IDEMPOTENCY_HANDLER_DATABASE_ERROR"


@pytest.mark.parametrize(
    ("configure", "streaming"),
    [
        (lambda o: setattr(o, "key", 7), False),  # no value of its enum: found on first use
        (lambda o: o.SetInParent(), True),  # keyed options on a server-streaming method
    ],
    ids=["bad-option", "streaming"],
)
async def test_a_method_whose_options_cannot_be_compiled_is_refused_internal(
    store: Store, configure: Any, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Options found bad when a method is first called (its service not given to the
    interceptor) raised PolicyError out of the interception, which grpc answers UNKNOWN
    "Unexpected <class 'PolicyError'>". They are answered with the error's own status and
    reason, on every call (README: "on every call of that method, logged once"), and the
    handler does not run."""
    method = method_with(configure, streaming=streaming)
    request_class: Any = message_factory.GetMessageClass(
        method.input_type
    )  # fields made at run time
    ran: list[object] = []

    async def unary(request: Any, context: Any) -> Any:
        ran.append(request)
        return request

    async def stream(request: Any, context: Any) -> Any:
        ran.append(request)
        yield request

    options: dict[str, Callable[..., Any]] = {
        "request_deserializer": request_class.FromString,
        "response_serializer": request_class.SerializeToString,
    }
    handler = (
        grpc.unary_stream_rpc_method_handler(stream, **options)
        if streaming
        else grpc.unary_unary_rpc_method_handler(unary, **options)
    )
    service = method.containing_service.full_name
    server = grpc.aio.server(interceptors=[IdempotencyInterceptor(store, scope=StaticScope("s"))])
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(service, {"Do": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    answers: list[tuple[grpc.StatusCode, str | None, Any]] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            path = f"/{service}/Do"
            for _ in range(2):
                metadata = (("idempotency-key", fresh()),)
                if streaming:
                    call = channel.unary_stream(
                        path,
                        request_serializer=request_class.SerializeToString,
                        response_deserializer=None,
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for _ in call(request_class(a="x"), metadata=metadata, timeout=10):
                            pass
                    status = rpc_status.from_call(refused.value)  # type: ignore[arg-type]  # grpc-stubs: from_call takes an AioRpcError too
                    assert status is not None
                    info = error_details_pb2.ErrorInfo()
                    assert len(status.details) == 1 and status.details[0].Unpack(info)
                    assert info.domain == "grpc-idempotency" and not info.metadata
                    answers.append((refused.value.code(), refused.value.details(), info.reason))
                else:
                    answer = await call_raw(channel, path, request_class(a="x"), metadata)
                    answers.append((answer.code, answer.details, answer.reason()))
    finally:
        await server.stop(None)
    for code, details, reason in answers:
        assert code is grpc.StatusCode.INTERNAL, details
        assert reason == "IDEMPOTENCY_POLICY_INVALID"
        assert "Unexpected" not in (details or "")
    assert ran == []
    logged = [r for r in caplog.records if "bad idempotency options" in r.getMessage()]
    assert len(logged) == 1, logged
