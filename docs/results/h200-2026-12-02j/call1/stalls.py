"""Warp-stall samples per reason and the 14 instructions with the most, from
`ncu --page source --csv --print-source sass` output files."""

import collections
import csv
import sys

for f in sys.argv[1:]:
    with open(f) as fh:
        rows = list(csv.reader(fh))
    hdr = rows[1]
    data = rows[2:]
    idx = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = collections.Counter()
    total = 0

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    per_ins = []
    for r in data:
        if len(r) < len(hdr):
            continue
        s = num(r[idx["Warp Stall Sampling (All Samples)"]])
        total += s
        for c in stall_cols:
            tot[c] += num(r[idx[c]])
        per_ins.append(
            (
                s,
                r[idx["Address"]],
                r[idx["Source"]],
                {c: num(r[idx[c]]) for c in stall_cols if num(r[idx[c]]) > 0.15 * s and s > 0},
            )
        )
    print(
        "==",
        f,
        "samples",
        total,
        "instructions executed",
        sum(num(r[idx["Instructions Executed"]]) for r in data if len(r) >= len(hdr)),
    )
    for c, v in tot.most_common(10):
        print(f"   {c:28s} {v / total * 100:5.1f}%")
    per_ins.sort(key=lambda x: -x[0])
    for s, a, src, d in per_ins[:14]:
        why = {k[6:]: round(v / s * 100) for k, v in d.items()}
        print(f"   {s / total * 100:5.1f}% {a} {src[:60]:60s} {why}")
