"""Failpoints armed in a process's environment say so: one WARNING per process (at the first
failpoint hit, or when a server or relay calls ``announce()`` as it starts), not one per call;
none when the variable is unset."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from grpc_idempotency.core.failpoints import ENV_VAR

SCRIPT = textwrap.dedent(
    """
    import asyncio, logging
    logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
    from grpc_idempotency import failpoints

    async def main():
        failpoints.announce()
        for _ in range(3):  # three calls through the points
            await failpoints.hit("before_commit")
            await failpoints.hit("after_claim")
        failpoints.announce()

    asyncio.run(main())
    print("DONE")
    """
)


def _run(env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if env_value is not None:
        env[ENV_VAR] = env_value
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr
    return done


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("WARNING")]


@pytest.mark.e2e
def test_armed_failpoints_log_one_warning_per_process() -> None:
    done = _run("before_commit=sleep:0")
    (warning,) = _warnings(done.stderr)
    assert ENV_VAR in warning and "before_commit=sleep:0" in warning
    assert "grpc_idempotency.failpoints" in warning
    assert "production" in warning


@pytest.mark.e2e
def test_the_first_hit_warns_without_announce() -> None:
    script = SCRIPT.replace("failpoints.announce()", "pass")
    env = {**os.environ, ENV_VAR: "after_claim=sleep:0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert len(_warnings(done.stderr)) == 1, done.stderr


@pytest.mark.e2e
def test_no_failpoints_no_warning() -> None:
    done = _run(None)
    assert _warnings(done.stderr) == [], done.stderr
