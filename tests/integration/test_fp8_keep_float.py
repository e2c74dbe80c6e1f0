"""FP8 checkpoints that keep some of the layers Baton would quantize in floating point and list
them in their ignore list, as llm-compressor's recipes for the hybrids do (compressed-tensors'
``ignore``: ``re:.*linear_attn.*`` keeps every Gated DeltaNet projection in bf16; others keep
the attention, the shared experts, or a first layer whole). The loader reads which layers those
are from the tensors themselves (``models/loader.keep_float``) and gives them the model's
dtype; the engine's greedy tokens are checked against the plain-PyTorch reference that
dequantizes the FP8 weights and leaves the float ones (and their inputs) as they are. A layer
whose parts the checkpoint stores in two formats is refused with its name."""

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from baton import LLM
from baton.tiny_model import make_tiny_model
from tests.helpers import FP8_GREEDY, FP8_PROMPTS, check_against_fp8_reference, fp8_generate

CASES: dict[str, dict[str, Any]] = {
    # every Gated DeltaNet projection float (per-channel FP8 elsewhere)
    "qwen3_next-linear-attn": {"arch": "qwen3_next", "quantize": "fp8-channel",
                               "keep_float": ("re:.*linear_attn.*",)},
    # the same in 128 x 128 blocks (heads 64 wide: q, k, v, z span blocks; two ranks split
    # every FP8 layer in whole blocks)
    "qwen3_next-linear-attn-block": {
        "arch": "qwen3_next", "quantize": "fp8-block", "hidden_size": 128, "num_heads": 8,
        "linear_head_dim": 64, "moe_intermediate_size": 256,
        "keep_float": ("re:.*linear_attn.*",),
    },
    # the attention, and the whole first layer (its experts too), float; 128 x 128 blocks
    "qwen3_moe-attention-and-layer-0": {
        "arch": "qwen3_moe", "num_layers": 3, "quantize": "fp8-block", "hidden_size": 128,
        "moe_intermediate_size": 128, "num_heads": 8,
        "keep_float": ("re:.*self_attn.*", "model.layers.0"),
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keep-float")
    return {name: make_tiny_model(root / name, **kw) for name, kw in CASES.items()}


def _methods(llm: LLM) -> dict[str, str]:
    """Each linear layer's and experts' method, by our module name."""
    model: nn.Module = llm.client.core.executor.worker.runner.model  # type: ignore[attr-defined]
    return {name: type(m.method).__name__ for name, m in model.named_modules()
            if hasattr(m, "method")}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_float_layers_run_float_and_match_the_reference(
    models: dict[str, Path], name: str
) -> None:
    path = models[name]
    with LLM(model=str(path), show_progress=False) as llm:
        methods = _methods(llm)
        outs = llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)
    floats = {n for n, m in methods.items() if m.startswith("Unquantized")}
    if name.startswith("qwen3_next"):
        assert {n for n in methods if ".linear_attn." in n} <= floats
        assert "model.layers.0.linear_attn.in_proj_qkvz" in floats  # (else FP8)
        assert "model.layers.3.self_attn.qkv_proj" not in floats  # the attention: FP8
    else:
        assert {n for n in methods if ".self_attn." in n or n.startswith("model.layers.0.")} \
            <= floats  # fmt: skip
        assert "model.layers.0.mlp.experts" in floats
        assert "model.layers.2.mlp.experts" not in floats  # the other layers' experts: FP8
    # (the Gated DeltaNet's recurrent state keeps a flipped e4m3 rounding: test_gated_delta_fp8)
    exact = check_against_fp8_reference(path, outs, median_atol=5e-3)
    assert exact >= 0.9 * len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


def test_two_ranks_with_expert_parallelism(models: dict[str, Path]) -> None:
    """Each rank keeps the same layers float (every rank reads every header) and loads its
    share of them: its heads of the float Gated DeltaNet projections, its half of the FP8
    experts."""
    # (blocks: per channel, a row-parallel layer's per-token activation scale is each rank's
    # half of the row, not the reference's whole row, with or without float layers)
    path = models["qwen3_next-linear-attn-block"]
    outs = fp8_generate(path, tensor_parallel_size=2, enable_expert_parallel=True)
    exact = check_against_fp8_reference(path, outs, median_atol=5e-3)
    assert exact >= 0.9 * len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


def test_the_checkpoint_lists_and_stores_them_float(models: dict[str, Path]) -> None:
    import json

    from safetensors import safe_open

    path = models["qwen3_next-linear-attn"]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert "re:.*linear_attn.*" in qc["ignore"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
    assert dtypes["model.layers.0.linear_attn.in_proj_qkvz.weight"] == "F32"
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight_scale" not in dtypes
    assert dtypes["model.layers.3.self_attn.q_proj.weight"] == "F8_E4M3"


def test_a_layer_stored_in_two_formats_is_refused(tmp_path: Path) -> None:
    """q float, k and v in FP8: one fused product cannot take both."""
    path = make_tiny_model(tmp_path / "m", arch="qwen3", quantize="fp8-channel",
                           keep_float=("model.layers.1.self_attn.q_proj",))  # fmt: skip
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.q_proj.*one layer"):
        LLM(model=str(path), show_progress=False)


def test_the_cli_writes_such_a_checkpoint(tmp_path: Path) -> None:
    """``baton make-tiny-model --quantize fp8-channel --keep-float ...``: the MLPs stay float
    and are listed; without an FP8 format the flag is refused."""
    import json

    from safetensors import safe_open

    from baton.cli import main

    out = tmp_path / "m"
    main(["make-tiny-model", str(out), "--arch", "qwen3", "--quantize", "fp8-channel",
          "--keep-float", "re:.*mlp.*"])  # fmt: skip
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == [
        "lm_head", "re:.*mlp.*"]  # fmt: skip
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.self_attn.o_proj.weight").get_dtype() == "F8_E4M3"
    with pytest.raises(SystemExit):
        main(["make-tiny-model", str(tmp_path / "n"), "--keep-float", "re:.*mlp.*"])
