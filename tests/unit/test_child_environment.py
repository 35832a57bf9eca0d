"""The environment the conformance kit gives its server processes: the test's own, less what
would make the kit's servers misbehave (a failpoint or a fixed address left in the shell)."""

from __future__ import annotations

import pytest

from grpc_idempotency.core.failpoints import ENV_VAR as FAILPOINTS_ENV
from grpc_idempotency.testing import serve
from grpc_idempotency.testing._process import child_environment


def test_a_fixed_address_or_failpoints_in_the_shell_are_not_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kit runs two servers at once: a fixed port made the second fail to bind, and a
    # failpoint meant for another test crashed servers that were to run cleanly.
    monkeypatch.setenv(serve.ADDRESS_ENV, "127.0.0.1:50051")
    monkeypatch.setenv(FAILPOINTS_ENV, "after_claim=crash")
    monkeypatch.setenv("KIT_TEST_KEPT", "yes")
    env = child_environment("postgresql://h/db", None, {})
    assert env[serve.ADDRESS_ENV] == serve.DEFAULT_ADDRESS
    assert FAILPOINTS_ENV not in env
    assert (env["KIT_TEST_KEPT"], env[serve.DSN_ENV]) == ("yes", "postgresql://h/db")


def test_server_env_and_the_checks_failpoints_still_choose() -> None:
    env = child_environment("dsn", "after_claim=crash", {serve.ADDRESS_ENV: "127.0.0.1:7"})
    assert (env[serve.ADDRESS_ENV], env[FAILPOINTS_ENV]) == ("127.0.0.1:7", "after_claim=crash")
