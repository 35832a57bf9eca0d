"""What the README and the examples import from grpc_idempotency type-checks in a user's project
under ``mypy --strict``, whose ``no_implicit_reexport`` refuses a name a module merely imports
(the package ships ``py.typed``: its modules' exports are what mypy sees, not what runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"^\s*(from grpc_idempotency[\w.]* import [\w, ]+?)\s*(?:#.*)?$", re.MULTILINE)


def _documented_imports() -> list[str]:
    sources = [ROOT / "README.md", *sorted((ROOT / "examples").rglob("*.py"))]
    found = {m.group(1) for path in sources for m in IMPORT.finditer(path.read_text("utf-8"))}
    return sorted(found)


# In the same run (one mypy start): a typed stub's method keeps its types through Operation.call.
# Were call() to return Any, strict mode's warn_return_any would refuse ``return``; were it to
# take any request, the ignore below would be unused (warn_unused_ignores).
TYPED_CALL = """
import grpc
from grpc_idempotency.client import Operation as _Operation

async def _typed(method: grpc.aio.UnaryUnaryMultiCallable[int, str]) -> str:
    await _Operation.new().call(method, "not an int")  # type: ignore[misc]
    return await _Operation.new().call(method, 1)
"""

# The packages resolve their names on first use (a module ``__getattr__``); were mypy to see that
# ``__getattr__``, every name imported from them would type-check as ``Any``, a misspelt one
# included (the ignores below would then be unused: warn_unused_ignores).
MISSPELT = """
from grpc_idempotency import IdempotencyInterceptr  # type: ignore[attr-defined]
from grpc_idempotency.testing import EmbededPostgres  # type: ignore[attr-defined]
import grpc_idempotency as _package
_package.Stroe  # type: ignore[attr-defined]
"""

# A user's own functions over the library's connection need a type to annotate it with: a named
# consumer effect, a helper handed ``current_call().connection``. ``asyncpg.Connection`` is not
# it (the pool hands out proxies, and mypy refuses an effect over one), so the package names it.
TYPED_CONNECTION = """
from typing import Any as _Any

import asyncpg
from grpc_idempotency import IdempotentConsumer as _Consumer
from grpc_idempotency import PooledConnection as _Conn
from grpc_idempotency import current_call as _current_call

async def _effect(conn: _Conn) -> int:
    return 1

async def _plain(conn: asyncpg.Connection[_Any]) -> int:
    return 1

def _helper(conn: _Conn) -> None: ...

async def _consume(consumer: _Consumer, context: grpc.aio.ServicerContext[_Any, _Any]) -> int:
    _helper(_current_call().connection)
    _helper(await _current_call().transaction())
    async with _current_call().savepoint() as nested:
        _helper(nested)
    await consumer.process("m", _plain)  # type: ignore[arg-type]
    called = await consumer.process_call(context, _effect)
    result = await consumer.process("m", _effect)
    return (result.value or 0) + (called.value or 0)
"""


def test_the_documented_imports_type_check_under_mypy_strict(tmp_path: Path) -> None:
    imports = _documented_imports()
    assert "from grpc_idempotency.client import Operation, RetryPolicy" in imports
    user = tmp_path / "user.py"
    user.write_text(
        "\n".join(
            ["from __future__ import annotations", *imports, TYPED_CALL, MISSPELT, TYPED_CONNECTION]
        ),
        "utf-8",
    )
    # Run from tmp_path, away from this repository's mypy configuration, as in a user's
    # project; the package from this tree (MYPYPATH), its own modules' errors not reported.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         "--no-incremental", str(user)],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
