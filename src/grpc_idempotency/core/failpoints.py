"""Failpoint specs: named crash, delay, stop and error points on the request path, in the outbox
relay and in purges, for tests.

``GRPC_IDEMPOTENCY_FAILPOINTS="after_commit_before_response=crash,after_claim=sleep:2000"``

``stop`` freezes the process at the point (it sends itself SIGSTOP) until a SIGCONT: a test waits
until the process is stopped, rather than hoping a sleep outlasts its own SIGSTOP under load.

Parsing is here (pure); carrying out an action is the driver's (``grpc_idempotency.failpoints``).
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VAR = "GRPC_IDEMPOTENCY_FAILPOINTS"

POINTS = frozenset(
    {
        "after_claim",  # the claim is made (atomic: not yet committed), the handler has not run
        "before_commit",  # the handler ran; its writes and the outcome are about to commit
        "after_commit_before_response",  # committed; the response has not been sent
        # the outbox relay: a sink delivered a message; the row is not yet marked sent (a crash
        # here leaves it claimed, and it is delivered again once the claim's lease expires)
        "relay_after_delivery",
        # the outbox relay's claim committed; its rows are not yet the relay's (``crash``: they
        # come back after the lease as lost claims; a cancel here gives them back)
        "relay_after_claim",
        # a purge (``Purger``, a relay's purge of sent rows, ``grpc-idempotency purge``) is about
        # to run a batch: ``error`` stands for a failure no outage explains (a bug)
        "purge_batch",
        # a phased claim's lease keeper is about to renew the lease while the handler runs
        "lease_renewal",
        # the keeper has its renewal's answer (renewed or lost) and has not acted on it yet
        "lease_renewed",
        # the consumer's mark: its 1 ms probe met the row held (55P03) and the ROLLBACK before the
        # wait on the row is about to run on the probe's connection: ``error`` stands for that
        # ROLLBACK failing (the connection is then dropped, its transaction's state unknown)
        "mark_probe_rollback",
    }
)


class FailAction(enum.Enum):
    CRASH = "crash"  # the process dies at once, as with kill -9
    SLEEP = "sleep"  # delay, in milliseconds
    ERROR = "error"  # raise FailpointError: the attempt fails like an unexpected exception
    STOP = "stop"  # SIGSTOP to itself: frozen at the point until SIGCONT (POSIX only)


# Refused at parse time where there is no SIGSTOP (Windows): a test arming ``stop`` would
# otherwise find out only when the point is reached, mid-request.
CAN_STOP = hasattr(signal, "SIGSTOP")


@dataclass(frozen=True, slots=True)
class Failpoint:
    action: FailAction
    sleep_ms: int = 0


def parse_failpoints(spec: str) -> Mapping[str, Failpoint]:
    """Parses the environment variable's value; raises ValueError naming the bad part."""
    points: dict[str, Failpoint] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, action = part.partition("=")
        if not sep or name not in POINTS:
            raise ValueError(f"{ENV_VAR}: unknown failpoint {part!r}; known: {sorted(POINTS)}")
        verb, colon, arg = action.partition(":")
        try:
            kind = FailAction(verb)
        except ValueError:
            raise ValueError(
                f"{ENV_VAR}: {part!r}: action must be crash, sleep:MS, error or stop"
            ) from None
        if kind is FailAction.SLEEP:
            # ASCII digits: str.isdigit() also takes a superscript two (then int() failed,
            # naming no variable) and an Arabic-Indic three (read as 3 ms).
            if not (arg.isascii() and arg.isdigit()):
                raise ValueError(f"{ENV_VAR}: {part!r}: sleep needs milliseconds, e.g. sleep:2000")
            points[name] = Failpoint(kind, int(arg))
        elif colon:  # "stop:" too: a ":" names an argument, even an empty one
            raise ValueError(f"{ENV_VAR}: {part!r}: {verb} takes no argument")
        elif kind is FailAction.STOP and not CAN_STOP:
            raise ValueError(
                f"{ENV_VAR}: {part!r}: stop sends the process SIGSTOP, which this platform"
                " does not have (POSIX only)"
            )
        else:
            points[name] = Failpoint(kind)
    return points
