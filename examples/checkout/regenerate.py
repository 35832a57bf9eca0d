"""Regenerate the committed protobuf code: ``python -m examples.checkout.regenerate [--check]``.

- ``examples/checkout/gen/`` from ``examples/checkout/protos/`` (messages, ``.pyi``, gRPC stubs
  and, from this package's own protoc plugin, ``protoc-gen-grpc-idempotency``, the
  ``*_idempotency.py`` modules: step names, policies, typed step calls, service config);
- the library's ``src/grpc_idempotency/v1/options_pb2.py(.pyi)`` from
  ``protos/grpc_idempotency/v1/options.proto``, and the copy of that proto that ships in the wheel
  (``src/grpc_idempotency/_proto/...``, what ``grpc_idempotency.proto_include()`` points at).

Everything is generated into a temporary directory first. Without ``--check`` the files that
differ are copied into the tree (and generated files whose proto is gone are deleted); with
``--check`` nothing is written and the exit code is 1 when any committed file is stale.
Run it with the pinned ``grpcio-tools`` of the dev extra: its protoc is what the check compares.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PROTOS = ROOT / "examples" / "checkout" / "protos"
EXAMPLE_GEN = ROOT / "examples" / "checkout" / "gen"
LIBRARY_PROTOS = ROOT / "protos"
LIBRARY_SRC = ROOT / "src"
OPTIONS_PROTO = Path("grpc_idempotency/v1/options.proto")
SHIPPED_PROTO = Path("grpc_idempotency/_proto") / OPTIONS_PROTO  # relative to src/
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_idempotency.py")
PLUGIN = "protoc-gen-grpc-idempotency"


def _protoc(*args: str | Path) -> None:
    # ``python -m grpc_tools.protoc`` (not ``grpc_tools.protoc.main``) adds the include path of
    # the well-known types (google/protobuf/timestamp.proto).
    command = [sys.executable, "-m", "grpc_tools.protoc", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed ({done.returncode}): {' '.join(command)}\n{done.stderr}")


def _files(directory: Path) -> set[Path]:
    return {p.relative_to(directory) for p in directory.rglob("*") if p.is_file()}


def generate_library(out: Path) -> set[Path]:
    """Generates the library's files into ``out`` laid out like ``src/``; returns their paths
    relative to ``out``: ``options_pb2.py``, ``options_pb2.pyi`` and the shipped proto copy."""
    _protoc(f"-I{LIBRARY_PROTOS}", f"--python_out={out}", f"--pyi_out={out}", OPTIONS_PROTO)
    shipped = out / SHIPPED_PROTO
    shipped.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(LIBRARY_PROTOS / OPTIONS_PROTO, shipped)
    return _files(out)


def _plugin(scratch: Path) -> Path:
    """The plugin executable of this interpreter's grpc_idempotency: the console script next to
    the interpreter when installed, else a wrapper running ``-m grpc_idempotency.protoc_gen``."""
    script = Path(sys.executable).parent / PLUGIN
    if script.is_file() and os.access(script, os.X_OK):
        return script
    wrapper = scratch / PLUGIN
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m grpc_idempotency.protoc_gen "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def generate_example(out: Path) -> set[Path]:
    """Generates the example's code into ``out`` laid out like ``gen/``; returns the paths."""
    from grpc_idempotency import proto_include

    protos = sorted(p.relative_to(EXAMPLE_PROTOS) for p in EXAMPLE_PROTOS.rglob("*.proto"))
    with tempfile.TemporaryDirectory(prefix="gi-plugin-") as scratch:
        _protoc(
            f"-I{EXAMPLE_PROTOS}",
            f"-I{proto_include()}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            f"--plugin={PLUGIN}={_plugin(Path(scratch))}",
            f"--grpc-idempotency_out={out}",
            *protos,
        )
    return _files(out)


def _stale(generated: Path, files: set[Path], tree: Path, owned: Sequence[Path]) -> list[Path]:
    """Tree paths that differ from ``generated``, are missing, or are generated files under an
    ``owned`` directory that nothing generates any more."""
    stale = [tree / f for f in sorted(files) if not _same(generated / f, tree / f)]
    for directory in owned:
        for path in sorted((tree / directory).rglob("*")):
            if path.name.endswith(GENERATED_SUFFIXES) and path.relative_to(tree) not in files:
                stale.append(path)
    return stale


def _same(a: Path, b: Path) -> bool:
    return b.is_file() and filecmp.cmp(a, b, shallow=False)


def stale_library_files() -> list[Path]:
    """The library's committed generated files (and shipped proto) that are not current."""
    with tempfile.TemporaryDirectory(prefix="gi-regen-lib-") as tmp:
        out = Path(tmp)
        files = generate_library(out)
        return _stale(out, files, LIBRARY_SRC, [Path("grpc_idempotency/v1")])


def _sync(generated: Path, files: set[Path], tree: Path, owned: Sequence[Path]) -> list[Path]:
    changed = _stale(generated, files, tree, owned)
    for path in changed:
        rel = path.relative_to(tree)
        if rel in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(generated / rel, path)
        else:
            path.unlink()
    return changed


def run(check: bool) -> list[Path]:
    """Regenerates everything (``check``: compares only); returns the stale or rewritten paths."""
    changed: list[Path] = []
    # The library first: the example imports options.proto through the shipped copy.
    for generate, tree, owned in (
        (generate_library, LIBRARY_SRC, [Path("grpc_idempotency/v1")]),
        (generate_example, EXAMPLE_GEN, [Path(".")]),
    ):
        with tempfile.TemporaryDirectory(prefix="gi-regen-") as tmp:
            out = Path(tmp)
            files = generate(out)
            sync = _stale if check else _sync
            changed += sync(out, files, tree, owned)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.checkout.regenerate")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a committed file is stale"
    )
    args = parser.parse_args(argv)
    changed = run(args.check)
    for path in changed:
        print(f"{'stale' if args.check else 'updated'}: {path.relative_to(ROOT)}")
    if args.check and changed:
        print("stale generated code: run python -m examples.checkout.regenerate", file=sys.stderr)
        return 1
    if not changed:
        print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
