"""Why do float32 norm codes differ from quantize_rows of the plain norm (300 rows)?"""
import torch
from services.worker.engine.models.layers.fused_ops import add_rms_norm, _rms_norm
from services.worker.engine.models.layers.fp8_linear import quantize_rows
from services.worker.engine.models.quantization import FP8
torch.manual_seed(0)
for rows in (1, 300):
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, 4096, device="cuda") * torch.linspace(0.01, 30, 4096, device="cuda")).to(dtype)
        res = torch.randn(rows, 4096, device="cuda").to(dtype)
        w = (torch.rand(4096, device="cuda") + 0.5).to(dtype)
        y, _ = add_rms_norm(x, res.clone(), w, 1e-6)
        c, _ = add_rms_norm(x, res.clone(), w, 1e-6, quantize=True)
        q, s = quantize_rows(y)
        dq = (c.codes.view(torch.uint8) != q.view(torch.uint8))
        ds = (c.scales != s)
        # the codes' own y: dequantized; vs y
        print(rows, dtype, "codes differ", int(dq.sum()), "rows with a differing scale", int(ds.sum()),
              "max |c - q| in code units", float((c.codes.float() - q.float()).abs().max()))
        if dq.any():
            i, j = dq.nonzero()[0].tolist()
            print("  first at", i, j, "y", float(y[i, j]), "scale", float(s[i]), float(c.scales[i]), "y/s", float(y[i, j].float() / s[i]), "codes", float(c.codes[i, j]), float(q[i, j]))

# the same two launches without FP contraction (mul/add never fused into fma by ptxas)
from services.worker.engine.models.layers.fused_ops import _codes_out
import triton
for rows in (300,):
    dtype = torch.float32
    x = (torch.randn(rows, 4096, device="cuda") * torch.linspace(0.01, 30, 4096, device="cuda")).to(dtype)
    res = torch.randn(rows, 4096, device="cuda").to(dtype)
    w = (torch.rand(4096, device="cuda") + 0.5).to(dtype)
    for fusion in (True, False):
        y = torch.empty_like(x); r1 = res.clone(); r2 = res.clone()
        _rms_norm[(rows, 1)](x, r1, w, y, y, y, x.stride(0), 0, r1.stride(0), y.stride(0), 0, 4096, 1e-6,
                             BLOCK=4096, HAS_RESIDUAL=True, QUANT=False, GPU=True, enable_fp_fusion=fusion)
        c = _codes_out(rows, 4096, x)
        _rms_norm[(rows, 1)](x, r2, w, x, c.codes, c.scales, x.stride(0), 0, r2.stride(0), 4096, 0, 4096, 1e-6,
                             BLOCK=4096, HAS_RESIDUAL=True, QUANT=True, GPU=True, enable_fp_fusion=fusion)
        q, s = quantize_rows(y)
        print("fusion", fusion, "codes differ", int((c.codes.view(torch.uint8) != q.view(torch.uint8)).sum()),
              "scales differ", int((c.scales != s).sum()))
