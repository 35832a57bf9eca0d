"""protoc-gen-grpc-idempotency: golden output, generated-code quality, and every validation error.

Everything runs the real protoc (``python -m grpc_tools.protoc``) with the installed plugin, on
tests/protos/codegen_shop (golden files in tests/golden/) or on small .proto files written to
tmp_path. ``GRPC_IDEMPOTENCY_UPDATE_GOLDEN=1`` rewrites the golden files.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import cast

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.compiler import plugin_pb2
from google.protobuf.descriptor import FileDescriptor

from grpc_idempotency import proto_include
from grpc_idempotency.client import service_config
from grpc_idempotency.core.keys import MAX_STEP_NAME_LENGTH
from grpc_idempotency.core.policy import MethodOverride, MethodPolicy, compile_policy, method_path
from grpc_idempotency.protoc_gen import generate, names
from grpc_idempotency.protoc_gen.pool import OptionsInvisible, declared_options, load
from tests.support.tools import buf_binary

ROOT = Path(__file__).resolve().parents[2]
TEST_PROTOS = ROOT / "tests" / "protos"
GOLDEN = ROOT / "tests" / "golden"
SHOP = ("codegen_shop/v1/shop.proto", "codegen_shop/v1/ledger.proto")
PLUGIN_NAME = "protoc-gen-grpc-idempotency"
BIN = Path(sys.executable).parent
UPDATE = os.environ.get("GRPC_IDEMPOTENCY_UPDATE_GOLDEN") == "1"


def plugin() -> Path:
    script = BIN / PLUGIN_NAME
    assert script.is_file(), (
        f"{script} missing: pip install -e '.[dev]' installs the console script"
    )
    return script


def protoc(
    include: Path, out: Path, *files: str, extra: tuple[str, ...] = (), plugin_flag: bool = True
) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{include}", f"-I{proto_include()}",
        f"--grpc-idempotency_out={out}", *extra, *files,
    ]  # fmt: skip
    if plugin_flag:
        command.insert(3, f"--plugin={PLUGIN_NAME}={plugin()}")
    env = dict(os.environ, PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)


def generated_files(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*_idempotency.py"))}


# -- golden files ----------------------------------------------------------------------------


def test_generated_code_matches_the_golden_files(tmp_path: Path) -> None:
    done = protoc(TEST_PROTOS, tmp_path, *SHOP)
    assert done.returncode == 0, done.stderr
    files = generated_files(tmp_path)
    assert sorted(files) == [
        "codegen_shop/v1/ledger_idempotency.py",
        "codegen_shop/v1/shop_idempotency.py",
    ]
    if UPDATE:
        shutil.rmtree(GOLDEN / "codegen_shop", ignore_errors=True)
        for name, content in files.items():
            (GOLDEN / name).parent.mkdir(parents=True, exist_ok=True)
            (GOLDEN / name).write_text(content)
    golden = generated_files(GOLDEN)
    assert sorted(golden) == sorted(files)
    for name, content in files.items():
        assert content == golden[name], (
            f"{name} differs from tests/golden/{name}; if the change is intended, rerun with"
            " GRPC_IDEMPOTENCY_UPDATE_GOLDEN=1 and review the diff"
        )


def test_output_does_not_depend_on_file_order_or_on_the_plugin_being_named(
    tmp_path: Path,
) -> None:
    # Reversed order, and the plugin found on PATH (no --plugin flag), as with a pip install.
    done = protoc(TEST_PROTOS, tmp_path, *reversed(SHOP), plugin_flag=False)
    assert done.returncode == 0, done.stderr
    assert generated_files(tmp_path) == generated_files(GOLDEN)


def test_the_example_is_generated_with_the_plugin() -> None:
    gen = ROOT / "examples" / "checkout" / "gen"
    assert sorted(generated_files(gen)) == [
        "checkout/v1/events_idempotency.py",
        "checkout/v1/ledger_idempotency.py",
        "checkout/v1/notifications_idempotency.py",
        "checkout/v1/orders_idempotency.py",
        "checkout/v1/payments_idempotency.py",
    ]  # that they are current is tests/unit/test_generated_current.py


@pytest.mark.skipif(
    buf_binary() is None, reason="buf is not installed (CI installs it into .ci/.buf)"
)
def test_buf_generate_with_the_repository_template_gives_the_committed_code(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    done = subprocess.run(
        [str(buf_binary()), "generate", "--output", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    gen = ROOT / "examples" / "checkout" / "gen"
    assert generated_files(tmp_path / "examples" / "checkout" / "gen") == generated_files(gen)


# -- the generated code: lint, format, types, imports, behaviour -----------------------------


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """codegen_shop generated with messages, .pyi, gRPC stubs and the plugin, importable."""
    out = tmp_path_factory.mktemp("codegen-shop")
    extra = (f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}")
    done = protoc(TEST_PROTOS, out, *SHOP, extra=extra)
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(out))
    try:
        yield out
    finally:
        sys.path.remove(str(out))


def shop_modules() -> tuple[ModuleType, ModuleType]:
    from codegen_shop.v1 import ledger_idempotency, shop_idempotency

    return shop_idempotency, ledger_idempotency


def run_with_generated(tmp_path: Path, out: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter with the generated modules (``out``) importable;
    asserts that it succeeded."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(out), os.environ.get("PYTHONPATH", "")]))
    ran = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    return ran


def assert_ruff_clean(paths: list[Path]) -> None:
    """Generated modules are formatted and lint clean. --isolated: ruff's defaults (line
    length 88), not this repository's settings. ASYNC109: the step calls take gRPC's
    ``timeout`` (a deadline sent to the server), as stubs do."""
    ruff = [sys.executable, "-m", "ruff"]
    files = [str(p) for p in paths]
    fmt = subprocess.run([*ruff, "format", "--isolated", "--check", "--diff", *files],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    lint = subprocess.run(
        [*ruff, "check", "--isolated", "--target-version", "py311",
         "--select", "E,F,W,I,B,UP,SIM,RUF,ASYNC", "--ignore", "ASYNC109", *files],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_generated_code_is_formatted_and_lint_clean(shop: Path) -> None:
    assert_ruff_clean(sorted(shop.rglob("*_idempotency.py")))


USAGE = """
from __future__ import annotations

import grpc

from codegen_shop.v1 import ledger_pb2, shop_idempotency, shop_pb2
from codegen_shop.v1.shop_idempotency import CheckoutServiceCheckoutSteps as Steps


async def handler(channel: grpc.aio.Channel) -> str:
    steps = Steps(stock_service=channel, ledger_service=channel)
    reserved: shop_pb2.ReserveResponse = await steps.reserve_stock(shop_pb2.ReserveRequest())
    posted: ledger_pb2.Ledger.Posted = await steps.debit(
        ledger_pb2.Ledger.Post(account="a"), timeout=1.0, metadata=[("x-trace", "1")]
    )
    step: str = Steps.RECEIPT_EMAIL
    config: str = shop_idempotency.SERVICE_CONFIG
    return reserved.reservation_id + posted.entry_id + step + config
"""

MISUSE = """
from __future__ import annotations

import grpc

from codegen_shop.v1 import shop_pb2
from codegen_shop.v1.shop_idempotency import CheckoutServiceCheckoutSteps as Steps


async def handler(channel: grpc.aio.Channel) -> None:
    steps = Steps(stock_service=channel, ledger_service=channel)
    await steps.debit(shop_pb2.ReserveRequest())
    await steps.debit_v1(shop_pb2.ReserveRequest())
"""


# One mypy cache for the module's runs: the standard library's stubs, grpc's, protobuf's and this
# package's are the same in every run, and checked cold each time they took most of its time. The
# generated files differ per test (each in its own tmp_path, so a cached module of the same name
# has another path and another hash, and mypy checks it again).
MYPY_CACHE = Path(tempfile.mkdtemp(prefix="gi-protoc-gen-mypy-"))
atexit.register(shutil.rmtree, MYPY_CACHE, ignore_errors=True)


def mypy(root: Path, *files: str) -> subprocess.CompletedProcess[str]:
    # --follow-imports=silent: the messages' .pyi that protoc writes are not mypy-strict clean
    # (bare Mapping); the files named here are checked in full.
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--explicit-package-bases",
         "--python-version", "3.11", "--cache-dir", str(MYPY_CACHE), *files],
        cwd=root, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_generated_code_passes_mypy_strict_and_is_typed(shop: Path) -> None:
    (shop / "usage.py").write_text(USAGE)
    (shop / "misuse.py").write_text(MISUSE)
    generated = [str(p.relative_to(shop)) for p in sorted(shop.rglob("*_idempotency.py"))]
    clean = mypy(shop, *generated, "usage.py")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # The wrappers are typed, not Any: a wrong request type and a retired step are errors.
    wrong = mypy(shop, "misuse.py")
    assert wrong.returncode == 1, wrong.stdout
    assert 'incompatible type "ReserveRequest"; expected "Post"' in wrong.stdout, wrong.stdout
    assert '"CheckoutServiceCheckoutSteps" has no attribute "debit_v1"' in wrong.stdout


def test_generated_module_surface(shop: Path) -> None:
    shop_idempotency, ledger_idempotency = shop_modules()
    for module in (shop_idempotency, ledger_idempotency):
        for name in module.__all__:
            assert getattr(module, name) is not None
    steps = shop_idempotency.CheckoutServiceCheckoutSteps
    # Active steps only; the retired debit.v1 keys no calls and has no constant.
    assert (steps.RESERVE_STOCK, steps.DEBIT, steps.REFUND, steps.RECEIPT_EMAIL) == (
        "reserve-stock.v1", "debit.v2", "refund.v1", "receipt-email.v1",
    )  # fmt: skip
    assert not hasattr(steps, "receipt_email")  # an outbox step is not a call
    assert [s.full_name for s in shop_idempotency.SERVICES] == [
        "codegen_shop.v1.CheckoutService",
        "codegen_shop.v1.StockService",
    ]
    assert sorted(shop_idempotency.POLICIES) == [
        "/codegen_shop.v1.CheckoutService/Cancel",
        "/codegen_shop.v1.CheckoutService/Checkout",
        "/codegen_shop.v1.StockService/Reserve",
    ]


def test_policies_compile_to_what_the_proto_options_compile_to(shop: Path) -> None:
    shop_idempotency, ledger_idempotency = shop_modules()
    from codegen_shop.v1 import ledger_pb2, shop_pb2

    for module, pb2 in ((shop_idempotency, shop_pb2), (ledger_idempotency, ledger_pb2)):
        bare = _without_method_options(pb2.DESCRIPTOR)
        keyed = {
            method_path(m): m
            for s in pb2.DESCRIPTOR.services_by_name.values()
            for m in s.methods
            if compile_policy(m) is not None
        }
        assert sorted(module.POLICIES) == sorted(keyed)
        for path, method in keyed.items():
            from_options = cast(MethodPolicy, compile_policy(method))  # keyed: not None
            override = module.POLICIES[path]
            assert compile_policy(method, override) == from_options, path
            # Without any option in the descriptors, POLICIES alone gives the same policy.
            stripped = bare.FindMethodByName(method.full_name)
            assert compile_policy(stripped) is None
            assert compile_policy(stripped, override) == from_options, path
            # And a change is one dataclasses.replace away.
            longer = dataclasses.replace(override, lease=timedelta(seconds=42))
            changed = compile_policy(method, longer)
            assert changed == dataclasses.replace(from_options, lease=timedelta(seconds=42))


def test_the_module_docstring_says_what_the_server_still_reads_from_descriptors(
    shop: Path,
) -> None:
    """The docstring (and README) said that with ``overrides=POLICIES`` the server reads no
    custom options from descriptors. It does: each override is merged onto the method's option,
    so a method left out of POLICIES, or a field left None, keeps what the proto says."""
    from grpc_idempotency.registry import PolicyRegistry

    shop_idempotency, _ = shop_modules()
    doc = " ".join((shop_idempotency.__doc__ or "").split())
    assert "reads no custom options" not in doc
    assert "The server still reads the descriptors" in doc
    assert "a method left out, keeps what the proto says" in doc
    assert "fingerprint exclusions come from the request's field options" in doc
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "without reading custom options from descriptors" not in readme
    assert "The descriptors are still read" in readme
    path = "/codegen_shop.v1.CheckoutService/Checkout"
    with_policies = PolicyRegistry(shop_idempotency.SERVICES, shop_idempotency.POLICIES)
    without = PolicyRegistry(shop_idempotency.SERVICES, {})
    assert without.get(path) == with_policies.get(path) is not None
    lease_only = {path: MethodOverride(lease=timedelta(seconds=42))}
    merged = PolicyRegistry(shop_idempotency.SERVICES, lease_only).get(path)
    policy = cast(MethodPolicy, with_policies.get(path))  # asserted not None above
    assert merged == dataclasses.replace(policy, lease=timedelta(seconds=42))


def _without_method_options(file: object) -> descriptor_pool.DescriptorPool:
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)  # type: ignore[attr-defined]
    del proto.dependency[:]  # options.proto: no option of it is left
    for service in proto.service:
        for method in service.method:
            method.ClearField("options")
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(proto.SerializeToString())
    return pool


def test_service_config_is_the_librarys(shop: Path) -> None:
    shop_idempotency, ledger_idempotency = shop_modules()
    for module in (shop_idempotency, ledger_idempotency):
        assert service_config(module.SERVICES) == module.SERVICE_CONFIG
        assert dict(module.CHANNEL_OPTIONS) == {
            "grpc.service_config": module.SERVICE_CONFIG,
            "grpc.enable_retries": 1,
        }


def test_a_file_whose_keys_are_all_optional_retries_nothing(tmp_path: Path) -> None:
    """gRPC's retry cannot see whether a call carries a key; one of a key-optional method
    without a key runs undeduplicated, and was run again (tests/integration/
    test_generated_code.py). Such a file's channel configuration retries nothing."""
    done = run_on(tmp_path, {"errs/v1/a.proto": svc("key: KEY_OPTIONAL")})
    assert done.returncode == 0, done.stderr
    module = (tmp_path / "out" / "errs/v1/a_idempotency.py").read_text()
    assert "SERVICE_CONFIG: Final = json.dumps({})\n" in module
    assert "no method here requires a key, so\ngRPC retries none" in module
    assert_ruff_clean([tmp_path / "out" / "errs/v1/a_idempotency.py"])


# -- validation: each error fails protoc and names the file, line and method -----------------

HEADER = """\
syntax = "proto3";
package errs.v1;
import "grpc_idempotency/v1/options.proto";
"""
MESSAGES = "message Req {}\nmessage Res {}\n"


def svc(options: str, *, extra_rpc: str = "", body: str = "") -> str:
    return (
        HEADER
        + "service Svc {\n"
        + f"  rpc Do(Req) returns (Res) {{\n    option (grpc_idempotency.v1.method) = {{ {options} }};\n    {body}\n  }}\n"
        + "  rpc Target(Req) returns (Res);\n"
        + extra_rpc
        + "}\n"
        + MESSAGES
    )


def run_on(tmp_path: Path, files: dict[str, str], *names_: str) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (tmp_path / "protos" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "protos" / name).write_text(text)
    return protoc(tmp_path / "protos", tmp_path / "out", *(names_ or tuple(files)))


def assert_fails(done: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr


ERRORS = {
    "malformed step name": (
        'steps: { name: "Charge-Card.v1" outbox: true }',
        "",
        "step name 'Charge-Card.v1' does not match",
    ),
    "unversioned step name": (
        'steps: { name: "charge-card" outbox: true }',
        "",
        "step name 'charge-card' does not match",
    ),
    "over-long step name": (
        f'steps: {{ name: "{"a" * 126}.v1" outbox: true }}',
        "",
        f"step name '{'a' * 40}'... is 129 characters long; a step name has at most 128",
    ),
    "duplicate step names": (
        'steps: { name: "charge.v1" outbox: true } steps: { name: "charge.v1" call: "errs.v1.Svc/Target" }',
        "",
        "step 'charge.v1' is declared twice",
    ),
    "call to a service in no file of the request": (
        'steps: { name: "charge.v1" call: "errs.v1.Payments/Charge" }',
        "",
        "step 'charge.v1' calls 'errs.v1.Payments/Charge', but no file given to the generator"
        " declares service errs.v1.Payments",
    ),
    "call to a method the service lacks": (
        'steps: { name: "charge.v1" call: "errs.v1.Svc/Charge" }',
        "",
        "step 'charge.v1' calls 'errs.v1.Svc/Charge', but service errs.v1.Svc has no method Charge",
    ),
    "call to a streaming method": (
        'steps: { name: "watch.v1" call: "errs.v1.Svc/Watch" }',
        "",
        "step 'watch.v1' calls 'errs.v1.Svc/Watch', a streaming method",
    ),
    "keyed and IDEMPOTENT": (
        "",
        "option idempotency_level = IDEMPOTENT;",
        "the method is declared idempotent by protobuf's idempotency_level",
    ),
    "keyed and NO_SIDE_EFFECTS": (
        "",
        "option idempotency_level = NO_SIDE_EFFECTS;",
        "the method is declared idempotent by protobuf's idempotency_level",
    ),
    "outbox step with a call": (
        'steps: { name: "event.v1" outbox: true call: "errs.v1.Svc/Target" }',
        "",
        "step 'event.v1' must set exactly one of call and outbox",
    ),
    # Values protoc accepts that are no value of the enum or outside the Duration's or the
    # Timestamp's range: the plugin crashed with a traceback on each (KeyError, OverflowError,
    # ValueError), and a Duration of mixed signs was generated as another value.
    "key out of its enum": ("key: 7", "", "unknown key 7"),
    "mode out of its enum": ("mode: 7", "", "unknown mode 7"),
    "store_down out of its enum": ("store_down: 9", "", "unknown store_down 9"),
    "isolation out of its enum": ("isolation: 9", "", "unknown isolation 9"),
    "retention past a Duration's range": (
        "retention: { seconds: 9000000000000000 }",
        "",
        "retention { seconds: 9000000000000000 nanos: 0 } is not a valid Duration",
    ),
    "lease of mixed signs": (
        "lease: { seconds: 10 nanos: -500000000 } mode: MODE_PHASED",
        "",
        "lease { seconds: 10 nanos: -500000000 } is not a valid Duration: seconds and nanos"
        " must have the same sign",
    ),
    # The server's floor (a client's registry takes it: check_lease), refused when generated.
    "lease under 100 ms": ("lease: { nanos: 50000000 }", "", "lease 0.05 s is too short"),
    "retired_at past year 9999": (
        'steps: { name: "a.v1" outbox: true retired_at: { seconds: 253402300800 } }',
        "",
        "step 'a.v1': retired_at { seconds: 253402300800 nanos: 0 } is not a valid Timestamp",
    ),
    "retired_at nanos out of range": (
        'steps: { name: "a.v1" outbox: true retired_at: { seconds: 1 nanos: 2000000000 } }',
        "",
        "step 'a.v1': retired_at { seconds: 1 nanos: 2000000000 } is not a valid Timestamp",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_validation_error(tmp_path: Path, case: str) -> None:
    options, body, message = ERRORS[case]
    extra = "  rpc Watch(Req) returns (stream Res);\n"
    done = run_on(tmp_path, {"errs/v1/bad.proto": svc(options, body=body, extra_rpc=extra)})
    # protoc's own form, file:line:column, at the method's option (line 6 of ``svc``).
    assert_fails(done, f"--grpc-idempotency_out: errs/v1/bad.proto:6:5: /errs.v1.Svc/Do: {message}")
    assert "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out" / "errs").exists()


def test_a_fingerprint_option_out_of_its_enum_is_an_error(tmp_path: Path) -> None:
    """``(grpc_idempotency.v1.field).fingerprint = 7``: protoc accepts a number that is no value
    of the enum, and it was read as INCLUDE, so a field meant to be excluded (a typo, a value
    of a newer options.proto) made every retry that changed it KEY_REUSED, with no error at
    generation or at server start."""
    text = svc('steps: { name: "a.v1" outbox: true }').replace(
        "message Req {}",
        "message Inner { string at = 1 [(grpc_idempotency.v1.field) = { fingerprint: 7 }]; }\n"
        "message Req { Inner inner = 1; }",
    )
    done = run_on(tmp_path, {"errs/v1/bad.proto": text})
    assert_fails(
        done,
        "--grpc-idempotency_out: errs/v1/bad.proto:6:5: /errs.v1.Svc/Do: field errs.v1.Inner.at:"
        " unknown fingerprint 7",
    )
    assert "Traceback" not in done.stderr, done.stderr


EXCLUDED_EXTENSIONS = {
    # Of the request: its value stayed in the fingerprint, so a retry that changed it was
    # refused KEY_REUSED, with nothing said at generation or at server start.
    "of the request": (
        "extend Req { optional string trace = 100 [(grpc_idempotency.v1.field) = {"
        " fingerprint: FINGERPRINT_EXCLUDE }]; }",
        "ext.v1.trace",
        43,
    ),
    # Declared inside a message, of a message the request holds.
    "nested, of a held message": (
        "message Holder { extend Inner { optional int64 sent_at = 100"
        " [(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_EXCLUDE]; } }",
        "ext.v1.Holder.sent_at",
        63,
    ),
    # A value of no Fingerprint (a newer options.proto's), which a field is refused for.
    "out of its enum": (
        "extend Req { optional string trace = 100 [(grpc_idempotency.v1.field) = {"
        " fingerprint: 7 }]; }",
        "ext.v1.trace",
        43,
    ),
}


@pytest.mark.parametrize("case", list(EXCLUDED_EXTENSIONS))
def test_a_fingerprint_option_on_an_extension_is_an_error(tmp_path: Path, case: str) -> None:
    """The fingerprint clears the request's declared fields (``Fingerprinter``); an extension's
    ``(grpc_idempotency.v1.field)`` was never read, so an extension marked FINGERPRINT_EXCLUDE
    stayed in the fingerprint while the proto said it did not. The error points at the
    option (line 10: the extension follows the file's 9 lines), as a method's does."""
    extension, name, column = EXCLUDED_EXTENSIONS[case]
    text = textwrap.dedent(
        """\
        syntax = "proto2";
        package ext.v1;
        import "grpc_idempotency/v1/options.proto";
        message Inner { optional string a = 1; extensions 100 to 199; }
        message Req { optional Inner inner = 1; extensions 100 to 199; }
        message Res {}
        service Svc {
          rpc Do(Req) returns (Res) { option (grpc_idempotency.v1.method) = {}; }
        }
        """
    )
    done = run_on(tmp_path, {"ext/v1/e.proto": text + extension + "\n"})
    assert_fails(
        done,
        f"--grpc-idempotency_out: ext/v1/e.proto:10:{column}: extension {name}:"
        " (grpc_idempotency.v1.field) is not read on an extension",
    )
    # Said once: the server's own refusal of it (compile_policy, through the request's
    # fingerprint) is the same problem.
    assert done.stderr.count(f"extension {name}:") == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert generated_files(tmp_path / "out") == {}


def test_an_excluded_extension_in_another_file_names_the_method_it_breaks(tmp_path: Path) -> None:
    """The server refuses a method whose request has such an extension (when its module is
    imported at start); the generator says which method too, for an extension of another file."""
    request = textwrap.dedent(
        """\
        syntax = "proto2";
        package ext.v1;
        import "grpc_idempotency/v1/options.proto";
        message Req { extensions 100 to 199; }
        message Res {}
        service Svc {
          rpc Do(Req) returns (Res) { option (grpc_idempotency.v1.method) = {}; }
        }
        """
    )
    extension = textwrap.dedent(
        """\
        syntax = "proto2";
        package ext.v1;
        import "grpc_idempotency/v1/options.proto";
        import "ext/v1/req.proto";
        extend Req { optional string trace = 100 [(grpc_idempotency.v1.field) = {
          fingerprint: FINGERPRINT_EXCLUDE }]; }
        """
    )
    done = run_on(tmp_path, {"ext/v1/req.proto": request, "ext/v1/trace.proto": extension})
    assert_fails(
        done,
        "ext/v1/trace.proto:5:43: extension ext.v1.trace: (grpc_idempotency.v1.field) is not read",
        "ext/v1/req.proto:7:31: /ext.v1.Svc/Do: extension ext.v1.trace: (grpc_idempotency.v1.field)"
        " is not read",
    )
    assert generated_files(tmp_path / "out") == {}


def test_a_fingerprint_include_on_an_extension_is_generated(tmp_path: Path) -> None:
    """FINGERPRINT_INCLUDE says what happens to an extension anyway: not refused."""
    text = svc('steps: { name: "a.v1" outbox: true }').replace(
        "message Req {}",
        'import "google/protobuf/descriptor.proto";\n'
        "extend google.protobuf.FieldOptions { string note = 50001"
        " [(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_INCLUDE]; }\n"
        "message Req {}",
    )
    done = run_on(tmp_path, {"errs/v1/ok.proto": text})
    assert done.returncode == 0, done.stderr


EXTENSION_HOLDER = """\
syntax = "proto2";
package ext.v1;
import "grpc_idempotency/v1/options.proto";
message Meta {
  optional string trace = 1 [(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_EXCLUDE];
  optional string note = 2;
}
message Req { optional string x = 1; optional Meta meta = 2; extensions 100 to 199; }
message Event { extensions 100 to 199; }
message Res {}
service Svc { rpc Do(Req) returns (Res) { option (grpc_idempotency.v1.method) = {}; } }
"""
EXCLUDED_INSIDE_EXTENSIONS = {
    # Of the request, in the keyed method's file.
    "same file": (
        {"ext/v1/e.proto": EXTENSION_HOLDER + "extend Req { optional Meta extra = 100; }\n"},
        "ext/v1/e.proto",
        "ext.v1.extra",
    ),
    # Declared in another file generated with it: a request carrying it is hashed alike.
    "another file": (
        {
            "ext/v1/e.proto": EXTENSION_HOLDER,
            "ext/v1/more.proto": 'syntax = "proto2";\npackage ext.v1;\nimport "ext/v1/e.proto";\n'
            "extend Req { optional Meta extra = 100; }\n",
        },
        "ext/v1/e.proto",
        "ext.v1.extra",
    ),
}


@pytest.mark.parametrize("case", list(EXCLUDED_INSIDE_EXTENSIONS))
def test_an_excluded_field_inside_a_requests_extension_is_an_error(
    tmp_path: Path, case: str
) -> None:
    """The fingerprint clears excluded fields through the request's declared fields only: inside
    an extension's value (a message whose field is FINGERPRINT_EXCLUDE) they are hashed as sent,
    so a retry that changed one was refused KEY_REUSED, generated without a word."""
    files, generated, extension = EXCLUDED_INSIDE_EXTENSIONS[case]
    done = run_on(tmp_path, files)
    assert_fails(
        done,
        f"--grpc-idempotency_out: {generated}:11:43: /ext.v1.Svc/Do: extension {extension}: holds"
        " ext.v1.Meta.trace, which is FINGERPRINT_EXCLUDE",
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert generated_files(tmp_path / "out") == {}


def test_an_excluded_field_inside_an_extension_no_request_carries_is_generated(
    tmp_path: Path,
) -> None:
    """Meta's exclusion holds where it is a declared field (Req.meta); as the value of an
    extension of a message no keyed method takes, it is no request's: not refused."""
    text = EXTENSION_HOLDER + "extend Event { optional Meta extra = 100; }\n"
    done = run_on(tmp_path, {"ext/v1/e.proto": text})
    assert done.returncode == 0, done.stderr


JSON_NAME_CONFLICT = """\
syntax = "proto2";
package jn.v1;
message Req { optional string foo_bar = 1; optional string fooBar = 2; }
"""


@pytest.mark.parametrize("given", [True, False], ids=["given", "imported"])
def test_a_file_protobufs_python_runtime_refuses_is_an_error_not_a_traceback(
    tmp_path: Path, given: bool
) -> None:
    """protoc only warns about two proto2 fields whose JSON names clash; protobuf's Python
    runtime refuses such a file ("duplicate json_name"), and the plugin, adding it to its pool,
    died with a traceback. It now names the file and why (its _pb2 fails to import alike)."""
    files = {
        "jn/v1/messages.proto": JSON_NAME_CONFLICT,
        "errs/v1/svc.proto": svc('steps: { name: "a.v1" outbox: true }').replace(
            'import "grpc_idempotency/v1/options.proto";',
            'import "grpc_idempotency/v1/options.proto";\nimport "jn/v1/messages.proto";',
        ),
    }
    done = run_on(tmp_path, files, *(files if given else ["errs/v1/svc.proto"]))
    assert_fails(
        done,
        "--grpc-idempotency_out: jn/v1/messages.proto: protobuf's Python runtime cannot load"
        " this file (Couldn't build proto file into descriptor pool: duplicate json_name (fooBar))",
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out" / "errs").exists()


def _proto_comment(source: str, declaration: str) -> str:
    """The ``//`` comment lines right above ``declaration`` in ``source``, joined."""
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(declaration))
    comment: list[str] = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("//"):
            break
        comment.insert(0, line.strip().removeprefix("//").strip())
    return " ".join(comment)


def test_the_options_proto_says_what_an_unset_mode_is() -> None:
    """options.proto, the user-facing contract, said MODE_UNSPECIFIED is "Treated as
    MODE_ATOMIC"; a method whose step calls another service is phased when its mode is unset
    (an atomic one calling services is refused)."""
    pool = _pool_of(
        svc('steps: { name: "a.v1" call: "errs.v1.Svc/Target" }'),
        svc('steps: { name: "a.v1" outbox: true }'),
    )
    calls, outbox = (pool[i].services_by_name["Svc"].methods_by_name["Do"] for i in (0, 1))
    assert (compile_policy(calls) or pytest.fail()).mode.name == "PHASED"
    assert (compile_policy(outbox) or pytest.fail()).mode.name == "ATOMIC"
    source = (ROOT / "protos" / "grpc_idempotency" / "v1" / "options.proto").read_text()
    said = _proto_comment(source, "MODE_UNSPECIFIED")
    assert "MODE_PHASED when a step calls another service" in said, said


def _pool_of(*sources: str) -> list[FileDescriptor]:
    """Each of ``sources`` (an ``errs/v1`` file), as the plugin loads it."""
    files: list[FileDescriptor] = []
    for source in sources:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "errs" / "v1").mkdir(parents=True)
            (root / "errs" / "v1" / "a.proto").write_text(source)
            out = root / "set.binpb"
            subprocess.run(
                [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"-I{proto_include()}",
                 "--include_imports", f"--descriptor_set_out={out}", "errs/v1/a.proto"],
                capture_output=True, check=True,
            )  # fmt: skip
            fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
        request = plugin_pb2.CodeGeneratorRequest(
            file_to_generate=["errs/v1/a.proto"], proto_file=fds.file
        )
        files += load(request).files
    return files


def test_valid_options_generate_a_module(tmp_path: Path) -> None:
    ok = run_on(tmp_path, {"errs/v1/ok.proto": svc('steps: { name: "a.v1" outbox: true }')})
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "out" / "errs" / "v1" / "ok_idempotency.py").is_file()


def test_every_error_is_reported_in_one_run(tmp_path: Path) -> None:
    """Each error starts ``file:line:column:`` at the method's option, as protoc's own do
    (editors and CI annotations read it); at its first line when it is set field by field. A
    field option's error at that option."""
    by_field = HEADER.replace("errs.v1", "errs.v3") + (
        "service Svc {\n  rpc Do(Req) returns (Res) {\n    option deprecated = true;\n"
        "    option (grpc_idempotency.v1.method).key = KEY_REQUIRED;\n"
        '    option (grpc_idempotency.v1.method).steps = { name: "Bad" outbox: true };\n'
        "  }\n}\n" + MESSAGES + 'import "google/protobuf/descriptor.proto";\n'
        "extend google.protobuf.FieldOptions {\n  string note = 50001\n"
        "    [(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_EXCLUDE];\n}\n"
    )
    text = svc(
        'steps: { name: "Bad" outbox: true }',
        extra_rpc=(
            "  rpc Other(Req) returns (Res) {\n"
            '    option (grpc_idempotency.v1.method) = { steps: { name: "x.v1" call: "errs.v1.Nope/X" } };\n'
            "  }\n"
        ),
    )
    done = run_on(tmp_path, {"errs/v1/two.proto": text, "errs/v2/three.proto": svc("").replace(
        "errs.v1", "errs.v2").replace("rpc Do(Req) returns (Res) {", "rpc Do(Req) returns (Res) {\n    option idempotency_level = NO_SIDE_EFFECTS;"),
        "errs/v3/four.proto": by_field})  # fmt: skip
    assert_fails(
        done,
        "errs/v1/two.proto:6:5: /errs.v1.Svc/Do: step name 'Bad'",
        "errs/v1/two.proto:11:5: /errs.v1.Svc/Other: step 'x.v1' calls 'errs.v1.Nope/X'",
        "errs/v2/three.proto:7:5: /errs.v2.Svc/Do: the method is declared idempotent",
        "errs/v3/four.proto:7:5: /errs.v3.Svc/Do: step name 'Bad'",
        "errs/v3/four.proto:16:6: extension errs.v3.note: (grpc_idempotency.v1.field) is not read",
    )


def test_errors_name_only_the_file_without_source_info(tmp_path: Path) -> None:
    """A request without SourceCodeInfo (one built from a descriptor set, not by protoc for its
    plugin): a method's and a field option's errors name the file alone, as before."""
    text = svc('steps: { name: "Bad" outbox: true }').replace(
        "message Req {}",
        'message Req {}\nimport "google/protobuf/descriptor.proto";\n'
        "extend google.protobuf.FieldOptions { string note = 50001"
        " [(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_EXCLUDE]; }",
    )
    (tmp_path / "errs" / "v1").mkdir(parents=True)
    (tmp_path / "errs" / "v1" / "bare.proto").write_text(text)
    out = tmp_path / "set.binpb"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"-I{proto_include()}",
         "--include_imports", f"--descriptor_set_out={out}", "errs/v1/bare.proto"],
        capture_output=True, check=True,
    )  # fmt: skip
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    request = plugin_pb2.CodeGeneratorRequest(
        file_to_generate=["errs/v1/bare.proto"], proto_file=files
    )
    error = generate(request).error
    assert "errs/v1/bare.proto: /errs.v1.Svc/Do: step name 'Bad'" in error, error
    assert "errs/v1/bare.proto: extension errs.v1.note: (grpc_idempotency.v1.field)" in error, error


def test_a_called_method_counts_when_its_file_is_given_or_imported(tmp_path: Path) -> None:
    payments = HEADER.replace("errs.v1", "pay.v1") + (
        "service Payments {\n  rpc Charge(Req) returns (Res) {\n"
        "    option (grpc_idempotency.v1.method) = {};\n  }\n}\n" + MESSAGES
    )
    orders = svc('steps: { name: "charge.v1" call: "pay.v1.Payments/Charge" }')
    files = {"pay/v1/payments.proto": payments, "errs/v1/orders.proto": orders}
    alone = run_on(tmp_path, files, "errs/v1/orders.proto")
    assert_fails(alone, "no file given to the generator declares service pay.v1.Payments")
    # buf's default strategy sends one request per directory: "pass it to protoc" told a buf
    # user nothing they could do.
    fix = "to protoc (or import it); with buf generate: strategy: all in buf.gen.yaml"
    assert fix in alone.stderr, alone.stderr
    both = run_on(tmp_path, files, "errs/v1/orders.proto", "pay/v1/payments.proto")
    assert both.returncode == 0, both.stderr
    generated = (tmp_path / "out" / "errs" / "v1" / "orders_idempotency.py").read_text()
    assert "from pay.v1 import payments_pb2" in generated
    imported = orders.replace(
        'import "grpc_idempotency/v1/options.proto";',
        'import "grpc_idempotency/v1/options.proto";\nimport "pay/v1/payments.proto";',
    )
    files["errs/v1/orders.proto"] = imported
    # protoc warns that the import is unused; the request still carries the file.
    assert run_on(tmp_path, files, "errs/v1/orders.proto").returncode == 0


def test_a_retired_step_may_call_a_method_that_is_gone(tmp_path: Path) -> None:
    text = svc(
        'steps: { name: "old.v1" call: "errs.v1.Gone/X" retired_at: { seconds: 1767225600 } }'
    )
    done = run_on(tmp_path, {"errs/v1/retired.proto": text})
    assert done.returncode == 0, done.stderr


def test_a_file_without_keyed_methods_gets_a_module_that_keys_nothing(tmp_path: Path) -> None:
    """protoc writes the files a plugin returns and deletes none. A file got no module once its
    last option was removed, so the module from before stayed, and its ``POLICIES`` kept the
    method keyed, with its steps, where the proto (and check-steps) said it was not. Every file
    given gets a module now; one without keyed methods gets the same names, empty."""
    keyed = svc('steps: { name: "a.v1" call: "errs.v1.Svc/Target" }')
    unkeyed = keyed.replace(
        '    option (grpc_idempotency.v1.method) = { steps: { name: "a.v1" call: "errs.v1.Svc/Target" } };\n',
        "",
    )
    assert "(grpc_idempotency.v1.method)" not in unkeyed
    files = {
        "errs/v1/a.proto": keyed,
        "errs/v1/messages.proto": 'syntax = "proto3";\npackage errs.v1;\nmessage Only {}\n',
    }
    out = tmp_path / "out"
    extra = (f"--python_out={out}", f"--pyi_out={out}")
    for text in (keyed, unkeyed):
        files["errs/v1/a.proto"] = text
        for name, content in files.items():
            (tmp_path / "protos" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "protos" / name).write_text(content)
        done = protoc(tmp_path / "protos", out, *files, extra=extra)
        assert done.returncode == 0, done.stderr
        keys_do = (
            '"/errs.v1.Svc/Do": MethodOverride(' in (out / "errs/v1/a_idempotency.py").read_text()
        )
        assert keys_do == (text is keyed)
    generated = ["errs/v1/a_idempotency.py", "errs/v1/messages_idempotency.py"]
    assert sorted(generated_files(out)) == generated
    for name in generated:
        assert "declares no keyed methods" in (out / name).read_text()
    assert_ruff_clean([out / name for name in generated])
    typed = mypy(out, *generated)
    assert typed.returncode == 0, typed.stdout + typed.stderr
    check = textwrap.dedent(
        """
        from errs.v1 import a_idempotency as gen, a_pb2, messages_idempotency
        from grpc_idempotency.core.policy import compile_policies

        service = a_pb2.DESCRIPTOR.services_by_name["Svc"]
        assert compile_policies(service.methods, gen.POLICIES) == {}
        for module in (gen, messages_idempotency):
            assert module.SERVICES == () and dict(module.POLICIES) == {}
            assert module.SERVICE_CONFIG == "{}", module.SERVICE_CONFIG
            assert dict(module.CHANNEL_OPTIONS)["grpc.service_config"] == "{}"
        print("keys nothing")
        """
    )
    assert run_with_generated(tmp_path, out, check).stdout.strip() == "keys nothing"


def test_the_options_own_file_gets_no_module(tmp_path: Path) -> None:
    # A buf workspace holding the exported options hands them to every plugin; their Python
    # code ships with the library.
    ok = svc('steps: { name: "a.v1" outbox: true }')
    (tmp_path / "protos" / "errs" / "v1").mkdir(parents=True)
    (tmp_path / "protos" / "errs" / "v1" / "ok.proto").write_text(ok)
    options = "grpc_idempotency/v1/options.proto"
    done = protoc(tmp_path / "protos", tmp_path / "out", "errs/v1/ok.proto", options)
    assert done.returncode == 0, done.stderr
    assert sorted(generated_files(tmp_path / "out")) == ["errs/v1/ok_idempotency.py"]


def test_unknown_parameters_are_refused(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.proto").write_text(svc(""))
    done = protoc(tmp_path / "p", tmp_path / "out", "a.proto", extra=("--grpc-idempotency_opt=x",))
    assert_fails(done, "unknown parameter 'x'")


def _newer_options() -> str:
    """options.proto as a later release might extend it: a field more in MethodPolicy, Step and
    FieldPolicy."""
    source = (ROOT / "protos" / "grpc_idempotency" / "v1" / "options.proto").read_text()
    for field, added in (
        ("  uint64 max_response_bytes = 10;\n", "  bool future_flag = 11;\n"),
        ("  google.protobuf.Timestamp retired_at = 4;\n", "  string note = 5;\n"),
        ("  Fingerprint fingerprint = 1;\n", "  bool redact = 2;\n"),
    ):
        assert field in source, field
        source = source.replace(field, field + added)
    return source


NEWER_OPTIONS = {
    "a method option": (
        "future_flag: true",
        "",
        ":6:5: /errs.v1.Svc/Do: (grpc_idempotency.v1.method) sets field 11",
    ),
    "a step's": (
        'steps: { name: "a.v1" outbox: true } steps: { name: "b.v1" outbox: true note: "later" }',
        "",
        ":6:5: /errs.v1.Svc/Do: (grpc_idempotency.v1.method) sets steps[1] field 5",
    ),
    # At the field's option (line 11 of ``svc``: message Req), as a method's.
    "a field option": (
        "",
        "string a = 1 [(grpc_idempotency.v1.field) = { redact: true }];",
        ":11:29: field errs.v1.Req.a: (grpc_idempotency.v1.field) sets field 2",
    ),
    "a nested message's field option": (
        "",
        "message Deep { message Deeper { string b = 1 [(grpc_idempotency.v1.field).redact = true]; } }",
        ":11:61: field errs.v1.Req.Deep.Deeper.b: (grpc_idempotency.v1.field) sets field 2",
    ),
}


@pytest.mark.parametrize("case", list(NEWER_OPTIONS))
def test_options_this_release_does_not_know_are_an_error(tmp_path: Path, case: str) -> None:
    """A proto compiled against a newer options.proto (exported by a later release) than the
    installed library's: the fields this release does not know were dropped without a word,
    and the generated module (and the server) ran without the setting the proto declares."""
    options, field, message = NEWER_OPTIONS[case]
    text = svc(options).replace("message Req {}", f"message Req {{ {field} }}")
    files = {"grpc_idempotency/v1/options.proto": _newer_options(), "errs/v1/new.proto": text}
    done = run_on(tmp_path, files, "errs/v1/new.proto")
    assert_fails(
        done,
        f"--grpc-idempotency_out: errs/v1/new.proto{message}",
        "this release of grpc-idempotency does not know",
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert generated_files(tmp_path / "out") == {}


@pytest.mark.parametrize(
    "data", [b"\xff\xff\xff", b'{"fileToGenerate": ["a.proto"]}'], ids=["garbage", "json"]
)
def test_the_executable_refuses_input_that_is_no_request(data: bytes) -> None:
    """Run by hand (or by a tool that is not protoc) on something that is no binary
    CodeGeneratorRequest: it printed a DecodeError traceback."""
    done = subprocess.run([str(plugin())], input=data, capture_output=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    stderr = done.stderr.decode()
    assert "Traceback" not in stderr, stderr
    assert "standard input is not a CodeGeneratorRequest" in stderr, stderr
    assert "protoc runs it" in stderr, stderr
    assert done.stdout == b""


# Other in-house options numbered like ours (50000-99999 is the in-house range).
FOREIGN_OPTIONS = {
    "other/opts.proto": """\
syntax = "proto3";
package other;
import "google/protobuf/descriptor.proto";
message Audit { string tag = 1; bool on = 2; }
extend google.protobuf.MethodOptions { Audit audit = 51842; }
extend google.protobuf.FieldOptions { string note = 51842; }
""",
    "other/nested.proto": """\
syntax = "proto3";
package other;
import "google/protobuf/descriptor.proto";
message Nested {
  extend google.protobuf.MethodOptions { string audited = 51842; }
}
""",
}
FOREIGN_USES = {
    # A string the default pool's FieldOptions would parse as FieldPolicy: the request itself
    # did not parse (DecodeError, a traceback from the plugin).
    "string field option": (
        'import "other/opts.proto";\nmessage M { string a = 1 [(other.note) = "free text"]; }\n'
        "service S { rpc Get(M) returns (M); }\n",
        "FieldOptions extension 51842 is other.note, not grpc_idempotency.v1.field",
    ),
    # A message that parsed as a MethodPolicy: the method was generated as keyed.
    "message method option": (
        'import "other/opts.proto";\nmessage M { string a = 1; }\n'
        'service S { rpc Get(M) returns (M) { option (other.audit) = { tag: "billing" on: true }; } }\n',
        "MethodOptions extension 51842 is other.audit, not grpc_idempotency.v1.method",
    ),
    # Beside our options, declared inside a message: a pool refused the file (a traceback).
    "nested, beside ours": (
        'import "other/nested.proto";\nimport "grpc_idempotency/v1/options.proto";\n'
        "message M { string a = 1; }\n"
        "service S { rpc Get(M) returns (M) { option (grpc_idempotency.v1.method) = {}; } }\n",
        "MethodOptions extension 51842 is other.Nested.audited, not grpc_idempotency.v1.method",
    ),
}


@pytest.mark.parametrize("case", list(FOREIGN_USES))
def test_another_extension_numbered_like_ours_is_refused(tmp_path: Path, case: str) -> None:
    body, message = FOREIGN_USES[case]
    files = {**FOREIGN_OPTIONS, "app/a.proto": 'syntax = "proto3";\npackage app;\n' + body}
    done = run_on(tmp_path, files, "app/a.proto")
    assert_fails(done, message, "another option claims grpc-idempotency's field number")
    assert "Traceback" not in done.stderr, done.stderr
    assert generated_files(tmp_path / "out") == {}


def test_options_imported_under_another_path_are_refused(tmp_path: Path) -> None:
    """A copy of options.proto imported as third_party/grpc_idempotency/v1/options.proto (an
    -I at the repository's root after ``export-protos third_party``) generated code whose _pb2
    registers the options' symbols a second time: "duplicate symbol" when imported beside the
    library. The plugin refuses it, naming the path to import them as."""
    options = (Path(proto_include()) / "grpc_idempotency/v1/options.proto").read_text()
    copy = "third_party/grpc_idempotency/v1/options.proto"
    text = svc('steps: { name: "a.v1" call: "errs.v1.Svc/Target" }').replace(
        '"grpc_idempotency/v1/options.proto"', f'"{copy}"'
    )
    done = run_on(tmp_path, {copy: options, "errs/v1/a.proto": text}, "errs/v1/a.proto")
    assert_fails(
        done,
        f"--grpc-idempotency_out: {copy}: grpc-idempotency's options imported under another"
        ' path; import them as "grpc_idempotency/v1/options.proto"',
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert generated_files(tmp_path / "out") == {}


TWO_FACTOR = """\
syntax = "proto3";
package auth;
import "grpc_idempotency/v1/options.proto";
message Code { string c = 1; }
service TwoFactor {
  rpc Send(Code) returns (Code);
  rpc Enroll(Code) returns (Code) OPTION
}
"""
KEYED = '{ option (grpc_idempotency.v1.method) = { steps: { name: "send.v1" call: "auth.TwoFactor/Send" } }; }'
CALLER = """\
syntax = "proto3";
package app.v1;
import "grpc_idempotency/v1/options.proto";
message Req {}
service App {
  rpc Do(Req) returns (Req) {
    option (grpc_idempotency.v1.method) = { steps: { name: "send.v1" call: "auth.TwoFactor/Send" } };
  }
}
"""
UNNAMABLE = {
    "keyed file": (
        {"auth/2fa.proto": TWO_FACTOR.replace("OPTION", KEYED)},
        "auth/2fa.proto: module auth.2fa_pb2 (of auth/2fa.proto) has a part, '2fa_pb2',",
    ),
    "called file": (
        {"auth/2fa.proto": TWO_FACTOR.replace("OPTION", ";"), "app/v1/b.proto": CALLER},
        "app/v1/b.proto: module auth.2fa_pb2 (of auth/2fa.proto) has a part, '2fa_pb2',",
    ),
    "directory": (
        {"2fa/v1/codes.proto": TWO_FACTOR.replace("OPTION", KEYED).replace("auth", "x2fa.v1")},
        "2fa/v1/codes.proto: module 2fa.v1.codes_pb2 (of 2fa/v1/codes.proto) has a part, '2fa',",
    ),
}


@pytest.mark.parametrize("case", list(UNNAMABLE))
def test_a_module_whose_path_is_no_identifier_is_refused(tmp_path: Path, case: str) -> None:
    """``auth/2fa.proto`` generated ``from auth import 2fa_pb2``, a SyntaxError. grpcio-tools'
    own code for such a file is no better (its _pb2_grpc.py, and the _pb2 of each file
    importing it, say the same), so the plugin refuses it and says why, where it could have
    used importlib: the file's services cannot be served or called with protoc's code."""
    files, message = UNNAMABLE[case]
    done = run_on(tmp_path, files)
    assert_fails(done, message, "rename")
    assert "Traceback" not in done.stderr, done.stderr
    assert generated_files(tmp_path / "out") == {}
    # The premise: grpc_python_out's module for the file is a SyntaxError.
    name = next(iter(files))
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path / 'protos'}",
         f"-I{proto_include()}", f"--grpc_python_out={stubs}", name],
        capture_output=True, check=True,
    )  # fmt: skip
    stub = stubs / name.replace(".proto", "_pb2_grpc.py")
    with pytest.raises(SyntaxError):
        compile(stub.read_text(), str(stub), "exec")


def test_a_file_whose_path_is_no_identifier_may_have_no_keyed_methods(tmp_path: Path) -> None:
    # Its module keys nothing and imports nothing of the file's: nothing to refuse.
    done = run_on(tmp_path, {"auth/2fa.proto": TWO_FACTOR.replace("OPTION", ";")})
    assert done.returncode == 0, done.stderr
    text = generated_files(tmp_path / "out")["auth/2fa_idempotency.py"]
    assert "declares no keyed methods" in text
    compile(text, "auth/2fa_idempotency.py", "exec")


def test_generated_names_never_collide(tmp_path: Path) -> None:
    # Two active versions of one step, a keyword step name, two called services of one name,
    # and two message modules of one basename.
    other: Callable[[str], str] = lambda pkg: (  # noqa: E731
        f'syntax = "proto3";\npackage {pkg};\nimport "grpc_idempotency/v1/options.proto";\n'
        "service Payments {\n  rpc Charge(Req) returns (Res) {\n"
        "    option (grpc_idempotency.v1.method) = {};\n  }\n}\n" + MESSAGES
    )
    main = svc(
        'steps: { name: "pay.v1" call: "a.v1.Payments/Charge" }'
        ' steps: { name: "pay.v2" call: "b.v1.Payments/Charge" }'
        ' steps: { name: "import.v1" call: "errs.v1.Svc/Target" }'
    )
    files = {"a/v1/types.proto": other("a.v1"), "b/v1/types.proto": other("b.v1"),
             "errs/v1/main.proto": main}  # fmt: skip
    done = run_on(tmp_path, files)
    assert done.returncode == 0, done.stderr
    source = (tmp_path / "out" / "errs" / "v1" / "main_idempotency.py").read_text()
    compile(source, "main_idempotency.py", "exec")
    for expected in (
        'PAY_V1: Final = "pay.v1"',
        'PAY_V2: Final = "pay.v2"',
        'IMPORT: Final = "import.v1"',
        "async def pay_v1(",
        "async def import_(",
        "a_v1_payments: grpc.aio.Channel,",
        "b_v1_payments: grpc.aio.Channel,",
        "svc: grpc.aio.Channel,",
        "from a.v1 import types_pb2 as a_dot_v1_dot_types__pb2",
        "a_dot_v1_dot_types__pb2.Req,",
    ):
        assert expected in source, expected


def test_called_services_whose_names_snake_case_alike_get_parameters_of_their_own(
    tmp_path: Path,
) -> None:
    """HTTPGateway and HttpGateway are both http_gateway: the clash was decided on the proto
    names, which differ, and the plugin generated ``def __init__(self, *, http_gateway,
    http_gateway)``, a SyntaxError, and exited 0. Now the full names are used, and when those
    snake-case alike too (one package) the plugin refuses."""
    gateways: Callable[[str, str], str] = lambda pkg, name: (  # noqa: E731
        f'syntax = "proto3";\npackage {pkg};\n'
        f"service {name} {{\n  rpc Send(Req) returns (Res);\n}}\n" + MESSAGES
    )
    main = svc(
        'steps: { name: "one.v1" call: "a.v1.HTTPGateway/Send" }'
        ' steps: { name: "two.v1" call: "b.v1.HttpGateway/Send" }'
    )
    files = {"a/v1/gw.proto": gateways("a.v1", "HTTPGateway"),
             "b/v1/gw.proto": gateways("b.v1", "HttpGateway"), "errs/v1/main.proto": main}  # fmt: skip
    done = run_on(tmp_path, files)
    assert done.returncode == 0, done.stderr
    source = (tmp_path / "out" / "errs" / "v1" / "main_idempotency.py").read_text()
    compile(source, "main_idempotency.py", "exec")
    assert "a_v1_http_gateway: grpc.aio.Channel," in source
    assert "b_v1_http_gateway: grpc.aio.Channel," in source
    one_package = svc(
        'steps: { name: "one.v1" call: "errs.v1.HTTPGateway/Send" }'
        ' steps: { name: "two.v1" call: "errs.v1.HttpGateway/Send" }',
        extra_rpc="}\nservice HTTPGateway {\n  rpc Send(Req) returns (Res);\n"
        "}\nservice HttpGateway {\n  rpc Send(Req) returns (Res);\n",
    )
    clash = run_on(tmp_path / "clash", {"errs/v1/one.proto": one_package})
    assert_fails(
        clash,
        "errs/v1/one.proto:6:5: /errs.v1.Svc/Do: called services errs.v1.HTTPGateway and"
        " errs.v1.HttpGateway would both be parameter 'errs_v1_http_gateway': generated names"
        " collide",
    )
    assert not (tmp_path / "clash" / "out" / "errs").exists()


def test_steps_whose_identifiers_collide_are_refused(tmp_path: Path) -> None:
    # import.v1 and import-.v1 differ as constants (IMPORT, IMPORT_) but not as wrappers
    # (import_ is the keyword's). (a.v1 and a.v2 active next to a-v1.v1 collided as a_v1 too:
    # two active versions of one step are refused before that now, below.)
    text = svc(
        'steps: { name: "import.v1" call: "errs.v1.Svc/Target" }'
        ' steps: { name: "import-.v1" call: "errs.v1.Svc/Target" }'
    )
    done = run_on(tmp_path, {"errs/v1/clash.proto": text})
    assert_fails(
        done,
        "errs/v1/clash.proto:6:5: /errs.v1.Svc/Do: steps 'import.v1' and 'import-.v1' would both"
        " be import_() in SvcDoSteps",
    )
    assert not (tmp_path / "out" / "errs").exists()


def test_two_active_versions_of_a_step_are_refused(tmp_path: Path) -> None:
    """Versions replace one another (propagation.as_of keys an operation begun before a
    version's retirement with it): two active at once, retiring one would key the other's
    in-flight calls with it."""
    text = svc(
        'steps: { name: "a.v1" call: "errs.v1.Svc/Target" }'
        ' steps: { name: "a.v2" call: "errs.v1.Svc/Target" }'
    )
    done = run_on(tmp_path, {"errs/v1/twice.proto": text})
    assert_fails(
        done,
        "errs/v1/twice.proto:6:5: /errs.v1.Svc/Do: steps 'a.v1' and 'a.v2' are both active on"
        " errs.v1.Svc/Target",
    )


def test_a_dotted_file_name_gives_a_module_next_to_its_pb2_that_imports(tmp_path: Path) -> None:
    # protoc's Python generator writes dotted/v1/orders.events.proto's messages to
    # dotted/v1/orders/events_pb2.py; the plugin's module must land beside it to be importable.
    text = svc('steps: { name: "notify.v1" call: "dotted.v1.Svc/Target" }').replace(
        "errs.v1", "dotted.v1"
    )
    (tmp_path / "protos" / "dotted" / "v1").mkdir(parents=True)
    (tmp_path / "protos" / "dotted" / "v1" / "orders.events.proto").write_text(text)
    out = tmp_path / "out"
    done = protoc(
        tmp_path / "protos", out, "dotted/v1/orders.events.proto", extra=(f"--python_out={out}",)
    )
    assert done.returncode == 0, done.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.py")) == [
        "dotted/v1/orders/events_idempotency.py",
        "dotted/v1/orders/events_pb2.py",
    ]
    check = textwrap.dedent(
        """
        from dotted.v1.orders import events_idempotency as gen, events_pb2
        from grpc_idempotency.core.policy import compile_policy

        assert gen.SERVICES == (events_pb2.DESCRIPTOR.services_by_name["Svc"],)
        method = events_pb2.DESCRIPTOR.services_by_name["Svc"].methods_by_name["Do"]
        assert compile_policy(method, gen.POLICIES["/dotted.v1.Svc/Do"]) == compile_policy(method)
        assert gen.SvcDoSteps.NOTIFY == "notify.v1"
        print("imported")
        """
    )
    ran = run_with_generated(tmp_path, out, check)
    assert ran.stdout.strip() == "imported"


REQUIRED_EXCLUDED = {
    "proto2": (
        'syntax = "proto2";\n',
        "required int64 sent_at = 2",
    ),
    "editions": (
        'edition = "2023";\n',
        "int64 sent_at = 2 [features.field_presence = LEGACY_REQUIRED,",
    ),
}


@pytest.mark.parametrize("syntax", list(REQUIRED_EXCLUDED))
def test_a_required_field_excluded_from_the_fingerprint_is_generated(
    tmp_path: Path, syntax: str
) -> None:
    """FINGERPRINT_EXCLUDE on a proto2 ``required`` (or editions LEGACY_REQUIRED) field: the
    server clears it in a copy it serializes partially, so the plugin generates the module as
    for any other field (it refused it while the fingerprint checked required fields)."""
    head, field = REQUIRED_EXCLUDED[syntax]
    exclude = "(grpc_idempotency.v1.field).fingerprint = FINGERPRINT_EXCLUDE"
    field += f" {exclude}];" if field.endswith(",") else f" [{exclude}];"
    text = head + textwrap.dedent(
        f"""
        package req.v1;
        import "grpc_idempotency/v1/options.proto";
        message Req {{
          {field}
        }}
        message Res {{}}
        service Svc {{
          rpc Do(Req) returns (Res) {{ option (grpc_idempotency.v1.method) = {{}}; }}
        }}
        """
    )
    done = run_on(tmp_path, {"req/v1/r.proto": text})
    assert done.returncode == 0, done.stderr
    assert "req/v1/r_idempotency.py" in generated_files(tmp_path / "out")


def test_policies_render_durations_as_the_server_compiles_them(tmp_path: Path) -> None:
    """Sub-second and microsecond durations in POLICIES compile to what the descriptor's options
    compile to (the renderer and compile_policy share ``policy.duration_of``)."""
    text = svc(
        "retention: { seconds: 5 nanos: 999 } lease: { seconds: 1 nanos: 500000000 }"
        " max_wait: { nanos: 1500 }"
    ).replace("errs.v1", "durs.v1")
    (tmp_path / "protos" / "durs" / "v1").mkdir(parents=True)
    (tmp_path / "protos" / "durs" / "v1" / "d.proto").write_text(text)
    out = tmp_path / "out"
    done = protoc(tmp_path / "protos", out, "durs/v1/d.proto", extra=(f"--python_out={out}",))
    assert done.returncode == 0, done.stderr
    source = (out / "durs" / "v1" / "d_idempotency.py").read_text()
    for expected in (
        "retention=timedelta(seconds=5),",
        "lease=timedelta(seconds=1, microseconds=500000),",
        "max_wait=timedelta(microseconds=1),",
    ):
        assert expected in source, source
    check = textwrap.dedent(
        """
        from durs.v1 import d_idempotency as gen, d_pb2
        from grpc_idempotency.core.policy import compile_policy

        method = d_pb2.DESCRIPTOR.services_by_name["Svc"].methods_by_name["Do"]
        assert compile_policy(method, gen.POLICIES["/durs.v1.Svc/Do"]) == compile_policy(method)
        print("same")
        """
    )
    ran = run_with_generated(tmp_path, out, check)
    assert ran.stdout.strip() == "same"


KEYWORD_PAY = """\
syntax = "proto3";
package inbound.v1;
import "grpc_idempotency/v1/options.proto";
message Req { string a = 1; }
message Res { string b = 1; }
service Pay {
  rpc Charge(Req) returns (Res) { option (grpc_idempotency.v1.method) = {}; }
}
"""
KEYWORD_SHOP = """\
syntax = "proto3";
package shop.v1;
import "grpc_idempotency/v1/options.proto";
message BuyRequest {}
message BuyResponse {}
service Shop {
  rpc Buy(BuyRequest) returns (BuyResponse) { option (grpc_idempotency.v1.method) = {
    steps: { name: "charge.v1" call: "inbound.v1.Pay/Charge" }
    steps: { name: "again.v1" call: "shop.v1.Shop/Buy" }
  }; }
}
"""
KEYWORD_USAGE = """
from __future__ import annotations

import grpc
from google.protobuf.message import Message

from shop.v1 import shop_pb2
from shop.v1.shop_idempotency import ShopBuySteps


async def handler(channel: grpc.aio.Channel) -> bytes:
    steps = ShopBuySteps(pay=channel, shop=channel)
    charged: Message = await steps.charge(shop_pb2.BuyRequest())
    again: shop_pb2.BuyResponse = await steps.again(shop_pb2.BuyRequest())
    return charged.SerializeToString() + again.SerializeToString()
"""


def test_a_module_in_a_keyword_directory_is_imported_with_importlib(tmp_path: Path) -> None:
    """A step target under in/v1/ generated ``from in.v1 import pay_pb2``, a SyntaxError (and
    so did a keyed file there, for its own module). protoc's python_out imports such a module
    with importlib.import_module; so does the plugin now, and the code stays mypy-strict clean
    (that module's messages typed ``Message``), formatted and lint clean."""
    files = {"in/v1/pay.proto": KEYWORD_PAY, "shop/v1/shop.proto": KEYWORD_SHOP}
    for name, text in files.items():
        (tmp_path / "protos" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "protos" / name).write_text(text)
    out = tmp_path / "out"
    extra = (f"--python_out={out}", f"--pyi_out={out}")
    done = protoc(tmp_path / "protos", out, *files, extra=extra)
    assert done.returncode == 0, done.stderr
    generated = ["in/v1/pay_idempotency.py", "shop/v1/shop_idempotency.py"]
    for name in generated:
        compile((out / name).read_text(), name, "exec")
    shop = (out / "shop/v1/shop_idempotency.py").read_text()
    assert 'pay_pb2 = importlib.import_module("in.v1.pay_pb2")' in shop
    assert "from shop.v1 import shop_pb2\n" in shop
    pay = (out / "in/v1/pay_idempotency.py").read_text()
    assert 'pay_pb2 = importlib.import_module("in.v1.pay_pb2")' in pay
    assert_ruff_clean([out / name for name in generated])
    (out / "usage.py").write_text(KEYWORD_USAGE)
    typed = mypy(out, *generated, "usage.py")
    assert typed.returncode == 0, typed.stdout + typed.stderr
    check = textwrap.dedent(
        """
        import importlib
        from shop.v1 import shop_idempotency as gen, shop_pb2
        from grpc_idempotency.core.policy import compile_policy

        pay = importlib.import_module("in.v1.pay_idempotency")
        assert pay.SERVICES[0].full_name == "inbound.v1.Pay"
        assert gen.pay_pb2 is importlib.import_module("in.v1.pay_pb2")
        method = shop_pb2.DESCRIPTOR.services_by_name["Shop"].methods_by_name["Buy"]
        assert compile_policy(method, gen.POLICIES["/shop.v1.Shop/Buy"]) == compile_policy(method)
        print("imported")
        """
    )
    ran = run_with_generated(tmp_path, out, check)
    assert ran.stdout.strip() == "imported"


def generate_checked(tmp_path: Path, files: dict[str, str], usage: str = "") -> dict[str, str]:
    """Generates ``files`` with messages, .pyi and the plugin; asserts that every generated
    module imports, is formatted and lint clean, and passes mypy --strict together with
    ``usage`` (a module using it). Returns the generated sources by path."""
    for name, text in files.items():
        (tmp_path / "protos" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "protos" / name).write_text(text)
    out = tmp_path / "out"
    done = protoc(
        tmp_path / "protos", out, *files, extra=(f"--python_out={out}", f"--pyi_out={out}")
    )
    assert done.returncode == 0, done.stderr
    generated = sorted(str(p.relative_to(out)) for p in out.rglob("*_idempotency.py"))
    assert generated, "no module generated"
    modules = [g.removesuffix(".py").replace("/", ".") for g in generated]
    imports = f"import importlib\nfor m in {modules!r}: importlib.import_module(m)"
    run_with_generated(tmp_path, out, imports)
    assert_ruff_clean([out / name for name in generated])
    if usage:
        (out / "usage.py").write_text(usage)
    typed = mypy(out, *generated, *(["usage.py"] if usage else []))
    assert typed.returncode == 0, typed.stdout + typed.stderr
    return {name: (out / name).read_text() for name in generated}


SERVICE_PROTO = """\
syntax = "proto3";
package mycompany.{name}.v1;
import "grpc_idempotency/v1/options.proto";
{imports}
service {service} {{
  rpc {method}({method}Request) returns ({method}Response) {{
    option (grpc_idempotency.v1.method) = {{ {options} }};
  }}
}}
message {method}Request {{}}
message {method}Response {{}}
"""


def test_packages_that_each_name_their_file_service_proto_generate_formatted_code(
    tmp_path: Path,
) -> None:
    """A file named service.proto in every package is a common layout: a step calling another
    package's service imports two modules named service_pb2, aliased as protoc does, and with
    ordinary names the import and the SERVICES entry passed 88 columns (ruff format split them).
    """
    payments = SERVICE_PROTO.format(
        name="payments", imports="", service="PaymentService", method="Charge", options=""
    )
    orders = SERVICE_PROTO.format(
        name="orders",
        imports='import "mycompany/payments/v1/service.proto";',
        service="OrderService",
        method="PlaceOrder",
        options='steps: { name: "charge-card.v1" call: "mycompany.payments.v1.PaymentService/Charge" }',
    )
    usage = (
        "from __future__ import annotations\n\n"
        "import grpc\n\n"
        "from mycompany.orders.v1.service_idempotency import OrderServicePlaceOrderSteps\n"
        "from mycompany.payments.v1 import service_pb2\n\n\n"
        "async def handler(channel: grpc.aio.Channel) -> service_pb2.ChargeResponse:\n"
        "    steps = OrderServicePlaceOrderSteps(payment_service=channel)\n"
        "    return await steps.charge_card(service_pb2.ChargeRequest())\n"
    )
    source = generate_checked(
        tmp_path,
        {
            "mycompany/payments/v1/service.proto": payments,
            "mycompany/orders/v1/service.proto": orders,
        },
        usage,
    )
    assert (
        "service_pb2 as mycompany_dot_payments_dot_v1_dot_service__pb2,"
        in (source["mycompany/orders/v1/service_idempotency.py"])
    )


OUTBOX_ONLY = """\
syntax = "proto3";
package ob.v1;
import "grpc_idempotency/v1/options.proto";
message Req { string x = 1; }
message Res { string y = 1; }
service Shop {
  rpc Buy(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = { steps: { name: "receipt.v1" outbox: true } };
  }
}
"""


def test_a_method_whose_steps_are_all_outbox_steps_is_formatted(tmp_path: Path) -> None:
    """A steps class without calls closed its docstring on a line of its own (the paragraph
    about channels left out), which ``ruff format`` (and black) fold onto the first line: the
    module was not in the formatter's shape the renderer promises."""
    source = generate_checked(tmp_path, {"ob/v1/shop.proto": OUTBOX_ONLY})
    assert '    """The steps of ``ob.v1.Shop/Buy``."""\n' in source["ob/v1/shop_idempotency.py"]


# Step names at both sides of each length where a line of a step's code changes shape (with
# method ``Charge``; in a module whose messages are typed ``Message`` too): the wrapper's
# docstring wraps from 45; its ``await`` is parenthesized from 51 (``Message``); its
# ``step_metadata(...)`` is split from 55; ``await`` and ``return await`` lines take a ``noqa``
# from 63 and 64; ``self._x = _unary(`` is parenthesized from 68, with a ``noqa`` from 74;
# the constant is one line with a ``noqa`` from 77; and the longest name.
LONG_STEP_LENGTHS = (44, 45, 50, 51, 54, 55, 62, 63, 64, 67, 68, 73, 74, 76, 77, 128)
assert max(LONG_STEP_LENGTHS) == MAX_STEP_NAME_LENGTH


def long_step(length: int, version: int = 1) -> str:
    base = f"long-step-{length}-v{version}-"
    return f"{base.ljust(length - len(f'.v{version}'), 'x')}.v{version}"


def long_steps(target: str) -> str:
    # A long version leaves a short constant: ``NAME: Final = (`` fits, the parenthesized
    # value line (88 columns, then 89) decides alone.
    lengths = [(n, 1) for n in LONG_STEP_LENGTHS] + [(78, 1000), (79, 1000)]
    return "".join(f'steps: {{ name: "{long_step(n, v)}" call: "{target}" }}\n' for n, v in lengths)


# A keyed method (a class, a parameter, gRPC paths) and a called one named at length.
LONG_METHOD = "RefundTheOrderAndReleaseTheReservedStockOfEveryLineOfItToTheWarehouse"
FORMATTER_SHAPES = (
    """\
syntax = "proto3";
package payments.checkout.v1;
import "grpc_idempotency/v1/options.proto";
message Req { string x = 1; }
message Res { string y = 1; }
service CustomerPaymentService {
  rpc Charge(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = { recorded_error_codes: "FAILED_PRECONDITION" };
  }
  rpc Order(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = {
      steps: { name: "charge-the-customers-saved-card.v1" call: "payments.checkout.v1.CustomerPaymentService/Charge" }
      steps: { name: "send-the-order-confirmation-email-now.v1" call: "payments.checkout.v1.CustomerPaymentService/Charge" }
      steps: { name: "notify-the-warehouse-of-the-order.v1" call: "payments.checkout.v1.CustomerPaymentService/Charge" }
      steps: { name: "charge-the-customers-gift-card-now.v10" call: "payments.checkout.v1.CustomerPaymentService/Charge" }
      steps: { name: "release-the-reserved-stock-of-order.v1" call: "payments.checkout.v1.CustomerPaymentService/Charge" }
"""
    + long_steps("payments.checkout.v1.CustomerPaymentService/Charge")
    + f"""\
    }};
  }}
  rpc {LONG_METHOD}(Req) returns (Res) {{
    option (grpc_idempotency.v1.method) = {{
      steps: {{ name: "refund.v1" call: "payments.checkout.v1.CustomerPaymentService/{LONG_METHOD}" }}
    }};
  }}
}}
"""
)

FORMATTER_SHAPES_HIDDEN = """\
syntax = "proto3";
package payments.checkout.v2;
import "grpc_idempotency/v1/options.proto";
message DESCRIPTOR {}
message Outer { message from {} }
service CustomerPaymentService {
  rpc Charge(DESCRIPTOR) returns (DESCRIPTOR) { option (grpc_idempotency.v1.method) = {}; }
  rpc Order(DESCRIPTOR) returns (DESCRIPTOR) {
    option (grpc_idempotency.v1.method) = {
STEPS    };
  }
}
service CustomerRefunds {
  rpc Refund(DESCRIPTOR) returns (DESCRIPTOR) { option (grpc_idempotency.v1.method) = {}; }
}
service CustomerDiscount {
  rpc Grant(DESCRIPTOR) returns (DESCRIPTOR) { option (grpc_idempotency.v1.method) = {}; }
}
""".replace("STEPS", long_steps("payments.checkout.v2.CustomerPaymentService/Charge"))


def test_one_recorded_code_and_long_names_are_in_the_formatters_shape(tmp_path: Path) -> None:
    """A one-element tuple's comma is no magic trailing comma: ``recorded_errors`` of one code,
    exploded, was joined onto one line by ruff format (and black). And past 88 columns they
    split a step wrapper's ``metadata=`` tuple (from a step name of 37 characters), a step
    constant (38) and, in a file with a symbol named ``DESCRIPTOR``, a service's lookup (a
    full name of 37): names of usual length, not only very long ones. (protoc's .pyi of a file
    with a ``DESCRIPTOR`` message declares the name twice, which mypy reports: that file is
    imported and formatted, not type-checked.) The three new steps and the services
    ``CustomerRefunds`` and ``CustomerDiscount`` put a line at 88 columns, kept whole, and
    one at 89, split: a split from 88, or none at 89, is rewritten by the formatter. Longer
    step names (``LONG_STEP_LENGTHS``, up to the longest valid) broke it again: a wrapper's
    docstring passed 88 columns (E501) from 45 characters, the formatter split
    ``step_metadata(...)`` from 55 and parenthesized ``self._x = _unary(`` from 68, and from
    77 it joined the parenthesized constant back onto one line, past 88. A line no shape
    fits carries a ``noqa: E501`` (RUF100 says if one is not needed); ``hidden.proto``'s
    messages are typed ``Message``, as a keyword-named one makes them, so its wrappers
    assign ``response`` before returning it."""
    files = {"pay/v1/plain.proto": FORMATTER_SHAPES, "pay/v2/hidden.proto": FORMATTER_SHAPES_HIDDEN}
    for name, text in files.items():
        (tmp_path / "protos" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "protos" / name).write_text(text)
    out = tmp_path / "out"
    done = protoc(
        tmp_path / "protos", out, *files, extra=(f"--python_out={out}", f"--pyi_out={out}")
    )
    assert done.returncode == 0, done.stderr
    plain, hidden = "pay/v1/plain_idempotency.py", "pay/v2/hidden_idempotency.py"
    assert sorted(generated_files(out)) == [plain, hidden]
    run_with_generated(tmp_path, out, "import pay.v1.plain_idempotency, pay.v2.hidden_idempotency")
    assert_ruff_clean([out / plain, out / hidden])
    typed = mypy(out, plain)
    assert typed.returncode == 0, typed.stdout + typed.stderr
    source = (out / plain).read_text()
    assert "        recorded_errors=(Code.FAILED_PRECONDITION,),\n" in source
    assert "    SEND_THE_ORDER_CONFIRMATION_EMAIL_NOW: Final = (\n" in source
    assert "            metadata=(\n                *metadata,\n" in source
    # 88 columns: one line (an exploded tuple keeps its magic trailing comma, so only this
    # says it is not split early).
    assert "metadata=(*metadata, step_metadata(self.NOTIFY_THE_WAREHOUSE_OF_THE_ORDER)),\n" in (
        source
    )
    untyped = (out / hidden).read_text()
    assert '        "payments.checkout.v2.CustomerPaymentService"\n    ),\n' in untyped
    assert f'        """Calls ``Charge`` as step ``{long_step(44)}``."""\n' in source
    assert f'        """Calls ``Charge`` as step\n        ``{long_step(45)}``."""\n' in source
    assert "        response: Message = (\n            await self._long_step_51_" in untyped


EDITION_2024 = """\
edition = "2024";
package e24.v1;
IMPORT "grpc_idempotency/v1/options.proto";
message Req { string x = 1; }
message Res { string y = 1; }
service Shop {
  rpc Pay(Req) returns (Res);
  rpc Buy(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = { steps: { name: "pay.v1" call: "e24.v1.Shop/Pay" } };
  }
}
"""


@pytest.mark.parametrize("form", ["import", "import option"])
def test_an_edition_2024_file_is_generated(tmp_path: Path, form: str) -> None:
    """protoc's python_out takes edition 2024; the plugin said it supported editions up to
    2023 only, so protoc refused the file. 2024's ``import option`` (an import for options
    alone, which the file's _pb2 does not import) still brings the options to the plugin."""
    text = EDITION_2024.replace("IMPORT", form)
    generated = generate_checked(tmp_path, {"e24/v1/shop.proto": text})
    assert sorted(generated) == ["e24/v1/shop_idempotency.py"]
    check = textwrap.dedent(
        """
        from e24.v1 import shop_idempotency as gen, shop_pb2
        from grpc_idempotency.core.policy import compile_policy

        method = shop_pb2.DESCRIPTOR.services_by_name["Shop"].methods_by_name["Buy"]
        assert compile_policy(method, gen.POLICIES["/e24.v1.Shop/Buy"]) == compile_policy(method)
        print(gen.ShopBuySteps.PAY)
        """
    )
    assert run_with_generated(tmp_path, tmp_path / "out", check).stdout.strip() == "pay.v1"


NO_PACKAGE = """\
syntax = "proto3";
import "grpc_idempotency/v1/options.proto";
message Req { string x = 1; }
message Res { string y = 1; }
service Pay { rpc Charge(Req) returns (Res) { option (grpc_idempotency.v1.method) = {}; } }
service Shop {
  rpc Buy(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = { steps: { name: "pay.v1" call: "Pay/Charge" } };
  }
}
"""
NO_PACKAGE_USAGE = """
from __future__ import annotations

import grpc

import nopkg_pb2
from nopkg_idempotency import POLICIES, ShopBuySteps


async def handler(channel: grpc.aio.Channel) -> str:
    charged: nopkg_pb2.Res = await ShopBuySteps(pay=channel).pay(nopkg_pb2.Req())
    return charged.y + str(POLICIES["/Shop/Buy"].steps)
"""


def test_a_step_may_call_a_service_declared_without_a_package(tmp_path: Path) -> None:
    """The plugin refused ``call: "Pay/Charge"`` ("expected 'package.Service/Method'"), the
    very step the runtime asks for when a keyed method calls keyed ``/Pay/Charge``."""
    source = generate_checked(tmp_path, {"nopkg.proto": NO_PACKAGE}, NO_PACKAGE_USAGE)
    shop = source["nopkg_idempotency.py"]
    assert '"/Pay/Charge",' in shop and "async def pay(" in shop


SHADOWING_STEPS = """\
syntax = "proto3";
package a.v1;
import "grpc_idempotency/v1/options.proto";
message Req { string x = 1; }
message Res { string y = 1; }
service Pay { rpc Charge(Req) returns (Res); }
service Shop {
  rpc Buy(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = {
      steps: { name: "str.v1" call: "a.v1.Pay/Charge" }
      steps: { name: "float.v1" call: "a.v1.Pay/Charge" }
      steps: { name: "svc-pb2.v1" call: "a.v1.Pay/Charge" }
      steps: { name: "grpc.v1" call: "a.v1.Pay/Charge" }
      steps: { name: "tuple.v1" call: "a.v1.Pay/Charge" }
      steps: { name: "bytes.v1" outbox: true }
      steps: { name: "zz.v1" call: "a.v1.Pay/Charge" }
    };
  }
}
"""
SHADOWING_USAGE = """
from __future__ import annotations

import grpc

from a.v1 import svc_pb2
from a.v1.svc_idempotency import ShopBuySteps


async def handler(channel: grpc.aio.Channel) -> str:
    steps = ShopBuySteps(pay=channel)
    text: svc_pb2.Res = await steps.str_(svc_pb2.Req(), timeout=1.0)
    module: svc_pb2.Res = await steps.svc_pb2_(svc_pb2.Req())
    last: svc_pb2.Res = await steps.zz(svc_pb2.Req())
    return text.y + module.y + last.y + ShopBuySteps.STR + ShopBuySteps.BYTES
"""


def test_a_wrapper_never_shadows_a_name_the_annotations_use(tmp_path: Path) -> None:
    """A method's annotations resolve in its class's scope: wrappers named ``str`` and
    ``float`` made ``timeout: float | None`` and ``metadata: ...[str, str | bytes]`` name them
    (mypy: 'Function ... is not valid as a type'), and a wrapper ``svc_pb2`` hid the module
    from the later wrappers' ``request: svc_pb2.Req`` ('Name ... is not defined'). A wrapper
    named like a builtin or like a name the module binds gets a trailing underscore."""
    source = generate_checked(tmp_path, {"a/v1/svc.proto": SHADOWING_STEPS}, SHADOWING_USAGE)
    shop = source["a/v1/svc_idempotency.py"]
    for wrapper in ("str_", "float_", "svc_pb2_", "grpc_", "tuple_", "zz"):
        assert f"    async def {wrapper}(\n" in shop, shop
    assert 'STR: Final = "str.v1"' in shop and 'BYTES: Final = "bytes.v1"' in shop
    # The underscore can meet another step's identifier, like a keyword's.
    clash = svc(
        'steps: { name: "str.v1" call: "errs.v1.Svc/Target" }'
        ' steps: { name: "str-.v1" call: "errs.v1.Svc/Target" }'
    )
    assert_fails(
        run_on(tmp_path / "clash", {"errs/v1/clash.proto": clash}),
        "errs/v1/clash.proto:6:5: /errs.v1.Svc/Do: steps 'str.v1' and 'str-.v1' would both be"
        " str_() in SvcDoSteps",
    )


AMBIGUOUS_NAMES = """\
syntax = "proto3";
package a.v1;
import "grpc_idempotency/v1/options.proto";
message Req {}
message Res {}
service L { rpc Get(Req) returns (Res); }
service __Pay { rpc Get(Req) returns (Res); }
service Shop {
  rpc Buy(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = {
      steps: { name: "l.v1" call: "a.v1.L/Get" }
      steps: { name: "i.v1" call: "a.v1.L/Get" }
      steps: { name: "o.v1" outbox: true }
      steps: { name: "pay.v1" call: "a.v1.__Pay/Get" }
    };
  }
}
"""
AMBIGUOUS_USAGE = """
from __future__ import annotations

import grpc

from a.v1 import svc_pb2
from a.v1.svc_idempotency import ShopBuySteps


async def handler(channel: grpc.aio.Channel) -> tuple[svc_pb2.Res, str, str]:
    steps = ShopBuySteps(l=channel, _pay=channel)
    return await steps.l(svc_pb2.Req()), ShopBuySteps.I, ShopBuySteps.O
"""


def test_odd_but_legal_names_give_parameters_callers_can_pass_and_lint_clean_code(
    tmp_path: Path,
) -> None:
    """Steps ``o.v1``, ``i.v1`` and ``l.v1`` and a called service ``L`` gave constants ``O``
    and ``I``, a wrapper ``l`` and a parameter ``l``: E741/E743 in code said to be lint clean.
    The names stay what the step and service names give; their lines carry the ``noqa``.
    A called service ``__Pay`` gave parameter ``__pay``, which Python mangles in a class body
    (``_ShopBuySteps__pay``): no caller could pass it. It is ``_pay``."""
    files = {"a/v1/svc.proto": AMBIGUOUS_NAMES}
    shop = generate_checked(tmp_path, files, AMBIGUOUS_USAGE)["a/v1/svc_idempotency.py"]
    assert '    O: Final = "o.v1"  # noqa: E741\n' in shop, shop
    assert "    async def l(  # noqa: E743\n" in shop
    assert "        l: grpc.aio.Channel,  # noqa: E741\n" in shop
    build = textwrap.dedent(
        """
        import asyncio, grpc
        from a.v1.svc_idempotency import ShopBuySteps

        async def main() -> None:
            async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
                ShopBuySteps(l=channel, _pay=channel)

        asyncio.run(main())
        """
    )
    run_with_generated(tmp_path, tmp_path / "out", build)


SHADOWING_SERVICES = """\
syntax = "proto3";
package a.v1;
import "grpc_idempotency/v1/options.proto";
message Req { string x = 1; }
message Res { string y = 1; }
service SvcPb2 { rpc Charge(Req) returns (Res); }
service List { rpc Charge(Req) returns (Res); }
service Shop {
  rpc Buy(Req) returns (Res) {
    option (grpc_idempotency.v1.method) = {
      steps: { name: "pay.v1" call: "a.v1.SvcPb2/Charge" }
      steps: { name: "list.v1" call: "a.v1.List/Charge" }
    };
  }
}
"""
SHADOWING_SERVICES_USAGE = """
from __future__ import annotations

import grpc

from a.v1 import svc_pb2
from a.v1.svc_idempotency import ShopBuySteps


async def handler(channel: grpc.aio.Channel) -> str:
    steps = ShopBuySteps(svc_pb2_=channel, list=channel)
    paid: svc_pb2.Res = await steps.pay(svc_pb2.Req())
    return paid.y
"""


def test_a_service_parameter_never_shadows_a_name_init_reads(tmp_path: Path) -> None:
    """``__init__``'s body reads the message modules: a called service ``SvcPb2`` was parameter
    ``svc_pb2``, so ``svc_pb2.Req`` there was the channel's attribute (AttributeError on
    construction, mypy: 'Channel has no attribute Req'). It is ``svc_pb2_`` now; a builtin's
    name (``list``) stays, as the body does not use it."""
    files = {"a/v1/svc.proto": SHADOWING_SERVICES}
    shop = generate_checked(tmp_path, files, SHADOWING_SERVICES_USAGE)["a/v1/svc_idempotency.py"]
    assert "        svc_pb2_: grpc.aio.Channel,\n        list: grpc.aio.Channel,\n" in shop, shop
    build = textwrap.dedent(
        """
        import asyncio

        import grpc

        from a.v1.svc_idempotency import ShopBuySteps


        async def main() -> None:
            async with grpc.aio.insecure_channel("localhost:1") as channel:
                ShopBuySteps(svc_pb2_=channel, list=channel)
            print("built")


        asyncio.run(main())
        """
    )
    out = tmp_path / "out"
    ran = run_with_generated(tmp_path, out, build)
    assert ran.stdout.strip() == "built"


KEYWORD_MESSAGES = """\
syntax = "proto3";
package kw.v1;
import "grpc_idempotency/v1/options.proto";
import "kw/v1/ledger.proto";
message Outer { message class { string x = 1; } }
message from { string y = 1; }
service Pay { rpc Charge(Outer.class) returns (from); }
service Shop {
  rpc Buy(from) returns (from) {
    option (grpc_idempotency.v1.method) = {
      steps: { name: "pay.v1" call: "kw.v1.Pay/Charge" }
      steps: { name: "post.v1" call: "kw.v1.Ledger/Post" }
    };
  }
}
"""
KEYWORD_LEDGER = """\
syntax = "proto3";
package kw.v1;
message Entry { string id = 1; }
service Ledger { rpc Post(Entry) returns (Entry); }
"""
KEYWORD_MESSAGES_USAGE = """
from __future__ import annotations

import grpc
from google.protobuf.message import Message

from kw.v1 import ledger_pb2
from kw.v1.shop_idempotency import ShopBuySteps


async def handler(channel: grpc.aio.Channel, request: Message) -> bytes:
    steps = ShopBuySteps(pay=channel, ledger=channel)
    paid: Message = await steps.pay(request)
    posted: ledger_pb2.Entry = await steps.post(ledger_pb2.Entry())
    return paid.SerializeToString() + posted.id.encode()
"""


def test_messages_named_like_keywords_are_read_with_getattr(tmp_path: Path) -> None:
    """``message from`` and ``Outer.class`` are legal proto; the module had
    ``kw_pb2.Outer.class``, a SyntaxError on import. protoc's .pyi of such a file is a
    SyntaxError too (``class from(...)``), which a type checker stops at: the module is
    imported with importlib, as one in a keyword directory, and its messages typed
    ``Message``; other modules' messages stay typed."""
    files = {"kw/v1/shop.proto": KEYWORD_MESSAGES, "kw/v1/ledger.proto": KEYWORD_LEDGER}
    source = generate_checked(tmp_path, files, KEYWORD_MESSAGES_USAGE)["kw/v1/shop_idempotency.py"]
    for expected in (
        'shop_pb2 = importlib.import_module("kw.v1.shop_pb2")',
        'getattr(shop_pb2.Outer, "class"),\n            getattr(shop_pb2, "from"),',
        "from kw.v1 import ledger_pb2\n",
        "ledger_pb2.Entry,\n            ledger_pb2.Entry,",
    ):
        assert expected in source, source


DESCRIPTOR_NAMED = """\
syntax = "proto3";
package dsc.{version};
import "grpc_idempotency/v1/options.proto";
{declaration}
message Res {{ string y = 1; }}
service Pay {{ rpc Charge(Req) returns (Res) {{ option (grpc_idempotency.v1.method) = {{}}; }} }}
"""


def test_a_message_or_enum_value_named_descriptor_does_not_hide_the_services(
    tmp_path: Path,
) -> None:
    """A top-level message, enum, enum value, extension or (py_generic_services) service named
    ``DESCRIPTOR`` (legal proto) is bound in the file's _pb2 module under that name, over the
    module's file descriptor. protoc's own code
    does not read it as one; ``SERVICES`` did (``shop_pb2.DESCRIPTOR.services_by_name``), and
    the generated module failed to import (AttributeError: services_by_name). (protoc's .pyi
    of such a file declares ``DESCRIPTOR`` twice, which mypy reports: generated without.)"""
    message = "message DESCRIPTOR { string x = 1; }\nmessage Req { DESCRIPTOR d = 1; }"
    value = "enum Kind { DESCRIPTOR = 0; }\nmessage Req { Kind kind = 1; }"
    enum = "enum DESCRIPTOR { D0 = 0; }\nmessage Req { DESCRIPTOR d = 1; }"
    extension = (
        'import "google/protobuf/descriptor.proto";\nmessage Req { string x = 1; }\n'
        "extend google.protobuf.MessageOptions { string DESCRIPTOR = 50123; }"
    )
    # py_generic_services binds each service's class in the _pb2 under the service's name.
    service = (
        "option py_generic_services = true;\nmessage Req { string x = 1; }\n"
        "service DESCRIPTOR { rpc Get(Req) returns (Res); }"
    )
    declarations = {"v1": message, "v2": value, "v3": enum, "v4": extension, "v5": service}
    files = {
        f"dsc/{version}/shop.proto": DESCRIPTOR_NAMED.format(version=version, declaration=text)
        for version, text in declarations.items()
    }
    for name, text in files.items():
        (tmp_path / "protos" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "protos" / name).write_text(text)
    out = tmp_path / "out"
    done = protoc(tmp_path / "protos", out, *files, extra=(f"--python_out={out}",))
    assert done.returncode == 0, done.stderr
    generated = sorted(generated_files(out))
    assert generated == [f"dsc/{version}/shop_idempotency.py" for version in declarations]
    check = "import importlib\n" + "".join(
        f"print(*(s.full_name for s in importlib.import_module('dsc.{v}.shop_idempotency')"
        ".SERVICES))\n"
        for v in declarations
    )
    ran = run_with_generated(tmp_path, out, check)
    assert ran.stdout.split() == [f"dsc.{version}.Pay" for version in declarations]
    assert_ruff_clean([out / name for name in generated])
    typed = mypy(out, *generated)
    assert typed.returncode == 0, typed.stdout + typed.stderr


# -- the request's descriptor pool -----------------------------------------------------------


def request_for(*files: str) -> plugin_pb2.CodeGeneratorRequest:
    """What protoc sends, from --descriptor_set_out --include_imports: the same
    FileDescriptorProtos, in dependency order."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{TEST_PROTOS}", f"-I{proto_include()}",
             "--include_imports", f"--descriptor_set_out={out}", *files],
            capture_output=True, check=True,
        )  # fmt: skip
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return plugin_pb2.CodeGeneratorRequest(file_to_generate=files, proto_file=fds.file)


def test_options_parsed_before_the_extension_is_known_are_still_read() -> None:
    # A request parsed in a process that has not imported options_pb2 holds the options as
    # unknown fields; the plugin's own pool must still see them.
    request = request_for(*SHOP).SerializeToString()
    script = textwrap.dedent(
        """
        import sys
        from google.protobuf.compiler import plugin_pb2
        request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
        assert "grpc_idempotency.v1.options_pb2" not in sys.modules
        from grpc_idempotency.protoc_gen import generate
        response = generate(request)
        assert not response.error, response.error
        print(sorted(f.name for f in response.file))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=request, capture_output=True, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == str(
        ["codegen_shop/v1/ledger_idempotency.py", "codegen_shop/v1/shop_idempotency.py"]
    )


def test_generate_in_process_matches_protoc() -> None:
    response = generate(request_for(*SHOP))
    assert not response.error
    assert {f.name: f.content for f in response.file} == generated_files(GOLDEN)
    assert response.supported_features & plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL


def test_options_the_descriptors_hide_are_refused_not_skipped() -> None:
    # If a descriptor's cached options missed the extension (parsed before it was known), the
    # library's compiler would see an unkeyed method; the plugin must fail loudly instead.
    script = textwrap.dedent(
        """
        import sys
        from google.protobuf import descriptor_pool
        from google.protobuf.compiler import plugin_pb2
        request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
        pool = descriptor_pool.DescriptorPool()
        for proto in request.proto_file:
            pool.AddSerializedFile(proto.SerializeToString())
        method = pool.FindMethodByName("codegen_shop.v1.LedgerService.Post")
        method.GetOptions()  # parsed and cached while the extension is unknown
        from grpc_idempotency.protoc_gen.pool import OptionsInvisible, declared_options
        try:
            declared_options(method)
        except OptionsInvisible as err:
            print("refused:", err)
        else:
            print("read")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=request_for(*SHOP).SerializeToString(),
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().startswith("refused: codegen_shop.v1.LedgerService.Post")


def test_declared_options_in_the_request_pool() -> None:
    loaded = load(request_for(*SHOP))
    method = loaded.pool.FindMethodByName("codegen_shop.v1.CheckoutService.Cancel")
    declared = declared_options(method)
    assert declared is not None and list(declared.recorded_error_codes) == [
        "NOT_FOUND",
        "PERMISSION_DENIED",
    ]
    status = loaded.pool.FindMethodByName("codegen_shop.v1.CheckoutService.Status")
    assert declared_options(status) is None
    assert OptionsInvisible.__mro__[1] is RuntimeError


# -- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("proto", "module", "output"),
    [
        ("checkout/v1/orders.proto", "checkout.v1.orders_pb2", "checkout/v1/orders_idempotency.py"),
        ("my-dir/a-b.proto", "my_dir.a_b_pb2", "my_dir/a_b_idempotency.py"),
        ("top.proto", "top_pb2", "top_idempotency.py"),
        # A dot in the base name is a package separator: protoc writes c/v1/x/y_pb2.py.
        ("c/v1/x.y.proto", "c.v1.x.y_pb2", "c/v1/x/y_idempotency.py"),
        ("a.b-c.protodevel", "a.b_c_pb2", "a/b_c_idempotency.py"),
    ],
)
def test_module_names_follow_protocs_python_generator(proto: str, module: str, output: str) -> None:
    assert names.pb2_module(proto) == module
    assert names.output_file(proto) == output


def test_identifiers() -> None:
    assert names.has_keyword("in.v1.pay_pb2") and names.has_keyword("a.class.x_pb2")
    assert not names.has_keyword("inbound.v1.pay_pb2") and not names.has_keyword("match.v1.x_pb2")
    assert names.snake_case("PaymentService") == "payment_service"
    assert names.snake_case("HTTPGateway") == "http_gateway"
    assert names.snake_case("a.v1.Payments") == "a_v1_payments"
    assert names.safe_identifier("import") == "import_"
    assert names.safe_identifier("self") == "self_"
    assert names.safe_identifier("str", {"str"}) == "str_"
    assert names.safe_identifier("str") == "str"
    # Python mangles ``__x`` in a class body, not ``__x__`` nor ``_x``.
    assert names.safe_identifier("__pay") == "_pay" == names.safe_identifier("___pay")
    assert names.safe_identifier("__pay__") == "__pay__"
    # A snapshot, so that the output does not depend on the Python the plugin runs on; a
    # Python with a new builtin fails here: add it (it renames a wrapper named like it).
    from grpc_idempotency.protoc_gen.render import _BUILTINS

    assert {n for n in dir(builtins) if n[:1].islower()} <= _BUILTINS
    assert names.step_base("send-confirmation.v12") == "send_confirmation"
    assert names.step_versioned("charge-card.v2") == "charge_card_v2"
    assert names.module_alias("a.v1.types_pb2") == "a_dot_v1_dot_types__pb2"
