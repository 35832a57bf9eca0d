"""Command-line input that can never work is bad usage (exit 2, one line, before connecting),
not a failure to retry later (exit 1).

A DSN that is not valid UTF-8 (a byte such as 0xff from argv or the environment, which reaches
Python surrogate-escaped) passed asyncpg's parsing and failed only once connected, encoding the
startup message: tracebacks and exit 1, and ``Store.connect`` raised the retryable
``StoreUnavailable``. So did a DSN holding a NUL character (``%00`` in its database or user, or
a raw one in an ``inspect --config`` file), which PostgreSQL refuses in the startup message
(08P01, a protocol violation), and the error printed the NUL. An empty ``relay --grpc-target`` (``--grpc-target "$UNSET"``) reported
ready and dead-lettered every row.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from grpc_idempotency import DsnUnusable, Store
from tests.support.tools import DB_COMMANDS as COMMANDS
from tests.support.tools import run_cli

PASSWORD = "hunter22"
NOT_UTF8_ARG = "not valid UTF-8 (the DSN is not shown: it may hold a password)"


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    return run_cli(*args, env={**base, **env})


def not_utf8(dsn: str) -> str:
    """``dsn`` (the test database's, so that it reaches the server) with a password and the
    byte 0xff in its database name, as Python sees it in argv or the environment."""
    parts = urlsplit(dsn)
    hosts = parts.netloc.rpartition("@")[2]
    user = parts.username or "postgres"
    return urlunsplit(
        parts._replace(netloc=f"{user}:{PASSWORD}@{hosts}", path=parts.path + "\udcff")
    )


def assert_refused(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 2, done.stderr  # fix the DSN, not "retry later"
    assert "not valid UTF-8" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "unavailable" not in done.stderr
    assert PASSWORD not in done.stderr + done.stdout
    assert "ready" not in done.stdout


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_dsn_option_that_is_not_utf8_exits_2(pg_dsn: str, command: list[str]) -> None:
    done = cli(*command, "--dsn", not_utf8(pg_dsn))
    assert_refused(done)
    # argparse's usage, then one line saying what is wrong.
    assert done.stderr.strip().splitlines()[-1].endswith("argument --dsn: " + NOT_UTF8_ARG)


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_dsn_variable_that_is_not_utf8_exits_2(pg_dsn: str, command: list[str]) -> None:
    assert_refused(cli(*command, GRPC_IDEMPOTENCY_DSN=not_utf8(pg_dsn)))


def test_a_listen_dsn_that_is_not_utf8_exits_2(pg_dsn: str, store: object) -> None:
    done = cli(*COMMANDS["relay"], "--dsn", pg_dsn, "--listen-dsn", not_utf8(pg_dsn))
    assert_refused(done)
    assert "argument --listen-dsn: " + NOT_UTF8_ARG in done.stderr


async def test_store_connect_refuses_it_as_not_retryable(pg_dsn: str) -> None:
    with pytest.raises(DsnUnusable) as refused:
        await Store.connect(not_utf8(pg_dsn), check_schema=False)
    assert "not valid UTF-8" in str(refused.value)
    assert PASSWORD not in str(refused.value)


def holding_nul(dsn: str, where: str) -> str:
    """``dsn`` (the test database's, so that it reaches the server) with a password and a NUL
    (``where``: ``database`` or ``user`` percent-encoded, ``raw`` in the database name)."""
    parts = urlsplit(dsn)
    hosts = parts.netloc.rpartition("@")[2]
    user = parts.username or "postgres"
    if where == "user":
        return urlunsplit(parts._replace(netloc=f"{user}%00x:{PASSWORD}@{hosts}"))
    nul = "%00" if where == "database" else "\x00"
    return urlunsplit(
        parts._replace(netloc=f"{user}:{PASSWORD}@{hosts}", path=parts.path + nul + "x")
    )


def assert_nul_refused(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 2, done.stderr  # fix the DSN, not "retry later"
    assert "holds a NUL character" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "unavailable" not in done.stderr
    assert "\x00" not in done.stderr + done.stdout
    assert PASSWORD not in done.stderr + done.stdout


@pytest.mark.parametrize("where", ["database", "user"])
@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_dsn_option_holding_a_nul_exits_2(pg_dsn: str, command: list[str], where: str) -> None:
    done = cli(*command, "--dsn", holding_nul(pg_dsn, where))
    assert_nul_refused(done)
    assert "argument --dsn: it holds a NUL character" in done.stderr


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_dsn_variable_holding_a_nul_exits_2(pg_dsn: str, command: list[str]) -> None:
    assert_nul_refused(cli(*command, GRPC_IDEMPOTENCY_DSN=holding_nul(pg_dsn, "database")))


def test_an_inspect_config_dsn_holding_a_nul_exits_2(pg_dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "inspect.toml"
    dsn = holding_nul(pg_dsn, "raw").replace("\x00", "\\u0000")  # TOML's escape
    config.write_text(f'[services.a]\ndsn = "{dsn}"\n')
    assert_nul_refused(cli("inspect", "--config", str(config), "--scope", "s", "k"))


def test_an_inspect_config_scope_the_server_refuses_exits_2(pg_dsn: str, tmp_path: Path) -> None:
    """A service's ``scope`` the server never takes (it holds a control, line-separator or
    format character) matched no record: the downstream records were looked up under it and
    reported missing."""
    config = tmp_path / "inspect.toml"
    config.write_text(f'[services.a]\ndsn = "{pg_dsn}"\nscope = "tenant:\\u202eab"\n')
    done = cli("inspect", "--config", str(config), "--scope", "s", "k")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "[services.a] scope: a scope holds no control" in done.stderr, done.stderr
    assert "U+202E" in done.stderr and "\u202e" not in done.stderr


@pytest.mark.parametrize("where", ["database", "user", "raw"])
async def test_store_connect_refuses_a_nul_as_not_retryable(pg_dsn: str, where: str) -> None:
    with pytest.raises(DsnUnusable) as refused:
        await Store.connect(holding_nul(pg_dsn, where), check_schema=False)
    assert "holds a NUL character" in str(refused.value)
    assert PASSWORD not in str(refused.value) and "\x00" not in str(refused.value)


@pytest.mark.parametrize("target", ["", " \t"], ids=["empty", "blank"])
def test_an_empty_relay_target_exits_2_before_connecting(target: str) -> None:
    # Port 1 refuses connections: a relay that got as far as the database would exit 1.
    dsn = "postgresql://app@127.0.0.1:1/shop"
    done = cli("relay", "--dsn", dsn, "--grpc-target", target, "--method", "/a.B/C")
    assert done.returncode == 2, done.stderr
    # The command named once, as in argparse's own errors ("... relay: error: relay: ..." was).
    assert done.stderr.strip().splitlines()[-1] == (
        "grpc-idempotency relay: error: --grpc-target is empty (an unset variable?): give HOST:PORT"
    )
    assert "Traceback" not in done.stderr and "ready" not in done.stdout


async def test_store_connect_refuses_an_unencoded_at_in_the_password() -> None:
    # asyncpg ends the user info at the first "@": it looked up the host "ss@127.0.0.1", and
    # the failure was an outage (StoreUnavailable, retryable) naming that host.
    with pytest.raises(DsnUnusable) as refused:
        await Store.connect("postgresql://app:p@ss@127.0.0.1:1/shop", check_schema=False)
    assert "@ as %40" in str(refused.value)
    assert "p@ss" not in str(refused.value) and "ss@" not in str(refused.value)
