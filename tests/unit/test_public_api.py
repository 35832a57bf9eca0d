import grpc_idempotency


def test_public_names_resolve_and_are_sorted() -> None:
    names = grpc_idempotency.__all__
    assert names == sorted(names, key=lambda n: (not n.isupper(), n[0].islower(), n))
    for name in names:
        assert getattr(grpc_idempotency, name) is not None
    # Errors carry their gRPC status, and every one is an IdempotencyError.
    for name in names:
        value = getattr(grpc_idempotency, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, grpc_idempotency.IdempotencyError), name
            assert value.reason.startswith("IDEMPOTENCY_"), name
