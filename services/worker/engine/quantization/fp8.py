"""FP8 (e4m3) linear layers, and a checkpoint's FP8 KV cache scales.

- ``Fp8LinearMethod``: a float32 scale per output row (per-tensor checkpoints give every row
  of a tensor the same one; a float checkpoint quantized at load gets one per channel),
  activations quantized at the layer's input per token or with the checkpoint's static scale.
  On a GPU with FP8 tensor cores and the engine's kernels: ``ops/fp8_linear.py`` (a GEMV for one
  token, the tensor cores for more rows).
- ``Fp8BlockLinearMethod``: 128×128 weight blocks, each with a scale (kept one row per weight
  row, [out, in / 128], for any shard), activations per token and 128-column group. On a GPU:
  ``ops/fp8_block.py``.
- Everywhere else (CPU, CI, shapes the kernels do not take) the plain-PyTorch path of
  ``fp8_math``: activations and weights rounded exactly as the kernels round them, then
  multiplied dequantized. It is the kernels' reference.

With dynamic activations on the kernels, a layer takes its input as codes (``input_group``):
the fused kernel before it (RMSNorm, SiLU·mul) writes the row's e4m3 codes and scales instead
of the row, bit for bit the layer's own quantization, and the layer skips that pass.
"""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.models.weights import (
    Loaded,
    copy_weight,
    full,
    one_value,
    vector_length,
    vector_part,
)
from services.worker.engine.quantization.base import (
    KVCacheMethod,
    Linear,
    LinearMethod,
    Shard,
    optional_tensor,
    scale_parameter,
    tensor,
)
from services.worker.engine.quantization.config import QuantConfig
from services.worker.engine.quantization.fp8_math import (
    FP8,
    Codes,
    dequantize,
    quantize_activations,
    quantize_rows,
)
from services.worker.engine.quantization.unquantized import UnquantizedLinearMethod


def _kernels_take(x: torch.Tensor, weight: torch.Tensor) -> bool:
    from services.worker.engine.ops import fp8_linear

    return fp8_linear.supported(x, weight)


class Fp8LinearMethod(LinearMethod):
    """Weights with a scale per output row (per-tensor or per-channel checkpoints, or a float
    checkpoint quantized at load); activations per token, or static."""

    def __init__(self, quant: QuantConfig, kernels: bool = False):
        self.quant = quant
        self.kernels = kernels  # the GPU's FP8 kernels where they take the input
        self.description = quant.method
        self.derived_parameters = ("weight_scale",) if quant.online else ()

    def create_weights(self, layer: Linear) -> None:
        weight = torch.empty(layer.out_features, layer.in_features, dtype=FP8)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.register_parameter("weight_scale", scale_parameter(layer.out_features, 1))
        static = self.quant.activations == "static"
        layer.register_parameter("input_scale", scale_parameter(1) if static else None)
        layer.register_buffer("scale_cols", None, persistent=False)  # (block layers: a map)

    def float_method(self) -> LinearMethod | None:
        return None if self.quant.online else UnquantizedLinearMethod(self.kernels)

    def load(self, layer: Linear, param: nn.Parameter, loaded: Loaded, shard: Shard) -> bool:
        if param is optional_tensor(layer, "input_scale"):
            # q, k and v (gate and up) share one input: the largest of their scales
            value = one_value(loaded, "a static input scale").to(param.device)
            param.data.copy_(torch.maximum(param.data, value))
            return True
        scale = tensor(layer, "weight_scale")
        if param is scale:
            self._load_scale(layer, loaded, scale.data.narrow(0, shard.dst, shard.size), shard)
            return True
        if param is tensor(layer, "weight") and self.quant.online:  # a float weight: quantize it
            weight, rows = quantize_rows(full(layer.rank_slice(loaded, shard)))
            copy_weight(param.data.narrow(0, shard.dst, shard.size), weight)
            scale.data.narrow(0, shard.dst, shard.size).copy_(rows)
            return True
        return False

    def _load_scale(self, layer: Linear, scale: Loaded, dst: torch.Tensor, shard: Shard) -> None:
        """This rank's rows of a shard's weight scale, only they read: one value, or one per
        output row."""
        if self.quant.weights == "tensor":
            dst.fill_(one_value(scale, "a per-tensor weight scale").item())
            return
        if vector_length(scale) != shard.total:
            raise ValueError(f"a per-channel weight scale of shape {tuple(scale.shape)} "
                             f"does not match {shard.total} output channels")  # fmt: skip
        dst.copy_(vector_part(scale, shard.src, shard.size).reshape(-1, 1))

    def input_group(self, layer: Linear, like: torch.Tensor) -> int:
        if not self.kernels or self.quant.activations != "token":
            return 0
        return layer.in_features if _kernels_take(like, tensor(layer, "weight")) else 0

    def apply(
        self, layer: Linear, x: torch.Tensor | Codes, bias: torch.Tensor | None
    ) -> torch.Tensor:
        weight = tensor(layer, "weight")
        if isinstance(x, Codes) or (self.kernels and _kernels_take(x, weight)):
            from services.worker.engine.ops import fp8_linear

            args = (x, weight, tensor(layer, "weight_scale"), bias,
                    optional_tensor(layer, "input_scale"))  # fmt: skip
            fast = self.quant.fast_accumulation
            if (x.rows if isinstance(x, Codes) else x.shape[0]) == 1:
                return fp8_linear.fp8_gemv(*args, fast_accumulation=fast)
            return fp8_linear.fp8_mm(*args, fast_accumulation=fast)
        return self._reference(layer, x, bias)

    def _reference(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The plain-PyTorch path: everywhere the kernels do not run, and their reference."""
        q = self.quant
        xq = quantize_activations(x, q.activations, q.block, optional_tensor(layer, "input_scale"))
        cols = optional_tensor(layer, "scale_cols")
        w = dequantize(tensor(layer, "weight"), tensor(layer, "weight_scale"), cols)
        return F.linear(xq, w.to(x.dtype), bias)


class Fp8BlockLinearMethod(Fp8LinearMethod):
    """Weights in ``block`` × ``block`` blocks with a scale each; activations per token and
    ``block`` columns. The layer keeps the scales one row per weight row and one column per
    block column its input columns fall in (``scale_cols`` maps each column to its scale)."""

    def create_weights(self, layer: Linear) -> None:
        b, start, k = self.quant.block, layer.col_start, layer.in_features
        first = start // b
        cols = (start + k - 1) // b - first + 1
        weight = torch.empty(layer.out_features, k, dtype=FP8)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.register_parameter("weight_scale", scale_parameter(layer.out_features, cols))
        index = (start + torch.arange(k)) // b - first
        layer.register_buffer("scale_cols", index, persistent=False)
        # on a GPU, where the rows fall in whole blocks: the scales a block too, as cuBLASLt's
        # block scaling takes them (``process_weights_after_loading``)
        layer.register_buffer("block_scales", None, persistent=False)

    def _load_scale(self, layer: Linear, scale: Loaded, dst: torch.Tensor, shard: Shard) -> None:
        """This rank's rows and block columns of a shard's block scales, only they read."""
        b = self.quant.block
        want = (-(-shard.total // b), -(-layer.in_total // b))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"a block weight scale of shape {tuple(scale.shape)}, expected {want}: "
                f"{shard.total}×{layer.in_total} weights, {b}×{b} blocks"
            )
        top = shard.src // b
        blocks = full(scale.narrow(0, top, (shard.src + shard.size - 1) // b - top + 1)
                      .narrow(1, layer.col_start // b, dst.shape[1])).float()  # fmt: skip
        dst.copy_(blocks[(shard.src + torch.arange(shard.size)) // b - top])

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not self.kernels or not tensor(layer, "weight").is_cuda:
            return
        from services.worker.engine.ops import fp8_block

        scales = fp8_block.block_scales(tensor(layer, "weight_scale").data, self.quant.block)
        layer.register_buffer("block_scales", scales, persistent=False)

    def _whole_blocks(self, layer: Linear) -> bool:
        """This rank's input columns start on a block (its K tiles are whole blocks)."""
        return layer.col_start % self.quant.block == 0

    def input_group(self, layer: Linear, like: torch.Tensor) -> int:
        b = self.quant.block
        if not self.kernels or not self._whole_blocks(layer) or layer.in_features % b:
            return 0
        return b if _kernels_take(like, tensor(layer, "weight")) else 0

    def apply(
        self, layer: Linear, x: torch.Tensor | Codes, bias: torch.Tensor | None
    ) -> torch.Tensor:
        weight = tensor(layer, "weight")
        takes = self.kernels and not isinstance(x, Codes) and _kernels_take(x, weight)
        if isinstance(x, Codes) or (takes and self._whole_blocks(layer)):
            from services.worker.engine.ops import fp8_block

            return fp8_block.fp8_block_mm(
                x, weight, tensor(layer, "weight_scale"), bias, self.quant.block,
                optional_tensor(layer, "block_scales"),
                fast_accumulation=self.quant.fast_accumulation,
            )  # fmt: skip
        assert isinstance(x, torch.Tensor)
        return self._reference(layer, x, bias)


class CheckpointKVScales(KVCacheMethod):
    """A key and a value scale per attention layer from the checkpoint (compressed-tensors
    ``kv_cache_scheme``): an FP8 cache holds k / k_scale and v / v_scale. Every rank loads the
    same two values."""

    def create_weights(self, layer: nn.Module) -> None:
        layer.register_parameter("k_scale", scale_parameter(fill=1.0))
        layer.register_parameter("v_scale", scale_parameter(fill=1.0))

    def load(self, param: nn.Parameter, loaded: Loaded) -> None:
        scale = float(one_value(loaded, "a KV cache scale (per tensor)"))
        if not scale > 0.0 or scale == float("inf"):
            raise ValueError(f"a KV cache scale must be positive and finite, got {scale}")
        param.data.fill_(scale)

    def scales(self, layer: nn.Module) -> tuple[float, float]:
        return float(tensor(layer, "k_scale")), float(tensor(layer, "v_scale"))
