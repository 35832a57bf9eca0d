"""The BEGIN of the library's own transactions (``store.sql.begin``): its timeouts are
PostgreSQL's whole milliseconds, a C int, and local to the transaction."""

from __future__ import annotations

import pytest

from grpc_idempotency.store.sql import begin

BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED"


@pytest.mark.parametrize(
    ("lock_timeout_s", "ms"),
    [
        (0.1, 100),
        # 0 is no timeout at all: a bound under half a millisecond is 1 ms, never unbounded.
        (0.0001, 1),
        (1e9, 2**31 - 1),  # past a C int PostgreSQL refuses it (22023), the batch with it
    ],
)
def test_a_lock_timeout_is_set_local_in_whole_milliseconds(lock_timeout_s: float, ms: int) -> None:
    # Local to the transaction (set_config's true), and ours only below a session's own
    # (tests/integration/test_purge.py runs it against the server's settings).
    sql = begin("read committed", None, lock_timeout_s)
    assert sql.startswith(f"{BEGIN}; SELECT pg_catalog.set_config('lock_timeout', "), sql
    assert f"'{ms} ms'::pg_catalog.interval THEN s ELSE '{ms}' END, true)" in sql, sql


def test_no_lock_timeout_adds_nothing() -> None:
    assert begin("read committed", 5.0) == (
        f"{BEGIN}; SET LOCAL idle_in_transaction_session_timeout = 5000"
    )
