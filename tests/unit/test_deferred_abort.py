"""``DeferredAbort`` refuses trailers gRPC cannot send when the handler aborts, before its
outcome is recorded (grpc.aio refuses them only when it sends them: after the commit)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from grpc_idempotency.server.handler_context import DeferredAbort

NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("trailers", "says"),
    [
        ((("Bad Key", "v"),), "'Bad Key'"),
        ((("X-Upper", "v"),), "'X-Upper'"),
        (((":path", "v"),), "':path'"),
        ((("grpc-timeout", "1S"),), "'grpc-timeout'"),  # aborted the server process
        (((b"x-bytes-name", "v"),), "b'x-bytes-name'"),
        ((("x-trace-bin", "text"),), "'-bin' names take bytes"),
        ((("x-trace-bin", 5),), "'-bin' names take bytes"),
        ((("x-note", "café"),), "not printable ASCII"),
        ((("x-note", "two\nlines"),), "not printable ASCII"),
        ((("x-note", b"\xff"),), "not printable ASCII"),
        ((("x-note", 5),), "text names take str"),
        ((("x-note",),), "not a (name, value) pair"),
        ((("x-note", "a", "b"),), "not a (name, value) pair"),
        (5, "not a sequence"),
    ],
)
def test_unsendable_trailers_raise_a_clear_value_error(trailers: Any, says: str) -> None:
    with pytest.raises(ValueError, match="trailing metadata") as raised:
        DeferredAbort(NOT_FOUND, "nf", trailers)
    assert says in str(raised.value)
    assert getattr(raised.value, "reason", None) == "IDEMPOTENCY_ABORT_INVALID"
    assert int(getattr(raised.value, "status_code", -1)) == grpc.StatusCode.INTERNAL.value[0]


@pytest.mark.parametrize(
    "trailers",
    [
        (),
        None,
        [("x-note", "printable ascii ~!")],
        (("x-note", b"bytes text"),),
        (("x-trace-bin", b"\x00\xff"),),
        (("grpc-status-details-bin", b"\x08\x05"),),
    ],
)
def test_sendable_trailers_are_kept(trailers: Any) -> None:
    aborted = DeferredAbort(NOT_FOUND, "nf", trailers)
    assert aborted.trailing_metadata == tuple(trailers or ())
    assert aborted.code is NOT_FOUND


def test_list_pairs_are_kept_as_the_tuples_grpc_aio_sends() -> None:
    aborted = DeferredAbort(NOT_FOUND, "nf", [["x_under.dot-dash", ""]])
    assert aborted.trailing_metadata == (("x_under.dot-dash", ""),)


class _AnsweredContext:
    """A call whose handler set ``trailers`` with set_trailing_metadata(); records the abort."""

    def __init__(self, trailers: Any) -> None:
        self._trailers = trailers
        self.answered: tuple[Any, str] | None = None

    def trailing_metadata(self) -> Any:
        return self._trailers

    async def abort(self, code: Any, details: str, trailing_metadata: Any = ()) -> None:
        self.answered = (code, details)
        raise grpc.aio.AbortError()


async def test_trailers_set_with_set_trailing_metadata_are_refused_naming_it() -> None:
    # Refused before the commit (interceptor._refuse_unsendable_trailers): the answer named
    # context.abort(), which a handler that only called set_trailing_metadata() never called.
    from grpc_idempotency.server.interceptor import _refuse_unsendable_trailers

    context = _AnsweredContext((("Bad Key", "v"),))
    with pytest.raises(grpc.aio.AbortError):
        await _refuse_unsendable_trailers(context, None)  # type: ignore[arg-type]
    assert context.answered is not None
    code, details = context.answered
    assert code == grpc.StatusCode.INTERNAL
    assert "set_trailing_metadata(): the trailing metadata" in details
    assert "context.abort()" not in details
