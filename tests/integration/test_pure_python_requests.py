"""Request bytes that do not parse, on a server running protobuf's pure-Python runtime
(``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``), end to end (the test LedgerService in a
process of its own, the real store).

A keyed method answers bytes that are not a request INVALID_ARGUMENT, reason
IDEMPOTENCY_REQUEST_INVALID, before the key is read (README, "Errors"). upb raises DecodeError
for a string field that is not UTF-8; the pure-Python runtime raises UnicodeDecodeError, which
went past the library to grpc.aio: UNKNOWN, "Unexpected <class 'UnicodeDecodeError'>: 'utf-8'
codec can't decode byte 0xff ...".
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


class _Raw:
    """Bytes sent as they are (``call_raw`` serializes with ``SerializeToString``)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


async def test_a_string_field_that_is_not_utf8_is_an_invalid_request(
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
    # account = the account's name, then a string field (behaviour, 3) holding 0xff 0xfe.
    wire = b"\x0a" + bytes([len(account)]) + account.encode() + b"\x1a\x02\xff\xfe"
    key = uuid.uuid4().hex
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            answers: list[Answer] = []
            for _ in range(2):  # nothing claimed: the same answer again
                answers.append(
                    await call_raw(
                        channel, POST, _Raw(wire), ((TENANT, "tenant-a"), ("idempotency-key", key))
                    )
                )
    finally:
        await server.stop()
    for answer in answers:
        assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
        assert answer.reason() == "IDEMPOTENCY_REQUEST_INVALID"
        assert (
            answer.details
            == f"{POST}: the request does not parse: a string field is not valid UTF-8"
        )
    assert await ledger_rows(store, account) == 0
    assert await store.lookup("tenant:tenant-a", key) is None
