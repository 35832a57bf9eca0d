"""``answers.serialize``'s check of a handler's answer against the method's response type (the
calls themselves: tests/integration/test_response_type.py)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    empty_pb2,
    message_factory,
)
from google.protobuf.message import EncodeError
from testsvc.v1 import testsvc_pb2

from grpc_idempotency.registry import PolicyRegistry
from grpc_idempotency.server import answers
from tests.support.hostile import classes

POST = "/testsvc.v1.LedgerService/Post"
EMPTY = empty_pb2.Empty.DESCRIPTOR.full_name


def _serialize(response: object, output_type: object = EMPTY, serializer: object = None) -> bytes:
    return answers.serialize(
        serializer or empty_pb2.Empty.SerializeToString,  # type: ignore[arg-type]
        response,
        output_type=output_type,  # type: ignore[arg-type]
        method=POST,
    )


def test_the_policy_knows_the_methods_response_type() -> None:
    policy = PolicyRegistry([testsvc_pb2]).get(POST)
    assert policy is not None and policy.output_type == "testsvc.v1.PostResponse"


def test_a_policy_stays_copyable_and_picklable() -> None:
    """A upb descriptor is neither: held in the policy, it made deepcopy, asdict and pickle of a
    public MethodPolicy raise TypeError."""
    policy = PolicyRegistry([testsvc_pb2]).get(POST)
    assert policy is not None
    assert copy.deepcopy(policy) == policy
    assert pickle.loads(pickle.dumps(policy)).output_type == policy.output_type
    assert dataclasses.asdict(policy)["output_type"] == "testsvc.v1.PostResponse"


def test_a_message_of_another_type_is_refused_naming_both() -> None:
    with pytest.raises(TypeError, match=r"google\.protobuf\.Duration message, not its response"):
        _serialize(duration_pb2.Duration(seconds=1))
    assert _serialize(empty_pb2.Empty()) == b""


def test_the_same_type_from_another_pool_is_the_same_message() -> None:
    """A copy of the same file in a pool of its own: other descriptors, the same type."""
    pool = descriptor_pool.DescriptorPool()
    proto = descriptor_pb2.FileDescriptorProto()
    empty_pb2.DESCRIPTOR.CopyToProto(proto)
    pool.Add(proto)
    copied = message_factory.GetMessageClass(pool.FindMessageTypeByName("google.protobuf.Empty"))
    assert copied.DESCRIPTOR is not empty_pb2.Empty.DESCRIPTOR
    assert _serialize(copied()) == b""


def test_what_is_no_message_is_left_to_the_serializer() -> None:
    """A handler's own serializer, for objects of its own, takes them; protobuf's refuses."""
    assert _serialize({"a": 1}, serializer=lambda d: repr(d).encode()) == b"{'a': 1}"
    # upb's TypeError, or the pure-Python runtime's AttributeError: a raise either way.
    with pytest.raises((TypeError, AttributeError), match="NoneType"):
        _serialize(None)


def test_only_protobufs_own_serializer_has_required_fields_checked_first() -> None:
    """protobuf's SerializeToString checks required fields with a walk that can kill the
    process (``check_required``): the answer is checked before it, with the library's error. A
    handler's own serializer may serialize partially on purpose: its answer is left to it."""
    leaf = classes()[1]["Leaf"]  # proto2: ``need`` and ``seen`` required (no map: no crash)
    partial = leaf(note="n")
    name = leaf.DESCRIPTOR.full_name
    with pytest.raises(EncodeError, match="answered, and its writes roll back"):
        _serialize(partial, output_type=name, serializer=leaf.SerializeToString)
    own = _serialize(partial, output_type=name, serializer=lambda m: m.SerializePartialToString())
    assert own == partial.SerializePartialToString()


def test_without_a_known_response_type_nothing_is_checked() -> None:
    one = duration_pb2.Duration(seconds=1)
    assert _serialize(one, output_type=None) == one.SerializeToString()


class _Bytes(bytes):
    """A subclass of bytes: grpc.aio's Cython send takes exact bytes only ("Expected bytes, got
    _Bytes"), as it does a bytearray, and refuses it only after the commit."""


def test_only_exact_bytes_are_recorded() -> None:
    """What grpc.aio would refuse as it sends the answer is refused before the commit, saying
    whose it is (the handler's serializer's, or the handler's own without one); exact bytes
    from a handler without a serializer are its answer as they are."""
    data = b"\x08\x01"
    with pytest.raises(TypeError, match=r"response serializer of \S+ returned _Bytes, not bytes"):
        _serialize(empty_pb2.Empty(), serializer=lambda m: _Bytes(m.SerializeToString()))
    for answer in (_Bytes(data), bytearray(data), 3):  # bytes(3) made b"\0\0\0" of the last
        with pytest.raises(TypeError, match="has no response serializer and returned"):
            answers.serialize(None, answer, output_type=EMPTY, method=POST)
    assert answers.serialize(None, data, output_type=EMPTY, method=POST) is data
