"""Big requests are fingerprinted off the event loop: clearing excluded fields and putting
undeclared ones in order is Python, and on the loop one big request held every other call of
the server for as long (benchmarks/bench_big_requests.py measures how long). Here: the thread
is used for a request over the bound and not for one under it, and a fingerprint made there is
the same as one made on the loop (a replay, and a refused mutation, across the two)."""

from __future__ import annotations

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import IdempotencyInterceptor, Store
from tests.support.ledger import fresh, ledger_rows, running_ledger

POST = "/testsvc.v1.LedgerService/Post"


def _batch(account: str, lines: int, amount: int = 1) -> testsvc_pb2.PostRequest:
    request = testsvc_pb2.PostRequest(account=account, amount=amount)
    for i in range(lines):
        line = request.lines.add(amount=i)
        line.seen_at.seconds = i  # excluded: cleared in a copy before hashing
        line.meta.trace_id, line.meta.origin = f"trace-{i}", "batch"
    return request


async def test_a_big_request_is_fingerprinted_off_the_loop_and_replays(store: Store) -> None:
    async with running_ledger(store, fingerprint_off_loop_bytes=4096) as ledger:
        small = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
        assert (await ledger.call(POST, small, fresh())).code is grpc.StatusCode.OK
        assert ledger.interceptor._fingerprint_executor is None  # under the bound: on the loop

        key, account = fresh(), fresh("acct")
        big = _batch(account, lines=1000)
        assert big.ByteSize() > 4096
        first = await ledger.call(POST, big, key)
        assert first.code is grpc.StatusCode.OK and not first.replayed
        assert ledger.interceptor._fingerprint_executor is not None

        # The same request with other values in its excluded fields: the same operation.
        retry = _batch(account, lines=1000)
        for line in retry.lines:
            line.seen_at.seconds += 3600
            line.meta.trace_id = "another trace"
        again = await ledger.call(POST, retry, key)
        assert again.code is grpc.StatusCode.OK and again.replayed and again.body == first.body

        changed = _batch(account, lines=1000, amount=2)
        refused = await ledger.call(POST, changed, key)
        assert refused.code is grpc.StatusCode.FAILED_PRECONDITION
        assert refused.reason() == "IDEMPOTENCY_KEY_REUSED"
    assert await ledger_rows(store, account) == 1


async def test_a_fingerprint_made_off_the_loop_is_the_one_made_on_it(store: Store) -> None:
    """Two servers on one store, one fingerprinting the request in its thread and one on its
    loop (no replay cache, so the second reads the record the first wrote): the retry is the
    same request on both."""
    key, account = fresh(), fresh("acct")
    big = _batch(account, lines=1000)
    async with (
        running_ledger(store, fingerprint_off_loop_bytes=0, replay_cache=False) as off,
        running_ledger(store, fingerprint_off_loop_bytes=None, replay_cache=False) as on,
    ):
        first = await off.call(POST, big, key)
        assert first.code is grpc.StatusCode.OK and not first.replayed
        again = await on.call(POST, big, key)
        assert again.code is grpc.StatusCode.OK and again.replayed and again.body == first.body
        assert on.interceptor._fingerprint_executor is None
        assert off.interceptor._fingerprint_executor is not None
    assert await ledger_rows(store, account) == 1


@pytest.mark.parametrize("bound", [-1, True, 1.5, float("nan")])
async def test_a_bound_that_is_not_a_byte_count_is_refused(store: Store, bound: object) -> None:
    with pytest.raises(ValueError, match="fingerprint_off_loop_bytes"):
        IdempotencyInterceptor(store, fingerprint_off_loop_bytes=bound)  # type: ignore[arg-type]
