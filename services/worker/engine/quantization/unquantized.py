"""Linear layers in the model's dtype: ``F.linear`` (cuBLAS on a GPU), or for one token on a
GPU with the engine's kernels the Triton GEMV (``ops/gemv.py``: at one token a product is a
weight read, which cuBLAS does at ≈ 3.1 TB/s on an 8B model's smaller projections)."""

import torch
from torch import nn

from services.worker.engine.ops.gemv import linear
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
        return linear(x, tensor(layer, "weight"), bias, self.kernels)
