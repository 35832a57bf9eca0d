"""A package's names imported on first use (PEP 562), so that importing the package loads
neither grpc, asyncpg nor the store until a name that needs them is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_names(
    package: str, locations: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name in ``locations`` (name -> the module
    defining it) is imported from there once, then kept in ``namespace`` (the package's
    globals) as a plain module attribute."""

    def __getattr__(name: str) -> Any:
        module = locations.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # next time, a plain module attribute
        return value

    return __getattr__
