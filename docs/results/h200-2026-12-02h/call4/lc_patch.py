# ruff: noqa: E501, RUF005  (a record of what ran, as it ran)
"""long_context.py with the decode kernel's split launch from SPLIT=block_n,warps,stages,lanes,prefetch
(set over the GPU's kept config)."""

import os
import runpy
import sys

sys.path.insert(0, ".")
from services.worker.engine.attention.triton_backend import TritonAttentionBackend as B

v = os.environ.get("SPLIT")
if v:
    bn, w, s, lanes, pf = (int(x) for x in v.split(","))
    orig = B.apply_config

    def apply(self, config):
        orig(self, config)
        self.DECODE_SPLIT_BLOCK_N, self.DECODE_SPLIT_WARPS, self.DECODE_SPLIT_STAGES = bn, w, s
        self.DECODE_SPLIT_LANES, self.DECODE_SPLIT_PREFETCH = lanes, pf

    B.apply_config = apply
    print("split launch", bn, w, s, lanes, pf, flush=True)
sys.argv = ["benchmarks/long_context.py"] + sys.argv[1:]
runpy.run_path("benchmarks/long_context.py", run_name="__main__")
