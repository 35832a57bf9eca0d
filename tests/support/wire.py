"""Client-side helpers to read what the server answered, byte for byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from grpc_idempotency.core.lifecycle import MAX_RETRY_AFTER_MS, MIN_RETRY_AFTER_MS
from grpc_idempotency.core.wire import ERROR_DOMAIN, PUSHBACK_TRAILER, REPLAYED_HEADER


@dataclass
class Answer:
    code: grpc.StatusCode
    body: bytes | None
    initial: dict[str, Any]
    trailing: dict[str, Any]
    details: str | None

    @property
    def replayed(self) -> bool:
        return self.initial.get(REPLAYED_HEADER) == "true"

    def check_replay_marker(self) -> None:
        """README, "Metadata": a replay sends its headers first, the marker only in them and
        nothing else (the handler's own initial metadata is not stored); no answer carries the
        marker in its trailers. Checked on every answer ``call_raw`` reads."""
        assert REPLAYED_HEADER not in self.trailing, self.trailing
        if REPLAYED_HEADER in self.initial:
            assert self.initial == {REPLAYED_HEADER: "true"}, self.initial

    def status(self) -> status_pb2.Status | None:
        raw = self.trailing.get("grpc-status-details-bin")
        return None if raw is None else status_pb2.Status.FromString(raw)

    def reason(self) -> str | None:
        """The first ``ErrorInfo.reason`` in the answer's ``google.rpc.Status``. One of the
        library's (``IDEMPOTENCY_...``) is checked as the README's wire contract gives it to
        clients in other languages, which read the Status alone: domain "grpc-idempotency", the
        Status's code and message the call's, and for a key in progress no initial metadata (a
        trailers-only answer, which gRPC's retries may retry) and one retry hint, in
        ``RetryInfo`` and in ``grpc-retry-pushback-ms`` alike (no other reason has one). So
        every test asserting such a reason asserts these fields too."""
        status = self.status()
        for detail in status.details if status else ():
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason: str = info.reason
                if reason.startswith("IDEMPOTENCY_"):
                    self._check_library_error(status, info)
                return reason
        return None

    def _check_library_error(
        self, status: status_pb2.Status | None, info: error_details_pb2.ErrorInfo
    ) -> None:
        assert status is not None
        assert info.domain == ERROR_DOMAIN, (info.reason, info.domain)
        assert not info.metadata, info  # README: "and no ErrorInfo metadata"
        infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        assert len(infos) == 1, status
        # Trailers-only (no headers first: gRPC's retry policy may retry it), or a replay of
        # a recorded RESPONSE_TOO_LARGE, whose headers carry the marker alone.
        assert self.initial in ({}, {REPLAYED_HEADER: "true"}), (info.reason, self.initial)
        assert (status.code, status.message) == (self.code.value[0], self.details), (
            status,
            self.code,
            self.details,
        )
        if info.reason == "IDEMPOTENCY_KEY_IN_PROGRESS":
            assert self.initial == {}, self.initial
            delay = self.retry_delay_ms()
            assert delay is not None and MIN_RETRY_AFTER_MS <= delay <= MAX_RETRY_AFTER_MS, delay
            assert self.trailing.get(PUSHBACK_TRAILER) == str(delay), self.trailing
        else:  # a hint only where the README gives one: the other answers name no time
            assert PUSHBACK_TRAILER not in self.trailing and self.retry_delay_ms() is None

    def retry_delay_ms(self) -> int | None:
        status = self.status()
        for detail in status.details if status else ():
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return int(info.retry_delay.ToMilliseconds())
        return None


async def call_raw(
    channel: grpc.aio.Channel,
    method: str,
    request: Any,
    metadata: tuple[tuple[str, str], ...],
    timeout: float | None = 10.0,
) -> Answer:
    """Calls ``method`` and returns the raw response bytes (no deserialization) and metadata."""
    stub = channel.unary_unary(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None
    )
    call = stub(request, metadata=metadata, timeout=timeout)
    try:
        body = await call
    except grpc.aio.AioRpcError as err:
        answer = Answer(
            err.code(),
            None,
            dict(err.initial_metadata() or ()),
            # grpc-stubs: AioRpcError's trailers are name/value pairs (an aio Metadata), not
            # the sync RpcError's _Metadatum objects
            dict(err.trailing_metadata() or ()),  # type: ignore[arg-type]
            err.details(),
        )
    else:
        answer = Answer(
            await call.code(),
            body,
            dict(await call.initial_metadata() or ()),
            dict(await call.trailing_metadata() or ()),
            await call.details(),
        )
    answer.check_replay_marker()
    return answer
