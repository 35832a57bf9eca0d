"""The conformance kit: the idempotency test plan, run against a user's own service.

Each check calls the user's method over gRPC, with real keys, on the user's server running as a
child process (``python -m grpc_idempotency.testing.serve package.module:build_server``), and
counts the business effect with the user's own query. A server started with a crash failpoint
really dies (SIGKILL from inside, at that point of the request path); the retry then goes to
another process of the same server, as it would to another replica. The checks:

==========================  =================================================================
``sequential_replay``       a retry with the same key replays the first answer byte for byte,
                            metadata included, and the effect happened once
``mutated_payload``         the same key with another request is refused: FAILED_PRECONDITION,
                            reason ``IDEMPOTENCY_KEY_REUSED``; nothing runs
``concurrent_duplicates``   N duplicates at once, over two processes, one of them slow to
                            commit: one execution, every answer the same bytes
``crash`` (each point)      the server dies at ``after_claim``, ``before_commit`` or
                            ``after_commit_before_response``; the retry executes once (or
                            replays, when the crash came after COMMIT); nothing is left
                            before COMMIT but, in phased mode, a child-keyed call's effect
``lost_response``           the client's deadline passes after COMMIT: the retry replays
``deterministic_error``     a recorded error (INVALID_ARGUMENT, ...) is replayed, metadata
                            included, nothing kept
``transient_error``         an attempt that fails unexpectedly after the handler ran is rolled
                            back and released: the retry runs the handler
``lost_connection``         the call's database connection dies after the claim, before the
                            handler's first statement: nothing is left, the retry executes
                            once (atomic mode; a phased method skips it)
``keyless``                 a call without a key is refused (INVALID_ARGUMENT, reason
                            ``IDEMPOTENCY_KEY_MISSING``) and runs nothing; or, for a target
                            that is ``key_optional``, answers OK with one effect
==========================  =================================================================

The kit sees the effects ``count_effects`` counts in the database. An effect outside it (an email
sent, a downstream service called) runs again with every attempt that does not commit; give
``count_external_effects`` to have every check require it at most once per operation.

Use it by subclassing ``IdempotencyConformance`` in a test module (each check is a test), or
drive a ``ConformancePlan`` directly. A failed check raises ``ConformanceFailure`` (an
``AssertionError``) saying what the service did and what usually causes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import numbers
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

try:
    import pytest
except ImportError as exc:  # the runtime install has no pytest: say which extra brings it
    raise ImportError(
        "the conformance kit runs under pytest (and pytest-asyncio); install them with:"
        " pip install 'grpc-idempotency[testing]'",
        name="pytest",
    ) from exc

from google.protobuf.message import Message

from grpc_idempotency.core import wire
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import KeyInProgress, KeyMissing, KeyReused
from grpc_idempotency.testing._process import ServerProcess

if TYPE_CHECKING:
    import asyncpg
    import grpc

__all__ = [
    "CRASH_POINTS",
    "ConformanceFailure",
    "ConformancePlan",
    "ConformanceTarget",
    "IdempotencyConformance",
]

CRASH_POINTS: tuple[str, ...] = ("after_claim", "before_commit", "after_commit_before_response")
"""The request path's failpoints the crash check kills the server at, in path order."""

EffectCounter = Callable[["asyncpg.Connection[Any]", Any], Awaitable[int]]
"""``async def count(db, request) -> int``: how many times ``request``'s business effect
happened (rows written for it), read on a connection to the test database."""

ExternalCounter = Callable[[Any], Awaitable[int]]
"""``async def count(request) -> int``: how many times ``request``'s effects outside the database
happened (emails in a test mailbox, rows a fake downstream service received): where they land,
not how often the handler tried."""

_NOT_INTERCEPTED = (
    "Is the method served through IdempotencyInterceptor (last in the server's interceptors),"
    " does it have an idempotency option (or a MethodOverride), and does every server process"
    " give a caller the same scope (one taken from the hostname or the pid gives each replica"
    " keys of its own)?"
)
# The kit sees only the count: a write through a connection of the handler's own and a call to
# another service without a child key (a plain channel) look the same, and both are common.
_OUTSIDE_TRANSACTION = (
    "The handler makes its effect outside the call's transaction: write through"
    " current_call().connection (or current_call().transaction() in phased mode), never through"
    " a connection of your own; and call another service only as a declared step, through a"
    " channel with IdempotencyClientInterceptor (the call then carries the step's child key and"
    " a retry replays it), never through a plain channel."
)
_OUTSIDE_DATABASE = (
    "An attempt that does not commit (a crash, a transient error) runs the handler again, and"
    " with it every effect outside the database it caused directly. Send such an effect through"
    " the transactional outbox (current_call().enqueue(step, message): delivered after COMMIT,"
    " once) or call the service that causes it with a child key (a declared step), which"
    " replays it."
)

# The backends holding an atomic-mode claim, with their statements: the claim is sent as literal
# SQL in the batch that opens the call's transaction, so the key in it names the call's
# connection (``_claim_backend`` picks it). ``since_call``: its transaction began after $2, when
# the call was made (a claim older than that is not the call's).
_ATOMIC_CLAIM_BACKENDS = """
    SELECT pid, query,
           pg_catalog.clock_timestamp() - state_change >= pg_catalog.make_interval(secs => $1)
             AS settled,
           xact_start >= $2 AS since_call
    FROM pg_catalog.pg_stat_activity
    WHERE datname = pg_catalog.current_database() AND pid <> pg_catalog.pg_backend_pid()
      AND state = 'idle in transaction' AND pg_catalog.strpos(query, '.claim_atomic(') > 0
"""
# The schemas holding the library's records (whichever the server's store uses), each once
# (claim_with_start has two overloads since migration 0016). Only those the kit can read: in a
# shared database another role's store (no USAGE for the test's role), or another program's
# claim_with_start beside no records table, failed a correct service's checks with a bare
# asyncpg error. The server's own schema is always among them: it runs as the same role.
_RECORD_SCHEMAS = """
    SELECT DISTINCT n.nspname FROM pg_catalog.pg_proc p
    JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    JOIN pg_catalog.pg_class c
      ON c.relnamespace = n.oid AND c.relname = 'records' AND c.relkind IN ('r', 'p')
    WHERE p.proname = 'claim_with_start'
      AND pg_catalog.has_schema_privilege(n.oid, 'USAGE')
      AND pg_catalog.has_table_privilege(c.oid, 'SELECT')
      AND (SELECT count(*) FROM pg_catalog.pg_attribute a
           WHERE a.attrelid = c.oid AND a.attname IN ('key', 'state') AND NOT a.attisdropped) = 2
"""


def _literal(text: str, at: int) -> tuple[str, int] | None:
    """The escape-string literal (``E'...'``, as ``store.sql.text_literal`` writes it) that
    starts at ``text[at]``: its value and the index just past it; when ``text`` ends inside it,
    the value so far and -1; ``None`` when no such literal starts there."""
    if not text.startswith("E'", at):
        return ("", -1) if "E'".startswith(text[at:]) else None
    value: list[str] = []
    i = at + 2
    while i < len(text):
        if text[i] == "\\" or text.startswith("''", i):
            if i + 1 == len(text):
                break
            value.append(text[i + 1])
            i += 2
        elif text[i] == "'":
            if i + 1 == len(text):
                break  # perhaps the first of a doubled quote: not known to end the literal
            return "".join(value), i + 1
        else:
            value.append(text[i])
            i += 1
    return "".join(value), -1


def _claimed_key(query: str, key: str) -> bool | None:
    """Whether ``query``, an atomic claim as pg_stat_activity shows it, claims ``key``; ``None``
    when the text stops before it says (pg_stat_activity keeps a statement's first
    track_activity_query_size bytes, 1024 by default, and the scope before the key may take up
    to 1024 of its own)."""
    start = query.find(".claim_atomic(")
    if start < 0:
        return False
    scope = _literal(query, start + len(".claim_atomic("))
    if scope is None:
        return False
    at = scope[1]
    if at < 0:
        return None  # cut inside the scope
    if not query.startswith(", ", at):
        return None if ", ".startswith(query[at:]) else False
    claimed = _literal(query, at + 2)
    if claimed is None:
        return False
    value, end = claimed
    if end < 0:
        return None if key.startswith(value) else False
    return value == key


def _claim_backend(rows: Sequence[Any], key: str) -> int | None:
    """The backend holding the atomic claim on ``key``, among ``rows`` (``pid``, ``query``,
    ``settled``, ``since_call``): the one whose statement names the key; else the only one whose
    statement is cut short before its key shows, whose transaction began after the call was
    made (``since_call``) and that has sat idle for a while (``settled``), as the paused call's
    does. In a database that other tests or services use at the same time, a claim of theirs
    held since before the call (polled before the call's own showed, it was the only one, and
    was cut: their connection, and the check failed a correct service) is not the call's; two
    such are left alone (neither is known to be the call's), and one idle only for a moment
    (before the paused call's claim came) is not taken for it."""
    named = [int(r["pid"]) for r in rows if _claimed_key(str(r["query"]), key)]
    if named:
        return named[0]
    cut = [r for r in rows if r["since_call"] and _claimed_key(str(r["query"]), key) is None]
    return int(cut[0]["pid"]) if len(cut) == 1 and cut[0]["settled"] else None


def _message(value: Any, what: str) -> Any:
    """``value``, a request ``what`` returned, when it is a protobuf message: anything else
    (``None`` from a factory that forgot its return) failed deep in the call's serializer with
    a raw AttributeError naming neither."""
    if not isinstance(value, Message):
        raise TypeError(
            f"{what} (ConformanceTarget.{_TARGET_FIELDS[what]}) must return a protobuf message,"
            f" a request of the method's type, not {type(value).__name__}"
        )
    return value


async def _counted(value: Any, what: str) -> int:
    """The number a counter (``what``) returned, awaited. A plain ``def`` (its int cannot be
    awaited), a forgotten ``return`` (``None``) or ``db.fetch`` (a list of rows) failed with
    Python's own TypeError ("int() argument must be ...", "can't be used in 'await'
    expression"), naming neither the counter nor what it must return."""
    expected = f"{what} must be an async function (async def) returning the number of effects"
    if not inspect.isawaitable(value):
        raise TypeError(f"{expected}; it returned {type(value).__name__}, not an awaitable")
    count = await value
    if isinstance(count, bool):
        # An int to isinstance, but a yes/no (SELECT EXISTS ...) never exceeds 1: every check
        # would pass with the effect made twice.
        raise TypeError(
            f"{expected}, an int, not bool: count the effects (SELECT count(*) ...), for a"
            " yes/no cannot show one made twice"
        )
    # A whole number of any type: PostgreSQL's sum() of a bigint column is numeric, which
    # asyncpg returns as a Decimal (``int()`` took it before this check was added).
    if isinstance(count, numbers.Integral):
        return int(count)
    if isinstance(count, Decimal) and count.is_finite() and count == count.to_integral_value():
        return int(count)
    raise TypeError(
        f"{expected}, an int, not {type(count).__name__} (a missing return? db.fetchval(...)"
        " returns the count, db.fetch(...) the rows)"
    )


_TARGET_FIELDS = {
    "make_request()": "request()",
    "mutate_request(request)": "mutate(request)",
    "make_error_request()": "error_request()",
}


class ConformanceFailure(AssertionError):
    """A check of the conformance plan failed; the message says what the service did."""


@dataclass(frozen=True, kw_only=True)
class ConformanceTarget:
    """The method under test and how to reach, call and observe it.

    ``server``: ``"package.module:build_server"``, run in child processes by
    ``python -m grpc_idempotency.testing.serve`` (see that module). ``method``: the full name,
    ``"/package.Service/Method"``. ``request()``: a fresh request, a new operation each time.
    ``count_effects(db, request)``: the number of times that request's effect happened.
    ``mutate(request)``: a request that must not reuse ``request``'s key (default: a fresh
    ``request()``). ``error_request()``: a request the method answers with a deterministic error
    (needed by the deterministic-error check only). ``metadata``: sent with every call
    (credentials). ``server_env``: added to the server processes' environment.
    ``count_external_effects(request)``: how many times that request's effects outside the
    database happened (optional; every check then requires at most one). ``key_optional``: the
    method is meant to be ``KEY_OPTIONAL`` (the keyless check then expects a call without a key
    to run, once, instead of being refused).
    """

    server: str
    method: str
    request: Callable[[], Any]
    count_effects: EffectCounter
    mutate: Callable[[Any], Any] | None = None
    error_request: Callable[[], Any] | None = None
    metadata: Sequence[tuple[str, str]] = ()
    server_env: Mapping[str, str] = field(default_factory=dict)
    count_external_effects: ExternalCounter | None = None
    key_optional: bool = False
    """Whether the method is meant to run calls without a key (``key: KEY_OPTIONAL``)."""
    concurrency: int = 8
    """Duplicates sent at once by the concurrency check."""
    slow_commit_ms: int = 300
    """How long one of the concurrency check's servers pauses before each COMMIT."""
    call_timeout_s: float = 10.0
    """The deadline of every call the checks make (but the lost-response check's first), and how
    long the crash check waits for the server to die."""
    start_timeout_s: float = 60.0
    """How long a server process may take to print its ready line."""
    lost_response_deadline_s: float = 2.0
    """The client's deadline in the lost-response check: long enough for the handler to commit."""
    in_progress_timeout_s: float = 30.0
    """How long a retry keeps coming back while the key is in progress (after a crash in phased
    mode, the dead owner's lease must run out first)."""
    lost_connection_pause_ms: int = 2000
    """How long the lost-connection check's server pauses after the claim: the time the kit has
    to find the call's connection and cut it."""

    def __post_init__(self) -> None:
        parts = self.method.split("/")
        if len(parts) != 3 or parts[0] or not parts[1] or not parts[2]:
            raise ValueError(f"method must be '/package.Service/Method', not {self.method!r}")
        if ":" not in self.server:
            raise ValueError(f"server must be 'package.module:build_server', not {self.server!r}")
        if self.concurrency < 2:
            raise ValueError("concurrency must be at least 2")
        if self.lost_connection_pause_ms < 1:
            raise ValueError("lost_connection_pause_ms must be at least 1")


@dataclass(frozen=True)
class _Answer:
    code: grpc.StatusCode
    details: str
    data: bytes | None
    initial_metadata: tuple[tuple[str, str | bytes], ...]
    trailing_metadata: tuple[tuple[str, str | bytes], ...]

    @property
    def ok(self) -> bool:
        return self.data is not None

    @property
    def replayed(self) -> bool:
        return wire.REPLAYED_METADATA[0] in self.initial_metadata

    @property
    def reason(self) -> str | None:
        return wire.reason_of(self.trailing_metadata)

    @property
    def status_details(self) -> bytes | None:
        for name, value in self.trailing_metadata:
            if name == wire.DETAILS_TRAILER and isinstance(value, bytes):
                return value
        return None

    def __str__(self) -> str:
        replay = ", replayed" if self.replayed else ""
        if self.data is not None:
            return f"OK ({len(self.data)} bytes{replay})"
        reason = f", reason {self.reason}" if self.reason else ""
        return f"{self.code.name} {self.details!r}{reason}{replay}"


def _why(answers: Sequence[_Answer], *servers: ServerProcess) -> str:
    """Where to look for why ``servers`` failed ``answers``. A handler's exception, or an abort,
    is often in the status details alone: "its log (below) says why" pointed at an empty log."""
    details = "; ".join(dict.fromkeys(a.details for a in answers if a.details))
    if "NotInIdempotentCall" in details:
        # current_call() in a handler the interceptor did not run: the likeliest cause.
        return f"current_call() found no idempotent call: {_NOT_INTERCEPTED}"
    if any(server.logged() for server in servers):
        return "its log (below) says why"
    if details:
        return f"it logged nothing; the status details say why: {details}"
    return "it logged nothing and the status has no details"


def _pairs(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((str(name), value) for name, value in metadata or ())


def _names(answer: _Answer) -> set[str]:
    return {name for name, _ in (*answer.initial_metadata, *answer.trailing_metadata)}


def _bytes_diff(first: bytes, second: bytes) -> str:
    at = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), None)
    where = f"first difference at byte {at}" if at is not None else "one is a prefix of the other"
    return f"{len(first)} vs {len(second)} bytes, {where}: {first[:64]!r} vs {second[:64]!r}"


class ConformancePlan:
    """The checks, run against ``target`` on PostgreSQL ``dsn``; server output goes to
    ``log_dir``. ``target`` is a ``ConformanceTarget``, or what an ``IdempotencyConformance``
    subclass describes: ``MyChecks().conformance_target()``. One server process without
    failpoints serves every check's ordinary calls and retries; checks that need failpoints
    start (and stop) processes of their own. ``close()`` stops them all."""

    def __init__(self, target: ConformanceTarget, dsn: str, log_dir: Path) -> None:
        if not isinstance(target, ConformanceTarget):
            # Else the first check fails on an attribute of it, naming nothing the user wrote.
            raise TypeError(
                "target must be a ConformanceTarget(server=..., method=..., request=...,"
                " count_effects=...), or an IdempotencyConformance subclass's"
                f" MyChecks().conformance_target(), not {type(target).__name__}"
            )
        self.target = target
        self.dsn = dsn
        self.log_dir = log_dir
        self._clean: ServerProcess | None = None
        self._started: list[ServerProcess] = []
        self._requests_made: set[bytes] = set()  # serialized: equal requests, equal bytes

    # -- processes and calls -------------------------------------------------------------

    async def _start(self, failpoints: str | None, name: str) -> ServerProcess:
        process = ServerProcess(
            self.target.server,
            self.dsn,
            log_dir=self.log_dir,
            name=f"{len(self._started):02d}-{name}",
            failpoints=failpoints,
            env=self.target.server_env,
        )
        self._started.append(process)
        await process.start(self.target.start_timeout_s)
        return process

    async def _clean_server(self) -> ServerProcess:
        if self._clean is None or self._clean.returncode is not None:
            self._clean = await self._start(None, "server")
        return self._clean

    @contextlib.asynccontextmanager
    async def _server_with(self, failpoints: str, name: str) -> AsyncIterator[ServerProcess]:
        process = await self._start(failpoints, name)
        try:
            yield process
        finally:
            process.stop()

    @contextlib.asynccontextmanager
    async def _db(self) -> AsyncIterator[asyncpg.Connection[Any]]:
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            yield conn
        finally:
            await conn.close()

    def close(self) -> None:
        """Stops every server process the plan started."""
        for process in self._started:
            process.stop()

    def _request(self) -> Any:
        request = _message(self.target.request(), "make_request()")
        # count_effects(db, request) cannot tell the effects of two equal requests apart: each
        # check after the first counted the earlier checks' effects too, and blamed the service
        # ("the handler writes outside the call's transaction", a missing interceptor). Any
        # earlier request, not only the last: one of a few taking turns (itertools.cycle, a
        # random.choice of fixed ids) counted another check's effects just the same.
        data = request.SerializeToString(deterministic=True)
        if data in self._requests_made:
            raise ValueError(
                "make_request() (ConformanceTarget.request()) returned the same request again:"
                " each must be a new operation (a fresh id in it, e.g. uuid.uuid4().hex), or"
                " count_effects counts the earlier operations' effects as this one's"
            )
        self._requests_made.add(data)
        return request

    def _key(self, check: str) -> str:
        return f"conformance-{check}-{uuid.uuid4().hex}"

    async def _call(
        self, address: str, request: Any, key: str | None, *, timeout: float | None = None
    ) -> _Answer:
        """Calls the method with ``key`` (``None``: without one)."""
        import grpc

        keyed = () if key is None else ((wire.KEY_HEADER, key),)
        metadata = (*self.target.metadata, *keyed)
        async with grpc.aio.insecure_channel(address) as channel:
            method = channel.unary_unary(
                self.target.method,
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=None,  # the bytes on the wire, to compare replays with
            )
            call = method(request, metadata=metadata, timeout=timeout or self.target.call_timeout_s)
            try:
                data = await call
            except grpc.aio.AioRpcError as err:
                return _Answer(
                    err.code(),
                    err.details() or "",
                    None,
                    _pairs(err.initial_metadata()),
                    _pairs(err.trailing_metadata()),
                )
            return _Answer(
                grpc.StatusCode.OK,
                await call.details() or "",
                bytes(data),
                _pairs(await call.initial_metadata()),
                _pairs(await call.trailing_metadata()),
            )

    async def _settled(self, check: str, server: ServerProcess, request: Any, key: str) -> _Answer:
        """Calls until the key is no longer in progress elsewhere, honouring the server's retry
        pushback, as a well-behaved client does; fails the check when it still is after
        ``in_progress_timeout_s``."""
        __tracebackhide__ = True  # pytest: the failure, not the kit's frames
        timeout = self.target.in_progress_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            answer = await self._call(server.address, request, key)
            if answer.reason != KeyInProgress.reason:
                return answer
            if time.monotonic() > deadline:
                # Reported as the timeout it is: the checks that follow saw "the effect count
                # is 0, expected 1" and blamed a correct service whose lease is long.
                raise self._fail(
                    check,
                    f"the retry still found the key in progress after in_progress_timeout_s="
                    f"{timeout:g} s: {answer}. After a failed attempt of a phased method, a"
                    " retry waits out the dead attempt's lease: raise in_progress_timeout_s"
                    " above the method's lease (and its max_wait).",
                    server,
                )
            pushback = wire.retry_after_ms(answer.trailing_metadata) or 50
            await asyncio.sleep(min(max(pushback, 10), 1000) / 1000)

    async def _count(self, db: asyncpg.Connection[Any], request: Any) -> int:
        return await _counted(self.target.count_effects(db, request), "count_effects(db, request)")

    async def _claim_committed(self, db: asyncpg.Connection[Any], key: str) -> bool:
        """Whether ``key``'s claim was committed on its own (phased mode: before the handler
        ran, with a lease); an atomic attempt that did not commit leaves no record."""
        for schema in await db.fetch(_RECORD_SCHEMAS):
            name = '"' + str(schema["nspname"]).replace('"', '""') + '"'
            state = await db.fetchval(f"SELECT state FROM {name}.records WHERE key = $1", key)
            if state == "in_progress":
                return True
        return False

    async def _at_most_once_outside(self, check: str, request: Any) -> None:
        """Raises unless ``request``'s effects outside the database (if the target counts them)
        happened at most once: the kit cannot see them otherwise."""
        __tracebackhide__ = True  # pytest: the failure, not the kit's frames
        counter = self.target.count_external_effects
        if counter is None:
            return
        if (count := await _counted(counter(request), "count_external_effects(request)")) > 1:
            raise self._fail(
                check,
                f"the effect outside the database happened {count} times for one operation."
                f" {_OUTSIDE_DATABASE}",
            )

    def _fail(
        self, check: str, message: str, *processes: ServerProcess | None
    ) -> ConformanceFailure:
        logs = "".join(f"\n{p.describe()}:\n{p.logs()}" for p in processes if p is not None)
        return ConformanceFailure(f"[{check}] {message}{logs}")

    async def _first(self, check: str, server: ServerProcess, request: Any, key: str) -> _Answer:
        __tracebackhide__ = True  # pytest: the failure, not the kit's frames
        answer = await self._call(server.address, request, key)
        if not answer.ok:
            # The library's own reason (a handler's misuse, a store it cannot use), or a server
            # error: the service failed, not the test's request.
            failed = answer.reason is not None or answer.code.value[0] in (
                int(Code.INTERNAL),
                int(Code.UNKNOWN),
            )
            if answer.code.value[0] == int(Code.UNIMPLEMENTED) and answer.reason is None:
                # gRPC's own "Method not found!": blaming the request sent users to the wrong
                # place for a misspelt method or a servicer build_server never added.
                hint = (
                    f"the server serves no method {self.target.method}: check the method"
                    " (/package.Service/Method, as in the .proto) and that build_server adds"
                    " its servicer"
                )
            elif failed:
                hint = f"the server failed it; {_why([answer], server)}"
            else:
                hint = "the request factory must make a request the method answers OK"
            raise self._fail(
                check, f"the first call with a new key failed: {answer}; {hint}", server
            )
        if answer.replayed:
            raise self._fail(check, f"the first call with a new key was a replay: {answer}")
        return answer

    def _same_metadata(self, check: str, first: _Answer, retry: _Answer, where: str) -> None:
        """Raises when ``first`` carried metadata ``retry``, its replay, lacks."""
        __tracebackhide__ = True  # pytest: the failure, not the kit's frames
        # The library replays the response (or error), status and details, never metadata a
        # handler sets: what the first answer carried and the replay lacks, the client gets
        # only once.
        lost = sorted(_names(first) - _names(retry))
        if lost:
            raise self._fail(
                check,
                f"the first answer carried metadata {lost} that the replay does not: metadata"
                " the handler sets (set_trailing_metadata, send_initial_metadata) is not stored,"
                " and a client whose first answer was lost never sees it. Put what a retry must"
                f" see in {where}.",
            )

    # -- the checks ----------------------------------------------------------------------

    async def check_sequential_replay(self) -> None:
        """A retry with the same key and request replays the first answer, byte for byte, and
        the business effect happened once. The first answer carries no metadata the replay
        lacks (a handler's own, which the library does not store)."""
        __tracebackhide__ = True  # pytest: the failure, not the kit\'s frames
        check = "sequential replay"
        request, key = self._request(), self._key("replay")
        server = await self._clean_server()
        async with self._db() as db:
            first = await self._first(check, server, request, key)
            if (count := await self._count(db, request)) != 1:
                raise self._fail(check, f"one call made {count} business effects, expected 1")
            retry = await self._call(server.address, request, key)
            count = await self._count(db, request)
        if count != 1:
            raise self._fail(
                check, f"the retry executed again: {count} business effects. {_NOT_INTERCEPTED}"
            )
        if not retry.ok:
            raise self._fail(check, f"the retry failed: {retry}", server)
        if not retry.replayed:
            raise self._fail(
                check, f"the retry was not marked as a replay: {retry}. {_NOT_INTERCEPTED}"
            )
        if retry.data != first.data:
            assert first.data is not None and retry.data is not None
            raise self._fail(
                check,
                "the replayed response differs from the first one:"
                f" {_bytes_diff(first.data, retry.data)}",
            )
        self._same_metadata(check, first, retry, "the response message")
        await self._at_most_once_outside(check, request)

    async def check_mutated_payload(self) -> None:
        """The same key with another request is refused (FAILED_PRECONDITION, reason
        ``IDEMPOTENCY_KEY_REUSED``) and runs nothing."""
        __tracebackhide__ = True  # pytest: the failure, not the kit\'s frames
        check = "mutated payload"
        request, key = self._request(), self._key("mutated")
        if self.target.mutate is None:
            mutated = self._request()
        else:
            mutated = _message(self.target.mutate(request), "mutate_request(request)")
        server = await self._clean_server()
        if mutated.SerializeToString(deterministic=True) == request.SerializeToString(
            deterministic=True
        ):
            raise ValueError("mutate(request) returned an equal request: change a field")
        async with self._db() as db:
            await self._first(check, server, request, key)
            before = await self._count(db, mutated)
            answer = await self._call(server.address, mutated, key)
            original, after = await self._count(db, request), await self._count(db, mutated)
        if answer.ok or after != before:
            raise self._fail(
                check,
                f"another request with a used key ran: {answer}, its effects {before} -> {after}."
                f" {_NOT_INTERCEPTED} (Fields marked fingerprint = EXCLUDE do not count: mutate"
                " one that does.)",
            )
        refused = answer.code.value[0] == int(Code.FAILED_PRECONDITION)
        if not refused or answer.reason != KeyReused.reason:
            raise self._fail(
                check,
                f"expected FAILED_PRECONDITION with reason {KeyReused.reason}, got {answer}",
                server,
            )
        if original != 1:
            raise self._fail(check, f"the first request's effect count is {original}, expected 1")
        await self._at_most_once_outside(check, request)

    async def check_concurrent_duplicates(self) -> None:
        """``concurrency`` duplicates at once, spread over two server processes (one pausing
        before each COMMIT): the effect happens once, one answer executes, the others replay
        the same bytes (or are told the key is in progress)."""
        __tracebackhide__ = True  # pytest: the failure, not the kit\'s frames
        check = "concurrent duplicates"
        n = self.target.concurrency
        request, key = self._request(), self._key("concurrent")  # refused before servers start
        clean = await self._clean_server()
        slow_points = f"before_commit=sleep:{self.target.slow_commit_ms}"
        async with self._server_with(slow_points, "slow") as slow, self._db() as db:
            servers = [slow, clean] * n
            answers = await asyncio.gather(
                *(self._call(servers[i].address, request, key) for i in range(n))
            )
            count = await self._count(db, request)
        summary = ", ".join(str(a) for a in answers)
        if count == 0 and not any(a.ok for a in answers):
            # Nothing ran to completion: the service failed every duplicate (its logs say why);
            # no sign of a missing interceptor.
            raise self._fail(
                check,
                f"no duplicate succeeded and the effect never happened: {summary}; the server"
                f" failed them; {_why(answers, clean, slow)}",
                clean,
                slow,
            )
        if count != 1:
            raise self._fail(
                check,
                f"{n} concurrent duplicates made {count} business effects: {summary}."
                f" {_NOT_INTERCEPTED}",
            )
        unexpected = [a for a in answers if not a.ok and a.reason != KeyInProgress.reason]
        if unexpected:
            raise self._fail(check, f"unexpected answers: {summary}", clean, slow)
        oks = [a for a in answers if a.ok]
        executed = [a for a in oks if not a.replayed]
        if not oks or len(executed) != 1:
            raise self._fail(
                check, f"expected exactly one executed answer among the OKs, got: {summary}"
            )
        if any(a.data != executed[0].data for a in oks):
            raise self._fail(check, f"the duplicates were answered different bytes: {summary}")
        await self._at_most_once_outside(check, request)

    async def check_crash(self, point: str) -> None:
        """The server dies (SIGKILL) at failpoint ``point``; a retry with the same key on
        another process executes once (or replays, after COMMIT), and the effect exists once.
        Before COMMIT nothing is left, but in phased mode the effect of a call to another
        service with a step's child key, committed there, which the retry replays."""
        if point not in CRASH_POINTS:
            raise ValueError(f"point must be one of {CRASH_POINTS}, not {point!r}")
        __tracebackhide__ = True  # pytest: the failure, not the kit\'s frames
        check = f"crash at {point}"
        committed = point == "after_commit_before_response"
        request, key = self._request(), self._key(point)
        clean = await self._clean_server()
        async with self._server_with(f"{point}=crash", f"crash-{point}") as doomed:
            answer = await self._call(doomed.address, request, key)
            if answer.ok:
                raise self._fail(
                    check,
                    f"the failpoint never fired: the call answered {answer}. {_NOT_INTERCEPTED}",
                    doomed,
                )
            if answer.reason is not None or answer.code.value[0] != int(Code.UNAVAILABLE):
                # The server answered the call itself (a library reason, a handler's error):
                # it never reached the failpoint, and waiting for it to die would be in vain.
                raise self._fail(
                    check,
                    f"the server answered {answer} before it reached the failpoint {point}, where"
                    f" it should have died; {_why([answer], doomed)}",
                    doomed,
                )
            code = await doomed.wait_exit(self.target.call_timeout_s)
            if code != -signal.SIGKILL:
                state = "is still running" if code is None else f"exited with {code}"
                raise self._fail(
                    check,
                    f"the call failed ({answer}) but the server {state}: expected it to kill"
                    " itself at the failpoint",
                    doomed,
                )
        async with self._db() as db:
            left = await self._count(db, request)
            expected = 1 if committed else 0
            # Phased mode: a downstream call with a step's child key commits there, before the
            # attempt's own transaction; its retry replays the call (one effect, checked below).
            child_call = left == 1 and not committed and await self._claim_committed(db, key)
            if left != expected and not child_call:
                cause = _OUTSIDE_TRANSACTION if left > expected else "The effect was lost."
                raise self._fail(
                    check,
                    f"after the crash the effect count is {left}, expected {expected}. {cause}",
                )
            retry = await self._settled(check, clean, request, key)
            count = await self._count(db, request)
            again = await self._call(clean.address, request, key)
        if count != 1:
            # The effect the crash left was not a child-keyed call's, which would have replayed.
            cause = f" {_OUTSIDE_TRANSACTION}" if child_call and count > 1 else ""
            raise self._fail(
                check,
                f"after the retry the effect count is {count}, expected 1: {retry}.{cause}",
                clean,
            )
        if not retry.ok:
            raise self._fail(check, f"the retry after the crash failed: {retry}", clean)
        if retry.replayed != committed:
            expected_answer = "a replay of the committed" if committed else "a new execution"
            raise self._fail(check, f"the retry should be {expected_answer} answer: {retry}")
        if not (again.ok and again.replayed and again.data == retry.data):
            raise self._fail(check, f"a second retry should replay the first retry: {again}")
        await self._at_most_once_outside(check, request)

    async def check_lost_response(self) -> None:
        """The client's deadline passes after COMMIT, before the answer: the retry replays the
        committed outcome and the effect exists once."""
        __tracebackhide__ = True  # pytest: the failure, not the kit\'s frames
        check = "lost response"
        deadline = self.target.lost_response_deadline_s
        hold_ms = int((deadline + self.target.call_timeout_s) * 1000)
        request, key = self._request(), self._key("lost")
        clean = await self._clean_server()
        points = f"after_commit_before_response=sleep:{hold_ms}"
        async with self._server_with(points, "lost-response") as holding, self._db() as db:
            lost = await self._call(holding.address, request, key, timeout=deadline)
            committed = await self._count(db, request)
            if lost.ok:
                raise self._fail(
                    check,
                    f"the answer arrived despite a {hold_ms} ms pause after COMMIT: {lost}."
                    f" {_NOT_INTERCEPTED}",
                )
            if committed != 1:
                raise self._fail(
                    check,
                    f"{lost}: the attempt had made {committed} effects by its deadline, expected"
                    f" 1 (did it commit within lost_response_deadline_s={deadline}?)",
                    holding,
                )
            retry = await self._settled(check, clean, request, key)
            count = await self._count(db, request)
        if not (retry.ok and retry.replayed) or count != 1:
            raise self._fail(
                check,
                f"the retry after a lost response answered {retry} with {count} effects;"
                " expected a replay and 1",
                clean,
            )
        await self._at_most_once_outside(check, request)

    async def check_deterministic_error(self) -> None:
        """A recorded error (INVALID_ARGUMENT, NOT_FOUND, ...) is answered again from the record
        on retry, the same status, message and details, and leaves no effect. The first answer
        carries no metadata the replay lacks (a handler's own trailers, which are not stored)."""
        __tracebackhide__ = True  # pytest: the failure, not the kit\'s frames
        check = "deterministic error"
        if self.target.error_request is None:
            raise ValueError("the deterministic-error check needs error_request")
        request = _message(self.target.error_request(), "make_error_request()")
        key = self._key("error")
        clean = await self._clean_server()
        async with self._db() as db:
            first = await self._call(clean.address, request, key)
            retry = await self._call(clean.address, request, key)
            count = await self._count(db, request)
        if first.ok or Code(first.code.value[0]) in wire.NEVER_RECORDED:
            raise self._fail(
                check,
                f"error_request was answered {first}: it must make the method fail with a"
                " deterministic error (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,"
                " FAILED_PRECONDITION, OUT_OF_RANGE)",
                clean,
            )
        if first.replayed:
            raise self._fail(check, f"the first call with a new key was a replay: {first}")
        if not retry.replayed:
            raise self._fail(
                check,
                f"the retry ran again instead of replaying the error: {retry}. Is"
                f" {first.code.name} in the method's recorded errors? {_NOT_INTERCEPTED}",
            )
        same = (retry.code, retry.details, retry.status_details) == (
            first.code,
            first.details,
            first.status_details,
        )
        if not same:
            raise self._fail(check, f"the replayed error differs: {first} then {retry}")
        # An error's own trailers (a code for the client, say) go with its first answer only.
        self._same_metadata(
            check, first, retry, "the status details (google.rpc.Status details, rich errors)"
        )
        if count != 0:
            raise self._fail(
                check, f"a failed call left {count} effects, expected 0. {_OUTSIDE_TRANSACTION}"
            )
        await self._at_most_once_outside(check, request)

    async def check_transient_error(self) -> None:
        """An attempt that fails unexpectedly after its handler ran (failpoint
        ``before_commit=error``) is rolled back and its key released: the retry runs the
        handler again, and the effect exists once. The failed attempt leaves nothing, but in
        phased mode the effect of a call to another service with a step's child key, which the
        retry replays."""
        __tracebackhide__ = True  # pytest: the failure, not the kit\'s frames
        check = "transient error"
        request, key = self._request(), self._key("transient")
        clean = await self._clean_server()
        async with self._server_with("before_commit=error", "transient") as failing:
            failed = await self._call(failing.address, request, key)
        async with self._db() as db:
            left = await self._count(db, request)
            if failed.ok:
                raise self._fail(
                    check, f"the failpoint never fired: {failed}. {_NOT_INTERCEPTED}", failing
                )
            # Phased mode: a downstream call with a step's child key committed there; the retry
            # replays it (one effect, checked below).
            child_call = left == 1 and await self._claim_committed(db, key)
            if left != 0 and not child_call:
                raise self._fail(
                    check,
                    f"the failed attempt ({failed}) left {left} effects, expected 0."
                    f" {_OUTSIDE_TRANSACTION}",
                )
            retry = await self._settled(check, clean, request, key)
            count = await self._count(db, request)
        if not retry.ok or retry.replayed:
            raise self._fail(
                check, f"the retry should run the handler and answer OK, got {retry}", clean
            )
        if count != 1:
            # The effect the failure left was not a child-keyed call's, which would have replayed.
            cause = f" {_OUTSIDE_TRANSACTION}" if child_call and count > 1 else ""
            raise self._fail(
                check, f"after the retry the effect count is {count}, expected 1.{cause}"
            )
        await self._at_most_once_outside(check, request)

    async def _cut_connection(
        self,
        db: asyncpg.Connection[Any],
        key: str,
        call: asyncio.Future[_Answer],
        since: datetime,
    ) -> str:
        """Terminates the backend of the call holding ``key``'s atomic claim, while the call
        (made at ``since``, the database's clock) pauses after the claim: ``"cut"``;
        ``"phased"`` when the claim was committed on its own instead (there is no call
        transaction to cut); ``"ended"`` when the call ended first."""
        # A quarter of the pause at most: it leaves time to cut the connection before it ends.
        settled_s = min(0.2, self.target.lost_connection_pause_ms / 4000)
        while not call.done():
            rows = await db.fetch(_ATOMIC_CLAIM_BACKENDS, settled_s, since)
            pid = _claim_backend(rows, key)
            if pid is not None:
                await db.fetchval("SELECT pg_catalog.pg_terminate_backend($1)", pid)
                return "cut"
            if await self._claim_committed(db, key):
                return "phased"
            # Wakes as soon as the call ends: then the pause is over and nothing is left to cut.
            await asyncio.wait({call}, timeout=0.02)
        return "ended"

    async def check_lost_connection(self) -> None:
        """The call's database connection dies after the claim, before the handler's first
        statement (failpoint ``after_claim=sleep``, then ``pg_terminate_backend`` of the call's
        backend): the attempt fails and leaves nothing, and a retry executes once. A handler
        that carries on over a connection of its own (a fresh one from the pool when the
        call's is lost) writes outside the call's transaction and fails it.

        Atomic mode only: a phased method's handler opens its transaction itself, so there is
        no call connection to cut after the claim; the check skips (``pytest.skip``)."""
        __tracebackhide__ = True  # pytest: the failure, not the kit's frames
        check = "lost connection"
        request, key = self._request(), self._key("lostconn")
        clean = await self._clean_server()
        pause_ms = self.target.lost_connection_pause_ms
        async with (
            self._server_with(f"after_claim=sleep:{pause_ms}", "lost-connection") as paused,
            self._db() as db,
        ):
            since = await db.fetchval("SELECT pg_catalog.clock_timestamp()")
            call = asyncio.ensure_future(self._call(paused.address, request, key))
            try:
                cut = await self._cut_connection(db, key, call, since)
            finally:
                failed = await call
            if cut == "phased":
                pytest.skip(
                    f"[{check}] the method runs in phased mode: its claim commits on its own and"
                    " the handler opens its transaction itself, so there is no call connection"
                    " to cut"
                )
            if cut == "ended":
                raise self._fail(
                    check,
                    f"the call ended ({failed}) before its connection could be cut: no"
                    f" transaction held its claim during the {pause_ms} ms pause after the claim."
                    f" {_NOT_INTERCEPTED} (On a slow machine, raise lost_connection_pause_ms.)",
                    paused,
                )
            left = await self._count(db, request)
            if left != 0:
                raise self._fail(
                    check,
                    f"the attempt whose connection was lost ({failed}) left {left} effects,"
                    " expected 0: the handler carried on outside the call's transaction (a"
                    " connection of its own, taken when the call's failed?). Let the error"
                    " propagate: the retry runs the handler again.",
                    paused,
                )
            if failed.ok:
                raise self._fail(
                    check, f"the call answered {failed} although its transaction was gone", paused
                )
            retry = await self._settled(check, clean, request, key)
            count = await self._count(db, request)
        if not retry.ok or retry.replayed or count != 1:
            raise self._fail(
                check,
                f"the retry after a lost connection answered {retry} with {count} effects;"
                " expected a new execution and 1",
                clean,
            )
        await self._at_most_once_outside(check, request)

    async def check_keyless(self) -> None:
        """A call without a key: refused with ``INVALID_ARGUMENT``, reason
        ``IDEMPOTENCY_KEY_MISSING``, and nothing runs; or, when the target is ``key_optional``,
        answered OK (not a replay) with one effect."""
        __tracebackhide__ = True  # pytest: the failure, not the kit's frames
        check = "keyless call"
        request = self._request()
        clean = await self._clean_server()
        answer = await self._call(clean.address, request, None)
        async with self._db() as db:
            count = await self._count(db, request)
        if not self.target.key_optional:
            refused = answer.code.value[0] == int(Code.INVALID_ARGUMENT)
            if not refused or answer.reason != KeyMissing.reason or count != 0:
                raise self._fail(
                    check,
                    f"a call without a key answered {answer} with {count} effects; expected"
                    f" INVALID_ARGUMENT, reason {KeyMissing.reason}, and none. Is the method"
                    " KEY_OPTIONAL (then say key_optional = True), or not served through"
                    " IdempotencyInterceptor?",
                    clean,
                )
            return
        if not answer.ok or answer.replayed or count != 1:
            raise self._fail(
                check,
                f"the method is key-optional, but a call without a key answered {answer} with"
                f" {count} effects; expected OK and 1. Does the handler need current_call().key"
                " (None without a key)? Or is the method KEY_REQUIRED (then leave key_optional"
                " False)?",
                clean,
            )
        await self._at_most_once_outside(check, request)

    async def run_all(self) -> None:
        """Every check, in order; stops at the first failure."""
        await self.check_sequential_replay()
        await self.check_mutated_payload()
        await self.check_concurrent_duplicates()
        for point in CRASH_POINTS:
            await self.check_crash(point)
        await self.check_lost_response()
        if self.target.error_request is not None:
            await self.check_deterministic_error()
        await self.check_transient_error()
        with contextlib.suppress(pytest.skip.Exception):  # not applicable in phased mode
            await self.check_lost_connection()
        await self.check_keyless()


class IdempotencyConformance:
    """Subclass it in a test module, named ``Test...``, to run the plan as one test per check::

        class TestChargeIsIdempotent(IdempotencyConformance):
            server = "myshop.server:build_server"
            method = "/shop.v1.PaymentService/Charge"
            metadata = (("authorization", "Bearer test-token"),)

            def make_request(self):
                return ChargeRequest(order_id=uuid.uuid4().hex, amount_cents=1250)

            async def count_effects(self, db, request):
                return await db.fetchval(
                    "SELECT count(*) FROM charges WHERE order_id = $1", request.order_id
                )

            def make_error_request(self):  # optional: the deterministic-error check
                return ChargeRequest(order_id=uuid.uuid4().hex, amount_cents=0)

            async def count_external_effects(self, request):  # optional: emails, calls out
                return test_mailbox.count(to=request.order_id)

    The class attributes and methods are ``ConformanceTarget``'s fields. The plugin's
    ``idempotency_conformance`` fixture holds the class's ``ConformancePlan`` (its server
    processes stop after the class's last check) on the ``idempotency_dsn`` database (override
    that fixture to use another). Needs the plugin and pytest-asyncio (the ``testing`` extra).
    """

    server: ClassVar[str]
    """``"package.module:build_server"``; see ``grpc_idempotency.testing.serve``."""
    method: ClassVar[str]
    """The full method name, ``"/package.Service/Method"``."""
    metadata: ClassVar[Sequence[tuple[str, str]]] = ()
    """Sent with every call, e.g. credentials."""
    server_env: ClassVar[Mapping[str, str]] = {}
    """Added to the server processes' environment."""
    key_optional: ClassVar[bool] = False
    """The method is meant to run calls without a key (``KEY_OPTIONAL``): the keyless check
    then expects such a call to run once instead of being refused."""
    concurrency: ClassVar[int] = 8
    """Duplicates sent at once by the concurrency check."""
    slow_commit_ms: ClassVar[int] = 300
    """How long one of the concurrency check's servers pauses before each COMMIT."""
    call_timeout_s: ClassVar[float] = 10.0
    """The deadline of the checks' calls (raise it for a slow handler or a slow CI machine)."""
    start_timeout_s: ClassVar[float] = 60.0
    """How long a server process may take to start and print its ready line."""
    lost_response_deadline_s: ClassVar[float] = 2.0
    """The client deadline of the lost-response check."""
    in_progress_timeout_s: ClassVar[float] = 30.0
    """How long a retry may keep finding the key in progress (a phased method's lease)."""
    lost_connection_pause_ms: ClassVar[int] = 2000
    """How long the lost-connection check's server pauses after the claim."""

    def make_request(self) -> Any:
        """A fresh request: a new operation each time it is called."""
        raise NotImplementedError(f"{type(self).__name__} must define make_request()")

    async def count_effects(self, db: asyncpg.Connection[Any], request: Any) -> int:
        """How many times ``request``'s business effect happened (e.g. rows for its id)."""
        raise NotImplementedError(f"{type(self).__name__} must define count_effects()")

    def mutate_request(self, request: Any) -> Any:
        """A request different from ``request`` (in a fingerprinted field); default: a fresh
        ``make_request()``."""
        return self.make_request()

    def make_error_request(self) -> Any:
        """A request answered with a deterministic error; ``None`` (the default) skips the
        deterministic-error check."""
        return None

    async def count_external_effects(self, request: Any) -> int:
        """How many times ``request``'s effects outside the database happened, where they land
        (a test mailbox, a fake downstream service); every check then requires at most one.
        Not defined (the default): the kit sees only ``count_effects``."""
        raise NotImplementedError  # pragma: no cover - never called unless overridden

    def conformance_target(self) -> ConformanceTarget:
        """The ``ConformanceTarget`` this class describes."""
        # Declared but not given a value: reading one raised a bare AttributeError in every
        # check, naming neither what to set nor what it holds.
        examples = {
            "server": "'package.module:build_server'",
            "method": "'/package.Service/Method'",
        }
        for name, example in examples.items():
            if not hasattr(self, name):
                raise TypeError(f"{type(self).__name__} must set {name} = {example}")
        error = self.make_error_request
        external = type(self).count_external_effects is not (
            IdempotencyConformance.count_external_effects
        )
        return ConformanceTarget(
            server=self.server,
            method=self.method,
            request=self.make_request,
            count_effects=self.count_effects,
            mutate=self.mutate_request,
            error_request=error if self.make_error_request() is not None else None,
            metadata=self.metadata,
            server_env=self.server_env,
            count_external_effects=self.count_external_effects if external else None,
            key_optional=self.key_optional,
            concurrency=self.concurrency,
            slow_commit_ms=self.slow_commit_ms,
            call_timeout_s=self.call_timeout_s,
            start_timeout_s=self.start_timeout_s,
            lost_response_deadline_s=self.lost_response_deadline_s,
            in_progress_timeout_s=self.in_progress_timeout_s,
            lost_connection_pause_ms=self.lost_connection_pause_ms,
        )

    @pytest.mark.asyncio
    async def test_sequential_retry_replays_byte_identical(
        self, idempotency_conformance: ConformancePlan
    ) -> None:
        """Check: a retry replays the first answer byte for byte; one effect."""
        await idempotency_conformance.check_sequential_replay()

    @pytest.mark.asyncio
    async def test_mutated_payload_is_refused(
        self, idempotency_conformance: ConformancePlan
    ) -> None:
        """Check: another request under a used key is refused with KEY_REUSED."""
        await idempotency_conformance.check_mutated_payload()

    @pytest.mark.asyncio
    async def test_concurrent_duplicates_execute_once(
        self, idempotency_conformance: ConformancePlan
    ) -> None:
        """Check: concurrent duplicates over two processes execute once."""
        await idempotency_conformance.check_concurrent_duplicates()

    @pytest.mark.asyncio
    @pytest.mark.parametrize("failpoint", CRASH_POINTS)
    async def test_crash_then_retry_executes_once(
        self, idempotency_conformance: ConformancePlan, failpoint: str
    ) -> None:
        """Check: the server dies at ``failpoint``; the retry makes the effect exist once."""
        await idempotency_conformance.check_crash(failpoint)

    @pytest.mark.asyncio
    async def test_lost_response_is_replayed(
        self, idempotency_conformance: ConformancePlan
    ) -> None:
        """Check: a deadline that passes after COMMIT; the retry replays."""
        await idempotency_conformance.check_lost_response()

    @pytest.mark.asyncio
    async def test_deterministic_error_is_replayed(
        self, idempotency_conformance: ConformancePlan
    ) -> None:
        """Check: a recorded error is replayed, same status and details."""
        if idempotency_conformance.target.error_request is None:
            pytest.skip("define make_error_request() to run the deterministic-error check")
        await idempotency_conformance.check_deterministic_error()

    @pytest.mark.asyncio
    async def test_transient_error_is_released(
        self, idempotency_conformance: ConformancePlan
    ) -> None:
        """Check: an attempt that fails unexpectedly is released; the retry runs again."""
        await idempotency_conformance.check_transient_error()

    @pytest.mark.asyncio
    async def test_lost_connection_leaves_nothing(
        self, idempotency_conformance: ConformancePlan
    ) -> None:
        """Check: the call's connection dies after the claim; nothing is left, the retry
        executes once (skipped in phased mode)."""
        await idempotency_conformance.check_lost_connection()

    @pytest.mark.asyncio
    async def test_call_without_a_key(self, idempotency_conformance: ConformancePlan) -> None:
        """Check: a call without a key is refused (KEY_MISSING), or runs once if
        ``key_optional``."""
        await idempotency_conformance.check_keyless()
