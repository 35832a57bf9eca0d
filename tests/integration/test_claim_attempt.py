"""The phased claim's attempt id (migration 0016): a try that finds the key in progress under its
own attempt id takes the claim as its own; nothing else does.

The call-level case (a claim that committed with its answer lost, claimed again on a fresh
connection) is in test_phased_failover.py. These tests call the claim function directly, to pin
down what counts as "its own": the same attempt id, the same claim (not one taken over since, by
a server of this release or of an earlier one), still in progress.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from grpc_idempotency import Store
from grpc_idempotency.core.keys import claim_lock_id
from tests.support.ledger import fresh
from tests.support.waiting import until

SCOPE = "tenant:attempts"
METHOD = "/testsvc.v1.LedgerService/PostPhased"
FINGERPRINT = b"f" * 32

Claim = Callable[..., Awaitable[asyncpg.Record]]


@pytest.fixture
def claim(store: Store) -> Claim:
    """The store's phased claim statement on ``key`` for ``attempt``; ``old=True``: the claim of
    a server before migration 0016 (claim(), no attempt id)."""

    async def claiming(key: str, attempt: int, *, lease_s: float = 30.0, old: bool = False) -> Any:
        lock = claim_lock_id(store.schema, SCOPE, key)
        args = (SCOPE, key, lock, METHOD, FINGERPRINT, 600.0, lease_s)
        if old:
            return await store.pool.fetchrow(
                "SELECT grpc_idempotency.claim($1, $2, $3, $4, $5, $6, $7) AS token", *args
            )
        return await store.pool.fetchrow(store.statements.claim_phased, *args, attempt)

    return claiming


async def lease_ended(store: Store, key: str) -> bool:
    return bool(
        await store.pool.fetchval(
            "SELECT locked_until <= clock_timestamp() FROM grpc_idempotency.records WHERE key = $1",
            key,
        )
    )


async def row(store: Store, key: str) -> asyncpg.Record:
    found = await store.pool.fetchrow(
        "SELECT fencing_token, created_at, locked_until, state FROM grpc_idempotency.records"
        " WHERE key = $1",
        key,
    )
    assert found is not None
    return found


async def test_the_same_attempt_gets_its_claim_with_a_lease_from_now(
    store: Store, claim: Claim
) -> None:
    """Its token and start as they were (the operation's), its lease a whole one from the try
    that found it: that try may have come most of the first lease later."""
    key = fresh()
    first = await claim(key, 7)
    between = await store.pool.fetchval("SELECT clock_timestamp()")
    again = await claim(key, 7)
    assert (again["token"], again["started_at"]) == (first["token"], first["started_at"])
    found = await row(store, key)
    assert found["fencing_token"] == 1 and found["state"] == "in_progress"
    assert found["locked_until"] >= between + timedelta(seconds=30)


async def test_a_takeover_that_waited_for_the_row_gets_its_lease_from_then(
    store: Store, claim: Claim
) -> None:
    """A takeover queued behind another transaction on the row (a purge batch, a stale owner's
    renewal): its lease counts from when it got the row, not from before its wait."""
    key = fresh()
    await claim(key, 7, lease_s=0.05)
    await until("the lease to run out", lambda: lease_ended(store, key))
    async with store.pool.acquire() as holder:
        async with holder.transaction():
            await holder.execute(
                "SELECT FROM grpc_idempotency.records WHERE key = $1 FOR UPDATE", key
            )
            taking = asyncio.ensure_future(claim(key, 9))

            async def waiting() -> bool:
                return bool(
                    await store.pool.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%claim_with_start%'"
                    )
                )

            await until("the takeover to wait for the row", waiting)
            released = await holder.fetchval("SELECT clock_timestamp()")
        taken = await taking
    assert taken["token"] == 2
    assert (await row(store, key))["locked_until"] > released + timedelta(seconds=30)


@pytest.mark.parametrize("attempt", [8, -7, 7 ^ 1, 0])
async def test_another_attempt_loses_the_race(store: Store, claim: Claim, attempt: int) -> None:
    """Any other attempt id is refused GI002, as every try was before, including those that
    differ from 7 only where the fencing token is folded in (7 ^ 1)."""
    key = fresh()
    await claim(key, 7)
    with pytest.raises(asyncpg.PostgresError) as refused:
        await claim(key, attempt)
    assert refused.value.sqlstate == "GI002"


@pytest.mark.parametrize("old", [False, True], ids=["this-release", "not-yet-upgraded"])
async def test_a_claim_taken_over_since_is_not_the_attempts(
    store: Store, claim: Claim, old: bool
) -> None:
    """The attempt's claim ran out its lease and another attempt took the key over, on a server
    of this release or on one not yet upgraded (whose claim() keeps claim_attempt as it was but
    adds one to the token): the first attempt's id no longer names the claim."""
    key = fresh()
    await claim(key, 7, lease_s=0.05)
    await until("the lease to run out", lambda: lease_ended(store, key))
    taken = await claim(key, 9, old=old)
    assert taken["token"] == 2
    with pytest.raises(asyncpg.PostgresError) as refused:
        await claim(key, 7)
    assert refused.value.sqlstate == "GI002"
    assert (await row(store, key))["fencing_token"] == 2
    if not old:
        assert (await claim(key, 9))["token"] == 2  # the new owner's, recognised in turn


async def test_a_completed_claim_is_not_the_attempts(store: Store, claim: Claim) -> None:
    key = fresh()
    await claim(key, 7)
    await store.pool.execute(
        "UPDATE grpc_idempotency.records SET state = 'completed', locked_until = NULL,"
        " completed_at = clock_timestamp(), status_code = 0 WHERE key = $1",
        key,
    )
    with pytest.raises(asyncpg.PostgresError) as refused:
        await claim(key, 7)
    assert refused.value.sqlstate == "GI002"


async def test_the_attempts_own_claim_past_its_lease_is_taken_over(
    store: Store, claim: Claim
) -> None:
    """Past its lease (released, or a try that came too late), the row is claimed the ordinary
    way: a takeover, with a new fencing token, which fences off anything still running under the
    old one."""
    key = fresh()
    await claim(key, 7, lease_s=0.05)
    await until("the lease to run out", lambda: lease_ended(store, key))
    assert (await claim(key, 7))["token"] == 2


async def test_a_release_by_attempt_id_ends_that_claims_lease_only(
    store: Store, claim: Claim
) -> None:
    """``release_attempt`` (a claim given up on, its answer lost): another attempt's id, or the
    id of a claim taken over since, releases nothing."""
    key = fresh()
    await claim(key, 7)
    released = store.statements.release_attempt
    assert await store.pool.execute(released, SCOPE, key, 8) == "UPDATE 0"
    assert not await lease_ended(store, key)
    assert await store.pool.execute(released, SCOPE, key, 7) == "UPDATE 1"
    assert await lease_ended(store, key)
    assert (await claim(key, 9))["token"] == 2  # taken over at once
    assert await store.pool.execute(released, SCOPE, key, 7) == "UPDATE 0"
    assert not await lease_ended(store, key)
