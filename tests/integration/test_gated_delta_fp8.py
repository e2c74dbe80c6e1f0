"""FP8 checkpoints of the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as they are
published: 128 × 128 blocks over q ‖ k ‖ v ‖ z and the output projection, the b and a
projections, the convolution, the routers and the shared-expert gate left float and listed in
``modules_to_not_convert`` (compressed-tensors per channel: in ``ignore``). The engine's greedy
tokens are checked against a plain-PyTorch reference that dequantizes the same weights
(``baton/tiny_fp8``), as for the dense and MoE FP8 layers.

The Gated DeltaNet heads are 64 wide here, so that q, k, v and z span several 128-row blocks
(and a block's rows straddle parts): Qwen3.5's ``in_proj_qkv`` loads its parts' scales by
their rows in the whole tensor, Qwen3-Next's ``in_proj_qkvz`` (stored by key head) each key
head's runs of rows with the blocks they fall in. Read any other way, the tokens differ.
"""

from pathlib import Path
from typing import Any

import pytest

from baton.tiny_model import make_tiny_model
from tests.helpers import FP8_GREEDY, FP8_PROMPTS, check_against_fp8_reference, fp8_generate

# hidden 128 and 8 heads of 32: the attention's output projection takes 256 columns, which two
# ranks split in whole 128-column groups; value heads 4 × 64 = 256 columns do the same for
# the Gated DeltaNet's output projection
_BLOCK = {"quantize": "fp8-block", "hidden_size": 128, "num_heads": 8, "linear_head_dim": 64}
CASES: dict[str, dict[str, Any]] = {
    "qwen3_5-fp8-block": {"arch": "qwen3_5", **_BLOCK},
    # (experts and the shared expert 256 wide: two ranks split the shared one in whole groups)
    "qwen3_next-fp8-block": {"arch": "qwen3_next", **_BLOCK, "moe_intermediate_size": 256},
    # (Qwen3.5-MoE's FP8 checkpoints keep each expert's projections apart, its bf16 ones stacked)
    "qwen3_5_moe-fp8-block": {"arch": "qwen3_5_moe", **_BLOCK, "moe_intermediate_size": 256},
    "qwen3_5-fp8-channel": {"arch": "qwen3_5", "quantize": "fp8-channel"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gdn-fp8")
    return {name: make_tiny_model(root / name, **kw) for name, kw in CASES.items()}


def _exact_enough(path: Path, outs: list[Any]) -> None:
    # (the median logprob's tolerance is test_fp8.py's for two ranks: a rounding that float
    # noise flips in the prefill, e4m3's step where the engine's sum and the reference's
    # differ by 5e-6, stays in the recurrent state for every later token: seen, 0.0023)
    exact = check_against_fp8_reference(path, outs, median_atol=5e-3)
    assert exact >= 0.9 * len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_published_layout_matches_its_dequantizing_reference(
    models: dict[str, Path], name: str
) -> None:
    _exact_enough(models[name], fp8_generate(models[name]))


def test_the_checkpoint_lists_what_it_leaves_float(models: dict[str, Path]) -> None:
    import json

    from safetensors import safe_open

    path = models["qwen3_next-fp8-block"]
    floats = json.loads((path / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    assert "model.layers.0.linear_attn.in_proj_ba" in floats
    assert "model.layers.0.mlp.shared_expert_gate" in floats
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert str(f.get_slice("model.layers.0.linear_attn.in_proj_qkvz.weight").get_dtype()) \
            == "F8_E4M3"  # fmt: skip
        assert str(f.get_slice("model.layers.0.linear_attn.in_proj_ba.weight").get_dtype()) \
            == "F32"  # fmt: skip


def test_two_ranks_load_their_key_heads_blocks(models: dict[str, Path]) -> None:
    """Each rank one key head of Qwen3-Next's by-key-head projection, with its blocks' scales,
    and half the experts whole."""
    path = models["qwen3_next-fp8-block"]
    _exact_enough(path, fp8_generate(path, tensor_parallel_size=2, enable_expert_parallel=True))


def test_a_float_checkpoint_quantized_at_load(models: dict[str, Path]) -> None:
    """``quantization="fp8"`` on the float model gives exactly the per-channel checkpoint made
    from it: q ‖ k ‖ v ‖ z and the output projections quantized as the checkpoint's, b and a
    kept float as it keeps them."""
    path = models["qwen3_5-fp8-channel"]
    online = fp8_generate(path / "unquantized", quantization="fp8")
    stored = fp8_generate(path)
    assert [o.outputs[0].token_ids for o in online] == [o.outputs[0].token_ids for o in stored]
