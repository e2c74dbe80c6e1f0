# ruff: noqa: B023  (a record of what ran: lambdas called at once)
"""greedy argmax over the vocab: torch's reduction against the sliced Triton pass (inv_t 0)."""

import json

import torch

from services.worker.engine.sample.gumbel import gumbel_argmax_triton


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
    x = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
    z = torch.zeros(rows, device="cuda")
    k = torch.zeros(rows, dtype=torch.int64, device="cuda")
    assert torch.equal(x.argmax(-1), gumbel_argmax_triton(x, z, k))
    out[rows] = {
        "torch_us": round(t(lambda: x.argmax(-1)), 2),
        "triton_slices_us": round(t(lambda: gumbel_argmax_triton(x, z, k)), 2),
    }
    for s in (2048, 4096):
        out[rows][f"triton_slice{s}_us"] = round(t(lambda: gumbel_argmax_triton(x, z, k, s)), 2)
print(json.dumps(out, indent=1))
