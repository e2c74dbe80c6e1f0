from shared.protos.baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRegistration(_message.Message):
    __slots__ = ("worker_id", "incarnation", "role", "address", "model", "max_model_len", "block_size", "num_kv_blocks", "vocab_size", "kv_side_channel", "quantization", "kv_cache_dtype", "tensor_parallel_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_SIDE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    role: _common_pb2.WorkerRole
    address: str
    model: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int
    kv_side_channel: str
    quantization: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_side_channel: _Optional[str] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_usage", "num_in_flight", "draining", "pending_prefill_tokens", "prefill_tokens_per_s", "num_received", "prefix_hit_tokens", "engine_stalled_s")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STALLED_S_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_usage: float
    num_in_flight: int
    draining: bool
    pending_prefill_tokens: int
    prefill_tokens_per_s: float
    num_received: int
    prefix_hit_tokens: int
    engine_stalled_s: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_in_flight: _Optional[int] = ..., draining: _Optional[bool] = ..., pending_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., num_received: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., engine_stalled_s: _Optional[float] = ...) -> None: ...

class WorkerHeartbeat(_message.Message):
    __slots__ = ("registration", "load", "kv_events", "leaving")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    registration: WorkerRegistration
    load: WorkerLoad
    kv_events: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVEventBatch]
    leaving: bool
    def __init__(self, registration: _Optional[_Union[WorkerRegistration, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., kv_events: _Optional[_Iterable[_Union[_common_pb2.KVEventBatch, _Mapping]]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class SchedulerCommand(_message.Message):
    __slots__ = ("resync_kv_events", "reason", "kv_peers", "dropped")
    RESYNC_KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KV_PEERS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    resync_kv_events: bool
    reason: str
    kv_peers: KVPeers
    dropped: bool
    def __init__(self, resync_kv_events: _Optional[bool] = ..., reason: _Optional[str] = ..., kv_peers: _Optional[_Union[KVPeers, _Mapping]] = ..., dropped: _Optional[bool] = ...) -> None: ...

class KVPeers(_message.Message):
    __slots__ = ("side_channels",)
    SIDE_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    side_channels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, side_channels: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "block_hashes", "num_prompt_tokens", "exclude_workers", "finished_request_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_prompt_tokens: int
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_prompt_tokens: _Optional[int] = ..., exclude_workers: _Optional[_Iterable[str]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id", "address", "matched_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    matched_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., matched_blocks: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("decode", "prefill", "reason", "block_size")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    decode: WorkerRef
    prefill: WorkerRef
    reason: str
    block_size: int
    def __init__(self, decode: _Optional[_Union[WorkerRef, _Mapping]] = ..., prefill: _Optional[_Union[WorkerRef, _Mapping]] = ..., reason: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class RouteCall(_message.Message):
    __slots__ = ("call_id", "request", "trace_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: RouteRequest
    trace_id: str
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[RouteRequest, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("call_id", "route", "failure", "lost")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    route: RouteResponse
    failure: RouteFailure
    lost: WorkersLost
    def __init__(self, call_id: _Optional[int] = ..., route: _Optional[_Union[RouteResponse, _Mapping]] = ..., failure: _Optional[_Union[RouteFailure, _Mapping]] = ..., lost: _Optional[_Union[WorkersLost, _Mapping]] = ...) -> None: ...

class WorkersLost(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[LostWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[LostWorker, _Mapping]]] = ...) -> None: ...

class LostWorker(_message.Message):
    __slots__ = ("worker_id", "address", "incarnation", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    incarnation: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RouteFailure(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("registration", "load", "seconds_since_heartbeat", "num_cached_blocks", "num_routed", "detached")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    registration: WorkerRegistration
    load: WorkerLoad
    seconds_since_heartbeat: float
    num_cached_blocks: int
    num_routed: int
    detached: bool
    def __init__(self, registration: _Optional[_Union[WorkerRegistration, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., seconds_since_heartbeat: _Optional[float] = ..., num_cached_blocks: _Optional[int] = ..., num_routed: _Optional[int] = ..., detached: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...
