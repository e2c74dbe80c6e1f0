"""Qwen3.5's and Qwen3-Next's configs as the engine reads them: Qwen3.5's published
multimodal checkpoints' text model (``model_config.text_config``), the layers' cache kinds, and
the block size a recurrent state raises (``config.state_block_size``), from the 27B shape's
config and Qwen3-Next-80B-A3B's."""

from benchmarks.shapes import SHAPES
from services.worker.engine.config import state_block_size
from services.worker.engine.kv_cache.groups import RECURRENT
from services.worker.engine.model_config import load_arch_config, text_config

TEXT = dict(SHAPES["qwen3.5-27b"])


def test_a_multimodal_config_reads_as_its_text_models() -> None:
    text = {**TEXT, "eos_token_id": None, "tie_word_embeddings": True}
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text, "vision_config": {"depth": 27}, "eos_token_id": 7,
           "dtype": "bfloat16"}  # fmt: skip
    merged = text_config(cfg)
    assert merged["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert merged["model_type"] == "qwen3_5_text" and merged["hidden_size"] == 5120
    assert merged["eos_token_id"] == 7  # (a null in the text config does not hide it)
    assert merged["tie_word_embeddings"] is False  # the multimodal model's default
    assert "vision_config" not in merged and "text_config" not in merged
    arch = load_arch_config("", cfg)
    assert arch.linear_attention is not None and arch.linear_attention.num_value_heads == 48
    assert arch.eos_token_ids == (7,)
    other = {"model_type": "gemma3", "text_config": {"hidden_size": 8}}
    assert text_config(other) is other  # only the listed multimodal types


def test_the_27b_shapes_kinds_and_block_size() -> None:
    arch = load_arch_config("", TEXT)
    kinds = arch.layer_cache_kinds()
    assert kinds[:4] == (RECURRENT, RECURRENT, RECURRENT, None) and len(kinds) == 64
    # a float32 state of 3 × 10,240 conv values + 48 × 128 × 128: 3,268,608 bytes; a bf16
    # slot holds 2 × 4 heads × 256 × 2 = 4,096 bytes a token: 798 tokens, 800 in 16s
    assert arch.linear_attention is not None
    assert arch.linear_attention.state_elements() * 4 == 3_268_608
    assert state_block_size(arch, 16, 1, 2) == 800
    assert state_block_size(arch, 16, 2, 2) == 800  # each rank half the state, half the heads
    assert state_block_size(arch, 16, 8, 2) == 400  # an eighth of the state, 1 KV head of 4
    assert state_block_size(arch, 1024, 1, 2) == 1024  # already large enough


def test_qwen3_next_80bs_published_config() -> None:
    """Its config gives the layer kinds as ``full_attention_interval`` (read as transformers
    derives them) and the rotary at the top; every layer a mixture of experts with a gated
    shared expert."""
    arch = load_arch_config("", dict(SHAPES["qwen3-next-80b-a3b"]))
    assert arch.layer_cache_kinds() == (RECURRENT, RECURRENT, RECURRENT, None) * 12
    assert arch.partial_rotary_factor == 0.25 and arch.rope.theta == 1e7
    assert arch.moe is not None and arch.moe.sparse_layers == tuple(range(48))
    assert (arch.moe.num_experts, arch.moe.top_k) == (512, 10)
    assert arch.moe.shared_intermediate_size == 512 and arch.moe.shared_expert_gate
    # a float32 state of 3 × 8,192 conv values + 32 × 128 × 128: 2,195,456 bytes; a bf16 slot
    # 2 × 2 KV heads × 256 × 2 = 2,048 bytes a token: 1,072 tokens
    assert arch.linear_attention is not None
    assert arch.linear_attention.state_elements() * 4 == 2_195_456
    assert state_block_size(arch, 16, 1, 2) == 1072


def test_qwen3_5_35b_a3bs_config() -> None:
    """Qwen3.5-MoE's config names no dense MLP and no ``norm_topk_prob``: every layer is a
    mixture of experts, its top-k weights renormalized (as transformers' router does); the
    layer kinds from the interval; the state as Qwen3-Next's, at the same block size."""
    cfg = {k: v for k, v in SHAPES["qwen3.5-35b-a3b"].items() if k != "rope_parameters"}
    arch = load_arch_config("", cfg)
    assert arch.layer_cache_kinds() == (RECURRENT, RECURRENT, RECURRENT, None) * 10
    assert arch.partial_rotary_factor == 0.25  # (transformers' default where none is named)
    assert arch.moe is not None and arch.moe.sparse_layers == tuple(range(40))
    assert (arch.moe.num_experts, arch.moe.top_k) == (256, 8) and arch.moe.norm_topk_prob
    assert arch.moe.shared_intermediate_size == 512 and arch.moe.shared_expert_gate
    assert state_block_size(arch, 16, 1, 2) == 1072
    multimodal = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                  "model_type": "qwen3_5_moe", "text_config": cfg}  # fmt: skip
    assert load_arch_config("", multimodal).moe == arch.moe


def test_the_published_fp8_configs_read_as_blocks() -> None:
    """Qwen3.5's FP8 checkpoints list, each by its full name, the layers they leave float: per
    Gated DeltaNet layer its convolution and b and a projections, per layer the router and the
    shared-expert gate, and the embeddings, the LM head, the vision encoder and the
    multi-token-prediction layers (norms and the decays' parameters too, in some). Baton keeps
    all of those float (or does not load them). A list naming a layer Baton would quantize (by
    name or pattern, as llm-compressor's recipes keep ``re:.*linear_attn.*``) reads too: the
    loader keeps float whatever the tensors store float (tests/integration/
    test_fp8_keep_float.py)."""
    import pytest

    from services.worker.engine.quantization.config import parse_quantization

    layer = "model.language_model.layers"
    floats = ["lm_head", "model.language_model.embed_tokens", "model.visual.blocks.0.attn.qkv",
              "mtp.fc", "mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate"]  # fmt: skip
    for i in range(4):
        floats += [f"{layer}.{i}.mlp.gate", f"{layer}.{i}.mlp.shared_expert_gate"]
        if i % 4 != 3:  # a Gated DeltaNet layer
            floats += [f"{layer}.{i}.linear_attn.{n}" for n in ("conv1d", "in_proj_a", "in_proj_b")]
    floats += [f"{layer}.0.input_layernorm", f"{layer}.0.linear_attn.A_log", "re:.*mlp\\.gate$"]
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "modules_to_not_convert": floats}  # fmt: skip
    quant = parse_quantization({**TEXT, "quantization_config": qc}, None)
    assert quant is not None and quant.weights == "block"
    # (Qwen3-Next's spelling of b and a)
    qc_next = {**qc, "modules_to_not_convert": ["model.layers.0.linear_attn.in_proj_ba"]}
    assert parse_quantization({"quantization_config": qc_next}, None) is not None
    for kept in ("model.layers.0.linear_attn.in_proj_qkv", "re:.*linear_attn.*",
                 "model.language_model.layers.3.mlp", "re:.*mlp\\.shared_expert$"):  # fmt: skip
        also = parse_quantization({"quantization_config": {
            **qc, "modules_to_not_convert": [*floats, kept]}}, None)  # fmt: skip
        assert also == quant
    with pytest.raises(ValueError, match="weight_block_size"):  # (what is still refused)
        parse_quantization({"quantization_config": {**qc, "weight_block_size": [64, 64]}}, None)
