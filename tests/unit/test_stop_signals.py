"""Which signals commands and servers take over to stop: none off the main thread, none the
process inherited as ignored."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from grpc_idempotency.cli_errors import run_command
from grpc_idempotency.stop_signals import catchable

BOTH = (signal.SIGINT, signal.SIGTERM)


def in_a_thread(fn: Callable[[], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # reported to the test, whatever it is
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    return out


@pytest.fixture
def sighup_ignored() -> Iterator[None]:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_main_thread_takes_the_signals_it_may(sighup_ignored: None) -> None:
    assert catchable(BOTH) == BOTH
    assert catchable((signal.SIGHUP, signal.SIGTERM)) == (signal.SIGTERM,)


def test_another_thread_takes_none() -> None:
    assert in_a_thread(lambda: catchable(BOTH)) == {"value": ()}


def test_a_command_runs_in_another_thread() -> None:
    """asyncio only handles signals on the main thread: run_command raised RuntimeError there
    (set_wakeup_fd only works in main thread) before the command ran, where asyncio.run, which
    it replaced, worked."""

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert in_a_thread(lambda: run_command(answer())) == {"value": 42}
