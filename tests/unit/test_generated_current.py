"""The committed generated code matches what ``python -m examples.checkout.regenerate`` makes.

Covers examples/checkout/gen/, src/grpc_idempotency/v1/options_pb2.py(.pyi) and the copy of
options.proto that ships in the wheel. The check itself is checked on a scratch copy of the tree:
it must see a stale file without touching it, and a plain run must repair it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What regenerate reads and writes: enough of the tree to run it from a copy.
TREE = (
    "examples/__init__.py",
    "examples/checkout/__init__.py",
    "examples/checkout/regenerate.py",
    "examples/checkout/protos",
    "examples/checkout/gen",
    "protos",
    "src/grpc_idempotency/v1",
    "src/grpc_idempotency/_proto",
)
GENERATED = "examples/checkout/gen/checkout/v1/payments_pb2_grpc.py"
SHIPPED = "src/grpc_idempotency/_proto/grpc_idempotency/v1/options.proto"
# The library's own gencode, in the wheel: its stubs are what a user's type checker reads.
LIBRARY_STUB = "src/grpc_idempotency/v1/options_pb2.pyi"


def _regenerate(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # The tree at ``root`` comes first; the installed grpc_idempotency stays importable.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "examples.checkout.regenerate", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_committed_generated_code_is_current() -> None:
    done = _regenerate(ROOT, "--check")
    assert done.returncode == 0, (
        "generated code is stale; run `python -m examples.checkout.regenerate`\n"
        f"{done.stdout}{done.stderr}"
    )


def test_check_reports_stale_files_and_regenerate_repairs_them(tmp_path: Path) -> None:
    for rel in TREE:
        source, target = ROOT / rel, tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(source, target)
    (tmp_path / GENERATED).write_text("# edited by hand\n")
    (tmp_path / LIBRARY_STUB).write_text("# edited by hand\n")
    (tmp_path / SHIPPED).unlink()
    orphan = tmp_path / "examples/checkout/gen/checkout/v1/removed_pb2.py"
    orphan.write_text("# its proto is gone\n")

    check = _regenerate(tmp_path, "--check")
    assert check.returncode == 1, check.stdout + check.stderr
    for rel in (
        GENERATED,
        LIBRARY_STUB,
        SHIPPED,
        "examples/checkout/gen/checkout/v1/removed_pb2.py",
    ):
        assert f"stale: {rel}" in check.stdout, check.stdout
    assert (tmp_path / GENERATED).read_text() == "# edited by hand\n", "--check wrote files"
    assert not (tmp_path / SHIPPED).exists(), "--check wrote files"

    fix = _regenerate(tmp_path)
    assert fix.returncode == 0, fix.stdout + fix.stderr
    assert (tmp_path / GENERATED).read_bytes() == (ROOT / GENERATED).read_bytes()
    assert (tmp_path / LIBRARY_STUB).read_bytes() == (ROOT / LIBRARY_STUB).read_bytes()
    assert (tmp_path / SHIPPED).read_bytes() == (
        ROOT / "protos/grpc_idempotency/v1/options.proto"
    ).read_bytes()
    assert not orphan.exists()
    assert _regenerate(tmp_path, "--check").returncode == 0
