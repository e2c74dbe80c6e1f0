"""The methods a model's layers are built with, chosen once from its quantization config.

A new method is a class (``base.LinearMethod``, ``base.MoEMethod`` or ``base.KVCacheMethod``)
and an entry in ``LINEAR_METHODS`` (``MOE_METHODS``) keyed by the weights' layout that
``config.parse_quantization`` reports; no model or layer changes.
"""

from collections.abc import Callable

import torch

from services.worker.engine.quantization.base import (
    Experts,
    KVCacheMethod,
    LinearMethod,
    MoEMethod,
)
from services.worker.engine.quantization.config import QuantConfig
from services.worker.engine.quantization.fp8 import (
    CheckpointKVScales,
    Fp8BlockLinearMethod,
    Fp8LinearMethod,
)
from services.worker.engine.quantization.moe import Fp8MoEMethod, UnquantizedMoEMethod
from services.worker.engine.quantization.unquantized import UnquantizedLinearMethod

# QuantConfig.weights → the linear method (quant, kernels) → method
LINEAR_METHODS: dict[str, Callable[[QuantConfig, bool], LinearMethod]] = {
    "tensor": Fp8LinearMethod,
    "channel": Fp8LinearMethod,
    "block": Fp8BlockLinearMethod,
}


def linear_method(quant: QuantConfig | None, kernels: bool) -> LinearMethod:
    """The method of every linear layer of a model (its embeddings and LM head stay in the
    model's dtype). ``kernels``: the engine's Triton kernels where they run (a GPU)."""
    if quant is None:
        return UnquantizedLinearMethod(kernels)
    return LINEAR_METHODS[quant.weights](quant, kernels)


# QuantConfig.weights → the mixture-of-experts layers' method (quant, kernels) → method
MOE_METHODS: dict[str, Callable[[QuantConfig, bool], MoEMethod]] = {
    "tensor": Fp8MoEMethod,
    "channel": Fp8MoEMethod,
    "block": Fp8MoEMethod,
}


class _NoMoEMethod(MoEMethod):
    """A layout with linear methods but no MoE one: a dense model runs, an MoE layer refuses."""

    def __init__(self, quant: QuantConfig):
        self.quant = quant

    def create_weights(self, layer: Experts) -> None:
        known = ", ".join(MOE_METHODS)
        raise ValueError(f"{self.quant.method}: no mixture-of-experts method for "
                         f"{self.quant.weights!r} weights; known: {known}")  # fmt: skip

    def apply(self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
        raise AssertionError("never created")


def moe_method(quant: QuantConfig | None, kernels: bool) -> MoEMethod:
    """The method of every mixture-of-experts layer's experts (the router stays float)."""
    if quant is None:
        return UnquantizedMoEMethod(kernels)
    make = MOE_METHODS.get(quant.weights)
    return make(quant, kernels) if make is not None else _NoMoEMethod(quant)


def kv_cache_method(quant: QuantConfig | None) -> KVCacheMethod:
    """The method of every attention layer's KV cache scales."""
    if quant is not None and quant.kv_scales:
        return CheckpointKVScales()
    return KVCacheMethod()


# checkpoint names that hold what our parameters hold: fp8 block checkpoints call the weight
# scale ``weight_scale_inv`` (a multiplier all the same: w = w_fp8 · weight_scale_inv); older
# compressed-tensors checkpoints keep a layer's KV cache scales as its k and v projections'
# ``output_scale``
_CHECKPOINT_SUFFIXES = {
    ".weight_scale_inv": ".weight_scale",
    ".k_proj.output_scale": ".k_scale",
    ".v_proj.output_scale": ".v_scale",
}


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as our parameters call it (quantization formats' aliases)."""
    for theirs, ours in _CHECKPOINT_SUFFIXES.items():
        if name.endswith(theirs):
            return name.removesuffix(theirs) + ours
    return name
