"""The README's "Testing your service" snippets, copied verbatim and run as a user would: pytest
in a project of their own, the plugin loaded by its entry point, pytest-asyncio's loop scopes set
as the README recommends. (Two of them built ``PaymentService(store)``, which takes no argument,
and counted ``charges`` instead of ``tutorial.charges``, and nothing ran them.)

The snippets are the section's ```python fences, each found by the line that makes it what it is
(``SNIPPETS``: the start of one of its lines), not by its place or the prose around it; the
section must hold no other Python fence, so a snippet added there fails here until it is run.

What the snippets assume the user has, the test writes, and nothing more: their proto in package
``shop.v1`` (the tutorial's payments.proto, only its package renamed, as the snippets' imports and
method name say), ``shop.payments`` (the tutorial's ``CHARGES_TABLE`` and ``PaymentService``,
from examples/tutorial/server.py) and the conformance snippet's ``test_mailbox`` ("yours"). The
snippets themselves are written unchanged: a name they get wrong fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpc_idempotency import proto_include
from tests.e2e.procs import ROOT, child_env

pytestmark = pytest.mark.e2e

README = ROOT / "README.md"
SECTION = "## Testing your service"
# The line that identifies each snippet, and where the user's project has it.
CONFORMANCE = "TestChargeConformance"
SNIPPETS = {
    "def idempotency_service():": "test_payments.py",
    f"class {CONFORMANCE}(IdempotencyConformance):": "test_conformance.py",
    "async def build_server(dsn: str):": "shop/server.py",
}
# The conformance checks run: the quick ones, which between them call every method the snippet
# defines, on the server its build_server builds. The others (crashes, concurrency, a lost
# response or connection, a transient error) add some 6 s of server processes and deadlines, and
# tests/e2e/test_checkout_conformance.py runs them all on the checkout example.
CHECKS = (
    "test_sequential_retry_replays_byte_identical",
    "test_mutated_payload_is_refused",
    "test_deterministic_error_is_replayed",
    "test_call_without_a_key",
)
EXPECTED_PASSED = 1 + len(CHECKS)  # the fixtures snippet's test_retry_is_replayed, the checks
TIMEOUT_S = 300  # a guard against a hang: it takes some seconds

PYTEST_INI = """\
[pytest]
asyncio_default_fixture_loop_scope = session
asyncio_default_test_loop_scope = session
"""

# The user's own modules that the snippets import but the README does not show.
SHOP_PAYMENTS = '''\
"""The user's service: the tutorial's (examples/tutorial/server.py)."""
import sys

from shop.v1 import payments_pb2, payments_pb2_grpc

# server.py imports the generated modules by their top-level names (the tutorial generates them
# flat): the same modules, not a second copy of the descriptors.
sys.modules["payments_pb2"] = payments_pb2
sys.modules["payments_pb2_grpc"] = payments_pb2_grpc

from examples.tutorial.server import CHARGES_TABLE, PaymentService  # noqa: E402
'''
# The conformance snippet's "test_mailbox: yours" (imported ahead of the snippet): the tutorial's
# service sends no email, so nothing lands in it.
MAILBOX = """\
class Mailbox:
    def __init__(self):
        self.sent = []

    def count(self, *, to):
        return sum(1 for recipient in self.sent if recipient == to)


test_mailbox = Mailbox()
"""


def readme_snippets() -> dict[str, str]:
    """The section's Python fences, by the line of ``SNIPPETS`` each holds."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    fences = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
    found: dict[str, str] = {}
    for fence in fences:
        # A mark starts a line of the fence (a comment may follow it).
        marks = [m for m in SNIPPETS if any(line.startswith(m) for line in fence.splitlines())]
        assert len(marks) == 1, f"a Python fence of {SECTION!r} not run here:\n{fence}"
        assert marks[0] not in found, f"two fences of {SECTION!r} hold {marks[0]!r}"
        found[marks[0]] = fence
    missing = set(SNIPPETS) - set(found)
    assert not missing, f"no fence of {SECTION!r} holds {sorted(missing)}"
    return found


def write_project(root: Path) -> None:
    """The user's project: the snippets, their generated code, their own modules."""
    proto = (ROOT / "examples" / "tutorial" / "payments.proto").read_text(encoding="utf-8")
    assert proto.count("\npackage payments.v1;\n") == 1
    protos = root / "protos" / "shop" / "v1"
    protos.mkdir(parents=True)
    (protos / "payments.proto").write_text(
        proto.replace("package payments.v1;", "package shop.v1;"), encoding="utf-8"
    )
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{root / 'protos'}",
            f"-I{proto_include()}", f"--python_out={root}", f"--grpc_python_out={root}",
            str(protos / "payments.proto"),
        ],
        check=True,
    )  # fmt: skip
    for package in ("shop", "shop/v1"):
        (root / package / "__init__.py").touch()
    (root / "shop" / "payments.py").write_text(SHOP_PAYMENTS)
    (root / "shop" / "testing.py").write_text(MAILBOX)
    (root / "pytest.ini").write_text(PYTEST_INI)
    for mark, snippet in readme_snippets().items():
        if CONFORMANCE in mark:
            snippet = "from shop.testing import test_mailbox\n" + snippet
        (root / SNIPPETS[mark]).write_text(snippet, encoding="utf-8")


def test_the_testing_snippets_run_as_written(tmp_path: Path, pg_dsn: str) -> None:
    project = tmp_path / "project"
    project.mkdir()
    write_project(project)
    env = child_env({"GRPC_IDEMPOTENCY_TEST_DSN": pg_dsn})
    env["PYTHONPATH"] = os.pathsep.join([str(project), env["PYTHONPATH"]])
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
            "test_payments.py", *(f"test_conformance.py::{CONFORMANCE}::{check}" for check in CHECKS),
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )  # fmt: skip
    report = f"exit {done.returncode}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    assert done.returncode == 0, report
    summary = done.stdout.rstrip().splitlines()[-1]
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (\w+)", summary))
    assert counts.get("passed") == EXPECTED_PASSED, report
    assert set(counts) <= {"passed", "warnings"}, report
