"""Edges of a phased claim's lease that its fencing must get right, at the store's level."""

from __future__ import annotations

from grpc_idempotency import Store
from tests.support.ledger import fresh

PHASED = "/testsvc.v1.LedgerService/PostPhased"
SCOPE = "tenant:tenant-a"


async def test_a_lease_run_out_that_nobody_took_over_is_still_renewed(store: Store) -> None:
    """A renewal that comes after its lease ran out (the event loop or the database slow), with
    no other attempt having taken the key over, still holds the claim: only a released claim
    (its lease ended at the operation's start) or one taken over is refused. Refused, the
    keeper took the claim for lost, cancelled a handler nobody had replaced and answered
    LEASE_LOST."""
    key = fresh()
    claim = await store.claim_phased(
        scope=SCOPE,
        key=key,
        method=PHASED,
        fingerprint=b"f" * 32,
        retention_s=600.0,
        lease_s=30.0,
    )
    assert claim is not None
    # The lease ran out: it ends between the operation's start and now.
    ran_out = await store.pool.fetchval(
        "UPDATE grpc_idempotency.records"
        " SET locked_until = created_at + (clock_timestamp() - created_at) / 2"
        " WHERE scope = $1 AND key = $2"
        " RETURNING created_at < locked_until AND locked_until <= clock_timestamp()",
        SCOPE,
        key,
    )
    assert ran_out is True
    assert await claim.renew()
    leased = await store.pool.fetchval(
        "SELECT locked_until > clock_timestamp() + interval '20 seconds'"
        " FROM grpc_idempotency.records WHERE scope = $1 AND key = $2",
        SCOPE,
        key,
    )
    assert leased is True
    await claim.release()
