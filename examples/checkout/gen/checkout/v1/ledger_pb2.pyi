from checkout.v1 import events_pb2 as _events_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RecordOrderCreatedResponse(_message.Message):
    __slots__ = ("entry_id", "duplicate")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    duplicate: bool
    def __init__(self, entry_id: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...
