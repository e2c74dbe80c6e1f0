"""Tensor-parallel linear layers (the Megatron split, as in vLLM and nano-vllm).

    ColumnParallelLinear   W: [out, in]  each rank holds rows  [out/tp, in]   → output sharded
    RowParallelLinear      W: [out, in]  each rank holds cols  [out, in/tp]   → all-reduce output
    QKVParallelLinear      q, k, v stacked along out; each rank holds its heads of each
    MergedColumnParallelLinear  gate and up stacked along out; each rank holds its slice of each

A layer keeps only its sharding. How it keeps and multiplies its weight is its method's
(``quantization/``: the model's dtype, or FP8 of several formats), one object chosen for the
whole model: it registers the layer's ``weight`` and whatever else its product needs, loads the
checkpoint tensors it owns, and applies the product.

Each layer has ``weight_loader(param, loaded, shard_id)`` that copies this rank's slice of a
checkpoint tensor into the right rows of its parameter, so the loader never needs to know the
layout (models/loader.py calls the loader of the module that owns each parameter). ``loaded`` is
lazy (models/weights.py): narrowing it reads nothing, so a rank reads only its slice. A
subclass says only where a shard's rows go (``shard``); one whose checkpoint tensors hold its
parts in several runs of rows loads each run with ``load_shard`` (models/layers/
gated_delta_net.py).
"""

import torch
from torch import nn

from services.worker.engine.distributed import all_reduce, tp_rank, tp_size
from services.worker.engine.models.weights import Loaded, copy_weight
from services.worker.engine.quantization.base import LinearMethod, Shard
from services.worker.engine.quantization.fp8_math import Codes
from services.worker.engine.quantization.registry import linear_method


class LinearBase(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        split_dim: int | None,
        method: LinearMethod | None = None,
        in_total: int | None = None,  # the checkpoint's input columns (row-parallel: all ranks')
    ):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.split_dim = split_dim
        self.in_features, self.out_features = in_features, out_features
        self.in_total = in_total or in_features
        self.col_start = self.tp_rank * in_features if split_dim == 1 else 0
        self.method = method or linear_method(None, kernels=False)  # (the model's dtype)
        self.weight: nn.Parameter
        self.method.create_weights(self)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self._input_group: int | None = None  # answered on the first ask (the device is set)

    def set_method(self, method: LinearMethod) -> None:
        """Replace the method, and the parameters and buffers it registered (the bias stays),
        before any weight is loaded: a layer the checkpoint keeps in another format than the
        model's (``models/loader.keep_float``). The new ones take the default device and dtype."""
        for name in [n for n in self._parameters if n != "bias"]:
            del self._parameters[name]
        self._buffers.clear()  # (a layer's own are none: its methods')
        self.method = method
        method.create_weights(self)
        self._input_group = None

    def shard(self, shard_id: str | int | None) -> Shard:
        """Where a checkpoint tensor's rows go on this rank."""
        size = self.out_features
        if self.split_dim == 0:
            return Shard(0, size, self.tp_rank * size, size * self.tp_size)
        return Shard(0, size, 0, size)

    def rank_slice(self, loaded: Loaded, shard: Shard) -> Loaded:
        """This rank's rows of a checkpoint tensor (and, row-parallel, its columns)."""
        src = loaded.narrow(0, shard.src, shard.size)
        if self.split_dim == 1:
            src = src.narrow(1, self.col_start, self.in_features)
        return src

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        self.load_shard(param, loaded, self.shard(shard_id))

    def load_shard(self, param: nn.Parameter, loaded: Loaded, shard: Shard) -> None:
        """Copy the checkpoint rows ``shard`` names into the parameter's (a weight through
        its method, which also reads a scale's rows of ``shard.total``)."""
        if param is self.bias and loaded.dim() == 1:
            if self.split_dim == 1:  # row-parallel: the bias is added once, on rank 0 only
                if self.tp_rank == 0:
                    copy_weight(param, loaded)
                else:
                    param.data.zero_()
                return
            copy_weight(param.data.narrow(0, shard.dst, shard.size),
                        loaded.narrow(0, shard.src, shard.size))  # fmt: skip
            return
        if self.method.load(self, param, loaded, shard):
            return
        copy_weight(param.data.narrow(0, shard.dst, shard.size), self.rank_slice(loaded, shard))

    def derived_parameters(self) -> tuple[str, ...]:
        """Its parameters computed at load, not read from the checkpoint."""
        return self.method.derived_parameters

    def after_load(self) -> None:
        """Once the weights are in place (and on their device)."""
        self.method.process_weights_after_loading(self)

    def input_group(self, like: torch.Tensor) -> int:
        """Whether this layer takes an input like ``like`` as codes (``fp8_math.Codes``), and
        in groups of how many columns; 0 for the input itself. The kernel before it (RMSNorm,
        SiLU·mul) asks, and writes its output that way. Fixed once the weights sit on a
        device."""
        if self._input_group is None:
            self._input_group = self.method.input_group(self, like)
        return self._input_group

    def forward(self, x: torch.Tensor | Codes) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        method: LinearMethod | None = None,
    ):  # fmt: skip
        super().__init__(in_features, out_features // tp_size(), bias, 0, method)


class RowParallelLinear(LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        method: LinearMethod | None = None,
    ):  # fmt: skip
        super().__init__(in_features // tp_size(), out_features, bias, 1, method,
                         in_total=in_features)  # fmt: skip

    def forward(self, x: torch.Tensor | Codes) -> torch.Tensor:
        return all_reduce(self.method.apply(self, x, self.bias if self.tp_rank == 0 else None))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of one input stacked in one matmul (gate ‖ up)."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool = False,
        method: LinearMethod | None = None,
    ):  # fmt: skip
        self.out_sizes = [s // tp_size() for s in out_sizes]
        super().__init__(in_features, sum(self.out_sizes), bias, 0, method)

    def shard(self, shard_id: str | int | None) -> Shard:
        assert isinstance(shard_id, int)  # the loader's packed-module table is ours
        size = self.out_sizes[shard_id]
        return Shard(sum(self.out_sizes[:shard_id]), size, self.tp_rank * size,
                     size * self.tp_size)  # fmt: skip


class QKVParallelLinear(LinearBase):
    """q, k and v projections stacked: [q heads | k heads | v heads] × head_dim rows per rank."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        method: LinearMethod | None = None,
    ):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_heads = num_heads
        self.total_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)  # kv heads replicate when tp > kv heads
        # (the same count as worker/model_runner.kv_heads_per_rank, which sizes the KV cache)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out, bias, split_dim=0, method=method)

    def shard(self, shard_id: str | int | None) -> Shard:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[str(shard_id)]
        if shard_id == "q":
            return Shard(offset, size, self.tp_rank * size, self.total_heads * self.head_dim)
        # with more ranks than kv heads, consecutive ranks share one kv head
        replicas = max(1, self.tp_size // self.total_kv_heads)
        start = (self.tp_rank // replicas) * size
        return Shard(offset, size, start, self.total_kv_heads * self.head_dim)
