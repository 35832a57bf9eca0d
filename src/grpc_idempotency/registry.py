"""Method policies by gRPC path, shared by the server and client interceptors.

Services named at construction are compiled at once, so bad options fail the start; any other
method is looked up in the default descriptor pool on first use (its ``_pb2`` module is imported
by then: a servicer or stub needs it) and the answer, keyed or not, is cached once its service is
in the pool.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor, MethodDescriptor, ServiceDescriptor

from grpc_idempotency.core.errors import PolicyError
from grpc_idempotency.core.policy import (
    MethodOverride,
    MethodPolicy,
    check_lease,
    compile_policies,
    compile_policy,
    method_path,
    normalize_method,
    overrides_by_path,
)

Services = Iterable[ServiceDescriptor | FileDescriptor | ModuleType]

log = logging.getLogger(__name__)


class PolicyRegistry:
    def __init__(
        self,
        services: Services = (),
        overrides: Mapping[str, MethodOverride] | None = None,
        *,
        check: Callable[[MethodPolicy], None] | None = None,
    ) -> None:
        overrides = overrides or {}
        if not isinstance(overrides, Mapping):
            # A list of pairs (or one override) was a bare AttributeError ("no attribute
            # 'items'") out of the interceptor's constructor.
            raise TypeError(
                "overrides must be a mapping of method names to MethodOverride"
                f" ({{'pkg.Service/Method': MethodOverride(...)}}), not {overrides!r}"
            )
        for name, override in overrides.items():
            # Here, not in compile_policy: a method found on its first call compiles then, and
            # an AttributeError from a dict in place of the override failed each of its calls
            # with UNKNOWN.
            if not isinstance(name, str):
                raise TypeError(
                    f"overrides names a method by a str ('pkg.Service/Method'), not {name!r}"
                )
            if not isinstance(override, MethodOverride):
                raise TypeError(
                    f"overrides[{name!r}] must be a MethodOverride, not {type(override).__name__}"
                )
        self._overrides = overrides_by_path(overrides)
        self._check = check
        self._policies: dict[str, MethodPolicy | None] = {}
        # A method found on first use whose options are bad: the same error on every call,
        # without compiling (and logging a traceback for) the options each time.
        self._errors: dict[str, PolicyError] = {}
        # A service imported after the start whose overrides name a method it lacks: every
        # path of it refused with that error, kept by service (the paths are the client's).
        self._typos: dict[str, PolicyError] = {}
        methods = list(methods_of(services))
        # Services some override names that are in neither ``services`` nor (yet) the default
        # pool: their overrides are checked when the service first shows up in get().
        self._unchecked = _check_overrides(self._overrides, methods)
        if self._unchecked:
            _warn_unchecked(self._unchecked, {m.containing_service.full_name for m in methods})
        self._policies.update(compile_policies(methods, self._overrides))
        for method in methods:
            self._policies.setdefault(method_path(method), None)
        for policy in self._policies.values():
            if policy is not None and check is not None:
                check(policy)

    @property
    def policies(self) -> Mapping[str, MethodPolicy | None]:
        return dict(self._policies)

    def get(self, path: str) -> MethodPolicy | None:
        """The policy of "/pkg.Service/Method", ``None`` when the method is not keyed."""
        try:
            return self._policies[path]
        except KeyError:
            pass
        if path in self._errors:
            raise self._errors[path]
        service_name, _, method_name = path.lstrip("/").partition("/")
        try:
            service = descriptor_pool.Default().FindServiceByName(service_name)
        except KeyError:
            # Not in the pool yet (its _pb2 not imported: a generic call made first, say): not
            # keyed for now, but not cached, or the method stayed unkeyed for the life of the
            # process once its _pb2 was imported. A miss costs well under a microsecond.
            return None
        package, _, last = service_name.rpartition(".")
        if (
            package
            and f"/{package}/{last}" in self._overrides
            and service_name not in self._typos
            and not _in_pool(package)
        ):
            # An override of the whole service, imported only now (refused at construction
            # when the service is known then). Not when ``package`` is a service itself: the
            # override names its method ``last`` (checked as any other), as at construction.
            self._typos[service_name] = _whole_service(service_name)
        if service_name in self._unchecked:
            typo = _unknown_override(self._overrides, service_name, set(service.methods_by_name))
            if typo is not None:
                # A misspelt override left the method it meant as its proto says (unkeyed,
                # say), silently: every method of the service is refused instead, as the
                # constructor refuses it for a service it knows. Kept by service, not by
                # path: each name a client made up under it was kept (and logged) otherwise.
                self._typos[service_name] = typo
            self._unchecked.discard(service_name)
        if service_name in self._typos:
            raise self._typos[service_name]
        method = service.methods_by_name.get(method_name)
        if method is None:
            # A name the service does not declare: not cached, as the path is the client's
            # choice (a server whose catch-all handler serves every path hands it here), and
            # each one made up was kept for the life of the process.
            return None
        try:
            policy = compile_policy(method, self._overrides.get(path))
            if policy is not None and self._check is not None:
                self._check(policy)
        except PolicyError as err:
            self._errors[path] = err
            raise
        self._policies[path] = policy
        return policy


def check_served(policy: MethodPolicy) -> None:
    """What a server checks of a method it serves, beyond what every registry (a client's too)
    checks: its lease (``check_lease``) and its steps' targets (``check_step_targets``)."""
    check_lease(policy)
    check_step_targets(policy)


def check_step_targets(policy: MethodPolicy) -> None:
    """Refuses an active step whose ``call`` names a method its service does not have, or a
    streaming one, when that service is in the default pool (imported): a misspelt target was
    found only by the method's calls, each failing at its downstream call, told to declare the
    step it had declared. A service not imported cannot be checked here; the generator checks
    every step against the files it is given (``protoc_gen.validate``).

    For the server, whose handlers make those calls (``PolicyRegistry(check=...)``), not for
    a client: the steps of the methods it calls are not its own calls, and the descriptors it
    imported of their targets may be of another version."""
    pool = descriptor_pool.Default()
    for step in policy.steps:
        if step.call is None or not step.active:
            continue  # a retired step's target may be gone
        service_name, _, method_name = normalize_method(step.call).lstrip("/").partition("/")
        try:
            service = pool.FindServiceByName(service_name)
        except KeyError:
            continue
        target = service.methods_by_name.get(method_name)
        if target is None:
            problem = f"but service {service_name} has no method {method_name}"
        elif target.client_streaming or target.server_streaming:
            problem = "a streaming method; steps call unary methods only"
        else:
            continue
        raise PolicyError(f"{policy.method}: step {step.name!r} calls {step.call!r}, {problem}")


def _check_overrides(overrides: Mapping[str, object], methods: list[MethodDescriptor]) -> set[str]:
    """Refuses an override naming a method its service does not have: a typo there silently
    left the method as its proto says (unkeyed, say). A service known neither from ``services``
    nor (yet) from the default pool may be imported later: its name is returned, and its
    overrides are checked when it is first looked up."""
    known: dict[str, set[str]] = {}
    for method in methods:
        known.setdefault(method.containing_service.full_name, set()).add(method.name)
    unchecked: set[str] = set()
    for path in overrides:
        service_name, _, method_name = path.lstrip("/").partition("/")
        names = known.get(service_name)
        if names is None:
            try:
                service = descriptor_pool.Default().FindServiceByName(service_name)
            except KeyError:
                whole = f"{service_name}.{method_name}"
                if whole in known or _in_pool(whole):
                    # "pkg.Service" reads as method "Service" of a service "pkg", never
                    # imported: meant for every method, the override applied to none.
                    raise _whole_service(whole) from None
                unchecked.add(service_name)
                continue
            names = set(service.methods_by_name)
        typo = _unknown_override(overrides, service_name, names)
        if typo is not None:
            raise typo
    return unchecked


def _warn_unchecked(unchecked: set[str], known: set[str]) -> None:
    """Says which services overrides name that are not known yet. Such a service may be
    imported later, so it cannot be refused; but a misspelt service name is never imported,
    and the method it meant stays as its proto says (unkeyed, say) with nothing said at all."""
    for name in sorted(unchecked):
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        log.warning(
            "overrides name service %s, which is neither among the services given nor imported"
            " yet; they are checked when a call first names it, and never if it is misspelt%s",
            name,
            hint,
        )


def _unknown_override(
    overrides: Mapping[str, object], service_name: str, names: set[str]
) -> PolicyError | None:
    """The error for the first override naming a method ``service_name`` does not have."""
    for path in overrides:
        service, _, method_name = path.lstrip("/").partition("/")
        if service == service_name and method_name not in names:
            return PolicyError(
                f"override for {path}: service {service_name} has no method {method_name!r}"
                f" (its methods: {', '.join(sorted(names))})"
            )
    return None


def methods_of(services: Services) -> Iterable[MethodDescriptor]:
    if isinstance(services, ModuleType | FileDescriptor | ServiceDescriptor):
        # One given alone was "'module' object is not iterable", naming no argument.
        raise TypeError(
            f"services must be a list of services or _pb2 modules, not one: [{services!r}]"
        )
    if isinstance(services, str | bytes) or not isinstance(services, Iterable):
        raise TypeError(
            f"services must be a list of service descriptors or _pb2 modules, not {services!r}"
        )
    for item in services:
        if isinstance(item, ModuleType):
            descriptor = getattr(item, "DESCRIPTOR", None)
            if descriptor is not None and not isinstance(descriptor, FileDescriptor):
                # Told apart from a _pb2_grpc module: refused as one, the _pb2 that was
                # passed was said not to be one.
                raise TypeError(
                    f"module {item.__name__}: its DESCRIPTOR is not the file descriptor but"
                    f" {descriptor!r}: its .proto declares a top-level message, enum, extension,"
                    " enum value or (py_generic_services) service named DESCRIPTOR, which"
                    " protoc's python_out binds over it;"
                    " pass the file's services instead: its generated SERVICES"
                    " (protoc-gen-grpc-idempotency), or"
                    ' descriptor_pool.Default().FindServiceByName("package.Service")'
                )
            if not isinstance(descriptor, FileDescriptor):
                # Typically the _pb2_grpc module, which servicers come from: it has no
                # descriptor (a bare AttributeError said only that).
                raise TypeError(
                    f"module {item.__name__} has no file descriptor: pass the _pb2 module"
                    " (or its service descriptors), not the _pb2_grpc one"
                )
            item = descriptor
        if isinstance(item, FileDescriptor):
            for service in item.services_by_name.values():
                yield from service.methods
        elif isinstance(item, ServiceDescriptor):
            yield from item.methods
        else:
            raise TypeError(f"expected a service or file descriptor or a _pb2 module, got {item!r}")


def _whole_service(name: str) -> PolicyError:
    return PolicyError(
        f"override for {name}: names service {name}, not a method; give one override per"
        f" method ('{name}/Method')"
    )


def _in_pool(service_name: str) -> bool:
    try:
        descriptor_pool.Default().FindServiceByName(service_name)
    except KeyError:
        return False
    return True
