# ruff: noqa: SIM115  (a record of what ran: lambdas called at once)
"""latency.py's batch-1 decode step (graphs; bf16 and FP8), the committed FP8 GEMV and torch's
argmax against the working tree's, alternating in one process. usage: ab.py OUT.json [input_len]
(As run in call 2; fp8_old.py is the GEMV module of commit 80f0ede.)"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, ".")
sys.path.insert(0, ".lab/t")
import fp8_old

from benchmarks import latency
from benchmarks.shapes import write_shape
from services.worker.engine.models.layers import fp8_linear
from services.worker.engine.sample import sampler

new_gemv, new_greedy = fp8_linear.fp8_gemv, sampler.greedy_argmax
STATES = {"old": (fp8_old.fp8_gemv, lambda x: x.argmax(-1)), "new": (new_gemv, new_greedy)}
args = argparse.Namespace(
    dtype="bfloat16",
    max_model_len=4096,
    input_len=int(sys.argv[2]) if len(sys.argv) > 2 else 128,
    output_len=128,
    prefill_len=2048,
    repeats=3,
    profile=False,
    profile_prefill=False,
)
model = str(write_shape("llama-3.1-8b", Path(tempfile.mkdtemp()) / "s"))
out = []
for rnd in range(2):
    for state, (g, a) in STATES.items():
        fp8_linear.fp8_gemv, sampler.greedy_argmax = g, a
        for v in ("graphs", "fp8"):
            r = latency.measure(model, v, args)
            row = {
                "round": rnd,
                "state": state,
                "variant": v,
                "decode_ms": r["decode_ms_per_step"],
                "replay_ms": r["graph_replay_ms"],
            }
            print(row, flush=True)
            out.append(row)
            torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
