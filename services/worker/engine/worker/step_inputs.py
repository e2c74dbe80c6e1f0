"""One step's model inputs, built on the host from the runner's per-request state.

The eager path moves them to the device as they are; the CUDA-graph path copies them into the
static buffers of a captured batch size (``cuda_graphs.py``). With async scheduling a decode
row's input token may be one the previous step sampled and the host has not seen yet: its slot
in ``input_ids`` holds 0 and ``pending_rows`` names it; the runner fills it on the device.
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.sched.output import SchedulerOutput
from services.worker.engine.worker.input_batch import CachedRequestState, to_device


@dataclass
class StepInputs:
    req_ids: list[str]  # batch order
    input_ids: np.ndarray  # int64 [tokens]
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [KV cache groups, tokens]
    query_start_loc: list[int]  # [reqs + 1]
    seq_lens: list[int]  # [reqs]
    block_table: np.ndarray  # int32 [KV cache groups, reqs, widest table]
    sample_rows: list[int]  # batch rows whose next token is sampled this step
    logits_indices: list[int]  # the token index of each sampled row's last token
    pending_rows: list[int]  # decode rows whose input is the previous step's sampled token
    decode_order: np.ndarray  # int32: the trailing decode rows, longest context first

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def max_query_len(self) -> int:
        qsl = self.query_start_loc
        return max(b - a for a, b in itertools.pairwise(qsl))

    def to_device(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, logits indices) on ``device``."""
        i64 = torch.int64
        return (
            to_device(self.input_ids, i64, device),
            to_device(self.positions, i64, device),
            self.metadata(device, to_device(self.slot_mapping, i64, device)),
            to_device(self.logits_indices, i64, device),
        )

    def metadata(self, device: torch.device, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """The attention metadata on ``device``, over ``slot_mapping`` [groups, tokens]: this
        step's slots, or (a piecewise CUDA graph's padded batch) a static buffer holding them
        and then the padding rows' slots; ``num_tokens`` is its length."""
        i32 = torch.int32
        # none to order in a step without decode rows
        order = to_device(self.decode_order, i32, device) if self.decode_order.size else None
        return AttentionMetadata.of_groups(
            to_device(self.block_table, i32, device),
            slot_mapping,
            num_tokens=slot_mapping.shape[1],
            query_start_loc=to_device(self.query_start_loc, i32, device),
            seq_lens=to_device(self.seq_lens, i32, device),
            query_start_loc_cpu=self.query_start_loc,
            seq_lens_cpu=self.seq_lens,
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens),
            decode_order=order,
        )


@dataclass
class TokenFill:
    """Input tokens the previous step sampled, still only on the device: ``values[i]`` goes to
    token index ``index[i]`` of this step's ``input_ids``."""

    index: torch.Tensor  # int64 [k], on the device
    values: torch.Tensor  # int64 [k], on the device

    def apply(self, input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, self.index, self.values)


def build_step_inputs(
    sched: SchedulerOutput, requests: dict[str, CachedRequestState], block_size: int
) -> StepInputs:
    """Flatten the scheduled tokens of every request (see model_runner.py for a picture).

    Runs on the host every step, for up to max_num_seqs requests, while the GPU waits: decode
    rows (one token) take a plain-int path; numpy only pays off for long prefill chunks.
    """
    # Requests with one token this step go last, so that a mixed step's decode rows are one
    # run the attention backend can serve as decode (AttentionMetadata.num_decodes).
    req_ids = sorted(
        [r.req_id for r in sched.new_reqs] + [r.req_id for r in sched.cached_reqs],
        key=lambda rid: sched.num_scheduled_tokens[rid] == 1,
    )
    bs = block_size
    groups = range(len(requests[req_ids[0]].block_ids)) if req_ids else range(1)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[list[int]] = [[] for _ in groups]  # per KV cache group (the decode rows' after)
    seq_lens: list[int] = []
    qsl = [0]
    sample_rows: list[int] = []
    logits_idx: list[int] = []
    pending_rows: list[int] = []
    tables: list[list[list[int]]] = []
    decodes = 0  # the one-token rows, all at the end
    for row, rid in enumerate(req_ids):
        state = requests[rid]
        n = sched.num_scheduled_tokens[rid]
        start = state.num_computed_tokens
        blocks = state.block_ids
        known = len(state.token_ids)
        if n == 1:
            decodes += 1
            if start < known:
                ids.append(state.token_ids[start])
            else:  # sampled by the step in flight: filled in on the device
                if start != known or state.num_pending != 1:
                    raise RuntimeError(f"request {rid}: token {start} is not known (has {known})")
                ids.append(0)
                pending_rows.append(row)
            pos.append(start)  # (its slots: from the tables, below)
        else:
            if start + n > known:
                raise RuntimeError(f"request {rid}: a chunk of {n} from {start} passes {known}")
            p = np.arange(start, start + n, dtype=np.int64)
            ids.extend(state.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            for g in groups:
                table = np.asarray(blocks[g], dtype=np.int64)
                slots[g].extend((table[p // bs] * bs + p % bs).tolist())
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        tables.append(blocks)
        if start + n == known + state.num_pending:  # every token computed: sample the next
            sample_rows.append(row)
            logits_idx.append(qsl[-1] - 1)
    # the one-token rows as offsets from the first, longest context first
    tail = np.asarray(seq_lens[len(req_ids) - decodes :], dtype=np.int64)
    order = np.argsort(-tail, kind="stable").astype(np.int32)
    width = max(len(t) for per_group in tables for t in per_group)
    table = np.zeros((len(groups), len(tables), width), dtype=np.int32)
    for g in groups:
        rows = table[g]
        for i, per_group in enumerate(tables):
            t = per_group[g]
            rows[i, : len(t)] = t
    # the decode rows' slots in every group at once: their block from the table, the offset
    first = len(req_ids) - decodes
    p = np.asarray(pos[len(pos) - decodes :], dtype=np.int64)
    decode_slots = (
        table[:, first:, :][:, np.arange(decodes), p // bs].astype(np.int64) * bs + p % bs
    )
    return StepInputs(
        req_ids=req_ids,
        input_ids=np.array(ids, dtype=np.int64),
        positions=np.array(pos, dtype=np.int64),
        slot_mapping=np.concatenate(
            [np.array(slots, dtype=np.int64).reshape(len(groups), -1), decode_slots], axis=1
        ),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=table,
        sample_rows=sample_rows,
        logits_indices=logits_idx,
        pending_rows=pending_rows,
        decode_order=order,
    )
