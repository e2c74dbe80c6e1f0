"""The linear layers' batched products on a GPU, bf16 against FP8 (``fp8_linear.fp8_mm``: e4m3
codes of the rows with a scale per row, e4m3 weights with a scale per output channel, on the FP8
tensor cores) with and without fast accumulation (the partial sums not promoted to float32).

For each projection of one decoder layer of ``--shape`` and each row count of ``--tokens``:
the median time of each (``triton.testing.do_bench``, which clears the L2 before each call)
as TFLOP/s, and each FP8 product's error against float64 over the same codes and scales:
the largest absolute error over the largest absolute output, and the mean relative error.

    python benchmarks/fp8_mm.py --shape llama-3.1-8b --tokens 64 256 2048 --output fp8_mm.json
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gemv import projections
from benchmarks.roofline import fp8_matmul_peak
from benchmarks.shapes import SHAPES
from services.worker.engine.models import quantization
from services.worker.engine.models.layers.fp8_linear import fp8_mm, quantize_rows
from services.worker.engine.models.quantization import Codes


def errors(y: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    err = (y.double() - exact).abs()
    return {
        "max_abs_over_max": float(err.max() / exact.abs().max()),
        "mean_rel": float((err / exact.abs().clamp_min(1e-3 * exact.abs().mean())).mean()),
    }


def case(n: int, k: int, m: int, dev: torch.device) -> dict[str, Any]:
    """One projection (N, K) at ``m`` rows: times and errors."""
    gen = torch.Generator(device=dev).manual_seed(n * 7 + k + m)
    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * k**-0.5
    wq, ws = quantization.quantize_rows(w)  # a scale per output channel
    xq, xs = quantize_rows(x)
    codes = Codes(xq, xs, torch.bfloat16)
    exact = (xq.double() * xs.double()) @ (wq.double() * ws.double().reshape(-1, 1)).t()
    flops = 2 * m * n * k
    row: dict[str, Any] = {"N": n, "K": k, "M": m}
    runs = {
        "bf16": lambda: F.linear(x, w),
        "fp8": lambda: fp8_mm(codes, wq, ws),
        "fp8_fast": lambda: fp8_mm(codes, wq, ws, fast_accumulation=True),
    }
    for name, fn in runs.items():
        ms = triton.testing.do_bench(fn, return_mode="median")
        row[f"{name}_us"] = round(ms * 1e3, 2)
        row[f"{name}_TFLOPs"] = round(flops / ms / 1e9, 1)
        if name != "bf16":
            row[f"{name}_error"] = errors(fn(), exact)
    row["fast_over_fp8"] = round(row["fp8_us"] / row["fp8_fast_us"], 3)
    row["fp8_over_bf16"] = round(row["bf16_us"] / row["fp8_us"], 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 2048])
    p.add_argument("--output")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = [
        {"projection": name, **case(n, k, m, dev)}
        for m in args.tokens
        for name, (n, k) in projections(SHAPES[args.shape]).items()
    ]
    for r in rows:
        print(json.dumps(r), flush=True)
    by_tokens = {}
    for m in args.tokens:
        sel = [r for r in rows if r["M"] == m]
        by_tokens[m] = {
            f"{name}_us": round(sum(r[f"{name}_us"] for r in sel), 1)
            for name in ("bf16", "fp8", "fp8_fast")
        }
    summary = {
        "gpu": torch.cuda.get_device_name(dev),
        "fp8_matmul_peak_TFLOPs": round(fp8_matmul_peak(dev) / 1e12, 1),
        "fp8_fast_matmul_peak_TFLOPs": round(
            fp8_matmul_peak(dev, fast_accumulation=True) / 1e12, 1
        ),
        "one_layer_by_tokens": by_tokens,
    }
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
