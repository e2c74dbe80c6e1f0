"""Linear layers in the model's dtype: ``F.linear`` (cuBLAS on a GPU), or for one token on a
GPU with the engine's kernels the Triton GEMV (``ops/gemv.py``: at one token a product is a
weight read, which cuBLAS does at ≈ 3.1 TB/s on an 8B model's smaller projections)."""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.quantization.base import Linear, LinearMethod, tensor
from services.worker.engine.quantization.fp8_math import Codes


class UnquantizedLinearMethod(LinearMethod):
    def __init__(self, kernels: bool = False):
        self.kernels = kernels  # the Triton GEMV for one token on a GPU

    def create_weights(self, layer: Linear) -> None:
        weight = torch.empty(layer.out_features, layer.in_features)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def apply(
        self, layer: Linear, x: torch.Tensor | Codes, bias: torch.Tensor | None
    ) -> torch.Tensor:
        assert isinstance(x, torch.Tensor), "codes are for FP8 layers"
        weight = tensor(layer, "weight")
        if self.kernels and x.is_cuda and x.shape[0] == 1:
            from services.worker.engine.ops.gemv import gemv

            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)
