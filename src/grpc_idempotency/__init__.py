"""grpc-idempotency: exactly-once gRPC writes with idempotency keys claimed in PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from grpc_idempotency.call import IdempotentCall, current_call
from grpc_idempotency.client import (
    IdempotencyClientInterceptor,
    Operation,
    OperationStub,
    TransactionOpen,
    capture_keys,
    channel_options,
    service_config,
    step,
    step_metadata,
)
from grpc_idempotency.consumer import (
    Consumed,
    ConsumeResult,
    IdempotentConsumer,
    MessageInProgress,
    purge_processed,
)
from grpc_idempotency.core.codes import Code
from grpc_idempotency.core.errors import (
    HandlerDatabaseError,
    IdempotencyError,
    KeyInProgress,
    KeyInvalid,
    KeyMissing,
    KeyReused,
    LeaseLost,
    NotInIdempotentCall,
    PolicyError,
    ResponseTooLarge,
    ScopeUnavailable,
    StoreMisconfigured,
    StoreUnavailable,
    TransactionConflict,
)
from grpc_idempotency.core.keys import KEY_HEADER, REPLAYED_HEADER, child_key
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
from grpc_idempotency.core.propagation import StepAmbiguous, StepUndeclared
from grpc_idempotency.core.retry import RetryPolicy
from grpc_idempotency.outbox import (
    CallableSink,
    DeliveryError,
    GrpcSink,
    OutboxMessage,
    PermanentDeliveryError,
    Relay,
    Sink,
    forward_scope,
)
from grpc_idempotency.retention import Purger
from grpc_idempotency.scope import MetadataScope, ScopeResolver, StaticScope, peer_identity_scope
from grpc_idempotency.server import IdempotencyInterceptor
from grpc_idempotency.store.postgres import Store
from grpc_idempotency.telemetry import Telemetry


def proto_include() -> str:
    """The directory to pass to protoc as ``-I`` so that ``import
    "grpc_idempotency/v1/options.proto";`` resolves (also: ``grpc-idempotency include-path``)."""
    return str(Path(__file__).parent / "_proto")


__all__ = [
    "KEY_HEADER",
    "REPLAYED_HEADER",
    "CallOutcome",
    "CallableSink",
    "Code",
    "ConsumeResult",
    "Consumed",
    "DeliveryError",
    "DeliveryPolicy",
    "GrpcSink",
    "HandlerDatabaseError",
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
    "OutboxMessage",
    "PermanentDeliveryError",
    "PolicyError",
    "Purger",
    "Relay",
    "ResponseTooLarge",
    "RetryPolicy",
    "ScopeResolver",
    "ScopeUnavailable",
    "Sink",
    "StaticScope",
    "Step",
    "StepAmbiguous",
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
