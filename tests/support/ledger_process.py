"""The test LedgerService (``running_ledger``) in a process of its own, for tests whose server
may die: ``python -m tests.support.ledger_process DSN [APPLICATION_NAME [PORT]]`` prints ``ledger ready
on HOST:PORT``. ``APPLICATION_NAME`` names its database sessions (``pg_stat_activity``), so that
a test can find them ("" or none: the store's default); ``PORT`` is the port to listen on (a
restart on the port of a server that died), any free one by default."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from grpc_idempotency import Store
from tests.support.ledger import running_ledger


async def main(dsn: str, application_name: str = "", port: str = "0") -> None:
    options: dict[str, Any] = {}
    if application_name:
        options["server_settings"] = {"application_name": application_name}
    store = await Store.connect(dsn, **options)
    try:
        async with running_ledger(store, port=int(port)) as ledger:
            print(f"ledger ready on {ledger.address}", flush=True)
            await asyncio.Event().wait()
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
