"""Failpoints: crash, delay or fail the request path at named points. A testing facility.

Switched on by the environment variable ``GRPC_IDEMPOTENCY_FAILPOINTS`` when the process starts,
for example ``after_commit_before_response=crash`` (the process dies at once, like kill -9),
``before_commit=sleep:2000`` or ``after_claim=error``. Points: ``after_claim``,
``before_commit``, ``after_commit_before_response`` (the server), ``relay_after_delivery`` (the
outbox relay: delivered, not yet marked sent). When the variable is unset, ``ENABLED`` is
False and the server never calls ``hit``: no cost on the request path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from grpc_idempotency.core.failpoints import ENV_VAR, FailAction, parse_failpoints

_points = parse_failpoints(os.environ.get(ENV_VAR, ""))
ENABLED = bool(_points)


class FailpointError(RuntimeError):
    """Raised by an ``error`` failpoint."""


async def hit(name: str) -> None:
    point = _points.get(name)
    if point is None:
        return
    if point.action is FailAction.CRASH:
        sys.stderr.write(f"grpc-idempotency: failpoint {name}=crash, killing process\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif point.action is FailAction.SLEEP:
        await asyncio.sleep(point.sleep_ms / 1000)
    else:
        raise FailpointError(f"failpoint {name} fired")
