"""Tensor-parallel linear layers (the Megatron split, as in vLLM and nano-vllm).

    ColumnParallelLinear   W: [out, in]  each rank holds rows  [out/tp, in]   → output sharded
    RowParallelLinear      W: [out, in]  each rank holds cols  [out, in/tp]   → all-reduce output
    QKVParallelLinear      q, k, v stacked along out; each rank holds its heads of each
    MergedColumnParallelLinear  gate and up stacked along out; each rank holds its slice of each

Each layer has ``weight_loader(param, loaded, shard_id)`` that copies this rank's slice of a
checkpoint tensor into the right rows of its parameter, so the loader never needs to know the
layout (models/loader.py calls the loader of the module that owns each parameter). ``loaded`` is
lazy (models/weights.py): narrowing it reads nothing, so a rank reads only its slice.
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.distributed import all_reduce, tp_rank, tp_size
from services.worker.engine.models.weights import Loaded, copy_weight


class _LinearBase(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        split_dim: int | None,
        fused: bool = False,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.split_dim = split_dim
        self.fused = fused  # one token on a GPU: the Triton GEMV (layers/gemv.py), not cuBLAS
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        if self.split_dim is not None and self.split_dim < loaded.dim():
            size = param.shape[self.split_dim]
            loaded = loaded.narrow(self.split_dim, self.tp_rank * size, size)
        copy_weight(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fused and x.is_cuda and x.shape[0] == 1:
            from services.worker.engine.models.layers.gemv import gemv

            return gemv(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, fused: bool = False
    ):
        super().__init__(in_features, out_features // tp_size(), bias, split_dim=0, fused=fused)


class RowParallelLinear(_LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, fused: bool = False
    ):
        super().__init__(in_features // tp_size(), out_features, bias, split_dim=1, fused=fused)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        if loaded.dim() == 1:  # the bias is added once, on rank 0 only (forward adds no other)
            if self.tp_rank == 0:
                copy_weight(param, loaded)
            else:
                param.data.zero_()
            return
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self._linear(x, self.bias if self.tp_rank == 0 else None))


class MergedColumnParallelLinear(_LinearBase):
    """Several column-parallel projections of one input stacked in one matmul (gate ‖ up)."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool = False, fused: bool = False
    ):
        self.out_sizes = [s // tp_size() for s in out_sizes]
        super().__init__(in_features, sum(self.out_sizes), bias, split_dim=0, fused=fused)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        assert isinstance(shard_id, int)  # the loader's packed-module table is ours
        size = self.out_sizes[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        copy_weight(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(_LinearBase):
    """q, k and v projections stacked: [q heads | k heads | v heads] × head_dim rows per rank."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        fused: bool = False,
    ):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)  # kv heads replicate when tp > kv heads
        # (the same count as worker/model_runner.kv_heads_per_rank, which sizes the KV cache)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out, bias, split_dim=0, fused=fused)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[str(shard_id)]
        if shard_id == "q":
            start = self.tp_rank * size
        else:  # with more ranks than kv heads, consecutive ranks share one kv head
            replicas = max(1, self.tp_size // self.total_kv_heads)
            start = (self.tp_rank // replicas) * size
        copy_weight(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))
