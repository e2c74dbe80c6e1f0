"""FP8 (e4m3) quantization of the linear layers: what a checkpoint's ``quantization_config``
says, and the arithmetic the layers and the reference share.

    weights      float8_e4m3fn, with a float32 scale per tensor, per output channel, or per
                 128×128 block (``w ≈ w_fp8 · scale``); the layer keeps the scale as one column
                 per output row ([out, 1]) or one per block column ([out, in/128])
    activations  quantized at each linear input: dynamic per token, dynamic per token and
                 128-column group (block checkpoints), or a static per-tensor scale
    kept bf16    embeddings, norms and the LM head

Formats read (``parse_quantization``):
    compressed-tensors  ``format: float-quantized`` (``weight_scale``, and ``input_scale`` when
                        activations are static)
    fp8                 ``weight_block_size: [128, 128]`` (``weight_scale_inv``: the multiplier)
    online              ``EngineArgs(quantization="fp8")`` on a float checkpoint: per-channel
                        scales computed at load, activations dynamic per token

This module is the plain-PyTorch path (it runs everywhere, CI included): activations and weights
are quantized exactly as the FP8 kernels would, then multiplied dequantized.
"""

from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_SCHEMES = ("token", "token_group", "static")


@dataclass(frozen=True)
class QuantConfig:
    weights: str  # tensor | channel | block
    activations: str  # token (dynamic) | token_group (dynamic, per 128 columns) | static
    block: int = 128  # the block's side (block weights, token_group activations)
    online: bool = False  # quantize a float checkpoint at load
    method: str = "fp8"  # what /v1/models and the registration report

    @property
    def scale_suffix(self) -> str:
        return "weight_scale"


def parse_quantization(hf: dict[str, Any], requested: str | None) -> QuantConfig | None:
    """The quantization a checkpoint's config.json (or ``requested``) asks for; refuses what it
    cannot run with a message that says what it found."""
    qc = hf.get("quantization_config")
    if qc is None:
        if requested is None:
            return None
        if requested != "fp8":
            raise ValueError(f"quantization must be fp8 or unset, got {requested!r}")
        return QuantConfig("channel", "token", online=True, method="fp8 (quantized at load)")
    if requested not in (None, "fp8"):
        raise ValueError(f"quantization={requested!r}, but the checkpoint is quantized already")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise ValueError(f"fp8 checkpoints need weight_block_size [128, 128], got {block!r}")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(
                "fp8 block checkpoints with static activation scales are not supported"
            )
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"unsupported fp8 format {qc.get('fmt')!r} (e4m3 only)")
        return QuantConfig("block", "token_group", method="fp8 (128x128 blocks)")
    raise ValueError(f"unknown quantization method {method!r} (supported: compressed-tensors "
                     "float-quantized, fp8)")  # fmt: skip


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    if qc.get("format") != "float-quantized":
        raise ValueError(f"compressed-tensors format {qc.get('format')!r} is not supported "
                         "(float-quantized only)")  # fmt: skip
    ignored = [name for name in qc.get("ignore", []) if name != "lm_head"]
    if ignored:
        raise ValueError(f"compressed-tensors ignore lists other than lm_head are not supported: "
                         f"{ignored[:4]}")  # fmt: skip
    groups = list(qc.get("config_groups", {}).values())
    if len(groups) != 1:
        raise ValueError(f"one compressed-tensors config group is supported, got {len(groups)}")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    for what, spec in (("weights", w), ("input_activations", a)):
        if spec.get("num_bits") != 8 or spec.get("type") != "float":
            raise ValueError(f"compressed-tensors {what}: 8-bit float only, got {spec!r}")
    if w.get("strategy") not in ("tensor", "channel") or w.get("dynamic"):
        raise ValueError(f"compressed-tensors weights: static tensor or channel scales only, "
                         f"got {w.get('strategy')!r}")  # fmt: skip
    if a.get("dynamic") and a.get("strategy") == "token":
        acts = "token"
    elif not a.get("dynamic") and a.get("strategy") == "tensor":
        acts = "static"
    else:
        raise ValueError(f"compressed-tensors activations: dynamic per token or static per "
                         f"tensor only, got {a!r}")  # fmt: skip
    return QuantConfig(w["strategy"], acts, method=f"fp8 ({w['strategy']} weights, {acts} acts)")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (output channel) e4m3 quantization: (w_fp8, scale [rows, 1])."""
    scale = (w.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(
    x: torch.Tensor, scheme: str, block: int, static_scale: torch.Tensor | None
) -> torch.Tensor:
    """``x`` rounded through e4m3 as the FP8 GEMM would see it, back in ``x``'s dtype."""
    xf = x.float()
    if scheme == "static":
        assert static_scale is not None
        scale = static_scale.float()
    elif scheme == "token":
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:  # token_group: one scale per token and ``block`` columns
        rows, cols = xf.shape
        groups = xf.view(rows, -1, block) if cols % block == 0 else None
        if groups is None:  # a last partial group (tiny models)
            pad = torch.nn.functional.pad(xf, (0, -cols % block))
            groups = pad.view(rows, -1, block)
        s = (groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        q = (groups / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
        return q.reshape(rows, -1)[:, :cols].to(x.dtype)
    return ((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


def dequantize(w: torch.Tensor, scale: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """``w_fp8 · scale`` in float32; ``cols`` maps each column to its scale column (blocks)."""
    s = scale if cols is None else scale[:, cols]
    return w.float() * s
