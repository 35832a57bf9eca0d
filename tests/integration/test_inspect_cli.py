"""``grpc-idempotency inspect`` and ``list`` against real stores, run as a user runs them.

Two services on their own schemas of the session's PostgreSQL: RelayService.Forward (phased,
steps calling LedgerService) in one, LedgerService in the other, both real grpc.aio servers.
Each test makes real calls through them, then runs the command as a subprocess
(``python -m grpc_idempotency.cli``) and checks what it prints against what the stores hold:
the child key is ``child_key(scope, key, step)``, the child record is found in the other store,
stored responses are decoded with the generated module or a descriptor set (and shown as bytes
without either), recorded errors and outbox rows appear, and the exit status says found (0),
not found (3), unreachable (1) or unusable (2).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from testsvc.v1 import testsvc_pb2

from grpc_idempotency import MethodOverride, StaticScope, Store, child_key
from grpc_idempotency.inspect_cli.cursor import ListCursor, Listing
from tests.e2e.procs import free_port
from tests.support.ledger import RunningLedger, fresh, metadata, running_ledger
from tests.support.relay import RunningRelay, running_relay
from tests.support.schemas import fresh_store
from tests.support.tools import run_cli
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
FORWARD = "/testsvc.v1.RelayService/Forward"
POST = "/testsvc.v1.LedgerService/Post"
POST_PHASED = "/testsvc.v1.LedgerService/PostPhased"
MODULE = "testsvc.v1.testsvc_pb2"


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


async def cli(*args: str, env: dict[str, str] | None = None) -> Done:
    """The command as a process of its own (tests/support/tools.py's run_cli), without the
    caller's PG* / GRPC_IDEMPOTENCY_* settings; the generated test modules stay importable
    (PYTHONPATH, set by tests/conftest.py)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GRPC_IDEMPOTENCY_"))}
    done = await asyncio.to_thread(run_cli, *args, env={**clean, **(env or {})})
    return Done(done.returncode, done.stdout, done.stderr)


@dataclass
class Services:
    dsn: str
    forward: Store
    ledger_store: Store
    ledger: RunningLedger
    relay: RunningRelay

    def stores(self) -> list[str]:
        """--dsn and one --schema per service."""
        return [
            "--dsn", self.dsn, "--schema", self.forward.schema, "--schema", self.ledger_store.schema
        ]  # fmt: skip


@pytest.fixture
async def services(pg_dsn: str, store: Store) -> AsyncIterator[Services]:
    # ``store`` (the session's) has created the ledger's business table.
    async with (
        fresh_store(pg_dsn, "insp_fwd") as forward,
        fresh_store(pg_dsn, "insp_ledger") as ledger_store,
        running_ledger(ledger_store) as ledger,
        running_relay(forward, ledger.address) as relay,
    ):
        yield Services(pg_dsn, forward, ledger_store, ledger, relay)


async def forward(s: Services, key: str, tenant: str) -> testsvc_pb2.ForwardResponse:
    request = testsvc_pb2.ForwardRequest(account=fresh("acct"), mode="post")
    response: testsvc_pb2.ForwardResponse = await s.relay.stub.Forward(
        request, metadata=metadata(key, tenant)
    )
    return response


def step_of(operation: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any]
    (found,) = [s for s in operation["steps"] if s["step"] == name]
    return found


async def test_inspect_shows_the_operation_its_child_key_and_the_child_in_the_other_store(
    services: Services,
) -> None:
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    response = await forward(services, key, tenant)

    done = await cli("inspect", *services.stores(), "--proto-module", MODULE,
                     "--scope", scope, key, "--json")  # fmt: skip

    assert done.returncode == 0, done.stderr
    report = done.json()
    assert report["found"] is True
    (op,) = report["operations"]
    assert op["service"] == services.forward.schema
    assert (op["scope"], op["key"], op["method"]) == (scope, key, FORWARD)
    assert op["state"] == "completed" and op["status_code"] == 0
    assert op["claims"] == 1 and op["lease"] is None and op["expired"] is False
    assert op["response"]["type"] == "testsvc.v1.ForwardResponse"
    assert op["response"]["decoded"]["entry_id"] == str(response.entry_id)  # int64: a string
    assert op["response"]["decoded"]["execution_nonce"] == response.execution_nonce
    assert op["steps_known"] is True

    post = step_of(op, "post-ledger.v1")
    assert post["key"] == child_key(scope, key, "post-ledger.v1")
    assert post["call"] == POST and post["in_effect"] is True
    assert post["looked_in"] == [services.forward.schema, services.ledger_store.schema]
    (child,) = post["records"]
    assert child["service"] == services.ledger_store.schema
    assert (child["method"], child["state"], child["key"]) == (POST, "completed", post["key"])
    assert child["response"]["decoded"]["entry_id"] == str(response.entry_id)
    # The steps this run did not take derive keys that reached nothing.
    for other in ("post-phased-a.v1", "post-phased-b.v1"):
        assert step_of(op, other)["records"] == []
    assert op["totals"]["effects_by_step"] == {
        "post-ledger.v1": 1, "post-phased-a.v1": 0, "post-phased-b.v1": 0
    }  # fmt: skip
    assert op["totals"]["duplicates"] == []

    # The same facts as a tree.
    tree = await cli("inspect", *services.stores(), "--proto-module", MODULE, "--scope", scope, key)
    assert tree.returncode == 0, tree.stderr
    text = tree.stdout
    assert f"{FORWARD}  completed OK  [{services.forward.schema}]" in text
    assert f"{POST}  completed OK  [{services.ledger_store.schema}]" in text
    assert f"step post-ledger.v1 -> {POST}" in text
    assert f"key {post['key']}" in text
    assert f'entry_id: "{response.entry_id}"' in text
    assert "effects: post-ledger.v1 x1, post-phased-a.v1 x0, post-phased-b.v1 x0" in text


async def test_one_store_reached_through_two_dsns_is_not_a_duplicated_effect(
    services: Services,
) -> None:
    """Services with roles of their own on one database (and schema) give it under two DSNs,
    as a config with a section per service does: each record was read once per DSN, and the
    child's two readings of one row were reported as its step reaching two records, the
    double-execution alarm (DUPLICATED, exit 4)."""
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    await forward(services, key, tenant)
    separator = "&" if "?" in services.dsn else "?"
    other = f"{services.dsn}{separator}application_name=payments"  # another role, in real life
    forward_schema, ledger_schema = services.forward.schema, services.ledger_store.schema
    stores = ["--dsn", services.dsn, "--dsn", other, "--dsn", services.dsn,
              "--schema", forward_schema, "--schema", ledger_schema, "--schema", ledger_schema]  # fmt: skip

    done = await cli("inspect", *stores, "--proto-module", MODULE, "--scope", scope, key, "--json")

    assert done.returncode == 0, done.stdout + done.stderr
    (op,) = done.json()["operations"]
    (child,) = step_of(op, "post-ledger.v1")["records"]
    assert child["key"] == child_key(scope, key, "post-ledger.v1")
    assert op["totals"]["duplicates"] == []
    assert op["totals"]["effects_by_step"]["post-ledger.v1"] == 1
    # Nor is the child's operation, inspected itself, one recorded in two stores.
    child_op = await cli("inspect", *stores, "--scope", scope, child["key"], "--json")
    assert child_op.returncode == 0, child_op.stdout + child_op.stderr
    assert child_op.json()["duplicated"] == [] and len(child_op.json()["operations"]) == 1


async def test_one_operation_recorded_in_two_stores_is_duplicated(
    services: Services, pg_dsn: str
) -> None:
    """A key of one method with a record in two stores ran there twice: a tenant's retry that
    reached another shard (a placement that moved it, or differs by replica) found no record
    and ran the handler again. inspect showed the two trees and exited 0, with nothing in the
    summary: the "was I charged twice?" question answered "no" to a script. Another method's
    record under the key, in a third store, is another operation: not named."""
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    request = testsvc_pb2.PostRequest(account=fresh("acct"), amount=5)
    async with (
        fresh_store(pg_dsn, "insp_shard") as shard,
        running_ledger(shard) as other,
        fresh_store(pg_dsn, "insp_events") as events,
        running_ledger(events) as third,
    ):
        await services.ledger.stub.Post(request, metadata=metadata(key, tenant))
        await other.stub.Post(request, metadata=metadata(key, tenant))
        await third.stub.PostWithEvent(request, metadata=metadata(key, tenant))
        argv = ["inspect", "--dsn", pg_dsn, "--schema", services.ledger_store.schema,
                "--schema", shard.schema, "--schema", events.schema, "--scope", scope, key]  # fmt: skip

        tree = await cli(*argv)
        report = await cli(*argv, "--json")

    assert tree.returncode == 4, tree.stdout + tree.stderr
    (line,) = [ln for ln in tree.stdout.splitlines() if ln.startswith("DUPLICATED")]
    assert line == (
        f"DUPLICATED: {POST} recorded in {services.ledger_store.schema}, {shard.schema}:"
        " the operation was claimed in each store"
    ), tree.stdout
    assert report.returncode == 4
    assert report.json()["duplicated"] == [POST]


async def test_steps_below_depth_are_not_looked_up_rather_than_counted_as_no_effect(
    services: Services,
) -> None:
    """``--depth 0`` never looks up the operation's child keys: the report must say so, not
    answer "was it charged?" with "x0" / "nothing under" for keys it did not check."""
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    await forward(services, key, tenant)  # post-ledger.v1 did reach a record
    steps = ["post-ledger.v1", "post-phased-a.v1", "post-phased-b.v1"]
    args = ("inspect", *services.stores(), "--proto-module", MODULE, "--scope", scope, key)

    done = await cli(*args, "--depth", "0", "--json")

    assert done.returncode == 0, done.stderr
    report = done.json()
    (op,) = report["operations"]
    assert op["totals"]["effects_by_step"] == {}  # not {"post-ledger.v1": 0, ...}
    assert op["totals"]["missing"] == []
    assert op["totals"]["not_looked_up"] == steps
    assert report["depth"] == 0
    for name in steps:
        step = step_of(op, name)
        assert step["looked_up"] is False
        assert step["looked_in"] == [] and step["records"] == []

    tree = await cli(*args, "--depth", "0")
    assert tree.returncode == 0, tree.stderr
    assert " x0" not in tree.stdout and "nothing under" not in tree.stdout, tree.stdout
    assert "effects: none" in tree.stdout
    assert f"not looked up (below --depth 0): {', '.join(steps)}" in tree.stdout
    assert tree.stdout.count("not looked up (below --depth 0)") == len(steps) + 1

    # One level down, the same steps are looked up and counted (the child has no steps).
    deeper = (await cli(*args, "--depth", "1", "--json")).json()
    (op,) = deeper["operations"]
    assert step_of(op, "post-ledger.v1")["looked_up"] is True
    assert op["totals"]["effects_by_step"] == {
        "post-ledger.v1": 1, "post-phased-a.v1": 0, "post-phased-b.v1": 0
    }  # fmt: skip
    assert op["totals"]["not_looked_up"] == []


async def test_a_descriptor_set_decodes_and_declares_steps_without_the_module(
    services: Services, tmp_path: Path
) -> None:
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    response = await forward(services, key, tenant)
    image = tmp_path / "testsvc.binpb"
    protoc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{ROOT / 'tests' / 'protos'}", f"-I{ROOT / 'src' / 'grpc_idempotency' / '_proto'}",
        "--include_imports", f"--descriptor_set_out={image}", "testsvc/v1/testsvc.proto",
    )  # fmt: skip
    assert await protoc.wait() == 0

    done = await cli("inspect", *services.stores(), "--descriptor-set", str(image),
                     "--scope", scope, key, "--json")  # fmt: skip

    assert done.returncode == 0, done.stderr
    (op,) = done.json()["operations"]
    assert op["response"]["decoded"]["execution_nonce"] == response.execution_nonce
    (child,) = step_of(op, "post-ledger.v1")["records"]
    assert child["response"]["decoded"]["entry_id"] == str(response.entry_id)


async def test_without_descriptors_the_response_is_shown_as_bytes(services: Services) -> None:
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    await forward(services, key, tenant)
    stored = bytes(
        await services.forward.pool.fetchval(
            f'SELECT response FROM "{services.forward.schema}".records'
            " WHERE scope = $1 AND key = $2",
            scope,
            key,
        )
    )

    done = await cli("inspect", *services.stores(), "--scope", scope, key, "--json")

    assert done.returncode == 0, done.stderr
    (op,) = done.json()["operations"]
    assert op["steps_known"] is False and op["steps"] == []
    shown = op["response"]
    assert shown["size"] == len(stored) and "decoded" not in shown
    assert shown["hex_prefix"] == stored[:32].hex()
    assert base64.b64decode(shown["base64_prefix"]) == stored[:32]
    assert "--proto-module" in shown["undecoded"]
    tree = await cli("inspect", *services.stores(), "--scope", scope, key)
    assert tree.returncode == 0, tree.stderr
    assert f"({len(stored)} bytes, not decoded" in tree.stdout
    assert f"hex {stored[:32].hex()}" in tree.stdout
    assert "steps unknown" in tree.stdout


async def test_outbox_rows_and_recorded_errors(services: Services) -> None:
    tenant = fresh("tenant")
    scope = f"tenant:{tenant}"
    stub = services.ledger.stub
    event_key, error_key = fresh(), fresh()
    posted = await stub.PostWithEvent(
        testsvc_pb2.PostRequest(account=fresh("acct"), amount=7),
        metadata=metadata(event_key, tenant),
    )
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.Post(
            testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="rich"),
            metadata=metadata(error_key, tenant),
        )
    assert failed.value.code() is grpc.StatusCode.NOT_FOUND

    done = await cli("inspect", *services.stores(), "--proto-module", MODULE,
                     "--scope", scope, event_key, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (op,) = done.json()["operations"]
    assert op["service"] == services.ledger_store.schema
    event = step_of(op, "entry-posted.v1")
    assert event["kind"] == "outbox" and event["key"] == child_key(
        scope, event_key, "entry-posted.v1"
    )
    (row,) = event["outbox"]
    assert (row["key"], row["state"], row["attempts"]) == (event["key"], "pending", 0)
    assert row["payload"]["type"] == "testsvc.v1.PostResponse"
    assert row["payload"]["decoded"]["entry_id"] == str(posted.entry_id)
    assert op["totals"]["effects_by_step"] == {"entry-posted.v1": 1}

    done = await cli("inspect", *services.stores(), "--proto-module", MODULE,
                     "--scope", scope, error_key, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (op,) = done.json()["operations"]
    assert op["state"] == "error" and op["response"] is None
    assert op["error"]["code"] == "NOT_FOUND"
    assert op["error"]["message"] == "no such account"
    (detail,) = op["error"]["details"]
    assert detail["@type"].endswith("google.rpc.ErrorInfo")
    assert detail["reason"] == "ACCOUNT_MISSING"
    tree = await cli("inspect", *services.stores(), "--scope", scope, error_key)
    assert "recorded error: NOT_FOUND: no such account" in tree.stdout


FORGED = "x\n\x1b[1A\x1b[2K/testsvc.v1.LedgerService/Post  completed OK\x9b\x7f"


async def test_stored_error_text_cannot_add_or_overwrite_lines_of_the_output(
    services: Services,
) -> None:
    """A recorded error's message and a delivery's last error are text a client or a downstream
    chose (a handler echoing a request field). Printed raw, a newline added a line to the tree
    and ESC [ 1 A moved a terminal's cursor up to overwrite one: a recorded error could be made
    to read "completed OK". Both are printed with their control characters escaped."""
    tenant = fresh("tenant")
    scope = f"tenant:{tenant}"
    error_key, event_key = fresh(), fresh()
    with pytest.raises(grpc.aio.AioRpcError):
        await services.ledger.stub.Post(
            testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="rich"),
            metadata=metadata(error_key, tenant),
        )
    await services.ledger.stub.PostWithEvent(
        testsvc_pb2.PostRequest(account=fresh("acct"), amount=7),
        metadata=metadata(event_key, tenant),
    )
    ledger = services.ledger_store
    await ledger.pool.execute(
        f'UPDATE "{ledger.schema}".records SET status_message = $1 WHERE key = $2',
        FORGED,
        error_key,
    )
    await ledger.pool.execute(
        f"UPDATE \"{ledger.schema}\".outbox SET state = 'dead', last_error = $1", FORGED
    )

    tree = await cli("inspect", *services.stores(), "--scope", scope, error_key)
    assert tree.returncode == 0, tree.stderr
    (line,) = [ln for ln in tree.stdout.splitlines() if "recorded error" in ln]
    assert line.endswith(
        "recorded error: NOT_FOUND: x\\n\\x1b[1A\\x1b[2K/testsvc.v1.LedgerService/Post"
        "  completed OK\\x9b\\x7f"
    ), line
    events = await cli("inspect", *services.stores(), "--scope", scope, event_key)
    assert events.returncode == 0, events.stderr
    for out in (tree.stdout, events.stdout):
        assert not any(c in out for c in "\x1b\x9b\x7f"), out
    (line,) = [ln for ln in events.stdout.splitlines() if "last error" in ln]
    assert line.endswith("last error: x\\n\\x1b[1A\\x1b[2K/testsvc.v1.LedgerService/Post"
                         "  completed OK\\x9b\\x7f"), line  # fmt: skip

    dead = await cli("outbox", "dead", "--dsn", services.dsn, "--schema", ledger.schema)
    assert dead.returncode == 0, dead.stderr
    assert "\x1b" not in dead.stdout and "x \\x1b[1A\\x1b[2K" in dead.stdout, dead.stdout


async def test_a_payload_of_a_well_known_type_or_of_another_type_than_declared_is_shown(
    services: Services,
) -> None:
    """The JSON form of some well-known types is no object (an Int64Value's is a string): the
    tree stopped with a traceback on such a payload. And bytes read with a descriptor that does
    not declare them (another type than the one stored) showed as that type's defaults, decoded
    cleanly: here a charge id, stored as a StringValue, read as an Int64Value of 0."""
    from google.protobuf import wrappers_pb2

    tenant = fresh("tenant")
    scope = f"tenant:{tenant}"
    key = fresh()
    await services.ledger.stub.PostWithEvent(
        testsvc_pb2.PostRequest(account=fresh("acct"), amount=7), metadata=metadata(key, tenant)
    )
    stored = wrappers_pb2.StringValue(value="ch_123").SerializeToString()
    ledger = services.ledger_store
    await ledger.pool.execute(
        f"UPDATE \"{ledger.schema}\".outbox SET payload_type = 'google.protobuf.Int64Value',"
        " payload = $1 WHERE scope = $2",
        stored,
        scope,
    )
    argv = ["inspect", *services.stores(), "--proto-module", MODULE,
            "--proto-module", "google.protobuf.wrappers_pb2", "--scope", scope, key]  # fmt: skip

    tree = await cli(*argv)

    assert tree.returncode == 0, tree.stderr
    lines = tree.stdout.splitlines()
    (at,) = [i for i, ln in enumerate(lines) if "payload google.protobuf.Int64Value" in ln]
    assert lines[at].endswith(f"({len(stored)} bytes)"), lines[at]
    undeclared = f"{len(stored)} of its bytes hold fields google.protobuf.Int64Value does not"
    assert undeclared in lines[at + 1], tree.stdout
    assert lines[at + 2].endswith('  "0"'), tree.stdout
    (op,) = (await cli(*argv, "--json")).json()["operations"]
    (row,) = step_of(op, "entry-posted.v1")["outbox"]
    assert row["payload"]["decoded"] == "0"
    assert row["payload"]["undeclared_bytes"] == len(stored)


async def test_a_dead_letters_scope_cannot_add_or_overwrite_lines_of_the_output(
    services: Services,
) -> None:
    """A scope is text a client may choose too: ``MetadataScope`` takes the tenant header as a
    raw HTTP/2 client sent it, control characters included (gRPC clients refuse to send them;
    the server passes them on). ``outbox dead`` printed a dead letter's scope raw."""
    tenant = fresh("tenant")
    await services.ledger.stub.PostWithEvent(
        testsvc_pb2.PostRequest(account=fresh("acct"), amount=7),
        metadata=metadata(fresh(), tenant),
    )
    ledger = services.ledger_store
    forged = f"tenant:{tenant}{FORGED}"
    await ledger.pool.execute(
        f"UPDATE \"{ledger.schema}\".outbox SET state = 'dead', scope = $1 WHERE scope = $2",
        forged,
        f"tenant:{tenant}",
    )
    dead = await cli("outbox", "dead", "--dsn", services.dsn, "--schema", ledger.schema)
    assert dead.returncode == 0, dead.stderr
    assert not any(c in dead.stdout for c in "\x1b\x9b\x7f"), dead.stdout
    assert f"(tenant:{tenant}x\\n\\x1b[1A\\x1b[2K/testsvc" in dead.stdout, dead.stdout


async def test_an_operation_in_progress_shows_its_lease(services: Services) -> None:
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    ledger = services.ledger
    call = asyncio.ensure_future(
        ledger.stub.PostPhased(
            testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="wait"),
            metadata=metadata(key, tenant),
        )
    )
    try:
        await asyncio.wait_for(ledger.service.started.wait(), 10)

        done = await cli("inspect", *services.stores(), "--scope", scope, key, "--json")
        assert done.returncode == 0, done.stderr
        (op,) = done.json()["operations"]
        assert op["state"] == "in_progress" and op["completed_at"] is None
        assert op["lease"] is not None and op["lease"]["locked_until"] is not None
        assert op["lease"]["released"] is False
        listed = await cli("list", "--dsn", services.dsn, "--schema", services.ledger_store.schema,
                           "--scope", scope, "--state", "in_progress", "--json")  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert [json.loads(line)["key"] for line in listed.stdout.splitlines()] == [key]
        # A running claim's row is not marked as one whose lease ran out.
        table = await cli(*_list_argv(services, scope))
        (row,) = [ln for ln in table.stdout.splitlines() if key in ln]
        assert row.startswith("in_progress") and row.endswith(key), row
    finally:
        ledger.service.release.set()
        await call


def _list_argv(services: Services, scope: str) -> list[str]:
    """``list`` of ``scope`` in the ledger's store."""
    return [
        "list",
        "--dsn",
        services.dsn,
        "--schema",
        services.ledger_store.schema,
        "--scope",
        scope,
    ]


async def test_a_claim_released_by_a_failed_attempt_is_shown_released_not_as_a_running_one(
    services: Services,
) -> None:
    """A phased attempt that fails transiently releases its claim (the row stays, its lease
    ended at the operation's start). inspect showed it as an operation whose lease had run out
    ("run out: a retry takes it over", as for an owner that died) and list as in_progress with
    nothing more: the operator could not tell a failed attempt from a dead or running one."""
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await services.ledger.stub.PostPhased(
            testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="UNAVAILABLE"),
            metadata=metadata(key, tenant),
        )
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE

    shown = await cli("inspect", *services.stores(), "--scope", scope, key)
    assert shown.returncode == 0, shown.stderr
    assert "lease: released: the last attempt failed or its client left" in shown.stdout
    assert "recording nothing; a retry runs it again" in shown.stdout, shown.stdout
    assert "run out" not in shown.stdout, shown.stdout
    done = await cli("inspect", *services.stores(), "--scope", scope, key, "--json")
    (op,) = done.json()["operations"]
    assert (op["state"], op["lease"]["released"], op["lease"]["expired"]) == (
        "in_progress",
        True,
        True,
    )
    base = _list_argv(services, scope)
    listed = await cli(*base, "--json")
    (record,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert record["lease"]["released"] is True
    table = await cli(*base)
    (row,) = [ln for ln in table.stdout.splitlines() if key in ln]
    assert row.endswith(f"{key}  (released)"), row  # not also "(lease run out)"


async def _claim_left_behind(services: Services, times: str) -> tuple[str, str]:
    """A phased operation's record made into a claim its owner left behind (in progress, no
    outcome) with ``times`` (an SQL SET list); its scope and key."""
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    store = services.ledger_store
    await services.ledger.stub.PostPhased(
        testsvc_pb2.PostRequest(account=fresh("acct")), metadata=metadata(key, tenant)
    )
    await store.pool.execute(
        f"UPDATE {store.schema}.records SET state = 'in_progress', completed_at = NULL,"
        f" response = NULL, status_code = NULL, {times} WHERE scope = $1 AND key = $2",
        scope,
        key,
    )
    return scope, key


async def test_an_abandoned_claim_past_its_lease_and_retention_shows_as_expired(
    services: Services,
) -> None:
    """Such a claim is a new key for another request (migration 0014), and the same request
    continues it: inspect and list said it was in progress, to be taken over by a retry of the
    same request only."""
    # As a claim left behind looks: its owner gone before completing, lease and retention over.
    scope, key = await _claim_left_behind(
        services,
        "locked_until = clock_timestamp() - interval '1 second',"
        " expires_at = clock_timestamp() - interval '1 second'",
    )
    store = services.ledger_store
    shown = await cli("inspect", *services.stores(), "--scope", scope, key)
    assert shown.returncode == 0, shown.stderr
    assert (
        "past its retention: the same request takes it over, continuing its operation;"
        " another request starts a new one"
    ) in shown.stdout
    listed = await cli("list", "--dsn", services.dsn, "--schema", store.schema,
                       "--scope", scope, "--json")  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    (record,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert record["key"] == key and record["expired"] is True


async def test_list_tells_a_claim_whose_lease_ran_out_from_a_running_one(
    services: Services,
) -> None:
    """A phased owner that died leaves its claim in progress until its lease runs out; then
    nothing runs it and a retry takes it over. list's table showed it as it shows a running
    one ("in_progress", nothing more): an operator looking for a stuck charge saw it running."""
    # As a dead owner's claim looks once its lease ran out, within its retention (a lease
    # granted ends after the operation's start; a released one, at it).
    scope, key = await _claim_left_behind(
        services,
        "created_at = clock_timestamp() - interval '1 minute',"
        " locked_until = clock_timestamp() - interval '1 second'",
    )

    table = await cli(*_list_argv(services, scope))

    assert table.returncode == 0, table.stderr
    (row,) = [ln for ln in table.stdout.splitlines() if key in ln]
    assert row.startswith("in_progress") and row.endswith(f"{key}  (lease run out)"), row


async def test_a_released_claim_past_its_retention_is_continued_by_the_same_request(
    pg_dsn: str, store: Store
) -> None:
    """A phased call fails transiently (its claim released, the lease ended) and its retention
    runs out. inspect said "any request under the key starts anew"; the same request retried
    continues the operation (its start kept, so the step versions it keyed with: migration
    0016's claim), as the README's table says. Only another request starts a new one."""
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    short = {POST_PHASED: MethodOverride(retention=timedelta(seconds=1))}
    request = testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="flaky:1")
    async with (
        fresh_store(pg_dsn, "insp_ret") as ledger_store,
        running_ledger(ledger_store, overrides=short) as ledger,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as flaky:
            await ledger.stub.PostPhased(request, metadata=metadata(key, tenant))
        assert flaky.value.code() is grpc.StatusCode.UNAVAILABLE, flaky.value
        records = f"{ledger_store.schema}.records"
        started = await ledger_store.pool.fetchval(
            f"SELECT created_at FROM {records} WHERE scope = $1 AND key = $2", scope, key
        )

        async def past_retention() -> bool:
            return bool(
                await ledger_store.pool.fetchval(
                    f"SELECT state = 'in_progress' AND locked_until <= clock_timestamp()"
                    f" AND expires_at <= clock_timestamp() FROM {records}"
                    " WHERE scope = $1 AND key = $2",
                    scope,
                    key,
                )
            )

        await until("the released claim's retention to run out", past_retention)
        stores = ["--dsn", pg_dsn, "--schema", ledger_store.schema]
        shown = await cli("inspect", *stores, "--scope", scope, key)
        assert shown.returncode == 0, shown.stderr
        assert "any request under the key starts anew" not in shown.stdout, shown.stdout
        assert (
            "past its retention: the same request takes it over, continuing its operation;"
            " another request starts a new one"
        ) in shown.stdout, shown.stdout

        # What the same request does: it continues the operation (its start is kept).
        await ledger.stub.PostPhased(request, metadata=metadata(key, tenant))
        row = await ledger_store.pool.fetchrow(
            f"SELECT state, fencing_token, created_at FROM {records} WHERE scope = $1 AND key = $2",
            scope,
            key,
        )
        assert row is not None
        assert (row["state"], row["fencing_token"], row["created_at"]) == (
            "completed",
            2,
            started,
        ), row


async def test_list_filters_by_state_and_method(services: Services) -> None:
    tenant = fresh("tenant")
    scope = f"tenant:{tenant}"
    stub = services.ledger.stub
    ok_keys = [fresh(), fresh()]
    for key in ok_keys:
        await stub.Post(
            testsvc_pb2.PostRequest(account=fresh("acct")), metadata=metadata(key, tenant)
        )
    error_key = fresh()
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Post(
            testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="NOT_FOUND"),
            metadata=metadata(error_key, tenant),
        )
    event_key = fresh()
    await stub.PostWithEvent(
        testsvc_pb2.PostRequest(account=fresh("acct")), metadata=metadata(event_key, tenant)
    )
    base = _list_argv(services, scope)

    async def keys(*extra: str) -> tuple[int, list[dict[str, Any]]]:
        done = await cli(*base, "--json", *extra)
        assert done.returncode in (0, 3), done.stderr
        return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]

    code, every = await keys()
    assert code == 0
    # Newest first.
    assert [r["key"] for r in every] == [event_key, error_key, *reversed(ok_keys)]
    assert {r["state"] for r in every} == {"completed", "error"}
    _, errors = await keys("--state", "error")
    assert [(r["key"], r["status_code"]) for r in errors] == [(error_key, 5)]
    _, completed = await keys("--state", "completed", "--method", POST)
    assert [r["key"] for r in completed] == list(reversed(ok_keys))
    _, limited = await keys("--limit", "1")
    assert [r["key"] for r in limited] == [event_key]
    code, none = await keys("--state", "in_progress")
    assert (code, none) == (3, [])
    # A method the scope has no record of, while it has others': it said "no records under
    # S", as if the scope were empty.
    for state, said in [((), ""), (("--state", "error"), " in state error")]:
        other = await cli(*base, "--method", POST_PHASED, *state)
        assert (other.returncode, other.stdout) == (
            3,
            f"no records of method {POST_PHASED} under {scope}{said}\n",
        ), other.stderr

    # A method past the method column's 40 characters, as a service's full name makes one.
    long_method = "/shop.payments.v1.PaymentAuthorizationService/AuthorizeAndCapture"
    store = services.ledger_store
    await store.pool.execute(
        f"UPDATE {store.schema}.records SET method = $3 WHERE scope = $1 AND key = $2",
        scope,
        event_key,
        long_method,
    )
    table = await cli(*base)
    assert table.returncode == 0, table.stderr
    assert "error NOT_FOUND" in table.stdout and error_key in table.stdout
    assert "4 record(s)" in table.stdout
    # Each row's values under their headings: "error NOT_FOUND", wider than the state column
    # was, pushed its row's claims under "started" and its method and key along with them, and
    # the long method its row's key.
    header, *rows = table.stdout.splitlines()[:-1]
    claims_end, key_at = header.index("claims") + len("claims"), header.index("key")
    assert [(r[claims_end - 1 : claims_end + 1], r[key_at:]) for r in rows] == [
        ("1 ", key) for key in (event_key, error_key, *reversed(ok_keys))
    ], table.stdout
    empty = await cli("list", "--dsn", services.dsn, "--schema", services.ledger_store.schema,
                      "--scope", "tenant:nobody-" + fresh())  # fmt: skip
    assert empty.returncode == 3 and "no records under" in empty.stdout


async def test_list_reads_no_stored_response_status_message_or_details(
    services: Services,
) -> None:
    """``list`` prints none of them, yet read them all: every listed record's stored response
    (up to max_response_bytes each, 1 MiB unless raised) came over the wire and was held at
    once (40 records of 4 MiB: 206 MB of memory instead of 62). A role that may read every
    column but those lists exactly what the store's owner lists; it was refused (exit 2)."""
    tenant = fresh("tenant")
    scope = f"tenant:{tenant}"
    stub = services.ledger.stub
    await stub.Post(
        testsvc_pb2.PostRequest(account=fresh("acct")), metadata=metadata(fresh(), tenant)
    )
    with pytest.raises(grpc.aio.AioRpcError):  # a recorded error: a status message and code
        await stub.Post(
            testsvc_pb2.PostRequest(account=fresh("acct"), behaviour="NOT_FOUND"),
            metadata=metadata(fresh(), tenant),
        )
    schema = services.ledger_store.schema
    role = "lister_" + uuid.uuid4().hex[:8]
    pool = services.ledger_store.pool
    columns = await pool.fetch(
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = $1 AND table_name = 'records'",
        schema,
    )
    readable = [c["column_name"] for c in columns]
    unread = {"response", "status_message", "status_details"}
    assert unread < set(readable)
    try:
        await pool.execute(f"CREATE ROLE {role} LOGIN")
        await pool.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        await pool.execute(f'GRANT SELECT ON "{schema}".schema_migrations TO {role}')
        kept = ", ".join(f'"{c}"' for c in readable if c not in unread)
        await pool.execute(f'GRANT SELECT ({kept}) ON "{schema}".records TO {role}')
        as_role = services.dsn.replace("postgres@", f"{role}@", 1)
        assert as_role != services.dsn
        for output in ([], ["--json"]):
            argv = ["list", "--schema", schema, "--scope", scope, *output]
            owner, lister = (
                await cli(*argv, "--dsn", services.dsn),
                await cli(*argv, "--dsn", as_role),
            )
            assert (lister.returncode, lister.stderr) == (0, ""), lister.stderr
            assert owner.returncode == 0, owner.stderr
            if output:  # the same records, read at another time
                assert [
                    {**json.loads(line), "read_at": None} for line in lister.stdout.splitlines()
                ] == [{**json.loads(line), "read_at": None} for line in owner.stdout.splitlines()]
            else:
                assert lister.stdout == owner.stdout and "error NOT_FOUND" in owner.stdout
    finally:
        await pool.execute(f"DROP OWNED BY {role}")
        await pool.execute(f"DROP ROLE {role}")


async def test_a_config_file_names_the_services(services: Services, tmp_path: Path) -> None:
    key, tenant = fresh(), fresh("tenant")
    scope = f"tenant:{tenant}"
    response = await forward(services, key, tenant)
    config = tmp_path / "inspect.toml"
    config.write_text(
        f"""
proto_modules = ["{MODULE}"]

[services.relay]
dsn_env = "INSPECT_TEST_DSN"
schema = "{services.forward.schema}"

[services.ledger]
dsn_env = "INSPECT_TEST_DSN"
schema = "{services.ledger_store.schema}"
"""
    )
    done = await cli("inspect", "--config", str(config), "--scope", scope, key, "--json",
                     env={"INSPECT_TEST_DSN": services.dsn})  # fmt: skip
    assert done.returncode == 0, done.stderr
    (op,) = done.json()["operations"]
    assert op["service"] == "relay"
    (child,) = step_of(op, "post-ledger.v1")["records"]
    assert child["service"] == "ledger"
    assert child["response"]["decoded"]["entry_id"] == str(response.entry_id)

    unset = await cli("inspect", "--config", str(config), "--scope", scope, key)
    assert unset.returncode == 2 and "INSPECT_TEST_DSN" in unset.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[services.relay\n")
    bad = await cli("inspect", "--config", str(broken), "--scope", scope, key)
    assert bad.returncode == 2 and "not valid TOML" in bad.stderr


async def test_services_sharing_a_schema_each_keep_their_scope(
    pg_dsn: str, store: Store, tmp_path: Path
) -> None:
    """Two services on one database and schema (one DSN), the downstream one recording its
    caller's calls under a scope of its own (its mTLS identity, say), as the config's ``scope``
    says: the config kept one section per DSN and schema, the first, and dropped the other's
    scope with it, so the child was looked up under the caller's scope only and shown as never
    made (``x0``)."""
    async with (
        fresh_store(pg_dsn, "insp_shared") as shared,
        running_ledger(shared, scope=StaticScope("relay-identity")) as ledger,
        running_relay(shared, ledger.address) as relay,
    ):
        key, tenant = fresh(), fresh("tenant")
        scope = f"tenant:{tenant}"
        request = testsvc_pb2.ForwardRequest(account=fresh("acct"), mode="post")
        await relay.stub.Forward(request, metadata=metadata(key, tenant))
        config = tmp_path / "inspect.toml"
        config.write_text(
            f"""
proto_modules = ["{MODULE}"]

[services.relay]
dsn_env = "INSPECT_TEST_DSN"
schema = "{shared.schema}"

[services.ledger]
dsn_env = "INSPECT_TEST_DSN"
schema = "{shared.schema}"
scope = "relay-identity"
"""
        )
        done = await cli("inspect", "--config", str(config), "--scope", scope, key, "--json",
                         env={"INSPECT_TEST_DSN": pg_dsn})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (op,) = done.json()["operations"]
    (child,) = step_of(op, "post-ledger.v1")["records"]
    assert (child["service"], child["scope"]) == ("ledger", "relay-identity")
    assert op["totals"]["effects_by_step"]["post-ledger.v1"] == 1


async def test_a_child_recorded_under_another_scope_is_not_reported_as_a_step_never_taken(
    pg_dsn: str, store: Store
) -> None:
    """A downstream that scopes its callers by their identity (the default, mTLS) records a
    parent's step calls under the parent service's scope, not the end caller's. Looked up with
    --dsn/--schema alone, the child is not under the inspected scope: the summary said only
    "steps the handler did not take, or whose store is not configured", and an operator asking
    "was it charged?" read the charge as never made. It names the scope, and the fix."""
    async with (
        fresh_store(pg_dsn, "insp_fwd") as forward_store,
        fresh_store(pg_dsn, "insp_ledger") as ledger_store,
        running_ledger(ledger_store, scope=StaticScope("relay-identity")) as ledger,
        running_relay(forward_store, ledger.address) as relay,
    ):
        key, tenant = fresh(), fresh("tenant")
        request = testsvc_pb2.ForwardRequest(account=fresh("acct"), mode="post")
        await relay.stub.Forward(request, metadata=metadata(key, tenant))
        done = await cli("inspect", "--dsn", pg_dsn, "--schema", forward_store.schema,
                         "--schema", ledger_store.schema, "--proto-module", MODULE,
                         "--scope", f"tenant:{tenant}", key)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("nothing under:")]
    assert "post-ledger.v1" in line
    assert "another scope" in line and "scope =" in line, line


async def test_exit_status_not_found_unreachable_unusable(services: Services, pg_dsn: str) -> None:
    missing = await cli("inspect", *services.stores(), "--scope", "tenant:x", fresh(), "--json")
    assert missing.returncode == 3, missing.stderr
    assert missing.json()["found"] is False and missing.json()["operations"] == []
    text = await cli("inspect", *services.stores(), "--scope", "tenant:x", "nope")
    assert text.returncode == 3 and "tenant:x nope: no record in" in text.stdout
    # "No record" alone invited running a charge again by hand.
    assert "not proof that it never ran" in text.stdout

    port = free_port()
    unreachable = await cli(
        "inspect", "--dsn", f"postgresql://u:s3cret@127.0.0.1:{port}/db", "--scope", "s", "k"
    )
    assert unreachable.returncode == 1, unreachable.stderr
    assert f"127.0.0.1:{port}" in unreachable.stderr and "s3cret" not in unreachable.stderr
    assert "store: grpc_idempotency" in unreachable.stderr

    unmigrated = await cli("inspect", "--dsn", pg_dsn, "--schema", "no_such_schema_here",
                           "--scope", "s", "k")  # fmt: skip
    assert unmigrated.returncode == 2, unmigrated.stderr
    # Not "run migrate": that makes an empty store, where every look-up finds no record.
    assert "check the schema's name" in unmigrated.stderr, unmigrated.stderr

    pairs = await cli("inspect", "--dsn", pg_dsn, "--dsn", pg_dsn, "--schema", "a", "--schema",
                      "b", "--schema", "c", "--scope", "s", "k")  # fmt: skip
    assert pairs.returncode == 2 and "paired in order" in pairs.stderr
    module = await cli("inspect", "--dsn", pg_dsn, "--proto-module", "no.such_pb2",
                       "--scope", "s", "k")  # fmt: skip
    assert module.returncode == 2 and "no.such_pb2" in module.stderr
    # Importable but no generated module (a mistyped name): taken silently, every message was
    # then shown as bytes.
    no_pb2 = await cli("inspect", "--dsn", pg_dsn, "--proto-module", "os.path",
                       "--scope", "s", "k")  # fmt: skip
    assert no_pb2.returncode == 2, no_pb2.stderr
    assert "--proto-module os.path: holds no protobuf descriptors" in no_pb2.stderr
    assert "_pb2 module" in no_pb2.stderr and "Traceback" not in no_pb2.stderr


def test_a_proto_module_that_imports_generated_modules_is_taken() -> None:
    """A _pb2_grpc module holds no DESCRIPTOR of its own but imports its _pb2 module, so it
    fills the pool too: not refused as a module without descriptors."""
    from grpc_idempotency.inspect_cli.descriptors import Descriptors

    descriptors = Descriptors(["testsvc.v1.testsvc_pb2_grpc"], [])
    assert descriptors.given


def test_a_pb2_module_whose_descriptor_name_is_taken_by_a_message_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .proto declaring a top-level message named DESCRIPTOR: its _pb2 binds the message's
    class over the file descriptor, yet importing it filled the pool: not refused."""
    from grpc_idempotency.inspect_cli.descriptors import Descriptors

    # No module among its names: only the message class tells that it filled the pool.
    (tmp_path / "hides_descriptor_pb2.py").write_text(
        "from google.protobuf.empty_pb2 import Empty as DESCRIPTOR\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Descriptors(["hides_descriptor_pb2"], []).given


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("inspect", "--scope", "tenant:x", ""), "idempotency key is empty"),
        (("inspect", "--scope", "tenant:x", "has space"), "must be visible ASCII"),
        (("inspect", "--scope", "tenant:x", "k" * 256), "longer than 255"),
        (("inspect", "--scope", "", "k"), "a scope is never empty"),
        (("inspect", "--scope", "s" * 1025, "k"), "at most 1024 bytes"),
        (("list", "--scope", ""), "a scope is never empty"),
        (("inspect", "--scope", "tenant:a\u2028b", "k"), "holds U+2028"),
        (("list", "--scope", "tenant:\u200bab"), "holds U+200B"),
        (("list", "--scope", "s", "--method", "/a.B/C/D"), "not a method"),
        (("list", "--scope", "s", "--method", "nomethod"), "not a method"),
    ],
    ids=[
        "empty-key",
        "key-space",
        "key-long",
        "empty-scope",
        "long-scope",
        "list-empty-scope",
        "scope-line-separator",
        "list-scope-zero-width-space",
        "method-three-parts",
        "method-no-service",
    ],
)
async def test_a_key_scope_or_method_no_record_can_have_is_bad_usage(
    pg_dsn: str, args: tuple[str, ...], says: str
) -> None:
    """A key the server refuses, a scope the store cannot hold or the server refuses (a
    control, line-separator or format character) and a method that is no method match no
    record: they were looked up, and answered "no record" (exit 3), as if the operation had not
    been found; a mistyped argument reads as a missing operation."""
    done = await cli(*args, "--dsn", pg_dsn)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    # Named by code point: the character itself (an ESC sequence, a newline) never printed.
    assert not any(c in done.stderr for c in "\u2028\u200b"), done.stderr


ANY_RESPONSE_PROTO = """
name: "r/v1/r.proto" package: "r.v1" dependency: "google/protobuf/any.proto" syntax: "proto3"
message_type { name: "Req" }
message_type { name: "Detail" field { name: "note" number: 1 label: LABEL_OPTIONAL
  type: TYPE_STRING json_name: "note" } }
message_type { name: "Res" field { name: "extra" number: 1 label: LABEL_OPTIONAL
  type: TYPE_MESSAGE type_name: ".google.protobuf.Any" json_name: "extra" } }
service { name: "S" method { name: "Do" input_type: ".r.v1.Req" output_type: ".r.v1.Res" } }
"""


async def test_a_response_holding_an_any_is_decoded_with_the_descriptor_set(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A google.protobuf.Any of a type declared in --descriptor-set (not in this process's
    default pool) used to crash inspect with a TypeError traceback."""
    from google.protobuf import (
        any_pb2,
        descriptor_pb2,
        descriptor_pool,
        message_factory,
        text_format,
    )
    from google.rpc import status_pb2

    files = descriptor_pb2.FileDescriptorSet()
    any_pb2.DESCRIPTOR.CopyToProto(files.file.add())
    text_format.Parse(ANY_RESPONSE_PROTO, files.file.add())
    image = tmp_path / "r.binpb"
    image.write_bytes(files.SerializeToString())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    # classes made at run time: their fields are unknown to mypy
    response: Any = message_factory.GetMessageClass(pool.FindMessageTypeByName("r.v1.Res"))()
    detail: Any = message_factory.GetMessageClass(pool.FindMessageTypeByName("r.v1.Detail"))
    response.extra.Pack(detail(note="packed"))
    unknown: Any = message_factory.GetMessageClass(pool.FindMessageTypeByName("r.v1.Res"))()
    unknown.extra.type_url = "type.googleapis.com/no.such.Type"

    async with fresh_store(pg_dsn, "insp_any") as store:
        for key, message in (("k1", response), ("k2", unknown)):
            await store.pool.execute(
                f'INSERT INTO "{store.schema}".records (scope, key, method, fingerprint, state,'
                " fencing_token, status_code, response, completed_at, expires_at)"
                " VALUES ('rv', $1, '/r.v1.S/Do', '\\x00', 'completed', 1, 0, $2,"
                " clock_timestamp(), clock_timestamp() + interval '1 hour')",
                key,
                message.SerializeToString(),
            )
        where = ["--dsn", pg_dsn, "--schema", store.schema, "--descriptor-set", str(image)]

        done = await cli("inspect", *where, "--scope", "rv", "k1", "--json")
        assert done.returncode == 0, done.stderr
        (op,) = done.json()["operations"]
        assert op["response"]["decoded"] == {
            "extra": {"@type": "type.googleapis.com/r.v1.Detail", "note": "packed"}
        }
        tree = await cli("inspect", *where, "--scope", "rv", "k1")
        assert tree.returncode == 0, tree.stderr
        assert "packed" in tree.stdout

        # A type in no descriptor given: shown as bytes, with why.
        done = await cli("inspect", *where, "--scope", "rv", "k2", "--json")
        assert done.returncode == 0, done.stderr
        (op,) = done.json()["operations"]
        assert "decoded" not in op["response"]
        assert "no.such.Type" in op["response"]["undecoded"]
        assert "Traceback" not in done.stderr

        # A recorded error's detail of a type the descriptor set declares: decoded too (it was
        # unpacked in the default pool only, and shown as its type URL and size).
        status = status_pb2.Status(code=9, message="no stock")
        status.details.add().Pack(detail(note="sku-1"))
        await store.pool.execute(
            f'INSERT INTO "{store.schema}".records (scope, key, method, fingerprint, state,'
            " fencing_token, status_code, status_message, status_details, completed_at,"
            " expires_at) VALUES ('rv', 'k3', '/r.v1.S/Do', '\\x00', 'completed', 1, 9,"
            " 'no stock', $1, clock_timestamp(), clock_timestamp() + interval '1 hour')",
            status.SerializeToString(),
        )
        done = await cli("inspect", *where, "--scope", "rv", "k3", "--json")
        assert done.returncode == 0, done.stderr
        (op,) = done.json()["operations"]
        assert op["error"]["details"] == [
            {"@type": "type.googleapis.com/r.v1.Detail", "note": "sku-1"}
        ]


async def test_steps_unknown_because_the_options_are_refused_says_so_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A method whose options this release refuses (here a field of a later release's
    options.proto) has its records' steps unknown, as the server would not read them either;
    that used to read "no descriptors for ... (--proto-module, --descriptor-set)" with its
    module given. Now the refusal is said, once for the method however many records show it."""
    from google.protobuf import descriptor_pb2

    from grpc_idempotency.v1 import options_pb2

    proto = descriptor_pb2.FileDescriptorProto(
        name="later/v1/later.proto",
        package="later.v1",
        syntax="proto3",
        dependency=["grpc_idempotency/v1/options.proto"],
    )
    proto.message_type.add(name="Req")
    method = proto.service.add(name="Later").method.add(
        name="Do", input_type=".later.v1.Req", output_type=".later.v1.Req"
    )
    later = options_pb2.MethodPolicy()
    later.MergeFromString(b"\x58\x01")  # field 11, varint 1: not in this release's MethodPolicy
    options: Any = method.options  # protoc's stubs mistype extensions
    options.Extensions[options_pb2.method].CopyFrom(later)
    # A generated module, as protoc's Python generator writes one, in a few lines.
    (tmp_path / "later_pb2.py").write_text(
        "from google.protobuf import descriptor_pool\n"
        "from grpc_idempotency.v1 import options_pb2  # noqa: F401\n"
        f"descriptor_pool.Default().AddSerializedFile({proto.SerializeToString()!r})\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    async with (
        fresh_store(pg_dsn, "insp_later_a") as one,
        fresh_store(pg_dsn, "insp_later_b") as two,
    ):
        for store in (one, two):  # the same operation seen in two services' stores
            await store.pool.execute(
                f'INSERT INTO "{store.schema}".records (scope, key, method, fingerprint, state,'
                " fencing_token, status_code, response, completed_at, expires_at)"
                " VALUES ('lv', 'k1', '/later.v1.Later/Do', '\\x00', 'completed', 1, 0, '',"
                " clock_timestamp(), clock_timestamp() + interval '1 hour')"
            )
        where = ["--dsn", pg_dsn, "--schema", one.schema, "--schema", two.schema]
        where += ["--proto-module", "later_pb2", "--scope", "lv", "k1"]

        tree = await cli("inspect", *where, env=env)
        # One method's operation in two stores ran twice: DUPLICATED (exit 4), beside the point
        # here, which is the refusal said once.
        assert tree.returncode == 4, tree.stderr
        assert "no descriptors for" not in tree.stdout
        assert tree.stdout.count("steps unknown: the method's options are refused") == 2
        assert tree.stdout.count("sets field 11 that this release") == 1, tree.stdout
        (why,) = [line for line in tree.stdout.splitlines() if "field 11" in line]
        assert "/later.v1.Later/Do" in why and "upgrade grpc-idempotency" in why

        done = await cli("inspect", *where, "--json", env=env)
        assert done.returncode == 4, done.stderr
        for op in done.json()["operations"]:
            assert op["steps_known"] is False
            assert (
                "/later.v1.Later/Do: (grpc_idempotency.v1.method) sets field 11"
                in (op["steps_refused"])
            )

        # The same from a descriptor set: its one refused method made inspect exit 2 ("bad
        # descriptor set") for any operation, where the server refuses that method alone.
        from google.protobuf import duration_pb2, timestamp_pb2

        files = descriptor_pb2.FileDescriptorSet()
        for module in (descriptor_pb2, duration_pb2, timestamp_pb2, options_pb2):
            module.DESCRIPTOR.CopyToProto(files.file.add())
        files.file.append(proto)
        image = tmp_path / "later.binpb"
        image.write_bytes(files.SerializeToString())
        from_set = ["--dsn", pg_dsn, "--schema", one.schema, "--descriptor-set", str(image)]
        tree = await cli("inspect", *from_set, "--scope", "lv", "k1")
        assert tree.returncode == 0, tree.stderr
        assert tree.stdout.count("steps unknown: the method's options are refused") == 1
        assert "sets field 11 that this release" in tree.stdout


async def test_a_scope_the_server_refuses_is_bad_usage_and_never_shown_raw(
    pg_dsn: str, store: Store
) -> None:
    """``inspect`` and ``list`` took any scope a record may be stored under: one holding an ESC
    sequence, a newline or a bidi override, which the server refuses before the store is
    touched (so no record is under it), was escaped, looked up and answered "no record" (exit
    3). It is bad usage (exit 2), the character named by its code point: not shown raw, where
    it rewrote the terminal's line or added one."""
    scope = "t\x1b[2K\rforged\nline\u202e"
    for args in (
        ("inspect", "--dsn", pg_dsn, "--schema", store.schema, "--scope", scope, "k"),
        ("list", "--dsn", pg_dsn, "--schema", store.schema, "--scope", scope),
    ):
        done = await cli(*args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout == ""
        assert "argument --scope: a scope holds no control" in done.stderr, done.stderr
        assert "U+001B" in done.stderr, done.stderr
        assert not any(c in done.stderr for c in "\x1b\r\u202e"), done.stderr
        assert "forged" not in done.stderr, done.stderr


async def test_list_pages_on_with_after_and_rows_inserted_meanwhile_move_nothing(
    pg_dsn: str, store: Store
) -> None:
    """``list`` listed the newest --limit records and no more: nothing past them could be
    listed. A page cut at --limit now ends with the cursor of the next (``--after``): the last
    record's (created_at, key), exact to the microsecond whatever the key holds, so records
    begun meanwhile, and ties on created_at, make no page repeat or skip a record."""
    scope = f"tenant:{fresh('pages')}"

    async def insert(micros: int, key: str, in_scope: str = scope) -> None:
        await store.pool.execute(
            f'INSERT INTO "{store.schema}".records (scope, key, method, fingerprint, state,'
            " fencing_token, status_code, response, created_at, completed_at, expires_at)"
            f" VALUES ($1, $2, '{POST}', '\\x00', 'completed', 1, 0, '', $3, clock_timestamp(),"
            " clock_timestamp() + interval '1 hour')",
            in_scope,
            key,
            T0 + timedelta(microseconds=micros),
        )

    # Three records begun at the same microsecond; keys with quotes, a comma, a backslash.
    for micros, key in [(9, 'k"1'), (5, "a,b"), (5, "b'c"), (5, "c\\d"), (3, "x=1"),
                        (1, "y}"), (0, "z;")]:  # fmt: skip
        await insert(micros, key)
    # Another scope's record at the cursor's microsecond, its key sorting after the cursor's:
    # the keyset is one condition ANDed with the scope, never an OR beside it.
    await insert(5, "zz", f"{scope}-other")
    base = ["list", "--dsn", pg_dsn, "--schema", store.schema, "--scope", scope, "--limit", "2"]

    async def page(*after: str) -> tuple[list[str], str | None]:
        done = await cli(*base, "--json", *after)
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        (following,) = {line["next"] for line in lines}  # the same on every line
        return [line["key"] for line in lines], following

    listed, cursor = await page()
    assert listed == ['k"1', "a,b"] and cursor is not None
    # The text listing ends with the same cursor, alone on its last line.
    text = await cli(*base)
    assert text.returncode == 0, text.stderr
    *_, counted, following = text.stdout.splitlines()
    assert counted.startswith("2 record(s), more after them;")
    assert following == f"next page: the same command with --after {cursor}"
    # Begun meanwhile: one newer than the page and one at the cursor's microsecond sorting
    # before its key (neither is listed on), one after the cursor (listed once).
    await insert(20, "new")
    await insert(5, "a,a")
    await insert(2, "mid")
    while cursor is not None:
        more, cursor = await page("--after", cursor)
        assert len(more) == 2  # eight records listed: the last page is full, and ends them
        listed += more
    order = await store.pool.fetch(
        f'SELECT key FROM "{store.schema}".records WHERE scope = $1 ORDER BY created_at DESC, key',
        scope,
    )
    assert listed == [r["key"] for r in order if r["key"] not in ("new", "a,a")]
    assert len(listed) == 8 and "mid" in listed

    last = await cli(*base, "--after", cursor_of(0, "z;", scope))
    assert (last.returncode, last.stdout) == (3, f"no records under {scope} after the cursor\n")

    valid = cursor_of(5, "a,b", scope)
    digests = b'"s":"0a1b2c3d","l":"0a1b2c3d"'
    for bad in ["not a cursor", valid[:-3], b64url(b'{"v":2}'), cursor_of(0, "\x00", scope),
                b64url(b'{"v":2,"t":99999999999999999999,"k":"a",' + digests + b"}")]:  # fmt: skip
        done = await cli(*base, "--after", bad)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert "argument --after: not a cursor" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr

    # Another listing's cursor, the scope's under a filter or another scope's, paged from a
    # place in another order. Refused before connecting: the database need not be reachable.
    nowhere = ["list", "--dsn", "postgresql://nowhere.invalid/db", "--after", valid]
    for others, says in [
        (["--scope", scope, "--method", POST], "a cursor of this scope listed with other filters"),
        (["--scope", scope, "--state", "completed"], "listed with other filters"),
        (["--scope", f"{scope}-other"], "a cursor of another scope's listing"),
    ]:
        done = await cli(*nowhere, *others)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert "argument --after: a cursor of " in done.stderr and says in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


T0 = datetime(2026, 1, 1, 0, 0, 0, 1, tzinfo=UTC)


def cursor_of(micros: int, key: str, scope: str) -> str:
    """The cursor ``list --scope scope`` prints after the record ``key`` begun ``micros`` after
    ``T0``."""
    return ListCursor.of(Listing(scope), T0 + timedelta(microseconds=micros), key).encode()
