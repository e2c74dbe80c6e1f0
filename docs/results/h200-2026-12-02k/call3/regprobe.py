"""e4m3 / bf16 decode attention at decode batches, by launch and register cap (one H200)."""

import argparse
import json
import random
import sys

import torch
import triton

sys.path.insert(0, ".")
from benchmarks.attention_sweep import decode_case
from services.worker.engine.attention.triton_backend import TritonAttentionBackend

dev = torch.device("cuda")
LAUNCHES = [
    (64, 4, 2, None),
    (64, 4, 2, 96),
    (32, 4, 2, None),
    (32, 4, 2, 80),
    (32, 4, 2, 72),
    (32, 4, 2, 64),
    (16, 4, 2, None),
    (16, 4, 2, 72),
    (16, 4, 2, 64),
    (32, 2, 2, None),
    (16, 2, 2, 80),
    (32, 4, 3, 72),
    (64, 8, 2, None),
    (64, 8, 2, 64),
]
CASES = [(256, 100, 1024), (128, 500, 2000), (64, 800, 2048)]
res = []
for kv_dtype in ("fp8", "auto"):
    for batch, lo, hi in CASES:
        a = argparse.Namespace(heads=32, kv_heads=8, head_dim=128, layers=32)
        rng = random.Random(0)
        lens = [rng.randint(lo, hi) for _ in range(batch)]
        q, meta, cache, kv_bytes = decode_case(lens, a, dev, kv_dtype=kv_dtype)
        out = torch.empty_like(q)
        b = TritonAttentionBackend(32, 8, 128, 128**-0.5)
        b._tuned = True
        ref = None
        for rnd in range(2):
            for bn, w, s, m in LAUNCHES:
                b.DECODE_BLOCK_N, b.DECODE_WARPS, b.DECODE_STAGES, b.DECODE_MAXNREG = bn, w, s, m
                try:
                    ms = triton.testing.do_bench(
                        lambda b=b, q=q, cache=cache, meta=meta, out=out: b._decode(
                            q, cache, meta, out
                        ),
                        return_mode="median",
                    )
                except Exception as e:
                    print(kv_dtype, batch, bn, w, s, m, "ERR", str(e)[:100])
                    continue
                if ref is None:
                    ref = out.clone()
                err = (out.float() - ref.float()).abs().max().item()
                r = dict(
                    kv=kv_dtype,
                    batch=batch,
                    ctx=[lo, hi],
                    block_n=bn,
                    warps=w,
                    stages=s,
                    maxnreg=m,
                    round=rnd,
                    us=round(ms * 1e3, 1),
                    TBps=round(kv_bytes / ms / 1e9, 3),
                    max_diff=err,
                )
                res.append(r)
                print(json.dumps(r), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
