"""EmbeddedPostgres does not outlive its owner: a real child process starts one, gets SIGTERM or
SIGHUP (a closed terminal, a dropped ssh session), and its postgres process and temporary
directories are gone afterwards, whether the child had a handler of its own for the signal
(which still runs) or the default one (the child still dies of the signal). A normal exit keeps
cleaning up as before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpc_idempotency.testing._postmaster import alive as _alive
from tests.support.waiting import until

# The child starts a server, prints what it owns, and waits for a signal (or exits at once).
CHILD = """
import json, os, signal, sys
from pathlib import Path

from grpc_idempotency.testing import EmbeddedPostgres

mode = sys.argv[1]
marker = Path(sys.argv[2])
signum = int(sys.argv[3])
signal.signal(signum, signal.SIG_DFL)  # not inherited ignored (pytest run under nohup)
if mode == "own-handler":
    def on_signal(signum, frame):
        marker.write_text("handled")
        sys.exit(3)
    signal.signal(signum, on_signal)

pg = EmbeddedPostgres(durable=False)
pg.start()
pid = int((pg._data_dir / "postmaster.pid").read_text().splitlines()[0])
print(json.dumps({"pid": pid, "dirs": [str(pg._data_dir), str(pg._socket_dir)]}), flush=True)
if mode != "exit":
    while True:
        signal.pause()
"""


def _start_child(
    mode: str, marker: Path, signum: int = signal.SIGTERM
) -> tuple[subprocess.Popen[str], dict[str, object]]:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), mode, str(marker), str(int(signum))],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # bounded: the child either prints or exits (EOF)
    assert line, f"the child exited before its server started (exit {child.wait(30)})"
    owned: dict[str, object] = json.loads(line)
    return child, owned


async def _assert_cleaned_up(owned: dict[str, object]) -> None:
    pid = owned["pid"]
    assert isinstance(pid, int)
    # pg_ctl stop --wait returns once the postmaster is gone; init may reap it a little later.
    await until("the postmaster to be gone", lambda: not _alive(pid))
    dirs = owned["dirs"]
    assert isinstance(dirs, list) and len(dirs) == 2
    assert _existing(dirs) == [], "temporary dirs survived their owner"


def _existing(paths: list[str]) -> list[str]:
    return [path for path in paths if Path(path).exists()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["default-handler", "own-handler"])
async def test_a_stop_signal_stops_the_server_and_removes_its_dirs(
    mode: str, signum: signal.Signals, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    child, owned = _start_child(mode, marker, signum)
    try:
        pid = owned["pid"]
        assert isinstance(pid, int) and _alive(pid)
        child.send_signal(signum)
        code = child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if mode == "own-handler":
        # The handler that was there first still ran, and decided how the process ended.
        assert marker.read_text() == "handled"
        assert code == 3
    else:
        assert code == -signum, "the default action (die of the signal) must still happen"
    await _assert_cleaned_up(owned)


async def test_normal_exit_still_stops_the_server(tmp_path: Path) -> None:
    child, owned = _start_child("exit", tmp_path / "marker")
    assert child.wait(60) == 0
    await _assert_cleaned_up(owned)


def test_an_ignored_signal_is_left_alone() -> None:
    # A process that ignores SIGTERM (or SIGHUP: nohup) keeps its server: installing a handler
    # would change that. The other signal is handled all the same.
    script = textwrap.dedent(
        """
        import signal
        from grpc_idempotency.testing import embedded
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        embedded._install_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) is embedded._on_stop_signal
        embedded._signals_installed_in = None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        embedded._install_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) is embedded._on_stop_signal
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
