"""The PostgreSQL store (asyncpg): claim, complete, release, look up, purge; SQL migrations."""

from grpc_idempotency.store.postgres import Attempt, PhasedClaim, Store

__all__ = ["Attempt", "PhasedClaim", "Store"]
