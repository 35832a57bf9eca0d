"""Database errors, mapped in one place: what the store's own statements and the statements a
handler runs on the call's connection raise, and what each becomes for a client.

Below this module errors are asyncpg's and the OS's; above it they are ``StoreUnavailable``
(retryable), ``StoreMisconfigured`` (logged with its cause, not retryable), ``TransactionConflict``
or ``HandlerDatabaseError``. ``core.db_failures`` decides by SQLSTATE; this module only knows
which exceptions are the database's. The original exception stays attached as ``__cause__``
(``raise ... from``), which the CLI prints; clients only ever see the mapped message.
"""

from __future__ import annotations

import re
import time

import asyncpg

from grpc_idempotency.core.db_failures import Failure, classify, outage, presumed_outage
from grpc_idempotency.core.errors import (
    HandlerDatabaseError,
    IdempotencyError,
    StoreMisconfigured,
    StoreUnavailable,
    TransactionConflict,
)
from grpc_idempotency.log_tracebacks import library_logger

log = library_logger("grpc_idempotency.store")


def sqlstate(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


class _OnceAMinute:
    """Whether an operator's log line about ``what`` is due: at most once a minute each, since
    every call can fail the same way until an operator acts, and the log must say why, not
    drown."""

    def __init__(self, every_s: float = 60.0) -> None:
        self._every_s = every_s
        self._last: dict[object, float] = {}

    def due(self, what: object) -> bool:
        now = time.monotonic()
        if now - self._last.get(what, -self._every_s) < self._every_s:
            return False
        self._last[what] = now
        return True


class StoreLog:
    """Which store the operator's log names, and how often it speaks of each of its problems:
    one per ``Store`` (``Store.store_log``), given its name once, when the store is made
    (``where``: ``host:port/database, schema S``) and when ``ShardedStores`` takes it as a shard
    (``shards``, by ``name_shards``). Once a minute per problem (a SQLSTATE, an exception's
    type) of each store: a process-wide limit hid one shard's problem behind another's for up to
    a minute, and the line named neither database."""

    def __init__(self, where: str = "", *, every_s: float = 60.0) -> None:
        self.where = where
        self.shards: tuple[str, ...] = ()
        """The names ``ShardedStores`` gave this store (several if it was given as more than
        one shard): its problem fails only the calls placed on them."""
        self._once = _OnceAMinute(every_s)

    def due(self, what: object) -> bool:
        return self._once.due(what)

    def shards_refused(self, names: tuple[str, ...]) -> str | None:
        """Why this store cannot be named ``names`` (the shards one ``ShardedStores`` gives
        it), ``None`` when it can: it is named once, by the first, and another naming it
        otherwise is refused. The names are the store's, not the ShardedStores': added up,
        a store given as shard 'a' of one and 'b' of another was "shards 'a', 'b'" in the log
        of either (and of its use alone), each naming a shard it did not know."""
        if not self.shards or set(self.shards) == set(names):
            return None
        given = " and ".join(map(repr, self.shards))
        return (
            f"this Store{self.label} is already shard {given} of another ShardedStores, and its"
            " log lines name it so wherever it is used: give it the same name here, or connect"
            " a Store of its own for each name"
        )

    def name_shards(self, names: tuple[str, ...]) -> None:
        """Names the store as ``names`` once ``shards_refused`` has found nothing against it."""
        self.shards = names

    @property
    def label(self) -> str:
        """`` [shard 'two': host:port/db, schema S]`` (with its leading space), ``""`` for a
        store that knows nothing of where it is."""
        shards = ", ".join(repr(name) for name in self.shards)
        if shards:
            what = "shards" if len(self.shards) > 1 else "shard"
            return f" [{what} {shards}: {self.where}]" if self.where else f" [{what} {shards}]"
        return f" [{self.where}]" if self.where else ""

    @property
    def failing(self) -> str:
        """Which keyed calls fail while the store is misconfigured: all of them, or a shard's
        (``ShardedStores``: the other shards' tenants are served)."""
        if not self.shards:
            return "every keyed call fails"
        shards = " or ".join(repr(name) for name in self.shards)
        return f"every keyed call placed on shard {shards} fails (the other shards serve theirs)"


UNNAMED = StoreLog()
"""For a statement of no known store's (the handler's own, on a connection of its choosing)."""


def _log_misconfigured(exc: BaseException, doing: str, store: StoreLog) -> None:
    """Logs a permanent store error with its cause, once a minute per store and SQLSTATE."""
    state = sqlstate(exc)
    if not store.due(("misconfigured", state)):
        return
    log.error(
        "idempotency store%s misconfigured while %s (SQLSTATE %s): %s; %s until this is fixed (%s)",
        store.label,
        doing,
        state,
        exc,
        store.failing,
        _hint(state),
    )


class PasswordFailed(Exception):
    """Raised in place of the error of a ``password=`` callable, which asyncpg calls for each
    connection it opens (``Store.connect`` wraps it): its own error, raised from inside the
    driver, was taken for the DSN's (a KeyError, a ValueError: "the DSN cannot be parsed", the
    cause dropped) or for an unreachable database (an OSError: a fail-open method ran
    unclaimed with the database up), or escaped raw. The original is its ``__cause__``."""


def password_error(exc: PasswordFailed, doing: str, *, store: StoreLog) -> StoreUnavailable:
    """A connection could not be opened because the ``password=`` callable failed: retryable
    (a secret being rotated, a vault that answers again), and no outage (the database may be up
    and hold the key's outcome). The callable's text is not quoted (it may hold the secret or a
    token), only its type; the log has its traceback, once a minute."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    what = type(cause).__name__
    if store.due(("password", what)):
        log.error(
            "the password callable (Store.connect's password=) raised %s while %s: no new"
            " connection to the store%s until it returns a password",
            what,
            doing,
            store.label,
            exc_info=cause,
        )
    return StoreUnavailable(
        f"idempotency store unavailable while {doing}: its password callable (Store.connect's"
        f" password=) raised {what}",
        outage=False,
    )


def _hint(state: str | None) -> str:
    if state in ("42P01", "42703", "42883", "3F000"):
        return "the schema is not migrated: run `grpc-idempotency migrate`"
    if state == "3D000":
        return "no such database: check the DSN"
    if state == "42501":
        return "the role lacks a privilege on the store's schema or tables"
    if state is not None and state.startswith("28"):
        return "authentication failed: check the role and its password"
    # connect_error: the server refused the session's start-up for a setting it was asked for.
    return "the server refused a setting of the session: check the DSN's parameters"


# invalid_sql_statement_name ("prepared statement "__asyncpg_stmt_..." does not exist") and
# duplicate_prepared_statement ("... already exists"): a named statement of asyncpg's cache
# (on by default) run on a server connection other than the one it was prepared on, or
# prepared again where another client's already is. What PgBouncer in transaction mode does to
# it, swapping server connections between transactions: keyed calls failed now and then
# (UNAVAILABLE, a released key left in progress for its lease), and nothing said why.
_PREPARED_STATEMENT_LOST = frozenset({"26000", "42P05"})


# The same cause when the server connection holds another client's statement under the name
# asyncpg cached (``__asyncpg_stmt_N__``, numbered alike by every connection): PostgreSQL
# refuses the Bind that does not fit it as a protocol violation, 08P01, the SQLSTATE PgBouncer
# sends its own failures with (query_wait_timeout...). Taken for those, it was "unavailable"
# and a presumed outage, a command exited 1 (retry later) for good. Told apart by PostgreSQL's
# messages for a Bind that does not fit its statement (postgres.c, pquery.c), which PgBouncer
# never sends: a parameter count naming one of asyncpg's statements, or a count of result
# formats (asyncpg sends one per column when a column is read as text).
_BIND_MISFIT = re.compile(
    r'^bind message supplies \d+ parameters?, but prepared statement "__asyncpg_'
    r"|^bind message has \d+ result formats? but query has \d+ columns?"
)


# The same cause when the other client's statement has as many parameters but of other types:
# asyncpg binds every parameter in binary, encoded for the type the server described when
# asyncpg prepared the statement, and the server decodes it with its own statement's type's
# receive function; one that leaves bytes unread (a text of more than 8 bytes read as a bigint)
# fails the Bind with 22P03 and this message (postgres.c, exec_bind_message). Not a value of
# the caller's: the store binds only its own parameters, through asyncpg's codecs for the
# types its statements declare (text, bytea, integers, timestamps), which write exactly what
# the receive function of the same type reads; text and bytea read any bytes. A Bind on the
# statement asyncpg prepared cannot leave bytes unread, so the statement is another client's.
# Taken for a refused value (OTHER), a command exited 1, "retry later", for good.
_BINARY_MISFIT = re.compile(r"^incorrect binary data format in bind parameter \d+$")


def prepared_statement_lost(exc: BaseException) -> bool:
    if sqlstate(exc) == "08P01":  # PgBouncer's own errors too: only a Bind's misfit is this
        return _BIND_MISFIT.match(str(exc)) is not None
    if sqlstate(exc) == "22P03":  # a receive function's own refusals too (numeric's sign...)
        return _BINARY_MISFIT.match(str(exc)) is not None
    # asyncpg's own classes carry these SQLSTATEs; both looked at, whichever it raises.
    return sqlstate(exc) in _PREPARED_STATEMENT_LOST or isinstance(
        exc, (asyncpg.InvalidSQLStatementNameError, asyncpg.DuplicatePreparedStatementError)
    )


def _log_prepared_statement_lost(exc: BaseException, doing: str, store: StoreLog) -> None:
    """Logs a store statement that failed for asyncpg's statement cache, with the likely
    cause and the fix, once a minute per store: the SQLSTATE alone sends an operator nowhere."""
    if not store.due("prepared statement lost"):
        return
    log.error(
        "an idempotency store%s statement failed while %s (SQLSTATE %s: %s): behind PgBouncer"
        " in transaction mode (before 1.21, or max_prepared_statements = 0) asyncpg's"
        " statement cache breaks: pass Store.connect(..., statement_cache_size=0)"
        " (--statement-cache-size 0 on the command line)",
        store.label,
        doing,
        sqlstate(exc),
        # The first line only: asyncpg appends a hint of its own about PgBouncer.
        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
    )


def store_error(exc: BaseException, doing: str, *, store: StoreLog) -> StoreUnavailable:
    """The store's own statement failed: unavailable (retryable) or misconfigured (not).
    ``store``: the failing store's ``Store.store_log``, which the log names."""
    if not isinstance(exc, STORE_ERRORS):
        # One of ``from_the_driver``'s others: the database answered, and asyncpg could not
        # make sense of it. Not an outage (the database is up and may hold the key's outcome);
        # logged with its traceback, which the StoreUnavailable's text leaves out.
        _log_driver_failure(exc, doing, store)
        return StoreUnavailable(
            f"idempotency store unavailable while {doing} (the driver failed reading the"
            f" database's answer: {type(exc).__name__})",
            outage=False,
        )
    state = sqlstate(exc)
    lost = prepared_statement_lost(exc)
    if lost:
        _log_prepared_statement_lost(exc, doing, store)
    if classify(state) is Failure.MISCONFIGURED:
        _log_misconfigured(exc, doing, store)
        return StoreMisconfigured(
            f"idempotency store misconfigured while {doing} (SQLSTATE {state}): {_hint(state)}"
        )
    detail = state or type(exc).__name__
    # Only an unreachable database is an outage (core.db_failures.outage): one that refused a
    # statement (a value it cannot hold), timed it out or cancelled it, or gave up waiting for
    # a lock is up and holds the records, and a fail-open method must not run unclaimed.
    # A timeout of the client's own (asyncpg's statement timeout, a wait for a pooled
    # connection) says only that no answer came in time: a partition, or a statement blocked
    # on a table lock in a live database. That outage is ambiguous, to be confirmed first.
    # So is a pooler's own error (PgBouncer's 08P01): taken for a certain outage, a client that
    # waited past query_wait_timeout for a busy pool had a fail-open method run a completed
    # key again, unclaimed, with the database up and holding its outcome.
    # The statement cache behind PgBouncer (its 08P01 too): the database answered, no outage.
    return StoreUnavailable(
        f"idempotency store unavailable while {doing} ({detail})",
        outage=outage(state) and not lost,
        ambiguous=not lost
        and ((state is None and isinstance(exc, TimeoutError)) or _pooler_said(exc)),
    )


# Classes a purge may meet that no trigger or key raises and the next run may not meet again:
# transaction rollback (40002, 40003: a commit's outcome unknown), snapshot too old (72000).
_NOT_A_REFUSAL = frozenset({"40", "72"})


def purge_refused(exc: BaseException, doing: str) -> StoreMisconfigured | None:
    """What a purge's statement that the database refused for no outage, conflict or schema
    problem (``Failure.OTHER``: a trigger's ``RAISE``, P0001; a foreign key of the
    application's restricting the delete, 23503) raises; ``None`` for any other failure, which
    ``store_error`` has mapped. Such a refusal was "store unavailable", retryable: a Purger
    warned every interval of an outage that was not one, and the CLI's purge exited 1 (retry
    later) for good. It comes back at every batch until the trigger or key is changed, so it is
    misconfigured (exit 2), naming the SQLSTATE and the database's message: the purge is the
    operator's, and no client ever sees it."""
    if not isinstance(exc, asyncpg.PostgresError) or prepared_statement_lost(exc):
        return None  # the statement cache behind PgBouncer: store_error's, with its own hint
    state = sqlstate(exc)
    if state is None or classify(state) is not Failure.OTHER or state[:2] in _NOT_A_REFUSAL:
        return None
    said = " ".join(str(exc).split())[:300] or type(exc).__name__
    return StoreMisconfigured(
        f"idempotency store refused {doing} (SQLSTATE {state}: {said}): not an outage, and"
        " retrying cannot help until what refused it (a trigger, rule or foreign key on the"
        " store's tables) is changed"
    )


def from_the_driver(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a store statement, is the database's or its driver's failure:
    one of ``STORE_ERRORS``, or any other Exception raised inside asyncpg. Its protocol code
    hands the caller whatever reading an answer raised: a text value that is not UTF-8
    (UnicodeDecodeError), a message out of turn (TypeError), a field cut short (its
    BufferError), as bytes flipped on a link or a broken pooler produce. Raw, it took the
    outbox relay down and answered a call UNKNOWN with the driver's text."""
    if isinstance(exc, STORE_ERRORS):
        return True
    return (
        isinstance(exc, Exception)
        and not isinstance(exc, IdempotencyError)
        and raised_in_asyncpg(exc)
    )


def _log_driver_failure(exc: BaseException, doing: str, store: StoreLog) -> None:
    """Logs the driver's unexpected failures with their traceback, once a minute per store and
    type."""
    if not store.due(("driver", type(exc))):
        return
    log.error(
        "the database driver failed while %s, reading an answer it could not make sense of"
        " (a corrupt stream?), from the idempotency store%s",
        doing,
        store.label,
        exc_info=exc,
    )


def _pooler_said(exc: BaseException) -> bool:
    """Whether ``exc`` is only a presumed outage (``presumed_outage``): a pooler's own error or
    a connection closed in the middle of an operation. PgBouncer closes the client's connection
    after its error, and asyncpg 0.32 raises ConnectionDoesNotExistError (08003) caused by the
    error it read (08P01, "query_wait_timeout"), 0.30 the 08003 alone: both are looked at."""
    return any(presumed_outage(sqlstate(e)) for e in (exc, exc.__cause__) if e is not None)


# object_not_in_prerequisite_state, which a session's start-up raises for a database whose
# ALLOW_CONNECTIONS is false.
_NOT_ACCEPTING_CONNECTIONS = "55000"


# PgBouncer's refusals of a session's start-up that stay until its configuration or the DSN
# changes, as its messages say them (PgBouncer 1.x): a startup parameter it does not track
# ("unsupported startup parameter: statement_timeout", "... in options: ..."), a database it
# does not know, a user its auth_file lacks or a password it refuses. All come as 08P01, like
# its passing failures (query_wait_timeout, max_client_conn, a server it cannot reach).
_POOLER_REFUSALS = (
    "unsupported startup parameter",
    "no such database",
    "no such user",
    "authentication failed",
)


# What to check when PgBouncer refused a session for good (``_pooler_refused``).
_POOLER_HINT = (
    "check the DSN's database, user and parameters (PgBouncer forwards only the startup"
    " parameters it tracks) and its configuration"
)


def _pooler_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (from opening a connection) is PgBouncer's refusal of the session for
    good (``_POOLER_REFUSALS``)."""
    if sqlstate(exc) != "08P01":
        return False
    text = str(exc).lower()
    return any(refusal in text for refusal in _POOLER_REFUSALS)


def connect_error(
    exc: BaseException, doing: str = "connecting", *, store: StoreLog
) -> StoreUnavailable:
    """Opening a connection failed (``doing``: what it was opened for). Past the network and
    authentication, the server refuses a session's start-up for a setting it was asked for (a
    query parameter of the DSN, a ``server_settings`` entry: one it does not know, 42704; a
    value it does not accept, 22023): every connection fails alike until the DSN changes, as
    with a missing database. So here a SQLSTATE that is neither an outage nor a conflict
    (``Failure.OTHER``) is misconfigured: it was "unavailable", retryable, and a deploy step's
    migrate retried it for good. So is PgBouncer's refusal of the same mistakes
    (``_pooler_refused``), which it says with 08P01, a connection exception."""
    state = sqlstate(exc)
    if _pooler_refused(exc):
        _log_misconfigured(exc, "connecting", store)
        return StoreMisconfigured(
            f"idempotency store misconfigured while connecting (SQLSTATE {state}): the pooler"
            f" (PgBouncer) refused the session: {_POOLER_HINT}"
        )
    if state == _NOT_ACCEPTING_CONNECTIONS:
        # ALTER DATABASE ... ALLOW_CONNECTIONS false: an operator closed the database (a
        # maintenance window) and will open it again, as after a start-up: retry later. Not an
        # outage for a fail-open method: the database is up and holds the records.
        return StoreUnavailable(
            f"idempotency store unavailable while connecting (SQLSTATE {state}): the database"
            " is not accepting connections (ALLOW_CONNECTIONS is false): retry once it is open",
            outage=False,
        )
    if state is not None and classify(state) is Failure.OTHER:
        _log_misconfigured(exc, "connecting", store)
        return StoreMisconfigured(
            f"idempotency store misconfigured while connecting (SQLSTATE {state}): {_hint(state)}"
        )
    return store_error(exc, doing, store=store)


def session_refused(exc: BaseException) -> str | None:
    """What the server said, when ``exc`` (from opening a connection) is its refusal of the
    session for good (``connect_error``'s misconfigured cases: a password or database that is
    wrong, a setting it does not know); ``None`` otherwise. Logs nothing: for a DSN other than
    the store's own (``vet_dsn``), where "every keyed call fails" would not be true. PgBouncer's
    refusals for good too (``_pooler_refused``): a ``probe_dsn`` it refused was "does not answer
    now", and every probe failed alike, so every ambiguous outage let fail-open methods run
    unclaimed."""
    state = sqlstate(exc)
    if _pooler_refused(exc):
        return f"the pooler (PgBouncer) refused the session (SQLSTATE {state}): {_POOLER_HINT}"
    if state is None or state == _NOT_ACCEPTING_CONNECTIONS:
        return None
    if classify(state) not in (Failure.MISCONFIGURED, Failure.OTHER):
        return None
    return f"the server refused the session (SQLSTATE {state}): {_hint(state)}"


def raised_in_asyncpg(exc: BaseException, module: str = "asyncpg.") -> bool:
    """Whether ``exc`` was raised by code of ``module`` (asyncpg's by default): an OSError or a
    TimeoutError is the database's only then, not that of the caller's own network calls."""
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith(module):
            return True
        tb = tb.tb_next
    return False


def dsn_unusable(exc: BaseException) -> bool:
    """Whether ``exc``, raised by ``asyncpg.connect``/``create_pool``, says the DSN cannot be
    parsed or used: asyncpg's ClientConfigurationError, or what its DSN parsing lets escape
    (int() of a "port" that is a piece of the password, parse_qs of a "query" that is one, an
    empty host in a list, a port beyond a C long; the OSError of a certificate, key or CRL file
    it names that is missing, a directory, unreadable or not PEM). Only from its
    connection-parameter module: a ValueError of the pool's own (min_size > max_size) is the
    caller's, and says so itself."""
    if isinstance(exc, asyncpg.ClientConfigurationError):
        return True
    if isinstance(exc, OSError):
        # A connection failure, unless raised while the DSN was read: asyncpg loads the files
        # of sslrootcert, sslcrl, sslcert and sslkey (or PGSSLROOTCERT ...) into an SSLContext
        # there, before connecting, and a file that fails escapes as the OS's or the ssl
        # module's error, naming no file. Retrying will not create it. The handshake's
        # ssl.SSLCertVerificationError (a server certificate failing verify-full; a ValueError
        # too) comes later, from connecting, and stays a connection failure.
        return _raised_in_function(exc, "asyncpg.connect_utils", "_parse_connect_dsn_and_args")
    if _raised_by(exc, "asyncpg.connect_utils", "_parse_connect_arguments"):
        # Its own checks of keyword arguments (statement_cache_size=-1): the caller's, and the
        # message names the argument and quotes no part of the DSN.
        return False
    return isinstance(
        exc, (ValueError, LookupError, ArithmeticError, TypeError)
    ) and raised_in_asyncpg(exc, "asyncpg.connect_utils")


def _raised_by(exc: BaseException, module: str, function: str) -> bool:
    """Whether ``exc`` was raised by ``module``'s ``function`` itself (its innermost frame)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    return frame.f_code.co_name == function and frame.f_globals.get("__name__") == module


def _raised_in_function(exc: BaseException, module: str, function: str) -> bool:
    """Whether ``exc`` was raised inside ``module``'s ``function`` (or something it called)."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        tb = tb.tb_next
    return False


def handler_error(
    exc: BaseException, *, connection_live: bool = False, store: StoreLog = UNNAMED
) -> IdempotencyError | None:
    """What a database error that escaped the handler (raised by a statement it ran on the
    call's connection) answers; ``None`` when ``exc`` is not a database error. The key is
    released in every case; only the status differs. ``connection_live``: the call's connection
    is still connected, so an asyncpg InterfaceError is the handler's misuse of it. ``store``:
    the call's store (``Store.store_log``), named by the log."""
    if connection_live and isinstance(exc, asyncpg.InterfaceError):
        # Nesting ``connection.transaction()`` in the call's transaction, two statements at once
        # on it: the handler's bug. Answered as the store being down, it was UNAVAILABLE,
        # retried for ever, on-call sent to the database. (The driver does not say which
        # connection: one of the handler's own pools is possible too, hence "a".)
        log.error("the handler misused a database connection", exc_info=exc)
        return HandlerDatabaseError(
            f"the handler misused a database connection ({type(exc).__name__}), the call's"
            " being live; nothing was recorded"
        )
    if isinstance(exc, (OSError, TimeoutError)):
        # Also what the handler's own network calls raise: only asyncpg's are the store's.
        if not raised_in_asyncpg(exc):
            return None
    elif not isinstance(exc, STORE_ERRORS):
        return None
    state = sqlstate(exc)
    failure = classify(state)
    if isinstance(exc, asyncpg.PostgresError) and failure is Failure.CONFLICT:
        return TransactionConflict(
            f"the call's transaction was rolled back by a conflict (SQLSTATE {state});"
            " nothing was recorded: retry"
        )
    if failure is Failure.UNAVAILABLE or not isinstance(exc, asyncpg.PostgresError):
        return store_error(exc, "running the handler", store=store)
    log.error("the handler's database statement failed (SQLSTATE %s)", state, exc_info=exc)
    return HandlerDatabaseError(
        f"the handler's database statement failed (SQLSTATE {state}); nothing was recorded"
    )


# in_failed_sql_transaction: a statement sent after an earlier one failed in the transaction.
IN_FAILED_TRANSACTION = "25P02"


def aborted_by(who: str) -> HandlerDatabaseError:
    """``who`` (the handler, a consumer's effect) caught the error of a statement that failed
    and carried on: its transaction is aborted and nothing it wrote can commit. PostgreSQL
    answers the COMMIT of such a transaction with ROLLBACK, not an error, so the library must
    notice itself, or it would report success for writes that never happened."""
    log.error(
        "%s caught the error of a failed database statement and carried on: its transaction"
        " was aborted, and nothing it wrote was committed (run a statement whose error is"
        " caught between `SAVEPOINT s` and `ROLLBACK TO SAVEPOINT s`, or let the error"
        " propagate)",
        who,
    )
    return HandlerDatabaseError(
        f"{who}'s transaction was aborted by a failed statement whose error it caught;"
        " nothing was recorded"
    )


# invalid_savepoint_specification: the library's savepoint is gone, so the transaction is not
# the one it opened (the handler committed or rolled it back and began another).
NO_SUCH_SAVEPOINT = "3B001"


def ended_by_handler(how: str) -> HandlerDatabaseError:
    """The handler ended the call's transaction itself (``COMMIT`` or ``ROLLBACK`` on
    ``current_call().connection``, perhaps followed by ``BEGIN``): what it wrote before may have
    committed, or be gone, without the outcome. Neither success nor a released key that a retry
    runs again (writing once more) may be reported: INTERNAL, which clients do not retry."""
    log.error(
        "the handler ended the call's transaction itself (%s): what it wrote before may have"
        " committed without the outcome, or be gone; nothing was recorded (never run COMMIT,"
        " ROLLBACK or BEGIN on current_call().connection: use current_call().savepoint())",
        how,
    )
    return HandlerDatabaseError(
        "the handler ended the call's transaction itself; nothing was recorded"
    )


# What a broken or unreachable database looks like from asyncpg.
STORE_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    # e.g. "cannot switch to state ..." when the server killed a pooled connection just before use
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)
