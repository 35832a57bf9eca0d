"""NotificationService: ``SendEmail`` inserts one row into ``notifications.emails`` per operation
(the table stands in for the email provider)."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from checkout.v1 import notifications_pb2, notifications_pb2_grpc

from examples.checkout import service
from examples.checkout.auth import Authenticator
from grpc_idempotency import Store, current_call

NAME = "notifications"
TABLES_SQL = """
CREATE TABLE IF NOT EXISTS notifications.emails (
    email_id  text PRIMARY KEY,
    order_id  text NOT NULL,
    recipient text NOT NULL,
    subject   text NOT NULL,
    tenant    text NOT NULL,
    sent_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS emails_order ON notifications.emails (order_id);
"""


class NotificationService(notifications_pb2_grpc.NotificationServiceServicer):
    async def SendEmail(
        self,
        request: notifications_pb2.SendEmailRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> notifications_pb2.SendEmailResponse:
        if "@" not in request.to:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "recipient is not an address")
        call = current_call()
        email_id = "em_" + uuid.uuid4().hex[:16]
        sent_at = await call.connection.fetchval(
            "INSERT INTO notifications.emails (email_id, order_id, recipient, subject, tenant)"
            " VALUES ($1, $2, $3, $4, $5) RETURNING sent_at",
            email_id,
            request.order_id,
            request.to,
            request.subject,
            call.scope,
        )
        response = notifications_pb2.SendEmailResponse(email_id=email_id)
        response.sent_at.FromDatetime(sent_at)
        return response


async def serve(store: Store, listen: str, *, auth: Authenticator) -> tuple[grpc.aio.Server, int]:
    server = service.make_server(store, NAME, [notifications_pb2], auth=auth)
    notifications_pb2_grpc.add_NotificationServiceServicer_to_server(NotificationService(), server)
    port = server.add_insecure_port(listen)
    await server.start()
    return server, port
