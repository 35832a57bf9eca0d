"""Hostile protobuf bytes and broken handler answers against a keyed server in a process of its
own (``tests.support.hostile``: proto2 required fields beside maps of scalars, closed enums,
groups, extensions, a recursive type, ``Any``; editions UTF-8 strings and LEGACY_REQUIRED), so
that a crash in upb is seen as the process dying, not as this one.

Every call gets a gRPC status the library or gRPC means (never UNKNOWN naming a Python
exception), a request executed is replayed under its key, and the server lives on."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from grpc_idempotency import Store
from grpc_idempotency.core.wire import KEY_HEADER, REPLAYED_HEADER
from tests.e2e.procs import ServiceProcess
from tests.support.hostile import ANSWER_HEADER, TAKE, TAKE_OPEN, classes
from tests.support.hostile_wire import hostile_bytes
from tests.support.processes import running


@pytest.fixture(scope="module")
async def server(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ServiceProcess]:
    # ``store``: the session's, which has migrated the schema the process's store checks for.
    process = ServiceProcess(
        ["-m", "tests.support.hostile", pg_dsn],
        ready="hostile ready",
        log_dir=tmp_path_factory.mktemp("hostile"),
        name="hostile",
    )
    await process.start()
    try:
        yield process
    finally:
        await process.stop()


def _call(
    server: ServiceProcess, method: str, data: bytes, key: str, answer: str = ""
) -> tuple[grpc.StatusCode, bytes | None, str, dict[str, str | bytes]]:
    """One call with a blocking channel (Hypothesis drives sync tests): code, body, details,
    initial metadata."""
    metadata: tuple[tuple[str, str | bytes], ...] = ((KEY_HEADER, key),)
    if answer:
        metadata += ((ANSWER_HEADER, answer),)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            body, done = call.with_call(data, metadata=metadata, timeout=15)
        except grpc.RpcError as err:
            failed: grpc.Call = err  # type: ignore[assignment]
            assert running(server.pid), f"the server died on {data!r}:\n{server.logs()}"
            return failed.code(), None, failed.details() or "", dict(failed.initial_metadata())
        return grpc.StatusCode.OK, body, "", dict(done.initial_metadata())


@pytest.mark.parametrize("method", [TAKE, TAKE_OPEN])
def test_hostile_request_bytes_get_a_status_and_the_server_lives(
    server: ServiceProcess, method: str
) -> None:
    cls = classes()[1]
    descriptor = cls["Req" if method == TAKE else "Open"].DESCRIPTOR

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(hostile_bytes(descriptor))
    def call_twice(data: bytes) -> None:
        key = uuid.uuid4().hex
        code, body, details, _ = _call(server, method, data, key)
        # INVALID_ARGUMENT: bytes that do not parse, or that the fingerprint cannot read.
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
        if code is grpc.StatusCode.OK:
            again, replayed, _, initial = _call(server, method, data, key)
            assert (again, replayed) == (code, body)
            assert initial.get(REPLAYED_HEADER) == "true"

    call_twice()
    assert running(server.pid)


@pytest.mark.parametrize("answer", ["partial", "outbox-partial"])
async def test_a_message_missing_a_required_field_beside_a_map_fails_the_call_not_the_server(
    server: ServiceProcess, answer: str
) -> None:
    """The handler answers (or enqueues in the outbox) a proto2 message missing a required field
    beside a map of scalar values. protobuf's SerializeToString checks required fields, and upb
    builds its error's text by reading such a map's values as messages: the server process died
    of SIGSEGV (every call it held failing with it), and again on every retry. Now the call fails
    as a handler's raise does (UNKNOWN, nothing recorded, its writes rolled back), so a retry
    runs it again."""
    key = uuid.uuid4().hex
    for _ in range(2):  # not recorded: the retry runs the handler again, and fails alike
        code, _, details, _ = await asyncio.to_thread(
            _call, server, TAKE, b"\x0a\x01a", key, answer
        )
        assert code is grpc.StatusCode.UNKNOWN, (code, details)
        assert "missing required fields" in details
    assert running(server.pid)
