"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-head
latent attention (``layers/mla.py``: a KV cache of one latent a token and layer) and, in the
layers ``MoEConfig.sparse_layers`` names, a mixture of experts with shared experts beside the
routed ones (``layers/moe.py``); the first ``first_k_dense_replace`` layers are dense MLPs.
What differs between the two versions (a low-rank q, the routing, YaRN) is read from
``ArchConfig``.

The surface is ``LlamaForCausalLM``'s: ``forward`` over a flattened batch, ``compute_logits``
on the rows the runner samples, ``attention_layers`` for the runner to bind each layer's cache.
"""

from typing import ClassVar

from services.worker.engine.model_config import ArchConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.mla import MLAAttention
from services.worker.engine.models.layers.moe import MoEBlock, expert_target
from services.worker.engine.models.layers.norm import RMSNorm
from services.worker.engine.models.llama import CausalLM, LlamaMLP, PreNormDecoderLayer
from services.worker.engine.models.weights import CheckpointTarget


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, arch: ArchConfig, ctx: ModelContext, index: int):
        super().__init__()
        self.self_attn = MLAAttention(arch, ctx)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.mlp: MoEBlock | LlamaMLP
        if arch.moe is not None and index in arch.moe.sparse_layers:
            self.mlp = MoEBlock(arch, ctx)
            feeds = None  # the router and the experts read the norm's output as it is
        else:
            self.mlp = LlamaMLP(arch, ctx)
            feeds = self.mlp.gate_up_proj
        # the input norm feeds two projections (q's and the latent's): no codes
        self.input_layernorm = RMSNorm(size, eps, ctx.kernels)
        self.post_attention_layernorm = RMSNorm(size, eps, ctx.kernels, feeds=feeds)


class DeepseekV2ForCausalLM(CausalLM):
    # the dense MLPs' and the shared experts' gate and up projections, stacked
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    decoder_layer = DeepseekDecoderLayer

    def checkpoint_target(self, name: str) -> CheckpointTarget | None:
        """One routed expert's projection (``models/loader.py`` asks before its table)."""
        return expert_target(name)

    def unused_checkpoint_tensor(self, name: str) -> bool:
        return self.draft_layer(name)  # (DeepSeek-V3's multi-token-prediction layers)
