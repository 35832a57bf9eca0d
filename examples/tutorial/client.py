"""The tutorial's client: one operation, two attempts, one charge."""

from __future__ import annotations

import grpc
import payments_pb2
import payments_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp

from grpc_idempotency.client import Operation, RetryPolicy


def charge_request(order_id: str) -> payments_pb2.ChargeRequest:
    sent_at = Timestamp()
    sent_at.GetCurrentTime()  # differs on every attempt; excluded from the fingerprint
    return payments_pb2.ChargeRequest(order_id=order_id, amount_cents=4200, sent_at=sent_at)


async def charge_and_retry(address: str, order_id: str) -> bool:
    """Charges once, retries as if the answer had been lost; True if the retry was replayed."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = payments_pb2_grpc.PaymentServiceStub(channel)

        op = Operation.new()  # one logical operation: one key for all of its attempts
        first = await op.call(stub.Charge, charge_request(order_id), retry=RetryPolicy())
        print(f"attempt 1: charged {first.charge_id} for {first.order_id} (key {op.key})")

        # The answer was lost (a timeout, a dropped connection): try again with the same key.
        # Over the wire the key is plain metadata, idempotency-key, that any client can send.
        call = stub.Charge(charge_request(order_id), metadata=op.metadata())
        again = await call
        replayed = (await call.initial_metadata()).get("idempotency-replayed")
        print(f"attempt 2: {again.charge_id}, idempotency-replayed: {replayed}")
        return replayed == "true" and again.charge_id == first.charge_id
