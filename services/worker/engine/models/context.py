"""What every layer of a model is built with, decided once for the model.

``ModelContext`` carries the choices a layer must not make for itself: the attention backend,
whether the engine's Triton kernels run, the quantization methods (``quantization/``) that
say how its linear layers, mixture-of-experts layers and KV cache scales are kept, and how
experts split over tensor-parallel ranks. A model passes it down; a layer takes
what it needs from it.
"""

from dataclasses import dataclass

from services.worker.engine.attention.backend import AttentionBackend
from services.worker.engine.quantization.base import KVCacheMethod, LinearMethod, MoEMethod
from services.worker.engine.quantization.config import QuantConfig
from services.worker.engine.quantization.registry import kv_cache_method, linear_method, moe_method


@dataclass(frozen=True)
class ModelContext:
    max_positions: int  # the rotary tables' length (the model's max_model_len)
    attention: type[AttentionBackend]
    kernels: (
        bool  # the engine's Triton kernels (norm, rotary, SiLU·mul, GEMV): EngineArgs.fused_ops
    )
    linear: LinearMethod  # every linear layer's (quantization/registry.linear_method)
    kv_cache: KVCacheMethod  # every attention layer's KV cache scales
    moe: MoEMethod  # every mixture-of-experts layer's experts (quantization/registry.moe_method)
    # experts split whole over the ranks (ParallelConfig.enable_expert_parallel), not each
    # expert's intermediate dimension
    expert_parallel: bool = False

    @classmethod
    def build(
        cls,
        max_positions: int,
        attention: type[AttentionBackend],
        kernels: bool = False,
        quant: QuantConfig | None = None,
        expert_parallel: bool = False,
    ) -> "ModelContext":
        return cls(max_positions, attention, kernels, linear_method(quant, kernels),
                   kv_cache_method(quant), moe_method(quant, kernels), expert_parallel)  # fmt: skip
