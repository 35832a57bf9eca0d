"""The pytest plugin (entry point ``pytest11``; ``pip install 'grpc-idempotency[testing]'``).

The entry point's name is this module's, ``grpc_idempotency.testing.plugin`` (``-p no:`` it to
turn it off): a project that also names the module, with ``-p`` or ``pytest_plugins`` (to load
it where ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` is set), would otherwise register it a second time,
under another name, and pytest stops before collecting a test.

Fixtures, all named ``idempotency_*`` so they stay clear of a project's own:

- ``idempotency_dsn`` (session): the DSN in the environment variable named by the ini option
  ``idempotency_dsn_env`` (default ``GRPC_IDEMPOTENCY_TEST_DSN``), else a throwaway
  ``EmbeddedPostgres`` started on first use and stopped at the end of the session. Nothing
  starts unless a test asks for it. A DSN no server accepts a connection on fails the fixture
  in one line naming the variable, the DSN (its password masked) and the cause.
- ``idempotency_schema`` (session): the records' schema, ``grpc_idempotency_test``; override it
  to use another.
- ``idempotency_store``: a migrated ``Store`` on that DSN and schema, closed after the test.
- ``idempotency_service``: yours to define: a ``ServiceUnderTest`` saying what to serve.
- ``idempotency_server``: a ``RunningServer``: your service on a started grpc.aio server with the
  ``IdempotencyInterceptor``, on 127.0.0.1 port 0, with a channel to it. Its calls' scope,
  unless the service names a resolver, is the session's own (``test-<random>``): sessions
  sharing a database never meet each other's keys.
- ``idempotency_conformance`` (class): the ``ConformancePlan`` of an ``IdempotencyConformance``
  subclass; its server processes stop after the class's last test.

The async fixtures use pytest-asyncio, in the event loop your configuration gives fixtures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pytest

try:
    import pytest_asyncio
except ImportError:  # the entry point loads with the package, the testing extra or not
    pytest_asyncio = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from grpc_idempotency.store.postgres import Store
    from grpc_idempotency.testing.conformance import ConformancePlan
    from grpc_idempotency.testing.service import RunningServer, ServiceUnderTest

DSN_ENV_INI = "idempotency_dsn_env"
DEFAULT_DSN_ENV = "GRPC_IDEMPOTENCY_TEST_DSN"
DEFAULT_SCHEMA = "grpc_idempotency_test"
# How long the DSN's server may take to accept a first connection (asyncpg's own is 60 s): one
# behind a partition fails the session's first fixture after this, not after a minute.
_PROBE_TIMEOUT_S = 10.0

F = TypeVar("F", bound=Callable[..., Any])


def _async_fixture(func: F) -> F:
    if pytest_asyncio is not None:
        return cast(F, pytest_asyncio.fixture(func))

    @functools.wraps(func)  # the same signature: pytest resolves the same fixtures
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(
            f"{func.__name__} needs pytest-asyncio: pip install 'grpc-idempotency[testing]'",
            pytrace=False,
        )

    return cast(F, pytest.fixture(unavailable))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        DSN_ENV_INI,
        "environment variable holding the PostgreSQL DSN for the grpc-idempotency fixtures"
        f" (unset or empty: an embedded PostgreSQL); default {DEFAULT_DSN_ENV}",
        default=DEFAULT_DSN_ENV,
    )


@pytest.fixture(scope="session")
def idempotency_dsn(pytestconfig: pytest.Config) -> Iterator[str]:
    """A PostgreSQL DSN: from the environment variable the ini option ``idempotency_dsn_env``
    names (default ``GRPC_IDEMPOTENCY_TEST_DSN``), else an embedded server for the session."""
    variable = str(pytestconfig.getini(DSN_ENV_INI) or DEFAULT_DSN_ENV)
    dsn = os.environ.get(variable)
    if dsn:
        _reachable(variable, dsn)
        yield dsn
        return
    from grpc_idempotency.testing.embedded import EmbeddedPostgres

    with EmbeddedPostgres(durable=False) as postgres:
        yield postgres.dsn


def _reachable(variable: str, dsn: str) -> None:
    """Fails the fixture, in one line naming ``variable``, unless ``dsn`` takes a connection.
    Else each fixture on it failed with the driver's traceback, which says neither where the
    DSN came from nor that unsetting the variable gives an embedded PostgreSQL."""
    import asyncpg

    from grpc_idempotency.cli_errors import safe_dsn
    from grpc_idempotency.store.errors import dsn_unusable

    async def probe() -> None:
        conn = await asyncpg.connect(dsn, timeout=_PROBE_TIMEOUT_S)
        await conn.close()

    try:
        # In a thread of its own: its event loop is not the one pytest-asyncio gives fixtures.
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            thread.submit(asyncio.run, probe()).result()
        return
    except Exception as exc:
        # The server's words (PostgresError) and a socket's name only addresses; anything else
        # (a DSN asyncpg could not parse) may quote a piece of the password: its type alone.
        words = f": {exc}" if isinstance(exc, asyncpg.PostgresError | OSError) and str(exc) else ""
        cause = f"{type(exc).__name__}{words}"
        if dsn_unusable(exc):
            cause = f"the DSN cannot be parsed or used ({type(exc).__name__})"
    # Out of the except clause: pytest would print the driver's exception above the message.
    pytest.fail(
        f"{variable} names a PostgreSQL the grpc-idempotency fixtures cannot connect to"
        f" ({safe_dsn(dsn)}): {cause}. Start it, correct {variable}, or unset it for an"
        " embedded PostgreSQL",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def idempotency_schema() -> str:
    """The schema of the idempotency records the ``idempotency_store`` fixture uses."""
    return DEFAULT_SCHEMA


@_async_fixture
async def idempotency_store(idempotency_dsn: str, idempotency_schema: str) -> AsyncIterator[Store]:
    """A ``Store`` on ``idempotency_dsn``, its schema migrated; closed after the test."""
    from grpc_idempotency.store.postgres import Store

    store = await Store.connect(
        idempotency_dsn, schema=idempotency_schema, min_size=1, max_size=10, migrate=True
    )
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def idempotency_service() -> ServiceUnderTest:
    """Define this fixture (in your conftest.py or test module) to say what
    ``idempotency_server`` serves: return a ``grpc_idempotency.testing.ServiceUnderTest``."""
    pytest.fail(
        "idempotency_server needs to know what to serve: define a fixture named"
        " idempotency_service returning grpc_idempotency.testing.ServiceUnderTest("
        "register=add_MyServiceServicer_to_server-like function, services=[my_pb2])",
        pytrace=False,
    )


@_async_fixture
async def idempotency_server(
    idempotency_service: ServiceUnderTest, idempotency_store: Store
) -> AsyncIterator[RunningServer]:
    """Your ``idempotency_service`` on a started grpc.aio server with the
    ``IdempotencyInterceptor`` on ``idempotency_store``, on 127.0.0.1 port 0."""
    from grpc_idempotency.testing.service import running_server

    async with running_server(idempotency_service, idempotency_store) as running:
        yield running


@pytest.fixture(scope="class")
def idempotency_conformance(
    request: pytest.FixtureRequest,
    idempotency_dsn: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ConformancePlan]:
    """The ``ConformancePlan`` of the requesting ``IdempotencyConformance`` subclass; its server
    processes (output in a temporary directory) stop after the class's last test."""
    from grpc_idempotency.testing.conformance import ConformancePlan, IdempotencyConformance

    cls = request.cls
    if cls is None or not issubclass(cls, IdempotencyConformance):
        pytest.fail(
            "idempotency_conformance serves subclasses of IdempotencyConformance", pytrace=False
        )
    log_dir = tmp_path_factory.mktemp("conformance")
    plan = ConformancePlan(cls().conformance_target(), idempotency_dsn, log_dir)
    try:
        yield plan
    finally:
        plan.close()
