"""Messages between the engine's frontend (LLM, AsyncLLM, the worker service) and its core.

All msgspec structs: the same types go through ``InprocClient`` as objects and through the ZMQ
boundary of ``EngineCoreProc`` as msgpack. Decoders are typed (a tagged union), so nothing on a
socket can construct an arbitrary object.
"""

import enum

import msgspec

from services.worker.engine.kv_transfer.params import KVTransferParams, RemoteKV
from services.worker.engine.params import SamplingParams
from services.worker.engine.request import FinishReason
from shared.kv_events import KVEventBatch


class EngineCoreRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None  # a leg of a disaggregated request


class EngineCoreAbort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class EngineCoreUtility(msgspec.Struct, tag="utility"):
    """A named call on the core (see ``UTILITY_METHODS`` below), answered in ``UtilityResult``."""

    call_id: int
    method: str


class EngineCoreShutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineCoreInput = EngineCoreRequest | EngineCoreAbort | EngineCoreUtility | EngineCoreShutdown


class SampleLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one generated position: the sampled token first, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1 = the most likely token


class ErrorCode(enum.StrEnum):
    """Why a request ended in error (EngineCoreOutput.error_code). The worker maps it to the
    protos' ErrorCode for the gateway, which picks the HTTP status from it."""

    INVALID_REQUEST = "invalid_request"  # refused on admission: the client's fault
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # a decode leg could not pull its prompt's KV
    OVERLOADED = "overloaded"  # not the request's fault: the engine had no room for it in time


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id, when one ended the request
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with finish_reason ERROR
    queued_seconds: float = 0.0  # time it waited in the scheduler before its first step
    kv_handle: RemoteKV | None = None  # a finished prefill leg: where its KV waits (leased)
    error_code: ErrorCode | None = None  # with error: its kind, when it has one
    # prompt logprobs (SamplingParams.prompt_logprobs) computed since the last output, in prompt
    # order, on from where the last left off (the first of all is about prompt token 1: token 0
    # has none)
    new_prompt_logprobs: list[SampleLogprobs] | None = None


class EngineStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_hit_tokens: int  # prompt tokens served from the cache, since start
    prompt_tokens: int  # prompt tokens admitted, since start
    computed_tokens: int  # tokens run through the model (prefill + decode), since start
    num_steps: int  # steps that ran the model, since start
    context_tokens_read: int  # sum over steps of each scheduled request's context length
    model_seconds: float = 0.0  # wall time inside the executor (model + sampling), since start
    pending_prefill_tokens: int = 0  # prompt tokens admitted but not computed yet (a backlog)
    # KV transfer (disaggregated prefill/decode), since start:
    kv_pulls: int = 0  # decode side: pulls completed
    kv_pull_failures: int = 0
    kv_pull_bytes: int = 0
    kv_pull_descriptors: int = 0
    kv_pull_seconds: float = 0.0  # summed from start to completion seen
    kv_notify_seconds: float = 0.0  # decode side: time spent sending release notifications
    kv_leases_released: int = 0  # prefill side: leases ended by the decode side's notification
    kv_leases_expired: int = 0  # prefill side: leases nobody pulled in time
    kv_stale_handles: int = 0  # decode side: handles whose lease had expired (not read)
    kv_leases_held: int = 0  # prefill side: finished prefills whose KV still waits to be pulled


class ModelInfo(msgspec.Struct):
    """What a benchmark needs to compute the machine's bound for a run."""

    num_params: int
    weight_bytes: int  # every parameter, tied ones once
    kv_bytes_per_token: int  # all layers, K and V
    device: str
    dtype: str
    # vocab × hidden: the LM head multiplies only the rows a step samples.
    lm_head_params: int = 0
    # The input embedding table when it is not also the LM head (0 when tied): a step reads only
    # the rows of its tokens, and it multiplies nothing.
    untied_embedding_params: int = 0
    kv_side_channel: str = ""  # where its KV side channel listens ("" without KV transfer)
    # ranks the model is split over; the sizes above are one rank's shard (rank 0's)
    tensor_parallel_size: int = 1
    quantization: str = ""  # "" or what its FP8 linear layers are (quantization/config.py)
    kv_cache_dtype: str = ""  # the KV cache's element type, e.g. bfloat16 or float8_e4m3fn
    kv_cache_groups: str = ""  # the layers by the state they keep (KVCacheGroups.describe)
    # the cache one request of max_model_len holds on this rank, and what it would hold were
    # every layer to keep every token (the KV cache groups' saving)
    kv_request_bytes: int = 0
    kv_full_attention_request_bytes: int = 0
    # one request's recurrent state (Gated DeltaNet layers: a page slot each), which a decode
    # step reads and writes whatever the context; 0 without recurrent layers
    recurrent_state_bytes: int = 0
    # a mixture-of-experts model's routed experts (this rank's, scales included): a token
    # multiplies ``active_expert_fraction`` of them (top_k / num_experts), so a batch-1 step
    # reads that fraction of these bytes
    routed_expert_params: int = 0
    routed_expert_bytes: int = 0
    active_expert_fraction: float = 1.0


class UtilityResult(msgspec.Struct):
    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack of the method's declared return type
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    utility_results: list[UtilityResult] = msgspec.field(default_factory=list)
    kv_events: KVEventBatch | None = None
    ready: EngineStats | None = None  # sent once by EngineCoreProc when it can take requests
    # The core's counts as a step left them, pushed by EngineCoreProc (every STATS_PUSH_S while
    # busy, and when it turns idle): a frontend reports its load from these without asking a
    # core that answers calls only between steps (a long prefill step can take minutes).
    stats: EngineStats | None = None


# Named calls a client may make on the core, with what each returns (decoded with this type).
UTILITY_METHODS: dict[str, type] = {
    "get_stats": EngineStats,
    "get_model_info": ModelInfo,
    "reset_prefix_cache": bool,
    "resync_kv_events": bool,
}
