"""``--shard I/N`` (tests/conftest.py): CI's lowest-versions, 3.12 and 3.13 runs each take a
quarter of the unit tests and a quarter of the integration tests, none the same one; the N
shards together take every one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# No e2e file: the lowest-versions job cannot import the example's services (their generated
# code needs the newest grpcio), and the shards leave e2e alone anyway.
FILES = [
    "tests/unit/test_shard_option.py",
    "tests/unit/test_wire.py",
    "tests/integration/test_handler_replay_marker.py",
]


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


def test_four_shards_split_the_unit_and_integration_tests() -> None:
    _, every = collected()
    shards = [set(collected("--shard", f"{i}/4")[1]) for i in range(4)]
    assert set().union(*shards) == set(every)
    for part in ("tests/unit/", "tests/integration/"):
        split = {t for t in every if t.startswith(part)}
        assert len(split) > 4, part
        taken = [shard & split for shard in shards]
        assert sum(len(t) for t in taken) == len(split), part  # none taken twice
        assert set().union(*taken) == split, part
        assert max(map(len, taken)) - min(map(len, taken)) <= 1, part


def test_a_shard_out_of_range_is_a_usage_error() -> None:
    status, _ = collected("--shard", "2/2")
    assert status == 4  # pytest's usage error
