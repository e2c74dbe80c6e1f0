"""The Llama-family dense decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

It runs on a flattened batch (``input_ids``/``positions`` of shape [num_tokens]) and reads the
paged KV cache through the attention backend; ``compute_logits`` runs only on the rows the
runner will sample from.
"""

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from services.worker.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
)
from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.layers.activation import SiluAndMul
from services.worker.engine.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.worker.engine.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from services.worker.engine.models.layers.norm import RMSNorm
from services.worker.engine.models.layers.rotary import RotaryEmbedding
from services.worker.engine.models.quantization import Codes, QuantConfig
from services.worker.engine.models.weights import Loaded, one_value

# (the layer, q, k, v, the step's metadata) → the attention's output, [tokens, heads, head_dim]
AttentionSplit = Callable[
    ["LlamaAttention", torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor
]


class LlamaAttention(nn.Module):
    # with fused kernels, the rotary kernel stores the step's keys and values in the KV cache
    # (False: the attention backend's own write, a launch of its own; benchmarks compare them)
    ROTARY_STORES_KV: ClassVar[bool] = True

    def __init__(
        self,
        arch: ArchConfig,
        max_positions: int,
        backend: type[AttentionBackend],
        fused: bool = False,
        quant: QuantConfig | None = None,
    ):
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, d, arch.num_heads, arch.num_kv_heads, arch.attention_bias, fused,
            quant,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.head_dim = d
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, False, fused, quant)
        self.rotary = RotaryEmbedding(d, max_positions, arch.rope, fused)
        # the fused rotary stores the step's keys (rotated) and values in the KV cache itself,
        # and the backend skips its write: one launch and one pass over the keys fewer a layer
        self.stores_kv = fused and self.ROTARY_STORES_KV
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, fused) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, fused) if arch.qk_norm else None
        self.attn = backend(self.num_heads, self.num_kv_heads, d, scale=d**-0.5)
        self.kv_cache: LayerKVCache | None = None  # bound by the worker after cache allocation
        # set by a piecewise CUDA graph runner (worker/piecewise_graphs.py) while it captures or
        # runs the forward: it is called in place of the backend, and the graph splits there
        self.split: AttentionSplit | None = None
        # a checkpoint's KV cache scales (compressed-tensors kv_cache_scheme): an FP8 cache
        # holds k / k_scale and v / v_scale; without them its scales are 1
        self.k_scale: nn.Parameter | None = None
        self.v_scale: nn.Parameter | None = None
        if quant is not None and quant.kv_scales:
            self.k_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        """``self_attn.k_scale`` / ``v_scale``: one positive value each (every rank the same)."""
        scale = float(one_value(loaded, "a KV cache scale (per tensor)"))
        if not scale > 0.0 or scale == float("inf"):
            raise ValueError(f"a KV cache scale must be positive and finite, got {scale}")
        param.data.fill_(scale)

    def kv_scales(self) -> tuple[float, float]:
        """The (key, value) scales an FP8 cache of this layer takes."""
        if self.k_scale is None or self.v_scale is None:
            return 1.0, 1.0
        return float(self.k_scale), float(self.v_scale)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Codes, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.q_norm and self.k_norm else None
        assert self.kv_cache is not None, "KV cache not bound"
        if self.stores_kv:
            q = self.rotary.forward_and_store(
                positions, q, k, v, self.kv_cache, meta.slot_mapping, norms
            )
        else:
            q, k = self.rotary(positions, q, k, norms)
        if self.split is not None:
            out = self.split(self, q, k, v, meta)
        else:
            out = self.attn.forward(q, k, v, self.kv_cache, meta, store_kv=not self.stores_kv)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, fused: bool = False, quant: QuantConfig | None = None):
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {arch.hidden_act!r}; supported: silu")
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [inter, inter], arch.mlp_bias, fused, quant
        )
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, arch.mlp_bias, fused, quant)
        self.act = SiluAndMul(fused)

    def forward(self, x: torch.Tensor | Codes) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(self.act(h, self.down_proj.takes_codes(h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        max_positions: int,
        backend: type[AttentionBackend],
        fused: bool = False,
        quant: QuantConfig | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(arch, max_positions, backend, fused, quant)
        self.mlp = LlamaMLP(arch, fused, quant)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # an FP8 layer that takes its input quantized gets codes from the norm before it
        codes = self.self_attn.qkv_proj.takes_codes(x)
        h: torch.Tensor | Codes
        if residual is None:
            residual, h = x, self.input_layernorm(x, codes)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual, codes)
        x = self.self_attn(positions, h, meta)
        codes = self.mlp.gate_up_proj.takes_codes(x)
        h, residual = self.post_attention_layernorm.forward_residual(x, residual, codes)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        max_positions: int,
        backend: type[AttentionBackend],
        fused: bool = False,
        quant: QuantConfig | None = None,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, max_positions, backend, fused, quant)
            for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fused)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        assert residual is not None
        out, _ = self.norm.forward_residual(x, residual)
        assert isinstance(out, torch.Tensor)  # (no codes asked)
        return out


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that we load into one stacked parameter: name → (our name, shard id).
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        arch: ArchConfig,
        max_positions: int,
        backend: type[AttentionBackend],
        fused: bool = False,
        quant: QuantConfig | None = None,
    ):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, max_positions, backend, fused, quant)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]  # type: ignore[misc]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
