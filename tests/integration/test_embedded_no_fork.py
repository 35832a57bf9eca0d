"""EmbeddedPostgres starts and stops reliably from a process whose grpc.aio server is busy.

Before, as root, the binaries were run with ``subprocess.run(user=...)``, which makes CPython
fork() the whole process (vfork/posix_spawn need no user/group switch); next to gRPC's threads
the forked pg_ctl died of SIGSEGV in 30-45% of the start/stop calls. Now the account switch is
setpriv's (or runuser's) and a stop signals the postmaster, so nothing forks this process; as
root the server still runs as the unprivileged account without supplementary groups (what the
reachability check of the data directory assumes).
"""

from __future__ import annotations

import asyncio
import os
import pwd
from pathlib import Path

import asyncpg
import grpc
import pytest

from grpc_idempotency.testing import EmbeddedPostgres

CYCLES = 20
# Two callers: with the forking code, pg_ctl (or initdb) died of SIGSEGV/SIGBUS within the 20
# cycles in 6 of 6 runs here (4 or 8 callers kept gRPC too busy to hit it as often).
CALLERS = 2


def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def test_start_and_stop_next_to_a_busy_grpc_aio_server_always_succeed() -> None:
    pg = EmbeddedPostgres(durable=False)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    done = asyncio.Event()
    calls = 0

    async def caller() -> None:
        nonlocal calls
        echo = channel.unary_unary(
            "/test.Echo/Echo", request_serializer=None, response_deserializer=None
        )
        while not done.is_set():
            assert await echo(b"x", timeout=10) == b"x"
            calls += 1

    callers = [asyncio.create_task(caller()) for _ in range(CALLERS)]
    try:
        await asyncio.to_thread(pg.start)
        for cycle in range(CYCLES):
            before = calls
            # In threads, as a test's fixtures do, while the callers keep gRPC's threads busy.
            # A pg_ctl that dies of a signal makes start() raise (stop() no longer runs one).
            await asyncio.to_thread(pg.stop)
            assert not pg.running, f"cycle {cycle}: stop() returned, the server runs on"
            await asyncio.to_thread(pg.start)
            assert pg.running, f"cycle {cycle}: start() returned, no server runs"
            assert calls > before or any(t.done() for t in callers), "no gRPC traffic ran"
        conn = await asyncpg.connect(pg.dsn, timeout=10)
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()
    finally:
        done.set()
        await asyncio.gather(*callers)  # re-raises a caller's failure
        await channel.close(None)
        await server.stop(None)
        await asyncio.to_thread(pg.close)
    assert not pg.running


def _status(pid: int) -> dict[str, list[str]]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.split() for k, _, v in (line.partition(":") for line in lines)}


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only: the server then runs unprivileged")
def test_as_root_the_server_runs_as_the_server_account_without_supplementary_groups() -> None:
    account = pwd.getpwnam("embedded_postgres")
    with EmbeddedPostgres(durable=False) as pg:
        pid = int((pg._data_dir / "postmaster.pid").read_text().splitlines()[0])
        status = _status(pid)
    # Real, effective, saved and filesystem ids: no way back to root from the server.
    assert status["Uid"] == [str(account.pw_uid)] * 4
    assert status["Gid"] == [str(account.pw_gid)] * 4
    assert status["Groups"] == [], "the server kept supplementary groups"
