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

from grpc_idempotency.core.errors import KeyInvalid, ScopeResolverFailed, ScopeUnavailable
from grpc_idempotency.core.log_text import code_point, unsafe_character
from grpc_idempotency.core.wire import KEY_HEADER, KEY_HEADER_BIN

MAX_KEY_LENGTH = 255
MAX_SCOPE_BYTES = 1024
"""A scope's most UTF-8 bytes: with a key, it must fit one entry of the records' unique index."""
STEP_NAME = re.compile(r"[a-z][a-z0-9-]*\.v[1-9][0-9]*")
MAX_STEP_NAME_LENGTH = 128
"""A step name's most characters (ASCII: bytes too). Not for the child key, a SHA-256 of 64 hex
characters whatever the name's length, but for where the name itself travels: the value of the
step header (``wire.STEP_HEADER``, metadata of its own only on a channel without the client
interceptor, which strips it) and the texts of the errors that name steps (``StepUndeclared``,
``StepAmbiguous``, ``StepReused``, some listing a method's steps on one target), sent as the
``grpc-message`` trailer. A receiver refuses metadata past its limit (gRPC's default: 8 KiB):
with a name of 20,000 characters, a handler naming a wrong step was answered RESOURCE_EXHAUSTED
("received metadata size exceeds hard limit") instead of the library's error. 128 is twice the
child key's length, ample for a name and a version ("charge-card.v1"), and keeps a message
listing dozens of a method's steps under 8 KiB."""

_CHILD_DOMAIN = b"grpc-idempotency/child/v1"
_LOCK_DOMAIN = b"grpc-idempotency/claim-lock/v1"
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def key_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The call's key, ``None`` when absent; raises ``KeyInvalid`` for every malformed form: an
    ``idempotency-key-bin`` entry, the key given more than once, or a key ``validate_key``
    refuses.

    The one definition of a malformed key's metadata: the server refuses a call by it, and the
    client interceptor refuses to send one by it (given the key entries it would send), so that
    the two cannot drift (the client's own copy of these checks was a second list to keep in
    step). Whichever the entries' order, -bin is said first, then the count, then the key."""
    keys: list[str | bytes] = []
    for name, value in metadata or ():
        if name == KEY_HEADER_BIN:
            # Said even beside a valid text key: a reader of the -bin form took another key.
            raise KeyInvalid(f"send the idempotency key as text metadata {KEY_HEADER!r}, not -bin")
        if name == KEY_HEADER:
            keys.append(value)
    if not keys:
        return None
    if len(keys) > 1:
        raise KeyInvalid(
            f"{KEY_HEADER!r} given {len(keys)} times; a call carries one key, never more than once"
        )
    (value,) = keys
    return validate_key(value.decode("latin-1") if isinstance(value, bytes) else value)


def validate_key(key: str) -> str:
    if not isinstance(key, str):
        # Bytes read back from a database, say: re and len() refused them with their own
        # TypeErrors, which said nothing about the key.
        raise KeyInvalid(f"an idempotency key is a str, not {type(key).__name__}")
    if not key:
        raise KeyInvalid("idempotency key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise KeyInvalid(f"idempotency key is longer than {MAX_KEY_LENGTH} characters")
    if not _VISIBLE_ASCII.fullmatch(key):
        raise KeyInvalid("idempotency key must be visible ASCII (0x21-0x7E)")
    return key


def validate_scope(scope: object) -> str:
    """``scope`` as a scope resolver returned it, checked before it reaches the store: a str of
    1..``MAX_SCOPE_BYTES`` UTF-8 bytes holding no character that is unsafe to show
    (``scope_problem``). What is not a str is the resolver's bug (``ScopeResolverFailed``); the
    rest is ``ScopeUnavailable``."""
    if not isinstance(scope, str):
        raise ScopeResolverFailed(f"the scope resolver returned {type(scope).__name__}, not str")
    problem = scope_problem(scope)
    if problem is not None:
        raise ScopeUnavailable(f"the scope resolver returned an unusable scope: {problem}")
    return scope


def scope_problem(scope: str) -> str | None:
    """Why ``scope`` can be no scope, without quoting it; ``None`` when it can be one.

    Empty; over ``MAX_SCOPE_BYTES`` bytes of UTF-8 (counted in characters, 1024 four-byte ones
    passed, and the record's index refused them: the handler ran and its call failed, or a
    fail-open method ran without deduplication); not UTF-8 (a lone surrogate); or holding a
    character that could split or disguise the lines it is shown in (``log_text.is_unsafe``:
    a control character, NUL (which PostgreSQL's text cannot hold), a newline, ESC, a line
    separator, a bidi override or mark, a zero width space). A scope is written to log lines
    and the command-line tools' output, where a newline forged a line, an ESC sequence rewrote
    a terminal and a bidi override reordered what the operator read, and sent as a header by
    ``forward_scope``, which gRPC refuses for them (the outbox row was a dead letter): whatever
    resolved it (a header, a certificate's name, a token), such a scope is refused. ZWNJ and
    ZWJ, which spell words in some scripts, are taken."""
    if not scope:
        return "it is empty"
    try:
        size = len(scope.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid UTF-8 (a lone surrogate)"
    if size > MAX_SCOPE_BYTES:
        return f"it is {size} bytes of UTF-8; a scope is 1-{MAX_SCOPE_BYTES} bytes"
    unsafe = unsafe_character(scope)
    if unsafe is not None:
        return (
            f"it holds {code_point(unsafe)}, a control, line-separator or format character"
            " (which would split or disguise the lines it is shown in)"
        )
    return None


def is_step_name(name: str) -> bool:
    return step_name_problem(name) is None


def step_name_problem(name: str) -> str | None:
    """Why ``name`` is no step name, as ``step name '...' ...``; ``None`` when it is one."""
    if len(name) > MAX_STEP_NAME_LENGTH:
        # Not quoted whole: the error would be as long as the name it refuses.
        return (
            f"step name {name[:40]!r}... is {len(name)} characters long; a step name has at most"
            f" {MAX_STEP_NAME_LENGTH}"
        )
    if STEP_NAME.fullmatch(name) is None:
        return f"step name {name!r} does not match {STEP_NAME.pattern}"
    return None


def step_base(name: str) -> str:
    """A step name without its version: "charge-card.v2" -> "charge-card" (the versions of one
    step share it)."""
    head, sep, version = name.rpartition(".v")
    return head if sep and version.isdigit() else name


def _lp(value: str) -> bytes:
    raw = value.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw


def child_key(scope: str, parent_key: str, step: str) -> str:
    """The key of ``step`` inside the operation ``(scope, parent_key)``: 64 hex characters."""
    for name, value in (("scope", scope), ("parent_key", parent_key)):
        if not isinstance(value, str):
            # current_call().scope and .key are None for a call without a key: no operation
            # to derive from. Said here, not as str.encode's AttributeError on None.
            raise TypeError(
                f"child_key: {name} is a str, not {type(value).__name__} (a call served"
                " without a key has no scope or key to derive child keys from)"
            )
    problem = step_name_problem(step)
    if problem is not None:
        raise ValueError(problem)
    digest = hashlib.sha256(_CHILD_DOMAIN + _lp(scope) + _lp(parent_key) + _lp(step))
    return digest.hexdigest()


def claim_lock_id(namespace: str, scope: str, key: str) -> int:
    """A signed 64-bit advisory-lock id for one (namespace, scope, key).

    A collision only makes two unrelated keys wait for each other once; it cannot mix records.
    """
    digest = hashlib.sha256(_LOCK_DOMAIN + _lp(namespace) + _lp(scope) + _lp(key)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)
