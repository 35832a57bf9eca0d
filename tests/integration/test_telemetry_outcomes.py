"""Every way a keyed call can end, as the README's "Metrics and traces" says it is counted: one
``grpc_idempotency.calls`` count and one ``grpc_idempotency.call.duration`` sample per call (never
none, never two), one span, each with its outcome and its answer's status code, the span an ERROR
for a server-side failure only. One table: each row runs its calls and says, per call, the
(outcome, status) an SRE's dashboard must see."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import grpc
import pytest
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.trace import StatusCode
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import (
    IdempotencyInterceptor,
    MetadataScope,
    MethodOverride,
    Store,
    Telemetry,
)
from grpc_idempotency.core.fingerprint import Fingerprinter
from tests.integration.test_cancellation import _StrayCancel
from tests.integration.test_left_behind_tasks import LeavesACallInFlight
from tests.integration.test_telemetry import _telemetry
from tests.support.ledger import TENANT, fresh, ledger_server, metadata, running_ledger
from tests.support.otel import attributes
from tests.support.relay import running_relay
from tests.support.waiting import until
from tests.support.wire import call_raw

SVC = "/testsvc.v1.LedgerService/"
POST, OPTIONAL, FAIL_OPEN, PHASED, WITH_EVENT = (
    SVC + name for name in ("Post", "PostOptional", "PostFailOpen", "PostPhased", "PostWithEvent")
)
SCOPE = "tenant:tenant-a"
S = grpc.StatusCode
# What the README calls a server-side failure: an ERROR span.
SERVER_ERRORS = {S.UNKNOWN, S.DEADLINE_EXCEEDED, S.UNIMPLEMENTED, S.INTERNAL, S.UNAVAILABLE}
SLEPT_S = 0.05  # "executed"'s handler sleeps this long: the duration is in seconds

Ended = list[tuple[str, grpc.StatusCode]]


@dataclass
class Env:
    store: Store
    pg_dsn: str
    telemetry: Telemetry
    reader: InMemoryMetricReader


def _post(behaviour: str = "", account: str | None = None) -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account or fresh("acct"), amount=1, behaviour=behaviour)


async def _one(env: Env, method: str, behaviour: str, key: str | None, **options: object) -> None:
    async with running_ledger(env.store, telemetry=env.telemetry, **options) as ledger:  # type: ignore[arg-type]
        await ledger.call(method, _post(behaviour), key)


async def executed(env: Env) -> Ended:
    await _one(env, POST, f"sleep:{int(SLEPT_S * 1000)}", fresh())
    return [("executed", S.OK)]


async def recorded_error(env: Env) -> Ended:
    await _one(env, POST, "NOT_FOUND", fresh())
    return [("executed", S.NOT_FOUND)]


async def released_transient(env: Env) -> Ended:
    await _one(env, POST, "UNAVAILABLE", fresh())
    return [("released", S.UNAVAILABLE)]


async def handler_raises(env: Env) -> Ended:
    await _one(env, POST, "raise", fresh())
    return [("released", S.UNKNOWN)]


async def each_answer(env: Env) -> Ended:
    """The ordinary ends, in both modes (phased: the claim committed before the handler, the
    outcome in a final transaction), and a recorded error replayed."""
    ended: Ended = []
    async with running_ledger(env.store, telemetry=env.telemetry) as ledger:
        for method in (POST, PHASED):
            for behaviour, end in [
                ("", ("executed", S.OK)),
                ("UNAVAILABLE", ("released", S.UNAVAILABLE)),
                ("raise", ("released", S.UNKNOWN)),
                ("return-none", ("released", S.UNKNOWN)),  # nothing gRPC can serialize
            ]:
                await ledger.call(method, _post(behaviour), fresh())
                ended.append(end)
            key, request = fresh(), _post("NOT_FOUND")
            for _ in range(2):
                await ledger.call(method, request, key)
            ended += [("executed", S.NOT_FOUND), ("replayed", S.NOT_FOUND)]
        await ledger.call(PHASED, _post("no-writes"), fresh())  # final transaction opened late
        ended.append(("executed", S.OK))
    return ended


async def _twice(env: Env, *, replay_cache: bool) -> Ended:
    async with running_ledger(
        env.store, telemetry=env.telemetry, replay_cache=replay_cache
    ) as ledger:
        key, request = fresh(), _post()
        await ledger.call(POST, request, key)
        again = await ledger.call(POST, request, key)
        assert again.replayed
        if replay_cache:
            assert ledger.interceptor.replay_cache is not None
            assert len(ledger.interceptor.replay_cache) == 1
        await ledger.call(POST, _post(), key)  # another request, the same key
    return [("executed", S.OK), ("replayed", S.OK), ("mismatch", S.FAILED_PRECONDITION)]


async def replayed_from_db(env: Env) -> Ended:
    return await _twice(env, replay_cache=False)


async def replayed_from_cache(env: Env) -> Ended:
    return await _twice(env, replay_cache=True)


async def waited_then_replayed(env: Env) -> Ended:
    async with running_ledger(env.store, telemetry=env.telemetry) as ledger:
        key, request = fresh(), _post("wait")
        owner = asyncio.ensure_future(ledger.call(POST, request, key))
        await ledger.service.started.wait()
        duplicate = asyncio.ensure_future(ledger.call(POST, request, key))
        await until("the duplicate waiting", lambda: ledger.interceptor.waiting_calls == 1)
        ledger.service.release.set()
        assert (await owner).code is S.OK and (await duplicate).replayed
    return [("executed", S.OK), ("waited", S.OK)]


async def polled_then_replayed(env: Env) -> Ended:
    """A duplicate on another replica polls the database while the owner runs, then replays."""
    async with (
        running_ledger(env.store, telemetry=env.telemetry) as origin,
        running_ledger(env.store, telemetry=env.telemetry, replay_cache=False) as replica,
    ):
        key, request = fresh(), _post("wait")
        owner = asyncio.ensure_future(origin.call(POST, request, key))
        await origin.service.started.wait()
        duplicate = asyncio.ensure_future(replica.call(POST, request, key))
        await until("the duplicate polling", lambda: replica.interceptor.waiting_calls == 1)
        origin.service.release.set()
        assert (await owner).code is S.OK and (await duplicate).replayed
    return [("executed", S.OK), ("waited", S.OK)]


async def waited_out(env: Env) -> Ended:
    # Its wait runs out at max_wait, far from its deadline: ended 100 ms before the deadline
    # (core.lifecycle.ANSWER_MARGIN_S), its answer could lose the race to the client's deadline
    # on a loaded CI machine (DEADLINE_EXCEEDED, counted "released").
    short_wait = {POST[1:]: MethodOverride(max_wait=timedelta(milliseconds=500))}
    async with running_ledger(env.store, telemetry=env.telemetry, overrides=short_wait) as ledger:
        key, request = fresh(), _post("wait")
        owner = asyncio.ensure_future(ledger.call(POST, request, key))
        await ledger.service.started.wait()
        try:
            duplicate = await ledger.call(POST, request, key, timeout=10)
        finally:
            ledger.service.release.set()
        assert duplicate.code is S.ABORTED, duplicate
        assert (await owner).code is S.OK
    return [("conflict", S.ABORTED), ("executed", S.OK)]


async def taken_over(env: Env) -> Ended:
    key, request = fresh(), _post()
    fingerprint = Fingerprinter.for_method(PHASED, testsvc_pb2.PostRequest.DESCRIPTOR)(request)
    # An earlier attempt's phased claim left IN_PROGRESS, its lease over.
    await env.store.pool.execute(
        "INSERT INTO grpc_idempotency.records (scope, key, method, fingerprint, state,"
        " fencing_token, locked_until, expires_at) VALUES ($1, $2, $3, $4, 'in_progress', 7,"
        " clock_timestamp() - interval '1 second', clock_timestamp() + interval '1 hour')",
        SCOPE,
        key,
        PHASED,
        fingerprint,
    )
    async with running_ledger(env.store, telemetry=env.telemetry) as ledger:
        assert (await ledger.call(PHASED, request, key)).code is S.OK
    return [("taken_over", S.OK)]


async def lease_lost(env: Env) -> Ended:
    async with running_ledger(env.store, telemetry=env.telemetry) as ledger:
        key = fresh()
        owner = asyncio.ensure_future(ledger.call(PHASED, _post("wait"), key))
        await ledger.service.started.wait()
        await env.store.pool.execute(  # another attempt takes the key over
            "UPDATE grpc_idempotency.records SET fencing_token = fencing_token + 1"
            " WHERE scope = $1 AND key = $2",
            SCOPE,
            key,
        )
        try:  # only the lease keeper's cancellation ends the handler
            answer = await asyncio.wait_for(owner, 10)
        finally:
            ledger.service.release.set()
        assert answer.reason() == "IDEMPOTENCY_LEASE_LOST", answer
    return [("released", S.ABORTED)]


async def _on_a_closed_store(env: Env, calls: list[tuple[str, str | None]]) -> None:
    closed = await Store.connect(env.pg_dsn, min_size=1, max_size=1)
    await closed.close()  # a closed store answers UNAVAILABLE, as one that is down
    async with running_ledger(closed, telemetry=env.telemetry) as ledger:
        for method, key in calls:
            await ledger.call(method, _post(), key)


async def store_down(env: Env) -> Ended:
    # Fail-open (an outage: the database stopped) is test_store_down's, which stops its own.
    await _on_a_closed_store(env, [(POST, fresh()), (OPTIONAL, None)])
    return [("unavailable", S.UNAVAILABLE)] * 2


async def no_key_or_bad_key(env: Env) -> Ended:
    async with running_ledger(env.store, telemetry=env.telemetry) as ledger:
        assert (await ledger.call(OPTIONAL, _post(), None)).code is S.OK
        await ledger.call(POST, _post(), None)
        await ledger.call(POST, _post(), "bad key")
        await ledger.call(POST, _post(), fresh(), tenant="")  # no scope
    # No scope: the resolver's UNAUTHENTICATED, refused before the store as a bad key is.
    return [
        ("bypassed", S.OK),
        *[("rejected", S.INVALID_ARGUMENT)] * 2,
        ("rejected", S.UNAUTHENTICATED),
    ]


async def _left_by_its_client(env: Env, *, timeout: float | None, method: str = POST) -> None:
    async with running_ledger(env.store, telemetry=env.telemetry) as ledger:
        stub = ledger.channel.unary_unary(
            method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
        )
        call = stub(_post("wait"), metadata=metadata(fresh(), "tenant-a"), timeout=timeout or 30)
        try:
            await ledger.service.started.wait()
            if timeout is None:
                call.cancel()
            else:
                assert await call.code() is S.DEADLINE_EXCEEDED
            await until("the call counted", lambda: _counted(env.reader) == 1)
        finally:
            ledger.service.release.set()


async def client_cancelled(env: Env) -> Ended:
    await _left_by_its_client(env, timeout=None)
    return [("released", S.CANCELLED)]


async def phased_client_cancelled(env: Env) -> Ended:
    await _left_by_its_client(env, timeout=None, method=PHASED)
    return [("released", S.CANCELLED)]


async def deadline_exceeded(env: Env) -> Ended:
    # 1 s: the handler must begin (its key claimed) before the deadline, or the test waits for
    # it forever; a loaded CI machine could take 0.5 s over that.
    await _left_by_its_client(env, timeout=1.0)
    return [("released", S.DEADLINE_EXCEEDED)]


async def stray_cancelled_error(env: Env) -> Ended:
    interceptor = IdempotencyInterceptor(
        env.store, services=[testsvc_pb2], scope=MetadataScope(TENANT), telemetry=env.telemetry
    )
    async with ledger_server(interceptor, _StrayCancel()) as (channel, _):
        for method in (POST, PHASED):
            answer = await call_raw(channel, method, _post(), metadata(fresh()), 10)
            assert answer.code is S.UNKNOWN, answer
    return [("released", S.UNKNOWN)] * 2


async def downstream_in_flight(env: Env) -> Ended:
    async with (
        running_ledger(env.store) as ledger,
        running_relay(
            env.store, ledger.address, servicer=LeavesACallInFlight, telemetry=env.telemetry
        ) as relay,
    ):
        try:
            answer = await relay.forward(testsvc_pb2.ForwardRequest(account=fresh("acct")), fresh())
            assert answer.reason() == "IDEMPOTENCY_TRANSACTION_OPEN", answer
        finally:
            ledger.service.release.set()
    return [("released", S.FAILED_PRECONDITION)]


async def enqueue_not_awaited(env: Env) -> Ended:
    await _one(env, WITH_EVENT, "event-not-awaited", fresh())
    return [("released", S.INTERNAL)]


async def response_too_large(env: Env) -> Ended:
    small = {POST[1:]: MethodOverride(max_response_bytes=1024)}
    await _one(env, POST, "big:4096", fresh(), overrides=small)
    return [("executed", S.FAILED_PRECONDITION)]  # recorded as an error, and replayed so


def _counted(reader: InMemoryMetricReader) -> int:
    return sum(_points(reader, "grpc_idempotency.calls").values())


def _metrics(reader: InMemoryMetricReader, name: str) -> list[Any]:
    # Each read collects; opentelemetry-sdk 1.16 (the floor) returns only the streams recorded
    # since the last collection (nothing, after the polling's read), so each stream's last
    # point is kept on the reader: the totals so far (cumulative temporality).
    seen: dict[tuple[str, frozenset[Any]], Any] = reader.__dict__.setdefault("_seen_points", {})
    data = reader.get_metrics_data()  # None: nothing recorded since the last read
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    seen[(m.name, frozenset(attributes(p).items()))] = p
    return [p for (metric, _), p in seen.items() if metric == name]


def _points(reader: InMemoryMetricReader, name: str) -> Counter[tuple[str, int]]:
    """``name``'s counts (a counter's value, a histogram's samples) by (outcome, code)."""
    found: Counter[tuple[str, int]] = Counter()
    for p in _metrics(reader, name):
        label = (
            str(attributes(p)["grpc_idempotency.outcome"]),
            attributes(p)["rpc.grpc.status_code"],
        )
        found[cast(tuple[str, int], label)] += int(
            p.count if isinstance(p, HistogramDataPoint) else p.value
        )
    return found


SCENARIOS: list[Callable[[Env], Awaitable[Ended]]] = [
    executed,
    recorded_error,
    each_answer,
    released_transient,
    handler_raises,
    replayed_from_db,
    replayed_from_cache,
    waited_then_replayed,
    polled_then_replayed,
    waited_out,
    taken_over,
    lease_lost,
    store_down,
    no_key_or_bad_key,
    client_cancelled,
    phased_client_cancelled,
    deadline_exceeded,
    stray_cancelled_error,
    downstream_in_flight,
    enqueue_not_awaited,
    response_too_large,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
async def test_each_way_a_call_ends_is_counted_once_with_its_outcome_and_status(
    store: Store, pg_dsn: str, scenario: Callable[[Env], Awaitable[Ended]]
) -> None:
    telemetry, spans, reader = _telemetry()
    expected = await scenario(Env(store, pg_dsn, telemetry, reader))
    want = Counter((outcome, code.value[0]) for outcome, code in expected)
    # Recorded as the call's handler ends, which may be just after its client has the
    # answer: waited for, then checked for no more than that.
    await until("every call counted", lambda: _counted(reader) >= len(expected))
    await until("every span ended", lambda: len(spans.get_finished_spans()) >= len(expected))
    assert _points(reader, "grpc_idempotency.calls") == want
    assert _points(reader, "grpc_idempotency.call.duration") == want  # one sample per call
    finished = spans.get_finished_spans()
    got = Counter(
        (str(attributes(s)["grpc_idempotency.outcome"]), attributes(s)["rpc.grpc.status_code"])
        for s in finished
    )
    assert got == want
    codes = {c.value[0]: c for c in S}
    for span in finished:
        outcome = str(attributes(span)["grpc_idempotency.outcome"])
        code = codes[cast(int, attributes(span)["rpc.grpc.status_code"])]
        if code in SERVER_ERRORS:
            assert span.status.status_code is StatusCode.ERROR, span
            assert span.status.description == f"{code.name} ({outcome})"
        else:
            assert span.status.status_code is StatusCode.UNSET, span
    elapsed = sum(p.sum for p in _metrics(reader, "grpc_idempotency.call.duration"))
    assert 0 < elapsed < 30  # seconds, not milliseconds
    if scenario is executed:
        assert elapsed >= SLEPT_S
    bypassed = sum(p.value for p in _metrics(reader, "grpc_idempotency.bypassed"))
    # Fail-open only (test_store_down counts those): not an optional-key call made without its
    # key, the store up.
    assert bypassed == 0
