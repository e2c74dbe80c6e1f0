"""RMSNorm, with the residual add fused in (as Hugging Face computes it: float32 statistics)."""

import torch
from torch import nn

from services.worker.engine.models.quantization import Codes


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused  # one Triton kernel (ops/fused_ops.py) instead of seven
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, group: int = 0) -> torch.Tensor | Codes:
        """``group``: the FP8 layer after this one takes its input as codes, a scale every
        ``group`` columns (``_LinearBase.takes_codes``, which only a fused layer on a GPU
        says): write those."""
        if self.fused:
            from services.worker.engine.ops.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, group)
        assert not group, "codes come from the fused kernel"
        return self._norm(x)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor, group: int = 0
    ) -> tuple[torch.Tensor | Codes, torch.Tensor]:
        """``residual + x`` becomes the new residual; returns (norm of it, or its codes, it).
        The fused kernel updates ``residual`` in place."""
        if self.fused:
            from services.worker.engine.ops.fused_ops import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps, group)
        assert not group, "codes come from the fused kernel"
        residual = residual + x
        return self._norm(residual), residual
