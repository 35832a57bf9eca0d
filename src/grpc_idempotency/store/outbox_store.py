"""The relay's side of the transactional outbox: claim due rows, mark them, park and revive dead
letters, purge. The only place that talks to PostgreSQL about outbox delivery.

Claims are short transactions of their own: ``UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED)``
takes a batch of due pending rows and gives them a lease (``locked_until``, and ``next_attempt_at``
moved to the same instant, so a claimed row is simply not due until its lease runs out), commits,
and only then are the messages delivered. No transaction stays open across deliveries. A relay that
dies after delivering and before marking leaves its rows claimed; they become due again when the
lease expires, and are delivered again (at least once; receivers dedupe on the key).

Every claim increments ``attempts`` and records the relay as ``claimed_by``; marking a row
(``sent``, rescheduled, ``dead``) requires both to be unchanged, so a relay that stalled past its
lease and was overtaken by another cannot overwrite the newer claim's outcome.

A claim that ended with no outcome leaves ``locked_until`` set (every mark clears it), so a due
pending row with ``locked_until`` set lost its last claim: the relay died or stalled delivering
its batch. Such a row is claimed **alone**, and its ``lost_claims`` goes up; a row whose delivery
kills relays then takes no other row down with it again, and only it runs up lost claims (see
``core.outbox``). Rows are claimed in due order, lost or not, so neither kind starves the other.

Every statement that locks or changes outbox rows runs at READ COMMITTED, whatever the
database's default (``Store.read_committed``: no session state, safe behind PgBouncer).
``SKIP LOCKED`` and the re-check of a row another relay changed meanwhile rely on it: at
REPEATABLE READ (a database or role whose ``default_transaction_isolation`` says so) a row
claimed, marked or deleted by another relay since the statement began is a serialization
failure (40001), which a relay would take for an outage.

The database's clock (``clock_timestamp()``) decides every time: due, lease, retention.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import asyncpg

from grpc_idempotency.core.errors import StoreUnavailable
from grpc_idempotency.core.outbox import StepRoutes
from grpc_idempotency.core.seconds import checked_seconds
from grpc_idempotency.store.dsn_files import dsn_where
from grpc_idempotency.store.errors import (
    STORE_ERRORS,
    PasswordFailed,
    from_the_driver,
    password_error,
    store_error,
)
from grpc_idempotency.store.postgres import PooledConnection, Store, _connection_gone
from grpc_idempotency.store.sql import schema_identifier

T = TypeVar("T")

_SELECT_MESSAGE = (
    "o.id, o.scope, o.key, o.step, o.method, o.payload_type, o.payload, o.attempts, o.failures,"
    " o.lost_claims, o.created_at, o.trace_context::text AS trace_context"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class OutboxMessage:
    """One claimed outbox row, as a sink receives it."""

    id: int
    scope: str
    """The scope of the keyed call that enqueued it."""
    key: str
    """The outbox step's child key: the same on every delivery; receivers dedupe on it."""
    step: str
    """The declared outbox step, e.g. ``order-created-event.v1``."""
    method: str
    """The gRPC method whose handler enqueued it."""
    payload_type: str
    """The protobuf full name of the payload, e.g. ``checkout.v1.OrderCreated``."""
    payload: bytes
    """The serialized message (deterministic serialization)."""
    attempts: int
    """Deliveries of this row begun so far, this one included: 1 on the first delivery."""
    created_at: datetime
    failures: int = 0
    """Failed deliveries of this row recorded so far (claims lost with their relay excluded)."""
    lost_claims: int = 0
    """Claims of this row in a row, just before this one, that ended with no recorded outcome
    (their relay died or stalled past its lease). When positive, this row was claimed alone."""
    trace_context: str | None = None
    """The propagation carrier (a JSON object, W3C ``traceparent`` by default) of the span that
    was current when the message was enqueued, that the relay's delivery span links to; ``None``
    when there was none (tracing off), or for a row enqueued before migration 0018."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """A failed delivery to record: rescheduled ``delay_s`` from now, or dead when ``None``."""

    id: int
    attempts: int
    delay_s: float | None
    error: str


@dataclass(frozen=True, kw_only=True, slots=True)
class DeadLetter:
    id: int
    scope: str
    key: str
    step: str
    method: str
    payload_type: str
    attempts: int
    last_error: str | None
    created_at: datetime
    dead_since: datetime
    claimed_by: str | None


class OutboxStatements:
    """The relay's statements for one schema, formatted once."""

    def __init__(self, schema: str) -> None:
        s = schema_identifier(schema)
        self.channel = f"{schema}_outbox"
        """The LISTEN channel; the outbox's insert trigger notifies it (migration 0006)."""
        self.table_exists = "SELECT pg_catalog.to_regclass($1) IS NOT NULL"
        self.table_name = f"{s}.outbox"
        # $1 batch size, $2 lease in seconds, $3 relay name. The row's next_attempt_at moves to
        # the end of the lease: the claimed row leaves the "due" range of the outbox_due index,
        # other relays skip it without looking at locked_until, and if this relay dies the row
        # is due again exactly when the lease ends. In READ COMMITTED, FOR UPDATE re-checks the
        # WHERE clause against the newest version of a row that another relay claimed (and
        # committed) meanwhile, so a row is never claimed twice within one lease.
        #
        # The first due row decides: lost (its locked_until still set), it is taken alone;
        # otherwise up to $1 due rows that are not lost are. A lost row behind the head waits
        # for a claim of its own, which it gets once the rows before it in due order are
        # claimed: no kind of row starves the other. Only the rows taken (and the head) are
        # locked, so a relay claiming at the same time takes the next rows, lost or not.
        self.claim = _claim(s, "")
        # The same for a relay routed by step (``core.outbox.StepRoutes``): $4 its step names,
        # $5 its steps' names without version. Filtered in the walk of outbox_due, before the
        # row locks: other steps' rows are neither locked nor claimed (nor taken as the head).
        self.claim_routed = _claim(s, _routed(4))
        # $1 ids, $2 attempts (the claim's), $3 relay name. The ids of the rows this claim has
        # marked sent, now or before (the relay ends the span of a row not among them
        # unrecorded, in the same round trip): run again after its answer was lost
        # (``OutboxStore._once_more_if_gone``), it found its rows sent, not pending, and they
        # went uncounted (``RelayStats.unrecorded``). A row sent under the same claim (attempts,
        # the fencing token, and relay unchanged) can only be this claim's own mark; a row
        # another claim took over has other attempts and is not counted. "already" reads the
        # statement's snapshot, from before "marked" changed anything: no row is in both.
        self.mark_sent = f"""
            WITH d AS (
                SELECT * FROM ROWS FROM (pg_catalog.unnest($1::bigint[]),
                                         pg_catalog.unnest($2::integer[])) AS d(id, attempts)),
            marked AS (
                UPDATE {s}.outbox o
                SET state = 'sent', sent_at = pg_catalog.clock_timestamp(), locked_until = NULL
                FROM d
                WHERE o.id = d.id AND o.attempts = d.attempts AND o.claimed_by = $3
                  AND o.state = 'pending'
                RETURNING o.id),
            already AS (
                SELECT o.id FROM {s}.outbox o JOIN d ON o.id = d.id AND o.attempts = d.attempts
                WHERE o.claimed_by = $3 AND o.state = 'sent')
            SELECT id FROM marked UNION ALL SELECT id FROM already"""
        # $1 ids, $2 attempts, $3 delays (NULL: dead), $4 errors, $5 relay name. A dead row's
        # next_attempt_at records when it was parked (purge-dead --older-than counts from it).
        # locked_until: still under the claim (every mark clears it), so that the statement run
        # again after its answer was lost (``OutboxStore._once_more_if_gone``) counts no failure
        # twice on a row it rescheduled, still pending with the same claim. Returns the id and
        # state of every row this claim has recorded a failure for, now or before (as mark_sent
        # counts): a row of the same claim that is dead, or pending with its lease cleared, was
        # marked by this statement's first run, whose answer was lost.
        self.mark_failed = f"""
            WITH f AS (
                SELECT * FROM ROWS FROM (pg_catalog.unnest($1::bigint[]),
                                         pg_catalog.unnest($2::integer[]),
                                         pg_catalog.unnest($3::float8[]),
                                         pg_catalog.unnest($4::text[]))
                    AS f(id, attempts, delay_s, error)),
            marked AS (
                UPDATE {s}.outbox o
                SET state = CASE WHEN f.delay_s IS NULL THEN 'dead' ELSE 'pending' END,
                    failures = o.failures + 1,
                    next_attempt_at = pg_catalog.clock_timestamp()
                        + pg_catalog.make_interval(secs => COALESCE(f.delay_s, 0)),
                    locked_until = NULL,
                    last_error = f.error
                FROM f
                WHERE o.id = f.id AND o.attempts = f.attempts AND o.claimed_by = $5
                  AND o.state = 'pending' AND o.locked_until IS NOT NULL
                RETURNING o.id, o.state)
            SELECT id, state FROM marked
            UNION ALL
            SELECT o.id, o.state FROM {s}.outbox o JOIN f ON o.id = f.id AND o.attempts = f.attempts
            WHERE o.claimed_by = $5
              AND (o.state = 'dead' OR (o.state = 'pending' AND o.locked_until IS NULL))"""
        # $1 ids, $2 attempts, $3 relay name: claims given back undelivered (the relay was
        # cancelled mid-batch). Due at once, as if never claimed: locked_until cleared, so the
        # next claim takes the row with its batch and counts no lost claim, and no failure is
        # recorded. Fenced as the marks are: a claim taken over after its lease is not touched.
        self.release = f"""
            WITH r AS (
                SELECT * FROM ROWS FROM (pg_catalog.unnest($1::bigint[]),
                                         pg_catalog.unnest($2::integer[])) AS r(id, attempts))
            UPDATE {s}.outbox o
            SET locked_until = NULL, next_attempt_at = pg_catalog.clock_timestamp()
            FROM r
            WHERE o.id = r.id AND o.attempts = r.attempts AND o.claimed_by = $3
              AND o.state = 'pending' AND o.locked_until IS NOT NULL
            RETURNING o.id"""
        # Seconds until the earliest pending row is due (negative: overdue); NULL: none pending.
        self.next_due_in = f"""
            SELECT EXTRACT(EPOCH FROM
                pg_catalog.min(next_attempt_at) - pg_catalog.clock_timestamp())::float8
            FROM {s}.outbox WHERE state = 'pending'"""
        # $1 step names, $2 names without version: a routed relay's next row. Other steps'
        # due rows, counted, kept it claiming in a loop (nothing of its own due) while their
        # relay was down; their retries woke it early.
        self.next_due_in_routed = self.next_due_in + _routed(1)
        # $1 batch size, $2 age in seconds; bounded batches that skip locked rows. The bound is
        # statement_timestamp(), not clock_timestamp(): a volatile bound cannot be an index
        # condition (outbox_done), and every purge read all the sent rows. Each batch is a
        # statement in its own transaction, so the two agree.
        self.purge_sent = f"""
            WITH doomed AS (
                SELECT id FROM {s}.outbox
                WHERE state = 'sent'
                  AND sent_at
                      <= pg_catalog.statement_timestamp() - pg_catalog.make_interval(secs => $2)
                LIMIT $1 FOR UPDATE SKIP LOCKED)
            DELETE FROM {s}.outbox o USING doomed d WHERE o.id = d.id"""
        self.purge_dead = f"""
            WITH doomed AS (
                SELECT id FROM {s}.outbox
                WHERE state = 'dead'
                  AND next_attempt_at
                      <= pg_catalog.statement_timestamp() - pg_catalog.make_interval(secs => $2)
                LIMIT $1 FOR UPDATE SKIP LOCKED)
            DELETE FROM {s}.outbox o USING doomed d WHERE o.id = d.id"""
        self.dead_letters = f"""
            SELECT id, scope, key, step, method, payload_type, attempts, last_error, created_at,
                   next_attempt_at AS dead_since, claimed_by
            FROM {s}.outbox WHERE state = 'dead' ORDER BY id LIMIT $1"""
        # $1 ids, or NULL for every dead row. Back to pending, due now, the failures and lost
        # claims (what parks a row) from zero; last_error stays as a record of why it died.
        # attempts goes on counting: it is the claims' fencing token, and from zero the next
        # claim had the number of one made before the row died, whose relay, stalled under the
        # same name, then recorded its outcome over the live claim's.
        self.retry_dead = f"""
            UPDATE {s}.outbox
            SET state = 'pending', failures = 0, lost_claims = 0,
                next_attempt_at = pg_catalog.clock_timestamp(),
                locked_until = NULL, claimed_by = NULL
            WHERE state = 'dead' AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))"""
        self.notify = "SELECT pg_catalog.pg_notify($1, '')"
        self.notify_with = "SELECT pg_catalog.pg_notify($1, $2)"
        self.counts = f"""
            SELECT state, pg_catalog.count(*) AS n,
                   pg_catalog.count(*) FILTER (WHERE state = 'pending'
                                    AND next_attempt_at <= pg_catalog.clock_timestamp()) AS due,
                   pg_catalog.count(*) FILTER (WHERE state = 'pending'
                                    AND locked_until > pg_catalog.clock_timestamp()) AS claimed,
                   EXTRACT(EPOCH FROM
                       pg_catalog.clock_timestamp() - pg_catalog.min(created_at))::float8
                       AS oldest_s
            FROM {s}.outbox GROUP BY state"""


def _claim(s: str, routed: str) -> str:
    """The claim statement on schema ``s`` (quoted), its candidate rows narrowed by ``routed``
    (an ``AND ...`` clause, or empty)."""
    return f"""
            WITH lease AS (
                SELECT pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $2)
                    AS until),
            head AS (
                SELECT id, locked_until IS NOT NULL AS lost FROM {s}.outbox
                WHERE state = 'pending' AND next_attempt_at <= pg_catalog.clock_timestamp(){routed}
                ORDER BY next_attempt_at, id
                LIMIT 1
                FOR UPDATE SKIP LOCKED),
            batch AS (
                SELECT id FROM {s}.outbox
                WHERE state = 'pending' AND next_attempt_at <= pg_catalog.clock_timestamp()
                  AND locked_until IS NULL AND NOT EXISTS (SELECT FROM head WHERE lost){routed}
                ORDER BY next_attempt_at, id
                LIMIT $1
                FOR UPDATE SKIP LOCKED),
            taken AS (SELECT id FROM head WHERE lost UNION ALL SELECT id FROM batch)
            UPDATE {s}.outbox o
            SET attempts = o.attempts + 1, claimed_by = $3,
                lost_claims = CASE WHEN o.locked_until IS NULL THEN 0 ELSE o.lost_claims + 1 END,
                locked_until = lease.until, next_attempt_at = lease.until
            FROM taken, lease
            WHERE o.id = taken.id
            RETURNING {_SELECT_MESSAGE}"""


def _routed(first: int) -> str:
    """The rows of a routed relay's steps (``StepRoutes.matches``, in SQL): parameter ``first``
    holds the step names taken exactly, the next one the names taken in every version. A step
    name (``STEP_NAME``, all an outbox row's step can be) holds one dot, before its version, so
    the part before it is ``core.keys.step_base``'s ("receipt-email.v2" -> "receipt-email"):
    split_part costs a fifth of the regular expression that cut the version off, per row
    walked past (another step's due rows, when its relay lags)."""
    return (
        f" AND (step = ANY(${first}::text[])"
        f" OR pg_catalog.split_part(step, '.', 1) = ANY(${first + 1}::text[]))"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StateCount:
    rows: int
    due: int
    """Pending rows due now (not claimed, not waiting for a retry)."""
    claimed: int
    """Pending rows under a relay's lease (being delivered, or left by a relay that died)."""
    oldest_s: float | None
    """Age of the oldest row in this state, in seconds."""


class OutboxStore:
    """Outbox delivery operations on a ``Store``'s pool and schema. Database errors become
    ``StoreUnavailable``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.statements = OutboxStatements(store.schema)

    @property
    def channel(self) -> str:
        return self.statements.channel

    async def listen(
        self,
        on_notify: Callable[..., None],
        *,
        dsn: str | None = None,
        connect_timeout: float = 60.0,
    ) -> Listener:
        """A session that LISTENs on ``channel`` and calls ``on_notify`` per notification: a
        connection of the pool, or one of its own to ``dsn`` (PostgreSQL itself, when the pool
        goes through a transaction pooler, where LISTEN cannot hold)."""
        doing = "opening the outbox's LISTEN session"
        if dsn is not None:
            # Not the store's own address, which the log names: where this one goes.
            doing += f" on listen_dsn {dsn_where(dsn)}"
        conn: asyncpg.Connection[Any] | PooledConnection
        try:
            if dsn is None:
                conn = await self.store.pool.acquire()
            else:
                conn = await asyncpg.connect(
                    dsn,
                    timeout=connect_timeout,
                    server_settings={"application_name": "grpc-idempotency"},
                )
        except (ValueError, IndexError, OverflowError) as exc:
            if dsn is None:
                raise
            if isinstance(exc, OSError):
                # ssl.SSLCertVerificationError, a ValueError too: the server's certificate
                # failed verify-full, a connection failure, not a DSN that does not parse.
                raise store_error(exc, doing, store=self.store.store_log) from exc
            # Never the driver's text, which quotes pieces of the DSN (of a password holding an
            # unencoded / ? #).
            raise ValueError(
                "the listen DSN cannot be parsed: percent-encode special characters in its password"
            ) from None
        except PasswordFailed as exc:  # the pool's password= callable (Store.connect)
            raise password_error(exc, doing, store=self.store.store_log) from exc.__cause__
        except STORE_ERRORS as exc:
            raise store_error(exc, doing, store=self.store.store_log) from exc
        listener = Listener(self, conn, pooled=dsn is None)
        try:
            await conn.add_listener(self.channel, on_notify)
        except BaseException as exc:
            await listener.close()
            if from_the_driver(exc):
                raise store_error(exc, doing, store=self.store.store_log) from exc
            raise
        return listener

    async def exists(self) -> bool:
        """Whether the outbox table is there (the schema is migrated)."""
        async with self.store.connection("looking for the outbox") as conn:
            found: bool = await conn.fetchval(
                self.statements.table_exists, self.statements.table_name
            )
        return found

    @contextlib.asynccontextmanager
    async def _at_read_committed(self, doing: str) -> AsyncIterator[PooledConnection]:
        """A store connection whose statements run at READ COMMITTED (``Store.read_committed``)."""
        async with self.store.connection(doing) as conn, self.store.read_committed(conn):
            yield conn

    async def _once_more_if_gone(
        self,
        doing: str,
        run: Callable[[PooledConnection], Awaitable[T]],
        *,
        mark: bool = False,
    ) -> T:
        """``run(conn)`` at READ COMMITTED; once more, on a connection opened now, if the pooled
        one was found gone (a restart or a failover: the pool's others are expired then), as
        the store's claims and look-ups do. Safe for the relay's statements: a mark changes
        only rows still under the claim, so one that ran before its answer was lost changes
        nothing the second time (and counts those rows as this claim's, recorded); a claim that
        did leaves its rows to come back after the lease (a lost claim), as it would have
        without the second try.

        Not tried again, a mark left the whole batch claimed (delivered again after the lease,
        each row counted a lost claim and claimed alone), and a claim raised StoreUnavailable
        from ``run_once``/``drain``, the database up.

        ``mark``: ``run`` is a mark, which counts the rows its claim recorded. Tried again, it
        runs twice, and the second run's count is the answer. The first try may still be running
        in PostgreSQL, waiting on a row lock (it notices its client gone only when it answers),
        and commit once the second began: that one read those rows as its snapshot had them,
        pending, then found them changed, and counted them taken over, though this very claim
        had recorded them. It waited for every row the first try held, so once it is done the
        first try has committed whatever it recorded, and a statement begun then (a snapshot of
        its own) counts it."""
        tries = 2
        for tried in range(1, tries + 1):
            try:
                async with self._at_read_committed(doing) as conn:
                    if tried > 1 and mark:
                        await run(conn)
                    return await run(conn)
            except StoreUnavailable as exc:
                if tried == tries or not _connection_gone(exc.__cause__ or exc):
                    raise
        raise AssertionError("unreachable")

    async def claim(
        self, *, relay: str, limit: int, lease_s: float, steps: StepRoutes | None = None
    ) -> list[OutboxMessage]:
        """Claims up to ``limit`` due pending rows for ``lease_s`` seconds (committed at once);
        only rows of ``steps`` (``core.outbox.step_routes``), unless ``None``."""

        async def claim(conn: PooledConnection) -> list[Any]:
            if steps is None:
                return await conn.fetch(self.statements.claim, limit, lease_s, relay)
            return await conn.fetch(
                self.statements.claim_routed,
                limit,
                lease_s,
                relay,
                list(steps.names),
                list(steps.bases),
            )

        rows = await self._once_more_if_gone("claiming outbox rows", claim)
        messages = [
            OutboxMessage(
                id=r["id"],
                scope=r["scope"],
                key=r["key"],
                step=r["step"],
                method=r["method"],
                payload_type=r["payload_type"],
                payload=bytes(r["payload"]),
                attempts=r["attempts"],
                created_at=r["created_at"],
                failures=r["failures"],
                lost_claims=r["lost_claims"],
                trace_context=r["trace_context"],
            )
            for r in rows
        ]
        messages.sort(key=lambda m: m.id)
        return messages

    async def mark_sent(self, *, relay: str, claims: Sequence[tuple[int, int]]) -> int:
        """Marks delivered rows (``(id, attempts)`` of their claims) sent; returns how many are
        sent under these claims (the others were taken over after their lease expired), those
        a first try whose answer was lost marked included."""
        return len(await self.mark_sent_ids(relay=relay, claims=claims))

    async def mark_sent_ids(
        self, *, relay: str, claims: Sequence[tuple[int, int]]
    ) -> frozenset[int]:
        """``mark_sent``, returning the ids of the rows sent under these claims: a row missing
        was taken over after its lease expired, and is delivered again."""
        if not claims:
            return frozenset()

        async def mark(conn: PooledConnection) -> list[Any]:
            return await conn.fetch(
                self.statements.mark_sent, [c[0] for c in claims], [c[1] for c in claims], relay
            )

        rows = await self._once_more_if_gone("marking outbox rows sent", mark, mark=True)
        return frozenset(r["id"] for r in rows)

    async def mark_failed(self, *, relay: str, failures: Sequence[Failure]) -> tuple[int, int]:
        """Reschedules failed rows, or parks them as dead letters; returns (rescheduled, dead)
        among the rows still claimed by this relay, those a first try whose answer was lost
        recorded included."""
        states = await self.mark_failed_states(relay=relay, failures=failures)
        dead = sum(1 for state in states.values() if state == "dead")
        return len(states) - dead, dead

    async def mark_failed_states(
        self, *, relay: str, failures: Sequence[Failure]
    ) -> dict[int, str]:
        """``mark_failed``, returning each recorded row's id and state (``pending``: to retry,
        ``dead``); a row missing was taken over after its lease expired."""
        if not failures:
            return {}

        async def mark(conn: PooledConnection) -> list[Any]:
            return await conn.fetch(
                self.statements.mark_failed,
                [f.id for f in failures],
                [f.attempts for f in failures],
                [f.delay_s for f in failures],
                [_text(f.error) for f in failures],
                relay,
            )

        rows = await self._once_more_if_gone("recording failed deliveries", mark, mark=True)
        return {r["id"]: r["state"] for r in rows}

    async def release(self, *, relay: str, claims: Sequence[tuple[int, int]]) -> int:
        """Gives back claims (``(id, attempts)``) whose rows were not delivered: pending and due
        at once, no failure or lost claim counted; returns how many this changed (a claim taken
        over after its lease, or already given back, is left alone)."""
        if not claims:
            return 0

        async def release(conn: PooledConnection) -> list[Any]:
            return await conn.fetch(
                self.statements.release, [c[0] for c in claims], [c[1] for c in claims], relay
            )

        # Tried again on a fresh connection, it changes nothing its first try changed.
        return len(await self._once_more_if_gone("releasing outbox claims", release))

    async def next_due_in(self, *, steps: StepRoutes | None = None) -> float | None:
        """Seconds until the earliest pending row (of ``steps``, unless ``None``) is due (<= 0:
        due now), ``None``: none."""
        async with self.store.connection("looking for due outbox rows") as conn:
            value: float | None
            if steps is None:
                value = await conn.fetchval(self.statements.next_due_in)
            else:
                value = await conn.fetchval(
                    self.statements.next_due_in_routed, list(steps.names), list(steps.bases)
                )
        return value

    async def purge_sent(
        self,
        *,
        older_than_s: float,
        batch_size: int = 1000,
        max_batches: int | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> int:
        """Deletes rows sent more than ``older_than_s`` seconds ago, in bounded batches.
        ``on_batch``: called with each committed batch's count (``Store.purge``'s)."""
        return await self._purge(
            self.statements.purge_sent, older_than_s, batch_size, max_batches, on_batch
        )

    async def purge_dead(
        self,
        *,
        older_than_s: float = 0.0,
        batch_size: int = 1000,
        max_batches: int | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> int:
        """Deletes dead letters parked more than ``older_than_s`` seconds ago (``on_batch``: as
        ``purge_sent``'s)."""
        return await self._purge(
            self.statements.purge_dead, older_than_s, batch_size, max_batches, on_batch
        )

    async def _purge(
        self,
        sql: str,
        older_than_s: float,
        batch_size: int,
        max_batches: int | None,
        on_batch: Callable[[int], None] | None,
    ) -> int:
        # Past the cap the database cannot take it from its clock (22008), which read as the
        # store being down.
        checked_seconds("older_than_s", older_than_s)
        # Each batch at READ COMMITTED (Store.purge_in_batches): relays purge side by side, and
        # at REPEATABLE READ a row another one deleted since the batch began would fail it.
        return await self.store.purge_in_batches(
            "purging outbox rows",
            sql,
            float(older_than_s),
            batch_size=batch_size,
            max_batches=max_batches,
            on_batch=on_batch,
        )

    async def dead_letters(self, *, limit: int = 1000) -> list[DeadLetter]:
        if not isinstance(limit, int) or not 1 <= limit <= BIGINT_MAX:
            # Past bigint (or not a whole number) PostgreSQL never saw it: asyncpg's DataError
            # was reported as the store being unavailable.
            raise ValueError(f"limit must be a whole number from 1 to {BIGINT_MAX}: {limit!r}")
        async with self.store.connection("listing dead letters") as conn:
            rows = await conn.fetch(self.statements.dead_letters, limit)
        return [DeadLetter(**dict(r)) for r in rows]

    async def retry_dead(self, ids: Sequence[int] | None) -> int:
        """Puts dead letters (``ids``, or all of them with ``None``) back to pending, due now,
        with their failures and lost claims from zero (``attempts``, the claims' fencing token,
        goes on counting), and wakes the relays; returns how many."""
        if ids is not None:
            ids = list(ids)
            for id_ in ids:
                if not isinstance(id_, int) or not -BIGINT_MAX - 1 <= id_ <= BIGINT_MAX:
                    # As for dead_letters' limit: a DataError read as the store being down.
                    raise ValueError(f"a dead letter's id is a bigint: {id_!r}")
        async with self._at_read_committed("retrying dead letters") as conn:
            status = await conn.execute(self.statements.retry_dead, ids)
            count = int(status.split()[-1])
            if count:
                await conn.execute(self.statements.notify, self.channel)
        return count

    async def notify_listeners(self, payload: str, *, timeout: float) -> None:
        """Sends ``NOTIFY <channel>, payload`` through the store's pool, so on the store's own
        database (a relay checks that its ``listen_dsn`` hears it). Raises
        ``StoreUnavailable``."""
        async with self.store.connection("notifying the outbox's listeners", timeout) as conn:
            await conn.execute(self.statements.notify_with, self.channel, payload, timeout=timeout)

    async def counts(self) -> dict[str, StateCount]:
        """Rows per state (``pending``, ``sent``, ``dead``; absent states are left out)."""
        async with self.store.connection("counting outbox rows") as conn:
            rows = await conn.fetch(self.statements.counts)
        return {
            r["state"]: StateCount(
                rows=r["n"], due=r["due"], claimed=r["claimed"], oldest_s=r["oldest_s"]
            )
            for r in rows
        }


BIGINT_MAX = 2**63 - 1
"""The largest id or count the outbox's statements take (bigint parameters)."""


def _text(value: str, limit: int = 2000) -> str:
    """An error message fit for a text column: no NUL, no lone surrogate (text decoded with
    surrogateescape: PostgreSQL refused it, and the whole batch's failures went unrecorded),
    bounded length."""
    value = value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\ufffd")
    return value if len(value) <= limit else value[: limit - 1] + "\u2026"


class Listener:
    """A session LISTENing for new outbox rows (``OutboxStore.listen``). ``lost`` is set when the
    connection drops; ``close()`` ends it (never handed back to the pool with LISTEN on it)."""

    def __init__(
        self, outbox: OutboxStore, conn: asyncpg.Connection[Any] | PooledConnection, *, pooled: bool
    ) -> None:
        self._outbox = outbox
        self._conn = conn
        self._pooled = pooled
        self.lost = asyncio.Event()
        conn.add_termination_listener(self._on_lost)

    def _on_lost(self, *_args: object) -> None:
        self.lost.set()

    async def still_listening(self, *, timeout: float) -> bool:
        """Whether this session still listens: a link that died silently (no FIN) shows up only
        when used (it raises), and a LISTEN that went to a pooled server connection (PgBouncer in
        transaction mode) as a session that is not listening (``False``)."""
        try:
            listening: bool = await self._conn.fetchval(
                _LISTENS_SQL, self._outbox.channel, timeout=timeout
            )
        except STORE_ERRORS as exc:  # the driver's own, raw, through the public API
            raise store_error(
                exc, "checking the outbox's LISTEN session", store=self._outbox.store.store_log
            ) from exc
        return listening

    async def close(self) -> None:
        # Closed rather than reused (the pool's reset is a no-op, so LISTEN would stay on it);
        # the pool opens a fresh connection when it needs one. A connection that was lost has
        # already gone back to the pool (asyncpg detached the proxy): nothing left to do then.
        with contextlib.suppress(asyncpg.InterfaceError):
            self._conn.remove_termination_listener(self._on_lost)
            self._conn.terminate()
        if self._pooled:
            with contextlib.suppress(asyncpg.InterfaceError):
                await self._outbox.store.pool.release(self._conn)  # type: ignore[arg-type]


# Whether this session listens on the channel ($1).
_LISTENS_SQL = "SELECT $1::text IN (SELECT pg_catalog.pg_listening_channels())"
