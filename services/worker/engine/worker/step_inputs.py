"""One step's model inputs, built on the host from the runner's per-request state.

The eager path moves them to the device as they are; the CUDA-graph path copies them into the
static buffers of a captured batch size (``cuda_graphs.py``).
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.sched.output import SchedulerOutput
from services.worker.engine.worker.input_batch import CachedRequestState


@dataclass
class StepInputs:
    req_ids: list[str]  # batch order
    input_ids: np.ndarray  # int64 [tokens]
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [tokens]
    query_start_loc: list[int]  # [reqs + 1]
    seq_lens: list[int]  # [reqs]
    block_table: np.ndarray  # int32 [reqs, widest table]
    sample_rows: list[int]  # batch rows whose next token is sampled this step
    logits_indices: list[int]  # the token index of each sampled row's last token

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
        meta = AttentionMetadata(
            num_tokens=self.num_tokens,
            query_start_loc=torch.tensor(self.query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(self.block_table).to(device),
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device),
            query_start_loc_cpu=self.query_start_loc,
            seq_lens_cpu=self.seq_lens,
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens),
        )
        return (
            torch.from_numpy(self.input_ids).to(device),
            torch.from_numpy(self.positions).to(device),
            meta,
            torch.tensor(self.logits_indices, dtype=torch.int64, device=device),
        )


def build_step_inputs(
    sched: SchedulerOutput, requests: dict[str, CachedRequestState], block_size: int
) -> StepInputs:
    """Flatten the scheduled tokens of every request (see model_runner.py for a picture).

    Runs on the host every step, for up to max_num_seqs requests, while the GPU waits: decode
    rows (one token) take a plain-int path; numpy only pays off for long prefill chunks.
    """
    req_ids = [r.req_id for r in sched.new_reqs] + [r.req_id for r in sched.cached_reqs]
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    sample_rows: list[int] = []
    logits_idx: list[int] = []
    tables: list[list[int]] = []
    for row, rid in enumerate(req_ids):
        state = requests[rid]
        n = sched.num_scheduled_tokens[rid]
        start = state.num_computed_tokens
        blocks = state.block_ids
        if n == 1:
            ids.append(state.token_ids[start])
            pos.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            p = np.arange(start, start + n, dtype=np.int64)
            ids.extend(state.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend((np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs).tolist())
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        tables.append(blocks)
        if start + n == len(state.token_ids):  # every known token computed: sample the next
            sample_rows.append(row)
            logits_idx.append(qsl[-1] - 1)
    width = max(map(len, tables))
    table = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return StepInputs(
        req_ids=req_ids,
        input_ids=np.array(ids, dtype=np.int64),
        positions=np.array(pos, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=table,
        sample_rows=sample_rows,
        logits_indices=logits_idx,
    )
