"""The test kit catches what it is for: the conformance checks fail, saying why, on services that
are not idempotent (no interceptor; a handler writing outside the call's transaction) and pass on
the same handler written correctly, phased mode included; the plugin's fixtures serve a user's
service in an inner pytest run, and ``assert_replayed`` / ``assert_not_replayed`` tell a replay
from an execution.

The three services below are ``build_server`` functions, run by the kit in child processes
(``python -m grpc_idempotency.testing.serve tests.integration.test_testing_kit:<name>``); they
write into ``test_ledger.ledger`` (created by the session's ``store`` fixture).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import (
    IdempotencyInterceptor,
    MethodOverride,
    StaticScope,
    Store,
    current_call,
)
from grpc_idempotency.core import wire
from grpc_idempotency.testing import (
    ConformanceFailure,
    ConformancePlan,
    ConformanceTarget,
    assert_not_replayed,
    assert_replayed,
    serve,
)
from tests.support.ledger import RunningLedger, metadata, running_ledger
from tests.support.processes import running

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
POST = "/testsvc.v1.LedgerService/Post"
POST_PHASED = "/testsvc.v1.LedgerService/PostPhased"
MODULE = "tests.integration.test_testing_kit"


MAILBOX_ENV = "KIT_MAILBOX"
"""A file the emailing server appends a line to per "email" (the account), in the server's
environment."""


class KitLedger(testsvc_pb2_grpc.LedgerServiceServicer):
    """Post and PostPhased insert one ledger row; ``outside`` writes through the pool, outside
    the call's transaction (the bug the kit must catch), instead of the call's connection;
    ``mailbox`` also "sends an email" from Post directly (appends the account to the file),
    instead of through the outbox: the other bug the kit must catch, when told where to look."""

    def __init__(
        self, pool: asyncpg.Pool[Any], *, outside: bool = False, mailbox: Path | None = None
    ) -> None:
        self.pool = pool
        self.outside = outside
        self.mailbox = mailbox

    async def _insert(self, conn: Any, request: testsvc_pb2.PostRequest) -> int:
        entry_id: int = await conn.fetchval(
            "INSERT INTO test_ledger.ledger (account, amount) VALUES ($1, $2) RETURNING id",
            request.account,
            request.amount,
        )
        return entry_id

    async def Post(
        self, request: testsvc_pb2.PostRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> testsvc_pb2.PostResponse:
        if request.amount <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "amount must be positive")
        conn = self.pool if self.outside else current_call().connection
        entry_id = await self._insert(conn, request)
        if self.mailbox is not None:
            with self.mailbox.open("a") as mailbox:
                mailbox.write(request.account + "\n")
        return testsvc_pb2.PostResponse(
            entry_id=entry_id,
            account=request.account,
            amount=request.amount,
            execution_nonce=uuid.uuid4().hex,
        )

    async def PostPhased(
        self, request: testsvc_pb2.PostRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> testsvc_pb2.PostResponse:
        entry_id = await self._insert(await current_call().transaction(), request)
        return testsvc_pb2.PostResponse(entry_id=entry_id, execution_nonce=uuid.uuid4().hex)


async def _ledger_server(
    dsn: str, *, intercepted: bool, outside: bool, mailbox: Path | None = None
) -> AsyncIterator[Any]:
    store = await Store.connect(dsn, min_size=1, max_size=10)
    interceptors: list[Any] = []
    if intercepted:
        interceptors.append(
            IdempotencyInterceptor(store, services=[testsvc_pb2], scope=StaticScope("kit"))
        )
    server = grpc.aio.server(interceptors=interceptors)
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(
        KitLedger(store.pool, outside=outside, mailbox=mailbox), server
    )
    try:
        yield server
    finally:
        await store.close()


async def correct_server(dsn: str) -> AsyncIterator[Any]:
    """The handler writes through the call's connection, behind the interceptor."""
    async for server in _ledger_server(dsn, intercepted=True, outside=False):
        yield server


async def no_interceptor_server(dsn: str) -> AsyncIterator[Any]:
    """The same servicer with no IdempotencyInterceptor: every call executes."""
    async for server in _ledger_server(dsn, intercepted=False, outside=True):
        yield server


async def outside_transaction_server(dsn: str) -> AsyncIterator[Any]:
    """Behind the interceptor, but the handler writes through a pool connection of its own."""
    async for server in _ledger_server(dsn, intercepted=True, outside=True):
        yield server


async def emailing_server(dsn: str) -> AsyncIterator[Any]:
    """Written correctly for the database, but it sends its email directly."""
    mailbox = Path(os.environ[MAILBOX_ENV])
    async for server in _ledger_server(dsn, intercepted=True, outside=False, mailbox=mailbox):
        yield server


async def bare_server(dsn: str) -> Any:
    """A server with no service and no database: enough for the kit to start it."""
    return grpc.aio.server()


class _ClosedLedger(testsvc_pb2_grpc.LedgerServiceServicer):
    def __init__(self, *, logs: bool) -> None:
        self.logs = logs

    async def Post(
        self, request: testsvc_pb2.PostRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> testsvc_pb2.PostResponse:
        if self.logs:
            print("ledger: closed until the audit ends", file=sys.stderr, flush=True)
        await context.abort(grpc.StatusCode.INTERNAL, "the ledger is closed for the day")
        raise AssertionError("unreachable")


async def closed_ledger_server(dsn: str) -> Any:
    """A Post that fails every call, saying why only in its status (it logs nothing)."""
    server = grpc.aio.server()
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(_ClosedLedger(logs=False), server)
    return server


async def logging_closed_ledger_server(dsn: str) -> Any:
    """The same, but it says why on stderr too."""
    server = grpc.aio.server()
    testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(_ClosedLedger(logs=True), server)
    return server


async def hung_cleanup_server(dsn: str) -> AsyncIterator[Any]:
    """Its clean-up blocks the event loop for good: the worst server to shut down."""
    yield grpc.aio.server()
    time.sleep(3600)  # noqa: ASYNC251 - the point: nothing of the loop's can run


def _request() -> testsvc_pb2.PostRequest:
    return testsvc_pb2.PostRequest(account="kit-" + uuid.uuid4().hex, amount=5)


async def _rows(db: asyncpg.Connection[Any], request: Any) -> int:
    count: int = await db.fetchval(
        "SELECT count(*) FROM test_ledger.ledger WHERE account = $1", request.account
    )
    return count


def _plan(
    pg_dsn: str,
    tmp_path_factory: pytest.TempPathFactory,
    server: str,
    method: str = POST,
    mailbox: Path | None = None,
) -> Iterator[ConformancePlan]:
    def sent(account: str) -> int:
        assert mailbox is not None
        return mailbox.read_text().splitlines().count(account) if mailbox.exists() else 0

    async def emails(request: testsvc_pb2.PostRequest) -> int:
        return await asyncio.to_thread(sent, request.account)

    target = ConformanceTarget(
        server=f"{MODULE}:{server}",
        method=method,
        request=_request,
        count_effects=_rows,
        error_request=lambda: testsvc_pb2.PostRequest(account="kit-" + uuid.uuid4().hex),
        concurrency=4,
        server_env={MAILBOX_ENV: str(mailbox)} if mailbox is not None else {},
        count_external_effects=emails if mailbox is not None else None,
    )
    plan = ConformancePlan(target, pg_dsn, tmp_path_factory.mktemp(server))
    try:
        yield plan
    finally:
        plan.close()


@pytest.fixture(scope="module")
def correct(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConformancePlan]:
    yield from _plan(pg_dsn, tmp_path_factory, "correct_server")


@pytest.fixture(scope="module")
def no_interceptor(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConformancePlan]:
    yield from _plan(pg_dsn, tmp_path_factory, "no_interceptor_server")


@pytest.fixture(scope="module")
def outside_transaction(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConformancePlan]:
    yield from _plan(pg_dsn, tmp_path_factory, "outside_transaction_server")


@pytest.mark.e2e
async def test_without_the_interceptor_replay_concurrency_and_crash_checks_fail(
    no_interceptor: ConformancePlan,
) -> None:
    with pytest.raises(ConformanceFailure, match=r"\[sequential replay\] the retry executed again"):
        await no_interceptor.check_sequential_replay()
    with pytest.raises(ConformanceFailure, match=r"4 concurrent duplicates made 4 business"):
        await no_interceptor.check_concurrent_duplicates()
    with pytest.raises(ConformanceFailure, match=r"\[crash at before_commit\] the failpoint never"):
        await no_interceptor.check_crash("before_commit")
    with pytest.raises(ConformanceFailure, match=r"\[mutated payload\] another request"):
        await no_interceptor.check_mutated_payload()


@pytest.mark.e2e
async def test_writes_outside_the_transaction_fail_the_crash_and_transient_checks(
    outside_transaction: ConformancePlan,
) -> None:
    # The interceptor still deduplicates completed calls: the replay check cannot see the bug.
    await outside_transaction.check_sequential_replay()
    with pytest.raises(
        ConformanceFailure,
        match=r"effect count is 1, expected 0\. The handler makes its effect outside",
    ):
        await outside_transaction.check_crash("before_commit")
    with pytest.raises(
        ConformanceFailure, match=r"\[transient error\] the failed attempt .* left 1"
    ):
        await outside_transaction.check_transient_error()


@pytest.mark.e2e
async def test_an_email_sent_directly_fails_the_crash_and_transient_checks(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The database side is right, so only counting where the emails land shows the bug: an
    attempt that dies before COMMIT (or fails) sent its email, and the retry sent another. A
    single execution, or a crash before the handler ran, sends one (no false alarm)."""
    mailbox = tmp_path_factory.mktemp("mailbox") / "sent"
    for plan in _plan(pg_dsn, tmp_path_factory, "emailing_server", mailbox=mailbox):
        await plan.check_sequential_replay()
        await plan.check_crash("after_claim")
        outside = r"the effect outside the database happened 2 times for one operation"
        with pytest.raises(ConformanceFailure, match=rf"\[crash at before_commit\] {outside}"):
            await plan.check_crash("before_commit")
        with pytest.raises(ConformanceFailure, match=rf"\[transient error\] {outside}"):
            await plan.check_transient_error()


@pytest.mark.e2e
async def test_the_same_handler_written_correctly_passes(correct: ConformancePlan) -> None:
    await correct.check_crash("before_commit")
    await correct.check_transient_error()
    await correct.check_deterministic_error()


@pytest.mark.e2e
async def test_record_schemas_the_kit_cannot_read_are_not_the_services(
    correct: ConformancePlan, pg_dsn: str
) -> None:
    """A shared database may hold another program's ``claim_with_start`` beside no records
    table, or a store of another role's: the kit, looking for the call's record (polled by the
    lost-connection check until it finds the call's backend; by the crash and transient checks
    when an effect is left), failed a correct service's check with asyncpg's
    UndefinedTableError (or, as a role without USAGE there, InsufficientPrivilegeError), and
    hid a broken one's explanation behind it. Checked on the lookup itself: the lost-connection
    check pauses 2 s."""
    decoy, role = "decoy_" + uuid.uuid4().hex[:8], "kit_" + uuid.uuid4().hex[:8]
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(
            f"CREATE SCHEMA {decoy}; CREATE FUNCTION {decoy}.claim_with_start() RETURNS int"
            " LANGUAGE sql AS 'SELECT 1'"
        )
        assert not await correct._claim_committed(admin, f"k-{uuid.uuid4().hex}")
        # A role that may read none of the database's stores finds none to look in.
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        limited = await asyncpg.connect(pg_dsn.replace("postgres@", f"{role}@", 1))
        try:
            assert not await correct._claim_committed(limited, f"k-{uuid.uuid4().hex}")
        finally:
            await limited.close()
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {decoy} CASCADE; DROP ROLE IF EXISTS {role}")
        await admin.close()


@pytest.mark.e2e
async def test_record_schemas_are_only_those_with_a_readable_records_table_of_key_and_state(
    correct: ConformancePlan, pg_dsn: str
) -> None:
    """Each of the lookup's conditions on its own (the test above meets several at once): a
    decoy schema holding ``claim_with_start`` and a relation called ``records`` that is not a
    table, or a table missing ``state``, or another table; and, to a role, a store schema it
    may use but whose records it may not read, or read but not use. Any of them looked in
    failed the check with asyncpg's error."""
    tag = uuid.uuid4().hex[:8]
    role = "kit_" + tag
    decoys = {
        "other_table": "CREATE TABLE {s}.other (key text, state text)",
        "not_a_table": "CREATE TYPE {s}.records AS (key text, state text)",
        "no_state": "CREATE TABLE {s}.records (key text)",
        "usage_only": "CREATE TABLE {s}.records (key text, state text);"
        " GRANT USAGE ON SCHEMA {s} TO {role}",
        "select_only": "CREATE TABLE {s}.records (key text, state text);"
        " GRANT SELECT ON {s}.records TO {role}",
    }
    schemas = {name: f"decoy_{name}_{tag}" for name in decoys}
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        for name, ddl in decoys.items():
            s = schemas[name]
            await admin.execute(
                f"CREATE SCHEMA {s}; CREATE FUNCTION {s}.claim_with_start() RETURNS int"
                " LANGUAGE sql AS 'SELECT 1'; " + ddl.format(s=s, role=role)
            )
        assert not await correct._claim_committed(admin, f"k-{uuid.uuid4().hex}")
        limited = await asyncpg.connect(pg_dsn.replace("postgres@", f"{role}@", 1))
        try:
            assert not await correct._claim_committed(limited, f"k-{uuid.uuid4().hex}")
        finally:
            await limited.close()
    finally:
        for s in schemas.values():
            await admin.execute(f"DROP SCHEMA IF EXISTS {s} CASCADE")
        await admin.execute(f"DROP OWNED BY {role}; DROP ROLE IF EXISTS {role}")
        await admin.close()


@pytest.mark.e2e
async def test_a_method_the_server_does_not_serve_is_named_not_blamed_on_the_request(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The failure said "the request factory must make a request the method answers OK".
    for plan in _plan(pg_dsn, tmp_path_factory, "bare_server", POST):
        with pytest.raises(
            ConformanceFailure,
            match=rf"UNIMPLEMENTED .*the server serves no method {POST}: check the method",
        ):
            await plan.check_sequential_replay()


@pytest.mark.e2e
async def test_a_failure_the_server_did_not_log_is_not_said_to_be_in_its_log(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The failure said "its log (below) says why" above an empty log. Without the interceptor,
    # current_call() raised NotInIdempotentCall: the status alone said so.
    for plan in _plan(pg_dsn, tmp_path_factory, "no_interceptor_server", POST_PHASED):
        with pytest.raises(ConformanceFailure) as failed:
            await plan.check_sequential_replay()
        message = str(failed.value)
        assert "current_call() found no idempotent call: Is the method served through" in message
        assert "says why" not in message
    for plan in _plan(pg_dsn, tmp_path_factory, "closed_ledger_server"):
        with pytest.raises(
            ConformanceFailure,
            match="it logged nothing; the status details say why: the ledger is closed",
        ):
            await plan.check_sequential_replay()
    for plan in _plan(pg_dsn, tmp_path_factory, "logging_closed_ledger_server"):
        with pytest.raises(
            ConformanceFailure, match=r"(?s)its log \(below\) says why.*closed until the audit"
        ):
            await plan.check_sequential_replay()


@pytest.mark.e2e
async def test_phased_crash_after_claim_retries_until_the_lease_runs_out(
    pg_dsn: str, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # PostPhased commits its claim first (lease 0.6 s): after the crash the retry is told the
    # key is in progress until the dead owner's lease runs out, then executes once.
    for plan in _plan(pg_dsn, tmp_path_factory, "correct_server", POST_PHASED):
        await plan.check_crash("after_claim")


# Starts one server process with the kit, prints its pid, and waits to be killed.
PARENT = """
import asyncio, sys, time
from pathlib import Path
from grpc_idempotency.testing._process import ServerProcess

server = ServerProcess(sys.argv[1], "postgresql://unused@/x", log_dir=Path(sys.argv[2]), name="child")
asyncio.run(server.start(60))
print(server.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states in /proc")
@pytest.mark.parametrize(
    ("server", "says"),
    [
        ("bare_server", "stdin closed (the parent is gone); stopping"),
        ("hung_cleanup_server", "not stopped 1s after stdin closed"),  # EOF_GRACE_ENV below
    ],
)
def test_a_server_process_exits_when_its_parent_is_killed(
    tmp_path: Path, server: str, says: str
) -> None:
    # The servers run in sessions of their own, and a SIGKILL (or a SIGTERM) to pytest runs no
    # teardown: only the child itself can notice that its parent is gone.
    with (tmp_path / "parent.stderr").open("wb") as stderr:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, f"{MODULE}:{server}", str(tmp_path)],
            env={**os.environ, serve.EOF_GRACE_ENV: "1"},  # the default 10 s, shortened
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    child: int | None = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()  # the pid once the server is ready, or EOF if it failed
        assert line.strip().isdigit(), (tmp_path / "parent.stderr").read_text()
        child = int(line)
        assert running(child)
        parent.send_signal(signal.SIGKILL)
        assert parent.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        logs = (tmp_path / "child.stderr").read_text()
        assert not running(child), f"the server outlived its killed parent\n{logs}"
        assert says in logs, logs
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)


def test_target_refuses_a_malformed_method_name() -> None:
    with pytest.raises(ValueError, match=r"'/package\.Service/Method'"):
        ConformanceTarget(
            server=f"{MODULE}:correct_server",
            method="testsvc.v1.LedgerService.Post",
            request=_request,
            count_effects=_rows,
        )


async def test_assertions_tell_a_replay_from_an_execution() -> None:
    replayed = (("idempotency-replayed", "true"),)
    await assert_replayed(replayed)
    await assert_not_replayed(())
    with pytest.raises(AssertionError, match="expected a replay"):
        await assert_replayed((("other", "x"),))
    with pytest.raises(AssertionError, match="expected an execution"):
        await assert_not_replayed(replayed)
    with pytest.raises(TypeError):
        await assert_replayed("idempotency-replayed")


async def test_assertions_tell_the_librarys_refusal_from_the_handlers_answer(
    ledger: RunningLedger,
) -> None:
    """A call the library answered itself (here KEY_REUSED: the same key, another request) is
    neither: assert_not_replayed passed it as an execution, and assert_replayed said "the
    handler ran" (a review's finding)."""
    key = f"k-{uuid.uuid4().hex}"
    first = ledger.stub.Post(_request(), metadata=metadata(key))
    await first
    await assert_not_replayed(first)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await ledger.stub.Post(_request(), metadata=metadata(key))
    said = r"the library answered the call itself: IDEMPOTENCY_KEY_REUSED \('"
    with pytest.raises(AssertionError, match=rf"expected an execution, but {said}"):
        await assert_not_replayed(refused.value)
    with pytest.raises(AssertionError, match=rf"expected a replay, but {said}"):
        await assert_replayed(refused.value)
    with pytest.raises(AssertionError, match=r"expected a replay \(.*\), but the handler ran"):
        await assert_replayed(first)


async def test_a_call_that_reached_no_server_is_neither_an_execution_nor_a_replay() -> None:
    """gRPC's own UNAVAILABLE for a call that reached no server carries no replay marker and no
    reason of the library's: assert_not_replayed passed it as the handler's answer, so a test
    asserting an execution passed with the server down; assert_replayed failed it saying the
    handler had run."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = testsvc_pb2_grpc.LedgerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.Post(_request(), metadata=metadata(f"k-{uuid.uuid4().hex}"), timeout=10)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(AssertionError, match="the call reached no server"):
        await assert_not_replayed(failed.value)
    # Nor a replay: assert_replayed said "the handler ran", of a call no server received.
    with pytest.raises(AssertionError, match="expected a replay, but the call reached no server"):
        await assert_replayed(failed.value)


async def test_an_outcome_the_library_recorded_is_an_execution_then_a_replay(
    store: Store,
) -> None:
    """A response over max_response_bytes is recorded as RESPONSE_TOO_LARGE, a reason of the
    library's: the handler ran, and the first answer is the operation's outcome, not a refusal
    (assert_not_replayed failed on it: the README's pair could not both be written)."""
    key = f"k-{uuid.uuid4().hex}"
    overrides = {POST.lstrip("/"): MethodOverride(max_response_bytes=100)}
    request = testsvc_pb2.PostRequest(
        account="kit-" + uuid.uuid4().hex, amount=1, behaviour="big:1024"
    )
    async with running_ledger(store, overrides=overrides) as ledger:
        answers = []
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await ledger.stub.Post(request, metadata=metadata(key))
            answers.append(failed.value)
    assert wire.reason_of(answers[0].trailing_metadata()) == "IDEMPOTENCY_RESPONSE_TOO_LARGE"
    await assert_not_replayed(answers[0])
    await assert_replayed(answers[1])


def test_dev_extra_holds_the_testing_extra_and_the_plugin_is_registered() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(extras["testing"]) <= set(extras["dev"])
    # Named after its module: see tests/unit/test_plugin_entry_point.py.
    assert project["entry-points"]["pytest11"] == {
        "grpc_idempotency.testing.plugin": "grpc_idempotency.testing.plugin"
    }


# A user's service for the inner pytest runs: a Post whose nonce tells an execution from a replay.
INNER_LEDGER = """
class Ledger(testsvc_pb2_grpc.LedgerServiceServicer):
    async def Post(self, request, context):
        nonce = await current_call().connection.fetchval("SELECT gen_random_uuid()::text")
        return testsvc_pb2.PostResponse(account=request.account, execution_nonce=nonce)


@pytest.fixture
def idempotency_service():
    def register(server, store):
        testsvc_pb2_grpc.add_LedgerServiceServicer_to_server(Ledger(), server)

    return ServiceUnderTest(register=register, services=[testsvc_pb2])
"""

INNER_TEST = (
    """
import uuid

import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import current_call
from grpc_idempotency.testing import ServiceUnderTest, assert_not_replayed, assert_replayed

"""
    + INNER_LEDGER
    + """

@pytest.mark.asyncio
async def test_a_retry_is_replayed(idempotency_server):
    stub = testsvc_pb2_grpc.LedgerServiceStub(idempotency_server.channel)
    metadata = (("idempotency-key", uuid.uuid4().hex),)
    request = testsvc_pb2.PostRequest(account="inner", amount=1)
    first = stub.Post(request, metadata=metadata)
    answer = await first
    await assert_not_replayed(first)
    retry = stub.Post(request, metadata=metadata)
    assert (await retry).execution_nonce == answer.execution_nonce
    await assert_replayed(retry)
    assert idempotency_server.store.schema == "grpc_idempotency_test"
"""
)

INNER_WITHOUT_SERVICE = """
import pytest

@pytest.mark.asyncio
async def test_needs_a_service(idempotency_server):
    pass
"""


def test_plugin_fixtures_serve_a_users_service(
    pytester: pytest.Pytester, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRPC_IDEMPOTENCY_TEST_DSN", pg_dsn)
    pytester.makepyfile(test_inner=INNER_TEST, test_no_service=INNER_WITHOUT_SERVICE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*define a fixture named idempotency_service*"])


def test_a_dsn_no_server_answers_is_one_line_naming_its_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DSN's variable (here the ini option's) names a closed port: every fixture on it
    failed with asyncpg's traceback, which named neither the variable nor the way out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KIT_DSN", f"postgresql://kit:hunter2@127.0.0.1:{port}/kit")
    pytester.makeini("[pytest]\nidempotency_dsn_env = KIT_DSN\n")
    pytester.makepyfile(
        test_inner="import pytest\n\n@pytest.mark.asyncio\nasync def test_s(idempotency_store):\n"
        "    pass\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            f"KIT_DSN names a PostgreSQL the grpc-idempotency fixtures cannot connect to"
            f" (postgresql://kit:***@127.0.0.1:{port}/kit): ConnectionRefusedError*"
            " unset it for an embedded PostgreSQL"
        ]
    )
    assert "hunter2" not in result.stdout.str()
    assert "Traceback" not in result.stdout.str() and "asyncpg" not in result.stdout.str()
    assert f"Connect call failed ('127.0.0.1', {port})" in result.stdout.str()
    # An unescaped "/" in the password: asyncpg reads "s3cr" as the port, and its error quotes
    # it. Only the error's type is said, never what the driver makes of the DSN.
    monkeypatch.setenv("KIT_DSN", f"postgresql://kit:s3cr/et@127.0.0.1:{port}/kit")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["KIT_DSN names a PostgreSQL * (postgresql://***@127.0.0.1*): the DSN cannot be parsed*"]
    )
    assert "s3cr" not in result.stdout.str()


INNER_HAND_WRITTEN_KEY = (
    """
import pytest
from testsvc.v1 import testsvc_pb2, testsvc_pb2_grpc

from grpc_idempotency import current_call
from grpc_idempotency.testing import ServiceUnderTest, assert_not_replayed

"""
    + INNER_LEDGER
    + """

@pytest.mark.asyncio
async def test_first_call_executes(idempotency_server):
    stub = testsvc_pb2_grpc.LedgerServiceStub(idempotency_server.channel)
    call = stub.Post(
        testsvc_pb2.PostRequest(account="o-1", amount=5),
        metadata=(("idempotency-key", "charge-o-1"),),
    )
    await call
    await assert_not_replayed(call)
"""
)


def test_two_sessions_on_one_database_do_not_share_hand_written_keys(
    pytester: pytest.Pytester, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test with a key written by hand, run by two sessions on one DSN (two CI jobs, xdist
    workers, a rerun on a database that persists): the second found the first's record under
    the fixed scope "test" and was answered a replay (a review's finding)."""
    monkeypatch.setenv("GRPC_IDEMPOTENCY_TEST_DSN", pg_dsn)
    pytester.makepyfile(test_hand_written=INNER_HAND_WRITTEN_KEY)
    for _ in range(2):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=1)
