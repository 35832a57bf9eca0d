"""``grpc-idempotency inspect`` on the checkout flow after a crash-and-retry drill.

OrderService (a real process) is killed (kill -9, the ``before_commit`` failpoint) after it
charged the card and sent the email and before its final commit; restarted; the retry takes the
order over once the dead attempt's lease has run out (by the database's clock) and re-runs the
handler, whose child keys reach the same charge and email. Then ``inspect`` runs as a real CLI
subprocess against the three services' stores and answers "was I charged twice?": one order
record (claimed twice, by the first attempt and the takeover), one charge, one email, one
OrderCreated outbox row, asserted from its ``--json`` output and checked in its tree output,
and cross-checked against the services' own tables.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypedDict

import asyncpg
import grpc
import pytest

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from examples.checkout import orders as orders_service
from examples.checkout.service import open_store, records_schema
from grpc_idempotency import child_key
from tests.e2e import tenants
from tests.e2e.procs import ROOT, Processes
from tests.support.waiting import until

# isort: split
from checkout.v1 import orders_pb2, orders_pb2_grpc  # importable only once examples.checkout.gen is

pytestmark = pytest.mark.e2e

GEN = ROOT / "examples" / "checkout" / "gen"
PLACE_ORDER = "/checkout.v1.OrderService/PlaceOrder"
CHARGE = "/checkout.v1.PaymentService/Charge"
SEND_EMAIL = "/checkout.v1.NotificationService/SendEmail"
ORDERS, PAYMENTS, NOTIFICATIONS = (
    records_schema(s) for s in ("orders", "payments", "notifications")
)
MODULES = ["checkout.v1.orders_pb2", "checkout.v1.payments_pb2", "checkout.v1.notifications_pb2"]
MODULES += ["checkout.v1.events_pb2"]
SIGKILLED = -signal.SIGKILL


@pytest.fixture(scope="module")
async def downstream(
    pg_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[int, int]]:
    """Payments and notifications processes for this module: (payments port, notifications)."""
    # Orders' schemas first, once: replicas started together would race to create them.
    store = await open_store(pg_dsn, orders_service.NAME, orders_service.TABLES_SQL)
    await store.close()
    processes = Processes(tmp_path_factory.mktemp("inspect-downstream"))
    try:
        payments, notifications = await asyncio.gather(
            processes.payments(pg_dsn, 0), processes.notifications(pg_dsn, 0)
        )
        assert payments.port and notifications.port
        yield payments.port, notifications.port
    finally:
        await processes.close()


async def inspect(*args: str, **env_extra: str) -> tuple[int, str, str]:
    """``python -m grpc_idempotency.cli inspect ARGS`` as a subprocess, without the caller's
    PG*, GRPC_IDEMPOTENCY_* or PYTHONPATH: (status, out, err)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    env.pop("PYTHONPATH", None)
    env.update(env_extra)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "grpc_idempotency.cli", "inspect", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def the_step(operation: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any]
    (found,) = [s for s in operation["steps"] if s["step"] == name]
    return found


class _Ports(TypedDict):
    payments: int
    notifications: int


async def test_after_a_crash_and_a_takeover_inspect_shows_one_charge_one_order_one_email(
    pg_dsn: str,
    procs: Processes,
    db: asyncpg.Connection,
    downstream: tuple[int, int],
    tmp_path: Path,
) -> None:
    payments_port, notifications_port = downstream
    tenant = tenants.fresh()
    scope, key = tenant.scope, "order-" + uuid.uuid4().hex
    order_id = "ord-" + uuid.uuid4().hex[:12]

    def request() -> orders_pb2.PlaceOrderRequest:
        r = orders_pb2.PlaceOrderRequest(
            order_id=order_id, amount_cents=4200, currency="EUR", card_token="tok_visa",
            email="buyer@example.com",
        )  # fmt: skip
        r.sent_at.GetCurrentTime()  # differs per attempt; excluded from the fingerprint
        return r

    async def place(address: str) -> orders_pb2.PlaceOrderResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = orders_pb2_grpc.OrderServiceStub(channel)
            md = (("idempotency-key", key), tenant.credential)
            response: orders_pb2.PlaceOrderResponse = await stub.PlaceOrder(
                request(), metadata=md, timeout=15
            )
            return response

    # The drill: charged and emailed, then killed before the final commit.
    ports: _Ports = {"payments": payments_port, "notifications": notifications_port}
    first = await procs.orders(pg_dsn, 0, **ports, lease=1, failpoints="before_commit=crash")
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await place(first.address)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value
    assert await first.wait() == SIGKILLED, first.logs()
    assert "failpoint before_commit=crash" in first.stderr_path.read_text(), first.logs()

    restarted = await procs.orders(pg_dsn, 0, **ports, lease=1)

    async def lease_ran_out() -> bool:
        expired: bool | None = await db.fetchval(
            f"SELECT state = 'in_progress' AND locked_until <= clock_timestamp()"
            f" FROM {ORDERS}.records WHERE scope = $1 AND key = $2",
            scope,
            key,
        )
        return bool(expired)

    await until("the dead attempt's lease to run out", lease_ran_out)
    placed = await place(restarted.address)

    # inspect, as JSON: the stores named on the command line, the modules on PYTHONPATH.
    stores = ["--dsn", pg_dsn, "--schema", ORDERS, "--schema", PAYMENTS, "--schema", NOTIFICATIONS]
    modules = [arg for m in MODULES for arg in ("--proto-module", m)]
    code, out, err = await inspect(
        *stores, *modules, "--scope", scope, key, "--json", PYTHONPATH=str(GEN)
    )
    assert code == 0, err
    report = json.loads(out)
    (order,) = report["operations"]
    assert (order["service"], order["method"], order["state"]) == (ORDERS, PLACE_ORDER, "completed")
    assert order["claims"] == 2  # the crashed attempt's claim, then the takeover's
    decoded = order["response"]["decoded"]
    assert (decoded["order_id"], decoded["charge_id"], decoded["email_id"]) == (
        order_id, placed.charge_id, placed.email_id
    )  # fmt: skip

    charge = the_step(order, "charge-card.v1")
    assert charge["key"] == child_key(scope, key, "charge-card.v1") and charge["call"] == CHARGE
    (charged,) = charge["records"]  # one charge record, in payments' store only
    assert (charged["service"], charged["method"], charged["state"]) == (
        PAYMENTS,
        CHARGE,
        "completed",
    )
    assert charged["claims"] == 1  # the re-run's call was replayed, not executed again
    assert charged["response"]["decoded"]["charge_id"] == placed.charge_id

    email = the_step(order, "send-confirmation.v1")
    (sent,) = email["records"]
    assert (sent["service"], sent["method"], sent["state"]) == (
        NOTIFICATIONS,
        SEND_EMAIL,
        "completed",
    )
    assert sent["response"]["decoded"]["email_id"] == placed.email_id

    event = the_step(order, "order-created-event.v1")
    (row,) = event["outbox"]  # the crashed attempt's row rolled back with its final transaction
    assert row["key"] == child_key(scope, key, "order-created-event.v1")
    assert row["payload"]["type"] == "checkout.v1.OrderCreated"
    assert row["payload"]["decoded"]["charge_id"] == placed.charge_id
    assert order["other_outbox"] == []

    assert order["totals"]["effects_by_step"] == {
        "charge-card.v1": 1, "send-confirmation.v1": 1, "order-created-event.v1": 1
    }  # fmt: skip
    assert order["totals"]["duplicates"] == [] and order["totals"]["missing"] == []

    # What inspect says is what the services did: one charge, one email, one order.
    for table in ("payments.charges", "notifications.emails", "orders.orders"):
        rows = await db.fetchval(
            f"SELECT count(*) FROM {table} WHERE order_id = $1 AND tenant = $2", order_id, scope
        )
        assert rows == 1, table

    # inspect, as a tree, from a config file that names the services and where the modules are.
    config = tmp_path / "checkout.toml"
    config.write_text(
        f'python_path = ["{GEN}"]\nproto_modules = {json.dumps(MODULES)}\n'
        + "".join(
            f'\n[services.{name}]\ndsn_env = "CHECKOUT_DSN"\nschema = "{records_schema(name)}"\n'
            for name in ("orders", "payments", "notifications")
        )
    )
    code, tree, err = await inspect(
        "--config", str(config), "--scope", scope, key, CHECKOUT_DSN=pg_dsn
    )
    assert code == 0, err
    assert tree.splitlines()[0] == f"{scope} {key}"
    assert f"{PLACE_ORDER}  completed OK  [orders]" in tree
    assert "claims: 2 (fencing token 2: the first and 1 later)" in tree
    assert f"{CHARGE}  completed OK  [payments]" in tree
    assert f"{SEND_EMAIL}  completed OK  [notifications]" in tree
    assert f'charge_id: "{placed.charge_id}"' in tree
    assert "step order-created-event.v1 (outbox)" in tree
    assert "payload checkout.v1.OrderCreated" in tree
    assert "effects: charge-card.v1 x1, send-confirmation.v1 x1, order-created-event.v1 x1" in tree
    assert "DUPLICATED" not in tree
