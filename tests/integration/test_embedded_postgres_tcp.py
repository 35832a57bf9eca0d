"""EmbeddedPostgres's TCP port (``tcp_port``) is not an open door to its superuser: 127.0.0.1 is
reachable by every local user of the machine (a shared CI runner, a dev box), and a superuser
runs programs as the server's account (``COPY ... TO PROGRAM``). Over TCP the server asks for
the cluster's own random password, which only ``tcp_dsn`` carries; a data dir initialised
without one (by an earlier version, with ``trust``) gets one on its first start with a port. The
unix socket, in a directory no other user may enter, needs none."""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from grpc_idempotency.testing import EmbeddedPostgres
from tests.support.pgbouncer import free_port
from tests.support.postgres_answers import answers

PASSWORD_FILE = "embedded-postgres.password"


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under the system temp dir, not pytest's tmp_path: as root, the server account must be
    # able to reach it, and pytest's base dir is private to its user.
    parent = Path(tempfile.mkdtemp(prefix="gi-embedded-tcp-"))
    parent.chmod(0o755)
    try:
        yield parent / "pgdata"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


async def _refused_without_password(port: int) -> None:
    # What any other local user can try: the superuser, no password.
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres?sslmode=disable"
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
        await asyncpg.connect(dsn, timeout=10)
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(dsn, password="guessed", timeout=10)


def _private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


async def test_tcp_asks_for_the_password_that_only_tcp_dsn_carries(data_dir: Path) -> None:
    port = free_port()
    with EmbeddedPostgres(data_dir, tcp_port=port, durable=False) as pg:
        await _refused_without_password(port)
        assert f"@127.0.0.1:{port}/" in pg.tcp_dsn
        assert await answers(pg.tcp_dsn)
        assert await answers(pg.dsn), "the unix socket needs no password"
        # Where the password is kept, and the socket's directory: no other user may read them.
        assert _private(data_dir / PASSWORD_FILE)
        assert _private(pg._socket_dir)
        assert pg._socket_dir.is_dir()
        # The cluster's own rules, for a server started by other means (pg_ctl: localhost).
        own = (data_dir / "pg_hba.conf").read_text().splitlines()
        hosts = [line.split() for line in own if line.startswith("host")]
        assert hosts, own
        assert all(fields[-1] == "scram-sha-256" for fields in hosts), hosts
        first = pg.tcp_dsn
        pg.stop()
        pg.start()
        assert pg.tcp_dsn == first, "stable across stop()/start(), like dsn"
        assert await answers(pg.tcp_dsn)
    # Another instance on the same cluster finds its password.
    with EmbeddedPostgres(data_dir, tcp_port=port, durable=False) as again:
        assert again.tcp_dsn == first
        await _refused_without_password(port)


async def _as_an_earlier_version_left_it(data_dir: Path, *statements: str) -> None:
    """A cluster initialised with trust: no password, no password file, TCP trusted; and
    ``statements`` run in it (its owner's own settings)."""
    with EmbeddedPostgres(data_dir, durable=False) as pg:
        conn = await asyncpg.connect(pg.dsn, timeout=10)
        try:
            for statement in ("ALTER ROLE postgres PASSWORD NULL", *statements):
                await conn.execute(statement)
        finally:
            await conn.close()
    (data_dir / PASSWORD_FILE).unlink()
    (data_dir / "pg_hba.conf").write_text(
        "local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n"
    )


async def test_a_cluster_initialised_with_trust_and_no_password_is_closed_on_reuse(
    data_dir: Path,
) -> None:
    """A data dir from an earlier version: pg_hba.conf trusts TCP, the superuser has no
    password and there is no password file."""
    await _as_an_earlier_version_left_it(data_dir)
    port = free_port()
    with EmbeddedPostgres(data_dir, tcp_port=port, durable=False) as reused:
        await _refused_without_password(port)
        assert await answers(reused.tcp_dsn)
        assert _private(data_dir / PASSWORD_FILE)


async def test_the_password_given_to_an_earlier_versions_cluster_is_not_in_its_log(
    data_dir: Path,
) -> None:
    """Its owner may log every statement (the server log ends up in start()'s and stop()'s
    errors, CI output) and may have kept md5 as password_encryption, which the scram-sha-256
    rule refuses: the server is sent only a SCRAM verifier, never the password."""
    await _as_an_earlier_version_left_it(
        data_dir,
        "ALTER SYSTEM SET log_statement = 'all'",
        "ALTER SYSTEM SET password_encryption = 'md5'",
    )
    with EmbeddedPostgres(data_dir, tcp_port=free_port(), durable=False) as reused:
        password = (data_dir / PASSWORD_FILE).read_text().strip()
        log = (data_dir / "embedded-postgres.log").read_text()
        assert "ALTER ROLE" in log, "the statement is logged, but not the password"
        assert password not in log
        assert await answers(reused.tcp_dsn)


def test_tcp_dsn_without_a_tcp_port_says_so() -> None:
    pg = EmbeddedPostgres(durable=False)
    try:
        with pytest.raises(RuntimeError, match="tcp_port"):
            pg.tcp_dsn  # noqa: B018
    finally:
        pg.close()
