"""A/B of the split decode's merge: in the kernel (last program) against a _combine launch."""

import json
import random
import sys
import types
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path.cwd()))
from benchmarks.attention_sweep import decode_case
from services.worker.engine.attention import triton_backend
from services.worker.engine.attention.triton_backend import TritonAttentionBackend

dev = torch.device("cuda")
args = types.SimpleNamespace(layers=32, kv_heads=8, head_dim=128, heads=32)
rng = random.Random(0)
cases = {
    "1x256": [256],
    "1x2048": [2048],
    "1x32768": [32768],
    "4x8192": [8192] * 4,
    "16x4096": [4096] * 16,
    "32xU[100,1024]": [rng.randint(100, 1024) for _ in range(32)],
}
res = {}
for name, lens in cases.items():
    for kvd in ("auto", "fp8"):
        q, meta, cache, kv_bytes = decode_case(lens, args, dev, kv_dtype=kvd)
        be = TritonAttentionBackend(32, 8, 128, 128**-0.5)
        out = torch.empty_like(q)
        be._decode(q, cache, meta, out)
        splits = triton_backend.num_decode_splits(
            len(lens), 8, max(lens), be._sms(dev), **be._split_rule
        )
        outs, times = {}, {}
        for _ in range(3):
            for mode in (True, False):
                be.DECODE_COMBINE_IN_KERNEL = mode
                o = torch.zeros_like(q)
                be._decode(q, cache, meta, o)
                outs[mode] = o
                ms = triton.testing.do_bench(
                    lambda: be._decode(q, cache, meta, out),  # noqa: B023
                    return_mode="median",
                )
                times.setdefault(str(mode), []).append(round(ms * 1e3, 2))
        diff = (outs[True].float() - outs[False].float()).abs().max().item()
        res[f"{name} {kvd}"] = {
            "splits": splits,
            "us_in_kernel_vs_launch": times,
            "max_abs_diff": diff,
        }
        print(name, kvd, json.dumps(res[f"{name} {kvd}"]), flush=True)
Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
