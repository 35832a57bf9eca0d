"""The default scope, from the peer's certificate names: two peers share it only if they have
the same names (else one could replay, or block, the other's operations)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpc_idempotency.core.errors import ScopeUnavailable
from grpc_idempotency.core.keys import validate_scope
from grpc_idempotency.scope import peer_scope


def test_plain_names_read_as_they_are() -> None:
    assert peer_scope([b"spiffe://prod/billing", b"billing.internal"]) == (
        "peer:billing.internal,spiffe://prod/billing"
    )


def test_names_holding_commas_are_not_confused_with_more_names() -> None:
    """Joined as they were, ["a,b", "c"] and ["a", "b,c"] were both "peer:a,b,c"."""
    assert peer_scope([b"a,b", b"c"]) != peer_scope([b"a", b"b,c"])
    assert peer_scope([b"a\\", b"b"]) != peer_scope([b"a\\,b"])


def test_names_that_are_not_utf8_stay_apart() -> None:
    """Decoded with replacement characters, both were "peer:\ufffd"."""
    assert peer_scope([b"\xff"]) != peer_scope([b"\xfe"])
    assert peer_scope([b"\xff"]) != peer_scope([b"\\xff"])  # nor like the text "\xff"


# At least one name: a peer with none is refused before (peer_identity_scope).
name = st.binary(max_size=6) | st.text(alphabet="a,\\x f", max_size=6).map(str.encode)
names = st.lists(name, min_size=1)


@given(names, names)
def test_one_scope_per_set_of_names(a: list[bytes], b: list[bytes]) -> None:
    assert (peer_scope(a) == peer_scope(b)) == (Counter(a) == Counter(b))


def test_a_certificate_with_many_names_has_a_scope_the_store_can_hold() -> None:
    """A verified client whose certificate lists many names (a service certificate with every
    DNS name of its service, say) was refused UNAUTHENTICATED on every keyed call: its scope,
    all its names, was over the 1024 bytes a scope may hold. Past that size the scope is a
    digest of them, still one per set of names, and never like a scope of plain names."""
    many = [f"replica-{n}.payments.prod.svc.cluster.example".encode() for n in range(30)]
    scope = peer_scope(many)
    assert validate_scope(scope) == scope
    assert scope.startswith("peer-sha256:")
    assert scope == peer_scope(list(reversed(many)))  # the order of the names does not matter
    assert scope != peer_scope([*many[:-1], b"other.example"])
    assert scope != peer_scope([*many, many[0]])
    # Up to the limit, names read as they are.
    few = many[:5]
    assert peer_scope(few) == "peer:" + ",".join(sorted(n.decode() for n in few))
    # A name holding NUL is still refused as it was (it cannot be stored), long or not.
    with pytest.raises(ScopeUnavailable):
        validate_scope(peer_scope([*many, b"a\x00b"]))
    # So is one holding another character no scope may hold (a control, line-separator or
    # format character), long list or short (only NUL was refused: a short list's scope was
    # taken as it read, a long one's hashed).
    for control in (b"a\nb", b"a\x1bb", "a\u202eb".encode(), "a\u2028b".encode()):
        with pytest.raises(ScopeUnavailable):
            validate_scope(peer_scope([*many, control]))
        with pytest.raises(ScopeUnavailable):
            validate_scope(peer_scope([control]))
