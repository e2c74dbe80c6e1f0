export PYTHONPATH=$PWD
for v in kept pvf16 pvfp8 kept pvf16; do timeout 200 python3 .lab/l/qk8.py $v 2>&1 | grep -v Warn | tail -4; done
python3 - <<'PY'
import os, torch
o = os.environ["OUT"]
for b in (256, 128, 64):
    ref = torch.load(f"{o}/out_kept_{b}.pt")
    for v in ("pvf16", "pvfp8"):
        p = f"{o}/out_{v}_{b}.pt"
        if os.path.exists(p):
            x = torch.load(p)
            d = (x - ref).abs()
            print(b, v, "max abs diff", d.max().item(), "rel to max", (d.max() / ref.abs().max()).item(), "mean", d.mean().item(), "ref mean abs", ref.abs().mean().item())
PY
