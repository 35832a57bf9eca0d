"""The life of an idempotency key, as data and pure functions. No I/O happens here.

Theory of operation
-------------------
A record lives under (scope, key) and is either IN_PROGRESS (an attempt owns it) or COMPLETED
(its outcome is stored). Every attempt first *looks* at the record and ``decide`` says what to do:

    no record, or record past retention          -> CLAIM        (treated as new)
    fingerprint differs (another method/payload) -> MISMATCH     FAILED_PRECONDITION, no effect
    COMPLETED                                    -> REPLAY       the stored bytes, no handler
    IN_PROGRESS, lease alive                     -> WAIT         then look again
    IN_PROGRESS, lease expired                   -> CLAIM        taken over (a crashed owner)

Past retention: a completed record past its retention, or an in-progress one past its
retention and its lease (an owner still renewing its lease keeps the key). The same request
takes such an in-progress record over, continuing its operation; another request begins a new
one under the key.

A CLAIM is one atomic statement in the store: it may still lose a race to another attempt, in
which case the driver WAITs and looks again. Because the claim is authoritative, the look may
also come *after* a failed claim: ``look_first`` picks the order (a key this process has not
seen is almost always new, so claiming first saves the look-up's round trip; a key it has seen
is likely a retry, and a look-up answers a replay in one round trip). While waiting no database
connection is held. A wait is bounded by the method's ``max_wait`` and the call's deadline; when
it runs out the answer is ABORTED with a retry hint (``KeyInProgress``).

When the owner's handler ends, ``finish`` classifies its status:

    OK                                   -> RECORD        commit the writes and the response
    a recorded error (deterministic)     -> RECORD_ERROR  roll back the writes, commit the status
    anything else, or an exception       -> RELEASE       roll back everything; a retry runs again
    either of the first two, with a keyed downstream call still in flight
                                         -> UNSETTLED     roll back everything; the call fails

and, before the status, what the handler left behind it, each failing the call with nothing
recorded (the first that applies wins): the lease lost (LEASE_LOST, whatever the status); then,
for OK only, an enqueue not run to its end (ENQUEUE_UNAWAITED) and a downstream call refused as a
misuse (DOWNSTREAM_REFUSED). An error answer commits none of the handler's writes, so it stands
against those two; not against the lost lease, which says whose the operation is now (``finish``).

A store failure at that end is answered as ``final_store_failure`` says: DEADLINE_EXCEEDED when
the call's deadline ran out before its final transaction opened (as during the claim), else
UNAVAILABLE.

The server interceptor walks a call through these decisions with ``transition`` (the table
below ``Finish``'s neighbours: phase and event in, next step and phase out), so the look-up
order, the wait's expiry, fail-open and takeovers are decided here, as data, and tested without
a database. The driver (the server interceptor) carries out the steps and re-implements none of
the rules. (Idempotent consumers follow rules of their own: ``core.consumer``.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.policy import LEASE_RENEWAL_FLOOR_S


class State(enum.Enum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a completed attempt answered: replayed byte for byte."""

    code: Code
    message: str = ""
    details: bytes | None = None
    """The serialized ``google.rpc.Status`` the handler sent (``grpc-status-details-bin``)."""
    response: bytes | None = None
    """The serialized response message, for ``Code.OK``."""


def outcome_bytes(outcome: Outcome) -> int:
    """What recording ``outcome`` stores, as ``max_response_bytes`` bounds it: the response,
    and the status message and details (a recorded error's, once cut to fit:
    ``wire.fitted_error``)."""
    return (
        len(outcome.response or b"")
        + len(outcome.details or b"")
        + len(outcome.message.encode("utf-8", "surrogatepass"))
    )


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """A record as a look-up saw it. Time comparisons were made by the database's clock."""

    fingerprint: bytes
    state: State
    outcome: Outcome | None
    expired: bool
    """Past retention: completed and past ``GREATEST(expires_at, completed_at + retention)``,
    or in progress and past both ``expires_at`` and the lease."""
    lease_expired: bool
    lease_remaining_ms: int
    started_at: datetime | None = None
    """When the operation first claimed the key (kept across takeovers)."""
    replayable_ms: int | None = None
    """For a completed record: how much longer (ms, by the database's clock, from some instant
    after the look-up was sent) its outcome stays replayable."""


class Action(enum.Enum):
    CLAIM = "claim"
    REPLAY = "replay"
    MISMATCH = "mismatch"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    takeover: bool = False
    """The claim replaces an in-progress record whose owner's lease expired."""
    outcome: Outcome | None = None
    retry_after_ms: int = 0


def decide(record: StoredRecord | None, fingerprint: bytes) -> Decision:
    if record is None:
        return Decision(Action.CLAIM)
    if record.expired:
        # Past retention the key is new. An in-progress record there (its lease over too) is
        # still taken over, not replaced, by the same request: it continues that operation.
        same = record.state is State.IN_PROGRESS and record.fingerprint == fingerprint
        return Decision(Action.CLAIM, takeover=same)
    if record.fingerprint != fingerprint:
        return Decision(Action.MISMATCH)
    if record.state is State.COMPLETED:
        assert record.outcome is not None, "a completed record always has an outcome"
        return Decision(Action.REPLAY, outcome=record.outcome)
    if record.lease_expired:
        return Decision(Action.CLAIM, takeover=True)
    return Decision(Action.WAIT, retry_after_ms=retry_after_ms(record.lease_remaining_ms))


def look_first(*, recently_seen: bool, atomic: bool) -> bool:
    """Whether to look the key up before trying to claim it. Correct either way; only the
    number of round trips differs. Phased claims always look first: their handlers call other
    services, so a round trip is noise there, and the look-up tells a takeover apart."""
    return recently_seen or not atomic


# -- the call's path to an answer, as a transition table -----------------------------------
#
# The driver (the server interceptor) reports what happened as an ``Event``; the table says the
# next ``Step`` and the ``Phase`` the call is in then. A pair missing from the table is a bug in
# the driver, and ``transition`` says so (``IllegalTransition``) instead of guessing.
#
#   FRESH          UNSEEN_KEY      -> CLAIM    CLAIMING_BLIND   (claim-first: saves the look-up)
#                  SEEN_KEY        -> LOOK_UP  LOOKING          (a likely retry: replay in 1 trip)
#   CLAIMING_BLIND CLAIM_WON       -> EXECUTE  EXECUTING
#                  CLAIM_LOST      -> LOOK_UP  LOOKING          (recorded or busy: look why)
#   LOOKING        NOTHING_LIVE    -> CLAIM    CLAIMING         (no record, or past retention)
#                  ABANDONED       -> CLAIM    TAKING_OVER      (in progress, lease expired)
#                  COMPLETED       -> REPLAY   DONE
#                  OTHER_REQUEST   -> REFUSE   DONE             (FAILED_PRECONDITION, KEY_REUSED)
#                  RUNNING         -> WAIT     WAITING
#   CLAIMING,      CLAIM_WON       -> EXECUTE  EXECUTING        (TAKEN_OVER from TAKING_OVER)
#   TAKING_OVER    CLAIM_LOST      -> WAIT     WAITING          (another attempt won the race)
#   WAITING        BUDGET_LEFT     -> SLEEP    FRESH            (poll again, no connection held)
#                  BUDGET_SPENT    -> ANSWER_IN_PROGRESS DONE   (ABORTED with a retry hint)
#   any phase that talks to the store:
#                  STORE_DOWN_OPEN   -> RUN_WITHOUT_STORE DONE  (fail open, counted)
#                  STORE_DOWN_CLOSED -> ANSWER_UNAVAILABLE DONE (fail closed)
#                  DEADLINE_SPENT    -> ANSWER_DEADLINE_EXCEEDED DONE (the store's wait ended
#                                       with the call's deadline: no outage, nothing kept)


class Phase(enum.Enum):
    # Members are singletons compared by identity: hash them as objects, in C, rather than by
    # Enum's Python-level __hash__ (the table is looked up on every call's hot path).
    __hash__ = object.__hash__

    FRESH = "fresh"
    CLAIMING_BLIND = "claiming_blind"
    LOOKING = "looking"
    CLAIMING = "claiming"
    TAKING_OVER = "taking_over"
    WAITING = "waiting"
    EXECUTING = "executing"
    DONE = "done"


class Event(enum.Enum):
    __hash__ = object.__hash__

    UNSEEN_KEY = "unseen_key"
    SEEN_KEY = "seen_key"
    CLAIM_WON = "claim_won"
    CLAIM_LOST = "claim_lost"
    NOTHING_LIVE = "nothing_live"
    ABANDONED = "abandoned"
    COMPLETED = "completed"
    OTHER_REQUEST = "other_request"
    RUNNING = "running"
    BUDGET_LEFT = "budget_left"
    BUDGET_SPENT = "budget_spent"
    STORE_DOWN_OPEN = "store_down_open"
    STORE_DOWN_CLOSED = "store_down_closed"
    DEADLINE_SPENT = "deadline_spent"


class Step(enum.Enum):
    CLAIM = "claim"
    LOOK_UP = "look_up"
    EXECUTE = "execute"
    REPLAY = "replay"
    REFUSE = "refuse"
    WAIT = "wait"
    SLEEP = "sleep"
    ANSWER_IN_PROGRESS = "answer_in_progress"
    RUN_WITHOUT_STORE = "run_without_store"
    ANSWER_UNAVAILABLE = "answer_unavailable"
    ANSWER_DEADLINE_EXCEEDED = "answer_deadline_exceeded"


class IllegalTransition(Exception):
    """The driver reported an event that cannot happen in the call's phase."""


_STORE_DOWN: dict[Event, tuple[Step, Phase]] = {
    Event.STORE_DOWN_OPEN: (Step.RUN_WITHOUT_STORE, Phase.DONE),
    Event.STORE_DOWN_CLOSED: (Step.ANSWER_UNAVAILABLE, Phase.DONE),
    Event.DEADLINE_SPENT: (Step.ANSWER_DEADLINE_EXCEEDED, Phase.DONE),
}

TRANSITIONS: dict[Phase, dict[Event, tuple[Step, Phase]]] = {
    Phase.FRESH: {
        Event.UNSEEN_KEY: (Step.CLAIM, Phase.CLAIMING_BLIND),
        Event.SEEN_KEY: (Step.LOOK_UP, Phase.LOOKING),
    },
    Phase.CLAIMING_BLIND: {
        Event.CLAIM_WON: (Step.EXECUTE, Phase.EXECUTING),
        Event.CLAIM_LOST: (Step.LOOK_UP, Phase.LOOKING),
        **_STORE_DOWN,
    },
    Phase.LOOKING: {
        Event.NOTHING_LIVE: (Step.CLAIM, Phase.CLAIMING),
        Event.ABANDONED: (Step.CLAIM, Phase.TAKING_OVER),
        Event.COMPLETED: (Step.REPLAY, Phase.DONE),
        Event.OTHER_REQUEST: (Step.REFUSE, Phase.DONE),
        Event.RUNNING: (Step.WAIT, Phase.WAITING),
        **_STORE_DOWN,
    },
    Phase.CLAIMING: {
        Event.CLAIM_WON: (Step.EXECUTE, Phase.EXECUTING),
        Event.CLAIM_LOST: (Step.WAIT, Phase.WAITING),
        **_STORE_DOWN,
    },
    Phase.TAKING_OVER: {
        Event.CLAIM_WON: (Step.EXECUTE, Phase.EXECUTING),
        Event.CLAIM_LOST: (Step.WAIT, Phase.WAITING),
        **_STORE_DOWN,
    },
    Phase.WAITING: {
        Event.BUDGET_LEFT: (Step.SLEEP, Phase.FRESH),
        Event.BUDGET_SPENT: (Step.ANSWER_IN_PROGRESS, Phase.DONE),
    },
}


def transition(phase: Phase, event: Event) -> tuple[Step, Phase]:
    """The next step and phase of a call in ``phase`` after ``event``."""
    try:
        return TRANSITIONS[phase][event]
    except KeyError:
        raise IllegalTransition(f"{event.name} cannot happen in phase {phase.name}") from None


def begin_event(*, recently_seen: bool, atomic: bool) -> Event:
    return (
        Event.SEEN_KEY
        if look_first(recently_seen=recently_seen, atomic=atomic)
        else (Event.UNSEEN_KEY)
    )


def look_event(record: StoredRecord | None, fingerprint: bytes) -> Event:
    """What a look-up found, as an event (``decide`` holds the rules)."""
    decision = decide(record, fingerprint)
    action = decision.action
    if action is Action.CLAIM:
        return Event.ABANDONED if decision.takeover else Event.NOTHING_LIVE
    if action is Action.REPLAY:
        return Event.COMPLETED
    if action is Action.MISMATCH:
        return Event.OTHER_REQUEST
    return Event.RUNNING


def store_down_event(*, fail_open: bool, deadline_spent: bool = False) -> Event:
    """What a store failure is. ``deadline_spent``: the call's deadline was all but over when
    it failed. The store bounds its statements and its wait for a connection by the call's
    time left, so such a failure is that bound running out (a claim queued on a records table a
    migration locked, a pool too busy), as gRPC's own cancellation at the deadline ends other
    calls: the client gets DEADLINE_EXCEEDED either way, and it is no outage (nor grounds to
    fail open, which the driver never does with the deadline spent)."""
    if deadline_spent:
        return Event.DEADLINE_SPENT
    return Event.STORE_DOWN_OPEN if fail_open else Event.STORE_DOWN_CLOSED


def budget_event(*, now: float, wait_until: float) -> Event:
    return Event.BUDGET_SPENT if now >= wait_until else Event.BUDGET_LEFT


def given_up_outcome(*, waited: bool) -> CallOutcome:
    """How a keyed call that ended before any outcome, with nothing of its own kept (its
    client left, or its deadline ran out while the store served it), is counted: "conflict"
    if it had waited on the key busy with another attempt (as when that wait runs out),
    "released" otherwise (its look-up or claim rolled back: the key free)."""
    return CallOutcome.CONFLICT if waited else CallOutcome.RELEASED


def final_store_failure(*, opened: bool, deadline_spent: bool) -> Step:
    """What answers a store failure at the end of a call that ran its handler (its claim then
    released: ``Finish.RELEASE``). ``opened``: the call's transaction was open when the store
    failed (atomic: always; phased: once the final transaction's opening succeeded).

    Not yet opened, with the deadline spent: the deadline's (``store_down_event``),
    ANSWER_DEADLINE_EXCEEDED, counted "released", as gRPC's cancellation of the call there is.
    The store bounds the final transaction's opening by the call's time left, as it does the
    claim: queued on a lock (a claim lock or a records row another session holds), it ran out
    with the deadline, and nothing of the attempt's but its claim is in the database.
    ANSWER_UNAVAILABLE otherwise: a store bound that ran out with time left, an outage, and a
    failure of the outcome's COMMIT whatever the time left. The store bounds a COMMIT by itself
    alone (not by the deadline, which ends it by cancelling the call: ``cut_short_outcome``), and
    its fate may be unknown: it is never counted "released"."""
    if deadline_spent and not opened:
        return Step.ANSWER_DEADLINE_EXCEEDED
    return Step.ANSWER_UNAVAILABLE


def cut_short_outcome(executed: CallOutcome, *, commit_sent: bool) -> CallOutcome:
    """How a call that ran its handler and was cancelled before its answer (its client left,
    its deadline ran out) is counted: "released", its writes rolled back and its claim released;
    but as the attempt it is (``executed``: "executed" or "taken_over") once the COMMIT of its
    outcome was sent. PostgreSQL goes on with a statement whose client left (one waiting on a
    lock waits on: it reads nothing from its client until it answers), and the outcome commits,
    which a retry replays: counted "released" (nothing recorded, the key free), it was not what
    the database held. Its fate is PostgreSQL's still: on a rollback the retry runs again."""
    return executed if commit_sent else CallOutcome.RELEASED


def claim_visible(*, phased: bool, claiming: Phase) -> bool:
    """Whether the claim a call just won (from ``claiming``, the claiming phase) may be seen by
    other attempts, whose requests it refuses (``decide``: MISMATCH): a local duplicate of
    another request must then be checked against the record too, as on any other replica, not
    kept waiting on the owner until its wait runs out (ABORTED, a retry hint for a request
    that can never run). A phased claim is committed. An atomic one that took a claim left in
    progress over (TAKING_OVER) leaves that row visible, with this request's fingerprint,
    until it commits; one made without a look (CLAIMING_BLIND) may have done so unseen. Only an
    atomic claim after a look that found nothing live (CLAIMING) is invisible. A hint: the
    driver asks the record before refusing."""
    return phased or claiming is not Phase.CLAIMING


def executed_outcome(phase: Phase) -> CallOutcome:
    """How a call that ran its handler from ``phase`` (the claiming phase) is counted."""
    return CallOutcome.TAKEN_OVER if phase is Phase.TAKING_OVER else CallOutcome.EXECUTED


class Finish(enum.Enum):
    RECORD = "record"
    RECORD_ERROR = "record_error"
    RELEASE = "release"
    UNSETTLED = "unsettled"
    """An outcome to record, but a downstream call the handler started is still in flight:
    release the key and fail the call (``TransactionOpen``), nothing recorded."""
    LEASE_LOST = "lease_lost"
    """Phased: the claim's lease was lost (another attempt may own the key): nothing recorded,
    only this call's own transaction rolled back, and the call fails (``LeaseLost``)."""
    ENQUEUE_UNAWAITED = "enqueue_unawaited"
    """OK, but an ``enqueue`` was never run to its end: committed, the outcome would say done
    without the message. Release the key and fail the call (``HandlerDatabaseError``)."""
    DOWNSTREAM_REFUSED = "downstream_refused"
    """OK, but the client interceptor refused a downstream call as a misuse (maybe inside a
    call object never awaited): release the key and fail the call with that refusal."""


def finish(
    code: Code,
    recorded_errors: frozenset[Code],
    *,
    lease_lost: bool = False,
    enqueue_unawaited: bool = False,
    downstream_refused: bool = False,
    downstream_in_flight: bool = False,
) -> Finish:
    """What to do with the status ``code`` the handler ended with, given what it left behind;
    the first that applies wins (the module's table):

    - ``lease_lost``: whatever the status, this attempt can record nothing (``LEASE_LOST``),
      and its error answer does not stand either, recorded or not. The operation is another
      attempt's now: a retry under the key gets that attempt's outcome (waits on it, replays
      it; another request's, is refused KEY_REUSED), which may well be OK. A recorded error
      answered unrecorded contradicts that replay. Any other error speaks of this attempt only:
      a client may take it as final (PERMISSION_DENIED, INTERNAL) while the operation goes on
      to succeed, or as "released, a retry runs the handler again" (UNAVAILABLE), which it
      does not; and it may be an echo of the takeover (a downstream call under the same child
      key, busy with the new owner). LEASE_LOST says what holds: nothing of this attempt's was
      kept, and another attempt has the operation, whose outcome a retry with the key learns;
    - ``enqueue_unawaited`` (an ``enqueue`` coroutine not run to its end), then
      ``downstream_refused`` (a downstream call the client interceptor refused as a misuse):
      an OK answer would commit without that message or that call's effect. An error answer
      commits none of the handler's writes (recorded or not), so it stands;
    - ``downstream_in_flight``: a keyed call it made through the client interceptor (a step's
      child key, or a key it gave) is not over (started in a task it never awaited,
      ``asyncio.ensure_future(stub.Charge(...))``). Such a call's effect is undecided:
      recorded now, the outcome (OK, or a recorded error) would be replayed to every retry
      whether that call then succeeds or fails, and a failed charge was never made again. So
      it is not recorded (``UNSETTLED``), as the final transaction does not open across such a
      call (``IdempotentCall.transaction``): the key is released, and the retry re-sends the
      same keys, so a call that did commit downstream is replayed there, not repeated. An
      unkeyed call in flight does not count: the retry would repeat it whatever this answer,
      so failing it makes nothing safer (metrics, a cache warm-up left running would fail
      every answer). A status that releases the key anyway keeps its own answer (a retry runs
      again just the same)."""
    if lease_lost:
        return Finish.LEASE_LOST
    if code is Code.OK:
        if enqueue_unawaited:
            return Finish.ENQUEUE_UNAWAITED
        if downstream_refused:
            return Finish.DOWNSTREAM_REFUSED
        return Finish.UNSETTLED if downstream_in_flight else Finish.RECORD
    if code in recorded_errors:
        return Finish.UNSETTLED if downstream_in_flight else Finish.RECORD_ERROR
    return Finish.RELEASE


def downstream_decides(code: Code, recorded_errors: frozenset[Code]) -> bool:
    """Whether a downstream call the handler left behind (refused, or keyed and in flight) can
    change what ``finish`` does with ``code``: only for an outcome it would record (OK, a
    recorded error). Any other status releases the key whatever was left, so the driver need
    not wait a loop turn for a call object made last to start."""
    return code is Code.OK or code in recorded_errors


class CallOutcome(enum.Enum):
    """How a keyed call ended: the span attribute and the metric label."""

    EXECUTED = "executed"
    REPLAYED = "replayed"
    WAITED = "waited"  # waited for another attempt, then replayed its outcome
    CONFLICT = "conflict"  # still in progress when the wait ran out (ABORTED) or the caller left
    MISMATCH = "mismatch"
    TAKEN_OVER = "taken_over"
    RELEASED = "released"
    BYPASSED = "bypassed"  # ran without deduplication: no key on an optional method, or fail-open
    REJECTED = "rejected"  # a missing or malformed key, no scope, a bad request: before the store
    UNAVAILABLE = "unavailable"  # store down, fail closed


# Backoff while polling for another process's attempt. In-process duplicates do not poll: they
# wait on the owner directly. Short first steps because atomic handlers are usually quick.
_POLL_STEPS_MS = (2, 5, 10, 20, 40, 80, 100)
MIN_RETRY_AFTER_MS = 50
MAX_RETRY_AFTER_MS = 2000
DEFAULT_RETRY_AFTER_MS = 250


def poll_delay_ms(attempt: int) -> int:
    return _POLL_STEPS_MS[min(attempt, len(_POLL_STEPS_MS) - 1)]


def retry_after_ms(lease_remaining_ms: int | None) -> int:
    """The retry hint sent with ABORTED: about when the current owner will be done or gone."""
    if lease_remaining_ms is None or lease_remaining_ms <= 0:
        return DEFAULT_RETRY_AFTER_MS
    return max(MIN_RETRY_AFTER_MS, min(MAX_RETRY_AFTER_MS, lease_remaining_ms))


# Kept from the deadline for the ABORTED answer to travel back (and for a loaded server to send
# it): answering late would turn a useful retry hint into a bare DEADLINE_EXCEEDED.
ANSWER_MARGIN_S = 0.1


def wait_budget_s(max_wait_s: float, time_remaining_s: float | None) -> float:
    """How long a duplicate may wait: the method's max wait, and never past the call deadline
    (keeping a small margin so the ABORTED answer still reaches the client in time)."""
    if time_remaining_s is None:
        return max_wait_s
    return max(0.0, min(max_wait_s, time_remaining_s - ANSWER_MARGIN_S))


# A phased claim's lease, renewed while its handler runs. The keeper counts the lease from when
# it sent the statement that set it last (the database set it later, so the lease ends no
# earlier than the keeper thinks, bar the claim's own round trip).
#
# A renewal stuck on a dead connection (its packets lost in a short partition of this replica, a
# half-open TCP connection) gets no answer until its bound. Bounded by a whole lease, sent a third
# of a lease after the last renewal, it held the keeper past the end of the lease, and only the
# next renewal, a third of a lease later still, went out on a fresh connection: the lease ran out
# with the database reachable again all along, and a retry on another replica took the live
# operation over (both handlers running). So a try's statement may take only half of what is
# left of the lease when it is sent (its wait for a connection, until the end:
# ``renewal_acquire_bound_s``), and after a failed try the next starts at most half of what was
# left later: the last try that can still land in time goes out on another connection.


def renewal_interval_s(lease_s: float) -> float:
    """Time between renewals that go well: a third of the lease, but never less than the floor."""
    return max(LEASE_RENEWAL_FLOOR_S, lease_s / 3)


def renewal_bound_s(lease_s: float, left_s: float) -> float:
    """How long one renewal sent ``left_s`` seconds before the lease runs out may take: half of
    that; with too little left for another try after it (or none: the lease ran out, which keeps
    the claim this attempt's until another takes it over), a whole lease."""
    return left_s / 2 if left_s > 2 * LEASE_RENEWAL_FLOOR_S else lease_s


def renewal_acquire_bound_s(lease_s: float, left_s: float) -> float:
    """How long a renewal sent ``left_s`` seconds before the lease runs out may wait for its
    connection: until then (with too little left, a whole lease, as ``renewal_bound_s``). Not
    half of it, as its statement: a pooled connection that is free comes at once, and one
    opened anew (after a failover, or past asyncpg's idle lifetime) is not opened any sooner by
    giving the connect up and beginning it again. Cut at half, a connect that took between a
    third and two thirds of the lease was begun again by every try, and the lease ran out."""
    return left_s if left_s > 2 * LEASE_RENEWAL_FLOOR_S else lease_s


def renewal_spacing_s(lease_s: float, left_s: float, *, renewed: bool) -> float:
    """Time from the start of a renewal, sent ``left_s`` seconds before the lease runs out, to
    the start of the next: ``renewal_interval_s`` after one that renewed; after one that failed,
    at most half of ``left_s`` (at least the floor), so that the next ends before the lease."""
    interval = renewal_interval_s(lease_s)
    if renewed or left_s <= 2 * LEASE_RENEWAL_FLOOR_S:
        return interval
    return max(LEASE_RENEWAL_FLOOR_S, min(interval, left_s / 2))
