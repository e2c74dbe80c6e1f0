"""The router's choice in one launch: from the gate's logits [T, E] (float32) to each token's
top-k experts and their weights, the steps ``models/layers/moe.select_experts`` takes in plain
PyTorch (softmax or sigmoid scores, DeepSeek-V3's correction bias on the choice only, top-k,
renormalisation, the routed scaling; gpt-oss's softmax over its top-k logits).

At a decode step those steps are eight or more launches of a few microseconds each on a
handful of values, in every MoE layer: more time than the layer's expert GEMMs take at batch
1. One program per token does them all in registers, DeepSeek-V2/V3's group-limited choice
among them (``num_groups`` > 1: the best ``topk_groups`` groups ranked first).

At one token the gate's GEMV and the choice are one launch (``gate_route``): each program
computes some of the gate's rows, as the GEMV (``ops/gemv.gemv_rows``) would, and the last to
arrive (an atomic counter) reads every logit and chooses, so a decode step's router is one
short launch a layer where it was two.

The top-k is k rounds of an argmax over the scores (the lowest index among equal scores);
the scores and weights are float32 as in ``select_experts``, whose results it equals up to
the last bits of ``exp`` (``tests/unit/test_moe_routing_kernel.py``).
"""

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from services.worker.engine.model_config import MoEConfig
from services.worker.engine.ops.dependent_launch import await_inputs, launch_options
from services.worker.engine.ops.gemv import gemv_rows

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
    """One token: ids[t, :K] its experts in descending score, weights[t, :K] theirs."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    await_inputs(USE_PDL)
    logits = tl.load(LOGITS + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    _choose(logits, BIAS, WEIGHTS + t * K, IDS + t * K, E, scaling, K, SCORING, HAS_BIAS, NORM,
            BLOCK_E, BLOCK_K, GROUPS, KEEP_GROUPS)  # fmt: skip


@triton.jit
def _choose(
    logits, BIAS, WEIGHTS, IDS, E, scaling,
    K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
):  # fmt: skip
    """One token's logits [BLOCK_E] (float32, -inf past E) → its K experts in descending score
    at IDS[:K] (int64) and their weights at WEIGHTS[:K] (float32); with GROUPS > 1 only among
    the best KEEP_GROUPS groups' (``_best_groups``)."""
    e = tl.arange(0, BLOCK_E)
    ok = e < E
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
    tl.store(WEIGHTS + ks, top_w, mask=ks < K)
    tl.store(IDS + ks, top_ids.to(tl.int64), mask=ks < K)


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


@triton.jit
def _gate_route_kernel(
    X, W, B, LOGITS, ARRIVALS, BIAS, WEIGHTS, IDS, E, HIDDEN, stride_wn, scaling,
    R, NW, H, R_OUT, eps,
    HAS_GATE_BIAS: tl.constexpr, K: tl.constexpr, SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, GROUPS: tl.constexpr = 1,
    KEEP_GROUPS: tl.constexpr = 1, NORMED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """One token's router in one launch: program p the gate's rows BLOCK_N · p onward (the
    GEMV's arithmetic, rounded to LOGITS' dtype: the gate's logits up to the float32
    summation order of its own tiles), stored; the
    program that arrives last (ARRIVALS, a counter it sets back to 0) reads every logit and
    chooses (``_choose``). With NORMED the gate's input is the decoder layer's
    post-attention RMSNorm of R + X, which every program works out for itself
    (``_normed_gemv_rows``), writing its share of the norm to H and of R + X to R_OUT."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if NORMED:
        y = _normed_gemv_rows(X, R, NW, H, R_OUT, eps, W, B, rows, E, HIDDEN, stride_wn,
                              HAS_GATE_BIAS, BLOCK_N, BLOCK_H, USE_PDL)  # fmt: skip
    else:
        y = gemv_rows(X, W, B, rows, E, HIDDEN, stride_wn, HAS_GATE_BIAS, BLOCK_N, BLOCK_H,
                      USE_PDL)  # fmt: skip
    tl.store(LOGITS + rows, y.to(LOGITS.dtype.element_ty), mask=rows < E)
    # every thread's logits stored before the arrival is counted (the counter's release then
    # publishes them all), and the last one's reads after its acquire, past L1
    tl.debug_barrier()
    arrived = tl.atomic_add(ARRIVALS, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(LOGITS + e, mask=e < E, other=float("-inf"), volatile=True)
        _choose(logits.to(tl.float32), BIAS, WEIGHTS, IDS, E, scaling, K, SCORING, HAS_BIAS,
                NORM, BLOCK_E, BLOCK_K, GROUPS, KEEP_GROUPS)  # fmt: skip
        tl.atomic_xchg(ARRIVALS, 0, sem="relaxed", scope="gpu")  # for the next launch


@triton.jit
def _normed_gemv_rows(
    X, R, NW, H, R_OUT, eps, W, B, rows, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``gemv_rows`` of h = RMSNorm(R + X) (weight NW), h and R + X rounded as
    ``fused_ops.add_rms_norm`` rounds them (its statistics summed in another order): a pass for
    the sum of squares, then the products. Of K's columns this program writes h's and R + X's
    own share (K / programs of them, in order) to H and R_OUT; R is only read (another program
    may still be reading it)."""
    row_ok = rows < N
    w_rows = W + rows[:, None].to(tl.int64) * stride_wn
    cols = tl.arange(0, BLOCK_K)
    # the first weight tile before the wait, as gemv_rows
    w_first = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                      other=0.0)  # fmt: skip
    await_inputs(USE_PDL)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + cols
        res = _residual_sum(X, R, c, c < K)
        squares += res * res
    inv = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    share = tl.cdiv(K, tl.num_programs(0))
    mine = tl.program_id(0) * share
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + cols
        ok = c < K
        res = _residual_sum(X, R, c, ok)
        normed = (res * inv).to(X.dtype.element_ty).to(tl.float32)
        h = (tl.load(NW + c, mask=ok, other=0.0).to(tl.float32) * normed).to(X.dtype.element_ty)
        own = ok & (c >= mine) & (c < mine + share)
        tl.store(H + c, h, mask=own)
        tl.store(R_OUT + c, res.to(X.dtype.element_ty), mask=own)
        if k0 == 0:
            w = w_first
        else:
            w = tl.load(w_rows + c[None, :], mask=row_ok[:, None] & ok[None, :], other=0.0)
        acc += w.to(tl.float32) * h.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    return y


@triton.jit
def _residual_sum(X, R, c, ok):
    """R + X at columns ``c``, rounded to X's dtype (as the norm's residual add), as float32."""
    x = tl.load(X + c, mask=ok, other=0.0)
    r = tl.load(R + c, mask=ok, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype).to(tl.float32)


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
    weights, ids = _chosen(t, moe, logits.device)
    if t == 0:
        return weights, ids
    # (the kernel reads the logits in their dtype: the model's or float32, as Router gives)
    bias = correction_bias.float() if correction_bias is not None else logits
    _route_kernel[(t,)](
        logits, bias, weights, ids, e, logits.stride(0), float(moe.routed_scaling_factor),
        **_choice(moe, correction_bias is not None), num_warps=1 if e <= 256 else 4,
        **launch_options(logits),
    )  # fmt: skip
    return weights, ids


def _chosen(tokens: int, moe: MoEConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for ``tokens`` tokens' choice: (weights float32 [T, k], ids int64 [T, k])."""
    shape = (tokens, moe.top_k)
    return (torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.int64, device=device))  # fmt: skip


def _choice(moe: MoEConfig, has_bias: bool) -> dict[str, Any]:
    """``_choose``'s constexprs for routing ``moe`` (the routing kernels' keywords)."""
    return {
        "K": moe.top_k, "SCORING": _SCORING[moe.scoring], "HAS_BIAS": has_bias,
        "NORM": moe.norm_topk_prob and moe.scoring != "softmax_of_topk",
        "BLOCK_E": triton.next_power_of_2(moe.num_experts),
        "BLOCK_K": triton.next_power_of_2(moe.top_k),
        "GROUPS": moe.num_groups, "KEEP_GROUPS": moe.topk_groups,
    }  # fmt: skip


# the fused router's launch: one warp a program, so that the last program's choice reduces over
# the experts in shuffles alone (at 4 warps each of its k argmax rounds crosses warps through
# shared memory: ~100 barriers, compiled for sm_90), one gate row a program (128 programs for
# 128 experts) read in steps of up to 2,048 columns
GATE_ROUTE_ROWS, GATE_ROUTE_COLUMNS, GATE_ROUTE_WARPS = 1, 2048, 1
# ... with the norm in it, 512 (its tiles of x, the residual, the norm's weight and the sums at
# 2,048 took 255 registers and a stack at sm_90; at 512, 85)
GATE_ROUTE_NORMED_COLUMNS = 512


class Gate(NamedTuple):
    """A router as its one-token launch takes it: its weight [E, H] and bias (gpt-oss's), the
    routing, DeepSeek-V3's correction bias, and its scratch: ``logits`` [E] (the gate's
    dtype) and ``arrivals`` (int32 [1], zero), kept from launch to launch (a CUDA graph
    replays the same ones; ``arrivals`` is zero again after each launch)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    moe: MoEConfig
    correction_bias: torch.Tensor | None
    logits: torch.Tensor
    arrivals: torch.Tensor


def gate_route(x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's ``route(x Wᵀ (+ bias))`` in one launch (``_gate_route_kernel``): x [1, H]
    in the gate's dtype or, with a float32 gate, the model's (widened as it is read: the
    products of ``x.float()``). Returns (weights float32 [1, k], ids int64 [1, k])."""
    x = x.contiguous()
    return _launch(x, gate, (x, x, x, x, 0.0), normed=False)


def norm_gate_route(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate: Gate
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gate_route`` of the decoder layer's post-attention norm, in the same one launch: x
    [1, H] the attention's output, the gate's input ``add_rms_norm(x, residual, norm_weight,
    eps)``'s norm. Returns (weights, ids, the norm, the new residual R + X: a new tensor, the
    residual given left as it was)."""
    x, residual = x.contiguous(), residual.contiguous()
    h, new_residual = torch.empty_like(x), torch.empty_like(x)
    weights, ids = _launch(x, gate, (residual, norm_weight, h, new_residual, eps), normed=True)
    return weights, ids, h, new_residual


def _launch(
    x: torch.Tensor,
    gate: Gate,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    normed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_gate_route_kernel``'s launch; ``norm``: (R, NW, H, R_OUT, eps), unread without
    ``normed``."""
    weight, bias, moe, correction_bias, logits, arrivals = gate
    assert x.shape[0] == 1 and weight.stride(1) == 1 and arrivals.dtype == torch.int32
    e, hidden = weight.shape
    weights, ids = _chosen(1, moe, x.device)
    if x.is_cuda:
        launch = {"BLOCK_N": GATE_ROUTE_ROWS, "num_warps": GATE_ROUTE_WARPS, "num_stages": 2}
        columns = GATE_ROUTE_NORMED_COLUMNS if normed else GATE_ROUTE_COLUMNS
        block_h = min(columns, triton.next_power_of_2(hidden))
    else:  # (the interpreter: several rows a program and several steps, several to arrive)
        launch, block_h = {"BLOCK_N": 4}, 64
    residual, norm_weight, h, new_residual, eps = norm
    _gate_route_kernel[(triton.cdiv(e, launch["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, logits, arrivals,
        correction_bias.float() if correction_bias is not None else logits, weights, ids, e,
        hidden, weight.stride(0), float(moe.routed_scaling_factor),
        residual, norm_weight, h, new_residual, float(eps),
        HAS_GATE_BIAS=bias is not None, **_choice(moe, correction_bias is not None),
        BLOCK_H=block_h, NORMED=normed, **launch, **launch_options(x),
    )  # fmt: skip
    return weights, ids
