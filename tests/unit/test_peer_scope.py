"""The default scope, from the peer's certificate names: two peers share it only if they have
the same names (else one could replay, or block, the other's operations)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

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
