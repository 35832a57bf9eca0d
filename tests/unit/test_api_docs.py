"""Every public name has a docstring, as the API reference (pdoc, ``.ci/api_docs.py``) sees it."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pdoc.doc

import grpc_idempotency

ROOT = Path(__file__).resolve().parents[2]

# Public names that have no docstring yet. Remove a name once it has one: the test fails while a
# name listed here is documented, and when a public name without a docstring is not listed.
# (Dataclasses count as undocumented when they only have the signature dataclasses writes, and
# re-exported constants and aliases need a docstring where pdoc can read it: in the package.)
UNDOCUMENTED = frozenset(
    {
        "grpc_idempotency.KEY_HEADER",
        "grpc_idempotency.PooledConnection",
        "grpc_idempotency.REPLAYED_HEADER",
        "grpc_idempotency.ScopeResolver",
    }
)


def _reference_modules() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / ".ci" / "api_docs.py")
    assert spec is not None and spec.loader is not None
    api_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_docs)
    modules: tuple[str, ...] = api_docs.MODULES
    return modules


def _public_members(module_name: str) -> dict[str, pdoc.doc.Doc[object]]:
    module = importlib.import_module(module_name)
    # The package resolves its names on first use (PEP 562); pdoc sees only resolved ones.
    for name in getattr(module, "__all__", ()):
        getattr(module, name)
    doc = pdoc.doc.Module(module)
    return {
        f"{module_name}.{name}": member
        for name, member in doc.members.items()
        if not name.startswith("_")
    }


def test_the_reference_covers_the_package_api() -> None:
    members = _public_members("grpc_idempotency")
    assert {f"grpc_idempotency.{name}" for name in grpc_idempotency.__all__} <= set(members)


def test_every_public_name_has_a_docstring() -> None:
    undocumented = {
        qualname
        for module_name in _reference_modules()
        for qualname, member in _public_members(module_name).items()
        if not member.docstring.strip()
    }
    assert not undocumented - UNDOCUMENTED, "public names without a docstring"
    assert not UNDOCUMENTED - undocumented, "documented now: remove them from UNDOCUMENTED"
