"""The harness itself: a service started by a test dies with the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.procs import ROOT
from tests.support.processes import running

# A stand-in for pytest: starts a "service" with ServiceProcess, prints its pid, then waits to be
# killed (as a CI timeout or an impatient engineer kills pytest: no teardown runs).
PARENT = """
import asyncio, sys, time
from pathlib import Path
from tests.e2e.procs import ServiceProcess

service = ServiceProcess(
    ["-c", "import time; print('service ready', flush=True); time.sleep(600)"],
    ready="service ready", log_dir=Path(sys.argv[1]), name="service",
)
asyncio.run(service.start(60))
print(service.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_service_dies_with_the_killed_test_process(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    child: int | None = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"no pid from the parent: {line!r}"
        child = int(line)
        assert running(child)
        # The pid the test kills is the service's own: the launcher exec'd into it.
        assert "time.sleep(600)" in Path(f"/proc/{child}/cmdline").read_text()
        parent.send_signal(signal.SIGKILL)
        assert parent.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not running(child), "the service outlived the killed test process"
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)
