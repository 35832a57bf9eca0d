import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from grpc_idempotency.v1 import options_pb2 as _options_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChargeRequest(_message.Message):
    __slots__ = ("order_id", "amount_cents", "currency", "card_token", "sent_at")
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_CENTS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    CARD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    order_id: str
    amount_cents: int
    currency: str
    card_token: str
    sent_at: _timestamp_pb2.Timestamp
    def __init__(self, order_id: _Optional[str] = ..., amount_cents: _Optional[int] = ..., currency: _Optional[str] = ..., card_token: _Optional[str] = ..., sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ChargeResponse(_message.Message):
    __slots__ = ("charge_id", "order_id", "amount_cents", "charged_at")
    CHARGE_ID_FIELD_NUMBER: _ClassVar[int]
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_CENTS_FIELD_NUMBER: _ClassVar[int]
    CHARGED_AT_FIELD_NUMBER: _ClassVar[int]
    charge_id: str
    order_id: str
    amount_cents: int
    charged_at: _timestamp_pb2.Timestamp
    def __init__(self, charge_id: _Optional[str] = ..., order_id: _Optional[str] = ..., amount_cents: _Optional[int] = ..., charged_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListChargesRequest(_message.Message):
    __slots__ = ("order_id",)
    ORDER_ID_FIELD_NUMBER: _ClassVar[int]
    order_id: str
    def __init__(self, order_id: _Optional[str] = ...) -> None: ...

class ListChargesResponse(_message.Message):
    __slots__ = ("charges",)
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    charges: _containers.RepeatedCompositeFieldContainer[ChargeResponse]
    def __init__(self, charges: _Optional[_Iterable[_Union[ChargeResponse, _Mapping]]] = ...) -> None: ...
