#!/usr/bin/env python
"""What the idempotency interceptor costs over a hand-written handler, measured side by side.

    cd /work/main && PYTHONPATH=. .venv/bin/python benchmarks/bench_server.py [--quick]

One run starts a durable embedded PostgreSQL 18 (unix socket), a server process (benchmarks/
_server.py: eight grpc.aio servers in one event loop) and, for the storm, two load processes
(benchmarks/_storm.py). This process is the client. Variants, all serving the same
BenchService.Charge (one INSERT in a transaction, same request and response):

  bare                    ``async with pool.acquire() as c, c.transaction(): await c.execute(...)``
                          on a default asyncpg pool: what a user writes without the library
  bare, no pool reset     the same, pool created with ``reset=<no-op coroutine>``
  bare + the library's SQL  no interceptor: the handler sends the keyed first execution's SQL
                          itself (the records' own cost, without the library's Python)
  bare + one record insert  no interceptor, no claim: the record inserted with the COMMIT (the
                          least any design keeping a durable record in the transaction pays)
  keyed, first execution  behind IdempotencyInterceptor, a fresh idempotency key per call
  keyed, replay           keys already completed: the stored response is replayed
  keyed, replay, no cache another replica's replay (``replay_cache=False``): reads the database
  gRPC floor              no interceptor, no database
  gRPC floor + marker     the same, sending ``idempotency-replayed: true`` as initial metadata
                          first, as every replay must (grpc.aio sends it in a batch of its own)

For each: sequential latency (p50/p99) and throughput with 64 calls in flight. The variants are
interleaved in rounds (the order rotates every round) so that machine noise hits all of them.
Then a storm: 200 concurrent duplicates of one key whose handler sleeps 300 ms in its
transaction (store pool max_size=10), back to back, while this process makes sequential
fresh-key calls; their latency is compared with quiet windows alternated with the storm windows.
A control storm with the same traffic shape (200 concurrent calls of ``Nap``, which sleeps 300 ms,
is not keyed and touches no database) on the same server runs in windows of its own: what 200
concurrent calls cost the other calls with no idempotency at all (the storm generator runs on
the same two cores). A second control storm (``NapMarked``) answers each call as a storm's
duplicates are answered, with the replay marker sent as initial metadata first (a gRPC batch of
its own): what the wire contract alone costs the other calls.

Ratios against "bare, no pool reset" (the strongest bare handler) are what to read: absolute
figures on a shared 2-core machine move. The default-pool "bare" stays as a row (its reset query
costs a round trip per call, which would flatter the library by about 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This process forks (pg_ctl, the server and storm processes) while gRPC threads may run; the
# children exec at once and never use gRPC, so gRPC's fork handlers (and their warning) are moot.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import _breakdown
import _common
import asyncpg
import grpc

from grpc_idempotency.testing import EmbeddedPostgres

HERE = Path(__file__).resolve().parent
CLK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    seq_rounds: int  # sequential: rounds x calls per variant per round
    seq_per_round: int
    tp_rounds: int  # concurrent: rounds x calls per variant per round, `inflight` in flight
    tp_per_round: int
    inflight: int
    warm_seq: int
    warm_tp: int
    storm_windows: int  # quiet windows and storm windows, alternated
    storm_window_s: float
    storm_dups: int
    slow_ms: float
    store_max_size: int
    rt_iterations: int  # the round-trip breakdown (direct asyncpg, no gRPC)


FULL = Config(
    seq_rounds=30,
    seq_per_round=100,
    tp_rounds=6,
    tp_per_round=1000,
    inflight=64,
    warm_seq=300,
    warm_tp=1500,
    storm_windows=3,
    storm_window_s=3.0,
    storm_dups=200,
    slow_ms=300,
    store_max_size=10,
    rt_iterations=1000,
)
QUICK = Config(
    seq_rounds=8,
    seq_per_round=60,
    tp_rounds=3,
    tp_per_round=500,
    inflight=64,
    warm_seq=100,
    warm_tp=600,
    storm_windows=2,
    storm_window_s=1.5,
    storm_dups=200,
    slow_ms=300,
    store_max_size=10,
    rt_iterations=300,
)

LABELS = {
    "bare_noreset": "bare, no pool reset",
    "bare": "bare (pool reset)",
    "library_sql": "bare + the library's SQL",
    "record_only": "bare + one record insert",
    "keyed_first": "keyed, first execution",
    "keyed_replay": "keyed, replay",
    "keyed_replay_db": "keyed, replay, no cache",
    "floor": "gRPC floor (no database)",
    "floor_marker": "floor + replay marker",
}
ORDER = list(LABELS)


# ----------------------------------------------------------------------------- CPU accounting


def _proc_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK


def _children(ppid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == ppid:
            pids.append(int(entry.name))
    return pids


def _all_cpu() -> dict[int, float]:
    cpu = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            cpu[int(entry.name)] = _proc_cpu(int(entry.name))
    return cpu


def _foreign(
    before: dict[int, float], after: dict[int, float], meter: CpuMeter, storm_pids: set[int]
) -> list[tuple[float, int, str]]:
    """Other processes' CPU seconds over the measured phases, largest first."""
    ours = {os.getpid(), meter.server_pid, *storm_pids}
    if meter.postmaster_pid is not None:
        ours |= {meter.postmaster_pid, *_children(meter.postmaster_pid)}
    used = [
        (cpu - before.get(pid, 0.0), pid, _common.cmdline(pid))
        for pid, cpu in after.items()
        if pid not in ours
    ]
    return sorted((u for u in used if u[0] > 0), reverse=True)


def _machine() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (parts + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK, steal / CLK


@dataclass
class CpuSample:
    client: float
    server: float
    postgres: float
    machine: float
    steal: float
    wall: float


class CpuMeter:
    def __init__(self, server_pid: int, postmaster_pid: int | None) -> None:
        self.server_pid = server_pid
        self.postmaster_pid = postmaster_pid

    def sample(self) -> CpuSample:
        pg = 0.0
        if self.postmaster_pid is not None:
            pg = sum(_proc_cpu(p) for p in [self.postmaster_pid, *_children(self.postmaster_pid)])
        busy, steal = _machine()
        return CpuSample(
            _proc_cpu(os.getpid()),
            _proc_cpu(self.server_pid),
            pg,
            busy,
            steal,
            time.perf_counter(),
        )


@dataclass
class CpuTotals:
    client: float = 0.0
    server: float = 0.0
    postgres: float = 0.0
    foreign: float = 0.0  # machine busy time not spent by our three processes
    steal: float = 0.0
    wall: float = 0.0

    def add(self, a: CpuSample, b: CpuSample) -> None:
        client, server, pg = b.client - a.client, b.server - a.server, b.postgres - a.postgres
        self.client += client
        self.server += server
        self.postgres += pg
        self.foreign += max(0.0, (b.machine - a.machine) - client - server - pg)
        self.steal += b.steal - a.steal
        self.wall += b.wall - a.wall


# ----------------------------------------------------------------------------- variants


@dataclass
class Variant:
    name: str
    call: Callable[..., Any]  # the stub's Charge
    make: Callable[[], tuple[Any, Any]]  # -> (request, metadata)
    seq: list[float] = field(default_factory=list)  # seconds, pooled over rounds
    seq_round_p50: list[float] = field(default_factory=list)
    tp_calls: int = 0
    tp_wall: float = 0.0
    tp_round_rate: list[float] = field(default_factory=list)
    tp_lat: list[float] = field(default_factory=list)
    tp_wal: float = 0.0  # WAL bytes written during the concurrent phases
    cpu: CpuTotals = field(default_factory=CpuTotals)  # sequential and concurrent phases
    tp_cpu: CpuTotals = field(default_factory=CpuTotals)  # concurrent phases only
    calls_made: int = 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def run_seq(v: Variant, n: int, out: list[float] | None) -> None:
    call = v.call
    for _ in range(n):
        request, metadata = v.make()
        began = time.perf_counter()
        await call(request, metadata=metadata, timeout=30)
        elapsed = time.perf_counter() - began
        if out is not None:
            out.append(elapsed)
    v.calls_made += n


async def run_tp(v: Variant, n: int, inflight: int) -> tuple[float, list[float]]:
    """Runs n calls with `inflight` in flight; returns (wall seconds, latencies)."""
    work = iter([v.make() for _ in range(n)])
    call = v.call
    lat: list[float] = []

    async def worker() -> None:
        for request, metadata in work:
            began = time.perf_counter()
            await call(request, metadata=metadata, timeout=30)
            lat.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    wall = time.perf_counter() - began
    v.calls_made += n
    return wall, lat


# ----------------------------------------------------------------------------- processes


async def _read_json(stream: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    while True:
        line = await asyncio.wait_for(stream.readline(), timeout)
        if not line:
            raise RuntimeError("child process exited early (see its stderr above)")
        with contextlib.suppress(json.JSONDecodeError):
            return dict(json.loads(line))


async def _spawn(script: str, *args: str) -> asyncio.subprocess.Process:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")) if p
    )
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / script),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.terminate()
        await proc.wait()


def _source_revision() -> str:
    """The commit the library was measured at, and whether src/ had uncommitted changes."""
    repo = HERE.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return head + (" + uncommitted changes in src/" if dirty else "")


# ----------------------------------------------------------------------------- the run


class Bench:
    def __init__(self, cfg: Config, args: argparse.Namespace) -> None:
        self.cfg = cfg
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self.counter = 0
        self.replay_keys: list[str] = []
        self.replay_next = 0
        self.info: dict[str, Any] = {}

    # requests ----------------------------------------------------------------
    def _next(self) -> int:
        self.counter += 1
        return self.counter

    def bare_request(self) -> tuple[Any, Any]:
        return self.pb2.ChargeRequest(
            order_id=f"{self.run_id}-b-{self._next()}", amount_cents=1234, currency="EUR"
        ), None

    def keyed_request(self, key: str) -> tuple[Any, Any]:
        # The request is a function of the key, so a replay sends the same fingerprint.
        request = self.pb2.ChargeRequest(order_id=key, amount_cents=1234, currency="EUR")
        return request, (("idempotency-key", key),)

    def fresh_keyed(self) -> tuple[Any, Any]:
        key = f"{self.run_id}-k-{self._next()}"
        self.replay_keys.append(key)
        return self.keyed_request(key)

    def replayed_keyed(self) -> tuple[Any, Any]:
        # Cycle through completed keys (thousands): calls in flight together use distinct keys.
        key = self.replay_keys[self.replay_next % self.replay_pool]
        self.replay_next += 1
        return self.keyed_request(key)

    # main --------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.cfg
        started = time.perf_counter()
        gen = Path(tempfile.mkdtemp(prefix="bench-gen-"))
        pg = EmbeddedPostgres()  # durable defaults (fsync on), unix socket only
        server = storm = control = marked = None
        try:
            _common.generate(gen)
            self.pb2, pb2_grpc = _common.load(gen)
            dsn = pg.start()
            conn = await asyncpg.connect(dsn)
            try:
                await conn.execute(_common.SCHEMA_SQL)
                self.info["pg_version"] = await conn.fetchval("SHOW server_version")
                self.info["fsync"] = await conn.fetchval("SHOW fsync")
                self.info["synchronous_commit"] = await conn.fetchval("SHOW synchronous_commit")
                data_directory = await conn.fetchval("SHOW data_directory")
            finally:
                await conn.close()

            server_args = ["--dsn", dsn, "--gen", str(gen), "--slow-ms", str(cfg.slow_ms)]
            server_args += ["--store-max-size", str(cfg.store_max_size)]
            if self.args.herd:
                server_args += ["--herd", self.args.herd]
            if self.args.profile:
                server_args += ["--profile-out", str(gen / "server.prof")]
            self.mon = await asyncpg.connect(dsn)  # WAL positions and statistics
            server = await _spawn("_server.py", *server_args)
            assert server.stdout is not None
            ports = (await _read_json(server.stdout, 60))["ports"]
            self.server = server
            self.meter = CpuMeter(server.pid, _common.postmaster_pid(data_directory))
            if self.meter.postmaster_pid is None:
                print("(cannot read postmaster.pid: PostgreSQL CPU not accounted)")
            # Started before this process opens channels (no fork while gRPC threads run).
            storm = await _spawn(
                "_storm.py",
                "--port",
                str(ports["keyed"]),
                "--gen",
                str(gen),
                "--dups",
                str(cfg.storm_dups),
                "--run-id",
                self.run_id,
            )
            control = await _spawn(
                "_storm.py",
                "--port",
                str(ports["keyed"]),
                "--method",
                "Nap",
                "--gen",
                str(gen),
                "--dups",
                str(cfg.storm_dups),
                "--run-id",
                f"{self.run_id}-control",
            )
            marked = await _spawn(
                "_storm.py",
                "--port",
                str(ports["keyed"]),
                "--method",
                "NapMarked",
                "--gen",
                str(gen),
                "--dups",
                str(cfg.storm_dups),
                "--run-id",
                f"{self.run_id}-marked",
            )
            for generator in (storm, control, marked):
                assert generator.stdout is not None
                await _read_json(generator.stdout, 60)

            channels = {
                name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, port in ports.items()
            }
            for channel in channels.values():
                await asyncio.wait_for(channel.channel_ready(), 30)
            stubs = {name: pb2_grpc.BenchServiceStub(ch) for name, ch in channels.items()}
            self.keyed_stub = stubs["keyed"]
            variants = {
                "bare": Variant("bare", stubs["bare"].Charge, self.bare_request),
                "bare_noreset": Variant(
                    "bare_noreset", stubs["bare_noreset"].Charge, self.bare_request
                ),
                "library_sql": Variant(
                    "library_sql", stubs["library_sql"].Charge, self.bare_request
                ),
                "record_only": Variant(
                    "record_only", stubs["record_only"].Charge, self.bare_request
                ),
                "keyed_first": Variant("keyed_first", stubs["keyed"].Charge, self.fresh_keyed),
                "keyed_replay": Variant("keyed_replay", stubs["keyed"].Charge, self.replayed_keyed),
                "keyed_replay_db": Variant(
                    "keyed_replay_db", stubs["keyed_nocache"].Charge, self.replayed_keyed
                ),
                "floor": Variant("floor", stubs["floor"].Charge, self.bare_request),
                "floor_marker": Variant(
                    "floor_marker", stubs["floor_marker"].Charge, self.bare_request
                ),
            }
            self.variants = variants

            print(
                f"warming up ({cfg.warm_seq} sequential + {cfg.warm_tp} concurrent calls per"
                " variant)...",
                flush=True,
            )
            for name in ("bare", "bare_noreset", "keyed_first", "floor"):
                await run_seq(variants[name], cfg.warm_seq, None)
                await run_tp(variants[name], cfg.warm_tp, cfg.inflight)
            self.replay_pool = len(self.replay_keys)
            await self.check_replay()
            for name in ("keyed_replay", "keyed_replay_db"):
                await run_seq(variants[name], cfg.warm_seq, None)
                await run_tp(variants[name], cfg.warm_tp, cfg.inflight)

            if self.args.profile:
                await self.profile(server, gen)
                return 0

            before = _all_cpu()
            # Sequential: many short rounds, the order rotating every round.
            print(
                f"sequential: {cfg.seq_rounds} rounds x {cfg.seq_per_round} calls per variant",
                flush=True,
            )
            for r in range(cfg.seq_rounds):
                order = ORDER[r % len(ORDER) :] + ORDER[: r % len(ORDER)]
                if r % 2:
                    order.reverse()
                for name in order:
                    v = variants[name]
                    samples: list[float] = []
                    a = self.meter.sample()
                    await run_seq(v, cfg.seq_per_round, samples)
                    v.cpu.add(a, self.meter.sample())
                    v.seq += samples
                    v.seq_round_p50.append(pct(samples, 0.5))
            print(
                f"concurrent: {cfg.tp_rounds} rounds x {cfg.tp_per_round} calls per variant,"
                f" {cfg.inflight} in flight",
                flush=True,
            )
            for r in range(cfg.tp_rounds):
                order = ORDER[r % len(ORDER) :] + ORDER[: r % len(ORDER)]
                if r % 2:
                    order.reverse()
                for name in order:
                    v = variants[name]
                    lsn = await self.mon.fetchval("SELECT pg_current_wal_lsn()")
                    a = self.meter.sample()
                    wall, lat = await run_tp(v, cfg.tp_per_round, cfg.inflight)
                    b = self.meter.sample()
                    v.tp_wal += float(
                        await self.mon.fetchval(
                            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1)", lsn
                        )
                    )
                    v.cpu.add(a, b)
                    v.tp_cpu.add(a, b)
                    v.tp_calls += cfg.tp_per_round
                    v.tp_wall += wall
                    v.tp_round_rate.append(cfg.tp_per_round / wall)
                    v.tp_lat += lat
            generators = {storm.pid, control.pid, marked.pid}
            self.foreign = _foreign(before, _all_cpu(), self.meter, generators)

            print(f"round trips: {cfg.rt_iterations} iterations, direct asyncpg", flush=True)
            self.rt = await _breakdown.breakdown(dsn, cfg.rt_iterations)

            storm_result = await self.storm(storm, control, marked)

            checks = await self.verify(dsn, storm_result)
            await self.mon.close()
            for channel in channels.values():
                await channel.close()
            self.report(storm_result, checks, time.perf_counter() - started)
            return 0
        finally:
            for generator in (storm, control, marked):
                if generator is not None:
                    await _stop(generator)
            if server is not None:
                await _stop(server)
            pg.close()
            shutil.rmtree(gen, ignore_errors=True)

    async def check_replay(self) -> None:
        """A replay must carry ``idempotency-replayed: true`` and the original response."""
        key = self.replay_keys[0]
        request, metadata = self.keyed_request(key)
        first = await self.keyed_stub.Charge(request, metadata=metadata)
        call = self.keyed_stub.Charge(request, metadata=metadata)
        again = await call
        initial = dict(await call.initial_metadata())
        if initial.get("idempotency-replayed") != "true" or again != first:
            raise SystemExit(f"replay check failed: metadata {initial}, {first} vs {again}")

    # storm -------------------------------------------------------------------
    async def storm(
        self,
        storm: asyncio.subprocess.Process,
        control: asyncio.subprocess.Process,
        marked: asyncio.subprocess.Process,
    ) -> dict[str, Any]:
        cfg = self.cfg
        quiet: list[float] = []
        during: list[float] = []
        during_control: list[float] = []
        during_marked: list[float] = []
        storms: list[dict[str, Any]] = []
        v = Variant("probe", self.keyed_stub.Charge, self.fresh_keyed)
        print(
            f"storm: {cfg.storm_windows} quiet, {cfg.storm_windows} storm and"
            f" 2 x {cfg.storm_windows} control windows of {cfg.storm_window_s:g} s,"
            f" {cfg.storm_dups} duplicates per key, handler sleeps {cfg.slow_ms:g} ms,"
            f" store pool max_size={cfg.store_max_size}",
            flush=True,
        )

        async def window(generator: asyncio.subprocess.Process, into: list[float]) -> Any:
            assert generator.stdin is not None and generator.stdout is not None
            generator.stdin.write(f"go {cfg.storm_window_s}\n".encode())
            await generator.stdin.drain()
            result = asyncio.ensure_future(_read_json(generator.stdout, cfg.storm_window_s + 60))
            await asyncio.sleep(0.005)  # let the first storm's calls leave
            while not result.done():
                await run_seq(v, 1, into)
            return result.result()

        for i in range(cfg.storm_windows):
            deadline = time.perf_counter() + cfg.storm_window_s
            while time.perf_counter() < deadline:
                await run_seq(v, 1, quiet)
            # The three kinds of storm take turns going first.
            kinds = [(storm, during), (control, during_control), (marked, during_marked)]
            for generator, into in kinds[i % 3 :] + kinds[: i % 3]:
                result = await window(generator, into)
                if generator is storm:
                    storms.append(result)
        return {
            "quiet": quiet,
            "during": during,
            "during_control": during_control,
            "during_marked": during_marked,
            "storms": storms,
            "probe_calls": v.calls_made,
        }

    # checks ------------------------------------------------------------------
    async def verify(self, dsn: str, storm: dict[str, Any]) -> dict[str, Any]:
        """Exactly once: one row per fresh-key call, none for replays, one per storm key."""
        keyed_calls = self.variants["keyed_first"].calls_made + storm["probe_calls"]
        storm_keys = [k for s in storm["storms"] for k in s["keys"]]
        conn = await asyncpg.connect(dsn)
        try:
            keyed_rows = await conn.fetchval(
                "SELECT count(*) FROM bench.charges WHERE variant = 'keyed'"
            )
            slow = await conn.fetch(
                "SELECT order_id, count(*) AS n FROM bench.charges WHERE variant = 'slow'"
                " GROUP BY order_id"
            )
            await asyncio.sleep(1.2)  # backends report table statistics at most once a second
            stats = await conn.fetchrow(
                "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                " WHERE schemaname = 'grpc_idempotency' AND relname = 'records'"
            )
        finally:
            await conn.close()
        per_key = {r["order_id"]: r["n"] for r in slow}
        return {
            "keyed_calls": keyed_calls,
            "keyed_rows": keyed_rows,
            "storm_keys": len(storm_keys),
            "storm_keys_run_once": sum(1 for k in storm_keys if per_key.get(k) == 1),
            "records": dict(stats) if stats is not None else {},
        }

    # profile -----------------------------------------------------------------
    async def profile(self, server: asyncio.subprocess.Process, gen: Path) -> None:
        """Where the server's CPU goes, per variant: py-spy (sampling, on-CPU samples only) when
        ``--py-spy`` names its binary, else cProfile of the loop thread."""
        assert server.stdout is not None
        n = self.args.profile_calls
        for name in ("bare", "keyed_first", "keyed_replay"):
            v = self.variants[name]
            if self.args.py_spy:
                out = gen / f"{name}.txt"
                spy = await asyncio.create_subprocess_exec(
                    self.args.py_spy,
                    "record",
                    "-p",
                    str(server.pid),
                    "-r",
                    "500",
                    # --native needs to pause the process while it samples
                    *([] if "--native" in self.args.py_spy_opt else ["--nonblocking"]),
                    "-f",
                    "raw",
                    "-o",
                    str(out),
                    *self.args.py_spy_opt,
                    stdout=asyncio.subprocess.DEVNULL,
                )
                await asyncio.sleep(1.0)  # attached
                a = self.meter.sample()
                wall, _ = await run_tp(v, n, self.cfg.inflight)
                b = self.meter.sample()
                spy.send_signal(signal.SIGINT)
                await spy.wait()
                if self.args.profile_keep:
                    shutil.copy(out, Path(self.args.profile_keep) / f"server-{name}.txt")
                _print_spy(LABELS[name], out, n, wall, b.server - a.server, self.args.profile_top)
                continue
            server.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.2)
            began = time.perf_counter()
            await run_seq(v, n, None)
            wall = time.perf_counter() - began
            server.send_signal(signal.SIGUSR2)
            index = (await _read_json(server.stdout, 30))["profile_dumped"]
            path = gen / f"server.prof.{index}"
            if self.args.profile_keep:
                shutil.copy(path, Path(self.args.profile_keep) / f"server-{name}.prof")
            _print_cprofile(LABELS[name], path, n, wall, self.args.profile_top)

    # report ------------------------------------------------------------------
    def report(self, storm: dict[str, Any], checks: dict[str, Any], elapsed: float) -> None:
        cfg = self.cfg
        v = self.variants
        # The baseline is the strongest bare handler: a pool without the reset round trip.
        # Against the default pool (its reset query costs a round trip per call) the library
        # would look about 10% better than it is; that variant stays as a row.
        bare = v["bare_noreset"]
        bare_p50 = pct(bare.seq, 0.5)
        bare_rate = bare.tp_calls / bare.tp_wall

        print()
        print(
            f"grpc-idempotency server benchmark ({'quick' if self.args.quick else 'full'}):"
            f" {os.cpu_count()} CPUs, Python {platform.python_version()},"
            f" grpcio {grpc.__version__}, asyncpg {asyncpg.__version__},"
            f" PostgreSQL {self.info['pg_version']} (embedded, unix socket,"
            f" fsync={self.info['fsync']},"
            f" synchronous_commit={self.info['synchronous_commit']}); library at"
            f" {_source_revision()}"
        )
        print(
            f"per variant: {cfg.seq_rounds} x {cfg.seq_per_round} sequential calls and"
            f" {cfg.tp_rounds} x {cfg.tp_per_round} calls at {cfg.inflight} in flight, in"
            " interleaved rounds; client and server in separate processes"
        )
        print()
        head = (
            f"{'variant':<24} {'seq p50':>8} {'seq p99':>8} {'p50 x':>6} {'calls/s':>8}"
            f" {'tput x':>6} {'p50@64':>8} {'server':>8} {'postgres':>9} {'client':>8}"
            f" {'WAL':>7}"
        )
        print(head)
        print(
            f"{'':<24} {'ms':>8} {'ms':>8} {'bare':>6} {'@64':>8} {'bare':>6} {'ms':>8}"
            f" {'CPU us/call':>27} {'B/call':>7}"
        )
        print("-" * len(head))
        for name in ORDER:
            x = v[name]
            p50, p99 = pct(x.seq, 0.5), pct(x.seq, 0.99)
            rate = x.tp_calls / x.tp_wall
            tc = x.tp_cpu
            print(
                f"{LABELS[name]:<24} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {p50 / bare_p50:6.2f}"
                f" {rate:8.0f} {rate / bare_rate:6.2f} {pct(x.tp_lat, 0.5) * 1e3:8.2f}"
                f" {tc.server / x.tp_calls * 1e6:8.0f} {tc.postgres / x.tp_calls * 1e6:9.0f}"
                f" {tc.client / x.tp_calls * 1e6:8.0f} {x.tp_wal / x.tp_calls:7.0f}"
            )
        print(
            "(p50@64: latency with 64 in flight; CPU and WAL per call: over the 64-in-flight"
            " runs, CPU at 10 ms tick resolution)"
        )

        print("\nnoise: per-round figures (the order of the variants rotates every round)")
        for name in ORDER:
            x = v[name]
            p50s = x.seq_round_p50
            rates = " ".join(f"{r:5.0f}" for r in x.tp_round_rate)
            print(
                f"  {LABELS[name]:<24} seq p50 ms median {statistics.median(p50s) * 1e3:5.2f}"
                f" [{min(p50s) * 1e3:5.2f}-{max(p50s) * 1e3:5.2f}]   calls/s: {rates}"
            )
        paired = {
            name: [a / b for a, b in zip(v[name].seq_round_p50, bare.seq_round_p50, strict=True)]
            for name in ORDER[1:]
        }
        paired_tp = {
            name: [a / b for a, b in zip(v[name].tp_round_rate, bare.tp_round_rate, strict=True)]
            for name in ORDER[1:]
        }
        for name in ORDER[1:]:
            pr, pt = paired[name], paired_tp[name]
            print(
                f"  {LABELS[name]:<24} per-round ratio to bare: p50 median"
                f" {statistics.median(pr):.2f} [{min(pr):.2f}-{max(pr):.2f}],"
                f" calls/s median {statistics.median(pt):.2f} [{min(pt):.2f}-{max(pt):.2f}]"
            )
        cpu = CpuTotals()
        for x in v.values():
            for attr in ("client", "server", "postgres", "foreign", "steal", "wall"):
                setattr(cpu, attr, getattr(cpu, attr) + getattr(x.cpu, attr))
        foreign_pct = cpu.foreign / cpu.wall * 100
        spread = max(
            (pct(x.seq_round_p50, 0.75) - pct(x.seq_round_p50, 0.25))
            / statistics.median(x.seq_round_p50)
            for x in v.values()
        )
        noisy = foreign_pct > 10 or spread > 0.15 or cpu.steal / cpu.wall > 0.02
        print(
            f"  CPU not ours during the measured phases: {foreign_pct:.0f}% of one core"
            f" (steal {cpu.steal / cpu.wall * 100:.1f}%); largest per-round p50 IQR/median"
            f" {spread * 100:.0f}% -> {'NOISY: compare ratios, rerun' if noisy else 'quiet'}"
        )
        for used, pid, cmd in self.foreign[:3]:
            if used / cpu.wall >= 0.05:
                print(f"    other process {pid}: {used / cpu.wall * 100:.0f}% of a core: {cmd}")

        first = pct(v["keyed_first"].seq, 0.5) / bare_p50
        replay = pct(v["keyed_replay"].seq, 0.5) / bare_p50
        first_tp = v["keyed_first"].tp_calls / v["keyed_first"].tp_wall / bare_rate
        replay_tp = v["keyed_replay"].tp_calls / v["keyed_replay"].tp_wall / bare_rate
        reset = v["bare"]
        reset_first = pct(v["keyed_first"].seq, 0.5) / pct(reset.seq, 0.5)
        print("\ntargets (pooled samples; bare = no pool reset)")

        def target(label: str, value: float, goal: float, *, at_most: bool) -> None:
            met = value <= goal if at_most else value >= goal
            sign = "<=" if at_most else ">="
            print(
                f"  {label:<32} = {value:.2f}x  (target {sign} {goal:.2f}x): "
                f"{'MET' if met else 'MISSED'}"
            )

        target("first execution p50 / bare p50", first, 1.15, at_most=True)
        target("first execution calls/s / bare", first_tp, 0.85, at_most=False)
        target("replay p50 / bare p50", replay, 0.50, at_most=True)
        print(f"  {'replay calls/s / bare':<32} = {replay_tp:.2f}x")
        floor = pct(v["floor"].seq, 0.5)
        replay_db = pct(v["keyed_replay_db"].seq, 0.5)
        cached = pct(v["keyed_replay"].seq, 0.5)
        print(
            f"  {'replay p50 / gRPC floor p50':<32} = {cached / floor:.2f}x"
            f"  (no cache: {replay_db / floor:.2f}x; no cache / bare: {replay_db / bare_p50:.2f}x)"
        )
        marker = pct(v["floor_marker"].seq, 0.5)
        print(
            f"  {'replay-marker floor p50 / bare':<32} = {marker / bare_p50:.2f}x"
            f"  (a replay's floor under the wire contract; replay / it: {cached / marker:.2f}x)"
        )
        print(
            f"  {'first execution p50 / bare (reset)':<32} = {reset_first:.2f}x  (the old baseline)"
        )
        sql = v["library_sql"]
        sql_tp = sql.tp_calls / sql.tp_wall / bare_rate
        print(
            f"  {'bare + the library SQL / bare':<32} = p50 {pct(sql.seq, 0.5) / bare_p50:.2f}x,"
            f" calls/s {sql_tp:.2f}x  (the records' own cost: the ceiling of a first execution)"
        )
        rec = v["record_only"]
        rec_tp = rec.tp_calls / rec.tp_wall / bare_rate
        print(
            f"  {'bare + one record insert / bare':<32} = p50 {pct(rec.seq, 0.5) / bare_p50:.2f}x,"
            f" calls/s {rec_tp:.2f}x  (no claim: the floor of any durable record)"
        )

        print(
            f"\nround trips, one by one ({cfg.rt_iterations} timed + {cfg.rt_iterations}"
            " CPU-measured iterations per path; direct asyncpg on the unix socket, no gRPC)"
        )
        print(f"  {'':<44} {'wall p50':>9} {'PostgreSQL CPU':>15} {'asyncpg CPU':>12}")
        print(f"  {'':<44} {'ms':>9} {'us, mean':>15} {'us, mean':>12}")
        for path, steps in (
            ("bare", _breakdown.BARE_STEPS),
            ("keyed first execution", _breakdown.KEYED_STEPS),
        ):
            samples = self.rt["bare" if path == "bare" else "keyed"]
            pg_total = client_total = 0.0
            for step in steps:
                entry = samples[step]
                pg = statistics.fmean(entry["pg_cpu"]) if entry["pg_cpu"] else float("nan")
                client = statistics.fmean(entry["client_cpu"])
                pg_total += pg
                client_total += client
                print(
                    f"  {path + ': ' + step:<44} {pct(entry['wall'], 0.5) * 1e3:9.3f}"
                    f" {pg * 1e6:15.0f} {client * 1e6:12.0f}"
                )
            print(
                f"  {path + ': all':<44} {pct(samples['total']['wall'], 0.5) * 1e3:9.3f}"
                f" {pg_total * 1e6:15.0f} {client_total * 1e6:12.0f}"
            )
        records = checks["records"]
        if records:
            upd = records["n_tup_upd"] or 0
            hot = records["n_tup_hot_upd"] or 0
            print(
                f"  records table: {records['n_tup_ins']} inserts, {upd} updates of which"
                f" {hot} HOT ({hot / max(upd, 1) * 100:.0f}%)"
            )

        quiet, during = storm["quiet"], storm["during"]
        walls = [w for s in storm["storms"] for w in s["walls"]]
        codes: dict[str, int] = {}
        for s in storm["storms"]:
            for code, n in s["codes"].items():
                codes[code] = codes.get(code, 0) + n
        print(
            f"\nstorm: {len(walls)} storms x {cfg.storm_dups} concurrent duplicates of one key"
            f" (handler sleeps {cfg.slow_ms:g} ms in its transaction), store pool max_size="
            f"{cfg.store_max_size}, herd release {self.args.herd or 'default (8 per 2 ms)'};"
            f" each storm took p50 {pct(walls, 0.5) * 1e3:.0f} ms,"
            f" max {max(walls) * 1e3:.0f} ms; answers: {codes}"
        )
        print(f"  {'fresh-key keyed calls, sequential':<36} {'p50 ms':>7} {'p99 ms':>7} {'n':>6}")
        print(
            f"  {'without storm':<36} {pct(quiet, 0.5) * 1e3:7.2f} {pct(quiet, 0.99) * 1e3:7.2f}"
            f" {len(quiet):6d}"
        )
        print(
            f"  {'during storm':<36} {pct(during, 0.5) * 1e3:7.2f}"
            f" {pct(during, 0.99) * 1e3:7.2f} {len(during):6d}"
        )
        control = storm["during_control"]
        print(
            f"  {'during control storm (not keyed)':<36} {pct(control, 0.5) * 1e3:7.2f}"
            f" {pct(control, 0.99) * 1e3:7.2f} {len(control):6d}"
        )
        marked = storm["during_marked"]
        print(
            f"  {'during control storm + replay marker':<36} {pct(marked, 0.5) * 1e3:7.2f}"
            f" {pct(marked, 0.99) * 1e3:7.2f} {len(marked):6d}"
        )
        p99_ratio = pct(during, 0.99) / pct(quiet, 0.99)
        control_ratio = pct(control, 0.99) / pct(quiet, 0.99)
        print(
            f"  other keys' p99 during / without storm = {p99_ratio:.2f}x  (target <= 2.00x):"
            f" {'MET' if p99_ratio <= 2 else 'MISSED'}"
        )
        print(
            f"  the same traffic with no idempotency (control storm) = {control_ratio:.2f}x;"
            f" storm / control p99 = {pct(during, 0.99) / pct(control, 0.99):.2f}x"
        )
        print(
            f"  the same, every answer carrying the replay marker (as the storm's do)"
            f" = {pct(marked, 0.99) / pct(quiet, 0.99):.2f}x;"
            f" storm / it p99 = {pct(during, 0.99) / pct(marked, 0.99):.2f}x"
        )
        exact = checks["keyed_rows"] == checks["keyed_calls"]
        print(
            f"\nexactly once: {checks['keyed_rows']} rows for {checks['keyed_calls']} fresh-key"
            f" calls (replays wrote none): {'OK' if exact else 'WRONG'};"
            f" storm keys whose handler ran exactly once: {checks['storm_keys_run_once']}/"
            f"{checks['storm_keys']}"
        )
        print(f"total run time {elapsed:.0f} s")


def _print_cprofile(label: str, path: Path, calls: int, wall: float, top: int) -> None:
    """cProfile of the server's loop thread: self time and function calls per gRPC call, by area
    (the time blocked in epoll is left out), then the top functions."""
    stats = pstats.Stats(str(path))
    raw: Any = stats.stats  # type: ignore[attr-defined]
    by_area: dict[str, list[float]] = {}
    for (filename, _line, func), (_cc, ncalls, tottime, _ct, _callers) in raw.items():
        if func == "<method 'poll' of 'select.epoll' objects>":
            continue
        kind = _area([f"{func} ({filename})"])
        if kind.startswith("other"):
            kind = "other: " + ("builtins/C" if filename == "~" else Path(filename).name)
        acc = by_area.setdefault(kind, [0.0, 0.0])
        acc[0] += tottime
        acc[1] += ncalls
    busy = sum(t for t, _n in by_area.values())
    ncalls_total = sum(n for _t, n in by_area.values())
    print(
        f"\n=== server cProfile, {label}: {calls} sequential calls,"
        f" {wall / calls * 1e3:.2f} ms/call under the profiler;"
        f" loop thread busy {busy / calls * 1e6:.0f} us/call,"
        f" {ncalls_total / calls:.0f} Python-visible function calls/call ==="
    )
    print(f"  {'area (self time, profiler overhead included)':<46} {'us/call':>8} {'calls':>10}")
    for kind, (t, nc) in sorted(by_area.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {kind:<46} {t / calls * 1e6:8.1f} {nc / calls:10.1f}")
    print("  top functions by self time:")
    rows = sorted(raw.items(), key=lambda kv: -kv[1][2])
    for (filename, line, func), (_cc, ncalls, tottime, _cum, _c) in rows[:top]:
        if func == "<method 'poll' of 'select.epoll' objects>":
            continue
        where = _frame(f"{func} ({filename}:{line})")
        print(f"    {tottime / calls * 1e6:7.1f} us  {ncalls / calls:6.1f}x  {where}")


def _print_spy(label: str, path: Path, calls: int, wall: float, cpu: float, top: int) -> None:
    """Summarises py-spy's raw (collapsed) output: leaf functions and inclusive time by area."""
    leaf: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    area: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        total += count
        frames = [_frame(f) for f in stack.split(";")[1:] if f.strip()]  # [0] is the thread
        if not frames:
            continue
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + count
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + count
        kind = _area(frames)
        area[kind] = area.get(kind, 0) + count
    print(
        f"\n=== server py-spy, {label}: {calls} calls at 64 in flight, {calls / wall:.0f} calls/s;"
        f" server process CPU {cpu / calls * 1e6:.0f} us/call; {total} on-CPU samples ==="
    )
    print("  on-CPU samples by where the leaf frame is:")
    for kind, count in sorted(area.items(), key=lambda kv: -kv[1]):
        print(f"    {count / total * 100:5.1f}%  {kind}")
    print("  top leaf functions (self):")
    for fn, count in sorted(leaf.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {count / total * 100:5.1f}%  {fn}")
    print("  library functions, inclusive:")
    for fn, count in sorted(inclusive.items(), key=lambda kv: -kv[1]):
        if "grpc_idempotency" in fn or "benchmarks" in fn:
            print(f"    {count / total * 100:5.1f}%  {fn}")


def _frame(frame: str) -> str:
    """Shortens "func (path/to/file.py:123)" to "func (file.py)"."""
    func, _, where = frame.strip().partition(" (")
    where = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    for marker in ("site-packages/", "src/", "python3.11/", "/work/main/"):
        if marker in where:
            where = where.split(marker, 1)[1]
            break
    return f"{func} ({where})"


def _area(frames: list[str]) -> str:
    last = frames[-1]
    if "grpc_idempotency/" in last:
        return "grpc_idempotency (library Python)"
    if "benchmarks/" in last or "_server.py" in last:
        return "the benchmark's handler"
    if "asyncpg/" in last:
        return "asyncpg"
    if "grpc/" in last:
        return "grpc (aio Cython/Python)"
    if "asyncio/" in last or "selectors" in last or "_asyncio" in last:
        return "asyncio event loop"
    if "opentelemetry/" in last:
        return "opentelemetry"
    return "other: " + last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--herd",
        default=None,
        help="the keyed servers' HerdRelease: PER_BATCH,INTERVAL_MS (e.g. 8,2), or off",
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls (~40 s)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of the comparison: cProfile the server over sequential calls of"
        " bare, keyed first execution and keyed replay, and print the top functions",
    )
    parser.add_argument("--profile-calls", type=int, default=2000)
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--profile-keep", default=None, help="directory to copy profiles to")
    parser.add_argument(
        "--py-spy", default=None, metavar="BIN", help="with --profile: sample with this py-spy"
    )
    parser.add_argument(
        "--py-spy-opt", action="append", default=[], help="extra py-spy record option (--native)"
    )
    args = parser.parse_args()
    if args.profile_keep:
        Path(args.profile_keep).mkdir(parents=True, exist_ok=True)
    cfg = QUICK if args.quick or args.profile else FULL
    return asyncio.run(Bench(cfg, args).run())


if __name__ == "__main__":
    sys.exit(main())
