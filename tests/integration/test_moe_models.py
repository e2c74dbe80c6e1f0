"""Mixture-of-experts models on CPU against their oracles: Qwen3-MoE (16 experts, 4 a token,
a dense layer among the MoE ones), Mixtral (8 experts, 2 a token) and GLM-4.5 (DeepSeek-V3's
routing over 8 experts, 2 a token, and a shared expert; q/k/v biases, q/k norms and a rotary
over half of each head; its first layer dense) and MiniMax-M2 (sigmoid routing with a
correction bias; q and k normed over all heads at once, summed over the ranks).

- Greedy tokens identical to Hugging Face float32, logprobs within 1e-4, with whole prompts
  (a prompt sharing a long prefix with another: a prefix hit) and with chunked prefill.
- Two ranks over gloo, each holding a slice of every expert or (expert parallelism) half the
  experts whole, give the same tokens and logprobs.
- The tiny checkpoints' routers really spread a prompt's tokens over most experts.
- FP8 experts (compressed-tensors per channel, ``fp8`` 128×128 blocks, a float checkpoint
  quantized at load) against the plain-PyTorch reference that dequantizes the same weights and
  rounds each expert's inputs the same way (``baton/tiny_fp8``). As for the dense FP8 layers
  (tests/integration/test_fp8.py), greedy is checked teacher-forced: rounding to e4m3 turns the
  float noise of another batch's summation order into a whole e4m3 step now and then, so a
  near-tie may flip; nine in ten steps must be the reference's exact argmax.
"""

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from tests.helpers import (
    FP8_GREEDY,
    FP8_PROMPTS,
    add_draft_layer,
    check_against_fp8_reference,
    experts_chosen,
    fp8_generate,
    hf_continue,
)

MAX_NEW = 16
LOGPROB_ATOL = 1e-4
_LONG = (
    "Return a new list containing all items from the iterable in ascending order. A custom key "
    "function can be supplied to customize the sort order, and the reverse flag can be set to "
    "request the result in descending order."
)
PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog",
    _LONG,
    _LONG + " The sort is stable.",  # shares a long prefix with the previous prompt
    "import os\nimport sys\n\ndef main():\n    return 0",
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True)
MODELS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"arch": "qwen3_moe", "num_layers": 3},  # layers 0, 2 MoE; 1 dense
    "mixtral": {"arch": "mixtral"},
    "glm4_moe": {"arch": "glm4_moe", "num_layers": 3},  # layer 0 dense; 1, 2 MoE
    # one KV head: over two ranks both hold it, and its norm's sum of squares counts it once
    "minimax_m2": {"arch": "minimax_m2", "num_kv_heads": 1},
}
MOE_LAYERS = {"qwen3_moe": [0, 2], "mixtral": [0, 1], "glm4_moe": [1, 2], "minimax_m2": [0, 1]}
MODES: dict[str, dict[str, Any]] = {
    "whole-prompts": {"enable_chunked_prefill": False},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    paths = {name: make_tiny_model(root / name, **kw) for name, kw in MODELS.items()}
    add_draft_layer(paths["glm4_moe"], 3)  # (its multi-token-prediction module, skipped)
    return paths


@cache
def hf_reference(path: Path) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Hugging Face's greedy tokens and log-softmax rows for each prompt."""
    tok = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, rows = [], []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = hf_continue(model, ids, MAX_NEW, output_logits=True, return_dict_in_generate=True)
        tokens.append(out.sequences[0, ids.shape[1] :].tolist())
        rows.append([step[0].float().log_softmax(-1).tolist() for step in out.logits])
    return tokens, rows


def _generate(path: Path, **kw: Any) -> tuple[list[Any], Any]:
    llm = LLM(model=str(path), show_progress=False, dtype="float32", **kw)
    try:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False), llm.get_stats()
    finally:
        llm.shutdown()


def _assert_hugging_faces(path: Path, outs: list[Any]) -> None:
    tokens, rows = hf_reference(path)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    for out, steps in zip(outs, rows, strict=True):
        for position, row in zip(out.outputs[0].logprobs, steps, strict=True):
            for token_id, lp in position.items():
                assert abs(lp.logprob - row[token_id]) < LOGPROB_ATOL


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_matches_hugging_face(moe_models: dict[str, Path], name: str, mode: str) -> None:
    outs, stats = _generate(moe_models[name], **MODES[mode])
    _assert_hugging_faces(moe_models[name], outs)
    assert stats.prefix_hit_tokens > 0  # the shared-prefix prompt read the cached blocks
    assert stats.num_free_blocks == stats.num_blocks


# each rank a slice of every expert; half the experts whole (expert parallelism)
TP_CASES = [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", False), ("mixtral", True),
            ("glm4_moe", False), ("minimax_m2", False)]  # fmt: skip


@pytest.mark.parametrize(("name", "ep"), TP_CASES)
def test_two_ranks_equal_one(moe_models: dict[str, Path], name: str, ep: bool) -> None:
    """Hugging Face's tokens and logprobs are one rank's (the test above)."""
    outs, _ = _generate(moe_models[name], tensor_parallel_size=2, enable_expert_parallel=ep,
                        **MODES["chunked-prefill"])  # fmt: skip
    _assert_hugging_faces(moe_models[name], outs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_prompts_tokens_spread_over_most_experts(moe_models: dict[str, Path], name: str) -> None:
    """Routing that sent every token to the same few experts would leave most experts' weights
    (their loading, their slicing over ranks) untested."""
    path = moe_models[name]
    used = experts_chosen(path, AutoTokenizer.from_pretrained(path)(_LONG)["input_ids"])
    config = AutoConfig.from_pretrained(path)
    local = ("mixtral", "glm4_moe", "minimax_m2")  # (their configs' name for the count)
    experts = config.num_local_experts if name in local else config.num_experts
    assert sorted(used) == MOE_LAYERS[name]
    assert all(len(chosen) >= 0.75 * experts for chosen in used.values()), used


# qwen3_moe in FP8: per channel at the usual sizes; 128×128 blocks at 128-wide experts, with 8
# heads of 32, so that o_proj's input splits over two ranks in whole 128-column groups (each
# rank quantizes its own columns: a split group would round unlike one rank's, test_fp8.py)
FP8_CASES: dict[str, dict[str, Any]] = {
    "fp8-channel": {"quantize": "fp8-channel"},
    "fp8-block": {"quantize": "fp8-block", "hidden_size": 128, "moe_intermediate_size": 128,
                  "num_heads": 8},
    # GLM-4.5 in both formats (q/k/v biases kept float)
    "glm4_moe-fp8-channel": {"arch": "glm4_moe", "quantize": "fp8-channel"},
    "glm4_moe-fp8-block": {"arch": "glm4_moe", "quantize": "fp8-block", "hidden_size": 128,
                           "moe_intermediate_size": 128, "num_heads": 8},
    # MiniMax-M2 is published in 128 × 128 blocks (its experts 256 wide here: 2 × hidden)
    "minimax_m2-fp8-block": {"arch": "minimax_m2", "quantize": "fp8-block", "hidden_size": 128,
                             "num_heads": 8},
}  # fmt: skip


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-fp8")
    return {fmt: make_tiny_model(root / fmt, num_layers=3, **{"arch": "qwen3_moe", **kw})
            for fmt, kw in FP8_CASES.items()}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(FP8_CASES))
def test_fp8_experts_match_their_dequantizing_reference(
    fp8_models: dict[str, Path], fmt: str
) -> None:
    exact = check_against_fp8_reference(fp8_models[fmt], fp8_generate(fp8_models[fmt]))
    assert exact >= 0.9 * len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


def test_fp8_block_experts_over_two_ranks(fp8_models: dict[str, Path]) -> None:
    """Expert parallelism: each rank loads its experts' weights and block scales whole. (Two
    ranks sum in another order than one: the median tolerance is test_fp8.py's for TP=2.)"""
    path = fp8_models["fp8-block"]
    outs = fp8_generate(path, tensor_parallel_size=2, enable_expert_parallel=True)
    exact = check_against_fp8_reference(path, outs, median_atol=5e-3)
    assert exact >= 0.9 * len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


def test_a_float_moe_checkpoint_quantized_at_load(fp8_models: dict[str, Path]) -> None:
    """``quantization="fp8"`` on the float model gives exactly the per-channel checkpoint made
    from it: every expert's weights and scales quantized as the checkpoint's were."""
    path = fp8_models["fp8-channel"]
    online = fp8_generate(path / "unquantized", quantization="fp8")
    stored = fp8_generate(path)
    assert [o.outputs[0].token_ids for o in online] == [o.outputs[0].token_ids for o in stored]
