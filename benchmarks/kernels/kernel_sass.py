"""What the engine's Triton kernels compile to on Hopper, read on any machine (no GPU needed):
each kernel compiled for sm_90 by Triton's bundled ``ptxas`` with the specializations a launch
on the H200 gets, then its registers, shared memory and spills (``cuobjdump -res-usage``) and
the instruction mix of its main loop (the longest backward branch of ``nvdisasm``'s listing)
and the widths of its global stores.

For reading a kernel change before spending device time on it: barriers, shared-memory trips,
spills, register pressure. Not for speed: a GEMV with 28 % fewer instructions in its loop ran
no faster (docs/performance.md, "FP8": the GEMV over codes loaded as words, 514 against
372–408 instructions a tile, tried and reverted).

    python benchmarks/kernels/kernel_sass.py                       # every preset
    python benchmarks/kernels/kernel_sass.py --kernels fp8_gemv_codes decode_fp8 --output sass.json
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.worker.engine.ops import attention as attention_ops
from services.worker.engine.ops import fp8_block, fp8_linear, fused_ops

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
_TOOLS = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin"


@dataclass(frozen=True)
class Preset:
    """A kernel and one launch of it: argument types (scalars not named are int32), the
    constexprs, warps and stages."""

    kernel: Any
    types: dict[str, str]
    constexprs: dict[str, Any]
    warps: int
    stages: int


def _gemv(codes: bool, fast: bool = False) -> Preset:
    """The FP8 GEMV at the 8B shape's kept launch for o, gate_up and down (8 rows × 2,048);
    ``fast``: its float16 products (fast accumulation, over codes)."""
    return Preset(
        fp8_linear._fp8_gemv_kernel,
        {"X": "*fp8e4nv" if codes else "*bf16", "W": "*i32", "WS": "*fp32", "B": "*bf16",
         "Y": "*bf16", "xs_in": "*fp32"},
        {"STATIC": False, "HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 2048, "AMAX_BLOCK": 4096,
         "GPU": True, "CODES": codes, "USE_PDL": True, "FAST": fast, "GROUP": 0},
        warps=4, stages=3,
    )  # fmt: skip


def _decode(fp8: bool) -> Preset:
    """The decode attention of a batch over one range a row (the one-range launch: 64 keys a
    tile), Llama-3.1-8B's heads (4 queries a KV head, head dim 128), bf16 queries."""
    kv = "*fp8e4nv" if fp8 else "*bf16"
    return Preset(
        attention_ops._decode,
        {"Q": "*bf16", "K": kv, "V": kv, "Out": "*bf16", "part_acc": "*bf16",
         "part_ml": "*bf16", "block_tables": "*i32", "query_start_loc": "*i32",
         "seq_lens": "*i32", "order": "*i32", "Sinks": "*fp32", "qk_scale": "fp32",
         "v_scale": "fp32"},
        {"KV_BLOCK": 16, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_D": 128,
         "BLOCK_N": 64, "NUM_SPLITS": 1, "PRECISION": "tf32", "ORDERED": True,
         "USE_PDL": False, "DOT_F16": fp8, "GPU": True, "LANES": 1, "PREFETCH": 0,
         "HAS_WINDOW": False, "HAS_SINKS": False},
        warps=4, stages=2,
    )  # fmt: skip


def _prefill(head_dim: int, v_dim: int, group: int, tile: tuple[int, int, int, int]) -> Preset:
    """The paged prefill attention, bf16, keys ``head_dim`` and values ``v_dim`` wide (MLA's
    narrower), ``group`` queries a KV head; ``tile``: BLOCK_M, BLOCK_N, warps, stages."""
    block_m, block_n, warps, stages = tile
    return Preset(
        attention_ops._prefill,
        {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "block_tables": "*i32",
         "query_start_loc": "*i32", "seq_lens": "*i32", "Sinks": "*fp32", "qk_scale": "fp32",
         "v_scale": "fp32"},
        {"KV_BLOCK": 16, "GROUP": group, "HEAD_DIM": head_dim,
         "BLOCK_D": triton.next_power_of_2(head_dim), "HEAD_DV": v_dim,
         "BLOCK_DV": triton.next_power_of_2(v_dim), "BLOCK_M": block_m, "BLOCK_N": block_n,
         "PRECISION": "tf32", "DOT_F16": False, "GPU": True, "HAS_WINDOW": False,
         "HAS_SINKS": False},
        warps=warps, stages=stages,
    )  # fmt: skip


def _gemm(block_n: int, block_m: int, warps: int, stages: int) -> Preset:
    """Our FP8 GEMM (decode batches; the product transposed) at one tile, 128 of K a step."""
    return Preset(
        fp8_linear._fp8_gemm_kernel,
        {"X": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "B": "*bf16",
         "Y": "*bf16", "PARTS": "*fp32", "TICKETS": "*i32"},
        {"HAS_BIAS": False, "BLOCK_N": block_n, "BLOCK_M": block_m, "BLOCK_K": 128,
         "PRECISE": False, "GROUPED": False},
        warps=warps, stages=stages,
    )  # fmt: skip


def _codes(kernel: str, group: int) -> Preset:
    """The kernels that write a block layer's input as codes (a scale per token and ``group``
    columns) at the 8B shape: RMSNorm with the residual (a 4,096-wide row a program),
    SiLU·mul and the layer's own pass (1,024 columns a program); ``group`` 0 per token."""
    if kernel == "rms_norm":
        return Preset(
            fused_ops._rms_norm,
            {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "Q": "*fp8e4nv",
             "S": "*fp32", "eps": "fp32"},
            {"BLOCK": 4096, "HAS_RESIDUAL": True, "QUANT": True, "GPU": True, "GROUP": group,
             "USE_PDL": True},
            warps=4, stages=1,
        )  # fmt: skip
    if kernel == "silu_mul":
        return Preset(
            fused_ops._silu_mul, {"X": "*bf16", "Y": "*fp8e4nv", "S": "*fp32"},
            {"BLOCK": 1024, "QUANT": True, "GPU": True, "GROUP": group, "USE_PDL": True},
            warps=4, stages=1,
        )  # fmt: skip
    return Preset(
        fp8_block._quantize_groups_kernel, {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32"},
        {"GROUP": group, "GROUPS": 1024 // group, "GPU": True, "USE_PDL": True},
        warps=4, stages=1,
    )  # fmt: skip


PRESETS = {
    "fp8_gemm_64x64": _gemm(64, 64, warps=4, stages=4),
    "fp8_gemm_128x128": _gemm(128, 128, warps=8, stages=3),
    "fp8_gemv_codes": _gemv(codes=True),
    "fp8_gemv_codes_fast": _gemv(codes=True, fast=True),
    "fp8_gemv": _gemv(codes=False),
    "decode_bf16": _decode(fp8=False),
    # the dense prefill at the H200's tuned launch (Llama-3.1-8B's heads); MLA's prefill
    # (DeepSeek's 192-wide keys, 128-wide values) at contiguous_prefill's launch
    "prefill_bf16": _prefill(128, 128, 4, (128, 32, 4, 3)),
    "prefill_mla": _prefill(192, 128, 1, (64, 64, 8, 2)),
    "decode_fp8": _decode(fp8=True),
    "rms_norm_codes": _codes("rms_norm", 0),
    "rms_norm_group_codes": _codes("rms_norm", 128),
    "silu_mul_group_codes": _codes("silu_mul", 128),
    "quantize_groups": _codes("quantize_groups", 128),
}


def compile_sm90(p: Preset) -> Any:
    """The compiled kernel; pointers and int32 arguments divisible by 16, as Triton
    specializes a launch whose tensors and strides are; a constexpr the preset does not name
    at its default."""
    names = p.kernel.arg_names
    unknown = (set(p.types) | set(p.constexprs)) - set(names)
    if unknown:
        raise ValueError(f"{p.kernel.__name__} has no arguments {sorted(unknown)}")
    defaults = {q.name: q.default for q in p.kernel.params if q.is_constexpr and q.has_default}
    constexprs = {**{n: v for n, v in defaults.items() if n not in p.types}, **p.constexprs}
    p = Preset(p.kernel, p.types, constexprs, p.warps, p.stages)
    sig = {n: "constexpr" if n in p.constexprs else p.types.get(n, "i32") for n in names}
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: the kernels were made for the interpreter")
    aligned = [n for n in names if sig[n].startswith("*") or sig[n] == "i32"]
    src = ASTSource(
        fn=p.kernel, signature=sig,
        constexprs={(names.index(k),): v for k, v in p.constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )  # fmt: skip
    return triton.compile(src, target=TARGET, options={"num_warps": p.warps,
                                                       "num_stages": p.stages})  # fmt: skip


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([str(_TOOLS / name), *args, f.name], capture_output=True, text=True)
    run.check_returncode()
    return run.stdout


def resources(cubin: bytes) -> dict[str, int]:
    """Registers a thread, and bytes of stack, static shared and local (spilled) memory."""
    out = _tool("cuobjdump", cubin, "-res-usage")
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    names = {"REG": "registers", "STACK": "stack", "SHARED": "shared_static", "LOCAL": "local"}
    return {names[k]: int(v) for k, v in found.items()}


def loop_mix(sass: str) -> collections.Counter[str]:
    """Opcodes between the label the longest backward branch targets and that branch."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*\.(L_x_\d+):", line))}  # fmt: skip
    best: tuple[int, int] | None = None
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\s+`?\(?\.(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            start = labels[m.group(1)]
            if best is None or i - start > best[1] - best[0]:
                best = (start, i)
    mix: collections.Counter[str] = collections.Counter()
    if best is None:
        return mix
    for line in lines[best[0] : best[1] + 1]:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            mix[m.group(1)] += 1
    return mix


def global_stores(sass: str) -> collections.Counter[str]:
    """The kernel's global store instructions by width (``STG.E.U8``: a byte a thread;
    ``STG.E.128``: 16 bytes), anywhere in the listing."""
    return collections.Counter(re.findall(r"\b(STG\.[A-Z0-9_.]+)", sass))


def report(name: str) -> dict[str, Any]:
    p = PRESETS[name]
    compiled = compile_sm90(p)
    sass = _tool("nvdisasm", compiled.asm["cubin"], "-c")
    mix = loop_mix(sass)
    return {
        "kernel": p.kernel.__name__, "warps": p.warps, "stages": p.stages,
        **resources(compiled.asm["cubin"]), "shared_dynamic": compiled.metadata.shared,
        "loop_instructions": sum(mix.values()), "loop_mix": dict(mix.most_common()),
        "global_stores": dict(global_stores(sass)),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="+", default=sorted(PRESETS), choices=sorted(PRESETS))
    ap.add_argument("--output")
    args = ap.parse_args()
    results = {name: report(name) for name in args.kernels}
    print(json.dumps(results, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
