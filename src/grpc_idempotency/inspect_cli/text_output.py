"""``inspect``'s text output: the operation as a tree of records, steps and outbox rows, then a
summary; ``list``'s table uses its outcome and time formats (``outcome_label``, ``timestamp``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

from grpc_idempotency.cli_errors import printable
from grpc_idempotency.core import inspection
from grpc_idempotency.core.inspection import (
    Child,
    ChildKind,
    Found,
    Node,
    OutboxEntry,
    Payload,
    Record,
    RecordState,
)
from grpc_idempotency.inspect_cli.config import Config
from grpc_idempotency.inspect_cli.descriptors import Descriptors


def timestamp(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def outcome_label(record: Record) -> str:
    state = record.record_state
    if state is RecordState.IN_PROGRESS:
        return "in_progress"
    if state is RecordState.COMPLETED:
        return "completed OK"
    err = inspection.recorded_error(record)
    return f"error {err.code if err else record.status_code}"


def _record_lines(service: str, n: Node) -> list[str]:
    r = n.record
    head = f"{r.method}  {outcome_label(r)}  [{service}]"
    lines = [head]
    # The token counts every claim of the key, not takeovers alone: a retry after a released
    # attempt and a new operation under the key after the retention claim it too.
    later = r.fencing_token - 1
    claims = f"claims: {r.fencing_token} (fencing token {r.fencing_token}"
    claims += f": the first and {later} later)" if later else ": the first)"
    lines.append(claims)
    times = f"started {timestamp(r.created_at)}"
    if r.completed_at is not None:
        took = (r.completed_at - r.created_at).total_seconds()
        times += f", completed {timestamp(r.completed_at)} ({_seconds(took)})"
    verb = "expired" if r.expired else "replayed until"
    times += f", {verb} {timestamp(r.expires_at)}" if r.state == "completed" else ""
    lines.append(times)
    if r.released:
        # Not a lease that ran out: its attempt ended, recorded nothing, and let the key go.
        lines.append(
            "lease: released: the last attempt failed or its client left, recording nothing; "
            + (
                "past its retention: the same request takes it over, continuing its"
                " operation; another request starts a new one"
                if r.expired
                else "a retry runs it again"
            )
        )
    elif r.record_state is RecordState.IN_PROGRESS:
        left = r.lease_remaining_s or 0.0
        lines.append(
            f"lease: until {timestamp(r.locked_until)}, "
            + (
                f"{_seconds(left)} left"
                if left > 0
                # The same request continues the operation, keeping its start (and so the step
                # versions it keys with): the claim keeps created_at for a matching fingerprint
                # (claim()). Only another request, refused within retention, is new now.
                else "run out, and past its retention: the same request takes it over,"
                " continuing its operation; another request starts a new one"
                if r.expired
                else "run out: a retry takes it over"
            )
        )
    if n.response is not None:
        lines += _payload_lines("response", n.response)
    if n.error is not None:
        lines.append(f"recorded error: {n.error.code}: {printable(n.error.message)}")
        lines += [f"  detail {json.dumps(d, sort_keys=True)}" for d in n.error.details]
    return lines


def _payload_lines(label: str, p: Payload) -> list[str]:
    if p.decoded:
        lines = [f"{label} {p.type_name} ({p.size} bytes)"]
        if p.undeclared_bytes:
            lines.append(
                f"  ({p.undeclared_bytes} of its bytes hold fields {p.type_name} does not"
                " declare, not shown: another message type, or a newer version of it?)"
            )
        if isinstance(p.fields, dict):
            # Escaped: a google.protobuf.Struct's keys are data, not field names.
            lines += [
                f"  {printable(name)}: {json.dumps(value)}" for name, value in p.fields.items()
            ]
        else:  # a well-known type's JSON form: a string (Timestamp, the wrappers), list, null
            lines.append(f"  {json.dumps(p.fields)}")
        return lines
    # An outbox row's payload_type, as stored, and quoted in the problem.
    what = printable(p.type_name) if p.type_name else "of unknown type"
    return [
        f"{label} {what} ({p.size} bytes, not decoded: {printable(p.problem or '')})",
        f"  hex {p.hex_prefix}{'...' if p.size > inspection.PREFIX_BYTES else ''}",
        f"  base64 {p.base64_prefix}{'...' if p.size > inspection.PREFIX_BYTES else ''}",
    ]


def _outbox_lines(row: OutboxEntry, payload: Payload) -> list[str]:
    line = f"outbox row {row.id}: {row.state}, {row.attempts} delivery attempt(s)"
    if row.sent_at is not None:
        line += f", sent {timestamp(row.sent_at)}"
    elif row.state == "pending":
        line += f", next {timestamp(row.next_attempt_at)}"
    lines = [line]
    if row.last_error:
        lines.append(f"last error: {printable(row.last_error)}")
    return lines + _payload_lines("payload", payload)


def _child_head(c: Child) -> str:
    target = f" -> {c.call}" if c.call else " (outbox)"
    notes = []
    if c.retired_at is not None:
        notes.append(f"retired {timestamp(c.retired_at)}")
    if not c.in_effect:
        notes.append("not in effect for this operation")
    extra = f" [{'; '.join(notes)}]" if notes else ""
    return f"step {c.step}{target}{extra}"


def _tree(lines: list[str], head: list[str], items: list[list[str]], prefix: str) -> None:
    """Appends ``head`` (the node's own lines) then ``items`` (each a subtree's lines) with
    box-drawing branches under ``prefix``."""
    for line in head:
        lines.append(f"{prefix}{line}")
    for i, item in enumerate(items):
        last = i == len(items) - 1
        for j, line in enumerate(item):
            if j == 0:
                lines.append(f"{prefix}{'└─ ' if last else '├─ '}{line}")
            else:
                lines.append(f"{prefix}{'   ' if last else '│  '}{line}")


def _node_lines(service: str, n: Node, depth: int) -> list[str]:
    own = _record_lines(service, n)
    items: list[list[str]] = []
    for s in n.steps:
        sub: list[str] = []
        heads = [_child_head(s.child), f"key {s.child.key}"]
        parts: list[list[str]] = []
        if s.child.kind is ChildKind.CALL:
            for f in s.records:
                sub_lines = _node_lines(f.service, f.node, depth)
                if f in s.mismatched:
                    note = f"not the step's method ({s.child.call}): the key was reused?"
                    sub_lines.insert(1, note)
                parts.append(sub_lines)
            if not s.looked_up:
                parts.append([f"not looked up (below --depth {depth})"])
            elif not s.records:
                parts.append([f"no record in {', '.join(s.looked_in)}"])
        else:
            parts += [_outbox_lines(r, p) for r, p in zip(s.outbox, s.payloads, strict=True)]
            if not s.outbox:
                parts.append(["no outbox row"])
        _tree(sub, heads, parts, "")
        items.append(sub)
    for row, payload in zip(n.other_outbox, n.other_payloads, strict=True):
        # "Undeclared" only when the steps are known: otherwise it may well be declared.
        label = "undeclared step" if n.steps_known else "step"
        items.append([f"{label} {printable(row.step)} (outbox)", *_outbox_lines(row, payload)])
    if n.steps_refused is not None:
        items.append(["steps unknown: the method's options are refused (why: below)"])
    elif not n.steps_known:
        items.append(
            [
                f"steps unknown: no descriptors for {n.record.method}"
                " (--proto-module, --descriptor-set)"
            ]
        )
    lines: list[str] = []
    _tree(lines, own, items, "")
    return lines


def _refusals(nodes: Iterable[Node]) -> Iterator[str]:
    """The ``steps_refused`` of these nodes and of every node below them, in tree order."""
    for n in nodes:
        if n.steps_refused is not None:
            yield n.steps_refused
        yield from _refusals(found.node for s in n.steps for found in s.records)


def render_tree(
    scope: str,
    key: str,
    config: Config,
    roots: list[Found],
    descriptors: Descriptors,
    *,
    depth: int,
) -> list[str]:
    """The inspection as text: one tree per store holding the operation, then a summary
    (``depth``: ``--depth``)."""
    names = ", ".join(s.name for s in config.stores)
    if not roots:
        # Read alone, "no record" invites running the operation again by hand.
        return [
            f"{printable(scope)} {printable(key)}: no record in {names}",
            "(not proof that it never ran: an atomic operation writes its record only when it"
            " commits, a record past its retention may be purged, and another scope's records"
            " are not looked at)",
        ]
    lines = [f"{printable(scope)} {printable(key)}"]
    for found in roots:
        lines += _node_lines(found.service, found.node, depth)
        t = inspection.totals(found.node)
        effects = (
            ", ".join(f"{printable(step)} x{n}" for step, n in t.effects_by_step.items()) or "none"
        )
        lines.append(f"effects: {effects}")
        if t.not_looked_up:
            lines.append(
                f"not looked up (below --depth {depth}): {', '.join(t.not_looked_up)}"
                " (neither counted nor missing: raise --depth to see them)"
            )
        if t.duplicates:
            lines.append(f"DUPLICATED: {', '.join(t.duplicates)} reached more than one record")
        if t.missing:
            # Child records are looked up under the inspected scope only. A downstream scoped by
            # its callers' identity (the default resolver: mTLS) keeps a parent's step calls under
            # the parent service's scope, so without this a charge made looked never made.
            lines.append(
                f"nothing under: {', '.join(t.missing)} (steps the handler did not take, or"
                " whose store is not configured, or whose service records them under another"
                " scope, such as the caller's mTLS identity: give it as `scope =` in that"
                " service's --config section)"
            )
    for method in inspection.duplicated(roots):
        where = ", ".join(f.service for f in roots if f.node.record.method == method)
        # "Claimed", not "ran": one of the records may be a claim whose attempt recorded
        # nothing (released), though a phased handler may have had effects before it failed.
        lines.append(
            f"DUPLICATED: {method} recorded in {where}: the operation was claimed in each store"
        )
    # Once per method however many of its records the tree holds: the text is long.
    for why in dict.fromkeys(_refusals(found.node for found in roots)):
        lines.append(
            f"options refused (steps unknown), as this release's server refuses them: {why}"
        )
    if not descriptors.given:
        lines.append("(no --proto-module or --descriptor-set: responses shown as bytes)")
    return lines
