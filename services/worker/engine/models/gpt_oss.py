"""gpt-oss (``GptOssForCausalLM``): a decoder whose layers alternate sliding-window attention
(``ArchConfig.sliding_window`` tokens) and full attention, every head with a learned sink, over
a mixture of experts in every layer (``layers/moe.py``: a router with a bias whose top-k logits
are weighed by their softmax, experts with biases and a clamped SwiGLU). YaRN rotary.

    layer i:   0        1       2        3      ...   (``ArchConfig.layer_types``; without
    attention: sliding  full    sliding  full          them, even layers slide)

The checkpoint keeps each layer's experts stacked (``layers/moe.StackedExperts``) and calls the
router ``mlp.router``. openai publishes the experts in MXFP4 (``*_blocks`` and ``*_scales``,
``layers/moe.Mxfp4Experts``): they are dequantized at load into the model's dtype (or, with
``--quantization fp8``, quantized again to FP8 as a float checkpoint's are).

The surface is ``LlamaForCausalLM``'s: ``forward`` over a flattened batch, ``compute_logits`` on
the rows the runner samples, ``attention_layers`` for the runner to bind each layer's cache.
"""

from typing import ClassVar

import torch
from torch import nn

from services.worker.engine.distributed import tp_rank, tp_size
from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.moe import (
    MoEBlock,
    mxfp4_expert_target,
    stacked_expert_target,
)
from services.worker.engine.models.layers.norm import RMSNorm
from services.worker.engine.models.llama import CausalLM, LlamaAttention, PreNormDecoderLayer
from services.worker.engine.models.weights import CheckpointTarget, Loaded, copy_weight


class GptOssAttention(LlamaAttention):
    """Llama's attention with biases on q/k/v and o, YaRN rotary, a window on alternate layers
    and a sink logit per query head (``sinks``: float32, this rank's heads, read by the backend
    at every forward)."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext, sliding: bool):
        sinks = nn.Parameter(torch.zeros(arch.num_heads // tp_size(), dtype=torch.float32),
                             requires_grad=False)  # fmt: skip
        window = arch.sliding_window if sliding else None
        super().__init__(arch, ctx, o_bias=arch.attention_bias, window=window, sinks=sinks)
        self.sinks = sinks
        self.first_head = tp_rank() * self.num_heads  # this rank's first query head

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        """Its own parameters: the sinks (this rank's heads of them) and the KV cache
        scales."""
        if param is self.sinks:
            copy_weight(param, loaded.narrow(0, self.first_head, self.num_heads))
            return
        self.kv_method.load(param, loaded)


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, arch: ArchConfig, ctx: ModelContext, index: int):
        super().__init__()
        self.self_attn = GptOssAttention(arch, ctx, arch.attention_windows()[index] is not None)
        self.mlp = MoEBlock(arch, ctx)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, ctx.kernels, feeds=self.self_attn.qkv_proj)
        # (the router and the experts read the norm's output as it is: no codes)
        self.post_attention_layernorm = RMSNorm(size, eps, ctx.kernels)


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
        """The stacked experts (``layers/moe.stacked_expert_target``; MXFP4's blocks and
        scales, ``mxfp4_expert_target``) and the router, which is our ``mlp.gate``. None: the
        packed-module table maps it (models/loader.py)."""
        target = stacked_expert_target(name) or mxfp4_expert_target(name)
        if target is None and ".mlp.router." in name:
            return CheckpointTarget(name.replace(".mlp.router.", ".mlp.gate."), None)
        return target
