"""One-token linear layers (batch-1 decode) on a GPU: cuBLAS, cuBLASLt and the engine's Triton
GEMV (ops/gemv.py) per projection shape, as achieved weight-read bandwidth next to
the copy bandwidth measured in the same run.

Each timing replays a CUDA graph of back-to-back calls (as a decode step does, no launch gaps)
cycling through enough weight copies that none is read from L2 twice.

    python benchmarks/kernels/gemv.py --shape llama-3.1-8b --output gemv.json

``--tune DIR``: each GEMV kernel's configurations timed that way per projection of each
``--shapes``, the fastest written into ``DIR/<GPU name>.json``, merged over that file's kept
entries (``services/worker/engine/ops/configs/linear/`` keeps them; the kernels read
that launch instead of their autotuner's: ``ops/gemv_configs.py``).

    python benchmarks/kernels/gemv.py --tune services/worker/engine/ops/configs/linear/

``--fp8``: the FP8 GEMV (ops/fp8_linear.py: e4m3 weights with a scale per row, the
activation quantized per token inside the kernel) beside the bf16 Triton GEMV, each against
its own weight bytes over the copy bandwidth.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.roofline import copy_bandwidth, matmul_peak
from benchmarks.shapes import SHAPES
from services.worker.engine.ops.gemv import gemv


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of one decoder layer, tensor-parallel size 1."""
    h, d = shape["hidden_size"], shape["head_dim"]
    q, kv, inter = (
        shape["num_attention_heads"] * d,
        shape["num_key_value_heads"] * d,
        shape["intermediate_size"],
    )
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def time_calls(fn, weights: list[torch.Tensor], x: torch.Tensor, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call: a graph of ``len(weights)`` calls, replayed ``reps`` times."""
    for w in weights:  # warm-up (and the Triton autotune) outside the capture
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / len(weights))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        help="instead: cuBLAS at these row counts (a decode step's batch) against the roofline "
        "max(weight bytes ÷ bandwidth, FLOPs ÷ matmul peak)",
    )
    p.add_argument("--fp8", action="store_true", help="instead: the FP8 GEMV against the bf16")
    p.add_argument("--tune", metavar="DIR", help="instead: measure both GEMVs' launches")
    p.add_argument("--shapes", nargs="+", default=None, help="--tune: default --shape")
    p.add_argument(
        "--kinds", nargs="+", help="--tune: these kernels only (the others' kept launches stay)"
    )
    p.add_argument("--output")
    args = p.parse_args()
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    if args.tokens:
        return batched(args, dev, bandwidth)
    if args.fp8:
        return fp8(args, dev, bandwidth)
    if args.tune:
        return tune(args, dev)
    result: dict[str, Any] = {"shape": args.shape, "copy_bandwidth_tbs": bandwidth / 1e12,
                              "device": torch.cuda.get_device_name(), "layers": {}}  # fmt: skip
    backends = {
        "cublas": ("cublas", lambda x, w: F.linear(x, w)),
        "cublaslt": ("cublaslt", lambda x, w: F.linear(x, w)),
        "triton_gemv": ("cublas", lambda x, w: gemv(x, w)),
    }
    for name, (n, k) in projections(SHAPES[args.shape]).items():
        nbytes = n * k * 2
        copies = max(2, -(-(512 << 20) // nbytes))  # ≥ 512 MiB in all: nothing stays in L2
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, weights[0])
        row: dict[str, Any] = {"n": n, "k": k, "mbytes": nbytes / 1e6}
        for backend, (library, fn) in backends.items():
            torch.backends.cuda.preferred_blas_library(library)
            torch.testing.assert_close(fn(x, weights[0]), ref, atol=2e-2, rtol=2e-2)
            seconds = time_calls(fn, weights, x, args.reps)
            row[backend] = {"us": seconds * 1e6, "tbs": nbytes / seconds / 1e12,
                            "of_copy": nbytes / seconds / bandwidth}  # fmt: skip
        torch.backends.cuda.preferred_blas_library("cublas")
        result["layers"][name] = row
        del weights
        torch.cuda.empty_cache()
        print(f"{name:8s} {n:6d}x{k:<6d} " + "  ".join(
            f"{b} {row[b]['us']:7.1f} us {row[b]['tbs']:.2f} TB/s ({100 * row[b]['of_copy']:.0f} %)"
            for b in backends
        ), flush=True)  # fmt: skip
    layers = SHAPES[args.shape]["num_hidden_layers"]
    for backend in backends:
        per_layer = sum(r[backend]["us"] for r in result["layers"].values())
        result[f"{backend}_us_per_step"] = per_layer * layers
    print(json.dumps({k: v for k, v in result.items() if k != "layers"}, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


def fp8(args: argparse.Namespace, dev: torch.device, bandwidth: float) -> None:
    """Per projection: the FP8 GEMV and the bf16 Triton GEMV, µs and the fraction of each one's
    weight-read bound (N·K bytes, or 2·N·K, over the copy bandwidth)."""
    from services.worker.engine.ops.fp8_linear import fp8_gemv
    from services.worker.engine.quantization.fp8_math import quantize_rows

    layers = SHAPES[args.shape]["num_hidden_layers"]
    result: dict[str, Any] = {"shape": args.shape, "copy_bandwidth_tbs": bandwidth / 1e12,
                              "device": torch.cuda.get_device_name(), "layers": {}}  # fmt: skip
    for name, (n, k) in projections(SHAPES[args.shape]).items():
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        row: dict[str, Any] = {"n": n, "k": k}
        for label, nbytes in (("fp8_gemv", n * k), ("bf16_gemv", 2 * n * k)):
            copies = max(2, -(-(512 << 20) // nbytes))  # ≥ 512 MiB in all: nothing stays in L2
            if label == "fp8_gemv":
                pairs = [quantize_rows(torch.randn(n, k, device=dev) * 0.05) for _ in range(copies)]
                seconds = time_calls(lambda x, p: fp8_gemv(x, *p), pairs, x, args.reps)  # type: ignore[arg-type]
            else:
                ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
                seconds = time_calls(lambda x, w: gemv(x, w), ws, x, args.reps)
            bound = nbytes / bandwidth
            row[label] = {"us": round(seconds * 1e6, 2), "bound_us": round(bound * 1e6, 2),
                          "of_bound": round(bound / seconds, 3)}  # fmt: skip
            torch.cuda.empty_cache()
        result["layers"][name] = row
        print(f"{name:8s} {n:6d}x{k:<6d} " + "  ".join(
            f"{b} {row[b]['us']:7.2f} us ({100 * row[b]['of_bound']:.0f} % of {row[b]['bound_us']})"
            for b in ("fp8_gemv", "bf16_gemv")
        ), flush=True)  # fmt: skip
    for label in ("fp8_gemv", "bf16_gemv"):
        result[f"{label}_us_per_step"] = round(
            sum(r[label]["us"] for r in result["layers"].values()) * layers, 1
        )
    print(json.dumps({k: v for k, v in result.items() if k != "layers"}, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


def tune(args: argparse.Namespace, dev: torch.device) -> None:
    """Per kind (bf16 ``gemv``, ``fp8_gemv``, ``fp8_gemv_codes``: its activation quantized by
    the kernel before, ``fp8_gemv_codes_fast``: and its products summed in float16, as with
    fast accumulation) and projection: every configuration of the
    kernel's autotune list, timed in a CUDA graph of back-to-back calls over weights from HBM;
    the fastest kept (the whole table under ``measured``)."""
    from services.worker.engine.ops import fp8_linear, gemv_configs, tuned_configs
    from services.worker.engine.ops import gemv as gemv_module
    from services.worker.engine.quantization.fp8_math import quantize_rows

    gpu = torch.cuda.get_device_name(dev)
    kept = tuned_configs.read(Path(args.tune), gpu)  # DIR's file of this GPU, as moe_layer.py's
    doc: dict[str, Any] = {kind: dict(kept.get(kind, {})) for kind in gemv_configs.KINDS}
    if gemv_configs.GEMM in kept:  # fp8_mm.py --tune's section, kept as it is
        doc[gemv_configs.GEMM] = kept[gemv_configs.GEMM]
    measured: dict[str, Any] = {"gpu": gpu, "us": dict(kept.get("measured", {}).get("us", {}))}
    from services.worker.engine.quantization.fp8_math import Codes

    kernels = {"gemv": gemv_module._CONFIGS, "fp8_gemv": fp8_linear._CONFIGS,
               "fp8_gemv_codes": fp8_linear._CONFIGS,
               "fp8_gemv_codes_fast": fp8_linear._CONFIGS}  # fmt: skip
    shapes = {nk for s in (args.shapes or [args.shape]) for nk in projections(SHAPES[s]).values()}
    for n, k in sorted(shapes):
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        codes = Codes(*fp8_linear.quantize_rows(x), x.dtype)  # as RMSNorm / SiLU·mul hand over
        for kind, configs in kernels.items():
            if args.kinds and kind not in args.kinds:
                continue
            nbytes = n * k * (2 if kind == "gemv" else 1)
            copies = max(2, -(-(512 << 20) // nbytes))  # ≥ 512 MiB in all: nothing stays in L2
            if kind != "gemv":
                weights: list[Any] = [
                    quantize_rows(torch.randn(n, k, device=dev) * 0.05) for _ in range(copies)
                ]
            else:
                weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                           for _ in range(copies)]  # fmt: skip
            times = {}
            for c in configs:
                entry = {"block_n": c.kwargs["BLOCK_N"], "block_k": c.kwargs["BLOCK_K"],
                         "warps": c.num_warps, "stages": c.num_stages}  # fmt: skip
                launch = gemv_configs.as_keywords(entry)

                def call(
                    x: torch.Tensor,
                    w: Any,
                    launch: dict[str, int] = launch,
                    kind: str = kind,
                    codes: Codes = codes,
                ) -> Any:
                    if kind == "fp8_gemv":
                        return fp8_linear.fp8_gemv(x, *w, config=launch)
                    if kind.startswith("fp8_gemv_codes"):
                        fast = kind.endswith("_fast")
                        return fp8_linear.fp8_gemv(codes, *w, config=launch, fast_accumulation=fast)
                    return gemv_module.gemv(x, w, config=launch)

                times["-".join(map(str, entry.values()))] = (
                    time_calls(call, weights, x, args.reps),
                    entry,
                )
            best = min(times, key=lambda c: times[c][0])
            doc[kind][f"{n}x{k}"] = times[best][1]
            us = {c: round(t * 1e6, 2) for c, (t, _) in times.items()}
            measured["us"][f"{kind} {n}x{k}"] = us
            print(f"{kind:9s} {n:6d}x{k:<6d} best {best} {times[best][0] * 1e6:.2f} us", flush=True)
            del weights
            torch.cuda.empty_cache()
    doc["measured"] = measured
    gemv_configs.parse(doc)  # what the kernels will read
    print("wrote", tuned_configs.write(Path(args.tune), gpu, doc))


def batched(args: argparse.Namespace, dev: torch.device, bandwidth: float) -> None:
    """cuBLAS per projection at M rows: how far from the machine's limit a decode step's GEMMs
    run as the batch grows from memory-bound to compute-bound."""
    peak = matmul_peak(dev, torch.bfloat16)
    layers = SHAPES[args.shape]["num_hidden_layers"]
    result: dict[str, Any] = {"shape": args.shape, "copy_bandwidth_tbs": bandwidth / 1e12,
                              "matmul_peak_tflops": peak / 1e12, "rows": {}}  # fmt: skip
    for m in args.tokens:
        row: dict[str, Any] = {}
        for name, (n, k) in projections(SHAPES[args.shape]).items():
            nbytes = n * k * 2
            copies = max(2, -(-(512 << 20) // nbytes))
            weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            seconds = time_calls(lambda x, w: F.linear(x, w), weights, x, args.reps)
            bound = max((nbytes + 2 * m * (n + k)) / bandwidth, 2 * m * n * k / peak)
            row[name] = {"us": round(seconds * 1e6, 2), "bound_us": round(bound * 1e6, 2),
                         "of_roofline": round(bound / seconds, 3)}  # fmt: skip
            del weights
        us = sum(r["us"] for r in row.values())
        bound_us = sum(r["bound_us"] for r in row.values())
        row["per_step_us"] = round(us * layers, 1)
        row["per_step_bound_us"] = round(bound_us * layers, 1)
        result["rows"][m] = row
        each = "  ".join(
            f"{k} {v['us']:.1f}/{v['bound_us']:.1f} us" for k, v in row.items()
            if isinstance(v, dict)
        )  # fmt: skip
        print(f"M={m:4d} {each}  per step {us * layers:.0f} us, bound {bound_us * layers:.0f} us")
    torch.cuda.empty_cache()
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
