"""Python names for proto things: modules as protoc's Python generator names them, identifiers
for steps and services. Pure string functions."""

from __future__ import annotations

import keyword
import re
from collections.abc import Collection

_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def _module_path(proto_file: str) -> str:
    """``my-dir/a-b.proto`` -> ``my_dir.a_b``, ``c/v1/x.y.proto`` -> ``c.v1.x.y``: protoc's
    Python generator's ``ModuleName`` without the ``_pb2``. A dot in the file's base name is
    a package separator like the slashes: ``x.y.proto``'s messages are module ``y_pb2`` in
    package ``c.v1.x``."""
    for suffix in (".protodevel", ".proto"):
        if proto_file.endswith(suffix):
            proto_file = proto_file[: -len(suffix)]
            break
    return proto_file.replace("-", "_").replace("/", ".")


def pb2_module(proto_file: str) -> str:
    """The module protoc's ``--python_out`` generates for a file: ``checkout.v1.orders_pb2``."""
    return _module_path(proto_file) + "_pb2"


def output_file(proto_file: str) -> str:
    """Where the plugin writes a file's module, next to its ``_pb2.py``:
    ``checkout/v1/orders_idempotency.py``, ``c/v1/x/y_idempotency.py`` for ``c/v1/x.y.proto``.
    Derived from the module path, as protoc's ``GetFileName`` derives the ``_pb2.py``: from the
    file name, a dotted base name would make ``x.y_idempotency.py``, which no import reaches."""
    return _module_path(proto_file).replace(".", "/") + "_idempotency.py"


def module_alias(module: str) -> str:
    """protoc's alias for an imported module (used only when two imports share a basename)."""
    return module.replace("_", "__").replace(".", "_dot_")


def snake_case(name: str) -> str:
    """``PaymentService`` -> ``payment_service``, ``HTTPGateway`` -> ``http_gateway``."""
    return _CAMEL_BOUNDARY.sub("_", name).replace(".", "_").lower()


def safe_identifier(name: str, reserved: Collection[str] = ()) -> str:
    """``name``, or ``name_`` when it is a keyword, ``self`` (a parameter of every method) or
    one of ``reserved`` (names it would shadow where they are used). A name Python would
    mangle in a class body (``__pay``, from service ``__Pay``) gets one leading underscore:
    parameter ``__pay`` of ``__init__`` was ``_ShopBuySteps__pay``, which no caller's
    ``__pay=`` reaches (TypeError)."""
    if name.startswith("__") and not name.endswith("__"):
        name = "_" + name.lstrip("_")
    taken = keyword.iskeyword(name) or name == "self" or name in reserved
    return f"{name}_" if taken else name


def ambiguous(name: str) -> bool:
    """Whether ``name`` is one pycodestyle calls ambiguous (E741-E743: ``l``, ``O``, ``I``,
    easily misread as ``1`` and ``0``): step ``o.v1`` gives constant ``O``, step ``l.v1``
    wrapper ``l``, service ``L`` parameter ``l``. The name is kept (it is what a user reads off
    the step's name) and the line carries a ``noqa`` for it."""
    return name in {"l", "O", "I"}


def has_keyword(module: str) -> bool:
    """Whether a part of the dotted ``module`` is a Python keyword (``in.v1.pay_pb2``): then
    no import statement can name it, and protoc's python_out uses ``importlib``."""
    return any(keyword.iskeyword(part) for part in module.split("."))


def non_identifier(module: str) -> str | None:
    """The first part of the dotted ``module`` that is no Python identifier (``2fa_pb2`` in
    ``auth.2fa_pb2``, from ``auth/2fa.proto``), or ``None``. Unlike a keyword part, protoc's
    generators do not work around one: python_out's importers and grpc_python_out write ``from
    auth import 2fa_pb2``, a SyntaxError."""
    return next((part for part in module.split(".") if not part.isidentifier()), None)


def step_base(step: str) -> str:
    """``charge-card.v1`` -> ``charge_card``."""
    return step.rpartition(".")[0].replace("-", "_")


def step_versioned(step: str) -> str:
    """``charge-card.v1`` -> ``charge_card_v1``."""
    return step.replace("-", "_").replace(".", "_")
