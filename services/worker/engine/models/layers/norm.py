"""RMSNorm, with the residual add fused in (as Hugging Face computes it: float32 statistics)."""

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from services.worker.engine.models.layers.linear import LinearBase
from services.worker.engine.quantization.fp8_math import Codes


class ResidualNorm(Protocol):
    """A norm with the residual add fused in: ``RMSNorm`` and Gemma's (``models/gemma3.py``)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor | Codes: ...

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | Codes, torch.Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False, feeds: LinearBase | None = None):
        super().__init__()
        self.eps = eps
        self.fused = fused  # one Triton kernel (ops/fused_ops.py) instead of seven
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        # the linear layer this norm's output goes to: where it takes its input as codes (an
        # FP8 method on the GPU's kernels, ``LinearBase.input_group``), the fused kernel
        # writes those instead of the row (a bound method: the layer is not a child here)
        self.codes_for: Callable[[torch.Tensor], int] | None = None
        if fused and feeds is not None:
            self.codes_for = feeds.input_group

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor | Codes:
        """The norm of ``x``, or the codes of it that the layer it feeds takes."""
        if self.fused:
            from services.worker.engine.ops.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, self.codes_for(x) if self.codes_for else 0)
        return self._norm(x)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | Codes, torch.Tensor]:
        """``residual + x`` becomes the new residual; returns (norm of it, or its codes, it).
        The fused kernel updates ``residual`` in place."""
        if self.fused:
            from services.worker.engine.ops.fused_ops import add_rms_norm

            group = self.codes_for(x) if self.codes_for else 0
            return add_rms_norm(x, residual, self.weight, self.eps, group)
        residual = residual + x
        return self._norm(residual), residual
