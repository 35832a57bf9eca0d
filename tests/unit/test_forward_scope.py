"""``forward_scope``, the relay's counterpart of ``MetadataScope``: its header is checked as
``MetadataScope`` checks it, when it is made, not on every delivery."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from grpc_idempotency import MetadataScope, OutboxMessage, forward_scope


def message(scope: str) -> OutboxMessage:
    return OutboxMessage(
        id=1,
        scope=scope,
        key="k" * 64,
        step="order-created.v1",
        method="/a.B/C",
        payload_type="a.Event",
        payload=b"",
        attempts=1,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def test_a_header_in_capitals_is_sent_as_metadata_scope_reads_it() -> None:
    """``MetadataScope("X-Tenant-Id")`` reads "x-tenant-id"; the same name given here was sent
    as written, which gRPC refuses: every message a dead letter at its first delivery."""
    assert MetadataScope("X-Tenant-Id").header == "x-tenant-id"
    assert forward_scope("X-Tenant-Id")(message("tenant:acme")) == [("x-tenant-id", "acme")]


@pytest.mark.parametrize(
    "header",
    [
        "x tenant",
        "",
        "idempotency-key",
        "x-grpc-idempotency-step",
        "x-tenant-bin",
        # gRPC's own: the receiver never sees the tenant sent in them.
        "grpc-timeout",
        "content-type",
        "te",
        "user-agent",
    ],
)
def test_a_header_no_delivery_could_send_is_refused_when_made(header: str) -> None:
    with pytest.raises(ValueError, match="forward_scope: "):
        forward_scope(header)


def test_a_prefix_with_nul_is_refused_when_made() -> None:
    with pytest.raises(ValueError, match="forward_scope: "):
        forward_scope(prefix="tenant\x00")


@pytest.mark.parametrize(
    "prefix", ["tenant\n", "\x1b[31mtenant:", "tenant\u2028", "\u202etenant:", "t" * 1024]
)
def test_a_prefix_no_scope_can_start_with_is_refused_when_made(prefix: str) -> None:
    """``MetadataScope`` refuses such a prefix (no scope may hold the character, or leave room
    for a tenant after it); made here, no message's scope started with it, so every message was
    a dead letter at its first delivery ("does not start with")."""
    with pytest.raises(ValueError, match=r"forward_scope: prefix .* unusable scope"):
        forward_scope(prefix=prefix)
    with pytest.raises(ValueError, match=r"MetadataScope: prefix .* unusable scope"):
        MetadataScope(prefix=prefix)
