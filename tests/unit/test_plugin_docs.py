"""The README's fixture table lists every fixture the pytest plugin defines, with its scope (it
left out ``idempotency_conformance``, the one the conformance kit runs on: a review's finding)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpc_idempotency.testing import plugin

ROOT = Path(__file__).resolve().parents[2]


def _fixtures() -> dict[str, str]:
    """The plugin's fixtures and their scopes."""
    found: dict[str, str] = {}
    for name, value in vars(plugin).items():
        marker = getattr(value, "_fixture_function_marker", None)
        if name.startswith("idempotency_") and marker is not None:
            found[name] = str(marker.scope)
    return found


def _readme_table() -> dict[str, str]:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("**Fixtures**", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `(idempotency_\w+)` \| (\w+) \|", table, flags=re.MULTILINE)
    return {name: ("function" if scope == "test" else scope) for name, scope in rows}


def test_the_plugin_defines_the_fixtures_this_test_knows() -> None:
    assert {"idempotency_dsn", "idempotency_conformance"} <= set(_fixtures())


@pytest.mark.parametrize("name", sorted(_fixtures()))
def test_the_readme_lists_each_fixture_with_its_scope(name: str) -> None:
    assert _readme_table().get(name) == _fixtures()[name]
