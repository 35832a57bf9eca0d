"""``--shard I/N`` (tests/conftest.py): CI's 3.12 and 3.13 runs each take half of the
integration tests; together they must take every one, and neither the same one twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/unit/test_shard_option.py", "tests/integration/test_handler_replay_marker.py"]


def collected(*args: str) -> tuple[int, list[str]]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *FILES, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, [line for line in done.stdout.splitlines() if "::" in line]


def test_two_shards_split_the_integration_tests_and_both_run_the_others() -> None:
    _, every = collected()
    _, first = collected("--shard", "0/2")
    _, second = collected("--shard", "1/2")
    integration = {t for t in every if t.startswith("tests/integration/")}
    others = set(every) - integration
    assert len(integration) > 2 and others
    assert others <= set(first) and others <= set(second)
    assert not (set(first) & set(second) & integration)
    assert (set(first) | set(second)) & integration == integration
    assert abs(len(set(first) & integration) - len(set(second) & integration)) <= 1


def test_a_shard_out_of_range_is_a_usage_error() -> None:
    status, _ = collected("--shard", "2/2")
    assert status == 4  # pytest's usage error
