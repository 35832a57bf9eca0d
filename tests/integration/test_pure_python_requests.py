"""Request bytes that do not parse, on a server running protobuf's pure-Python runtime
(``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``), end to end (the test LedgerService in a
process of its own, the real store).

A keyed method answers bytes that are not a request INVALID_ARGUMENT, reason
IDEMPOTENCY_REQUEST_INVALID, before the key is read (README, "Errors"). upb raises DecodeError
for a string field that is not UTF-8; the pure-Python runtime raises UnicodeDecodeError, which
went past the library to grpc.aio: UNKNOWN, "Unexpected <class 'UnicodeDecodeError'>: 'utf-8'
codec can't decode byte 0xff ...". And it takes an undeclared group that upb refuses as
corrupt (closed by another field's end tag, or holding a record cut short): the handler would run,
but the fingerprint, which reads the request's records to put undeclared fields in order
(``core/field_order.py``), could not, and the ValueError went to grpc.aio: UNKNOWN.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc

from grpc_idempotency import Store
from tests.e2e.procs import ServiceProcess
from tests.support.ledger import TENANT, fresh, ledger_rows
from tests.support.wire import Answer, call_raw

POST = "/testsvc.v1.LedgerService/Post"
_BAD_GROUP = b"\x9b\x06" + b"\x08\x01" + b"\x84\x9c\x06"


class _Raw:
    """Bytes sent as they are (``call_raw`` serializes with ``SerializeToString``)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


async def test_bytes_upb_would_not_parse_are_an_invalid_request(
    store: Store, pg_dsn: str, tmp_path: Path
) -> None:
    server = ServiceProcess(
        ["-m", "tests.support.ledger_process", pg_dsn],
        ready="ledger ready",
        log_dir=tmp_path,
        name="ledger",
        env={"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
    )
    account = fresh("acct")
    # account = the account's name, then:
    prefix = b"\x0a" + bytes([len(account)]) + account.encode()
    malformed = "a field it does not declare is malformed"
    wires = [
        # a string field (behaviour, 3) holding 0xff 0xfe
        ("a string field is not valid UTF-8", prefix + b"\x1a\x02\xff\xfe"),
        # an undeclared group (99) closed by field 12736's end tag, which ends in group 99's
        # (the pure-Python runtime compares the last bytes only)
        (malformed, prefix + _BAD_GROUP),
        # the same inside meta (5)
        (malformed, prefix + b"\x2a" + bytes([len(_BAD_GROUP)]) + _BAD_GROUP),
        # an undeclared group (99) whose varint (field 1) runs to the end of the request: the
        # records' reader runs off the end (IndexError, not ValueError)
        (malformed, prefix + b"\x9b\x06\x08\x9c\x06"),
        # a request big enough to be fingerprinted off the event loop (over 16 KiB: an
        # undeclared field 100 of 17000 bytes), then the bad group
        (malformed, prefix + b"\xa2\x06\xe8\x84\x01" + b"x" * 17000 + _BAD_GROUP),
    ]
    keys = [uuid.uuid4().hex for _ in wires]
    answers: list[tuple[str, Answer]] = []
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            for (problem, wire), key in zip(wires, keys, strict=True):
                metadata = ((TENANT, "tenant-a"), ("idempotency-key", key))
                for _ in range(2):  # nothing claimed: the same answer again
                    answer = await call_raw(channel, POST, _Raw(wire), metadata)
                    answers.append((problem, answer))
    finally:
        await server.stop()
    for problem, answer in answers:
        assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
        assert answer.reason() == "IDEMPOTENCY_REQUEST_INVALID"
        assert answer.details == f"{POST}: the request does not parse: {problem}"
    assert await ledger_rows(store, account) == 0
    for key in keys:
        assert await store.lookup("tenant:tenant-a", key) is None
