"""Where one decode step's time goes at a large batch (the throughput workload's steady state):
the step's wall time in the engine core, the GPU kernel time inside it (torch.profiler), the
difference (host work the GPU waits for), and the kernels by GPU time.

``--batch`` requests with prompts uniform in [--min-len, --max-len] are admitted and prefilled
first; then ``--steps`` pure decode steps are timed, then profiled. With ``--prefill`` the
admission itself is measured instead (the throughput workload's first steps, prompt chunks
with the decode rows of the requests already prefilled): each step's wall time, twice over
with fresh prompts (the first pass pays whatever happens once), then the second pass profiled.

    python benchmarks/kernels/step_profile.py --shape qwen3-0.6b --batch 256 --output step.json
"""

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from baton import LLM, SamplingParams
from benchmarks.profiling import cpu_rows, kernel_rows
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
    p.add_argument("--prefill", action="store_true", help="measure the admission phase instead")
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--output")
    args = p.parse_args()
    model = args.model or str(write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape))
    llm = LLM(model=model, load_format="dummy", max_num_seqs=args.batch, show_progress=False,
              max_model_len=args.max_len + 512, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    core = llm.client.core  # type: ignore[attr-defined]  (the in-process client)
    rng = random.Random(0)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=10_000)
    vocab = llm.config.model.arch.vocab_size

    first_step_profile: list[str] = []

    def admit(tag: str) -> list[float]:
        """Admit a batch and step until every prompt is computed: each step's wall time."""
        for i in range(args.batch):
            ids = [rng.randrange(1, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
            request = llm.processor.process(f"{tag}{i}", {"prompt_token_ids": ids}, params)[1]
            core.add_request(request)
        walls: list[float] = []
        while core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
        ):
            start = time.perf_counter()
            if args.prefill and tag == "a" and not walls:  # the engine's very first such step
                hot = cProfile.Profile()
                compiled = _triton_variants()
                hot.runcall(core.step)
                sync()
                print("Triton kernels compiled by this step:", _triton_variants() - compiled)
                text = io.StringIO()
                pstats.Stats(hot, stream=text).sort_stats("cumulative").print_stats(30)
                first_step_profile.append(text.getvalue())
            else:
                core.step()
            walls.append(time.perf_counter() - start)
        return walls

    first = admit("a")
    if args.prefill:
        print(first_step_profile[0])
        return _profile_admission(args, llm, core, admit, first, sync)
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
    kernels = kernel_rows(prof, args.steps)
    gpu_ms = sum(k["us_per_step"] for k in kernels) / 1e3
    contexts = [r.num_tokens for r in core.scheduler.running]
    result: dict[str, Any] = {
        "shape": args.shape,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
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


def _triton_variants() -> set[str]:
    """Kernels in Triton's on-disk cache (one directory per compiled variant; a kernel compiled
    in this process lands there too): what a step compiled is what it added."""
    import os

    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {
        f"{p.parent.name[:8]}/{p.stem}"
        for p in root.glob("*/*.json")
        if not p.name.startswith("__grp__")
    }


def _profile_admission(args, llm, core, admit, first, sync) -> None:  # type: ignore[no-untyped-def]
    """The admission phase twice (fresh prompts each time), the second under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    def drain() -> None:
        core.abort_requests([r.request_id for r in list(core.scheduler.running)])
        while core.has_work():
            core.step()
        sync()

    drain()
    second = admit("b")
    drain()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        third = admit("c")
        sync()
    drain()
    gpu = [{"kernel": k["kernel"], "ms": k["us_per_step"] / 1e3, "calls": int(k["calls_per_step"])}
           for k in kernel_rows(prof)]  # fmt: skip
    cpu = cpu_rows(prof)
    result = {
        "shape": args.shape, "batch": args.batch,
        "steps": len(second),
        "first_pass_ms": [round(w * 1e3, 2) for w in first],
        "second_pass_ms": [round(w * 1e3, 2) for w in second],
        "first_pass_s": round(sum(first), 3), "second_pass_s": round(sum(second), 3),
        "profiled_pass_s": round(sum(third), 3),
        "gpu_kernel_s": round(sum(k["ms"] for k in gpu) / 1e3, 3),
        "kernels": gpu[: args.top], "cpu_ops": cpu[: args.top],
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k not in ("kernels", "cpu_ops")}))
    for k in result["kernels"]:
        print(f"{k['ms']:9.2f} ms {k['calls']:6d}x  {k['kernel']}")
    for k in result["cpu_ops"]:
        print(f"{k['ms']:9.2f} ms {k['calls']:6d}x  cpu {k['op']}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
