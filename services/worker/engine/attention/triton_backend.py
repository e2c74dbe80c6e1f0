"""The Triton paged-attention backend (the GPU default). Requests with more than one query
(prefill chunks) go through ``_prefill``; requests with one (decode rows: the whole batch of a
decode step, the trailing rows of a mixed one) through ``_decode``, which reads each kv head's
K/V once for its whole query group, split over the context when the rows are too few to fill
the GPU, then ``_combine``. A layer's sliding window and sinks reach the kernels as constexpr
switches (ops/attention.py); with a window, the decode split rule and launch follow the keys a
row reads (``attended``: at most W), not its context.

It needs only device values from the metadata plus ``max_query_len`` and ``max_seq_len`` —
which the CUDA-graph path pins to 1 and ``max_model_len`` — so decode can be captured.
On CPU the same kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI
checks them on every commit.

Launch configurations: the class defaults below, or those measured on a GPU model by
``benchmarks/kernels/attention_sweep.py --tune`` and kept in ``configs/<GPU name>.json`` beside this
file (read once per process, for the GPU the backend runs on).
"""

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import triton

from services.worker.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
    write_kv,
)
from services.worker.engine.ops import tuned_configs
from services.worker.engine.ops.attention import (
    CONTIGUOUS_BLOCK,
    LOG2E,
    _combine,
    _decode,
    _prefill,
    _write_kv,
    contiguous_prefill,
)
from services.worker.engine.ops.dependent_launch import launch_options

MAX_SPLITS = 16
TOKENS_PER_SPLIT = 512  # below this a split's work is too small to pay for the combine step
CONFIG_DIR = tuned_configs.CONFIG_DIR / "attention"


def tuned_config(device_name: str) -> dict[str, Any]:
    """The measured launch configuration of a GPU model ({} when none was measured)."""
    return tuned_configs.read(CONFIG_DIR, device_name)


def num_decode_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    waves: int = 1,
    max_splits: int | None = None,
    tokens_per_split: int | None = None,
) -> int:
    """A power of two: enough programs to fill the GPU ``waves`` times over, none shorter than
    ``tokens_per_split``, at most ``max_splits``."""
    max_splits = MAX_SPLITS if max_splits is None else max_splits
    tokens_per_split = TOKENS_PER_SPLIT if tokens_per_split is None else tokens_per_split
    splits = 1
    while (
        splits < max_splits
        and num_reqs * num_kv_heads * splits < waves * num_sms
        and max_seq_len > 2 * splits * tokens_per_split
    ):
        splits *= 2
    return splits


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    # GPU launch configurations (benchmarks/kernels/attention_sweep.py measures the
    # alternatives; its --prefill mode those of the prefill kernel)
    DECODE_BLOCK_N = 64
    DECODE_WARPS = 4
    DECODE_STAGES = 2
    # ... when the context is split over more than DECODE_LONG_CONTEXT tokens (few rows, long
    # contexts); None: as above. Up to DECODE_LONG_CONTEXT (None: no limit) a split context
    # takes the launch above: its splits are short, and on the H200 the split launch's deeper
    # pipeline made a batch-1 step of the 8B shape 0.12–0.36 ms slower (bf16) at 128–16k tokens
    # of context, 0.09 ms faster at 32k (docs/performance.md)
    DECODE_SPLIT_BLOCK_N: int | None = None
    DECODE_SPLIT_WARPS: int | None = None
    DECODE_SPLIT_STAGES: int | None = None
    # a launch's context in LANES interleaved streams of BLOCK_N keys, each with its own
    # softmax state (ops.attention._attend_lanes; 1: one stream, the tile split over warps),
    # and the keys PREFETCH tiles on asked of L2 (0: none); the split launch's own, or None
    DECODE_LANES = 1
    DECODE_PREFETCH = 0
    DECODE_SPLIT_LANES: int | None = None
    DECODE_SPLIT_PREFETCH: int | None = None
    DECODE_LONG_CONTEXT: int | None = None
    PREFILL_BLOCK_M = 64
    PREFILL_BLOCK_N = 64
    PREFILL_WARPS = 4
    PREFILL_STAGES = 2

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
        self.group = num_heads // num_kv_heads
        self.block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
        self._num_sms: int | None = None
        self._split_rule: dict[str, int] = {}
        self._tuned = False

    def tune(self, device: torch.device) -> None:
        """Take the measured configuration of this GPU over the class defaults, once (the
        first launch does, when nothing did before). (A sweep that sets its own configurations
        marks the instance tuned first: ``use_config``.)"""
        self._tuned = True
        if device.type == "cuda":
            self.apply_config(tuned_config(torch.cuda.get_device_name(device)))

    def use_config(self, config: dict[str, Any]) -> None:
        """``config`` (a tuned-config document: a sweep's, a test's) instead of this GPU's
        measured configuration: applied now, and ``tune`` takes nothing over it."""
        self._tuned = True
        self.apply_config(config)

    @property
    def split_rule(self) -> dict[str, int]:
        """What a tuned configuration sets of ``num_decode_splits``'s rule (``waves``,
        ``max_splits``, ``tokens_per_split``; {}: its defaults)."""
        return dict(self._split_rule)

    TUNABLE: ClassVar[dict[str, tuple[str, ...]]] = {
        "prefill": ("block_m", "block_n", "warps", "stages"),
        "decode": (
            "block_n",
            "warps",
            "stages",
            "waves",
            "max_splits",
            "tokens_per_split",
            "split_block_n",
            "split_warps",
            "split_stages",
            "long_context",
            "lanes",
            "prefetch",
            "split_lanes",
            "split_prefetch",
        ),
    }
    SPLIT_RULE = ("waves", "max_splits", "tokens_per_split")

    def apply_config(self, config: dict[str, Any]) -> None:
        """Set the launch configuration of this head dim from a tuned-config document (its
        other head dims and its ``measured`` record are ignored; an unknown key is an error)."""
        for kind, keys in self.TUNABLE.items():
            values = config.get(kind, {}).get(f"head_dim_{self.head_dim}", {})
            unknown = set(values) - set(keys)
            if unknown:
                raise ValueError(f"unknown {kind} launch settings {sorted(unknown)}")
            for key, value in values.items():
                if key in self.SPLIT_RULE:
                    self._split_rule[key] = int(value)
                else:
                    setattr(self, f"{kind.upper()}_{key.upper()}", int(value))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
        store_kv: bool = True,
    ) -> torch.Tensor:
        if store_kv:
            self.write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        if metadata.max_query_len == 1:
            self._decode(q, kv_cache, metadata, out)
            return out
        num_reqs = metadata.seq_lens.shape[0]
        decodes = metadata.num_decodes
        self._prefill(q, kv_cache, metadata, out, num_reqs - decodes)
        if decodes:
            self._decode(q, kv_cache, metadata, out, num_reqs - decodes)
        return out

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv: LayerKVCache, slot_mapping: torch.Tensor
    ) -> None:
        """Store the step's keys and values [T, kv heads, D] at their slots: one launch."""
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("new keys and values need a contiguous head dimension")
        if kv.is_fp8 and not k.is_cuda:
            # Triton's interpreter casts some float32 values to e4m3 toward zero (and drops a
            # round-up's carry into the next power of two), where the GPU rounds to nearest:
            # on CPU the cache takes PyTorch's rounding, the reference's
            write_kv(k, v, kv, slot_mapping)
            return
        _write_kv[(k.shape[0], self.num_kv_heads)](
            k, v, kv.key, kv.value, slot_mapping, float(kv.k_scale), float(kv.v_scale),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kv.key.stride(0), kv.key.stride(1), kv.key.stride(2),
            KV_BLOCK=kv.block_size, HEAD_DIM=self.head_dim, BLOCK_D=self.block_d,
            **launch_options(k),
        )  # fmt: skip

    def _common(
        self, q: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata, out: torch.Tensor
    ) -> dict[str, object]:
        if q.stride(-1) != 1 or kv.key.stride(-1) != 1 or kv.key.stride() != kv.value.stride():
            raise ValueError("the Triton backend needs a contiguous head dimension")
        return {
            "stride_qt": q.stride(0), "stride_qh": q.stride(1),
            "stride_ot": out.stride(0), "stride_oh": out.stride(1),
            "stride_kb": kv.key.stride(0), "stride_ks": kv.key.stride(1),
            "stride_kh": kv.key.stride(2), "stride_bt": meta.block_tables.stride(0),
            # an FP8 cache's scales: k's folded into the scores' scale, v's into the output
            "qk_scale": self.scale * LOG2E * kv.k_scale, "v_scale": float(kv.v_scale),
            "KV_BLOCK": kv.block_size, "GROUP": self.group,
            "HEAD_DIM": self.head_dim, "BLOCK_D": self.block_d,
            "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
            # bf16 queries over an FP8 cache: the dots in float16, which e4m3 widens to
            # directly (ops.attention._compute_dtype)
            "DOT_F16": kv.is_fp8 and q.dtype == torch.bfloat16,
            "GPU": q.is_cuda,  # PTX where the interpreter has none (ops.attention._widen_values)
            # a layer's window and sinks; neither: the dense kernels (any tensor stands for
            # absent sinks: the kernels do not read it)
            "window": self.sliding_window or 0, "HAS_WINDOW": self.sliding_window is not None,
            "Sinks": meta.seq_lens if self.sinks is None else self.sinks,
            "HAS_SINKS": self.sinks is not None,
        }  # fmt: skip

    def attend_contiguous(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The prefill kernel (``contiguous_prefill``: no [H, Q, L] scores), which reads keys and
        values through one layout: both go into one buffer of the wider's width, the values in
        its first DV columns, which are all it reads of them (zeros past narrower keys' and the
        queries' own width add nothing)."""
        seq_len, heads, dim = k.shape
        v_dim = v.shape[-1]
        width = max(dim, v_dim)
        length = -(-seq_len // CONTIGUOUS_BLOCK) * CONTIGUOUS_BLOCK
        kv = q.new_empty(2, length, heads, width)  # (rows from seq_len on: never read)
        kv[0, :seq_len, :, :dim] = k
        kv[1, :seq_len, :, :v_dim] = v
        if width > dim:
            kv[0, :seq_len, :, dim:] = 0.0
            q = F.pad(q, (0, width - dim))
        return contiguous_prefill(q.contiguous(), kv[0], kv[1, :, :, :v_dim], seq_len, self.scale)

    def _prefill(
        self,
        q: torch.Tensor,
        kv: LayerKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        num_reqs: int,
    ) -> None:
        """The first ``num_reqs`` requests of the batch."""
        if not self._tuned:
            self.tune(q.device)
        block_m, block_n = (self.PREFILL_BLOCK_M, self.PREFILL_BLOCK_N) if q.is_cuda else (16, 16)
        grid = (self.num_heads, triton.cdiv(meta.max_query_len, block_m), num_reqs)
        launch = {"num_warps": self.PREFILL_WARPS, "num_stages": self.PREFILL_STAGES}
        _prefill[grid](
            q, kv.key, kv.value, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DV=self.head_dim, BLOCK_DV=self.block_d,
            **self._common(q, kv, meta, out), **(launch if q.is_cuda else {}),
        )  # fmt: skip

    def _decode(
        self,
        q: torch.Tensor,
        kv: LayerKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        first: int = 0,
    ) -> None:
        """The requests from ``first`` on, one query each, in ``meta.decode_order``."""
        if not self._tuned:
            self.tune(q.device)
        num_reqs = meta.seq_lens.shape[0] - first
        attended = self.attended(meta.max_decode_seq_len)  # a window's keys at most
        splits = num_decode_splits(
            num_reqs, self.num_kv_heads, attended, self._sms(q.device), **self._split_rule
        )
        part_acc = part_ml = out  # unused placeholders when there is a single split
        if splits > 1:
            shape = (num_reqs, self.num_heads, splits)
            part_acc = torch.empty((*shape, self.block_d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=q.device)
        common = self._common(q, kv, meta, out)
        order = meta.decode_order
        grid = (num_reqs, self.num_kv_heads, splits)
        if order is not None:
            grid = (self.num_kv_heads, num_reqs, splits)
        _decode[grid](
            q, kv.key, kv.value, out, part_acc, part_ml,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, first,
            order if order is not None else meta.seq_lens, ORDERED=order is not None,
            GROUP_PAD=max(16, triton.next_power_of_2(self.group)),
            NUM_SPLITS=splits, **common, **self.decode_launch(q, splits, attended),
        )  # fmt: skip
        if splits > 1:
            _combine[(num_reqs, self.num_heads)](
                out, part_acc, part_ml, meta.query_start_loc, first, common["Sinks"],
                out.stride(0), out.stride(1),
                HEAD_DIM=self.head_dim, BLOCK_D=self.block_d, NUM_SPLITS=splits,
                HAS_SINKS=self.sinks is not None, **launch_options(q),
            )  # fmt: skip

    def decode_launch(
        self, q: torch.Tensor, splits: int, max_seq_len: int
    ) -> dict[str, int | bool]:
        """The decode kernel's launch settings for queries ``q`` in ``splits`` splits of a
        context of up to ``max_seq_len`` tokens (Triton's interpreter: its block and lanes)."""
        long = splits > 1 and self.is_long_context(max_seq_len)
        lanes, prefetch = self.decode_streams()[1 if long else 0]
        if not q.is_cuda:
            return {"BLOCK_N": 16, "LANES": lanes}
        one, split = self.decode_launches()
        block_n, warps, stages = split if long else one
        return {
            "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "LANES": lanes,
            "PREFETCH": prefetch, **launch_options(q),
        }  # fmt: skip

    def decode_launches(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(BLOCK_N, warps, stages) of the decode kernel: one range, and long split ones."""
        one = self.DECODE_BLOCK_N, self.DECODE_WARPS, self.DECODE_STAGES
        split = (self.DECODE_SPLIT_BLOCK_N, self.DECODE_SPLIT_WARPS, self.DECODE_SPLIT_STAGES)
        return one, (split[0] or one[0], split[1] or one[1], split[2] or one[2])

    def decode_streams(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(LANES, PREFETCH) of the decode kernel: one range, and long split ones."""
        one = self.DECODE_LANES, self.DECODE_PREFETCH
        lanes, prefetch = self.DECODE_SPLIT_LANES, self.DECODE_SPLIT_PREFETCH
        return one, (lanes or one[0], one[1] if prefetch is None else prefetch)

    def is_long_context(self, max_seq_len: int) -> bool:
        """Whether a split context of ``max_seq_len`` tokens takes the split launch."""
        return self.DECODE_LONG_CONTEXT is None or max_seq_len > self.DECODE_LONG_CONTEXT

    def decode_graph_contexts(
        self, num_reqs: int, max_model_len: int, device: torch.device
    ) -> tuple[int, ...]:
        """Two where ``num_reqs`` rows split a context of ``max_model_len`` tokens and the
        split launch, of its own, starts above ``DECODE_LONG_CONTEXT``: contexts up to it, and
        the rest (a graph keeps its launch). One otherwise."""
        if not self._tuned:
            self.tune(device)
        long = self.DECODE_LONG_CONTEXT
        one, split = self.decode_launches()
        attended = self.attended(max_model_len)  # the launch follows the keys a row reads
        splits = num_decode_splits(
            num_reqs, self.num_kv_heads, attended, self._sms(device), **self._split_rule
        )
        same = one == split and self.decode_streams()[0] == self.decode_streams()[1]
        if splits == 1 or long is None or long >= attended or same:
            return (max_model_len,)
        return (long, max_model_len)

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            cuda = device.type == "cuda"
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if cuda else 8
            )
        return self._num_sms
