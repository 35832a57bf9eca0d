"""Tenants and their bearer tokens for the process-level tests.

The example's services accept only the tokens they were started with (``CHECKOUT_TOKENS``,
``CHECKOUT_RELAY_TOKEN``; see examples/checkout/auth.py), and processes shared by a module start
before its tests choose their tenants. So the session draws a pool of tenants with random tokens
up front, every process started through ``procs`` gets the whole table, and each test takes
tenants of its own with ``fresh()``: a test still isolates its rows by tenant.
"""

from __future__ import annotations

import itertools
import secrets
import uuid
from dataclasses import dataclass

from examples.checkout.auth import RELAY_TOKEN_ENV, SCOPE_PREFIX, TOKENS_ENV, bearer

POOL_SIZE = 400
RELAY_TOKEN = "e2e-relay-" + secrets.token_hex(16)


@dataclass(frozen=True)
class Tenant:
    name: str
    token: str

    @property
    def scope(self) -> str:
        """The idempotency scope, and the ``tenant`` column of the rows the services write."""
        return SCOPE_PREFIX + self.name

    @property
    def credential(self) -> tuple[str, str]:
        """``("authorization", "Bearer <token>")``."""
        return bearer(self.token)


def _tenant() -> Tenant:
    return Tenant("t-" + uuid.uuid4().hex[:12], "e2e-" + secrets.token_hex(16))


_POOL = tuple(_tenant() for _ in range(POOL_SIZE))
_next = itertools.count()


def fresh() -> Tenant:
    """A tenant no other test has used; every process started by ``procs`` accepts its token."""
    n = next(_next)
    if n >= POOL_SIZE:
        raise RuntimeError("the e2e tenant pool is used up: raise tests/e2e/tenants.POOL_SIZE")
    return _POOL[n]


def stranger() -> Tenant:
    """A tenant with a well-formed token that no process accepts."""
    return _tenant()


def environment() -> dict[str, str]:
    """The token configuration of every process the tests start."""
    return {
        TOKENS_ENV: ",".join(f"{t.token}={t.name}" for t in _POOL),
        RELAY_TOKEN_ENV: RELAY_TOKEN,
    }
