import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from services.worker.engine.models.layers import fp8_linear

out = {}
n, k = 1024, 4096
w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
blocks = torch.rand(n // 128, k // 128, device="cuda") + 0.1
for m in [*range(1, 21), 24, 31, 32, 33, 300, 301, 2047]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    c = fp8_linear.quantize_groups(x, 128)
    try:
        torch._scaled_mm(
            c.codes, w.t(), scale_a=c.scales, scale_b=blocks.t(), out_dtype=torch.bfloat16
        )
        torch.cuda.synchronize()
        out[m] = "ok"
    except Exception as e:
        out[m] = str(e)[:80]
print(json.dumps(out))
