"""The e4m3 decode attention with e4m3 queries (FP8 tensor cores for q·kᵀ, and for p·v in one
variant) against the kept kernel (queries and keys in float16): time and error at batch 256."""

import argparse
import importlib.util
import json
import os
import random
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
variant = sys.argv[1]  # kept | pvf16 | pvfp8
NAME = "services.worker.engine.attention.triton_kernels"
if variant != "kept":
    spec = importlib.util.spec_from_file_location(NAME, f".lab/l/tk_{variant}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = mod
    spec.loader.exec_module(mod)
from benchmarks.attention_sweep import decode_case  # noqa: E402
from services.worker.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

out_rows = []
for batch, lo, hi in ((256, 100, 1024), (128, 1000, 4000), (64, 1000, 4000)):
    args = argparse.Namespace(heads=32, kv_heads=8, head_dim=128, layers=32)
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q, meta, cache, kv_bytes = decode_case(lens, args, dev, kv_dtype="fp8")
    out = torch.empty_like(q)
    b = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    b._decode(q, cache, meta, out)
    torch.cuda.synchronize()
    res = {"variant": variant, "batch": batch, "ctx": [lo, hi]}
    launches = [None, (32, 2, 2), (32, 4, 2), (64, 4, 2), (16, 4, 3), (64, 8, 2)]
    for launch in launches:
        if launch is not None:
            b._tuned = True
            b.DECODE_BLOCK_N, b.DECODE_WARPS, b.DECODE_STAGES = launch
            b.DECODE_LANES = 1
        try:
            ms = min(
                triton.testing.do_bench(
                    lambda b=b, q=q, cache=cache, meta=meta, out=out: b._decode(
                        q, cache, meta, out
                    ),
                    return_mode="median",
                )
                for _ in range(3)
            )
            res[str(launch)] = round(ms * 1e3, 1)
        except Exception as e:
            res[str(launch)] = str(e)[:150]
    b2 = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    b2._decode(q, cache, meta, out)
    torch.save(out.float().cpu(), os.environ.get("OUT", "/tmp") + f"/out_{variant}_{batch}.pt")
    print(json.dumps(res), flush=True)
    out_rows.append(res)
with open(os.environ.get("OUT", "/tmp") + f"/qk8_{variant}.json", "w") as f:
    json.dump(out_rows, f)
