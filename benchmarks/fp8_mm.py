"""The linear layers' batched products on a GPU, bf16 against FP8 (``fp8_linear.fp8_mm``: e4m3
codes of the rows with a scale per row, e4m3 weights with a scale per output channel, on the FP8
tensor cores) with and without fast accumulation (the partial sums not promoted to float32).

At row counts where the GPU's table gives our own FP8 GEMM (``fp8_linear.fp8_gemm``), "fp8"
is that kernel, as in the engine; ``--tune`` below sets it against cuBLASLt by name.

For each projection of one decoder layer of ``--shape`` and each row count of ``--tokens``:
the median time of each (``triton.testing.do_bench``, which clears the L2 before each call)
as TFLOP/s, and each FP8 product's error against float64 over the same codes and scales:
the largest absolute error over the largest absolute output, and the mean relative error.

    python benchmarks/fp8_mm.py --shape llama-3.1-8b --tokens 64 256 2048 --output fp8_mm.json

``--tune DIR``: instead, at each row count of ``--tokens`` (decode batches), our own FP8 GEMM
(``fp8_linear.fp8_gemm``) at each launch of ``GEMM_LAUNCHES`` against cuBLASLt (fast
accumulation, the engine's default), each timed as a decode step runs them: a CUDA graph of
back-to-back calls over weights read from HBM. Where the fastest launch beats cuBLASLt by
``--margin``, it goes into the GPU's table in DIR (``fp8_gemm``, read by
``gemv_configs.gemm_launch``), replacing that section and keeping the rest of the file; every
time and each kept launch's error against float64 go to ``--output``.

    python benchmarks/fp8_mm.py --tune services/worker/engine/models/layers/configs \
        --output fp8_gemm_tune.json
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
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


def exact_product(codes: Codes, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The product of the codes and weights, each times its scales, in float64."""
    x = codes.codes.double() * codes.scales.double()
    return x @ (wq.double() * ws.double().reshape(-1, 1)).t()


def case(n: int, k: int, m: int, dev: torch.device) -> dict[str, Any]:
    """One projection (N, K) at ``m`` rows: times and errors."""
    gen = torch.Generator(device=dev).manual_seed(n * 7 + k + m)
    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * k**-0.5
    wq, ws = quantization.quantize_rows(w)  # a scale per output channel
    xq, xs = quantize_rows(x)
    codes = Codes(xq, xs, torch.bfloat16)
    exact = exact_product(codes, wq, ws)
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


# (BLOCK_N, BLOCK_K, warps, stages): the weight-row side and K depth of a tile; each is tried
# at every BLOCK_M from 16 up to the row count's power of two (128 at most; 256 with 64-row
# tiles) and every split of K
GEMM_TILES = [(64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (64, 128, 8, 4),
              (128, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3)]  # fmt: skip
GEMM_SPLITS = (1, 2, 4)


def gemm_launches(m: int) -> list[dict[str, int]]:
    """The launches tried at ``m`` rows, as table entries (``gemv_configs.GEMM_KEYS``)."""
    top = max(16, triton.next_power_of_2(m))
    out = []
    for bn, bk, warps, stages in GEMM_TILES:
        for bm in (16, 32, 64, 128, 256):
            if bm > top or bm < min(top, 64) // 2 or (bm == 256 and bn != 64):
                continue
            for splits in GEMM_SPLITS:
                out.append({"block_n": bn, "block_m": bm, "block_k": bk, "splits": splits,
                            "warps": warps, "stages": stages})  # fmt: skip
    return out


def tune(args: argparse.Namespace, dev: torch.device) -> None:
    from benchmarks.gemv import time_calls
    from services.worker.engine import tuned_configs
    from services.worker.engine.models.layers import fp8_linear, gemv_configs

    gpu = torch.cuda.get_device_name(dev)
    path = Path(args.tune) / tuned_configs.config_file(gpu)
    doc = json.loads(path.read_text()) if path.is_file() else {}
    table: dict[str, dict[str, dict[str, int]]] = {}
    rows: list[dict[str, Any]] = []
    for name, (n, k) in projections(SHAPES[args.shape]).items():
        copies = max(2, -(-(512 << 20) // (n * k)))  # ≥ 512 MiB in all: nothing stays in L2
        gen = torch.Generator(device=dev).manual_seed(n + k)
        weights = [
            quantization.quantize_rows(torch.randn(n, k, device=dev, generator=gen) * k**-0.5)
            for _ in range(copies)
        ]
        for m in args.tokens:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            codes = Codes(*quantize_rows(x), torch.bfloat16)

            def cublas(x: torch.Tensor, w: Any, codes: Codes = codes) -> Any:
                ws = w[1].reshape(1, -1)
                return torch._scaled_mm(codes.codes, w[0].t(), scale_a=codes.scales,
                                        scale_b=ws, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)  # fmt: skip

            base = time_calls(cublas, weights, x, args.reps)
            times: dict[str, float] = {}
            entries: dict[str, dict[str, int]] = {}
            for entry in gemm_launches(m):
                launch = gemv_configs.gemm_keywords(entry)
                label = "-".join(map(str, entry.values()))

                def ours(
                    x: torch.Tensor, w: Any, launch: dict = launch, codes: Codes = codes
                ) -> Any:
                    return fp8_linear.fp8_gemm(
                        codes, w[0], w[1], None, dict(launch), fast_accumulation=True
                    )

                try:
                    times[label] = time_calls(ours, weights, x, args.reps)
                    entries[label] = entry
                except Exception as e:  # a launch this GPU cannot run (shared memory, registers)
                    print(f"  {name} M={m} {entry}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best = min(times, key=times.__getitem__)
            entry = entries[best]
            wq, ws = weights[0]
            exact = exact_product(codes, wq, ws)
            launch = gemv_configs.gemm_keywords(entry)
            y = fp8_linear.fp8_gemm(codes, wq, ws, None, launch, fast_accumulation=True)
            ref = cublas(x, weights[0])
            row = {"projection": name, "N": n, "K": k, "M": m,
                   "cublas_us": round(base * 1e6, 2), "best": entry,
                   "best_us": round(times[best] * 1e6, 2),
                   "speedup": round(base / times[best], 3),
                   "best_error": errors(y, exact), "cublas_error": errors(ref, exact),
                   "us": {c: round(t * 1e6, 2) for c, t in sorted(times.items())}}  # fmt: skip
            rows.append(row)
            ours_us, gain = row["best_us"], row["speedup"]
            print(f"{name:8s} M={m:4d} cuBLASLt {row['cublas_us']:7.2f} us, "
                  f"ours {ours_us:7.2f} ({gain:.3f}x) {best}", flush=True)  # fmt: skip
            if base / times[best] >= 1 + args.margin:
                table.setdefault(f"{n}x{k}", {})[str(m)] = entry
        del weights
        torch.cuda.empty_cache()
    doc[gemv_configs.GEMM] = table
    gemv_configs.parse(doc)  # what the kernels will read
    gemv_configs.parse_gemm(doc)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", path)
    if args.output:
        Path(args.output).write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+",
                   help="row counts (default 64 256 2048; with --tune 16 32 64 128)")  # fmt: skip
    p.add_argument("--output")
    p.add_argument("--tune", metavar="DIR", help="instead: our FP8 GEMM's launches (above)")
    p.add_argument("--margin", type=float, default=0.03, help="--tune: the least gain kept")
    p.add_argument("--reps", type=int, default=20, help="--tune: graph replays, the best kept")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.tune:
        # (at 256 rows o and down measured 1.16x and 1.04x alone, but no engine step showed a
        # gain: docs/results/h200-2026-12-02i/NOTES.md §3)
        args.tokens = args.tokens or [16, 32, 64, 128]
        return tune(args, dev)
    args.tokens = args.tokens or [64, 256, 2048]
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
