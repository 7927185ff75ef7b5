from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("key", "value", "parent", "pin", "retain_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    RETAIN_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    parent: bytes
    pin: bool
    retain_s: float
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., pin: _Optional[bool] = ..., retain_s: _Optional[float] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    def __init__(self, stored: _Optional[bool] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class PrefixMatchRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefixMatchResponse(_message.Message):
    __slots__ = ("matched",)
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    matched: int
    def __init__(self, matched: _Optional[int] = ...) -> None: ...

class BatchPutRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutRequest, _Mapping]]] = ...) -> None: ...

class BatchPutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, stored: _Optional[_Iterable[bool]] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchGetResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[GetResponse, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    counters: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "node")
    class NodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    node: _containers.ScalarMap[str, str]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., node: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("keys", "targets", "copies", "write_quorum", "orders")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    WRITE_QUORUM_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    targets: _containers.RepeatedScalarFieldContainer[str]
    copies: int
    write_quorum: int
    orders: _containers.RepeatedCompositeFieldContainer[TargetOrder]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., targets: _Optional[_Iterable[str]] = ..., copies: _Optional[int] = ..., write_quorum: _Optional[int] = ..., orders: _Optional[_Iterable[_Union[TargetOrder, _Mapping]]] = ...) -> None: ...

class TargetOrder(_message.Message):
    __slots__ = ("index",)
    INDEX_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("copies", "missing", "stored_on", "failed")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    STORED_ON_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    copies: int
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    stored_on: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, copies: _Optional[int] = ..., missing: _Optional[_Iterable[bytes]] = ..., stored_on: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("blocks", "copies", "bytes_copied", "seconds")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    copies: int
    bytes_copied: int
    seconds: float
    def __init__(self, blocks: _Optional[int] = ..., copies: _Optional[int] = ..., bytes_copied: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("keys", "tier", "wait")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: str
    wait: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[str] = ..., wait: _Optional[bool] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outcomes: _Optional[_Iterable[str]] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("keys", "retain_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    retain_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., retain_s: _Optional[float] = ...) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outcomes: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenChannelRequest(_message.Message):
    __slots__ = ("client_host_id",)
    CLIENT_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    client_host_id: str
    def __init__(self, client_host_id: _Optional[str] = ...) -> None: ...

class OpenChannelResponse(_message.Message):
    __slots__ = ("protocol_version", "tcp_host", "tcp_port", "unix_path", "token", "same_host", "region_bytes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TCP_HOST_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    UNIX_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    tcp_host: str
    tcp_port: int
    unix_path: str
    token: bytes
    same_host: bool
    region_bytes: int
    def __init__(self, protocol_version: _Optional[int] = ..., tcp_host: _Optional[str] = ..., tcp_port: _Optional[int] = ..., unix_path: _Optional[str] = ..., token: _Optional[bytes] = ..., same_host: _Optional[bool] = ..., region_bytes: _Optional[int] = ...) -> None: ...
