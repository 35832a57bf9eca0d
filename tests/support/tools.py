"""Where the tests find external tools."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def buf_binary() -> str | None:
    """buf from CI's install (.ci/run puts it in .ci/.buf), a local npm install, or PATH."""
    for candidate in (
        ROOT / ".ci/.buf/node_modules/.bin/buf",
        Path("/tmp/buf/node_modules/.bin/buf"),
    ):
        if candidate.exists():
            return str(candidate)
    return shutil.which("buf")
