"""Tensor-parallel linear layers (the Megatron split, as in vLLM and nano-vllm).

    ColumnParallelLinear   W: [out, in]  each rank holds rows  [out/tp, in]   → output sharded
    RowParallelLinear      W: [out, in]  each rank holds cols  [out, in/tp]   → all-reduce output
    QKVParallelLinear      q, k, v stacked along out; each rank holds its heads of each
    MergedColumnParallelLinear  gate and up stacked along out; each rank holds its slice of each

Each layer has ``weight_loader(param, loaded, shard_id)`` that copies this rank's slice of a
checkpoint tensor into the right rows of its parameter, so the loader never needs to know the
layout (models/loader.py calls the loader of the module that owns each parameter). ``loaded`` is
lazy (models/weights.py): narrowing it reads nothing, so a rank reads only its slice. A
subclass says only where a shard's rows go (``_rows``); the base places weights, biases and,
for FP8 layers (models/quantization.py), the weight scales and static activation scales.
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.distributed import all_reduce, tp_rank, tp_size
from services.worker.engine.models.quantization import (
    FP8,
    Codes,
    QuantConfig,
    dequantize,
    quantize_activations,
    quantize_rows,
)
from services.worker.engine.models.weights import Loaded, copy_weight, full, one_value


class _LinearBase(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        split_dim: int | None,
        fused: bool = False,
        quant: QuantConfig | None = None,
        in_total: int | None = None,  # the checkpoint's input columns (row-parallel: all ranks')
    ):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.split_dim = split_dim
        self.fused = fused  # one token on a GPU: the Triton GEMV (ops/gemv.py), not cuBLAS
        self.quant = quant
        self.in_total = in_total or in_features
        self.col_start = self.tp_rank * in_features if split_dim == 1 else 0
        dtype = FP8 if quant is not None else None
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.weight_scale: nn.Parameter | None = None
        self.input_scale: nn.Parameter | None = None
        self._takes_codes: int | None = None  # answered on the first ask (the device is set)
        self.scale_cols: torch.Tensor | None
        self.register_buffer("scale_cols", None, persistent=False)  # block layers set it
        # block layers on a GPU: the weight's scale a block, as cuBLASLt takes it (after_load)
        self.block_scales: torch.Tensor | None = None
        if quant is not None:
            cols = 1
            if quant.weights == "block":  # the block columns this rank's input columns fall in
                b = quant.block
                first = self.col_start // b
                cols = (self.col_start + in_features - 1) // b - first + 1
                index = (self.col_start + torch.arange(in_features)) // b - first
                self.register_buffer("scale_cols", index, persistent=False)
            self.weight_scale = nn.Parameter(
                torch.empty(out_features, cols, dtype=torch.float32), requires_grad=False
            )
            if quant.activations == "static":
                self.input_scale = nn.Parameter(
                    torch.zeros(1, dtype=torch.float32), requires_grad=False
                )

    @property
    def derives_scale(self) -> bool:
        """Its weight scales are computed at load, not read (a float checkpoint quantized)."""
        return self.quant is not None and self.quant.online

    def _rows(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        """Where a checkpoint tensor's rows go: (first parameter row, rows, first checkpoint
        row, the checkpoint tensor's rows)."""
        size = self.weight.shape[0]
        if self.split_dim == 0:
            return 0, size, self.tp_rank * size, size * self.tp_size
        return 0, size, 0, size

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | int | None = None
    ) -> None:
        dst0, size, src0, total = self._rows(shard_id)
        if param is self.input_scale:  # q, k and v (gate and up) share one input: the largest
            value = one_value(loaded, "a static input scale").to(param.device)
            param.data.copy_(torch.maximum(param.data, value))
            return
        if param is self.weight_scale:
            self._load_scale(loaded, dst0, size, src0, total)
            return
        if param is self.bias and loaded.dim() == 1:
            if self.split_dim == 1:  # row-parallel: the bias is added once, on rank 0 only
                if self.tp_rank == 0:
                    copy_weight(param, loaded)
                else:
                    param.data.zero_()
                return
            copy_weight(param.data.narrow(0, dst0, size), loaded.narrow(0, src0, size))
            return
        src = loaded.narrow(0, src0, size)
        if self.split_dim == 1:
            src = src.narrow(1, self.col_start, self.weight.shape[1])
        dst = param.data.narrow(0, dst0, size)
        if param is self.weight and self.derives_scale:
            assert self.weight_scale is not None
            weight, scale = quantize_rows(full(src))
            copy_weight(dst, weight)
            self.weight_scale.data.narrow(0, dst0, size).copy_(scale)
            return
        copy_weight(dst, src)

    def _load_scale(self, loaded: Loaded, dst0: int, size: int, src0: int, total: int) -> None:
        """This rank's rows (and block columns) of a shard's weight scale, in the layer's
        layout: one column per row, or one per block column."""
        assert self.quant is not None and self.weight_scale is not None
        scale = full(loaded).float()
        dst = self.weight_scale.data.narrow(0, dst0, size)
        kind = self.quant.weights
        if kind == "tensor":
            if scale.numel() != 1:
                raise ValueError(
                    f"a per-tensor weight scale has one value, got {tuple(scale.shape)}"
                )
            dst.fill_(scale.reshape(()).item())
            return
        if kind == "channel":
            if scale.reshape(-1).shape[0] != total or scale.numel() != total:
                raise ValueError(f"a per-channel weight scale of shape {tuple(scale.shape)} "
                                 f"does not match {total} output channels")  # fmt: skip
            dst.copy_(scale.reshape(-1, 1)[src0 : src0 + size])
            return
        b = self.quant.block
        want = (-(-total // b), -(-self.in_total // b))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"a block weight scale of shape {tuple(scale.shape)}, expected {want}: "
                f"{total}×{self.in_total} weights, {b}×{b} blocks"
            )
        rows = scale[(src0 + torch.arange(size)) // b]
        first = self.col_start // b
        dst.copy_(rows[:, first : first + self.weight_scale.shape[1]])

    def after_load(self) -> None:
        """Once the weights are in place: a block layer on a GPU keeps its scales a block too
        (``fp8_block.block_scales``), for cuBLASLt's block scaling."""
        q = self.quant
        if q is None or q.weights != "block" or not self.fused or not self.weight.is_cuda:
            return
        from services.worker.engine.ops import fp8_block

        assert self.weight_scale is not None
        self.block_scales = fp8_block.block_scales(self.weight_scale.data, q.block)

    def takes_codes(self, like: torch.Tensor) -> int:
        """Whether this layer's FP8 kernels take an input like ``like`` quantized beforehand
        (``quantization.Codes``), and in groups of how many columns: dynamic activations on
        the GPU kernels, so that the fused kernel before it (RMSNorm, SiLU·mul) writes the
        codes instead of the row. The input's width for per-token codes, the block's side
        for block checkpoints (per token and 128 columns), 0 for the row itself. Asked by
        the module that calls both; the answer is fixed once the weights sit on a device."""
        if self._takes_codes is None:
            q, k, group = self.quant, self.weight.shape[1], 0
            if q is not None and self.fused:
                from services.worker.engine.ops import fp8_linear

                if q.activations == "token":
                    group = k
                elif q.weights == "block" and self.col_start % q.block == 0 == k % q.block:
                    group = q.block  # (this rank's columns in whole blocks)
                if not fp8_linear.supported(like, self.weight):
                    group = 0
            self._takes_codes = group
        return self._takes_codes

    def forward(self, x: torch.Tensor | Codes) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _fp8_kernels(self, x: torch.Tensor | Codes, bias: torch.Tensor | None) -> torch.Tensor:
        """The GPU's FP8 kernels: a GEMV for one token, else the tensor cores. ``x``: the
        activation, or its codes from the kernel before (``takes_codes`` said so)."""
        from services.worker.engine.ops import fp8_linear

        assert self.weight_scale is not None and self.quant is not None
        args = (x, self.weight, self.weight_scale, bias, self.input_scale)
        fast = self.quant.fast_accumulation
        if (x.rows if isinstance(x, Codes) else x.shape[0]) == 1:
            return fp8_linear.fp8_gemv(*args, fast_accumulation=fast)
        return fp8_linear.fp8_mm(*args, fast_accumulation=fast)

    def _block_kernels(self, x: torch.Tensor | Codes, bias: torch.Tensor | None) -> torch.Tensor:
        """A block checkpoint's GPU kernels (``fp8_block.fp8_block_mm``); ``x``: the activation,
        or its codes a group of columns at a time from the kernel before."""
        from services.worker.engine.ops import fp8_block

        assert self.weight_scale is not None and self.quant is not None
        return fp8_block.fp8_block_mm(
            x, self.weight, self.weight_scale, bias, self.quant.block, self.block_scales,
            fast_accumulation=self.quant.fast_accumulation,
        )  # fmt: skip

    def _linear(self, x: torch.Tensor | Codes, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Codes):
            assert self.quant is not None
            if self.quant.weights == "block":
                return self._block_kernels(x, bias)
            return self._fp8_kernels(x, bias)
        if self.quant is not None:
            assert self.weight_scale is not None
            q = self.quant
            if self.fused:
                from services.worker.engine.ops import fp8_linear

                if fp8_linear.supported(x, self.weight):  # (on a GPU only)
                    if q.weights != "block":
                        return self._fp8_kernels(x, bias)
                    if self.col_start % q.block == 0:  # this rank's K tiles are whole blocks
                        return self._block_kernels(x, bias)
            # the plain-PyTorch path (models/quantization.py): everywhere else, and the
            # reference of the kernels
            xq = quantize_activations(x, q.activations, q.block, self.input_scale)
            w = dequantize(self.weight, self.weight_scale, self.scale_cols).to(x.dtype)
            return F.linear(xq, w, bias)
        if self.fused and x.is_cuda and x.shape[0] == 1:
            from services.worker.engine.ops.gemv import gemv

            return gemv(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, fused: bool = False,
        quant: QuantConfig | None = None,
    ):  # fmt: skip
        super().__init__(in_features, out_features // tp_size(), bias, 0, fused, quant)


class RowParallelLinear(_LinearBase):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, fused: bool = False,
        quant: QuantConfig | None = None,
    ):  # fmt: skip
        super().__init__(in_features // tp_size(), out_features, bias, 1, fused, quant,
                         in_total=in_features)  # fmt: skip

    def forward(self, x: torch.Tensor | Codes) -> torch.Tensor:
        return all_reduce(self._linear(x, self.bias if self.tp_rank == 0 else None))


class MergedColumnParallelLinear(_LinearBase):
    """Several column-parallel projections of one input stacked in one matmul (gate ‖ up)."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool = False, fused: bool = False,
        quant: QuantConfig | None = None,
    ):  # fmt: skip
        self.out_sizes = [s // tp_size() for s in out_sizes]
        super().__init__(in_features, sum(self.out_sizes), bias, 0, fused, quant)

    def _rows(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        assert isinstance(shard_id, int)  # the loader's packed-module table is ours
        size = self.out_sizes[shard_id]
        return sum(self.out_sizes[:shard_id]), size, self.tp_rank * size, size * self.tp_size


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
        quant: QuantConfig | None = None,
    ):
        tp = tp_size()
        self.head_dim = head_dim
        self.total_heads = num_heads
        self.total_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)  # kv heads replicate when tp > kv heads
        # (the same count as worker/model_runner.kv_heads_per_rank, which sizes the KV cache)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out, bias, split_dim=0, fused=fused, quant=quant)

    def _rows(self, shard_id: str | int | None) -> tuple[int, int, int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[str(shard_id)]
        if shard_id == "q":
            return offset, size, self.tp_rank * size, self.total_heads * self.head_dim
        # with more ranks than kv heads, consecutive ranks share one kv head
        replicas = max(1, self.tp_size // self.total_kv_heads)
        start = (self.tp_rank // replicas) * size
        return offset, size, start, self.total_kv_heads * self.head_dim
