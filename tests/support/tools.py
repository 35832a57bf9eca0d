"""Where the tests find external tools."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

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
    """``grpc-idempotency <args>`` run to the end as ``python -m grpc_idempotency.cli`` (60 s at
    most), its output captured as text; ``env`` replaces the inherited environment."""
    return subprocess.run(
        [sys.executable, "-m", "grpc_idempotency.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
        check=False,
    )
