"""Reads a Hugging Face checkpoint's config.json into a typed, frozen ``ArchConfig``.

Torch-free on purpose: the gateway uses it too (context length, eos ids). Handles both the
transformers<5 spelling (``rope_theta`` + ``rope_scaling``) and the v5 one (``rope_parameters``).
A GGUF model has no config.json: its metadata reads as one (``shared/gguf_checkpoint.py``).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.worker.engine.kv_cache.groups import RECURRENT
from shared.gguf_files import gguf_path


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | dynamic (fixed at load)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # YaRN (rope_type "yarn": DeepSeek-V2/V3): the ramp between interpolated and extrapolated
    # frequencies, and the attention scale's correction (``mscale``, ``mscale_all_dim``; 0 where
    # the config gives none: the tables' scale is then YaRN's own, from the factor alone)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # the ramp's ends rounded to whole pairs (gpt-oss: False)
    attention_factor: float = 0.0  # YaRN: the tables' scale as the config gives it (0: derived)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts decoder's feed-forward layers (Qwen3-MoE, Qwen3-Next, Mixtral,
    DeepSeek-V2/V3, gpt-oss).

    Routing: ``scoring`` (softmax | sigmoid) of the router's logits, plus a learned per-expert
    ``correction_bias`` for the choice only (DeepSeek-V3's ``noaux_tc``); the experts split in
    ``num_groups`` groups of which the best ``topk_groups`` are eligible (group-limited top-k;
    a group's score is its best expert's, or with a correction bias the sum of its best two);
    the top ``top_k`` eligible experts are taken, their weights (the scores, without bias)
    renormalized to sum 1 when ``norm_topk_prob``, then multiplied by
    ``routed_scaling_factor``. ``scoring`` "softmax_of_topk" (gpt-oss) takes the top ``top_k``
    logits and weighs them by their softmax (no renormalization, no scaling)."""

    num_experts: int  # routed experts
    top_k: int
    intermediate_size: int  # one expert's (moe_intermediate_size)
    scoring: str = "softmax"  # softmax | sigmoid | softmax_of_topk
    norm_topk_prob: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False  # e_score_correction_bias (DeepSeek-V3)
    routed_scaling_factor: float = 1.0
    # the router's logits in float32 (DeepSeek's gate casts x and its weight) or, False, in
    # the model's dtype, as Qwen3-MoE's, Mixtral's and gpt-oss's gates compute them
    router_float32: bool = True
    # shared experts beside the routed ones, as one dense MLP of this intermediate size
    # (DeepSeek: n_shared_experts × moe_intermediate_size); 0: none
    shared_intermediate_size: int = 0
    # the shared experts' output scaled per token by σ(x · w), w [1, hidden] (Qwen3-Next's
    # ``shared_expert_gate``)
    shared_expert_gate: bool = False
    # which decoder layers are MoE (the others are dense MLPs of ``ArchConfig.intermediate_size``)
    sparse_layers: tuple[int, ...] = ()
    # gpt-oss: a bias on the router's logits, and on every expert's gate, up and down
    router_bias: bool = False
    expert_bias: bool = False
    # the experts' activation: "silu" (silu(gate) · up) or "swiglu_clamped" (gpt-oss: gate
    # clamped above at ``swiglu_limit``, up at ±limit, then (up + 1) · gate · σ(alpha · gate))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent vector of
    ``kv_lora_rank`` plus the shared rotary key of ``qk_rope_head_dim`` per token and layer."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q is one projection (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the rotary pairs are adjacent (DeepSeek's checkpoints)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """One token's cache entry per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3.5's and Qwen3-Next's ``linear_attention`` layers): a short
    causal convolution over q, k, v, then the gated delta rule, whose state per request is a
    fixed-size matrix per value head, not K and V per token."""

    conv_kernel: int  # linear_conv_kernel_dim
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def state_elements(self, tp: int = 1) -> int:
        """One layer's state on one of ``tp`` ranks, in float32 values (the engine keeps it in
        float32): the convolution's last ``conv_kernel - 1`` inputs and the recurrent state
        (value heads × key dim × value dim)."""
        conv = self.conv_dim // tp * (self.conv_kernel - 1)
        return conv + self.num_value_heads // tp * self.key_head_dim * self.value_head_dim


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
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3; GLM-4.5's ``use_qk_norm``)
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str  # as written in the checkpoint, e.g. "bfloat16"
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    moe: MoEConfig | None = None  # a mixture-of-experts decoder's
    mla: MLAConfig | None = None  # multi-head latent attention's (then the KV cache is latent)
    # each decoder layer's attention: "sliding_attention" (a window of ``sliding_window``) or
    # "full_attention" (Gemma 3, gpt-oss); () where the config names no kinds
    layer_types: tuple[str, ...] = ()
    # the sliding-window layers' own rotary (Gemma 3's local base); None: they take ``rope``
    rope_local: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None  # Gemma: the softmax scale is its ** -0.5
    final_logit_softcapping: float | None = None  # Gemma: logits → cap · tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # the same on the attention scores
    # Gated DeltaNet layers (``layer_types`` "linear_attention": Qwen3.5); None: none
    linear_attention: LinearAttentionConfig | None = None
    # the attention's rotary covers this share of each head's dims (Qwen3.5: 0.25)
    partial_rotary_factor: float = 1.0

    def kv_cache_entry(self) -> tuple[int, int, int]:
        """(parts, heads, dim) of one token's KV cache entry per layer over all ranks: K and V
        of every KV head (2, num_kv_heads, head_dim), or MLA's one latent vector (1, 1,
        kv_lora_rank + qk_rope_head_dim), which every tensor-parallel rank holds whole."""
        if self.mla is not None:
            return 1, 1, self.mla.cache_dim
        return 2, self.num_kv_heads, self.head_dim

    def layer_cache_kinds(self) -> tuple[int | str | None, ...]:
        """What each decoder layer keeps per request (``kv_cache/groups.py``): its attention
        window (``attention_windows``), or ``RECURRENT`` for a Gated DeltaNet layer."""
        windows = self.attention_windows()
        return tuple(RECURRENT if kind == "linear_attention" else w
                     for kind, w in zip(self.layer_types or (None,) * self.num_layers, windows,
                                        strict=True))  # fmt: skip

    def attention_windows(self) -> tuple[int | None, ...]:
        """Each decoder layer's attention window: W for a ``sliding_attention`` layer (the query
        at p sees the keys in (p - W, p]), None for full attention. Only ``layer_types`` makes a
        layer slide: a dense model's lone ``sliding_window`` (Mistral's, Qwen2's) is not used."""
        if not self.layer_types:
            return (None,) * self.num_layers
        return tuple(self.sliding_window if kind == "sliding_attention" else None
                     for kind in self.layer_types)  # fmt: skip


def _rope(cfg: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return _rope_from(params, cfg.get("rope_theta", default_theta))


def _rope_from(params: dict[str, Any], default_theta: float) -> RopeConfig:
    theta = params.get("rope_theta", default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    orig = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(params.get("attention_factor") or 0.0),
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


def _moe(cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """The MoE fields of a Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, DeepSeek-V2/V3,
    GLM-4.5, MiniMax-M2 or gpt-oss config; None for a dense one."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    if not experts:
        return None
    model_type = str(cfg.get("model_type", ""))
    top_k = int(cfg["num_experts_per_tok"])
    if model_type.startswith("deepseek") or model_type == "glm4_moe":  # (GLM-4.5: V3's MoE)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        sparse = tuple(i for i in range(first_dense, num_layers) if i % freq == 0)
        v3 = model_type in ("deepseek_v3", "glm4_moe")
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported DeepSeek topk_method {method!r}")
        grouped = method != "greedy"
        inter = int(cfg["moe_intermediate_size"])
        scoring = cfg.get("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax")
        return MoEConfig(
            num_experts=int(experts), top_k=top_k, intermediate_size=inter,
            scoring=str(scoring),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "glm4_moe")),
            num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
            topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
            correction_bias=method == "noaux_tc",
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
            sparse_layers=sparse,
        )  # fmt: skip
    if model_type == "mixtral":
        return MoEConfig(int(experts), top_k, int(cfg["intermediate_size"]),
                         router_float32=False, sparse_layers=tuple(range(num_layers)))  # fmt: skip
    if model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        sparse = tuple(range(num_layers))  # (Qwen3.5-MoE: every layer, whatever the config)
        norm = True  # (and always renormalized)
        if model_type != "qwen3_5_moe_text":
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            sparse = tuple(i for i in sparse if i not in dense and (i + 1) % step == 0)
            # (transformers' default where a config leaves it out: Qwen3-MoE's False)
            norm = cfg.get("norm_topk_prob", model_type == "qwen3_next")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)  # (Qwen3-Next's, 3.5's)
        return MoEConfig(int(experts), top_k, int(cfg["moe_intermediate_size"]),
                         norm_topk_prob=bool(norm),
                         router_float32=False, shared_intermediate_size=shared,
                         shared_expert_gate=shared > 0, sparse_layers=sparse)  # fmt: skip
    if model_type == "minimax_m2":  # sigmoid scores, a correction bias, no groups, no sharing
        # (the variants its published configs name: others are refused, not run as these)
        if (cfg.get("scoring_func") or "sigmoid") != "sigmoid":
            raise ValueError(f"unsupported MiniMax-M2 scoring_func {cfg['scoring_func']!r}")
        if (cfg.get("qk_norm_type") or "per_layer") != "per_layer":
            raise ValueError(f"unsupported MiniMax-M2 qk_norm_type {cfg['qk_norm_type']!r}")
        if cfg.get("shared_intermediate_size"):
            raise ValueError("MiniMax-M2 configs with shared experts are not supported")
        return MoEConfig(int(experts), top_k, int(cfg["intermediate_size"]), scoring="sigmoid",
                         correction_bias=True, router_float32=False,
                         sparse_layers=tuple(range(num_layers)))  # fmt: skip
    if model_type == "gpt_oss":
        return MoEConfig(int(experts), top_k, int(cfg["intermediate_size"]),
                         scoring="softmax_of_topk", router_bias=True, expert_bias=True,
                         router_float32=False,
                         activation="swiglu_clamped",
                         swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
                         swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
                         sparse_layers=tuple(range(num_layers)))  # fmt: skip
    raise ValueError(f"unsupported mixture-of-experts model_type {model_type!r}")


# Gemma 3's rotary bases where its config gives none (transformers' ``default_theta``)
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _layer_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(the rotary of the full-attention layers, the sliding layers' own or None). Gemma 3
    gives its sliding layers another base: transformers 5 nests ``rope_parameters`` by layer
    type; older configs write ``rope_theta`` + ``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` for the local ones."""
    params = cfg.get("rope_parameters") or {}
    gemma3 = cfg.get("model_type") == "gemma3_text"
    if "full_attention" in params or "sliding_attention" in params:
        ropes = [
            _rope_from(params.get(kind) or {}, _GEMMA3_THETA[kind])
            for kind in ("full_attention", "sliding_attention")
        ]
        return ropes[0], ropes[1]
    if not gemma3:
        return _rope(cfg), None
    local = float(cfg.get("rope_local_base_freq") or _GEMMA3_THETA["sliding_attention"])
    return _rope(cfg, _GEMMA3_THETA["full_attention"]), RopeConfig(theta=local)


_GATED_DELTA_NET = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # (their model_types)


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """The config's ``layer_types``, or where it gives none, the kinds transformers derives: an
    older Gemma 3 config's every ``sliding_window_pattern``-th layer global, gpt-oss's even
    layers sliding, Qwen3-Next's and Qwen3.5's every ``full_attention_interval``-th attending."""
    kinds = cfg.get("layer_types")
    if kinds is None and cfg.get("model_type") == "gemma3_text":
        every = int(cfg.get("sliding_window_pattern") or 6)
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention"
                 for i in range(num_layers)]  # fmt: skip
    if kinds is None and cfg.get("model_type") == "gpt_oss" and _sliding_window(cfg):
        # (transformers' default: the even layers slide)
        kinds = ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)]
    if kinds is None and cfg.get("model_type") in _GATED_DELTA_NET:
        # every ``full_attention_interval``-th layer attends, the others are Gated DeltaNet
        # (Qwen3-Next's published configs give the interval, not the list)
        every = int(cfg.get("full_attention_interval") or 4)
        kinds = ["linear_attention" if (i + 1) % every else "full_attention"
                 for i in range(num_layers)]  # fmt: skip
    if kinds is not None and len(kinds) != num_layers:
        raise ValueError(f"layer_types names {len(kinds)} layers, the model has {num_layers}")
    return tuple(str(kind) for kind in kinds or ())


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """The share of each head's dims the rotary turns: the config's ``partial_rotary_factor``
    (at the top or in ``rope_parameters``), or MiniMax-M2's ``rotary_dim`` over ``head_dim``."""
    factor = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor"
    )
    if factor is None and cfg.get("rotary_dim") and cfg.get("head_dim"):
        factor = int(cfg["rotary_dim"]) / int(cfg["head_dim"])
    return float(factor or _PARTIAL_ROTARY.get(str(cfg.get("model_type")), 1.0))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _mla(cfg: dict[str, Any]) -> MLAConfig | None:
    if cfg.get("kv_lora_rank") is None:
        return None
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        q_lora_rank=int(q_lora) if q_lora else None,
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _linear_attention(
    cfg: dict[str, Any], layer_types: tuple[str, ...]
) -> LinearAttentionConfig | None:
    if "linear_attention" not in layer_types:
        return None
    return LinearAttentionConfig(
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
        num_key_heads=int(cfg["linear_num_key_heads"]),
        num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
    )


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


# multimodal checkpoints whose text model the engine serves alone: model_type → its text
# config's (Qwen3.5's published checkpoints are Qwen3_5ForConditionalGeneration: a vision
# encoder beside the text decoder, whose config sits in ``text_config``)
_TEXT_OF_MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text model's config, as a text checkpoint's would read (its
    ``architectures`` kept: the registry maps them to the text model); others as they are."""
    text = cfg.get("text_config")
    model_type = str(cfg.get("model_type", ""))
    if model_type not in _TEXT_OF_MULTIMODAL or not isinstance(text, dict):
        return cfg
    merged = {
        key: value for key, value in cfg.items() if key not in ("text_config", "vision_config")
    }
    merged.update({key: value for key, value in text.items() if value is not None})
    merged["architectures"] = cfg.get("architectures") or []
    merged["model_type"] = _TEXT_OF_MULTIMODAL[model_type]
    # the multimodal model's own (Hugging Face's default for it: untied)
    merged["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    return merged


# transformers' defaults for fields a config may leave out where they differ from the generic
# ones read below (a config written by transformers holds them all; a hand-written one may not)
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": {"first_k_dense_replace": 1, "n_shared_experts": 1, "rms_norm_eps": 1e-5},
    "minimax_m2": {"head_dim": 128, "rope_theta": 5_000_000.0},
    # (every layer a mixture of experts: its configs name no dense MLP)
    "qwen3_5_moe_text": {"intermediate_size": 0},
}
# the share of each head the rotary turns where a config names none (Glm4MoeConfig's 0.5)
_PARTIAL_ROTARY = {"glm4_moe": 0.5, **dict.fromkeys(_GATED_DELTA_NET, 0.25)}


def load_arch_config(model_dir: str | Path, cfg: dict[str, Any] | None = None) -> ArchConfig:
    """Parse ``config.json`` (``cfg`` when the caller has read it already: ``load_hf_config``)
    and ``generation_config.json`` for extra eos ids. A multimodal checkpoint's: its text
    model's (``text_config``)."""
    path = Path(model_dir)
    if cfg is None:
        cfg = load_hf_config(path)
    cfg = text_config(cfg)
    cfg = {**_TYPE_DEFAULTS.get(str(cfg.get("model_type", "")), {}), **cfg}
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
    rope, rope_local = _layer_ropes(cfg)
    layer_types = _layer_types(cfg, int(cfg["num_hidden_layers"]))
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
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3_text")),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "qwen3_moe")
        or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        # (Gemma's ``hidden_activation`` is the one it runs; its ``hidden_act`` is ignored)
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        sliding_window=_sliding_window(cfg),
        eos_token_ids=tuple(eos),
        bos_token_id=cfg.get("bos_token_id"),
        moe=_moe(cfg, int(cfg["num_hidden_layers"])),
        mla=_mla(cfg),
        layer_types=layer_types,
        rope_local=rope_local,
        query_pre_attn_scalar=_optional_float(cfg.get("query_pre_attn_scalar")),
        final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping")),
        attn_logit_softcapping=_optional_float(cfg.get("attn_logit_softcapping")),
        linear_attention=_linear_attention(cfg, layer_types),
        partial_rotary_factor=_partial_rotary_factor(cfg),
    )
