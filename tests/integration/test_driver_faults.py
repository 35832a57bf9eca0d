"""What the store and its drivers do when asyncpg raises something that is not one of the
database's error classes: a value in PostgreSQL's answer it cannot decode, as bytes flipped on a
link or in a broken pooler leave it. The proxy corrupts one text value in the answers (its first
byte made 0xFF, not UTF-8), the messages' framing intact; asyncpg raises UnicodeDecodeError."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import Store, StoreUnavailable
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.lifecycle import Outcome
from grpc_idempotency.outbox import Relay
from tests.integration.test_relay import Receiver, insert
from tests.support.blackhole import BlackholeProxy, store_behind_proxy
from tests.support.ledger import fresh, running_ledger
from tests.support.schemas import fresh_store

SVC = "/testsvc.v1.LedgerService/"
WAIT_S = 20.0  # an upper bound for things that take milliseconds; never a pause


@contextlib.asynccontextmanager
async def behind_proxy(pg_dsn: str) -> AsyncIterator[tuple[Store, BlackholeProxy, Store]]:
    """A store on a fresh schema, a proxy to PostgreSQL, and a store on that schema through it."""
    async with fresh_store(pg_dsn, "faults") as direct:
        proxy = BlackholeProxy(pg_dsn)
        await proxy.start()
        try:
            store = await Store.connect(proxy.dsn, schema=direct.schema, min_size=1, max_size=1)
            try:
                yield direct, proxy, store
            finally:
                await store.close(timeout=1)
        finally:
            await proxy.close()


async def test_a_relay_outlives_an_answer_it_cannot_decode(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim's answer cannot be decoded: the batch fails as an outage would (its rows stay
    claimed, and come back after the lease), logged with the traceback, and the relay goes on.
    The raw UnicodeDecodeError took ``run()`` down, and nothing was delivered any more."""
    caplog.set_level(logging.WARNING)
    async with behind_proxy(pg_dsn) as (direct, proxy, store):
        receiver = Receiver(expect=1)
        relay = Relay(store, receiver, lease=0.5, poll_interval=0.2, listen=False)
        proxy.corrupt_answers(b"garbled-key")
        await insert(direct, direct.schema, ["garbled-key"])
        stop = asyncio.Event()
        failure = _Logged("driver failed while claiming")
        logging.getLogger("grpc_idempotency.store").addHandler(failure)
        running = asyncio.create_task(relay.run(stop))
        try:
            logged = asyncio.ensure_future(failure.seen.wait())
            done, _ = await asyncio.wait(
                [running, logged], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert running not in done, running.exception()
            assert logged in done and proxy.rewritten >= 1
            proxy.corrupt_answers(None)
            delivered = asyncio.ensure_future(receiver.all_in.wait())
            done, _ = await asyncio.wait(
                [running, delivered], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert delivered in done, running.exception() if running in done else "no delivery"
        finally:
            logging.getLogger("grpc_idempotency.store").removeHandler(failure)
            stop.set()
            await asyncio.wait_for(running, WAIT_S)
    assert set(receiver.delivered) == {"garbled-key"}
    assert relay.stats.unrecorded == 0  # the claim failed: no batch was taken for delivered
    warned = [r for r in caplog.records if "trying again" in r.getMessage()]
    assert warned and "UnicodeDecodeError" in warned[0].getMessage()


class _Logged(logging.Handler):
    """Sets ``seen`` when a record with ``text`` and a traceback is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage() and record.exc_info:
            self.seen.set()


async def test_a_lookup_whose_answer_cannot_be_decoded_is_unavailable_not_an_outage(
    pg_dsn: str,
) -> None:
    """Answered raw, the UnicodeDecodeError reached the client as UNKNOWN with the driver's
    text. StoreUnavailable (UNAVAILABLE), and no outage: the database answered, and a fail-open
    method must not run unclaimed. The connection is dropped; the next look-up works."""
    async with behind_proxy(pg_dsn) as (direct, proxy, store):
        attempt = await direct.claim_atomic(
            scope="s",
            key="k",
            method="/m/M",
            fingerprint=b"f",
            retention_s=60.0,
            lease_s=5.0,
        )
        assert attempt is not None
        await attempt.record(Outcome(Code.NOT_FOUND, "garbled-message"))
        proxy.corrupt_answers(b"garbled-message")
        with pytest.raises(StoreUnavailable) as raised:
            await store.lookup("s", "k")
        assert not raised.value.outage
        assert "UnicodeDecodeError" in str(raised.value)
        assert isinstance(raised.value.__cause__, UnicodeDecodeError)
        proxy.corrupt_answers(None)
        found = await store.lookup("s", "k")
        assert found is not None and found.outcome is not None
        assert found.outcome.message == "garbled-message"


async def test_a_retry_whose_record_cannot_be_decoded_answers_unavailable(
    pg_dsn: str, store: Store
) -> None:
    """The retry reads the key's recorded error, and asyncpg cannot decode its message: the call
    answers UNAVAILABLE with the store's reason, not UNKNOWN with the driver's text; the handler
    does not run again; once the answers are whole, the retry replays."""
    async with (
        store_behind_proxy(pg_dsn, pool=2) as (proxy, via),
        running_ledger(via, replay_cache=False) as ledger,
    ):
        ledger.service.release.set()
        key = fresh()
        request = testsvc_pb2.PostRequest(
            account=fresh("acct"), amount=1, behaviour="wait:NOT_FOUND"
        )
        first = await ledger.call(SVC + "Post", request, key)
        assert first.code is grpc.StatusCode.NOT_FOUND, first.details
        proxy.corrupt_answers(b"handler says NOT_FOUND")
        answer = await ledger.call(SVC + "Post", request, key)
        assert proxy.rewritten >= 1
        assert answer.code is grpc.StatusCode.UNAVAILABLE, answer.details
        assert answer.reason() == "IDEMPOTENCY_STORE_UNAVAILABLE"
        assert "can't decode" not in (answer.details or "")
        proxy.corrupt_answers(None)
        again = await ledger.call(SVC + "Post", request, key)
        assert again.code is grpc.StatusCode.NOT_FOUND and again.replayed, again.details
        assert ledger.service.executions == 1


async def test_a_phased_claim_whose_answer_cannot_be_read_is_not_left_behind(
    pg_dsn: str, store: Store
) -> None:
    """The phased claim commits on its own, and asyncpg fails reading its answer (a field longer
    than its row: an AssertionError of its buffer code). The claim may have committed: taken
    again on a connection opened now, as after a connection lost under it, it is the call's own
    (its attempt id), and the call goes on. Taken for a plain failure, the call answered
    UNAVAILABLE and left the claim to its lease with nobody behind it: every retry was told
    the key was in progress until the lease ran out."""
    async with (
        store_behind_proxy(pg_dsn, pool=2) as (proxy, via),
        running_ledger(via, replay_cache=False) as ledger,
    ):
        key = fresh()
        request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=1)
        proxy.corrupt_row_after(key.encode())
        answer = await ledger.call(SVC + "PostPhased", request, key)
        assert proxy.rewritten == 1
        assert answer.code is grpc.StatusCode.OK, (answer.code, answer.details)
        retry = await ledger.call(SVC + "PostPhased", request, key)
        assert retry.code is grpc.StatusCode.OK and retry.replayed, retry.details
        assert ledger.service.executions == 1
