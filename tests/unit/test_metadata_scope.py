"""MetadataScope refuses, when it is made, a header it could never read a tenant from."""

from __future__ import annotations

import pytest

from grpc_idempotency.scope import MetadataScope


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        # Binary metadata: gRPC hands its values over as bytes, so every call was refused
        # UNAUTHENTICATED, "expected exactly one 'x-tenant-bin' metadata entry", with one sent.
        ("x-tenant-bin", "-bin"),
        # The library's own: the scope was the key itself (two tenants with one key shared a
        # record) or a step name.
        ("idempotency-key", "library"),
        ("Idempotency-Key", "library"),
        ("idempotency-key-bin", "-bin"),
        ("x-grpc-idempotency-step", "library"),
        # Names gRPC never delivers as metadata: no call could ever have a scope.
        ("x tenant", "letters"),
        (":authority", "letters"),
        ("", "letters"),
        # gRPC's own (tests/integration/test_scope_headers.py): a caller's value of them never
        # reaches the handler, so every call was refused UNAUTHENTICATED.
        ("grpc-timeout", "reserved by gRPC"),
        ("grpc-tenant", "reserved by gRPC"),
        ("Content-Type", "reserved by gRPC"),
        ("te", "reserved by gRPC"),
        ("user-agent", "reserved by gRPC"),
    ],
)
def test_a_header_no_tenant_can_come_from_is_refused(header: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        MetadataScope(header)


@pytest.mark.parametrize(
    ("options", "argument"),
    [({"header": None}, "header"), ({"header": 5}, "header"), ({"prefix": None}, "prefix")],
)
def test_a_header_or_prefix_that_is_no_str_is_a_type_error(
    options: dict[str, object], argument: str
) -> None:
    # Were a bare AttributeError ("'NoneType' object has no attribute 'lower'") and "argument
    # of type 'NoneType' is not iterable".
    with pytest.raises(TypeError, match=f"^MetadataScope: {argument} must be a str"):
        MetadataScope(**options)  # type: ignore[arg-type]


def test_a_prefix_that_cannot_be_stored_is_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        MetadataScope(prefix="tenant\x00")


@pytest.mark.parametrize(
    "prefix",
    ["tenant\n", "\x1b[31mtenant:", "tenant\x85", "tenant\u2028", "\u202etenant:", "t" * 1024],
)
def test_a_prefix_no_call_could_have_a_scope_with_is_refused(prefix: str) -> None:
    # validate_scope refuses every scope holding a control, line-separator or format character
    # (or too long): made, every call was refused UNAUTHENTICATED ("... an unusable scope").
    with pytest.raises(ValueError, match="unusable scope"):
        MetadataScope(prefix=prefix)


def test_plain_tenant_headers_are_accepted() -> None:
    assert MetadataScope("X-Tenant-Id").header == "x-tenant-id"
    assert MetadataScope("x_org.id", prefix="").prefix == ""
