"""The relay as a real process, killed between delivering a message and marking it sent.

``grpc-idempotency relay`` runs with ``GRPC_IDEMPOTENCY_FAILPOINTS=relay_after_delivery=crash``
and delivers through its gRPC sink to a real grpc.aio receiver started here: LedgerService.Post
behind IdempotencyInterceptor, which inserts a ledger row and records its outcome in one
transaction, keyed by the ``idempotency-key`` the relay sends. The relay dies after the receiver
answered and before the row is marked: the row stays claimed. A relay started without the
failpoint delivers it again once the lease expires, marks it sent, and the receiver replays its
stored answer: the ledger row exists once.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store, Telemetry
from tests.e2e.procs import ServiceProcess
from tests.support.ledger import ledger_rows, running_ledger
from tests.support.otel import attributes
from tests.support.schemas import fresh_store

pytestmark = pytest.mark.e2e

POST = "/testsvc.v1.LedgerService/Post"
LEASE_S = 2.0
WAIT_S = 30.0


@pytest.fixture
async def outbox(pg_dsn: str) -> AsyncIterator[Store]:
    async with fresh_store(pg_dsn, "relay_e2e", max_size=3) as store:
        yield store


def relay_process(
    pg_dsn: str, schema: str, target: str, log_dir: Path, name: str, failpoints: str | None = None
) -> ServiceProcess:
    return ServiceProcess(
        [
            "-m", "grpc_idempotency.cli", "relay",
            "--dsn", pg_dsn, "--schema", schema,
            "--grpc-target", target, "--method", POST,
            "--scope-header", "x-tenant-id",
            "--lease", str(LEASE_S), "--poll-interval", "30", "--timeout", "0.9",
            "--name", name,
        ],
        ready="ready:",
        log_dir=log_dir,
        name=name,
        env={"GRPC_IDEMPOTENCY_FAILPOINTS": failpoints} if failpoints else None,
    )  # fmt: skip


async def outbox_row(outbox: Store, key: str) -> dict[str, object]:
    found = await outbox.pool.fetchrow(
        f"""SELECT *, locked_until > clock_timestamp() AS leased
            FROM "{outbox.schema}".outbox WHERE key = $1""",
        key,
    )
    assert found is not None
    return dict(found)


async def test_a_relay_killed_after_delivery_delivers_again_and_the_effect_happens_once(
    pg_dsn: str, store: Store, outbox: Store, tmp_path: Path
) -> None:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    account = "acct-" + uuid.uuid4().hex
    key = uuid.uuid4().hex
    payload = testsvc_pb2.PostRequest(account=account, amount=42).SerializeToString()
    async with running_ledger(
        store, telemetry=Telemetry(tracer_provider=tracer_provider)
    ) as ledger:
        doomed = relay_process(
            pg_dsn,
            outbox.schema,
            ledger.address,
            tmp_path,
            "relay-doomed",
            failpoints="relay_after_delivery=crash",
        )
        survivor = relay_process(pg_dsn, outbox.schema, ledger.address, tmp_path, "relay-2")
        try:
            await doomed.start()  # listening before the row commits: woken by its NOTIFY
            await outbox.pool.execute(
                f"""INSERT INTO "{outbox.schema}".outbox
                        (scope, key, step, parent_key, method, payload_type, payload)
                    VALUES ('tenant:tenant-a', $1, 'entry-posted.v1', 'parent', '/x.Y/Z',
                            'testsvc.v1.PostRequest', $2)""",
                key,
                payload,
            )
            assert await doomed.wait(WAIT_S) == -signal.SIGKILL, doomed.logs()
            assert "failpoint relay_after_delivery=crash" in doomed.logs()

            # Delivered (the receiver ran and committed), not marked: still claimed.
            assert ledger.service.attempts == {key: 1}
            assert await ledger_rows(store, account) == 1
            crashed = await outbox_row(outbox, key)
            assert crashed["state"] == "pending" and crashed["attempts"] == 1
            assert crashed["claimed_by"] == "relay-doomed" and crashed["leased"]

            restarted_at = time.monotonic()
            await survivor.start()
            deadline = time.monotonic() + WAIT_S
            while (done := await outbox_row(outbox, key))["state"] != "sent":
                assert time.monotonic() < deadline, survivor.logs()
                await asyncio.sleep(0.05)  # looking at the database, not waiting for a time
            # Not before the first claim's lease ran out (measured from the restart: a bound).
            assert time.monotonic() - restarted_at < LEASE_S + 10
            assert done["attempts"] == 2 and done["claimed_by"] == "relay-2"
            await survivor.stop()
            assert survivor.returncode == 0, survivor.logs()
            assert "stopped: delivered 1, retried 0, dead 0" in survivor.logs()
        finally:
            await doomed.stop()
            await survivor.stop()

        # Delivered twice; the handler ran once, the second delivery was answered from the
        # stored outcome; the effect happened once.
        assert ledger.service.attempts == {key: 1}
        assert await ledger_rows(store, account) == 1
        outcomes = [attributes(s)["grpc_idempotency.outcome"] for s in spans.get_finished_spans()]
        assert outcomes == ["executed", "replayed"]


async def test_the_relay_process_stops_cleanly_on_sigterm_and_refuses_an_unmigrated_schema(
    pg_dsn: str, outbox: Store, tmp_path: Path
) -> None:
    relay = relay_process(pg_dsn, outbox.schema, "127.0.0.1:1", tmp_path, "relay-idle")
    await relay.start()
    await relay.stop()
    assert relay.returncode == 0, relay.logs()
    assert "stopped: delivered 0" in relay.logs()

    missing = relay_process(pg_dsn, "no_outbox_here", "127.0.0.1:1", tmp_path, "relay-missing")
    with pytest.raises(RuntimeError, match="exited with 2"):
        await missing.start()
    assert "grpc-idempotency migrate" in missing.logs()
