# ruff: noqa: SIM115, E741  (a record of what ran: lambdas called at once)
"""Compile the FP8 GEMV for sm_90 here (no GPU) and count the SASS of its main loop."""

import collections
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import services.worker.engine.models.layers.fp8_linear as f

BIN = triton.__path__[0] + "/backends/nvidia/bin/nvdisasm"


def compile_(fn, bn=8, bk=2048, warps=4, stages=3, codes=True, even=True):
    sig = {
        "X": "*i32" if codes else "*bf16",
        "W": "*i32",
        "WS": "*fp32",
        "B": "*bf16",
        "Y": "*bf16",
        "xs_in": "*fp32",
        "N": "i32",
        "K": "i32",
        "stride_wn": "i32",
    }
    cx = {
        "STATIC": False,
        "HAS_BIAS": False,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "AMAX_BLOCK": 4096,
        "GPU": True,
        "CODES": codes,
        "USE_PDL": True,
    }
    for k in cx:
        sig[k] = "constexpr"
    sig = {k: sig[k] for k in fn.arg_names}
    names = list(sig)
    div = ["X", "W", "WS", "B", "Y", "xs_in", "N", "K", "stride_wn"]  # as the runtime specializes
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in div}
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cx.items()}, attrs=attrs
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


def loop_counts(c):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as t:
        t.write(c.asm["cubin"])
        t.flush()
        sass = subprocess.run([BIN, "-c", t.name], capture_output=True, text=True).stdout
    lines = [l for l in sass.splitlines()]
    # the loop: from the label a backward BRA targets to that BRA
    labels = {}
    for i, l in enumerate(lines):
        m = re.match(r"\s*\.(L_x_\d+):", l)
        if m:
            labels[m.group(1)] = i
    best = None
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            span = (labels[m.group(1)], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    ops = collections.Counter()
    for l in lines[best[0] : best[1] + 1]:
        m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", l)
        if m:
            ops[m.group(2)] += 1
    return ops, sum(ops.values())


if __name__ == "__main__":
    c = compile_(f._fp8_gemv_kernel)
    ops, n = loop_counts(c)
    print(n, ops.most_common())


def dump(c, path):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as t:
        t.write(c.asm["cubin"])
        t.flush()
        open(path, "w").write(
            subprocess.run([BIN, "-c", t.name], capture_output=True, text=True).stdout
        )
