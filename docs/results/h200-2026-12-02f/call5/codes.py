"""The bf16 codes test, 8 seeds: per pair (RMSNorm, SiLU·mul), codes and scales that differ
between the fused kernel's codes and quantize_rows of its plain output, and the values there."""

import sys

import torch

sys.path.insert(0, ".")
from services.worker.engine.models.layers.fp8_linear import quantize_rows
from services.worker.engine.models.layers.fused_ops import add_rms_norm, silu_and_mul

for seed in range(8):
    torch.manual_seed(seed)
    rows, dtype = 300, torch.bfloat16
    x = torch.randn(rows, 4096, device="cuda") * torch.linspace(0.01, 30, 4096, device="cuda")
    x, res = x.to(dtype), torch.randn(rows, 4096, device="cuda").to(dtype)
    w = (torch.rand(4096, device="cuda") + 0.5).to(dtype)
    h = (torch.randn(rows, 2 * 14336, device="cuda") * 3).to(dtype)
    normed, _ = add_rms_norm(x, res.clone(), w, 1e-6)
    nc, _ = add_rms_norm(x, res.clone(), w, 1e-6, quantize=True)
    for name, plain, codes in (
        ("norm", normed, nc),
        ("silu", silu_and_mul(h), silu_and_mul(h, quantize=True)),
    ):
        q, s = quantize_rows(plain)
        d = codes.codes.view(torch.uint8) != q.view(torch.uint8)
        sd = codes.scales != s
        out = [seed, name, int(d.sum()), int(sd.sum())]
        if d.any():
            i = d.nonzero()[:3]
            for r, c in i.tolist():
                v = plain[r, c].float().item()
                sc = s[r].item()
                out.append(
                    (
                        r,
                        c,
                        v,
                        sc,
                        codes.scales[r].item(),
                        v / sc,
                        codes.codes[r, c].float().item(),
                        q[r, c].float().item(),
                    )
                )
        print(out, flush=True)
