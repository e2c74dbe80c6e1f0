"""Per-token SiLU·mul codes at 1 and 16 rows of the 8B shape: num_warps swept (CUDA graph of
50 calls, best of five replays). As run in call 2, formatted for the linter."""

import torch

from services.worker.engine.dependent_launch import launch_options
from services.worker.engine.models.layers.fused_ops import _codes_out, _silu_mul, silu_and_mul


def timed(fn, reps=50):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


def launch(h, codes, rows, n, warps):
    _silu_mul[(rows, 1)](
        h, codes.codes, codes.scales, h.stride(0), codes.codes.stride(0), 0, n, BLOCK=16384,
        QUANT=True, GPU=True, num_warps=warps, **launch_options(h),
    )  # fmt: skip


n = 14336


def row_count(rows):
    h = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16)
    ref = silu_and_mul(h, n)
    out = {"plain": timed(lambda: silu_and_mul(h)), "g128": timed(lambda: silu_and_mul(h, 128))}
    for w in (4, 8, 16, 32):
        codes = _codes_out(rows, n, n, h)
        launch(h, codes, rows, n, w)
        same = torch.equal(codes.codes.view(torch.uint8), ref.codes.view(torch.uint8))
        same = same and torch.equal(codes.scales, ref.scales)
        out[f"tok_w{w}"] = (round(timed(lambda c=codes, w=w: launch(h, c, rows, n, w)), 2), same)
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


for rows in (1, 16):
    print(rows, row_count(rows), flush=True)
