"""``python -m grpc_idempotency``: the ``grpc-idempotency`` command, for when the virtualenv's
scripts are not on ``PATH`` (``.venv/bin/python -m grpc_idempotency include-path``)."""

from grpc_idempotency.cli import main

# Only when run: imported (pkgutil.walk_packages, pydoc, an API doc generator), it ran the
# command with the importer's argv and exited the importing process.
if __name__ == "__main__":
    raise SystemExit(main())
