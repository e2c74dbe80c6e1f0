"""Which quantization a checkpoint (or ``EngineArgs.quantization``) asks for: torch-free, so
that configuration (and the CLI) never imports torch. The formats are described in the
package's docstring; the methods that run them are chosen in ``registry.py``.
"""

from dataclasses import dataclass, replace
from typing import Any

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_SCHEMES = ("token", "token_group", "static")


@dataclass(frozen=True)
class QuantConfig:
    weights: str  # tensor | channel | block
    activations: str  # token (dynamic) | token_group (dynamic, per 128 columns) | static
    block: int = 128  # the block's side (block weights, token_group activations)
    online: bool = False  # quantize a float checkpoint at load
    method: str = "fp8"  # a description, for logs and model info
    # the checkpoint carries a key and a value scale per layer (compressed-tensors
    # ``kv_cache_scheme``), which an FP8 KV cache takes instead of 1.0
    kv_scales: bool = False
    # the FP8 tensor cores' products of more than one row accumulate in the tensor cores' own
    # precision, without promoting partial sums to float32 (EngineArgs.fp8_fast_accumulation)
    fast_accumulation: bool = False


def parse_quantization(
    hf: dict[str, Any], requested: str | None, fast_accumulation: bool | None = False
) -> QuantConfig | None:
    """The quantization a checkpoint's config.json (or ``requested``) asks for; refuses what it
    cannot run with a message that says what it found. ``fast_accumulation``
    (``EngineArgs.fp8_fast_accumulation``): True or False as asked; None, on for an FP8 model."""
    quant = _parse(hf, requested)
    if fast_accumulation and quant is None:
        raise ValueError("fp8_fast_accumulation needs an FP8 model: a quantized "
                         "checkpoint or quantization='fp8'")  # fmt: skip
    if quant is None or fast_accumulation is False:
        return quant
    return replace(quant, fast_accumulation=True, method=f"{quant.method}, fast accumulation")


def check_expert_slice(quant: QuantConfig | None, intermediate: int, ranks: int) -> None:
    """FP8 experts in blocks keep whole blocks on a rank: when ``ranks`` split each expert's
    ``intermediate`` dimension, each rank's share must be a multiple of the block."""
    if quant is None or quant.weights != "block" or (intermediate // ranks) % quant.block == 0:
        return
    raise ValueError(
        f"FP8 block experts need each rank's share of moe_intermediate_size ({intermediate} / "
        f"{ranks} = {intermediate // ranks}) to be a multiple of {quant.block}: fewer ranks, "
        "or --enable-expert-parallel"
    )


def describe(quant: QuantConfig | None) -> str:
    """What a worker says its linear layers are ("" in the model's dtype)."""
    return "" if quant is None else quant.method


def _parse(hf: dict[str, Any], requested: str | None) -> QuantConfig | None:
    qc = hf.get("quantization_config")
    if qc is None:
        if requested is None:
            return None
        if requested != "fp8":
            raise ValueError(f"quantization must be fp8 or unset, got {requested!r}")
        return QuantConfig("channel", "token", online=True, method="fp8 (quantized at load)")
    method = qc.get("quant_method")
    if method == "mxfp4":  # (openai/gpt-oss as published: its experts dequantized at load)
        if "GptOssForCausalLM" not in (hf.get("architectures") or []):
            raise ValueError(f"MXFP4 checkpoints are read for gpt-oss's experts only, not "
                             f"{hf.get('architectures')}")  # fmt: skip
        return _parse({}, requested)  # a float checkpoint's, which they are then
    if requested not in (None, "fp8"):
        raise ValueError(f"quantization={requested!r}, but the checkpoint is quantized already")
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
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # (MiniMax's spelling)
            raise ValueError(f"unsupported fp8 format {qc.get('fmt')!r} (e4m3 only)")
        # (modules_to_not_convert: what stays float; the loader reads that from the tensors,
        # models/loader.keep_float)
        return QuantConfig("block", "token_group", method="fp8 (128x128 blocks)")
    raise ValueError(f"unknown quantization method {method!r} (supported: compressed-tensors "
                     "float-quantized, fp8)")  # fmt: skip


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    if qc.get("format") != "float-quantized":
        raise ValueError(f"compressed-tensors format {qc.get('format')!r} is not supported "
                         "(float-quantized only)")  # fmt: skip
    # (ignore: what stays float, read from the tensors as above)
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
    kv_scales = _kv_cache_scheme(qc.get("kv_cache_scheme"))
    method = f"fp8 ({w['strategy']} weights, {acts} acts{', KV scales' if kv_scales else ''})"
    return QuantConfig(w["strategy"], acts, method=method, kv_scales=kv_scales)


def _kv_cache_scheme(kv: dict[str, Any] | None) -> bool:
    """Whether the checkpoint has KV cache scales: static, 8-bit float, one per tensor (a key
    and a value scale per layer, ``self_attn.k_scale`` / ``v_scale``), or none."""
    if kv is None:
        return False
    kind = (kv.get("num_bits"), kv.get("type"), kv.get("strategy"), bool(kv.get("dynamic")))
    if kind != (8, "float", "tensor", False):
        raise ValueError(f"compressed-tensors kv_cache_scheme: static 8-bit float scales per "
                         f"tensor only, got {kv!r}")  # fmt: skip
    return True
