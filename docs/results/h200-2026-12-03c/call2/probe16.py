"""Does cuBLASLt's block scaling take float16 outputs (torch._scaled_mm)?"""

import torch

from services.worker.engine.models.layers import fp8_block
from services.worker.engine.models.quantization import quantize_blocks

torch.manual_seed(0)
for n, k, m in [(512, 512, 16), (1536, 512, 64), (512, 1536, 32), (4096, 4096, 64)]:
    w = torch.randn(n, k, device="cuda") * 0.05
    wq, blocks = quantize_blocks(w, 128)
    ws = blocks.repeat_interleave(128, 0)
    bs = fp8_block.block_scales(ws, 128)
    x = torch.randn(m, k, device="cuda")
    for dt in (torch.bfloat16, torch.float16):
        codes = fp8_block.quantize_groups(x.to(dt), 128, rows_multiple=4)
        try:
            y = torch._scaled_mm(
                codes.codes, wq.t(), scale_a=codes.scales, scale_b=bs, out_dtype=dt
            )[:m]
            cols = torch.arange(k, device="cuda") // 128
            ref = (codes.codes[:m].float() * codes.scales[:m][:, cols]) @ (
                wq.float() * ws[:, cols]
            ).t()
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            print(n, k, m, dt, "ok", err)
        except Exception as e:
            print(n, k, m, dt, "raised", type(e).__name__, str(e)[:300])
