"""grpc-idempotency: exactly-once gRPC writes with idempotency keys claimed in PostgreSQL.

Names are imported on first use (PEP 562), so that ``import grpc_idempotency.core``, the sans-I/O
decisions, loads neither asyncpg nor grpc: the public API below is the same either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from grpc_idempotency._lazy import lazy_names

if TYPE_CHECKING:
    from grpc_idempotency.call import IdempotentCall, current_call
    from grpc_idempotency.client import (
        IdempotencyClientInterceptor,
        Operation,
        OperationStub,
        capture_keys,
        channel_options,
        service_config,
        step,
        step_metadata,
    )
    from grpc_idempotency.consumer import (
        Consumed,
        ConsumeResult,
        ConsumerOutcome,
        IdempotentConsumer,
        purge_processed,
    )
    from grpc_idempotency.core.codes import Code
    from grpc_idempotency.core.errors import (
        AbortInvalid,
        DeliveryError,
        DsnUnusable,
        HandlerDatabaseError,
        IdempotencyError,
        KeyInProgress,
        KeyInvalid,
        KeyMissing,
        KeyReused,
        LeaseLost,
        MessageInProgress,
        NotInIdempotentCall,
        OutboxKeyReused,
        PermanentDeliveryError,
        PolicyError,
        RequestInvalid,
        ResponseTooLarge,
        ScopeResolverFailed,
        ScopeUnavailable,
        StepAmbiguous,
        StepReused,
        StepUndeclared,
        StoreMisconfigured,
        StoreUnavailable,
        TransactionConflict,
        TransactionOpen,
    )
    from grpc_idempotency.core.herd import HerdRelease
    from grpc_idempotency.core.keys import child_key
    from grpc_idempotency.core.lifecycle import CallOutcome
    from grpc_idempotency.core.outbox import DeliveryPolicy
    from grpc_idempotency.core.policy import (
        Isolation,
        KeyRequirement,
        MethodOverride,
        MethodPolicy,
        Mode,
        Step,
        StoreDown,
    )
    from grpc_idempotency.core.replay_cache import ReplayCache
    from grpc_idempotency.core.retry import RetryPolicy
    from grpc_idempotency.core.wire import KEY_HEADER, REPLAYED_HEADER
    from grpc_idempotency.outbox import (
        CallableSink,
        GrpcSink,
        OutboxMessage,
        Relay,
        Sink,
        forward_scope,
    )
    from grpc_idempotency.retention import Purger
    from grpc_idempotency.scope import (
        MetadataScope,
        ScopeResolver,
        StaticScope,
        peer_identity_scope,
    )
    from grpc_idempotency.server.interceptor import IdempotencyInterceptor
    from grpc_idempotency.store.postgres import PooledConnection, Store
    from grpc_idempotency.store.shards import ShardedStores
    from grpc_idempotency.telemetry import Telemetry

# Where each public name lives.
_LOCATIONS: dict[str, str] = {
    "CallOutcome": "grpc_idempotency.core.lifecycle",
    "AbortInvalid": "grpc_idempotency.core.errors",
    "CallableSink": "grpc_idempotency.outbox",
    "Code": "grpc_idempotency.core.codes",
    "ConsumeResult": "grpc_idempotency.consumer",
    "Consumed": "grpc_idempotency.consumer",
    "ConsumerOutcome": "grpc_idempotency.consumer",
    "DeliveryError": "grpc_idempotency.core.errors",
    "DeliveryPolicy": "grpc_idempotency.core.outbox",
    "DsnUnusable": "grpc_idempotency.core.errors",
    "GrpcSink": "grpc_idempotency.outbox",
    "HandlerDatabaseError": "grpc_idempotency.core.errors",
    "HerdRelease": "grpc_idempotency.core.herd",
    "IdempotencyClientInterceptor": "grpc_idempotency.client",
    "IdempotencyError": "grpc_idempotency.core.errors",
    "IdempotencyInterceptor": "grpc_idempotency.server.interceptor",
    "IdempotentCall": "grpc_idempotency.call",
    "IdempotentConsumer": "grpc_idempotency.consumer",
    "Isolation": "grpc_idempotency.core.policy",
    "KEY_HEADER": "grpc_idempotency.core.wire",
    "KeyInProgress": "grpc_idempotency.core.errors",
    "KeyInvalid": "grpc_idempotency.core.errors",
    "KeyMissing": "grpc_idempotency.core.errors",
    "KeyRequirement": "grpc_idempotency.core.policy",
    "KeyReused": "grpc_idempotency.core.errors",
    "OutboxKeyReused": "grpc_idempotency.core.errors",
    "LeaseLost": "grpc_idempotency.core.errors",
    "MessageInProgress": "grpc_idempotency.core.errors",
    "MetadataScope": "grpc_idempotency.scope",
    "MethodOverride": "grpc_idempotency.core.policy",
    "MethodPolicy": "grpc_idempotency.core.policy",
    "Mode": "grpc_idempotency.core.policy",
    "NotInIdempotentCall": "grpc_idempotency.core.errors",
    "Operation": "grpc_idempotency.client",
    "OperationStub": "grpc_idempotency.client",
    "OutboxMessage": "grpc_idempotency.outbox",
    "PermanentDeliveryError": "grpc_idempotency.core.errors",
    "PolicyError": "grpc_idempotency.core.errors",
    "PooledConnection": "grpc_idempotency.store.postgres",
    "Purger": "grpc_idempotency.retention",
    "REPLAYED_HEADER": "grpc_idempotency.core.wire",
    "Relay": "grpc_idempotency.outbox",
    "ReplayCache": "grpc_idempotency.core.replay_cache",
    "RequestInvalid": "grpc_idempotency.core.errors",
    "ResponseTooLarge": "grpc_idempotency.core.errors",
    "RetryPolicy": "grpc_idempotency.core.retry",
    "ScopeResolver": "grpc_idempotency.scope",
    "ScopeResolverFailed": "grpc_idempotency.core.errors",
    "ScopeUnavailable": "grpc_idempotency.core.errors",
    "ShardedStores": "grpc_idempotency.store.shards",
    "Sink": "grpc_idempotency.outbox",
    "StaticScope": "grpc_idempotency.scope",
    "Step": "grpc_idempotency.core.policy",
    "StepAmbiguous": "grpc_idempotency.core.errors",
    "StepReused": "grpc_idempotency.core.errors",
    "StepUndeclared": "grpc_idempotency.core.errors",
    "Store": "grpc_idempotency.store.postgres",
    "StoreDown": "grpc_idempotency.core.policy",
    "StoreMisconfigured": "grpc_idempotency.core.errors",
    "StoreUnavailable": "grpc_idempotency.core.errors",
    "Telemetry": "grpc_idempotency.telemetry",
    "TransactionConflict": "grpc_idempotency.core.errors",
    "TransactionOpen": "grpc_idempotency.core.errors",
    "capture_keys": "grpc_idempotency.client",
    "channel_options": "grpc_idempotency.client",
    "child_key": "grpc_idempotency.core.keys",
    "current_call": "grpc_idempotency.call",
    "forward_scope": "grpc_idempotency.outbox",
    "peer_identity_scope": "grpc_idempotency.scope",
    "purge_processed": "grpc_idempotency.consumer",
    "service_config": "grpc_idempotency.client",
    "step": "grpc_idempotency.client",
    "step_metadata": "grpc_idempotency.client",
}


# Hidden from type checkers, which read the TYPE_CHECKING imports instead: seeing a module
# __getattr__, mypy would type every name imported from the package as Any, a misspelt one
# included, and a strict user's typo would pass the check to fail at import.
if not TYPE_CHECKING:
    __getattr__ = lazy_names(__name__, _LOCATIONS, globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def proto_include() -> str:
    """The directory to pass to protoc as ``-I`` so that ``import
    "grpc_idempotency/v1/options.proto";`` resolves (also: ``grpc-idempotency include-path``)."""
    return str(Path(__file__).parent / "_proto")


__all__ = [
    "KEY_HEADER",
    "REPLAYED_HEADER",
    "AbortInvalid",
    "CallOutcome",
    "CallableSink",
    "Code",
    "ConsumeResult",
    "Consumed",
    "ConsumerOutcome",
    "DeliveryError",
    "DeliveryPolicy",
    "DsnUnusable",
    "GrpcSink",
    "HandlerDatabaseError",
    "HerdRelease",
    "IdempotencyClientInterceptor",
    "IdempotencyError",
    "IdempotencyInterceptor",
    "IdempotentCall",
    "IdempotentConsumer",
    "Isolation",
    "KeyInProgress",
    "KeyInvalid",
    "KeyMissing",
    "KeyRequirement",
    "KeyReused",
    "LeaseLost",
    "MessageInProgress",
    "MetadataScope",
    "MethodOverride",
    "MethodPolicy",
    "Mode",
    "NotInIdempotentCall",
    "Operation",
    "OperationStub",
    "OutboxKeyReused",
    "OutboxMessage",
    "PermanentDeliveryError",
    "PolicyError",
    "PooledConnection",
    "Purger",
    "Relay",
    "ReplayCache",
    "RequestInvalid",
    "ResponseTooLarge",
    "RetryPolicy",
    "ScopeResolver",
    "ScopeResolverFailed",
    "ScopeUnavailable",
    "ShardedStores",
    "Sink",
    "StaticScope",
    "Step",
    "StepAmbiguous",
    "StepReused",
    "StepUndeclared",
    "Store",
    "StoreDown",
    "StoreMisconfigured",
    "StoreUnavailable",
    "Telemetry",
    "TransactionConflict",
    "TransactionOpen",
    "capture_keys",
    "channel_options",
    "child_key",
    "current_call",
    "forward_scope",
    "peer_identity_scope",
    "proto_include",
    "purge_processed",
    "service_config",
    "step",
    "step_metadata",
]
