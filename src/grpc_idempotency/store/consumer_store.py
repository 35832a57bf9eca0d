"""The idempotent consumers' table, ``processed_messages``: the only SQL of the consumers.

A delivery opens a transaction that marks its message id (``ProcessedMessages.mark``), the
consumer runs its effect on that transaction's connection, and the mark commits with the effect
(``Mark.commit``, which also starts its retention) or goes with it (``Mark.abandon``). A
duplicate finds the mark (and the payload digest it keeps, ``Mark.kept_fingerprint``); a
concurrent delivery of the same id waits on the row's lock, bounded by ``lock_timeout``, and
then is told ``MarkBusy``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable

import asyncpg

from grpc_idempotency import failpoints
from grpc_idempotency.core.consumer import Consumed, consumed, lock_timeout
from grpc_idempotency.core.db_failures import Failure, classify
from grpc_idempotency.core.errors import HandlerDatabaseError, StoreUnavailable
from grpc_idempotency.log_tracebacks import library_logger
from grpc_idempotency.store.errors import (
    STORE_ERRORS,
    aborted_by,
    from_the_driver,
    raised_in_asyncpg,
    store_error,
)
from grpc_idempotency.store.postgres import (
    ROLLBACK_TIMEOUT_S,
    PooledConnection,
    Store,
    _connection_gone,
    connection_closed,
)
from grpc_idempotency.store.sql import (
    RESET_SESSION_ALONE,
    ROLLBACK_AND_RESET,
    ROLLBACK_AND_UNLOCK,
    SESSION_RESET,
    begin,
    bytes_literal,
    float_literal,
    schema_identifier,
    text_literal,
)

log = library_logger("grpc_idempotency.consumer")


class MarkBusy(Exception):
    """Another delivery of the same message id holds its mark (still running its effect)."""


_LOCK_NOT_AVAILABLE = "55P03"
_PROBE_S = 0.0  # the mark's first statement: lock_timeout at its minimum (core.consumer)
_MARK_GONE = "GI004"  # raised by the commit: the mark's transaction is not the one committing
_READ_ONLY = "25006"  # read_only_sql_transaction
_MARK_SETTING = "grpc_idempotency.consumer_mark"
# A connection that broke under the effect: the store's failure, not the effect's. Also the
# SQLSTATE classes 08 (connection exception) and 57P (the server shutting down or restarting).
_CONNECTION_LOST: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InternalClientError,  # the protocol noticed the server hang up mid-operation
)
_CONNECTION_LOST_STATES = ("08", "57P")


class ConsumerStatements:
    def __init__(self, schema: str) -> None:
        s = schema_identifier(schema)
        self.table = f"{s}.processed_messages"
        # Set to this call's bound for the mark only: the wait on a concurrent delivery's row is
        # a lock wait, which lock_timeout bounds. The RETURNING clause puts the session's own
        # setting back, so the effect's lock waits are not cut short by ours.
        #
        # The BEGIN carries idle_in_transaction_session_timeout (sql.begin), in the same batch:
        # a replica frozen or cut off mid-effect kept the row locked, and every redelivery was
        # MessageInProgress, until TCP keepalive ended its session hours later.
        self.mark_template = (
            "{begin}; "
            "WITH prior AS MATERIALIZED ("
            "SELECT pg_catalog.current_setting('lock_timeout') AS setting), "
            "bounded AS MATERIALIZED ("
            "SELECT setting, pg_catalog.set_config('lock_timeout', {wait}, true) FROM prior), "
            f"marked AS (INSERT INTO {self.table} AS p "
            "(consumer, message_id, expires_at, fingerprint) "
            "SELECT {consumer}, {message_id}, "
            "pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => {retention}), "
            "{fingerprint} "
            "FROM bounded "
            "ON CONFLICT (consumer, message_id) DO UPDATE "
            "SET processed_at = pg_catalog.clock_timestamp(), expires_at = EXCLUDED.expires_at, "
            "fingerprint = EXCLUDED.fingerprint "
            # A live mark is a duplicate; an expired one is taken over, as if purged already.
            "WHERE p.expires_at <= pg_catalog.clock_timestamp() "
            "RETURNING pg_catalog.set_config('lock_timeout', (SELECT setting FROM bounded), true), "
            # This transaction's token, checked by the commit (below); a setting local to the
            # transaction: ROLLBACK and COMMIT clear it, a savepoint's rollback does not.
            f"pg_catalog.set_config('{_MARK_SETTING}', {{token}}, true), "
            # Whether the row was inserted (a new id) or an expired mark updated (taken over:
            # processed before, to be processed again). Told by the statement's row count, as
            # the batch's simple query returns only its last status, in the one round trip: a
            # new id 1 row, an expired mark taken over 2, a live mark 0. An updated row's xmax
            # is this transaction's (ON CONFLICT DO UPDATE locks the row first), an inserted
            # one's 0.
            "(p.xmax = 0) AS inserted) "
            "SELECT FROM marked, (VALUES (false), (true)) AS twice (again) "
            "WHERE NOT (twice.again AND marked.inserted)"
        )
        # The mark's retention counts from its commit, not from the mark: an effect slower
        # than the retention committed a mark already expired, and a redelivery (or the
        # duplicate waiting on the row) ran the effect again. Sent with the COMMIT in one
        # round trip; in an aborted transaction it fails (25P02) and the COMMIT is not run.
        #
        # The transaction committing must be the mark's: an effect that ended the mark's
        # transaction and opened another (ROLLBACK; BEGIN) had its mark rolled back, and the
        # COMMIT then committed nothing of the kind; it was reported PROCESSED and the next
        # delivery ran the effect again (or, over an expired mark, its retention was renewed
        # without the effect). Either of two signs tells the mark's transaction: the mark's
        # token, a setting local to it (which RESET ALL clears), or the mark row's xmin being
        # this transaction's id (which an effect writing the row inside a savepoint changes);
        # an effect that does both is refused, the safe side (not acknowledged, redelivered).
        # A mark the effect deleted is refused too: acknowledged, its redelivery ran again.
        # A DO block raises _MARK_GONE, in the same round trip; the COMMIT after it is not run.
        #
        # The block runs after the effect, in its transaction, whose search_path the effect may
        # have set (SET LOCAL): a schema of its ahead of pg_catalog with a now() or
        # clock_timestamp() of its own (a frozen clock) gave the mark an expiry in the past,
        # and the next redelivery ran the effect again. The block reads the built-ins' own
        # search_path and puts the effect's back before the COMMIT, whose deferred triggers
        # (the application's) see the application's setting.
        self.commit_template = (
            "DO {tag}DECLARE prior pg_catalog.text := pg_catalog.current_setting('search_path');"
            " BEGIN PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true); "
            f"UPDATE {self.table} SET processed_at = pg_catalog.clock_timestamp(), "
            "expires_at = pg_catalog.clock_timestamp()"
            " + pg_catalog.make_interval(secs => {retention}) "
            "WHERE consumer = {consumer} AND message_id = {message_id} "
            f"AND (pg_catalog.current_setting('{_MARK_SETTING}', true)"
            " IS NOT DISTINCT FROM {token} "
            "OR xmin = pg_catalog.pg_current_xact_id()::xid); "
            f"IF NOT FOUND THEN RAISE EXCEPTION USING ERRCODE = '{_MARK_GONE}', "
            "MESSAGE = 'grpc_idempotency: the consumer''s mark is not in this transaction"
            " (the effect ended it, or deleted the mark)'; END IF;"
            " PERFORM pg_catalog.set_config('search_path', prior, true); END{tag}; "
            # After the block, whose set_config it would undo; what the effect set on the
            # session goes, as a handler's does (sql.SESSION_RESET: no braces, for format).
            + SESSION_RESET
            + "COMMIT"
        )
        # A duplicate's mark, read in the duplicate's transaction (after the mark statement found
        # it committed and live), to compare payloads.
        self.fingerprint = (
            f"SELECT fingerprint FROM {self.table} WHERE consumer = $1 AND message_id = $2"
        )
        self.is_processed = (
            f"SELECT EXISTS (SELECT FROM {self.table} WHERE consumer = $1 AND message_id = $2"
            " AND expires_at > pg_catalog.clock_timestamp())"
        )
        # statement_timestamp(), not clock_timestamp(): a volatile bound cannot use the index on
        # expires_at; each batch is a statement in its own transaction, so the two agree.
        self.purge = f"""
            WITH doomed AS (
                SELECT consumer, message_id FROM {self.table}
                WHERE expires_at <= pg_catalog.statement_timestamp()
                  AND ($2::text IS NULL OR consumer = $2)
                LIMIT $1 FOR UPDATE SKIP LOCKED)
            DELETE FROM {self.table} p USING doomed d
            WHERE p.consumer = d.consumer AND p.message_id = d.message_id"""

    def mark(
        self,
        consumer: str,
        message_id: str,
        retention_s: float,
        wait_s: float,
        idle_timeout_s: float,
        token: str,
        fingerprint: bytes | None,
    ) -> str:
        return self.mark_template.format(
            token=text_literal(token),
            fingerprint=bytes_literal(fingerprint),
            begin=begin("read committed", idle_timeout_s),
            wait=text_literal(lock_timeout(wait_s)),
            consumer=text_literal(consumer),
            message_id=text_literal(message_id),
            retention=float_literal(retention_s),
        )

    def commit(self, consumer: str, message_id: str, retention_s: float, token: str) -> str:
        consumer_sql, message_id_sql = text_literal(consumer), text_literal(message_id)
        # The DO block's body is dollar-quoted: its tag must not occur in the literals in it
        # (a message id is any text).
        tag = "$mark$"
        while tag in consumer_sql or tag in message_id_sql:
            tag = tag[:-1] + "_$"
        return self.commit_template.format(
            token=text_literal(token),
            tag=tag,
            consumer=consumer_sql,
            message_id=message_id_sql,
            retention=float_literal(retention_s),
        )


class ProcessedMessages:
    """Marks of processed message ids, per consumer name."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._sql = ConsumerStatements(store.schema)

    async def mark(
        self,
        consumer: str,
        message_id: str,
        *,
        retention_s: float,
        wait_s: float,
        idle_timeout_s: float,
        acquire_timeout: float | None,
        fingerprint: bytes | None = None,
        waiting: Callable[[bool], None] | None = None,
    ) -> Mark:
        """Opens a transaction holding ``message_id``'s mark for ``consumer`` (with the payload's
        ``fingerprint``, if given); its ``outcome`` says whether the id was new (``PROCESSED``)
        or marked already (``DUPLICATE``). Raises ``MarkBusy`` after ``wait_s`` on a concurrent
        delivery, ``StoreUnavailable``. ``waiting(True)``: the mark waits on another
        transaction's hold of the row (a delivery elsewhere), ``waiting(False)``: it stopped."""
        store = self.store
        token = uuid.uuid4().hex  # the mark's transaction, as the commit checks it
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        marking: float | None = None  # when the first try's statement was sent
        # A first statement that does not wait on the row (the shortest lock_timeout): a mark
        # cancelled while it waits on another process's delivery cannot otherwise be told from
        # one cancelled in its own statement time. Only when the row is held does the mark wait,
        # in a second statement: a round trip more for a delivery that waits anyway.
        probing = waiting is not None and wait_s > _PROBE_S
        contended = False  # the probe found the row held
        told = False  # waiting(True) was said
        tries = 2
        tried = 0
        conn: PooledConnection | None = None  # kept from the probe, rolled back
        while tried < tries:
            tried += 1
            if conn is None:
                left = None if deadline is None else deadline - time.monotonic()
                conn = await store._acquire("marking a message", left)
            # The second try waits on a concurrent delivery's row only what the first left of
            # wait_s: it waited wait_s anew, up to twice max_wait and past the caller's timeout.
            now = time.monotonic()
            marking = now if marking is None else marking
            wait = _PROBE_S if probing else max(0.0, wait_s - (now - marking))
            sql = self._sql.mark(
                consumer, message_id, retention_s, wait, idle_timeout_s, token, fingerprint
            )
            # The statement may wait that long on the row (lock_timeout), beyond the pool's
            # command_timeout, which bounds the rest: with only command_timeout, a max_wait
            # longer than it was cut short, and the duplicate failed as StoreUnavailable (an
            # ambiguous outage, its connection dropped) instead of MessageInProgress.
            statement_timeout = (
                None if store.command_timeout is None else store.command_timeout + wait
            )
            if contended and not told and waiting is not None:
                # Said only now, the waiting statement about to go on a connection held: a
                # delivery cancelled while it waited for a pooled connection (the probe's
                # dropped) is the delivery's own time ("released"), not a wait on the row.
                told = True
                waiting(True)
            try:
                status = await conn.execute(sql, timeout=statement_timeout)
            except BaseException as exc:
                busy = getattr(exc, "sqlstate", None) == _LOCK_NOT_AVAILABLE
                keep = False
                try:
                    point = "mark_probe_rollback" if busy and probing else None
                    await _abandon(conn, exc, failpoint=point)
                    # The probe's only statement failed, rolled back (_abandon's ROLLBACK and
                    # advisory unlock, one round trip as a bare ROLLBACK): the wait goes on this
                    # connection, not after a release and an acquire, which an exhausted pool
                    # makes a wait of its own. Unless the ROLLBACK failed and dropped it.
                    keep = busy and probing and not connection_closed(conn)
                finally:
                    # However the abandon ends: cancelled during its ROLLBACK, it drops the
                    # connection and re-raises (asyncpg's pool takes a terminated connection
                    # back by itself; the release is then a no-op, here in case it does not).
                    if not keep:
                        await store._release(conn)
                if busy:
                    if probing and waiting is not None:
                        # Held elsewhere: wait on it now, as a try of its own.
                        probing, contended = False, True
                        conn = conn if keep else None
                        tried -= 1
                        continue
                    raise MarkBusy(message_id) from None
                conn = None
                if from_the_driver(exc):
                    # A pooled connection that a restart or a failover left dead: the pool's
                    # others are replaced now, and the mark tried once more on a connection
                    # opened now, as the claim is. Safe: the batch commits nothing, and a dead
                    # session's transaction is rolled back. Without it, each of the pool's
                    # dead connections failed a delivery in turn with the database up.
                    if tried < tries and await store._forget_connections_if_gone(exc):
                        continue
                    raise store_error(exc, "marking a message", store=store.store_log) from exc
                raise
            # Not in a finally: a cancellation must find the mark still waiting.
            if waiting is not None and told:
                waiting(False)
            commit = self._sql.commit(consumer, message_id, retention_s, token)
            kept = (self._sql.fingerprint, consumer, message_id)
            outcome, taken_over = consumed(int(status.split()[-1]))
            return Mark(store, conn, outcome, commit, kept, taken_over=taken_over)
        raise AssertionError("unreachable")

    async def is_processed(self, consumer: str, message_id: str) -> bool:
        # A read: on a pooled connection a restart or a failover left dead (``_holding`` then
        # replaces the pool's others) it is tried once more, on a connection opened now, as the
        # store's look-up of a key is. Answered StoreUnavailable, the database up. A failure to
        # get a connection is not tried again: the pool has just tried to open one.
        store = self.store
        doing = "looking up a message"
        tries = 2
        for tried in range(1, tries + 1):
            conn = await store._acquire(doing, None)
            try:
                async with store._holding(conn, doing):
                    found: bool = await conn.fetchval(self._sql.is_processed, consumer, message_id)
            except StoreUnavailable as err:
                cause = err.__cause__
                if tried < tries and cause is not None and _connection_gone(cause):
                    continue
                raise
            return found
        raise AssertionError("unreachable")

    async def purge(self, *, consumer: str | None, batch_size: int, max_batches: int | None) -> int:
        return await self.store.purge_in_batches(
            "purging processed messages",
            self._sql.purge,
            consumer,
            batch_size=batch_size,
            max_batches=max_batches,
        )


class Mark:
    """An open transaction holding a message's mark; ``commit`` or ``abandon`` ends it and
    gives the connection back."""

    def __init__(
        self,
        store: Store,
        conn: PooledConnection,
        outcome: Consumed,
        commit_sql: str,
        kept_sql: tuple[str, str, str],
        *,
        taken_over: bool = False,
    ) -> None:
        self._store = store
        self.connection = conn
        self.outcome = outcome
        self.taken_over = taken_over
        """The id's mark had expired and was taken over: it was processed before."""
        self._commit_sql = commit_sql
        self._kept_sql = kept_sql
        self._done = False

    async def kept_fingerprint(self) -> bytes | None:
        """The payload digest the committed mark holds (``None``: written without one); for a
        ``DUPLICATE``, before ``abandon``. Raises ``StoreUnavailable``."""
        sql, consumer, message_id = self._kept_sql
        try:
            kept: bytes | None = await self.connection.fetchval(sql, consumer, message_id)
        except STORE_ERRORS as exc:
            raise store_error(exc, "reading a message's mark", store=self._store.store_log) from exc
        return None if kept is None else bytes(kept)

    def lost_by(self, exc: BaseException) -> bool:
        """Whether ``exc`` (raised by the effect) is the connection breaking under it: the
        store's failure, not the effect's."""
        return _connection_lost(self.connection, exc)

    async def commit(self, message_id: str) -> None:
        conn = self.connection
        try:
            if connection_closed(conn):
                # PostgreSQL ended the session (the effect sat idle past idle_timeout, or the
                # link broke): the transaction rolled back, unless the effect committed it.
                raise StoreUnavailable(
                    f"the connection was lost while the effect of message {message_id!r} ran"
                    " (idle in its transaction past the consumer's idle_timeout, or the link"
                    " broke)"
                )
            if not conn.is_in_transaction():
                # The effect committed or rolled back itself: whether the mark went with it is
                # unknown, so do not claim success (the message is not acknowledged; a
                # redelivery sees the mark or runs again). What it ran on the session after
                # (a SET, a LISTEN) no rollback undoes: the connection goes, as a handler's.
                _terminate(conn)
                raise _ended_by_the_effect(message_id)
            try:
                status = await conn.execute(self._commit_sql)
            except asyncpg.InFailedSQLTransactionError:
                # The effect caught a failed statement's error: the transaction was aborted,
                # the COMMIT after the mark's update never ran, nothing committed.
                await _abandon(conn, None, after_effect=True)
                raise aborted_by("the effect") from None
            except BaseException as exc:
                if getattr(exc, "sqlstate", None) == _MARK_GONE:
                    # The effect ended the mark's transaction and opened another (ROLLBACK;
                    # BEGIN, or COMMIT; BEGIN): the mark is not in the transaction at hand.
                    # Roll that one back (what the effect wrote after its BEGIN) and report it
                    # as the effect ending the transaction itself. The connection goes: what
                    # the effect ran between its ROLLBACK and its BEGIN no rollback undoes.
                    await _abandon(conn, None)
                    _terminate(conn)
                    raise _ended_by_the_effect(message_id) from None
                if getattr(exc, "sqlstate", None) == _READ_ONLY:
                    # The effect made the mark's transaction read-only (SET TRANSACTION READ
                    # ONLY), which then refused the mark's update: no failover (the mark was
                    # written in this transaction), nor the store's fault. The batch stopped
                    # before its COMMIT: nothing committed, and every redelivery fails the same
                    # way, so it is the effect's error, not StoreUnavailable (retried).
                    await _abandon(conn, None, after_effect=True)
                    raise _made_read_only_by_the_effect(message_id) from None
                # The commit may or may not have happened: never reuse this connection.
                _terminate(conn)
                if isinstance(exc, asyncpg.PostgresError) and classify(exc.sqlstate) is (
                    Failure.OTHER
                ):
                    # The effect's own write failing only now (a constraint checked at
                    # COMMIT): the message's problem, raised as it would be at once.
                    raise
                if from_the_driver(exc):
                    raise store_error(
                        exc, "committing a processed message", store=self._store.store_log
                    ) from exc
                raise
            if status != "COMMIT":  # ROLLBACK: neither the effect nor the mark committed
                raise aborted_by("the effect")
        finally:
            await self._finish()

    async def abandon(self, exc: BaseException | None, *, after_effect: bool = False) -> None:
        """Rolls back; ``after_effect``: the effect ran, and the session is reset too (it may
        have changed it out of the mark's transaction, which it may have ended)."""
        try:
            await _abandon(self.connection, exc, after_effect=after_effect)
        finally:
            await self._finish()

    async def _finish(self) -> None:
        if not self._done:
            self._done = True
            await self._store._release(self.connection)


def _ended_by_the_effect(message_id: str) -> StoreUnavailable:
    return StoreUnavailable(
        f"the effect of message {message_id!r} ended the consumer's transaction itself, or"
        " deleted its mark; never COMMIT or ROLLBACK it"
    )


def _made_read_only_by_the_effect(message_id: str) -> HandlerDatabaseError:
    return HandlerDatabaseError(
        f"the effect of message {message_id!r} made the consumer's transaction read-only"
        " (SET TRANSACTION READ ONLY), so its mark could not be committed there and that"
        " transaction was rolled back (inside a savepoint, the switch ends at RELEASE"
        " SAVEPOINT); what the effect committed itself before, if it did, stays committed"
    )


def _terminate(conn: PooledConnection) -> None:
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()


def _connection_lost(conn: PooledConnection, exc: BaseException) -> bool:
    """Whether ``exc``, raised by the effect, is the store's failure: the connection is gone,
    or asyncpg says it broke, or one of the effect's statements timed out (``command_timeout``).
    Any other OSError is the effect's own, even raised through asyncpg (``copy_to_table`` of a
    missing file, a source streaming another service's data that reset), and so is an
    InterfaceError on a live connection (asyncpg refusing ``conn.transaction()`` inside the
    mark's): both were reported as the store being down, and the message came back until it
    was a dead letter."""
    if not isinstance(exc, Exception):
        return False
    state = getattr(exc, "sqlstate", None) or ""
    return (
        isinstance(exc, _CONNECTION_LOST)
        or state.startswith(_CONNECTION_LOST_STATES)
        or (isinstance(exc, TimeoutError) and raised_in_asyncpg(exc))
        or connection_closed(conn)
    )


async def _abandon(
    conn: PooledConnection,
    exc: BaseException | None,
    *,
    failpoint: str | None = None,
    after_effect: bool = False,
) -> None:
    """Ends the transaction without committing. A cancellation or a timeout may have interrupted
    a statement mid-flight, and a failed ROLLBACK leaves the transaction's fate with the
    connection: in these cases the connection is dropped (PostgreSQL rolls back) rather than
    reused. After an interrupted statement a ROLLBACK would first wait for its cancellation to
    be confirmed: for ever behind a dead link."""
    if connection_closed(conn):
        return
    if exc is not None and (
        not isinstance(exc, Exception) or (isinstance(exc, TimeoutError) and raised_in_asyncpg(exc))
    ):
        _terminate(conn)
        return
    try:
        if failpoint is not None and failpoints.ENABLED:
            # In the ROLLBACK's place: ``error`` fails it, as a link that died just now does.
            await failpoints.hit(failpoint)
        if conn.is_in_transaction():
            # Bounded: a ROLLBACK that hangs (the link died just now) is given up on, and the
            # connection dropped, rather than holding the delivery for ever. A session advisory
            # lock of the effect's, which the ROLLBACK leaves, is released after it; after the
            # effect, the whole session is reset (sql.ROLLBACK_AND_RESET).
            rollback = ROLLBACK_AND_RESET if after_effect else ROLLBACK_AND_UNLOCK
            await conn.execute(rollback, timeout=ROLLBACK_TIMEOUT_S)
        elif after_effect:
            # The effect committed (or rolled back) the mark's transaction itself, then failed:
            # what it ran on the session after, no transaction of the library's holds.
            await conn.execute(RESET_SESSION_ALONE, timeout=ROLLBACK_TIMEOUT_S)
    except Exception:
        log.debug("rollback failed; dropping the connection", exc_info=True)
        _terminate(conn)
    except BaseException:
        _terminate(conn)
        raise
