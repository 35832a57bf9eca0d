"""``python -m examples.checkout demo [--dsn DSN]``: failure drills against a real payments process.

PaymentService runs as a separate process (restarted with failpoints where a drill needs one);
this process is a grpc.aio client that retries the way a real caller would and then counts, with
SQL, the rows each operation wrote to ``payments.charges``. The drills:

a. plain retries        the same key three times: one charge, attempts 2-3 replayed
b. lost response        the charge commits but the answer never arrives (a deadline; a crash
                        after commit): the retry replays the committed charge
c. concurrent dups      50 calls at once with one key: one charge, identical answers
d. mutated payload      the same key with another amount: refused, nothing written
e. two tenants          one key, two tenants: two independent charges

Exit status 1 when any side effect happened more often than expected or any expectation failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import asyncpg
import grpc
from google.rpc import error_details_pb2, status_pb2

import examples.checkout.gen  # noqa: F401  (puts the generated package on sys.path)
from grpc_idempotency import KEY_HEADER, REPLAYED_HEADER
from grpc_idempotency.core.failpoints import ENV_VAR as FAILPOINTS_ENV

# isort: split
# Only importable once examples.checkout.gen has run: keep the import sorter from hoisting it.
from checkout.v1 import payments_pb2

ROOT = Path(__file__).resolve().parents[2]
CHARGE = "/checkout.v1.PaymentService/Charge"
TENANT_HEADER = "x-tenant-id"
DETAILS_TRAILER = "grpc-status-details-bin"
IN_PROGRESS = "IDEMPOTENCY_KEY_IN_PROGRESS"
REUSED = "IDEMPOTENCY_KEY_REUSED"
TIMEOUT_S = 5.0
START_TIMEOUT_S = 20.0
CONCURRENT_CALLS = 50


# --- talking to PaymentService ----------------------------------------------------------------


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
        if self.response is None:
            return None
        return payments_pb2.ChargeResponse.FromString(self.response).charge_id

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


class Client:
    """Charge over one channel; responses are kept as raw bytes so replays can be compared."""

    def __init__(self, target: str) -> None:
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
    ) -> Answer:
        request = payments_pb2.ChargeRequest(
            order_id=order_id, amount_cents=amount_cents, currency="EUR", card_token="tok_visa"
        )
        request.sent_at.GetCurrentTime()  # differs per attempt; excluded from the fingerprint
        metadata = ((TENANT_HEADER, tenant), (KEY_HEADER, key))
        call = self._charge(request, metadata=metadata, timeout=timeout)
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

    async def close(self) -> None:
        await self.channel.close()


# --- the payments process ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Payments:
    """``python -m examples.checkout payments`` as a child process, restartable on one port."""

    def __init__(self, dsn: str, port: int) -> None:
        self.dsn = dsn
        self.port = port
        self.proc: asyncio.subprocess.Process | None = None
        self.client: Client | None = None
        self._stderr: IO[bytes] | None = None
        self._drain: asyncio.Task[bytes] | None = None

    async def start(self, failpoints: str | None = None) -> Client:
        await self.stop()
        env = dict(os.environ)
        env.pop(FAILPOINTS_ENV, None)
        if failpoints:
            env[FAILPOINTS_ENV] = failpoints
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # Kept open for the child's lifetime (closed in stop()); shown when it fails to start.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "examples.checkout", "payments",
            "--listen", f"127.0.0.1:{self.port}", "--dsn", self.dsn,
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
                status = "still running" if code is None else f"exit {code}"
                raise RuntimeError(f"payments did not start ({status}):\n{self.stderr_tail()}")
            text = line.decode(errors="replace").strip()
            if text.startswith("payments listening"):
                # The line names the port actually bound.
                self.port = int(text.rpartition(":")[2])
                break
        # Keep reading, so that a chatty child can never block on a full pipe.
        self._drain = asyncio.create_task(self.proc.stdout.read())
        note = f" with {FAILPOINTS_ENV}={failpoints}" if failpoints else ""
        print(f"  payments pid {self.proc.pid} on 127.0.0.1:{self.port}{note}", flush=True)
        self.client = Client(f"127.0.0.1:{self.port}")
        return self.client

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the process has exited by itself, None if it still runs."""
        assert self.proc is not None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.proc.wait(), timeout)
        return None

    async def stop(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
        if self.proc is not None:
            proc, self.proc = self.proc, None
            if proc.returncode is None:
                proc.terminate()
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


# --- the drills -------------------------------------------------------------------------------


@dataclass
class Drill:
    name: str
    expected: str
    expected_charges: int
    order_id: str = field(default_factory=lambda: "ord_" + uuid.uuid4().hex[:12])
    answers: list[Answer] = field(default_factory=list)
    charges: int | None = None
    problems: list[str] = field(default_factory=list)

    def check(self, condition: bool, problem: str) -> None:
        if not condition:
            self.problems.append(problem)

    @property
    def summary(self) -> str:
        counts = Counter(a.label for a in self.answers)
        return ", ".join(f"{n} {label}" for label, n in counts.items()) or "-"


class Demo:
    def __init__(self, db: asyncpg.Connection, payments: Payments) -> None:
        self.db = db
        self.payments = payments
        run = uuid.uuid4().hex[:8]
        self.tenants = (f"acme-{run}", f"globex-{run}")

    @property
    def client(self) -> Client:
        assert self.payments.client is not None, "payments is not running"
        return self.payments.client

    async def charge_rows(self, order_id: str) -> list[str]:
        rows = await self.db.fetch(
            "SELECT charge_id FROM payments.charges WHERE order_id = $1 ORDER BY charged_at",
            order_id,
        )
        return [r["charge_id"] for r in rows]

    async def plain_retries(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        for _ in range(3):
            d.answers.append(await self.client.charge(self.tenants[0], key, d.order_id, 1999))
        d.check(all(a.ok for a in d.answers), "not every attempt succeeded")
        d.check(
            [a.replayed for a in d.answers] == [False, True, True],
            "expected attempt 1 executed and attempts 2-3 marked replayed",
        )
        d.check(len({a.charge_id for a in d.answers}) == 1, "attempts returned different charges")
        d.check(len({a.response for a in d.answers}) == 1, "replayed bytes differ from the first")

    async def lost_response_deadline(self, d: Drill) -> None:
        await self.payments.start("after_commit_before_response=sleep:1500")
        key = "pay-" + uuid.uuid4().hex
        first = await self.client.charge(self.tenants[0], key, d.order_id, 2500, timeout=0.5)
        d.answers.append(first)
        d.check(
            first.code is grpc.StatusCode.DEADLINE_EXCEEDED,
            f"attempt 1: expected DEADLINE_EXCEEDED, got {first.label}",
        )
        committed = await self.charge_rows(d.order_id)
        d.check(len(committed) == 1, f"the charge did not commit before the deadline: {committed}")
        retry = await self.client.charge(self.tenants[0], key, d.order_id, 2500)
        d.answers.append(retry)
        d.check(retry.ok and retry.replayed, f"retry: expected a replay, got {retry.label}")
        d.check(
            retry.charge_id in committed, f"retry answered {retry.charge_id}, rows: {committed}"
        )

    async def lost_response_crash(self, d: Drill) -> None:
        await self.payments.start("after_commit_before_response=crash")
        key = "pay-" + uuid.uuid4().hex
        first = await self.client.charge(self.tenants[0], key, d.order_id, 4200)
        d.answers.append(first)
        d.check(not first.ok, f"attempt 1: expected the call to fail, got {first.label}")
        code = await self.payments.wait_exit(5)
        d.check(code is not None, "the payments process did not crash")
        print(f"  payments crashed after commit (exit {code}); restarting it", flush=True)
        committed = await self.charge_rows(d.order_id)
        d.check(len(committed) == 1, f"the charge did not commit before the crash: {committed}")
        await self.payments.start()
        retry = await self.client.charge(self.tenants[0], key, d.order_id, 4200)
        d.answers.append(retry)
        d.check(retry.ok and retry.replayed, f"retry: expected a replay, got {retry.label}")
        d.check(
            retry.charge_id in committed, f"retry answered {retry.charge_id}, rows: {committed}"
        )

    async def concurrent_duplicates(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        calls = [
            self.client.charge(self.tenants[0], key, d.order_id, 999)
            for _ in range(CONCURRENT_CALLS)
        ]
        d.answers.extend(await asyncio.gather(*calls))
        bodies = {a.response for a in d.answers if a.ok}
        d.check(len(bodies) == 1, f"{len(bodies)} different OK response bodies (expected 1)")
        d.check(
            sum(a.ok and not a.replayed for a in d.answers) <= 1,
            "more than one answer claims to have executed",
        )
        odd = [a.label for a in d.answers if not a.ok and a.label != "aborted"]
        d.check(not odd, f"unexpected answers: {sorted(set(odd))}")

    async def mutated_payload(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        first = await self.client.charge(self.tenants[0], key, d.order_id, 5000)
        d.answers.append(first)
        d.check(first.ok and not first.replayed, f"attempt 1: expected OK, got {first.label}")
        mutated = await self.client.charge(self.tenants[0], key, d.order_id, 50000)
        d.answers.append(mutated)
        d.check(
            mutated.code is grpc.StatusCode.FAILED_PRECONDITION and mutated.reason == REUSED,
            f"mutated attempt: expected FAILED_PRECONDITION/{REUSED}, got {mutated.label}",
        )

    async def two_tenants(self, d: Drill) -> None:
        key = "pay-" + uuid.uuid4().hex
        firsts = [await self.client.charge(t, key, d.order_id, 1234) for t in self.tenants]
        retries = [await self.client.charge(t, key, d.order_id, 1234) for t in self.tenants]
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
        per_tenant = await self.db.fetch(
            "SELECT tenant, count(*) AS n FROM payments.charges WHERE order_id = $1"
            " GROUP BY tenant",
            d.order_id,
        )
        d.check(
            sorted(r["n"] for r in per_tenant) == [1, 1],
            f"expected one charge per tenant: {[tuple(r) for r in per_tenant]}",
        )

    async def run(self, d: Drill, drill: Callable[[Drill], Awaitable[None]]) -> Drill:
        print(f"{d.name} ...", flush=True)
        try:
            await drill(d)
        except Exception as exc:
            d.problems.append(f"{type(exc).__name__}: {exc}")
        try:
            d.charges = len(await self.charge_rows(d.order_id))
        except Exception as exc:
            d.problems.append(f"counting charges failed: {type(exc).__name__}: {exc}")
            return d
        if d.charges > d.expected_charges:
            d.problems.append(
                f"SIDE EFFECT REPEATED: {d.charges} charges written, {d.expected_charges} expected"
            )
        elif d.charges < d.expected_charges:
            d.problems.append(f"{d.charges} charges written, {d.expected_charges} expected")
        return d


def print_table(drills: list[Drill]) -> None:
    header = ("drill", "sent", "answers", "charges", "expected", "verdict")
    rows = [
        (
            d.name,
            str(len(d.answers)),
            d.summary,
            "?" if d.charges is None else str(d.charges),
            d.expected,
            "FAIL" if d.problems else "PASS",
        )
        for d in drills
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

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
    # SIGTERM would otherwise end this process without cleanup, orphaning the payments process
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


async def _run(dsn: str | None) -> int:
    started = time.monotonic()
    pg = None
    if dsn is None:
        from grpc_idempotency.store.embedded import EmbeddedPostgres

        pg = EmbeddedPostgres()
    payments: Payments | None = None
    db: asyncpg.Connection | None = None
    try:
        if pg is not None:
            dsn = pg.start()
            print(f"embedded PostgreSQL: {dsn}", flush=True)
        assert dsn is not None
        payments = Payments(dsn, _free_port())
        await payments.start()
        db = await asyncpg.connect(dsn)
        demo = Demo(db, payments)
        one = "1 charge"
        plan: list[tuple[Drill, Callable[[Drill], Awaitable[None]]]] = [
            (
                Drill("a. plain retries", f"{one}; attempts 2-3 replayed, same charge_id", 1),
                demo.plain_retries,
            ),
            (
                Drill("b. lost response: deadline", f"{one}; DEADLINE_EXCEEDED, then replayed", 1),
                demo.lost_response_deadline,
            ),
            (
                Drill("b. lost response: crash", f"{one}; crash after commit, then replayed", 1),
                demo.lost_response_crash,
            ),
            (
                Drill(
                    "c. concurrent duplicates",
                    f"{one}; identical bytes or aborted (IN_PROGRESS)",
                    1,
                ),
                demo.concurrent_duplicates,
            ),
            (
                Drill("d. mutated payload", f"{one}; FAILED_PRECONDITION/KEY_REUSED", 1),
                demo.mutated_payload,
            ),
            (
                Drill("e. two tenants, one key", "2 charges, 1 per tenant; retries replay own", 2),
                demo.two_tenants,
            ),
        ]
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
        if payments is not None:
            await payments.stop()
        if pg is not None:
            pg.close()
