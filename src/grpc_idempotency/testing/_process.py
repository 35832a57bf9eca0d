"""A user's server as a child process (``python -m grpc_idempotency.testing.serve``): started
with its failpoints in the environment, waited for until it prints its port, killed for real.

Output goes to files, not pipes: a chatty child never blocks on a full pipe, and the files are
quoted in a failing check's message.

A child never outlives this process: its stdin is a pipe only this process holds the write end
of, and ``serve`` shuts down at its end of file, which the kernel delivers however this process
ends (a SIGTERM or SIGKILL to pytest runs no fixture teardown, so ``stop`` may never run).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from grpc_idempotency.core.failpoints import ENV_VAR as FAILPOINTS_ENV
from grpc_idempotency.testing import serve

_LOG_TAIL_CHARS = 3000
_POLL_S = 0.02


class ServerStartError(RuntimeError):
    """The user's server did not come up; the message has its output."""


def child_environment(dsn: str, failpoints: str | None, extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment, its ``sys.path`` on ``PYTHONPATH`` (so the child imports
    what the test can), the DSN, and exactly the given failpoints; the address is ``extra``'s,
    else any free port on 127.0.0.1."""
    # Nor the address this process's environment may name, for a server run by hand: the kit
    # runs several at once, and every one after the first failed to bind its fixed port.
    # ``extra`` (a target's ``server_env``) may still choose one.
    env = {k: v for k, v in os.environ.items() if k not in (FAILPOINTS_ENV, serve.ADDRESS_ENV)}
    env.update(extra)
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env[serve.DSN_ENV] = dsn
    env.setdefault(serve.ADDRESS_ENV, serve.DEFAULT_ADDRESS)
    if failpoints:
        env[FAILPOINTS_ENV] = failpoints
    return env


class ServerProcess:
    """One run of ``python -m grpc_idempotency.testing.serve <target>``."""

    def __init__(
        self,
        target: str,
        dsn: str,
        *,
        log_dir: Path,
        name: str,
        failpoints: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.target = target
        self.failpoints = failpoints
        self.name = name
        self._env = child_environment(dsn, failpoints, env or {})
        self._stdout = log_dir / f"{name}.stdout"
        self._stderr = log_dir / f"{name}.stderr"
        self._proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def address(self) -> str:
        """``HOST:PORT`` as the server printed it."""
        assert self.port is not None, "not started"
        host = self._env[serve.ADDRESS_ENV].rpartition(":")[0]
        return f"{host}:{self.port}"

    @property
    def pid(self) -> int:
        """The child's process id."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""
        return None if self._proc is None else self._proc.poll()

    async def start(self, timeout: float) -> None:
        """Starts the process and waits (at most ``timeout`` seconds) for its ready line."""
        with self._stdout.open("wb") as out, self._stderr.open("wb") as err:
            # Popen, not asyncio's: the process may outlive this event loop (a class's servers
            # serve tests that each run in a loop of their own), and it is only polled.
            self._proc = subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-m", "grpc_idempotency.testing.serve", self.target],
                # Never written to: the pipe is the child's lifeline (see the module's
                # docstring). Its write end is close-on-exec, so later children do not
                # inherit it and keep it open after this process is gone.
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env={**self._env, serve.EXIT_ON_STDIN_EOF_ENV: "1"},
                start_new_session=True,  # a Ctrl-C of pytest must not reach it first
            )
        deadline = time.monotonic() + timeout
        while (port := self._ready_port()) is None:
            code = self._proc.poll()
            if code is not None:
                raise ServerStartError(f"{self.describe()} exited with {code}\n{self.logs()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.describe()}: not ready in {timeout}s\n{self.logs()}")
            await asyncio.sleep(_POLL_S)
        self.port = port

    def _ready_port(self) -> int | None:
        text = self._stdout.read_text(errors="replace")
        for line in text.splitlines(keepends=True):
            if line.startswith(serve.READY) and line.endswith("\n"):
                return int(line.rstrip().rpartition(":")[2])
        return None

    async def wait_exit(self, timeout: float) -> int | None:
        """Its exit status once it exits, or None if it is still running after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (code := self.returncode) is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        return code

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL if it is still alive after ``timeout``."""
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            # Only once it has exited: closing the lifeline earlier would stop it too, but
            # without the SIGKILL fallback above.
            if proc.stdin is not None:
                proc.stdin.close()

    def describe(self) -> str:
        """What it runs, with which failpoints."""
        failpoints = f" with {FAILPOINTS_ENV}={self.failpoints}" if self.failpoints else ""
        return f"server {self.target}{failpoints}"

    def logged(self) -> bool:
        """Whether it wrote anything to stderr (stdout has the port it listens on, at least)."""
        try:
            return self._stderr.stat().st_size > 0
        except OSError:
            return False

    def logs(self) -> str:
        """The tail of its stdout and stderr."""
        parts = []
        for path in (self._stdout, self._stderr):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                text = ""
            parts.append(f"--- {path.name} ---\n{text[-_LOG_TAIL_CHARS:]}")
        return "\n".join(parts)
