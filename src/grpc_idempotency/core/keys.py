"""Idempotency keys, scopes and the child keys derived from them.

Invariants held here:
- a key is 1..255 visible ASCII characters (0x21-0x7E), sent once, as text metadata; anything
  else is refused before the store is touched, so a malformed key can never reach SQL or a lock;
- a record lives under (scope, key): a key is never global;
- a child key is a function of the parent's *scoped* identity and a versioned step name, encoded
  with length prefixes, so two tenants who choose the same parent key never share a child record
  and no (scope, key, step) triple can collide with another by shifting bytes between fields.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from grpc_idempotency.core.errors import KeyInvalid, ScopeUnavailable
from grpc_idempotency.core.wire import KEY_HEADER, KEY_HEADER_BIN

MAX_KEY_LENGTH = 255
MAX_SCOPE_LENGTH = 1024
STEP_NAME = re.compile(r"[a-z][a-z0-9-]*\.v[1-9][0-9]*")

_CHILD_DOMAIN = b"grpc-idempotency/child/v1"
_LOCK_DOMAIN = b"grpc-idempotency/claim-lock/v1"
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def key_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The call's key, ``None`` when absent; raises ``KeyInvalid`` for every malformed form."""
    found: str | None = None
    for name, value in metadata or ():
        if name == KEY_HEADER_BIN:
            raise KeyInvalid(f"send the idempotency key as text metadata {KEY_HEADER!r}, not -bin")
        if name != KEY_HEADER:
            continue
        if found is not None:
            raise KeyInvalid(f"{KEY_HEADER!r} was sent more than once")
        found = validate_key(value.decode("latin-1") if isinstance(value, bytes) else value)
    return found


def validate_key(key: str) -> str:
    if not key:
        raise KeyInvalid("idempotency key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise KeyInvalid(f"idempotency key is longer than {MAX_KEY_LENGTH} characters")
    if not _VISIBLE_ASCII.fullmatch(key):
        raise KeyInvalid("idempotency key must be visible ASCII (0x21-0x7E)")
    return key


def validate_scope(scope: str) -> str:
    if not scope:
        raise ScopeUnavailable("the scope resolver returned an empty scope")
    if len(scope) > MAX_SCOPE_LENGTH or "\x00" in scope:
        raise ScopeUnavailable("the scope resolver returned an unusable scope")
    return scope


def is_step_name(name: str) -> bool:
    return STEP_NAME.fullmatch(name) is not None


def _lp(value: str) -> bytes:
    raw = value.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw


def child_key(scope: str, parent_key: str, step: str) -> str:
    """The key of ``step`` inside the operation ``(scope, parent_key)``: 64 hex characters."""
    if not is_step_name(step):
        raise ValueError(f"step name {step!r} does not match {STEP_NAME.pattern}")
    digest = hashlib.sha256(_CHILD_DOMAIN + _lp(scope) + _lp(parent_key) + _lp(step))
    return digest.hexdigest()


def claim_lock_id(namespace: str, scope: str, key: str) -> int:
    """A signed 64-bit advisory-lock id for one (namespace, scope, key).

    A collision only makes two unrelated keys wait for each other once; it cannot mix records.
    """
    digest = hashlib.sha256(_LOCK_DOMAIN + _lp(namespace) + _lp(scope) + _lp(key)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)
