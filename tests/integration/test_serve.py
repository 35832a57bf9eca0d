"""The server runner (``python -m grpc_idempotency.testing.serve``) as a real process: whatever
signal a supervisor or a terminal sends to end it (SIGTERM, SIGINT, SIGHUP, SIGQUIT), it shuts
down cleanly and runs the build's clean-up (where an EmbeddedPostgres or a store is closed); an
address it cannot bind is a one-line error and exit status 2, not a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from grpc_idempotency.testing import serve
from grpc_idempotency.testing._process import ServerProcess

MODULE = "tests.integration.test_serve"
MARKER_ENV = "GI_TEST_SERVE_CLEANED_UP"
NO_DSN = "postgresql://unused@/x"  # the servers below touch no database


async def marking_server(dsn: str) -> AsyncIterator[Any]:
    """Its clean-up (after the ``yield``) leaves a file behind: proof that it ran."""
    yield grpc.aio.server()
    Path(os.environ[MARKER_ENV]).write_text("cleaned up")  # noqa: ASYNC240 - tiny, at exit


async def bare_server(dsn: str) -> Any:
    return grpc.aio.server()


async def never_yields(dsn: str) -> AsyncIterator[Any]:
    """An async generator that returns before its ``yield``: no server."""
    if not dsn:
        yield grpc.aio.server()


NOT_CALLABLE = "build_server"


def takes_nothing() -> Any:
    return grpc.aio.server()


async def takes_two(dsn: str, address: str) -> Any:
    return grpc.aio.server()


async def raises_type_error(dsn: str) -> Any:
    """A TypeError of the build's own: its bug, shown with its traceback."""
    return len(42)  # type: ignore[arg-type]


@contextlib.contextmanager
def _default_in_children(signum: int) -> Iterator[None]:
    """Children started meanwhile get ``signum`` at its default action even if pytest ignores
    it. Under nohup pytest ignores SIGHUP, and so did the runner it started (an inherited
    ignored signal is left alone): the SIGHUP test waited 30 s in vain. exec resets a caught
    signal to its default, not an ignored one; a handler that does nothing (not SIG_DFL) keeps
    pytest shielded meanwhile."""
    if signal.getsignal(signum) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signum, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signum, signal.SIG_IGN)


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
        # A timeout below aborts it (SIGABRT): faulthandler writes where each thread was stuck.
        env={MARKER_ENV: str(marker), "PYTHONFAULTHANDLER": "1"},
    )
    with _default_in_children(signum):
        await server.start(60)
    name = signal.Signals(signum).name
    try:
        # Its ready line comes once its handlers are in place; one it ignores (inherited so)
        # it leaves alone, and the wait below would be in vain.
        ignored, caught = _dispositions(server.pid, signum)
        assert not ignored, f"it inherited {name} ignored"
        assert caught, f"ready with no handler for {name}"
        os.kill(server.pid, signum)
        code = await server.wait_exit(30)
        if code is None:
            os.kill(server.pid, signal.SIGABRT)
            await server.wait_exit(10)
    finally:
        server.stop()
    assert code is not None, f"still running 30 s after {name}; its stacks:\n{server.logs()}"
    assert code == 0, f"exit {code}: killed without its clean-up\n{server.logs()}"
    assert marker.read_text() == "cleaned up"


@pytest.mark.e2e
async def test_the_kits_servers_take_no_fixed_address_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GRPC_IDEMPOTENCY_SERVE_ADDRESS left in the shell (from running a server by hand) gave
    every server of the conformance kit its fixed port: the kit runs two at once, and every
    check but the first failed with "cannot listen on ...: the port is in use"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(serve.ADDRESS_ENV, f"127.0.0.1:{port}")
    servers = [
        ServerProcess(f"{MODULE}:bare_server", NO_DSN, log_dir=tmp_path, name=f"s{i}")
        for i in range(2)
    ]
    try:
        await asyncio.gather(*(server.start(60) for server in servers))
        assert len({server.port for server in servers}) == 2
    finally:
        for server in servers:
            server.stop()


def _dispositions(pid: int, signum: int) -> tuple[bool, bool]:
    """Whether process ``pid`` ignores ``signum``, and whether it has a handler for it (Linux:
    the SigIgn and SigCgt masks of /proc/PID/status)."""
    masks = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("SigIgn", "SigCgt"):
            masks[name] = int(value.strip(), 16)
    bit = 1 << (signum - 1)
    return bool(masks["SigIgn"] & bit), bool(masks["SigCgt"] & bit)


@pytest.mark.e2e
def test_a_signal_inherited_as_ignored_stays_ignored(tmp_path: Path) -> None:
    """Started under nohup (SIGHUP ignored), the runner took SIGHUP over and stopped when the
    terminal closed. SIGTERM still stops it, with its clean-up."""
    marker = tmp_path / "cleaned"
    env = {**os.environ, serve.DSN_ENV: NO_DSN, MARKER_ENV: str(marker)}
    nohup = shutil.which("nohup")
    assert nohup is not None, "coreutils' nohup"
    # nohup itself, not a preexec_fn doing what it does: a preexec_fn makes subprocess fork()
    # this gRPC-threaded pytest process, and the forked child died now and then before exec.
    proc = subprocess.Popen(
        [
            nohup,
            sys.executable,
            "-m",
            "grpc_idempotency.testing.serve",
            f"{MODULE}:marking_server",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()  # printed once the handlers are in place
        assert ready.startswith("grpc-idempotency serve: listening on "), ready
        assert _dispositions(proc.pid, signal.SIGHUP) == (True, False)
        assert _dispositions(proc.pid, signal.SIGTERM) == (False, True)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert code == 0
    assert marker.read_text() == "cleaned up"


@pytest.mark.e2e
def test_an_address_in_use_is_a_clear_error_with_status_2() -> None:
    with socket.socket() as taken:  # no SO_REUSEPORT: grpc cannot share the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "grpc_idempotency.testing.serve", f"{MODULE}:bare_server"],
            env={**os.environ, serve.DSN_ENV: NO_DSN, serve.ADDRESS_ENV: f"127.0.0.1:{port}"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert serve.READY not in done.stdout


@pytest.mark.e2e
def test_a_port_another_grpc_server_listens_on_is_a_clear_error_with_status_2() -> None:
    # gRPC servers bind with SO_REUSEPORT: a second one on a port the first listens on was not
    # refused but shared it, the kernel spreading the connections over both (the kit's crash
    # checks then reached the clean server, or the clean server's retries the doomed one).
    with socket.socket() as taken:  # as a gRPC server of this user binds
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "grpc_idempotency.testing.serve", f"{MODULE}:bare_server"],
            env={
                **os.environ,
                serve.DSN_ENV: NO_DSN,
                serve.ADDRESS_ENV: f"127.0.0.1:{port}",
                # Without the check it serves, and stops at once at stdin's end of file.
                serve.EXIT_ON_STDIN_EOF_ENV: "1",
            },
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert "Traceback" not in done.stderr, done.stderr
    assert serve.READY not in done.stdout
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def run_serve(target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "grpc_idempotency.testing.serve", f"{MODULE}:{target}"],
        env={**os.environ, serve.DSN_ENV: NO_DSN},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    "target, expected",
    [
        # Was "RuntimeError: async generator raised StopAsyncIteration", a traceback, exit 1.
        ("never_yields", f"{MODULE}:never_yields yielded no server"),
        # Were TypeError tracebacks, exit 1.
        ("NOT_CALLABLE", f"{MODULE}:NOT_CALLABLE is a str, not a function"),
        ("takes_nothing", f"{MODULE}:takes_nothing cannot be called as build_server(dsn)"),
        ("takes_two", f"{MODULE}:takes_two cannot be called as build_server(dsn)"),
    ],
)
def test_a_build_that_gives_no_server_is_one_line_and_status_2(target: str, expected: str) -> None:
    done = run_serve(target)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [done.stderr.splitlines()[0]]  # one line
    assert done.stderr.startswith(f"grpc-idempotency serve: {expected}"), done.stderr
    assert serve.READY not in done.stdout


@pytest.mark.e2e
def test_a_type_error_inside_the_build_is_its_own() -> None:
    """Only a call that does not fit the build's signature is the runner's to report: a
    TypeError the build raises itself keeps its traceback, to be fixed where it is."""
    done = run_serve("raises_type_error")
    assert done.returncode == 1, done.stderr
    assert "Traceback" in done.stderr and "len(42)" in done.stderr
