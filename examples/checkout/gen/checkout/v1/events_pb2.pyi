from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class OrderCreated(_message.Message):
    __slots__ = ("order_id", "tenant", "amount_cents", "currency", "charge_id")
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_CENTS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    CHARGE_ID_FIELD_NUMBER: _ClassVar[int]
    order_id: str
    tenant: str
    amount_cents: int
    currency: str
    charge_id: str
    def __init__(self, order_id: _Optional[str] = ..., tenant: _Optional[str] = ..., amount_cents: _Optional[int] = ..., currency: _Optional[str] = ..., charge_id: _Optional[str] = ...) -> None: ...
