"""The fused MoE kernels (ops/fused_moe.py) on a GPU at real expert shapes (Qwen3-30B-A3B:
E 128, k 8, H 2048, I 768; DeepSeek-V2-Lite: E 64, k 6, H 2048, I 1408), bf16 and FP8 (per
channel, 128 × 128 blocks): closely against their own arithmetic in float64, and within FP8's
error against ``fused_moe_reference``; the activations' e4m3 codes bit for bit the dense
layers' rounding; and one call captured in a CUDA graph and replayed on new inputs. Skipped
without CUDA."""

import functools
from typing import Any

import pytest
import torch

from services.worker.engine.ops.fused_moe import (
    fused_moe,
    fused_moe_reference,
    quantize_input,
    supported,
)
from services.worker.engine.quantization.fp8_math import (
    Codes,
    quantize_activations,
    quantize_blocks,
    quantize_rows,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}
SCHEMES = {"bf16": None, "fp8-channel": 0, "fp8-block": 128}  # the block; 0: per channel


@functools.cache
def _experts(shape: str, scheme: str) -> dict[str, Any]:
    """One shape's experts in one format (made once: a GB of bf16 weights at most)."""
    e, _, h, i = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(e + i)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).bfloat16()
    block = SCHEMES[scheme]
    if block is None:
        return {"w13": w13, "w2": w2, "w13_scale": None, "w2_scale": None, "block": None}
    out: dict[str, Any] = {"block": block or None}
    for name, w in (("w13", w13), ("w2", w2)):
        parts = [quantize_blocks(we, block) if block else quantize_rows(we) for we in w]
        out[name] = torch.stack([q for q, _ in parts])
        out[f"{name}_scale"] = torch.stack([s for _, s in parts])
    return out


def _routing(t: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, experts, device="cuda", generator=g) * 2
    weights, ids = logits.softmax(-1).topk(k, -1)
    return weights, ids.int()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _dequantized(codes: Codes, block: int | None) -> torch.Tensor:
    cols = torch.arange(codes.codes.shape[1], device="cuda") // (block or codes.codes.shape[1])
    return codes.codes.double() * codes.scales.double()[:, cols]


def _weight(w: dict[str, Any], name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s weight ``name`` in float64, dequantized with its scales."""
    q, scale, block = w[name][e], w[f"{name}_scale"], w["block"]
    if scale is None:
        return q.double()
    if block is None:
        return q.double() * scale[e].double().reshape(-1, 1)
    rows = scale[e].double().repeat_interleave(block, 0)[: q.shape[0]]
    return q.double() * rows[:, torch.arange(q.shape[1], device="cuda") // block]


def _kernel_arithmetic(
    x: torch.Tensor, w: dict[str, Any], weights: torch.Tensor, ids: torch.Tensor,
    emap: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """What the kernels compute, in float64 over the very operands they multiply (FP8: the
    codes ``quantize_input`` writes, x's and h's, which the test below holds to the dense
    layers' rounding), rounded to bf16 where they round: gate and up, silu(gate), h, each
    expert's output row and its weighted value, and the sum over the slots."""
    fp8 = w["w13_scale"] is not None
    block = w["block"]
    local = emap.long()[ids.long()] if emap is not None else ids.long()
    out = torch.zeros(x.shape, dtype=torch.float64, device="cuda")
    for e in range(w["w13"].shape[0]):
        tokens, slots = torch.where(local == e)
        if tokens.numel() == 0:
            continue
        xd = _dequantized(quantize_input(x[tokens], block), block) if fp8 else x[tokens].double()
        gate, up = (xd @ _weight(w, "w13", e).T).bfloat16().float().chunk(2, dim=-1)
        h = ((gate * torch.sigmoid(gate)).bfloat16().float() * up).bfloat16()
        hd = _dequantized(quantize_input(h, block), block) if fp8 else h.double()
        y = (hd @ _weight(w, "w2", e).T).bfloat16().float()
        out.index_add_(0, tokens, (y * weights[tokens, slots, None]).bfloat16().double())
    return out.bfloat16()


# against the kernels' arithmetic in float64: bf16, a sum's rounding in float32 and not float64
# moves a rounding to bf16 now and then; FP8, also the tensor cores' sums within a K tile (at
# 64 rows and more, wgmma's reduced precision) and so a code of h now and then
TIGHT = {"bf16": 2e-3, "fp8-channel": 1e-2, "fp8-block": 1e-2}
# against the reference: FP8, its dequantized activations and weights are rounded to bf16 before
# its GEMM (up to 2^-9 each), so that h moves codes: 1.6-1.8 % in a CPU emulation of both
LOOSE = {"bf16": 4e-3, "fp8-channel": 5e-2, "fp8-block": 5e-2}


# (tokens, path): the GEMVs at one token (with PDL) and 4; the grouped GEMMs there too
CALLS = [(1, None), (4, True), (1, False), (4, False), (64, None), (512, None)]
CALL_IDS = ["1-gemv", "4-gemv", "1-grouped", "4-grouped", "64", "512"]


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize(("t", "gemv"), CALLS, ids=CALL_IDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_moe_is_the_reference(shape: str, t: int, gemv: bool | None, scheme: str) -> None:
    e, k, h, _ = SHAPES[shape]
    w = _experts(shape, scheme)
    x = torch.randn(t, h, device="cuda", generator=torch.Generator("cuda").manual_seed(t))
    x = (x * 2).bfloat16()
    weights, ids = _routing(t, e, k, seed=t)
    assert supported(x, w["w13"])
    got = fused_moe(x, topk_weights=weights, topk_ids=ids, gemv=gemv, **w)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h)
    exact = _kernel_arithmetic(x, w, weights, ids)
    assert _relative_error(got, exact) < TIGHT[scheme]
    assert (got.double() - exact.double()).abs().max() < 0.05 * exact.double().abs().max()
    want = fused_moe_reference(x, topk_weights=weights, topk_ids=ids, **w)
    assert _relative_error(got, want) < LOOSE[scheme]


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("t", [1, 64], ids=["gemv", "grouped"])
def test_half_the_experts_on_this_rank(t: int, scheme: str) -> None:
    """Expert parallelism over two ranks: each rank's sum over its experts; the two add up to
    the sum over all of them (each rounded to bf16 once more)."""
    e, k, h, _ = SHAPES["qwen3-30b-a3b"]
    w = _experts("qwen3-30b-a3b", scheme)
    x = torch.randn(t, h, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    x = x.bfloat16()
    weights, ids = _routing(t, e, k, seed=5)
    ranks = []
    for rank in range(2):
        mine = slice(rank * e // 2, (rank + 1) * e // 2)
        local: dict[str, Any] = {n: v[mine] if isinstance(v, torch.Tensor) else v
                                 for n, v in w.items()}  # fmt: skip
        emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
        emap[mine] = torch.arange(e // 2, dtype=torch.int32, device="cuda")
        got = fused_moe(x, topk_weights=weights, topk_ids=ids, expert_map=emap, **local)
        exact = _kernel_arithmetic(x, local, weights, ids, emap)
        assert _relative_error(got, exact) < TIGHT[scheme]
        ranks.append(got.double())
    whole = fused_moe(x, topk_weights=weights, topk_ids=ids, **w)
    assert _relative_error(ranks[0] + ranks[1], whole) < 4e-3


@pytest.mark.parametrize("block", [None, 128], ids=["per-token", "per-token-and-group"])
def test_the_activation_codes_are_the_dense_layers_rounding(block: int | None) -> None:
    """x's e4m3 codes and scales, dequantized: exactly ``quantize_activations``' (what the
    dense FP8 layers' reference path multiplies)."""
    x = torch.randn(37, 2048, device="cuda") * torch.linspace(0.01, 30, 2048, device="cuda")
    x = x.bfloat16()
    codes = quantize_input(x, block)
    cols = torch.arange(2048, device="cuda") // (block or 2048)
    dequantized = (codes.codes.float() * codes.scales[:, cols]).to(x.dtype)
    want = quantize_activations(x, "token" if block is None else "token_group", block or 0, None)
    assert torch.equal(dequantized, want)


@pytest.mark.parametrize("scheme", ["bf16", "fp8-block"])
@pytest.mark.parametrize(("t", "gemv"), [(1, None), (4, True), (4, False)],
                         ids=["1-gemv-pdl", "4-gemv", "4-grouped"])  # fmt: skip
def test_a_captured_call_replays_on_new_inputs(t: int, gemv: bool | None, scheme: str) -> None:
    """fused_moe in a CUDA graph: no host sync in it (the capture would fail), and a replay
    over new tokens and routing gives their eager result."""
    e, k, h, _ = SHAPES["qwen3-30b-a3b"]
    w = _experts("qwen3-30b-a3b", scheme)
    x = torch.randn(t, h, device="cuda").bfloat16()
    weights, ids = _routing(t, e, k, seed=1)
    out = torch.empty_like(x)
    fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, gemv=gemv, **w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, topk_weights=weights, topk_ids=ids, out=out, gemv=gemv, **w)
    new_weights, new_ids = _routing(t, e, k, seed=2)
    x.copy_(torch.randn(t, h, device="cuda").bfloat16())
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe(x, topk_weights=weights, topk_ids=ids, gemv=gemv, **w)
    assert torch.equal(out, eager)
