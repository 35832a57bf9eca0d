"""Waiting for observable state (a row, a counter, a log line), bounded: the tests' one way to
coordinate with servers and processes, never a blind sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

import pytest

T = TypeVar("T")


# What until() returns is truthy: never None.
@overload
async def until(
    what: str, probe: Callable[[], Awaitable[T | None]], timeout: float = 10.0
) -> T: ...
@overload
async def until(what: str, probe: Callable[[], T | None], timeout: float = 10.0) -> T: ...
async def until(
    what: str, probe: Callable[[], T | Awaitable[T | None] | None], timeout: float = 10.0
) -> T:
    """Polls ``probe()`` (sync or async) until it returns something truthy, and returns that;
    fails the test, naming ``what``, after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
