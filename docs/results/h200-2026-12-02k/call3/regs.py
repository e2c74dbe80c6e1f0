import dataclasses
import sys

sys.path.insert(0, ".")
import triton
from triton.compiler import ASTSource

from benchmarks import kernel_sass as ks


def comp(p, maxnreg):
    names = p.kernel.arg_names
    sig = {n: "constexpr" if n in p.constexprs else p.types.get(n, "i32") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or sig[n] == "i32"]
    src = ASTSource(
        fn=p.kernel,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in p.constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    opts = {"num_warps": p.warps, "num_stages": p.stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=ks.TARGET, options=opts)


print("---- shared memory and occupancy")
for fp8 in (True, False):
    base = ks._decode(fp8)
    for bn, w, s, m in (
        (64, 4, 2, None),
        (64, 4, 2, 96),
        (32, 4, 2, None),
        (32, 4, 2, 80),
        (32, 4, 2, 72),
        (32, 2, 2, None),
        (16, 2, 2, None),
        (16, 2, 2, 80),
        (16, 4, 2, None),
        (16, 4, 2, 72),
    ):
        p = dataclasses.replace(
            base, constexprs={**base.constexprs, "BLOCK_N": bn}, warps=w, stages=s
        )
        k = comp(p, m)
        res = ks._tool("cuobjdump", k.asm["cubin"], "-res-usage")
        import re

        regs = int(re.search(r"REG:(\d+)", res).group(1))
        sh = k.metadata.shared
        per_warp = ((regs * 32 + 255) // 256) * 256
        ctas_r = 65536 // (per_warp * w)
        ctas_s = (228 * 1024) // (sh + 1024) if sh else 32
        ctas = min(ctas_r, ctas_s, 32, 64 // w)
        print(
            "fp8" if fp8 else "bf16",
            bn,
            w,
            s,
            m,
            "regs",
            regs,
            "stack",
            re.search(r"STACK:(\d+)", res).group(1),
            "smem",
            sh,
            "ctas",
            ctas,
            "warps/SM",
            ctas * w,
        )
