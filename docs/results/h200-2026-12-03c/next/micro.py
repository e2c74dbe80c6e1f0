"""Fused group codes (RMSNorm, SiLU·mul writing a block layer's codes) against the plain
kernel followed by the layer's own quantize_groups pass, each in a CUDA graph of 50 calls,
at 1, 16 and 2,048 rows of the 8B shape. Run first next session (ab.sh): not yet run."""

import torch

from services.worker.engine.models.layers.fp8_block import quantize_groups
from services.worker.engine.models.layers.fused_ops import add_rms_norm, silu_and_mul


def timed(fn, reps=50):
    """µs a call, the best of five replays of a graph of ``reps`` calls."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


def row_count(rows):
    bf16 = torch.bfloat16
    x = torch.randn(rows, 4096, device="cuda", dtype=bf16)
    r = torch.randn(rows, 4096, device="cuda", dtype=bf16)
    w = torch.rand(4096, device="cuda", dtype=bf16) + 0.5
    h = torch.randn(rows, 2 * 14336, device="cuda", dtype=bf16)
    return {
        "norm_fused_g128": timed(lambda: add_rms_norm(x, r, w, 1e-6, 128)),
        "norm_fused_tok": timed(lambda: add_rms_norm(x, r, w, 1e-6, 4096)),
        "norm_plain": timed(lambda: add_rms_norm(x, r, w, 1e-6)),
        "norm_plain+qg": timed(lambda: quantize_groups(add_rms_norm(x, r, w, 1e-6)[0], 128)),
        "silu_fused_g128": timed(lambda: silu_and_mul(h, 128)),
        "silu_fused_tok": timed(lambda: silu_and_mul(h, 14336)),
        "silu_plain": timed(lambda: silu_and_mul(h)),
        "silu_plain+qg": timed(lambda: quantize_groups(silu_and_mul(h), 128)),
    }


for rows in (1, 16, 2048):
    print(rows, {k: round(v, 2) for k, v in row_count(rows).items()}, flush=True)
