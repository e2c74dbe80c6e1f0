"""Reads a Hugging Face checkpoint's config.json into a typed, frozen ``ArchConfig``.

Torch-free on purpose: the gateway uses it too (context length, eos ids). Handles both the
transformers<5 spelling (``rope_theta`` + ``rope_scaling``) and the v5 one (``rope_parameters``).
A GGUF model has no config.json: its metadata reads as one (``shared/gguf_checkpoint.py``).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.gguf_files import gguf_path


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | dynamic (fixed at load)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # e.g. "LlamaForCausalLM"; the model registry key
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str  # as written in the checkpoint, e.g. "bfloat16"
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None


def _rope(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    orig = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    # Qwen2 writes a window but only uses it when use_sliding_window is true.
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


def load_hf_config(model: str | Path) -> dict[str, Any]:
    """A checkpoint's ``config.json``, or a GGUF model's metadata as one (``model``: a GGUF
    file or a directory holding one, ``shared/gguf_files.py``)."""
    gguf = gguf_path(model)
    if gguf is not None:
        from shared.gguf_checkpoint import hf_config

        return hf_config(gguf)
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no config.json in {model} (expected a Hugging Face checkpoint or a GGUF file)"
        )
    cfg: dict[str, Any] = json.loads(config_file.read_text())
    return cfg


def load_arch_config(model_dir: str | Path, cfg: dict[str, Any] | None = None) -> ArchConfig:
    """Parse ``config.json`` (``cfg`` when the caller has read it already: ``load_hf_config``)
    and ``generation_config.json`` for extra eos ids."""
    path = Path(model_dir)
    if cfg is None:
        cfg = load_hf_config(path)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"the config of {path} names no 'architectures'")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = list(_ids(cfg.get("eos_token_id")))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos += [
            i for i in _ids(json.loads(gen_file.read_text()).get("eos_token_id")) if i not in eos
        ]
    model_type = str(cfg.get("model_type", ""))
    return ArchConfig(
        architecture=str(archs[0]),
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=_rope(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        sliding_window=_sliding_window(cfg),
        eos_token_ids=tuple(eos),
        bos_token_id=cfg.get("bos_token_id"),
    )
