"""A/B of the e4m3 decode attention's widening (DECODE_WIDEN 0 / 1 / 2), one process."""

import json
import random
import sys
import types
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path.cwd()))
from benchmarks.attention_sweep import decode_case
from benchmarks.roofline import copy_bandwidth
from services.worker.engine.attention.triton_backend import TritonAttentionBackend

dev = torch.device("cuda")
bw = copy_bandwidth(dev)
args = types.SimpleNamespace(layers=32, kv_heads=8, head_dim=128, heads=32)
cases = {
    "256xU[100,1024]": [random.Random(0).randint(100, 1024) for _ in range(256)],
    "64xU[1024,4096]": [random.Random(1).randint(1024, 4096) for _ in range(64)],
    "1x32768": [32768],
    "32x8192": [8192] * 32,
}
res = {"copy_GBps": round(bw / 1e9, 1)}
for name, lens in cases.items():
    for kvd in ("fp8", "auto"):
        if kvd == "auto" and name not in ("256xU[100,1024]", "1x32768"):
            continue
        q, meta, cache, kv_bytes = decode_case(lens, args, dev, kv_dtype=kvd)
        be = TritonAttentionBackend(32, 8, 128, 128**-0.5)
        out = torch.empty_like(q)
        be._decode(q, cache, meta, out)  # tunes from the GPU's file
        launches = [None]
        if name.startswith("256"):
            launches.append((32, 2, 2))
        for launch in launches:
            if launch:
                be.DECODE_BLOCK_N, be.DECODE_WARPS, be.DECODE_STAGES = launch
            outs, times = {}, {}
            widens = (0, 1, 2) if kvd == "fp8" else (0,)
            for _ in range(3):
                for w in widens:
                    be.DECODE_WIDEN = w
                    o = torch.empty_like(q)
                    be._decode(q, cache, meta, o)
                    outs[w] = o
                    ms = triton.testing.do_bench(
                        lambda: be._decode(q, cache, meta, out),  # noqa: B023
                        return_mode="median",
                    )
                    times.setdefault(w, []).append(round(ms * 1e3, 1))
            key = f"{name} {kvd} {launch or 'kept'}"
            res[key] = {
                "us": times,
                "of_copy": {w: round(kv_bytes / (min(t) * 1e-6) / bw, 3) for w, t in times.items()},
                "equal_to_0": {w: bool(torch.equal(outs[w], outs[0])) for w in outs},
            }
            be.DECODE_WIDEN = 0
            print(key, json.dumps(res[key]), flush=True)
Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
