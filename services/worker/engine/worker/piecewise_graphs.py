"""Piecewise CUDA graphs for steps of many tokens (prefill chunks, mixed steps, decode batches
larger than the decode graphs'): the model forward captured once per token count of a ladder,
in pieces that end at each layer's attention call. The attention runs eagerly between the
pieces, on the step's own metadata, so one graph of N tokens serves every mix of requests
whose tokens add up to at most N. (vLLM captures its prefill steps the same way, splitting the
graph that torch.compile traces at the attention op; here the split point is the model's one
attention call a layer, ``LlamaAttention.split``.)

Why: a step of 2,048 prompt tokens launches some 350-500 kernels, and with FP8 linear layers
the host takes longer to launch them (Triton's launch path, cuBLASLt's per-call set-up, the
tensors' allocations) than the GPU takes to run them: the step is bound by the host
(docs/performance.md, "FP8": the 2k prefill was bound by the host; 225 Triton launches, 128
``torch._scaled_mm``). Replayed, a step costs one graph launch per layer plus the attention's
own launches.

Capture (``capture``), per size N, largest first, every piece in one memory pool:

- the forward runs once eagerly on the static inputs (kernels compiled, allocations settled),
  then again under capture, with each attention layer's ``split`` set: the split keeps
  unowned views of the layer's q, k, v (``unowned_view``: their memory is the pool's, where the
  replayed piece writes them), ends that piece's capture, begins the next one, and hands the
  layer the static output buffer, which the next piece reads. L layers give L + 1 pieces; the
  last one's hidden states stay.
- The views own nothing, so the pool may hand their memory to a later piece; that piece
  replays after the attention that reads them, so nothing is copied between a piece and the
  attention (as vLLM's piecewise graphs keep weak references to their pieces' outputs).
- Nothing runs during a capture, so no attention runs then: the output buffer's contents are
  whatever the replayed attention writes later.
- With fused kernels the rotary kernel stores the layer's keys and values in the KV cache
  (``LlamaAttention.stores_kv``), so that store is captured in the piece before the attention,
  at the static slot mapping's slots; the attention then writes none (``store_kv=False``).

Replay (``run``), a step of n ≤ N tokens in the smallest size N: its ids, positions and KV slots
go to the static buffers, rows [n, N) padded (token 0 at position 0, its K/V written to the
spare block past the real cache, as the decode graphs' padding rows); then piece 0, layer 0's
attention (``forward(..., out=)`` on the static q/k/v, with the step's metadata whose slot
mapping is the static, padded one), piece 1, ... the last piece. The attention computes no
padding row: the metadata covers the n real tokens, and every later kernel works row by row,
so what the padding rows hold never reaches a real one.

Without capture (``capture=False``: CPU, where CUDA graphs do not exist) ``run`` runs the same
split forward inline: at each split the attention runs on the layer's own q, k, v into the
static output buffer, which the rest of the forward reads, as it does between replayed pieces.
The tests check that path on CPU against the eager forward, and the captured one on the GPU.
"""

import bisect
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.models.llama import AttentionSplit, LlamaAttention
from services.worker.engine.worker.cuda_graphs import StaticTokens
from services.worker.engine.worker.input_batch import to_device
from services.worker.engine.worker.step_inputs import StepInputs, TokenFill


class PiecewiseGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        sizes: tuple[int, ...],
        block_size: int,
        pad_block: int,
        dtype: torch.dtype,
        device: torch.device,
        capture: bool = True,
        num_groups: int = 1,
    ):
        self.model = model
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.device = device
        self.captured = capture
        top = self.sizes[-1]
        self.layers: list[LlamaAttention] = model.attention_layers()  # type: ignore[operator]
        heads, _, d = _dims(self.layers[0])
        self.tokens = StaticTokens(top, self.pad_slot, device, num_groups)
        # what crosses from the attention to the next piece; every layer uses the same one
        self.out = torch.zeros((top, heads, d), dtype=dtype, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.order: dict[int, list[LlamaAttention]] = {}  # the layers between the pieces
        # per size, per attention call: unowned views of the q, k, v its piece writes
        self.qkv: dict[int, list[QKV]] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # the last piece's output, per size

    @staticmethod
    def static_bytes(model: nn.Module, top: int, dtype: torch.dtype) -> int:
        """The static buffers' bytes for steps of up to ``top`` tokens (outside the pool)."""
        heads, _, d = _dims(model.attention_layers()[0])  # type: ignore[operator]
        return top * (3 * 8 + heads * d * dtype.itemsize)

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.num_tokens <= self.sizes[-1]

    # ---- capture ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # (a capture needs a stream other than the default)
            for size in reversed(self.sizes):  # largest first: the smaller reuse its memory
                meta = self._capture_metadata(size)
                # on the capture stream, as the capture will: kernels compiled, cuBLAS's
                # workspace for this stream allocated, the allocator settled
                self._forward(size, meta)
                stream.synchronize()
                self._capture_size(size, meta, pool)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _capture_size(self, size: int, meta: AttentionMetadata, pool: Any) -> None:
        pieces = [torch.cuda.CUDAGraph()]
        order: list[LlamaAttention] = []
        views: list[QKV] = []
        open_ = [False]  # a piece's capture has begun and not ended

        def begin() -> None:
            pieces[-1].capture_begin(pool=pool)
            open_[0] = True

        def end() -> None:
            open_[0] = False
            pieces[-1].capture_end()

        def split(layer: LlamaAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  _: AttentionMetadata) -> torch.Tensor:  # fmt: skip
            views.append((unowned_view(q), unowned_view(k), unowned_view(v)))
            end()
            order.append(layer)
            pieces.append(torch.cuda.CUDAGraph())
            begin()
            return self.out[:size]

        try:
            with self._splitting(split):
                begin()
                hidden = self._forward(size, meta)
                end()
        except Exception as e:
            if open_[0]:  # leave the stream out of capture mode
                with contextlib.suppress(Exception):
                    pieces[-1].capture_end()
            raise RuntimeError(
                f"piecewise CUDA graphs: capturing the {size}-token forward failed after "
                f"{len(order)} of its {len(self.layers)} attention calls ({e}); serve without "
                "--piecewise-cuda-graph-tokens (or with fewer tokens)"
            ) from e
        self.pieces[size], self.order[size], self.hidden[size] = pieces, order, hidden
        self.qkv[size] = views

    def _capture_metadata(self, size: int) -> AttentionMetadata:
        """One request of ``size`` tokens over the spare block (its writes land there): what
        the warm-up forward attends with. The captured forward runs no attention."""
        dev = self.device
        width = -(-size // self.block_size)
        groups = self.tokens.slot_mapping.shape[0]
        return AttentionMetadata.of_groups(
            torch.full((groups, 1, width), self.pad_block, dtype=torch.int32, device=dev),
            self.tokens.slot_mapping[:, :size],
            num_tokens=size,
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=dev),
            query_start_loc_cpu=[0, size],
            seq_lens_cpu=[size],
            max_query_len=size,
            max_seq_len=size,
        )

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, inputs: StepInputs, fill: TokenFill | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states of the padded batch [N, hidden], the sampled rows' token indices)
        for a step of at most the largest size's tokens. ``fill`` writes tokens the previous
        step sampled on the device into their rows' inputs."""
        n = inputs.num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.tokens.load(inputs, n, size, fill)  # (from pinned memory, without blocking)
        meta = inputs.metadata(self.device, self.tokens.slot_mapping[:, :size])
        logits_indices = to_device(inputs.logits_indices, torch.int64, self.device)
        if not self.captured:
            return self._split_inline(size, meta), logits_indices
        pieces = self.pieces[size]
        for piece, layer, (q, k, v) in zip(pieces, self.order[size], self.qkv[size], strict=False):
            piece.replay()
            self._attend(layer, size, q, k, v, meta.group(layer.kv_group))  # (its own tables)
        pieces[-1].replay()
        return self.hidden[size], logits_indices

    def _split_inline(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        def split(layer: LlamaAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
            self._attend(layer, size, q, k, v, meta)
            return self.out[:size]  # (what the next piece reads, as in replay)

        with self._splitting(split):
            return self._forward(size, meta)

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden: torch.Tensor = self.model(
            self.tokens.input_ids[:size], self.tokens.positions[:size], meta
        )
        return hidden

    def _attend(self, layer: LlamaAttention, size: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, meta: AttentionMetadata) -> None:  # fmt: skip
        """The layer's attention into the static output (its return value is not read: the
        captured piece after it reads the buffer)."""
        assert layer.kv_cache is not None, "KV cache not bound"
        layer.attn.forward(
            q, k, v, layer.kv_cache, meta, out=self.out[:size], store_kv=not layer.stores_kv
        )

    @contextlib.contextmanager
    def _splitting(self, split: AttentionSplit) -> Iterator[None]:
        for layer in self.layers:
            layer.split = split
        try:
            yield
        finally:
            for layer in self.layers:
                layer.split = None


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def unowned_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory (its offset, shape and strides) that keeps no reference to it:
    the allocator counts the memory free once ``t`` is gone. It stays valid as long as the
    graphs' pool does (the runner holds the graphs). (PyTorch's own CUDA-graph trees rebuild
    their outputs' views through the same call, ``torch._C``'s, as no public one exists.)"""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(alias, t.storage_offset(), t.shape, t.stride())


def _dims(layer: LlamaAttention) -> tuple[int, int, int]:
    """This rank's query heads, KV heads, and the head dim."""
    return layer.num_heads, layer.num_kv_heads, layer.head_dim
