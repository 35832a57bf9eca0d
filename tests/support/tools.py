"""Where the tests find external tools."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from tests.support.cli_forks import run_forked

ROOT = Path(__file__).resolve().parents[2]

# Every CLI command that opens the store, with its other required arguments: where the
# tests of bad DSNs run each.
DB_COMMANDS = {
    "migrate": ["migrate"],
    "purge": ["purge"],
    "list": ["list", "--scope", "s"],
    "inspect": ["inspect", "--scope", "s", "k"],
    "outbox stats": ["outbox", "stats"],
    "outbox dead": ["outbox", "dead"],
    "relay": ["relay", "--grpc-target", "127.0.0.1:1", "--method", "/a.B/C"],
}


def buf_binary() -> str | None:
    """buf from CI's install (.ci/run puts it in .ci/.buf), a local npm install, or PATH."""
    for candidate in (
        ROOT / ".ci/.buf/node_modules/.bin/buf",
        Path("/tmp/buf/node_modules/.bin/buf"),
    ):
        if candidate.exists():
            return str(candidate)
    return shutil.which("buf")


def run_cli(
    *args: str, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``grpc-idempotency <args>`` run to the end in a process of its own (a fork of one that
    imported the CLI: tests/support/cli_forks.py; 60 s at most), its output captured as text;
    ``env`` replaces the inherited environment."""
    return run_forked(list(args), env=os.environ if env is None else env, cwd=cwd)
