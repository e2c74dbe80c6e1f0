"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 and Qwen3-Next (after Hugging
Face's ``Qwen3_5GatedDeltaNet`` and ``Qwen3NextGatedDeltaNet``), on the flattened batch and a
state kept in the KV cache's pages.

    x ─ in_proj_qkvz ─┬─ q, k, v ─ causal conv (kernel K, SiLU) ─ L2-norm q, k ─┐
                      └─ z ──────────────────────────────┐                      │
    x ─ in_proj_ba ───┬─ b ─ σ ──────────────────────────│─── β ────────────────┤ gated delta rule
                      └─ a ─ -exp(A_log) · softplus(a + dt_bias) ─ g ───────────┘ (ops/gated_delta)
                                                         │                          │ o
                                                         └─ RMSNorm(o) · SiLU(z) ◄──┘ ─ out_proj ─►

The state a request carries from step to step is per layer: the convolution's last K - 1
inputs and, per value head, the delta rule's [key dim × value dim] matrix, in float32. It
lives in one layer slot of a page of the layer's recurrent KV cache group
(``kv_cache/groups.py``): the page at the block of the request's last computed token. A step
reads the state of the page at block (c - 1) // bs (none at c = 0) and writes the page at
block (end - 1) // bs (``state_pages``).

Tensor parallelism splits the heads: the projections' q, k, v, z, b and a parts, the
convolution's channels of each, ``A_log`` and ``dt_bias`` (each rank its heads'); the output
projection is row-parallel.
"""

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.distributed import tp_rank, tp_size
from services.worker.engine.model_config import ArchConfig, LinearAttentionConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from services.worker.engine.models.weights import Loaded, copy_weight, full
from services.worker.engine.ops.gated_delta import causal_conv1d, gated_delta_rule
from services.worker.engine.quantization.base import Shard
from services.worker.engine.quantization.registry import linear_method

# the state's dtype whatever the model's (a bfloat16 state would round the delta rule's sums
# at every step; Qwen3.5's checkpoints ask for float32, ``mamba_ssm_dtype``): the page slot's
# bytes, seen as float32
STATE_DTYPE = torch.float32


class GatedDeltaNetProjection(MergedColumnParallelLinear):
    """Parts of Gated DeltaNet's input projection in one GEMM, each rank its heads of each:
    q ‖ k ‖ v ‖ z (``qkvz``, in the model's linear method: FP8 checkpoints quantize it, unless
    they keep it float, as llm-compressor's recipes do) or
    b ‖ a (``ba``, [Hv] rows each: always in the model's dtype, as the published FP8
    checkpoints keep them, in ``modules_to_not_convert``: they feed the gates' sigmoid and
    softplus, and are narrower than a 128-row block).

    The checkpoints' spellings (a shard id of the packed-module table): a part's own tensor
    (its index: Qwen3.5's ``in_proj_z`` 3, ``in_proj_b`` 0, ``in_proj_a`` 1); ``"qkv"``,
    Qwen3.5's ``in_proj_qkv``, q, k and v one after another; ``"qkvz"`` and ``"ba"``,
    Qwen3-Next's, stored by key head: for each key head g in turn, its q and k and the v and z
    (b and a) of the r = Hv / Hk value heads it serves (g·r to g·r + r - 1). Every spelling
    loads as runs of rows (``Shard``), so that an FP8 checkpoint's scales follow their
    weights' rows (a block scale by the block its row falls in)."""

    def __init__(self, hidden: int, la: LinearAttentionConfig, parts: str, ctx: ModelContext):
        kd, vd, hv = la.key_dim, la.value_dim, la.num_value_heads
        self.la = la
        self.full_sizes = [kd, kd, vd, vd] if parts == "qkvz" else [hv, hv]
        method = ctx.linear if parts == "qkvz" else linear_method(None, ctx.kernels)
        super().__init__(hidden, self.full_sizes, False, method)
        # a spelling of several parts → (its parts, whether stored by key head)
        self.spellings: dict[str | int, tuple[list[int], bool]] = (
            {"qkv": ([0, 1, 2], False), "qkvz": ([0, 1, 2, 3], True)}
            if parts == "qkvz" else {"ba": ([0, 1], True)}
        )  # fmt: skip

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        if shard_id not in self.spellings:
            super().weight_loader(param, loaded, shard_id)
            return
        parts, by_key_head = self.spellings[shard_id]
        rows = sum(self.full_sizes[p] for p in parts)
        if param is self.weight and (loaded.dim() != 2 or loaded.shape[0] != rows):
            raise ValueError(f"a weight of shape {tuple(loaded.shape)}, expected {rows} rows")
        for shard in self._runs(parts, by_key_head, rows):
            self.load_shard(param, loaded, shard)

    def _runs(self, parts: list[int], by_key_head: bool, rows: int) -> list[Shard]:
        """Where this rank's rows of a tensor holding ``parts`` (``rows`` in all) go."""
        dst = [sum(self.out_sizes[:p]) for p in range(len(self.out_sizes))]
        if not by_key_head:  # one part after another: each rank its slice of each
            runs, src = [], 0
            for p in parts:
                mine = self.out_sizes[p]
                runs.append(Shard(dst[p], mine, src + self.tp_rank * mine, rows))
                src += self.full_sizes[p]
            return runs
        heads = self.la.num_key_heads
        mine = heads // self.tp_size  # this rank's key heads: whole groups of rows
        per = [self.full_sizes[p] // heads for p in parts]  # a part's rows in one group
        runs = []
        for j in range(mine):
            group = (self.tp_rank * mine + j) * (rows // heads)  # the group's first row
            for p, size, offset in zip(parts, per, accumulate([0, *per]), strict=False):
                runs.append(Shard(dst[p] + j * size, size, group + offset, rows))
        return runs


class ShortConv(nn.Module):
    """The depthwise causal convolution's weight [channels, K] (the checkpoint's
    ``conv1d.weight`` [channels, 1, K]): each rank the channels of its q, k and v heads."""

    def __init__(self, la: LinearAttentionConfig):
        super().__init__()
        tp = tp_size()
        self.parts = [la.key_dim, la.key_dim, la.value_dim]  # over all ranks
        channels = la.conv_dim // tp
        self.weight = nn.Parameter(torch.empty(channels, la.conv_kernel), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        rank, tp = tp_rank(), tp_size()
        dst = src = 0
        for size in self.parts:
            mine = size // tp
            piece = full(loaded.narrow(0, src + rank * mine, mine)).reshape(mine, -1)
            copy_weight(param.data[dst : dst + mine], piece)
            dst, src = dst + mine, src + size


class HeadParameter(nn.Module):
    """A per-value-head vector (``A_log``, ``dt_bias``): each rank its heads'."""

    @staticmethod
    def load(param: nn.Parameter, loaded: Loaded) -> None:
        mine = param.shape[0]
        copy_weight(param, loaded.narrow(0, tp_rank() * mine, mine))


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (float32, weight applied in the input's dtype), then
    · SiLU(z) in float32 (``Qwen3_5RMSNormGated``: its weight is not centred on 0)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return (out * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__()
        la = arch.linear_attention
        assert la is not None
        tp = tp_size()
        for name, n in (("linear_num_key_heads", la.num_key_heads),
                        ("linear_num_value_heads", la.num_value_heads)):  # fmt: skip
            if n % tp:
                raise ValueError(f"{name}={n} does not split over tensor_parallel_size={tp}")
        self.la = la
        self.num_k_heads, self.num_v_heads = la.num_key_heads // tp, la.num_value_heads // tp
        self.dk, self.dv = la.key_head_dim, la.value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.dk, self.num_v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = GatedDeltaNetProjection(arch.hidden_size, la, "qkvz", ctx)
        self.in_proj_ba = GatedDeltaNetProjection(arch.hidden_size, la, "ba", ctx)
        self.conv1d = ShortConv(la)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, arch.rms_norm_eps)
        self.out_proj = RowParallelLinear(la.value_dim, arch.hidden_size, False, ctx.linear)
        # bound with the KV cache (``bind_state``): this layer's slot of every page, as the
        # convolution's state [pages, conv_dim, K - 1] and the delta rule's [pages, Hv, dk, dv]
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.block_size = 0
        self.kv_group = 0  # its KV cache group (a recurrent one), bound with the cache

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        """Its own parameters: ``A_log`` and ``dt_bias``, each rank its heads'."""
        HeadParameter.load(param, loaded)

    @property
    def state_elements(self) -> int:
        """One page slot's use: the convolution's state, then the delta rule's."""
        return self.conv_dim * (self.la.conv_kernel - 1) + self.num_v_heads * self.dk * self.dv

    def bind_state(self, kv: torch.Tensor | None, slot: int = 0) -> None:
        """Views of slot ``slot`` of every page of the cache tensor ``kv`` (``layout.py``'s
        [pages, page_layers, parts, block_size, heads, dim]); None unbinds."""
        if kv is None:
            self.conv_state = self.ssm_state = None
            return
        # [pages, slot bytes as float32]: contiguous within a page
        flat = kv[:, slot].flatten(1).view(STATE_DTYPE)
        if flat.shape[1] < self.state_elements:
            raise ValueError(
                f"a page slot holds {flat.shape[1]} float32 values, the layer's state "
                f"{self.state_elements}: the block size is too small for its recurrent state"
            )
        pages, conv = kv.shape[0], self.conv_dim * (self.la.conv_kernel - 1)
        self.conv_state = flat[:, :conv].view(pages, self.conv_dim, self.la.conv_kernel - 1)
        self.ssm_state = flat[:, conv : self.state_elements].view(
            pages, self.num_v_heads, self.dk, self.dv
        )
        self.block_size = int(kv.shape[3])

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert self.conv_state is not None and self.ssm_state is not None, "state not bound"
        meta = meta.group(self.kv_group)
        src, dst, has_state = state_pages(meta, self.block_size)
        kd, vd, hv = self.key_dim, self.value_dim, self.num_v_heads
        qkv, z = self.in_proj_qkvz(x).split([2 * kd + vd, vd], dim=-1)
        b, a = self.in_proj_ba(x).split([hv, hv], dim=-1)
        qsl = meta.query_start_loc
        qkv = causal_conv1d(qkv.contiguous(), self.conv1d.weight, self.conv_state, qsl, src,
                            dst, has_state)  # fmt: skip
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        t = q.shape[0]
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = gated_delta_rule(
            q.reshape(t, self.num_k_heads, self.dk), k.reshape(t, self.num_k_heads, self.dk),
            v.reshape(t, hv, self.dv), g, beta, self.ssm_state, qsl, src, dst, has_state,
            meta.max_query_len, num_decodes=meta.num_decodes,
        )  # fmt: skip
        o = self.norm(o, z.reshape(t, hv, self.dv))
        return self.out_proj(o.reshape(t, vd))


def state_pages(
    meta: AttentionMetadata, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request of the step: the page whose state it starts from (block (c - 1) // bs of
    its table, c its first computed position), the page it leaves its state in (block
    (end - 1) // bs), and whether it starts from one (c > 0). Device arithmetic on the step's
    tensors (no host sync: a decode graph captures it); computed once per forward and group
    (``Qwen3_5Model.forward`` clears them first)."""
    cached = meta.state_pages
    if cached is not None:
        return cached
    qsl, ends = meta.query_start_loc, meta.seq_lens.long()
    n = ends.shape[0]
    starts = ends - (qsl[1 : n + 1] - qsl[:n]).long()
    table = meta.block_tables.long()
    rows = torch.arange(n, device=ends.device)
    src = table[rows, (starts - 1).clamp(min=0) // block_size].to(torch.int32)
    dst = table[rows, (ends - 1).clamp(min=0) // block_size].to(torch.int32)
    meta.state_pages = (src, dst, (starts > 0).to(torch.int32))
    return meta.state_pages
