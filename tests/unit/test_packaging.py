"""The wheel and the sdist carry what users need at run time, at protoc time and to comply with the
license; the dependency floors are the versions CI's lowest-versions job installs."""

from __future__ import annotations

import ast
import email
import email.message
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
CONSTRAINTS_LOWEST = ROOT / ".ci" / "constraints-lowest.txt"
PACKAGE = ROOT / "src" / "grpc_idempotency"
MIGRATIONS = sorted((ROOT / "src" / "grpc_idempotency" / "store" / "migrations").glob("*.sql"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (path,) = out.glob("grpc_idempotency-*.whl")
    return zipfile.ZipFile(path)


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def test_wheel_ships_the_proto_migrations_and_type_marker(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert MIGRATIONS
    for required in (
        "grpc_idempotency/_proto/grpc_idempotency/v1/options.proto",
        "grpc_idempotency/v1/options_pb2.py",
        "grpc_idempotency/v1/options_pb2.pyi",
        *(f"grpc_idempotency/store/migrations/{m.name}" for m in MIGRATIONS),
        "grpc_idempotency/py.typed",
    ):
        assert required in names, required
    assert not any(n.startswith(("tests/", "examples/")) for n in names)


def test_the_wheel_holds_exactly_the_files_of_the_package(wheel: zipfile.ZipFile) -> None:
    # Nothing missing (a data file no package-data pattern covers) and nothing more: setuptools
    # builds in the tree's build/ and ships whatever an earlier build left in build/lib (a module
    # since renamed or deleted) along with the current files.
    src = ROOT / "src"
    expected = {
        path.relative_to(src).as_posix()
        for path in (src / "grpc_idempotency").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    shipped = {name for name in wheel.namelist() if ".dist-info/" not in name}
    missing, extra = sorted(expected - shipped), sorted(shipped - expected)
    assert not missing, f"not in the wheel (add to [tool.setuptools.package-data]): {missing}"
    assert not extra, f"in the wheel, not in src/ (left in build/? rm -rf build): {extra}"


def test_license_is_apache_2_and_ships_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it
    assert PROJECT["license"] == "Apache-2.0"
    (shipped,) = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(shipped).decode("utf-8") == text
    metadata = _metadata(wheel)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]


def test_metadata_names_pythons_urls_and_extras(wheel: zipfile.ZipFile) -> None:
    metadata = _metadata(wheel)
    assert metadata["Requires-Python"] == ">=3.11"
    classifiers = set(metadata.get_all("Classifier") or [])
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert {"Typing :: Typed", "Framework :: AsyncIO", "Topic :: Database"} <= classifiers
    urls = {u.split(",", 1)[0] for u in metadata.get_all("Project-URL") or []}
    assert {"Homepage", "Repository", "Documentation", "Changelog", "Issues"} <= urls
    assert {"codegen", "embedded", "dev"} <= set(metadata.get_all("Provides-Extra") or [])


def test_sdist_ships_the_license_proto_and_migrations(
    tmp_path: Path, wheel: zipfile.ZipFile
) -> None:
    subprocess.run(
        [sys.executable, "-c",
         f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path)!r})"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )  # fmt: skip
    (sdist,) = tmp_path.glob("grpc_idempotency-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    for required in (
        "LICENSE",
        "pyproject.toml",
        "src/grpc_idempotency/_proto/grpc_idempotency/v1/options.proto",
        *(f"src/grpc_idempotency/store/migrations/{m.name}" for m in MIGRATIONS),
    ):
        assert required in names, required
    # What builds the package and nothing else from the tree (no virtualenv, data directory,
    # cache), and the wheel pip builds from the sdist is the wheel built from the tree.
    assert {n.split("/", 1)[0] for n in names} == {
        "LICENSE", "PKG-INFO", "README.md", "pyproject.toml", "setup.cfg", "src",
    }  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "from-sdist"), str(sdist)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (rebuilt_path,) = (tmp_path / "from-sdist").glob("grpc_idempotency-*.whl")
    rebuilt = zipfile.ZipFile(rebuilt_path)
    assert sorted(rebuilt.namelist()) == sorted(wheel.namelist())
    for name in wheel.namelist():
        assert rebuilt.read(name) == wheel.read(name), name


def _floors() -> dict[str, str]:
    floors = {}
    for line in PROJECT["dependencies"]:
        requirement = Requirement(line)
        (floor,) = [s.version for s in requirement.specifier if s.operator == ">="]
        floors[requirement.name] = floor
    return floors


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {raw!r} is not name==version"
            pins[name.strip()] = version.strip()
    return pins


def test_every_dependency_has_a_floor_and_ci_installs_exactly_the_floors() -> None:
    floors = _floors()
    assert set(floors) == {Requirement(d).name for d in PROJECT["dependencies"]}
    pins = _pins(CONSTRAINTS_LOWEST)
    # The tests' OpenTelemetry SDK requires exactly its own API version.
    assert pins.pop("opentelemetry-sdk") == floors["opentelemetry-api"]
    assert pins == floors, "raise a floor in pyproject.toml and .ci/constraints-lowest.txt alike"


def test_protobuf_floor_is_not_below_the_gencode_version_of_the_committed_pb2() -> None:
    # protobuf refuses a runtime older than the gencode (VersionError at import), and supports
    # gencode only with a runtime of the same major version. (The floor may be higher, for a
    # runtime's bug: 7.36.0, see pyproject.toml.)
    generated = (ROOT / "src" / "grpc_idempotency" / "v1" / "options_pb2.py").read_text()
    (line,) = [x for x in generated.splitlines() if x.startswith("# Protobuf Python Version:")]
    gencode = Version(line.rsplit(" ", 1)[1])
    (protobuf,) = [Requirement(d) for d in PROJECT["dependencies"] if d.startswith("protobuf")]
    (floor,) = [Version(s.version) for s in protobuf.specifier if s.operator == ">="]
    (ceiling,) = [Version(s.version) for s in protobuf.specifier if s.operator == "<"]
    assert floor >= gencode
    assert floor.major == gencode.major and ceiling == Version(f"{gencode.major + 1}")


def test_the_dev_extra_holds_what_builds_the_package() -> None:
    # The tests above build the wheel and the sdist in this virtualenv (no build isolation), so
    # the README's `pip install -e '.[dev]'` must bring the build backend itself: a Python 3.12
    # virtualenv has no setuptools at all, and 3.11's is older than `license = "..."` allows.
    dev = {
        Requirement(line).name: Requirement(line)
        for line in PROJECT["optional-dependencies"]["dev"]
    }
    for line in PYPROJECT["build-system"]["requires"]:
        backend = Requirement(line)
        assert backend.name in dev, f"add {line!r} to the dev extra"
        assert dev[backend.name].specifier == backend.specifier, line


def _third_party_imports(files: list[Path]) -> dict[str, set[str]]:
    """Each module the files import from outside the standard library and the package (``from a
    import b`` as ``a.b``, which may be a module: ``google.rpc`` alone is a namespace shared by
    several distributions), with the files importing it."""
    imported: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".", 1)[0]
                if top not in sys.stdlib_module_names and top != "grpc_idempotency":
                    imported.setdefault(name, set()).add(path.relative_to(PACKAGE).as_posix())
    return imported


def _distribution_of(module: str, owners: dict[str, str]) -> str | None:
    """The installed distribution whose files hold ``module`` (or the nearest enclosing module
    that is a file: ``a.b.Name`` is looked up as ``a.b``)."""
    parts = module.split(".")
    while parts:
        try:
            spec = importlib.util.find_spec(".".join(parts))
        except ImportError:  # a name inside a module, not a submodule
            spec = None
        if spec is not None and spec.has_location and spec.origin:
            return owners.get(os.path.normcase(os.path.realpath(spec.origin)))
        parts.pop()
    return None


def test_every_third_party_import_comes_from_a_declared_dependency() -> None:
    # A module imported through another dependency's requirement is not declared: its floor is
    # that package's (grpcio-status asks googleapis-common-protos>=1.5.5, whose google.rpc
    # gencode a protobuf 7 runtime refuses at import), and the lowest-versions job never pins it.
    owners: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        base = os.path.realpath(str(dist.locate_file("")))
        name = canonicalize_name(dist.metadata["Name"])
        for file in dist.files or ():
            owners[os.path.normcase(os.path.normpath(os.path.join(base, str(file))))] = name
    runtime = {canonicalize_name(Requirement(d).name) for d in PROJECT["dependencies"]}
    testing = runtime | {
        canonicalize_name(Requirement(d).name) for d in PROJECT["optional-dependencies"]["testing"]
    }
    sources = [p for p in PACKAGE.rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    undeclared = []
    for module, importers in sorted(_third_party_imports(sources).items()):
        allowed = testing if all(i.startswith("testing/") for i in importers) else runtime
        owner = _distribution_of(module, owners)
        if owner not in allowed:
            undeclared.append(f"{module} ({owner or 'no distribution found'}): {sorted(importers)}")
    assert not undeclared, "imported, not declared in pyproject.toml:\n" + "\n".join(undeclared)
