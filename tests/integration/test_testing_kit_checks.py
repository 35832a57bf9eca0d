"""The conformance checks a review found missing or blind catch what they are for, and pass the
same handler written correctly:

- lost connection: a handler that, when the call's connection is lost, carries on over a fresh
  connection from the pool (a common "resilience" pattern) passed every other check and wrote
  twice for one key;
- keyless: the kit always sent a key, so a method left KEY_OPTIONAL by mistake, or a
  key-optional handler that fails without one, passed;
- sequential replay: a handler that sent what the client needs (the entry's id) as metadata of
  its own, which the library does not replay, passed the byte-for-byte check;
- messages: duplicates that all failed were blamed on a missing interceptor; a server that
  answered before its crash failpoint was waited for (``call_timeout_s``) and said to be "still
  running"; a failure in ``_first`` showed the kit's frames.

The services are ``build_server`` functions, run by the kit in child processes; the variant
comes from the server's environment (``KIT_CHECKS_VARIANT``). They write into
``test_ledger.ledger`` (created by the session's ``store`` fixture).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    StaticScope,
    Store,
    current_call,
)
from grpc_idempotency.client import IdempotencyClientInterceptor
from grpc_idempotency.testing import ConformanceFailure, ConformancePlan, ConformanceTarget
from tests.support.ledger import TENANT, running_ledger
from tests.support.relay import RelayService

pytestmark = pytest.mark.e2e
pytest_plugins = ["pytester"]

MODULE = "tests.integration.test_testing_kit_checks"
POST = "/testsvc.v1.LedgerService/Post"
POST_PHASED = "/testsvc.v1.LedgerService/PostPhased"
POST_OPTIONAL = "/testsvc.v1.LedgerService/PostOptional"
VARIANT_ENV = "KIT_CHECKS_VARIANT"
SCOPE_ENV = "KIT_CHECKS_SCOPE"

CONNECTION_LOST = (asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError)


class CheckedLedger(testsvc_pb2_grpc.LedgerServiceServicer):
    """Post (atomic), PostOptional (the same, key optional) and PostPhased insert one ledger
    row. ``variant``: ``correct``, ``fallback`` (a lost call connection is replaced by one from
    the pool), ``needs_key`` (fails a call without a key), ``trailer`` or ``header`` (the entry's
    id in custom trailing or initial metadata, which a replay does not carry), ``commits`` (ends
    the call's transaction itself: the library answers INTERNAL), ``unavailable`` (fails every
    call, transiently), ``error_trailer`` (its deterministic error, for an amount of 0, carries a
    custom trailer, which a replay does not) or ``outside`` (PostPhased writes through the pool, outside its final
    transaction)."""

    def __init__(self, pool: asyncpg.Pool[Any], variant: str) -> None:
        self.pool = pool
        self.variant = variant

    async def Post(
        self, request: testsvc_pb2.PostRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> testsvc_pb2.PostResponse:
        if self.variant == "needs_key" and current_call().key is None:
            raise RuntimeError("the handler uses the idempotency key as the entry's id")
        if request.amount == 0:  # the deterministic error, recorded and replayed
            if self.variant == "error_trailer":
                context.set_trailing_metadata((("x-error-code", "AMOUNT_ZERO"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "amount must not be 0")
        conn: Any = current_call().connection
        if self.variant == "fallback":
            try:
                await conn.execute("SELECT 1")
            except CONNECTION_LOST:
                # Handed back when the handler ends, as such code does: kept, it held the
                # server's shutdown (the pool's close) until the kit killed it 5 s later.
                async with self.pool.acquire() as fresh:
                    return await self._post(fresh, request, context)
        return await self._post(conn, request, context)

    async def _post(
        self,
        conn: Any,
        request: testsvc_pb2.PostRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> testsvc_pb2.PostResponse:
        entry_id: int = await conn.fetchval(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, $2) RETURNING id",
            request.account,
            request.amount,
        )
        if self.variant == "commits":
            await conn.execute("COMMIT")
        if self.variant == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the downstream is down")
        if self.variant == "trailer":
            context.set_trailing_metadata((("x-entry-id", str(entry_id)),))
        if self.variant == "header":
            await context.send_initial_metadata((("x-entry-id", str(entry_id)),))
        return testsvc_pb2.PostResponse(
            entry_id=entry_id, account=request.account, execution_nonce=uuid.uuid4().hex
        )

    PostOptional = Post

    async def PostPhased(
        self, request: testsvc_pb2.PostRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> testsvc_pb2.PostResponse:
        conn: Any = self.pool if self.variant == "outside" else await current_call().transaction()
        entry_id: int = await conn.fetchval(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, $2) RETURNING id",
            request.account,
            request.amount,
        )
        return testsvc_pb2.PostResponse(entry_id=entry_id, execution_nonce=uuid.uuid4().hex)


LEASE_ENV = "KIT_CHECKS_PHASED_LEASE_S"


async def build_server(dsn: str) -> AsyncIterator[Any]:
    store = await Store.connect(dsn, min_size=1, max_size=10)
    scope = StaticScope(os.environ.get(SCOPE_ENV, "kit"))
    lease = os.environ.get(LEASE_ENV)
    overrides = (
        {POST_PHASED.lstrip("/"): MethodOverride(lease=timedelta(seconds=float(lease)))}
        if lease
        else None
    )
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=scope, overrides=overrides
    )
    server = grpc.aio.server(interceptors=[interceptor])
    servicer = CheckedLedger(store.pool, os.environ.get(VARIANT_ENV, "correct"))
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, server)
    try:
        yield server
    finally:
        await store.close()


LEDGER_ENV = "KIT_CHECKS_LEDGER"


# Forward's lease, 5 s in its proto: the crash check's retry waits out the dead attempt's lease,
# and waited those 5 s. 1.5 s (renewed every 0.5 s) is still long past an attempt's one call
# to the ledger (test_testing_kit.py's crash check runs a phased method on a 0.6 s lease).
FORWARD_LEASE = {
    "testsvc.v1.RelayService/Forward": MethodOverride(lease=timedelta(seconds=1.5)),
}


async def orchestrator_server(dsn: str) -> AsyncIterator[Any]:
    """RelayService.Forward (phased): its one effect is a call to the ledger at ``LEDGER_ENV``
    (a server of the test process, without the failpoints) with the step's child key, as the
    README says to call another service."""
    interceptors = IdempotencyClientInterceptor(
        services=[testsvc_pb2], forward_metadata=[TENANT]
    ).all_kinds()
    async with _relay_server(dsn, RelayService, interceptors) as server:
        yield server


@contextlib.asynccontextmanager
async def _relay_server(
    dsn: str, relay: Callable[[Any], Any], interceptors: Sequence[Any] = ()
) -> AsyncIterator[Any]:
    """A keyed RelayService server (``relay``, made with a ledger stub) whose ledger channel has
    ``interceptors``."""
    store = await Store.connect(
        dsn, schema="kit_checks_relay", min_size=1, max_size=10, migrate=True
    )
    downstream = grpc.aio.insecure_channel(os.environ[LEDGER_ENV], interceptors=interceptors)
    interceptor = IdempotencyInterceptor(
        store, services=[testsvc_pb2], scope=MetadataScope(TENANT), overrides=FORWARD_LEASE
    )
    server = grpc.aio.server(interceptors=[interceptor])
    testsvc_pb2_grpc.add_RelayServiceServicer_to_server(
        relay(testsvc_pb2_grpc.LedgerServiceStub(downstream)), server
    )
    try:
        yield server
    finally:
        await downstream.close(None)
        await store.close()


class PlainChannelRelay(testsvc_pb2_grpc.RelayServiceServicer):
    """Forward's effect, a ledger row, made through a channel without the client interceptor:
    the call carries no child key (the ledger's PostOptional runs every call it gets)."""

    def __init__(self, ledger: testsvc_pb2_grpc.LedgerServiceStub) -> None:
        self.ledger = ledger

    async def Forward(self, request: Any, context: Any) -> Any:
        post = testsvc_pb2.PostRequest(account=request.account, amount=1)
        answer = await self.ledger.PostOptional(post, metadata=((TENANT, "plain"),))
        await current_call().transaction()
        return testsvc_pb2.ForwardResponse(entry_id=answer.entry_id)


async def plain_channel_server(dsn: str) -> AsyncIterator[Any]:
    async with _relay_server(dsn, PlainChannelRelay) as server:
        yield server


def _request() -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account="kit-checks-" + uuid.uuid4().hex, amount=5)


async def _rows(db: asyncpg.Connection[Any], request: Any) -> int:
    count: int = await db.fetchval(
        "SELECT count(*) FROM test_ledger.ledger WHERE account = $1", request.account
    )
    return count


# The lost-connection check's pause after the claim, which every such check waits out in full
# (the call sleeps on after its connection is cut): the kit's default is 2 s. 1 s is the shortest
# that leaves the kit's own timing alone (it takes a claim idle for min(0.2 s, a quarter of the
# pause) for the call's), and leaves it 0.8 s to find the claim and cut its connection, which
# takes a few polls of 20 ms.
LOST_CONNECTION_PAUSE_MS = 1000


@pytest.fixture
def plan_for(pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``plan_for(variant, method=POST, scope=None, **target)``: a plan on a server of that
    variant (its calls' scope ``scope``, default ``kit``; ``server_env`` adds to its
    environment)."""
    plans: list[ConformancePlan] = []

    def make(
        variant: str, method: str = POST, scope: str | None = None, **target: Any
    ) -> ConformancePlan:
        env = {VARIANT_ENV: variant} if scope is None else {VARIANT_ENV: variant, SCOPE_ENV: scope}
        env.update(target.pop("server_env", {}))
        target.setdefault("lost_connection_pause_ms", LOST_CONNECTION_PAUSE_MS)
        target.setdefault("request", _request)
        target.setdefault("count_effects", _rows)
        plan = ConformancePlan(
            ConformanceTarget(
                server=f"{MODULE}:build_server",
                method=method,
                server_env=env,
                **target,
            ),
            pg_dsn,
            tmp_path_factory.mktemp(variant),
        )
        plans.append(plan)
        return plan

    try:
        yield make
    finally:
        for plan in plans:
            plan.close()


async def test_a_handler_falling_back_to_a_pool_connection_fails_the_lost_connection_check(
    plan_for: Any,
) -> None:
    plan = plan_for("fallback")
    # The other checks cannot see it: nothing fails the handler's own statements.
    await plan.check_sequential_replay()
    await plan.check_crash("before_commit")
    await plan.check_transient_error()
    with pytest.raises(
        ConformanceFailure,
        match=r"\[lost connection\] the attempt whose connection was lost \(.*\) left 1 effects,"
        r" expected 0: the handler carried on outside the call's transaction",
    ):
        await plan.check_lost_connection()


async def test_a_correct_handler_passes_the_lost_connection_check(plan_for: Any) -> None:
    await plan_for("correct").check_lost_connection()


# A scope long enough (900 UTF-8 bytes, 1024 allowed) that pg_stat_activity, which keeps the first
# track_activity_query_size (1024) bytes of a statement, cuts the claim before its key; quotes and
# a backslash, which the claim's literal escapes.
LONG_SCOPE = "tenant:o'brien\\eu:" + "\u00e9" * 441


async def test_a_long_scope_passes_the_lost_connection_check_of_a_correct_handler(
    plan_for: Any,
) -> None:
    # The kit found the call's connection by its key in the claim's text: cut off there, the
    # check failed a correct service, saying that the method was perhaps not intercepted.
    assert len(LONG_SCOPE.encode()) == 900
    await plan_for("correct", scope=LONG_SCOPE).check_lost_connection()


async def test_a_long_scope_still_fails_a_handler_falling_back_to_a_pool_connection(
    plan_for: Any,
) -> None:
    with pytest.raises(ConformanceFailure, match=r"\[lost connection\] the attempt whose"):
        await plan_for("fallback", scope=LONG_SCOPE).check_lost_connection()


async def test_the_lost_connection_check_leaves_another_calls_claim_alone(
    plan_for: Any, store: Store
) -> None:
    # Another call on the same database, claimed before the check began and idle in its
    # transaction, its claim's text cut before the key (a long scope): the only such claim, the
    # kit took it for the check's own before that one showed, cut it, and failed a correct
    # service ("answered OK although its transaction was gone").
    other = await store.claim_atomic(
        scope="\u00e9" * 512,  # 1024 bytes: its text is cut inside the scope
        key=f"other-{uuid.uuid4().hex}",
        method=POST,
        fingerprint=bytes(32),
        retention_s=60,
        lease_s=60,
    )
    assert other is not None
    try:
        async with store.pool.acquire() as db:
            # Idle (since before claim_atomic returned) for longer than the kit waits (0.2 s)
            # before it takes a cut claim for the call's: a duration, not a race.
            await db.execute("SELECT pg_catalog.pg_sleep(0.25)")
        await plan_for("correct").check_lost_connection()
        assert await other.connection.fetchval("SELECT 1") == 1  # its connection was left alone
    finally:
        await other.release()


async def test_the_lost_connection_check_skips_a_phased_method(plan_for: Any) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"phased mode"):
        await plan_for("correct", POST_PHASED).check_lost_connection()


@pytest.fixture
async def orchestrator(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ConformancePlan]:
    """A plan on ``orchestrator_server``, its effect counted where it lands: the ledger's rows."""
    async with running_ledger(store) as ledger:
        plan = ConformancePlan(
            ConformanceTarget(
                server=f"{MODULE}:orchestrator_server",
                method="/testsvc.v1.RelayService/Forward",
                request=lambda: testsvc_pb2.ForwardRequest(account=_request().account, mode="post"),
                count_effects=_rows,
                metadata=((TENANT, "kit-checks-orchestrator"),),
                server_env={LEDGER_ENV: ledger.address},
            ),
            pg_dsn,
            tmp_path_factory.mktemp("orchestrator"),
        )
        try:
            yield plan
        finally:
            plan.close()


async def test_a_phased_method_whose_effect_is_a_child_keyed_call_passes_the_failure_checks(
    orchestrator: ConformancePlan,
) -> None:
    # The downstream call committed (under the step's child key) before the attempt failed: the
    # effect exists once, and the retry replays the call instead of making it again. The checks
    # required no effect at all after the failure, and said the handler wrote outside its
    # transaction, of a method written as the README says.
    await orchestrator.check_sequential_replay()
    await orchestrator.check_crash("before_commit")
    await orchestrator.check_transient_error()


async def test_a_phased_handler_writing_outside_its_final_transaction_still_fails(
    plan_for: Any,
) -> None:
    plan = plan_for("outside", POST_PHASED)
    await plan.check_sequential_replay()
    with pytest.raises(ConformanceFailure, match=r"effect count is 2, expected 1.*outside"):
        await plan.check_crash("before_commit")
    with pytest.raises(ConformanceFailure, match=r"effect count is 2, expected 1.*outside"):
        await plan.check_transient_error()


async def test_a_downstream_call_without_the_child_key_is_named_as_the_cause(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A phased handler calling another service through a plain channel (no client interceptor,
    # so no child key): the failed attempt's call committed downstream, and the retry made it
    # again. The kit caught it but said only "never through a connection of your own", which
    # sent the user looking for a database write the handler does not make.
    async with running_ledger(store) as ledger:
        plan = ConformancePlan(
            ConformanceTarget(
                server=f"{MODULE}:plain_channel_server",
                method="/testsvc.v1.RelayService/Forward",
                request=lambda: testsvc_pb2.ForwardRequest(account=_request().account),
                count_effects=_rows,
                metadata=((TENANT, "kit-checks-plain"),),
                server_env={LEDGER_ENV: ledger.address},
            ),
            pg_dsn,
            tmp_path_factory.mktemp("plain-channel"),
        )
        try:
            with pytest.raises(
                ConformanceFailure,
                match=r"effect count is 2, expected 1\..*through a channel with"
                r" IdempotencyClientInterceptor .*child key",
            ):
                await plan.check_transient_error()
        finally:
            plan.close()


async def test_a_required_key_passes_the_keyless_check(plan_for: Any) -> None:
    await plan_for("correct").check_keyless()


async def test_a_key_optional_method_passes_the_keyless_check_when_the_target_says_so(
    plan_for: Any,
) -> None:
    await plan_for("correct", POST_OPTIONAL, key_optional=True).check_keyless()


async def test_a_method_left_key_optional_fails_the_keyless_check(plan_for: Any) -> None:
    with pytest.raises(
        ConformanceFailure,
        match=r"\[keyless call\] a call without a key answered OK \(.*\) with 1 effects;"
        r" expected INVALID_ARGUMENT, reason IDEMPOTENCY_KEY_MISSING, and none\. Is the method"
        r" KEY_OPTIONAL \(then say key_optional = True\)",
    ):
        await plan_for("correct", POST_OPTIONAL).check_keyless()


async def test_a_key_optional_handler_that_needs_the_key_fails_the_keyless_check(
    plan_for: Any,
) -> None:
    plan = plan_for("needs_key", POST_OPTIONAL, key_optional=True)
    await plan.check_sequential_replay()  # with a key, all is well
    with pytest.raises(
        ConformanceFailure,
        match=r"\[keyless call\] the method is key-optional, but a call without a key answered"
        r" UNKNOWN .* with 0 effects; expected OK and 1\. Does the handler need",
    ):
        await plan.check_keyless()


async def test_a_required_key_fails_the_keyless_check_of_a_key_optional_target(
    plan_for: Any,
) -> None:
    with pytest.raises(
        ConformanceFailure,
        match=r"answered INVALID_ARGUMENT .*IDEMPOTENCY_KEY_MISSING with 0 effects; expected OK",
    ):
        await plan_for("correct", key_optional=True).check_keyless()


@pytest.mark.parametrize("variant", ["trailer", "header"])
async def test_handler_metadata_a_replay_lacks_fails_the_sequential_replay_check(
    plan_for: Any, variant: str
) -> None:
    with pytest.raises(
        ConformanceFailure,
        match=r"\[sequential replay\] the first answer carried metadata \['x-entry-id'\] that"
        r" the replay does not: .* Put what a retry must see in the response message\.",
    ):
        await plan_for(variant).check_sequential_replay()


def _error_request() -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account="kit-checks-error-" + uuid.uuid4().hex, amount=0)


async def test_error_metadata_a_replay_lacks_fails_the_deterministic_error_check(
    plan_for: Any,
) -> None:
    # The handler's own trailers go with an error's first answer, not with its replays: a
    # client whose first answer was lost never saw the code it carried. The check compared the
    # status, message and details only, and passed.
    with pytest.raises(
        ConformanceFailure,
        match=r"\[deterministic error\] the first answer carried metadata \['x-error-code'\]"
        r" that the replay does not: .* Put what a retry must see in the status details",
    ):
        await plan_for("error_trailer", error_request=_error_request).check_deterministic_error()
    await plan_for("correct", error_request=_error_request).check_deterministic_error()


async def test_what_the_library_replays_passes_the_sequential_replay_check(plan_for: Any) -> None:
    # The replay marker is the retry's alone; the first answer carries nothing the retry lacks.
    await plan_for("correct", metadata=(("x-caller", "kit"),)).check_sequential_replay()


async def test_duplicates_that_all_failed_are_not_blamed_on_the_interceptor(
    plan_for: Any,
) -> None:
    with pytest.raises(ConformanceFailure) as failed:
        await plan_for("unavailable", concurrency=2).check_concurrent_duplicates()
    message = str(failed.value)
    assert message.startswith(
        "[concurrent duplicates] no duplicate succeeded and the effect never happened:"
        " UNAVAILABLE 'the downstream is down'"
    ), message
    assert "IdempotencyInterceptor" not in message.splitlines()[0]


async def test_a_request_factory_repeating_one_operation_is_named_not_the_service(
    plan_for: Any,
) -> None:
    # count_effects(db, request) cannot tell two equal requests' effects apart: every check
    # after the first counted the earlier checks' rows too, and blamed the service for them
    # ("the handler writes outside the call's transaction", a missing interceptor). Equal, not
    # the same object: each request is built anew. Two operations taking turns are caught
    # too, each the second time it comes back, not only one repeated at once.
    accounts = itertools.cycle(f"kit-checks-turns-{uuid.uuid4().hex}-{n}" for n in (1, 2))
    plan = plan_for(
        "correct", request=lambda: testsvc_pb2.PostRequest(account=next(accounts), amount=5)
    )
    await plan.check_sequential_replay()  # the first two operations: nothing to tell them from
    await plan.check_crash("before_commit")
    with pytest.raises(ValueError, match=r"make_request\(\) .* returned the same request again"):
        await plan.check_sequential_replay()


async def test_a_counter_that_is_not_an_async_function_returning_an_int_is_named(
    plan_for: Any,
) -> None:
    # Python's own TypeError ("int() argument must be ... not 'NoneType'", "object int can't be
    # used in 'await' expression") named neither count_effects nor what it must return.
    async def no_return(db: asyncpg.Connection[Any], request: Any) -> None:
        await _rows(db, request)

    def not_async(db: asyncpg.Connection[Any], request: Any) -> int:
        return 1

    for counter, said in (
        (no_return, r"an int, not NoneType \(a missing return"),
        (not_async, r"it returned int, not an awaitable"),
    ):
        with pytest.raises(
            TypeError, match=r"^count_effects\(db, request\) must be an async function .*" + said
        ):
            await plan_for("correct", count_effects=counter).check_sequential_replay()


async def test_a_lease_longer_than_the_in_progress_timeout_is_named_not_the_service(
    plan_for: Any,
) -> None:
    # After a crash past a phased claim, the retry finds the key in progress until the dead
    # owner's lease runs out: a lease longer than in_progress_timeout_s (a minute, for a slow
    # operation) failed a correct service as "the effect count is 0, expected 1".
    plan = plan_for(
        "correct", method=POST_PHASED, in_progress_timeout_s=0.5, server_env={LEASE_ENV: "60"}
    )
    with pytest.raises(
        ConformanceFailure,
        match=r"\[crash at after_claim\] the retry still found the key in progress after"
        r" in_progress_timeout_s=0\.5 s: .*KEY_IN_PROGRESS.* raise in_progress_timeout_s",
    ):
        await plan.check_crash("after_claim")


async def test_a_server_answering_before_the_crash_failpoint_is_not_waited_for(
    plan_for: Any,
) -> None:
    plan = plan_for("commits")
    started = time.monotonic()
    with pytest.raises(
        ConformanceFailure,
        match=r"\[crash at after_commit_before_response\] the server answered INTERNAL .*"
        r"IDEMPOTENCY_HANDLER_DATABASE_ERROR.* before it reached the failpoint"
        r" after_commit_before_response, where it should have died",
    ):
        await plan.check_crash("after_commit_before_response")
    # It waited call_timeout_s for the server to die, then said "the server is still running".
    assert time.monotonic() - started < plan.target.call_timeout_s


INNER_UNSERVED = """
from testsvc.v1 import testsvc_pb2

from grpc_idempotency.testing import IdempotencyConformance


class TestUnserved(IdempotencyConformance):
    server = "tests.integration.test_testing_kit:bare_server"
    method = "/testsvc.v1.LedgerService/Post"

    def make_request(self):
        return testsvc_pb2.PostRequest(account="unserved", amount=1)

    async def count_effects(self, db, request):
        return 0
"""


def test_a_failed_first_call_shows_the_failure_not_the_kits_frames(
    pytester: pytest.Pytester, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRPC_IDEMPOTENCY_TEST_DSN", pg_dsn)
    pytester.makepyfile(test_unserved=INNER_UNSERVED)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--tb=long", "-k", "sequential"
    )
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "[sequential replay] the first call with a new key failed: UNIMPLEMENTED" in out, out
    # One frame of the kit's module: the test method the user's class inherits, not _first.
    assert "def _first(" not in out, out
    assert out.count("grpc_idempotency/testing/conformance.py:") == 1, out
