"""The one place where the scheduler translates between protobuf and its own structs."""

from services.global_scheduler.registry import WorkerLoad, WorkerState
from shared.ids import BlockHash, WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from shared.protos.baton.v1 import common_pb2, scheduler_pb2

MAX_DESCRIPTION = 128  # characters of a registration's quantization or KV dtype
MAX_TP = 1024
ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_BOTH: "both",
}


def worker_state(reg: scheduler_pb2.WorkerRegistration) -> WorkerState:
    if not reg.worker_id or not reg.incarnation or not reg.address or not reg.model:
        raise ValueError("a registration needs worker_id, incarnation, address and model")
    if reg.role not in ROLE_NAMES:
        raise ValueError(f"unknown worker role {reg.role}")
    if reg.block_size == 0:
        raise ValueError("block_size must be > 0")
    if len(reg.quantization) > MAX_DESCRIPTION or len(reg.kv_cache_dtype) > MAX_DESCRIPTION:
        raise ValueError(f"quantization and kv_cache_dtype are at most {MAX_DESCRIPTION} chars")
    if reg.tensor_parallel_size > MAX_TP:
        raise ValueError(f"tensor_parallel_size must be <= {MAX_TP}")
    return WorkerState(
        worker_id=WorkerId(reg.worker_id),
        incarnation=reg.incarnation,
        role=ROLE_NAMES[reg.role],
        address=reg.address,
        model=reg.model,
        max_model_len=reg.max_model_len,
        block_size=reg.block_size,
        num_kv_blocks=reg.num_kv_blocks,
        vocab_size=reg.vocab_size,
        kv_side_channel=reg.kv_side_channel,
        quantization=reg.quantization,
        kv_cache_dtype=reg.kv_cache_dtype,
        tensor_parallel_size=reg.tensor_parallel_size or 1,
    )


def load(msg: scheduler_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        msg.num_running, msg.num_waiting, msg.kv_usage, msg.num_in_flight, msg.draining,
        msg.pending_prefill_tokens, msg.prefill_tokens_per_s, msg.num_received,
        msg.prefix_hit_tokens, msg.engine_stalled_s,
    )  # fmt: skip


def kv_event_batch(msg: common_pb2.KVEventBatch) -> KVEventBatch:
    events: list[KVEvent] = []
    for e in msg.events:
        kind = e.WhichOneof("event")
        if kind == "stored":
            parent = BlockHash(e.stored.parent) if e.stored.HasField("parent") else None
            hashes = [BlockHash(h) for h in e.stored.block_hashes]
            events.append(BlockStored(hashes, parent, e.stored.block_size))
        elif kind == "removed":
            events.append(BlockRemoved([BlockHash(h) for h in e.removed.block_hashes]))
        elif kind == "cleared":
            events.append(AllBlocksCleared())
    return KVEventBatch(seq=msg.seq, events=events)


def registration(w: WorkerState) -> scheduler_pb2.WorkerRegistration:
    role = {v: k for k, v in ROLE_NAMES.items()}[w.role]
    return scheduler_pb2.WorkerRegistration(
        worker_id=w.worker_id, incarnation=w.incarnation, role=role, address=w.address,
        model=w.model, max_model_len=w.max_model_len, block_size=w.block_size,
        num_kv_blocks=w.num_kv_blocks, vocab_size=w.vocab_size, quantization=w.quantization,
        kv_cache_dtype=w.kv_cache_dtype, tensor_parallel_size=w.tensor_parallel_size,
    )  # fmt: skip


def load_msg(load: WorkerLoad) -> scheduler_pb2.WorkerLoad:
    return scheduler_pb2.WorkerLoad(
        num_running=load.num_running, num_waiting=load.num_waiting, kv_usage=load.kv_usage,
        num_in_flight=load.num_in_flight, draining=load.draining,
        pending_prefill_tokens=load.pending_prefill_tokens, prefill_tokens_per_s=load.tokens_per_s,
        num_received=load.num_received, prefix_hit_tokens=load.prefix_hit_tokens,
        engine_stalled_s=load.engine_stalled_s,
    )  # fmt: skip
