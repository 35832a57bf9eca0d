"""A DSN naming a certificate, key or CRL file that cannot be used: bad input, never an outage.

asyncpg opens ``sslrootcert``, ``sslcrl``, ``sslcert`` and ``sslkey`` while it reads the DSN,
before connecting anywhere, and lets the OS's or the ssl module's error escape (an ``OSError``
naming no file). Taken for a connection failure, the CLI exited 1 ("unreachable, retry later")
with "FileNotFoundError" and no file, and ``Store.connect`` raised the retryable
``StoreUnavailable``: a server's start-up loop retried a typo forever. Port 1 refuses
connections, so a DSN that got past its files would fail differently (and retryably).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import grpc
import pytest

from grpc_idempotency import DsnUnusable, Store, StoreMisconfigured, StoreUnavailable
from grpc_idempotency.store.errors import dsn_unusable
from tests.support.tools import run_cli

# A real bundle of root certificates, shipped inside grpcio: a usable sslrootcert.
ROOTS = Path(grpc.__file__).parent / "_cython" / "_credentials" / "roots.pem"
DSN = "postgresql://app@127.0.0.1:1/db?{query}"

# query (with {missing}, {dir}, {garbage}, {roots}), what the message names
CASES = {
    "sslrootcert missing": (
        "sslmode=verify-full&sslrootcert={missing}",
        "sslrootcert {missing}: No such file or directory",
    ),
    "sslrootcert a directory": (
        "sslmode=verify-full&sslrootcert={dir}",
        "sslrootcert {dir}: Is a directory",
    ),
    "sslrootcert not PEM": (
        "sslmode=verify-ca&sslrootcert={garbage}",
        "sslrootcert {garbage}: [X509: NO_CERTIFICATE_OR_CRL_FOUND]",
    ),
    "sslcrl missing": (
        "sslmode=verify-full&sslrootcert={roots}&sslcrl={missing}",
        "sslcrl {missing}: No such file or directory",
    ),
    # sslmode=require finds no ~/.postgresql/root.crt (HOME is empty) and goes on without one,
    # so the client certificate is the file that fails. (Under verify-full the missing root.crt
    # failed first, with asyncpg's own ClientConfigurationError: that case exited 2 already.)
    "sslcert missing": (
        "sslmode=require&sslcert={missing}&sslkey={missing}",
        "sslcert {missing}: No such file or directory",
    ),
    "sslcert not PEM": (
        "sslmode=require&sslcert={garbage}&sslkey={garbage}",
        "sslcert {garbage}: [SSL] PEM lib",
    ),
}


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    home = tmp_path / "home"  # no ~/.postgresql: asyncpg's defaults find nothing
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("PGSSLROOTCERT", "PGSSLCRL", "PGSSLCERT", "PGSSLKEY", "PGSSLMODE"):
        monkeypatch.delenv(name, raising=False)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    assert ROOTS.is_file()
    return {
        "missing": str(tmp_path / "nonexistent.pem"),
        "dir": str(tmp_path),
        "garbage": str(garbage),
        "roots": str(ROOTS),
    }


def dsn_of(case: str, files: dict[str, str]) -> tuple[str, str]:
    query, named = CASES[case]
    return DSN.format(query=query.format(**files)), named.format(**files)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    return run_cli(*args, env=env)


@pytest.mark.parametrize("case", CASES)
async def test_the_driver_refusing_a_file_is_a_dsn_it_cannot_use(
    case: str, files: dict[str, str]
) -> None:
    dsn, _ = dsn_of(case, files)
    with pytest.raises(OSError) as raised:
        await asyncpg.connect(dsn, timeout=5)
    assert dsn_unusable(raised.value)


async def test_a_connection_failure_is_still_not_the_dsns(files: dict[str, str]) -> None:
    # The same DSN with usable files gets as far as connecting: refused, retryable.
    with pytest.raises(OSError) as raised:
        await asyncpg.connect(DSN.format(query=f"sslmode=verify-full&sslrootcert={ROOTS}"))
    assert isinstance(raised.value, ConnectionRefusedError)
    assert not dsn_unusable(raised.value)


@pytest.mark.parametrize("case", CASES)
async def test_store_connect_refuses_it_as_not_retryable(case: str, files: dict[str, str]) -> None:
    dsn, named = dsn_of(case, files)
    with pytest.raises(StoreUnavailable) as refused:
        await Store.connect(dsn, check_schema=False)
    # It was StoreUnavailable itself ("while connecting (FileNotFoundError)"): retryable.
    assert isinstance(refused.value, DsnUnusable) and isinstance(refused.value, StoreMisconfigured)
    # Naming the file, as the CLI does (it was the generic "cannot be parsed" message).
    assert str(refused.value).startswith("cannot use the DSN: ") and named in str(refused.value)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "command", [["purge"], ["list", "--scope", "s"], ["inspect", "--scope", "s", "k"]]
)
def test_the_cli_names_the_file_and_exits_2(
    case: str, command: list[str], files: dict[str, str]
) -> None:
    dsn, named = dsn_of(case, files)
    done = cli(*command, "--dsn", dsn)
    assert done.returncode == 2, done.stderr  # fix the DSN or the file, not "retry later"
    assert named in done.stderr
    assert "Traceback" not in done.stderr and "unavailable" not in done.stderr


def test_a_file_named_by_the_environment_is_named_by_its_variable(
    files: dict[str, str],
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    done = subprocess.run(
        [sys.executable, "-m", "grpc_idempotency.cli", "purge", "--dsn",
         DSN.format(query="sslmode=verify-full")],
        capture_output=True, text=True, timeout=60, check=False,
        env={**env, "PGSSLROOTCERT": files["missing"]},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"PGSSLROOTCERT {files['missing']}: No such file or directory" in done.stderr


def test_the_relay_refuses_a_listen_dsn_whose_file_fails_before_relaying(
    pg_dsn: str, store: object, files: dict[str, str]
) -> None:
    """--listen-dsn is tried once before relaying: a DSN that failed this way was taken for one
    not reachable yet, and the relay ran on, failing to LISTEN, over and over."""
    dsn, named = dsn_of("sslrootcert missing", files)
    done = cli("relay", "--dsn", pg_dsn, "--listen-dsn", dsn,
               "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"cannot use --listen-dsn: {named}" in done.stderr and "ready" not in done.stdout
