"""The test LedgerService in a process of its own whose event loop is run and closed by hand, as
grpc's own examples run a server (``loop.run_until_complete``, then ``loop.close()``, which,
unlike ``asyncio.run``, cancels nothing left on the loop): ``python -m
tests.support.sync_shutdown_process DSN`` prints ``ledger ready on HOST:PORT``, then ``sync
handler waiting`` once a sync handler waits in ``call.run``; SIGTERM stops the server. At exit,
once the sync handlers' threads are joined, it prints ``sync handlers ended: [...]``, what ended
each one's wait."""

from __future__ import annotations

import asyncio
import atexit
import signal
import sys

from grpc_idempotency import Store
from tests.support.ledger import LedgerService, running_ledger
from tests.support.waiting import until


async def main(dsn: str) -> LedgerService:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    store = await Store.connect(dsn)
    try:
        async with running_ledger(store) as ledger:
            print(f"ledger ready on {ledger.address}", flush=True)
            await until("a sync handler waiting", ledger.service.sync_started.is_set, 30)
            print("sync handler waiting", flush=True)
            await stop.wait()
    finally:
        await store.close()
    return ledger.service


if __name__ == "__main__":
    loop = asyncio.new_event_loop()
    try:
        service = loop.run_until_complete(main(sys.argv[1]))
    finally:
        loop.close()
    # atexit's functions run after the interpreter has joined the threads (the sync pool's).
    atexit.register(lambda: print(f"sync handlers ended: {service.sync_outcomes}", flush=True))
