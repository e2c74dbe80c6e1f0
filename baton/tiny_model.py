"""``baton make-tiny-model DIR --arch ...``: a small random checkpoint in Hugging Face format, with
a byte-level BPE tokenizer trained here on the Python standard library's own docstrings (no
download), loadable by both Baton and ``transformers``. For tests, the demo and benchmarks.
"""

import importlib
import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Modules whose docstrings make the training text: plain English, always installed.
_CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "functools",
    "http.client", "itertools", "json", "logging", "os", "pathlib", "random", "re", "socket",
    "statistics", "string", "subprocess", "textwrap", "threading", "unittest", "urllib.parse",
)  # fmt: skip
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# multi-head latent attention's sizes (DeepSeek): a latent of 32 and a rotary key of 8 a token
_MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
# MLA with one q projection; softmax greedy routing over 8 experts, 2 shared experts; layer 0
# dense
_DEEPSEEK_V2 = {
    **_MLA, "q_lora_rank": None, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "topk_method": "greedy",
}  # fmt: skip
# MLA with a low-rank q; sigmoid scores with a (random) correction bias, 4 groups of which the
# best 2 are eligible, weights scaled by 2.5; YaRN (both its table scale and its softmax
# correction: mscale ≠ mscale_all_dim); layer 0 dense
_DEEPSEEK_V3 = {
    **_MLA, "q_lora_rank": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.707,
    },
}  # fmt: skip

# Qwen3-MoE: 16 experts, 4 a token; layer 1 a dense MLP among the MoE ones (mlp_only_layers)
_QWEN3_MOE = {"head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
              "moe_intermediate_size": 32, "mlp_only_layers": [1]}  # fmt: skip

# Gemma 3 (text): 2 sliding-window layers (8 tokens, local rotary base 10k) to every global
# one (base 1M, linear scaling ×2); head_dim and query_pre_attn_scalar apart, so that the
# softmax scale is checked; logits soft-capped (Gemma 2's; None in Gemma 3's checkpoints)
_GEMMA3 = {
    "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
    "sliding_window_pattern": 3, "final_logit_softcapping": 15.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
    },
}  # fmt: skip

# gpt-oss: sliding-window layers (8 tokens) alternating with full ones, sinks; 8 experts, 4 a
# token, with biases and a SwiGLU clamped at 1 (gpt-oss's 7 would never bind at these sizes);
# head_dim ≠ hidden / heads; YaRN without truncation (the ramp ends between pairs)
_GPT_OSS = {
    "head_dim": 32, "sliding_window": 8, "num_local_experts": 8, "num_experts_per_tok": 4,
    "swiglu_limit": 1.0,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64,
    },
}  # fmt: skip

# Qwen3.5 (text): three Gated DeltaNet layers to every full-attention one (the default
# interval of 4); linear attention of 2 key heads and 4 value heads of 16 (a key head serves
# two value heads, as in the real models), a convolution of 4; gated attention heads of 32
# whose rotary turns a quarter of their dims
_QWEN3_5 = {
    "head_dim": 32, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
}  # fmt: skip

# Qwen3-Next: Qwen3.5's layers (its projections stored by key head) with mixture-of-experts
# feed-forward layers of 8 experts, 2 a token, and a gated shared expert; layer 1 dense
_QWEN3_NEXT = {
    **_QWEN3_5, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "mlp_only_layers": [1],
}  # fmt: skip

# Qwen3.5-MoE: Qwen3.5's layers with mixture-of-experts feed-forward layers everywhere (8
# experts, 2 a token, and a gated shared expert); its experts saved stacked, as transformers
# keeps them (``experts.gate_up_proj``)
_QWEN3_5_MOE = {
    **_QWEN3_5, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}  # fmt: skip

# GLM-4.5: DeepSeek-V3's routing (sigmoid scores, a correction bias, 4 groups of which the best
# 2 are eligible, weights scaled by 2.5) over 8 experts, 2 a token, one shared expert, layer 0
# dense; q/k/v biases, q/k norms, a rotary over half of each head of 32
_GLM4_MOE = {
    "head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
}  # fmt: skip

# MiniMax-M2: 8 experts, 2 a token, by sigmoid scores with a (random) correction bias; q and k
# normed over all heads at once; a rotary over half of each head of 32 (its ``rotary_dim``)
_MINIMAX_M2 = {
    "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
}  # fmt: skip

# Architecture → (transformers config class, extra config fields). Sizes are shared below.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # head_dim ≠ hidden / heads, as in real Qwen3
    "qwen3_moe": ("Qwen3MoeConfig", _QWEN3_MOE),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "deepseek_v2": ("DeepseekV2Config", _DEEPSEEK_V2),
    "deepseek_v3": ("DeepseekV3Config", _DEEPSEEK_V3),
    "gemma3": ("Gemma3TextConfig", _GEMMA3),
    "gpt_oss": ("GptOssConfig", _GPT_OSS),
    "qwen3_5": ("Qwen3_5TextConfig", _QWEN3_5),
    "qwen3_next": ("Qwen3NextConfig", _QWEN3_NEXT),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", _QWEN3_5_MOE),
    "glm4_moe": ("Glm4MoeConfig", _GLM4_MOE),
    "minimax_m2": ("MiniMaxM2Config", _MINIMAX_M2),
}
# decoder layers where an arch needs more than make_tiny_model's default 2 (gemma3: two
# rounds of its sliding, sliding, global pattern; gpt_oss: two of sliding, full; qwen3_5 and
# qwen3_next: one of three linear-attention layers and a full one)
DEFAULT_LAYERS = {"gemma3": 6, "gpt_oss": 4, "qwen3_5": 4, "qwen3_next": 4, "qwen3_5_moe": 4}


def corpus() -> list[str]:
    """The same text in every process: submodules are skipped, because which ones a package
    has as attributes depends on what else the process imported (``email.utils`` appears
    once some library imports it), and that made the tokenizer, and so the model, vary."""
    texts = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        own = [v for v in vars(module).values() if not isinstance(v, types.ModuleType)]
        for obj in [module, *own]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                texts.append(doc)
    return texts


def train_tokenizer(out_dir: Path, vocab_size: int = 1024, splits_like: str | None = None) -> int:
    """Train byte-level BPE, save it as a transformers fast tokenizer; returns its size.
    ``splits_like``: a ``transformers`` tokenizer class whose normalizer and pre-tokenizer the
    saved one takes (for model types whose tokenizer transformers rebuilds from the vocabulary
    and merges with its own splitting, whatever the checkpoint's says, as the published
    checkpoints' own tokenizer.json splits: the engine's tokenizer and the gateway's agree)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)
    if splits_like is not None:
        rebuilt = getattr(transformers, splits_like).from_pretrained(out_dir).backend_tokenizer
        tok.normalizer, tok.pre_tokenizer = rebuilt.normalizer, rebuilt.pre_tokenizer
        tok.save(str(Path(out_dir) / "tokenizer.json"))
    return len(fast)


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    num_shards: int = 1,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    hidden_size: int = 64,
    num_layers: int | None = None,  # None: 2, or the arch's DEFAULT_LAYERS
    num_heads: int = 4,
    num_kv_heads: int = 2,
    # fp8-tensor | fp8-channel | fp8-block (baton/tiny_fp8.py) | mxfp4 (gpt_oss's experts)
    quantize: str | None = None,
    kv_scales: bool = False,  # with quantize: KV cache scales per layer too
    # with fp8 quantize: layers left float and listed so (names, or ``re:`` patterns)
    keep_float: tuple[str, ...] = (),
    initializer_range: float | None = None,  # None: 0.1, or 0.03 for an FP8 checkpoint
    # Qwen3-MoE, DeepSeek: one expert's (Qwen3-Next: its shared expert's too; None: 32)
    moe_intermediate_size: int | None = None,
    linear_head_dim: int | None = None,  # Gated DeltaNet's key and value heads' (None: 16)
    head_dim: int | None = None,  # the attention heads' width (None: the arch's, 16 or 32)
    # MLA (DeepSeek): its heads' (qk_nope, qk_rope, v) widths (None: 16, 8, 16; DeepSeek's
    # own, (128, 64, 128), give the 192-wide keys and 128-wide values FlashAttention-4 takes)
    mla_widths: tuple[int, int, int] | None = None,
) -> Path:
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(sorted(ARCHS))}")
    if keep_float and (quantize is None or not quantize.startswith("fp8")):
        raise ValueError("keep_float names layers an FP8 checkpoint leaves float (give an fp8 "
                         "quantize)")  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out, splits_like=SPLITS_LIKE.get(arch))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    cls_name, extra = ARCHS[arch]
    num_layers = num_layers or DEFAULT_LAYERS.get(arch, 2)
    if moe_intermediate_size is not None:
        extra = {**extra, "moe_intermediate_size": moe_intermediate_size}
        if "shared_expert_intermediate_size" in extra:
            extra["shared_expert_intermediate_size"] = moe_intermediate_size
    if linear_head_dim is not None:
        if "linear_key_head_dim" not in extra:
            raise ValueError(f"{arch} has no Gated DeltaNet layers (linear_head_dim)")
        extra = {**extra, "linear_key_head_dim": linear_head_dim,
                 "linear_value_head_dim": linear_head_dim}  # fmt: skip
    if head_dim is not None:
        if "head_dim" not in extra:
            raise ValueError(f"{arch}'s heads are hidden_size / num_heads wide (head_dim)")
        extra = {**extra, "head_dim": head_dim}
    if mla_widths is not None:
        if "kv_lora_rank" not in extra:
            raise ValueError(f"{arch} has no latent attention (mla_widths)")
        nope, rope, v = mla_widths
        extra = {**extra, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v}
    if cls_name.startswith("Deepseek"):  # MLA: every head reads the one latent
        num_kv_heads = num_heads
    config = getattr(transformers, cls_name)(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        # FP8 checkpoints: weights nearer a trained model's scale. At 0.1 the two-layer random
        # model is chaotic: a 2.5 % weight error (e4m3's) moved some positions' logits to a
        # cosine of 0.74 with the float model's; at 0.03, 0.99
        initializer_range=initializer_range or (0.03 if quantize else 0.1),
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **extra,
    )
    if arch == "qwen2":
        config.use_sliding_window = False
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in ROUTER_SCALE:
        _spread_routers(model, ROUTER_SCALE[arch])
    if arch in ("deepseek_v3", "glm4_moe", "minimax_m2"):
        _random_correction_bias(model)
    if arch in ("glm4_moe", "minimax_m2"):  # q/k norms of w start at w = 1: random, tested
        _random_qk_norms(model)
    if arch in ("gemma3", "qwen3_5", "qwen3_next", "qwen3_5_moe"):  # norms of 1 + w start at 0
        _random_norms(model)
    if arch == "gpt_oss":
        _random_expert_biases(model)
    if arch in ("qwen2", "glm4_moe"):  # random q/k/v biases, so loading them is really tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
    shard = (
        f"{max(1, _param_bytes(model) // num_shards // 1000 + 1)}KB" if num_shards > 1 else "5GB"
    )
    model.save_pretrained(out, max_shard_size=shard)
    if arch in STACKED_EXPERTS:
        _stack_experts(out)
    if quantize == "mxfp4":
        if kv_scales:
            raise ValueError("KV cache scales come with an FP8 checkpoint, not MXFP4")
        _mxfp4_experts(out, arch)
    elif quantize is not None:
        from baton.tiny_fp8 import quantize_checkpoint

        quantize_checkpoint(out, model, tokenizer, quantize, seed, kv_scales, keep_float)
    elif kv_scales:
        raise ValueError("KV cache scales come with an FP8 checkpoint (give quantize)")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [config.eos_token_id, im_end]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


# MoE archs: their routers' weights × this. At the initializer's scale a random router's
# logits are close together: near-ties between experts that float noise (another batch's
# summation order, two ranks) could flip; scaled, each token's choice is clear and its tokens
# still spread over most experts (tests/integration/test_moe_models.py counts them)
ROUTER_SCALE = {"qwen3_moe": 4.0, "mixtral": 4.0, "deepseek_v2": 4.0, "deepseek_v3": 4.0,
                "gpt_oss": 4.0, "qwen3_next": 4.0, "glm4_moe": 4.0, "minimax_m2": 4.0,
                "qwen3_5_moe": 4.0}  # fmt: skip


# archs whose tokenizer transformers rebuilds with its own splitting (its
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS; Qwen2's and MiniMax-M2's split as this byte-level
# BPE does) → that tokenizer class
SPLITS_LIKE = {"qwen3_5_moe": "Qwen3_5Tokenizer"}

# archs whose published bf16 checkpoints keep a layer's experts stacked as transformers holds
# them (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), where
# ``save_pretrained`` writes each expert's projections apart
STACKED_EXPERTS = ("qwen3_5_moe",)


def _rewrite_tensors(
    out: Path, what: str, rewrite: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    """The checkpoint's one safetensors file, its tensors rewritten by ``rewrite``."""
    from safetensors.torch import load_file, save_file

    file = out / "model.safetensors"
    if not file.is_file():
        raise ValueError(f"{what} are written to one safetensors file (num_shards=1)")
    save_file(rewrite(load_file(file)), str(file), metadata={"format": "pt"})


def _stack_experts(out: Path) -> None:
    from baton.tiny_fp8 import stack_experts

    _rewrite_tensors(out, "stacked experts", stack_experts)


def _mxfp4_experts(out: Path, arch: str) -> None:
    """The checkpoint's experts in MXFP4, as openai publishes gpt-oss: each projection's
    [out, in] weights as ``<proj>_blocks`` and ``<proj>_scales`` (models/mxfp4.py), the
    biases and every other layer as they were, and the config's ``quantization_config`` as
    the published one (attention, routers, embeddings and the LM head not converted)."""
    from services.worker.engine.models.mxfp4 import quantize

    if arch != "gpt_oss":
        raise ValueError("MXFP4 checkpoints are written for gpt_oss (its experts)")

    def experts_in_mxfp4(state: dict[str, Any]) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for name, t in state.items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                # ([E, in, out] as transformers keeps them; the blocks are of [out, in] rows)
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize(t.transpose(1, 2))
            else:
                tensors[name] = t
        return tensors

    _rewrite_tensors(out, "MXFP4 experts", experts_in_mxfp4)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _spread_routers(model: Any, scale: float) -> None:
    import torch

    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith((".mlp.gate", ".mlp.router")):  # (gpt-oss: router)
                module.weight.mul_(scale)


def _random_expert_biases(model: Any) -> None:
    """gpt-oss's experts' biases start at zero: random, so that loading them (every expert's,
    gate and up interleaved) and adding them is tested."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.copy_(torch.randn_like(bias) * 0.1)


def _random_correction_bias(model: Any) -> None:
    """DeepSeek-V3's routers' ``e_score_correction_bias`` starts at zero: random, it steers the
    choice of experts (not their weights), so that loading and applying it is tested."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn_like(bias) * 0.1)


def _random_norms(model: Any) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # (Qwen3.5's gated norm: w, not 1 + w)
                param.normal_(1.0, 0.2)
            elif name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)


def _random_qk_norms(model: Any) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.2)


def _param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
