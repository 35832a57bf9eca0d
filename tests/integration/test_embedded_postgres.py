"""EmbeddedPostgres stops only the server it started itself: another instance on the same data
directory (one that could not start, or was never started) closing, or being collected, leaves
the running server alone."""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from grpc_idempotency.testing import EmbeddedPostgres


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under the system temp dir, not pytest's tmp_path: as root, the server account must be
    # able to reach it, and pytest's base dir is private to its user.
    parent = Path(tempfile.mkdtemp(prefix="gi-embedded-test-"))
    parent.chmod(0o755)
    try:
        yield parent / "pgdata"
    finally:
        import shutil

        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def owner(data_dir: Path) -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(data_dir, durable=False) as pg:
        yield pg


async def _answers(pg: EmbeddedPostgres) -> bool:
    conn = await asyncpg.connect(pg.dsn, timeout=10)
    try:
        return bool(await conn.fetchval("SELECT true"))
    finally:
        await conn.close()


async def test_an_instance_that_failed_to_start_leaves_the_owners_server_running(
    owner: EmbeddedPostgres, data_dir: Path
) -> None:
    with (
        pytest.raises(RuntimeError, match="another PostgreSQL server"),
        EmbeddedPostgres(data_dir, durable=False),
    ):
        pass  # __enter__ fails, then closes the instance: that must not stop the owner's server
    assert owner.running
    assert await _answers(owner)


async def test_stop_close_and_collection_of_another_instance_leave_the_server_alone(
    owner: EmbeddedPostgres, data_dir: Path
) -> None:
    other = EmbeddedPostgres(data_dir, durable=False)
    assert not other.running, "the server on its data dir is not this instance's"
    other.stop()
    other.close()
    assert owner.running
    collected = EmbeddedPostgres(data_dir, durable=False)
    del collected
    gc.collect()  # runs its finalizer, as at interpreter exit
    assert owner.running
    assert await _answers(owner)


async def test_the_owner_still_stops_its_own_server(data_dir: Path) -> None:
    pg = EmbeddedPostgres(data_dir, durable=False)
    pg.start()
    pid = int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    assert pg.running
    pg.stop(mode="immediate")
    assert not pg.running
    pg.start()  # the same instance starts it again, behind the same DSN
    assert int((data_dir / "postmaster.pid").read_text().splitlines()[0]) != pid
    assert await _answers(pg)
    pg.close()
    assert not pg.running
