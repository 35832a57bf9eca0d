"""Completed outcomes kept in memory, so that a replay costs no database round trip.

Why a cached outcome is still the truth on every replica
--------------------------------------------------------
A COMPLETED record does not change until it expires, at
``GREATEST(expires_at, completed_at + retention)`` by the database's clock: the claim takes over
only expired records, purge deletes only expired records, and renew and release touch only
IN_PROGRESS ones. So the outcome under (scope, key), once committed, is the answer for that key
on every replica until that instant, and a replica may answer from memory until then.

The cache never learns that instant exactly, so each entry keeps a bound that is provably no
later, taken on a clock of this process that keeps counting while the machine is suspended
(the interceptor's ``_cache_clock``: CLOCK_BOOTTIME on Linux; CLOCK_MONOTONIC stops then, the
database's clock does not):

- an outcome this process committed: the commit statement was *sent* at ``sent`` (read before
  the round trip), so PostgreSQL's ``completed_at`` is later, and the record lives at least until
  ``sent + retention``;
- an outcome read by a look-up: the database computed the record's remaining life ``life`` at some
  instant after the look-up was sent at ``sent``, so the record lives at least until
  ``sent + life``.

Both are shortened by ``CLOCK_RATE_MARGIN`` (the two clocks may run at rates that differ by up to
NTP's 500 ppm slew) and by ``CLOCK_STEP_MARGIN_S`` (the wall clock PostgreSQL reads may be
stepped forward under the monotonic one: time daemons step offsets they will not slew, and
virtual machines are stepped by their hosts), and bounded by the cache's ``max_age``, which
bounds what the library cannot see: an operator deleting a record by hand, or a failover that
lost committed transactions. The fingerprint is still compared on every hit, so a mutated retry
is refused as it would be by the database. Nothing else is cached: in-progress records change
under their owner.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

from grpc_idempotency.core.lifecycle import Outcome

# Rates of this process's monotonic clock and PostgreSQL's clock may differ (NTP slews a clock
# by up to 500 ppm): a bound derived on one and spent on the other is shortened by twice that.
CLOCK_RATE_MARGIN = 1e-3

# The wall clock may also be stepped forward (chrony's default makestep threshold is 1 s; a
# virtual machine's host steps its guest's clock). A step during an entry's life makes the record
# expire earlier on the monotonic clock than the bound says; a cached copy outlived its record by a
# few milliseconds once on CI. A second off the end of a record's life costs the cache nothing it
# needs (entries live at most max_age, 60 s by default, and a default record lives a day).
CLOCK_STEP_MARGIN_S = 1.0

Slot = tuple[str, str]
"""(scope, key)"""


@dataclass(frozen=True, slots=True)
class CachedOutcome:
    fingerprint: bytes
    outcome: Outcome
    valid_until: float
    """Monotonic time (seconds) after which the entry is not used."""
    size: int


def entry_size(slot: Slot, fingerprint: bytes, outcome: Outcome) -> int:
    """What an entry weighs against ``max_bytes``: its bytes (the scope alone can be 1 KiB) and
    a fixed overhead."""
    scope, key = slot
    return (
        256
        + len(scope.encode("utf-8", "surrogatepass"))
        + len(key)
        + len(fingerprint)
        + len(outcome.response or b"")
        + len(outcome.details or b"")
        + len(outcome.message.encode("utf-8", "surrogatepass"))
    )


class ReplayCache:
    """A bounded in-process cache of completed outcomes (least recently used out), used by
    ``IdempotencyInterceptor(replay_cache=...)`` to answer replays without the database.

    ``max_entries`` and ``max_bytes`` bound its memory (an outcome larger than an eighth of
    ``max_bytes`` is not kept); ``max_age`` bounds how long any entry is used, on top of the
    record's own retention, which is never exceeded. Pure: the caller passes the monotonic time.
    """

    def __init__(
        self,
        *,
        max_entries: int = 10_000,
        max_bytes: int = 32 * 1024 * 1024,
        max_age: timedelta = timedelta(seconds=60),
    ) -> None:
        for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                # A whole number: None or text was a bare "'>=' not supported", inf (as NaN)
                # disabled the bound, True was one entry.
                # TypeError, as every other setting of the wrong type (max_age's below).
                raise TypeError(f"{name} must be a whole number, not {value!r}")
        if not isinstance(max_age, timedelta):
            # Seconds as a number was a bare "'<=' not supported", naming no setting.
            raise TypeError(f"max_age must be a timedelta (timedelta(seconds=60)), not {max_age!r}")
        if not max_entries >= 1:
            raise ValueError("max_entries must be at least 1")
        if not max_bytes >= 1024:
            raise ValueError("max_bytes must be at least 1024")
        if max_age <= timedelta(0):
            raise ValueError("max_age must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age_s = max_age.total_seconds()
        self._entries: OrderedDict[Slot, CachedOutcome] = OrderedDict()
        self._bytes = 0
        self._store: object = None

    def bind(self, store: object) -> None:
        """Ties the cache to the store whose outcomes it holds (the interceptor does, when given
        this cache): its slots are (scope, key), so a cache shared with an interceptor on
        another store (another database or schema) would answer that store's calls with this
        one's outcomes, and its operations would never run. Interceptors on the same store may
        share one."""
        if self._store is None:
            self._store = store
        elif self._store is not store:
            raise ValueError(
                "this ReplayCache already holds the outcomes of another store: give each store's"
                " interceptors a ReplayCache of their own"
            )

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, slot: Slot, now: float) -> CachedOutcome | None:
        entry = self._entries.get(slot)
        if entry is None:
            return None
        if now >= entry.valid_until:
            self._drop(slot)
            return None
        self._entries.move_to_end(slot)
        return entry

    def put(
        self,
        slot: Slot,
        fingerprint: bytes,
        outcome: Outcome,
        *,
        sent: float,
        life_s: float,
        now: float,
    ) -> None:
        """Keeps ``outcome`` for ``slot``: it was committed, or read, by a statement sent at
        monotonic time ``sent``, and the record lives at least ``life_s`` after that."""
        until = replayable_until(sent=sent, life_s=life_s, now=now, max_age_s=self.max_age_s)
        size = entry_size(slot, fingerprint, outcome)
        if until <= now or size > self.max_bytes // 8:
            return
        if slot in self._entries:
            self._drop(slot)
        self._entries[slot] = CachedOutcome(fingerprint, outcome, until, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)

    def _drop(self, slot: Slot) -> None:
        entry = self._entries.pop(slot)
        self._bytes -= entry.size


def replayable_until(*, sent: float, life_s: float, now: float, max_age_s: float) -> float:
    """The monotonic time until which an outcome may be answered from memory (see the module's
    first lines): never past ``sent + life_s`` shortened for clock rates and steps, nor past
    ``max_age_s`` from ``now``."""
    return min(sent + life_s * (1 - CLOCK_RATE_MARGIN) - CLOCK_STEP_MARGIN_S, now + max_age_s)
