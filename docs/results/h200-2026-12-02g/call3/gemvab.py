# ruff: noqa: B023, SIM115, UP031, E731  (a record of what ran: lambdas called at once)
"""The FP8 GEMV over codes: the committed kernel (fp8_old) against the working tree's, per 8B
projection, at the kept launch and each of _CONFIGS; CUDA graph of calls cycling weight copies."""

import json
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, ".lab/t")
import fp8_lab
import fp8_old

from services.worker.engine.models.layers import fp8_linear as new
from services.worker.engine.models.layers import gemv_configs
from services.worker.engine.models.quantization import Codes

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed(fn, ws, reps=3):
    fn(ws[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws * 4:
            fn(w)
    g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / (len(ws) * 4))
    return best


out = {}
for name, (n, k) in SHAPES.items():
    copies = max(2, int(400e6 // (n * k)))
    ws = [(torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
    scale = torch.rand(n, 1, device="cuda") + 0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    q, s = new.quantize_rows(x)
    c = Codes(q, s, torch.bfloat16)
    same = torch.equal(fp8_old.fp8_gemv(c, ws[0], scale), new.fp8_gemv(c, ws[0], scale))
    kept = gemv_configs.launch("fp8_gemv_codes", x, n, k)
    row = {"equal": same, "kept": kept}
    for rep in range(2):
        row[f"old_us_{rep}"] = round(timed(lambda w: fp8_old.fp8_gemv(c, w, scale), ws), 2)
        row[f"new_us_{rep}"] = round(timed(lambda w: new.fp8_gemv(c, w, scale), ws), 2)
    VARS = {
        "bytes_pre0": (0, 0, 0),
        "bytes_pre1": (0, 1, 0),
        "bytes_wrap": (0, 2, 0),
        "words_pre0": (1, 0, 0),
        "words_pre1": (1, 1, 0),
        "words_wrap": (1, 2, 0),
        "words_xpre": (1, 0, 1),
        "words_pre1_xpre": (1, 1, 1),
    }
    for vname, (xw, pre, xpre) in VARS.items():
        f = lambda w, a=(xw, pre, xpre): fp8_lab.gemv(c, w, scale, kept, *a)
        row[vname + "_equal"] = torch.equal(f(ws[0]), fp8_old.fp8_gemv(c, ws[0], scale))
        row[vname] = round(timed(f, ws), 2)
    row["old_us_2"] = round(timed(lambda w: fp8_old.fp8_gemv(c, w, scale), ws), 2)
    for cfg in []:
        kw = {
            "BLOCK_N": cfg.kwargs["BLOCK_N"],
            "BLOCK_K": cfg.kwargs["BLOCK_K"],
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
        }
        key = "%d-%d-%d-%d" % tuple(kw.values())
        row["new_" + key] = round(timed(lambda w: new.fp8_gemv(c, w, scale, config=kw), ws), 2)
    row["bound_us"] = round(n * k / 4.26e12 * 1e6, 2)
    print(name, row, flush=True)
    out[name] = row
    del ws
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
