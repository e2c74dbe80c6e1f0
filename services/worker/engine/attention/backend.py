"""The attention-backend seam: what the model runner hands a backend each step, and the contract
every backend (torch reference, Triton, flash-attn) must keep.

The batch is flattened ("varlen"): the scheduled tokens of every request sit end to end.

    tokens:          | req0: 5 new tokens | req1: 1 (decode) | req2: 3 (prefill chunk) |
    query_start_loc: 0                    5                  6                         9
    seq_lens:        req0: 5              req1: 37           req2: 19   (cached + new)

Request *i*'s queries are the last ``q_len_i`` of its ``seq_lens[i]`` positions; each attends
causally to every position before it, read from the paged cache through ``block_tables[i]``.

A layer may narrow that (Hugging Face's semantics, ``masking_utils.sliding_window_overlay`` and
gpt-oss's ``eager_attention_forward``):

- a sliding window of W: the query at position p sees the keys in (p - W, p], W keys counting
  its own (fewer near the start)

      keys:    0 1 2 3 4 5 6 7 8 9
      p = 8, W = 4:      . . . . . x x x x .     (keys 5..8)

- sinks: one logit per query head that joins the softmax's denominator and has no value, so a
  head can attend to "nothing": out = sum_k e^(s_k) v_k / (e^(sink_h) + sum_k e^(s_k)).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.engine.quantization.fp8_math import to_e4m3

# the bytes of scores one call of ``AttentionBackend.attend_contiguous``'s PyTorch path builds
CONTIGUOUS_SCORES = 1 << 30


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; read by every layer. Device tensors unless noted."""

    num_tokens: int  # length of the flattened batch: the scheduled tokens (and any padding rows)
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]: request i's tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # int32 [num_reqs]: cached + scheduled tokens per request
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]: KV block ids, padded past the end
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset to write K/V
    query_start_loc_cpu: list[int]  # host copies, for backends that loop over requests
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # int32 [num_decodes] or None: the trailing decode rows, as offsets from the first of them,
    # longest context first. A backend may start their work in this order, so that the last
    # programs to run are short ones (the longest-first rule); None is batch order.
    decode_order: torch.Tensor | None = None
    # The trailing requests with one query each (a mixed step's decode rows, which the model
    # runner puts last) and their longest context: a backend may serve them as decode.
    num_decodes: int = field(init=False)
    max_decode_seq_len: int = field(init=False)
    # every KV cache group's metadata, in group order, where the model has more than one
    # (kv_cache/groups.py): the same step, each group's block tables and slots
    groups: "tuple[AttentionMetadata, ...]" = field(default=(), repr=False)
    # a recurrent group's per-request (read page, write page, has a state), computed by its
    # first Gated DeltaNet layer for the others (models/layers/gated_delta_net.state_pages)
    state_pages: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = field(
        default=None, repr=False
    )

    def __post_init__(self) -> None:
        qsl, n = self.query_start_loc_cpu, len(self.query_start_loc_cpu) - 1
        d = 0
        while d < n and qsl[n - d] - qsl[n - d - 1] == 1:
            d += 1
        self.num_decodes = d
        self.max_decode_seq_len = max(self.seq_lens_cpu[n - d :], default=0)

    def group(self, g: int) -> "AttentionMetadata":
        """The metadata a layer of KV cache group ``g`` attends with."""
        return self.groups[g] if self.groups else self

    @staticmethod
    def of_groups(
        block_tables: torch.Tensor, slot_mapping: torch.Tensor, **step: Any
    ) -> "AttentionMetadata":
        """One step's metadata over every KV cache group: ``block_tables`` [groups, reqs,
        blocks] and ``slot_mapping`` [groups, tokens] (a step's tokens have a slot in each
        group's blocks); the rest (``step``) is the same for all. Group 0's is returned."""
        metas = [
            AttentionMetadata(block_tables=block_tables[g], slot_mapping=slot_mapping[g], **step)
            for g in range(block_tables.shape[0])
        ]
        if len(metas) > 1:
            metas[0].groups = tuple(metas)
        return metas[0]


@dataclass
class LayerKVCache:
    """One layer's view of the shared KV tensor: two strided views [num_blocks, block_size, H, D].

    The underlying tensor keeps a whole block contiguous across layers (see kv_cache/layout.py),
    so these views are not contiguous; backends must honour their strides.
    """

    key: torch.Tensor
    value: torch.Tensor
    # an FP8 (e4m3) cache holds k / k_scale and v / v_scale (one scale per layer)
    k_scale: float = 1.0
    v_scale: float = 1.0
    # its pages may have held a recurrent state (a Gated DeltaNet model's pool: float32 bytes,
    # not finite keys and values, past a sequence's end in its last page): a kernel that reads
    # whole pages must not
    holds_states: bool = False

    @property
    def block_size(self) -> int:
        return int(self.key.shape[1])

    @property
    def is_fp8(self) -> bool:
        return self.key.dtype == torch.float8_e4m3fn

    def read(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered cache entries as float32 (an FP8 cache's dequantized)."""
        if self.is_fp8:
            return keys.float() * self.k_scale, values.float() * self.v_scale
        return keys.float(), values.float()


class AttentionBackend(ABC):
    """One instance per attention layer. Called once per layer per step, inside the forward pass.

    ``forward`` must (1) write this step's k/v into ``kv_cache`` at ``metadata.slot_mapping``
    (unless ``store_kv`` is False: a kernel before it stored them, the fused rotary of
    ``models/layers/rotary.py``, and k and v are then not read) and (2) return causal attention
    of ``q`` over each request's whole context (cached + new; only its window's keys with a
    sliding window, with the sinks in the softmax), in ``out`` when given (the static
    buffer of a piecewise CUDA graph: worker/piecewise_graphs.py).
    Rows of ``q`` past ``metadata.query_start_loc[-1]`` are padding: their keys and values go
    to the slots ``slot_mapping`` names for them, and their output is left as it is. It must not
    allocate per-step state that outlives the call and must not synchronise with the host except
    where a reference implementation says so.
    """

    name: str = "abstract"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """``sliding_window``: W, the query at position p sees the keys in (p - W, p] (None:
        all before it). ``sinks``: [num_heads] logits (this rank's heads), one extra term per
        head in the softmax's denominator with no value (None: none). The backend keeps a
        reference to ``sinks``, not a copy: pass the layer's parameter itself and load it in
        place (``copy_``, or ``Module.to``, which keeps the parameter object); it is read at
        every forward, in float32."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.sinks = sinks

    def attended(self, seq_len: int) -> int:
        """How many keys the last query of a ``seq_len``-token context sees."""
        return seq_len if self.sliding_window is None else min(seq_len, self.sliding_window)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written and returned
        store_kv: bool = True,  # False: k and v are in the cache already
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def attend_contiguous(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One request's causal attention over keys and values that are not paged (multi-head
        latent attention's prefill, over a context decompressed from its latents): q [Q, H, D],
        the last Q of the context's L positions; k [L, H, D]; v [L, H, DV], DV may differ from D
        (DeepSeek's 192-wide keys, 128-wide values). Returns [Q, H, DV] in q's dtype. No window,
        no sinks, no cache: nothing is stored.

        Here PyTorch's attention with a mask, over as many queries at a time as keep each call's
        scores within ``CONTIGUOUS_SCORES`` (its fallback for these head sizes and a mask builds
        every head's [queries, L] scores: 64 GiB at once for 32k tokens and 16 heads); the
        kernel backends override it."""
        q_len, seq_len, heads = q.shape[0], k.shape[0], q.shape[1]
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        step = max(1, CONTIGUOUS_SCORES // (heads * seq_len * q.element_size()))
        out = q.new_empty(q_len, heads, v.shape[-1])
        for start in range(0, q_len, step):
            end = min(q_len, start + step)
            q_pos = torch.arange(seq_len - q_len + start, seq_len - q_len + end, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale
            ).transpose(0, 1)
        return out

    def decode_graph_contexts(
        self, num_reqs: int, max_model_len: int, device: torch.device
    ) -> tuple[int, ...]:
        """The longest contexts a decode CUDA graph of ``num_reqs`` rows is captured for,
        ascending, the last ``max_model_len``: a graph captured at a context serves every step
        whose longest context is no longer (worker/cuda_graphs.py). More than one where the
        backend launches its decode kernel differently for shorter contexts; a captured graph
        keeps the launch it was captured with."""
        return (max_model_len,)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's keys and values into their cache slots (strided views, in place)."""
    block_size = kv_cache.block_size
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    if kv_cache.is_fp8:  # e4m3 of k / k_scale, saturated at its largest finite value
        k, v = to_e4m3(k, kv_cache.k_scale), to_e4m3(v, kv_cache.v_scale)
    kv_cache.key[blocks, offsets] = k.to(kv_cache.key.dtype)
    kv_cache.value[blocks, offsets] = v.to(kv_cache.value.dtype)
