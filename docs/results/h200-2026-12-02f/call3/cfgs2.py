"""latency.py's batch-1 decode step at longer contexts (max_model_len 32768: 32 splits at batch
1 either way), the split launch 64-4-2 against 128-8-4 (the tuned one). usage: cfgs2.py OUT.json"""

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, ".")
from benchmarks import latency
from benchmarks.shapes import write_shape
from services.worker.engine.attention import triton_backend

base = triton_backend.tuned_config("NVIDIA H200")
CANDS = {
    "tuned": {},
    "t32_64": {"tokens_per_split": 32, "split_block_n": 64, "split_warps": 4, "split_stages": 2},
}
args = argparse.Namespace(
    dtype="bfloat16",
    max_model_len=32768,
    input_len=128,
    output_len=64,
    prefill_len=2048,
    repeats=2,
    profile=False,
    profile_prefill=False,
)
model = str(write_shape("llama-3.1-8b", Path(tempfile.mkdtemp()) / "s"))
out = []
for ilen in (128, 4096, 8192, 16384):
    args.input_len = ilen
    for v in ("graphs", "fp8"):
        for name, over in CANDS.items():
            cfg = copy.deepcopy(base)
            cfg["decode"]["head_dim_128"].update(over)
            triton_backend.tuned_config = lambda _n, c=cfg: c
            r = latency.measure(model, v, args)
            row = {
                "cand": name,
                "input_len": ilen,
                "variant": v,
                "decode_ms": r["decode_ms_per_step"],
                "replay_ms": r["graph_replay_ms"],
            }
            print(row, flush=True)
            out.append(row)
            torch.cuda.empty_cache()
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
