"""Build the API reference from the docstrings with pdoc: ``python .ci/api_docs.py [OUT_DIR]``.

The HTML is not committed. CI builds it into a temporary directory, so that a module pdoc cannot
import, or a reference missing a public name, fails the build. Without ``OUT_DIR`` the pages go to
a new temporary directory, printed at the end; ``python -m pdoc --docformat restructuredtext
grpc_idempotency grpc_idempotency.client grpc_idempotency.testing`` serves them live instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

# What a user imports: the package (its ``__all__``), the client module and the test helpers.
MODULES = ("grpc_idempotency", "grpc_idempotency.client", "grpc_idempotency.testing")
# The docstrings are reStructuredText-ish (``literal``, *emphasis*, - lists).
DOCFORMAT = "restructuredtext"


def build(out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pdoc", "--docformat", DOCFORMAT, "-o", str(out), *MODULES],
        check=True,
    )
    missing_pages = [m for m in MODULES if not (out / (m.replace(".", "/") + ".html")).is_file()]
    if missing_pages:
        raise SystemExit(f"api docs: no page for {', '.join(missing_pages)} in {out}")
    # The package resolves its names lazily (PEP 562): check that pdoc saw every one of them.
    import grpc_idempotency

    page = (out / "grpc_idempotency.html").read_text(encoding="utf-8")
    anchors = set(re.findall(r'id="([A-Za-z_][A-Za-z0-9_]*)"', page))
    unresolved = sorted(set(grpc_idempotency.__all__) - anchors)
    if unresolved:
        raise SystemExit(f"api docs: grpc_idempotency.html lacks {', '.join(unresolved)}")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="grpc-idempotency-api-"))
    build(out)
    print(f"api docs: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
