# ruff: noqa: E402, E731, B023, SIM115  (a record of what ran, as it ran)
"""Lab: the decode kernel as committed (HEADS=1) against HEADS=2 and the warp-split kernel
(.lab/u/ws.py), bf16 and e4m3 caches, at serving batches and at 1 x 32k; checks each output
against the committed launch's."""

import argparse
import json
import os
import sys

sys.path.insert(0, ".")
sys.path.insert(0, ".lab/u")
import torch
import triton
import triton.testing
import ws

from benchmarks.attention_sweep import decode_case
from benchmarks.roofline import copy_bandwidth
from services.worker.engine.attention.triton_backend import TritonAttentionBackend
from services.worker.engine.attention.triton_kernels import _combine, _decode

dev = torch.device("cuda")
bw = copy_bandwidth(dev)
import random


def launch(kernel, backend, q, kv, meta, out, splits, block_n, warps, stages, pf=0, lanes=None):
    num_reqs = meta.seq_lens.shape[0]
    part_acc = part_ml = out
    if splits > 1:
        shape = (num_reqs, backend.num_heads, splits)
        part_acc = torch.empty((*shape, backend.block_d), dtype=torch.float32, device=dev)
        part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=dev)
    common = backend._common(q, kv, meta, out)
    grid = (backend.num_kv_heads, num_reqs, splits)
    extra = {"PREFETCH": pf} if lanes is None else {"LANES": lanes, "PREFETCH": pf}
    kernel[grid](
        q,
        kv.key,
        kv.value,
        out,
        part_acc,
        part_ml,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        0,
        meta.decode_order,
        ORDERED=True,
        GROUP_PAD=max(16, triton.next_power_of_2(backend.group)),
        NUM_SPLITS=splits,
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=stages,
        **common,
        **extra,
    )
    if splits > 1:
        _combine[(num_reqs, backend.num_heads)](
            out,
            part_acc,
            part_ml,
            meta.query_start_loc,
            0,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=backend.head_dim,
            BLOCK_D=backend.block_d,
            NUM_SPLITS=splits,
        )


CASES = [(256, 100, 1024, 1), (64, 1000, 4000, 1), (1, 32768, 32768, 16)]
VARIANTS = [
    ("committed", 64, 4, 2, 0, None),
    ("committed", 64, 4, 2, 1, None),
    ("committed", 64, 4, 2, 2, None),
    ("committed", 64, 4, 2, 3, None),
    ("committed", 64, 4, 2, 4, None),
    ("committed", 64, 4, 2, 6, None),
    ("committed", 32, 2, 2, 0, None),
    ("committed", 32, 2, 2, 2, None),
    ("committed", 32, 2, 2, 4, None),
    ("committed", 32, 2, 2, 8, None),
    ("committed", 128, 4, 1, 0, None),
    ("committed", 128, 4, 1, 1, None),
    ("committed", 128, 4, 2, 1, None),
    ("committed", 128, 8, 2, 1, None),
    ("committed", 64, 2, 2, 2, None),
    ("committed", 32, 4, 2, 4, None),
    ("committed", 16, 1, 2, 8, None),
    ("committed", 32, 1, 2, 4, None),
    ("ws", 16, 4, 2, 0, 4),
    ("ws", 16, 4, 2, 1, 4),
    ("ws", 16, 4, 2, 2, 4),
    ("ws", 16, 2, 2, 2, 2),
    ("ws", 64, 1, 2, 2, 1),
    ("ws", 16, 1, 2, 4, 1),
    ("ws", 32, 1, 2, 2, 1),
]
results = []
for batch, lo, hi, splits in CASES:
    for kvd in ("auto", "fp8"):
        args = argparse.Namespace(heads=32, kv_heads=8, head_dim=128, layers=32)
        rng = random.Random(0)
        lens = [rng.randint(lo, hi) for _ in range(batch)]
        q, meta, cache, kv_bytes = decode_case(lens, args, dev, kv_dtype=kvd)
        backend = TritonAttentionBackend(32, 8, 128, 128**-0.5)
        backend._tuned = True
        ref = torch.empty_like(q)
        launch(_decode, backend, q, cache, meta, ref, splits, 64, 4, 2)
        for name, bn, w, s, pf, lanes in VARIANTS:
            out = torch.zeros_like(q)
            k = ws._decode_ws if name == "ws" else _decode
            fn = lambda: launch(k, backend, q, cache, meta, out, splits, bn, w, s, pf, lanes)
            try:
                fn()
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(fn, return_mode="median")
            except Exception as e:
                r = dict(
                    case=f"{batch}x[{lo},{hi}]/{splits}",
                    kv=kvd,
                    name=name,
                    bn=bn,
                    warps=w,
                    stages=s,
                    pf=pf,
                    lanes=lanes,
                    error=str(e)[:200],
                )
                print(r, flush=True)
                results.append(r)
                continue
            r = dict(
                case=f"{batch}x[{lo},{hi}]/{splits}",
                kv=kvd,
                name=name,
                bn=bn,
                warps=w,
                stages=s,
                pf=pf,
                lanes=lanes,
                us=round(ms * 1e3, 1),
                frac=round(kv_bytes / ms / 1e-3 / bw, 3),
                maxerr=err,
            )
            print(r, flush=True)
            results.append(r)
json.dump(
    {"copy_GBps": bw / 1e9, "results": results},
    open(os.environ.get("OUT", "/tmp") + "/wsbench.json", "w"),
    indent=1,
)
