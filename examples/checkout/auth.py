"""Who is calling: bearer tokens, each standing for one tenant.

Every call to a checkout service carries ``authorization: Bearer <token>``. The token names the
tenant; nothing the client says besides the token does. In particular an ``x-tenant-id`` header
from a tenant's client is never read: the idempotency scope (and the ``tenant`` column of every
row a service writes) is ``tenant:<the token's tenant>``, so a caller can neither replay another
tenant's stored responses nor squat its keys.

Tokens are configured per process, from the environment (the defaults are the demo's, fine on a
laptop and nowhere else):

``CHECKOUT_TOKENS``       ``token=tenant,token=tenant,...``: the tokens payments, notifications
                          and orders accept (default: ``demo-token-acme=acme,
                          demo-token-globex=globex``)
``CHECKOUT_RELAY_TOKEN``  the token of the outbox relay, the only caller the ledger accepts
                          (default: ``demo-token-relay``). The relay delivers every tenant's
                          events, so it names the tenant of each one in ``x-tenant-id``: the
                          ledger believes that header from the relay's token and from no other.

Three pieces share one ``Authenticator``:

- ``AuthInterceptor``, the **first** server interceptor: a call without a valid token is answered
  UNAUTHENTICATED before any other interceptor runs, so it touches no database and is never
  deduplicated, logged or replayed. Placed after ``IdempotencyInterceptor`` it would come too
  late for replays, which the idempotency interceptor answers from its records without calling
  further in (tests/integration/test_auth_order.py shows both orders).
- ``Authenticator.scope``, the ``IdempotencyInterceptor``'s scope resolver: the token's tenant
  again (it raises ``ScopeUnavailable``, so even a misordered server refuses a bad token on a
  keyed method).
- ``Authenticator.identify`` for handlers that read the caller's own rows (``GetOrder``,
  ``ListCharges``) and for the attempt log.

Orders calls payments and notifications on the caller's behalf with the caller's own token
(``forward_metadata=["authorization"]`` on its client interceptor): downstream, the tenant, and so
the child keys' scope, is the same one, proven by the same token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from grpc_idempotency import ScopeUnavailable

AUTHORIZATION = "authorization"
TENANT_HEADER = "x-tenant-id"  # believed from the relay's token only
SCOPE_PREFIX = "tenant:"
TOKENS_ENV = "CHECKOUT_TOKENS"
RELAY_TOKEN_ENV = "CHECKOUT_RELAY_TOKEN"
DEMO_TOKENS: Mapping[str, str] = {"demo-token-acme": "acme", "demo-token-globex": "globex"}
DEMO_RELAY_TOKEN = "demo-token-relay"

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_TOKEN = re.compile(r"[\x21-\x7e]{8,512}")  # visible ASCII, as metadata values allow
Metadata = Iterable[tuple[str, str | bytes]]


class Unauthenticated(Exception):
    """No valid credential on the call; the message says what is wrong, never a token."""


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    relay: bool = False
    """The call comes from the outbox relay, delivering an event of ``tenant``."""

    @property
    def scope(self) -> str:
        return SCOPE_PREFIX + self.tenant


def bearer(token: str) -> tuple[str, str]:
    """The metadata entry a client sends: ``("authorization", "Bearer <token>")``."""
    return (AUTHORIZATION, f"Bearer {token}")


def parse_tokens(text: str) -> dict[str, str]:
    """``token=tenant,token=tenant`` -> ``{token: tenant}``; raises ValueError naming the entry
    (by position, not by its token) that is malformed or repeated."""
    tokens: dict[str, str] = {}
    for n, part in enumerate((p.strip() for p in text.split(",")), 1):
        if not part:
            continue
        token, sep, tenant = part.partition("=")
        if not sep or not _TOKEN.fullmatch(token) or not _TENANT.fullmatch(tenant):
            raise ValueError(
                f"{TOKENS_ENV}: entry {n} is not token=tenant (a token is 8-512 visible ASCII"
                " characters; a tenant is letters, digits, '.', '_' and '-')"
            )
        if token in tokens:
            raise ValueError(f"{TOKENS_ENV}: entry {n} repeats an earlier token")
        tokens[token] = tenant
    if not tokens:
        raise ValueError(f"{TOKENS_ENV}: no tokens")
    return tokens


def _digest(token: str) -> bytes:
    # Tokens are looked up by digest: no comparison runs over the secret itself.
    return hashlib.sha256(token.encode("utf-8")).digest()


def _single(metadata: Metadata, name: str) -> str | None:
    values = [v for k, v in metadata if k == name]
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    return values[0]


class Authenticator:
    """Maps the bearer token of a call to an ``Identity``.

    ``tenants``: ``{token: tenant}``, the tenants' tokens this service accepts. ``relay_token``:
    the relay's token, accepted with an ``x-tenant-id`` naming the event's tenant.
    """

    def __init__(
        self, tenants: Mapping[str, str] | None = None, *, relay_token: str | None = None
    ) -> None:
        self._tenants = {_digest(t): tenant for t, tenant in (tenants or {}).items()}
        self._relay = None if relay_token is None else _digest(relay_token)
        if not self._tenants and self._relay is None:
            raise ValueError("an Authenticator that accepts no token would refuse every call")

    @classmethod
    def for_service(cls, service: str, environ: Mapping[str, str] | None = None) -> Authenticator:
        """The tokens ``service`` accepts, from the environment: the ledger accepts the relay
        only; payments, notifications and orders accept the tenants' tokens."""
        env = os.environ if environ is None else environ
        if service == "ledger":
            return cls(relay_token=relay_token(env))
        text = env.get(TOKENS_ENV)
        if text is None:
            _demo_warning(TOKENS_ENV)
            return cls(DEMO_TOKENS)
        return cls(parse_tokens(text))

    def identify(self, metadata: Metadata | None) -> Identity:
        """The caller's identity; raises ``Unauthenticated``."""
        md = list(metadata or ())
        header = _single(md, AUTHORIZATION)
        scheme, _, token = (header or "").partition(" ")
        if header is None or scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(f"send exactly one '{AUTHORIZATION}: Bearer <token>' entry")
        digest = _digest(token.strip())
        tenant = self._tenants.get(digest)
        if tenant is not None:
            return Identity(tenant)
        if self._relay is not None and hmac.compare_digest(digest, self._relay):
            named = _single(md, TENANT_HEADER)
            if named is None or not _TENANT.fullmatch(named):
                raise Unauthenticated(f"the relay must name the event's tenant in {TENANT_HEADER}")
            return Identity(named, relay=True)
        raise Unauthenticated("unknown or revoked token")

    def scope(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The scope resolver for ``IdempotencyInterceptor``: ``tenant:<the token's tenant>``."""
        try:
            return self.identify(context.invocation_metadata()).scope
        except Unauthenticated as exc:
            raise ScopeUnavailable(str(exc)) from exc


def relay_token(environ: Mapping[str, str] | None = None) -> str:
    """The relay's token, from ``CHECKOUT_RELAY_TOKEN`` (default: the demo's)."""
    env = os.environ if environ is None else environ
    token = env.get(RELAY_TOKEN_ENV)
    if token is None:
        _demo_warning(RELAY_TOKEN_ENV)
        return DEMO_RELAY_TOKEN
    if not _TOKEN.fullmatch(token):
        raise ValueError(f"{RELAY_TOKEN_ENV}: a token is 8-512 visible ASCII characters")
    return token


def _demo_warning(variable: str) -> None:
    print(f"auth: {variable} is not set, using the demo's public tokens", file=sys.stderr)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses a call without a valid token: UNAUTHENTICATED, before the interceptors after it
    run (put it first). Unary methods only, as every checkout method is."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        try:
            self.authenticator.identify(details.invocation_metadata)
        except Unauthenticated as exc:
            return _refusal(str(exc))
        return await continuation(details)


def _refusal(message: str) -> grpc.RpcMethodHandler[Any, Any]:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # Not calling further in: no deserializer either, the request is never even parsed.
    return grpc.unary_unary_rpc_method_handler(refuse)
