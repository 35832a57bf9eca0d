"""``core.inspection.children``: which declared steps an operation keys its effects with
(``in_effect``), as ``core.propagation.choose_step`` decides it for the operation's calls."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from grpc_idempotency.core.errors import StepUndeclared
from grpc_idempotency.core.inspection import Record, children
from grpc_idempotency.core.outbox import outbox_step
from grpc_idempotency.core.policy import Step
from grpc_idempotency.core.propagation import Parent, choose_step

RETIRED = datetime(2026, 6, 1, tzinfo=UTC)
METHOD = "/shop.v1.Orders/Place"
TARGET = "/shop.v1.Mail/Send"


def record(started: datetime) -> Record:
    return Record(
        scope="tenant:a",
        key="order-1",
        method=METHOD,
        state="completed",
        fingerprint=b"\x00",
        fencing_token=1,
        created_at=started,
        completed_at=started,
        expires_at=started + timedelta(days=1),
        locked_until=None,
        lease_remaining_s=None,
        expired=False,
        status_code=0,
        status_message="",
        status_details=None,
        response=b"",
        read_at=started,
    )


def test_a_step_retired_for_good_is_in_effect_for_the_operations_begun_before_its_retirement() -> (
    None
):
    """With no active version of its name, a retired call step named by the handler keys the
    operations begun before its retirement (``choose_step``); ``inspect`` said it was "not in
    effect for this operation" and left it out of ``missing`` when nothing was found."""
    steps = (Step(name="send-mail.v1", call=TARGET, retired_at=RETIRED),)
    before, after = RETIRED - timedelta(hours=1), RETIRED + timedelta(hours=1)

    parent = Parent(method=METHOD, scope="tenant:a", key="order-1", steps=steps, started_at=before)
    assert choose_step(parent, TARGET, "send-mail.v1").name == "send-mail.v1"
    (child,) = children(record(before), steps)
    assert child.in_effect is True

    later = Parent(method=METHOD, scope="tenant:a", key="order-1", steps=steps, started_at=after)
    with pytest.raises(StepUndeclared):
        choose_step(later, TARGET, "send-mail.v1")
    (child,) = children(record(after), steps)
    assert child.in_effect is False


def test_a_retired_version_with_an_active_one_is_in_effect_as_as_of_says() -> None:
    steps = (
        Step(name="send-mail.v1", call=TARGET, retired_at=RETIRED),
        Step(name="send-mail.v2", call=TARGET),
    )
    early = {c.step: c.in_effect for c in children(record(RETIRED - timedelta(hours=1)), steps)}
    late = {c.step: c.in_effect for c in children(record(RETIRED + timedelta(hours=1)), steps)}
    assert early == {"send-mail.v1": True, "send-mail.v2": False}
    assert late == {"send-mail.v1": False, "send-mail.v2": True}


def test_a_version_retired_for_good_is_in_effect_only_where_no_earlier_version_keys() -> None:
    """send-mail.v2 retired for good after send-mail.v1 was retired for it: an operation begun
    before v1's retirement keys its call with v1 whichever of the two the handler names
    (``choose_step``); inspect said v2 was in effect for it too."""
    later = RETIRED + timedelta(days=1)
    steps = (
        Step(name="send-mail.v1", call=TARGET, retired_at=RETIRED),
        Step(name="send-mail.v2", call=TARGET, retired_at=later),
    )
    for started, used in (
        (RETIRED - timedelta(hours=1), "send-mail.v1"),
        (RETIRED + timedelta(hours=1), "send-mail.v2"),
    ):
        parent = Parent(METHOD, "tenant:a", "order-1", steps, started)
        assert choose_step(parent, TARGET, "send-mail.v2").name == used
        in_effect = {c.step for c in children(record(started), steps) if c.in_effect}
        assert in_effect == {used}


def test_an_outbox_step_retired_for_good_is_in_effect_as_enqueue_keys_it() -> None:
    """A retired outbox version named in ``enqueue`` keys as a call's retired step does
    (``outbox.outbox_step``): retired for good, it keys the operations begun before its
    retirement, or the version retired before it that they began before. ``inspect`` read only
    call steps so, and said the step keying the operation's message was not in effect."""
    later = RETIRED + timedelta(days=1)
    steps = (
        Step(name="audit.v1", outbox=True, retired_at=RETIRED),
        Step(name="audit.v2", outbox=True, retired_at=later),
    )
    for started, used in (
        (RETIRED - timedelta(hours=1), {"audit.v1"}),
        (RETIRED + timedelta(hours=1), {"audit.v2"}),
        (later + timedelta(hours=1), set()),
    ):
        enqueued = set()
        for named in ("audit.v1", "audit.v2"):
            with contextlib.suppress(StepUndeclared):
                enqueued.add(outbox_step(METHOD, steps, named, started).name)
        assert enqueued == used
        assert {c.step for c in children(record(started), steps) if c.in_effect} == used


def test_an_outbox_row_under_no_known_step_counts_as_an_effect_and_is_not_called_undeclared() -> (
    None
):
    """Without the method's descriptors every outbox row is under no known step's key: the tree
    showed the row as an "undeclared step", then "effects: none" under it."""
    from grpc_idempotency.core.inspection import Found, OutboxEntry, decode, node, totals
    from grpc_idempotency.inspect_cli.config import Config, StoreConfig
    from grpc_idempotency.inspect_cli.descriptors import Descriptors
    from grpc_idempotency.inspect_cli.text_output import render_tree

    started = RETIRED
    op = node(record(started), output_type=None, output_class=None, steps_known=False)
    row = OutboxEntry(
        id=1, scope="tenant:a", key="k", step="order-placed.v1", parent_key="order-1",
        method="/shop.v1.Events/Publish", payload_type="shop.v1.Placed", payload=b"",
        state="pending", attempts=0, next_attempt_at=started, locked_until=None,
        claimed_by=None, last_error=None, created_at=started, sent_at=None,
    )  # fmt: skip
    op.other_outbox.append(row)
    op.other_payloads.append(decode(b"", row.payload_type, None))

    assert totals(op).effects_by_step == {"order-placed.v1": 1}
    config = Config(
        stores=(StoreConfig(name="orders", dsn="x", schema="orders"),),
        proto_modules=(),
        descriptor_sets=(),
        statement_cache_size=None,
    )
    found = [Found(service="orders", node=op)]
    lines = render_tree("tenant:a", "order-1", config, found, Descriptors([], []), depth=4)
    assert "effects: order-placed.v1 x1" in lines
    assert not [line for line in lines if "undeclared" in line]


def test_stored_names_in_the_tree_reach_the_terminal_escaped() -> None:
    """A google.protobuf.Struct response's keys (data, not field names), and an outbox row's
    step and payload type as stored, were printed raw: an ESC in them rewrote the terminal."""
    from dataclasses import replace

    from google.protobuf import struct_pb2

    from grpc_idempotency.core.inspection import Found, OutboxEntry, decode, node
    from grpc_idempotency.inspect_cli.config import Config, StoreConfig
    from grpc_idempotency.inspect_cli.descriptors import Descriptors
    from grpc_idempotency.inspect_cli.text_output import render_tree

    response = struct_pb2.Struct()
    response.update({"\x1b[2J": 1})
    stored = replace(record(RETIRED), response=response.SerializeToString())
    op = node(
        stored,
        output_type="google.protobuf.Struct",
        output_class=struct_pb2.Struct,
        steps_known=True,
    )
    row = OutboxEntry(
        id=1, scope="tenant:a", key="k", step="st\x1b]0;x\x07ep", parent_key="order-1",
        method="/shop.v1.Events/Publish", payload_type="p\x1b[2J", payload=b"",
        state="pending", attempts=0, next_attempt_at=RETIRED, locked_until=None,
        claimed_by=None, last_error=None, created_at=RETIRED, sent_at=None,
    )  # fmt: skip
    op.other_outbox.append(row)
    op.other_payloads.append(decode(b"", row.payload_type, None))
    config = Config(
        stores=(StoreConfig(name="orders", dsn="x", schema="orders"),),
        proto_modules=(),
        descriptor_sets=(),
        statement_cache_size=None,
    )
    found = [Found(service="orders", node=op)]

    lines = render_tree("tenant:a", "order-1", config, found, Descriptors([], []), depth=4)

    assert [line for line in lines if "\x1b" in line or "\x07" in line] == []
    assert "  \\x1b[2J: 1.0" in lines


def _descriptor_set(path: Path, refused: bool, malformed: bool = False) -> str:
    """A set declaring ``/later.v1.Later/Do`` (its options a later release's, refused, or
    this release's; ``malformed``: our option's field number with the wrong wire type) and
    ``/later.v1.Later/Fine`` (keyed, no steps) beside it."""
    from google.protobuf import descriptor_pb2, duration_pb2, timestamp_pb2

    from grpc_idempotency.v1 import options_pb2

    proto = descriptor_pb2.FileDescriptorProto(
        name="later/v1/later.proto",
        package="later.v1",
        syntax="proto3",
        dependency=["grpc_idempotency/v1/options.proto"],
    )
    proto.message_type.add(name="Req")
    service = proto.service.add(name="Later")
    for name in ("Do", "Fine"):
        method = service.method.add(
            name=name, input_type=".later.v1.Req", output_type=".later.v1.Req"
        )
        policy = options_pb2.MethodPolicy()
        if refused and name == "Do":
            policy.MergeFromString(b"\x58\x01")  # field 11: not in this release's MethodPolicy
        options: Any = method.options  # protoc's stubs mistype extensions
        if malformed and name == "Do":
            options.MergeFromString(bytes([0x90, 0xA8, 0x19, 0x01]))
        else:
            options.Extensions[options_pb2.method].CopyFrom(policy)
    files = descriptor_pb2.FileDescriptorSet()
    for module in (descriptor_pb2, duration_pb2, timestamp_pb2, options_pb2):
        module.DESCRIPTOR.CopyToProto(files.file.add())
    files.file.append(proto)
    path.write_bytes(files.SerializeToString())
    return str(path)


def test_a_method_refused_in_a_descriptor_set_is_that_method_alone_and_never_also_known(
    tmp_path: Path,
) -> None:
    """A refused method's steps are unknown and said why; the set's other methods keep theirs.
    Of two sets, the first to declare the method is taken, as for its steps: a refusal in the
    first beside steps from the second gave a node whose steps were known ("steps_known":
    true) and refused at once ("steps unknown: the method's options are refused")."""
    from grpc_idempotency.inspect_cli.descriptors import Descriptors

    refusing = _descriptor_set(tmp_path / "later.binpb", refused=True)
    keyed = _descriptor_set(tmp_path / "now.binpb", refused=False)
    alone = Descriptors([], [refusing])
    assert alone.steps_of("/later.v1.Later/Do") is None
    assert "sets field 11" in (alone.refusal("later.v1.Later.Do") or "")
    assert (alone.steps_of("/later.v1.Later/Fine"), alone.refusal("/later.v1.Later/Fine")) == (
        (),
        None,
    )
    # Refused by contract_of, never read again (upb parses this option as an empty policy:
    # read through the pool, the method had no steps, known, and a refusal beside them).
    garbled = Descriptors([], [_descriptor_set(tmp_path / "bad.binpb", False, malformed=True)])
    assert garbled.steps_of("/later.v1.Later/Do") is None
    assert "does not parse" in (garbled.refusal("/later.v1.Later/Do") or "")
    for sets, known in (([refusing, keyed], False), ([keyed, refusing], True)):
        d = Descriptors([], sets)
        steps, why = d.steps_of("/later.v1.Later/Do"), d.refusal("/later.v1.Later/Do")
        assert (steps is not None, why is None) == (known, known), sets


def test_rows_under_no_known_step_of_a_child_record_count_under_its_path_each() -> None:
    """Rows under no known step's key count once each (two rows, x2) under the path of the
    record whose key they hang from, and are called "undeclared" where its steps are known."""
    from grpc_idempotency.core.inspection import (
        Child,
        ChildKind,
        Found,
        OutboxEntry,
        StepNode,
        decode,
        node,
        totals,
    )
    from grpc_idempotency.inspect_cli.text_output import _node_lines

    op = node(record(RETIRED), output_type=None, output_class=None, steps_known=True)
    charged = node(record(RETIRED), output_type=None, output_class=None, steps_known=True)
    charge = Child(
        step="charge.v1", kind=ChildKind.CALL, key="c", call=TARGET, retired_at=None, in_effect=True
    )
    op.steps.append(StepNode(child=charge, records=[Found(service="orders", node=charged)]))
    for i in (1, 2):
        row = OutboxEntry(
            id=i, scope="tenant:a", key=f"k{i}", step="audit.v1", parent_key="c",
            method="/shop.v1.Events/Publish", payload_type="shop.v1.Audit", payload=b"",
            state="pending", attempts=0, next_attempt_at=RETIRED, locked_until=None,
            claimed_by=None, last_error=None, created_at=RETIRED, sent_at=None,
        )  # fmt: skip
        charged.other_outbox.append(row)
        charged.other_payloads.append(decode(b"", row.payload_type, None))

    assert totals(op).effects_by_step == {"charge.v1": 1, "charge.v1/audit.v1": 2}
    lines = _node_lines("orders", op, depth=4)
    assert sum("undeclared step audit.v1 (outbox)" in line for line in lines) == 2, lines
