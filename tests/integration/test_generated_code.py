"""The code protoc-gen-grpc-idempotency generates drives real servers (grpc.aio, PostgreSQL).

CheckoutService/Checkout (tests/protos/codegen_shop) declares three active steps; two of them
call the same method (LedgerService/Post), which without named steps is ambiguous. Its handler
makes each call through the generated ``CheckoutServiceCheckoutSteps``; the servers and the
client interceptor are configured from the generated ``SERVICES`` and ``POLICIES`` only.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from grpc_idempotency import (
    IdempotencyClientInterceptor,
    IdempotencyInterceptor,
    MetadataScope,
    Operation,
    StaticScope,
    Store,
    child_key,
    current_call,
    proto_include,
)
from grpc_idempotency.client import service_config

ROOT = Path(__file__).resolve().parents[2]
TENANT = "x-tenant-id"
DOWNSTREAM_SCOPE = "svc:checkout"


@dataclass
class Generated:
    shop_pb2: ModuleType
    shop_pb2_grpc: ModuleType
    ledger_pb2: ModuleType
    ledger_pb2_grpc: ModuleType
    shop: ModuleType
    ledger: ModuleType


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Generated]:
    out = tmp_path_factory.mktemp("codegen-shop-int")
    plugin = Path(sys.executable).parent / "protoc-gen-grpc-idempotency"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'tests' / 'protos'}",
         f"-I{proto_include()}", f"--plugin=protoc-gen-grpc-idempotency={plugin}",
         f"--python_out={out}", f"--grpc_python_out={out}", f"--grpc-idempotency_out={out}",
         "codegen_shop/v1/shop.proto", "codegen_shop/v1/ledger.proto"],
        check=True, capture_output=True,
    )  # fmt: skip
    sys.path.insert(0, str(out))
    try:
        from codegen_shop.v1 import (
            ledger_idempotency,
            ledger_pb2,
            ledger_pb2_grpc,
            shop_idempotency,
            shop_pb2,
            shop_pb2_grpc,
        )

        yield Generated(
            shop_pb2,
            shop_pb2_grpc,
            ledger_pb2,
            ledger_pb2_grpc,
            shop_idempotency,
            ledger_idempotency,
        )
    finally:
        sys.path.remove(str(out))


@dataclass
class Seen:
    """What the downstream handlers saw, per execution (replays do not reach them)."""

    calls: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def record(self, method: str, context: Any) -> str:
        md = dict(context.invocation_metadata() or ())
        self.calls.append((method, md.get("idempotency-key"), md.get("x-trace")))
        self.ids.append(uuid.uuid4().hex)
        return self.ids[-1]


@dataclass
class Running:
    seen: Seen
    checkout: Any
    channel: grpc.aio.Channel
    fail_after_downstream: list[bool]
    handler_runs: list[int]


@contextlib.asynccontextmanager
async def running(store: Store, gen: Generated) -> AsyncIterator[Running]:
    seen = Seen()
    fail_after_downstream = [False]
    handler_runs = [0]
    policies = {**gen.shop.POLICIES, **gen.ledger.POLICIES}
    services = [*gen.shop.SERVICES, *gen.ledger.SERVICES]

    # Classes of modules generated at test time: named here for mypy, which takes bases by name.
    stock_servicer: Any = gen.shop_pb2_grpc.StockServiceServicer
    ledger_servicer: Any = gen.ledger_pb2_grpc.LedgerServiceServicer
    checkout_servicer: Any = gen.shop_pb2_grpc.CheckoutServiceServicer

    class Stock(stock_servicer):
        async def Reserve(self, request: Any, context: Any) -> Any:
            return gen.shop_pb2.ReserveResponse(reservation_id=seen.record("reserve", context))

    class Ledger(ledger_servicer):
        async def Post(self, request: Any, context: Any) -> Any:
            return gen.ledger_pb2.Ledger.Posted(entry_id=seen.record("post", context))

    downstream = grpc.aio.server(
        interceptors=[
            IdempotencyInterceptor(
                store, services=services, overrides=policies, scope=StaticScope(DOWNSTREAM_SCOPE)
            )
        ]
    )
    gen.shop_pb2_grpc.add_StockServiceServicer_to_server(Stock(), downstream)
    gen.ledger_pb2_grpc.add_LedgerServiceServicer_to_server(Ledger(), downstream)
    downstream_port = downstream.add_insecure_port("127.0.0.1:0")
    await downstream.start()
    to_downstream = grpc.aio.insecure_channel(
        f"127.0.0.1:{downstream_port}",
        options=[("grpc.service_config", service_config(services)), ("grpc.enable_retries", 1)],
        interceptors=[IdempotencyClientInterceptor(services=services, overrides=policies)],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    )
    steps = gen.shop.CheckoutServiceCheckoutSteps(
        stock_service=to_downstream, ledger_service=to_downstream
    )

    class Checkout(checkout_servicer):
        async def Checkout(self, request: Any, context: Any) -> Any:
            handler_runs[0] += 1
            reserved = await steps.reserve_stock(
                gen.shop_pb2.ReserveRequest(cart_id=request.cart_id)
            )
            post = gen.ledger_pb2.Ledger.Post(account=request.cart_id, amount=request.amount)
            debit = await steps.debit(post, metadata=[("x-trace", "debit")])
            refund = await steps.refund(post, timeout=5)
            if fail_after_downstream[0]:
                fail_after_downstream[0] = False
                # Transient: the claim is released and a retry runs the handler again.
                await context.abort(grpc.StatusCode.UNAVAILABLE, "flaky")
            await current_call().transaction()
            return gen.shop_pb2.CheckoutResponse(
                reservation_id=reserved.reservation_id,
                debit_entry=debit.entry_id,
                refund_entry=refund.entry_id,
            )

    upstream = grpc.aio.server(
        interceptors=[
            IdempotencyInterceptor(
                store,
                services=gen.shop.SERVICES,
                overrides=gen.shop.POLICIES,
                scope=MetadataScope(TENANT),
            )
        ]
    )
    gen.shop_pb2_grpc.add_CheckoutServiceServicer_to_server(Checkout(), upstream)
    port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=gen.shop.CHANNEL_OPTIONS)
    try:
        yield Running(
            seen,
            gen.shop_pb2_grpc.CheckoutServiceStub(channel),
            channel,
            fail_after_downstream,
            handler_runs,
        )
    finally:
        await channel.close(None)
        await upstream.stop(None)
        await to_downstream.close(None)
        await downstream.stop(None)


async def test_each_step_call_carries_its_own_child_key(store: Store, gen: Generated) -> None:
    async with running(store, gen) as svc:
        op = Operation.new()
        request = gen.shop_pb2.CheckoutRequest(cart_id=f"cart-{uuid.uuid4().hex}", amount=7)
        md = [(TENANT, "acme")]
        first = await op.call(svc.checkout.Checkout, request, metadata=md)
        scope = "tenant:acme"
        assert svc.seen.calls == [
            ("reserve", child_key(scope, op.key, "reserve-stock.v1"), None),
            ("post", child_key(scope, op.key, "debit.v2"), "debit"),
            ("post", child_key(scope, op.key, "refund.v1"), None),
        ]
        # A retry of the operation replays; nothing downstream runs again.
        again = await op.call(svc.checkout.Checkout, request, metadata=md)
        assert again == first
        assert len(svc.seen.calls) == 3
        # Another tenant with the same key is another operation, with other child keys.
        other = await op.call(svc.checkout.Checkout, request, metadata=[(TENANT, "globex")])
        assert other.debit_entry != first.debit_entry
        assert svc.seen.calls[3][1] == child_key("tenant:globex", op.key, "reserve-stock.v1")


async def test_a_re_run_handler_reaches_the_same_downstream_records(
    store: Store, gen: Generated
) -> None:
    async with running(store, gen) as svc:
        # The first run fails transiently after its downstream calls: the claim is released and
        # gRPC's own retry (CHANNEL_OPTIONS: retry UNAVAILABLE) runs the handler again. Its step
        # calls carry the same child keys, so the downstream services replay their first
        # answers instead of reserving and posting twice.
        svc.fail_after_downstream[0] = True
        op = Operation.new()
        request = gen.shop_pb2.CheckoutRequest(cart_id=f"cart-{uuid.uuid4().hex}", amount=3)
        done = await op.call(svc.checkout.Checkout, request, metadata=[(TENANT, "acme")])
        assert svc.handler_runs == [2]
        assert len(svc.seen.calls) == 3
        assert [done.reservation_id, done.debit_entry, done.refund_entry] == svc.seen.ids


class LoseFirstAnswer(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Outermost: the first call of each of ``methods`` runs to its end (the idempotency
    interceptor committed its writes), then its answer is lost on the way back and the client
    is answered UNAVAILABLE, as a reset connection or a proxy answers. (The library's server
    answers UNAVAILABLE after a committed write itself, for a commit whose answer a partition
    lost: test_partition.py.)"""

    def __init__(self, *methods: str) -> None:
        self.pending = set(methods)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method not in self.pending:
            return handler
        inner = handler.unary_unary

        async def lose(request: Any, context: Any) -> Any:
            response = await inner(request, context)
            if details.method in self.pending:
                self.pending.discard(details.method)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
            return response

        return grpc.unary_unary_rpc_method_handler(
            lose,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def test_channel_options_never_retry_a_call_that_may_carry_no_key(
    store: Store, gen: Generated
) -> None:
    """CHANNEL_OPTIONS has gRPC retry UNAVAILABLE and ABORTED. Safe for a method whose every
    call carries a key (the server refuses one without); a KEY_OPTIONAL method (Cancel) called
    without one runs undeduplicated, and gRPC's retry of its lost answer ran it, and committed
    its write, a second time. Its caller now sees the UNAVAILABLE instead; Reserve (key
    required) is still retried, and replayed."""
    account = f"cart-{uuid.uuid4().hex}"
    cancels = [0]
    reserves = [0]

    # Classes of modules generated at test time: named here for mypy, which takes bases by name.
    checkout_servicer: Any = gen.shop_pb2_grpc.CheckoutServiceServicer
    stock_servicer: Any = gen.shop_pb2_grpc.StockServiceServicer

    class Checkout(checkout_servicer):
        async def Cancel(self, request: Any, context: Any) -> Any:
            cancels[0] += 1
            conn = await current_call().transaction()
            await conn.execute(
                "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, -1)",
                request.cart_id,
            )
            return gen.shop_pb2.CancelResponse()

    class Stock(stock_servicer):
        async def Reserve(self, request: Any, context: Any) -> Any:
            reserves[0] += 1
            return gen.shop_pb2.ReserveResponse(reservation_id=uuid.uuid4().hex)

    lose = LoseFirstAnswer(
        "/codegen_shop.v1.CheckoutService/Cancel", "/codegen_shop.v1.StockService/Reserve"
    )
    server = grpc.aio.server(
        interceptors=[
            lose,
            IdempotencyInterceptor(
                store,
                services=gen.shop.SERVICES,
                overrides=gen.shop.POLICIES,
                scope=StaticScope(DOWNSTREAM_SCOPE),
            ),
        ]
    )
    gen.shop_pb2_grpc.add_CheckoutServiceServicer_to_server(Checkout(), server)
    gen.shop_pb2_grpc.add_StockServiceServicer_to_server(Stock(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # A plain stub: no client interceptor to give the call a key.
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=gen.shop.CHANNEL_OPTIONS)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await gen.shop_pb2_grpc.CheckoutServiceStub(channel).Cancel(
                gen.shop_pb2.CancelRequest(cart_id=account), timeout=10
            )
        assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
        async with store.pool.acquire() as conn:
            rows = await conn.fetchval(
                "SELECT count(*) FROM test_ledger.ledger WHERE account = $1", account
            )
        assert (cancels, rows) == ([1], 1)

        # A key required: gRPC's retry is safe and still on; the retry is replayed.
        reserved = await gen.shop_pb2_grpc.StockServiceStub(channel).Reserve(
            gen.shop_pb2.ReserveRequest(cart_id=account),
            metadata=[("idempotency-key", uuid.uuid4().hex)],
            timeout=10,
        )
        assert reserved.reservation_id
        assert reserves == [1]
        assert not lose.pending  # both answers were lost once
    finally:
        await channel.close(None)
        await server.stop(None)


DOTTED = """\
syntax = "proto3";
package dotted_shop.v1;
import "grpc_idempotency/v1/options.proto";
message Req { string id = 1; }
message Res { string id = 1; }
service Orders {
  rpc Place(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = {
      steps: { name: "notify.v1" call: "dotted_shop.v1.Notifier/Send" }
    };
  }
}
service Notifier {
  rpc Send(Req) returns (Res) { option (grpc_idempotency.v1.method) = {}; }
}
"""


@pytest.fixture
def dotted(tmp_path: Path) -> Iterator[tuple[ModuleType, ModuleType, ModuleType]]:
    """DOTTED as dotted_shop/v1/orders.events.proto, generated and imported: the plugin's
    module, the messages, the gRPC stubs."""
    # protoc's Python generator makes package dotted_shop.v1.orders with module events_pb2;
    # the plugin's module must be its sibling, importing it, to be usable at all.
    (tmp_path / "protos" / "dotted_shop" / "v1").mkdir(parents=True)
    (tmp_path / "protos" / "dotted_shop" / "v1" / "orders.events.proto").write_text(DOTTED)
    out = tmp_path / "out"
    out.mkdir()
    plugin = Path(sys.executable).parent / "protoc-gen-grpc-idempotency"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path / 'protos'}",
         f"-I{proto_include()}", f"--plugin=protoc-gen-grpc-idempotency={plugin}",
         f"--python_out={out}", f"--grpc_python_out={out}", f"--grpc-idempotency_out={out}",
         "dotted_shop/v1/orders.events.proto"],
        check=True, capture_output=True,
    )  # fmt: skip
    sys.path.insert(0, str(out))
    try:
        from dotted_shop.v1.orders import events_idempotency, events_pb2, events_pb2_grpc

        yield events_idempotency, events_pb2, events_pb2_grpc
    finally:
        sys.path.remove(str(out))


async def test_a_dotted_proto_file_name_generates_a_working_module(
    store: Store, dotted: tuple[ModuleType, ModuleType, ModuleType]
) -> None:
    gen, pb2, pb2_grpc = dotted
    keys: list[str | None] = []

    # Classes of modules generated at test time: named here for mypy, which takes bases by name.
    notifier_servicer: Any = pb2_grpc.NotifierServicer
    orders_servicer: Any = pb2_grpc.OrdersServicer

    class Notifier(notifier_servicer):
        async def Send(self, request: Any, context: Any) -> Any:
            keys.append(dict(context.invocation_metadata() or ()).get("idempotency-key"))
            return pb2.Res(id=uuid.uuid4().hex)

    downstream = grpc.aio.server(
        interceptors=[
            IdempotencyInterceptor(
                store,
                services=gen.SERVICES,
                overrides=gen.POLICIES,
                scope=StaticScope(DOWNSTREAM_SCOPE),
            )
        ]
    )
    pb2_grpc.add_NotifierServicer_to_server(Notifier(), downstream)
    to_downstream = grpc.aio.insecure_channel(
        f"127.0.0.1:{downstream.add_insecure_port('127.0.0.1:0')}",
        options=gen.CHANNEL_OPTIONS,
        interceptors=[IdempotencyClientInterceptor(services=gen.SERVICES, overrides=gen.POLICIES)],  # type: ignore[list-item]  # grpc-stubs: cast or ignore client interceptors
    )
    steps = gen.OrdersPlaceSteps(notifier=to_downstream)

    class Orders(orders_servicer):
        async def Place(self, request: Any, context: Any) -> Any:
            sent = await steps.notify(pb2.Req(id=request.id))
            await current_call().transaction()
            return pb2.Res(id=sent.id)

    upstream = grpc.aio.server(
        interceptors=[
            IdempotencyInterceptor(
                store, services=gen.SERVICES, overrides=gen.POLICIES, scope=StaticScope("orders")
            )
        ]
    )
    pb2_grpc.add_OrdersServicer_to_server(Orders(), upstream)
    port = upstream.add_insecure_port("127.0.0.1:0")
    await downstream.start()
    await upstream.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=gen.CHANNEL_OPTIONS)
    try:
        place = channel.unary_unary(
            "/dotted_shop.v1.Orders/Place",
            request_serializer=pb2.Req.SerializeToString,
            response_deserializer=pb2.Res.FromString,
        )
        op = Operation.new()
        first = await op.call(place, pb2.Req(id="o-1"))
        assert keys == [child_key("orders", op.key, "notify.v1")]
        assert await op.call(place, pb2.Req(id="o-1")) == first  # replayed
        assert len(keys) == 1
    finally:
        await channel.close(None)
        await upstream.stop(None)
        await to_downstream.close(None)
        await downstream.stop(None)
