"""A consumer replica in a process of its own, for tests that freeze it (SIGSTOP).

``python -m tests.support.consumer_replica DSN NAME MESSAGE_ID IDLE_TIMEOUT_MS`` processes one
message whose effect writes a row to ``consumer_test.effects``, prints ``entered``, and waits
for a line on stdin before it returns; then prints ``outcome PROCESSED`` (or ``DUPLICATE``), or
``raised <exception class>``.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta
from typing import Any

from grpc_idempotency import Store
from grpc_idempotency.consumer import IdempotentConsumer


async def main(dsn: str, name: str, message_id: str, idle_timeout_ms: int) -> None:
    store = await Store.connect(dsn, min_size=1, max_size=2)
    consumer = IdempotentConsumer(store, name, idle_timeout=timedelta(milliseconds=idle_timeout_ms))

    async def effect(conn: Any) -> None:
        await conn.execute(
            "INSERT INTO consumer_test.effects (consumer, message_id, amount) VALUES ($1, $2, 1)",
            name,
            message_id,
        )
        print("entered", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

    try:
        result = await consumer.process(message_id, effect)
    except Exception as exc:  # reported to the test, which decides
        print("raised", type(exc).__name__, flush=True)
    else:
        print("outcome", result.outcome.name, flush=True)
    finally:
        await store.close(timeout=1)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
