"""The PostgreSQL store: the only place that talks to the database about idempotency records.

Round trips per call (asyncpg, no pool reset query; see ``Store.connect``):
    replay:           1  (look-up)
    first execution:  2 + the handler's own (BEGIN+claim+SAVEPOINT; complete+COMMIT), plus a
                      look-up when the server has seen the key before (``lifecycle.look_first``)
Every time comparison (retention, leases) happens in SQL with the database's clock, never with
the application's: ``clock_timestamp()`` on the request path, the statement's start in purges
(an index can serve it). Errors below this module are asyncpg's and the OS's; above it they are
``StoreUnavailable`` or ``LeaseLost``: nothing raw escapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

import asyncpg

from grpc_idempotency import failpoints
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.db_failures import Failure, classify
from grpc_idempotency.core.errors import (
    DsnUnusable,
    HandlerDatabaseError,
    IdempotencyError,
    LeaseLost,
    OutboxKeyReused,
    StoreMisconfigured,
    StoreUnavailable,
    TransactionConflict,
)
from grpc_idempotency.core.keys import claim_lock_id
from grpc_idempotency.core.lifecycle import (
    Outcome,
    State,
    StoredRecord,
    renewal_acquire_bound_s,
    renewal_bound_s,
)
from grpc_idempotency.core.policy import Isolation
from grpc_idempotency.core.seconds import MAX_DURATION_S, checked_seconds
from grpc_idempotency.log_tracebacks import library_logger
from grpc_idempotency.store import migrations
from grpc_idempotency.store.dsn_files import at_in_user_info, dsn_where, unsendable, unusable_file
from grpc_idempotency.store.errors import (
    IN_FAILED_TRANSACTION,
    NO_SUCH_SAVEPOINT,
    STORE_ERRORS,
    PasswordFailed,
    StoreLog,
    aborted_by,
    connect_error,
    dsn_unusable,
    ended_by_handler,
    from_the_driver,
    handler_error,
    password_error,
    purge_refused,
    session_refused,
    sqlstate,
    store_error,
)
from grpc_idempotency.store.sql import (
    ROLLBACK_AND_UNLOCK,
    SAVEPOINT,
    SESSION_RESET,
    Statements,
    schema_identifier,
)
from grpc_idempotency.store.sql import begin as begin_sql

log = library_logger("grpc_idempotency.store")

# The type of ``current_call().connection`` and of what a consumer's effect is given: the pool's
# proxy, not an ``asyncpg.Connection``, so a user's function annotated with the latter is refused
# by mypy; public as ``grpc_idempotency.PooledConnection`` for users to annotate with.
if TYPE_CHECKING:
    PooledConnection: TypeAlias = asyncpg.pool.PoolConnectionProxy[asyncpg.Record]
else:
    PooledConnection = asyncpg.pool.PoolConnectionProxy

DEFAULT_SCHEMA = "grpc_idempotency"

# SQLSTATEs raised by the store's own functions (migrations/0001_records.sql).
_CLAIM_BUSY = "GI001"
_ALREADY_RECORDED = "GI002"
_CLAIM_LOST = "GI003"


# Outcomes up to this size are inlined in the batched commit (one round trip); larger ones
# travel as binary bind parameters (hex literals would double them on the wire and in memory).
INLINE_OUTCOME_BYTES = 16 * 1024
# A rollback after a failure gets this long before the connection is dropped instead: after a
# partition the connection may never answer again.
ROLLBACK_TIMEOUT_S = 2.0
# How long a store-internal READ COMMITTED transaction (``Store.read_committed``: a relay's claim
# or marks, a purge batch) may sit idle: its statements are sent back to back, so an idle gap
# this long means the process froze or the network split while it held rows locked.
READ_COMMITTED_IDLE_S = 5.0
# How long a records purge batch waits on a row lock another transaction holds (lock_timeout,
# per wait) before it is rolled back and redone skipping locked rows (Statements.purge_skipping).
# While it waits it holds the rows it already deleted, and claims of their keys wait with it:
# this bounds that wait. Above the usual holders' time (a takeover's statement, a batch of
# 1,000 deleted in about 5 ms) so that the faster statement stays the usual one; a lock held
# longer (a long call transaction, a session idle in one) is skipped, at the cost of one batch
# redone (tens of ms of the purge's time). A session's own lock_timeout (a role's), if
# shorter, bounds it instead (sql.begin).
PURGE_LOCK_WAIT_S = 0.1
_DEFAULT_COMMAND_TIMEOUT_S = 30.0

PROBE_S = 2.0
"""How long a live database may take, by default, to answer the outage probe's ``SELECT 1``
on a fresh connection (``Store.connect``'s ``probe_timeout``), and a DSN given for later use
to answer at all (``vet_dsn``)."""


def _lost_race(exc: asyncpg.PostgresError) -> bool:
    """A claim that failed this way lost to a concurrent attempt: look again. Besides the claim
    function's own codes, at REPEATABLE READ or SERIALIZABLE a concurrent claim that committed
    after this transaction's snapshot is a serialization failure (DESIGN pitfall 7)."""
    state = exc.sqlstate
    return state in (_CLAIM_BUSY, _ALREADY_RECORDED) or classify(state) is Failure.CONFLICT


async def _no_session_reset(_conn: PooledConnection) -> None:
    """The library ends every transaction it opens, takes only transaction-scoped locks and
    sets nothing on the session, and resets what a handler may have set in the same round trip
    as its commit (``sql.SESSION_RESET``), so the pool's default reset query would be a wasted
    round trip on every call (see README, "Handlers and the connection")."""


@dataclass(slots=True)  # not frozen: never changed, and built on every claim (2 us frozen)
class _Claim:
    scope: str
    key: str
    retention_s: float
    token: int | None = None
    """The fencing token; ``None`` in atomic mode, where the claim is in the same transaction."""
    method: str = ""
    fingerprint: bytes = b""
    """Atomic mode: what the record written at completion holds."""


class Attempt:
    """An open transaction that holds a claimed key: in atomic mode the claim itself is in it,
    in phased mode it has verified and locked the committed claim (``PhasedClaim.begin_final``).

    Exactly one of ``record``, ``record_error`` or ``release`` ends it, and the connection goes
    back to the pool in every case.
    """

    started_at: datetime | None = None
    """Atomic mode: when the operation began on the database's clock, if the claim was asked
    to read it (``claim_atomic(read_start=True)``). A class attribute until then: nothing on
    every call's."""

    commit_sent = False
    """Whether ``record`` or ``record_error`` was cancelled (the call's client gone, its
    deadline spent) with the COMMIT handed to the driver: its fate is then PostgreSQL's, which
    commits it as a rule (a statement waiting on a lock waits on, its client gone); or with
    the COMMIT answered, as the connection went back to the pool. Set on those paths only (a
    class attribute until then: nothing on every call's)."""

    def __init__(
        self, store: Store, conn: PooledConnection, claim: _Claim, timeout: float | None = None
    ) -> None:
        self._store = store
        self.connection = conn
        self._claim = claim
        self._timeout = timeout
        self._done = False

    # Plain functions returning the coroutine (awaited as before): a coroutine of their own
    # around ``_complete`` was one more frame for each of its resumptions, on every call.
    def record(self, outcome: Outcome) -> Coroutine[Any, Any, None]:
        """Commits the handler's writes with the outcome. Raises ``StoreUnavailable`` when the
        commit's fate is unknown or failed, ``LeaseLost`` (phased: the claim was taken over),
        ``TransactionConflict`` (a serialization failure) or ``HandlerDatabaseError`` (the
        handler's transaction was aborted, replaced, or a write of its failed at COMMIT):
        nothing was recorded then, and the caller must not claim success."""
        return self._complete(outcome, discard_writes=False)

    def record_error(self, outcome: Outcome) -> Coroutine[Any, Any, None]:
        """Rolls back the handler's writes and commits the (deterministic) error outcome."""
        return self._complete(outcome, discard_writes=True)

    async def _complete(self, outcome: Outcome, *, discard_writes: bool) -> None:
        conn = self.connection
        c = self._claim
        message = outcome.message.replace("\x00", "\ufffd")
        size = len(outcome.response or b"") + len(outcome.details or b"")
        # Keeping the handler's writes, the batch releases the library's savepoint first: in a
        # transaction the handler replaced (COMMIT or ROLLBACK, then BEGIN) it is gone, and the
        # batch fails (3B001) instead of committing the outcome with half the writes (discarding
        # them, ROLLBACK TO SAVEPOINT does the same). No round trip more.
        keep = "" if discard_writes else f"RELEASE SAVEPOINT {SAVEPOINT}; "
        committed = False
        inline = size <= INLINE_OUTCOME_BYTES
        # Whether a cancellation finds the COMMIT handed to the driver: inline, one batch with
        # it, sent before the first await in it (the check below raises, never waits).
        committing = inline
        try:
            # (A connection asyncpg terminated cannot even be asked: the statement below then
            # fails as the store's error, as it does on one the server closed.)
            if not connection_closed(conn) and not conn.is_in_transaction():
                # Committed (it may not be retried: the writes would be made again) or gone.
                raise _ended_by_handler(conn, "no transaction was open at the commit")
            if inline:
                sql = self._store.statements.complete_and_commit(
                    scope=c.scope,
                    key=c.key,
                    token=c.token,
                    method=c.method,
                    fingerprint=c.fingerprint,
                    code=int(outcome.code),
                    message=message,
                    details=outcome.details,
                    response=outcome.response,
                    retention_s=c.retention_s,
                    discard_writes=discard_writes,
                )
                await conn.execute(keep + sql, timeout=self._timeout)
            else:
                # Two more round trips, a small price next to shipping the bytes as text. The
                # savepoint is ended first, as in the inline batch: the handler's writes rolled
                # back to it (a recorded error, cut to 7 KiB, no longer gets here) or kept. Kept,
                # the release also ends a SET TRANSACTION READ ONLY of the handler's (PostgreSQL
                # puts back the read-write state the savepoint began with): recorded inside it,
                # the outcome failed (25006) where the inline batch committed it.
                end = "ROLLBACK TO" if discard_writes else "RELEASE"
                await conn.execute(f"{end} SAVEPOINT {SAVEPOINT}", timeout=self._timeout)
                statements = self._store.statements
                by_token: tuple[Any, ...] = (c.token,)
                sql = statements.complete
                if c.token is None:
                    by_token, sql = (c.method, c.fingerprint), statements.complete_atomic
                await conn.execute(
                    sql,
                    c.scope,
                    c.key,
                    *by_token,
                    int(outcome.code),
                    message,
                    outcome.details,
                    outcome.response,
                    c.retention_s,
                    timeout=self._timeout,
                )
                committing = True
                await conn.execute(SESSION_RESET + "COMMIT", timeout=self._timeout)
            committed = True
        except asyncpg.PostgresError as exc:
            await self._rollback_quietly()
            if exc.sqlstate == _CLAIM_LOST:
                raise LeaseLost("the claim was lost before commit; nothing recorded") from exc
            if exc.sqlstate == NO_SUCH_SAVEPOINT:
                raise _ended_by_handler(conn, "its transaction was replaced by another") from exc
            if exc.sqlstate == IN_FAILED_TRANSACTION:
                raise aborted_by("the handler") from exc
            failure = classify(exc.sqlstate)
            if failure is Failure.CONFLICT:
                raise TransactionConflict(
                    f"the commit failed on a serialization conflict (SQLSTATE {exc.sqlstate});"
                    " nothing was recorded: retry"
                ) from exc
            if failure is Failure.OTHER:
                # The handler's write failing only now: a constraint checked at COMMIT.
                raise _handler_failed(exc, self._store) from exc
            raise store_error(exc, "committing the outcome", store=self._store.store_log) from exc
        except (LeaseLost, HandlerDatabaseError):
            await self._rollback_quietly()
            raise
        except Exception as exc:
            if not from_the_driver(exc):
                raise
            if not isinstance(exc, STORE_ERRORS):
                # asyncpg could not read an answer (the COMMIT's, perhaps): the connection's
                # state is unknown, and the commit's fate is PostgreSQL's, as on a lost one.
                _drop(conn)
                raise store_error(
                    exc, "committing the outcome", store=self._store.store_log
                ) from exc
            live = not connection_closed(conn)
            await self._rollback_quietly()
            # A statement of the handler's still running on the connection (spawned, not
            # awaited): asyncpg refuses the commit (InterfaceError, "another operation is in
            # progress"). The handler's bug, not a store outage to retry for ever.
            if live and isinstance(exc, asyncpg.InterfaceError):
                raise _handler_failed(exc, self._store, connection_live=True) from exc
            raise store_error(exc, "committing the outcome", store=self._store.store_log) from exc
        except asyncio.CancelledError:
            # The call was cancelled (its client gone, its deadline spent, the server stopping)
            # with the commit on the wire: its fate is PostgreSQL's. Handed back, the connection
            # made the pool wait for the database to confirm the cancellation; with the answer
            # lost (a partition), the call's task and the connection were held until asyncpg
            # gave up on it: the pool's command_timeout (30 s by default), for good without one.
            # Dropped, as ``Store.connection`` drops a statement cut short: PostgreSQL commits
            # or rolls back what it has, and a retry replays or runs again.
            self.commit_sent = committing
            _drop(conn)
            raise
        finally:
            try:
                await self._finish()
            except asyncio.CancelledError:
                # Cancelled as the connection went back to the pool (its reset: a turn of the
                # loop, a round trip with a ``reset=`` of the pool's own), the COMMIT answered:
                # the outcome is committed. Counted "released", it was not what the database
                # held, and the retry replayed it.
                if committed:
                    self.commit_sent = True
                raise

    async def release(self, *, interrupted: bool = False) -> HandlerDatabaseError | None:
        """Rolls back everything, once the handler has run: the claim disappears and a retry
        runs the handler again. ``interrupted``: a statement of this transaction timed out or
        was cancelled on the wire and may still run; the connection is dropped rather than
        handed back, which would wait for the database to confirm the cancellation (behind a
        partition, the whole ``command_timeout``, or for ever without one). PostgreSQL rolls
        back what was open.

        Returns the handler's misuse found on the way (logged at error), ``None`` if none: it
        ended the call's transaction itself (COMMIT, or ROLLBACK then BEGIN), so what it wrote
        may have committed, and a retry would write it again. The call must then answer that
        error (INTERNAL), not the handler's own (transient) status. Found in the same round
        trip: ``ROLLBACK TO SAVEPOINT`` fails (3B001) once the library's savepoint is gone."""
        if self._done:
            return None
        if interrupted:
            _drop(self.connection)
        try:
            return await self._rollback_checked()
        finally:
            await self._finish()

    async def _abandon(self, *, interrupted: bool = False) -> None:
        """``release`` before the handler ran (the opening batch failed: no savepoint yet)."""
        if interrupted:
            _drop(self.connection)
        try:
            await self._rollback_quietly()
        finally:
            await self._finish()

    async def _rollback_checked(self) -> HandlerDatabaseError | None:
        return await _rollback_checked(self.connection)

    async def _rollback_quietly(self) -> None:
        await _rollback_quietly(self.connection)

    async def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        # ``Store._release``, inline (it runs on every call).
        try:
            await self._store.pool.release(self.connection)
        except STORE_ERRORS:
            log.debug("dropping a broken connection", exc_info=True)


async def _rollback_checked(conn: PooledConnection) -> HandlerDatabaseError | None:
    """Rolls back a transaction that holds the library's savepoint; returns the handler's misuse
    found on the way (``Attempt.release``), ``None`` if none."""
    try:
        # (Even asking raises once asyncpg has let go of a connection a statement timed out on:
        # connection_closed says closed.)
        if connection_closed(conn):
            return None
        if not conn.is_in_transaction():
            return _ended_by_handler(conn, "no transaction was open at the release")
        # A rollback undoes every SET, LISTEN, cursor and temporary table of the handler's,
        # but not a session advisory lock it took: held by a pooled connection, it blocked
        # every later call that asked for it, for as long as the connection lived. (After the
        # ROLLBACK: in an aborted transaction it would fail, and the ROLLBACK with it.)
        await conn.execute(
            f"ROLLBACK TO SAVEPOINT {SAVEPOINT}; {ROLLBACK_AND_UNLOCK}", timeout=ROLLBACK_TIMEOUT_S
        )
    except asyncpg.PostgresError as exc:
        await _rollback_quietly(conn)  # the batch stopped at its failing statement
        if exc.sqlstate == NO_SUCH_SAVEPOINT:
            return _ended_by_handler(conn, "its transaction was replaced by another")
    except Exception:
        # The transaction dies with the connection; make sure the pool does not reuse it. (Not
        # STORE_ERRORS alone: what asyncpg raises reading an answer it cannot make sense of
        # escaped the release raw.)
        _drop(conn)
    except BaseException:
        _drop(conn)  # cancelled on the wire: see _rollback_quietly
        raise
    return None


async def _rollback_quietly(conn: PooledConnection) -> None:
    try:
        if connection_closed(conn) or not conn.is_in_transaction():
            return
        # A commit's batch that failed (an aborted transaction, a deferred constraint, a lost
        # claim) stopped before its reset: a session advisory lock of the handler's, which the
        # ROLLBACK leaves, reached the next call on the connection (_rollback_checked).
        await conn.execute(ROLLBACK_AND_UNLOCK, timeout=ROLLBACK_TIMEOUT_S)
    except Exception:
        # The transaction dies with the connection; make sure the pool does not reuse it.
        _drop(conn)
    except BaseException:
        # Cancelled with the ROLLBACK on the wire (the call's client gone, its deadline spent):
        # handed back, the connection made the pool wait for the database to confirm the
        # cancellation, unbounded, and with the answer lost (a partition) the release's task
        # and the connection were held as long as the partition lasted. Dropped: PostgreSQL
        # rolls back, and asyncpg's pool takes a terminated connection back on its own.
        _drop(conn)
        raise


def connection_closed(conn: PooledConnection) -> bool:
    """Whether ``conn`` is closed. asyncpg detaches the pool's proxy of a connection it let go
    of (terminated, lost, or after a statement timeout it could not cancel): then even asking
    raises InterfaceError, which escaped the library as a raw exception (UNKNOWN)."""
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True


def _unknown(applied: set[int]) -> list[int]:
    known = max(m.version for m in migrations.available_migrations())
    return sorted(v for v in applied if v > known)


def _warn_newer(schema: str, newer: list[int]) -> None:
    log.warning(
        "schema %r has migrations %s that this version of grpc-idempotency does not know"
        " (a newer release migrated it); running anyway",
        schema,
        newer,
    )


def _ended_by_handler(conn: PooledConnection, how: str) -> HandlerDatabaseError:
    """``ended_by_handler``, and the connection dropped: once the call's transaction is over,
    what the handler ran on the session (a SET, an advisory lock, a LISTEN) is no longer
    undone by a ROLLBACK, and no commit of the library's resets it (``sql.SESSION_RESET``).
    Given back, the next call on the connection, another tenant's perhaps, inherited it."""
    _drop(conn)
    return ended_by_handler(how)


def _drop(conn: PooledConnection) -> None:
    """Closes ``conn`` at once, so that the pool does not reuse it. asyncpg may have dropped it
    already (a lost connection, a cancellation it could not confirm): then even ``terminate()``
    raises (InterfaceError, "released back to the pool"), and there is nothing left to do. That
    error escaped: a relay died of it, and a look-up answered UNKNOWN."""
    with contextlib.suppress(*STORE_ERRORS):
        conn.terminate()


async def _stopped(conn: PooledConnection) -> None:
    """Waits, at most ``ROLLBACK_TIMEOUT_S``, for asyncpg's cancel request of the statement a
    cancellation cut short to reach PostgreSQL; the caller drops the connection after.

    asyncpg sends a cancel request (over a connection of its own, to the address ``conn`` was
    opened to: a pooler forwards it to the server connection this client holds) as soon as a
    statement's task is cancelled. Dropped at once, the connection took that request down with
    it (``terminate()`` cancels asyncpg's pending cancellation tasks) and PostgreSQL, which does
    not read a socket while a statement runs or waits on a lock, never noticed: a purge batch
    deleted on for seconds after the command exited, or waited on a row lock for as long as it
    was held, then went on. Bounded: behind a network partition the request never arrives, and
    the connection is dropped anyway (the open transaction still cannot commit)."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        # Private, but the only handle on asyncpg's own cancel request: the task sending it, in
        # the connection's ``_cancellations`` (PoolConnectionProxy forwards the attribute), the
        # same in asyncpg 0.30 and 0.32 (``Protocol._wait_for_cancellation`` changed its
        # signature between them). Once sent, the request stops the statement; no task: none.
        cancellations = getattr(conn, "_cancellations", None)
        if cancellations is None:
            _warn_no_cancellations()
            return
        pending: set[asyncio.Task[None]] = set(cancellations)
        if pending:
            await asyncio.wait(pending, timeout=ROLLBACK_TIMEOUT_S)


@functools.cache
def _warn_no_cancellations() -> None:
    # Once: an asyncpg whose connections have no ``_cancellations`` (renamed in a release
    # newer than this library knows) would let a stopped purge's statement run on unseen.
    log.warning(
        "this asyncpg's connections have no _cancellations: a statement cut short is dropped"
        " without waiting for its cancel request, and may run on in PostgreSQL"
    )


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` cut a statement short on the wire (it may still run in PostgreSQL)."""
    return isinstance(exc, (TimeoutError, asyncio.CancelledError))


def _state_unknown(exc: BaseException) -> bool:
    """Whether the connection a statement raised ``exc`` on is in a state nobody knows: the
    statement was cut short (``_interrupted``), or asyncpg failed reading its answer with an
    error of no database class (``from_the_driver``), after which a ROLLBACK on it may fail
    the same way, raw."""
    return _interrupted(exc) or not isinstance(exc, STORE_ERRORS)


def _answer_unread(exc: BaseException) -> bool:
    """Whether asyncpg failed reading a statement's answer with an error of no database class
    (``from_the_driver``): the statement ran, and may have committed, whatever it answered."""
    return not isinstance(exc, STORE_ERRORS) and from_the_driver(exc)


# The server ended the session: admin_shutdown (a restart, a failover, pg_terminate_backend),
# crash_shutdown.
_SESSION_ENDED = frozenset({"57P01", "57P02"})


def _connection_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says that the statement's pooled connection is gone: reset or closed
    under it, or its session ended by the server. That says nothing of the database itself:
    after a restart or a failover every connection the pool opened before is gone, and each
    fails once, when next used (a failover that moved a virtual IP resets it only then; the
    event loop may not have seen a restart's end of a connection yet). Not a timeout: behind a
    partition another connection would wait as long."""
    if isinstance(exc, TimeoutError):
        return False
    if sqlstate(exc) in _SESSION_ENDED:
        return True
    return isinstance(
        exc,
        (
            asyncpg.PostgresConnectionError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,  # "cannot switch to state": the server's end pending
            OSError,
        ),
    )


def _read_only(conn: PooledConnection) -> bool:
    """Whether ``conn``'s session takes no writes, as the server last reported it (its
    ParameterStatus messages, no round trip): a hot standby (``in_hot_standby``, PostgreSQL 14
    and later), or a session whose transactions are read-only by default
    (``default_transaction_read_only``: set on the database, the role or the server)."""
    settings = conn.get_settings()
    # Two getattr()s, not any() over a generator: this runs after every atomic claim.
    return (
        getattr(settings, "in_hot_standby", None) == "on"
        or getattr(settings, "default_transaction_read_only", None) == "on"
    )


def _checked_acquire_timeout(value: float | None) -> float | None:
    # A negative one was clamped to 1 ms without a word, and NaN compared false everywhere.
    # Text (from the environment) was a bare "'<' not supported", naming no option. Capped:
    # 10**400 (below math.inf) raised OverflowError from asyncpg.
    return checked_seconds("acquire_timeout", value, positive=True, or_none=True)


def _checked_timeout(name: str, value: object) -> None:
    # Checked here: asyncpg's own check of command_timeout raises from its connection-parameter
    # module, where it was told as "the DSN cannot be parsed"; a connect timeout of 0 or less
    # timed every connection out, told as an outage; NaN and inf meant no timeout at all; and
    # 10**400 (below math.inf) raised OverflowError from asyncpg. None: no timeout.
    checked_seconds(name, value, positive=True, or_none=True)


def _own_password(password: Callable[[], Any]) -> Callable[[], Coroutine[Any, Any, Any]]:
    """``password``, whose failure is raised as ``PasswordFailed``: asyncpg calls it (and awaits
    what it returns) for each connection it opens, and lets its error escape from inside the
    driver, where it passed for the DSN's or the database's."""

    async def own() -> Any:
        try:
            value = password()
            if inspect.isawaitable(value):
                value = await value
            if value is not None and not isinstance(value, str):
                # Never quoted: it is the secret. asyncpg refused it only where the server asks
                # for a password, as an InternalClientError taken for a certain outage (a
                # fail-open method ran unclaimed with the database up).
                raise TypeError(f"the password callable returned {type(value).__name__}, not a str")
        except Exception as exc:
            raise PasswordFailed(
                f"the password callable (Store.connect's password=) raised {type(exc).__name__}"
            ) from exc
        return value

    return own


_DEFAULT_MIN_SIZE = 2


def _checked_pool_size(name: str, value: object) -> None:
    # asyncpg checks the values, not the type: text (from the environment) was a bare
    # "'<' not supported between instances of 'str' and 'int'", naming no option.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number of connections, not {value!r}")


_WHOLE_NUMBER_OPTIONS = (
    "statement_cache_size",
    "max_cacheable_statement_size",
    "max_queries",
)
"""asyncpg's pool and connection options that are counts: asyncpg compares them raw, and text
(from the environment, ``statement_cache_size="0"`` behind PgBouncer) was a bare "'<' not
supported between 'str' and 'int'", naming no option."""


_CALLABLE_OPTIONS = ("connect", "setup", "init", "reset")
"""asyncpg's pool options that are functions it calls."""


def _checked_whole_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, not {value!r}")


def _checked_lifetime(name: str, value: object) -> None:
    # Seconds, as asyncpg times both lifetimes (loop.call_later): 0.5 works, and asyncpg's own
    # tests use it; refused as no whole number, a valid setting failed. Text or None was
    # asyncpg's bare "'<' not supported"; NaN passed its check (nan < 0 is false) to time every
    # cached statement out at nan, and 10**400 (below math.inf) made call_later raise
    # OverflowError once the pool ran. 0 is asyncpg's "no limit".
    checked_seconds(name, value)


def _checked_schema(schema: object) -> None:
    # Before the pool is opened: refused after, the pool was left open (its connections held
    # until the process ended), and with the database down a typo was an outage to retry.
    if not isinstance(schema, str):
        raise TypeError(f"schema must be a str (a PostgreSQL schema name), not {schema!r}")
    schema_identifier(schema)


def _checked_server_settings(value: object) -> None:
    # asyncpg refuses any other with a ClientConfigurationError, told as "the DSN cannot be
    # parsed" (statement_timeout=5000, an int, is the likely slip).
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"server_settings must be a dict of str to str, not {value!r}")
    wrong = {k: v for k, v in value.items() if not (isinstance(k, str) and isinstance(v, str))}
    if wrong:
        raise TypeError(f"server_settings must map str to str (give numbers as text): {wrong!r}")


class _HoldingClaim:
    """``Store.holding_claim``'s block (a class, not a generator-based context manager: it is
    entered on every call)."""

    __slots__ = ("_claiming", "_outermost", "_task")

    def __init__(self, claiming: set[asyncio.Task[Any]]) -> None:
        self._claiming = claiming
        self._task: asyncio.Task[Any] | None = None
        self._outermost = False

    def __enter__(self) -> None:
        if self._task is not None:
            # Entered again inside its own block: the inner entry took the hold for not the
            # outermost, and neither end released it (``close`` waited for the task). The
            # generator-based context manager this was refused a second entry too.
            raise RuntimeError("a holding_claim() block cannot be entered again while it runs")
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - the interceptor runs in a task
            return
        # Nested blocks of one task (``claim_phased`` called inside another claim's block):
        # the outermost one ends the hold, or the inner end let ``close`` stop waiting for it.
        self._task = task
        self._outermost = task not in self._claiming
        self._claiming.add(task)

    def __exit__(self, *exc: object) -> None:
        task, self._task = self._task, None
        if task is not None and self._outermost:
            self._claiming.discard(task)


class Store:
    """Idempotency records in PostgreSQL, under their own schema."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = DEFAULT_SCHEMA,
        acquire_timeout: float | None = None,
    ) -> None:
        # (Not every awaitable: an asyncpg Pool is one, awaited to open it.)
        if pool is None or isinstance(pool, str | bytes) or inspect.iscoroutine(pool):
            # The DSN (or None, or an un-awaited Store.connect) was accepted: every statement
            # then failed with a bare AttributeError naming no argument.
            if inspect.iscoroutine(pool):
                pool.close()  # else reported "never awaited" when collected
            raise TypeError(
                f"Store takes an asyncpg pool, not {type(pool).__name__}: for a DSN,"
                " store = await Store.connect(dsn)"
            )
        _checked_schema(schema)  # its type too: re's "expected string" named no argument
        self.pool = pool
        self.schema = schema
        self.statements = Statements(schema)
        # Named from the pool's own connect arguments (asyncpg keeps them with the pool; a pool
        # that keeps them elsewhere is named by its schema alone): ``Store(pool)`` too.
        args = getattr(pool, "_connect_args", None)
        kwargs = getattr(pool, "_connect_kwargs", None)
        self.store_log = StoreLog(
            _described(
                args[0] if isinstance(args, list | tuple) and args else None,
                kwargs if isinstance(kwargs, dict) else {},
                schema,
            )
        )
        """How the operator's log names this store (``host:port/database, schema S``; and its
        shard's name, given by ``ShardedStores``), each of its problems once a minute."""
        self.acquire_timeout = _checked_acquire_timeout(acquire_timeout)
        # The pool's command_timeout (asyncpg keeps it with the pool's connect options; a pool
        # made without one, or an asyncpg that keeps it elsewhere, gives None: calls' deadlines
        # alone bound the statements then).
        options = getattr(pool, "_connect_kwargs", None)
        timeout = options.get("command_timeout") if isinstance(options, dict) else None
        self.command_timeout: float | None = (
            float(timeout) if isinstance(timeout, int | float) and 0 < timeout < math.inf else None
        )
        self._settling: set[asyncio.Future[None]] = set()
        self._claiming: set[asyncio.Task[Any]] = set()
        """Tasks holding a claim of this store's (``holding_claim``): ``close`` lets them end."""
        self._draining = False
        """``close`` has begun: no new claims."""
        self._closing = False
        self._probe: _Probe | None = None
        """How ``answers`` opens a connection of its own; set by ``connect`` only."""
        self._renewal_line: _RenewalLine | None = None
        """The connection of its own that lease renewals use when the pool has none free; set
        by ``connect`` only (a ``Store(pool)`` cannot open one: its renewals wait in the pool)."""
        self._probing: asyncio.Future[bool] | None = None
        self._default_isolation: str | None = None
        self._acquired = 0
        """Connections handed out by ``_acquire``: progress, seen by a wait that times out."""

    @property
    def closed(self) -> bool:
        """Whether the application closed this store (``close()`` has begun), or its pool: no
        statement will run on it again, unlike a store that cannot be reached for now. The
        background loops (``Purger``, ``Relay.run``) end on it rather than retry for ever."""
        return self._draining or self.pool.is_closing()

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        min_size: int | None = None,
        max_size: int = 10,
        acquire_timeout: float | None = None,
        command_timeout: float | None = _DEFAULT_COMMAND_TIMEOUT_S,
        migrate: bool = False,
        check_schema: bool = True,
        probe_dsn: str | None = None,
        probe_timeout: float = PROBE_S,
        **pool_options: Any,
    ) -> Store:
        """Opens a pool for the store (and for handlers' writes, which share its transaction).

        ``min_size`` (connections kept open) is 2, or ``max_size`` if that is smaller.

        One more connection, outside the pool, is opened when a phased claim's lease renewal
        finds no pooled connection free (every one held by handlers): renewals never queue
        behind them, so a busy pool does not cost a live owner its lease. Count ``max_size``
        + 1 per store against ``max_connections`` (or PgBouncer's client limit).

        ``acquire_timeout`` bounds the wait for a pooled connection; a call's own deadline always
        does. ``None`` (the default) waits as long as the call may, without arming a timer when
        it has no deadline.

        ``command_timeout`` (asyncpg's: the default timeout of every statement on the pool's
        connections, the handlers' included; pass ``timeout=`` on a statement to override it)
        bounds how long a call can hang on a database that stopped answering, e.g. behind a
        network partition. It also bounds opening a pooled connection (asyncpg's connect
        ``timeout``, 60 s by default, unless you pass ``timeout=``). ``None`` waits forever.

        Behind PgBouncer in transaction mode pass ``statement_cache_size=0`` (an asyncpg pool
        option): its server connections do not keep a client's named prepared statements. The
        library keeps no session state, so nothing else changes (README, "Running in
        production").

        ``probe_dsn`` is where ``answers`` (the check before a fail-open method runs unclaimed on a
        timeout) connects, ``dsn`` by default. Behind PgBouncer give the database's own address:
        through the pooler, whose server connections a locked table can hold, the check can go
        unanswered with the database up. ``probe_timeout`` is how long that check waits for the
        fresh connection's ``SELECT 1`` (connect, TLS and authentication included), never more
        than half the call's time left: past it the database counts as down, and a fail-open
        method runs unclaimed. On a saturated host a live database can take longer than the
        default 2 s to accept a connection; raise it there.

        ``migrate=True`` applies missing migrations first; production deployments usually run
        ``grpc-idempotency migrate`` instead. Otherwise ``check_schema`` (the default) verifies
        that the schema is migrated and raises ``StoreMisconfigured`` naming the fix if not, so a
        server does not start only to fail every keyed call.
        """
        _checked_acquire_timeout(acquire_timeout)  # before a pool is opened for nothing
        for flag, value in (("migrate", migrate), ("check_schema", check_schema)):
            # Truth-tested below: migrate="false" (from the environment) migrated, and
            # check_schema=None skipped the check.
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, not {value!r}")
        _checked_schema(schema)
        _checked_pool_size("max_size", max_size)
        if min_size is None:
            # Not a fixed 2: ``max_size=1`` alone was refused by asyncpg as "min_size is greater
            # than max_size", naming an option the caller never gave.
            min_size = min(_DEFAULT_MIN_SIZE, max_size)
        _checked_pool_size("min_size", min_size)
        _checked_timeout("command_timeout", command_timeout)
        # Never None: an outage probe with no bound left a fail-open method waiting on a
        # database that accepts connections and never answers, as long as the call may wait.
        checked_seconds("probe_timeout", probe_timeout, positive=True)
        _checked_timeout("timeout", pool_options.get("timeout"))
        _checked_server_settings(pool_options.get("server_settings"))
        for name in _WHOLE_NUMBER_OPTIONS:
            if name in pool_options:
                _checked_whole_number(name, pool_options[name])
        for name in _CALLABLE_OPTIONS:
            # asyncpg calls them only as the pool opens: 5 or a name was a bare "'int' object is
            # not callable", naming no option.
            if pool_options.get(name) is not None and not callable(pool_options[name]):
                raise TypeError(f"{name} must be a function or None, not {pool_options[name]!r}")
        for name in ("max_cached_statement_lifetime", "max_inactive_connection_lifetime"):
            # Only if given: None is no default of asyncpg's (its "'<' not supported").
            if name in pool_options:
                _checked_lifetime(name, pool_options[name])
        # None (dsn) is asyncpg's: the PG* environment variables' database. Anything else but
        # text was a bare AttributeError ("no attribute 'decode'") out of the driver, and a
        # probe_dsn that is none was accepted, to fail every probe ("does not answer").
        if dsn is not None and not isinstance(dsn, str):
            raise TypeError(f"dsn must be a str, not {type(dsn).__name__}")
        if probe_dsn is not None and not isinstance(probe_dsn, str):
            raise TypeError(f"probe_dsn must be a str or None, not {type(probe_dsn).__name__}")
        unsent = unsendable(dsn)
        if unsent is not None:  # never quoted: it may hold a password
            raise DsnUnusable(f"cannot use the DSN: {unsent}")
        if at_in_user_info(dsn):
            raise DsnUnusable()  # the fixed message: percent-encode @ as %40
        if probe_dsn is not None:
            unsent = unsendable(probe_dsn)
            if unsent is not None:
                raise DsnUnusable(f"cannot use probe_dsn: {unsent}")
            if at_in_user_info(probe_dsn):
                raise DsnUnusable(f"probe_dsn: {DsnUnusable().message}")
        pool_options.setdefault("reset", _no_session_reset)
        if callable(pool_options.get("password")):
            pool_options["password"] = _own_password(pool_options["password"])
        if command_timeout is not None:
            # A connection the pool opens for a call (after a restart, or to grow) is bounded
            # like a statement: behind a partition the handshake hung for asyncpg's connect
            # timeout (60 s), past most calls' deadlines, and a fail-open method never ran.
            pool_options.setdefault("timeout", command_timeout)
        pool_options.setdefault("server_settings", {"application_name": "grpc-idempotency"})
        named = StoreLog(_described(dsn, pool_options, schema))  # for a pool that fails to open
        try:
            pool = await asyncpg.create_pool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                command_timeout=command_timeout,
                **pool_options,
            )
        except Exception as exc:
            if isinstance(exc, PasswordFailed):
                refused = password_error(exc, "connecting", store=named)
                raise _naming(refused, named) from exc.__cause__
            if dsn_unusable(exc):
                # The driver's text can quote pieces of the password: name the file it could
                # not use, if that is what it was, else say nothing of it.
                problem = unusable_file(dsn)
                raise DsnUnusable(f"cannot use the DSN: {problem}" if problem else "") from None
            if isinstance(exc, STORE_ERRORS):
                raise _naming(connect_error(exc, store=named), named) from exc
            raise
        store = cls(pool, schema=schema, acquire_timeout=acquire_timeout)
        connect = pool_options.get("connect") or asyncpg.connect
        options = {k: v for k, v in pool_options.items() if k not in _POOL_ONLY_OPTIONS}
        # As the pool calls ``connect`` (a custom one may require these).
        options.setdefault("connection_class", asyncpg.Connection)
        options.setdefault("record_class", asyncpg.Record)
        store._probe = _Probe(
            connect,
            dsn if probe_dsn is None else probe_dsn,
            options,
            float(probe_timeout),
            store.store_log,
        )
        # The pool's DSN, not probe_dsn: behind PgBouncer (transaction mode) each renewal is a
        # transaction of its own, so the line takes a server connection only while it renews.
        store._renewal_line = _RenewalLine(connect, dsn, options, store.store_log)
        try:
            if probe_dsn is not None:
                await store._probe.vet()
            if migrate:
                await store.migrate()
                newer = await store.newer_migrations()
                if newer:  # migrating skips the check below, not what it tells
                    _warn_newer(store.schema, newer)
            elif check_schema:
                await store.check_schema()
        except BaseException as exc:
            await store.close()
            if isinstance(exc, StoreUnavailable):
                _naming(exc, store.store_log)
            raise
        return store

    async def close(self, timeout: float = 10.0) -> None:
        """Closes the pool, within ``timeout`` in all; connections that do not close in time
        (a partitioned database never answers) are dropped.

        First, for as long as ``timeout`` allows, the calls that hold a claim of this store end
        (``holding_claim``): commit, or release their keys. A server's ``stop(grace)`` returns
        before the handlers it cancelled have run their release, and a phased call's release
        needs a pooled connection: closed first, the pool refused it, and the key stayed
        claimed for its whole lease (a retry elsewhere was told "in progress" that long). So
        are claims whose callers went while they were on the wire (``_settle``)."""
        # Else text was a bare "unsupported operand" naming nothing, and the store left open;
        # NaN cut every wait below to none, and the pool terminated under the calls holding
        # claims (their keys claimed for their whole lease), without a word. Any other number
        # goes: 0 or less closes at once, more than the cap waits without bound.
        checked_seconds("timeout", timeout, minimum=-math.inf, cap=math.inf)
        if timeout > MAX_DURATION_S:
            # No bound, as math.inf is: 10**400 (below it) was a bare OverflowError, and the
            # store left open.
            timeout = math.inf
        elif timeout < 0:
            # At once, as 0: -10**400 (an int no float holds) was a bare OverflowError added to
            # the clock, and the store left open.
            timeout = 0.0
        deadline = asyncio.get_running_loop().time() + timeout
        if self._probing is not None:
            self._probing.cancel()  # its waiters take that for "no answer" (``answers``)
        # No claim from now on (``_refuse_if_draining``): one that began while the others
        # ended was not waited for, and the pool closed under it.
        self._draining = True
        current = asyncio.current_task()
        while self._left(deadline) > 0:
            # Again and again: a claim on the wire when the drain began holds it once it lands,
            # and an end may start a release (``_settling``).
            ending = {t for t in self._claiming if t is not current} | set(self._settling)
            if not ending:
                break
            await asyncio.wait(ending, timeout=self._left(deadline))
        self._closing = True
        if self._renewal_line is not None:
            # After the drain: the calls that held claims have stopped their lease keepers.
            self._renewal_line.close()
        try:
            await asyncio.wait_for(self.pool.close(), self._left(deadline))
        except TimeoutError:
            self.pool.terminate()

    async def _acquire_to_claim(self, timeout: float | None) -> PooledConnection:
        """A pooled connection for a claim, refused (``_refuse_if_draining``) if ``close`` began
        while the claim was queued for it: it has sent nothing yet. Let through, it claimed once
        the drain freed a connection and ran its handler during the drain (an atomic one not
        waited for; a phased one past close()'s timeout had the pool terminated under it, the
        key IN_PROGRESS for the whole lease)."""
        conn = await self._acquire("claiming a key", timeout)
        if self._draining:
            await self._release(conn)
            self._refuse_if_draining()
        return conn

    def _refuse_if_draining(self) -> None:
        if self._draining:
            # The store is closing: no outage (a fail-open method must not run unclaimed), and
            # UNAVAILABLE to the client, which retries on another replica.
            raise StoreUnavailable("idempotency store closing: no new claims", outage=False)

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - asyncio.get_running_loop().time())

    def holding_claim(self) -> _HoldingClaim:
        """Marks the current task as holding a claim of this store's until the block ends:
        ``close`` waits for it (the interceptor holds one around each execution)."""
        return _HoldingClaim(self._claiming)

    async def check_schema(self, *, readable_from: int | None = None) -> frozenset[int]:
        """Raises ``StoreMisconfigured`` unless every migration this version of the library
        needs has been applied to the store's schema; returns the versions applied.

        ``readable_from``: for a caller that only reads (``inspect``, ``list``, ``outbox stats``
        and ``outbox dead``), the oldest schema version it can read. A schema migrated that far
        is accepted with migrations missing, with a warning naming them and ``migrate``: in a
        rolling upgrade the new command is installed before the schema is migrated, which is
        when an operator most needs to look. The caller reads it as it stands (the versions
        returned say how; the CLI's readers pass them on). Whatever writes keeps refusing it:
        it would write in a shape the schema does not have yet."""
        if readable_from is not None and (
            isinstance(readable_from, bool)
            or not isinstance(readable_from, int)
            or readable_from < 1
        ):
            # Below 1 a schema never created passed as readable (with a warning), and every
            # read then failed on tables that are not there. A str raised TypeError.
            raise ValueError(
                f"readable_from must be a migration version (1 or more): {readable_from!r}"
            )
        async with self.connection("checking the schema") as conn:
            applied = frozenset(await migrations.applied_versions(conn, self.schema))
            others = (
                [] if applied or readable_from is None else await migrations.store_schemas(conn)
            )
        wanted = [m.version for m in migrations.available_migrations()]
        missing = [v for v in wanted if v not in applied]
        if not applied and readable_from is not None:
            # A reader given a schema that is not there most likely named the wrong one (left
            # out --schema for a store that has its own): "run migrate" sent it to create an
            # empty store there, whose every look-up then answered "no record".
            here = ", ".join(repr(o) for o in others) if others else "none"
            raise StoreMisconfigured(
                f"the idempotency schema {self.schema!r} is not created in this database, so"
                f" there is nothing to read there: check the schema's name (the schemas"
                f" holding a store in this database: {here})"
            )
        if missing:
            state = f"at version {max(applied)}" if applied else "not created"
            behind = (
                f"the idempotency schema {self.schema!r} is {state}; this version of"
                f" grpc-idempotency needs migrations {missing}: run `grpc-idempotency migrate"
                f" --dsn DSN --schema {self.schema}`"
            )
            if readable_from is None or min(missing) <= readable_from:
                raise StoreMisconfigured(f"{behind} (or Store.connect(..., migrate=True))")
            log.warning("%s; read as it stands meanwhile (commands that write refuse it)", behind)
        newer = _unknown(set(applied))
        if newer:
            _warn_newer(self.schema, newer)
        return applied

    async def newer_migrations(self) -> list[int]:
        """The migrations applied to the store's schema that this version of the library does
        not know: a newer release migrated it (a rollback, or a rolling deploy)."""
        async with self.connection("checking the schema") as conn:
            return _unknown(set(await migrations.applied_versions(conn, self.schema)))

    async def migrate(self) -> list[int]:
        async with self.connection("migrating") as conn:
            try:
                # Each statement as long as the pool's command_timeout allows, whatever the
                # role's statement_timeout says (``--command-timeout``).
                return await migrations.migrate(
                    conn, self.schema, statement_timeout_s=self.command_timeout
                )
            except migrations.MigrationLockTimeout as exc:
                _drop(conn)  # the wait was cut short on the wire, as ``connection`` drops
                raise StoreUnavailable(str(exc), outage=False) from exc
            except migrations.MigrationTimedOut as exc:
                _drop(conn)  # its statement was cut short on the wire, as ``connection`` drops
                limit = "" if self.command_timeout is None else f" of {self.command_timeout:g} s"
                raise StoreUnavailable(
                    f"{exc} ran past the statement timeout{limit} (or was cancelled) and was"
                    " rolled back: give a migration this long more time (--command-timeout, or"
                    " Store.connect(command_timeout=...)) and run it again, from one job before"
                    " the replicas start",
                    outage=False,
                ) from exc
            except migrations.MigrationFailed as exc:
                # Not retryable: the same migration fails alike on every run (exit 2).
                raise StoreMisconfigured(
                    f"idempotency store misconfigured while migrating schema {self.schema!r}:"
                    f" {exc}; it fails alike on every run until what PostgreSQL names is fixed"
                    " (an object of the same name that is not the store's: give the store a"
                    " schema of its own)"
                ) from exc
            except (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError) as exc:
                wait_s = migrations.lock_wait_s(self.command_timeout)
                # Its last try a deadlock's victim (40P01), said so: "a long transaction holds
                # it" and how long each wait was would send the operator to the wrong cause.
                why = (
                    f"a long transaction holds it; {migrations.LOCK_ATTEMPTS} tries of"
                    f" {wait_s:g} s each"
                    if isinstance(exc, asyncpg.LockNotAvailableError)
                    else "a transaction waiting for what the migration held deadlocked with it,"
                    f" the last of {migrations.LOCK_ATTEMPTS} tries"
                )
                raise StoreUnavailable(
                    f"a migration could not take its table lock ({why}): run"
                    " the migration again when that transaction has ended"
                ) from exc

    @contextlib.asynccontextmanager
    async def connection(
        self, doing: str, timeout: float | None = None
    ) -> AsyncIterator[PooledConnection]:
        """A pooled connection; database errors inside the block become ``StoreUnavailable``.

        Cancelled inside the block (a purger or relay stopping, a call's deadline), stopped
        (KeyboardInterrupt, SystemExit), or timed out there (a statement's ``timeout=``), the
        connection is dropped, not handed back: its statement may still be running, and
        asyncpg would wait for the database to confirm the cancellation, which behind a network
        partition takes the whole ``command_timeout`` (forever without one): a lease renewal
        bounded by the lease took lease + ``command_timeout``. PostgreSQL rolls back what was
        open."""
        conn = await self._acquire(doing, timeout)
        async with self._holding(conn, doing):
            yield conn

    @contextlib.asynccontextmanager
    async def _holding(self, conn: PooledConnection, doing: str) -> AsyncIterator[None]:
        """``connection``'s block on a connection already acquired: hands it back at the end,
        dropped if a statement was cut short."""
        try:
            yield
        except Exception as exc:
            if not from_the_driver(exc):
                raise
            if isinstance(exc, TimeoutError) or not isinstance(exc, STORE_ERRORS):
                # Cut short, or what asyncpg read made no sense to it: the connection's state
                # is unknown, and handed back it may fail the next statement on it.
                _drop(conn)
            await self._forget_connections_if_gone(exc)
            raise store_error(exc, doing, store=self.store_log) from exc
        except BaseException:
            # Cancelled, or any other exit that is no error (KeyboardInterrupt, SystemExit):
            # a statement may be mid-flight, and the next user would wait for it (as _abandon).
            _drop(conn)
            raise
        finally:
            await self._release(conn)

    @contextlib.asynccontextmanager
    async def read_committed(
        self,
        conn: PooledConnection,
        *,
        idle_timeout_s: float = READ_COMMITTED_IDLE_S,
        own_transaction: bool = False,
        lock_timeout_s: float | None = None,
    ) -> AsyncIterator[None]:
        """The block's statements at READ COMMITTED, whatever the database's or role's default:
        ``SKIP LOCKED`` and the re-check of a row changed meanwhile rely on it (at REPEATABLE
        READ such a row is a serialization failure). At a READ COMMITTED default (the usual
        one, looked up once per store) each statement is already a transaction of its own at
        that level, and nothing is added; otherwise the block is one transaction, ``BEGIN
        ISOLATION LEVEL READ COMMITTED`` ... ``COMMIT`` (two more round trips). No session
        state either way, so a transaction pooler may hand any server connection over.

        That transaction sits idle at most ``idle_timeout_s`` (``SET LOCAL``, as every
        transaction of the library's): it holds the rows its statements locked (a relay's
        claimed batch, a purge batch), and a process frozen or cut off between its statements
        otherwise kept them locked, skipped by every other relay, until TCP keepalive noticed.

        ``own_transaction``: the block is that one transaction at a READ COMMITTED default too,
        so that a statement cut short can never commit. A purge batch alone needs it: as a lone
        statement it ran on after its client was stopped and committed, while the purge
        reported those rows as not deleted.

        Not asyncpg's ``transaction()``: on a cancellation its exit would await a ROLLBACK on a
        connection whose statement may still be running. Here a cancellation first waits, a
        bounded while, for asyncpg's cancel request of the statement to reach PostgreSQL
        (``_stopped``), then leaves the connection to ``Store.connection``, which drops it
        (PostgreSQL rolls back).

        ``lock_timeout_s``: each lock wait of the transaction's statements at most that long,
        or the session's own ``lock_timeout`` if shorter (local to the transaction, as ``SET
        LOCAL``; 55P03 past it, raised as asyncpg's ``LockNotAvailableError``); only with
        ``own_transaction``."""
        if lock_timeout_s is not None and not own_transaction:
            raise ValueError("lock_timeout_s needs own_transaction")
        if self._default_isolation is None:
            self._default_isolation = await conn.fetchval("SHOW default_transaction_isolation")
        if self._default_isolation == "read committed" and not own_transaction:
            try:
                yield
            except asyncio.CancelledError:
                await _stopped(conn)
                raise
            return
        await conn.execute(begin_sql("read committed", idle_timeout_s, lock_timeout_s))
        try:
            yield
        except asyncio.CancelledError:
            await _stopped(conn)
            raise
        except Exception:
            try:
                if not connection_closed(conn) and conn.is_in_transaction():
                    await conn.execute("ROLLBACK", timeout=ROLLBACK_TIMEOUT_S)
            except Exception:
                # The transaction's fate is the connection's: the pool must not reuse it.
                with contextlib.suppress(Exception):
                    conn.terminate()
            raise
        await conn.execute("COMMIT")

    def statement_timeout(self, remaining: float | None) -> float | None:
        """The timeout of a store statement made for a call with ``remaining`` seconds left:
        that, but never more than the pool's ``command_timeout``. A ``timeout=`` on a statement
        replaces asyncpg's command_timeout instead of adding to it, so with the call's deadline
        alone a database behind a partition held every call for its whole deadline: the client
        got DEADLINE_EXCEEDED, never UNAVAILABLE, and a fail-open method never failed open."""
        cap = self.command_timeout
        if remaining is None or cap is None:
            return cap if remaining is None else remaining
        return min(remaining, cap)

    async def _acquire(
        self, doing: str, timeout: float | None, *, always_bounded: bool = False
    ) -> PooledConnection:
        """A pooled connection within ``timeout`` (and ``acquire_timeout``). ``always_bounded``:
        the timeout is armed even when a connection is free (see below), for a caller that no
        call's deadline cancels (a lease renewal)."""
        budget = self.acquire_timeout
        if timeout is not None:
            budget = timeout if budget is None else min(timeout, budget)
            if self.pool.get_idle_size() > 0 and not always_bounded:
                # A connection is free, so acquiring does not wait for one: skip the timeout,
                # which asyncpg implements with a task and a timer per acquire. (If the free
                # holder must reconnect first, asyncpg's connect timeout bounds that, and a
                # gRPC call's deadline cancels it anyway.)
                budget = self.acquire_timeout
        acquired = self._acquired
        try:
            conn: PooledConnection = await self.pool.acquire(
                timeout=None if budget is None else max(budget, 0.001)
            )
        except TimeoutError as exc:
            if self._acquired != acquired:
                # Other calls got connections while this one waited: the database is up and
                # busy, not an outage (a fail-open method must not run unclaimed: the store
                # may hold the key's outcome). Behind a partition, or with a frozen database,
                # nothing comes back to the pool, and the wait is an outage.
                raise StoreUnavailable(
                    f"idempotency store busy while {doing}: no pooled connection came free"
                    f" for this call within {budget:g} s",
                    outage=False,
                ) from exc
            raise store_error(exc, doing, store=self.store_log) from exc
        except PasswordFailed as exc:
            raise password_error(exc, doing, store=self.store_log) from exc.__cause__
        except STORE_ERRORS as exc:
            if self._closing:
                # The pool is closing or closed (asyncpg's InterfaceError, no SQLSTATE): no
                # outage, the database is up and may hold the key's outcome. Taken for one, a
                # fail-open method ran unclaimed while another replica ran the same key.
                raise StoreUnavailable(
                    f"idempotency store closed while {doing}", outage=False
                ) from exc
            # The pool opened a connection for it (``min_size=0``, a pool growing, a connection
            # replaced after a restart): refused for good at start-up (a setting, a database,
            # PgBouncer's refusals), it is misconfigured here as in ``connect``, not unavailable.
            raise connect_error(exc, doing, store=self.store_log) from exc
        self._acquired += 1
        return conn

    async def _release(self, conn: PooledConnection) -> None:
        try:
            await self.pool.release(conn)
        except STORE_ERRORS:
            log.debug("dropping a broken connection", exc_info=True)

    async def _forget_connections_if_gone(self, exc: BaseException) -> bool:
        """Whether ``exc`` says its connection is gone (``_connection_gone``); if so, the pool's
        other connections, opened as long ago, are replaced on their next use: after a restart
        or a failover each of them failed a call in turn (a keyed call answered UNAVAILABLE, a
        fail-open method run unclaimed on a database that held its key's outcome), where a
        connection opened now tells whether the database is there."""
        if not _connection_gone(exc):
            return False
        with contextlib.suppress(Exception):
            await self.pool.expire_connections()
        return True

    async def lookup(
        self, scope: str, key: str, *, timeout: float | None = None
    ) -> StoredRecord | None:
        """The record under (scope, key), as the database's clock sees it now."""
        # A pooled connection may have died with a database restart, and at SERIALIZABLE even a
        # read-only statement can lose a serialization race (40001): a look-up is a read, so
        # trying again is safe and spares the caller a spurious UNAVAILABLE.
        attempts = 3
        for attempt in range(1, attempts + 1):
            conn = await self._acquire("looking up a key", timeout)
            try:
                row = await conn.fetchrow(
                    self.statements.lookup, scope, key, timeout=self.statement_timeout(timeout)
                )
            except (
                asyncpg.PostgresConnectionError,
                asyncpg.InterfaceError,
                # "cannot switch to state": the connection read its session's end (a restart's
                # FATAL), not yet that of the socket. Not tried again, it failed the call as an
                # outage, and a fail-open method ran a completed key again.
                asyncpg.InternalClientError,
                OSError,
            ) as exc:
                _drop(conn)
                # A statement that timed out met a database that stopped answering (TimeoutError
                # is an OSError): trying again would wait out the timeout again, then a connect.
                if attempt == attempts or isinstance(exc, TimeoutError):
                    raise store_error(exc, "looking up a key", store=self.store_log) from exc
                # The next try on a connection opened now, not on another one of the pool's
                # that a restart or a failover left as dead as this one.
                await self._forget_connections_if_gone(exc)
                continue
            except asyncpg.PostgresError as exc:
                if classify(exc.sqlstate) is Failure.CONFLICT and attempt < attempts:
                    continue
                raise store_error(exc, "looking up a key", store=self.store_log) from exc
            except STORE_ERRORS as exc:
                raise store_error(exc, "looking up a key", store=self.store_log) from exc
            except Exception as exc:
                if not from_the_driver(exc):
                    raise
                _drop(conn)  # what it read made no sense to asyncpg: its state is unknown
                raise store_error(exc, "looking up a key", store=self.store_log) from exc
            except asyncio.CancelledError:
                # The client went with the look-up on the wire: handed back, asyncpg would wait
                # for PostgreSQL to confirm the cancellation, behind a partition the whole
                # command_timeout, and the call (the owner its local duplicates wait on) with it.
                _drop(conn)
                raise
            finally:
                await self._release(conn)
            return None if row is None else _record(row)
        raise AssertionError("unreachable")

    def _atomic_claim_sql(
        self,
        scope: str,
        key: str,
        method: str,
        fingerprint: bytes,
        retention_s: float,
        lease_s: float,
    ) -> str:
        return self.statements.claim(
            scope=scope,
            key=key,
            lock_id=claim_lock_id(self.schema, scope, key),
            method=method,
            fingerprint=fingerprint,
            retention_s=retention_s,
            lease_s=lease_s,
            atomic=True,
        )

    async def claim_atomic(
        self,
        *,
        scope: str,
        key: str,
        method: str,
        fingerprint: bytes,
        retention_s: float,
        lease_s: float,
        isolation: Isolation | None = None,
        timeout: float | None = None,
        read_start: bool = False,
    ) -> Attempt | None:
        """Opens the call's transaction and claims the key in it; ``None`` if another attempt
        holds or has recorded the key (look again). ``read_start``: set the attempt's
        ``started_at`` from the database (one round trip more).

        The transaction may sit idle for at most ``lease_s`` (the atomic lease): a frozen or
        partitioned owner loses the claim then, and a retry can take the key."""
        self._refuse_if_draining()
        claim = self._atomic_claim_sql(scope, key, method, fingerprint, retention_s, lease_s)
        sql = self.statements.begin_atomic_claim(
            claim, isolation=_level(isolation), idle_timeout_s=lease_s
        )
        held = _Claim(scope, key, retention_s, method=method, fingerprint=fingerprint)
        deadline = None if timeout is None else time.monotonic() + timeout
        tries = 2
        for tried in range(1, tries + 1):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # ``_acquire_to_claim``, inline (one coroutine fewer on every call).
            conn = await self._acquire("claiming a key", left)
            if self._draining:
                await self._release(conn)
                self._refuse_if_draining()
            attempt = Attempt(self, conn, held, _commit_timeout(lease_s))
            try:
                await conn.execute(sql, timeout=self.statement_timeout(left))
            except asyncpg.PostgresError as exc:
                await attempt._abandon()
                if _lost_race(exc):
                    return None
                # A pooled connection that a restart or a failover left dead (the pool's
                # others are replaced now): once more on a connection opened now. Safe: the
                # batch commits nothing, and a dead session's transaction is rolled back.
                # Answered as an outage instead, a fail-open method ran unclaimed, a completed
                # key again, on a database that was up and held its outcome.
                if tried < tries and await self._forget_connections_if_gone(exc):
                    continue
                raise store_error(exc, "claiming a key", store=self.store_log) from exc
            except BaseException as exc:
                await attempt._abandon(interrupted=_state_unknown(exc))
                if from_the_driver(exc):
                    if tried < tries and await self._forget_connections_if_gone(exc):
                        continue
                    raise store_error(exc, "claiming a key", store=self.store_log) from exc
                raise
            if _read_only(conn) and await self._transaction_read_only(attempt, left):
                # The claim writes nothing for a new key (the record is written with the
                # outcome), so it passed on a database that takes no writes (a standby after a
                # failover, one set read-only): the handler ran, the completion failed (25006),
                # and the call answered UNAVAILABLE, on every retry once more; a fail-open
                # method never failed open. It is the outage 25006 is (core.db_failures).
                await attempt._abandon()
                raise StoreUnavailable(
                    "idempotency store unavailable while claiming a key (read-only: a standby,"
                    " or default_transaction_read_only)"
                )
            if read_start:
                attempt.started_at = await self._atomic_start(attempt, scope, key, left)
            return attempt
        raise AssertionError("unreachable")

    async def _atomic_start(
        self, attempt: Attempt, scope: str, key: str, timeout: float | None
    ) -> datetime:
        """When the atomic attempt's operation began, on the database's clock (its record's
        created_at to be): the step versions it keys with follow it (``start_decides``)."""
        try:
            started: datetime = await attempt.connection.fetchval(
                self.statements.atomic_start, scope, key, timeout=self.statement_timeout(timeout)
            )
        except BaseException as exc:
            await attempt._abandon(interrupted=_state_unknown(exc))
            if from_the_driver(exc):
                raise store_error(exc, "claiming a key", store=self.store_log) from exc
            raise
        return started

    async def _transaction_read_only(self, attempt: Attempt, timeout: float | None) -> bool:
        """Whether the claim's transaction is read-only, asked of the transaction itself: once
        ``_read_only`` says the session is, which is a hint only. Behind PgBouncer it is the
        ParameterStatus PgBouncer cached at its first login to the database and sends every
        client since: a database read-only then (a maintenance window, a standby since
        promoted) had every atomic claim refused UNAVAILABLE for good, its transactions
        writable, and a fail-open method ran unclaimed on every call. One round trip, only
        when the hint says read-only."""
        conn = attempt.connection
        try:
            value = await conn.fetchval(
                "SELECT pg_catalog.current_setting('transaction_read_only')",
                timeout=self.statement_timeout(timeout),
            )
        except BaseException as exc:
            await attempt._abandon(interrupted=_state_unknown(exc))
            if from_the_driver(exc):
                raise store_error(exc, "claiming a key", store=self.store_log) from exc
            raise
        return bool(value == "on")

    async def begin(
        self,
        *,
        isolation: Isolation | None = None,
        timeout: float | None = None,
        idle_timeout_s: float | None = None,
        lease_s: float | None = None,
    ) -> PlainTransaction:
        """A transaction with no idempotency record (an optional-key call made without a key).
        ``idle_timeout_s``: how long it may sit idle (``SET LOCAL
        idle_in_transaction_session_timeout``, as in every transaction of a keyed call): the
        method's lease. Without it a replica partitioned or frozen while it held the
        transaction kept its handler's row locks until TCP keepalive noticed, hours later.
        ``lease_s``: the method's lease, which bounds the commit's wait for its answer as a
        keyed call's (``_commit_timeout``); without it, the pool's ``command_timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tries = 2
        for tried in range(1, tries + 1):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            conn = await self._acquire("beginning a transaction", left)
            try:
                # The library's savepoint, as in a keyed call's transaction: the commit releases
                # it, which fails if the handler replaced the transaction (COMMIT or ROLLBACK,
                # then BEGIN).
                await conn.execute(
                    f"{begin_sql(_level(isolation), idle_timeout_s)}; SAVEPOINT {SAVEPOINT}",
                    timeout=self.statement_timeout(left),
                )
            except BaseException as exc:
                # Cancelled too (the client went): whether the BEGIN ran is unknown, and the
                # connection must go back to the pool all the same, or it is lost to it for good.
                _drop(conn)
                await self._release(conn)
                if from_the_driver(exc):
                    # A pooled connection a restart or a failover left dead: once more on one
                    # opened now (as claim_atomic), not UNAVAILABLE with the database up.
                    if tried < tries and await self._forget_connections_if_gone(exc):
                        continue
                    raise store_error(exc, "beginning a transaction", store=self.store_log) from exc
                raise
            commit_timeout = None if lease_s is None else _commit_timeout(lease_s)
            return PlainTransaction(self, conn, commit_timeout)
        raise AssertionError("unreachable")

    async def claim_phased(
        self,
        *,
        scope: str,
        key: str,
        method: str,
        fingerprint: bytes,
        retention_s: float,
        lease_s: float,
        isolation: Isolation | None = None,
        timeout: float | None = None,
    ) -> PhasedClaim | None:
        """Claims the key in a statement of its own, committed with a lease; ``None`` if another
        attempt holds or has recorded the key (look again). ``isolation`` is that of the final
        transaction (the claim itself runs at the database's default)."""
        args = (scope, key, claim_lock_id(self.schema, scope, key), method, fingerprint)
        # This call's attempt id, the same on both tries below: the second finds the first's
        # claim in progress when it committed with its answer lost, and takes it as its own
        # (migration 0016). Random: attempts of one key on every replica must differ.
        attempt_id = int.from_bytes(os.urandom(8), "big", signed=True)
        # The connection is acquired here, not in the claim's task: the wait for one is
        # _acquire's to judge (a busy pool is no outage), where a timeout of the wait below
        # while the task still waited in the pool's queue was taken for a dead database, and a
        # fail-open method ran unclaimed on a live, busy store.
        deadline = None if timeout is None else time.monotonic() + timeout
        self._refuse_if_draining()
        # Held from here, not only once the claim is won (the interceptor's ``holding_claim``):
        # ``close`` waits for this call then. Not waited for, a claim on the wire when the drain
        # began landed after the pool had closed, its handler found no connection for the final
        # transaction, nor its release one, and the key stayed IN_PROGRESS for the whole lease.
        with self.holding_claim():
            # Whether a try's connection was lost under its claim, which may have committed with
            # its answer lost; and the claim this call returns, if any. A lost claim that no
            # later try takes as its own (no connection in time after a failover, the store
            # closing, the caller gone, the second try's connection lost too, or its claim
            # refused: GI001 to a statement that took the claim lock just after the second
            # try's wait for it) is released by the attempt id once the database answers (a
            # best effort, as every release; one lost to another attempt's claim, GI002, matches
            # nothing). Left alone it kept its lease with nobody behind it, and every retry was
            # answered IN_PROGRESS for the whole lease. A second try the caller gave up on is
            # also _settle's: released twice, harmlessly.
            lost = False
            claimed: PhasedClaim | None = None
            try:
                tries = 2
                for tried in range(1, tries + 1):
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    conn = await self._acquire_to_claim(left)
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        claimed = await self._claim_phased_once(
                            conn,
                            args,
                            attempt_id,
                            scope,
                            key,
                            retention_s,
                            lease_s,
                            isolation,
                            left,
                            after_lost=lost,
                        )
                        return claimed
                    except StoreUnavailable as err:
                        # The claim's session ended under it (pg_terminate_backend, a failover
                        # or a restart that left the pool's connection dead): once more on a
                        # connection opened now (``_holding`` had the pool's others replaced),
                        # as the atomic claim does. Answered as an outage, with the database
                        # up, a fail-open method ran its handler unclaimed while another attempt
                        # could claim and run the same key. Safe: a claim whose session ended
                        # mid-statement is rolled back; one that committed before its answer
                        # was lost is this call's own, and this try is answered with it (same
                        # attempt id). It used to lose the race to it, and the call and every
                        # retry waited the lease out. Not a timeout: behind a partition another
                        # connection waits as long.
                        # So is one whose answer asyncpg failed to read (``_answer_unread``):
                        # committed, it was left to its lease, and every retry was answered
                        # IN_PROGRESS until it ran out.
                        cause = err.__cause__ or err
                        if tried < tries and (_connection_gone(cause) or _answer_unread(cause)):
                            lost = True
                            self._refuse_if_draining()  # no new claim once close() has begun
                            continue
                        raise
                raise AssertionError("unreachable")
            finally:
                if lost and claimed is None:
                    self._release_attempt_later(scope, key, attempt_id)

    async def _claim_phased_once(
        self,
        conn: PooledConnection,
        args: tuple[str, str, int, str, bytes],
        attempt_id: int,
        scope: str,
        key: str,
        retention_s: float,
        lease_s: float,
        isolation: Isolation | None,
        timeout: float | None,
        *,
        after_lost: bool = False,
    ) -> PhasedClaim | None:
        """One try of ``claim_phased`` on ``conn`` (handed back at its end), within ``timeout``.
        ``after_lost``: an earlier try's connection was lost under its claim."""

        async def claim() -> tuple[int, datetime] | None:
            async with self._holding(conn, "claiming a key"):
                try:
                    if after_lost:
                        # The earlier try's statement may still be running in PostgreSQL (a
                        # connection reset while it waited on a row lock goes unnoticed until
                        # it answers) and commit after this one: it holds the key's claim lock
                        # meanwhile, and this try lost the race to it (GI001), the call and
                        # every retry answered IN_PROGRESS for the whole lease with nobody
                        # behind the claim. Once it has ended, its claim is known by the
                        # attempt id (or it was rolled back).
                        await conn.execute(self.statements.wait_claim_lock, args[2])
                    # No timeout of its own beyond the pool's command_timeout: asyncpg's fires
                    # after a claim that committed as well as before, and the claim would then
                    # be left with its lease and nobody behind it. The caller's wait is bounded
                    # below instead, and a claim it gave up on is settled.
                    row = await conn.fetchrow(
                        self.statements.claim_phased,
                        *args,
                        float(retention_s),
                        float(lease_s),
                        attempt_id,
                    )
                except asyncpg.PostgresError as exc:
                    if _lost_race(exc):
                        return None
                    raise
                assert row is not None
                return row["token"], row["started_at"]

        # The claim commits on its own: cancelled while it is on the wire (the client went) or
        # given up on at the call's deadline, it may commit all the same, and its lease would
        # then run on with nobody behind it, every retry answered IN_PROGRESS for the whole
        # lease. So it runs to its end in a task of its own, and a claim that turns out to have
        # committed is released (with its own token) once it answers; one whose answer is lost,
        # by this call's attempt id.
        claiming = asyncio.ensure_future(claim())
        try:
            claimed = await asyncio.wait_for(
                asyncio.shield(claiming), self.statement_timeout(timeout)
            )
        except TimeoutError as exc:
            self._settle(claiming, scope, key, retention_s, lease_s, attempt_id)
            raise store_error(exc, "claiming a key", store=self.store_log) from exc
        except asyncio.CancelledError:
            self._settle(claiming, scope, key, retention_s, lease_s, attempt_id)
            raise
        if claimed is None:
            return None
        token, started_at = claimed
        return PhasedClaim(
            self,
            _Claim(scope, key, retention_s, token),
            lease_s,
            isolation,
            started_at=started_at,
        )

    def _settle(
        self,
        claiming: asyncio.Future[tuple[int, datetime] | None],
        scope: str,
        key: str,
        retention_s: float,
        lease_s: float,
        attempt_id: int,
    ) -> None:
        """Ends the lease of a claim whose caller went before it was answered, once it is."""

        async def release_if_claimed() -> None:
            try:
                claimed = await claiming
            except StoreUnavailable as err:
                # Unknown when its answer went with its connection, or never came in time: it
                # may have committed. Its attempt id names it, if so. Left alone, every retry
                # was answered IN_PROGRESS for the whole lease, with nobody behind the claim.
                cause = err.__cause__ or err
                if isinstance(cause, TimeoutError) or _connection_gone(cause):
                    await self._release_attempt(scope, key, attempt_id)
                return
            except BaseException:  # refused by the database, so not claimed
                return
            if claimed is not None:
                token, started_at = claimed
                held = _Claim(scope, key, retention_s, token)
                await PhasedClaim(self, held, lease_s, started_at=started_at).release()

        task = asyncio.ensure_future(release_if_claimed())
        self._settling.add(task)  # a reference, until it is done
        task.add_done_callback(self._settling.discard)

    async def _release_attempt(self, scope: str, key: str, attempt_id: int) -> None:
        """Ends the lease of the claim ``attempt_id`` made of the key, if it committed (its
        answer lost) and is still in progress under it."""
        # After the claim's statement has ended in PostgreSQL, which may be later
        # (wait_claim_lock): released before it committed, it kept its lease.
        lock = claim_lock_id(self.schema, scope, key)
        release = self.statements.release_attempt
        await self._end_lease(scope, key, release, attempt_id, after_lock=lock)

    def _release_attempt_later(self, scope: str, key: str, attempt_id: int) -> None:
        """``_release_attempt`` in a task of its own, which ``close`` waits for."""
        task = asyncio.ensure_future(self._release_attempt(scope, key, attempt_id))
        self._settling.add(task)  # a reference, until it is done
        task.add_done_callback(self._settling.discard)

    async def _end_lease(
        self, scope: str, key: str, statement: str, *claim: object, after_lock: int | None = None
    ) -> None:
        """Runs a release (``statement`` on ``scope``, ``key`` and what names the ``claim``),
        once the claim lock ``after_lock`` is free if given. Best effort: if this fails the
        lease still expires."""
        tries = 2
        for tried in range(1, tries + 1):
            try:
                async with self.connection("releasing a claim") as conn:
                    if after_lock is not None:
                        await conn.execute(self.statements.wait_claim_lock, after_lock)
                    await conn.execute(statement, scope, key, *claim)
            except StoreUnavailable as err:
                # On a pooled connection a restart or a failover left dead (the first statement
                # of the call since: a handler failing without touching the database), once
                # more on one opened now (``connection`` replaced the pool's others): the
                # release matches this claim only, so it may run twice. Given up, every retry
                # was told IN_PROGRESS for the whole lease.
                if tried < tries and _connection_gone(err.__cause__ or err):
                    continue
                log.warning("could not release claim %s/%s; it expires with its lease", scope, key)
            return

    async def purge(
        self,
        *,
        batch_size: int = 1000,
        max_batches: int | None = None,
        pause: float = 0.0,
        on_batch: Callable[[int], None] | None = None,
    ) -> int:
        """Deletes records past retention in batches of ``batch_size``; returns how many. The
        batches walk ``records_expires_at`` in order, each starting where the last stopped.
        ``pause``: seconds to wait between batches, so that a backlog leaves the calls some of
        the database's CPU and WAL bandwidth (benchmarks/README.md, "Retention").
        ``on_batch``: called with each committed batch's count (progress, and what a purge
        stopped midway did)."""
        return await self.purge_in_batches(
            "purging records",
            self.statements.purge,
            batch_size=batch_size,
            max_batches=max_batches,
            walk=True,
            skipping=self.statements.purge_skipping,
            pause=pause,
            on_batch=on_batch,
        )

    async def purge_in_batches(
        self,
        doing: str,
        sql: str,
        *args: object,
        batch_size: int,
        max_batches: int | None,
        walk: bool = False,
        pause: float = 0.0,
        on_batch: Callable[[int], None] | None = None,
        skipping: str | None = None,
    ) -> int:
        """Runs a purge statement (``$1`` the batch size, ``args`` after it) once per transaction
        until a batch comes back short or ``max_batches`` ran, ``pause`` seconds apart (holding
        no connection meanwhile); returns how many rows went. Every purge of the library goes
        through here: short transactions, so housekeeping never holds locks that calls wait on
        for long.

        ``walk``: the statement takes where the previous batch stopped as ``$2`` (``None`` at
        first) and returns one row, ``deleted`` and ``last`` (where the next batch starts);
        otherwise it is a ``DELETE`` and its status says how many rows went.

        ``skipping``: ``sql`` waits on rows other transactions hold, and this (its arguments
        alike) skips them instead. A batch then waits on a lock ``PURGE_LOCK_WAIT_S`` at most
        and is redone, from where it started, with ``skipping``: a purge never keeps the rows
        of its batch locked, and the claims of their keys waiting, behind an unrelated long
        transaction, and it loses no progress. ``None``: ``sql`` itself skips locked rows."""
        # Whole numbers, as Purger checks them: a str raised a raw TypeError, a float was sent
        # as the LIMIT.
        for name, value in (("batch_size", batch_size), ("max_batches", max_batches)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be a whole number, not {value!r}")
        if batch_size <= 0 or (max_batches is not None and max_batches <= 0):
            raise ValueError("batch_size and max_batches must be positive")
        if batch_size > 2**63 - 1:  # a bigint: beyond, 22000 read as the store being down
            raise ValueError("batch_size must be at most 2**63 - 1")
        # As Purger checks it: None or text was a bare "'<=' not supported", True 1 s;
        # asyncio.sleep(nan) never returns; 10**400 (below math.inf) was a bare OverflowError
        # after the first batch.
        checked_seconds("pause", pause)
        total = batches = 0
        position: object = None
        while max_batches is None or batches < max_batches:
            if batches and pause:
                await asyncio.sleep(pause)
            if failpoints.ENABLED:
                await failpoints.hit("purge_batch")
            # A pooled connection that a restart or a failover left dead (``_holding`` then
            # replaces the pool's others): the batch once more, on a connection opened now, as a
            # claim is; the purge failed with the database up (a Purger skipped its run). Safe:
            # a batch whose session died rolled back, and one whose COMMIT's answer was lost
            # deleted only rows past retention, which the next finds gone. A failure to get a
            # connection is not tried again: the pool has just tried to open one.
            tries = 2
            for tried in range(1, tries + 1):
                conn = await self._acquire(doing, None)
                try:
                    # At READ COMMITTED whatever the default: a row a call changed meanwhile is
                    # re-checked, where REPEATABLE READ would fail the batch (40001).
                    # In a transaction of its own even at a READ COMMITTED default: a batch cut
                    # short (a purge stopped) is rolled back, never committed behind a count
                    # that leaves it out.
                    async with self._holding(conn, doing):
                        statement, bounded = sql, skipping is not None
                        while True:
                            try:
                                async with self.read_committed(
                                    conn,
                                    own_transaction=True,
                                    lock_timeout_s=PURGE_LOCK_WAIT_S if bounded else None,
                                ):
                                    if walk:
                                        row = await conn.fetchrow(
                                            statement, batch_size, position, *args
                                        )
                                        assert row is not None
                                        deleted = int(row["deleted"])
                                        last = row["last"]
                                    else:
                                        status = await conn.execute(statement, batch_size, *args)
                                        deleted = int(status.split()[-1])
                                        last = None
                            except asyncpg.LockNotAvailableError:
                                # Rolled back (read_committed): the rows it had locked are free.
                                # Unbounded this time: a lock that skipping cannot step round
                                # (a table's, an application trigger's) is waited for as before;
                                # a role's own lock_timeout still applies (to the first attempt
                                # too, if shorter than ours), and its 55P03 is the purge's
                                # error.
                                if not bounded or skipping is None:
                                    raise
                                log.debug(
                                    "%s: a batch waited on a lock over %g s; redone skipping"
                                    " locked rows",
                                    doing,
                                    PURGE_LOCK_WAIT_S,
                                )
                                statement, bounded = skipping, False
                                continue
                            break
                        # Committed: counted before the connection goes back to the pool, an
                        # await at which a stop (the CLI's SIGINT) lost the count of a batch
                        # that stays deleted, and the purge said fewer rows went than did.
                        if on_batch is not None:
                            on_batch(deleted)
                except StoreUnavailable as err:
                    cause = err.__cause__
                    if tried < tries and cause is not None and _connection_gone(cause):
                        continue
                    if cause is not None and (refused := purge_refused(cause, doing)):
                        raise refused from cause
                    raise
                break
            if last is not None:
                position = last
            total += deleted
            batches += 1
            if deleted < batch_size:
                break
        return total

    async def enqueue(
        self,
        conn: PooledConnection,
        *,
        scope: str,
        key: str,
        step: str,
        parent_key: str,
        method: str,
        payload_type: str,
        payload: bytes,
        trace_context: str | None = None,
    ) -> None:
        """Writes an outbox row on ``conn``, in the call's transaction. ``key`` (the outbox
        step's child key) is unique with ``scope``: the same message again adds nothing; a
        different one under the same key raises ``OutboxKeyReused`` rather than be dropped.
        ``trace_context``: the enqueuing span's propagation carrier, JSON
        (``telemetry.trace_carrier``), that the relay's delivery span links to; ``None``: none."""
        attempts = 3  # bounded: each repeat needs a row written and purged again meanwhile
        for _ in range(attempts):
            status = await conn.execute(
                self.statements.enqueue,
                scope,
                key,
                step,
                parent_key,
                method,
                payload_type,
                payload,
                trace_context,
            )
            if status == "INSERT 0 1":
                return
            # The key is taken (the one extra round trip is on this rare path only). No attempt
            # of the same operation can have left a row: an attempt that enqueued either
            # committed with its outcome, so the operation is done, or rolled back. So the row
            # is this call's own (the step enqueued twice) or an earlier operation's under a
            # reused key.
            kept = await conn.fetchrow(self.statements.enqueued, scope, key)
            if kept is None:
                # The earlier operation's row was purged (sent, or a dead letter) between the
                # INSERT and the look-up: nothing is kept under the key, so nothing differs.
                # It was refused as a different message. Insert again.
                continue
            if (kept["payload_type"], bytes(kept["payload"])) == (payload_type, payload):
                return
            raise OutboxKeyReused(
                f"outbox step {step!r} of this operation already holds a different message (the"
                " step enqueued twice in one call, or the idempotency key reused after its"
                " retention while the earlier operation's message is kept); use a new key for a"
                " new operation"
            )
        # Rows under the key came and went on every attempt: a race this call lost, not a
        # different message; a retry runs it again.
        raise TransactionConflict(
            f"outbox step {step!r}: the row under its key was purged and written again by"
            f" others {attempts} times during this call; retry"
        )

    async def database_identity(self) -> tuple[object, ...] | None:
        """What tells this store's tables from any other's, whatever DSN reached them (another
        spelling, host name, port or option names the same database): the server's start time,
        the database's and the schema's OIDs. ``None`` while the schema does not exist (two
        stores of different schemas not yet created would look alike). Raises
        ``StoreUnavailable`` as any statement does."""
        async with self.connection("identifying its database") as conn:
            row = await conn.fetchrow(_IDENTITY, self.schema)
        assert row is not None
        return None if row["schema"] is None else tuple(row)

    async def ping(self, timeout: float | None = None) -> None:
        async with self.connection("checking the store", timeout) as conn:
            await conn.fetchval("SELECT 1")

    async def answers(self, timeout: float | None = None) -> bool:
        """Whether the database answers ``SELECT 1`` on a connection of its own within the
        probe's budget (``Store.connect``'s ``probe_timeout``), waiting at most ``timeout``
        seconds for it, opened outside the pool with the parameters ``connect`` was given: it
        confirms an ambiguous outage (``StoreUnavailable.ambiguous``). A table locked by a
        migration blocks every pooled connection's statement, the pool's included, so only a
        fresh connection tells a live database from an unreachable one. Never raises: any
        failure, or no answer in time, is ``False``, except a ``password=`` callable's, which
        says nothing of the database: ``True`` (no certain outage, no failing open).

        Concurrent callers share one probe (a lock that blocks every call would otherwise open
        a connection per call), each waiting at most its own ``timeout``. A store made directly
        on a pool (``Store(pool)``) does not know how to connect outside it and answers
        ``False``: an ambiguous outage counts as an outage there, as before."""
        if self._probe is None or (timeout is not None and not timeout > 0):
            return False
        probing = self._probing
        if probing is None or probing.done():
            # Its own budget, not this caller's: later callers with more time left share it.
            probing = self._probing = asyncio.ensure_future(self._probe.answers())
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(probing)
        except TimeoutError:
            return False
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if probing.cancelled() and (task is None or task.cancelling() == 0):
                return False  # the probe was cancelled by close(), not this caller
            raise


_PROBE_CONNECT_SLACK_S = 1.0
"""How far past the probe's budget its connect's own timeout is set: the budget decides."""

_POOL_ONLY_OPTIONS = frozenset(
    {
        "init_size",
        "min_size",
        "max_size",
        "max_queries",
        "max_inactive_connection_lifetime",
        "connect",
        "setup",
        "init",
        "reset",
        "loop",
    }
)
"""``asyncpg.create_pool``'s own options: the rest of ``Store.connect``'s are the connection's."""


class _RenewalLine:
    """One connection outside the pool for lease renewals that find no pooled connection free
    (``PhasedClaim.renew``), opened on first use, shared by the store's renewals one at a time.

    Each renewal is one statement, a transaction of its own: no session state, so a
    transaction pooler may hand any server connection over. A renewal cut short (its bound, a
    cancellation) or failed on the wire drops the connection, as ``Store._holding`` drops a
    pooled one: its statement may still be running, and the next renewal opens a fresh one."""

    def __init__(
        self, connect: Callable[..., Any], dsn: str, options: dict[str, Any], store_log: StoreLog
    ) -> None:
        self._connect = connect
        self._dsn = dsn
        self._options = options
        self._store_log = store_log
        self._conn: Any = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def execute(
        self,
        sql: str,
        args: tuple[Any, ...],
        *,
        connect_until: float,
        deadline: Callable[[], float],
        doing: str,
    ) -> str:
        """``sql`` with ``args``, its status; the wait for the line and its connect by
        ``connect_until``, the statement by what ``deadline()`` says once they are done (both
        on ``time.monotonic()``)."""
        try:
            async with asyncio.timeout(max(0.001, connect_until - time.monotonic())):
                await self._lock.acquire()
        except TimeoutError as exc:
            raise StoreUnavailable(
                f"idempotency store busy while {doing}: the renewal line stayed busy",
                outage=False,
            ) from exc
        try:
            if self._closed:
                raise StoreUnavailable(f"idempotency store closed while {doing}", outage=False)
            try:
                if self._conn is None or connection_closed(self._conn):
                    budget = max(0.001, connect_until - time.monotonic())
                    async with asyncio.timeout(budget):
                        self._conn = await self._connect(
                            self._dsn,
                            loop=asyncio.get_running_loop(),
                            **{**self._options, "timeout": budget},
                        )
                    if self._closed:  # the store closed while it connected: nothing may leak
                        self._drop()
                        raise StoreUnavailable(
                            f"idempotency store closed while {doing}", outage=False
                        )
                status: str = await self._conn.execute(
                    sql, *args, timeout=max(0.001, deadline() - time.monotonic())
                )
                return status
            except PasswordFailed as exc:
                self._drop()
                raise password_error(exc, doing, store=self._store_log) from exc.__cause__
            except Exception as exc:
                self._drop()
                if not from_the_driver(exc):
                    raise
                raise store_error(exc, doing, store=self._store_log) from exc
            except BaseException:
                self._drop()  # cancelled mid-statement: see the class's docstring
                raise
        finally:
            self._lock.release()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(*STORE_ERRORS):
                conn.terminate()

    def close(self) -> None:
        """With the store: a renewal still on the line (none once the claims have ended) is cut
        short."""
        self._closed = True
        self._drop()


@dataclass(frozen=True)
class _Probe:
    """A connection outside the pool, opened as the pool opens its own (``Store.answers``)."""

    connect: Callable[..., Any]
    dsn: str
    options: dict[str, Any]
    budget: float
    """How long a live database may take to answer the probe's ``SELECT 1`` (connect, TLS,
    authentication included) before an ambiguous outage is taken for a real one."""
    store_log: StoreLog
    """The store's (``Store.store_log``): its log lines name the store probed."""

    async def vet(self) -> None:
        """``Store.connect`` given a ``probe_dsn``: one the driver cannot parse or use is refused
        (``vet_dsn``). Accepted, every probe failed, so every ambiguous outage let fail-open
        methods run unclaimed, and each probe logged the driver's text. One that does not
        answer now (it may when it is needed) is only said in the log."""
        options = {"loop": asyncio.get_running_loop(), **self.options}
        # Bounded by the probe's budget, as the probe is (``answers``).
        options["timeout"] = self.budget + _PROBE_CONNECT_SLACK_S
        if not await vet_dsn("probe_dsn", self.dsn, self.connect, self.budget, **options):
            log.warning(
                "probe_dsn does not answer now (idempotency store%s): until it does, an"
                " ambiguous outage of the store counts as a real one (fail-open methods run"
                " unclaimed)",
                self.store_log.label,
            )

    async def answers(self) -> bool:
        conn: Any = None
        try:
            async with asyncio.timeout(self.budget):
                # The pool's connect timeout is its command_timeout (1 s, say), which a loaded host
                # can take to accept a live database's connection: read as down, and a fail-open
                # method ran a completed key's handler again. The probe's own budget bounds it;
                # the connect's timeout is set past that budget, so that the budget alone decides
                # (and a timeout from the connect never races the budget's own).
                options = {**self.options, "timeout": self.budget + _PROBE_CONNECT_SLACK_S}
                conn = await self.connect(self.dsn, loop=asyncio.get_running_loop(), **options)
                await conn.fetchval("SELECT 1")
                await conn.close()
            return True
        except PasswordFailed as exc:
            # The pool's password= callable (``_own_password``) failed: that says nothing of the
            # database, which may be up and hold the key's outcome. Taken for no answer, a
            # fail-open method ran unclaimed while the secret was being rotated.
            password_error(
                exc, "probing the database after an ambiguous outage", store=self.store_log
            )
            return True
        except STORE_ERRORS as exc:
            # TimeoutError included (one of STORE_ERRORS): no answer in time.
            log.debug("the database did not answer a probe%s: %r", self.store_log.label, exc)
            return False
        except Exception as exc:  # a custom connect's own failure: no answer either
            log.warning("the store's outage probe failed%s: %r", self.store_log.label, exc)
            return False
        finally:
            if conn is not None and not connection_closed(conn):
                # Cut short (a timeout, a cancellation): close() would wait for the server.
                conn.terminate()


async def vet_dsn(
    name: str,
    dsn: str,
    connect: Callable[..., Any] = asyncpg.connect,
    budget: float = PROBE_S,
    **options: Any,
) -> bool:
    """Raises ``DsnUnusable`` naming ``name`` if the driver cannot parse or use ``dsn``, which
    is connected to later, over and over (``probe_dsn``, a relay's ``listen_dsn``): each failure
    then told as no answer, with nothing to say why (or the driver's text, which can quote
    pieces of the password). Found by connecting once; returns whether it answered."""
    unsent = unsendable(dsn)
    if unsent is not None:
        raise DsnUnusable(f"cannot use {name}: {unsent}")
    if at_in_user_info(dsn):  # parses, but as another host: no answer, for ever
        raise DsnUnusable(f"{name}: {DsnUnusable().message}")
    conn: Any = None
    try:
        async with asyncio.timeout(budget):
            conn = await connect(dsn, **options)
            await conn.close()
    except Exception as exc:
        if dsn_unusable(exc):
            problem = unusable_file(dsn)
            raise DsnUnusable(
                f"cannot use {name}: {problem}" if problem else f"{name}: {DsnUnusable().message}"
            ) from None
        refused = session_refused(exc)
        if refused is not None:
            # The server answered and refused the session for good (a database that does not
            # exist, a setting it does not know), as connect refuses the store's own DSN:
            # every later connection fails the same, each told as no answer.
            raise StoreMisconfigured(f"{name}: {refused}") from None
        return False  # unreachable, refused, not yet: its user tries again anyway
    finally:
        if conn is not None and not connection_closed(conn):
            conn.terminate()  # cut short: close() would wait for the server
    return True


def _naming(err: StoreUnavailable, store: StoreLog) -> StoreUnavailable:
    """``err`` of ``Store.connect``, its text ending with the store's database (``[host:port/
    database, schema S]``, never a password). Every shard's schema has the same name, and the
    shards are opened side by side (``ShardedStores({"eu": await Store.connect(EU), "us":
    await Store.connect(US)})``): a shard behind or down at start was refused with nothing to
    tell which one. A DSN that cannot be parsed has no database to name."""
    if not isinstance(err, DsnUnusable) and store.label:
        err.message = f"{err.message}{store.label}"
        err.args = (err.message, *err.args[1:])
        err.store_label = store.label
    return err


def _described(dsn: object, options: dict[str, Any], schema: str) -> str:
    """``host:port/database, schema S``: a store's name in the log (``dsn_where``: never a
    password)."""
    return f"{dsn_where(dsn, options)}, schema {schema}"


def _level(isolation: Isolation | None) -> str | None:
    return None if isolation is None else isolation.value


def _commit_timeout(lease_s: float) -> float:
    """How long the final commit may take before its fate is declared unknown (and the call
    answered UNAVAILABLE): PostgreSQL ends a transaction left idle for the lease anyway, so a
    commit that has not answered by then is no longer worth waiting for."""
    return max(5.0, lease_s * 2)


def _record(row: asyncpg.Record) -> StoredRecord:
    state = State(row["state"])
    outcome = None
    if state is State.COMPLETED:
        outcome = Outcome(
            code=Code(row["status_code"]),
            message=row["status_message"] or "",
            details=row["status_details"],
            response=row["response"],
        )
    return StoredRecord(
        fingerprint=bytes(row["fingerprint"]),
        state=state,
        outcome=outcome,
        expired=bool(row["expired"]),
        lease_expired=bool(row["lease_expired"]),
        lease_remaining_ms=int(row["lease_remaining_ms"] or 0),
        started_at=row["created_at"],
        replayable_ms=row["replayable_ms"],
    )


def _handler_failed(
    exc: asyncpg.PostgresError | asyncpg.InterfaceError,
    store: Store,
    *,
    connection_live: bool = False,
) -> IdempotencyError:
    mapped = handler_error(exc, connection_live=connection_live, store=store.store_log)
    assert mapped is not None  # a PostgresError always maps, a live connection's misuse too
    return mapped


class PlainTransaction:
    """A transaction with no idempotency record: optional-key calls made without a key."""

    def __init__(
        self, store: Store, conn: PooledConnection, commit_timeout: float | None = None
    ) -> None:
        self._store = store
        self.connection = conn
        self._commit_timeout = commit_timeout

    async def commit(self) -> None:
        """Commits the handler's writes. A handler that ended the transaction itself, or caught
        the error of a failed statement and carried on, gets ``HandlerDatabaseError``: the same
        misuse is found with a key and without one, so it shows in development either way."""
        conn = self.connection
        try:
            if not connection_closed(conn) and not conn.is_in_transaction():
                raise _ended_by_handler(conn, "no transaction was open at the commit")
            # Bounded as a keyed call's commit: with the pool's command_timeout only (None
            # allowed), a commit whose answer a partition swallowed held the call, and its
            # connection, until TCP gave up. Past the bound its fate is unknown: UNAVAILABLE.
            await conn.execute(
                f"RELEASE SAVEPOINT {SAVEPOINT}; {SESSION_RESET}COMMIT",
                timeout=self._commit_timeout,
            )
        except HandlerDatabaseError:
            await self._store._release(conn)
            raise
        except asyncpg.PostgresError as exc:
            if exc.sqlstate in (NO_SUCH_SAVEPOINT, IN_FAILED_TRANSACTION):
                ended = None
                if exc.sqlstate == NO_SUCH_SAVEPOINT:  # dropped before it goes back
                    ended = _ended_by_handler(conn, "its transaction was replaced by another")
                try:
                    await _rollback_quietly(conn)  # the batch stopped at its failing statement
                finally:
                    # However the ROLLBACK ends: a cancellation raised in this clause skips the
                    # BaseException one below (the connection once neither dropped nor given
                    # back: lost to the pool for good).
                    await self._store._release(conn)
                if ended is not None:
                    raise ended from exc
                raise aborted_by("the handler") from exc
            await self._failed_commit(exc)
        except STORE_ERRORS as exc:
            await self._failed_commit(exc)
        except BaseException as exc:
            if from_the_driver(exc):  # asyncpg could not read the COMMIT's answer
                await self._failed_commit(exc)
            # Cancelled (the server stopping): whether the COMMIT ran is unknown; the connection
            # goes, and back to the pool all the same, or the pool loses it for good.
            _drop(conn)
            await self._store._release(conn)
            raise
        else:
            await self._store._release(conn)

    async def _failed_commit(self, exc: BaseException) -> NoReturn:
        try:
            live = not connection_closed(self.connection)
            _drop(self.connection)
            # A statement of the handler's still running (InterfaceError): its bug, no outage.
            if live and isinstance(exc, asyncpg.InterfaceError):
                raise _handler_failed(exc, self._store, connection_live=True) from exc
            failure = classify(sqlstate(exc))
            if failure is Failure.CONFLICT:
                raise TransactionConflict(
                    f"the commit failed on a serialization conflict (SQLSTATE {sqlstate(exc)})"
                ) from exc
            if failure is Failure.OTHER and isinstance(exc, asyncpg.PostgresError):
                raise _handler_failed(exc, self._store) from exc  # a constraint checked at COMMIT
            raise store_error(exc, "committing", store=self._store.store_log) from exc
        finally:
            await self._store._release(self.connection)

    async def rollback(self) -> HandlerDatabaseError | None:
        """Rolls back; returns the handler's misuse found on the way (as ``Attempt.release``):
        it ended the transaction itself, so what it wrote may have committed."""
        try:
            return await _rollback_checked(self.connection)
        finally:
            await self._store._release(self.connection)


class PhasedClaim:
    """A committed in-progress claim with a lease and a fencing token (phased mode).

    No transaction is open while the handler runs. The outcome commits in a final transaction
    (``begin_final``) that first checks the fencing token, so an owner whose lease expired and
    was taken over cannot commit.

    The claim is the pair (fencing token, ``started_at``): a takeover adds one to the token and
    keeps the start, while a record purged and claimed again starts over at token 1 with a new
    start. The final transaction, ``renew`` and ``release`` all match both, so a stalled owner
    whose record was purged meanwhile cannot commit over, extend or end the new claim.
    """

    def __init__(
        self,
        store: Store,
        claim: _Claim,
        lease_s: float,
        isolation: Isolation | None = None,
        *,
        started_at: datetime,
    ) -> None:
        self._store = store
        self._claim = claim
        self.lease_s = lease_s
        self._isolation = isolation
        self.started_at = started_at
        """When the operation began (the record's created_at, the database's clock): this
        claim, or the attempt it took over."""

    @property
    def token(self) -> int:
        assert self._claim.token is not None
        return self._claim.token

    async def renew(
        self, *, timeout: float | None = None, lease_until: float | None = None
    ) -> bool:
        """Extends the lease; ``False`` when the claim is no longer this attempt's, or was
        released. Bounded by ``timeout``, by default the lease itself: a renewal that slow would
        be of no use. The lease keeper passes ``lease_until`` instead, when the lease runs out
        as it counts it (``time.monotonic()``): the connection may take until then
        (``core.lifecycle.renewal_acquire_bound_s``), the statement half of what is left when it
        is sent (``renewal_bound_s``)."""
        c, store = self._claim, self._store
        doing = "renewing a lease"
        bound = self.lease_s if timeout is None else timeout
        if lease_until is not None:
            bound = renewal_acquire_bound_s(self.lease_s, lease_until - time.monotonic())
        deadline = time.monotonic() + bound
        args = (c.scope, c.key, self.token, self.lease_s, self.started_at)
        line = store._renewal_line
        if line is not None and store.pool.get_idle_size() == 0 and not store._closing:
            # Every pooled connection is held (long handlers, a burst of calls): that is load,
            # not an outage of this owner. Queued behind them, the renewal gave up at the end
            # of the lease, and a retry elsewhere took the live operation over (both handlers
            # running, the owner fenced off at its commit): spurious takeovers exactly under
            # load. The store's renewal line is not in the pool.

            def statement_deadline() -> float:
                # As on a pooled connection: counted once the line is held and open.
                if lease_until is None:
                    return deadline
                left = lease_until - time.monotonic()
                return time.monotonic() + renewal_bound_s(self.lease_s, left)

            status = await line.execute(
                store.statements.renew,
                args,
                connect_until=deadline,
                deadline=statement_deadline,
                doing=doing,
            )
            return status.endswith(" 1")
        # The wait for a connection bounded too, even when the pool counts one as free: after a
        # failover or a restart (``_forget_connections_if_gone``) every free connection is
        # opened anew when acquired, and that waited for asyncpg's connect timeout (60 s) while
        # the new primary could not be reached yet. The keeper lets a renewal on the wire run to
        # its end, so the call that had its answer waited as long (past its deadline).
        conn = await store._acquire(doing, bound, always_bounded=True)
        if lease_until is not None:
            left = lease_until - time.monotonic()
            deadline = time.monotonic() + renewal_bound_s(self.lease_s, left)
        async with store._holding(conn, doing):
            status = await conn.execute(
                store.statements.renew, *args, timeout=max(0.001, deadline - time.monotonic())
            )
        return status.endswith(" 1")

    async def begin_final(
        self,
        *,
        timeout: float | None = None,
        acquired: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> Attempt:
        """Opens the final transaction, holding the claim row; raises ``LeaseLost``.
        ``acquired`` is awaited once a pooled connection is held, before the claim is checked
        on it (the lease keeper's stop: the lease is renewed while the pool has none free)."""
        store, c = self._store, self._claim
        sql = store.statements.begin_final(
            scope=c.scope,
            key=c.key,
            token=self.token,
            started_at=self.started_at,
            lock_id=claim_lock_id(store.schema, c.scope, c.key),
            isolation=_level(self._isolation),
            idle_timeout_s=self.lease_s,
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        tries = 2
        conflicts = 0
        # Once more on a connection opened now when a pooled one is found dead (a restart or a
        # failover while the handler ran): safe, the batch commits nothing. Answered UNAVAILABLE
        # instead, the call's release met the pool's next dead connection, and every retry was
        # told IN_PROGRESS for the whole lease.
        reconnected = False
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            conn = await store._acquire("opening the final transaction", left)
            if acquired is not None:
                try:
                    await acquired()
                except BaseException:
                    await store._release(conn)  # nothing was sent on it
                    raise
            attempt = Attempt(store, conn, c, _commit_timeout(self.lease_s))
            try:
                await conn.execute(sql, timeout=store.statement_timeout(left))
            except asyncpg.PostgresError as exc:
                await attempt._abandon()
                if exc.sqlstate == _CLAIM_LOST:
                    raise LeaseLost("the claim was taken over by another attempt") from exc
                if classify(exc.sqlstate) is Failure.CONFLICT:
                    # At REPEATABLE READ or above: the claim row changed after the snapshot. A
                    # takeover does that, but so does this claim's own renewal committing late
                    # (sent before the lease keeper stopped, it ran on after its client gave
                    # up). Nothing is written yet, so look once more in a fresh snapshot: a
                    # takeover is then told apart by verify_claim (GI003, above).
                    conflicts += 1
                    if conflicts < tries:
                        continue
                    raise LeaseLost("the claim changed under the final transaction") from exc
                if not reconnected and await store._forget_connections_if_gone(exc):
                    reconnected = True
                    continue
                raise store_error(
                    exc, "opening the final transaction", store=self._store.store_log
                ) from exc
            except BaseException as exc:
                await attempt._abandon(interrupted=_state_unknown(exc))
                if from_the_driver(exc):
                    if not reconnected and await store._forget_connections_if_gone(exc):
                        reconnected = True
                        continue
                    raise store_error(
                        exc, "opening the final transaction", store=self._store.store_log
                    ) from exc
                raise
            return attempt

    async def release(self) -> None:
        """Ends the claim's lease now, so that a retry takes the operation over at once instead
        of waiting the lease out. Best effort: if this fails the lease still expires."""
        c = self._claim
        statement = self._store.statements.release
        await self._store._end_lease(c.scope, c.key, statement, self.token, self.started_at)


# A server's start time with a database's and a schema's OIDs: OIDs alone repeat from one
# cluster to another (two clones of one backup), the start time to the microsecond does not.
_IDENTITY = """
    SELECT pg_catalog.pg_postmaster_start_time() AS started,
           (SELECT oid FROM pg_catalog.pg_database
            WHERE datname = pg_catalog.current_database()) AS database,
           (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = $1) AS schema
"""


def one_store(store: object, *, user: str, per_shard: str) -> Store:
    """``store`` if it is a ``Store``; else a ``TypeError`` that says what to pass instead.
    ``ShardedStores`` is accepted by the interceptor and ``Purger`` only: a relay or a consumer
    works on one database (``per_shard`` says how to run one per shard)."""
    if isinstance(store, Store):
        return store
    hint = f"; for ShardedStores, {per_shard}" if type(store).__name__ == "ShardedStores" else ""
    raise TypeError(f"{user} takes a Store, not {type(store).__name__}{hint}")
