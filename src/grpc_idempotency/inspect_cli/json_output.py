"""``inspect --json`` and ``list --json``: records, outbox rows and whole inspections as JSON.

Each output, and ``outbox dead --json``'s, says how far the schema it read is migrated
(``schema_json``: per store in ``inspect``, on every line of the others): a schema behind is
read as it stands (a rolling upgrade), and what it shows is what that schema does (``expired``
before migration 0014), which a script reading only stdout could not otherwise tell.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any

from grpc_idempotency.core import inspection
from grpc_idempotency.core.inspection import (
    ChildKind,
    Found,
    Node,
    OutboxEntry,
    Payload,
    Record,
    StepNode,
)
from grpc_idempotency.inspect_cli.config import Config, StoreConfig
from grpc_idempotency.store.migrations import available_migrations


def _time(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).isoformat()


def _payload_json(p: Payload | None) -> dict[str, Any] | None:
    if p is None:
        return None
    out: dict[str, Any] = {"type": p.type_name, "size": p.size}
    if p.decoded:
        out["decoded"] = p.fields
        out["undeclared_bytes"] = p.undeclared_bytes
    else:
        out.update(undecoded=p.problem, hex_prefix=p.hex_prefix, base64_prefix=p.base64_prefix)
    return out


def schema_json(applied: Collection[int]) -> dict[str, Any]:
    """``schema_migrations``: the migrations of the schema read (``applied``, as
    ``Store.check_schema`` returned them), against this release's. ``missing`` not empty: the
    schema is behind and was read as it stands; ``unknown`` not empty: a newer release migrated
    it. Both are warned about on stderr too."""
    known = [m.version for m in available_migrations()]
    return {
        "version": max(applied, default=None),
        "expected": known[-1],
        "missing": [v for v in known if v not in applied],
        "unknown": sorted(v for v in applied if v > known[-1]),
    }


def record_json(record: Record) -> dict[str, Any]:
    """A record as JSON (``list --json`` prints one per line)."""
    lease = None
    if record.locked_until is not None:
        lease = {
            "locked_until": _time(record.locked_until),
            "remaining_s": record.lease_remaining_s,
            "expired": not record.lease_remaining_s,
            "released": record.released,
        }
    return {
        "scope": record.scope,
        "key": record.key,
        "method": record.method,
        "state": record.record_state.value,
        "status_code": record.status_code,
        "claims": record.fencing_token,
        "fencing_token": record.fencing_token,
        "lease": lease,
        "created_at": _time(record.created_at),
        "completed_at": _time(record.completed_at),
        "expires_at": _time(record.expires_at),
        "expired": record.expired,
        "read_at": _time(record.read_at),
        "fingerprint": record.fingerprint.hex(),
    }


def _outbox_json(row: OutboxEntry, payload: Payload) -> dict[str, Any]:
    return {
        "id": row.id,
        "key": row.key,
        "step": row.step,
        "method": row.method,
        "state": row.state,
        "attempts": row.attempts,
        "created_at": _time(row.created_at),
        "sent_at": _time(row.sent_at),
        "next_attempt_at": _time(row.next_attempt_at),
        "locked_until": _time(row.locked_until),
        "claimed_by": row.claimed_by,
        "last_error": row.last_error,
        "payload": _payload_json(payload),
    }


def _node_json(service: str, n: Node) -> dict[str, Any]:
    out = {"service": service, **record_json(n.record)}
    out["response"] = _payload_json(n.response)
    out["error"] = (
        None
        if n.error is None
        else {"code": n.error.code, "message": n.error.message, "details": n.error.details}
    )
    out["steps_known"] = n.steps_known
    out["steps_refused"] = n.steps_refused  # why unknown, when the descriptor is known
    out["steps"] = [_step_json(s) for s in n.steps]
    out["other_outbox"] = [
        _outbox_json(r, p) for r, p in zip(n.other_outbox, n.other_payloads, strict=True)
    ]
    return out


def _step_json(s: StepNode) -> dict[str, Any]:
    c = s.child
    out: dict[str, Any] = {
        "step": c.step,
        "kind": c.kind.value,
        "key": c.key,
        "call": c.call,
        "retired_at": _time(c.retired_at),
        "in_effect": c.in_effect,
    }
    if c.kind is ChildKind.CALL:
        out["looked_up"] = s.looked_up
        out["looked_in"] = s.looked_in
        out["records"] = [_node_json(f.service, f.node) for f in s.records]
    else:
        out["outbox"] = [_outbox_json(r, p) for r, p in zip(s.outbox, s.payloads, strict=True)]
    return out


def inspect_json(
    scope: str,
    key: str,
    config: Config,
    roots: list[Found],
    *,
    depth: int,
    applied: Mapping[StoreConfig, Collection[int]],
) -> dict[str, Any]:
    """The whole inspection as one JSON document (``depth``: ``--depth``; ``applied``: each
    store's schema migrations, as read)."""
    return {
        "scope": scope,
        "key": key,
        "depth": depth,
        "found": bool(roots),
        "duplicated": inspection.duplicated(roots),  # methods recorded in more than one store
        "stores": [
            {"name": s.name, "schema": s.schema, "schema_migrations": schema_json(applied[s])}
            for s in config.stores
        ],
        "operations": [
            {
                **_node_json(f.service, f.node),
                "totals": _totals_json(inspection.totals(f.node)),
            }
            for f in roots
        ],
    }


def _totals_json(t: inspection.Totals) -> dict[str, Any]:
    return {
        "records": t.records,
        "effects_by_step": t.effects_by_step,
        "duplicates": t.duplicates,
        "missing": t.missing,
        "not_looked_up": t.not_looked_up,
    }
