"""Python names for proto things: modules as protoc's Python generator names them, identifiers
for steps and services. Pure string functions."""

from __future__ import annotations

import keyword
import re

_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def _stem(proto_file: str) -> str:
    """``my-dir/a-b.proto`` -> ``my_dir/a_b``: what protoc's Python generator does to a name."""
    stem = proto_file[: -len(".proto")] if proto_file.endswith(".proto") else proto_file
    return stem.replace("-", "_")


def pb2_module(proto_file: str) -> str:
    """The module protoc's ``--python_out`` generates for a file: ``checkout.v1.orders_pb2``."""
    return _stem(proto_file).replace("/", ".") + "_pb2"


def output_file(proto_file: str) -> str:
    """Where the plugin writes a file's module, next to its ``_pb2.py``:
    ``checkout/v1/orders_idempotency.py``."""
    return _stem(proto_file) + "_idempotency.py"


def module_alias(module: str) -> str:
    """protoc's alias for an imported module (used only when two imports share a basename)."""
    return module.replace("_", "__").replace(".", "_dot_")


def snake_case(name: str) -> str:
    """``PaymentService`` -> ``payment_service``, ``HTTPGateway`` -> ``http_gateway``."""
    return _CAMEL_BOUNDARY.sub("_", name).replace(".", "_").lower()


def safe_identifier(name: str) -> str:
    """``name``, or ``name_`` when it is a keyword or ``self`` (a parameter of every method)."""
    return f"{name}_" if keyword.iskeyword(name) or name == "self" else name


def step_base(step: str) -> str:
    """``charge-card.v1`` -> ``charge_card``."""
    return step.rpartition(".")[0].replace("-", "_")


def step_versioned(step: str) -> str:
    """``charge-card.v1`` -> ``charge_card_v1``."""
    return step.replace("-", "_").replace(".", "_")
