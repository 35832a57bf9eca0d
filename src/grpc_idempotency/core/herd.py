"""How a herd of duplicates waiting on one key in this process is answered once its outcome is in.

Why pace them
-------------
Duplicates of a key that this process is executing wait on the local owner. Answered all at
once, a herd of N becomes N tasks ready in one event-loop iteration, each sending the replay
marker and the stored response: the loop runs all of them before it reads a socket again, and
every other call on the server waits behind the herd. Measured (``benchmarks/bench_server.py``,
storms of 200 duplicates on 2 cores): other keys' p99 went to 1.8-2.3x what the same 200 calls
cost unkeyed (the control storm), whose answers are spread naturally by their arrival times.
Released a few at a time, a batch per interval, the herd costs other calls what the control
storm costs them (1.04-1.07x of it with 8 per 2 ms), and its last duplicate is answered
``interval_s * (N / per_batch - 1)`` later: 48 ms for 200. A duplicate has already waited for
the whole execution; the others had not asked to wait at all.

No duplicate waits past its own budget for pacing: one whose wait runs out while it is queued
takes the outcome that is already there instead of giving up (``interceptor._wait_for_owner``).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpc_idempotency.core.seconds import checked_seconds


@dataclass(frozen=True, slots=True)
class HerdRelease:
    """``per_batch`` waiting duplicates are answered at once, the next ``per_batch``
    ``interval_s`` later, and so on. The default releases 4,000 a second."""

    per_batch: int = 8
    interval_s: float = 0.002

    def __post_init__(self) -> None:
        # Checked here, not when a herd is released: that happens in the owner's ``finally``,
        # after its commit, where a bad value would turn a committed answer into an error.
        if isinstance(self.per_batch, bool) or not isinstance(self.per_batch, int):
            # TypeError, as every other setting of the wrong type (2.5 or True is no count).
            raise TypeError(f"HerdRelease.per_batch must be an int, not {self.per_batch!r}")
        if self.per_batch < 1:
            raise ValueError("HerdRelease.per_batch must be at least 1")
        # Capped: 10**400 (below math.inf) made the release (in the owner's ``finally``, after
        # its commit) raise OverflowError from call_later.
        checked_seconds("HerdRelease.interval_s", self.interval_s)

    def batches(self, waiting: int) -> list[tuple[float, int, int]]:
        """``(delay_s, start, stop)`` for each batch of ``waiting`` duplicates in arrival order:
        those at ``[start:stop]`` are answered ``delay_s`` after the outcome is in."""
        return [
            (self.interval_s * i, start, min(start + self.per_batch, waiting))
            for i, start in enumerate(range(0, waiting, self.per_batch))
        ]
