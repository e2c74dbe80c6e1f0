"""Run one kernel kind a few times, for ncu to profile one launch of it."""

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))
from benchmarks.attention_sweep import decode_case
from services.worker.engine.attention.triton_backend import TritonAttentionBackend

p = argparse.ArgumentParser()
p.add_argument("kind")
p.add_argument("--kv", default="auto")
p.add_argument("--launch", default="")
p.add_argument("--fast", action="store_true")
a = p.parse_args()
dev = torch.device("cuda")
if a.kind == "decode":
    import random

    rng = random.Random(0)
    lens = [rng.randint(100, 1024) for _ in range(256)]
    args = types.SimpleNamespace(layers=32, kv_heads=8, head_dim=128, heads=32)
    q, meta, cache, kv_bytes = decode_case(lens, args, dev, kv_dtype=a.kv)
    out = torch.empty_like(q)
    be = TritonAttentionBackend(32, 8, 128, 128**-0.5)
    be._tuned = True
    if a.launch:
        bn, w, s = map(int, a.launch.split("/"))
        be.DECODE_BLOCK_N, be.DECODE_WARPS, be.DECODE_STAGES = bn, w, s
    for _ in range(4):
        be._decode(q, cache, meta, out)
    torch.cuda.synchronize()
    print("kv MB", kv_bytes / 1e6)
else:
    from services.worker.engine.models.layers import fp8_linear
    from services.worker.engine.models.layers.gemv import gemv

    n, k = map(int, a.launch.split("x"))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    if a.kind == "bf16_gemv":
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for _ in range(4):
            gemv(x, w)
    else:
        w = fp8_linear.quantize_rows(torch.randn(n, k, device=dev) * 0.05)
        from services.worker.engine.models.quantization import Codes

        codes = Codes(*fp8_linear.quantize_rows(x), x.dtype)
        for _ in range(4):
            fp8_linear.fp8_gemv(codes, *w, fast_accumulation=a.fast)
    torch.cuda.synchronize()
    print("done")
