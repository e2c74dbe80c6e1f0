# ruff: noqa: E731, B023, SIM115  (a record of what ran, as it ran)
"""Lab: how fast can the decode's access pattern read the paged cache, with no attention?
Each program sums the bytes it loads (so nothing is optimized away)."""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, ".")
import torch
import triton
import triton.language as tl
import triton.testing

from benchmarks.attention_sweep import decode_case
from benchmarks.roofline import copy_bandwidth


@triton.jit
def _gather(
    K,
    V,
    out,
    block_tables,
    seq_lens,
    order,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    KV_BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    req = tl.load(order + tl.program_id(1))
    h0 = tl.program_id(0) * HEADS
    seq_len = tl.load(seq_lens + req)
    table = block_tables + req.to(tl.int64) * stride_bt
    offs_c = tl.arange(0, HEADS * HEAD_DIM)
    cols = (offs_c // HEAD_DIM) * stride_kh + offs_c % HEAD_DIM
    acc = tl.zeros([BLOCK_N, HEADS * HEAD_DIM], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        block = tl.load(table + offs_n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        kv = block * stride_kb + (offs_n % KV_BLOCK) * stride_ks + h0 * stride_kh
        k = tl.load(K + kv[:, None] + cols[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv[:, None] + cols[None, :], mask=n_ok[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(
        out + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0)
    )


dev = torch.device("cuda")
bw = copy_bandwidth(dev)
res = []
for batch, lo, hi in [(256, 100, 1024), (64, 1000, 4000)]:
    for kvd in ("auto", "fp8"):
        args = argparse.Namespace(heads=32, kv_heads=8, head_dim=128, layers=32)
        rng = random.Random(0)
        lens = [rng.randint(lo, hi) for _ in range(batch)]
        q, meta, cache, kv_bytes = decode_case(lens, args, dev, kv_dtype=kvd)
        for heads in (1, 2, 4, 8):
            for bn, warps, stages in (
                (16, 4, 3),
                (32, 4, 3),
                (64, 4, 2),
                (64, 4, 3),
                (32, 2, 3),
                (64, 8, 3),
            ):
                if heads * bn > 256 and warps < 8:
                    continue
                out = torch.empty(batch * 8 // heads, device=dev)
                fn = lambda: _gather[(8 // heads, batch)](
                    cache.key,
                    cache.value,
                    out,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.decode_order,
                    cache.key.stride(0),
                    cache.key.stride(1),
                    cache.key.stride(2),
                    meta.block_tables.stride(0),
                    KV_BLOCK=16,
                    HEADS=heads,
                    HEAD_DIM=128,
                    BLOCK_N=bn,
                    num_warps=warps,
                    num_stages=stages,
                )
                try:
                    ms = triton.testing.do_bench(fn, return_mode="median")
                except Exception as e:
                    print(batch, kvd, heads, bn, warps, stages, "ERR", str(e)[:100])
                    continue
                r = dict(
                    case=f"{batch}x[{lo},{hi}]",
                    kv=kvd,
                    heads=heads,
                    bn=bn,
                    warps=warps,
                    stages=stages,
                    us=round(ms * 1e3, 1),
                    frac=round(kv_bytes / ms / 1e-3 / bw, 3),
                )
                print(r, flush=True)
                res.append(r)
json.dump(
    {"copy_GBps": bw / 1e9, "results": res},
    open(os.environ.get("OUT", "/tmp") + "/gather.json", "w"),
    indent=1,
)
