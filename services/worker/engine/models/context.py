"""What every layer of a model is built with, decided once for the model.

``ModelContext`` carries the choices a layer must not make for itself: the attention backend,
whether the engine's Triton kernels run, and the quantization methods (``quantization/``) that
say how its linear layers and KV cache scales are kept. A model passes it down; a layer takes
what it needs from it.
"""

from dataclasses import dataclass

from services.worker.engine.attention.backend import AttentionBackend
from services.worker.engine.quantization.base import KVCacheMethod, LinearMethod
from services.worker.engine.quantization.config import QuantConfig
from services.worker.engine.quantization.registry import kv_cache_method, linear_method


@dataclass(frozen=True)
class ModelContext:
    max_positions: int  # the rotary tables' length (the model's max_model_len)
    attention: type[AttentionBackend]
    kernels: (
        bool  # the engine's Triton kernels (norm, rotary, SiLU·mul, GEMV): EngineArgs.fused_ops
    )
    linear: LinearMethod  # every linear layer's (quantization/registry.linear_method)
    kv_cache: KVCacheMethod  # every attention layer's KV cache scales

    @classmethod
    def build(
        cls,
        max_positions: int,
        attention: type[AttentionBackend],
        kernels: bool = False,
        quant: QuantConfig | None = None,
    ) -> "ModelContext":
        return cls(max_positions, attention, kernels, linear_method(quant, kernels),
                   kv_cache_method(quant))  # fmt: skip
