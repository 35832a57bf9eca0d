"""``forward_metadata`` cannot copy the library's own headers downstream.

Forwarded, the serving call's key reached every call that chose no key of its own (an unkeyed
target, a stream): two tenants who picked the same key shared one record downstream, and the
second was answered the first one's stored response (a review's reproducer, with a relay
forwarding ``[tenant, "idempotency-key"]`` to a method keyed only downstream)."""

from __future__ import annotations

import pytest

from grpc_idempotency.client import IdempotencyClientInterceptor, step, step_metadata


@pytest.mark.parametrize(
    "header",
    ["idempotency-key", "Idempotency-Key", "idempotency-key-bin", "x-grpc-idempotency-step"],
)
def test_the_librarys_headers_are_refused(header: str) -> None:
    with pytest.raises(ValueError, match="forward_metadata cannot name the library's own headers"):
        IdempotencyClientInterceptor(forward_metadata=["x-tenant", header])


def test_other_headers_are_forwarded() -> None:
    interceptor = IdempotencyClientInterceptor(forward_metadata=["Authorization", "x-tenant"])
    assert interceptor._forward == ("authorization", "x-tenant")


def test_a_single_name_given_as_a_str_is_refused() -> None:
    """A str is a sequence of one-letter names: ``forward_metadata="x-tenant-id"`` forwarded
    "x", "-", "t"... and never the tenant, without a word."""
    with pytest.raises(TypeError, match=r"forward_metadata=\['x-tenant-id'\]"):
        IdempotencyClientInterceptor(forward_metadata="x-tenant-id")


@pytest.mark.parametrize("name", ["x tenant", "x-tenant:", "", "tenant\n", "ténant"])
def test_a_name_no_metadata_entry_can_have_is_refused(name: str) -> None:
    """gRPC sends no entry under such a name: it was accepted and forwarded nothing."""
    with pytest.raises(ValueError, match="forward_metadata: "):
        IdempotencyClientInterceptor(forward_metadata=["x-tenant", name])


@pytest.mark.parametrize("name", [b"x-tenant", None])
def test_a_name_that_is_no_str_is_refused_naming_the_option(name: object) -> None:
    """It failed with re's "cannot use a string pattern on a bytes-like object", or an
    AttributeError on None, neither naming forward_metadata."""
    with pytest.raises(TypeError, match="forward_metadata names headers by str"):
        IdempotencyClientInterceptor(forward_metadata=["x-tenant", name])  # type: ignore[list-item]


@pytest.mark.parametrize("name", [None, 5, b"charge.v1"])
def test_a_step_named_by_no_str_is_refused(name: object) -> None:
    """``step(None)`` named no step (the call went on as if none were given), and a number was
    sent as its text, refused downstream as undeclared."""
    with pytest.raises(TypeError, match="a step is named by a str"):
        step_metadata(name)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a step is named by a str"), step(name):  # type: ignore[arg-type]
        pass
