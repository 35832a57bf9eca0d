"""Crash tests: the payments example as a real process, killed at the worst moments.

Each test runs ``python -m examples.checkout payments`` against the session's real PostgreSQL,
kills it (a failpoint's self-inflicted SIGKILL, or SIGKILL from here), restarts it without
failpoints and retries with the same key. Whatever the moment of death, the charge exists
exactly once afterwards: a crash after COMMIT replays the stored bytes, a crash before COMMIT
leaves nothing behind (PostgreSQL rolls back the dead backend's transaction and its advisory
lock goes with it) and the retry executes.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from examples.checkout.service import records_schema
from grpc_idempotency.core.keys import claim_lock_id
from tests.e2e import tenants
from tests.e2e.procs import SIGKILLED, Processes, ServiceProcess, free_port
from tests.e2e.services import CHARGE
from tests.support.waiting import until

# isort: split
from checkout.v1 import payments_pb2  # importable only once examples.checkout.gen is

pytestmark = pytest.mark.e2e

PAYMENTS_RECORDS = records_schema("payments")
APP_NAME = "grpc-idempotency"
CALL_TIMEOUT_S = 10.0


class Operation:
    """One logical charge: a tenant, a key, an order; every attempt sends the same request."""

    def __init__(self) -> None:
        self.account = tenants.fresh()  # the tenant its token authenticates
        self.tenant = self.account.name
        self.scope = self.account.scope
        self.key = "crash-" + uuid.uuid4().hex
        self.order_id = "ord-" + uuid.uuid4().hex[:12]

    def request(self) -> payments_pb2.ChargeRequest:
        # sent_at differs per attempt, like a real client's; it is excluded from the fingerprint.
        sent_at = Timestamp()
        sent_at.GetCurrentTime()
        return payments_pb2.ChargeRequest(
            order_id=self.order_id,
            amount_cents=1999,
            currency="EUR",
            card_token="tok_visa",
            sent_at=sent_at,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("idempotency-key", self.key), self.account.credential)

    def lock_id(self) -> int:
        return claim_lock_id(PAYMENTS_RECORDS, self.scope, self.key)


class Answer:
    def __init__(self, raw: bytes, initial_metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.raw = raw
        self.initial_metadata = initial_metadata

    @property
    def replayed(self) -> bool:
        return ("idempotency-replayed", "true") in self.initial_metadata

    def message(self) -> payments_pb2.ChargeResponse:
        return payments_pb2.ChargeResponse.FromString(self.raw)


def _call(channel: grpc.aio.Channel, op: Operation) -> grpc.aio.UnaryUnaryCall[Any, Any]:
    # No response deserializer: the call yields the exact bytes the server sent.
    charge = channel.unary_unary(
        CHARGE,
        request_serializer=payments_pb2.ChargeRequest.SerializeToString,
        response_deserializer=None,
    )
    return charge(op.request(), metadata=op.metadata(), timeout=CALL_TIMEOUT_S)


async def charge(port: int, op: Operation) -> Answer:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = _call(channel, op)
        raw = await call
        metadata = tuple(await call.initial_metadata() or ())
        assert isinstance(raw, bytes)
        return Answer(raw, metadata)


async def charge_into_crash(
    db: asyncpg.Connection, port: int, op: Operation, server: ServiceProcess, failpoint: str
) -> None:
    """The first attempt: the failpoint kills the server under it; the client sees UNAVAILABLE."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await charge(port, op)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
    assert await server.wait() == SIGKILLED, server.logs()
    # It died where the test meant it to, not somewhere else.
    assert f"failpoint {failpoint}=crash" in server.stderr_path.read_text(), server.logs()
    await claim_released(db, op)


async def charges_of(db: asyncpg.Connection, op: Operation) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT charge_id, order_id, amount_cents, tenant FROM payments.charges"
        " WHERE order_id = $1",
        op.order_id,
    )


async def record_of(db: asyncpg.Connection, op: Operation) -> asyncpg.Record | None:
    return await db.fetchrow(
        f"SELECT state, status_code, response FROM {PAYMENTS_RECORDS}.records"
        " WHERE scope = $1 AND key = $2",
        op.scope,
        op.key,
    )


async def claim_holders(db: asyncpg.Connection, op: Operation) -> list[asyncpg.Record]:
    """Backends holding the key's claim lock (pg_locks splits a bigint key into two oids)."""
    unsigned = op.lock_id() & 0xFFFF_FFFF_FFFF_FFFF
    return await db.fetch(
        "SELECT a.pid, a.application_name, a.state FROM pg_locks l"
        " JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
        " AND l.classid::bigint = $1 AND l.objid::bigint = $2",
        unsigned >> 32,
        unsigned & 0xFFFF_FFFF,
    )


async def claim_released(db: asyncpg.Connection, op: Operation) -> None:
    """Waits until no backend holds the key's claim lock: PostgreSQL has noticed that the dead
    server's connections are gone and rolled back whatever they left open. (A retry before that
    would only wait on the claim; waiting here keeps the test's sequence deterministic.)"""

    async def released() -> bool:
        return not await claim_holders(db, op)

    await until("the claim lock to be released", released)


async def assert_executed_once(db: asyncpg.Connection, op: Operation, answer: Answer) -> None:
    """The retry ran the handler: no replay marker, one charge, one completed record."""
    assert not answer.replayed, answer.initial_metadata
    response = answer.message()
    assert response.order_id == op.order_id
    rows = await charges_of(db, op)
    assert len(rows) == 1, rows
    assert rows[0]["charge_id"] == response.charge_id
    assert rows[0]["tenant"] == op.scope
    record = await record_of(db, op)
    assert record is not None
    assert record["state"] == "completed"
    assert record["status_code"] == 0
    assert bytes(record["response"]) == answer.raw


async def test_kill_after_commit_before_response_replays_stored_bytes(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection
) -> None:
    op = Operation()
    port = free_port()
    point = "after_commit_before_response"
    server = await procs.payments(pg_dsn, port, failpoints=f"{point}=crash")
    await charge_into_crash(db, port, op, server, point)

    # The charge and its outcome committed together before the process died.
    rows = await charges_of(db, op)
    assert len(rows) == 1, rows
    record = await record_of(db, op)
    assert record is not None and record["state"] == "completed", record
    stored = bytes(record["response"])

    await procs.payments(pg_dsn, port)
    answer = await charge(port, op)

    assert answer.replayed, answer.initial_metadata
    assert answer.raw == stored
    response = answer.message()
    assert response.charge_id == rows[0]["charge_id"]
    assert response.order_id == op.order_id
    assert response.amount_cents == 1999
    assert len(await charges_of(db, op)) == 1


@pytest.mark.parametrize("failpoint", ["after_claim", "before_commit"])
async def test_kill_before_commit_leaves_nothing_and_retry_executes(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection, failpoint: str
) -> None:
    op = Operation()
    port = free_port()
    server = await procs.payments(pg_dsn, port, failpoints=f"{failpoint}=crash")
    await charge_into_crash(db, port, op, server, failpoint)

    # Nothing committed: no charge, no record (the claim died with its transaction).
    assert await charges_of(db, op) == []
    assert await record_of(db, op) is None

    await procs.payments(pg_dsn, port)
    answer = await charge(port, op)
    await assert_executed_once(db, op, answer)


async def test_kill_from_outside_mid_transaction_rolls_back_and_retry_executes(
    pg_dsn: str, procs: Processes, db: asyncpg.Connection
) -> None:
    op = Operation()
    port = free_port()
    # The wait after the claim only has to outlast the test's look at pg_stat_activity and its
    # kill: long, so that load cannot end it first (and free: the process is killed in it).
    server = await procs.payments(pg_dsn, port, failpoints="after_claim=sleep:60000")

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = _call(channel, op)

        # The handler is mid-transaction once the key's claim lock is held by a library
        # connection that sits idle in its open transaction.
        async def claimed() -> list[asyncpg.Record]:
            return [
                r
                for r in await claim_holders(db, op)
                if r["application_name"] == APP_NAME and r["state"] == "idle in transaction"
            ]

        holders = await until("the claim to be held", claimed)
        assert len(holders) == 1, holders
        backend = holders[0]["pid"]
        assert not call.done()

        server.kill()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
    assert await server.wait() == SIGKILLED, server.logs()

    # PostgreSQL notices the dead client, rolls back its transaction and drops the lock.
    async def backend_gone() -> bool:
        alive: int = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", backend
        )
        return alive == 0

    await until("the dead server's backend to end", backend_gone)
    await claim_released(db, op)
    assert await charges_of(db, op) == []
    assert await record_of(db, op) is None

    await procs.payments(pg_dsn, port)
    answer = await charge(port, op)
    await assert_executed_once(db, op, answer)
