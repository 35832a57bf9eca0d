"""Outbox decisions: which step a message belongs to, and how deliveries are retried.

A message enqueued by a keyed handler is keyed by the child key of a declared outbox step, so a
re-run of the handler (a retry, a takeover) enqueues nothing new, and every delivery of it carries
the same key for the receiver to dedupe. Delivery is at least once: a failed delivery waits an
exponentially growing, jittered delay; after ``max_attempts`` the row is parked as a dead letter
so that one poison message does not hold up the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from grpc_idempotency.core.errors import StepUndeclared
from grpc_idempotency.core.keys import child_key
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.propagation import as_of


def outbox_step(
    method: str, steps: tuple[Step, ...], name: str, started_at: datetime | None
) -> Step:
    """The declared outbox step ``name`` (or, for an operation begun before it replaced an
    earlier version, that version); ``StepUndeclared`` if ``method`` declares no such step."""
    outbox = [s for s in steps if s.outbox]
    step = next((s for s in outbox if s.name == name and s.active), None)
    if step is None:
        declared = [s.name for s in outbox if s.active]
        raise StepUndeclared(
            f"{method} enqueues outbox step {name!r}, but its declared outbox steps are"
            f' {declared}: add steps: {{ name: "{name}" outbox: true }} to its options'
        )
    return as_of(step, outbox, started_at)


def message_key(scope: str, parent_key: str, step: Step) -> str:
    return child_key(scope, parent_key, step.name)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeliveryPolicy:
    """How a relay retries a failed delivery: exponential backoff with full jitter from
    ``initial_backoff_s`` up to ``max_backoff_s``, then a dead letter after ``max_attempts``."""

    max_attempts: int = 10
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 300.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("backoffs must be positive, and max_backoff_s >= initial_backoff_s")

    def after_failure(self, attempts: int, jitter: float) -> float | None:
        """Seconds until the next delivery after ``attempts`` failed ones, or ``None``: park the
        row as a dead letter. ``jitter`` in [0, 1) spreads retries (half fixed, half random)."""
        if attempts >= self.max_attempts:
            return None
        ceiling = min(
            self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempts - 1)
        )
        return ceiling * (0.5 + jitter / 2)
