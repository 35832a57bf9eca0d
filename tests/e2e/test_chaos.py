"""Exactly once under chaos: real replicas, real crashes, real retries, one PostgreSQL.

Three LedgerService replicas (``tests.support.ledger_process``), each a process of its own, share
the session's PostgreSQL. A few hundred operations, atomic (``Post``) and phased
(``PostPhased``), each with its own key and request, run many at once; each is retried with the
same key and request over the replicas until it has a final answer, as a client would: honouring
the server's retry hint (``ABORTED`` / ``IDEMPOTENCY_KEY_IN_PROGRESS`` with its pushback) and the
library's ``RetryPolicy`` backoff otherwise. An attempt with no answer after a while gets a hedge
on another replica (the first final answer wins; the loser's is checked too), some attempts go
with a deadline of a few milliseconds, and some clients "lose" their answer and ask again.

Meanwhile, driven by what the test observes rather than by time:

- crashes, one replica disrupted at a time, several per run: a replica is SIGKILLed once it has
  enough calls in flight (started, not answered), or once a batch of its answers arrived while
  it has calls in flight, and restarted on a new port; or it is stalled (SIGSTOP, holding its
  connections, claims and transactions) once it holds several phased calls, until another
  replica answered one of them (the stalled lease taken over), then let go on (SIGCONT) with
  its stale attempts. The operations are launched in rounds, each after the previous round's
  crash is over (or after its operations, when none came), so that crashes spread over the run;
- every so many answers, a random database session of the replicas (a busy one when there is
  one: in a claim, a handler, a commit) is ended with ``pg_terminate_backend``.

At the end, with everything answered: every operation got the answer its request asks for (OK,
or the recorded NOT_FOUND); every later answer to it (the lost-answer retries, then one call per
replica) is the same status, details and response bytes, as a replay, and so is any final answer
of a hedge's loser; the ledger holds exactly one row per OK operation and none for the others,
the one the answer names; every record of the run's scope is completed with the outcome
answered, none in progress (a released phased claim keeps its row in progress, README, but every
operation here ended with an outcome); and the handler executions that committed (a ledger row,
or a recorded error outcome) are as many as the operations.

``GRPC_IDEMPOTENCY_CHAOS_SEED`` replays a run's random choices (which replica, which request,
which backend, which deadline); the seed is printed and attached to any failure. The
interleaving of processes is not reproducible, the choices are.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import RetryPolicy, Store
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.wire import retry_after_ms
from tests.e2e.procs import SIGKILLED, ServiceProcess
from tests.support.ledger import POST, metadata
from tests.support.waiting import until
from tests.support.wire import Answer, call_raw

pytestmark = pytest.mark.e2e

POST_PHASED = "/testsvc.v1.LedgerService/PostPhased"
APP_NAME = "chaos-ledger"
"""The replicas' database sessions, as ``pg_stat_activity`` names them: the ones ended here."""

REPLICAS = 3
OPERATIONS = 480
CRASHES = 9
ROUND = OPERATIONS // (CRASHES + 2)
"""Operations launched per round; a round begins once the previous round's crash is over."""
CONCURRENCY = 36
"""Operations in flight at once (each retrying until its final answer)."""
CRASH_IN_FLIGHT = 6
"""A replica with this many calls started and not answered is killed..."""
CRASH_ANSWERED = 10
"""...or one that answered this many calls since it started, with a call still in flight..."""
PAUSE_PHASED_IN_FLIGHT = 3
"""...or paused with this many phased calls in flight."""
HEDGE_AFTER_S = 0.3
"""A client whose attempt has no answer after this long sends the same call to another replica
too (a hedge), and takes the first final answer."""
TERMINATE_EVERY = 12
"""Answers between two ``pg_terminate_backend`` of a replica's session."""
MIN_TERMINATED = 8
LOST_ANSWERS = 0.25
"""The share of operations whose client asks again after its final answer."""
RECORDED_ERRORS = 0.1
"""The share of operations whose request asks for a recorded error (NOT_FOUND)."""
ATTEMPT_TIMEOUT_S = 5.0
SHORT_DEADLINES = 0.1
"""The share of attempts sent with a deadline of a few milliseconds: cancelled at the server
wherever the deadline finds them (a claim, the handler, a commit), as an impatient client's."""
RUN_TIMEOUT_S = 40.0
START_TRIES = 5
"""Starts of a replica's process before giving up (see ``Cluster._start``)."""
# Answers that say "not done yet, try again": an attempt that died with its replica or its
# session (UNAVAILABLE), a key still in progress elsewhere or a lost lease or a serialization
# race (ABORTED), an attempt that ran out of time (DEADLINE_EXCEEDED).
RETRY = RetryPolicy(
    max_attempts=1_000,
    initial_backoff_s=0.02,
    max_backoff_s=0.3,
    retryable=frozenset({Code.UNAVAILABLE, Code.ABORTED, Code.DEADLINE_EXCEEDED}),
)


@dataclass
class Operation:
    key: str
    method: str
    request: testsvc_pb2.PostRequest
    expected: grpc.StatusCode
    answers: list[Answer] = field(default_factory=list)
    """Every final answer, in order: the first, then the lost-answer retries, then the sweep."""
    late: list[Answer] = field(default_factory=list)
    """Final answers of attempts still running when the operation had its answer (a hedge's
    loser): the same answer, replayed or not (the loser may be the attempt that ran)."""
    stragglers: set[asyncio.Task[Answer]] = field(default_factory=set)
    transient: list[str] = field(default_factory=list)
    """The transient answers along the way (code and reason), for failure reports."""
    attempts: int = 0
    hedges: int = 0
    misanswered: list[str] = field(default_factory=list)
    """Transient answers that broke the wire contract's form for them."""

    def describe(self) -> str:
        got = [(a.code.name, a.replayed) for a in self.answers]
        return (
            f"{self.key} {self.method.rsplit('/', 1)[1]} {self.request.account}"
            f" expecting {self.expected.name}: {self.attempts} attempts, answers {got},"
            f" transient {collections.Counter(self.transient).most_common()}"
        )


@dataclass
class Incarnation:
    """One process of a replica, from its start to its death."""

    proc: ServiceProcess
    channel: grpc.aio.Channel
    in_flight: int = 0
    answered: int = 0
    phased_in_flight: set[str] = field(default_factory=set)
    """The keys of the phased calls in flight on it."""
    pauses: int = 0
    stalled: int = 0
    """Calls begun before its last pause ended and not answered yet."""


@dataclass
class Replica:
    name: str
    current: Incarnation | None = None
    starts: int = 0


class Cluster:
    """The replicas, the calls to them, and the crashes those calls trigger."""

    def __init__(self, dsn: str, log_dir: Path, rng: random.Random, tenant: str) -> None:
        self.dsn = dsn
        self.tenant = tenant
        self.log_dir = log_dir
        self.rng = rng
        self.replicas = [Replica(f"replica-{i}") for i in range(REPLICAS)]
        self.crashes_allowed = 0
        """Raised by one per round: a round's crash waits for its round."""
        self.crashes: list[str] = []
        """Why each crash happened (which replica, which trigger, how many in flight)."""
        self.crash_over: list[asyncio.Event] = [asyncio.Event() for _ in range(CRASHES)]
        self._crash_tasks: list[asyncio.Task[None]] = []
        self.answers = 0
        self.answered_keys: set[str] = set()
        """The operations that have their (first) final answer."""
        self.disrupted = False
        """A replica is down or paused."""
        self.answered = asyncio.Event()
        """Set on every answer (the terminator's cue)."""
        self.dead: list[ServiceProcess] = []
        self.failed_starts: list[str] = []
        """Processes that exited before they were ready (started again)."""

    async def start(self) -> None:
        started = await asyncio.gather(*(self._start(r) for r in self.replicas))
        for replica, incarnation in zip(self.replicas, started, strict=True):
            replica.current = incarnation

    async def _start(
        self, replica: Replica, port: int = 0, channel: grpc.aio.Channel | None = None
    ) -> Incarnation:
        """Starts a process of ``replica`` on ``port`` (0: a free one), and a channel to it
        unless ``channel`` (to that port) is given. A process that exits before it is ready is
        started again, as a supervisor would: the terminator may end the sessions of a store
        that is still connecting (``Store.connect`` then fails, and the process exits 1)."""
        for _ in range(START_TRIES):
            replica.starts += 1
            proc = ServiceProcess(
                ["-m", "tests.support.ledger_process", self.dsn, APP_NAME, str(port)],
                ready="ledger ready",
                log_dir=self.log_dir,
                name=f"{replica.name}-{replica.starts}",
            )
            try:
                await proc.start()
            except RuntimeError:
                if proc.returncode is None:  # not ready in time: no supervisor would wait
                    await proc.stop()
                    raise
                self.failed_starts.append(f"{replica.name}-{replica.starts}: {proc.returncode}")
                continue
            except BaseException:
                await proc.stop()
                raise
            return Incarnation(proc, channel or grpc.aio.insecure_channel(proc.address))
        raise RuntimeError(f"{replica.name} failed to start {START_TRIES} times\n{proc.logs()}")

    async def close(self) -> None:
        for task in self._crash_tasks:
            task.cancel()
        await asyncio.gather(*self._crash_tasks, return_exceptions=True)
        for replica in self.replicas:
            if replica.current is not None:
                await replica.current.channel.close(None)
                await replica.current.proc.stop()
        for proc in self.dead:
            await proc.stop()

    def settled(self) -> bool:
        """Whether every crash is over (its replica back, or let go on); raises the error of a
        crash that failed (a replica that would not start, a pause never relieved)."""
        for task in self._crash_tasks:
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                raise error
        return not self.disrupted

    async def attempt(self, op: Operation) -> Answer:
        """One attempt of ``op`` on a replica that is up (picked at random)."""
        up = [r for r in self.replicas if r.current is not None]
        while not up:  # cannot happen with one replica down at a time; kept honest
            await until("a replica up", lambda: [r for r in self.replicas if r.current])
            up = [r for r in self.replicas if r.current is not None]
        replica = self.rng.choice(up)
        incarnation = replica.current
        assert incarnation is not None
        timeout = (
            self.rng.uniform(0.002, 0.03)
            if self.rng.random() < SHORT_DEADLINES
            else ATTEMPT_TIMEOUT_S
        )
        incarnation.in_flight += 1
        pauses = incarnation.pauses
        op.attempts += 1
        if op.method == POST_PHASED:
            incarnation.phased_in_flight.add(op.key)
        try:
            return await call_raw(
                incarnation.channel,
                op.method,
                op.request,
                metadata(op.key, self.tenant),
                timeout,
            )
        finally:
            incarnation.in_flight -= 1
            if pauses < incarnation.pauses:
                incarnation.stalled -= 1
            incarnation.phased_in_flight.discard(op.key)
            incarnation.answered += 1
            self.answers += 1
            self.answered.set()
            self._maybe_crash(replica)

    def _maybe_crash(self, replica: Replica) -> None:
        """Disrupts ``replica`` (which just answered a call) if the next crash's trigger holds.
        Crashes 0, 3, 6, ... kill it once it has ``CRASH_IN_FLIGHT`` calls in flight (and start
        it on a new port); 1, 4, ... once it answered ``CRASH_ANSWERED`` calls (since it
        started) with a call still in flight (and start it on the same port); 2, 5, ... pause
        it (SIGSTOP, a stalled owner) once it has ``PAUSE_PHASED_IN_FLIGHT`` phased calls in
        flight, until another replica answered one of them (its lease ran out, taken over),
        then let it go on (SIGCONT)."""
        incarnation = replica.current
        number = len(self.crashes)
        if incarnation is None or number >= self.crashes_allowed or self.disrupted:
            return  # one disruption at a time: the other replicas serve
        kind = number % 3
        if kind == 0 and incarnation.in_flight >= CRASH_IN_FLIGHT:
            why = f"killed, {incarnation.in_flight} calls in flight"
        elif kind == 1 and incarnation.answered >= CRASH_ANSWERED and incarnation.in_flight:
            why = f"killed, {incarnation.answered} answers, {incarnation.in_flight} in flight"
        elif kind == 2 and len(incarnation.phased_in_flight) >= PAUSE_PHASED_IN_FLIGHT:
            why = f"paused, {len(incarnation.phased_in_flight)} phased calls in flight"
        else:
            return
        self.crashes.append(f"{replica.name} (pid {incarnation.proc.pid}): {why}")
        self.disrupted = True
        # Now, while the trigger holds: the task below runs once this one yields, when the
        # calls seen in flight may be over.
        if kind == 2:
            incarnation.proc.pause()
            caught = set(incarnation.phased_in_flight)
            crash = self._pause(replica, incarnation, number, caught)
        elif kind == 1:
            incarnation.proc.kill()
            crash = self._crash_and_return(replica, incarnation, number)
        else:
            incarnation.proc.kill()
            replica.current = None  # no new call goes to it from now on
            crash = self._crash(replica, incarnation, number)
        self._crash_tasks.append(asyncio.create_task(crash))

    async def _crash(self, replica: Replica, incarnation: Incarnation, number: int) -> None:
        """The replica killed, starts it again on a new port, with a new channel."""
        code = await incarnation.proc.wait()
        assert code == SIGKILLED, f"{replica.name} exited {code}\n{incarnation.proc.logs()}"
        self.dead.append(incarnation.proc)
        # Its calls fail at once (the connection is reset): closed after them, no call is
        # cancelled by the test's own hand.
        await until(f"{replica.name}'s calls to fail", lambda: incarnation.in_flight == 0)
        await incarnation.channel.close(None)
        replica.current = await self._start(replica)
        self.disrupted = False
        self.crash_over[number].set()

    async def _crash_and_return(
        self, replica: Replica, incarnation: Incarnation, number: int
    ) -> None:
        """The replica killed, starts it again on the same port; the clients keep their
        channel to it and keep calling it meanwhile (refused: UNAVAILABLE), as clients of a
        fixed address do."""
        code = await incarnation.proc.wait()
        assert code == SIGKILLED, f"{replica.name} exited {code}\n{incarnation.proc.logs()}"
        self.dead.append(incarnation.proc)
        assert incarnation.proc.port is not None
        replica.current = await self._start(replica, incarnation.proc.port, incarnation.channel)
        self.disrupted = False
        self.crash_over[number].set()

    async def _pause(
        self, replica: Replica, incarnation: Incarnation, number: int, caught: set[str]
    ) -> None:
        """The replica stalled (SIGSTOP: it holds its connections, claims and transactions)
        with the phased calls ``caught`` in flight, waits until one of them was answered by
        another replica (the clients hedge), then lets it go on (SIGCONT): its stale attempts
        find their leases taken over."""
        try:
            await until(
                f"a phased call stalled on {replica.name} answered elsewhere",
                lambda: caught & self.answered_keys,
                timeout=15,
            )
        finally:
            incarnation.pauses += 1
            incarnation.stalled = incarnation.in_flight
            incarnation.proc.resume()
        # Over once the calls it stalled are answered: the stale owners among them have tried
        # to commit (and found their leases taken over), not been killed by the next crash.
        await until(f"{replica.name}'s stalled calls", lambda: incarnation.stalled == 0)
        self.disrupted = False
        self.crash_over[number].set()


async def terminator(
    cluster: Cluster, pg_dsn: str, rng: random.Random, done: asyncio.Event
) -> list[str]:
    """Every ``TERMINATE_EVERY`` answers, ends one of the replicas' database sessions: a busy one
    (in a statement or a transaction) when there is one. Returns what it ended."""
    ended: list[str] = []
    conn = await asyncpg.connect(pg_dsn, server_settings={"application_name": "chaos-terminator"})
    try:
        next_at = TERMINATE_EVERY
        while not done.is_set():
            cluster.answered.clear()
            if cluster.answers < next_at:
                waiting = asyncio.ensure_future(cluster.answered.wait())
                finished = asyncio.ensure_future(done.wait())
                await asyncio.wait({waiting, finished}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                finished.cancel()
                continue
            next_at = cluster.answers + TERMINATE_EVERY
            sessions = await conn.fetch(
                "SELECT pid, state FROM pg_stat_activity WHERE application_name = $1 ORDER BY pid",
                APP_NAME,
            )
            busy = [s for s in sessions if s["state"] in ("active", "idle in transaction")]
            pool = busy or list(sessions)
            if not pool:
                continue
            victim = rng.choice(pool)
            if await conn.fetchval("SELECT pg_terminate_backend($1)", victim["pid"]):
                ended.append(f"{victim['pid']} ({victim['state']})")
    finally:
        await conn.close()
    return ended


def new_operation(rng: random.Random, tenant: str, index: int) -> Operation:
    method = POST if rng.random() < 0.5 else POST_PHASED
    recorded_error = rng.random() < RECORDED_ERRORS
    # A short sleep before the write for most: handlers in flight for the crashes to catch.
    behaviour = "NOT_FOUND" if recorded_error else rng.choice(["", "sleep:5", "sleep:20"])
    request = testsvc_pb2.PostRequest(
        account=f"{tenant}/{index}",
        amount=rng.randrange(1, 1_000_000),
        behaviour=behaviour,
    )
    expected = grpc.StatusCode.NOT_FOUND if recorded_error else grpc.StatusCode.OK
    return Operation(f"chaos-{uuid.UUID(int=rng.getrandbits(128))}", method, request, expected)


async def until_final(cluster: Cluster, op: Operation, rng: random.Random) -> Answer:
    """Attempts ``op`` until an answer that is not transient, waiting between attempts as the
    server asks (its pushback) or with the retry policy's jittered backoff; an attempt with no
    answer after ``HEDGE_AFTER_S`` gets a hedge (one at a time). Attempts still running at the
    end are left to finish in ``op.stragglers``."""
    attempt = 0
    running: set[asyncio.Task[Answer]] = set()
    while True:
        if not running:
            attempt += 1
            running.add(asyncio.create_task(cluster.attempt(op)))
        done, running = await asyncio.wait(
            running, timeout=HEDGE_AFTER_S, return_when=asyncio.FIRST_COMPLETED
        )
        if not done:
            if len(running) < 2:
                op.hedges += 1
                running.add(asyncio.create_task(cluster.attempt(op)))
            continue
        delay = 0.0
        final = []
        for task in done:
            answer = task.result()
            wait = RETRY.delay_s(
                attempt=attempt,
                code=Code(answer.code.value[0]),
                retry_after_ms=retry_after_ms(list(answer.trailing.items())),
                jitter=rng.random(),
            )
            if wait is None:
                final.append(answer)
            else:
                op.transient.append(f"{answer.code.name}/{answer.reason()}")
                op.misanswered += in_progress_misanswered(answer)
                delay = max(delay, wait)
        if final:
            op.late += final[1:]
            op.stragglers |= running
            return final[0]
        if not running:
            await asyncio.sleep(delay)


def in_progress_misanswered(answer: Answer) -> list[str]:
    """What an ``IDEMPOTENCY_KEY_IN_PROGRESS`` answer lacks of the wire contract's: ABORTED with
    a ``RetryInfo`` and the same delay in ``grpc-retry-pushback-ms``, no initial metadata sent
    first (so that gRPC's own retries still apply)."""
    if answer.reason() != "IDEMPOTENCY_KEY_IN_PROGRESS":
        return []
    pushback = answer.trailing.get("grpc-retry-pushback-ms")
    delay = answer.retry_delay_ms()
    if (
        answer.code is grpc.StatusCode.ABORTED
        and delay is not None
        and pushback == str(delay)
        and not answer.initial
    ):
        return []
    return [f"{answer.code.name} delay {delay} pushback {pushback!r} initial {answer.initial}"]


def identity(answer: Answer) -> tuple[object, ...]:
    """What a replay must repeat exactly."""
    return (
        answer.code,
        answer.body,
        answer.details,
        answer.trailing.get("grpc-status-details-bin"),
    )


async def test_every_operation_commits_exactly_once_through_crashes_and_terminated_sessions(
    store: Store, pg_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    seed = int(os.environ.get("GRPC_IDEMPOTENCY_CHAOS_SEED", random.randrange(2**32)))
    print(f"chaos seed: {seed} (GRPC_IDEMPOTENCY_CHAOS_SEED={seed} to replay its choices)")
    try:
        await _chaos(seed, pg_dsn, db, tmp_path)
    except BaseException as exc:
        exc.add_note(f"chaos seed: {seed} (rerun with GRPC_IDEMPOTENCY_CHAOS_SEED={seed})")
        exc.add_note(f"the replicas' output: {tmp_path}")
        raise


async def _chaos(seed: int, pg_dsn: str, db: asyncpg.Connection, tmp_path: Path) -> None:
    rng = random.Random(seed)
    tenant = f"chaos{seed}-{uuid.uuid4().hex[:8]}"
    scope = f"tenant:{tenant}"
    ops = [new_operation(rng, tenant, i) for i in range(OPERATIONS)]
    cluster = Cluster(pg_dsn, tmp_path, rng, tenant)
    done = asyncio.Event()
    started = time.monotonic()
    try:
        await cluster.start()
        ending = asyncio.ensure_future(terminator(cluster, pg_dsn, random.Random(seed + 1), done))
        slots = asyncio.Semaphore(CONCURRENCY)

        def budget() -> float:
            """What is left of ``RUN_TIMEOUT_S`` for the operations."""
            return max(0.1, RUN_TIMEOUT_S - (time.monotonic() - started))

        async def operate(op: Operation) -> None:
            async with slots:
                op.answers.append(await until_final(cluster, op, rng))
                cluster.answered_keys.add(op.key)
                if rng.random() < LOST_ANSWERS:  # the answer never reached the application
                    op.answers.append(await until_final(cluster, op, rng))

        tasks: list[asyncio.Task[None]] = []
        for round_start in range(0, OPERATIONS, ROUND):
            launched = [asyncio.create_task(operate(op)) for op in ops[round_start:][:ROUND]]
            tasks += launched
            number = len(cluster.crashes)  # the crash this round may bring
            if number >= CRASHES:
                continue
            cluster.crashes_allowed = number + 1
            # The next round once this round's crash is over (the replica back: a crash begun
            # is waited for), or once every operation of the round has its answer without one
            # (the crash then comes in the next round).
            crash_over = asyncio.ensure_future(cluster.crash_over[number].wait())
            round_over = asyncio.ensure_future(asyncio.wait(launched))
            await asyncio.wait(
                {crash_over, round_over},
                timeout=budget(),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if len(cluster.crashes) > number:
                await asyncio.wait({crash_over}, timeout=budget())
            crash_over.cancel()
            round_over.cancel()
        _, pending = await asyncio.wait(tasks, timeout=budget())
        cluster.settled()  # a crash that failed says why first
        unfinished = [op.describe() for op in ops if len(op.answers) == 0]
        assert not pending, (
            f"{len(pending)} operations without a final answer after {RUN_TIMEOUT_S}s"
            f" (crashes: {cluster.crashes}):\n" + "\n".join(unfinished[:20])
        )
        for task in tasks:
            task.result()  # an error of the test itself
        cluster.crashes_allowed = 0
        # Every crash over (a replica back up, or let go on) before the sweep, which asks every
        # replica; the hedges' losers over (a stalled owner's, say).
        await until("the last crash to be over", cluster.settled, 15)
        stragglers = [s for op in ops for s in op.stragglers]
        if stragglers:
            _, running = await asyncio.wait(stragglers, timeout=2 * ATTEMPT_TIMEOUT_S)
            assert not running, f"{len(running)} hedged attempts still running"
        for op in ops:
            for straggler in op.stragglers:
                answer = straggler.result()
                if Code(answer.code.value[0]) not in RETRY.retryable:
                    op.late.append(answer)
                else:
                    op.transient.append(f"late {answer.code.name}/{answer.reason()}")
                    op.misanswered += in_progress_misanswered(answer)
        done.set()
        terminated = await ending
        chaos_s = time.monotonic() - started

        # A client that asks again, much later, on every replica: the same answer, replayed.
        sweep = asyncio.Semaphore(64)

        for replica in cluster.replicas:  # a channel to a replica that came back may be
            assert replica.current is not None  # waiting to connect again (its backoff)
            await asyncio.wait_for(replica.current.channel.channel_ready(), 10)

        async def ask_everywhere(op: Operation) -> None:
            for replica in cluster.replicas:
                incarnation = replica.current
                assert incarnation is not None
                async with sweep:
                    op.answers.append(
                        await call_raw(
                            incarnation.channel,
                            op.method,
                            op.request,
                            metadata(op.key, tenant),
                            ATTEMPT_TIMEOUT_S,
                        )
                    )

        await asyncio.gather(*(ask_everywhere(op) for op in ops))
    finally:
        done.set()
        await cluster.close()

    print(
        f"chaos: {OPERATIONS} operations, {sum(op.attempts for op in ops)} attempts in"
        f" {chaos_s:.1f}s; crashes: {cluster.crashes}; {len(terminated)} sessions terminated;"
        f" failed starts: {cluster.failed_starts};"
        f" {sum(op.hedges for op in ops)} hedges, their losers' final answers:"
        f" {collections.Counter((a.code.name, a.replayed) for op in ops for a in op.late)};"
        f" transient answers: {collections.Counter(t for op in ops for t in op.transient)}"
    )
    # The chaos happened as planned (else the invariants below prove little).
    assert len(cluster.crashes) == CRASHES, cluster.crashes
    assert len(terminated) >= MIN_TERMINATED, terminated
    assert sum(len(op.transient) for op in ops) > 0

    misanswered = [f"{op.key}: {m}" for op in ops for m in op.misanswered]
    assert not misanswered, misanswered
    wrong = [op.describe() for op in ops if op.answers[0].code is not op.expected]
    assert not wrong, "operations answered otherwise than their request asks:\n" + "\n".join(
        wrong[:20]
    )
    for op in ops:
        first = op.answers[0]
        for later in op.answers[1:]:
            assert identity(later) == identity(first), f"{op.describe()}: {later} != {first}"
            assert later.replayed, f"{op.describe()}: a later answer was not a replay: {later}"
        for late in op.late:  # a hedge's loser: the same answer (replayed, or the one that ran)
            assert identity(late) == identity(first), f"{op.describe()}: {late} != {first}"

    # The database: one ledger row per OK operation, the one its answer names; none otherwise.
    rows = await db.fetch(
        "SELECT account, count(*) AS n, min(id) AS id FROM test_ledger.ledger"
        " WHERE tenant = $1 GROUP BY account",
        scope,
    )
    ledger = {r["account"]: (r["n"], r["id"]) for r in rows}
    for op in ops:
        account = op.request.account
        if op.expected is grpc.StatusCode.OK:
            response = testsvc_pb2.PostResponse.FromString(op.answers[0].body or b"")
            assert (response.account, response.amount) == (account, op.request.amount)
            assert ledger.get(account) == (1, response.entry_id), op.describe()
        else:
            assert account not in ledger, f"{op.describe()}: rolled back, yet {ledger[account]}"
    assert set(ledger) <= {op.request.account for op in ops}

    records = await db.fetch(
        "SELECT key, state, status_code FROM grpc_idempotency.records WHERE scope = $1", scope
    )
    states = {r["key"]: (r["state"], r["status_code"]) for r in records}
    in_progress = sorted(key for key, (state, _) in states.items() if state != "completed")
    assert not in_progress, f"records left in progress after every answer: {in_progress}"
    assert states == {op.key: ("completed", op.expected.value[0]) for op in ops}

    # Handler executions that committed: a ledger row each (OK), or a recorded error outcome.
    committed = sum(n for n, _ in ledger.values()) + sum(
        1 for _, code in states.values() if code != grpc.StatusCode.OK.value[0]
    )
    assert committed == OPERATIONS, (committed, OPERATIONS)
