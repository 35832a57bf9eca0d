"""SQL text for the store, and the literal encoding of the hot path's batched statements.

Why literals: the claim and the commit are each sent as one simple-protocol query holding
several statements ("BEGIN; SELECT claim(...); SAVEPOINT ..." and "SELECT complete(...); COMMIT"),
which saves two database round trips per call. Simple-protocol queries take no parameters, so
values are encoded here, and only here:
- text becomes an escape-string literal E'...' with backslashes and quotes doubled, which reads
  the same whatever ``standard_conforming_strings`` says; NUL (which PostgreSQL text cannot hold)
  is refused;
- bytes become E'\\\\x<hex>'::bytea: hex digits only, nothing to escape;
- numbers are formatted from int/float, never from strings;
- an aware datetime becomes its ISO 8601 form in UTC, '...+00:00'::timestamptz (digits and
  separators only), exact to the microsecond PostgreSQL keeps.
Everything else uses ordinary bind parameters.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

# At most 56 characters: the outbox's NOTIFY channel is "<schema>_outbox", and PostgreSQL
# refuses channel names of 64 bytes or more (every enqueue would fail, migrations passing).
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,55}")


def schema_identifier(schema: str) -> str:
    if not SCHEMA_NAME.fullmatch(schema):
        raise ValueError(f"schema name {schema!r} must match {SCHEMA_NAME.pattern}")
    if schema.startswith("pg_"):
        raise ValueError(f"schema name {schema!r}: names starting with pg_ are PostgreSQL's")
    if schema == "information_schema":
        # It exists in every database, so CREATE SCHEMA IF NOT EXISTS passes; but it belongs to
        # PostgreSQL, and pg_dump leaves it out: the store's tables would be missing from backups.
        raise ValueError(f"schema name {schema!r} is PostgreSQL's own (pg_dump skips it)")
    return f'"{schema}"'


def text_literal(value: str) -> str:
    if "\x00" in value:
        raise ValueError("PostgreSQL text cannot hold NUL characters")
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def bytes_literal(value: bytes | None) -> str:
    if value is None:
        return "NULL"
    # bytea's hex input format in an escape string (E'\\x...' is \x... whatever
    # standard_conforming_strings says): a constant to PostgreSQL, where decode() was a function
    # call it had to resolve and fold on every statement. The type is named with its schema: the
    # completion is sent after the handler's statements, in its transaction, whose search_path
    # the handler may have changed (SET LOCAL).
    return f"E'\\\\x{value.hex()}'::pg_catalog.bytea"


def int_literal(value: int | None) -> str:
    return "NULL" if value is None else str(int(value))


def float_literal(value: float) -> str:
    return repr(float(value))


def timestamp_literal(value: datetime) -> str:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("a timestamptz literal needs an aware datetime")
    return f"'{value.astimezone(UTC).isoformat()}'::pg_catalog.timestamptz"


SAVEPOINT = "grpc_idempotency_handler"

# Sent just before the COMMIT of every transaction a handler was given (same round trip): the
# pool runs no reset query on release (Store.connect), so session state a handler left (a SET
# without LOCAL, SET ROLE or SESSION AUTHORIZATION, a session advisory lock, LISTEN, a WITH
# HOLD cursor, a temporary table) reached the next call on that connection, another tenant's
# perhaps. Inside the transaction: a failure here aborts it, so it can never turn a committed
# outcome into an error (after the COMMIT it could). The SETs are transactional, the
# advisory unlock is not (it need not be). Not DEALLOCATE ALL: it would drop asyncpg's own
# prepared statements. A rollback undoes all of it but advisory locks (released after it:
# postgres._rollback_checked) and PREPARE. Deferred constraints are checked first, as the
# COMMIT would have: their triggers (the application's) see the handler's settings and role.
# A SET LOCAL of a setting read at the COMMIT itself (synchronous_commit) is reset too.
_RESET_SESSION = (
    "SELECT pg_catalog.pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; "
    "RESET SESSION AUTHORIZATION; RESET ROLE; DISCARD TEMP"
)
SESSION_RESET = f"SET CONSTRAINTS ALL IMMEDIATE; {_RESET_SESSION}; "

# How a transaction a handler (or a consumer's effect) ran in is rolled back: all the rollback
# leaves of its session state is a session advisory lock, released after it (in an aborted
# transaction the unlock would fail, and the ROLLBACK with it). The library holds none.
ROLLBACK_AND_UNLOCK = "ROLLBACK; SELECT pg_catalog.pg_advisory_unlock_all()"

# How a consumer's transaction is rolled back once its effect ran: the whole session is reset
# after the ROLLBACK, not only advisory locks. An effect that ended the mark's transaction
# (COMMIT, or ROLLBACK then BEGIN) and changed the session out of it (SET ROLE, a search_path,
# LISTEN...) before failing left state no rollback undoes, and with no savepoint of the
# library's to tell the transaction was replaced, the connection went back to the pool with
# it. ``RESET_SESSION_ALONE``: the same when the effect left no transaction open.
ROLLBACK_AND_RESET = f"ROLLBACK; {_RESET_SESSION}"
RESET_SESSION_ALONE = _RESET_SESSION

ISOLATION_LEVELS = frozenset({"read committed", "repeatable read", "serializable"})


_MAX_TIMEOUT_MS = 2**31 - 1
"""The largest value of PostgreSQL's millisecond timeouts (a C int)."""


def begin(
    isolation: str | None,
    idle_timeout_s: float | None = None,
    lock_timeout_s: float | None = None,
) -> str:
    """BEGIN at ``isolation`` (``None``: the database's default_transaction_isolation).

    ``idle_timeout_s`` bounds how long the transaction may sit idle: if this process freezes or
    the network partitions while it holds a claim, PostgreSQL ends the session after that long
    (rolling the claim back and freeing its lock) instead of keeping it "idle in transaction"
    until TCP keepalive notices, hours later, with every retry answered IN_PROGRESS meanwhile.
    SET LOCAL lasts for this transaction only: no session state (safe behind PgBouncer).

    ``lock_timeout_s`` bounds each lock wait of the transaction's statements, or the session's
    own ``lock_timeout`` if that is shorter (and not 0).
    """
    sql = "BEGIN"
    if isolation is not None:
        if isolation not in ISOLATION_LEVELS:
            raise ValueError(f"unknown isolation level {isolation!r}")
        sql += f" ISOLATION LEVEL {isolation.upper()}"
    if idle_timeout_s is not None:
        # The setting is an int of milliseconds (about 24.8 days at most); a longer lease
        # (policies allow 36500 days) failed every claim with 22023, as if the store were down.
        ms = min(max(1, round(idle_timeout_s * 1000)), _MAX_TIMEOUT_MS)
        sql += f"; SET LOCAL idle_in_transaction_session_timeout = {ms}"
    if lock_timeout_s is not None:
        # ``lock_timeout_s`` bounds each lock wait of the transaction's statements (55P03 past
        # it), for this transaction only, as above (set_config(..., true) is SET LOCAL). A
        # shorter one of the session's (a role's, the connection's) stays: SET LOCAL overrode a
        # role's 20 ms with our 100 ms. Decided in the same batch, no round trip more: the
        # setting reads with its unit ('20ms', '1s', '1min') or '0' (none), as an interval.
        ms = min(max(1, round(lock_timeout_s * 1000)), _MAX_TIMEOUT_MS)
        sql += (
            "; SELECT pg_catalog.set_config('lock_timeout', CASE WHEN"
            f" t > '0'::pg_catalog.interval AND t < '{ms} ms'::pg_catalog.interval"
            f" THEN s ELSE '{ms}' END, true)"
            " FROM (SELECT s, s::pg_catalog.interval AS t"
            " FROM pg_catalog.current_setting('lock_timeout') AS s) AS session"
        )
    return sql


PAST_RETENTION = """(CASE state
    WHEN 'completed'
        THEN GREATEST(expires_at, completed_at + retention) <= pg_catalog.clock_timestamp()
    WHEN 'in_progress'
        THEN expires_at <= pg_catalog.clock_timestamp()
             AND locked_until <= pg_catalog.clock_timestamp()
END IS TRUE)"""
"""Whether a record is past retention, as claim() decides it (migration 0014): a completed one,
and an in-progress one whose lease has run out too (any request under the key then starts a new
operation). The look-up and the inspection read it alike."""

PAST_RETENTION_BEFORE_0014 = """((state = 'completed'
    AND GREATEST(expires_at, completed_at + retention) <= pg_catalog.clock_timestamp()) IS TRUE)"""
"""The same, as claim() decided it before migration 0014 (migrations 0007 to 0013): completed
records only. An in-progress claim whose lease has run out is taken over by the same request,
continuing its operation, past its retention or not; another request is refused. ``inspect`` and
``list`` read a schema not yet migrated to 0014 by this rule, as its own claim() still decides."""


# Type names that are not SQL keywords resolve through search_path (bigint and integer are
# keywords and cannot be shadowed).
_T, _B, _F = "pg_catalog.text", "pg_catalog.bytea", "pg_catalog.float8"


class Statements:
    """The store's statements for one schema, formatted once."""

    def __init__(self, schema: str) -> None:
        s = schema_identifier(schema)
        self.schema = s
        self.lookup = f"""
            SELECT fingerprint, state, status_code, status_message, status_details, response,
                   created_at,
                   {PAST_RETENTION} AS expired,
                   (locked_until IS NULL OR locked_until <= pg_catalog.clock_timestamp())
                       AS lease_expired,
                   GREATEST(0, EXTRACT(EPOCH FROM
                       locked_until - pg_catalog.clock_timestamp()) * 1000)::bigint
                       AS lease_remaining_ms,
                   -- how much longer a completed outcome stays replayable (the replay cache),
                   -- rounded down: a cached copy must never outlive the record
                   CASE WHEN state = 'completed' THEN GREATEST(0, pg_catalog.floor(
                       EXTRACT(EPOCH FROM GREATEST(expires_at, completed_at + retention)
                           - pg_catalog.clock_timestamp()) * 1000))::bigint END AS replayable_ms
            FROM {s}.records WHERE scope = $1 AND key = $2"""
        # A claim is (fencing_token, created_at), here as in verify_claim (migration 0013): the
        # token restarts at 1 when a record is purged and the key claimed again, and the start
        # tells the new claim from the purged one's stalled owner.
        #
        # A released claim is not renewed: a renewal that reaches the row after the release (it
        # was on the wire, or ran on after its client gave up on it) would set the lease again,
        # and retries would wait it out instead of taking over. A lease still running is
        # renewed even if it ends before the operation's start: after a takeover on a database
        # clock that stepped back (a failover to a primary whose clock is behind), the rightful
        # owner was refused, and its handler cancelled, until the clock caught up.
        self.renew = f"""
            UPDATE {s}.records
            SET locked_until = pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => $4)
            WHERE scope = $1 AND key = $2 AND fencing_token = $3 AND created_at = $5
              AND state = 'in_progress'
              AND (locked_until > created_at OR locked_until > pg_catalog.clock_timestamp())"""
        # Ends the lease now rather than deleting the claim: a retry takes it over at once, and
        # the takeover keeps the operation's start (created_at), which child keys rely on. The
        # lease ends at the operation's start, not at now: a lease that was granted always ends
        # later than that, so `renew` tells a released claim apart without a column of its own.
        self.release = f"""
            UPDATE {s}.records SET locked_until = LEAST(created_at, pg_catalog.clock_timestamp())
            WHERE scope = $1 AND key = $2 AND fencing_token = $3 AND created_at = $4
              AND state = 'in_progress'"""
        # The same, for a claim whose answer never came (its token and start unknown): the one
        # this attempt ($3) made, if it committed (migration 0016).
        self.release_attempt = f"""
            UPDATE {s}.records SET locked_until = LEAST(created_at, pg_catalog.clock_timestamp())
            WHERE scope = $1 AND key = $2 AND state = 'in_progress'
              AND claim_attempt = $3::bigint # fencing_token"""
        # Waits until no transaction holds the key's claim lock ($1), and lets it go again (an
        # implicit transaction's lock ends with the statement). Before a second try of a claim,
        # or a release by attempt id: a claim whose connection was lost may still be running in
        # PostgreSQL (it notices a client gone only when it answers), and commit after both.
        self.wait_claim_lock = "SELECT pg_catalog.pg_advisory_xact_lock($1::bigint)"
        # The key is the outbox step's child key; on a conflict Store.enqueue compares messages.
        # $8: the enqueuing span's propagation carrier, JSON text or NULL (migration 0018).
        self.enqueue = f"""
            INSERT INTO {s}.outbox
                (scope, key, step, parent_key, method, payload_type, payload, trace_context)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8::text::jsonb)
            ON CONFLICT (scope, key) DO NOTHING"""
        self.enqueued = (
            f"SELECT payload_type, payload FROM {s}.outbox WHERE scope = $1 AND key = $2"
        )
        bound = "pg_catalog.statement_timestamp()"
        # One batch of the purge: $1 the batch size, $2 where the previous batch stopped (NULL:
        # the start); returns how many went and the last expires_at deleted, where the next batch
        # starts. The bound is the statement's start, not clock_timestamp(): a volatile bound
        # cannot be an index condition, and every purge then read the whole table. The walk
        # follows records_expires_at (expires_at is the earliest a record can expire; a
        # completed one lives on until completed_at + retention: migration 0007) from $2, so a
        # batch does not rescan the index entries its predecessors left dead, and a purge that
        # finds nothing reads a few index pages, whatever the table's size.
        #
        # No FOR UPDATE SKIP LOCKED pass: it wrote every row twice (a lock, then the delete);
        # without it, deleting by ctid, a batch runs 2.2-2.6x faster (benchmarks/README.md). A
        # row another transaction holds is waited for, not skipped (for PURGE_LOCK_WAIT_S at
        # most: past it the batch is redone as purge_skipping, below), so the DELETE repeats the
        # whole condition: a row updated by a concurrent takeover (claim(), complete_atomic():
        # both under the key's claim lock) makes the DELETE wait for that transaction and, at
        # READ COMMITTED, re-evaluate its WHERE on the new version, which stays twice over: its
        # ctid is not the one selected (an UPDATE, HOT or not, writes a new version), and it is
        # within retention or held by a lease (the repeated condition, which does not rely on
        # how PostgreSQL rechecks a ctid). The condition sits in a CASE so that the planner cannot
        # turn it into an expires_at index scan: the DELETE must find its rows by ctid.
        purgeable = f"""CASE state
                WHEN 'completed' THEN GREATEST(expires_at, completed_at + retention) <= {bound}
                WHEN 'in_progress' THEN expires_at <= {bound} AND locked_until <= {bound}
            END"""
        purge = """
            WITH gone AS (
                DELETE FROM {s}.records
                WHERE ctid = ANY (ARRAY(
                        SELECT ctid FROM {s}.records
                        WHERE expires_at >= COALESCE($2::timestamptz, '-infinity')
                          AND expires_at <= {bound} AND {purgeable}
                        ORDER BY expires_at LIMIT $1{lock}))
                  AND {purgeable}
                RETURNING expires_at)
            SELECT pg_catalog.count(*)::integer AS deleted, pg_catalog.max(expires_at) AS last
            FROM gone"""
        self.purge = purge.format(s=s, bound=bound, purgeable=purgeable, lock="")
        # The same batch for when the DELETE above met a row that another transaction held
        # past PURGE_LOCK_WAIT_S (55P03): waiting, it kept the rows it had already deleted
        # locked, and a claim of one of those keys waited as long as that unrelated lock was
        # held. Locking first, skipping what another holds (the slower statement the one above
        # replaced, used only for a batch that met such a lock), it never waits on a row. The
        # rows it skips lie behind where the walk goes on from: the next purge takes them.
        self.purge_skipping = purge.format(
            s=s, bound=bound, purgeable=purgeable, lock=" FOR UPDATE SKIP LOCKED"
        )

        # The completion with bind parameters, for outcomes too large to inline as literals:
        # bytea travels in binary, instead of as hex text twice its size. Its types are named
        # with their schema, as in bytes_literal: it runs after the handler's statements.
        self.complete = (
            f"SELECT {s}.complete($1::{_T}, $2::{_T}, $3::bigint, $4::integer, $5::{_T},"
            f" $6::{_B}, $7::{_B}, $8::{_F})"
        )
        # The phased claim, a statement of its own: with bind parameters, so that asyncpg
        # prepares it once per connection. As a literal it was a new statement every time: two
        # round trips (parse, then execute) and an entry in asyncpg's statement cache, which it
        # filled, evicting the look-up's and the completion's (benchmarks/README.md).
        self.claim_phased = (
            f"SELECT token, started_at FROM {s}.claim_with_start($1::text, $2::text, $3::bigint,"
            " $4::text, $5::bytea, $6::float8, $7::float8, $8::bigint)"
        )
        # When the atomic attempt's operation began, on the database's clock, as its record
        # will say: the in-progress row's start (one claim() wrote in this transaction, at
        # REPEATABLE READ and above, or a phased claim it took over), else the transaction's
        # start, which complete_atomic writes as created_at (migration 0009).
        self.atomic_start = f"""
            SELECT COALESCE((SELECT created_at FROM {s}.records
                             WHERE scope = $1 AND key = $2 AND state = 'in_progress'),
                            pg_catalog.now())"""
        self.complete_atomic = (
            f"SELECT {s}.complete_atomic($1::{_T}, $2::{_T}, $3::{_T}, $4::{_B}, $5::integer,"
            f" $6::{_T}, $7::{_B}, $8::{_B}, $9::{_F})"
        )

    def claim(
        self,
        *,
        scope: str,
        key: str,
        lock_id: int,
        method: str,
        fingerprint: bytes,
        retention_s: float,
        lease_s: float,
        atomic: bool = False,
    ) -> str:
        """The claim as a literal statement; ``atomic``: the atomic-mode claim, sent in the
        batch that opens the call's transaction, which writes nothing when the key is new (the
        record is written once, by ``complete_atomic``: migration 0008). The phased claim
        returns its fencing token and when its operation began (migration 0012); the store
        sends it as ``claim_phased``, with bind parameters."""
        function = "claim_atomic" if atomic else "claim_with_start"
        select = "SELECT" if atomic else "SELECT * FROM"
        return (
            f"{select} {self.schema}.{function}({text_literal(scope)}, {text_literal(key)}, "
            f"{int_literal(lock_id)}, {text_literal(method)}, {bytes_literal(fingerprint)}, "
            f"{float_literal(retention_s)}, {float_literal(lease_s)})"
        )

    @staticmethod
    def begin_atomic_claim(claim: str, *, isolation: str | None, idle_timeout_s: float) -> str:
        """``claim`` (from ``claim()``) as the first statement of the call's transaction."""
        return f"{begin(isolation, idle_timeout_s)}; {claim}; SAVEPOINT {SAVEPOINT}"

    def begin_final(
        self,
        *,
        scope: str,
        key: str,
        token: int,
        started_at: datetime,
        lock_id: int,
        isolation: str | None,
        idle_timeout_s: float,
    ) -> str:
        """Opens the final transaction of the claim (``token``, ``started_at``): verify_claim
        takes the claim lock and the row's, or raises GI003 (migration 0013)."""
        return (
            f"{begin(isolation, idle_timeout_s)}; "
            f"SELECT {self.schema}.verify_claim({text_literal(scope)}, {text_literal(key)}, "
            f"{int_literal(token)}, {int_literal(lock_id)}, {timestamp_literal(started_at)});"
            f" SAVEPOINT {SAVEPOINT}"
        )

    def complete_and_commit(
        self,
        *,
        scope: str,
        key: str,
        token: int | None,
        method: str,
        fingerprint: bytes,
        code: int,
        message: str,
        details: bytes | None,
        response: bytes | None,
        retention_s: float,
        discard_writes: bool,
    ) -> str:
        """The outcome and COMMIT, one round trip. ``token`` ``None``: an atomic attempt, whose
        record is written here (``complete_atomic``); else the phased claim holding ``token``."""
        rollback = f"ROLLBACK TO SAVEPOINT {SAVEPOINT}; " if discard_writes else ""
        outcome = (
            f"{int_literal(code)}, {text_literal(message)}, {bytes_literal(details)}, "
            f"{bytes_literal(response)}, {float_literal(retention_s)}"
        )
        if token is None:
            call = (
                f"complete_atomic({text_literal(scope)}, {text_literal(key)}, "
                f"{text_literal(method)}, {bytes_literal(fingerprint)}, {outcome})"
            )
        else:
            call = f"complete({text_literal(scope)}, {text_literal(key)}, {token:d}, {outcome})"
        return f"{rollback}SELECT {self.schema}.{call}; {SESSION_RESET}COMMIT"
