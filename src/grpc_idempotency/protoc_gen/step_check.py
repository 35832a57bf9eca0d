"""``grpc-idempotency check-steps``: read two descriptor sets, compare their declared steps.

The comparison is ``core.step_contract``; this module reads the inputs (``buf build -o x.binpb``
images, or ``protoc --descriptor_set_out=x.binpb --include_imports`` sets, optionally gzipped),
turns the ``(grpc_idempotency.v1.method)`` options into plain data, and renders the report.

The set is loaded into a fresh descriptor pool (so a set that is missing imports is refused
rather than half read, and method paths come from real descriptors), while each method's options
are parsed explicitly against ``options_pb2`` from their raw bytes: the extension must resolve. A
method whose options carry the extension's field number but do not parse as it is an input error,
never a silently "unkeyed" method; that is how a check like this one passes while seeing nothing.
"""

from __future__ import annotations

import functools
import gzip
import sys
import zlib
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import IO, Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, unknown_fields
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError

from grpc_idempotency.core import option_checks
from grpc_idempotency.core.policy import (
    DEFAULT_RETENTION,
    Step,
    duration_of,
    method_path,
    timestamp_of,
)
from grpc_idempotency.core.step_contract import (
    Contract,
    Finding,
    MethodSteps,
    Report,
    check_contract,
)
from grpc_idempotency.v1 import options_pb2

EXIT_OK = 0
EXIT_BROKEN = 1
EXIT_USAGE = 2

_EXTENSION = options_pb2.method
_EXTENSION_NUMBER: int = _EXTENSION.number
_EXTENSION_NAME = "grpc_idempotency.v1.method"


class InputError(Exception):
    """An input that is not a usable descriptor set (exit code 2)."""


def read_descriptor_set(source: str, *, label: str, stdin: IO[bytes] | None = None) -> Any:
    """The descriptor set in file ``source`` (``-``: standard input), options left unparsed.

    Parsed with a ``FileDescriptorSet`` class of a private pool that knows no extensions, so
    options stay unknown fields whatever this process has imported; a malformed option cannot
    fail the whole set, and ``_method_policy`` parses each method's options explicitly.
    """
    where = f"{label} ({'stdin' if source == '-' else source})"
    if source == "-":
        if stdin is None and sys.stdin is None:
            # Run with stdin closed (`<&-`, some process managers): an AttributeError, exit 1.
            raise InputError(f"{where}: standard input is closed; pass {label} as a file")
        stream = stdin if stdin is not None else sys.stdin.buffer
        if stream.isatty():
            raise InputError(
                f"{where}: standard input is a terminal; pass a file, or pipe a descriptor set"
                " (e.g. `buf build -o - | grpc-idempotency check-steps --against old.binpb`)"
            )
        try:
            data = stream.read()
        except OSError as err:
            # Open for writing only (`0>file`: EBADF), or a read error: bad input like a file
            # that cannot be read, not a traceback with exit 1 (read as a broken contract).
            raise InputError(f"{where}: cannot read standard input: {err.strerror or err}") from err
    else:
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as err:
            raise InputError(f"{where}: cannot read: {err.strerror or err}") from err
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            # zlib.error (no OSError): a gzip header over a corrupt deflate stream.
            raise InputError(f"{where}: broken gzip data: {err}") from err
    if not data:
        raise InputError(f"{where}: empty input, not a descriptor set")
    hint = (
        " (it looks like JSON: build a binary image, e.g. `buf build -o x.binpb`)"
        if data.lstrip()[:1] in (b"{", b"[")
        else " (build one with `buf build -o x.binpb`, or protoc"
        " `--descriptor_set_out=x.binpb --include_imports`)"
    )
    try:
        fds = _raw_set_class().FromString(data)
    except DecodeError as err:
        raise InputError(f"{where}: not a binary descriptor set{hint}") from err
    if not fds.file or any(not f.name for f in fds.file):
        raise InputError(f"{where}: not a binary descriptor set{hint}")
    return fds


@functools.cache
def _raw_set_class() -> Any:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(descriptor_pb2.DESCRIPTOR.serialized_pb)
    descriptor = pool.FindMessageTypeByName("google.protobuf.FileDescriptorSet")
    return message_factory.GetMessageClass(descriptor)


def build_pool(fds: Any, *, label: str) -> descriptor_pool.DescriptorPool:
    """A fresh pool holding every file of ``fds``, dependencies first."""
    files: dict[str, Any] = {}
    for f in fds.file:
        known = files.get(f.name)
        if known is not None and known.SerializeToString(deterministic=True) != (
            f.SerializeToString(deterministic=True)
        ):
            raise InputError(f"{label}: the set holds two different files named {f.name!r}")
        files.setdefault(f.name, f)
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(name: str, chain: tuple[str, ...]) -> None:
        if name in added:
            return
        if name in chain:
            raise InputError(f"{label}: import cycle: {' -> '.join((*chain, name))}")
        fdp = files[name]
        for dep in fdp.dependency:
            if dep not in files:
                raise InputError(
                    f"{label}: {name} imports {dep}, which is not in the set; build it with"
                    " imports (protoc --include_imports; buf build includes them unless"
                    " --exclude-imports)"
                )
            add(dep, (*chain, name))
        try:
            pool.AddSerializedFile(fdp.SerializeToString())
        except (TypeError, ValueError, KeyError) as err:
            raise InputError(
                f"{label}: {name} does not load into a descriptor pool: {err}"
            ) from err
        added.add(name)

    for name in files:
        add(name, ())
    return pool


def contract_of(
    fds: Any, *, label: str, refused: dict[str, str] | None = None
) -> dict[str, MethodSteps]:
    """The keyed methods of a descriptor set read by ``read_descriptor_set``. ``refused``: when
    given, a method whose options are refused is left out and its refusal put there (by its
    path), rather than raised (``inspect``: one method's options refused, the server refusing
    that method alone, made every operation uninspectable)."""
    pool = build_pool(fds, label=label)
    _check_extension(pool, label)
    raw_options: dict[str, bytes] = {}
    for f in fds.file:
        for service in f.service:
            for method in service.method:
                prefix = f"{f.package}." if f.package else ""
                full_name = f"{prefix}{service.name}.{method.name}"
                raw_options[full_name] = method.options.SerializeToString()
    contract: dict[str, MethodSteps] = {}
    for f in fds.file:
        for service in pool.FindFileByName(f.name).services_by_name.values():
            for method in service.methods:
                try:
                    steps = _steps_of(method, raw_options.get(method.full_name, b""), label)
                except InputError as err:
                    if refused is None:
                        raise
                    refused[method_path(method)] = str(err)
                    continue
                if steps is not None:
                    contract[method_path(method)] = steps
    return contract


def _steps_of(method: Any, raw_options: bytes, label: str) -> MethodSteps | None:
    """``method``'s steps (``None``: not keyed); ``InputError`` if its options are refused."""
    policy = _method_policy(method, raw_options, label)
    if policy is None:
        return None
    where = f"{label}: {method_path(method)}"
    unknown = option_checks.unknown_fields(policy)
    if unknown:
        # A later release's Step (or MethodPolicy) field, which may bear on the contract:
        # compared without it, the check could pass what that release would call breaking.
        # The server and the generator refuse it too.
        raise InputError(
            f"{where}: (grpc_idempotency.v1.method) sets {unknown} {option_checks.UNKNOWN_WHY}"
        )
    return _method_steps(policy, where)


def _check_extension(pool: descriptor_pool.DescriptorPool, label: str) -> None:
    """The set's own declaration of our field number must be our extension, or nothing."""
    try:
        options = pool.FindMessageTypeByName("google.protobuf.MethodOptions")
        ext = pool.FindExtensionByNumber(options, _EXTENSION_NUMBER)
    except KeyError:
        return
    if ext.full_name != _EXTENSION_NAME:
        raise InputError(
            f"{label}: MethodOptions extension {_EXTENSION_NUMBER} is {ext.full_name}, not"
            f" {_EXTENSION_NAME}: another option claims grpc-idempotency's field number"
        )


def _method_policy(
    method: MethodDescriptor, raw: bytes, label: str
) -> options_pb2.MethodPolicy | None:
    """The method's ``(grpc_idempotency.v1.method)`` option, parsed against ``options_pb2``.

    Not ``method.GetOptions()``: a pool parses options against whatever extensions were known
    when it parsed them (DESIGN pitfall 8), and upb turns a malformed extension into an empty
    message without an error. Here the extension must resolve, or the input is refused.
    """

    def unresolved(problem: str) -> InputError:
        return InputError(
            f"{label}: {method_path(method)} carries option field {_EXTENSION_NUMBER} that does"
            f" not parse as {_EXTENSION_NAME}{problem}"
        )

    try:
        options: Any = descriptor_pb2.MethodOptions.FromString(raw)  # stubs mistype extensions
    except DecodeError as err:
        raise unresolved(f": {err}") from err
    if options.HasExtension(_EXTENSION):
        policy: options_pb2.MethodPolicy = options.Extensions[_EXTENSION]
        return policy
    left = unknown_fields.UnknownFieldSet(options)
    if any(left[i].field_number == _EXTENSION_NUMBER for i in range(len(left))):
        raise unresolved("")
    return None


def _method_steps(policy: options_pb2.MethodPolicy, where: str) -> MethodSteps:
    """The method's retention and steps, read as the server reads them (``duration_of``,
    ``timestamp_of``); a value outside a Duration's or a Timestamp's range, which protoc takes,
    is bad input (it was a traceback: OverflowError, ValueError)."""
    retention = DEFAULT_RETENTION
    if policy.HasField("retention"):
        try:
            retention = duration_of(policy.retention)
        except ValueError as err:
            raise InputError(
                f"{where}: retention {policy.retention.seconds}s is not a valid duration: {err}"
            ) from None
    return MethodSteps(
        retention=retention,
        steps=tuple(
            Step(
                name=s.name,
                call=s.call or None,
                outbox=s.outbox,
                retired_at=_retired_at(s, where) if s.HasField("retired_at") else None,
            )
            for s in policy.steps
        ),
    )


def _retired_at(step: options_pb2.Step, where: str) -> datetime:
    try:
        return timestamp_of(step.retired_at)
    except ValueError as err:
        raise InputError(
            f"{where}: step {step.name}: retired_at {step.retired_at.seconds}s is not a valid"
            f" timestamp: {err}"
        ) from None


def load_contract(source: str, *, label: str, stdin: IO[bytes] | None = None) -> Contract:
    return contract_of(read_descriptor_set(source, label=label, stdin=stdin), label=label)


def render(report: Report, *, old: str, new: str, now: datetime) -> str:
    """The report as text: a headline, then each method's findings (breaking ones explained)."""
    broken = report.breaking
    lines = [
        f"check-steps: {old} -> {new}, now {_ts(now)}, {report.methods_checked} keyed method(s)",
    ]
    for method in _in_order(f.method for f in report.findings):
        lines.append("")
        lines.append(method)
        for f in report.findings:
            if f.method == method:
                lines.extend(_finding_lines(f))
    lines.append("")
    if broken:
        methods = len({f.method for f in broken})
        lines.append(
            f"FAILED: {len(broken)} change(s) in {methods} method(s) would make in-flight"
            " operations execute a downstream effect again."
        )
    else:
        lines.append("OK: no change to the declared steps re-executes in-flight work.")
    return "\n".join(lines) + "\n"


def _finding_lines(f: Finding) -> list[str]:
    lines = [f"  {'FAIL' if f.breaking else 'ok  '} {f.change.value}: {f.what}"]
    if f.why:
        lines.append(f"       why: {f.why}")
    if f.fix:
        lines.append(f"       fix: {f.fix}")
    return lines


def _in_order(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _ts(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run(
    against: str,
    new: str = "-",
    *,
    now: datetime | None = None,
    stdin: IO[bytes] | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """The command: 0 when the contract holds, 1 when it is broken, 2 on bad input."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    when = now if now is not None else datetime.now(UTC)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        if against == "-" and new == "-":
            raise InputError("OLD and NEW cannot both be read from standard input")
        old_contract = load_contract(against, label="OLD", stdin=stdin)
        new_contract = load_contract(new, label="NEW", stdin=stdin)
    except InputError as e:
        print(f"grpc-idempotency check-steps: {e}", file=err)
        return EXIT_USAGE
    report = check_contract(old_contract, new_contract, now=when)
    old_name = "stdin" if against == "-" else against
    new_name = "stdin" if new == "-" else new
    out.write(render(report, old=old_name, new=new_name, now=when))
    return EXIT_OK if report.ok else EXIT_BROKEN
