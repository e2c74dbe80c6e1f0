# ruff: noqa: B023  (a record of what ran: lambdas called at once)
"""greedy argmax over the vocab: torch's reduction against gumbel.greedy_argmax (the kept path)."""

import json

import torch

from services.worker.engine.sample.gumbel import greedy_argmax


def t(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps // 20):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (reps // 20 * 20) * 1e3


out = {}
for rows in (1, 16, 256):
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, 128256, device="cuda", dtype=dt)
        assert torch.equal(x.argmax(-1), greedy_argmax(x))
        out[f"{rows}-{dt}"] = {
            "torch_us": round(t(lambda: x.argmax(-1)), 2),
            "greedy_argmax_us": round(t(lambda: greedy_argmax(x)), 2),
        }
print(json.dumps(out, indent=1))
