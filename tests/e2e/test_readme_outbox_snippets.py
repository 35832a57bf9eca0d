"""The README's outbox snippets ("Side effects outside the database: the outbox, relays and
consumers"), run as a user would, end to end: an order placed through the interceptor enqueues
its event, the relay delivers it to the raw-bytes receiver, which records it once, and a
redelivery of the same row records nothing more.

The snippets are the section's ```proto and ```python fences, each found by the line that makes
it what it is (``SNIPPETS``: the start of one of its lines), not by its place or the prose
around it; the section must hold no other such fence, so a snippet added there fails here until
it is run. Each runs as written, top-level ``await`` included (as in ``python -m asyncio``), in a
namespace holding only what the user would have around it:

- the method option: ``rpc PlaceOrder`` of the user's ``shop/v1/orders.proto``, compiled with
  grpc_tools.protoc and ``proto_include()``; ``shop/v1/events.proto`` (``OrderCreated``, an
  ``order_id``) and ``shop/v1/ledger.proto`` (``Ledger.Record``, ``RecordResponse``) are the
  user's too;
- the enqueue line: in ``PlaceOrder``'s handler, behind ``IdempotencyInterceptor``, with
  ``current_call``, ``events_pb2`` and the handler's ``request``;
- the relay: ``store`` and ``target`` (the receiver's address), nothing imported for it (it
  imports its own names, ``asyncio`` included; it used ``grpc`` without importing it); run
  with ``run(stop)``, ``stop`` set once the row is marked sent, then ``drain()`` as its comment
  offers, for the redelivery;
- the consumer: ``store`` and ``message_id``;
- the receiver: ``grpc``, ``PooledConnection``, ``events_pb2``, ``ledger_pb2``, the consumer
  snippet's ``consumer`` and ``server`` (a ``grpc.aio.Server``, started after it); its
  ``ledger`` table is the user's.

The README's placeholders (``...``) are the only text replaced (``FILL_INS``, each found exactly
once); a name a snippet gets wrong fails here.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import pytest

from grpc_idempotency import (
    Consumed,
    IdempotencyInterceptor,
    PooledConnection,
    StaticScope,
    Store,
    current_call,
    proto_include,
)
from tests.e2e.procs import ROOT
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

README = ROOT / "README.md"
SECTION = "### Side effects outside the database: the outbox, relays and consumers"
# The line that identifies each snippet.
OPTION = "rpc PlaceOrder(PlaceOrderRequest) returns (PlaceOrderResponse) {"
ENQUEUE = 'await current_call().enqueue("order-created-event.v1",'
RELAY = "relay = Relay(store, sink"
CONSUMER = "consumer = IdempotentConsumer(store,"
RECEIVER = "async def record(request: bytes, context) -> bytes:"
SNIPPETS = {"proto": (OPTION,), "python": (ENQUEUE, RELAY, CONSUMER, RECEIVER)}
# The README's placeholders, and what the user would write there.
FILL_INS = {
    ENQUEUE: {"events_pb2.OrderCreated(...)": "events_pb2.OrderCreated(order_id=request.order_id)"},
    CONSUMER: {
        'conn.execute("INSERT ...", ...)': (
            'conn.execute("INSERT INTO ledger (order_id) VALUES ($1)", message_id)'
        )
    },
}

# The user's protos around the README's method option.
ORDERS_PROTO = """\
syntax = "proto3";

package shop.v1;

import "grpc_idempotency/v1/options.proto";

service Orders {
%s
}

message PlaceOrderRequest {
  string order_id = 1;
}

message PlaceOrderResponse {
  string order_id = 1;
}
"""
EVENTS_PROTO = """\
syntax = "proto3";

package shop.v1;

message OrderCreated {
  string order_id = 1;
}
"""
LEDGER_PROTO = """\
syntax = "proto3";

package shop.v1;

import "shop/v1/events.proto";

service Ledger {
  rpc Record(OrderCreated) returns (RecordResponse);
}

message RecordResponse {}
"""
# The receiver's table: no unique constraint, so an effect run twice shows as two rows.
LEDGER_TABLE = "CREATE TABLE ledger (order_id text NOT NULL)"


def readme_snippets() -> dict[str, str]:
    """The section's proto and Python fences, by the line of ``SNIPPETS`` each holds."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{SECTION}\n")
    # The next heading of its level or above (a fence's comment starts "# ", not "## ").
    ends = [text.find(f"\n{h} ", start + 1) for h in ("##", "###")]
    end = min((e for e in ends if e != -1), default=len(text))
    section = text[start:end]
    found: dict[str, str] = {}
    for language, marks_of_language in SNIPPETS.items():
        for fence in re.findall(rf"^```{language}\n(.*?)^```$", section, re.S | re.M):
            lines = fence.splitlines()
            marks = [m for m in marks_of_language if any(line.startswith(m) for line in lines)]
            assert len(marks) == 1, f"a {language} fence of {SECTION!r} not run here:\n{fence}"
            assert marks[0] not in found, f"two fences of {SECTION!r} hold {marks[0]!r}"
            found[marks[0]] = fence
    missing = {m for marks in SNIPPETS.values() for m in marks} - set(found)
    assert not missing, f"no fence of {SECTION!r} holds {sorted(missing)}"
    for mark, fill_ins in FILL_INS.items():
        for placeholder, filled in fill_ins.items():
            assert found[mark].count(placeholder) == 1, (mark, placeholder)
            found[mark] = found[mark].replace(placeholder, filled)
    return found


async def run_snippet(mark: str, source: str, namespace: dict[str, Any]) -> None:
    """Runs ``source`` in ``namespace`` as ``python -m asyncio`` would: top-level ``await``s
    are awaited; what it defines stays in ``namespace``."""
    code = compile(source, f"<README: {mark}>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)  # the README's own text
    if result is not None:
        await result


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModuleType]]:
    """The user's generated modules: orders, events and ledger of ``shop.v1``."""
    project = tmp_path_factory.mktemp("shop-project")
    protos = project / "protos" / "shop" / "v1"
    protos.mkdir(parents=True)
    option = readme_snippets()[OPTION]
    (protos / "orders.proto").write_text(ORDERS_PROTO % option, encoding="utf-8")
    (protos / "events.proto").write_text(EVENTS_PROTO, encoding="utf-8")
    (protos / "ledger.proto").write_text(LEDGER_PROTO, encoding="utf-8")
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{project / 'protos'}",
            f"-I{proto_include()}", f"--python_out={project}", f"--grpc_python_out={project}",
            *(str(p) for p in sorted(protos.glob("*.proto"))),
        ],
        check=True,
    )  # fmt: skip
    for package in ("shop", "shop/v1"):
        (project / package / "__init__.py").touch()
    sys.path.insert(0, str(project))
    try:
        yield {
            name: importlib.import_module(f"shop.v1.{name}")
            for name in ("orders_pb2", "orders_pb2_grpc", "events_pb2", "ledger_pb2")
        }
    finally:
        sys.path.remove(str(project))
        for name in [n for n in sys.modules if n == "shop" or n.startswith("shop.")]:
            del sys.modules[name]


@pytest.fixture
async def user_store(pg_dsn: str) -> AsyncIterator[Store]:
    """A store on a database of its own: the relay takes every due row of its step, and the
    session's database holds other tests' rows."""
    database = "readme_outbox_" + uuid.uuid4().hex[:10]
    admin = await asyncpg.connect(pg_dsn)
    await admin.execute(f'CREATE DATABASE "{database}"')
    try:
        dsn = urlunsplit(urlsplit(pg_dsn)._replace(path="/" + database))
        store = await Store.connect(dsn, min_size=1, max_size=5, migrate=True)
        try:
            await store.pool.execute(LEDGER_TABLE)
            yield store
        finally:
            await store.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()


async def ledger_rows(store: Store, order_id: str) -> int:
    count = await store.pool.fetchval("SELECT count(*) FROM ledger WHERE order_id = $1", order_id)
    return int(count)


async def test_the_outbox_snippets_run_as_written(
    shop: dict[str, ModuleType], user_store: Store
) -> None:
    snippets = readme_snippets()
    store = user_store
    events_pb2, ledger_pb2 = shop["events_pb2"], shop["ledger_pb2"]
    orders_pb2, orders_pb2_grpc = shop["orders_pb2"], shop["orders_pb2_grpc"]

    # The consumer snippet, alone: its effect runs once, a repeat is a duplicate.
    consumed: dict[str, Any] = {"store": store, "message_id": "msg-" + uuid.uuid4().hex}
    await run_snippet(CONSUMER, snippets[CONSUMER], consumed)
    assert consumed["result"].outcome is Consumed.PROCESSED
    again = dict(consumed)
    await run_snippet(CONSUMER, snippets[CONSUMER], again)
    assert again["result"].outcome is Consumed.DUPLICATE and again["result"].duplicate
    assert await ledger_rows(store, consumed["message_id"]) == 1

    # The receiver snippet, on the server it is registered with.
    ledger_server = grpc.aio.server()
    receiving: dict[str, Any] = {
        "grpc": grpc,
        "PooledConnection": PooledConnection,
        "events_pb2": events_pb2,
        "ledger_pb2": ledger_pb2,
        "consumer": consumed["consumer"],
        "server": ledger_server,
    }
    await run_snippet(RECEIVER, snippets[RECEIVER], receiving)
    target = f"127.0.0.1:{ledger_server.add_insecure_port('127.0.0.1:0')}"
    await ledger_server.start()

    # The orders service, whose handler enqueues with the README's line.
    class Orders(orders_pb2_grpc.OrdersServicer):  # type: ignore[name-defined,misc]
        async def PlaceOrder(self, request: Any, context: Any) -> Any:
            namespace = {"current_call": current_call, "events_pb2": events_pb2, "request": request}
            await run_snippet(ENQUEUE, snippets[ENQUEUE], namespace)
            return orders_pb2.PlaceOrderResponse(order_id=request.order_id)

    orders_server = grpc.aio.server(
        interceptors=[
            IdempotencyInterceptor(store, services=[orders_pb2], scope=StaticScope("shop"))
        ]
    )
    orders_pb2_grpc.add_OrdersServicer_to_server(Orders(), orders_server)
    orders_port = orders_server.add_insecure_port("127.0.0.1:0")
    await orders_server.start()
    relaying: dict[str, Any] = {"store": store, "target": target}
    try:
        order_id = "order-" + uuid.uuid4().hex
        async with grpc.aio.insecure_channel(f"127.0.0.1:{orders_port}") as channel:
            place = channel.unary_unary(
                "/shop.v1.Orders/PlaceOrder",
                request_serializer=orders_pb2.PlaceOrderRequest.SerializeToString,
                response_deserializer=orders_pb2.PlaceOrderResponse.FromString,
            )
            key = (("idempotency-key", "place-" + order_id),)
            for _ in range(2):  # the retry is replayed: it enqueues nothing more
                await place(orders_pb2.PlaceOrderRequest(order_id=order_id), metadata=key)
        outbox = "SELECT key, state FROM grpc_idempotency.outbox"
        [row] = await store.pool.fetch(outbox)
        assert row["state"] == "pending"

        # The relay snippet as written: run(stop), stopped once the row is marked sent.
        relay = asyncio.create_task(run_snippet(RELAY, snippets[RELAY], relaying))
        await until(
            "the relay to deliver the order's event",
            lambda: relay.done() or ("relay" in relaying and relaying["relay"].stats.delivered),
        )
        if relay.done():
            relay.result()  # the snippet failed: its error
        relaying["stop"].set()
        await asyncio.wait_for(relay, timeout=10)
        assert await ledger_rows(store, order_id) == 1
        assert [dict(r) for r in await store.pool.fetch(outbox)] == [
            {"key": row["key"], "state": "sent"}
        ]

        # Delivered again, as after a relay that died before marking it sent: the receiver
        # answers OK and records nothing more.
        await store.pool.execute(
            "UPDATE grpc_idempotency.outbox SET state = 'pending', sent_at = NULL,"
            " locked_until = NULL, next_attempt_at = clock_timestamp()"
        )
        assert await relaying["relay"].drain() == 1
        assert await ledger_rows(store, order_id) == 1
        marks = "SELECT count(*) FROM grpc_idempotency.processed_messages WHERE message_id = $1"
        assert await store.pool.fetchval(marks, row["key"]) == 1
    finally:
        if "channel" in relaying:
            await relaying["channel"].close()
        await orders_server.stop(None)
        await ledger_server.stop(None)
