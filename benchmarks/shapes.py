"""Config-only checkpoints of real model shapes, for ``load_format="dummy"`` benchmarks: the
architecture's config.json plus the small locally trained tokenizer (prompts are token ids)."""

import json
from pathlib import Path
from typing import Any

from baton.tiny_model import train_tokenizer

SHAPES = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # 128 experts, 8 active: 30.5 B parameters, 3.3 B of them multiply a token
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # MLA (a 512-wide latent + a 64-wide rotary key per token and layer), 64 routed experts
    # (6 active) and 2 shared, the first layer dense: 15.7 B parameters
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # google/gemma-3-12b-it's text model (its text_config, with Gemma3TextConfig's defaults
    # written out): five sliding-window layers (1024 tokens, local rotary base 10k) to every
    # global one (base 1M, linear scaling ×8), embeddings tied
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 1024,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # openai/gpt-oss-20b as its bfloat16 copy (the published experts are MXFP4): 24 layers
    # alternating a 128-token sliding window and full attention, sinks in every head, 32
    # experts (4 active, with biases, a clamped SwiGLU) in every layer, YaRN ×32 over 4096
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "swiglu_limit": 7.0, "attention_bias": True, "hidden_act": "silu",
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "initial_context_length": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                         "truncate": False},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # Qwen/Qwen3.5-27B's text model (its text_config): 48 Gated DeltaNet layers (16 key heads,
    # 48 value heads of 128; a convolution of 4) and 16 gated full-attention layers (24 heads,
    # 4 KV heads of 256, a quarter of each rotated), three of the first to each of the second;
    # a dense SiLU MLP of 17,408
    "qwen3.5-27b": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_act": "silu", "attention_bias": False,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config as published (the layer kinds as an interval,
    # the rotary's keys at the top): Qwen3.5's layers at 2048 wide (16 key heads, 32 value
    # heads of 128; attention 16 heads, 2 KV heads of 256), every layer 512 experts of 512,
    # 10 a token, and a gated shared expert of 512; 80B parameters (FP8 to fit one H200)
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "hidden_act": "silu", "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000,
        "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # Qwen/Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults, its
    # shipped rotary): Qwen3-Next's layers at 2048 wide (16 key heads, 32 value heads of 128;
    # attention 16 heads, 2 KV heads of 256), 40 layers, every one 256 experts of 512, 8 a
    # token, and a gated shared expert of 512; 35B parameters (70 GB in bf16: one H200)
    "qwen3.5-35b-a3b": {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_act": "silu", "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
    # zai-org/GLM-4.5-Air (transformers' Glm4MoeConfig defaults): 46 layers of 96 heads and 8 KV
    # heads of 128, half of each rotated, q/k/v biases; 128 experts of 1,408, 8 a token, one
    # shared expert, layer 0 dense; 106B parameters (its FP8 checkpoint fits one H200)
    "glm-4.5-air": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "attention_bias": True, "use_qk_norm": False,
        "partial_rotary_factor": 0.5, "rope_theta": 1000000.0,
        "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
    },
}  # fmt: skip
SHAPES["qwen3.5-27b"]["layer_types"] *= 16  # type: ignore[operator]


# what a checkpoint's config.json says to be read as stored FP8 (``--checkpoint``): the
# ``fp8`` method's 128 × 128 weight blocks, activations per token and 128 columns (dummy
# weights: e4m3 codes, every block's scale 1)
CHECKPOINT_FORMATS: dict[str, dict[str, Any]] = {
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
}  # fmt: skip


def write_shape(name: str, out_dir: str | Path, checkpoint: str | None = None) -> Path:
    """The shape's config.json (as a ``checkpoint`` format stores it, when given) and the
    tokenizer, in ``out_dir``."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        train_tokenizer(out)
    config = dict(SHAPES[name])
    if checkpoint is not None:
        config["quantization_config"] = CHECKPOINT_FORMATS[checkpoint]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
