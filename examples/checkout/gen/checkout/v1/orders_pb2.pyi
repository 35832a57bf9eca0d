import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from grpc_idempotency.v1 import options_pb2 as _options_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlaceOrderRequest(_message.Message):
    __slots__ = ("order_id", "amount_cents", "currency", "card_token", "email", "sent_at")
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_CENTS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    CARD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EMAIL_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    order_id: str
    amount_cents: int
    currency: str
    card_token: str
    email: str
    sent_at: _timestamp_pb2.Timestamp
    def __init__(self, order_id: _Optional[str] = ..., amount_cents: _Optional[int] = ..., currency: _Optional[str] = ..., card_token: _Optional[str] = ..., email: _Optional[str] = ..., sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PlaceOrderResponse(_message.Message):
    __slots__ = ("order_id", "charge_id", "email_id", "placed_at")
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    CHARGE_ID_FIELD_NUMBER: _ClassVar[int]
    EMAIL_ID_FIELD_NUMBER: _ClassVar[int]
    PLACED_AT_FIELD_NUMBER: _ClassVar[int]
    order_id: str
    charge_id: str
    email_id: str
    placed_at: _timestamp_pb2.Timestamp
    def __init__(self, order_id: _Optional[str] = ..., charge_id: _Optional[str] = ..., email_id: _Optional[str] = ..., placed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetOrderRequest(_message.Message):
    __slots__ = ("order_id",)
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    order_id: str
    def __init__(self, order_id: _Optional[str] = ...) -> None: ...

class GetOrderResponse(_message.Message):
    __slots__ = ("order", "found")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    order: PlaceOrderResponse
    found: bool
    def __init__(self, order: _Optional[_Union[PlaceOrderResponse, _Mapping]] = ..., found: _Optional[bool] = ...) -> None: ...
