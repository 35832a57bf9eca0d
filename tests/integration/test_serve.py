"""The server runner (``python -m grpc_idempotency.testing.serve``) as a real process: whatever
signal a supervisor or a terminal sends to end it (SIGTERM, SIGINT, SIGHUP, SIGQUIT), it shuts
down cleanly and runs the build's clean-up (where an EmbeddedPostgres or a store is closed)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from grpc_idempotency.testing._process import ServerProcess

MODULE = "tests.integration.test_serve"
MARKER_ENV = "GI_TEST_SERVE_CLEANED_UP"
NO_DSN = "postgresql://unused@/x"  # the servers below touch no database


async def marking_server(dsn: str) -> AsyncIterator[Any]:
    """Its clean-up (after the ``yield``) leaves a file behind: proof that it ran."""
    yield grpc.aio.server()
    Path(os.environ[MARKER_ENV]).write_text("cleaned up")  # noqa: ASYNC240 - tiny, at exit


@pytest.mark.e2e
@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT],
    ids=lambda s: signal.Signals(s).name,
)
async def test_a_signal_to_end_it_runs_the_clean_up(tmp_path: Path, signum: int) -> None:
    marker = tmp_path / "cleaned"
    server = ServerProcess(
        f"{MODULE}:marking_server",
        NO_DSN,
        log_dir=tmp_path,
        name="server",
        env={MARKER_ENV: str(marker)},
    )
    await server.start(60)
    try:
        os.kill(server.pid, signum)
        code = await server.wait_exit(30)
    finally:
        server.stop()
    assert code == 0, f"exit {code}: killed without its clean-up\n{server.logs()}"
    assert marker.read_text() == "cleaned up"
