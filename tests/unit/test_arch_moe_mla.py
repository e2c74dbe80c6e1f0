"""Mixture-of-experts and MLA configs read from the real models' config.json (the benchmark
shapes hold them), the KV cache entry each gives, and the layout and compatibility string that
follow from it."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.shapes import SHAPES
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views
from services.worker.engine.kv_transfer.connector import compat_hash
from services.worker.engine.model_config import ArchConfig, load_arch_config


def _arch(tmp_path: Path, cfg: dict) -> ArchConfig:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_arch_config(tmp_path)


def test_qwen3_moe_shape(tmp_path: Path) -> None:
    arch = _arch(tmp_path, SHAPES["qwen3-30b-a3b"])
    assert arch.mla is None and arch.moe is not None
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 768)
    assert moe.scoring == "softmax" and moe.norm_topk_prob and not moe.correction_bias
    assert moe.shared_intermediate_size == 0 and moe.sparse_layers == tuple(range(48))
    assert arch.kv_cache_entry() == (2, 4, 128)


def test_qwen3_moe_dense_layers_and_sparse_step(tmp_path: Path) -> None:
    cfg = dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=6, decoder_sparse_step=2,
               mlp_only_layers=[3])  # fmt: skip
    moe = _arch(tmp_path, cfg).moe
    assert moe is not None and moe.sparse_layers == (1, 5)  # (i + 1) % 2 == 0, not 3


def test_deepseek_v2_lite_shape(tmp_path: Path) -> None:
    arch = _arch(tmp_path, SHAPES["deepseek-v2-lite"])
    assert arch.moe is not None and arch.mla is not None
    moe, mla = arch.moe, arch.mla
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (64, 6, 1408)
    assert moe.shared_intermediate_size == 2 * 1408
    assert moe.sparse_layers == tuple(range(1, 27))  # the first layer dense
    assert moe.num_groups == 1 and moe.scoring == "softmax" and not moe.norm_topk_prob
    assert mla.q_lora_rank is None and mla.cache_dim == 576 and mla.qk_head_dim == 192
    assert arch.kv_cache_entry() == (1, 1, 576)
    assert arch.rope.rope_type == "yarn" and arch.rope.factor == 40
    assert arch.rope.mscale_all_dim == pytest.approx(0.707)


def test_deepseek_v3_routing(tmp_path: Path) -> None:
    cfg = dict(SHAPES["deepseek-v2-lite"], model_type="deepseek_v3",
               architectures=["DeepseekV3ForCausalLM"], n_routed_experts=256, n_shared_experts=1,
               num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
               routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536,
               topk_method="noaux_tc", num_hidden_layers=61)  # fmt: skip
    del cfg["scoring_func"]
    arch = _arch(tmp_path, cfg)
    moe = arch.moe
    assert moe is not None and arch.mla is not None and arch.mla.q_lora_rank == 1536
    assert moe.scoring == "sigmoid" and moe.correction_bias
    assert (moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) == (8, 4, 2.5)
    assert moe.sparse_layers[0] == 3 and len(moe.sparse_layers) == 58


def test_glm_4_5_air_shape(tmp_path: Path) -> None:
    """GLM-4.5: DeepSeek-V3's routing (sigmoid, a correction bias, ``noaux_tc`` without saying
    so) over grouped-query attention with biases and a rotary over half of each head."""
    arch = _arch(tmp_path, SHAPES["glm-4.5-air"])
    assert arch.mla is None and arch.moe is not None
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 1408)
    assert moe.scoring == "sigmoid" and moe.correction_bias and moe.norm_topk_prob
    assert moe.shared_intermediate_size == 1408 and moe.sparse_layers == tuple(range(1, 46))
    assert arch.attention_bias and not arch.qk_norm and arch.partial_rotary_factor == 0.5
    assert arch.kv_cache_entry() == (2, 8, 128)
    assert _arch(tmp_path, {**SHAPES["glm-4.5-air"], "use_qk_norm": True}).qk_norm


# MiniMaxAI/MiniMax-M2's config.json as published (the rotary as ``rotary_dim``)
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
    "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536,
    "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "rotary_dim": 64, "rope_theta": 5000000, "num_local_experts": 256,
    "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True,
    "use_qk_norm": True, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 196608, "tie_word_embeddings": False,
}  # fmt: skip


def test_minimax_m2_config(tmp_path: Path) -> None:
    arch = _arch(tmp_path, MINIMAX_M2)
    assert arch.partial_rotary_factor == 0.5 and arch.rope.theta == 5e6
    assert not arch.qk_norm  # (its norms are over all heads: the model's own)
    moe = arch.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (256, 8, 1536)
    assert moe.scoring == "sigmoid" and moe.correction_bias and moe.norm_topk_prob
    assert moe.num_groups == 1 and moe.shared_intermediate_size == 0
    assert moe.sparse_layers == tuple(range(62))
    for field, value in (("scoring_func", "softmax"), ("qk_norm_type", "per_head")):
        with pytest.raises(ValueError, match=field):
            _arch(tmp_path, {**MINIMAX_M2, field: value})


def test_minimax_m2s_published_fp8_config_reads_as_blocks() -> None:
    """MiniMax-M2 is published in FP8 only: ``float8_e4m3fn`` (DeepSeek's ``e4m3``) in 128 ×
    128 blocks, its routers and correction biases kept float, which Baton keeps float anyway
    (a module kept float that Baton would quantize reads too: the loader keeps float what the
    tensors store float); another FP8 format is refused."""
    from services.worker.engine.quantization.config import parse_quantization

    qc = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
          "weight_block_size": [128, 128],
          "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}  # fmt: skip
    quant = parse_quantization({**MINIMAX_M2, "quantization_config": qc}, None)
    assert quant is not None and quant.weights == "block"
    assert parse_quantization({"quantization_config": {**qc, "modules_to_not_convert": [
        "gate", "model.layers.0.self_attn"]}}, None) == quant  # fmt: skip
    with pytest.raises(ValueError, match="e5m2"):
        parse_quantization({"quantization_config": {**qc, "fmt": "e5m2"}}, None)


def test_fields_a_config_leaves_out_take_transformers_defaults(tmp_path: Path) -> None:
    """GLM-4.5's rotary turns half of each head, its first layer is dense, it has a shared
    expert and an epsilon of 1e-5; MiniMax-M2's heads are 128 wide, its rotary base 5e6."""
    glm = {k: v for k, v in SHAPES["glm-4.5-air"].items()
           if k not in ("partial_rotary_factor", "first_k_dense_replace", "n_shared_experts",
                        "rms_norm_eps")}  # fmt: skip
    arch = _arch(tmp_path, glm)
    assert arch.partial_rotary_factor == 0.5 and arch.rms_norm_eps == 1e-5
    assert arch.moe is not None and arch.moe.sparse_layers[0] == 1
    assert arch.moe.shared_intermediate_size == 1408
    minimax = {k: v for k, v in MINIMAX_M2.items() if k not in ("head_dim", "rope_theta")}
    arch = _arch(tmp_path, minimax)
    assert arch.head_dim == 128 and arch.partial_rotary_factor == 0.5 and arch.rope.theta == 5e6
    with pytest.raises(ValueError, match="shared experts"):
        _arch(tmp_path, {**MINIMAX_M2, "shared_intermediate_size": 256})


def test_mixtral_every_layer_sparse(tmp_path: Path) -> None:
    cfg = dict(SHAPES["llama-3.1-8b"], architectures=["MixtralForCausalLM"],
               model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
    moe = _arch(tmp_path, cfg).moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 14336)
    assert moe.sparse_layers == tuple(range(32)) and moe.norm_topk_prob


def test_unknown_deepseek_topk_method_is_refused(tmp_path: Path) -> None:
    cfg = dict(SHAPES["deepseek-v2-lite"], topk_method="random")
    with pytest.raises(ValueError, match="topk_method"):
        _arch(tmp_path, cfg)


def test_dense_models_have_neither(tmp_path: Path) -> None:
    arch = _arch(tmp_path, SHAPES["llama-3.1-8b"])
    assert arch.moe is None and arch.mla is None and arch.kv_cache_entry() == (2, 8, 128)


def test_latent_layout_is_one_part_and_both_views_are_the_latent() -> None:
    dense = KVCacheLayout(27, 16, 128, 16, torch.bfloat16)
    latent = KVCacheLayout(27, 1, 576, 16, torch.bfloat16, parts=1)
    assert latent.shape(3) == (3, 27, 1, 16, 1, 576)
    # DeepSeek-V2-Lite's cache: 576 values a token and layer against 2 × 16 × 128 dense
    assert latent.bytes_per_block * 4096 // 576 == dense.bytes_per_block
    kv = latent.allocate(3, "cpu")
    view = layer_views(kv, 5)
    view.key[1, 2, 0, 7] = 3.0
    assert view.value[1, 2, 0, 7] == 3.0 and kv[1, 5, 0, 2, 0, 7] == 3.0
    dense_views = layer_views(dense.allocate(2, "cpu"), 0)
    assert dense_views.key.data_ptr() != dense_views.value.data_ptr()


def test_compat_string_names_the_layout() -> None:
    mla = compat_hash("m", "bfloat16", 16, 27, 1, 576, (), parts=1)
    dense = compat_hash("m", "bfloat16", 16, 27, 16, 128)
    assert mla != dense
    assert mla.startswith("latent 1x576, bfloat16, 27 layers, blocks of 16 #")
    assert dense.startswith("K|V 16x128")
    assert compat_hash("m", "bfloat16", 16, 27, 1, 576, (), parts=1) == mla


def test_make_tiny_model_offers_every_tiny_architecture() -> None:
    from baton.cli import TINY_ARCHS
    from baton.tiny_model import ARCHS

    assert sorted(TINY_ARCHS) == sorted(ARCHS)


def test_block_fp8_experts_that_straddle_ranks_are_refused_before_any_rank_starts(
    tmp_path: Path,
) -> None:
    """Qwen3-30B-A3B in FP8 blocks: 768 / 2 = 384 = 3 blocks a rank splits; 768 / 4 = 192 does
    not, unless each rank holds whole experts."""
    from benchmarks.shapes import CHECKPOINT_FORMATS
    from services.worker.engine.config import EngineArgs

    cfg = dict(SHAPES["qwen3-30b-a3b"], quantization_config=CHECKPOINT_FORMATS["fp8-block"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def config(tp: int, ep: bool = False) -> object:
        return EngineArgs(model=str(tmp_path), device="cpu", tensor_parallel_size=tp,
                          enable_expert_parallel=ep).create_engine_config()  # fmt: skip

    assert config(2)
    with pytest.raises(ValueError, match=r"768 / 4 = 192\) to be a multiple of 128"):
        config(4)
    assert config(4, ep=True)


def test_glm_4_5_airs_published_fp8_config_reads_as_channels() -> None:
    """GLM-4.5-Air-FP8 is compressed-tensors per channel with dynamic per-token activations,
    its ignore list the LM head and every layer's router by name (the draft layer's too)."""
    from services.worker.engine.quantization.config import parse_quantization

    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
               "dynamic": False, "group_size": None, "block_structure": None}  # fmt: skip
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": acts}},
          "ignore": ["lm_head", *[f"model.layers.{n}.mlp.gate" for n in range(47)]]}  # fmt: skip
    quant = parse_quantization({**SHAPES["glm-4.5-air"], "quantization_config": qc}, None)
    assert quant is not None and (quant.weights, quant.activations) == ("channel", "token")
    qc["ignore"] = [*qc["ignore"], "model.layers.1.mlp.shared_experts"]  # (kept float at load)
    assert parse_quantization({"quantization_config": qc}, None) == quant
