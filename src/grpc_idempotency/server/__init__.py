"""The grpc.aio server side: ``IdempotencyInterceptor`` (``interceptor``), how its answers leave
(``answers``: errors with rich status, replays byte for byte), and the context handlers get
(``handler_context``: aborts held until the outcome is durable)."""

from __future__ import annotations

from grpc_idempotency.server.interceptor import IdempotencyInterceptor

__all__ = ["IdempotencyInterceptor"]
