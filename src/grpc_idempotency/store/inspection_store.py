"""Read-only look-ups for ``grpc-idempotency inspect`` and ``list``: records by (scope, key), a
scope's records, and the outbox rows an operation enqueued. The only place these reads talk to
PostgreSQL.

Everything here reads; nothing locks, claims or writes, so an inspection can run beside live
traffic. Times are compared by the database's clock (``clock_timestamp()``), as everywhere in
the store, and each row says when it was read. Look-ups go through the primary key (scope, key)
or the outbox's unique (scope, key); listing a scope walks that scope's part of the primary key.
Database errors become ``StoreUnavailable`` / ``StoreMisconfigured`` (``Store.connection``).

A schema behind this release's migrations is read as it stands (``READABLE_FROM``): in a rolling
upgrade the new command is installed before the schema is migrated. What a reader shows is what
the schema in place does, never what the newer release would do with it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from grpc_idempotency.core.inspection import OutboxEntry, Record, RecordState
from grpc_idempotency.store.postgres import Store
from grpc_idempotency.store.sql import (
    PAST_RETENTION,
    PAST_RETENTION_BEFORE_0014,
    schema_identifier,
)

# What each migration changed in what the read-only commands read, checked for every migration
# up to REVIEWED_THROUGH (a schema before READABLE_FROM, or OUTBOX_READABLE_FROM, is refused):
# - 0006 made the outbox: ``outbox stats`` and ``outbox dead`` read it (OutboxStore's counts and
#   dead_letters), ``inspect`` reads it when it is there;
# - 0007 added the records' retention column, which ``inspect`` and ``list`` select (a completed
#   record's expiry);
# - 0014 made an in-progress claim past its lease and its retention a new key for another
#   request (claim()): before it, ``expired`` is read by the rule the schema's claim() still
#   applies (PAST_RETENTION_BEFORE_0014);
# - the others change nothing these reads select or decide: functions only the servers call
#   (0008, 0009, 0012, 0013, 0015, 0016), the outbox's failures and lost_claims (0010, 0011),
#   the records' claim_attempt (0016), processed_messages' fingerprint (0017: no command reads
#   that table), the outbox's trace_context (0018: a nullable column no command selects).
READABLE_FROM = 7
"""The oldest schema version ``inspect`` and ``list`` read (``Store.check_schema``)."""
OUTBOX_READABLE_FROM = 6
"""The oldest schema version ``outbox stats`` and ``outbox dead`` read."""
REVIEWED_THROUGH = 18
"""The last migration checked above. A test fails once a newer one ships, until it is checked
too: a schema behind by it alone is read as if it were migrated."""
_ABANDONED_CLAIMS_EXPIRE = 14


def _summary_columns(past_retention: str) -> str:
    """What a listing prints, and more: everything but the stored outcome."""
    return f"""
    scope, key, method, state, fingerprint, fencing_token, created_at, completed_at,
    CASE WHEN state = 'completed' THEN GREATEST(expires_at, completed_at + retention)
         ELSE expires_at END AS expires_at,
    locked_until,
    CASE WHEN state = 'in_progress' AND locked_until IS NOT NULL
         THEN GREATEST(0, EXTRACT(EPOCH FROM
             locked_until - pg_catalog.clock_timestamp()))::float8 END
        AS lease_remaining_s,
    {past_retention} AS expired,
    status_code, pg_catalog.clock_timestamp() AS read_at"""


_STATE_FILTER = {
    None: "TRUE",
    RecordState.IN_PROGRESS: "state = 'in_progress'",
    RecordState.COMPLETED: "state = 'completed' AND status_code = 0",
    RecordState.ERROR: "state = 'completed' AND status_code <> 0",
}


class InspectionStore:
    """Read-only look-ups on a ``Store``'s pool and schema. ``applied``: the schema's migrations
    (``Store.check_schema(readable_from=READABLE_FROM)``), to read one behind as it stands;
    ``None``: migrated."""

    def __init__(self, store: Store, *, applied: Collection[int] | None = None) -> None:
        self.store = store
        s = schema_identifier(store.schema)
        old_rule = applied is not None and _ABANDONED_CLAIMS_EXPIRE not in applied
        summary = _summary_columns(PAST_RETENTION_BEFORE_0014 if old_rule else PAST_RETENTION)
        self._records = (
            f"SELECT {summary}, status_message, status_details, response FROM {s}.records"
        )
        # A listing prints no outcome: reading the stored ones fetched every listed record's
        # response (up to max_response_bytes each) and held them all at once, for nothing.
        self._listed = (
            f"SELECT {summary}, NULL::text AS status_message, NULL::bytea AS status_details,"
            f" NULL::bytea AS response FROM {s}.records"
        )
        self._outbox_table = f"{s}.outbox"
        self._outbox = f"""
            SELECT id, scope, key, step, parent_key, method, payload_type, payload, state,
                   attempts, next_attempt_at, locked_until, claimed_by, last_error, created_at,
                   sent_at
            FROM {s}.outbox
            WHERE scope = $1 AND (key = ANY($2::text[]) OR parent_key = $3)
            ORDER BY id"""

    async def records(self, scope: str, keys: Sequence[str]) -> list[Record]:
        """The records under ``scope`` and any of ``keys`` (through the primary key)."""
        if not keys:
            return []
        async with self.store.connection("inspecting records") as conn:
            rows = await conn.fetch(
                f"{self._records} WHERE scope = $1 AND key = ANY($2::text[])", scope, list(keys)
            )
        return [_record(r) for r in rows]

    async def record(self, scope: str, key: str) -> Record | None:
        """The record under (``scope``, ``key``), or ``None``."""
        found = await self.records(scope, [key])
        return found[0] if found else None

    async def scope_records(
        self,
        scope: str,
        *,
        state: RecordState | None = None,
        method: str | None = None,
        limit: int = 100,
        after: tuple[datetime, str] | None = None,
    ) -> list[Record]:
        """``scope``'s records, newest operation first, at most ``limit``, and only those after
        ``after`` (the (created_at, key) of the last record a page listed) in that order: without
        their outcomes (``response``, ``status_message`` and ``status_details`` are ``None``, not
        read; ``status_code`` is); ``records`` reads a record whole."""
        # The order is total (a key is unique in its scope), so "after" is one place in it that
        # rows inserted meanwhile do not move (keyset paging: inspect_cli/cursor.py). No index
        # serves it: the scope's rows are read (through the primary key's scope prefix) and
        # sorted, as the first page's are; an index would cost every keyed call a write.
        # ``key > $5`` compares under the column's collation, the one ORDER BY sorts by.
        keyset = " AND (created_at < $4 OR (created_at = $4 AND key > $5))" if after else ""
        sql = (
            f"{self._listed} WHERE scope = $1 AND ({_STATE_FILTER[state]})"
            f" AND ($2::text IS NULL OR method = $2){keyset}"
            " ORDER BY created_at DESC, key LIMIT $3"
        )
        async with self.store.connection("listing records") as conn:
            rows = await conn.fetch(sql, scope, method, limit, *(after or ()))
        return [_record(r) for r in rows]

    async def outbox(self, scope: str, parent_key: str, keys: Sequence[str]) -> list[OutboxEntry]:
        """Outbox rows under ``scope`` keyed by one of ``keys`` (the declared outbox steps'
        child keys) or enqueued by the operation ``parent_key``; none when the schema has no
        outbox (migrations before 0006)."""
        async with self.store.connection("inspecting the outbox") as conn:
            if not await conn.fetchval(
                "SELECT pg_catalog.to_regclass($1) IS NOT NULL", self._outbox_table
            ):
                return []
            rows = await conn.fetch(self._outbox, scope, list(keys), parent_key)
        return [_outbox_entry(r) for r in rows]


def _record(row: Any) -> Record:
    return Record(
        scope=row["scope"],
        key=row["key"],
        method=row["method"],
        state=row["state"],
        fingerprint=bytes(row["fingerprint"]),
        fencing_token=row["fencing_token"],
        created_at=row["created_at"],
        completed_at=row["completed_at"],
        expires_at=row["expires_at"],
        locked_until=row["locked_until"],
        lease_remaining_s=row["lease_remaining_s"],
        expired=bool(row["expired"]),
        status_code=row["status_code"],
        status_message=row["status_message"],
        status_details=None if row["status_details"] is None else bytes(row["status_details"]),
        response=None if row["response"] is None else bytes(row["response"]),
        read_at=row["read_at"],
    )


def _outbox_entry(row: Any) -> OutboxEntry:
    return OutboxEntry(
        id=row["id"],
        scope=row["scope"],
        key=row["key"],
        step=row["step"],
        parent_key=row["parent_key"],
        method=row["method"],
        payload_type=row["payload_type"],
        payload=bytes(row["payload"]),
        state=row["state"],
        attempts=row["attempts"],
        next_attempt_at=row["next_attempt_at"],
        locked_until=row["locked_until"],
        claimed_by=row["claimed_by"],
        last_error=row["last_error"],
        created_at=row["created_at"],
        sent_at=row["sent_at"],
    )
