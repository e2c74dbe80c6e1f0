"""The FlashAttention backend: FlashAttention-4 (PyPI ``flash-attn-4``, a CuTe DSL kernel with
a Hopper forward path) for the prefill rows of a step, the Triton kernels for the rest.

- Prefill rows (prefill chunks, also over a cached prefix): one varlen call, reading the paged
  KV cache in place through the block table (``page_table``; no gather, no copy of K/V).
  FlashAttention's causal mask is aligned to the end of each sequence, which is exactly
  "request i's queries are the last q_len_i of its seq_lens[i] positions".
- Decode rows (a decode step, the trailing rows of a mixed step): the Triton split-over-context
  decode kernel, which CUDA graphs capture, as in the Triton backend.
- K/V writes: the Triton backend's ``write_kv``; the cache layout (and what NIXL pulls) is
  unchanged.
- A layer's sliding window of W tokens and its sinks (Gemma 3's and gpt-oss's windowed
  layers, gpt-oss's sinks) are FlashAttention's local mask, ``window_size_left`` W − 1 to the
  left of each query (the Triton kernels' rule: a query at p sees the keys after p − W), and
  its ``learnable_sink`` (a logit per head joining each row's softmax denominator). The
  block table's entries behind a window are the spare page past the pool
  (``KVCacheBlocks.null_block_id``, where CUDA-graph padding rows write) or a released page's
  stale id: finite values either way, which FlashAttention skips (tiles wholly behind the
  window) or masks.
- Multi-head latent attention's prefill (``attend_contiguous``: a context decompressed from
  latents, not paged): one FlashAttention call over the request as a batch of one, the keys
  and values each at their own width (DeepSeek's 192 and 128).
- float32 (which FlashAttention does not run), head dims its paged path does not take
  (other than 64, 128, 256), an FP8 cache and a Gated DeltaNet model's cache (its pages'
  other bytes may be a state's) go to the Triton prefill kernel.

FlashAttention reads whole pages: rows past a sequence's end in its last page are masked but
must be finite, which holds since the KV cache is allocated zeroed (kv_cache/layout.py) and
only ever holds finite keys and values.

Imported only when this backend is chosen: CPU installs and CI do without the package.
"""

import importlib.util
import inspect
import warnings
from typing import Any

import torch

from services.worker.engine.attention.backend import AttentionMetadata, LayerKVCache
from services.worker.engine.attention.triton_backend import TritonAttentionBackend


def available() -> bool:
    """FlashAttention-4 is importable and this is a Hopper GPU (its fast forward path)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


PAGED_HEAD_DIMS = (64, 128, 256)
# the (keys, values) widths its forward over contiguous keys and values (``attend_contiguous``)
# is given on Hopper: a dense head's, and DeepSeek's MLA prefill (192-wide keys, 128-wide values:
# the pair its interface names); others run the Triton prefill kernel
CONTIGUOUS_HEAD_DIMS = frozenset({(d, d) for d in PAGED_HEAD_DIMS} | {(192, 128)})


class FlashAttnBackend(TritonAttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True  # decode runs the Triton kernel; prefill is never captured
    # write into the step's output (FlashAttention's forward with ``out``) rather than copy
    # its result in: False gives the public wrapper's path, for benchmarks/long_context.py's
    # ``flash_attn_copy`` variant (2k prompts ran 5.6 ms slower in the run that added it)
    WRITE_IN_PLACE = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, sinks)
        with warnings.catch_warnings():  # its compiler's names it deprecated itself
            warnings.simplefilter("ignore", DeprecationWarning)
            from flash_attn.cute import (  # the optional dependency
                flash_attn_func,
                flash_attn_varlen_func,
                interface,
            )

        self._varlen: Any = flash_attn_varlen_func
        self._dense: Any = flash_attn_func
        # the forward under the autograd wrapper, which writes into our output (a 32k-token
        # prompt's copy of it cost 0.1 ms a layer); the pinned version has it, others may not
        fwd = getattr(interface, "_flash_attn_fwd", None)
        takes_out = fwd is not None and "out" in inspect.signature(fwd).parameters
        self._fwd: Any = fwd if takes_out else None
        # its paged path needs a head dim that fills its tiles; others run the Triton prefill
        self._paged_ok = head_dim in PAGED_HEAD_DIMS

    def _prefill(
        self,
        q: torch.Tensor,
        kv: LayerKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        num_reqs: int,
    ) -> None:
        """The first ``num_reqs`` requests of the batch, in one FlashAttention call."""
        if (
            q.dtype not in (torch.bfloat16, torch.float16)
            or not q.is_cuda
            or not self._paged_ok
            or kv.is_fp8  # an FP8 cache: the Triton prefill reads it
            or kv.holds_states  # (it reads whole pages: see LayerKVCache.holds_states)
        ):
            super()._prefill(q, kv, meta, out, num_reqs)
            return
        n = meta.query_start_loc_cpu[num_reqs]
        args = {
            "cu_seqlens_q": meta.query_start_loc[: num_reqs + 1],
            "seqused_k": meta.seq_lens[:num_reqs],
            "max_seqlen_q": meta.max_query_len, "max_seqlen_k": meta.max_seq_len,
            "page_table": meta.block_tables[:num_reqs],
            "softmax_scale": self.scale, "causal": True, "learnable_sink": self.sinks,
        }  # fmt: skip
        left = None if self.sliding_window is None else self.sliding_window - 1
        if self._fwd is not None and self.WRITE_IN_PLACE:
            self._fwd(q[:n], kv.key, kv.value, out=out[:n], window_size_left=left, **args)
            return
        result = self._varlen(q[:n], kv.key, kv.value, window_size=(left, None), **args)
        out[:n].copy_(result[0] if isinstance(result, tuple) else result)

    def attend_contiguous(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One FlashAttention call over the request as a batch of one (its causal mask aligned to
        the context's end: the queries are its last positions), keys and values each at their
        own width; the Triton prefill kernel where FlashAttention does not take them."""
        widths = (k.shape[-1], v.shape[-1])
        if (
            q.dtype not in (torch.bfloat16, torch.float16)
            or not q.is_cuda
            or widths not in CONTIGUOUS_HEAD_DIMS
        ):
            return super().attend_contiguous(q, k, v)
        args = {"softmax_scale": self.scale, "causal": True}
        if self._fwd is not None and self.WRITE_IN_PLACE:
            out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
            self._fwd(q[None], k[None], v[None], out=out[None], **args)
            return out
        result = self._dense(q[None], k[None], v[None], **args)
        return (result[0] if isinstance(result, tuple) else result)[0]
