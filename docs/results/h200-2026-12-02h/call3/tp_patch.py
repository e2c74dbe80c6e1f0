# ruff: noqa: RUF005  (a record of what ran, as it ran)
"""throughput.py with the decode kernel's launch set from DECODE=block_n,warps,stages[,prefetch]"""

import os
import runpy
import sys

sys.path.insert(0, ".")
from services.worker.engine.attention.triton_backend import TritonAttentionBackend as B

v = os.environ.get("DECODE")
if v:
    bn, w, s = (int(x) for x in v.split(","))
    B.DECODE_BLOCK_N, B.DECODE_WARPS, B.DECODE_STAGES = bn, w, s
    print("decode launch", bn, w, s, flush=True)
sys.argv = ["benchmarks/throughput.py"] + sys.argv[1:]
runpy.run_path("benchmarks/throughput.py", run_name="__main__")
