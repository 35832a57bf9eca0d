"""Run example services as real child processes: start, wait until listening, kill, reap.

Output goes to files, not pipes: a child that logs a lot can never block on a full pipe, and the
files are there to show when a start or a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc

from tests.e2e import tenants

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0
SIGKILLED = -signal.SIGKILL
"""The return code of a process killed by SIGKILL (a failpoint's crash, or ``kill``)."""


def free_port() -> int:
    """A TCP port that nothing listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The current environment with the repo root on PYTHONPATH, no inherited failpoints, and
    the tokens of the session's tenants (``tenants.environment()``)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_IDEMPOTENCY_FAILPOINTS"}
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(tenants.environment())
    env.update(extra or {})
    return env


# Started in front of every service: asks the kernel to SIGKILL the child when this process
# dies (PR_SET_PDEATHSIG, which survives exec), so that a pytest killed mid-test leaves no
# servers behind holding ports and database connections. If this process died before the
# prctl, the child's parent is no longer the pid it was given: it exits instead of running.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(70)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


class ServiceProcess:
    """One child process running ``python -m <module> <args>`` until it prints ``ready``; it
    dies with this process (SIGKILL included) on Linux."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        ready: str,
        log_dir: Path,
        name: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.args = [sys.executable, *args]
        launcher = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid())]
        self._command = [*launcher, *args] if sys.platform == "linux" else self.args
        self.ready = ready
        self.env = child_env(env)
        self.stdout_path = log_dir / f"{name}.stdout"
        self.stderr_path = log_dir / f"{name}.stderr"
        self.proc: asyncio.subprocess.Process | None = None
        self.port: int | None = None
        """The TCP port named at the end of the ready line, once started."""

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, for a service that named its port when it became ready."""
        assert self.port is not None, "not started, or its ready line named no port"
        return f"127.0.0.1:{self.port}"

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def start(self, timeout: float = START_TIMEOUT_S) -> None:
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = await asyncio.create_subprocess_exec(
                *self._command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=ROOT,
                env=self.env,
                start_new_session=True,  # a Ctrl-C of pytest must not reach it first
            )
        deadline = time.monotonic() + timeout
        while (line := self._ready_line()) is None:
            if self.proc.returncode is not None:
                raise RuntimeError(f"{self.args} exited with {self.proc.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.args}: no {self.ready!r} in {timeout}s\n{self.logs()}")
            # Wakes at once if the child exits; otherwise looks at its output again.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), 0.02)
        # "<name> listening on HOST:PORT" names the port actually bound (the port may be 0).
        bound = re.search(r":(\d+)\s*$", line)
        self.port = int(bound.group(1)) if bound else None

    def _ready_line(self) -> str | None:
        """The first complete line of output containing ``ready``, once there is one."""
        for line in self.stdout_path.read_text(errors="replace").splitlines(keepends=True):
            if self.ready in line and line.endswith("\n"):
                return line
        return None

    async def wait(self, timeout: float = 10.0) -> int:
        """Waits for the process to exit; returns its return code (-9: SIGKILL)."""
        assert self.proc is not None, "not started"
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def kill(self) -> None:
        """SIGKILL, like a crash; no-op once it has exited."""
        self.send_signal(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the process stalls where it is (a GC pause, a frozen VM), holding its
        sockets and database connections, until ``resume``."""
        self.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause`` (or a ``stop`` failpoint)."""
        self.send_signal(signal.SIGCONT)

    async def wait_stopped(self, timeout: float = 20.0) -> None:
        """Waits until the process is stopped (SIGSTOP: ``pause``, or a ``stop`` failpoint it
        reached); raises if it exits first or is still running after ``timeout``. A ``pause``
        only queues the signal: this is when the process can no longer take a step."""
        assert self.proc is not None, "not started"
        deadline = time.monotonic() + timeout
        while not _is_stopped(self.proc.pid):
            if self.proc.returncode is not None:
                raise RuntimeError(f"{self.args} exited with {self.proc.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.args}: not stopped in {timeout}s\n{self.logs()}")
            with contextlib.suppress(TimeoutError):  # wakes at once if it exits
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), 0.01)

    def send_signal(self, sig: int) -> None:
        """Sends ``sig``; no-op once the process has exited."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    async def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it is still alive after ``timeout``."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self.proc.send_signal(signal.SIGCONT)  # a paused process would never see SIGTERM
            self.proc.terminate()
            await asyncio.wait_for(self.proc.wait(), timeout)
        except ProcessLookupError:
            pass
        except TimeoutError:
            self.kill()
            await self.proc.wait()

    def logs(self) -> str:
        parts = []
        for path in (self.stdout_path, self.stderr_path):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                text = ""
            parts.append(f"--- {path.name} ---\n{text[-4000:]}")
        return "\n".join(parts)


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal: state ``T`` in /proc/PID/stat on Linux, else as
    ``ps`` shows it. The child's parent reaps it through asyncio, so no waitpid(WUNTRACED) here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses, so the last ")".
            return stat.read().rpartition(b")")[2].split()[0] == b"T"
    except FileNotFoundError:
        if sys.platform == "linux":
            return False  # gone: the caller sees its return code
    ps = subprocess.run(
        ["ps", "-o", "state=", "-p", str(pid)], capture_output=True, text=True, check=False
    )
    return ps.stdout.strip().startswith("T")


@contextlib.asynccontextmanager
async def ledger_process(
    dsn: str, log_dir: Path
) -> AsyncIterator[tuple[ServiceProcess, grpc.aio.Channel]]:
    """The test LedgerService (``tests.support.ledger_process``) in a process of its own on
    ``dsn``, for a test whose server may die or freeze, and a channel to it; stopped on the way
    out."""
    server = ServiceProcess(
        ["-m", "tests.support.ledger_process", dsn],
        ready="ledger ready",
        log_dir=log_dir,
        name="ledger",
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield server, channel
    finally:
        await server.stop()


class Processes:
    """Every process a test started, so that a fixture can reap them all however it ends
    (``async with Processes(log_dir) as processes:`` stops them all on the way out)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._started: list[ServiceProcess] = []

    async def __aenter__(self) -> Processes:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def payments(
        self, dsn: str, port: int, *, failpoints: str | None = None
    ) -> ServiceProcess:
        """Starts ``python -m examples.checkout payments`` on 127.0.0.1:``port``."""
        return await self.service("payments", dsn, port, failpoints=failpoints)

    async def notifications(
        self, dsn: str, port: int, *, failpoints: str | None = None
    ) -> ServiceProcess:
        """Starts ``python -m examples.checkout notifications`` on 127.0.0.1:``port``."""
        return await self.service("notifications", dsn, port, failpoints=failpoints)

    async def orders(
        self,
        dsn: str,
        port: int,
        *,
        payments: int,
        notifications: int,
        lease: float | None = None,
        failpoints: str | None = None,
        downstream_timeout: float | None = None,
    ) -> ServiceProcess:
        """Starts ``python -m examples.checkout orders`` on 127.0.0.1:``port``, calling payments
        and notifications on the given local ports; ``lease`` overrides PlaceOrder's lease,
        ``downstream_timeout`` its bound on each downstream call (``DOWNSTREAM_TIMEOUT_S``,
        through ``tests.e2e.checkout_with_timeout``)."""
        args = [
            "--payments",
            f"127.0.0.1:{payments}",
            "--notifications",
            f"127.0.0.1:{notifications}",
        ]
        if lease is not None:
            args += ["--lease", str(lease)]
        module = (
            ["examples.checkout"]
            if downstream_timeout is None
            else ["tests.e2e.checkout_with_timeout", str(downstream_timeout)]
        )
        return await self.service("orders", dsn, port, args, failpoints=failpoints, module=module)

    async def ledger(self, dsn: str, port: int, *, failpoints: str | None = None) -> ServiceProcess:
        """Starts ``python -m examples.checkout ledger`` on 127.0.0.1:``port``."""
        return await self.service("ledger", dsn, port, failpoints=failpoints)

    async def relay(
        self,
        dsn: str,
        *,
        ledger: int,
        lease: float | None = None,
        batch_size: int | None = None,
        poll_interval: float | None = None,
        failpoints: str | None = None,
    ) -> ServiceProcess:
        """Starts the example's relay, ``python -m examples.checkout relay``, delivering the
        orders outbox to the ledger on local port ``ledger``; waits until it listens for new
        rows."""
        args = ["--dsn", dsn, "--ledger", f"127.0.0.1:{ledger}"]
        for flag, value in (
            ("--lease", lease),
            ("--batch-size", batch_size),
            ("--poll-interval", poll_interval),
        ):
            if value is not None:
                args += [flag, str(value)]
        return await self._start(
            ["-m", "examples.checkout", "relay", *args],
            ready="relay listening on",
            name="relay",
            failpoints=failpoints,
        )

    async def library_relay(
        self,
        dsn: str,
        *,
        schema: str,
        target: str,
        method: str,
        args: Sequence[str] = (),
        failpoints: str | None = None,
    ) -> ServiceProcess:
        """Starts the library's ``grpc-idempotency relay`` (as ``python -m
        grpc_idempotency.cli``) delivering ``schema``'s outbox to ``method`` on ``target``; waits
        until it is ready."""
        name = f"e2e-relay-{len(self._started)}"
        return await self._start(
            [
                "-m", "grpc_idempotency.cli", "relay", "--dsn", dsn, "--schema", schema,
                "--grpc-target", target, "--method", method, "--name", name, *args,
            ],
            ready=f"relay {name} ready",
            name=name,
            failpoints=failpoints,
        )  # fmt: skip

    async def _start(
        self, args: Sequence[str], *, ready: str, name: str, failpoints: str | None
    ) -> ServiceProcess:
        env = {"GRPC_IDEMPOTENCY_FAILPOINTS": failpoints} if failpoints else {}
        proc = ServiceProcess(
            args,
            ready=ready,
            log_dir=self.log_dir,
            name=f"{name}-{len(self._started)}",
            env=env,
        )
        self._started.append(proc)
        await proc.start()
        return proc

    async def service(
        self,
        name: str,
        dsn: str,
        port: int,
        args: Sequence[str] = (),
        *,
        failpoints: str | None = None,
        module: Sequence[str] = ("examples.checkout",),
    ) -> ServiceProcess:
        """Starts ``python -m examples.checkout <name>`` (or ``module``, a module and its first
        arguments) on 127.0.0.1:``port`` and waits until it listens."""
        return await self._start(
            ["-m", *module, name, "--listen", f"127.0.0.1:{port}", "--dsn", dsn, *args],
            ready=f"{name} listening on",
            name=name,
            failpoints=failpoints,
        )

    async def close(self) -> None:
        for proc in self._started:
            await proc.stop()


def run_example(
    args: Sequence[str], timeout: float
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Runs ``python -m <args>`` (an example that starts what it needs) to the end, on GRPC_IDEMPOTENCY_TEST_DSN when set (else the
    example starts its own PostgreSQL), without inherited failpoints; returns the finished process
    and a report of its exit code and output for assertion messages."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_IDEMPOTENCY_FAILPOINTS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", *args]
    if dsn := os.environ.get("GRPC_IDEMPOTENCY_TEST_DSN"):
        command += ["--dsn", dsn]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    report = f"exit {done.returncode}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    return done, report
