"""A mixture-of-experts layer's experts alone on a GPU: the fused Triton kernels
(``ops/fused_moe.fused_moe``) against the same computation with one GEMM per expert
(``fused_moe_reference``, the loop a layer without the kernels runs), at each token count of
``--tokens``, bf16 and FP8 with 128 × 128 weight blocks, at Qwen3-30B-A3B's expert shape. Up
to twice ``GEMV_TOKENS`` tokens both of its paths as well (``gemv_ms``, ``grouped_ms``): the
two GEMV launches and the grouped GEMMs.

Each call is timed by CUDA events with the L2 cleared before it (a step reads the weights from
HBM: one token's 8 FP8 experts would fit in the L2), over ``--routings`` different random
routings in turn; the median of ``--reps``. At one token the achieved bandwidth: the bytes of
the k chosen experts' weights (and scales) over the time, and that as a fraction of the copy
bandwidth measured in the same run (``roofline.copy_bandwidth``).

    python benchmarks/moe_layer.py --out moe_layer.json

``--sweep``: instead, every launch of ``SWEEP`` at each token count and format, the fastest
named beside the table's (what ``fused_moe``'s tables should keep). ``--smoke``: tiny shapes,
a few reps, on CPU in Triton's interpreter where there is no GPU (a check that it runs, not a
timing).

``--tune DIR``: instead, the two GEMVs of one token (``ops/moe_gemv.py``) in each format:
every launch of ``sweep_of`` (``UP_SWEEP`` / ``DOWN_SWEEP`` and the autotuner's own) for GEMV
1, then for GEMV 2 (the other at its best so far, else the engine's), and the engine's own
pair (its table's, else its autotuner's), timed as a decode step runs them: a CUDA graph of
``--routings`` calls back to back, each routing to other experts, so the weights come from
HBM (the autotuner times one call on weights its repeats leave in the L2). A GEMV's fastest
launch is written into ``DIR/<GPU name>.json`` over that file's kept entries where it beats
the engine's pair by ``--margin`` (``ops/gemv_configs.py``'s ``moe_*`` kinds, keyed by one
expert's weight shape: ``--tp N`` measures one rank's slice; the µs of every launch and the
engine's under ``measured``).

    python benchmarks/moe_layer.py --tune services/worker/engine/ops/configs/linear/ \
        --formats bf16 fp8 fp8-block
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # read when Triton's kernels are defined: before the imports
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kernels.gemv import time_calls
from benchmarks.roofline import copy_bandwidth
from benchmarks.shapes import SHAPES
from services.worker.engine.ops import moe_gemv as moe_gemv_module
from services.worker.engine.ops.fused_moe import (
    GEMV_TOKENS,
    MoELaunch,
    fused_moe,
    fused_moe_reference,
    launch_for,
)
from services.worker.engine.ops.moe_gemv import k_tiles_fit, moe_gemv
from services.worker.engine.quantization.fp8_math import quantize_blocks, quantize_rows

SMOKE = {"num_experts": 4, "num_experts_per_tok": 2, "hidden_size": 64, "moe_intermediate_size": 64}
BLOCK = 128  # FP8 block checkpoints' blocks
SWEEP = [  # (weight rows a program: GEMM 1's half gate, half up; FP8 blocks: K tiles of 128)
    MoELaunch(m, n, kk, w, s)
    for m, n, kk, w, s in [
        (16, 32, 128, 4, 4), (16, 64, 64, 4, 5), (16, 64, 128, 4, 3), (16, 128, 128, 4, 2),
        (16, 128, 128, 4, 3), (16, 256, 128, 8, 2), (32, 128, 128, 4, 3), (32, 256, 128, 4, 2),
        (64, 128, 64, 4, 3), (64, 128, 128, 4, 4), (64, 256, 128, 8, 3), (128, 128, 64, 4, 4),
        (128, 256, 64, 8, 4),
    ]
]  # fmt: skip
FORMATS = ["bf16", "fp8", "fp8-block"]  # fp8: a scale per output channel, as FP8 at load
# --tune's launches of GEMV 1 and GEMV 2: (BLOCK_N, BLOCK_K, warps, stages); a format in
# blocks takes those whose K tiles divide its block. GEMV 1 holds two [BLOCK_N, BLOCK_K] sums
# (gate, up), GEMV 2 one [SLOTS, BLOCK_N, BLOCK_K] tile a K step: kept within ~64 float32
# registers a thread
UP_SWEEP = [
    (1, 512, 2, 1), (1, 1024, 4, 1), (1, 2048, 4, 1), (1, 2048, 8, 1), (2, 128, 2, 3),
    (2, 256, 2, 3), (2, 512, 4, 1), (2, 512, 4, 3), (2, 1024, 4, 1), (2, 1024, 8, 1),
    (2, 2048, 8, 1), (4, 128, 2, 3), (4, 128, 4, 3), (4, 256, 4, 1), (4, 256, 4, 3),
    (4, 512, 4, 1), (4, 512, 8, 3), (4, 1024, 8, 1), (8, 64, 4, 3), (8, 128, 2, 3),
    (8, 128, 4, 1), (8, 128, 4, 3), (8, 256, 4, 3), (8, 256, 8, 1), (8, 512, 8, 3),
    (16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 8, 1), (16, 256, 8, 3), (32, 128, 4, 3),
    (32, 128, 8, 3), (64, 128, 8, 3),
]  # fmt: skip
DOWN_SWEEP = [
    (1, 128, 4, 1), (1, 256, 4, 1), (1, 256, 8, 3), (2, 64, 2, 3), (2, 128, 4, 1),
    (2, 128, 4, 3), (2, 256, 8, 1), (4, 32, 2, 3), (4, 64, 4, 1), (4, 64, 4, 3),
    (4, 128, 8, 1), (4, 128, 8, 3), (8, 32, 4, 3), (8, 64, 8, 1), (8, 64, 8, 3),
    (16, 32, 8, 3), (16, 64, 8, 3),
]  # fmt: skip


def sweep_of(stage: str) -> list[tuple[int, int, int, int]]:
    """``stage``'s launches to time: the sweep's and the autotuner's own (so a table entry is
    never chosen from fewer than the autotuner chooses from)."""
    mine = UP_SWEEP if stage == "up" else DOWN_SWEEP
    configs = (
        moe_gemv_module._GEMV_UP_CONFIGS if stage == "up" else moe_gemv_module._GEMV_DOWN_CONFIGS
    )
    tuners = [
        (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in configs
    ]
    return sorted(set(mine) | set(tuners))


def model_dtype(dev: torch.device) -> torch.dtype:
    """bf16 (the interpreter's ``tl.dot`` takes no bf16: float32 there)."""
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def experts(shape: dict[str, int], fmt: str, dev: torch.device) -> dict[str, Any]:
    """Random experts of ``shape`` ([E, 2I, H] and [E, H, I]) in format ``fmt`` (FORMATS):
    bf16, or e4m3 with a scale per row or per block."""
    e, h, i = shape["num_experts"], shape["hidden_size"], shape["moe_intermediate_size"]
    dtype = model_dtype(dev)
    w13 = (torch.randn(e, 2 * i, h, device=dev) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=dev) * i**-0.5).to(dtype)
    if fmt == "bf16":
        return {"w13": w13, "w2": w2}
    block = min(BLOCK, h, i) if fmt == "fp8-block" else None
    out: dict[str, Any] = {"block": block} if block else {}
    for name, w in (("w13", w13), ("w2", w2)):
        parts = [quantize_blocks(we, block) if block else quantize_rows(we) for we in w]
        out[name] = torch.stack([q for q, _ in parts])
        out[f"{name}_scale"] = torch.stack([s for _, s in parts])
    return out


def chosen_bytes(w: dict[str, Any], k: int) -> int:
    """The bytes of k experts' weights and scales: what one token must read."""
    return k * sum(t[0].numel() * t.element_size() for t in w.values() if torch.is_tensor(t))


class Inputs:
    """Static tokens and routing, and ``routings`` random routings (softmax, top k) that
    ``use`` copies into them in turn: what a captured graph reads."""

    def __init__(self, shape: dict[str, int], t: int, routings: int, dev: torch.device) -> None:
        self.x = torch.randn(t, shape["hidden_size"], device=dev).to(model_dtype(dev))
        self.routes = []
        for _ in range(routings):
            logits = torch.randn(t, shape["num_experts"], device=dev)
            weights, ids = logits.softmax(-1).topk(shape["num_experts_per_tok"], -1)
            self.routes.append((weights, ids.int()))
        self.weights, self.ids = (v.clone() for v in self.routes[0])

    def use(self, r: int) -> None:
        weights, ids = self.routes[r % len(self.routes)]
        self.weights.copy_(weights)
        self.ids.copy_(ids)


def time_ms(run: Callable[[], object], inputs: Inputs, reps: int, graph: bool) -> float:
    """Median ms of ``run()`` over ``reps`` calls, the routings in turn, the L2 cleared before
    each (CUDA events; with ``graph`` the call captured once and replayed: the kernels' time
    without their launches' host overhead, as the engine's decode steps run them); on CPU a
    host clock."""
    dev = inputs.x.device
    run()  # compiles
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            run()
        run = captured.replay
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev) if dev.type == "cuda" else None
    times = []
    for r in range(reps):
        inputs.use(r)
        if flush is None:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def case(shape: dict[str, int], fmt: str, t: int, args: argparse.Namespace,
         dev: torch.device, w: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One token count in one format: the fused kernels' medians (in a CUDA graph, and
    launched from Python) and the per-expert loop's."""
    inp = Inputs(shape, t, args.routings, dev)
    out = torch.empty_like(inp.x)
    extra = {n: v for n, v in w.items() if n not in ("w13", "w2")}  # scales, block
    fused = lambda: fused_moe(inp.x, w["w13"], w["w2"], inp.weights, inp.ids, out=out, **extra)  # noqa: E731
    loop = lambda: fused_moe_reference(inp.x, w["w13"], w["w2"], inp.weights, inp.ids, **extra)  # noqa: E731
    cuda = dev.type == "cuda"
    fused_ms = time_ms(fused, inp, args.reps, graph=cuda)
    eager_ms = time_ms(fused, inp, args.reps, graph=False)
    loop_ms = time_ms(loop, inp, max(3, args.reps // 10), graph=False)
    row: dict[str, Any] = {"tokens": t, "format": fmt, "fused_ms": round(fused_ms, 4),
                           "fused_eager_ms": round(eager_ms, 4),
                           "per_expert_loop_ms": round(loop_ms, 4),
                           "speedup": round(loop_ms / fused_ms, 2)}  # fmt: skip
    if t <= 2 * GEMV_TOKENS:  # both paths side by side: where GEMV_TOKENS should lie
        for name, gemv in (("gemv_ms", True), ("grouped_ms", False)):
            fn = lambda g=gemv: fused_moe(inp.x, w["w13"], w["w2"], inp.weights, inp.ids,  # noqa: E731
                                          out=out, gemv=g, **extra)  # fmt: skip
            row[name] = round(time_ms(fn, inp, args.reps, graph=cuda), 4)
    if t == 1:
        nbytes = chosen_bytes(w, shape["num_experts_per_tok"])
        row["chosen_expert_bytes"] = nbytes
        row["achieved_GBps"] = round(nbytes / fused_ms / 1e6, 1)
    return row


def sweep(shape: dict[str, int], fmt: str, t: int, args: argparse.Namespace,
          dev: torch.device, w: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Every launch of SWEEP at one token count (in a CUDA graph): each one's median, the
    fastest named, beside the table's."""
    inp = Inputs(shape, t, args.routings, dev)
    extra = {n: v for n, v in w.items() if n not in ("w13", "w2")}
    times = {}
    for c in SWEEP:
        if "block" in extra and c.block_k != extra["block"]:
            continue
        fn = lambda: fused_moe(inp.x, w["w13"], w["w2"], inp.weights, inp.ids, config=c, **extra)  # noqa: E731,B023
        name = f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.num_warps}s{c.num_stages}"
        times[name] = round(time_ms(fn, inp, args.reps, graph=dev.type == "cuda"), 4)
    table = launch_for(t, w["w13"], extra.get("block"))
    return {"tokens": t, "format": fmt, "best": min(times, key=times.__getitem__),
            "table": f"{table.block_m}x{table.block_n}x{table.block_k}", "ms": times}  # fmt: skip


def graph_us(calls: list[Callable[[], object]], reps: int) -> float:
    """µs a call: ``calls`` captured back to back in one CUDA graph, the fastest of ``reps``
    replays (``kernels/gemv.py``'s timing, each call its own weights)."""
    return time_calls(lambda _, call: call(), calls, None, reps) * 1e6


def gemv_calls(
    x: torch.Tensor,
    w: dict[str, Any],
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    out: torch.Tensor,
    launches: tuple[dict[str, int] | None, dict[str, int] | None],
) -> list[Callable[[], object]]:
    """One ``moe_gemv`` call a routing of ``routes`` over experts ``w`` (``experts``'), at
    ``launches``."""
    scales = (w.get("w13_scale"), w.get("w2_scale"), w.get("block"))
    return [
        functools.partial(moe_gemv, x, w["w13"], w["w2"], weights, ids, None, *scales, out,
                          None, None, None, 1.702, launches=launches)
        for weights, ids in routes
    ]  # fmt: skip


def host_us(calls: list[Callable[[], object]]) -> float:
    """µs a call by the host's clock, each call once (the interpreter's: a check that every
    launch runs, not a timing)."""
    t0 = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - t0) * 1e6 / len(calls)


def tune(shape: dict[str, int], args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """--tune (the module docstring): each format's GEMV 1 then GEMV 2 launches against the
    engine's own (its table's, else its autotuner's); the fastest written over the kept table
    of this GPU in ``args.tune`` where it beats the engine's by ``args.margin``. Returns what
    was measured."""
    from services.worker.engine.ops import gemv_configs, tuned_configs

    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    kept = tuned_configs.read(Path(args.tune), gpu)
    doc: dict[str, Any] = {k: dict(v) for k, v in kept.items() if k != "measured"}
    measured: dict[str, Any] = {"gpu": gpu, "us": dict(kept.get("measured", {}).get("us", {}))}
    inputs = Inputs(shape, 1, args.routings, dev)  # a call each routing, its own experts
    x, routes, out = inputs.x, inputs.routes, torch.empty_like(inputs.x)
    timer = graph_us if dev.type == "cuda" else lambda calls, _: host_us(calls)
    for fmt in args.formats:
        w = experts(shape, fmt, dev)
        block = w.get("block")
        engine_us = timer(gemv_calls(x, w, routes, out, (None, None)), args.reps)
        best: dict[str, dict[str, int] | None] = {"up": None, "down": None}
        for stage in ("up", "down"):
            weight = w["w13"] if stage == "up" else w["w2"]
            kind = gemv_configs.moe_kind(stage, fmt != "bf16", block)
            shape_key = f"{weight.shape[1]}x{weight.shape[2]}"
            fits = [c for c in sweep_of(stage) if k_tiles_fit(c[1], block)]
            if args.smoke:  # the interpreter: the two widest (fewest programs)
                fits = sorted(fits, key=lambda c: -c[0])[:2]
            times: dict[str, tuple[float, dict[str, int]]] = {}
            for bn, bk, warps, stages in fits:
                entry = {"block_n": bn, "block_k": bk, "warps": warps, "stages": stages}
                launch = gemv_configs.as_keywords(entry)
                pair = (launch, best["down"]) if stage == "up" else (best["up"], launch)
                times["-".join(map(str, entry.values()))] = (
                    timer(gemv_calls(x, w, routes, out, pair), args.reps), entry
                )  # fmt: skip
            name = min(times, key=lambda n: times[n][0])
            won = times[name][0] < engine_us * (1 - args.margin)
            if won:
                doc.setdefault(kind, {})[shape_key] = times[name][1]
                best[stage] = gemv_configs.as_keywords(times[name][1])
            measured["us"][f"{kind} {shape_key}"] = {
                "engine": round(engine_us, 2), **{n: round(t, 2) for n, (t, _) in times.items()}
            }  # fmt: skip
            print(f"{kind:18s} {shape_key:10s} best {name} {times[name][0]:.2f} us a call "
                  f"(of {len(times)}), the engine's {engine_us:.2f}: "
                  f"{'kept' if won else 'not kept'}", flush=True)  # fmt: skip
        del w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    doc["measured"] = measured
    gemv_configs.parse(doc)  # what the kernels will read
    gemv_configs.parse_gemm(doc)
    print("wrote", tuned_configs.write(Path(args.tune), gpu, doc))
    return measured


def expert_shape(name: str) -> dict[str, int]:
    """A model's expert dims (``benchmarks/shapes.py``; DeepSeek's config names its experts
    ``n_routed_experts``), under SMOKE's names."""
    config = SHAPES[name]
    dims = {n: config.get(n, config.get("n_routed_experts")) for n in SMOKE}
    assert all(isinstance(v, int) for v in dims.values()), dims
    return dims  # type: ignore[return-value]


MOE_SHAPES = [n for n in SHAPES if "moe_intermediate_size" in SHAPES[n]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=MOE_SHAPES)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 64, 512, 4096])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8-block"], choices=FORMATS)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--routings", type=int, default=8, help="different routings, in turn")
    p.add_argument("--sweep", action="store_true", help="time every launch of SWEEP instead")
    p.add_argument("--tune", metavar="DIR", help="instead: measure the one-token GEMVs' launches")
    p.add_argument(
        "--margin",
        type=float,
        default=0.02,
        help="--tune: keep a launch only this much faster than the engine's",
    )
    p.add_argument("--tp", type=int, default=1,
                   help="the experts' slice of one of this many tensor-parallel ranks")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few reps (CPU too)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.smoke:
        p.error("no GPU: only --smoke runs on CPU")
    shape = SMOKE if args.smoke else expert_shape(args.shape)
    shape = {**shape, "moe_intermediate_size": shape["moe_intermediate_size"] // args.tp}
    if args.smoke:
        args.tokens, args.reps, args.routings = [t for t in args.tokens if t <= 64], 3, 2
    if args.tune:
        tune(shape, args, dev)
        return
    rows = []
    for fmt in args.formats:
        w = experts(shape, fmt, dev)
        for t in args.tokens:
            rows.append((sweep if args.sweep else case)(shape, fmt, t, args, dev, w))
            print(json.dumps(rows[-1]), flush=True)
    result: dict[str, Any] = {"shape": "smoke" if args.smoke else args.shape, **shape,
                              "device": torch.cuda.get_device_name() if dev.type == "cuda"
                              else "cpu (Triton interpreter)", "rows": rows}  # fmt: skip
    if dev.type == "cuda" and not args.sweep:
        bandwidth = copy_bandwidth(dev)
        result["copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1)
        for row in rows:
            if "achieved_GBps" in row:
                row["fraction_of_copy_bandwidth"] = round(row["achieved_GBps"] * 1e9 / bandwidth, 3)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
