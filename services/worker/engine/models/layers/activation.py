"""SiLU(gate) · up on a stacked [gate ‖ up] projection."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from services.worker.engine.models.layers.fused_ops import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
