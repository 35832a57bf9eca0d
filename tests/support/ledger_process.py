"""The test LedgerService (``running_ledger``) in a process of its own, for tests whose server
may die: ``python -m tests.support.ledger_process DSN`` prints ``ledger ready on HOST:PORT``."""

from __future__ import annotations

import asyncio
import sys

from grpc_idempotency import Store
from tests.support.ledger import running_ledger


async def main(dsn: str) -> None:
    store = await Store.connect(dsn)
    try:
        async with running_ledger(store) as ledger:
            print(f"ledger ready on {ledger.address}", flush=True)
            await asyncio.Event().wait()
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
