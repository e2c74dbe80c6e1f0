import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from services.worker.engine.models.layers import fp8_linear

out = {}
for n, k in [(256, 384), (256, 256), (512, 256), (256, 512), (384, 640), (1024, 4096)]:
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    nb, g = n // 128, k // 128
    blocks = torch.rand(nb, g, device="cuda") + 0.1
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    c = fp8_linear.quantize_groups(x, 128)
    exact = (c.codes.double() * c.scales.double().repeat_interleave(128, 1)[:, :k]) @ (
        w.double() * blocks.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :k]
    ).t()
    gp = -(-g // 4) * 4
    padded = torch.zeros(nb, gp, device="cuda")
    padded[:, :g] = blocks
    npad = -(-nb // 4) * 4
    padn = torch.zeros(g, npad, device="cuda")
    padn[:, :nb] = blocks.t()
    for name, sb in {
        "view": blocks.t(),
        "ld_padded": padded[:, :g].t(),
        "contig_GxNb": blocks.t().contiguous(),
        "GxNb_padN": padn[:, :nb],
    }.items():
        try:
            y = torch._scaled_mm(
                c.codes, w.t(), scale_a=c.scales, scale_b=sb, out_dtype=torch.bfloat16
            )
            torch.cuda.synchronize()
            out[f"{n}x{k}:{name}"] = float((y.double() - exact).abs().max() / exact.abs().max())
        except Exception as e:
            out[f"{n}x{k}:{name}"] = str(e).split("\n")[0][:150]
print(json.dumps(out, indent=0))
