"""The router's choice in one launch: from the gate's logits [T, E] (float32) to each token's
top-k experts and their weights, the steps ``models/layers/moe.select_experts`` takes in plain
PyTorch (softmax or sigmoid scores, DeepSeek-V3's correction bias on the choice only, top-k,
renormalisation, the routed scaling; gpt-oss's softmax over its top-k logits).

At a decode step those steps are eight or more launches of a few microseconds each on a
handful of values, in every MoE layer: more time than the layer's expert GEMMs take at batch
1. One program per token does them all in registers, DeepSeek-V2/V3's group-limited choice
among them (``num_groups`` > 1: the best ``topk_groups`` groups ranked first).

The top-k is k rounds of an argmax over the scores (the lowest index among equal scores);
the scores and weights are float32 as in ``select_experts``, whose results it equals up to
the last bits of ``exp`` (``tests/unit/test_moe_routing_kernel.py``).
"""

import torch
import triton
import triton.language as tl

from services.worker.engine.model_config import MoEConfig
from services.worker.engine.ops.dependent_launch import await_inputs, launch_options

_SCORING = {"softmax": 0, "sigmoid": 1, "softmax_of_topk": 2}
# the most expert groups the kernel ranks (DeepSeek-V3's 8; a loop of reductions a group)
MAX_GROUPS = 16
GROUP_LANES = tl.constexpr(MAX_GROUPS)  # (a power of two)


@triton.jit
def _route_kernel(
    LOGITS, BIAS, WEIGHTS, IDS, E, stride_l, scaling,
    K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr = 1,
    KEEP_GROUPS: tl.constexpr = 1, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """One token: ids[t, :K] its experts in descending score, weights[t, :K] theirs; with
    GROUPS > 1 only among the best KEEP_GROUPS groups' (``_best_groups``)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    await_inputs(USE_PDL)
    logits = tl.load(LOGITS + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SCORING == 0:  # softmax over every expert
        z = tl.exp(logits - tl.max(logits, 0))
        scores = z / tl.sum(z, 0)
    elif SCORING == 1:
        scores = tl.sigmoid(logits)
    else:  # gpt-oss: the choice by logit, the weights a softmax over the chosen
        scores = logits
    choice = tl.where(ok, scores, float("-inf"))
    if HAS_BIAS:  # steers the choice, never the weights
        choice += tl.load(BIAS + e, mask=ok, other=0.0)
    if GROUPS > 1:
        choice = _best_groups(choice, e, E, GROUPS, KEEP_GROUPS, HAS_BIAS)
    ks = tl.arange(0, BLOCK_K)
    top_ids = tl.zeros([BLOCK_K], tl.int32)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    taken = e >= E  # (the padding lanes are never chosen)
    for j in tl.static_range(K):
        best = tl.argmax(choice, 0, tie_break_left=True)
        # fewer than K finite choices (-inf logits): the first lane not taken yet
        untaken = tl.min(tl.where(taken, BLOCK_E, e), 0)
        best = tl.where(tl.max(choice, 0) == float("-inf"), untaken, best)
        picked = e == best
        top_ids = tl.where(ks == j, best, top_ids)
        top_w = tl.where(ks == j, tl.sum(tl.where(picked, scores, 0.0), 0), top_w)
        choice = tl.where(picked, float("-inf"), choice)
        taken = taken | picked
    if SCORING == 2:
        z = tl.where(ks < K, tl.exp(top_w - tl.max(tl.where(ks < K, top_w, -float("inf")), 0)), 0.0)
        top_w = z / tl.sum(z, 0)
    if NORM:  # (+1e-20 as select_experts: DeepSeek-V3's; a no-op on any other float32 sum)
        top_w = top_w / (tl.sum(top_w, 0) + 1e-20)
    if SCORING != 2:  # (gpt-oss's weights are the softmax alone, as select_experts')
        top_w = top_w * scaling
    tl.store(WEIGHTS + t * K + ks, top_w, mask=ks < K)
    tl.store(IDS + t * K + ks, top_ids.to(tl.int64), mask=ks < K)


@triton.jit
def _best_groups(
    choice, e, E, GROUPS: tl.constexpr, KEEP: tl.constexpr, BY_TOP2: tl.constexpr
):  # fmt: skip
    """Group-limited top-k (DeepSeek-V2/V3's, ``models/layers/moe._eligible``): the experts in
    GROUPS groups of E / GROUPS consecutive ones; ``choice`` with all but the best KEEP groups'
    at -inf. A group's score is its best choice, or (BY_TOP2: with a correction bias,
    DeepSeek-V3) the sum of its best two."""
    size = E // GROUPS
    group = tl.where(e < E, e // size, GROUPS)  # (the padding lanes: in no group)
    g = tl.arange(0, GROUP_LANES)
    scores = tl.full(g.shape, float("-inf"), tl.float32)
    for gi in tl.static_range(GROUPS):
        mine = tl.where(group == gi, choice, float("-inf"))
        best = tl.max(mine, 0)
        if BY_TOP2:
            first = tl.argmax(mine, 0, tie_break_left=True)
            best += tl.max(tl.where(e == first, float("-inf"), mine), 0)
        scores = tl.where(g == gi, best, scores)
    keep = group < 0  # (none)
    for _ in tl.static_range(KEEP):
        top = tl.argmax(scores, 0, tie_break_left=True)
        keep = keep | (group == top)
        scores = tl.where(g == top, float("-inf"), scores)
    return tl.where(keep, choice, float("-inf"))


def supported(moe: MoEConfig) -> bool:
    """The kernel takes this routing: a known scoring; groups, if any, that split the experts
    evenly, at most ``MAX_GROUPS``."""
    groups = moe.num_groups
    if groups > 1 and (groups > MAX_GROUPS or moe.num_experts % groups):
        return False
    return moe.scoring in _SCORING


def route(
    logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], ids int64 [T, k]) as ``select_experts`` returns them."""
    t, e = logits.shape
    k = moe.top_k
    weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    # (the kernel reads the logits in their dtype: the model's or float32, as Router gives)
    bias = correction_bias.float() if correction_bias is not None else logits
    _route_kernel[(t,)](
        logits, bias, weights, ids, e, logits.stride(0), float(moe.routed_scaling_factor),
        K=k, SCORING=_SCORING[moe.scoring], HAS_BIAS=correction_bias is not None,
        NORM=moe.norm_topk_prob and moe.scoring != "softmax_of_topk",
        BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(k),
        GROUPS=moe.num_groups, KEEP_GROUPS=moe.topk_groups,
        num_warps=1 if e <= 256 else 4, **launch_options(logits),
    )  # fmt: skip
    return weights, ids
