"""Mixture-of-experts feed-forward layers (Qwen3-MoE, Qwen3-Next, Mixtral, DeepSeek-V2/V3,
gpt-oss).

    MoEBlock(x) = all_reduce( FusedMoE(x, select_experts(gate(x)))  +  shared_experts(x) )

``select_experts`` is the routing of every supported family (``MoEConfig`` says which), the
router kept in float32 as Hugging Face computes it. ``FusedMoE`` holds every expert's gate and
up projections stacked in ``w13_weight`` [E, 2I, H] and the down projections in ``w2_weight``
[E, H, I]; how they are kept and multiplied is its method's (``quantization/moe.py``: the
model's dtype or FP8; ``ops/fused_moe.py`` on a GPU). The shared experts are one dense MLP
(Qwen3-Next's scaled by a per-token sigmoid gate). gpt-oss adds biases to the router and to
every expert's projections, and a clamped SwiGLU (``MoEConfig.activation``): those layers run
the methods' plain path, which applies them.

Tensor parallelism. Attention stays tensor-parallel, so every rank holds every token's hidden
state after it: that replicated input is the dispatch, and the one all-reduce at the end of
the block is the combine (an all-to-all dispatch is what expert parallelism across nodes would
add). What a rank holds of the experts:

    without expert parallelism          with it (``enable_expert_parallel``)
    every expert, 1/tp of its I         E/tp whole experts
      w13 [E, 2I/tp, H]: its rows of      w13 [E/tp, 2I, H]: experts
        gate and of up                      [rank·E/tp, (rank+1)·E/tp)
      w2  [E, H, I/tp]: its columns       w2  [E/tp, H, I]; ``expert_map`` sends the
                                            others' ids to -1

Either way a rank's output is a partial sum, the shared experts' row-parallel product too: the
block adds them and all-reduces once.
"""

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.distributed import all_reduce, tp_rank, tp_size
from services.worker.engine.model_config import ArchConfig, MoEConfig
from services.worker.engine.models import mxfp4
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.activation import SiluAndMul
from services.worker.engine.models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from services.worker.engine.models.weights import (
    CheckpointTarget,
    CheckpointTensor,
    Loaded,
    ReadCounter,
    copy_weight,
    entry,
    full,
)
from services.worker.engine.ops import moe_routing
from services.worker.engine.ops.gemv import linear
from services.worker.engine.quantization.base import MoEMethod, Proj, expert_part
from services.worker.engine.quantization.fp8_math import Codes


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """The shard id of one expert's checkpoint tensor (``FusedMoE.weight_loader``)."""

    expert: int  # the checkpoint's expert index (over every rank)
    proj: Proj


@dataclass(frozen=True, slots=True)
class StackedExperts:
    """The shard id of a checkpoint tensor that holds every expert's projection at once, in one
    of two layouts. gpt-oss's checkpoints keep each expert's weight transposed ([in, out]),
    gate and up interleaved (``interleaved``):

        gate_up_proj       [E, H, 2I]   the last dim interleaved: g0 u0 g1 u1 ... (gate, up)
        gate_up_proj_bias  [E, 2I]      the same interleaving
        down_proj          [E, I, H]
        down_proj_bias     [E, H]

    ``transformers``' own (Qwen3.5-MoE's checkpoints) keeps each as it multiplies, [out, in],
    gate then up:

        gate_up_proj       [E, 2I, H]   rows: gate's I, then up's I
        down_proj          [E, H, I]
    """

    gate_up: bool  # gate_up_proj(_bias); else down_proj(_bias)
    interleaved: bool = True  # gpt-oss's layout; else transformers'


@dataclass(frozen=True, slots=True)
class Mxfp4Experts:
    """The shard id of one of the two tensors an MXFP4 checkpoint keeps every expert's
    projection in (gpt-oss as openai publishes it: ``gate_up_proj_blocks`` and ``_scales``,
    rows [2I] with gate and up interleaved; ``down_proj_blocks`` and ``_scales``, rows [H];
    models/mxfp4.py draws the format). The layer dequantizes them into its weights once
    it holds both."""

    gate_up: bool  # gate_up_proj_*; else down_proj_*
    part: str  # "blocks" or "scales"


ACTIVATIONS = ("silu", "swiglu_clamped")  # MoEConfig.activation's values (FusedMoE.activate)

_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<suffix>\w+)$"
)
# Qwen3-MoE and DeepSeek's names, and Mixtral's (w1 gate, w3 up, w2 down)
_PROJ: dict[str, Proj] = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                          "down_proj": "down", "w2": "down"}  # fmt: skip


def expert_target(name: str) -> CheckpointTarget | None:
    """``<prefix>.experts.<e>.<proj>.<suffix>`` → ``<prefix>.experts.w13_<suffix>`` (gate,
    up) or ``w2_<suffix>`` (down), shard ``ExpertShard(e, proj)``; None for another name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    proj = _PROJ[m["proj"]]
    param = f"{m['prefix']}.{'w2' if proj == 'down' else 'w13'}_{m['suffix']}"
    return CheckpointTarget(param, ExpertShard(int(m["expert"]), proj))


_STACKED = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$"
)


_MXFP4 = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)_(?P<part>blocks|scales)$"
)


def mxfp4_expert_target(name: str) -> CheckpointTarget | None:
    """``<prefix>.experts.gate_up_proj_blocks`` (``_scales``; ``down_proj_*``) → ``w13_weight``
    (``w2_weight``) with an ``Mxfp4Experts`` shard; None for another name."""
    m = _MXFP4.match(name)
    if m is None:
        return None
    gate_up = m["proj"] == "gate_up_proj"
    param = f"{m['prefix']}.{'w13' if gate_up else 'w2'}_weight"
    return CheckpointTarget(param, Mxfp4Experts(gate_up, m["part"]))


def stacked_expert_target(name: str, interleaved: bool = True) -> CheckpointTarget | None:
    """``<prefix>.experts.gate_up_proj`` (``down_proj``, each ``_bias``) → ``w13_weight``
    (``w2_weight``, ``w13_bias``, ``w2_bias``) with a ``StackedExperts`` shard of the layout
    ``interleaved`` says; None for another name. Only a model whose checkpoints use such a
    layout asks (gpt-oss; Qwen3.5-MoE, transformers' layout)."""
    m = _STACKED.match(name)
    if m is None:
        return None
    gate_up = m["proj"] == "gate_up_proj"
    param = f"{m['prefix']}.{'w13' if gate_up else 'w2'}_{'bias' if m['bias'] else 'weight'}"
    return CheckpointTarget(param, StackedExperts(gate_up, interleaved))


def select_experts(
    router_logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k], topk_ids int64 [T, k]) from the router's logits [T, E],
    as Hugging Face's routers of Qwen3-MoE, Mixtral and DeepSeek-V2/V3 compute them
    (``MoEConfig`` describes the steps); the bias steers the choice, never the weights. On a
    GPU the same steps run in one launch (``ops/moe_routing.py``) where it takes them."""
    if router_logits.is_cuda and moe_routing.supported(moe):
        return moe_routing.route(router_logits, moe, correction_bias)
    logits = router_logits.float()
    if moe.scoring == "softmax_of_topk":  # gpt-oss: the top logits, then their softmax
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return top.softmax(dim=-1), ids
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.num_groups > 1:
        choice = _eligible(choice, moe, by_top2=correction_bias is not None)
    ids = torch.topk(choice, moe.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:  # (+1e-20 as DeepSeek-V3; a no-op on any other sum in float32)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


def _eligible(choice: torch.Tensor, moe: MoEConfig, by_top2: bool) -> torch.Tensor:
    """Group-limited top-k: ``choice`` with the experts outside the best ``topk_groups``
    groups at -inf. A group's score is its best expert's, or (with a correction bias,
    DeepSeek-V3) the sum of its best two."""
    groups = choice.view(choice.shape[0], moe.num_groups, -1)  # [T, groups, experts/group]
    if by_top2:
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = groups.max(dim=-1).values
    best = torch.topk(group_scores, moe.topk_groups, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return groups.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class Router(nn.Module):
    """The gate: logits [T, E] = x Wᵀ (+ gpt-oss's ``bias``), replicated on every rank, in
    the dtype its model's Hugging Face gate computes them (``MoEConfig.router_float32``:
    DeepSeek's in float32, the others' in the model's dtype, which also saves a decode step
    a float32 GEMV a layer), and DeepSeek-V3's ``e_score_correction_bias`` (float32).
    ``select_experts`` takes the logits to float32. With ``kernels``, one token's logits on a
    GPU are the Triton GEMV's (``ops/gemv.py``, as the linear layers' at one token: one launch,
    overlapping the one before; a float32 gate's GEMV reads x in the model's dtype and widens it, so
    no launch casts x first); ``route`` gives the choice itself (``select_experts``: on a GPU
    the routing kernel's one launch)."""

    def __init__(self, hidden: int, moe: MoEConfig, kernels: bool = False):
        super().__init__()
        e = moe.num_experts
        self.moe = moe
        self.kernels = kernels
        dtype = torch.float32 if moe.router_float32 else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(e, hidden, dtype=dtype), requires_grad=False)
        self.bias: nn.Parameter | None = None
        if moe.router_bias:
            self.bias = nn.Parameter(torch.zeros(e, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(e, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)  # (a float32 gate widens x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``select_experts`` of the logits: (weights float32 [T, k], ids int64 [T, k])."""
        return select_experts(self(x), self.moe, self.e_score_correction_bias)


class FusedMoE(nn.Module):
    """The routed experts of one layer: this rank's share of them (the module docstring
    draws it), kept and run by ``method``; with ``MoEConfig.expert_bias`` their biases,
    ``w13_bias`` [E, 2I] (this rank's rows of gate and of up) and ``w2_bias`` [E, H], in the
    model's dtype. The down bias is added once over the ranks: without expert parallelism every
    rank computes a share of every expert, and only rank 0 holds it (the others hold zeros)."""

    def __init__(self, moe: MoEConfig, hidden: int, method: MoEMethod, expert_parallel: bool):
        super().__init__()
        tp, rank = tp_size(), tp_rank()
        self.hidden_size = hidden
        self.intermediate_total = moe.intermediate_size
        self.total_experts = moe.num_experts  # over every rank
        expert_map: torch.Tensor | None = None
        if expert_parallel:
            self.num_experts = moe.num_experts // tp
            self.first_expert = rank * self.num_experts
            self.intermediate_size, self.intermediate_start = moe.intermediate_size, 0
            expert_map = torch.full((moe.num_experts,), -1, dtype=torch.int32)
            mine = slice(self.first_expert, self.first_expert + self.num_experts)
            expert_map[mine] = torch.arange(self.num_experts, dtype=torch.int32)
        else:
            self.num_experts, self.first_expert = moe.num_experts, 0
            self.intermediate_size = moe.intermediate_size // tp
            self.intermediate_start = rank * self.intermediate_size
        self.expert_map: torch.Tensor | None
        self.register_buffer("expert_map", expert_map, persistent=False)
        if moe.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported expert activation {moe.activation!r}; supported: "
                             + ", ".join(ACTIVATIONS))  # fmt: skip
        self.activation = moe.activation
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.w13_bias: torch.Tensor | None = None  # (parameters when set)
        self.w2_bias: torch.Tensor | None = None
        if moe.expert_bias:
            e, i = self.num_experts, self.intermediate_size
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, hidden), requires_grad=False)
        self.adds_down_bias = expert_parallel or rank == 0
        self.method = method
        self.method.create_weights(self)
        self._loaded: set[tuple[int, Proj]] = set()  # (expert, proj) weights read
        self._scaled: set[tuple[int, Proj]] = set()  # (expert, proj) weight scales read
        # an MXFP4 projection's blocks or scales read before its other half: gate_up → part
        self._mxfp4: dict[bool, dict[str, Loaded]] = {}

    def set_method(self, method: MoEMethod) -> None:
        """As ``LinearBase.set_method``: a new method and its parameters (the biases and the
        expert map stay)."""
        for name in [n for n in self._parameters if n not in ("w13_bias", "w2_bias")]:
            del self._parameters[name]
        self.method = method
        method.create_weights(self)

    def rank_slice(self, loaded: Loaded, proj: Proj) -> Loaded:
        """This rank's share of one expert's weight: its rows of gate or up ([I, H]), its
        columns of down ([H, I])."""
        dim = 1 if proj == "down" else 0
        return loaded.narrow(dim, self.intermediate_start, self.intermediate_size)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object) -> None:
        if isinstance(shard_id, StackedExperts):
            self._load_stacked(param, loaded, shard_id)
            return
        if isinstance(shard_id, Mxfp4Experts):
            self._load_mxfp4(param, loaded, shard_id)
            return
        assert isinstance(shard_id, ExpertShard)  # (the model's checkpoint_target is ours)
        if not 0 <= shard_id.expert < self.total_experts:
            raise ValueError(f"expert {shard_id.expert} of a layer of {self.total_experts} "
                             "experts (the config's num_experts)")  # fmt: skip
        expert = shard_id.expert - self.first_expert
        if 0 <= expert < self.num_experts:  # (else another rank's expert: nothing read)
            self._load_expert(param, loaded, expert, shard_id.proj)

    def _load_expert(self, param: nn.Parameter, loaded: Loaded, expert: int, proj: Proj) -> None:
        """One expert's ``proj`` (the checkpoint's [out, in] weight or [out] bias, whole) into
        this rank's part of ``param``; ``expert``: its index on this rank."""
        if param is self.w13_bias or param is self.w2_bias:
            dst = expert_part(param, expert, proj)
            if proj != "down":
                copy_weight(dst, loaded.narrow(0, self.intermediate_start, self.intermediate_size))
            elif self.adds_down_bias:
                copy_weight(dst, loaded)
            else:
                dst.zero_()
            return
        if param is getattr(self, "w2_weight" if proj == "down" else "w13_weight"):
            self._loaded.add((expert, proj))
        if param is getattr(self, "w2_weight_scale" if proj == "down" else "w13_weight_scale",
                            None):  # fmt: skip
            self._scaled.add((expert, proj))
        if self.method.load(self, param, loaded, expert, proj):
            return
        copy_weight(expert_part(param, expert, proj), self.rank_slice(loaded, proj))

    def _load_stacked(self, param: nn.Parameter, loaded: Loaded, layout: StackedExperts) -> None:
        """Every expert's weight or bias in one tensor (``StackedExperts`` draws the layouts),
        each expert loaded as one expert's tensors are. In transformers' layout a rank reads
        only its rows of each of its experts; gpt-oss's interleaved columns are read whole."""
        if loaded.dim() < 2 or loaded.shape[0] != self.total_experts:
            raise ValueError(f"stacked experts of shape {tuple(loaded.shape)}, expected "
                             f"{self.total_experts} (the config's num_experts) first")  # fmt: skip
        if not layout.interleaved:  # [out, in], gate's rows then up's
            for e in range(self.num_experts):
                g = self.first_expert + e
                one = entry(loaded, g)
                if not layout.gate_up:
                    self._load_expert(param, one, e, "down")
                    continue
                rows = one.shape[0] // 2
                self._load_expert(param, one.narrow(0, 0, rows), e, "gate")
                self._load_expert(param, one.narrow(0, rows, rows), e, "up")
            return
        mine = full(loaded.narrow(0, self.first_expert, self.num_experts))
        for e, t in enumerate(mine):
            if not layout.gate_up:
                self._load_expert(param, t.T if t.dim() == 2 else t, e, "down")
                continue
            halves: tuple[tuple[Proj, torch.Tensor], ...] = (("gate", t[..., 0::2]),
                                                            ("up", t[..., 1::2]))  # fmt: skip
            for proj, part in halves:
                self._load_expert(param, part.T if part.dim() == 2 else part, e, proj)

    def _load_mxfp4(self, param: nn.Parameter, loaded: Loaded, shard: Mxfp4Experts) -> None:
        """Hold an MXFP4 projection's blocks (or scales) until its other half comes, then
        dequantize this rank's share of its experts, one at a time, and load each as one
        expert's [out, in] tensors (gate and up: the even and the odd rows)."""
        held = self._mxfp4.setdefault(shard.gate_up, {})
        held[shard.part] = loaded
        if len(held) < 2:
            return
        del self._mxfp4[shard.gate_up]
        blocks, scales = held["blocks"], held["scales"]
        for t in (blocks, scales):
            if t.dim() < 3 or t.shape[0] != self.total_experts:
                raise ValueError(f"MXFP4 experts of shape {tuple(t.shape)}, expected "
                                 f"{self.total_experts} (num_experts) first")  # fmt: skip
        counter = blocks.counter if isinstance(blocks, CheckpointTensor) else ReadCounter()
        for e in range(self.num_experts):
            g = self.first_expert + e
            # (each a lazy tensor of the expert's values: rank_slice narrows it to this
            # rank's rows or columns, and only those are read and dequantized, on the
            # weights' device)
            code, exponent = (entry(t, g) for t in (blocks, scales))
            if not shard.gate_up:
                down = mxfp4.Mxfp4Slices(code, exponent, param.device)
                self._load_expert(param, CheckpointTensor.of(down, counter), e, "down")
                continue
            halves: tuple[tuple[Proj, int], ...] = (("gate", 0), ("up", 1))  # (interleaved)
            for proj, first in halves:
                rows = mxfp4.Mxfp4Slices(code, exponent, param.device, every=2, first=first)
                self._load_expert(param, CheckpointTensor.of(rows, counter), e, proj)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate ‖ up) → [T, I]: silu(gate) · up, or gpt-oss's clamped SwiGLU."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def unloaded_weights(self) -> list[str]:
        """The experts' weights no checkpoint tensor reached (models/loader.py refuses them)."""
        projs: tuple[Proj, ...] = ("gate", "up", "down")
        # a quantized checkpoint's scales too, unless the method computes them at load (a
        # scale left at its fill would zero that expert's output without a word)
        scaled = hasattr(self, "w13_weight_scale") and not self.method.derived_parameters
        return [f"experts.{self.first_expert + e}.{p}_proj{suffix}"
                for e in range(self.num_experts) for p in projs
                for suffix, done in (("", self._loaded), (" weight scale", self._scaled))
                if (suffix == "" or scaled) and (e, p) not in done]  # fmt: skip

    def derived_parameters(self) -> tuple[str, ...]:
        return self.method.derived_parameters

    def after_load(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts' weighted sum, not yet summed over ranks."""
        return self.method.apply(self, x, topk_weights, topk_ids)


class _PartialRowLinear(RowParallelLinear):
    """Row-parallel, without its all-reduce: the block adds this partial sum to the experts'
    and reduces once."""

    def forward(self, x: torch.Tensor | Codes) -> torch.Tensor:
        return self.method.apply(self, x, self.bias if self.tp_rank == 0 else None)


class SharedExperts(nn.Module):
    """The shared experts as one dense MLP (gate ‖ up column-parallel, down row-parallel);
    ``gated``: its output scaled per token by σ(x · ``output_gate``ᵀ), a [1, hidden] weight
    every rank holds whole (Qwen3-Next's ``shared_expert_gate``: each rank scales its partial
    sum by the same factor)."""

    def __init__(self, hidden: int, intermediate: int, ctx: ModelContext, gated: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], False, ctx.linear
        )
        self.down_proj = _PartialRowLinear(intermediate, hidden, False, ctx.linear)
        self.act = SiluAndMul(ctx.kernels, feeds=self.down_proj)
        self.output_gate: nn.Parameter | None = None
        if gated:
            self.output_gate = nn.Parameter(torch.empty(1, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        if self.output_gate is not None:
            out = out * torch.sigmoid(F.linear(x, self.output_gate))
        return out


class MoEBlock(nn.Module):
    """A decoder layer's feed-forward part when it is a mixture of experts: forward(x [T, H])
    → [T, H], summed over the tensor-parallel ranks. Checkpoint names under it: ``gate.weight``,
    ``gate.e_score_correction_bias``, ``experts.<e>.{gate,up,down}_proj.*`` (the model's
    ``checkpoint_target`` maps them with ``expert_target``), ``shared_experts.*``."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__()
        moe = arch.moe
        assert moe is not None, "an MoE block of a dense model"
        if arch.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {arch.hidden_act!r}; supported: silu")
        self.moe = moe
        self.gate = Router(arch.hidden_size, moe, ctx.kernels)
        self.experts = FusedMoE(moe, arch.hidden_size, ctx.moe, ctx.expert_parallel)
        self.shared_experts: SharedExperts | None = None
        if moe.shared_intermediate_size:
            self.shared_experts = SharedExperts(arch.hidden_size, moe.shared_intermediate_size,
                                                ctx, moe.shared_expert_gate)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out)
