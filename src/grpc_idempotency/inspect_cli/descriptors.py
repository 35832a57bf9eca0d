"""The descriptors that decode stored messages and declare the methods' steps, from imported
generated ``_pb2`` modules and from descriptor sets."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor
from google.protobuf.message import Message

from grpc_idempotency.core import inspection
from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.policy import Step, compile_policy, normalize_method
from grpc_idempotency.inspect_cli.config import ConfigError


def _has_descriptors(module: ModuleType) -> bool:
    """Whether importing ``module`` gave the default pool descriptors: a generated ``_pb2``
    module (its ``DESCRIPTOR`` is the file's, or its message classes: a .proto declaring a
    top-level symbol named DESCRIPTOR binds that over the file's), or one that imports such
    modules under its own names (a ``_pb2_grpc`` module; a package whose ``__init__`` imports
    its ``_pb2`` modules)."""
    values = list(vars(module).values())
    if _generated(module) or any(_is_message_class(value) for value in values):
        return True
    return any(isinstance(value, ModuleType) and _generated(value) for value in values)


def _generated(module: ModuleType) -> bool:
    return isinstance(getattr(module, "DESCRIPTOR", None), FileDescriptor)


def _is_message_class(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, Message)


class Descriptors:
    """Methods and message types from imported ``_pb2`` modules (the default pool) and from
    descriptor sets (a pool each, never the default one, which would refuse files it already
    holds)."""

    def __init__(self, modules: Sequence[str], descriptor_sets: Sequence[str]) -> None:
        from grpc_idempotency.protoc_gen.step_check import (
            InputError,
            build_pool,
            contract_of,
            read_descriptor_set,
        )

        for name in modules:
            try:
                module = importlib.import_module(name)
            except Exception as err:  # a broken module raises anything while it runs
                raise ConfigError(
                    f"--proto-module {name}: cannot import: {type(err).__name__}: {err}"
                    " (is its directory on PYTHONPATH, or in the config's python_path?)"
                ) from err
            if not _has_descriptors(module):
                # A mistyped name that happened to import (os.path, the package rather than
                # its _pb2) was taken silently, and every message then showed as bytes.
                raise ConfigError(
                    f"--proto-module {name}: holds no protobuf descriptors: give a generated"
                    " _pb2 module (one with a DESCRIPTOR), e.g. checkout.v1.payments_pb2"
                )
        self.given = bool(modules or descriptor_sets)
        self._pools = [descriptor_pool.Default()]
        self._steps: dict[str, tuple[Step, ...]] = {}
        self._refused: dict[str, str] = {}
        for path in descriptor_sets:
            label = f"--descriptor-set {path}"
            try:
                fds = read_descriptor_set(path, label=label)
                self._pools.append(build_pool(fds, label=label))
                refused: dict[str, str] = {}
                for method, declared in contract_of(fds, label=label, refused=refused).items():
                    # The first set declaring the method is taken, refusing it or not: steps
                    # from a later set beside an earlier one's refusal showed a node whose
                    # steps were known and refused at once.
                    if method not in self._refused:
                        self._steps.setdefault(method, declared.steps)
                # As the server refuses such a method alone: its steps unknown, said why.
                for method, why in refused.items():
                    if method not in self._steps:
                        self._refused.setdefault(method, why)
            except InputError as err:
                raise ConfigError(str(err)) from err

    def method(self, path: str) -> MethodDescriptor | None:
        service_name, _, method_name = normalize_method(path).lstrip("/").partition("/")
        for pool in self._pools:
            try:
                service = pool.FindServiceByName(service_name)
            except KeyError:
                continue
            found = service.methods_by_name.get(method_name)
            if found is not None:
                return found
        return None

    def steps_of(self, path: str) -> tuple[Step, ...] | None:
        """The method's declared steps; ``None`` when its descriptors are unknown, or its
        options refused (then said by ``refusal``)."""
        path = normalize_method(path)
        if path in self._steps:
            return self._steps[path]
        if path in self._refused:
            return None
        method = self.method(path)
        if method is None:
            return None
        try:
            policy = compile_policy(method)
        except PolicyError as err:
            # As the server would refuse them, so not read: but said, or the method's steps
            # were "unknown" as if no descriptor for it had been given.
            self._refused[path] = err.message
            return None
        return policy.steps if policy is not None else ()

    def refusal(self, path: str) -> str | None:
        """Why ``steps_of(path)`` was ``None`` although the method's descriptor is known: the
        server's words refusing its options (a later release's option fields, an option on an
        extension), naming the method; ``None`` otherwise."""
        return self._refused.get(normalize_method(path))

    def output_type(self, path: str) -> str | None:
        method = self.method(path)
        return None if method is None else method.output_type.full_name

    def message_class(self, type_name: str | None) -> inspection.MessageClass | None:
        if type_name is None:
            return None
        for pool in self._pools:
            try:
                descriptor = pool.FindMessageTypeByName(type_name)
            except KeyError:
                continue
            cls: inspection.MessageClass = message_factory.GetMessageClass(descriptor)
            return cls
        return None
