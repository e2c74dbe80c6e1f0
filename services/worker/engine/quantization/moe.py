"""Mixture-of-experts layers' methods: how the experts' weights are kept and run.

- ``UnquantizedMoEMethod``: the model's dtype.
- ``Fp8MoEMethod``: e4m3 weights with a scale per output channel (compressed-tensors channel or
  tensor checkpoints, or a float checkpoint quantized at load) or per 128×128 block (the ``fp8``
  method's ``weight_scale_inv``), activations quantized per token (per token and 128 columns
  with blocks) at each expert's two products, as the dense FP8 layers quantize theirs.

On a GPU with the engine's kernels both run ``ops/fused_moe.py`` (every expert in two grouped
GEMMs, no host sync) unless the layer has biases or another activation than SiLU (gpt-oss's),
which the kernel does not compute. Everywhere else, and as the kernel's reference,
``combine``: each expert's tokens gathered, one GEMM pair per expert, the products added back
with their routing weights, expert by expert in order (Hugging Face's loop); FP8 rounds
exactly as the kernel does (``fp8_math``) and multiplies dequantized.

Scales are kept as the kernel takes them: per channel ``w13_weight_scale`` [E, 2I, 1] and
``w2_weight_scale`` [E, H, 1]; in blocks [E, 2I/128, ⌈H/128⌉] and [E, ⌈H/128⌉, I/128].
"""

from collections.abc import Callable
from typing import Any

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
    Experts,
    MoEMethod,
    Proj,
    expert_part,
    scale_parameter,
    tensor,
)
from services.worker.engine.quantization.config import QuantConfig
from services.worker.engine.quantization.fp8_math import FP8, quantize_activations, quantize_rows

# (this rank's expert index, the rows of x routed to it) → its output rows
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def combine(
    layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert: ExpertFn,
) -> torch.Tensor:  # fmt: skip
    """``Σ_j topk_weights[t, j] · expert(ids[t, j], x[t])`` over this rank's experts, in plain
    PyTorch: the (token, slot) pairs sorted by expert, each expert's run of tokens multiplied
    at once, added back in float32 with ``index_add``.

        flat (token·k + slot) sorted by local expert:  [ -1 -1 | 0 0 0 | 1 | 3 3 ]
                                                        others   e=0     e=1  e=3

    Sizing each run reads the counts on the host; while a CUDA graph captures, which cannot,
    every expert runs on every token instead, its output weighted by 0 where not chosen."""
    ids = topk_ids.long()
    local = ids if layer.expert_map is None else layer.expert_map[ids].long()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        for e in range(layer.num_experts):
            weight = (topk_weights.float() * (local == e)).sum(-1, keepdim=True)
            out += expert(e, x).float() * weight
        return out.to(x.dtype)
    flat, k = local.flatten(), local.shape[1]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=layer.num_experts + 1).tolist()
    start = counts[0]  # the pairs routed to other ranks' experts sort first
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        token, slot = pairs // k, pairs % k
        y = expert(e, x[token]).float() * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def _kernel_takes(layer: Experts, x: torch.Tensor, w13: torch.Tensor) -> bool:
    """ops/fused_moe computes either activation, with or without biases, on CUDA tensors it
    supports."""
    if not x.is_cuda:
        return False
    from services.worker.engine.ops import fused_moe

    return bool(fused_moe.supported(x, w13))


def _kernel_extras(layer: Experts) -> dict[str, Any]:
    """gpt-oss's biases and clamped SwiGLU, as ``fused_moe`` takes them."""
    clamped = layer.activation == "swiglu_clamped"
    return {
        "w13_bias": layer.w13_bias,
        "w2_bias": layer.w2_bias,
        "swiglu_limit": layer.limit if clamped else None,
        "swiglu_alpha": layer.alpha,
    }


def _weights(layer: Experts, dtype: torch.dtype) -> tuple[nn.Parameter, nn.Parameter]:
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
    w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
    layer.register_parameter("w13_weight", w13)
    layer.register_parameter("w2_weight", w2)
    return w13, w2


class UnquantizedMoEMethod(MoEMethod):
    def __init__(self, kernels: bool = False):
        self.kernels = kernels  # ops/fused_moe on a GPU

    def create_weights(self, layer: Experts) -> None:
        _weights(layer, torch.get_default_dtype())

    def apply(
        self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        w13, w2 = tensor(layer, "w13_weight"), tensor(layer, "w2_weight")
        if self.kernels and _kernel_takes(layer, x, w13):
            from services.worker.engine.ops import fused_moe

            return fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids,
                                       expert_map=layer.expert_map, w13_scale=None,
                                       w2_scale=None, block=None,
                                       **_kernel_extras(layer))  # fmt: skip

        b13, b2 = layer.w13_bias, layer.w2_bias

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = F.linear(rows, w13[e], None if b13 is None else b13[e])
            return F.linear(layer.activate(gate_up), w2[e], None if b2 is None else b2[e])

        return combine(layer, x, topk_weights, topk_ids, expert)


class Fp8MoEMethod(MoEMethod):
    """e4m3 experts: a scale per output channel (``quant.weights`` channel or tensor, or a
    float checkpoint quantized at load) or per ``quant.block``-square block."""

    def __init__(self, quant: QuantConfig, kernels: bool = False):
        self.quant = quant
        self.kernels = kernels  # ops/fused_moe on a GPU
        self.block = quant.block if quant.weights == "block" else None
        self.description = quant.method
        self.derived_parameters = ("w13_weight_scale", "w2_weight_scale") if quant.online else ()

    def float_method(self) -> MoEMethod | None:
        return None if self.quant.online else UnquantizedMoEMethod(self.kernels)

    def create_weights(self, layer: Experts) -> None:
        if self.quant.activations == "static":
            raise ValueError("FP8 experts with static activation scales are not supported "
                             "(dynamic per-token activations only)")  # fmt: skip
        _weights(layer, FP8)
        e, h, i, b = layer.num_experts, layer.hidden_size, layer.intermediate_size, self.block
        if b is None:
            layer.register_parameter("w13_weight_scale", scale_parameter(e, 2 * i, 1))
            layer.register_parameter("w2_weight_scale", scale_parameter(e, h, 1))
            return
        if i % b:  # a block would straddle gate and up, or two ranks
            raise ValueError(
                f"FP8 block experts need each rank's intermediate size ({i}) to be a multiple "
                f"of {b}: fewer ranks, or expert parallelism"
            )
        layer.register_parameter("w13_weight_scale", scale_parameter(e, 2 * i // b, -(-h // b)))
        layer.register_parameter("w2_weight_scale", scale_parameter(e, -(-h // b), i // b))

    def load(
        self, layer: Experts, param: nn.Parameter, loaded: Loaded, expert: int, proj: Proj
    ) -> bool:
        weight = tensor(layer, "w2_weight" if proj == "down" else "w13_weight")
        scale = tensor(layer, "w2_weight_scale" if proj == "down" else "w13_weight_scale")
        if param is scale:
            self._load_scale(layer, loaded, expert_part(scale, expert, proj), proj)
            return True
        if param is weight and self.quant.online:  # a float weight: quantize it
            codes, rows = quantize_rows(full(layer.rank_slice(loaded, proj)))
            copy_weight(expert_part(weight, expert, proj), codes)
            expert_part(scale, expert, proj).copy_(rows)
            return True
        return False

    def _load_scale(self, layer: Experts, scale: Loaded, dst: torch.Tensor, proj: Proj) -> None:
        """This rank's part of one expert's weight scale, and only it read: its rows (gate, up)
        or its block columns (down) of the checkpoint's (down's per-channel scales, one a
        hidden row, whole); a per-tensor scale's one value on every row."""
        i, start, b = layer.intermediate_size, layer.intermediate_start, self.block
        h, total = layer.hidden_size, layer.intermediate_total
        shape = tuple(int(n) for n in scale.shape)
        if b is None and vector_length(scale) == 1:
            dst.fill_(one_value(scale, "a per-tensor weight scale").item())
            return
        if b is None:
            want: tuple[int, ...] = (h,) if proj == "down" else (total,)
            got: tuple[int | None, ...] = (vector_length(scale),)
        else:
            want = (-(-h // b), -(-total // b)) if proj == "down" else (-(-total // b), -(-h // b))
            got = shape
        if got != want:
            kind = "per-channel" if b is None else f"{b}×{b} block"
            raise ValueError(f"a {kind} weight scale of shape {shape} does not match the "
                             f"expert's {proj} projection, expected {want}")  # fmt: skip
        if b is None:
            rows = (0, h) if proj == "down" else (start, i)
            dst.copy_(vector_part(scale, *rows).reshape(dst.shape))
            return
        first, count = start // b, (start + i) // b - start // b
        part = scale.narrow(1 if proj == "down" else 0, first, count)
        dst.copy_(full(part).float())

    def apply(
        self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        w13, w2 = tensor(layer, "w13_weight"), tensor(layer, "w2_weight")
        s13, s2 = tensor(layer, "w13_weight_scale"), tensor(layer, "w2_weight_scale")
        if self.kernels and _kernel_takes(layer, x, w13):
            from services.worker.engine.ops import fused_moe

            return fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids,
                                       expert_map=layer.expert_map, w13_scale=s13,
                                       w2_scale=s2, block=self.block,
                                       **_kernel_extras(layer))  # fmt: skip
        acts, b = self.quant.activations, self.quant.block
        b13, b2 = layer.w13_bias, layer.w2_bias

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = F.linear(rows, self._dequantize(w13[e], s13[e], x.dtype),
                               None if b13 is None else b13[e])  # fmt: skip
            h = quantize_activations(layer.activate(gate_up), acts, b, None)
            return F.linear(h, self._dequantize(w2[e], s2[e], x.dtype),
                            None if b2 is None else b2[e])  # fmt: skip

        # (rounding per token, or per token and group: the same for every expert's rows)
        return combine(layer, quantize_activations(x, acts, b, None), topk_weights, topk_ids,
                       expert)  # fmt: skip

    def _dequantize(self, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``w_fp8 · scale`` in float32 (a block's scale on each of its weights), in ``dtype``."""
        b = self.block
        if b is not None:
            scale = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)
            scale = scale[: w.shape[0], : w.shape[1]]
        return (w.float() * scale).to(dtype)
