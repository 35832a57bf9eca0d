"""``python -m grpc_idempotency``: the ``grpc-idempotency`` command, for when the virtualenv's
scripts are not on ``PATH`` (``.venv/bin/python -m grpc_idempotency include-path``)."""

from grpc_idempotency.cli import main

raise SystemExit(main())
