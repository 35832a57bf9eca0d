"""The harness itself: a service started by a test dies with the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.procs import ROOT, ServiceProcess
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


# A "service" whose comm ("a) T (") would read as stopped, were /proc/PID/stat split at its first
# ")": it waits for the test's go file, then reaches a ``stop`` failpoint, then says it went on.
STOPPING = """
import asyncio, os, sys, time
with open("/proc/self/comm", "w") as comm:
    comm.write("a) T (")
from grpc_idempotency import failpoints
print("service ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
asyncio.run(failpoints.hit("purge_batch"))
print("went on", flush=True)
"""


@pytest.mark.e2e
@pytest.mark.skipif(sys.platform != "linux", reason="/proc/PID/comm is Linux's")
async def test_a_stop_failpoint_freezes_the_process_there_until_sigcont(tmp_path: Path) -> None:
    """``stop`` says so on stderr, then stops the process where it is (wait_stopped sees it, a
    comm with parentheses notwithstanding); SIGCONT lets it go on from that point. wait_stopped
    is bounded, and gives up on a process that has exited."""
    go = tmp_path / "go"
    service = ServiceProcess(
        ["-c", STOPPING, str(go)],
        ready="service ready",
        log_dir=tmp_path,
        name="stopping",
        env={"GRPC_IDEMPOTENCY_FAILPOINTS": "purge_batch=stop"},
    )
    await service.start()
    try:
        with pytest.raises(RuntimeError, match=r"not stopped in 0\.05s"):
            await service.wait_stopped(0.05)  # running: waiting for the go file
        go.touch()
        await service.wait_stopped(10)
        assert "failpoint purge_batch=stop, stopped until SIGCONT" in service.logs()
        assert "went on" not in service.stdout_path.read_text()
        service.resume()
        assert await service.wait() == 0, service.logs()
        assert "went on" in service.stdout_path.read_text()
        with pytest.raises(RuntimeError, match="exited with 0"):
            await service.wait_stopped()
    finally:
        service.kill()
        if service.proc is not None:
            await service.proc.wait()
