"""The PostgreSQL store (asyncpg): claim, complete, release, look up, purge; SQL migrations."""

from grpc_idempotency.store.postgres import AtomicAttempt, Store

__all__ = ["AtomicAttempt", "Store"]
