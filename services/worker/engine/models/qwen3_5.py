"""Qwen3.5's text decoder (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``), Qwen3.5-MoE's
(``Qwen3_5MoeForCausalLM``) and Qwen3-Next (``Qwen3NextForCausalLM``), the same decoder with
mixture-of-experts layers: a hybrid of
Gated DeltaNet layers (``layers/gated_delta_net.py``, a fixed-size recurrent state per request)
and full-attention layers, three of the first for every one of the second, after Hugging
Face's ``modeling_qwen3_5.py``.

What sets it apart from the Llama family (models/llama.py):

- ``layer_types``: "linear_attention" layers mix tokens with Gated DeltaNet, "full_attention"
  layers with attention; each kind keeps its own KV cache group (kv_cache/groups.py: the
  recurrent layers' state in pages, the attention layers' K and V in blocks);
- the attention's query projection also yields a per-head gate (out · σ(gate) before o), its
  q and k are normalised per head, and its rotary turns only a share of each head's dims
  (``partial_rotary_factor``, 0.25);
- its RMSNorms scale by (1 + w) in float32, as Gemma's (``GemmaRMSNorm``).

The feed-forward layers are Llama's dense SiLU MLPs (Qwen3.5-MoE's and Qwen3-Next's: experts,
``MoEBlock``, with a gated shared expert; Qwen3-Next's beside dense ones where
``mlp_only_layers`` says). The rotary stays unfused (the fused kernel
turns whole heads), and the backend stores the keys.
"""

from typing import ClassVar

import torch
from torch import nn

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.gemma3 import GemmaRMSNorm
from services.worker.engine.models.layers.gated_delta_net import GatedDeltaNet
from services.worker.engine.models.layers.moe import (
    MoEBlock,
    expert_target,
    stacked_expert_target,
)
from services.worker.engine.models.layers.rotary import RotaryEmbedding
from services.worker.engine.models.llama import (
    CausalLM,
    DecoderModel,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    PreNormDecoderLayer,
)
from services.worker.engine.models.weights import CheckpointTarget

LINEAR, FULL = "linear_attention", "full_attention"


class Qwen3_5Attention(LlamaAttention):
    """Llama's attention with a gated output, Gemma-style q/k norms and a partial rotary."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext, rotary: RotaryEmbedding):
        super().__init__(arch, ctx, rotary=rotary, o_bias=arch.attention_bias, gated=True)
        self.stores_kv = False  # (the rotary is not the fused kernel)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        assert self.q_norm is not None and self.k_norm is not None
        return self.q_norm(q), self.k_norm(k), None


class Qwen3_5DecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, arch: ArchConfig, ctx: ModelContext, rotary: RotaryEmbedding, index: int
    ) -> None:
        super().__init__()
        self.kind = arch.layer_types[index]
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(arch, ctx)
        else:
            self.self_attn = Qwen3_5Attention(arch, ctx, rotary)
        self.mlp: LlamaMLP | MoEBlock
        if arch.moe is not None and index in arch.moe.sparse_layers:  # (Qwen3-Next, 3.5-MoE)
            self.mlp = MoEBlock(arch, ctx)
        else:
            self.mlp = LlamaMLP(arch, ctx)
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: Gated DeltaNet or attention."""
        return self.linear_attn if self.kind == LINEAR else self.self_attn


class Qwen3_5Model(DecoderModel):
    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        kinds = arch.layer_types
        unknown = set(kinds) - {LINEAR, FULL}
        if not kinds or unknown:
            raise ValueError(f"Qwen3.5 and Qwen3-Next need layer_types of {LINEAR} and {FULL}, got "
                             f"{sorted(unknown) or 'none'}")  # fmt: skip
        if arch.linear_attention is None:
            raise ValueError("linear_attention layers need the linear_* config fields")
        rotary_dim = int(arch.head_dim * arch.partial_rotary_factor)
        rotary = RotaryEmbedding(arch.head_dim, ctx.max_positions, arch.rope,
                                 rotary_dim=rotary_dim)  # fmt: skip

        def layer(arch: ArchConfig, ctx: ModelContext, i: int) -> nn.Module:
            return Qwen3_5DecoderLayer(arch, ctx, rotary, i)

        super().__init__(arch, ctx, layer)
        self.rotary = rotary
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)  # type: ignore[assignment]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # the state pages are worked out by the first Gated DeltaNet layer of every forward:
        # a decode graph is captured by forwards over one metadata object, whose buffers each
        # replay refills, so the capture must record that arithmetic (not reuse a warm-up's)
        for group in meta.groups or (meta,):
            group.state_pages = None
        out: torch.Tensor = super().forward(input_ids, positions, meta)
        return out


class Qwen3_5ForCausalLM(CausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        **LlamaForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj_qkvz", "qkv"),
        "in_proj_z": ("in_proj_qkvz", 3),
        "in_proj_b": ("in_proj_ba", 0),
        "in_proj_a": ("in_proj_ba", 1),
    }

    # Qwen3_5ForConditionalGeneration's checkpoints: the text decoder under
    # ``model.language_model``; the vision encoder and the multi-token-prediction layers
    # (a draft model for speculative decoding) are not run
    checkpoint_prefixes: ClassVar[dict[str, str]] = {"model.language_model.": "model."}

    def build_model(self, arch: ArchConfig, ctx: ModelContext) -> DecoderModel:
        return Qwen3_5Model(arch, ctx)

    def unused_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith(("model.visual.", "mtp."))

    def decoder_layers(self) -> list[Qwen3_5DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, Qwen3_5DecoderLayer)]

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.decoder_layers() if layer.kind == FULL]

    def cache_layers(self) -> list[nn.Module]:
        return [layer.mixer for layer in self.decoder_layers()]


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5's decoder (its layers came first) with mixture-of-experts
    feed-forward layers (``layers/moe.py``: softmax top-k, and a shared expert scaled by a
    per-token sigmoid gate) where ``MoEConfig.sparse_layers`` says, and its Gated DeltaNet
    projections stored by key head (``GatedDeltaNetProjection``)."""

    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        **LlamaForCausalLM.packed_modules,
        "in_proj_qkvz": ("in_proj_qkvz", "qkvz"),
        "in_proj_ba": ("in_proj_ba", "ba"),
    }

    def checkpoint_target(self, name: str) -> CheckpointTarget | None:
        """A routed expert's projection (``layers/moe.expert_target``); the shared expert's
        (``mlp.shared_expert.*``, gate and up stacked) and its gate, which are our
        ``mlp.shared_experts``. None: the packed-module table maps it (models/loader.py)."""
        target = expert_target(name)
        if target is not None or ".mlp.shared_expert" not in name:
            return target
        if name.endswith(".mlp.shared_expert_gate.weight"):
            return CheckpointTarget(name.replace("shared_expert_gate.weight",
                                                 "shared_experts.output_gate"), None)  # fmt: skip
        for theirs, (ours, shard) in _SHARED_EXPERT.items():
            if f".mlp.shared_expert.{theirs}." in name:
                return CheckpointTarget(
                    name.replace(f".shared_expert.{theirs}.", f".shared_experts.{ours}."), shard
                )
        return None


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE (the 35B-A3B to the 397B-A17B, and the published
    ``Qwen3_5MoeForConditionalGeneration`` checkpoints' text model): Qwen3-Next's decoder,
    every layer's feed-forward a mixture of experts, with Qwen3.5's Gated DeltaNet projections
    (``in_proj_qkv``, ``_z``, ``_b``, ``_a``). Its bf16 checkpoints keep a layer's experts
    stacked as ``transformers`` does (``experts.gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]); its FP8 ones each expert's projections apart, as Qwen3-Next's."""

    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = Qwen3_5ForCausalLM.packed_modules

    def checkpoint_target(self, name: str) -> CheckpointTarget | None:
        return stacked_expert_target(name, interleaved=False) or super().checkpoint_target(name)


# Qwen3-Next's shared expert's projections → ours (``layers/moe.SharedExperts``), shard
_SHARED_EXPERT: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}  # fmt: skip
