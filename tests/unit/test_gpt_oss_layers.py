"""gpt-oss's layers on CPU against Hugging Face's own modules: the router (a bias, the top-k
logits weighed by their softmax), the experts (the checkpoint's stacked, interleaved tensors,
biases, the clamped SwiGLU) whole and split over two ranks (a slice of every expert, or whole
experts), YaRN without truncation; the config of the real gpt-oss-20b read; MXFP4's
dequantization against transformers'."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import (
    GptOssExperts,
    GptOssRotaryEmbedding,
    GptOssTopKRouter,
)

from benchmarks.shapes import SHAPES
from services.worker.engine.attention.registry import get_backend
from services.worker.engine.distributed.parallel_state import GroupCoordinator, use_tp_group
from services.worker.engine.model_config import MoEConfig, RopeConfig, load_arch_config
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.gpt_oss import GptOssForCausalLM
from services.worker.engine.models.layers.moe import (
    FusedMoE,
    Router,
    select_experts,
    stacked_expert_target,
)
from services.worker.engine.models.layers.rotary import RotaryEmbedding, rotary_scale
from services.worker.engine.quantization.config import parse_quantization
from services.worker.engine.quantization.registry import moe_method

T, H, INTER, E, K = 9, 32, 16, 8, 4  # tokens, hidden, an expert's intermediate, experts, top-k
LIMIT = 0.5  # the SwiGLU's clamp: low enough that it binds on these random weights


def _config(**kw: Any) -> GptOssConfig:
    fields = {"hidden_size": H, "intermediate_size": INTER, "num_local_experts": E,
              "num_experts_per_tok": K, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "swiglu_limit": LIMIT, **kw}  # fmt: skip
    return GptOssConfig(**fields)


def _arch(tmp_path: Path, config: GptOssConfig) -> Any:
    cfg = {**json.loads(config.to_json_string()), "architectures": ["GptOssForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_arch_config(tmp_path)


def _moe(tmp_path: Path) -> MoEConfig:
    moe = _arch(tmp_path, _config()).moe
    assert moe is not None
    return moe


def test_routing_is_hugging_faces(tmp_path: Path) -> None:
    moe = _moe(tmp_path)
    assert (moe.scoring, moe.router_bias, moe.top_k) == ("softmax_of_topk", True, K)
    hf = GptOssTopKRouter(_config())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        hf.bias.copy_(torch.randn(hf.bias.shape, generator=gen))
    x = torch.randn(64, H, generator=gen)
    _, hf_weights, hf_ids = hf(x)
    ours = Router(H, moe)
    assert ours.bias is not None
    ours.weight.data.copy_(hf.weight)
    ours.bias.data.copy_(hf.bias)
    weights, ids = select_experts(ours(x), moe)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    assert len(ids.unique()) == E  # (routing is not degenerate)


def _hf_experts() -> GptOssExperts:
    experts = GptOssExperts(_config())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / (H**0.5 if p.dim() == 3 else 4))
    return experts


def _build(moe: MoEConfig, hf: GptOssExperts, ep: bool = False) -> FusedMoE:
    """Our experts, loaded from Hugging Face's stacked tensors under their checkpoint names."""
    layer = FusedMoE(moe, H, moe_method(None, kernels=False), ep)
    params = dict(layer.named_parameters())
    for name, t in hf.named_parameters():
        target = stacked_expert_target(f"mlp.experts.{name}")
        assert target is not None, name
        layer.weight_loader(params[target.param.removeprefix("mlp.experts.")], t.data,
                            target.shard)  # fmt: skip
    assert layer.unloaded_weights() == []
    return layer


def test_the_clamp_binds() -> None:
    """(else the test below would pass with an unclamped SwiGLU)"""
    hf = _hf_experts()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    gate_up = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
    assert (gate_up[:, 0::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()
    assert (gate_up.abs() < LIMIT).any()


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_experts_are_hugging_faces_whole_and_over_two_ranks(tmp_path: Path, ep: bool) -> None:
    moe = _moe(tmp_path)
    assert (moe.activation, moe.expert_bias, moe.swiglu_limit) == ("swiglu_clamped", True, LIMIT)
    hf = _hf_experts()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen).softmax(-1)
    with torch.no_grad():
        want = hf(x, ids, weights)
    torch.testing.assert_close(_build(moe, hf)(x, weights, ids), want, rtol=1e-5, atol=1e-6)
    parts = []
    for rank in range(2):
        with use_tp_group(GroupCoordinator(rank, 2)):
            layer = _build(moe, hf, ep)
        assert layer.w13_bias is not None
        assert tuple(layer.w13_bias.shape) == ((E // 2, 2 * INTER) if ep else (E, INTER))
        parts.append(layer(x, weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-6)


def _yarn(truncate: bool) -> GptOssConfig:
    return _config(head_dim=32, max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": truncate, "original_max_position_embeddings": 64,
    })  # fmt: skip


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_are_hugging_faces(tmp_path: Path, truncate: bool) -> None:
    config = _yarn(truncate)
    rope = _arch(tmp_path, config).rope
    assert (rope.rope_type, rope.truncate) == ("yarn", truncate)
    hf = GptOssRotaryEmbedding(config)
    assert rotary_scale(rope) == pytest.approx(hf.attention_scaling, rel=1e-12)
    positions = torch.arange(256)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(32, 256, rope)
    torch.testing.assert_close(ours.cos_cache[:, :16], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin_cache[:, :16], sin[0], rtol=0, atol=1e-6)


def test_truncation_moves_the_ramp() -> None:
    """(the two cases above differ: the tiny checkpoint's ramp ends between two pairs)"""
    tables = [RotaryEmbedding(32, 256, RopeConfig(150000.0, "yarn", 16.0,
                                                  original_max_position_embeddings=64,
                                                  truncate=t)).cos_cache
              for t in (False, True)]  # fmt: skip
    assert not torch.allclose(tables[0], tables[1])


def test_the_real_config_reads(tmp_path: Path) -> None:
    """openai/gpt-oss-20b's config.json (benchmarks/shapes.py), as transformers reads it."""
    shape = SHAPES["gpt-oss-20b"]
    (tmp_path / "config.json").write_text(json.dumps(shape))
    arch = load_arch_config(tmp_path)
    fields: dict[str, Any] = {k: v for k, v in shape.items() if k != "architectures"}
    hf = GptOssConfig(**fields)
    assert arch.moe is not None
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (32, 4, 2880)
    assert arch.moe.sparse_layers == tuple(range(24))
    assert arch.layer_types == tuple(hf.layer_types or ())
    assert (arch.sliding_window, arch.head_dim, arch.attention_bias) == (128, 64, True)
    assert (arch.rope.theta, arch.rope.factor, arch.rope.truncate) == (150000.0, 32.0, False)
    assert arch.rope.original_max_position_embeddings == 4096


def _model(tmp_path: Path) -> GptOssForCausalLM:
    return GptOssForCausalLM(
        _arch(tmp_path, _config()), ModelContext.build(16, get_backend("torch"))
    )


def test_layers_alternate_and_names_map(tmp_path: Path) -> None:
    model = _model(tmp_path)
    assert model.arch.layer_types == ("sliding_attention", "full_attention")
    attns = model.attention_layers()
    assert [attn.attn.sliding_window for attn in attns] == [128, None]
    assert all(attn.attn.sinks is attn.sinks for attn in attns)
    target = model.checkpoint_target("model.layers.0.mlp.router.bias")
    assert target is not None and target.param == "model.layers.0.mlp.gate.bias"
    target = model.checkpoint_target("model.layers.1.mlp.experts.down_proj_bias")
    assert target is not None and target.param == "model.layers.1.mlp.experts.w2_bias"
    assert model.checkpoint_target("model.layers.1.self_attn.q_proj.bias") is None  # (packed)


def test_mxfp4_reads_as_transformers_dequantizes_it(tmp_path: Path) -> None:
    """MXFP4 (openai's gpt-oss experts): our dequantization equals transformers' on random
    codes and exponents; a weight quantized and dequantized again is unchanged; the checkpoint's
    blocks and scales map to the experts' weights; the config reads as a float checkpoint's
    (its experts dequantized at load), or as one quantized at load to FP8."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from services.worker.engine.models import mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [E, out, in]
    assert torch.equal(ours, theirs.transpose(1, 2))
    again = mxfp4.dequantize(*mxfp4.quantize(ours), torch.float32)
    assert torch.equal(again, ours)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, scales[..., :3], torch.float32)
    target = _model(tmp_path).checkpoint_target("model.layers.0.mlp.experts.gate_up_proj_blocks")
    assert target is not None and target.param == "model.layers.0.mlp.experts.w13_weight"
    qc = {"architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    assert parse_quantization(qc, None) is None
    online = parse_quantization(qc, "fp8")
    assert online is not None and online.online
    with pytest.raises(ValueError, match="gpt-oss's experts only"):
        parse_quantization({**qc, "architectures": ["Qwen3MoeForCausalLM"]}, None)


def test_an_mxfp4_projection_without_its_scales_is_refused() -> None:
    """Blocks without their scales (or the other way round) leave the experts unloaded, which
    the loader refuses, naming them; with both, each rank holds its share of every expert."""
    from services.worker.engine.models import mxfp4
    from services.worker.engine.models.layers.moe import mxfp4_expert_target

    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=64, expert_bias=True,
                    activation="swiglu_clamped", scoring="softmax_of_topk")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 128, H, generator=gen)  # [E, 2I, H]: gate and up rows interleaved
    w2 = torch.randn(4, H, 64, generator=gen)
    tensors = {}
    for name, w in (("gate_up_proj", w13), ("down_proj", w2)):
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4.quantize(w)
    for rank in range(2):
        with use_tp_group(GroupCoordinator(rank, 2)):
            layer = FusedMoE(moe, H, moe_method(None, kernels=False), False)
        params = dict(layer.named_parameters())
        for name, t in tensors.items():
            if name == "down_proj_scales":
                continue  # (left out)
            target = mxfp4_expert_target(f"layer.experts.{name}")
            assert target is not None
            with use_tp_group(GroupCoordinator(rank, 2)):
                layer.weight_loader(params[target.param.removeprefix("layer.experts.")], t,
                                    target.shard)  # fmt: skip
        assert layer.unloaded_weights() == [f"experts.{e}.down_proj" for e in range(4)]
        gate = mxfp4.dequantize(tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"],
                                torch.float32)[:, 0::2]  # fmt: skip
        mine = gate[:, rank * 32 : (rank + 1) * 32]
        torch.testing.assert_close(layer.w13_weight[:, :32], mine, rtol=0, atol=0)
