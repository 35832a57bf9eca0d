"""Code generated from ../protos (do not edit; `python -m examples.checkout.regenerate`).

protoc's gRPC stubs import their messages as ``checkout.v1...``, a top-level package, so this
directory goes on ``sys.path`` when the example is imported.
"""

import sys
from pathlib import Path

_here = str(Path(__file__).parent)
if _here not in sys.path:
    sys.path.append(_here)
