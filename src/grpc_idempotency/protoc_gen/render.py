"""Renders a file's ``<name>_idempotency.py`` from its checked keyed methods (none: a module with
the same names, empty, that imports nothing of the file's).

The output is deterministic, typed for ``mypy --strict``, and in the shape ``ruff format`` (and
black) give it at 88 columns, lint clean (E501 too), for names of every valid length (a step's
up to ``MAX_STEP_NAME_LENGTH``): every bracket that may grow is exploded with a trailing comma,
a line a long name pushes past 88 columns takes the shape a formatter gives it (checked by
running ``ruff format`` over names at each boundary), and one that no shape fits (a long
identifier, which cannot be split) carries a ``# noqa: E501``, which formatters leave out of a
line's length. So a formatter run over generated code changes nothing.
"""

from __future__ import annotations

import json
import keyword
from collections.abc import Callable, Collection, Iterable, Sequence
from functools import partial

from google.protobuf.descriptor import (
    Descriptor,
    EnumDescriptor,
    FileDescriptor,
    ServiceDescriptor,
)
from google.protobuf.duration_pb2 import Duration

from grpc_idempotency.core.policy import duration_of, timestamp_of
from grpc_idempotency.core.retry import service_config
from grpc_idempotency.protoc_gen import names
from grpc_idempotency.protoc_gen.validate import KeyedFile, KeyedMethod
from grpc_idempotency.v1 import options_pb2

INDENT = "    "

_KEY = {options_pb2.KEY_REQUIRED: "REQUIRED", options_pb2.KEY_OPTIONAL: "OPTIONAL"}
_MODE = {options_pb2.MODE_ATOMIC: "ATOMIC", options_pb2.MODE_PHASED: "PHASED"}
_STORE_DOWN = {
    options_pb2.STORE_DOWN_FAIL_CLOSED: "FAIL_CLOSED",
    options_pb2.STORE_DOWN_FAIL_OPEN: "FAIL_OPEN",
}
_ISOLATION = {
    options_pb2.ISOLATION_READ_COMMITTED: "READ_COMMITTED",
    options_pb2.ISOLATION_REPEATABLE_READ: "REPEATABLE_READ",
    options_pb2.ISOLATION_SERIALIZABLE: "SERIALIZABLE",
}

# Every name the generated module binds at its top level (``_imports``, ``render``), and every
# lowercase builtin (as of Python 3.11; a snapshot, so that the output does not depend on the
# Python the plugin runs on). A step's wrapper is a method of its class, and a method's
# annotations are resolved in the class's scope: a wrapper ``float`` or ``svc_pb2`` made
# ``timeout: float`` or ``request: svc_pb2.Req`` name the wrapper (mypy: "not valid as a type",
# "not defined"). Such a wrapper gets a trailing underscore, as a keyword does.
_MODULE_NAMES = frozenset(
    {
        "importlib", "json", "Mapping", "Sequence", "datetime", "timedelta", "Final", "TypeVar",
        "grpc", "descriptor_pool", "ServiceDescriptor", "Message", "Code", "Isolation",
        "KeyRequirement",
        "MethodOverride", "Mode", "Step", "StoreDown", "step_metadata", "SERVICES", "POLICIES",
        "SERVICE_CONFIG", "CHANNEL_OPTIONS", "_Request", "_Response", "_unary",
    }
)  # fmt: skip
_BUILTINS = frozenset(
    {
        "abs", "aiter", "all", "anext", "any", "ascii", "bin", "bool", "breakpoint", "bytearray",
        "bytes", "callable", "chr", "classmethod", "compile", "complex", "copyright", "credits",
        "delattr", "dict", "dir", "divmod", "enumerate", "eval", "exec", "exit", "filter",
        "float", "format", "frozenset", "getattr", "globals", "hasattr", "hash", "help", "hex",
        "id", "input", "int", "isinstance", "issubclass", "iter", "len", "license", "list",
        "locals", "map", "max", "memoryview", "min", "next", "object", "oct", "open", "ord",
        "pow", "print", "property", "quit", "range", "repr", "reversed", "round", "set",
        "setattr", "slice", "sorted", "staticmethod", "str", "sum", "super", "tuple", "type",
        "vars", "zip",
    }
)  # fmt: skip


class RenderError(Exception):
    """The file's module cannot be generated (the message names the file, and why)."""


class NameClash(RenderError):
    """Two generated names would be the same."""


def render(file: KeyedFile) -> str:
    return _Renderer(file).render()


class _Renderer:
    def __init__(self, file: KeyedFile) -> None:
        self.file = file
        self.source = file.descriptor.name
        # The file's own module only when something reads it (``SERVICES``).
        files = {names.pb2_module(self.source): file.descriptor} if file.methods else {}
        for method in file.methods:
            for call in method.calls:
                for message in (call.target.input_type, call.target.output_type):
                    files[names.pb2_module(message.file.name)] = message.file
        # ``auth/2fa.proto``: grpcio-tools' own code for it (its _pb2_grpc.py, and the _pb2 of
        # every file importing it) is ``from auth import 2fa_pb2``, a SyntaxError, so its
        # services can be neither served nor called with protoc's code. The module could be
        # imported with importlib, as for a keyword part, but only to serve a file that protoc's
        # own output cannot: refused, with the reason, rather than generated.
        unnamable = [
            f"{self.source}: module {module} (of {proto.name}) has a part, {part!r}, that is not"
            " a Python identifier: protoc's python_out (in every file importing it) and"
            f" grpc_python_out import it as `{_import_statement(module)}`, a SyntaxError;"
            f" rename {proto.name} (or its directory) so that every part of its path is one"
            for module, proto in sorted(files.items())
            if (part := names.non_identifier(module)) is not None
        ]
        if unnamable:
            raise RenderError("\n".join(unnamable))
        self.modules = _local_names(set(files))
        self.reserved = _MODULE_NAMES | _BUILTINS | set(self.modules.values())
        # A service's parameter of ``__init__`` is in scope in its body, which reads the
        # modules, ``_unary`` and ``getattr`` (``_type``): parameter ``svc_pb2`` (service
        # ``SvcPb2``) made ``svc_pb2.Req`` the channel's attribute. Other builtins are free.
        self.parameters_reserved = _MODULE_NAMES | {"getattr"} | set(self.modules.values())
        # Modules imported with importlib and typed ``Message`` (``_imports``, ``_annotation``).
        self.dynamic = sorted(
            module
            for module, proto in files.items()
            if names.has_keyword(module) or _stub_has_keyword(proto)
        )
        self.classes = {m.path: f"{m.service.name}{m.descriptor.name}Steps" for m in file.methods}
        self.step_classes = [m for m in file.methods if _active_steps(m)]
        problems: list[str] = []
        clashes = _duplicates(self.classes[m.path] for m in self.step_classes)
        if clashes:
            problems.append(f"{self.source}: generated class names collide: {clashes}")
        for method in self.step_classes:
            problems += [
                f"{method.where}: {method.path}: {clash}"
                for clash in _step_clashes(
                    _active_steps(method), self.classes[method.path], self.reserved
                )
            ]
            try:
                _service_parameters(
                    (c.target.containing_service for c in method.calls),
                    self.parameters_reserved,
                )
            except NameClash as clash:
                problems.append(f"{method.where}: {method.path}: {clash}")
        if problems:
            raise NameClash("\n".join(problems))
        self.needs: set[str] = set()
        # Modules an expression of the body reads (``_services``, ``_type``): one imported and
        # read by none is imported for its descriptors alone (``_imports``).
        self.read: set[str] = set()

    # -- the file ---------------------------------------------------------------------------

    def render(self) -> str:
        body = [
            *self._services(),
            "",
            *self._policies(),
            "",
            *self._service_config(),
        ]
        if any(m.calls for m in self.file.methods):
            body += ["", "", *self._unary_helper()]
        for method in self.step_classes:
            body += ["", "", *self._steps_class(method)]
        lines = [
            "# Generated by protoc-gen-grpc-idempotency. DO NOT EDIT.",
            f"# source: {self.source}",
            "# isort: skip_file",
            *self._docstring(),
            "",
            "from __future__ import annotations",
            "",
            *self._imports(),
            "",
            *self._all(),
            "",
            *body,
        ]
        return "\n".join(lines) + "\n"

    def _docstring(self) -> list[str]:
        if not self.file.methods:
            return [
                f'"""Generated from ``{self.source}``, which declares no keyed methods.',
                "",
                "``SERVICES`` and ``POLICIES`` are empty, ``SERVICE_CONFIG`` retries nothing.",
                "The module is generated all the same: regenerating after a file's last option",
                "is removed leaves no stale module, whose ``POLICIES`` kept the method keyed.",
                '"""',
            ]
        return [
            f'"""Generated from the idempotency options of ``{self.source}``.',
            "",
            "- ``SERVICES``, ``POLICIES``: for ``IdempotencyInterceptor(store,",
            "  services=SERVICES, overrides=POLICIES)``. ``POLICIES`` holds each keyed",
            "  method's options as declared (``None`` where the proto sets nothing: the",
            "  library's defaults apply). The server still reads the descriptors: each",
            "  entry is merged field by field onto the method's own option (a ``None``",
            "  field, or a method left out, keeps what the proto says), and fingerprint",
            "  exclusions come from the request's field options.",
            "- ``SERVICE_CONFIG``, ``CHANNEL_OPTIONS``: the recommended configuration of a",
            "  channel calling the keyed methods: gRPC retries UNAVAILABLE and ABORTED of the",
            "  methods whose key is required (safe: the server refuses a call without a key,",
            "  and every attempt carries the same one). Not of those whose key is optional: a",
            "  call without a key runs undeduplicated, and retried after an UNAVAILABLE that",
            "  came once it had run, it would run twice. Retry their calls with",
            "  ``Operation.call``, which keeps one key.",
            "- ``<Service><Method>Steps``: a keyed method's step names and, built with",
            "  channels to the called services, one typed call per step, made with the step",
            "  named so that it carries the step's child key.",
            '"""',
        ]

    def _imports(self) -> list[str]:
        stdlib = []
        if self.dynamic:
            stdlib.append("import importlib")
        if "json" in self.needs:
            stdlib.append("import json")
        collections = sorted(self.needs & {"Mapping", "Sequence"})
        if collections:
            stdlib.append(f"from collections.abc import {', '.join(collections)}")
        dates = sorted(self.needs & {"datetime", "timedelta"})
        if dates:
            stdlib.append(f"from datetime import {', '.join(dates)}")
        stdlib.append(f"from typing import {', '.join(sorted(self.needs & {'Final', 'TypeVar'}))}")
        third = []
        if "grpc" in self.needs:
            third.append("import grpc")
        if "descriptor_pool" in self.needs:
            third.append("from google.protobuf import descriptor_pool")
        third.append("from google.protobuf.descriptor import ServiceDescriptor")
        if "Message" in self.needs:
            third.append("from google.protobuf.message import Message")
        library = sorted(
            self.needs
            & {"Code", "Isolation", "KeyRequirement", "MethodOverride", "Mode", "Step", "StoreDown"}
        )
        if "step_metadata" in self.needs:
            library.append("step_metadata")
        lines = [*stdlib, "", *third, "", *_import_lines("grpc_idempotency", library)]
        generated = [
            line
            for module, local in sorted(self.modules.items())
            if module not in self.dynamic
            for line in _import_lines_of(module, local, unread=module not in self.read)
        ]
        # ``from in.v1 import pay_pb2`` is a SyntaxError: protoc's python_out imports such a
        # module with importlib too. So is a module whose .pyi protoc's pyi_out writes with a
        # keyword as a name (``class from(...)``, ``_stub_has_keyword``): imported statically,
        # a type checker reads that stub and stops at its syntax error. Their messages are
        # typed ``Message`` here (``_annotation``): a type checker cannot follow the import.
        assigned = [f'{self.modules[m]} = importlib.import_module("{m}")' for m in self.dynamic]
        if generated and assigned:
            generated.append("")
        generated += assigned
        return [*lines, "", *generated] if generated else lines

    def _all(self) -> list[str]:
        public = [
            "CHANNEL_OPTIONS",
            "POLICIES",
            "SERVICES",
            "SERVICE_CONFIG",
            *(self.classes[m.path] for m in self.step_classes),
        ]
        public.sort(key=lambda n: (not n.isupper(), n[0].islower(), n))
        return ["__all__ = [", *(f'{INDENT}"{n}",' for n in public), "]"]

    # -- server side -----------------------------------------------------------------------

    def _services(self) -> list[str]:
        self.needs.add("Final")
        if not self.file.methods:
            return [
                "SERVICES: Final[tuple[ServiceDescriptor, ...]] = ()",
                '"""The services of this file that have keyed methods: none."""',
            ]
        own = self.modules[names.pb2_module(self.source)]
        services: list[ServiceDescriptor] = []
        for method in self.file.methods:
            if method.service not in services:
                services.append(method.service)
        # A top-level message, enum, extension, enum value or (py_generic_services) service
        # named DESCRIPTOR is bound in the _pb2 module over its file descriptor (protoc's own
        # code never reads it as one): the services are found in the default pool instead,
        # where importing the module put them.
        hidden = _hides_descriptor(self.file.descriptor)
        if hidden:
            self.needs.add("descriptor_pool")
        else:
            self.read.add(names.pb2_module(self.source))
        entries: list[str] = []
        for service in services:
            if hidden:
                lookup = f'descriptor_pool.Default().FindServiceByName("{service.full_name}")'
                # Split as a formatter splits a call of one argument: that argument on a line
                # of its own, with no trailing comma.
                entries += (
                    [f"{INDENT}{lookup},"]
                    if len(f"{INDENT}{lookup},") <= 88
                    else [
                        f"{INDENT}descriptor_pool.Default().FindServiceByName(",
                        f'{INDENT * 2}"{service.full_name}"',
                        f"{INDENT}),",
                    ]
                )
                continue
            entry = f'{INDENT}{own}.DESCRIPTOR.services_by_name["{service.name}"],'
            # An aliased module (``a_dot_v1_dot_service__pb2``) makes ordinary names long: split
            # at the bracket, as a formatter does.
            entries += (
                [entry]
                if len(entry) <= 88
                else [
                    f"{INDENT}{own}.DESCRIPTOR.services_by_name[",
                    f'{INDENT * 2}"{service.name}"',
                    f"{INDENT}],",
                ]
            )
        return [
            "SERVICES: Final[tuple[ServiceDescriptor, ...]] = (",
            *entries,
            ")",
            '"""The services of this file that have keyed methods."""',
        ]

    def _policies(self) -> list[str]:
        self.needs |= {"Final", "Mapping", "MethodOverride"}
        if not self.file.methods:
            return [
                "POLICIES: Final[Mapping[str, MethodOverride]] = {}",
                '"""Each keyed method\'s options as declared, by gRPC path: none."""',
            ]
        lines = ["POLICIES: Final[Mapping[str, MethodOverride]] = {"]
        for method in self.file.methods:
            fields = self._override_fields(method.declared)
            # A long gRPC path cannot be split: the line keeps it whole (``_long``).
            if not fields:
                lines.append(_long(f'{INDENT}"{method.path}": MethodOverride(),'))
                continue
            lines.append(_long(f'{INDENT}"{method.path}": MethodOverride('))
            lines += [INDENT * 2 + line for line in fields]
            lines.append(f"{INDENT}),")
        lines += [
            "}",
            '"""Each keyed method\'s options as declared, by gRPC path. To change one, replace its',
            'entry: ``{**POLICIES, path: dataclasses.replace(POLICIES[path], lease=...)}``."""',
        ]
        return lines

    def _override_fields(self, declared: options_pb2.MethodPolicy) -> list[str]:
        fields: list[str] = []
        if declared.key in _KEY:
            self.needs.add("KeyRequirement")
            fields.append(f"key=KeyRequirement.{_KEY[declared.key]},")
        for name in ("retention", "lease", "max_wait"):
            if declared.HasField(name):
                self.needs.add("timedelta")
                fields.append(f"{name}={_timedelta(getattr(declared, name))},")
        if declared.mode in _MODE:
            self.needs.add("Mode")
            fields.append(f"mode=Mode.{_MODE[declared.mode]},")
        if declared.recorded_error_codes:
            self.needs.add("Code")
            codes = list(dict.fromkeys(declared.recorded_error_codes))
            # A one-element tuple's comma is no "magic trailing comma" to a formatter (it is
            # the tuple's syntax): exploded, ruff format and black joined it onto one line.
            fields += (
                [f"recorded_errors=(Code.{codes[0]},),"]
                if len(codes) == 1
                else ["recorded_errors=(", *(f"{INDENT}Code.{c}," for c in codes), "),"]
            )
        if declared.store_down in _STORE_DOWN:
            self.needs.add("StoreDown")
            fields.append(f"store_down=StoreDown.{_STORE_DOWN[declared.store_down]},")
        if declared.isolation in _ISOLATION:
            self.needs.add("Isolation")
            fields.append(f"isolation=Isolation.{_ISOLATION[declared.isolation]},")
        if declared.max_response_bytes:
            fields.append(f"max_response_bytes={declared.max_response_bytes},")
        if declared.steps:
            self.needs.add("Step")
            fields.append("steps=(")
            for step in declared.steps:
                fields.append(f"{INDENT}Step(")
                step_args = [f"name={_str(step.name)},"]
                if step.call:
                    step_args.append(f"call={_str(step.call)},")
                if step.outbox:
                    step_args.append("outbox=True,")
                if step.HasField("retired_at"):
                    self.needs.add("datetime")
                    when = timestamp_of(step.retired_at).isoformat()
                    step_args.append(f"retired_at=datetime.fromisoformat({_str(when)}),")
                fields += [INDENT * 2 + a for a in step_args]
                fields.append(f"{INDENT}),")
            fields.append("),")
        return fields

    # -- client side -----------------------------------------------------------------------

    def _service_config(self) -> list[str]:
        self.needs |= {"json", "Final"}
        # gRPC's retry policy cannot see whether a call carries a key. A key-optional method
        # called without one (a plain stub, no client interceptor) runs undeduplicated, and
        # gRPC ran it again after an UNAVAILABLE that came once it had run (its answer lost, a
        # commit of unknown fate): the write twice. So only required keys (unset means
        # required, as on the server), whose every call that runs carries one.
        required = [m.path for m in self.file.methods if m.declared.key != options_pb2.KEY_OPTIONAL]
        config = service_config(required)
        literal = _literal(config)
        # ``json.dumps({})`` on one line: the form a formatter gives it.
        call = (
            [f"SERVICE_CONFIG: Final = json.dumps({literal[0]})"]
            if len(literal) == 1
            else [
                "SERVICE_CONFIG: Final = json.dumps(",
                *(_long(INDENT + line) for line in literal),
                ")",
            ]
        )
        if required:
            about = [
                '"""The ``grpc.service_config`` for a channel calling these methods: gRPC retries',
                "UNAVAILABLE and ABORTED of those whose key is required, honouring the server's",
                'pushback."""',
            ]
        elif self.file.methods:
            about = [
                '"""The ``grpc.service_config`` for a channel: no method here requires a key, so',
                'gRPC retries none (a call without a key runs undeduplicated)."""',
            ]
        else:
            about = [
                '"""The ``grpc.service_config`` for a channel: no keyed methods, no retries."""'
            ]
        return [
            *call,
            *about,
            "",
            "CHANNEL_OPTIONS: Final[tuple[tuple[str, str | int], ...]] = (",
            f'{INDENT}("grpc.service_config", SERVICE_CONFIG),',
            f'{INDENT}("grpc.enable_retries", 1),',
            ")",
            '"""For ``grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, ...)``."""',
        ]

    def _unary_helper(self) -> list[str]:
        self.needs |= {"TypeVar", "Message", "grpc"}
        return [
            '_Request = TypeVar("_Request", bound=Message)',
            '_Response = TypeVar("_Response", bound=Message)',
            "",
            "",
            "def _unary(",
            f"{INDENT}channel: grpc.aio.Channel,",
            f"{INDENT}method: str,",
            f"{INDENT}request: type[_Request],",
            f"{INDENT}response: type[_Response],",
            ") -> grpc.aio.UnaryUnaryMultiCallable[_Request, _Response]:",
            f"{INDENT}return channel.unary_unary(",
            f"{INDENT * 2}method,",
            f"{INDENT * 2}request_serializer=request.SerializeToString,",
            f"{INDENT * 2}response_deserializer=response.FromString,",
            f"{INDENT})",
        ]

    def _steps_class(self, method: KeyedMethod) -> list[str]:
        self.needs.add("Final")
        name = self.classes[method.path]
        target = method.path.lstrip("/")
        steps = _active_steps(method)
        constants = _step_identifiers(steps)
        lines = [_long(f"class {name}:")]
        if method.calls:
            lines += [
                *_docstring(INDENT, f"The steps of ``{target}``.", closed=False),
                "",
                f"{INDENT}Build it with channels to the called services, each carrying an",
                f"{INDENT}``IdempotencyClientInterceptor``, and call its methods from the",
                f"{INDENT}method's handler: each makes one step's call with the step named, and",
                f"{INDENT}the interceptor gives the call that step's child key.",
                f'{INDENT}"""',
            ]
        else:
            # One line, closed on it: a formatter folds a lone closing quote onto the first line.
            lines += _docstring(INDENT, f"The steps of ``{target}``.")
        lines.append("")
        for step in steps:
            what = f"Calls ``{step.call.lstrip('/')}``." if step.call else "An outbox message."
            lines += _constant(constants[step.name].upper(), _str(step.name))
            lines += _docstring(INDENT, what)
        if not method.calls:
            return lines
        self.needs |= {"grpc", "Sequence", "step_metadata"}
        params = _service_parameters(
            (c.target.containing_service for c in method.calls), self.parameters_reserved
        )
        lines += [
            "",
            f"{INDENT}def __init__(",
            f"{INDENT * 2}self,",
            f"{INDENT * 2}*,",
            *(
                f"{INDENT * 2}{p}: grpc.aio.Channel,  # noqa: E741"
                if names.ambiguous(p)
                else _long(f"{INDENT * 2}{p}: grpc.aio.Channel,")
                for p in params.values()
            ),
            f"{INDENT}) -> None:",
        ]
        for call in method.calls:
            service = call.target.containing_service
            arguments = [
                params[service.full_name],
                f'"/{service.full_name}/{call.target.name}"',
                self._type(call.target.input_type),
                self._type(call.target.output_type),
            ]
            lines += _assignment(2, f"self._{constants[call.name]}", _call("_unary", arguments))
        for call in method.calls:
            ident = constants[call.name]
            returned = self._annotation(call.target.output_type)
            # A message of a module imported with importlib is Any to a type checker: returned
            # as is, it fails mypy --strict (warn_return_any).
            untyped = returned != self._type(call.target.output_type)

            step_call = _call(
                f"await self._{ident}",
                ["request", "timeout=timeout"],
                partial(_metadata_argument, ident.upper()),
            )
            if untyped:
                body = [
                    *_assignment(2, "response: Message", step_call),
                    f"{INDENT * 2}return response",
                ]
            else:
                returned_call = step_call(2)
                body = [_long(f"{INDENT * 2}return {returned_call[0]}"), *returned_call[1:]]
            lines += [
                "",
                _wrapper_head(names.safe_identifier(ident, self.reserved)),
                f"{INDENT * 2}self,",
                _long(f"{INDENT * 2}request: {self._annotation(call.target.input_type)},"),
                f"{INDENT * 2}*,",
                f"{INDENT * 2}timeout: float | None = None,",
                f"{INDENT * 2}metadata: Sequence[tuple[str, str | bytes]] = (),",
                _long(f"{INDENT}) -> {returned}:"),
                *_docstring(INDENT * 2, f"Calls ``{call.target.name}`` as step ``{call.name}``."),
                *body,
            ]
        return lines

    def _annotation(self, message: Descriptor) -> str:
        """``message``'s class as a type: ``Message`` when its module is imported with importlib
        (``_imports``)."""
        if names.pb2_module(message.file.name) in self.dynamic:
            self.needs.add("Message")
            return "Message"
        return self._type(message)

    def _type(self, message: Descriptor) -> str:
        """``message``'s class: ``shop_pb2.Order.Line``. A keyword part (proto allows ``message
        from``, ``Outer.class``) is read with ``getattr``: ``kw_pb2.Outer.class`` is a
        SyntaxError. Such a message's module is imported with importlib (``_stub_has_keyword``):
        its annotation is ``Message``."""
        self.read.add(names.pb2_module(message.file.name))
        expression = self.modules[names.pb2_module(message.file.name)]
        for part in _relative_name(message).split("."):
            expression = (
                f'getattr({expression}, "{part}")'
                if keyword.iskeyword(part)
                else f"{expression}.{part}"
            )
        return expression


def _stub_has_keyword(proto: FileDescriptor) -> bool:
    """Whether a message, enum, enum value or extension of ``proto`` is named with a Python
    keyword (``message from``, ``Outer.class``): protoc's pyi_out writes it as is, so the file's
    .pyi is a SyntaxError (its .py reads it with ``getattr``)."""

    def enum_named(enum: EnumDescriptor) -> bool:
        return keyword.iskeyword(enum.name) or any(
            keyword.iskeyword(v) for v in enum.values_by_name
        )

    def message_named(message: Descriptor) -> bool:
        return (
            keyword.iskeyword(message.name)
            or any(enum_named(e) for e in message.enum_types)
            or any(keyword.iskeyword(x.name) for x in message.extensions)
            or any(message_named(m) for m in message.nested_types)
        )

    return (
        any(message_named(m) for m in proto.message_types_by_name.values())
        or any(enum_named(e) for e in proto.enum_types_by_name.values())
        or any(keyword.iskeyword(name) for name in proto.extensions_by_name)
    )


def _hides_descriptor(proto: FileDescriptor) -> bool:
    """Whether ``proto``'s _pb2 module binds ``DESCRIPTOR`` to one of the file's own symbols:
    a top-level message, enum, extension or enum value (enum values are bound at the top level
    too) named so, or a service (``py_generic_services`` binds each service's class; without
    it the default pool's answer is the same)."""
    return (
        "DESCRIPTOR" in proto.message_types_by_name
        or "DESCRIPTOR" in proto.enum_types_by_name
        or "DESCRIPTOR" in proto.extensions_by_name
        or "DESCRIPTOR" in proto.services_by_name
        or any("DESCRIPTOR" in enum.values_by_name for enum in proto.enum_types_by_name.values())
    )


def _relative_name(message: Descriptor) -> str:
    """``message``'s name within its file's package: ``Order.Line``."""
    package = message.file.package
    return message.full_name[len(package) + 1 :] if package else message.full_name


def _active_steps(method: KeyedMethod) -> list[options_pb2.Step]:
    return [s for s in method.declared.steps if not s.HasField("retired_at")]


def _step_identifiers(steps: Sequence[options_pb2.Step]) -> dict[str, str]:
    """Snake-case identifiers by step name: ``charge_card``, or ``charge_card_v2`` when two
    active steps differ only in version."""
    bases = [names.step_base(s.name) for s in steps]
    shared = set(_duplicates(bases))
    return {
        s.name: names.step_versioned(s.name) if base in shared else base
        for s, base in zip(steps, bases, strict=True)
    }


def _step_clashes(
    steps: Sequence[options_pb2.Step], class_name: str, reserved: Collection[str]
) -> list[str]:
    """Steps that would get the same constant or wrapper in the class. ``_step_identifiers``
    only versions bases that two steps share, so a step named like another's versioned
    identifier (``a-v1.v1`` beside ``a.v1`` and ``a.v2``) lands on it; the trailing underscore
    of a keyword or ``reserved`` name (``import.v1``, ``import-.v1``; ``str.v1``, ``str-.v1``)
    can too. Python keeps the last definition of a name: a wrapper would silently make another
    step's call, with that step's child key."""
    identifiers = _step_identifiers(steps)
    owners: dict[str, list[str]] = {}
    for step in steps:
        ident = identifiers[step.name]
        generated = [ident.upper()]
        if step.call:
            generated.append(f"{names.safe_identifier(ident, reserved)}()")
        for name in generated:
            owners.setdefault(name, []).append(step.name)
    shared: dict[tuple[str, ...], list[str]] = {}
    for name, stepped in owners.items():
        if len(stepped) > 1:
            shared.setdefault(tuple(stepped), []).append(name)
    return [
        f"steps {_and([repr(s) for s in stepped])} would {'both' if len(stepped) == 2 else 'all'}"
        f" be {_and(generated)} in {class_name}; rename one so that each step has names of its own"
        for stepped, generated in shared.items()
    ]


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _service_parameters(
    services: Iterable[ServiceDescriptor], reserved: Collection[str]
) -> dict[str, str]:
    """A keyword parameter per called service, by full name: ``payment_service``, or the
    snake-cased full name when two called services' names snake-case alike (``a.v1.Payments``
    and ``b.v1.Payments``, but also ``HTTPGateway`` and ``HttpGateway``, which gave a duplicate
    argument, a SyntaxError). ``NameClash`` when the full names snake-case alike too."""
    unique: dict[str, ServiceDescriptor] = {}
    for service in services:
        unique.setdefault(service.full_name, service)
    short = {
        full: names.safe_identifier(names.snake_case(s.name), reserved)
        for full, s in unique.items()
    }
    shared = set(_duplicates(short.values()))
    params = {
        full: names.safe_identifier(names.snake_case(full), reserved)
        if short[full] in shared
        else name
        for full, name in short.items()
    }
    clashes = []
    for param in _duplicates(params.values()):
        called = sorted(f for f in params if params[f] == param)
        clashes.append(
            f"called services {_and(called)} would {'both' if len(called) == 2 else 'all'} be"
            f" parameter {param!r}: generated names collide; rename one of the services"
        )
    if clashes:
        raise NameClash("; ".join(clashes))
    return params


def _local_names(modules: set[str]) -> dict[str, str]:
    """How each imported module is named in the generated file: its basename, or protoc's alias
    when two modules share a basename."""
    bases = [m.rpartition(".")[2] for m in modules]
    shared = set(_duplicates(bases))
    return {
        m: names.module_alias(m) if m.rpartition(".")[2] in shared else m.rpartition(".")[2]
        for m in modules
    }


def _duplicates(values: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    repeated: list[str] = []
    for value in values:
        if value in seen and value not in repeated:
            repeated.append(value)
        seen.add(value)
    return repeated


def _import_statement(module: str, local: str | None = None) -> str:
    """``from checkout.v1 import orders_pb2``, ``import nopkg_pb2``, with ``as local`` when the
    module is bound to another name."""
    package, _, base = module.rpartition(".")
    alias = f" as {local}" if local is not None and local != base else ""
    return f"from {package} import {base}{alias}" if package else f"import {base}{alias}"


def _import_lines_of(module: str, local: str, *, unread: bool = False) -> list[str]:
    """``_import_statement``, exploded as a formatter explodes it when it passes 88 columns (an
    alias, ``service_pb2 as a_dot_v1_dot_service__pb2``, doubles the length of a name).
    ``unread``: imported only for the descriptors it adds to the default pool (a formatter
    leaves the pragma out of a line's length)."""
    noqa = "  # noqa: F401" if unread else ""
    single = _import_statement(module, local)
    package, _, base = module.rpartition(".")
    if len(single) <= 88 or not package:
        return [single + noqa]
    alias = f" as {local}" if local != base else ""
    return [
        f"from {package} import (  {noqa.strip()}" if noqa else f"from {package} import (",
        f"{INDENT}{base}{alias},",
        ")",
    ]


def _metadata_argument(constant: str, depth: int) -> list[str]:
    """A step wrapper's ``metadata=`` argument, a tuple of the caller's entries and the step's
    ``step_metadata(self.CONSTANT)``, exploded (a tuple a formatter splits one element a line,
    with a trailing comma) when a long step name pushes it past 88 columns: from a step name of
    37 characters. From 55 the call is split too, its one argument on a line of its own without
    a trailing comma (none is added where no comma separates arguments), whether or not that
    line fits: a line of one word, which E501 lets pass."""
    step = f"step_metadata(self.{constant})"
    indent, inner = INDENT * depth, INDENT * (depth + 1)
    line = f"{indent}metadata=(*metadata, {step}),"
    if len(line) <= 88:
        return [line]
    element = (
        [f"{inner}{step},"]
        if len(f"{inner}{step},") <= 88
        else [f"{inner}step_metadata(", f"{inner}{INDENT}self.{constant}", f"{inner}),"]
    )
    return [f"{indent}metadata=(", f"{inner}*metadata,", *element, f"{indent}),"]


def _constant(name: str, value: str) -> list[str]:
    """A class constant, ``NAME: Final = "value"``. Past 88 columns a formatter puts the value
    in parentheses on a line of its own, but only if both that line and the first,
    ``NAME: Final = (``, then fit (from a step name of 39 characters to one of 76): otherwise
    the split gains nothing and it keeps (or joins back) the one line, which only a ``noqa``
    makes lint clean (a formatter leaves a pragma out of a line's length)."""
    single = f"{INDENT}{name}: Final = {value}"
    if names.ambiguous(name):  # a name of one letter, its value short: one line
        return [single + "  # noqa: E741"]
    if len(single) <= 88:
        return [single]
    head, body = f"{INDENT}{name}: Final = (", f"{INDENT * 2}{value}"
    if len(head) <= 88 and len(body) <= 88:
        return [head, body, f"{INDENT})"]
    return [single + _NOQA_E501]


def _call(
    callee: str,
    arguments: Sequence[str],
    last: Callable[[int], list[str]] | None = None,
) -> Callable[[int], list[str]]:
    """An exploded call, as a function of its depth: its lines, the first unindented (it follows
    ``return `` or ``target = ``), each argument on a line of its own, then ``last``'s lines."""

    def at(depth: int) -> list[str]:
        inner = INDENT * (depth + 1)
        return [
            f"{callee}(",
            *(f"{inner}{argument}," for argument in arguments),
            *(last(depth + 1) if last else []),
            f"{INDENT * depth})",
        ]

    return at


def _assignment(depth: int, target: str, value: Callable[[int], list[str]]) -> list[str]:
    """``target = value`` at ``depth``, ``value`` an exploded call: ``value(depth)`` its lines as
    they follow ``target = `` (the first unindented). When a long target or callee (a step's
    identifier: ``self._x = _unary(`` from a step name of 68 characters, ``response: Message =
    await self._x(`` from 51) puts the first line past 88 columns, a formatter puts the call in
    parentheses, on lines of their own, if then every line fits (to 73 and 62); if not, it
    leaves the first line as it is (``_long``)."""
    indent = INDENT * depth
    flat = value(depth)
    head = f"{indent}{target} = {flat[0]}"
    if len(head) > 88:
        inner = value(depth + 1)
        parenthesized = [
            f"{indent}{target} = (",
            INDENT * (depth + 1) + inner[0],
            *inner[1:],
            f"{indent})",
        ]
        if all(len(line) <= 88 for line in parenthesized):
            return parenthesized
    return [_long(head), *flat[1:]]


def _long(line: str) -> str:
    """``line``, which a formatter leaves as it is however long (its brackets are split
    already, or it has none), with a ``noqa: E501`` if a long name puts it past 88 columns:
    ``async def`` from a step name of 77 characters, ``return await self._x(`` from 64, a
    class, parameter or gRPC path from long service and method names."""
    return line + _NOQA_E501 if len(line) > 88 else line


_NOQA_E501 = "  # noqa: E501"


def _wrapper_head(wrapper: str) -> str:
    """A step wrapper's ``async def`` line (``_long``; a name of one letter fits)."""
    head = f"{INDENT}async def {wrapper}("
    return f"{head}  # noqa: E743" if names.ambiguous(wrapper) else _long(head)


def _docstring(indent: str, text: str, *, closed: bool = True) -> list[str]:
    """``text`` as a docstring at ``indent``: one line when it fits in 88 columns, else filled
    word by word (``ruff format`` and black never rewrap a docstring's text, nor move its
    closing quotes). A word too long for a line of its own, a step name of 71 characters or
    more, is alone on its line: one word, which E501 lets pass. ``closed=False``: the first
    paragraph of a docstring that goes on, without the closing quotes."""
    words = text.split(" ")
    lines: list[str] = []
    line = f'{indent}"""{words[0]}'
    for position, word in enumerate(words[1:], 2):
        # the last word carries the closing quotes
        end = '"""' if closed and position == len(words) else ""
        if len(f"{line} {word}{end}") <= 88:
            line = f"{line} {word}"
        else:
            lines.append(line)
            line = indent + word
    return [*lines, line + '"""' if closed else line]


def _import_lines(module: str, imported: list[str]) -> list[str]:
    single = f"from {module} import {', '.join(imported)}"
    if len(single) <= 88:
        return [single]
    return [f"from {module} import (", *(f"{INDENT}{n}," for n in imported), ")"]


def _timedelta(value: Duration) -> str:
    """The ``timedelta`` the server compiles ``value`` to (``policy.duration_of``), as source:
    ``timedelta(seconds=1, microseconds=500000)``. Only valid Durations get here (the method's
    policy compiled), so the value is never negative."""
    span = duration_of(value)
    seconds = span.days * 86400 + span.seconds
    parts = [f"seconds={seconds}"] if seconds or not span.microseconds else []
    if span.microseconds:
        parts.append(f"microseconds={span.microseconds}")
    return f"timedelta({', '.join(parts)})"


def _str(value: str) -> str:
    return json.dumps(value)


def _literal(value: object) -> list[str]:
    """``value`` (dicts, lists, str, int) as exploded Python source lines."""
    if isinstance(value, dict):
        if not value:
            return ["{}"]
        lines = ["{"]
        for key, item in value.items():
            inner = _literal(item)
            lines.append(f"{INDENT}{_str(str(key))}: {inner[0]}")
            lines += [INDENT + line for line in inner[1:]]
            lines[-1] += ","
        return [*lines, "}"]
    if isinstance(value, list):
        if not value:
            return ["[]"]
        lines = ["["]
        for item in value:
            inner = _literal(item)
            lines += [INDENT + line for line in inner]
            lines[-1] += ","
        return [*lines, "]"]
    if isinstance(value, str):
        return [_str(value)]
    if isinstance(value, bool | int | float):
        return [repr(value)]
    raise TypeError(f"cannot render {value!r}")
