"""assert_replayed / assert_not_replayed / is_replayed take initial metadata in any shape a test
has it in: pairs, grpc.aio.Metadata, or a mapping (a dict made of it, a MappingProxyType)."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from grpc_idempotency.testing import assert_not_replayed, assert_replayed, is_replayed

REPLAYED = {"idempotency-replayed": "true", "x-request-id": "r1"}
EXECUTED = {"x-request-id": "r2"}

SHAPES: list[tuple[str, Callable[[dict[str, str]], Any]]] = [
    ("pairs", lambda md: tuple(md.items())),
    ("grpc.aio.Metadata", lambda md: grpc.aio.Metadata(*md.items())),
    ("dict", dict),
    ("MappingProxyType", MappingProxyType),
]


@pytest.mark.parametrize("shape", [s for _, s in SHAPES], ids=[n for n, _ in SHAPES])
async def test_every_shape_of_metadata_tells_a_replay_from_an_execution(
    shape: Callable[[dict[str, str]], Any],
) -> None:
    assert await is_replayed(shape(REPLAYED))
    assert not await is_replayed(shape(EXECUTED))
    await assert_replayed(shape(REPLAYED))
    await assert_not_replayed(shape(EXECUTED))
    with pytest.raises(AssertionError, match=r"expected a replay.*x-request-id: 'r2'"):
        await assert_replayed(shape(EXECUTED))
    with pytest.raises(AssertionError, match="expected an execution"):
        await assert_not_replayed(shape(REPLAYED))


async def test_what_is_no_metadata_is_a_type_error() -> None:
    for wrong in ("idempotency-replayed", b"true", 3):
        with pytest.raises(TypeError, match="initial metadata"):
            await assert_replayed(wrong)


async def test_a_response_message_is_a_type_error_that_says_to_keep_the_call() -> None:
    # What ``response = await stub.M(...)`` leaves in hand: no metadata, and an error that said
    # only "not ChargeResponse" did not say what to pass instead.
    for check in (assert_replayed, assert_not_replayed, is_replayed):
        with pytest.raises(
            TypeError, match=r"not its response message \(Timestamp\).*keep the call"
        ):
            await check(Timestamp())
