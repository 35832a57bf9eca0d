"""The tutorial's client: one operation, two attempts, one charge; its key reused for another
amount is refused."""

from __future__ import annotations

import grpc
import payments_pb2
import payments_pb2_grpc
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from grpc_idempotency.client import Operation, RetryPolicy


def charge_request(order_id: str, amount_cents: int = 4200) -> payments_pb2.ChargeRequest:
    sent_at = Timestamp()
    sent_at.GetCurrentTime()  # differs on every attempt; excluded from the fingerprint
    return payments_pb2.ChargeRequest(order_id=order_id, amount_cents=amount_cents, sent_at=sent_at)


def reason(err: grpc.aio.AioRpcError) -> str | None:
    """The library's reason for an error it answered: ErrorInfo in grpc-status-details-bin."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]  # an AioRpcError has its parts
    for detail in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return None


async def charge_and_retry(address: str, order_id: str) -> bool:
    """Charges once, retries as if the answer had been lost, then reuses the key for another
    amount; True if the retry was replayed and the reuse refused with IDEMPOTENCY_KEY_REUSED."""
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

        # The same key for another amount is another request: refused, never answered with
        # the first charge (nor charged).
        try:
            await stub.Charge(charge_request(order_id, amount_cents=1), metadata=op.metadata())
            refused = None
        except grpc.aio.AioRpcError as err:
            refused = (err.code(), reason(err))
            print(f"attempt 3, another amount: {err.code().name} {refused[1]}")
        return (
            replayed == "true"
            and again.charge_id == first.charge_id
            and refused == (grpc.StatusCode.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED")
        )
