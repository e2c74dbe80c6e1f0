"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), and
with mixture-of-experts feed-forward layers (``layers/moe.py``) Qwen3-MoE and Mixtral.

It runs on a flattened batch (``input_ids``/``positions`` of shape [num_tokens]) and reads the
paged KV cache through the attention backend; ``compute_logits`` runs only on the rows the
runner will sample from. Every layer is built from one ``ModelContext`` (models/context.py):
the attention backend, the engine's kernels on or off, and the quantization methods.
"""

import re
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from services.worker.engine.attention.backend import AttentionMetadata, LayerKVCache
from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.activation import SiluAndMul
from services.worker.engine.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.worker.engine.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from services.worker.engine.models.layers.moe import MoEBlock, expert_target
from services.worker.engine.models.layers.norm import ResidualNorm, RMSNorm
from services.worker.engine.models.layers.rotary import RotaryEmbedding
from services.worker.engine.models.weights import CheckpointTarget, Loaded
from services.worker.engine.quantization.fp8_math import Codes

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# (the layer, q, k, v, the step's metadata) → the attention's output, [tokens, heads, head_dim]
AttentionSplit = Callable[
    ["LlamaAttention", torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor
]


class LlamaAttention(nn.Module):
    """q/k/v projections, q/k norms (Qwen3), rotary, the attention backend over the paged cache,
    the o projection. The other decoders' attention is this one with their differences as
    arguments (gpt-oss, Gemma 3): a shared ``rotary``, a bias on o, another softmax ``scale``,
    a sliding ``window``, ``sinks``, an output ``gated`` by the query projection (Qwen3.5);
    ``normed`` is where a subclass puts other q/k norms."""

    def __init__(
        self, arch: ArchConfig, ctx: ModelContext, *, rotary: RotaryEmbedding | None = None,
        o_bias: bool = False, scale: float | None = None, window: int | None = None,
        sinks: torch.Tensor | None = None, gated: bool = False,
    ):  # fmt: skip
        super().__init__()
        d, fused = arch.head_dim, ctx.kernels
        # gated: each head's query rows are followed by as many of its gate's, out · σ(gate)
        self.gated = gated
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, d, arch.num_heads * (2 if gated else 1), arch.num_kv_heads,
            arch.attention_bias, ctx.linear,
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_heads // (2 if gated else 1)
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.head_dim = d
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, o_bias, ctx.linear)
        if rotary is None:
            # a partial rotary (GLM-4.5's: each head's first half turns) is not the fused
            # kernel's: the keys go to the backend, the q/k norms run before the rotary
            rotary_dim = int(d * arch.partial_rotary_factor)
            fused = fused and rotary_dim == d
            rotary = RotaryEmbedding(d, ctx.max_positions, arch.rope, fused, rotary_dim)
        self.rotary = rotary
        # the fused rotary stores the step's keys (rotated) and values in the KV cache itself,
        # and the backend skips its write: one launch and one pass over the keys fewer a layer
        self.stores_kv = fused
        self.q_norm: nn.Module | None = (
            RMSNorm(d, arch.rms_norm_eps, fused) if arch.qk_norm else None
        )
        self.k_norm: nn.Module | None = (
            RMSNorm(d, arch.rms_norm_eps, fused) if arch.qk_norm else None
        )
        self.attn = ctx.attention(self.num_heads, self.num_kv_heads, d, scale=scale or d**-0.5,
                                  sliding_window=window, sinks=sinks)  # fmt: skip
        self.kv_cache: LayerKVCache | None = None  # bound by the worker after cache allocation
        self.kv_group = 0  # its KV cache group (kv_cache/groups.py), bound with the cache
        # set by a piecewise CUDA graph runner (worker/piecewise_graphs.py) while it captures or
        # runs the forward: it is called in place of the backend, and the graph splits there
        self.split: AttentionSplit | None = None
        # the KV cache scales a checkpoint may hold (``self_attn.k_scale`` / ``v_scale``): an
        # FP8 cache holds k / k_scale and v / v_scale; without them its scales are 1
        self.kv_method = ctx.kv_cache
        self.kv_method.create_weights(self)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        """Its own parameters are the KV cache scales (the projections load their own)."""
        self.kv_method.load(param, loaded)

    def kv_scales(self) -> tuple[float, float]:
        """The (key, value) scales an FP8 cache of this layer takes."""
        return self.kv_method.scales(self)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Codes, meta: AttentionMetadata
    ) -> torch.Tensor:
        meta = meta.group(self.kv_group)
        qkv = self.qkv_proj(x)
        q_rows = self.q_size * (2 if self.gated else 1)
        q, k, v = qkv.split([q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.contiguous()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k, norms = self.normed(q, k)
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
        out = out.reshape(-1, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(-1, self.q_size))
        return self.o_proj(out)

    def normed(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[RMSNorm, RMSNorm] | None]:
        """(q, k, the norms the rotary applies first, fused): Qwen3's q/k RMSNorms go to the
        rotary; without them, none."""
        if isinstance(self.q_norm, RMSNorm) and isinstance(self.k_norm, RMSNorm):
            return q, k, (self.q_norm, self.k_norm)
        return q, k, None


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {arch.hidden_act!r}; supported: silu")
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [inter, inter], arch.mlp_bias, ctx.linear
        )
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, arch.mlp_bias, ctx.linear)
        self.act = SiluAndMul(ctx.kernels, feeds=self.down_proj)

    def forward(self, x: torch.Tensor | Codes) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class PreNormDecoderLayer(nn.Module):
    """A decoder layer of two pre-norm residual blocks: ``input_layernorm`` → the token mixer
    (``mixer``: the attention unless a model says otherwise) → ``post_attention_layernorm`` →
    ``mlp``, each norm adding the residual first (fused, ``forward_residual``). The first
    layer gets no residual: its input is one. Subclasses build the four modules."""

    input_layernorm: ResidualNorm
    post_attention_layernorm: ResidualNorm
    self_attn: nn.Module
    mlp: nn.Module

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h: torch.Tensor | Codes  # (codes where a norm feeds an FP8 projection)
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.mixer(positions, h, meta)
        h, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(h), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    attention: ClassVar[type[LlamaAttention]] = LlamaAttention  # (a model's own: MiniMax-M2's)

    def __init__(self, arch: ArchConfig, ctx: ModelContext, index: int):
        super().__init__()
        self.self_attn = self.attention(arch, ctx)
        self.mlp: LlamaMLP | MoEBlock
        # each norm hands the projection after it its input as that projection takes it (the
        # experts' router takes the norm itself)
        feeds: MergedColumnParallelLinear | None = None
        if arch.moe is not None and index in arch.moe.sparse_layers:
            self.mlp = MoEBlock(arch, ctx)
        else:
            self.mlp = LlamaMLP(arch, ctx)
            feeds = self.mlp.gate_up_proj
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ctx.kernels, feeds=self.self_attn.qkv_proj)
        self.post_attention_layernorm = RMSNorm(size, eps, ctx.kernels, feeds=feeds)


# builds decoder layer ``index`` of a model: (arch, ctx, index) → the layer (a layer class)
DecoderLayerFactory = Callable[..., nn.Module]


class DecoderModel(nn.Module):
    """The stack every decoder here shares: embedding → layers (each ``(positions, x, residual,
    meta) → (x, residual)``) → the final norm with the last residual add."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext, layer: DecoderLayerFactory):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layer(arch, ctx, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ctx.kernels)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        assert residual is not None
        out, _ = self.norm.forward_residual(x, residual)
        assert isinstance(out, torch.Tensor)  # (it feeds no layer: no codes)
        return out


class CausalLM(nn.Module):
    """A decoder (``build_model``: a ``DecoderModel`` of ``decoder_layer``s unless a model says
    otherwise) and its LM head, tied to the embedding where the config says: the surface the
    model runner and the loader use (``attention_layers``, ``forward``, ``compute_logits``,
    ``packed_modules``)."""

    # Checkpoint names that we load into one stacked parameter: name → (our name, shard id).
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {}
    decoder_layer: ClassVar[type[nn.Module]]

    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__()
        self.arch = arch
        self.model: DecoderModel = self.build_model(arch, ctx)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self, arch: ArchConfig, ctx: ModelContext) -> DecoderModel:
        return DecoderModel(arch, ctx, type(self).decoder_layer)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.layers]  # type: ignore[misc]

    def cache_layers(self) -> list[nn.Module]:
        """The layers that keep state in the KV cache, in the model's layer order (the index
        ``ArchConfig.layer_cache_kinds`` and the KV cache groups use): its attention layers,
        and a hybrid model's recurrent ones among them."""
        return self.attention_layers()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids, positions, meta)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def draft_layer(self, name: str) -> bool:
        """A tensor of ``model.layers.<n>`` past the decoder's layers: the multi-token-
        prediction layers DeepSeek-V3's and GLM-4.5's checkpoints ship (a draft model for
        speculative decoding, which this engine does not run)."""
        m = _LAYER.match(name)
        return m is not None and int(m[1]) >= self.arch.num_layers


class LlamaForCausalLM(CausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    decoder_layer = LlamaDecoderLayer

    def checkpoint_target(self, name: str) -> CheckpointTarget | None:
        """One expert's tensor (``layers/moe.expert_target``); Mixtral's ``block_sparse_moe``
        is our ``mlp``. None: the packed-module table maps it (models/loader.py)."""
        renamed = name.replace(".block_sparse_moe.", ".mlp.")
        target = expert_target(renamed)
        if target is None and renamed != name:
            return CheckpointTarget(renamed, None)
        return target


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 and its successors (``Glm4MoeForCausalLM``): Llama's decoder with q/k/v biases,
    q/k norms where ``use_qk_norm`` says, a rotary over each head's first half, and
    DeepSeek-V3's mixture of experts (sigmoid scores with a correction bias, group-limited
    top-k, a routed scaling factor, a shared expert; the first layers dense)."""

    def unused_checkpoint_tensor(self, name: str) -> bool:
        return self.draft_layer(name)
