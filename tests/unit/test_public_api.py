import pytest

import grpc_idempotency


def test_public_names_resolve_and_are_sorted() -> None:
    names = grpc_idempotency.__all__
    assert names == sorted(names, key=lambda n: (not n.isupper(), n[0].islower(), n))
    for name in names:
        assert getattr(grpc_idempotency, name) is not None
    # Errors carry their gRPC status, and every one is an IdempotencyError.
    for name in names:
        value = getattr(grpc_idempotency, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, grpc_idempotency.IdempotencyError), name
            assert value.reason.startswith("IDEMPOTENCY_"), name


def test_every_library_error_is_public() -> None:
    """An error a handler or caller can meet is catchable by its public name."""
    import inspect

    from grpc_idempotency.core import errors

    defined = {
        name
        for name, value in inspect.getmembers(errors, inspect.isclass)
        if issubclass(value, Exception) and value.__module__ == errors.__name__
    }
    assert defined - set(grpc_idempotency.__all__) == set()


def test_importing_core_loads_neither_asyncpg_nor_grpc() -> None:
    """core/ decides and does no I/O: importing it (and so the package's __init__) must not pull
    in the database driver or gRPC. Checked in a fresh interpreter, where nothing is loaded yet."""
    import subprocess
    import sys

    probe = (
        "import sys, pkgutil, importlib, grpc_idempotency.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__): importlib.import_module(f'{core.__name__}.{m.name}')\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('asyncpg', 'grpc', 'opentelemetry')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_public_names_are_importable_by_name() -> None:
    from grpc_idempotency import IdempotencyInterceptor, Store  # resolved lazily

    assert IdempotencyInterceptor.__module__ == "grpc_idempotency.server.interceptor"
    assert Store.__module__ == "grpc_idempotency.store.postgres"
    with pytest.raises(AttributeError):
        grpc_idempotency.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
    assert set(grpc_idempotency.__all__) <= set(dir(grpc_idempotency))


@pytest.mark.parametrize("package", ["grpc_idempotency", "grpc_idempotency.testing"])
def test_every_public_name_is_imported_for_type_checkers(package: str) -> None:
    """Names are resolved lazily (``__getattr__``, hidden from type checkers); type checkers read
    the ``TYPE_CHECKING`` imports instead, and a name missing there does not exist to them: a
    strict user's documented import of it is refused. (Before the ``__getattr__`` was hidden, it
    was ``Any``: ``OutboxKeyReused`` was, so a strict user could not subclass it.) Each is
    imported from the module it is resolved from at run time, so both see the same object."""
    import ast
    import importlib
    from pathlib import Path

    module = importlib.import_module(package)
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text("utf-8"))
    imported = {
        alias.asname or alias.name: stmt.module
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for stmt in node.body
        if isinstance(stmt, ast.ImportFrom)
        for alias in stmt.names
    }
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    lazy = set(module.__all__) - defined  # e.g. proto_include, defined in the module itself
    assert lazy == set(module._LOCATIONS)
    assert {name: imported.get(name) for name in lazy} == module._LOCATIONS
