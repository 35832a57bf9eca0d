"""The wheel carries what users need at run time and at protoc time."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_the_proto_migrations_and_type_marker(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("grpc_idempotency-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "grpc_idempotency/_proto/grpc_idempotency/v1/options.proto",
        "grpc_idempotency/v1/options_pb2.py",
        "grpc_idempotency/v1/options_pb2.pyi",
        "grpc_idempotency/store/migrations/0001_records.sql",
        "grpc_idempotency/py.typed",
    ):
        assert required in names, required
    assert not any(n.startswith(("tests/", "examples/")) for n in names)
