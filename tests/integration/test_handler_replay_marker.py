"""Only the library says an answer is a replay: ``idempotency-replayed`` sent by a handler is
dropped.

A handler that copies a downstream call's headers into its own (a gateway, a proxy-like
handler) copied the marker of a downstream replay too, and its first execution reached the
client marked as a replay. Sent as initial metadata, every client read it so; in trailers, a
trailers-only answer (an error sent with no headers first) carries them in its only header
block, which grpc-go and grpc-java hand to the application as headers. Frames are read here
with a bare HTTP/2 client, as those clients see them; the handler's other entries still go out.
Every way an answer carries the trailers the handler set is covered, with a key, without one
and failing open: a raise after set_trailing_metadata() too, which grpc.aio answers UNKNOWN
with them (the marker went out there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import REPLAYED_HEADER, Store
from grpc_idempotency.server import handler_context
from tests.support.ledger import POST, RunningLedger, fresh, metadata, running_ledger
from tests.support.raw_h2 import unary_frames

SVC = "/testsvc.v1.LedgerService/"
FAIL_OPEN = SVC + "PostFailOpen"
MARKER = REPLAYED_HEADER.encode()
# The handler's own entry beside the marker: it must still arrive.
BOTH = f"x-handler=kept&{REPLAYED_HEADER}=true"


async def frames(
    ledger: RunningLedger, method: str, behaviour: str, key: str | None, account: str = ""
) -> list[dict[bytes, bytes]]:
    port = int(ledger.address.rsplit(":", 1)[1])
    account = account or fresh("acct")
    request = testsvc_pb2.PostRequest(account=account, amount=1, behaviour=behaviour)
    headers = [(name.encode(), value.encode()) for name, value in metadata(key)]
    return await asyncio.to_thread(unary_frames, port, method, request.SerializeToString(), headers)


@pytest.fixture(autouse=True)
def unsaid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warning afresh."""
    monkeypatch.setattr(handler_context, "_marker_dropped_said", False, raising=False)


@pytest.mark.parametrize(
    ("method", "behaviour", "status"),
    [
        (POST, f"initial:{BOTH}", b"0"),  # headers, then OK
        (SVC + "PostSync", f"initial:{BOTH}", b"0"),  # a sync handler's context
        (POST, f"trailer:{BOTH}", b"5"),  # abort(..., trailers): trailers-only, recorded
        (POST, f"set-trailer:{BOTH}", b"0"),  # set_trailing_metadata(), then OK
        (POST, f"set-trailer:{BOTH};NOT_FOUND", b"5"),  # set, then abort: recorded
        (POST, f"set-trailer:{BOTH};UNAVAILABLE", b"14"),  # set, then abort: key released
        # set, then a raise: grpc.aio answers UNKNOWN (trailers-only) with the trailers set
        (POST, f"set-trailer:{BOTH};raise", b"2"),
    ],
    ids=[
        "initial",
        "sync-initial",
        "abort",
        "set-ok",
        "set-then-recorded",
        "set-then-released",
        "set-then-raise",
    ],
)
async def test_a_handlers_replay_marker_is_dropped_from_a_first_execution(
    store: Store, caplog: pytest.LogCaptureFixture, method: str, behaviour: str, status: bytes
) -> None:
    async with running_ledger(store) as ledger:
        with caplog.at_level(logging.WARNING, logger="grpc_idempotency.server"):
            first = await frames(ledger, method, behaviour, fresh())
            again = await frames(ledger, method, behaviour, fresh())
    for answer in (first, again):
        assert answer[-1][b"grpc-status"] == status, answer
        assert all(MARKER not in block for block in answer), answer
        assert any(block.get(b"x-handler") == b"kept" for block in answer), answer
    said = [r for r in caplog.records if REPLAYED_HEADER in r.getMessage()]
    assert len(said) == 1, said  # once per process, not once per call
    assert "dropped" in said[0].getMessage()


async def test_a_replay_still_carries_the_marker_after_the_handler_sent_one(
    store: Store,
) -> None:
    """The library's own marker is untouched: the retry of that call is marked a replay, and
    carries only that (README, "Metadata": the handler's initial metadata is not stored)."""
    key, account = fresh(), fresh("acct")
    async with running_ledger(store) as ledger:
        first = await frames(ledger, POST, f"initial:{BOTH}", key, account)
        replay = await frames(ledger, POST, f"initial:{BOTH}", key, account)
    assert all(MARKER not in block for block in first)
    headers, trailers = replay
    assert headers[MARKER] == b"true" and trailers[b"grpc-status"] == b"0"
    assert any(block.get(b"x-handler") == b"kept" for block in first)
    assert b"x-handler" not in headers and b"x-handler" not in trailers


# What the handler does after setting the trailers, and the answer's grpc-status: every way
# the answer of a call run without a claim can carry them.
AFTER_SET = [("", b"0"), (";NOT_FOUND", b"5"), (";set:NOT_FOUND", b"5"), (";raise", b"2")]
AFTER_SET_IDS = ["set-ok", "set-then-abort", "set-code", "set-then-raise"]


@pytest.mark.parametrize(
    ("behaviour", "status"),
    [(f"set-trailer:{BOTH}{then}", status) for then, status in AFTER_SET]
    + [(f"initial:{BOTH}", b"0")],
    ids=[*AFTER_SET_IDS, "initial"],
)
async def test_without_a_key_the_handlers_replay_marker_is_dropped_too(
    store: Store, behaviour: str, status: bytes
) -> None:
    """An optional-key method called without one runs once, and is no replay either."""
    async with running_ledger(store) as ledger:
        answer = await frames(ledger, SVC + "PostOptional", behaviour, None)
    assert answer[-1][b"grpc-status"] == status, answer
    assert all(MARKER not in block for block in answer), answer
    assert any(block.get(b"x-handler") == b"kept" for block in answer), answer


@pytest.fixture
async def down_store() -> AsyncIterator[Store]:
    """A store whose database refuses every connection (nothing listens on port 1): a certain
    outage, so a fail-open method runs at once, unclaimed (no probe to wait for)."""
    store = await Store.connect(
        "postgresql://postgres@127.0.0.1:1/postgres", min_size=0, check_schema=False
    )
    yield store
    await store.close()


@pytest.mark.parametrize(("then", "status"), AFTER_SET, ids=AFTER_SET_IDS)
async def test_a_fail_open_call_drops_the_handlers_replay_marker_too(
    down_store: Store, caplog: pytest.LogCaptureFixture, then: str, status: bytes
) -> None:
    """Run without its store, the handler's answer carries the trailers it set, as with one."""
    async with running_ledger(down_store) as ledger:
        with caplog.at_level(logging.WARNING, logger="grpc_idempotency.server"):
            answer = await frames(ledger, FAIL_OPEN, f"set-trailer:{BOTH}{then}", fresh())
    assert "running without deduplication" in caplog.text  # it did fail open
    # Naming the store that is down (one of several, sharded): it named none.
    assert "store [127.0.0.1:1/postgres, schema grpc_idempotency] unavailable" in caplog.text
    assert answer[-1][b"grpc-status"] == status, answer
    assert all(MARKER not in block for block in answer), answer
    assert any(block.get(b"x-handler") == b"kept" for block in answer), answer
