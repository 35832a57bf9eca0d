from __future__ import annotations

import hashlib
import uuid

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from testsvc.v1 import testsvc_pb2

from grpc_idempotency.client import IdempotencyClientInterceptor, Operation
from grpc_idempotency.core.errors import KeyInvalid, ScopeResolverFailed, ScopeUnavailable
from grpc_idempotency.core.keys import (
    MAX_STEP_NAME_LENGTH,
    child_key,
    claim_lock_id,
    is_step_name,
    key_from_metadata,
    validate_key,
    validate_scope,
)


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ([("idempotency-key", "")], "empty"),
        ([("idempotency-key", "a" * 256)], "longer than 255"),
        ([("idempotency-key", "caf\u00e9")], "visible ASCII"),
        ([("idempotency-key", "a b")], "visible ASCII"),
        ([("idempotency-key", "a\tb")], "visible ASCII"),
        ([("idempotency-key", "a\x7fb")], "visible ASCII"),
        ([("idempotency-key", "a"), ("idempotency-key", "a")], "more than once"),
        ([("idempotency-key-bin", b"abc")], "-bin"),
        # -bin is said even after a valid text key (a reader of -bin took another key), and
        # before the count.
        ([("idempotency-key", "a"), ("idempotency-key-bin", b"b")], "-bin"),
        (
            [("idempotency-key", "a"), ("idempotency-key", "b"), ("idempotency-key-bin", b"")],
            "-bin",
        ),
        # Bytes that are not UTF-8: refused as a key, not a UnicodeDecodeError.
        ([("idempotency-key", b"a\xffb")], "visible ASCII"),
    ],
)
def test_malformed_keys_are_refused(metadata: list[tuple[str, str | bytes]], problem: str) -> None:
    with pytest.raises(KeyInvalid, match=problem):
        key_from_metadata(metadata)


@pytest.mark.parametrize("key", [None, b"order-1", uuid.UUID(int=1), 42, ["order-1"]])
def test_a_key_that_is_not_a_str_is_refused_clearly(key: object) -> None:
    """``Operation(b"order-1")`` (a key read back from the database as bytes) raised re's "cannot
    use a string pattern on a bytes-like object", an int or a UUID len()'s TypeError, and
    ``Operation(None)`` said the key was empty."""
    for make in (validate_key, Operation):
        with pytest.raises(KeyInvalid, match=f"a str, not {type(key).__name__}"):
            make(key)  # type: ignore[arg-type]


def test_key_found_among_other_metadata() -> None:
    md = [("x-tenant-id", "t"), ("idempotency-key", "A-1_~!"), ("user-agent", "x")]
    assert key_from_metadata(md) == "A-1_~!"
    assert key_from_metadata([("x", "y")]) is None
    assert key_from_metadata(None) is None


@given(
    st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255
    )
)
def test_every_visible_ascii_key_up_to_255_is_accepted(key: str) -> None:
    assert key_from_metadata([("idempotency-key", key)]) == key


def test_child_key_matches_the_documented_formula() -> None:
    def lp(s: str) -> bytes:
        b = s.encode()
        return len(b).to_bytes(4, "big") + b

    expected = hashlib.sha256(
        b"grpc-idempotency/child/v1" + lp("tenant:a") + lp("order-1") + lp("charge-card.v1")
    ).hexdigest()
    assert child_key("tenant:a", "order-1", "charge-card.v1") == expected


def test_child_keys_never_cross_tenants_or_steps() -> None:
    base = child_key("tenant:a", "order-1", "charge-card.v1")
    assert child_key("tenant:b", "order-1", "charge-card.v1") != base
    assert child_key("tenant:a", "order-1", "charge-card.v2") != base
    # The textbook sha256(parent + ":" + step) would be equal for both tenants.
    assert child_key("tenant:a", "order-1", "send-email.v1") != base


@given(st.text(max_size=20), st.text(max_size=20), st.text(max_size=20), st.text(max_size=20))
def test_length_prefixes_make_field_boundaries_unambiguous(a: str, b: str, c: str, d: str) -> None:
    # Shifting characters between scope and key must change the child key.
    if (a, b) != (c, d):
        assert child_key(a, b, "step.v1") != child_key(c, d, "step.v1")


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("charge-card.v1", True),
        ("a.v12", True),
        ("charge-card", False),
        ("Charge.v1", False),
        ("charge.v0", False),
        ("1charge.v1", False),
        ("charge_card.v1", False),
        ("charge.v1 ", False),
    ],
)
def test_step_names(name: str, ok: bool) -> None:
    assert is_step_name(name) is ok
    if not ok:
        with pytest.raises(ValueError):
            child_key("s", "k", name)


def test_a_step_name_has_a_length_limit() -> None:
    """The name travels in the step header and in the texts of the errors that name steps
    (grpc-message): past gRPC's metadata limit, such an error reached the caller as
    RESOURCE_EXHAUSTED instead."""
    longest = "a" * (MAX_STEP_NAME_LENGTH - 3) + ".v1"
    too_long = "a" + longest
    assert is_step_name(longest) and not is_step_name(too_long)
    assert len(child_key("s", "k", longest)) == 64
    with pytest.raises(ValueError, match=f"has at most {MAX_STEP_NAME_LENGTH}") as caught:
        child_key("s", "k", too_long)
    assert f"is {MAX_STEP_NAME_LENGTH + 1} characters long" in str(caught.value)
    assert too_long not in str(caught.value)  # not quoted whole: as long as what it refuses


def test_scope_validation() -> None:
    assert validate_scope("tenant:a") == "tenant:a"
    assert validate_scope("\u00e9" * 512) == "\u00e9" * 512  # 1024 bytes: the most
    other = "t\u00e9nant \u00a0\u3000 \ue000"  # spaces, private use: shown as they are
    assert validate_scope(other) == other
    controls = ("a\nb", "a\rb", "a\tb", "a\x1b[2Jb", "a\x7fb", "a\x85b", "a\x9bb")
    for bad in ("", "x" * 1025, "a\x00b", "\u00e9" * 513, "\U0001f600" * 257, "t\udcff", *controls):
        with pytest.raises(ScopeUnavailable):
            validate_scope(bad)
    for wrong in (42, b"tenant", None):
        with pytest.raises(ScopeResolverFailed):
            validate_scope(wrong)


def test_child_key_of_no_scope_or_key_says_so() -> None:
    """``child_key(call.scope, call.key, step)`` (the README's per-item keys) in a handler of an
    optional-key method called without a key, where both are None, raised AttributeError
    ("'NoneType' object has no attribute 'encode'")."""
    for scope, key in ((None, "k"), ("s", None), (b"s", "k")):
        with pytest.raises(TypeError, match="is a str, not"):
            child_key(scope, key, "a.v1")  # type: ignore[arg-type]


def test_claim_lock_ids_are_signed_64_bit_and_namespaced() -> None:
    a = claim_lock_id("grpc_idempotency", "s", "k")
    assert -(2**63) <= a < 2**63
    assert a == claim_lock_id("grpc_idempotency", "s", "k")
    assert a != claim_lock_id("other_schema", "s", "k")
    assert a != claim_lock_id("grpc_idempotency", "sk", "")


# Child keys and claim-lock ids are read across releases: a child key is the key a downstream
# service holds the step's outcome under (and an outbox row's), and the lock id is what two
# replicas of different versions serialize a key's claim on during a rolling deploy. A change
# of either re-runs every in-flight operation's effects downstream. Do not update these values
# to make the test pass.
@pytest.mark.parametrize(
    ("scope", "parent", "step", "expected"),
    [
        (
            "tenant:a",
            "order-1",
            "charge-card.v1",
            "deb6c6493e2bfa924d7e6e6a976525beb8ba3e5133c621f30f6c576d8ef4c293",
        ),
        (
            "spiffe://bank.example/ns/pay/sa/api",
            "8b0d2f1e-0f3a-4c55-9a55-2f3c1d9e7a10",
            "send-confirmation.v12",
            "5a2a4ae835a4384b6864fc17200f641180d6caa582d7eb399a32164a14c2180d",
        ),
        (  # a scope's UTF-8 bytes are counted, not its characters
            "t\u00e9nant-\U0001f600",
            "!~",
            "a.v1",
            "4a380bbacc35906d39a3fa14a8d3edf3a10b821125c2523ca2fc494838ff6946",
        ),
    ],
)
def test_child_keys_are_pinned(scope: str, parent: str, step: str, expected: str) -> None:
    assert child_key(scope, parent, step) == expected


def test_claim_lock_ids_are_pinned() -> None:
    assert claim_lock_id("grpc_idempotency", "tenant:a", "order-1") == 4897178196358540786


# A line or paragraph separator splits the line it is shown in (str.splitlines, many viewers);
# a bidi embedding, override, isolate or mark reorders it on display; an invisible format
# character makes two scopes read the same. Each was taken as a scope, and shown as it is in
# the server's log lines, `inspect`, `list` and `outbox dead`.
UNSAFE_FORMAT = {
    "line-separator": "acme\u2028INFO forged",
    "paragraph-separator": "acme\u2029",
    "rlo": "tenant:\u202eemca",
    "lre": "\u202aacme",
    "rli": "acme\u2067x\u2069",
    "rlm": "acme\u200f",
    "arabic-letter-mark": "acme\u061c",
    "zwsp": "ac\u200bme",
    "soft-hyphen": "ac\u00adme",
    "bom": "\ufeffacme",
    "word-joiner": "acme\u2060",
    "tag": "acme\U000e0041",
}


@pytest.mark.parametrize("scope", UNSAFE_FORMAT.values(), ids=UNSAFE_FORMAT.keys())
def test_a_scope_holding_a_separator_or_format_character_is_refused(scope: str) -> None:
    with pytest.raises(ScopeUnavailable) as caught:
        validate_scope(scope)
    unsafe = next(c for c in scope if not c.isascii())
    # Which character, by its code point: the scope itself is not quoted (nor shown raw).
    assert f"U+{ord(unsafe):04X}" in caught.value.message
    assert scope not in caught.value.message


def test_zwnj_and_zwj_are_taken_in_a_scope() -> None:
    """Format characters too, but they spell words (Persian, the Indic scripts, emoji
    sequences) and reorder nothing: IDNA and PRECIS allow them, as a scope does."""
    for scope in (
        "tenant:\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
        "t:\u0915\u094d\u200d\u0937",
        "t:\U0001f469\u200d\U0001f4bb",
    ):
        assert validate_scope(scope) == scope


_KEY_METADATA = [
    [],
    [("x-tenant-id", "t")],
    [("idempotency-key", "k-1")],
    [("idempotency-key", b"k-1")],
    [("idempotency-key", "~" * 255)],
    [("idempotency-key", "")],
    [("idempotency-key", "k" * 256)],
    [("idempotency-key", "has space")],
    [("idempotency-key", "a\tb")],
    [("idempotency-key", "caf\u00e9")],
    [("idempotency-key", "a\x7fb")],
    [("idempotency-key", b"a\xffb")],
    [("idempotency-key", "k-1"), ("idempotency-key", "k-1")],
    [("idempotency-key", "k-1"), ("idempotency-key", "k-2")],
    [("idempotency-key-bin", b"k-1")],
    [("idempotency-key", "k-1"), ("idempotency-key-bin", b"k-1")],
    [("idempotency-key-bin", b"k-1"), ("idempotency-key", "")],
]


@pytest.mark.parametrize("metadata", _KEY_METADATA, ids=repr)
def test_client_and_server_refuse_the_same_key_metadata(
    metadata: list[tuple[str, str | bytes]],
) -> None:
    """The client interceptor refuses a keyed call's key metadata exactly when the server would
    (``key_from_metadata``), before sending it; and what it does send, the server takes. The
    client once kept its own copy of the checks, free to drift from the server's."""
    try:
        key_from_metadata(metadata)
    except KeyInvalid:
        server_refuses = True
    else:
        server_refuses = False
    interceptor = IdempotencyClientInterceptor(services=[testsvc_pb2])
    details = grpc.aio.ClientCallDetails(
        "/testsvc.v1.LedgerService/Post", None, grpc.aio.Metadata(*metadata), None, None
    )
    try:
        sent, *_ = interceptor._outgoing(details, keyed=True)
    except KeyInvalid:
        client_refuses = True
    else:
        client_refuses = False
        assert key_from_metadata(tuple(sent.metadata or ())) is not None  # keyed, and valid
    assert client_refuses == server_refuses
