"""Where a 2k prefill's wall time goes outside its kernels: GPU gaps over 20 us with the host's
runtime calls around them, and the host's time before the first GPU activity and after the last.

Run from the repository root: ``python3 gaps.py graphs fp8`` (latency.py's variants; the env
SHAPE and N change the shape and the prompt's length). What ran on the H200 in call 9, laid out
for the linter afterwards (the logic unchanged)."""

import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, ".")
from baton import LLM
from benchmarks.latency import VARIANTS, _timed
from benchmarks.shapes import write_shape


def main(model: str, variant: str) -> None:
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=4, num_kv_blocks=512, show_progress=False,
              max_num_batched_tokens=2048, enable_prefix_caching=False,
              **VARIANTS[variant])  # fmt: skip
    long_prompt = [i % 1000 + 1 for i in range(int(os.environ.get("N", 2048)))]
    for _ in range(3):
        _timed(llm, long_prompt, 1)
    print(variant, "wall ms", [round(_timed(llm, long_prompt, 1) * 1e3, 2) for _ in range(3)])
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof, record_function("CALL"):
        _timed(llm, long_prompt, 1)
    ev = prof.events()
    call = next(e for e in ev if e.name == "CALL" and e.device_type.name == "CPU")
    t0, t1 = call.time_range.start, call.time_range.end
    gpu = sorted((e for e in ev if e.device_type.name == "CUDA"),
                 key=lambda e: e.time_range.start)  # fmt: skip
    rt = sorted((e for e in ev if e.device_type.name == "CPU" and e.name.startswith("cuda")),
                key=lambda e: e.time_range.start)  # fmt: skip
    print(f"call {t1 - t0:.0f} us; first GPU at +{gpu[0].time_range.start - t0:.0f}, "
          f"last GPU end at +{gpu[-1].time_range.end - t0:.0f}; "
          f"first runtime call at +{rt[0].time_range.start - t0:.0f}")  # fmt: skip
    busy = sum(e.time_range.end - e.time_range.start for e in gpu)
    span = gpu[-1].time_range.end - gpu[0].time_range.start
    print(f"GPU busy {busy:.0f} us over span {span:.0f}")
    gaps = []
    end, prev = gpu[0].time_range.end, gpu[0]
    for e in gpu[1:]:
        if e.time_range.start - end > 20:
            gaps.append((e.time_range.start - end, end, prev.name[:40], e.name[:40]))
        if e.time_range.end > end:
            end, prev = e.time_range.end, e
    gaps.sort(reverse=True)
    print("gaps total", round(sum(g[0] for g in gaps)), "us in", len(gaps))
    for g, at, a, b in gaps[:12]:
        calls = [f"{r.name[:22]}@{r.time_range.start - t0:.0f}" for r in rt
                 if at - 100 <= r.time_range.start <= at + g][:6]  # fmt: skip
        print(f"  {g:7.0f} us at +{at - t0:.0f}: after {a} before {b}; host: {calls}")
    # the host's own ops (aten, runtime calls, the CALL range) by self CPU time
    rows = sorted(((e.self_cpu_time_total, e.key, e.count) for e in prof.key_averages()
                   if e.self_cpu_time_total > 0), reverse=True)[:15]  # fmt: skip
    for us, k, c in rows:
        print(f"  host {us:8.0f} us  {c:5d}x {k[:70]}")
    del llm


if __name__ == "__main__":
    shape = os.environ.get("SHAPE", "llama-3.1-8b")
    model = str(write_shape(shape, Path(tempfile.mkdtemp()) / "s"))
    for v in sys.argv[1:]:
        main(model, v)
        torch.cuda.empty_cache()
