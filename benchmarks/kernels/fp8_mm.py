"""The linear layers' batched products on a GPU, bf16 against FP8 (``fp8_linear.fp8_mm``: e4m3
codes of the rows with a scale per row, e4m3 weights with a scale per output channel, on the FP8
tensor cores) with and without fast accumulation (the partial sums not promoted to float32).

At row counts where the GPU's table gives our own FP8 GEMM (``fp8_linear.fp8_gemm``), "fp8"
is that kernel, as in the engine; ``--tune`` below sets it against cuBLASLt by name.

For each projection of one decoder layer of ``--shape`` and each row count of ``--tokens``:
the median time of each (``triton.testing.do_bench``, which clears the L2 before each call)
as TFLOP/s, and each FP8 product's error against float64 over the same codes and scales:
the largest absolute error over the largest absolute output, and the mean relative error.

    python benchmarks/kernels/fp8_mm.py --shape llama-3.1-8b --tokens 64 256 2048 \
        --output fp8_mm.json

``--tune DIR``: instead, at each row count of ``--tokens`` (decode batches), our own FP8 GEMM
(``fp8_linear.fp8_gemm``) at each launch of ``GEMM_LAUNCHES`` against cuBLASLt (fast
accumulation, the engine's default), each timed as a decode step runs them: a CUDA graph of
back-to-back calls over weights read from HBM. Where the fastest launch beats cuBLASLt by
``--margin``, it goes into the GPU's table in DIR (``fp8_gemm``, read by
``gemv_configs.gemm_launch``), replacing that section and keeping the rest of the file; every
time and each kept launch's error against float64 go to ``--output``.

    python benchmarks/kernels/fp8_mm.py --tune services/worker/engine/ops/configs/linear/ \
        --output fp8_gemm_tune.json

``--block``: instead, block checkpoints' products (128 × 128 weight blocks, activations per
token and 128 columns: ``fp8_block.fp8_block_mm``) at each row count of ``--tokens``, timed
as ``--tune`` times them, beside bf16 (``F.linear``) and the per-channel FP8 path the engine
takes at that row count (the GEMV over codes for one row, ``fp8_mm`` above): the engine's
block path over the rows' codes (cuBLASLt's block scaling from 16 rows), our kernel at its
default launch (``block_launch``, with the group quantization), and up to
``--block-sweep-rows`` rows every launch of ``BLOCK_LAUNCHES`` over the same codes, the
fastest named; the engine path's error against float64.

    python benchmarks/kernels/fp8_mm.py --block --tokens 1 16 64 128 256 2048 --output block.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.gemv import projections
from benchmarks.roofline import fp8_matmul_peak
from benchmarks.shapes import SHAPES
from services.worker.engine.ops.fp8_linear import fp8_mm, quantize_rows
from services.worker.engine.quantization import fp8_math
from services.worker.engine.quantization.fp8_math import Codes


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
    wq, ws = fp8_math.quantize_rows(w)  # a scale per output channel
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
    from benchmarks.kernels.gemv import time_calls
    from services.worker.engine.ops import fp8_linear, gemv_configs, tuned_configs

    gpu = torch.cuda.get_device_name(dev)
    doc = dict(tuned_configs.read(Path(args.tune), gpu))
    table: dict[str, dict[str, dict[str, int]]] = {}
    rows: list[dict[str, Any]] = []
    for name, (n, k) in projections(SHAPES[args.shape]).items():
        copies = max(2, -(-(512 << 20) // (n * k)))  # ≥ 512 MiB in all: nothing stays in L2
        gen = torch.Generator(device=dev).manual_seed(n + k)
        weights = [
            fp8_math.quantize_rows(torch.randn(n, k, device=dev, generator=gen) * k**-0.5)
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
    print("wrote", tuned_configs.write(Path(args.tune), gpu, doc))
    if args.output:
        Path(args.output).write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))


# (BLOCK_N, BLOCK_M, warps, stages) of the block GEMM, each at every split of K in
# BLOCK_SPLITS (BLOCK_K is the group: 128); those of more rows than the count's power of two
# (at least 16) are skipped
BLOCK_LAUNCHES = [(64, 16, 4, 4), (64, 16, 4, 6), (128, 16, 4, 4), (64, 32, 4, 4),
                  (64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3),
                  (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3)]  # fmt: skip
BLOCK_SPLITS = (1, 2, 3, 4, 6, 8)


def block(args: argparse.Namespace, dev: torch.device) -> None:
    from benchmarks.kernels.gemv import time_calls
    from services.worker.engine.ops import fp8_block, fp8_linear
    from services.worker.engine.ops.gemv import gemv

    def engine_block(codes: Codes, w: Any) -> torch.Tensor:  # cuBLASLt's from 16 rows
        # over codes, as RMSNorm and SiLU·mul hand them over (since h200-2026-12-03c; before,
        # this timed the rows' quantization too). Fast accumulation, the engine's default for
        # FP8 models: the one-row GEMV's float16 word sums (until h200-2026-12-03b's last
        # call this ran its float32 sums)
        return fp8_block.fp8_block_mm(codes, w[0], w[1], None, 128, w[2], fast_accumulation=True)

    def our_block(x: torch.Tensor, w: Any) -> torch.Tensor:  # our kernel at any row count
        return fp8_block.fp8_block_mm(x, w[0], w[1], None, 128)

    gpu = torch.cuda.get_device_name(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows: list[dict[str, Any]] = []
    for name, (n, k) in projections(SHAPES[args.shape]).items():
        copies = max(2, -(-(512 << 20) // (n * k)))  # ≥ 512 MiB of FP8 weights: not in L2
        gen = torch.Generator(device=dev).manual_seed(n + k)
        cols = torch.arange(k, device=dev) // 128
        blocks, channels, floats = [], [], []
        for i in range(copies):
            w = torch.randn(n, k, device=dev, generator=gen) * k**-0.5
            wq, scale = fp8_math.quantize_blocks(w, 128)
            ws = scale.repeat_interleave(128, 0)  # as the layer keeps it: a row a weight row
            blocks.append((wq, ws, fp8_block.block_scales(ws, 128)))
            channels.append(fp8_math.quantize_rows(w))
            if i < max(2, copies // 2):  # bf16's copies: 2 bytes a weight
                floats.append(w.to(torch.bfloat16))
            del w
        for m in args.tokens:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            codes = fp8_block.quantize_groups(x, 128)
            rc = Codes(*quantize_rows(x), torch.bfloat16)
            # the engine's paths at this row count: the GEMVs for one row
            dense = gemv if m == 1 else F.linear
            channel = fp8_linear.fp8_gemv if m == 1 else fp8_mm
            t: dict[str, float] = {
                "bf16": time_calls(lambda x, w, f=dense: f(x, w), floats, x, args.reps),
                "channel": time_calls(
                    lambda x, w, rc=rc, f=channel: f(rc, w[0], w[1], fast_accumulation=True),
                    channels, x, args.reps),
                "block": time_calls(lambda x, w, c=codes: engine_block(c, w), blocks, x,
                                    args.reps),
                "block_ours": time_calls(our_block, blocks, x, args.reps),
            }  # fmt: skip
            launches: dict[str, float] = {}
            top = max(16, triton.next_power_of_2(m))
            for bn, bm, warps, stages in BLOCK_LAUNCHES if m <= args.block_sweep_rows else []:
                if bm > top or (m > 64 and bm < 64):
                    continue
                for splits in BLOCK_SPLITS:
                    if splits > k // 128:
                        continue
                    launch = {"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": 128, "SPLITS": splits,
                              "num_warps": warps, "num_stages": stages}  # fmt: skip

                    def run(x: torch.Tensor, w: Any, c: Codes = codes, lc: dict = launch) -> Any:
                        return fp8_linear.fp8_gemm(c, w[0], w[1], None, dict(lc), group=128)

                    try:
                        launches["-".join(map(str, launch.values()))] = time_calls(
                            run, blocks, x, args.reps
                        )
                    except Exception as e:  # shared memory, registers
                        print(f"  {name} M={m} {launch}: {type(e).__name__}", flush=True)
            best = min(launches, key=launches.__getitem__) if launches else None
            wq, ws, _ = blocks[0]
            exact = (codes.codes.double() * codes.scales.double()[:, cols]) @ (
                wq.double() * ws.double()[:, cols]
            ).t()
            y = fp8_block.fp8_block_mm(x, wq, ws, None, 128, blocks[0][2])
            default = fp8_block.block_launch(m, n, k, 128, sms)
            row = {
                "projection": name,
                "N": n,
                "K": k,
                "M": m,
                **{f"{key}_us": round(v * 1e6, 2) for key, v in t.items()},
                "default": "-".join(map(str, default.values())),
                "best": best,
                "best_us": round(launches[best] * 1e6, 2) if best else None,
                "block_over_channel": round(t["channel"] / t["block"], 3),
                "block_over_bf16": round(t["bf16"] / t["block"], 3),
                "block_error": errors(y, exact),
                "launches_us": {c: round(v * 1e6, 2) for c, v in sorted(launches.items())},
            }
            rows.append(row)  # fmt: skip
            print(f"{name:8s} M={m:4d} bf16 {row['bf16_us']:8.2f} channel {row['channel_us']:8.2f}"
                  f" block {row['block_us']:8.2f} ours {row['block_ours_us']:8.2f}"
                  f" ({row['default']}) best {row['best_us']} ({best})", flush=True)  # fmt: skip
        del blocks, channels, floats
        torch.cuda.empty_cache()
    layer: dict[int, dict[str, float]] = {}
    for m in args.tokens:
        sel = [r for r in rows if r["M"] == m]
        keys = ["bf16", "channel", "block", "block_ours"]
        keys += ["best"] if all(r["best_us"] is not None for r in sel) else []  # (swept)
        layer[m] = {key: round(sum(r[f"{key}_us"] for r in sel), 1) for key in keys}
    print(json.dumps(layer, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps({"gpu": gpu, "layer_us": layer, "rows": rows},
                                                indent=1))  # fmt: skip


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
    p.add_argument("--block", action="store_true", help="instead: block checkpoints (above)")
    p.add_argument("--block-sweep-rows", type=int, default=64,
                   help="--block: our kernel's launches swept up to this many rows")  # fmt: skip
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.block:
        args.tokens = args.tokens or [1, 16, 64, 128, 256, 2048]
        return block(args, dev)
    if args.tune:
        # (at 256 rows o and down measured 1.16x and 1.04x alone, but no engine step showed a
        # gain: docs/performance.md, "FP8": our own FP8 GEMM, the 256-row entries not kept)
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
