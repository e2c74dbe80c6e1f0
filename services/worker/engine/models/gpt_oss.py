"""gpt-oss (``GptOssForCausalLM``): a decoder whose layers alternate sliding-window attention
(``ArchConfig.sliding_window`` tokens) and full attention, every head with a learned sink, over
a mixture of experts in every layer (``layers/moe.py``: a router with a bias whose top-k logits
are weighed by their softmax, experts with biases and a clamped SwiGLU). YaRN rotary.

    layer i:   0        1       2        3      ...   (``ArchConfig.layer_types``; without
    attention: sliding  full    sliding  full          them, even layers slide)

The checkpoint keeps each layer's experts stacked (``layers/moe.StackedExperts``) and calls the
router ``mlp.router``; an MXFP4 checkpoint (the experts as ``*_blocks`` and ``*_scales``, as
openai publishes the weights) is refused: a bfloat16 copy of it loads. The KV cache holds every
layer's whole context for now; a sliding layer reads only its window of it.

The surface is ``LlamaForCausalLM``'s: ``forward`` over a flattened batch, ``compute_logits`` on
the rows the runner samples, ``attention_layers`` for the runner to bind each layer's cache.
"""

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from services.worker.engine.attention.backend import AttentionMetadata, LayerKVCache
from services.worker.engine.distributed import tp_rank
from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.linear import QKVParallelLinear, RowParallelLinear
from services.worker.engine.models.layers.moe import MoEBlock, stacked_expert_target
from services.worker.engine.models.layers.norm import RMSNorm
from services.worker.engine.models.layers.rotary import RotaryEmbedding
from services.worker.engine.models.llama import CausalLM
from services.worker.engine.models.weights import CheckpointTarget, Loaded, copy_weight
from services.worker.engine.quantization.fp8_math import Codes

# (the layer, q, k, v, the step's metadata) → the attention's output, [tokens, heads, head_dim]
AttentionSplit = Callable[
    ["GptOssAttention", torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata],
    torch.Tensor,
]


class GptOssAttention(nn.Module):
    """q/k/v and o projections with biases, YaRN rotary, and a sink logit per query head
    (``sinks``: float32, this rank's heads, read by the backend at every forward)."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext, sliding: bool):
        super().__init__()
        d, fused = arch.head_dim, ctx.kernels
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, d, arch.num_heads, arch.num_kv_heads, arch.attention_bias,
            ctx.linear,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.head_dim = d
        self.first_head = tp_rank() * self.num_heads  # this rank's first query head
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, arch.attention_bias,
                                        ctx.linear)  # fmt: skip
        self.rotary = RotaryEmbedding(d, ctx.max_positions, arch.rope, fused)
        self.stores_kv = fused  # the fused rotary writes the keys and values (LlamaAttention)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32),
                                  requires_grad=False)  # fmt: skip
        window = arch.sliding_window if sliding else None
        self.attn = ctx.attention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5,
                                  sliding_window=window, sinks=self.sinks)  # fmt: skip
        self.kv_cache: LayerKVCache | None = None  # bound by the worker after cache allocation
        self.kv_group = 0  # its KV cache group (kv_cache/groups.py), bound with the cache
        self.split: AttentionSplit | None = None  # a piecewise CUDA graph's (LlamaAttention)
        self.kv_method = ctx.kv_cache
        self.kv_method.create_weights(self)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        """Its own parameters: the sinks (this rank's heads of them) and the KV cache
        scales."""
        if param is self.sinks:
            copy_weight(param, loaded.narrow(0, self.first_head, self.num_heads))
            return
        self.kv_method.load(param, loaded)

    def kv_scales(self) -> tuple[float, float]:
        """The (key, value) scales an FP8 cache of this layer takes."""
        return self.kv_method.scales(self)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Codes, meta: AttentionMetadata
    ) -> torch.Tensor:
        meta = meta.group(self.kv_group)
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        assert self.kv_cache is not None, "KV cache not bound"
        if self.stores_kv:
            q = self.rotary.forward_and_store(positions, q, k, v, self.kv_cache,
                                              meta.slot_mapping)  # fmt: skip
        else:
            q, k = self.rotary(positions, q, k)
        if self.split is not None:
            out = self.split(self, q, k, v, meta)
        else:
            out = self.attn.forward(q, k, v, self.kv_cache, meta, store_kv=not self.stores_kv)
        return self.o_proj(out.reshape(-1, self.q_size))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ModelContext, index: int):
        super().__init__()
        self.self_attn = GptOssAttention(arch, ctx, arch.attention_windows()[index] is not None)
        self.mlp = MoEBlock(arch, ctx)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ctx.kernels, feeds=self.self_attn.qkv_proj)
        # (the router and the experts read the norm's output as it is: no codes)
        self.post_attention_layernorm = RMSNorm(size, eps, ctx.kernels)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h: torch.Tensor | Codes
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm.forward_residual(x, residual)
        assert isinstance(h, torch.Tensor)  # (it feeds no linear layer: no codes)
        return self.mlp(h), residual


class GptOssForCausalLM(CausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }
    decoder_layer = GptOssDecoderLayer

    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        if arch.moe is None:
            raise ValueError("a gpt-oss config without experts (num_local_experts)")
        super().__init__(arch, ctx)

    def checkpoint_target(self, name: str) -> CheckpointTarget | None:
        """The stacked experts (``layers/moe.stacked_expert_target``) and the router, which
        is our ``mlp.gate``. None: the packed-module table maps it (models/loader.py)."""
        if ".mlp.experts." in name and name.endswith(("_blocks", "_scales")):
            raise ValueError(f"{name}: MXFP4 experts are not supported; load a bfloat16 copy "
                             "of the model (experts.gate_up_proj, experts.down_proj)")  # fmt: skip
        target = stacked_expert_target(name)
        if target is None and ".mlp.router." in name:
            return CheckpointTarget(name.replace(".mlp.router.", ".mlp.gate."), None)
        return target
