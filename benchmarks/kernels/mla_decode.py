"""The MLA decode kernel (``ops/mla_decode.py``) on its own: one layer's absorbed-MLA decode
step at DeepSeek's widths (Lr 512, R 64, bf16) over a paged latent cache, for each batch, head
count and context.

Each point is timed as CUDA-graph replays (a step's kernels run from a graph in the engine)
with CUDA events, and reported as the cache bytes read per second, that as a fraction of the
copy bandwidth measured in the same run (``benchmarks.roofline.copy_bandwidth``), and the
bytes read against a dense cache's for the same context (2 × heads × 128 values a token: at
16 heads, DeepSeek-V2-Lite's dense equivalent). ``--sweep`` times launch configurations
too, and ``--splits`` the default launch at other split counts (the rule is
``ops.mla_decode.num_splits``).

    python benchmarks/kernels/mla_decode.py --out mla.json
    python benchmarks/kernels/mla_decode.py --batches 1 --heads 128 --sweep --out sweep.json
    python benchmarks/kernels/mla_decode.py --smoke          # tiny, on CPU (the interpreter)
"""

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if not torch.cuda.is_available():  # before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

from benchmarks.roofline import copy_bandwidth
from services.worker.engine.ops.mla_decode import (
    MLALaunch,
    default_launch,
    mla_decode,
    mla_decode_reference,
)

DENSE_HEAD_DIM = 128
# (q_lat, q_pe, cache view, block tables, seq_lens)
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (heads a program, tokens a tile, warps, stages): those that compile for sm_90 without
# spills at Lr 512, bf16 (benchmarks/kernels/kernel_sass.py's way); 64 heads: wgmma
SWEEP = [
    MLALaunch(block_h=h, block_n=n, num_warps=w, num_stages=s)
    for h, n, w, s in [(16, 16, 4, 2), (16, 32, 4, 2), (16, 32, 4, 3), (16, 16, 8, 2),
                       (16, 32, 8, 2), (32, 32, 8, 2), (64, 16, 8, 2), (64, 32, 8, 2),
                       (64, 32, 8, 3)]
]  # fmt: skip


def make_case(
    batch: int, heads: int, ctx: int, args: argparse.Namespace, device: torch.device
) -> Case:
    """(q_lat, q_pe, cache, block tables, seq_lens): one layer's view of a ``--layers``-layer
    latent cache holding ``batch`` contexts of ``ctx`` tokens in shuffled blocks."""
    dtype, lr, r, layers = DTYPES[args.dtype], args.lr, args.r, args.layers
    per_req = -(-ctx // args.block_size)
    kv = torch.randn(batch * per_req, layers, 1, args.block_size, 1, lr + r, device=device)
    kv = kv.to(dtype)
    tables = torch.randperm(batch * per_req, device=device).to(torch.int32).view(batch, per_req)
    q_lat = torch.randn(batch, heads, lr, device=device).to(dtype)
    q_pe = torch.randn(batch, heads, r, device=device).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q_lat, q_pe, kv[:, layers // 2, 0], tables, lens


def call_seconds(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call: ``reps`` calls captured in one CUDA graph, the best of 5 replays (on
    CPU, the interpreter's: the best of ``reps`` calls by the host clock)."""
    if not torch.cuda.is_available():
        return min(_host_seconds(fn) for _ in range(reps))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return min(times)


def _host_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, batch: int, heads: int, ctx: int, copy_bw: float,
            launches: list[MLALaunch | None]) -> list[dict[str, Any]]:  # fmt: skip
    """One row per launch (those that fit the GPU) at one point."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = make_case(batch, heads, ctx, args, device)
    scale = 192**-0.5
    want = mla_decode_reference(*case, scale).float()
    cache_bytes = batch * ctx * (args.lr + args.r) * case[2].element_size()
    dense_bytes = batch * ctx * 2 * heads * DENSE_HEAD_DIM * case[2].element_size()
    default = default_launch(case[0], case[2])
    splits = [dataclasses.replace(default, splits=n) for n in args.splits]
    rows = []
    for launch in [*launches, *splits]:
        out = torch.empty_like(case[0])
        call = functools.partial(mla_decode, *case, scale, out=out, max_seq_len=ctx,
                                 launch=launch)  # fmt: skip
        try:
            call()
        except triton.runtime.errors.OutOfResources:
            continue
        error = (out.float() - want).abs().max().item()
        seconds = call_seconds(call, args.reps)
        rows.append({
            "batch": batch, "heads": heads, "context": ctx,
            "launch": dataclasses.asdict(launch) if launch else "default",
            "us": seconds * 1e6, "max_abs_error": error,
            "cache_bytes": cache_bytes, "GB_per_s": cache_bytes / seconds / 1e9,
            "fraction_of_copy_bw": cache_bytes / seconds / copy_bw,
            "dense_bytes": dense_bytes, "bytes_vs_dense": cache_bytes / dense_bytes,
        })  # fmt: skip
        r = rows[-1]
        print(f"B={batch:3d} H={heads:3d} ctx={ctx:6d} {r['launch']}: {r['us']:8.1f} us "
              f"{r['GB_per_s']:7.1f} GB/s ({r['fraction_of_copy_bw']:.2f} of copy) "
              f"err {error:.3g}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    p.add_argument("--lr", type=int, default=512)
    p.add_argument("--r", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)  # the cache's stride between blocks
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="time SWEEP's launches as well")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="time the default launch at these split counts as well")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny, on CPU: the script runs")
    p.add_argument("--out")
    args = p.parse_args()
    if args.smoke:
        args.batches, args.heads, args.contexts, args.reps = [1, 2], [2], [40], 2
        args.lr, args.r, args.dtype = 32, 16, "fp32"  # the interpreter has no bf16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    copy_bw = copy_bandwidth(device, nbytes=1 << 20 if args.smoke else None)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    launches: list[MLALaunch | None] = [None, *(SWEEP if args.sweep else [])]
    rows = []
    for heads in args.heads:
        for batch in args.batches:
            for ctx in args.contexts:
                rows += measure(args, batch, heads, ctx, copy_bw, launches)
    if args.smoke:
        assert all(r["max_abs_error"] < 2e-2 for r in rows), rows
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "copy_bandwidth": copy_bw, "rows": rows}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
