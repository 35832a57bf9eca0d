import datetime

from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Key(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_UNSPECIFIED: _ClassVar[Key]
    KEY_REQUIRED: _ClassVar[Key]
    KEY_OPTIONAL: _ClassVar[Key]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_ATOMIC: _ClassVar[Mode]
    MODE_PHASED: _ClassVar[Mode]

class StoreDown(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_DOWN_UNSPECIFIED: _ClassVar[StoreDown]
    STORE_DOWN_FAIL_CLOSED: _ClassVar[StoreDown]
    STORE_DOWN_FAIL_OPEN: _ClassVar[StoreDown]

class Isolation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISOLATION_UNSPECIFIED: _ClassVar[Isolation]
    ISOLATION_READ_COMMITTED: _ClassVar[Isolation]
    ISOLATION_REPEATABLE_READ: _ClassVar[Isolation]
    ISOLATION_SERIALIZABLE: _ClassVar[Isolation]

class Fingerprint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINGERPRINT_UNSPECIFIED: _ClassVar[Fingerprint]
    FINGERPRINT_INCLUDE: _ClassVar[Fingerprint]
    FINGERPRINT_EXCLUDE: _ClassVar[Fingerprint]
KEY_UNSPECIFIED: Key
KEY_REQUIRED: Key
KEY_OPTIONAL: Key
MODE_UNSPECIFIED: Mode
MODE_ATOMIC: Mode
MODE_PHASED: Mode
STORE_DOWN_UNSPECIFIED: StoreDown
STORE_DOWN_FAIL_CLOSED: StoreDown
STORE_DOWN_FAIL_OPEN: StoreDown
ISOLATION_UNSPECIFIED: Isolation
ISOLATION_READ_COMMITTED: Isolation
ISOLATION_REPEATABLE_READ: Isolation
ISOLATION_SERIALIZABLE: Isolation
FINGERPRINT_UNSPECIFIED: Fingerprint
FINGERPRINT_INCLUDE: Fingerprint
FINGERPRINT_EXCLUDE: Fingerprint
METHOD_FIELD_NUMBER: _ClassVar[int]
method: _descriptor.FieldDescriptor
FIELD_FIELD_NUMBER: _ClassVar[int]
field: _descriptor.FieldDescriptor

class Step(_message.Message):
    __slots__ = ("name", "call", "outbox", "retired_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    OUTBOX_FIELD_NUMBER: _ClassVar[int]
    RETIRED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    call: str
    outbox: bool
    retired_at: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., call: _Optional[str] = ..., outbox: _Optional[bool] = ..., retired_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class MethodPolicy(_message.Message):
    __slots__ = ("key", "retention", "lease", "max_wait", "mode", "recorded_error_codes", "store_down", "steps", "isolation", "max_response_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RECORDED_ERROR_CODES_FIELD_NUMBER: _ClassVar[int]
    STORE_DOWN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: Key
    retention: _duration_pb2.Duration
    lease: _duration_pb2.Duration
    max_wait: _duration_pb2.Duration
    mode: Mode
    recorded_error_codes: _containers.RepeatedScalarFieldContainer[str]
    store_down: StoreDown
    steps: _containers.RepeatedCompositeFieldContainer[Step]
    isolation: Isolation
    max_response_bytes: int
    def __init__(self, key: _Optional[_Union[Key, str]] = ..., retention: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., mode: _Optional[_Union[Mode, str]] = ..., recorded_error_codes: _Optional[_Iterable[str]] = ..., store_down: _Optional[_Union[StoreDown, str]] = ..., steps: _Optional[_Iterable[_Union[Step, _Mapping]]] = ..., isolation: _Optional[_Union[Isolation, str]] = ..., max_response_bytes: _Optional[int] = ...) -> None: ...

class FieldPolicy(_message.Message):
    __slots__ = ("fingerprint",)
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: Fingerprint
    def __init__(self, fingerprint: _Optional[_Union[Fingerprint, str]] = ...) -> None: ...
