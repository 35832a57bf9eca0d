"""An in-progress claim past its lease and its retention: the key is new (the wire contract's
"key past retention" row), for another request too.

Such a claim is what an attempt leaves behind when its owner released it (a transient error, a
cancelled call) or stalled or died, and nobody retried the same request within the retention.
claim() took it over only for the same fingerprint, so another request under the key was
answered KEY_REUSED until a purge happened to delete the row (migration 0014).

Every wait here is for the database's clock to pass the record's lease and retention, polled.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, Store, StoreMisconfigured
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import LeaseLost
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.core.lifecycle import Action, Outcome, State, decide
from grpc_idempotency.core.policy import Isolation
from grpc_idempotency.server import interceptor
from grpc_idempotency.store import PhasedClaim
from grpc_idempotency.store.migrations import available_migrations
from tests.support.ledger import fresh, ledger_rows, running_ledger
from tests.support.waiting import until

SVC = "/testsvc.v1.LedgerService/"
PHASED = SVC + "PostPhased"  # lease 0.6 s
POST = SVC + "Post"  # atomic
SCOPE = "tenant:tenant-a"
# Retention shorter than PostPhased's lease: a claim passes its retention before its lease.
SHORT_RETENTION = {PHASED: MethodOverride(retention=timedelta(milliseconds=200))}


def post(account: str, behaviour: str = "") -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account=account, amount=4, behaviour=behaviour)


async def row_of(store: Store, key: str) -> asyncpg.Record:
    row = await store.pool.fetchrow(
        "SELECT state, method, fingerprint, fencing_token, created_at, locked_until, response,"
        " locked_until > clock_timestamp() AS leased"
        f' FROM "{store.schema}".records WHERE scope = $1 AND key = $2',
        SCOPE,
        key,
    )
    assert row is not None
    return row


async def past_lease_and_retention(store: Store, key: str) -> bool:
    """Whether, by the database's clock, the in-progress record under ``key`` is past both its
    lease and its retention (what purge deletes)."""
    return bool(
        await store.pool.fetchval(
            "SELECT state = 'in_progress' AND expires_at <= clock_timestamp()"
            " AND locked_until <= clock_timestamp()"
            f' FROM "{store.schema}".records WHERE scope = $1 AND key = $2',
            SCOPE,
            key,
        )
    )


async def wait_past_lease_and_retention(store: Store, key: str) -> None:
    await until(
        "the claim to pass its lease and its retention",
        lambda: past_lease_and_retention(store, key),
    )


# -- through gRPC ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "replica"),
    [
        (PHASED, "other"),  # a phased retry looks the key up first
        (POST, "other"),  # atomic, on a replica that has not seen the key: claims first
        (POST, "same"),  # atomic, on the server that has: looks first
    ],
    ids=["phased", "atomic-claim-first", "atomic-look-first"],
)
async def test_a_released_claim_past_its_retention_is_a_new_key_for_another_request(
    store: Store, method: str, replica: str
) -> None:
    """The first attempt failed with a transient error (its claim released: in progress, the
    lease over) and was never retried; past its retention the key serves another request."""
    key, account, other = fresh(), fresh("acct"), fresh("acct")
    async with (
        running_ledger(store, overrides=SHORT_RETENTION) as first,
        running_ledger(store) as second,
    ):
        failed = await first.call(PHASED, post(account, "UNAVAILABLE"), key)
        assert failed.code is grpc.StatusCode.UNAVAILABLE
        released = await row_of(store, key)
        assert released["state"] == "in_progress" and not released["leased"]
        await wait_past_lease_and_retention(store, key)

        retrying = first if replica == "same" else second
        answer = await retrying.call(method, post(other), key)
        assert answer.code is grpc.StatusCode.OK, (answer.code, answer.reason(), answer.details)
        assert not answer.replayed
        assert await ledger_rows(store, other) == 1
        assert await ledger_rows(store, account) == 0
        taken = await row_of(store, key)
        assert taken["state"] == "completed" and taken["method"] == method
        assert taken["fencing_token"] == released["fencing_token"] + 1
        assert taken["created_at"] > released["created_at"]  # a new operation, begun now
        # It is the key's operation now: replayed to its own request, refused to the first.
        again = await retrying.call(method, post(other), key)
        assert again.replayed and again.body == answer.body
        first_again = await second.call(PHASED, post(account), key)
        assert first_again.code is grpc.StatusCode.FAILED_PRECONDITION
        assert first_again.reason() == "IDEMPOTENCY_KEY_REUSED"


async def test_two_requests_racing_for_an_abandoned_claim_past_its_retention_one_runs(
    store: Store,
) -> None:
    """Two different requests under the key, on two replicas at once: one claims the key (the
    claim lock lets one in), and the other, looking again, finds that operation: KEY_REUSED."""
    key, account, one, two = fresh(), fresh("acct"), fresh("acct"), fresh("acct")
    async with (
        running_ledger(store, overrides=SHORT_RETENTION) as a,
        running_ledger(store) as b,
    ):
        failed = await a.call(PHASED, post(account, "UNAVAILABLE"), key)
        assert failed.code is grpc.StatusCode.UNAVAILABLE
        await wait_past_lease_and_retention(store, key)
        answers = await asyncio.gather(
            a.call(PHASED, post(one), key), b.call(PHASED, post(two), key)
        )
    codes = sorted(answer.code.value[0] for answer in answers)
    assert codes == [grpc.StatusCode.OK.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0]]
    (refused,) = [answer for answer in answers if answer.code is not grpc.StatusCode.OK]
    assert refused.reason() == "IDEMPOTENCY_KEY_REUSED"
    assert await ledger_rows(store, one) + await ledger_rows(store, two) == 1


@pytest.fixture
def frozen_lease_keepers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Lease keepers that never renew: the owner's process stalls (a GC pause, a frozen VM)
    while its handler is running, and its lease runs out."""

    def frozen(self: Any) -> None:
        return None

    monkeypatch.setattr(interceptor._LeaseKeeper, "start", frozen)
    yield


@pytest.mark.usefixtures("frozen_lease_keepers")
async def test_a_stalled_owner_past_lease_and_retention_loses_the_key_to_another_request(
    store: Store,
) -> None:
    """Replica A's owner stalls mid-handler past its lease and its retention; a different
    request under the key on replica B is a new operation. When A wakes up its final
    transaction is fenced off: ABORTED, LEASE_LOST, nothing of it committed."""
    key, account, other = fresh(), fresh("acct"), fresh("acct")
    # B keeps the default retention: with A's 200 ms the outcome it recorded could expire
    # before the replay at the end on a loaded machine (CI's, once), and the replay ran anew.
    async with (
        running_ledger(store, overrides=SHORT_RETENTION) as a,
        running_ledger(store) as b,
    ):
        stalled = asyncio.ensure_future(a.call(PHASED, post(account, "wait"), key))
        await a.service.started.wait()
        claimed = await row_of(store, key)
        await wait_past_lease_and_retention(store, key)

        answer = await b.call(PHASED, post(other), key)
        assert answer.code is grpc.StatusCode.OK, (answer.code, answer.reason(), answer.details)
        assert not answer.replayed and b.service.executions == 1
        taken = await row_of(store, key)
        assert taken["fencing_token"] == claimed["fencing_token"] + 1
        assert taken["created_at"] > claimed["created_at"]
        assert b.service.operation_starts == [taken["created_at"]]

        a.service.release.set()
        woke = await stalled
        assert woke.code is grpc.StatusCode.ABORTED
        assert woke.reason() == "IDEMPOTENCY_LEASE_LOST"
        assert await ledger_rows(store, account) == 0
        assert await ledger_rows(store, other) == 1
        replay = await a.call(PHASED, post(other), key)
        assert replay.replayed and replay.body == answer.body


# -- the store ---------------------------------------------------------------------------------


async def claim(
    store: Store,
    key: str,
    fingerprint: bytes,
    *,
    lease_s: float,
    retention_s: float,
    isolation: Isolation | None = None,
) -> PhasedClaim | None:
    return await store.claim_phased(
        scope=SCOPE,
        key=key,
        method=PHASED,
        fingerprint=fingerprint,
        retention_s=retention_s,
        lease_s=lease_s,
        isolation=isolation,
    )


async def abandoned(store: Store, key: str, fingerprint: bytes = b"a" * 32) -> PhasedClaim:
    """A phased claim whose owner stalls: its lease and retention run out (0.05 s each)."""
    stale = await claim(store, key, fingerprint, lease_s=0.05, retention_s=0.05)
    assert stale is not None
    await wait_past_lease_and_retention(store, key)
    return stale


@pytest.mark.parametrize("isolation", [None, Isolation.REPEATABLE_READ, Isolation.SERIALIZABLE])
async def test_another_request_over_an_abandoned_claim_is_a_new_operation_fencing_the_old_owner(
    store: Store, isolation: Isolation | None
) -> None:
    key = fresh()
    stale = await abandoned(store, key)
    record = await store.lookup(SCOPE, key)
    assert record is not None and record.state is State.IN_PROGRESS and record.expired
    assert decide(record, b"b" * 32).action is Action.CLAIM
    assert not decide(record, b"b" * 32).takeover  # a new operation, not a takeover

    new = await claim(store, key, b"b" * 32, lease_s=30, retention_s=600, isolation=isolation)
    assert new is not None, "another request was refused a key past its retention"
    assert new.token == stale.token + 1
    assert new.started_at > stale.started_at  # the new operation begins now
    row = await row_of(store, key)
    assert bytes(row["fingerprint"]) == b"b" * 32 and row["created_at"] == new.started_at

    # The stalled owner wakes up: it can neither commit, nor renew, nor release the new claim.
    with pytest.raises(LeaseLost):
        await stale.begin_final(timeout=5)
    assert not await stale.renew()
    await stale.release()
    assert (await row_of(store, key))["leased"]
    attempt = await new.begin_final(timeout=5)
    await attempt.record(Outcome(code=Code.OK, response=b"new"))
    done = await row_of(store, key)
    assert (done["state"], done["fencing_token"], done["response"]) == ("completed", 2, b"new")


async def test_the_same_request_over_an_abandoned_claim_continues_its_operation(
    store: Store,
) -> None:
    """Past its retention too, a retry of the same request takes the claim over as before:
    the operation continues, and keeps its start (child keys rely on it)."""
    key = fresh()
    stale = await abandoned(store, key)
    record = await store.lookup(SCOPE, key)
    assert record is not None
    decision = decide(record, b"a" * 32)
    assert decision.action is Action.CLAIM and decision.takeover
    again = await claim(store, key, b"a" * 32, lease_s=30, retention_s=600)
    assert again is not None
    assert again.token == stale.token + 1 and again.started_at == stale.started_at
    with pytest.raises(LeaseLost):
        await stale.begin_final(timeout=5)


async def test_a_live_lease_past_its_retention_still_refuses_another_request(
    store: Store,
) -> None:
    """The retention counts from the claim: an owner still renewing its lease past it is
    running the operation, and the key stays its own."""
    key = fresh()
    owner = await claim(store, key, b"a" * 32, lease_s=30, retention_s=0.05)
    assert owner is not None

    async def past_retention() -> bool:
        return bool(
            await store.pool.fetchval(
                f'SELECT expires_at <= clock_timestamp() FROM "{store.schema}".records'
                " WHERE scope = $1 AND key = $2",
                SCOPE,
                key,
            )
        )

    await until("the claim to pass its retention", past_retention)
    assert await claim(store, key, b"b" * 32, lease_s=30, retention_s=600) is None
    record = await store.lookup(SCOPE, key)
    assert record is not None and not record.expired
    assert decide(record, b"b" * 32).action is Action.MISMATCH


async def test_an_old_owner_that_opened_its_final_transaction_first_keeps_the_key(
    store: Store,
) -> None:
    """The race the other way round: the stalled owner's final transaction holds the claim lock
    (verify_claim) before another request claims. That claim loses (looks again), the owner
    commits, and its outcome is kept for its retention from the completion."""
    key = fresh()
    stale = await abandoned(store, key)
    # The final transaction may sit idle for the claim's lease (idle_in_transaction_session
    # _timeout), 0.05 s here: on a loaded CI machine the other claim's round trip outlasted it,
    # PostgreSQL ended the owner's session, and its record failed. What is tested is the lock
    # order, not that timeout: the owner's final transaction idles for as long as it needs.
    stale.lease_s = 30
    attempt = await stale.begin_final(timeout=5)
    try:
        assert await claim(store, key, b"b" * 32, lease_s=30, retention_s=600) is None
    finally:
        await attempt.record(Outcome(code=Code.OK, response=b"old"))
    row = await row_of(store, key)
    assert (row["state"], row["fencing_token"], row["response"]) == ("completed", 1, b"old")


async def test_a_claim_meeting_a_purge_of_the_abandoned_claim_waits_and_inserts_anew(
    store: Store, db: asyncpg.Connection
) -> None:
    """The purge deletes the abandoned claim as another request claims the key: the claim waits
    for the purge's transaction, then inserts (token 1, a new start); the old owner is fenced
    off all the same. (The other order, a purge reaching a row just taken over, is
    test_purge.py's test_purge_never_deletes_a_key_taken_over_concurrently.)"""
    key = fresh()
    stale = await abandoned(store, key)
    purger = await db.fetchval("SELECT pg_backend_pid()")
    await db.execute("BEGIN")
    deleted = await db.execute(
        f'DELETE FROM "{store.schema}".records WHERE scope = $1 AND key = $2', SCOPE, key
    )
    assert deleted == "DELETE 1"
    claiming = asyncio.ensure_future(claim(store, key, b"b" * 32, lease_s=30, retention_s=600))
    try:

        async def claim_waits() -> bool:
            return bool(
                await store.pool.fetchval(
                    "SELECT EXISTS (SELECT FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND $1 = ANY (pg_blocking_pids(pid)))",
                    purger,
                )
            )

        await until("the claim to wait for the purge", claim_waits)
    finally:
        await db.execute("COMMIT")
    new = await claiming
    assert new is not None and new.token == 1 and new.started_at > stale.started_at
    with pytest.raises(LeaseLost):
        await stale.begin_final(timeout=5)


# -- the migration -----------------------------------------------------------------------------


async def test_a_schema_at_0013_needs_0014_and_takes_abandoned_claims_over_once_migrated(
    pg_dsn: str,
) -> None:
    """A server of this version refuses a schema at 0013, whose claim() refuses another request
    over an abandoned claim past its retention; migrating applies 0014 (claim() replaced, its
    signature kept) and what came after it, and the same claim is then a new operation."""
    schema = f"gi_at_13_{uuid.uuid4().hex[:8]}"
    store = await Store.connect(pg_dsn, schema=schema, migrate=True)
    try:
        key = fresh()
        await abandoned(store, key)
        # Back to 0013: its claim() is 0007's (0008 to 0013 did not replace it), and 0016's
        # claim_with_start overload and column are not there yet.
        (retention_floor,) = [m for m in available_migrations() if m.version == 7]
        await store.pool.execute(retention_floor.sql.replace("{schema}", f'"{schema}"'))
        await store.pool.execute(
            f'DROP FUNCTION "{schema}".claim_with_start('
            "text, text, bigint, text, bytea, float8, float8, bigint)"
        )
        await store.pool.execute(f'ALTER TABLE "{schema}".records DROP COLUMN claim_attempt')
        await store.pool.execute(f'DELETE FROM "{schema}".schema_migrations WHERE version >= 14')
        later = [m.version for m in available_migrations() if m.version >= 14]
        with pytest.raises(
            StoreMisconfigured, match=rf"at version 13; .* needs migrations {re.escape(str(later))}"
        ):
            await Store.connect(pg_dsn, schema=schema)
        # What a server of the release before 0014 sends (0012's claim_with_start over claim()).
        with pytest.raises(asyncpg.PostgresError) as refused:
            await store.pool.fetchrow(
                f'SELECT * FROM "{schema}".claim_with_start($1, $2, $3, $4, $5, $6, $7)',
                SCOPE,
                key,
                claim_lock_id(schema, SCOPE, key),
                PHASED,
                b"b" * 32,
                600.0,
                30.0,
            )
        assert refused.value.sqlstate == "GI002"
        assert await store.migrate() == later
        new = await claim(store, key, b"b" * 32, lease_s=30, retention_s=600)
        assert new is not None and new.token == 2
        await (await Store.connect(pg_dsn, schema=schema)).close()
    finally:
        await store.pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await store.close()
