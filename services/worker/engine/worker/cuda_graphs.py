"""CUDA graphs for decode steps: the model forward (and logits) captured once per batch size of
a ladder (1, 2, 4, 8, 16, 32, …), replayed with the step's inputs copied into static buffers.

A batch of B requests runs in the smallest captured size S ≥ B; rows [B, S) are padding: one
token at position 0 that writes to the spare block after the real cache and attends to itself.
Batches larger than the largest size, and any step with a prefill, run eagerly.

A graph keeps the launches it was captured with, among them the decode attention's split count
and launch configuration, chosen for the longest context the graph may see. Where the backend
launches shorter contexts differently (``AttentionBackend.decode_graph_contexts``, asked per
size: only sizes whose rows split the context get more than one), a size is captured once per
context bound, and a step replays the graph of the smallest bound that holds its longest
context.

Capture needs a backend that reads no per-step host values (``supports_cuda_graphs``).
"""

import bisect

import torch
from torch import nn

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.worker.input_batch import host_tensor
from services.worker.engine.worker.step_inputs import StepInputs, TokenFill


class StaticTokens:
    """What a captured forward reads for its tokens, in buffers of ``top`` rows its graphs
    keep: ids, positions, KV slots (one row of slots per KV cache group). ``load`` puts a
    step's ``n`` rows there and pads rows [n, size): token 0 at position 0, its K/V written to
    the spare slot past the cache."""

    def __init__(self, top: int, pad_slot: int, device: torch.device, num_groups: int = 1):
        self.pad_slot = pad_slot
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full(
            (num_groups, top), pad_slot, dtype=torch.int64, device=device
        )

    def load(self, inputs: StepInputs, n: int, size: int, fill: TokenFill | None) -> None:
        """``fill`` writes tokens the previous step sampled on the device into their rows."""
        dev, i64 = self.input_ids.device, torch.int64
        # from pinned memory, without blocking: the previous step may still be running
        self.input_ids[:n].copy_(host_tensor(inputs.input_ids, i64, dev), non_blocking=True)
        if fill is not None:
            fill.apply(self.input_ids)
        self.positions[:n].copy_(host_tensor(inputs.positions, i64, dev), non_blocking=True)
        slots = host_tensor(inputs.slot_mapping, i64, dev)
        self.slot_mapping[:, :n].copy_(slots, non_blocking=True)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[:, n:size].fill_(self.pad_slot)


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        sizes: tuple[int, ...],
        max_model_len: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
        contexts: dict[int, tuple[int, ...]] | None = None,
        num_groups: int = 1,
    ):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        # per size: the longest context each of its graphs is captured for, ascending
        given = contexts or {}
        self.contexts = {s: sorted(given.get(s, (max_model_len,))) for s in self.sizes}
        for size, bounds in self.contexts.items():
            if bounds[-1] != max_model_len:
                raise ValueError(
                    f"size {size}'s graph contexts {bounds} must end at {max_model_len}"
                )
        self.pad_slot = pad_block * block_size
        self.pad_block = pad_block
        top = self.sizes[-1]
        width = -(-max_model_len // block_size)
        self.tokens = StaticTokens(top, self.pad_slot, device, num_groups)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (num_groups, top, width), pad_block, dtype=torch.int32, device=device
        )
        # the rows' order for the decode kernel (longest context first; a batch of one has
        # nothing to order and is captured without); padding rows keep theirs, at the end
        self.rows = torch.arange(top, dtype=torch.int32, device=device)
        self.decode_order = self.rows.clone()
        # keyed by (size, context bound)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.max_query_len == 1 and len(inputs.req_ids) <= self.sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # largest first: later graphs reuse its memory (no two of them ever run at once)
        keys = [(s, c) for s, bounds in self.contexts.items() for c in bounds]
        for key in sorted(keys, reverse=True):
            size = key[0]
            meta = self.capture_metadata(*key)
            for _ in range(2):  # compile kernels, settle allocations
                self._forward(size, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[key] = self._forward(size, meta)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def key(self, batch: int, seq_lens: list[int]) -> tuple[int, int]:
        """The graph a step of ``batch`` decode rows with contexts ``seq_lens`` replays: the
        smallest size and context bound that hold them (the longest context is looked for
        only where the size has more than one bound)."""
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        bounds = self.contexts[size]
        if len(bounds) == 1:
            return size, bounds[0]
        return size, bounds[bisect.bisect_left(bounds, max(seq_lens))]

    def run(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor:
        """Logits [B, vocab] for a decode batch of B requests (one token each). ``fill``
        writes tokens the previous step sampled on the device into their rows' inputs."""
        b = len(inputs.req_ids)
        key = self.key(b, inputs.seq_lens)
        size = key[0]
        dev, i32 = self.seq_lens.device, torch.int32
        self.tokens.load(inputs, b, size, fill)  # (from pinned memory, without blocking)
        self.seq_lens[:b].copy_(host_tensor(inputs.seq_lens, i32, dev), non_blocking=True)
        width = inputs.block_table.shape[2]
        table = host_tensor(inputs.block_table, i32, dev)
        self.block_tables[:, :b, :width].copy_(table, non_blocking=True)
        if size > 1:
            order = host_tensor(inputs.decode_order, i32, dev)
            self.decode_order[:b].copy_(order, non_blocking=True)
        if size > b:  # padding rows: harmless single-token requests on the spare block
            self.decode_order[b:size].copy_(self.rows[b:size])
            self.seq_lens[b:size].fill_(1)
            self.block_tables[:, b:size, 0].fill_(self.pad_block)
        self.graphs[key].replay()
        return self.logits[key][:b]

    def capture_metadata(self, size: int, context: int) -> AttentionMetadata:
        """What the graph of ``size`` rows and context bound ``context`` is captured with: the
        static buffers' first ``size`` rows, every row at the bound's context."""
        return AttentionMetadata.of_groups(
            self.block_tables[:, :size],
            self.tokens.slot_mapping[:, :size],
            num_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[context] * size,
            max_query_len=1,
            max_seq_len=context,  # fixes the decode kernel's split count and launch
            decode_order=self.decode_order[:size] if size > 1 else None,
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.tokens.input_ids[:size], self.tokens.positions[:size], meta)
        return self.model.compute_logits(hidden)  # type: ignore[operator]
