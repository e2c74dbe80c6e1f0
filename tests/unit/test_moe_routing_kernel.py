"""The one-launch router (ops/moe_routing.py) against ``select_experts``, its plain-PyTorch
oracle, for each scoring the models use: the same experts in the same order, weights within
float32's rounding of ``exp`` (Triton's interpreter on CPU; on the GPU through the MoE models'
tests in tests/gpu)."""

from dataclasses import replace

import pytest
import torch

from services.worker.engine.model_config import MoEConfig
from services.worker.engine.models.layers.moe import select_experts
from services.worker.engine.ops.moe_routing import route, supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

QWEN3 = MoEConfig(num_experts=128, top_k=8, intermediate_size=8)
CASES = {
    "qwen3-moe (softmax, renormalized)": QWEN3,
    "mixtral (8 experts, top 2)": MoEConfig(num_experts=8, top_k=2, intermediate_size=8),
    "unnormalized, scaled": replace(QWEN3, norm_topk_prob=False, routed_scaling_factor=2.5),
    "sigmoid + correction bias (no groups)": MoEConfig(
        num_experts=64, top_k=4, intermediate_size=8, scoring="sigmoid", correction_bias=True,
        routed_scaling_factor=2.5,
    ),
    "gpt-oss (softmax of the top-k)": MoEConfig(
        num_experts=32, top_k=4, intermediate_size=8, scoring="softmax_of_topk",
        norm_topk_prob=False,
    ),
    "non-power-of-two experts": MoEConfig(num_experts=60, top_k=4, intermediate_size=8),
    "deepseek-v2-lite (64 experts, top 6, no groups)": MoEConfig(
        num_experts=64, top_k=6, intermediate_size=8, norm_topk_prob=False,
    ),
    "deepseek-v3 (256 experts, 8 groups, best 4 by their top 2, sigmoid + bias)": MoEConfig(
        num_experts=256, top_k=8, intermediate_size=8, scoring="sigmoid", correction_bias=True,
        num_groups=8, topk_groups=4, routed_scaling_factor=2.5,
    ),
    "deepseek-v2 (160 experts, 8 groups of 20, best 3 by their best)": MoEConfig(
        num_experts=160, top_k=6, intermediate_size=8, num_groups=8, topk_groups=3,
        norm_topk_prob=False, routed_scaling_factor=16.0,
    ),
    "tiny deepseek-v3 (8 experts, 4 groups, best 2)": MoEConfig(
        num_experts=8, top_k=2, intermediate_size=8, scoring="sigmoid", correction_bias=True,
        num_groups=4, topk_groups=2, routed_scaling_factor=2.5,
    ),
    "gpt-oss, top 3": MoEConfig(
        num_experts=32, top_k=3, intermediate_size=8, scoring="softmax_of_topk",
        norm_topk_prob=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tokens", [1, 37])
def test_route_equals_select_experts(name: str, tokens: int) -> None:
    moe = CASES[name]
    g = torch.Generator().manual_seed(tokens)
    logits = (3 * torch.randn(tokens, moe.num_experts, generator=g)).to(DEVICE)
    bias = None
    if moe.correction_bias:
        bias = (0.1 * torch.randn(moe.num_experts, generator=g)).to(DEVICE)
    assert supported(moe)
    # (the PyTorch path: select_experts of a GPU tensor would route through the kernel)
    want_w, want_ids = select_experts(logits.cpu(), moe, None if bias is None else bias.cpu())
    got_w, got_ids = route(logits, moe, bias)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(got_w.cpu(), want_w.cpu(), rtol=1e-6, atol=1e-7)


def test_the_bias_steers_the_choice_not_the_weights() -> None:
    """A bias that lifts expert 5 past every other: chosen first, its weight its own score."""
    moe = CASES["sigmoid + correction bias (no groups)"]
    logits = torch.zeros(1, moe.num_experts, device=DEVICE)
    logits[0, 9] = 2.0
    bias = torch.zeros(moe.num_experts, device=DEVICE)
    bias[5] = 10.0
    weights, ids = route(logits, replace(moe, norm_topk_prob=False, routed_scaling_factor=1.0),
                         bias)  # fmt: skip
    assert ids[0, :2].tolist() == [5, 9]
    assert weights[0, 0].item() == pytest.approx(0.5) and weights[0, 1].item() == pytest.approx(
        torch.sigmoid(torch.tensor(2.0)).item()
    )


def test_fewer_finite_scores_than_k_still_give_k_experts() -> None:
    """gpt-oss with all but two logits at -inf (a masked router): two real choices, then two
    more distinct experts of weight 0, as torch.topk gives."""
    moe = CASES["gpt-oss (softmax of the top-k)"]
    logits = torch.full((1, moe.num_experts), float("-inf"), device=DEVICE)
    logits[0, 7], logits[0, 3] = 1.0, 2.0
    weights, ids = route(logits, moe)
    assert ids[0, :2].tolist() == [3, 7] and len(set(ids[0].tolist())) == 4
    assert weights[0, 2:].tolist() == [0.0, 0.0]
    assert weights[0].sum().item() == pytest.approx(1.0)


def test_groups_the_kernel_does_not_rank_keep_the_pytorch_path() -> None:
    grouped = MoEConfig(num_experts=64, top_k=8, intermediate_size=8, num_groups=8)
    assert supported(grouped)
    assert not supported(replace(grouped, num_experts=60))  # (uneven groups)
    assert not supported(replace(grouped, num_groups=32))  # (more than MAX_GROUPS)


@pytest.mark.parametrize("by_top2", [False, True], ids=["best", "best-two"])
def test_the_choice_stays_in_the_best_groups(by_top2: bool) -> None:
    """4 groups of 4, the best 2 eligible. Group 0 holds the single best expert, group 3 the
    next three: ranked by their best, groups 0 and 3 are kept; by their best two (with a
    correction bias), group 0 (one high score) loses to groups 3 and 1."""
    moe = MoEConfig(num_experts=16, top_k=4, intermediate_size=8, scoring="sigmoid",
                    correction_bias=by_top2, num_groups=4, topk_groups=2,
                    norm_topk_prob=False)  # fmt: skip
    logits = torch.full((1, 16), -4.0)
    logits[0, 0] = 4.0  # group 0: one high
    logits[0, 12:15] = torch.tensor([3.0, 2.9, 2.8])  # group 3: three high
    logits[0, 4:6] = torch.tensor([1.0, 0.9])  # group 1: two middling
    bias = torch.zeros(16) if by_top2 else None
    logits, bias = logits.to(DEVICE), None if bias is None else bias.to(DEVICE)
    want_w, want_ids = select_experts(logits.cpu(), moe, None if bias is None else bias.cpu())
    got_w, got_ids = route(logits, moe, bias)
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-6, atol=1e-7)
    eligible = {0, 1, 2, 3, 12, 13, 14, 15} if not by_top2 else {4, 5, 6, 7, 12, 13, 14, 15}
    assert set(got_ids[0].tolist()) <= eligible
    assert (0 in got_ids[0].tolist()) is not by_top2
