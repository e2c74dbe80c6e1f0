"""``baton make-tiny-model DIR --arch ...``: a small random checkpoint in Hugging Face format, with
a byte-level BPE tokenizer trained here on the Python standard library's own docstrings (no
download), loadable by both Baton and ``transformers``. For tests, the demo and benchmarks.
"""

import importlib
import json
import types
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
}


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


def train_tokenizer(out_dir: Path, vocab_size: int = 1024) -> int:
    """Train byte-level BPE, save it as a transformers fast tokenizer; returns its size."""
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
    return len(fast)


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    num_shards: int = 1,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    quantize: str | None = None,  # fp8-tensor | fp8-channel | fp8-block (baton/tiny_fp8.py)
    kv_scales: bool = False,  # with quantize: KV cache scales per layer too
    initializer_range: float | None = None,  # None: 0.1, or 0.03 for an FP8 checkpoint
) -> Path:
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(sorted(ARCHS))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    cls_name, extra = ARCHS[arch]
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
    if arch == "qwen2":  # random q/k/v biases, so loading them is really tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
    shard = (
        f"{max(1, _param_bytes(model) // num_shards // 1000 + 1)}KB" if num_shards > 1 else "5GB"
    )
    model.save_pretrained(out, max_shard_size=shard)
    if quantize is not None:
        from baton.tiny_fp8 import quantize_checkpoint

        quantize_checkpoint(out, model, tokenizer, quantize, seed, kv_scales)
    elif kv_scales:
        raise ValueError("KV cache scales come with an FP8 checkpoint (give quantize)")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [config.eos_token_id, im_end]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def _param_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
