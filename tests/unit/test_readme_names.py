"""What the README names exists, as the README says: error reasons and their status codes, the
classes and dotted names it mentions, the imports of its snippets, the files it points to, the
CLI's commands and options, the test kit's fixtures and checks, failpoints, telemetry names and
the defaults it quotes. Prose is not checked here, only names and numbers a user copies."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import grpc_idempotency
import grpc_idempotency.testing
from grpc_idempotency import cli
from grpc_idempotency.core import errors, failpoints, policy
from grpc_idempotency.core.consumer import ConsumerOutcome
from grpc_idempotency.core.lifecycle import CallOutcome
from grpc_idempotency.testing import IdempotencyConformance

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SOURCE = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "src").rglob("*.py"))

REASONS = {
    cls.reason: cls.status_code.name
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.IdempotencyError)
}
CODES = (
    "OK|CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
    "PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
    "UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED"
)

# Capitalised names in backticks that are not the library's: the example's, Python's, protobuf's,
# PostgreSQL's and PgBouncer's. A name of the library's missing from the package fails the test.
NOT_THE_LIBRARYS = frozenset(
    {
        "Any",
        "AuthInterceptor",
        "ChargeRequest",
        "DateStyle",
        "False",
        "FieldOptions",
        "FutureRecordMetadata",  # kafka-python's
        "Mapping",
        "Message",
        "Method",
        "MethodOptions",
        "None",
        "OrderServicePlaceOrderSteps",
        "PaymentServiceStub",
        "PermissionError",
        "RetryInfo",
        "RuntimeError",
        "Struct",  # protobuf's
        "TimeZone",
        "Timestamp",
        "True",
        "TypeError",
        "ValueError",
    }
)


def line_of(match: re.Match[str]) -> int:
    return README.count("\n", 0, match.start()) + 1


def python_blocks() -> list[str]:
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", README, re.S | re.M)
    return [textwrap.dedent(block) for _, block in blocks]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def test_every_reason_named_is_an_error_reason() -> None:
    named = set(re.findall(r"(?<![A-Z_])IDEMPOTENCY_[A-Z_]+[A-Z]", README))
    assert named, "the README names no reason: the pattern is stale"
    assert not named - set(REASONS), "reasons the README names that no error class has"
    assert not set(REASONS) - named, "reasons no part of the README explains"


def test_every_status_given_with_a_reason_is_that_reasons_status() -> None:
    pairs = re.compile(rf"`?({CODES})`?,?\s*\(?(?:reason\s+)?`(IDEMPOTENCY_[A-Z_]+)`")
    found = [(line_of(m), m[1], m[2]) for m in pairs.finditer(README)]
    assert len(found) > 20, "the pattern no longer finds the wire contract's pairs"
    wrong = [(line, code, reason, REASONS.get(reason)) for line, code, reason in found]
    assert [w for w in wrong if w[1] != w[3]] == []


def test_the_library_names_in_backticks_exist() -> None:
    names = set(re.findall(r"`([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)`", README))
    public = set(grpc_idempotency.__all__) | set(grpc_idempotency.testing.__all__)
    assert not names - public - NOT_THE_LIBRARYS, "names the package does not have"


def test_the_snippets_imports_resolve() -> None:
    imports = [
        node
        for block in python_blocks()
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.ImportFrom)
        and node.module is not None
        and node.module.split(".")[0] == "grpc_idempotency"
    ]
    assert len(imports) >= 5
    for node in imports:
        assert node.module is not None
        module = importlib.import_module(node.module)
        for alias in node.names:
            assert hasattr(module, alias.name), f"from {node.module} import {alias.name}"


def inline_calls() -> list[ast.Module]:
    """The inline code spans of the prose that are Python calls (``Relay(store, sink,
    listen_dsn=...)``); the spans that do not parse (``32 MiB``) are left out."""
    parsed = []
    for span in re.findall(r"(?<!`)`([A-Za-z_][\w.]*\((?:[^`])*\))`(?!`)", README):
        try:
            parsed.append(ast.parse(span.replace("\n", " ")))
        except SyntaxError:
            continue
    return parsed


def test_the_snippets_keywords_exist() -> None:
    """``Name(keyword=...)`` in a snippet or an inline span: the callable takes that keyword."""
    targets: dict[str, Any] = {
        "Store.connect": grpc_idempotency.Store.connect,
        "store.close": grpc_idempotency.Store.close,
        "close": grpc_idempotency.Store.close,
        **{n: getattr(grpc_idempotency, n) for n in grpc_idempotency.__all__},
        **{n: getattr(grpc_idempotency.testing, n) for n in grpc_idempotency.testing.__all__},
    }
    checked = 0
    trees = [ast.parse(block) for block in python_blocks()] + inline_calls()
    assert len(trees) > 20
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            target = targets.get(name)
            if target is None or not callable(target):
                continue
            parameters = inspect.signature(target).parameters
            if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                continue
            for keyword in node.keywords:
                checked += 1
                assert keyword.arg in parameters, f"{name}({keyword.arg}=...)"
    assert checked >= 20


def test_dotted_names_resolve_or_are_telemetry_names() -> None:
    """``grpc_idempotency.x.y``: an importable name, or a metric, attribute or logger name the
    source spells out."""
    names = set(re.findall(r"`(grpc_idempotency\.[A-Za-z0-9_.]*[A-Za-z0-9_])", README))
    assert names
    for name in sorted(names):
        if f'"{name}"' in SOURCE or name.startswith("grpc_idempotency.v1."):
            continue
        module_name, _, attribute = name.rpartition(".")
        try:
            found = hasattr(importlib.import_module(module_name), attribute)
        except ImportError:
            found = False
        assert found or importlib.util.find_spec(name) is not None, name


def test_the_files_it_points_to_exist() -> None:
    paths = set(
        re.findall(r"((?:tests|benchmarks|examples|\.ci)/[A-Za-z0-9_./-]*[A-Za-z0-9_])", README)
    )
    assert len(paths) > 10
    # .ci/.chroots is a cache CI makes, not a file of the repository.
    missing = [p for p in paths if not (ROOT / p).exists() and not p.startswith(".ci/.")]
    assert sorted(missing) == []
    # A test file named without its directory ("test_pgbouncer.py").
    for bare in set(re.findall(r"(?<![/\w])(test_[a-z0-9_]+\.py)", README)):
        assert list((ROOT / "tests").rglob(bare)), bare


def test_the_tested_in_pointers_name_modules_of_tests() -> None:
    """Every test module the README points to ("tested in ``tests/...py``") holds tests, and a
    ``path::test_name`` pointer names one of them."""
    modules = set(re.findall(r"(tests/[\w/]+/test_\w+\.py)", README))
    assert len(modules) >= 8
    for module in modules:
        assert re.search(
            r"^(?:(?:async )?def test_|class Test)", (ROOT / module).read_text(), re.M
        ), module
    for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", README):
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), f"{path}::{name}"


def test_the_cli_commands_and_options_it_names_exist() -> None:
    parser = cli._parser()
    commands = subcommands(parser)
    listed = re.search(r"`grpc-idempotency --help` lists the commands \(([^)]*)\)", README)
    assert listed is not None
    named = {c.strip("` .\n") for c in listed[1].split(",")}
    assert named == set(commands)
    uses = [
        m
        for m in re.finditer(r"grpc-idempotency ([a-z-]+)((?: [^`\n|]*)?)", README)
        if m[1] in commands
    ]
    assert len(uses) > 10
    for use in uses:
        command = commands[use[1]]
        words = use[2].split()
        actions = subcommands(command)
        if words and words[0] in actions:
            command = actions[words[0]]
        for option in re.findall(r"--[a-z][a-z-]*", use[2]):
            assert option in options_of(command), (line_of(use), use[0], option)


def test_the_cli_exit_statuses_it_gives() -> None:
    from grpc_idempotency.inspect_cli import commands
    from grpc_idempotency.protoc_gen import step_check

    assert (commands.NOT_FOUND, commands.DUPLICATED, cli.OUTPUT_FAILED) == (3, 4, 74)
    assert (step_check.EXIT_OK, step_check.EXIT_BROKEN, step_check.EXIT_USAGE) == (0, 1, 2)
    assert "4 `inspect` found a child key on more than one record" in README
    assert "74 output that could not be written" in README


def test_the_conformance_checks_and_settings_it_lists() -> None:
    listed = set(re.findall(r"^\| `(test_[a-z_]+)", README, re.M))
    checks = {n for n in dir(IdempotencyConformance) if n.startswith("test_")}
    assert listed == checks
    from grpc_idempotency.testing.conformance import CRASH_POINTS

    crash = re.search(r"`test_crash_then_retry_executes_once\[([^\]]*)\]`", README)
    assert crash is not None and tuple(crash[1].split(" / ")) == CRASH_POINTS
    settings = re.findall(r"`([a-z_]+)`\s\((\d+)", README)
    quoted = {n: int(v) for n, v in settings if hasattr(IdempotencyConformance, n)}
    assert len(quoted) >= 7
    assert {n: getattr(IdempotencyConformance, n) for n in quoted} == quoted


def test_the_fixtures_it_lists() -> None:
    from grpc_idempotency.testing import plugin

    rows = re.findall(r"^\| `(idempotency_[a-z_]+)` \| ([a-z]+) \|", README, re.M)
    assert len(rows) == 6
    for name, scope in rows:
        fixture = getattr(plugin, name)
        defined = re.search(
            rf"(?:@pytest\.fixture(?:\(scope=\"(\w+)\"\))?|@_async_fixture)\n(?:async )?def {name}\(",
            inspect.getsource(plugin),
        )
        assert fixture is not None and defined is not None, name
        assert (defined[1] or "function") == {"test": "function"}.get(scope, scope), name
    assert plugin.DEFAULT_SCHEMA in README


def test_the_failpoints_it_lists() -> None:
    points = re.search(r"Points: ([^\n]*)", README)
    assert points is not None
    assert set(re.findall(r"`([a-z_]+)`", points[1])) == failpoints.POINTS
    actions = re.search(r"Actions: ((?:.|\n)*?)\. ", README)
    assert actions is not None
    named = {a.split(":")[0] for a in re.findall(r"`([a-z:A-Z]+)`", actions[1])}
    assert named == {a.value for a in failpoints.FailAction}


def test_the_outcomes_and_metric_names_it_gives() -> None:
    outcomes = re.search(r"`grpc_idempotency\.outcome` = ((?:`[a-z_]+`(?:,\s|\sor\s)?)+)", README)
    assert outcomes is not None
    assert set(re.findall(r"`([a-z_]+)`", outcomes[1])) == {o.value for o in CallOutcome}
    for name in (
        "grpc_idempotency.calls",
        "grpc_idempotency.call.duration",
        "grpc_idempotency.bypassed",
        "grpc_idempotency.outbox.deliveries",
        "grpc_idempotency.outbox.outcome",
        "grpc_idempotency.consumer.messages",
        "grpc_idempotency.consumer.process.duration",
        "grpc_idempotency.consumer.name",
        "grpc_idempotency.consumer.outcome",
    ):
        assert f"`{name}`" in README and f'"{name}"' in SOURCE, name
    consumer = re.search(r"\(`ConsumerOutcome`\):\s((?:`[a-z_]+`(?:,\s|\sor\s)?)+)", README)
    assert consumer is not None
    assert set(re.findall(r"`([a-z_]+)`", consumer[1])) == {o.value for o in ConsumerOutcome}


def test_the_option_defaults_it_gives() -> None:
    table = {
        name: default.strip()
        for name, default in re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", README, re.M)
    }

    def spelt(value: timedelta) -> str:
        for unit, label in ((3600, "h"), (1, "s")):
            if value.total_seconds() % unit == 0:
                return f"{int(value.total_seconds()) // unit} {label}"
        return f"{int(value.total_seconds() * 1000)} ms"

    assert table["key"] == "`KEY_REQUIRED`"
    assert table["retention"] == spelt(policy.DEFAULT_RETENTION)
    assert table["lease"] == f"{spelt(policy.DEFAULT_LEASE)}, at least {spelt(policy.MIN_LEASE)}"
    assert table["max_wait"] == spelt(policy.DEFAULT_MAX_WAIT)
    assert table["max_response_bytes"] == f"{policy.DEFAULT_MAX_RESPONSE_BYTES >> 20} MiB"
    assert table["store_down"] == "`STORE_DOWN_FAIL_CLOSED`"


def _quoted_defaults(call: str) -> dict[str, Any]:
    """The keywords after ``call`` (which ends with its open parenthesis) as the README writes
    them, evaluated (``32 MiB`` included)."""
    start = README.find(call)
    assert start >= 0, call
    end = start + len(call)
    depth = 1
    while depth:
        depth += {"(": 1, ")": -1}.get(README[end], 0)
        end += 1
    values = {}
    for part in re.split(r",\s*(?![^()]*\))", README[start + len(call) : end - 1]):
        name, sep, value = part.partition("=")
        if not sep:
            continue
        value = value.replace("_", "").replace(" MiB", " * 1024 * 1024")
        values[name.strip()] = eval(value, {"timedelta": timedelta})  # the README's own text
    return values


@pytest.mark.parametrize(
    ("call", "target"),
    [
        ("**Pool settings.** `Store.connect(", grpc_idempotency.Store.connect),
        ("IdempotencyInterceptor(replay_cache=ReplayCache(", grpc_idempotency.ReplayCache),
    ],
)
def test_the_defaults_it_quotes_are_the_signatures(call: str, target: Any) -> None:
    quoted = _quoted_defaults(call)
    assert quoted
    parameters = inspect.signature(target).parameters
    assert {n: parameters[n].default for n in quoted} == quoted


def test_the_herd_release_and_close_defaults() -> None:
    herd = grpc_idempotency.HerdRelease()
    assert (herd.per_batch, herd.interval_s) == (8, 0.002)
    assert "by default 8\nevery 2 ms" in README or "by default 8 every 2 ms" in README
    close = inspect.signature(grpc_idempotency.Store.close).parameters["timeout"]
    assert close.default == 10 and "`close(timeout=10)`" in README


def all_options(parser: argparse.ArgumentParser) -> set[str]:
    found = options_of(parser)
    for sub in subcommands(parser).values():
        found |= all_options(sub)
    return found


# Options of other tools the README shows: protoc, mypy, pdoc, git, the checkout example, and
# the project's own test suite (pytest --shard, tests/conftest.py; pytest-xdist's --dist).
OTHER_TOOLS_OPTIONS = frozenset(
    {
        "--check",
        "--descriptor_set_out",
        "--detach",
        "--dist",
        "--docformat",
        "--follow-imports",
        "--grpc-idempotency_out",
        "--grpc_python_out",
        "--include_imports",
        "--listen",
        "--mypy_grpc_out",
        "--plugin",
        "--pyi_out",
        "--python_out",
        "--shard",
        "--strict",
    }
)


def test_every_option_it_names_is_an_option_of_the_cli() -> None:
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z_-]*[a-z]", README))
    assert not named - all_options(cli._parser()) - OTHER_TOOLS_OPTIONS


def test_the_scopes_it_spells_are_the_resolvers() -> None:
    """What a user passes to ``inspect --scope`` and ``list --scope``, and what ``shard_of`` sees."""
    from grpc_idempotency.scope import peer_scope

    assert "`peer:<name>,<name>...` in sorted order" in README
    assert peer_scope([b"b.example", b"a.example"]) == "peer:a.example,b.example"
    assert peer_scope([b"x" * 2000]).startswith("peer-sha256:") and "`peer-sha256:<hex>`" in README
    # The sharding snippet strips MetadataScope's default prefix.
    assert 'scope.removeprefix("tenant:")' in README
    assert grpc_idempotency.MetadataScope().prefix == "tenant:"


def test_the_environment_variables_it_names_are_read() -> None:
    named = set(re.findall(r"\b((?:GRPC_IDEMPOTENCY|CHECKOUT)_[A-Z_]+[A-Z])\b", README))
    assert len(named) >= 8
    readers = SOURCE + "\n".join(
        p.read_text(encoding="utf-8")
        for folder in ("tests", "examples")
        for p in (ROOT / folder).rglob("*.py")
    )
    assert sorted(n for n in named if f'"{n}"' not in readers) == []


def test_the_enum_members_it_names_exist() -> None:
    members = set(re.findall(r"\b([A-Z][a-z]\w*)\.([A-Z][A-Z_]*[A-Z])\b", README))
    ours = {(cls, member) for cls, member in members if cls in grpc_idempotency.__all__}
    assert len(ours) >= 3
    for cls, member in ours:
        assert hasattr(getattr(grpc_idempotency, cls), member), f"{cls}.{member}"


def test_the_method_option_snippets_parse() -> None:
    """The proto fragments a user pastes into ``option (grpc_idempotency.v1.method) = {...}``
    (the outbox step's ``steps: { name: ... outbox: true }``, the step versions') name the
    option's fields and values as ``options.proto`` spells them. Whole files (the tutorial's
    ``syntax = ...``) are compiled by the tutorial's own test."""
    from google.protobuf import text_format

    from grpc_idempotency.v1 import options_pb2

    blocks = re.findall(r"^( *)```proto\n(.*?)^\1```", README, re.S | re.M)
    fragments = [textwrap.dedent(body) for _, body in blocks if "syntax =" not in body]
    assert any("outbox: true" in fragment for fragment in fragments), "the pattern is stale"
    for fragment in fragments:
        option = re.search(r"option \(grpc_idempotency\.v1\.method\) = \{(.*)\};", fragment, re.S)
        policy = text_format.Parse(option[1] if option else fragment, options_pb2.MethodPolicy())
        assert policy.steps, fragment
