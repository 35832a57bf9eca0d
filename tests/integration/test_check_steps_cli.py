"""``grpc-idempotency check-steps`` on real descriptor sets built by protoc (and buf, when present).

Each test writes an old and a new version of a small annotated .proto to tmp_path, builds both with
``python -m grpc_tools.protoc --descriptor_set_out ... --include_imports``, and runs the CLI as a
subprocess. Input errors are checked in-process (same ``main``), which is faster.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypedDict, Unpack

import pytest

from grpc_idempotency.cli import main
from grpc_idempotency.protoc_gen.step_check import _raw_set_class, run
from tests.support.tools import buf_binary

ROOT = Path(__file__).resolve().parents[2]
NOW = "2026-06-01T12:00:00Z"
NOW_S = int(datetime(2026, 6, 1, 12, tzinfo=UTC).timestamp())
HOUR = 3600
DAY = 86400
PLACE = "/shop.v1.Orders/Place"
CHARGE = 'call: "pay.v1.Payments/Charge"'

Build = Callable[..., Path]


def cli() -> list[str]:
    script = Path(sys.executable).with_name("grpc-idempotency")
    return [str(script)] if script.exists() else [sys.executable, "-m", "grpc_idempotency.cli"]


@pytest.fixture(scope="module")
def include_path() -> str:
    done = subprocess.run([*cli(), "include-path"], check=True, capture_output=True, text=True)
    return done.stdout.strip()


def orders_proto(*steps: str, retention: int = DAY, cancel: str | None = None) -> str:
    """shop/v1/orders.proto: Orders.Place with ``steps``, and Orders.Cancel when ``cancel``."""
    body = "\n".join(f"      steps: {{ {s} }}" for s in steps)
    cancel_rpc = (
        f"""
  rpc Cancel(CancelRequest) returns (CancelResponse) {{
    option (grpc_idempotency.v1.method) = {{
      steps: {{ {cancel} }}
    }};
  }}"""
        if cancel
        else ""
    )
    return f"""syntax = "proto3";
package shop.v1;
import "grpc_idempotency/v1/options.proto";
service Orders {{
  rpc Place(PlaceRequest) returns (PlaceResponse) {{
    option (grpc_idempotency.v1.method) = {{
      retention: {{ seconds: {retention} }}
{body}
    }};
  }}{cancel_rpc}
  rpc Get(PlaceRequest) returns (PlaceResponse);
}}
message PlaceRequest {{ string cart_id = 1; }}
message PlaceResponse {{ string order_id = 1; }}
message CancelRequest {{ string order_id = 1; }}
message CancelResponse {{}}
"""


def retired(seconds_ago: int) -> str:
    return f"retired_at: {{ seconds: {NOW_S - seconds_ago} }}"


@pytest.fixture
def build(tmp_path: Path, include_path: str) -> Build:
    def build(name: str, source: str, *, include_imports: bool = True) -> Path:
        src = tmp_path / name
        (src / "shop" / "v1").mkdir(parents=True)
        (src / "shop" / "v1" / "orders.proto").write_text(source)
        out = tmp_path / f"{name}.binpb"
        subprocess.run(
            [
                sys.executable, "-m", "grpc_tools.protoc", f"-I{src}", f"-I{include_path}",
                f"--descriptor_set_out={out}", *(["--include_imports"] if include_imports else []),
                "shop/v1/orders.proto",
            ],
            check=True,
            capture_output=True,
        )  # fmt: skip
        return out

    return build


def check(
    old: Path, new: Path | None, *, now: str | None = NOW, stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    args = [*cli(), "check-steps", "--against", str(old)]
    args += [str(new)] if new is not None else []
    args += ["--now", now] if now is not None else []
    done = subprocess.run(
        args, input=stdin, capture_output=True, env={**os.environ, "PYTHONIOENCODING": "utf-8"}
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


class _CheckOptions(TypedDict, total=False):
    now: str | None
    stdin: bytes | None


def compare(
    build: Build, old: str, new: str, **kw: Unpack[_CheckOptions]
) -> subprocess.CompletedProcess[str]:
    return check(build("old", old), build("new", new), **kw)


# The acceptance cases.


def test_rename_fails(build: Build) -> None:
    done = compare(
        build,
        orders_proto(f'name: "charge-card.v1" {CHARGE}'),
        orders_proto(f'name: "take-payment.v1" {CHARGE}'),
    )
    assert done.returncode == 1, done
    out = done.stdout
    assert PLACE in out
    assert (
        "FAIL step renamed: step charge-card.v1 (calls pay.v1.Payments/Charge) was renamed to take-payment.v1"
        in out
    )
    assert "a step's name is its identity" in out and "take-payment.v1's child key" in out
    assert (
        "fix: keep the old name and bump its version instead:"
        f' steps: {{ name: "charge-card.v1" {CHARGE} retired_at: {{ seconds: {NOW_S + 86400} }} }}'
        f' steps: {{ name: "charge-card.v2" {CHARGE} }}, in place of take-payment.v1'
    ) in out
    assert "FAILED: 1 change(s) in 1 method(s)" in out
    assert done.stderr == ""


@pytest.mark.parametrize("change", ["rename", "version bump"])
def test_the_printed_fix_still_passes_when_the_check_runs_again_later(
    build: Build, change: str
) -> None:
    """The fix put retired_at at "now": pasted in and checked again a moment later (the next CI
    run of the pull request), the retirement was already past and failed as backdated over
    operations begun, with a new fix at the new "now", for ever. It lies a day ahead now."""
    old = orders_proto(f'name: "charge-card.v1" {CHARGE}')
    successor = "take-payment.v1" if change == "rename" else "charge-card.v2"
    done = compare(build, old, orders_proto(f'name: "{successor}" {CHARGE}'))
    assert done.returncode == 1, done
    (fix,) = [line for line in done.stdout.splitlines() if line.strip().startswith("fix: ")]
    declarations = re.findall(r"steps: \{ (.*?) \}(?= steps:|;|,|$)", fix)
    assert declarations and all(d.startswith('name: "charge-card.') for d in declarations), fix
    if change == "version bump":  # the fix is the old step, retired; the new one stays
        declarations.append(f'name: "charge-card.v2" {CHARGE}')
    later = datetime.fromtimestamp(NOW_S + 6 * HOUR, UTC).isoformat()
    fixed = check(build("old-again", old), build("fixed", orders_proto(*declarations)), now=later)
    assert fixed.returncode == 0, fixed


def test_rename_with_the_old_name_retired_fails_and_its_fix_passes(build: Build) -> None:
    """Keeping the old name retired does not make a rename safe (no rename is followed); the
    printed fix, a new version of the old name, does."""
    old = orders_proto(f'name: "charge-card.v1" {CHARGE}')
    done = compare(
        build,
        old,
        orders_proto(
            f'name: "charge-card.v1" {CHARGE} {retired(0)}', f'name: "take-payment.v1" {CHARGE}'
        ),
    )
    assert done.returncode == 1, done
    assert (
        "FAIL step renamed: step charge-card.v1 (calls pay.v1.Payments/Charge) was renamed to"
        " take-payment.v1 (calls pay.v1.Payments/Charge), the old name kept, retired at"
        " 2026-06-01T12:00:00Z"
    ) in done.stdout
    (fix,) = [line for line in done.stdout.splitlines() if line.strip().startswith("fix: ")]
    declarations = re.findall(r"steps: \{ (.*?) \}(?= steps:|,)", fix)
    assert declarations == [
        f'name: "charge-card.v1" {CHARGE} {retired(0)}',
        f'name: "charge-card.v2" {CHARGE}',
    ]
    fixed = check(build("old-again", old), build("fixed", orders_proto(*declarations)))
    assert fixed.returncode == 0, fixed


def test_removal_fails(build: Build) -> None:
    done = compare(
        build,
        orders_proto(f'name: "charge-card.v1" {CHARGE}', 'name: "order-placed.v1" outbox: true'),
        orders_proto(f'name: "charge-card.v1" {CHARGE}'),
    )
    assert done.returncode == 1, done
    assert (
        "FAIL step removed: step order-placed.v1 (enqueues in the outbox) was removed"
        in done.stdout
    )


def test_version_bump_without_retirement_fails(build: Build) -> None:
    done = compare(
        build,
        orders_proto(f'name: "charge-card.v1" {CHARGE}'),
        orders_proto(f'name: "charge-card.v2" {CHARGE}'),
    )
    assert done.returncode == 1, done
    assert "FAIL step version changed: step charge-card.v1" in done.stdout
    assert "changed version to charge-card.v2" in done.stdout


def test_added_step_passes(build: Build) -> None:
    done = compare(
        build,
        orders_proto(f'name: "charge-card.v1" {CHARGE}'),
        orders_proto(f'name: "charge-card.v1" {CHARGE}', 'name: "order-placed.v1" outbox: true'),
    )
    assert done.returncode == 0, done
    assert "ok   step added: step order-placed.v1 (enqueues in the outbox) added" in done.stdout
    assert "OK: no change to the declared steps re-executes in-flight work." in done.stdout


def test_properly_retired_step_passes(build: Build) -> None:
    done = compare(
        build,
        orders_proto(f'name: "charge-card.v1" {CHARGE}'),
        orders_proto(
            f'name: "charge-card.v1" {CHARGE} {retired(0)}', f'name: "charge-card.v2" {CHARGE}'
        ),
    )
    assert done.returncode == 0, done
    assert (
        "ok   step retired: step charge-card.v1 retired at 2026-06-01T12:00:00Z; it can be removed from 2026-06-02T12:00:00Z"
        in done.stdout
    )
    assert "ok   step added: step charge-card.v2" in done.stdout


def test_retired_step_removed_too_early_fails(build: Build) -> None:
    done = compare(
        build,
        orders_proto(
            f'name: "charge-card.v1" {CHARGE} {retired(20 * HOUR)}',
            f'name: "charge-card.v2" {CHARGE}',
        ),
        orders_proto(f'name: "charge-card.v2" {CHARGE}'),
    )
    assert done.returncode == 1, done
    assert (
        "FAIL retired step removed too early: retired step charge-card.v1 removed too early"
        in done.stdout
    )
    assert "must stay declared until 2026-06-01T16:00:00Z (4h from now)" in done.stdout


def test_retired_step_removed_after_retention_passes(build: Build) -> None:
    done = compare(
        build,
        orders_proto(
            f'name: "charge-card.v1" {CHARGE} {retired(DAY)}', f'name: "charge-card.v2" {CHARGE}'
        ),
        orders_proto(f'name: "charge-card.v2" {CHARGE}'),
    )
    assert done.returncode == 0, done
    assert "ok   retired step removed: retired step charge-card.v1 removed" in done.stdout


def test_the_method_retention_decides_when_a_retired_step_may_go(build: Build) -> None:
    old = orders_proto(f'name: "charge-card.v1" {CHARGE} {retired(2 * HOUR)}', retention=HOUR)
    assert compare(build, old, orders_proto(retention=HOUR)).returncode == 0
    old = orders_proto(f'name: "charge-card.v1" {CHARGE} {retired(2 * HOUR)}', retention=3 * HOUR)
    assert (
        check(
            build("old2", old), build("new2", orders_proto(retention=3 * HOUR)), now=NOW
        ).returncode
        == 1
    )


def test_call_target_changed_fails(build: Build) -> None:
    done = compare(
        build,
        orders_proto(f'name: "charge-card.v1" {CHARGE}'),
        orders_proto('name: "charge-card.v1" call: "pay.v2.Payments/Charge"'),
    )
    assert done.returncode == 1, done
    assert (
        "FAIL step target changed: step charge-card.v1 changed target under the same name: it calls pay.v1.Payments/Charge, now it calls pay.v2.Payments/Charge"
        in done.stdout
    )


def test_keyed_method_removed_with_steps_fails(build: Build) -> None:
    done = compare(
        build,
        orders_proto(cancel='name: "refund.v1" call: "pay.v1.Payments/Refund"'),
        orders_proto(),
    )
    assert done.returncode == 1, done
    assert "/shop.v1.Orders/Cancel" in done.stdout
    assert (
        "FAIL keyed method removed: keyed method removed, or it lost its (grpc_idempotency.v1.method) option, while it still declared steps ['refund.v1']"
        in done.stdout
    )


def test_everything_at_once_is_reported_together(build: Build) -> None:
    done = compare(
        build,
        orders_proto(
            f'name: "charge-card.v1" {CHARGE}',
            'name: "email.v1" call: "mail.v1.Mailer/Send"',
            'name: "order-placed.v1" outbox: true',
            cancel='name: "refund.v1" call: "pay.v1.Payments/Refund"',
        ),
        orders_proto(f'name: "charge-card.v2" {CHARGE}', 'name: "email.v1" outbox: true'),
    )
    assert done.returncode == 1, done
    assert done.stdout.count("  FAIL ") == 4
    assert "FAILED: 4 change(s) in 2 method(s)" in done.stdout


# How NEW and the time are given.


def test_new_defaults_to_stdin(build: Build) -> None:
    old = build("old", orders_proto(f'name: "charge-card.v1" {CHARGE}'))
    new = build("new", orders_proto(f'name: "charge-card.v2" {CHARGE}'))
    done = check(old, None, stdin=new.read_bytes())
    assert done.returncode == 1, done
    assert f"check-steps: {old} -> stdin" in done.stdout
    assert check(old, None, stdin=old.read_bytes()).returncode == 0


def test_now_defaults_to_the_current_time(build: Build) -> None:
    # Retired in 2020 with a day's retention: removable today, whatever today is.
    step = f'name: "charge-card.v1" {CHARGE} retired_at: {{ seconds: 1577836800 }}'
    done = compare(build, orders_proto(step), orders_proto(), now=None)
    assert done.returncode == 0, done
    # ... and not removable when the check runs in 2019.
    done = check(
        build("o2", orders_proto(step)), build("n2", orders_proto()), now="2019-12-31T00:00:00"
    )
    assert done.returncode == 1, done


def test_gzipped_sets_are_read(build: Build, tmp_path: Path) -> None:
    old = build("old", orders_proto(f'name: "charge-card.v1" {CHARGE}'))
    new = build("new", orders_proto(f'name: "charge-card.v2" {CHARGE}'))
    packed = tmp_path / "new.binpb.gz"
    packed.write_bytes(gzip.compress(new.read_bytes()))
    assert check(old, packed).returncode == 1


def test_the_checkout_example_holds_against_itself(tmp_path: Path, include_path: str) -> None:
    protos = ROOT / "examples" / "checkout" / "protos"
    out = tmp_path / "checkout.binpb"
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{protos}", f"-I{include_path}",
            f"--descriptor_set_out={out}", "--include_imports",
            *[str(p.relative_to(protos)) for p in protos.rglob("*.proto")],
        ],
        check=True,
    )  # fmt: skip
    done = check(out, out)
    assert done.returncode == 0, done
    assert "3 keyed method(s)" in done.stdout


@pytest.mark.skipif(
    buf_binary() is None, reason="buf is not installed (CI installs it into .ci/.buf)"
)
def test_buf_images(tmp_path: Path, include_path: str) -> None:
    """`buf build -o x.binpb` images (FileDescriptorSet-compatible) and `buf build -o -` piped."""
    buf = buf_binary()
    assert buf is not None

    def module(name: str, source: str) -> Path:
        root = tmp_path / name
        (root / "proto" / "shop" / "v1").mkdir(parents=True)
        (root / "proto" / "shop" / "v1" / "orders.proto").write_text(source)
        shutil.copytree(include_path, root / "vendor")  # options.proto, vendored as a module
        (root / "buf.yaml").write_text("version: v2\nmodules:\n  - path: proto\n  - path: vendor\n")
        return root

    old = module("old", orders_proto(f'name: "charge-card.v1" {CHARGE}'))
    new = module("new", orders_proto(f'name: "take-payment.v1" {CHARGE}'))
    subprocess.run([buf, "build", "-o", "old.binpb"], cwd=old, check=True)
    checker = shlex.join([*cli(), "check-steps", "--against", str(old / "old.binpb"), "--now", NOW])
    done = subprocess.run(
        f"{shlex.quote(buf)} build -o - | {checker}",
        shell=True,
        cwd=new,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done
    assert "FAIL step renamed" in done.stdout
    subprocess.run([buf, "build", "-o", "new.binpb"], cwd=old, check=True)
    assert check(old / "old.binpb", old / "new.binpb").returncode == 0


# Input errors: exit 2, a message on stderr, no report.


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_unreadable_file(build: Build, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = build("good", orders_proto())
    code, out, err = run_main(
        ["check-steps", "--against", str(tmp_path / "missing.binpb"), str(good)], capsys
    )
    assert (code, out) == (2, "")
    assert "OLD (" in err and "cannot read: No such file or directory" in err
    code, _, err = run_main(["check-steps", "--against", str(good), str(tmp_path)], capsys)
    assert code == 2 and "NEW (" in err and "cannot read" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty input, not a descriptor set"),
        (b'syntax = "proto3";\npackage shop.v1;\n', "not a binary descriptor set"),
        (b'{"file": []}', "it looks like JSON"),
        (b"\x08\x96\x01", "not a binary descriptor set"),  # a valid message, but no files
        (b"\x1f\x8bnot gzip", "broken gzip data"),
        # A gzip header, then no deflate stream: zlib.error, a traceback with exit 1 ("broken").
        (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"\xff" * 20, "broken gzip data"),
        (gzip.compress(b"\x08\x96\x01")[:-8], "broken gzip data"),  # EOFError: no trailer
    ],
    ids=["empty", "proto source", "json", "other message", "bad gzip", "bad deflate", "cut gzip"],
)
def test_not_a_descriptor_set(
    content: bytes, message: str, build: Build, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = build("good", orders_proto())
    bad = tmp_path / "bad.binpb"
    bad.write_bytes(content)
    code, out, err = run_main(["check-steps", "--against", str(good), str(bad)], capsys)
    assert (code, out) == (2, ""), err
    assert message in err


def test_a_set_without_its_imports_is_refused(
    build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    good = build("good", orders_proto())
    partial = build("partial", orders_proto(), include_imports=False)
    code, _, err = run_main(["check-steps", "--against", str(good), str(partial)], capsys)
    assert code == 2
    assert (
        "shop/v1/orders.proto imports grpc_idempotency/v1/options.proto, which is not in the set"
        in err
    )
    assert "--include_imports" in err


@pytest.mark.parametrize(
    "option",
    [bytes([0x90, 0xA8, 0x19, 0x01]), bytes([0x92, 0xA8, 0x19, 0x01, 0x78])],
    ids=["wrong wire type", "corrupt message"],
)
def test_options_that_do_not_resolve_are_refused(
    option: bytes, build: Build, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Our field number that does not parse as our option: an error, not an "unkeyed" method.

    (upb's own ``GetOptions()`` turns the corrupt one into an empty policy without a word.)
    """
    good = build("good", orders_proto(f'name: "charge-card.v1" {CHARGE}'))
    # Edited through a class that knows no extensions, so the bytes go in as they are.
    fds = _raw_set_class().FromString(good.read_bytes())
    (orders,) = [f for f in fds.file if f.name == "shop/v1/orders.proto"]
    get = orders.service[0].method[1]
    assert get.name == "Get"
    get.options.MergeFromString(option)  # field 51842: a varint / a truncated message
    broken = tmp_path / "broken.binpb"
    broken.write_bytes(fds.SerializeToString())
    code, _, err = run_main(["check-steps", "--against", str(good), str(broken)], capsys)
    assert code == 2, err
    assert (
        "/shop.v1.Orders/Get carries option field 51842 that does not parse as"
        " grpc_idempotency.v1.method" in err
    )


def test_a_foreign_extension_on_our_number_is_refused(
    tmp_path: Path, include_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "other.proto").write_text(
        'syntax = "proto3";\npackage other.v1;\nimport "google/protobuf/descriptor.proto";\n'
        "extend google.protobuf.MethodOptions { string method = 51842; }\n"
        'service S { rpc Do(R) returns (R) { option (other.v1.method) = "x"; } }\nmessage R {}\n'
    )
    out = tmp_path / "other.binpb"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"--descriptor_set_out={out}", "--include_imports", "other.proto"],
        check=True,
    )  # fmt: skip
    code, _, err = run_main(["check-steps", "--against", str(out), str(out)], capsys)
    assert code == 2
    assert "MethodOptions extension 51842 is other.v1.method, not grpc_idempotency.v1.method" in err


def test_usage_errors(build: Build, capsys: pytest.CaptureFixture[str]) -> None:
    good = str(build("good", orders_proto()))
    assert run_main(["check-steps", good], capsys)[0] == 2  # --against is required
    code, _, err = run_main(["check-steps", "--against", good, good, "--now", "yesterday"], capsys)
    assert code == 2 and "not an ISO 8601 time" in err
    code, _, err = run_main(["check-steps", "--against", "-", "-"], capsys)
    assert code == 2 and "cannot both be read from standard input" in err


class _Terminal(io.BytesIO):
    def isatty(self) -> bool:
        return True


def test_stdin_from_a_terminal_is_refused(build: Build) -> None:
    good = str(build("good", orders_proto()))
    err = io.StringIO()
    assert run(good, "-", stdin=_Terminal(), err=err) == 2
    assert "NEW (stdin): standard input is a terminal" in err.getvalue()


def test_stdin_closed_is_bad_input(build: Build, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run with stdin closed (``<&-``, some process managers: ``sys.stdin`` is None), NEW read
    from stdin died with a traceback (AttributeError) and exit 1, which a build reads as a
    broken contract."""
    good = str(build("good", orders_proto()))
    monkeypatch.setattr(sys, "stdin", None)
    err = io.StringIO()
    assert run(good, "-", err=err) == 2
    assert "NEW (stdin): standard input is closed" in err.getvalue(), err.getvalue()
    # A stream given to run() is read, whatever became of the process's own stdin.
    assert (
        run(good, "-", stdin=io.BytesIO(Path(good).read_bytes()), err=err, out=io.StringIO()) == 0
    )


def test_unreadable_stdin_is_bad_input(build: Build, tmp_path: Path) -> None:
    """Stdin open for writing only (``0>file``): reading it fails (EBADF), which died with a
    traceback (OSError) and exit 1, which a build reads as a broken contract."""
    good = str(build("good", orders_proto()))
    err = io.StringIO()
    with open(os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT), "rb") as write_only:
        assert run("-", good, stdin=write_only, err=err) == 2
    assert "OLD (stdin): cannot read standard input: Bad file descriptor" in err.getvalue()


def test_a_retired_at_past_what_a_timestamp_allows_is_bad_input(build: Build) -> None:
    """Year 10000: protoc takes it (seconds are an int64), and check-steps died with a
    traceback ("Timestamp is not valid")."""
    step = 'name: "charge-card.v1" call: "pay.v1.Payments/Charge"'
    too_late = "retired_at: { seconds: 253402300800 }"
    done = compare(build, orders_proto(step), orders_proto(f"{step} {too_late}"))
    assert done.returncode == 2, done.stderr
    assert "not a valid timestamp" in done.stderr and "Traceback" not in done.stderr


def test_a_retention_past_what_a_duration_allows_is_bad_input(build: Build) -> None:
    """protoc takes any int64 in a Duration's seconds; past timedelta's range, check-steps died
    with a traceback (OverflowError, exit 1, which reads as "the contract is broken")."""
    step = 'name: "charge-card.v1" call: "pay.v1.Payments/Charge"'
    good = orders_proto(step)
    huge = orders_proto(step, retention=9_000_000_000_000_000)
    done = compare(build, good, huge)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert (
        "NEW: /shop.v1.Orders/Place: retention 9000000000000000s is not a valid duration:"
        " seconds must be within"
    ) in done.stderr


def test_a_step_field_this_release_does_not_know_is_refused(
    build: Build, tmp_path: Path, include_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A set compiled against a later release's options.proto, whose Step has a field more: the
    comparison was made without it (it may bear on the contract), where the server and the
    generator refuse the same proto. An input error, as they say it."""
    good = build("good", orders_proto(f'name: "charge.v1" {CHARGE}'))
    options = (ROOT / "protos" / "grpc_idempotency" / "v1" / "options.proto").read_text()
    retired_at = "  google.protobuf.Timestamp retired_at = 4;\n"
    assert retired_at in options
    newer = tmp_path / "newer"
    (newer / "grpc_idempotency" / "v1").mkdir(parents=True)
    (newer / "grpc_idempotency" / "v1" / "options.proto").write_text(
        options.replace(retired_at, retired_at + "  string note = 5;\n")
    )
    (newer / "shop" / "v1").mkdir(parents=True)
    (newer / "shop" / "v1" / "orders.proto").write_text(
        orders_proto(f'name: "charge.v1" {CHARGE} note: "later"')
    )
    out = tmp_path / "newer.binpb"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{newer}", f"-I{include_path}",
         f"--descriptor_set_out={out}", "--include_imports", "shop/v1/orders.proto"],
        check=True, capture_output=True,
    )  # fmt: skip
    for old, new, label in ((good, out, "NEW"), (out, good, "OLD")):
        code, stdout, err = run_main(
            ["check-steps", "--against", str(old), str(new), "--now", NOW], capsys
        )
        assert (code, stdout) == (2, ""), err
        assert f"{PLACE}: (grpc_idempotency.v1.method) sets steps[0] field 5" in err
        assert label in err and "does not know" in err
