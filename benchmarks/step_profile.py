"""Where one decode step's time goes at a large batch (the throughput workload's steady state):
the step's wall time in the engine core, the GPU kernel time inside it (torch.profiler), the
difference (host work the GPU waits for), and the kernels by GPU time.

``--batch`` requests with prompts uniform in [--min-len, --max-len] are admitted and prefilled
first; then ``--steps`` pure decode steps are timed, then profiled.

    python benchmarks/step_profile.py --shape qwen3-0.6b --batch 256 --output step.json
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton import LLM, SamplingParams
from benchmarks.shapes import SHAPES, write_shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--model", help="a checkpoint instead of a shape (a CPU smoke test)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--output")
    args = p.parse_args()
    model = args.model or str(write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape))
    llm = LLM(model=model, load_format="dummy", max_num_seqs=args.batch, show_progress=False,
              max_model_len=args.max_len + 512)  # fmt: skip
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    core = llm.client.core  # type: ignore[attr-defined]  (the in-process client)
    rng = random.Random(0)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=10_000)
    vocab = llm.config.model.arch.vocab_size
    for i in range(args.batch):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        core.add_request(llm.processor.process(str(i), {"prompt_token_ids": ids}, params)[1])
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    for _ in range(3):  # graphs and allocator warm
        core.step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    sync()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            core.step()
        sync()
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0 and e.device_type.name == "CUDA":
            kernels.append({"kernel": e.key[:90], "us_per_step": us / args.steps,
                            "calls_per_step": e.count / args.steps})  # fmt: skip
    kernels.sort(key=lambda k: -k["us_per_step"])
    gpu_ms = sum(k["us_per_step"] for k in kernels) / 1e3
    contexts = [r.num_tokens for r in core.scheduler.running]
    result: dict[str, Any] = {
        "shape": args.shape,
        "batch": len(core.scheduler.running),
        "mean_context": sum(contexts) / len(contexts),
        "step_wall_ms": round(wall_ms, 3),
        "gpu_kernel_ms_per_step": round(gpu_ms, 3),
        "host_gap_ms_per_step": round(wall_ms - gpu_ms, 3),
        "gpu_busy_fraction": round(gpu_ms / wall_ms, 3),
        "kernels": kernels[: args.top],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }
    print(json.dumps({k: v for k, v in result.items() if k != "kernels"}, indent=2))
    for k in result["kernels"]:
        print(f"{k['us_per_step']:9.1f} us  {k['calls_per_step']:6.1f}x  {k['kernel']}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
