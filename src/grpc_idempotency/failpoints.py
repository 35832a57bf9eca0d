"""Failpoints: crash, delay, freeze or fail the request path at named points. A testing facility.

Switched on by the environment variable ``GRPC_IDEMPOTENCY_FAILPOINTS`` when the process starts,
for example ``after_commit_before_response=crash`` (the process dies at once, like kill -9),
``before_commit=sleep:2000``, ``after_claim=error`` or ``after_claim=stop`` (the process sends
itself SIGSTOP there and stays frozen, mid-request, until a SIGCONT; POSIX only). Points:
``after_claim``, ``before_commit``, ``after_commit_before_response`` (the server),
``relay_after_delivery`` (the outbox relay: delivered, not yet marked sent),
``relay_after_claim`` (the relay's claim committed, its rows not yet the relay's), ``purge_batch``
(every purge, before each batch), ``lease_renewal`` (a phased claim's lease keeper, before each
renewal), ``lease_renewed`` (the keeper, with a renewal's answer, before it acts on it),
``mark_probe_rollback`` (the consumer's mark: its probe met the row held, the ROLLBACK before
the wait on the row is about to run).
When the variable is unset, ``ENABLED`` is False and the server never calls ``hit``: no cost on
the request path.

A process with failpoints armed says so, once: a WARNING from ``announce()`` (for a server or a
relay to call as it starts), or else at the first ``hit``. The variable left set in production
would crash or fail real requests; the warning is how an operator finds out why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

from grpc_idempotency.core.failpoints import ENV_VAR, FailAction, parse_failpoints

_SPEC = os.environ.get(ENV_VAR, "")
_points = parse_failpoints(_SPEC)
ENABLED = bool(_points)

_log = logging.getLogger(__name__)
_announced = False
_announce_lock = threading.Lock()


class FailpointError(RuntimeError):
    """Raised by an ``error`` failpoint."""


def announce() -> None:
    """Logs a WARNING naming the armed failpoints, once per process; nothing when none is."""
    global _announced
    if _announced or not ENABLED:
        return
    with _announce_lock:  # a server and a relay starting in threads of one process: one line
        if _announced:
            return
        _announced = True
    _log.warning(
        "%s=%s: failpoints are armed in this process; they crash, delay, freeze or fail requests on"
        " purpose. A testing facility: unset the variable in production.",
        ENV_VAR,
        _SPEC.strip(),
    )


async def hit(name: str) -> None:
    if not _announced:
        announce()  # no server or relay announced them: warn before the first one acts
    point = _points.get(name)
    if point is None:
        return
    if point.action is FailAction.CRASH:
        sys.stderr.write(f"grpc-idempotency: failpoint {name}=crash, killing process\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif point.action is FailAction.SLEEP:
        await asyncio.sleep(point.sleep_ms / 1000)
    elif point.action is FailAction.STOP:
        sys.stderr.write(f"grpc-idempotency: failpoint {name}=stop, stopped until SIGCONT\n")
        sys.stderr.flush()
        # Every thread stops with it (the event loop, gRPC's, asyncpg's sockets), as in a frozen
        # VM. On SIGCONT this request goes on from here; timers that fell due meanwhile (a lease
        # keeper's renewal) fire at once, late: exactly what a replica resumed from a freeze does.
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise FailpointError(f"failpoint {name} fired")
