"""Shared by the benchmark's processes: the proto (compiled at run time) and the table."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
PROTO = HERE / "bench.proto"
SERVICE = "grpc_idempotency.bench.v1.BenchService"
CHARGE = f"{SERVICE}/Charge"
SLOW_CHARGE = f"{SERVICE}/SlowCharge"

SCHEMA_SQL = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE IF NOT EXISTS bench.charges (
    charge_id     text PRIMARY KEY,
    order_id      text NOT NULL,
    amount_cents  bigint NOT NULL,
    currency      text NOT NULL,
    variant       text NOT NULL
);
"""

INSERT_SQL = (
    "INSERT INTO bench.charges (charge_id, order_id, amount_cents, currency, variant)"
    " VALUES ($1, $2, $3, $4, $5)"
)


async def no_reset(_conn: Any) -> None:
    """A pool reset that does nothing (``asyncpg.create_pool(reset=no_reset)``)."""


async def charge(conn: Any, request: Any, variant: str, response_type: Any) -> Any:
    """The benchmark's business write, the same in every variant: one INSERT on ``conn``; returns
    the response."""
    charge_id = "ch_" + uuid.uuid4().hex[:16]
    await conn.execute(
        INSERT_SQL, charge_id, request.order_id, request.amount_cents, request.currency, variant
    )
    return response_type(
        charge_id=charge_id,
        order_id=request.order_id,
        amount_cents=request.amount_cents,
        currency=request.currency,
    )


def generate(out_dir: Path) -> None:
    """Compiles bench.proto into ``out_dir`` (``bench_pb2.py``, ``bench_pb2_grpc.py``)."""
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{HERE}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO),
    ]
    subprocess.run(cmd, check=True)


def load(gen_dir: Path) -> tuple[ModuleType, ModuleType]:
    if str(gen_dir) not in sys.path:
        sys.path.insert(0, str(gen_dir))
    return importlib.import_module("bench_pb2"), importlib.import_module("bench_pb2_grpc")


def postmaster_pid(data_directory: str) -> int | None:
    """The PID of the PostgreSQL server whose data directory this is (for CPU accounting)."""
    try:
        return int((Path(data_directory) / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cmdline(pid: int) -> str:
    """A process's command line, shortened, for the noise report."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:70] or "?"


def export(commit: str, prefix: str) -> tuple[str, Path]:
    """``src/`` at ``commit`` (its short name returned) in a new directory named ``prefix``...,
    with the benchmark's generated proto in its ``gen/``: the base version of a side-by-side
    run."""
    repo = HERE.parent
    base = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", commit],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", base, "src"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
    (work / "gen").mkdir()
    generate(work / "gen")
    return base, work


def interleaved_rounds(
    procs: dict[str, subprocess.Popen[str]], rounds: int
) -> dict[str, list[dict[str, float]]]:
    """Each child's results, one JSON line per "go" sent to it: the children take turns, in
    an order that alternates every round, so drift on a shared machine falls on both sides."""
    names = list(procs)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("go\n")
            p.stdin.flush()
            results[name].append(json.loads(p.stdout.readline()))
    return results


def source_rounds(
    script: str, child_args: list[str], base: str | None, rounds: int, prefix: str
) -> dict[str, list[dict[str, float]]]:
    """Runs ``script --child *child_args`` once on this checkout's ``src/`` and, with ``base``,
    once on that commit's, and collects ``rounds`` interleaved rounds of their JSON lines
    (``interleaved_rounds``), by label: "current", "base <commit>"."""
    sources = {"current": str(HERE.parent / "src")}
    if base:
        name, work = export(base, prefix)
        sources[f"base {name}"] = str(work / "src")
    procs = {
        label: subprocess.Popen(
            [sys.executable, script, "--child", *child_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": src},
        )
        for label, src in sources.items()
    }
    try:
        return interleaved_rounds(procs, rounds)
    finally:
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait()


def lines_request_type(package: str, *, exclude_seen_at: bool) -> Any:
    """``Req { repeated Line lines = 1; }``, ``Line { int64 amount = 1; int64 seen_at = 2;
    Meta meta = 3; }``, ``Meta { string trace = 1; }`` in ``package``, built at run time in the
    default pool; ``seen_at`` FINGERPRINT_EXCLUDE if ``exclude_seen_at``. The message class of
    ``Req``: many small messages in one request, as a client may send."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from grpc_idempotency.v1 import options_pb2

    field = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"{package}.proto", package=package, syntax="proto3"
    )
    fdp.dependency.append("grpc_idempotency/v1/options.proto")
    meta = fdp.message_type.add(name="Meta")
    meta.field.add(name="trace", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    line = fdp.message_type.add(name="Line")
    line.field.add(name="amount", number=1, type=field.TYPE_INT64, label=field.LABEL_OPTIONAL)
    seen_at = line.field.add(
        name="seen_at", number=2, type=field.TYPE_INT64, label=field.LABEL_OPTIONAL
    )
    if exclude_seen_at:
        extensions: Any = seen_at.options.Extensions
        extensions[options_pb2.field].fingerprint = options_pb2.FINGERPRINT_EXCLUDE
    line.field.add(
        name="meta", number=3, type=field.TYPE_MESSAGE, type_name=f".{package}.Meta",
        label=field.LABEL_OPTIONAL,
    )  # fmt: skip
    req = fdp.message_type.add(name="Req")
    req.field.add(
        name="lines", number=1, type=field.TYPE_MESSAGE, type_name=f".{package}.Line",
        label=field.LABEL_REPEATED,
    )  # fmt: skip
    pool = descriptor_pool.Default()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.Req"))


def best_of(work: Callable[[], object], repeat: int) -> float:
    """The least time ``work`` took in ``repeat`` runs (another process may take the core)."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best
