"""The one place where the worker translates between protobuf and the engine's structs."""

from services.worker.engine.kv_transfer.params import RemoteKV
from services.worker.engine.messages import EngineStats, ErrorCode
from services.worker.engine.outputs import CompletionOutput, Logprob, RequestOutput
from services.worker.engine.params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputParams,
)
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from shared.protos.baton.v1 import common_pb2, scheduler_pb2, worker_pb2

ERROR_CODES: dict[ErrorCode | None, worker_pb2.ErrorCode] = {
    ErrorCode.INVALID_REQUEST: worker_pb2.ERROR_CODE_INVALID_REQUEST,
    ErrorCode.KV_TRANSFER_FAILED: worker_pb2.ERROR_CODE_KV_TRANSFER_FAILED,
    ErrorCode.OVERLOADED: worker_pb2.ERROR_CODE_OVERLOADED,
}


def sampling_params(p: common_pb2.SamplingParams) -> SamplingParams:
    """Engine params for a request from the gateway: token ids out, the gateway decodes.
    Raises ValueError (named field) for a bad value."""
    kwargs: dict[str, object] = {
        "n": p.n or 1,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "min_tokens": p.min_tokens,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "max_tokens": p.max_tokens if p.HasField("max_tokens") else None,
        "seed": p.seed if p.HasField("seed") else None,
        "logprobs": p.logprobs if p.HasField("logprobs") else None,
        "prompt_logprobs": p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        "detokenize": False,
        "output_kind": RequestOutputKind.DELTA,
    }
    for name in ("temperature", "top_p", "repetition_penalty"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    if p.allowed_token_ids:  # (empty on the wire: no restriction; the gateway refuses [])
        kwargs["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.logit_bias:  # bounded and checked against the vocabulary by SamplingParams, processor
        kwargs["logit_bias"] = dict(p.logit_bias)
    if p.bad_words:  # tokenized on admission (engine/processor.py), bounded by SamplingParams
        kwargs["bad_words"] = list(p.bad_words)
    if p.HasField("structured_output"):
        kwargs["structured_outputs"] = structured_output(p.structured_output)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def structured_output(s: common_pb2.StructuredOutput) -> StructuredOutputParams:
    """The grammar of a request (ValueError when none of its kinds is set)."""
    kind = s.WhichOneof("kind")
    replay = s.replay_tokens
    if kind == "json_schema":
        return StructuredOutputParams(json=s.json_schema, replay_tokens=replay)
    if kind == "json_object":
        return StructuredOutputParams(json_object=True, replay_tokens=replay)
    if kind == "regex":
        return StructuredOutputParams(regex=s.regex, replay_tokens=replay)
    if kind == "choice":
        return StructuredOutputParams(choice=list(s.choice.choices), replay_tokens=replay)
    if kind == "grammar":
        return StructuredOutputParams(grammar=s.grammar, replay_tokens=replay)
    if kind == "structural_tag":
        return StructuredOutputParams(structural_tag=s.structural_tag, replay_tokens=replay)
    raise ValueError("structured_output sets none of json_schema, json_object, regex, choice, "
                     "grammar")  # fmt: skip


def generate_response(out: RequestOutput) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        deltas=[_delta(c) for c in out.outputs],
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        finished=out.finished,
        error=out.error or "",
        error_code=ERROR_CODES.get(out.error_code, worker_pb2.ERROR_CODE_UNSPECIFIED),
        prompt_logprobs=prompt_logprobs(out),
    )


def token_logprobs(c: CompletionOutput) -> list[common_pb2.TokenLogprobs]:
    return [_position(position) for position in c.logprobs or []]


def prompt_logprobs(out: RequestOutput) -> list[common_pb2.TokenLogprobs]:
    """The prompt's logprobs, from its second token on (the first has none); [] when not asked
    for, or already sent (a DELTA request's later outputs)."""
    return [_position(p) for p in (out.prompt_logprobs or [])[1:] if p is not None]


def _position(position: dict[int, Logprob]) -> common_pb2.TokenLogprobs:
    ids = list(position)  # the sampled (or prompt) token first, then the top-N (output_processor)
    return common_pb2.TokenLogprobs(
        token_ids=ids,
        logprobs=[position[t].logprob for t in ids],
        sampled_rank=position[ids[0]].rank,
    )


def _delta(c: CompletionOutput) -> worker_pb2.CompletionDelta:
    delta = worker_pb2.CompletionDelta(
        index=c.index,
        token_ids=c.token_ids,
        logprobs=token_logprobs(c),
        finish_reason=c.finish_reason or "",
    )
    if isinstance(c.stop_reason, int):
        delta.stop_token_id = c.stop_reason
    return delta


def load(
    stats: EngineStats, in_flight: int, draining: bool, tokens_per_s: float, received: int,
    engine_stalled_s: float = 0.0,
) -> scheduler_pb2.WorkerLoad:  # fmt: skip
    return scheduler_pb2.WorkerLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_usage=stats.kv_usage,
        num_in_flight=in_flight,
        draining=draining,
        pending_prefill_tokens=stats.pending_prefill_tokens,
        prefill_tokens_per_s=tokens_per_s,
        num_received=received,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        engine_stalled_s=engine_stalled_s,
    )


def kv_event_batch(batch: KVEventBatch) -> common_pb2.KVEventBatch:
    events = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            stored = common_pb2.BlockStored(block_hashes=e.block_hashes, block_size=e.block_size)
            if e.parent is not None:
                stored.parent = e.parent
            events.append(common_pb2.KVEvent(stored=stored))
        elif isinstance(e, BlockRemoved):
            events.append(
                common_pb2.KVEvent(removed=common_pb2.BlockRemoved(block_hashes=e.block_hashes))
            )
        elif isinstance(e, AllBlocksCleared):
            events.append(common_pb2.KVEvent(cleared=common_pb2.AllBlocksCleared()))
    return common_pb2.KVEventBatch(seq=batch.seq, events=events)


def kv_handle(h: RemoteKV) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        engine_id=h.engine_id, side_channel=h.side_channel, block_ids=h.block_ids,
        num_tokens=h.num_tokens, lease_expires_at=h.lease_expires_at, request_id=h.request_id,
        num_groups=h.num_groups,
    )  # fmt: skip


def remote_kv(h: common_pb2.KVHandle) -> RemoteKV:
    return RemoteKV(
        engine_id=h.engine_id, side_channel=h.side_channel, block_ids=list(h.block_ids),
        num_tokens=h.num_tokens, lease_expires_at=h.lease_expires_at, request_id=h.request_id,
        num_groups=max(1, h.num_groups),
    )  # fmt: skip
