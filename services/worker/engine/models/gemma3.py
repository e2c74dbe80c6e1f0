"""Gemma 3's text decoder (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

What sets it apart from the Llama family (models/llama.py), after Hugging Face's
``modeling_gemma3.py``:

- its RMSNorm scales by (1 + w), in float32 (``GemmaRMSNorm``), and a layer has four: before and
  after the attention, before and after the MLP. The "after" ones normalise a sublayer's output
  before it joins the residual stream:

      x ─┬─ norm ─ attention ─ norm ─(+)─┬─ norm ─ MLP ─ norm ─(+)─► next layer
         └────────────────────────────────┘└─────────────────────────┘

- q and k are normalised per head (Gemma norms) before the rotary;
- ``layer_types``: sliding-window layers (the query at p sees the keys in (p - W, p]) with their
  own rotary base, and global layers with the global rotary (linear scaling in the larger
  checkpoints); each kind's cos/sin tables are built once and shared by its layers;
- the embedding is multiplied by sqrt(hidden), rounded to the model's dtype; the softmax scale is
  ``query_pre_attn_scalar ** -0.5``; the MLP is GELU (tanh) · up; the logits may be soft-capped.

The engine's fused kernels cover SiLU and plain RMSNorm only: with ``ctx.kernels`` Gemma's
norms and GELU still run in plain PyTorch (the rotary, the same as Llama's, stays fused). The KV
cache is full length for every layer; a sliding layer's backend reads only its window of it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from services.worker.engine.models.layers.rotary import RotaryEmbedding
from services.worker.engine.models.llama import (
    CausalLM,
    DecoderModel,
    LlamaAttention,
    LlamaForCausalLM,
)

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) · (1 + w) in float32, then cast back: the checkpoint's w is centred on 0, and
    it multiplies before the cast (Llama's norm casts first)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` becomes the new residual; returns (its norm, it)."""
        residual = residual + x
        return self(residual), residual


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's q/k norms (applied before the rotary: the fused rotary
    takes Llama's only), the rotary of the layer's kind (shared by those layers), the softmax
    scale from ``query_pre_attn_scalar``, a bias on o where the config says, and a window on
    the sliding layers."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext, rotary: RotaryEmbedding, kind: str):
        if arch.attn_logit_softcapping is not None:
            raise ValueError(
                "attn_logit_softcapping is not supported: no attention backend soft-caps scores"
            )
        d = arch.head_dim
        super().__init__(
            arch, ctx, rotary=rotary, o_bias=arch.attention_bias,
            scale=(arch.query_pre_attn_scalar or d) ** -0.5,
            window=arch.sliding_window if kind == SLIDING else None,
        )  # fmt: skip
        self.q_norm = GemmaRMSNorm(d, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, arch.rms_norm_eps)

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        assert self.q_norm is not None and self.k_norm is not None
        return self.q_norm(q), self.k_norm(k), None


class Gemma3MLP(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__()
        if arch.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(
                f"unsupported Gemma hidden_activation {arch.hidden_act!r}; supported: "
                "gelu_pytorch_tanh"
            )
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [inter, inter], False, ctx.linear
        )
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, False, ctx.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ModelContext, rotary: RotaryEmbedding, kind: str):
        super().__init__()
        self.self_attn = Gemma3Attention(arch, ctx, rotary, kind)
        self.mlp = Gemma3MLP(arch, ctx)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the layer before's MLP output, normed, not yet added to ``residual`` (None:
        the first layer, ``x`` the embedding). Returns its own (MLP output, residual)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, meta))
        h, residual = self.pre_feedforward_layernorm.forward_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(DecoderModel):
    """The shared stack with Gemma's embedding scale, final norm, and one rotary table per
    layer kind (local and global bases), shared by that kind's layers."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        kinds = arch.layer_types or (FULL,) * arch.num_layers
        unknown = set(kinds) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"unsupported Gemma 3 layer_types {sorted(unknown)}")
        if SLIDING in kinds and arch.sliding_window is None:
            raise ValueError("Gemma 3 sliding_attention layers need a sliding_window")
        ropes = {FULL: arch.rope, SLIDING: arch.rope_local or arch.rope}
        rotary = {kind: RotaryEmbedding(arch.head_dim, ctx.max_positions, ropes[kind], ctx.kernels)
                  for kind in sorted(set(kinds))}  # fmt: skip

        def layer(arch: ArchConfig, ctx: ModelContext, i: int) -> nn.Module:
            return Gemma3DecoderLayer(arch, ctx, rotary[kinds[i]], kinds[i])

        super().__init__(arch, ctx, layer)
        self.rotary = nn.ModuleDict(rotary)
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)  # type: ignore[assignment]
        # sqrt(hidden) in the model's dtype, as Hugging Face rounds it (55.4256 → 55.5 in bf16)
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size**0.5), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)


class Gemma3ForCausalLM(CausalLM):
    packed_modules = LlamaForCausalLM.packed_modules  # (q/k/v and gate/up stacked alike)

    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__(arch, ctx)
        self.softcap = arch.final_logit_softcapping

    def build_model(self, arch: ArchConfig, ctx: ModelContext) -> DecoderModel:
        return Gemma3Model(arch, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is not None:  # (a rank other than 0 holds no logits: nothing to cap)
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
