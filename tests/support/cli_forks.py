"""``grpc-idempotency`` commands run as forks of one process that has imported the CLI.

The CLI tests run the command hundreds of times. As ``python -m grpc_idempotency.cli`` each run
spent about 0.4 CPU-seconds starting Python and importing asyncpg, grpc and protobuf, most of
the CLI tests' cost and a large share of CI's 15 minutes. A fork of a process that has done that
once starts in milliseconds and is still a process of its own: its own stdin, stdout and stderr
(pipes, as before), environment, working directory and exit status; ``main()`` runs in it as
``python -m grpc_idempotency.cli`` runs it.

What a fork cannot give is what Python reads as it starts: the encoding of stdout and stderr
(``PYTHONIOENCODING``, the locale), other ``PYTHON*`` settings, gRPC's ``GRPC_*``, and the
failpoints (read when ``grpc_idempotency.failpoints`` is imported). A run that sets any of these
otherwise than the fork server was started with runs as a new process, as do the tests of the
process itself (signals, a closed stdout), which start it themselves.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

# The fork server: imports the CLI, then forks once per request. A request is a pickled
# (argv, env, cwd) with stdin, stdout and stderr passed as file descriptors; the child answers
# its pid, then its exit status, each as a 4-byte signed integer.
_SERVER = r"""
import os, pickle, select, signal, socket, struct, sys, traceback

import grpc_idempotency.cli as cli

listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(64)
# No threads here, ever: a fork of a threaded process may inherit a lock some other thread held.
# The children are reaped by the kernel; each one reports its own exit status.
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
sys.stdout.write("ready\n")
sys.stdout.flush()


def child(conn, request, fds):
    listener.close()
    argv, env, cwd = request
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # As a new Python has them (this server's sys.stdin was never read: no buffered input).
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [cli.__file__, *argv]
    conn.sendall(struct.pack("!i", os.getpid()))
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    conn.sendall(struct.pack("!i", code & 0xFF))
    os._exit(code & 0xFF)


while True:
    ready, _, _ = select.select([listener, 0], [], [])
    if 0 in ready and not os.read(0, 1):
        os._exit(0)  # the tests ended: their end of this server's stdin closed
    if listener in ready:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:
            child(conn, pickle.loads(message), fds)
        for fd in fds:
            os.close(fd)
        conn.close()
"""

# Read as Python or gRPC start, or as the package is imported: a run setting them otherwise
# than the server had them is a new process.
_AT_START = ("PYTHON", "LC_", "LANG", "GRPC_")
_AT_RUN = ("GRPC_IDEMPOTENCY_",)
_FAILPOINTS = "GRPC_IDEMPOTENCY_FAILPOINTS"

_lock = threading.Lock()
_server: tuple[subprocess.Popen[bytes], str, dict[str, str]] | None = None


def _read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if (k.startswith(_AT_START) and not k.startswith(_AT_RUN)) or k == _FAILPOINTS
    }


def _started() -> tuple[str, dict[str, str]]:
    """The fork server's socket and what it read as it started; started on first use."""
    global _server
    with _lock:
        if _server is None:
            env = {
                k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))
            }
            path = os.path.join(tempfile.mkdtemp(prefix="gi-cli-forks-"), "socket")
            proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            assert proc.stdout is not None
            if proc.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the CLI fork server did not start: {proc.wait()}")
            atexit.register(_stop, proc)
            _server = (proc, path, _read_at_start(env))
        _, path, at_start = _server
        return path, at_start


def _stop(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise RuntimeError("the CLI fork server closed the connection")
        data += more
    return data


def run_forked(
    argv: list[str],
    *,
    env: Mapping[str, str],
    cwd: Path | str | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """``grpc-idempotency <argv>`` run to the end in a fork, like
    ``subprocess.run([python, -m, grpc_idempotency.cli, *argv], capture_output=True,
    text=True, stdin=DEVNULL)``; a new process instead when ``env`` sets what Python reads as
    it starts."""
    path, at_start = _started()
    if _read_at_start(env) != at_start:
        return subprocess.run(
            [sys.executable, "-m", "grpc_idempotency.cli", *argv],
            capture_output=True, text=True, timeout=timeout, cwd=cwd, env=dict(env),
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    stdin_r = os.open(os.devnull, os.O_RDONLY)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.settimeout(timeout)
        request = pickle.dumps((list(argv), dict(env), None if cwd is None else str(cwd)))
        socket.send_fds(conn, [request], [stdin_r, out_w, err_w])
        for fd in (stdin_r, out_w, err_w):
            os.close(fd)
        (pid,) = struct.unpack("!i", _exactly(conn, 4))
        # Both outputs read at once, as subprocess.run reads them: a child filling one pipe
        # while we wait on the other would wait forever.
        outputs: dict[int, bytes] = {}

        def drain(fd: int) -> None:
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            os.close(fd)
            outputs[fd] = b"".join(chunks)

        threads = [threading.Thread(target=drain, args=(fd,)) for fd in (out_r, err_r)]
        for t in threads:
            t.start()
        try:
            (code,) = struct.unpack("!i", _exactly(conn, 4))
        except TimeoutError:
            os.kill(pid, 9)
            raise subprocess.TimeoutExpired(argv, timeout) from None
        except RuntimeError:
            code = -1  # the child died before it could tell its status (a signal)
        for t in threads:
            t.join(timeout)
    # Decoded as subprocess.run(text=True) decodes: the locale's encoding, universal newlines.
    return subprocess.CompletedProcess(argv, code, _text(outputs[out_r]), _text(outputs[err_r]))


def _text(data: bytes) -> str:
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")
