"""The pytest plugin's entry point is named after its module, so a project that also names the
module (``pytest_plugins = [...]`` in its conftest.py, or ``-p``, to keep working where
``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` is set) does not register it twice."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_naming_the_plugin_module_where_the_entry_point_loaded_it_is_no_error() -> None:
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    [(name, module)] = entry_points["pytest11"].items()
    manager = pytest.PytestPluginManager()
    # What pytest's autoload does with the entry point: the module, under the entry point's name.
    manager.register(importlib.import_module(module), name)
    # What ``-p grpc_idempotency.testing.plugin`` and ``pytest_plugins`` then do: pytest skips a
    # name it knows; under another name the same module was "already registered" (ValueError)
    # and the run stopped before collecting a test.
    manager.import_plugin(module)
    assert manager.get_plugin(module) is importlib.import_module(module)
