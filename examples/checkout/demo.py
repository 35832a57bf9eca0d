"""``python -m examples.checkout demo [--dsn DSN]``: failure drills against real service processes.

Payments, notifications, orders, the ledger and the outbox relay each run as a separate process
on one PostgreSQL (restarted with failpoints where a drill needs one); this process is a grpc.aio
client that retries the way a real caller would and then counts, with SQL, what each service
received (``<service>.attempts``) against what it did (``payments.charges``,
``notifications.emails``, ``orders.orders``, ``ledger.entries``).

PaymentService.Charge on its own:

a. plain retries        the same key three times: one charge, attempts 2-3 replayed
b. lost response        the charge commits but the answer never arrives (the client gives up
                        once the charge is in the database; a crash after commit): the retry
                        replays the committed charge
c. concurrent dups      50 calls at once with one key: one charge, identical answers (a caller
                        told to come back, IN_PROGRESS, comes back and gets them too)
d. mutated payload      the same key with another amount: refused, nothing written
e. two tenants          one key, two tenants (two tokens): two independent charges; the first
                        tenant's token naming the second in x-tenant-id replays its own charge

The checkout flow, OrderService.PlaceOrder (phased: it calls Charge and SendEmail with child keys
derived from its own key, tenant and declared steps, then commits the order):

f. lost order response  the order commits, the client gives up before the answer: the retry
                        replays it; payments and notifications are not called again
g. two tenants          one parent key, two tenants: two charges, two emails, two orders, each
                        tenant's retry replays its own
h. crash mid-order      orders dies (kill -9) after the charge and before its final commit; the
                        retry, once the lease ran out, runs PlaceOrder again: payments replays
                        the charge to the same child key, the order completes once

The outbox, OrderService -> relay -> LedgerService (PlaceOrder enqueues an OrderCreated event in
its final transaction; the relay delivers it at least once; the ledger dedupes with the consumer
API, keyed by the event's outbox key):

i. outbox to ledger     first the relay delivers the events of drills f-h (a replayed order, two
                        tenants, an order re-run after a crash): one entry per order; then two
                        new orders (one retried) and a relay killed after delivering an event
                        and before marking it sent: a second relay delivers it again, and the
                        ledger still writes one entry per order

Two more ways for one order to be attempted twice:

j. orders stalled past  a second orders replica (lease 1 s) claims the order and is frozen
   its lease            (SIGSTOP) before it charges; once its lease has run out by the database's
                        clock, the retry on the other replica takes the order over and completes
                        it; the frozen replica, resumed (SIGCONT), must not commit: its call ends
                        ABORTED/LEASE_LOST
k. one key across gRPC  a channel with IdempotencyClientInterceptor and channel_options: no key
   retries              from the caller; a proxy resets the connection under the first two
                        attempts and gRPC's own retries resend the request, with the one key the
                        interceptor minted: one call, three or more attempts, one order

No drill races a timer against the services: each waits for what the database shows (a commit,
a claim held, a lease run out by the database's clock) before it breaks something, and checks
the contract (one effect, one key, the same answer), not how many times the scheduler made a
retry happen.

Every call carries ``authorization: Bearer <token>``: each drill's tenants get tokens of their own
(random, given to the services at start in ``CHECKOUT_TOKENS``), so a drill with two tenants
uses two tokens, and the scope is the token's tenant (examples/checkout/auth.py).

And the door:

l. no valid token       no token, a forged token, x-tenant-id alone: UNAUTHENTICATED, before the
                        attempt log and any claim; nothing stored

Exit status 1 when any side effect happened more often than expected or any expectation failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import asyncpg
import grpc
from google.rpc import error_details_pb2, status_pb2

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from examples.checkout.auth import RELAY_TOKEN_ENV, TOKENS_ENV, bearer
from examples.checkout.proxy import ResettingProxy
from grpc_idempotency import KEY_HEADER, REPLAYED_HEADER, child_key
from grpc_idempotency.client import IdempotencyClientInterceptor, capture_keys, channel_options
from grpc_idempotency.core.failpoints import ENV_VAR as FAILPOINTS_ENV

# isort: split
# Only importable once examples.checkout.gen has run: keep the import sorter from hoisting it.
from checkout.v1 import orders_pb2, payments_pb2

ROOT = Path(__file__).resolve().parents[2]
CHARGE = "/checkout.v1.PaymentService/Charge"
PLACE_ORDER = "/checkout.v1.OrderService/PlaceOrder"
CHARGE_STEP = "charge-card.v1"
EMAIL_STEP = "send-confirmation.v1"
ORDER_EVENT_STEP = "order-created-event.v1"
DETAILS_TRAILER = "grpc-status-details-bin"
IN_PROGRESS = "IDEMPOTENCY_KEY_IN_PROGRESS"
REUSED = "IDEMPOTENCY_KEY_REUSED"
TIMEOUT_S = 5.0
START_TIMEOUT_S = 20.0
CONCURRENT_CALLS = 50
ORDER_LEASE_S = 1.0  # drills h, j: a short orders lease, so a dead or frozen claim frees quickly
RELAY_LEASE_S = 1.5  # drill i: how soon the events a crashed relay claimed are due again
# drill j: how long the stalled replica waits after its claim, frozen there. It only has to
# outlast the demo's look at the claim and its SIGSTOP, which load can delay (3 s left a window
# for that), so it is long; resumed, the replica's lease keeper finds the lease taken over and
# cancels the handler, the wait with it: it costs nothing.
STALL_MS = 60_000
RETRY_TIMEOUT_S = 15.0  # drills b, f, j, k: calls that span a lease or gRPC's retries
HOLD_MS = 60_000  # drills b, f: the answer held back after the commit, longer than anyone waits
# drill k: each attempt at the holding replica waits after its claim, the window for the reset.
# Long, so that no load closes it (3 s once let the second attempt commit before its connection's
# reset reached it, and the third got its answer replayed), and free: the reset cancels the wait,
# and the last attempt, which nothing resets, goes to a replica that does not wait.
CLAIM_HOLD_MS = 60_000
RESETS = 2  # drill k: connections dropped under the first attempts
LEASE_LOST = "IDEMPOTENCY_LEASE_LOST"
RECORDS = "orders_idempotency.records"
OUTBOX = "orders_idempotency.outbox"
SERVICES = ("orders", "payments", "notifications", "ledger")
# The side-effect table of each service; each has order_id and tenant (the scope) columns.
EFFECTS = {
    "orders": "orders.orders",
    "payments": "payments.charges",
    "notifications": "notifications.emails",
    "ledger": "ledger.entries",
}
EFFECT_NAMES = {
    "orders": "orders",
    "payments": "charges",
    "notifications": "emails",
    "ledger": "ledger entries",
}


# --- talking to the services ------------------------------------------------------------------


class Credentials:
    """The demo's tenants and their bearer tokens: a random token per tenant, which the services
    accept from the start (``CHECKOUT_TOKENS``) and the clients send. The relay's token too."""

    def __init__(self) -> None:
        self.tokens: dict[str, str] = {}  # tenant -> token
        self.relay = "relay-" + secrets.token_urlsafe(24)

    def add(self, tenant: str) -> None:
        self.tokens.setdefault(tenant, "tok-" + secrets.token_urlsafe(24))

    def of(self, tenant: str) -> tuple[str, str]:
        """``tenant``'s ``authorization`` metadata entry."""
        return bearer(self.tokens[tenant])

    def environment(self) -> dict[str, str]:
        table = ",".join(f"{token}={tenant}" for tenant, token in self.tokens.items())
        return {TOKENS_ENV: table, RELAY_TOKEN_ENV: self.relay}


@dataclass(frozen=True)
class Answer:
    """What the client saw for one attempt."""

    code: grpc.StatusCode
    replayed: bool
    response: bytes | None = None  # the exact bytes on the wire (OK only)
    reason: str | None = None  # google.rpc.ErrorInfo reason, if the error carried one
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK

    @property
    def charge_id(self) -> str | None:
        """The charge a ChargeResponse names (payments drills)."""
        if self.response is None:
            return None
        return payments_pb2.ChargeResponse.FromString(self.response).charge_id

    @property
    def order(self) -> orders_pb2.PlaceOrderResponse | None:
        """The PlaceOrderResponse (order drills)."""
        if self.response is None:
            return None
        return orders_pb2.PlaceOrderResponse.FromString(self.response)

    @property
    def label(self) -> str:
        if self.ok:
            return "replayed" if self.replayed else "OK"
        if self.code is grpc.StatusCode.ABORTED and self.reason == IN_PROGRESS:
            return "aborted"
        if self.reason:
            return f"{self.code.name}/{self.reason.removeprefix('IDEMPOTENCY_')}"
        return self.code.name


def _replayed(metadata: Any) -> bool:
    return any(k == REPLAYED_HEADER and v == "true" for k, v in metadata or ())


def _reason(trailers: Any) -> str | None:
    for name, value in trailers or ():
        if name == DETAILS_TRAILER and isinstance(value, bytes):
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return str(info.reason)
    return None


async def _answer(call: Any) -> Answer:
    try:
        response = await call
    except grpc.aio.AioRpcError as err:
        return Answer(
            err.code(),
            _replayed(err.initial_metadata()),
            reason=_reason(err.trailing_metadata()),
            details=err.details() or "",
        )
    return Answer(grpc.StatusCode.OK, _replayed(await call.initial_metadata()), response)


class Client:
    """Charge over one channel; responses are kept as raw bytes so replays can be compared. Each
    call carries its tenant's token."""

    def __init__(self, target: str, credentials: Credentials) -> None:
        self.credentials = credentials
        self.channel = grpc.aio.insecure_channel(target)
        # No response deserializer: the call returns the serialized bytes as received.
        self._charge = self.channel.unary_unary(
            CHARGE, request_serializer=payments_pb2.ChargeRequest.SerializeToString
        )

    async def charge(
        self,
        tenant: str,
        key: str,
        order_id: str,
        amount_cents: int,
        *,
        timeout: float = TIMEOUT_S,
        auth: Sequence[tuple[str, str]] | None = None,
    ) -> Answer:
        """One Charge as ``tenant``; ``auth`` replaces the tenant's token (drills e and l)."""
        request = payments_pb2.ChargeRequest(
            order_id=order_id, amount_cents=amount_cents, currency="EUR", card_token="tok_visa"
        )
        request.sent_at.GetCurrentTime()  # differs per attempt; excluded from the fingerprint
        credential = (self.credentials.of(tenant),) if auth is None else tuple(auth)
        metadata = (*credential, (KEY_HEADER, key))
        return await _answer(self._charge(request, metadata=metadata, timeout=timeout))

    async def close(self) -> None:
        await self.channel.close()


class OrdersClient:
    """PlaceOrder over one channel, raw bytes as for Charge. By default a plain channel, no
    retries of its own: each drill makes its attempts explicitly, with one key per logical order.
    Drill k passes the client interceptor and ``channel_options`` instead (key minted, gRPC
    retries)."""

    def __init__(
        self,
        target: str,
        credentials: Credentials,
        *,
        interceptors: Sequence[Any] = (),  # grpc.aio client interceptors
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.credentials = credentials
        self.channel = grpc.aio.insecure_channel(
            target, options=list(options), interceptors=list(interceptors) or None
        )
        self._place = self.channel.unary_unary(
            PLACE_ORDER, request_serializer=orders_pb2.PlaceOrderRequest.SerializeToString
        )

    async def place(
        self,
        tenant: str,
        key: str | None,
        order_id: str,
        *,
        timeout: float = TIMEOUT_S,
        auth: Sequence[tuple[str, str]] | None = None,
    ) -> Answer:
        """One PlaceOrder as ``tenant``; ``key`` None sends none (the interceptor, if any, mints
        one); ``auth`` replaces the tenant's token (drill l)."""
        request = orders_pb2.PlaceOrderRequest(
            order_id=order_id,
            amount_cents=4200,
            currency="EUR",
            card_token="tok_visa",
            email="buyer@example.com",
        )
        request.sent_at.GetCurrentTime()  # differs per attempt; excluded from the fingerprint
        credential = (self.credentials.of(tenant),) if auth is None else tuple(auth)
        metadata = credential + (((KEY_HEADER, key),) if key else ())
        return await _answer(self._place(request, metadata=metadata, timeout=timeout))

    async def close(self) -> None:
        await self.channel.close()


# --- the service processes --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """``python -m examples.checkout <name>`` as a child process, restartable on one port."""

    def __init__(
        self, name: str, dsn: str, port: int, credentials: Credentials, args: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.credentials = credentials
        self.dsn = dsn
        self.port = port
        self.args = list(args)
        self.proc: asyncio.subprocess.Process | None = None
        self._stderr: IO[bytes] | None = None
        self._drain: asyncio.Task[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(
        self, failpoints: str | None = None, args: Sequence[str] = (), *, may_crash: bool = False
    ) -> None:
        """(Re)starts the process, with ``failpoints`` and ``args`` (after the fixed ones).
        ``may_crash``: a crash failpoint may kill it (kill -9) before it reports ready."""
        await self.stop()
        env = dict(os.environ)
        env.pop(FAILPOINTS_ENV, None)
        if failpoints:
            env[FAILPOINTS_ENV] = failpoints
        env.update(self.credentials.environment())  # the tokens the service accepts
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # Kept open for the child's lifetime (closed in stop()); shown when it fails to start.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "examples.checkout", self.name, *self.command(args),
            cwd=ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=self._stderr,
        )  # fmt: skip
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.0, remaining))
            except TimeoutError:
                line = None
            if not line:
                code = await self.wait_exit(1)
                if may_crash and code == -signal.SIGKILL:
                    return  # the failpoint fired before the ready line got out
                status = "still running" if code is None else f"exit {code}"
                raise RuntimeError(f"{self.name} did not start ({status}):\n{self.stderr_tail()}")
            if self.ready(line.decode(errors="replace").strip()):
                break
        # Keep reading, so that a chatty child can never block on a full pipe.
        self._drain = asyncio.create_task(self.proc.stdout.read())
        extra = " ".join(args)
        note = f" {extra}" if extra else ""
        note += f" with {FAILPOINTS_ENV}={failpoints}" if failpoints else ""
        print(f"  {self.name} pid {self.proc.pid} {self.where}{note}", flush=True)

    def command(self, args: Sequence[str]) -> list[str]:
        """The arguments after ``python -m examples.checkout <name>``."""
        return ["--listen", self.address, "--dsn", self.dsn, *self.args, *args]

    def ready(self, line: str) -> bool:
        if not line.startswith(f"{self.name} listening"):
            return False
        # The line names the port actually bound.
        self.port = int(line.rpartition(":")[2])
        return True

    @property
    def where(self) -> str:
        return f"on {self.address}"

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the process has exited by itself, None if it still runs."""
        assert self.proc is not None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.proc.wait(), timeout)
        return None

    def pause(self) -> None:
        """SIGSTOP: the process stays, frozen (no renewals, no answers) until ``resume()``."""
        assert self.proc is not None and self.proc.returncode is None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)

    async def stop(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            if proc.returncode is None:
                proc.terminate()
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)  # a paused process acts on SIGTERM now
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        if self._drain is not None:
            drain, self._drain = self._drain, None
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def stderr_tail(self, lines: int = 20) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return "\n".join(self._stderr.read().decode(errors="replace").splitlines()[-lines:])


class Payments(Service):
    """PaymentService, with a Charge client for the payments drills."""

    def __init__(self, dsn: str, port: int, credentials: Credentials) -> None:
        super().__init__("payments", dsn, port, credentials)
        self.client: Client | None = None

    async def start(self, failpoints: str | None = None, args: Sequence[str] = ()) -> None:
        await super().start(failpoints, args)
        self.client = Client(self.address, self.credentials)

    async def stop(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
        await super().stop()


class OutboxRelay(Service):
    """``python -m examples.checkout relay``: delivers the orders outbox (OrderCreated events)
    to the ledger. It listens on no port; it is ready once it holds its LISTEN connection."""

    def __init__(self, dsn: str, ledger: Service) -> None:
        super().__init__("relay", dsn, 0, ledger.credentials)
        self.ledger = ledger

    def command(self, args: Sequence[str]) -> list[str]:
        return ["--dsn", self.dsn, "--ledger", self.ledger.address, *self.args, *args]

    def ready(self, line: str) -> bool:
        return line.startswith("relay listening")

    @property
    def where(self) -> str:
        return f"-> ledger {self.ledger.address}"


class Orders(Service):
    """OrderService calling the given payments and notifications, with a PlaceOrder client."""

    def __init__(self, dsn: str, port: int, payments: Service, notifications: Service) -> None:
        args = ["--payments", payments.address, "--notifications", notifications.address]
        super().__init__("orders", dsn, port, payments.credentials, args)
        self.client: OrdersClient | None = None

    async def start(self, failpoints: str | None = None, args: Sequence[str] = ()) -> None:
        await super().start(failpoints, args)
        self.client = OrdersClient(self.address, self.credentials)

    async def stop(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
        await super().stop()


# --- the drills -------------------------------------------------------------------------------


def _tenant(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@dataclass
class Drill:
    """One drill: its expectations, what the client saw, and what each service received (calls
    logged in ``<service>.attempts``) and did (rows in its side-effect table)."""

    name: str
    expected: str
    effects_expected: dict[str, int]  # service -> rows the drill must leave, in total
    order_id: str = field(default_factory=lambda: "ord_" + uuid.uuid4().hex[:12])
    tenants: tuple[str, str] = field(default_factory=lambda: (_tenant("acme"), _tenant("globex")))
    answers: list[Answer] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    effects: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, condition: bool, problem: str) -> None:
        if not condition:
            self.problems.append(problem)

    @property
    def summary(self) -> str:
        counts = Counter(a.label for a in self.answers)
        return ", ".join(f"{n} {label}" for label, n in counts.items()) or "-"

    def cell(self, service: str) -> str:
        """``calls received -> rows written`` for one service, "-" where it took no part."""
        calls, rows = self.attempts.get(service), self.effects.get(service)
        if calls is None or rows is None:
            return "?"
        if not calls and not rows and not self.effects_expected.get(service):
            return "-"
        return f"{calls} -> {rows}"


class Demo:
    def __init__(
        self,
        db: asyncpg.Connection,
        payments: Payments,
        notifications: Service,
        orders: Orders,
        relay: OutboxRelay,
    ) -> None:
        self.db = db
        self.payments = payments
        self.notifications = notifications
        self.orders = orders
        self.relay = relay
        self.placed: list[Drill] = []
        """The drills so far that placed orders (their events wait in the outbox)."""

    @property
    def client(self) -> Client:
        assert self.payments.client is not None, "payments is not running"
        return self.payments.client

    @property
    def orders_client(self) -> OrdersClient:
        assert self.orders.client is not None, "orders is not running"
        return self.orders.client

    async def charge_rows(self, order_id: str) -> list[str]:
        rows = await self.db.fetch(
            "SELECT charge_id FROM payments.charges WHERE order_id = $1 ORDER BY charged_at",
            order_id,
        )
        return [r["charge_id"] for r in rows]

    async def order_rows(self, tenant: str, order_id: str) -> list[tuple[str, str]]:
        rows = await self.db.fetch(
            "SELECT charge_id, email_id FROM orders.orders WHERE tenant = $1 AND order_id = $2",
            "tenant:" + tenant,
            order_id,
        )
        return [(r["charge_id"], r["email_id"]) for r in rows]

    async def attempt_keys(self, service: str, tenant: str) -> list[str]:
        rows = await self.db.fetch(
            f"SELECT key FROM {service}.attempts WHERE tenant = $1 ORDER BY id", tenant
        )
        return [r["key"] for r in rows]

    # --- a-e: PaymentService on its own ---

    async def plain_retries(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        for _ in range(3):
            d.answers.append(await self.client.charge(d.tenants[0], key, d.order_id, 1999))
        d.check(all(a.ok for a in d.answers), "not every attempt succeeded")
        d.check(
            [a.replayed for a in d.answers] == [False, True, True],
            "expected attempt 1 executed and attempts 2-3 marked replayed",
        )
        d.check(len({a.charge_id for a in d.answers}) == 1, "attempts returned different charges")
        d.check(len({a.response for a in d.answers}) == 1, "replayed bytes differ from the first")

    async def lost_response_gave_up(self, d: Drill) -> None:
        # The answer is held back after the commit for longer than anyone waits.
        await self.payments.start(f"after_commit_before_response=sleep:{HOLD_MS}")
        key = "pay-" + uuid.uuid4().hex
        first = await self.give_up_after_commit(
            self.client.charge(d.tenants[0], key, d.order_id, 2500, timeout=RETRY_TIMEOUT_S),
            lambda: self.charge_rows(d.order_id),
        )
        d.answers.append(first)
        d.check(
            first.code is grpc.StatusCode.CANCELLED,
            f"attempt 1: expected to give up after the commit, got {first.label}",
        )
        committed = await self.charge_rows(d.order_id)
        d.check(len(committed) == 1, f"expected the charge committed, rows: {committed}")
        retry = await self.client.charge(d.tenants[0], key, d.order_id, 2500)
        d.answers.append(retry)
        d.check(retry.ok and retry.replayed, f"retry: expected a replay, got {retry.label}")
        d.check(
            retry.charge_id in committed, f"retry answered {retry.charge_id}, rows: {committed}"
        )

    async def lost_response_crash(self, d: Drill) -> None:
        await self.payments.start("after_commit_before_response=crash")
        key = "pay-" + uuid.uuid4().hex
        first = await self.client.charge(d.tenants[0], key, d.order_id, 4200)
        d.answers.append(first)
        d.check(not first.ok, f"attempt 1: expected the call to fail, got {first.label}")
        code = await self.payments.wait_exit(5)
        d.check(code is not None, "the payments process did not crash")
        print(f"  payments crashed after commit (exit {code}); restarting it", flush=True)
        committed = await self.charge_rows(d.order_id)
        d.check(len(committed) == 1, f"the charge did not commit before the crash: {committed}")
        await self.payments.start()
        retry = await self.client.charge(d.tenants[0], key, d.order_id, 4200)
        d.answers.append(retry)
        d.check(retry.ok and retry.replayed, f"retry: expected a replay, got {retry.label}")
        d.check(
            retry.charge_id in committed, f"retry answered {retry.charge_id}, rows: {committed}"
        )

    async def concurrent_duplicates(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        calls = [
            self.client.charge(d.tenants[0], key, d.order_id, 999) for _ in range(CONCURRENT_CALLS)
        ]
        answers = await asyncio.gather(*calls)
        d.answers.extend(answers)
        # Whether a duplicate is answered from the first attempt's result or told to come back
        # (ABORTED/IN_PROGRESS; or its deadline passed first, on a loaded machine) depends on
        # the scheduler. Either way it retries with the same key, as a client does, and then
        # gets the one charge too.
        unsettled = [a for a in answers if not a.ok]
        odd = [a.label for a in unsettled if a.label not in ("aborted", "DEADLINE_EXCEEDED")]
        d.check(not odd, f"unexpected answers: {sorted(set(odd))}")
        for _ in unsettled:
            d.answers.append(await self.client.charge(d.tenants[0], key, d.order_id, 999))
        d.check(all(a.ok for a in d.answers[len(answers) :]), "a retry did not get the charge")
        bodies = {a.response for a in d.answers if a.ok}
        d.check(len(bodies) == 1, f"{len(bodies)} different OK response bodies (expected 1)")
        d.check(
            sum(a.ok and not a.replayed for a in d.answers) <= 1,
            "more than one answer claims to have executed",
        )

    async def mutated_payload(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        first = await self.client.charge(d.tenants[0], key, d.order_id, 5000)
        d.answers.append(first)
        d.check(first.ok and not first.replayed, f"attempt 1: expected OK, got {first.label}")
        mutated = await self.client.charge(d.tenants[0], key, d.order_id, 50000)
        d.answers.append(mutated)
        d.check(
            mutated.code is grpc.StatusCode.FAILED_PRECONDITION and mutated.reason == REUSED,
            f"mutated attempt: expected FAILED_PRECONDITION/{REUSED}, got {mutated.label}",
        )

    async def two_tenants(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        firsts = [await self.client.charge(t, key, d.order_id, 1234) for t in d.tenants]
        retries = [await self.client.charge(t, key, d.order_id, 1234) for t in d.tenants]
        d.answers.extend(firsts + retries)
        d.check(
            all(a.ok and not a.replayed for a in firsts),
            "each tenant's first call should execute (not replay the other tenant's)",
        )
        d.check(firsts[0].charge_id != firsts[1].charge_id, "the tenants share one charge")
        d.check(
            all(r.ok and r.replayed for r in retries)
            and [r.charge_id for r in retries] == [f.charge_id for f in firsts],
            "each tenant's retry should replay its own charge",
        )
        # The first tenant's token, naming the second tenant in x-tenant-id: the token decides.
        mine, theirs = d.tenants
        spoofed = await self.client.charge(
            mine,
            key,
            d.order_id,
            1234,
            auth=(self.client.credentials.of(mine), ("x-tenant-id", theirs)),
        )
        d.answers.append(spoofed)
        d.check(
            spoofed.ok and spoofed.replayed and spoofed.charge_id == firsts[0].charge_id,
            f"{mine}'s token naming {theirs} in x-tenant-id: expected {mine}'s own charge"
            f" replayed, got {spoofed.label} {spoofed.charge_id}",
        )

    # --- f-h: the checkout flow, OrderService -> PaymentService, NotificationService ---

    async def lost_order_response(self, d: Drill) -> None:
        await self.orders.start(f"after_commit_before_response=sleep:{HOLD_MS}")
        tenant, key = d.tenants[0], "order-" + uuid.uuid4().hex
        first = await self.give_up_after_commit(
            self.orders_client.place(tenant, key, d.order_id, timeout=RETRY_TIMEOUT_S),
            lambda: self.order_rows(tenant, d.order_id),
        )
        d.answers.append(first)
        d.check(
            first.code is grpc.StatusCode.CANCELLED,
            f"attempt 1: expected to give up after the commit, got {first.label}",
        )
        committed = await self.order_rows(tenant, d.order_id)
        d.check(len(committed) == 1, f"expected the order committed, rows: {committed}")
        called = await self.expect_child_keys(d, tenant, key, calls=1)
        retry = await self.orders_client.place(tenant, key, d.order_id)
        d.answers.append(retry)
        d.check(retry.ok and retry.replayed, f"retry: expected a replay, got {retry.label}")
        order = retry.order
        d.check(
            order is not None and [(order.charge_id, order.email_id)] == committed,
            f"retry answered {order}, rows: {committed}",
        )
        # OrderService replayed its record: the downstream services received nothing more.
        again = await self.expect_child_keys(d, tenant, key, calls=1)
        d.check(again == called, f"the replay called downstream: {called} -> {again} calls")

    async def two_tenants_one_order_key(self, d: Drill) -> None:
        await self.orders.start()
        key = "order-" + uuid.uuid4().hex
        # Byte-identical requests with the same key: only the tenant header differs.
        firsts = [await self.orders_client.place(t, key, d.order_id) for t in d.tenants]
        retries = [await self.orders_client.place(t, key, d.order_id) for t in d.tenants]
        d.answers.extend(firsts + retries)
        d.check(
            all(a.ok and not a.replayed for a in firsts),
            "each tenant's first call should execute (not replay the other tenant's)",
        )
        placed = [o for a in firsts if (o := a.order) is not None]
        d.check(
            len({o.charge_id for o in placed}) == len(d.tenants), "the tenants share one charge"
        )
        d.check(len({o.email_id for o in placed}) == len(d.tenants), "the tenants share one email")
        d.check(
            all(r.ok and r.replayed for r in retries)
            and [r.response for r in retries] == [f.response for f in firsts],
            "each tenant's retry should replay its own order",
        )
        for tenant in d.tenants:
            await self.expect_child_keys(d, tenant, key, calls=1)

    async def crash_between_charge_and_order(self, d: Drill) -> None:
        lease = ["--lease", f"{ORDER_LEASE_S:g}"]
        await self.orders.start("before_commit=crash", lease)
        tenant, key = d.tenants[0], "order-" + uuid.uuid4().hex
        first = await self.orders_client.place(tenant, key, d.order_id)
        d.answers.append(first)
        d.check(not first.ok, f"attempt 1: expected the call to fail, got {first.label}")
        code = await self.orders.wait_exit(5)
        d.check(code is not None, "the orders process did not crash")
        charges = await self.charge_rows(d.order_id)
        d.check(len(charges) == 1, f"expected the charge before the crash, rows: {charges}")
        d.check(
            not await self.order_rows(tenant, d.order_id), "an order committed before the crash"
        )
        print(
            f"  orders killed after the charge, before its final commit (exit {code});"
            " restarting it, retrying once its lease has run out",
            flush=True,
        )
        await self.orders.start(args=lease)
        waited = await self.wait_for_lease(tenant, key)
        print(f"  the dead attempt's lease ran out after {waited:.1f} s (database clock)")
        retry = await self.orders_client.place(tenant, key, d.order_id)
        d.answers.append(retry)
        d.check(retry.ok and not retry.replayed, f"retry: expected a takeover, got {retry.label}")
        order = retry.order
        d.check(
            order is not None and [order.charge_id] == charges,
            f"retry answered charge {order and order.charge_id}, rows: {charges}",
        )
        # The re-run sent the same child keys: payments and notifications replayed.
        await self.expect_child_keys(d, tenant, key, calls=2)

    # --- i: the outbox, OrderService -> relay -> LedgerService ---

    async def outbox_to_ledger(self, d: Drill) -> None:
        # The orders of drills f-h left one OrderCreated event each in the outbox: no relay ran.
        earlier = ["tenant:" + t for drill in self.placed for t in drill.tenants]
        await self.relay.start(args=["--lease", f"{RELAY_LEASE_S:g}"])
        await self.outbox_sent(earlier)
        await self.relay.stop()
        orders = await self.entries_per_order(earlier)
        d.check(bool(orders), "drills f-h left no orders to record")
        d.check(
            all(n == 1 for n in orders.values()),
            f"drills f-h: ledger entries per order should be 1: {orders}",
        )
        d.notes.append(
            f"drills f-h: {len(orders)} orders (replayed, two tenants, re-run after a crash)"
            f" -> {sum(orders.values())} ledger entries"
        )

        # Two new orders, one retried: two events (the replay enqueues nothing).
        first_key = "order-" + uuid.uuid4().hex
        first = await self.orders_client.place(d.tenants[0], first_key, d.order_id)
        retry = await self.orders_client.place(d.tenants[0], first_key, d.order_id)
        other = await self.orders_client.place(
            d.tenants[1], "order-" + uuid.uuid4().hex, d.order_id
        )
        d.answers += [first, retry, other]
        d.check(first.ok and not first.replayed, f"attempt 1: expected OK, got {first.label}")
        d.check(retry.ok and retry.replayed, f"retry: expected a replay, got {retry.label}")
        d.check(other.ok and not other.replayed, f"other tenant: expected OK, got {other.label}")
        scopes = ["tenant:" + t for t in d.tenants]
        events = await self.outbox_states(scopes)
        d.check(events == ["pending", "pending"], f"expected 2 pending events, got {events}")

        # A relay takes the first event (batches of one), delivers it, and dies (kill -9) before
        # marking it sent: the event stays claimed until its lease runs out.
        await self.relay.start(
            "relay_after_delivery=crash",
            ["--batch-size", "1", "--lease", f"{RELAY_LEASE_S:g}"],
            may_crash=True,
        )
        code = await self.relay.wait_exit(10)
        d.check(code is not None, "the relay did not crash after delivering")
        # Delivered (once, or more if a delivery timed out and was retried) with the event's key.
        delivered = await self.attempt_keys("ledger", d.tenants[0])
        expected = child_key(scopes[0], first_key, ORDER_EVENT_STEP)
        d.check(
            bool(delivered) and set(delivered) == {expected},
            f"expected the first event delivered before the crash with key {expected[:12]}...,"
            f" got {[k[:12] if k else k for k in delivered]}",
        )
        print(
            f"  relay killed after delivering an event, before marking it sent (exit {code});"
            " starting another",
            flush=True,
        )
        await self.relay.start(args=["--lease", f"{RELAY_LEASE_S:g}"])
        await self.outbox_sent(scopes)
        await self.relay.stop()
        again = await self.attempt_keys("ledger", d.tenants[0])
        d.check(
            len(again) > len(delivered) and set(again) == {expected},
            f"the first event should reach the ledger again with key {expected[:12]}...,"
            f" got {[k[:12] if k else k for k in again]}",
        )
        if len(again) > len(delivered) and set(again) == {expected}:
            d.notes.append(
                f"ledger.attempts: one event delivered {len(again)} times, key {expected}"
            )

    async def outbox_states(self, scopes: list[str]) -> list[str]:
        rows = await self.db.fetch(
            f"SELECT state FROM {OUTBOX} WHERE scope = ANY($1::text[]) ORDER BY id", scopes
        )
        return [r["state"] for r in rows]

    async def outbox_sent(self, scopes: list[str], timeout: float = 15.0) -> None:
        """Waits until the relay has delivered and marked every event of ``scopes``."""
        deadline = time.monotonic() + timeout
        while any(state != "sent" for state in await self.outbox_states(scopes)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not deliver the events within {timeout} s")
            await asyncio.sleep(0.02)

    async def entries_per_order(self, scopes: list[str]) -> dict[str, int]:
        """Ledger entries per order placed under ``scopes`` ("tenant order_id" -> count)."""
        rows = await self.db.fetch(
            "SELECT o.tenant, o.order_id, (SELECT count(*) FROM ledger.entries e"
            "  WHERE e.tenant = o.tenant AND e.order_id = o.order_id) AS entries"
            " FROM orders.orders o WHERE o.tenant = ANY($1::text[])",
            scopes,
        )
        return {f"{r['tenant']} {r['order_id']}": r["entries"] for r in rows}

    async def wait_for_lease(self, tenant: str, key: str, timeout: float = 10.0) -> float:
        """Polls until the claim's lease has run out by the database's clock; returns the wait."""
        started = time.monotonic()
        while True:
            expired = await self.db.fetchval(
                "SELECT locked_until <= clock_timestamp() FROM orders_idempotency.records"
                " WHERE scope = $1 AND key = $2 AND state = 'in_progress'",
                "tenant:" + tenant,
                key,
            )
            if expired:
                return time.monotonic() - started
            if expired is None:
                raise RuntimeError("no in-progress claim left by the crashed attempt")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"the lease did not run out within {timeout} s")
            await asyncio.sleep(0.02)

    async def expect_child_keys(
        self, d: Drill, tenant: str, key: str, *, calls: int
    ) -> tuple[int, int]:
        """Payments and notifications received at least ``calls`` calls for the tenant (one per
        run of PlaceOrder), all with the child key of their step: ``child_key("tenant:<t>",
        parent key, step)``. At least: orders' channels retry ABORTED and UNAVAILABLE (gRPC's
        own retries), as often as the scheduler makes them happen. Returns the two counts."""
        counts = []
        for service, step in (("payments", CHARGE_STEP), ("notifications", EMAIL_STEP)):
            keys = await self.attempt_keys(service, tenant)
            expected = child_key("tenant:" + tenant, key, step)
            d.check(
                len(keys) >= calls and set(keys) == {expected},
                f"{service}.attempts for {tenant}: expected {calls}+ x child key"
                f" {expected[:12]}..., got {[k[:12] if k else k for k in keys]}",
            )
            if len(keys) > 1 and len(set(keys)) == 1:
                d.notes.append(f"{service}.attempts: {len(keys)} calls, one child key {keys[0]}")
            counts.append(len(keys))
        return counts[0], counts[1]

    # --- j-k: one order attempted twice, by a stalled replica or by gRPC's own retries ---

    async def stalled_past_lease(self, d: Drill) -> None:
        tenant, key = d.tenants[0], "order-" + uuid.uuid4().hex
        # A second replica (A) with a short lease that waits after claiming: it holds the claim
        # and has not charged yet when it is frozen. The running replica (B) takes over.
        stalled = Orders(self.orders.dsn, _free_port(), self.payments, self.notifications)
        try:
            await stalled.start(f"after_claim=sleep:{STALL_MS}", ["--lease", f"{ORDER_LEASE_S:g}"])
            assert stalled.client is not None and stalled.proc is not None
            pid = stalled.proc.pid
            stale = asyncio.create_task(
                stalled.client.place(tenant, key, d.order_id, timeout=RETRY_TIMEOUT_S)
            )
            try:
                await self.wait_for_claim(tenant, key)
                stalled.pause()
                try:
                    print(f"  orders pid {pid} holds the claim: frozen (SIGSTOP)", flush=True)
                    waited = await self.wait_for_lease(tenant, key)
                    print(f"  its lease ran out after {waited:.1f} s (database clock); retrying")
                    retry = await self.orders_client.place(tenant, key, d.order_id)
                finally:
                    stalled.resume()
                    print(f"  orders pid {pid} resumed (SIGCONT)", flush=True)
                first = await stale
            finally:
                if not stale.done():
                    stale.cancel()
        finally:
            await stalled.stop()
        d.answers += [retry, first]
        d.check(retry.ok and not retry.replayed, f"retry: expected a takeover, got {retry.label}")
        d.check(
            first.code is grpc.StatusCode.ABORTED and first.reason == LEASE_LOST,
            f"the stalled attempt: expected ABORTED/{LEASE_LOST.removeprefix('IDEMPOTENCY_')},"
            f" got {first.label}",
        )
        order = retry.order
        committed = await self.order_rows(tenant, d.order_id)
        d.check(
            order is not None and [(order.charge_id, order.email_id)] == committed,
            f"retry answered {order}, rows: {committed}",
        )
        record = await self.record_of(tenant, key)
        d.check(
            record is not None and record["state"] == "completed" and record["fencing_token"] == 2,
            f"expected the record completed by the takeover (fencing token 2), got {record}",
        )
        if record is not None:
            d.notes.append(
                f"{RECORDS}: {record['state']}, fencing token {record['fencing_token']}"
                f" (the stalled replica held 1)"
            )
        # B charged and emailed with the child keys; A, stalled before its charge, sent nothing
        # (or, had it got that far, the same child keys: replayed).
        for service, step in (("payments", CHARGE_STEP), ("notifications", EMAIL_STEP)):
            keys = await self.attempt_keys(service, tenant)
            expected = child_key("tenant:" + tenant, key, step)
            d.check(
                bool(keys) and set(keys) == {expected},
                f"{service}.attempts: expected child key {expected[:12]}...,"
                f" got {[k[:12] if k else k for k in keys]}",
            )

    async def one_key_across_grpc_retries(self, d: Drill) -> None:
        tenant = d.tenants[0]
        # Each attempt at a second replica waits after its claim: provably inside the handler
        # when its connection drops (the server then cancels it and releases the claim for the
        # next attempt). The attempt after the last reset goes to the demo's own replica
        # (restarted without failpoints), which answers it without waiting.
        holding = Orders(self.orders.dsn, _free_port(), self.payments, self.notifications)
        try:
            await asyncio.gather(
                holding.start(f"after_claim=sleep:{CLAIM_HOLD_MS}"), self.orders.start()
            )
            proxy = ResettingProxy(holding.address)
            client = OrdersClient(
                await proxy.start(),
                self.orders.credentials,
                interceptors=[IdempotencyClientInterceptor(services=[orders_pb2])],
                options=channel_options([orders_pb2]),
            )
            try:
                with capture_keys() as keys:  # the task's context shares this list
                    call = asyncio.create_task(
                        client.place(tenant, None, d.order_id, timeout=RETRY_TIMEOUT_S)
                    )
                try:
                    deadline = time.monotonic() + 10
                    while not keys:  # the interceptor runs once the call has started
                        if time.monotonic() > deadline:
                            raise RuntimeError("the interceptor minted no key")
                        await asyncio.sleep(0.01)
                    key = keys[0]
                    for claim in range(1, RESETS + 1):
                        await self.wait_for_claim(tenant, key, claim=claim)
                        if claim == RESETS:  # the retry after this reset connects anew
                            proxy.upstream = self.orders.address
                        dropped = proxy.reset()
                        d.check(dropped == 1, f"claim {claim}: {dropped} connections to drop")
                        print(f"  the attempt holding claim {claim}: connection reset", flush=True)
                    answer = await call
                finally:
                    if not call.done():
                        call.cancel()
            finally:
                await client.close()
                await proxy.close()
        finally:
            await holding.stop()
        d.answers.append(answer)
        d.check(len(keys) == 1, f"the interceptor minted {len(keys)} keys (expected 1)")
        d.check(answer.ok and not answer.replayed, f"the call: expected OK, got {answer.label}")
        seen = await self.attempt_keys("orders", tenant)
        # RESETS + 1 attempts at least; how many more (a retry that outruns the release of the
        # previous claim waits, and may be answered ABORTED/IN_PROGRESS and retried again) is the
        # scheduler's business.
        d.check(
            len(seen) > RESETS and set(seen) == {key},
            f"orders.attempts: expected {RESETS + 1}+ attempts with key {key},"
            f" got {len(seen)}: {sorted(set(seen))}",
        )
        if len(seen) > 1 and len(set(seen)) == 1:
            d.notes.append(
                f"orders.attempts: {len(seen)} attempts of one call ({proxy.connections}"
                f" connections), one minted key {seen[0]}"
            )
        await self.expect_child_keys(d, tenant, key, calls=1)

    # --- l: no valid token ---

    async def no_valid_token(self, d: Drill) -> None:
        tenant = d.tenants[0]
        key, order_key = "pay-" + uuid.uuid4().hex, "order-" + uuid.uuid4().hex
        forged = bearer("tok-" + secrets.token_urlsafe(24))
        attempts = (
            ("Charge, no token", self.client.charge(tenant, key, d.order_id, 700, auth=())),
            (
                "Charge, a forged token",
                self.client.charge(tenant, key, d.order_id, 700, auth=[forged]),
            ),
            (
                "Charge, x-tenant-id and no token",
                self.client.charge(tenant, key, d.order_id, 700, auth=[("x-tenant-id", tenant)]),
            ),
            (
                "PlaceOrder, a forged token",
                self.orders_client.place(tenant, order_key, d.order_id, auth=[forged]),
            ),
        )
        for what, attempt in attempts:
            answer = await attempt
            d.answers.append(answer)
            d.check(
                answer.code is grpc.StatusCode.UNAUTHENTICATED,
                f"{what}: expected UNAUTHENTICATED, got {answer.label}",
            )
        # Refused before the attempt log and before any claim: nothing received, nothing stored.
        for service, k in (("payments", key), ("orders", order_key)):
            logged = await self.db.fetchval(
                f"SELECT count(*) FROM {service}.attempts WHERE key = $1", k
            )
            stored = await self.db.fetchval(
                f"SELECT count(*) FROM {service}_idempotency.records WHERE key = $1", k
            )
            d.check(
                (logged, stored) == (0, 0),
                f"{service}: {logged} attempts logged, {stored} records stored (expected none)",
            )

    async def give_up_after_commit(
        self,
        attempt: Coroutine[Any, Any, Answer],
        committed: Callable[[], Awaitable[Sequence[object]]],
        timeout: float = RETRY_TIMEOUT_S,
    ) -> Answer:
        """Runs ``attempt`` and gives up on it (cancels it, as a client's deadline or a closed
        tab would) once ``committed()`` finds its effect: the response is lost after the
        commit, decided by what the database shows, not by racing a deadline against it."""
        call = asyncio.create_task(attempt)
        deadline = time.monotonic() + timeout
        try:
            while not call.done() and not await committed():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nothing committed within {timeout} s")
                await asyncio.sleep(0.02)
        finally:
            call.cancel()
            await asyncio.wait([call])
        if call.cancelled():
            return Answer(grpc.StatusCode.CANCELLED, False, details="gave up after the commit")
        return call.result()  # it ended first: the drill reports what it was

    async def record_of(self, tenant: str, key: str) -> asyncpg.Record | None:
        """The key's record at orders; ``held``: claimed, its lease running (database clock)."""
        return await self.db.fetchrow(
            "SELECT state, fencing_token, state = 'in_progress'"
            "  AND locked_until > clock_timestamp() AS held"
            f" FROM {RECORDS} WHERE scope = $1 AND key = $2",
            "tenant:" + tenant,
            key,
        )

    async def wait_for_claim(
        self, tenant: str, key: str, *, claim: int = 1, timeout: float = 10.0
    ) -> None:
        """Polls until the ``claim``-th claim of the key at orders is held, its lease running: the
        attempt that made it is inside the handler. Every claim (first or takeover) adds one to
        the fencing token; a released claim stays in progress with its lease ended, and an
        earlier attempt's claim not yet released does not count."""
        deadline = time.monotonic() + timeout
        while True:
            record = await self.record_of(tenant, key)
            if record is not None and record["fencing_token"] == claim and record["held"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"claim {claim} of the key was not held within {timeout} s")
            await asyncio.sleep(0.01)

    async def run(self, d: Drill, drill: Callable[[Drill], Awaitable[None]]) -> Drill:
        print(f"{d.name} ...", flush=True)
        try:
            await drill(d)
        except Exception as exc:
            d.problems.append(f"{type(exc).__name__}: {exc}")
        if d.effects_expected.get("orders"):
            self.placed.append(d)
        try:
            await self.count(d)
        except Exception as exc:
            d.problems.append(f"counting failed: {type(exc).__name__}: {exc}")
        for note in d.notes:
            print(f"  {note}")
        return d

    async def count(self, d: Drill) -> None:
        """Calls received and rows written per service, and the verdict on repeats."""
        tenants = list(d.tenants)
        scopes = ["tenant:" + t for t in tenants]
        for service in SERVICES:
            d.attempts[service] = await self.db.fetchval(
                f"SELECT count(*) FROM {service}.attempts WHERE tenant = ANY($1::text[])",
                tenants,
            )
            table = EFFECTS[service]
            d.effects[service] = await self.db.fetchval(
                f"SELECT count(*) FROM {table} WHERE order_id = $1", d.order_id
            )
            # A side effect happens at most once per tenant and order, whatever the drill.
            repeated = await self.db.fetch(
                f"SELECT tenant, count(*) AS n FROM {table}"
                " WHERE order_id = $1 AND tenant = ANY($2::text[]) GROUP BY tenant"
                " HAVING count(*) > 1",
                d.order_id,
                scopes,
            )
            for row in repeated:
                d.problems.append(
                    f"SIDE EFFECT REPEATED: {row['n']} {EFFECT_NAMES[service]} for"
                    f" {row['tenant']}, order {d.order_id}"
                )
            want, got = d.effects_expected.get(service, 0), d.effects[service]
            if got > want and not repeated:
                d.problems.append(
                    f"SIDE EFFECT REPEATED: {got} {EFFECT_NAMES[service]} written, {want} expected"
                )
            elif got < want:
                d.problems.append(f"{got} {EFFECT_NAMES[service]} written, {want} expected")


def print_table(drills: list[Drill]) -> None:
    header = (
        "drill",
        "sent",
        "answers",
        "orders",
        "payments",
        "notifications",
        "ledger",
        "expected",
        "verdict",
    )
    rows = [
        (
            d.name,
            str(len(d.answers)),
            d.summary,
            d.cell("orders"),
            d.cell("payments"),
            d.cell("notifications"),
            d.cell("ledger"),
            d.expected,
            "FAIL" if d.problems else "PASS",
        )
        for d in drills
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    print()
    print("per service: calls received (<service>.attempts) -> rows written (orders.orders,")
    print("payments.charges, notifications.emails, ledger.entries); '-': the drill does not")
    print("involve it")
    print()
    print(line(header))
    print(line(tuple("-" * w for w in widths)))
    for row in rows:
        print(line(row))
    for d in drills:
        for problem in d.problems:
            print(f"  {d.name}: {problem}")
    failed = sum(bool(d.problems) for d in drills)
    print()
    print(f"{failed} of {len(drills)} drills FAILED" if failed else "all drills passed")


async def run(dsn: str | None) -> int:
    """Runs the drills, prints the table; 0 when every expectation held, else 1."""
    # SIGTERM would otherwise end this process without cleanup, orphaning the service processes
    # and the embedded PostgreSQL: turn it into a cancellation, which the finally blocks handle.
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        return await _run(dsn)
    except asyncio.CancelledError:
        if not terminated:
            raise
        print("demo: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _plan(demo: Demo) -> list[tuple[Drill, Callable[[Drill], Awaitable[None]]]]:
    one = "1 charge"
    charge = {"payments": 1}
    once = {"orders": 1, "payments": 1, "notifications": 1}
    return [
        (
            Drill("a. plain retries", f"{one}; attempts 2-3 replayed, same charge_id", charge),
            demo.plain_retries,
        ),
        (
            Drill(
                "b. lost response: gave up", f"{one}; gave up after commit, then replayed", charge
            ),
            demo.lost_response_gave_up,
        ),
        (
            Drill("b. lost response: crash", f"{one}; crash after commit, then replayed", charge),
            demo.lost_response_crash,
        ),
        (
            Drill(
                "c. concurrent duplicates",
                f"{one}; identical bytes, retried IN_PROGRESS ones too",
                charge,
            ),
            demo.concurrent_duplicates,
        ),
        (
            Drill("d. mutated payload", f"{one}; FAILED_PRECONDITION/KEY_REUSED", charge),
            demo.mutated_payload,
        ),
        (
            Drill(
                "e. two tenants, one key",
                "2 charges, 1 per tenant; retries replay own",
                {"payments": 2},
            ),
            demo.two_tenants,
        ),
        (
            Drill(
                "f. lost order response",
                "1 of each; gave up after commit, then replayed",
                once,
            ),
            demo.lost_order_response,
        ),
        (
            Drill(
                "g. two tenants, one order key",
                "2 of each, 1 per tenant; retries replay own",
                {"orders": 2, "payments": 2, "notifications": 2},
            ),
            demo.two_tenants_one_order_key,
        ),
        (
            Drill(
                "h. crash between charge and order",
                "1 of each; re-run after the lease, same child keys",
                once,
            ),
            demo.crash_between_charge_and_order,
        ),
        (
            Drill(
                "i. outbox to ledger",
                "2 of each; an event delivered again, 1 entry",
                {"orders": 2, "payments": 2, "notifications": 2, "ledger": 2},
            ),
            demo.outbox_to_ledger,
        ),
        (
            Drill(
                "j. orders stalled past its lease",
                "1 of each; taken over, stalled one ABORTED",
                once,
            ),
            demo.stalled_past_lease,
        ),
        (
            Drill(
                "k. one key across gRPC retries",
                "1 of each; 1 call, 3+ attempts, 1 minted key",
                once,
            ),
            demo.one_key_across_grpc_retries,
        ),
        (
            Drill("l. no valid token", "nothing; UNAUTHENTICATED, nothing logged or stored", {}),
            demo.no_valid_token,
        ),
    ]


async def _run(dsn: str | None) -> int:
    started = time.monotonic()
    pg = None
    if dsn is None:
        from grpc_idempotency.testing import EmbeddedPostgres

        pg = EmbeddedPostgres()
    services: list[Service] = []
    db: asyncpg.Connection | None = None
    try:
        if pg is not None:
            dsn = pg.start()
            print(f"embedded PostgreSQL: {dsn}", flush=True)
        assert dsn is not None
        credentials = Credentials()
        payments = Payments(dsn, _free_port(), credentials)
        notifications = Service("notifications", dsn, _free_port(), credentials)
        orders = Orders(dsn, _free_port(), payments, notifications)
        ledger = Service("ledger", dsn, _free_port(), credentials)
        relay = OutboxRelay(dsn, ledger)
        servers: list[Service] = [payments, notifications, orders, ledger]
        services += [*servers, relay]
        db = await asyncpg.connect(dsn)
        demo = Demo(db, payments, notifications, orders, relay)
        plan = _plan(demo)
        for drill, _ in plan:  # every tenant of every drill, known to the services from the start
            for tenant in drill.tenants:
                credentials.add(tenant)
        # The four services from the start: each creates its schemas, which every drill's count
        # reads. The drills restart payments and orders with failpoints where they need them;
        # drill i runs the relay.
        await asyncio.gather(*(service.start() for service in servers))
        drills = [await demo.run(drill, fn) for drill, fn in plan]
        print_table(drills)
        print(f"({time.monotonic() - started:.1f} s)")
        return 1 if any(d.problems for d in drills) else 0
    except Exception as exc:  # setup failed (the drills report their own errors)
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if db is not None:
            with contextlib.suppress(Exception):
                await db.close()
        for service in reversed(services):
            await service.stop()
        if pg is not None:
            pg.close()
