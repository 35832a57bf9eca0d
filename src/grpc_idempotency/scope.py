"""Scope resolvers: whose key is this? A record lives under (scope, key), never under a key alone.

A resolver is a plain (not async) function: it takes the call's ``grpc.aio.ServicerContext`` and
returns the scope, a str of 1..1024 bytes of UTF-8 without control, line-separator or format
characters (but ZWNJ and ZWJ: ``keys.scope_problem``), or raises
``ScopeUnavailable`` (the call is refused with UNAUTHENTICATED before the store is touched;
another of the library's errors is answered with its own status). A str that cannot be a scope
(empty, too long, holding such a character) is refused as ``ScopeUnavailable`` too. Anything
else it raises, or a return that is not a str, is a bug of the server's: logged (at most once a
minute), and the call refused with INTERNAL (``ScopeResolverFailed``) without the exception's
text.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from grpc_idempotency.core.errors import IdempotencyError, ScopeUnavailable
from grpc_idempotency.core.keys import MAX_SCOPE_BYTES, scope_problem, validate_scope
from grpc_idempotency.core.log_text import code_point, unsafe_character
from grpc_idempotency.core.wire import HEADER_NAME, KEY_HEADER_BIN, LIBRARY_HEADERS

ScopeResolver = Callable[[grpc.aio.ServicerContext[Any, Any]], str]


def peer_identity_scope(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The default: the authenticated peer's identity (the TLS client certificate's names).

    A call over a connection without client authentication is refused: guessing a scope would
    let two callers share each other's keys.

    The names are gRPC's peer identities: the certificate's subject alternative names of every
    type (DNS, URI, email, IP) as bare text, or its common name when it has none. So certificates
    whose names read the same share a scope whatever the names' types (CN=a.example with no SAN,
    DNS:a.example, email:a.example, URI:a.example). Where the CA can issue such names to
    different callers, resolve the scope from ``context.auth_context()`` (``peer_dns``,
    ``peer_uri``, ``peer_email``, ``peer_ip``, ``x509_common_name``) instead. Behind a proxy
    that opens its own mutual TLS connection, every caller is the proxy.
    """
    identities = context.peer_identities()
    if not identities:
        raise ScopeUnavailable(
            "no authenticated peer identity (mutual TLS) to scope the idempotency key;"
            " configure a scope resolver"
        )
    return peer_scope(identities)


def peer_scope(identities: Iterable[bytes]) -> str:
    """The scope of a peer with these certificate names: one-to-one, so that two peers share a
    scope only if they have the same names. Names are sorted and joined with "," after escaping
    "\\" and "," (a name may hold a comma: a URI SAN); a name that is not UTF-8 is written as
    "\\x" and its hex digits (decoding it with replacement characters made different names
    equal). Names of plain text, which is what certificates hold, read as they are.

    Names too many or too long for a scope (over ``MAX_SCOPE_BYTES`` so written: a certificate
    listing every DNS name of a service) give "peer-sha256:" and the SHA-256 of that text in
    hex, one per set of names still, and never a scope of plain names; such a peer was refused
    on every keyed call. Names holding characters no scope may hold (NUL, which no text column
    can hold, a newline, ESC, a bidi override: ``log_text.is_unsafe``) are left as they are, and
    refused, however many (``validate_scope``)."""
    scope = "peer:" + ",".join(sorted(_name(identity) for identity in identities))
    written = scope.encode("utf-8")
    if len(written) <= MAX_SCOPE_BYTES or unsafe_character(scope) is not None:
        return scope
    return "peer-sha256:" + hashlib.sha256(written).hexdigest()


def _name(identity: bytes) -> str:
    try:
        text = identity.decode("utf-8")
    except UnicodeDecodeError:
        return "\\x" + identity.hex()
    return text.replace("\\", "\\\\").replace(",", "\\,")


class StaticScope:
    """One fixed scope: a service with a single trusted caller, or tests."""

    def __init__(self, scope: str) -> None:
        try:
            self.scope = validate_scope(scope)
        except IdempotencyError as err:  # found now rather than on every call
            raise ValueError(f"StaticScope: {err.message}") from None

    def __call__(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        return self.scope


class MetadataScope:
    """The scope from a metadata entry such as ``x-tenant-id``.

    Safe only behind an authenticating gateway that sets the header and strips any value the
    client sent: otherwise any caller can name any tenant and read its stored responses.
    """

    def __init__(self, header: str = "x-tenant-id", *, prefix: str = "tenant:") -> None:
        # Refused now rather than on every call: no call could ever have a scope, or worse.
        self.header = tenant_header(header, prefix, user="MetadataScope")
        self.prefix = prefix

    def __call__(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        values = [v for k, v in context.invocation_metadata() or () if k == self.header]
        if len(values) != 1 or not isinstance(values[0], str) or not values[0]:
            raise ScopeUnavailable(f"expected exactly one {self.header!r} metadata entry")
        unsafe = unsafe_character(values[0])
        if unsafe is not None:
            # No gRPC client sends one (it refuses what is not printable ASCII), but the
            # server passes a raw HTTP/2 client's on, decoded as UTF-8 or else Latin-1: a
            # newline, an ESC sequence or a bidi override in a scope reached the server's log
            # lines, the command-line tools' output and the outbox (whose forward_scope cannot
            # send it). Said here as the header's fault, not the resolver's.
            raise ScopeUnavailable(
                f"the {self.header!r} metadata entry holds {code_point(unsafe)}, a control,"
                " line-separator or format character"
            )
        return self.prefix + values[0]


_TRANSPORT_HEADERS = frozenset({"content-type", "te", "user-agent"})
"""Headers of gRPC's HTTP/2 transport, besides the reserved ``grpc-`` ones."""


def tenant_header(header: str, prefix: str, *, user: str) -> str:
    """``header`` as gRPC names it (lowercase), checked for carrying a tenant as a scope's text
    after ``prefix``: ``MetadataScope`` reads it, ``forward_scope`` sends it."""
    # Types first: None or an int header was a bare AttributeError ("no attribute 'lower'"), a
    # None prefix "argument of type 'NoneType' is not iterable", naming neither.
    if not isinstance(header, str):
        raise TypeError(f"{user}: header must be a str (a metadata name), not {header!r}")
    if not isinstance(prefix, str):
        raise TypeError(f"{user}: prefix must be a str, not {prefix!r}")
    name = header.lower()
    if not HEADER_NAME.fullmatch(name):
        raise ValueError(
            f"{user}: header {header!r}: gRPC metadata names are letters a-z, digits and - _ ."
        )
    if name.startswith("grpc-") or name in _TRANSPORT_HEADERS:
        # gRPC's own: a caller's grpc-timeout, content-type or te never reaches the handler, its
        # user-agent is gRPC's, and the other grpc- names are reserved for gRPC's use. Accepted,
        # every call was refused UNAUTHENTICATED, and forward_scope's tenant went nowhere (the
        # relay's --scope-header refused them already).
        raise ValueError(
            f"{user}: {name!r} is reserved by gRPC (grpc-..., content-type, te, user-agent),"
            " which does not deliver a caller's value of it"
        )
    if name in LIBRARY_HEADERS - {KEY_HEADER_BIN}:
        # The key as the scope: two tenants who pick one key share its record.
        raise ValueError(f"{user}: {name!r} is the library's own header")
    if name.endswith("-bin"):
        raise ValueError(
            f"{user}: {name!r} is binary metadata (-bin), whose values are bytes;"
            " send the tenant as text"
        )
    if "\x00" in prefix:
        raise ValueError(f"{user}: the prefix holds NUL, which no scope can hold")
    # The shortest scope it makes: a prefix holding a control or format character (refused in
    # every scope), or too long for a scope, had every MetadataScope call refused
    # UNAUTHENTICATED, and every message forward_scope sent a dead letter (no scope starts so).
    problem = scope_problem(prefix + "-")
    if problem is not None:
        raise ValueError(f"{user}: prefix {prefix!r} makes an unusable scope: {problem}")
    return name


def is_async(fn: object) -> bool:
    """Whether ``fn`` returns an awaitable: an ``async def`` function, or an object whose
    ``__call__`` is one. Scope resolvers and shard placements are called synchronously on every
    call, so such a function would "return" a coroutine that is never awaited."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004  (an object whose __call__ is async)
    )
