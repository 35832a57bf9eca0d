"""The checkout example: a payment service whose Charge runs once per idempotency key."""

# protoc's gRPC stubs import their messages as ``checkout.v1...``: importing the package puts the
# generated code on sys.path before any module of the example imports it.
from examples.checkout import gen as _gen  # noqa: F401
