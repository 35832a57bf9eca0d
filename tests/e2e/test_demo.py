"""The checkout demo end to end: ``python -m examples.checkout demo`` must pass every drill.

The demo starts its own embedded PostgreSQL (or uses GRPC_IDEMPOTENCY_TEST_DSN), runs each
service as a separate process, restarts them with failpoints, and exits non-zero when any side
effect was written more often than expected or any expectation failed. Its drills wait for what
the database shows, never for a timer, so a loaded machine makes the demo slower, not red.
"""

from __future__ import annotations

import pytest

from tests.e2e.procs import run_example

pytestmark = pytest.mark.e2e

# Only a guard against a hang: the demo takes some 15 s on an idle 2-core machine.
DEMO_TIMEOUT_S = 600
DRILLS = (
    "a. plain retries",
    "b. lost response: gave up",
    "b. lost response: crash",
    "c. concurrent duplicates",
    "d. mutated payload",
    "e. two tenants, one key",
    "f. lost order response",
    "g. two tenants, one order key",
    "h. crash between charge and order",
    "i. outbox to ledger",
    "j. orders stalled past its lease",
    "k. one key across gRPC retries",
    "l. no valid token",
)


def test_demo_passes_every_drill() -> None:
    done, report = run_example(["examples.checkout", "demo"], DEMO_TIMEOUT_S)
    assert done.returncode == 0, report
    rows = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    for drill in DRILLS:
        assert drill in rows, f"no table row for {drill!r}\n{report}"
        assert rows[drill].endswith("PASS"), report
    assert "all drills passed" in done.stdout, report
