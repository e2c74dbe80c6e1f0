"""Batch-1 latency: decode ms/step and tokens/s next to the HBM roofline (weight bytes ÷ copy
bandwidth, both measured in this run), and prefill of a long prompt as achieved TFLOP/s
against the matmul peak measured in this run. Variants (CUDA graphs off, fused kernels off)
run in the same process so their ratios are side by side; each is a set of engine options
(``LLM(**kwargs)``) or a checkpoint format, except the A/B variants of the experts' paths
(``moe_grouped``, ``fp8_moe_quantize_apart``), which set an attribute of a module for their
run (``IN_PROCESS``; the engine core runs in this process).

    python benchmarks/latency.py --shape llama-3.1-8b --variants graphs eager unfused
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton import LLM, SamplingParams
from benchmarks.profiling import device_span_us, kernel_rows
from benchmarks.roofline import ModelCost, fp8_matmul_peak, limits, limits_seen
from benchmarks.shapes import write_shape
from services.worker.engine.ops import fused_moe, moe_gemv

VARIANTS: dict[str, dict[str, Any]] = {
    # the default: CUDA graphs (whole decode steps; prefill steps piecewise) + fused kernels +
    # attention "auto", async scheduling
    "graphs": {},
    "sync": {"async_scheduling": False},  # the default, but the host waits for each step
    "eager": {"enforce_eager": True},
    "unfused": {"fused_ops": False},
    "triton": {"attention_backend": "triton"},  # the default with the Triton attention backend
    "flash_attn": {"attention_backend": "flash_attn"},  # ... with FlashAttention-4's prefill
    # the default, its one rank in a process of its own (MultiprocExecutor at TP=1): what the
    # executor's messages cost a step, against "graphs" in the same run
    "multiproc": {"distributed_executor_backend": "mp"},
    # FP8 linear weights quantized at load (per channel; activations per token): the FP8 GEMV
    # for one token, the FP8 tensor cores (torch._scaled_mm) for more, accumulating in their
    # own precision (EngineArgs.fp8_fast_accumulation, on for FP8 models by default)
    "fp8": {"quantization": "fp8"},
    "fp8_eager": {"quantization": "fp8", "enforce_eager": True},  # for --profile's kernel table
    # FP8, the batched products' partial sums promoted to float32 (the default before
    # 2026-12-02)
    "fp8_fp32_accumulation": {"quantization": "fp8", "fp8_fast_accumulation": False},
    # prefill steps (and the short prompt's) launched kernel by kernel, not replayed from the
    # piecewise CUDA graphs (the default replays them up to the step's budget, --prefill-len)
    "no_piecewise": {"piecewise_cuda_graph_tokens": 0},
    "fp8_no_piecewise": {"quantization": "fp8", "piecewise_cuda_graph_tokens": 0},
    # a checkpoint stored in FP8 128 × 128 blocks (benchmarks/shapes.CHECKPOINT_FORMATS): the
    # block kernels at every row count (fp8_block.fp8_block_mm)
    "fp8_block": {"checkpoint": "fp8-block"},
    # a mixture of experts' layers at a few tokens through the grouped GEMMs, not the two GEMV
    # launches (ops/fused_moe.GEMV_TOKENS set to 0 in this process): the A/B of that path
    "moe_grouped": {"moe_gemv_tokens": 0},
    "fp8_moe_grouped": {"quantization": "fp8", "moe_gemv_tokens": 0},
    # FP8 experts at one token with their activations quantized by two launches of their own,
    # not inside the GEMVs (ops/moe_gemv.QUANTIZE_TOKENS set to 0): the A/B of that
    "fp8_moe_quantize_apart": {"quantization": "fp8", "moe_quantize_tokens": 0},
}

# the variants' keys that set an attribute in this process for their run, not an engine option
IN_PROCESS: dict[str, tuple[Any, str]] = {
    "moe_gemv_tokens": (fused_moe, "GEMV_TOKENS"),
    "moe_quantize_tokens": (moe_gemv, "QUANTIZE_TOKENS"),
}


def _timed(llm: LLM, ids: list[int], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == max_tokens
    return time.perf_counter() - start


def measure(model: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    engine_args = dict(VARIANTS[variant])
    before = {key: getattr(*IN_PROCESS[key]) for key in engine_args if key in IN_PROCESS}
    for key in before:
        setattr(*IN_PROCESS[key], engine_args.pop(key))
    try:
        return _measure(model, variant, engine_args, args)
    finally:
        for key, value in before.items():
            setattr(*IN_PROCESS[key], value)


def _measure(
    model: str, variant: str, engine_args: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    checkpoint = engine_args.pop("checkpoint", None)
    if checkpoint is not None:  # the shape's config as that format stores it, beside the model
        model = str(write_shape(args.shape, Path(model).parent / checkpoint, checkpoint))
    llm = LLM(
        model=model, load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=4, num_kv_blocks=args.max_model_len // 16 * 2, show_progress=False,
        max_num_batched_tokens=args.prefill_len, enable_prefix_caching=False,  # every token runs
        **engine_args,
    )  # fmt: skip
    info = llm.get_model_info()
    prompt = list(range(1, args.input_len + 1))
    long_prompt = [i % 1000 + 1 for i in range(args.prefill_len)]
    for _ in range(2):  # warm-up: compile kernels, settle the allocator
        _timed(llm, prompt, 8)
        _timed(llm, long_prompt, 1)
    prefill_only = min(_timed(llm, prompt, 1) for _ in range(3))
    whole = min(_timed(llm, prompt, args.output_len) for _ in range(args.repeats))
    ms_step = (whole - prefill_only) / (args.output_len - 1) * 1e3
    long_prefill = min(_timed(llm, long_prompt, 1) for _ in range(3))
    replay_ms = _graph_replay_ms(llm)
    eager = VARIANTS[variant].get("enforce_eager", False)
    kernels = _kernel_table(llm, prompt)[0] if args.profile and eager else None
    prefill_kernels = prefill_host = prefill_span = None
    if args.profile_prefill:
        prefill_kernels, prefill_span = _kernel_table(llm, long_prompt, steps=0)
        prefill_host = _prefill_host_table(llm, long_prompt)
    cost = ModelCost(info, llm.config.model.arch)
    # every weight that multiplies each token (the LM head only the last), and attention over
    # the causal half of the square. (Until 2026-11-30 this counted 2 FLOPs per token for every
    # parameter, the embedding table and the LM head too: 14 % more than run on the 8B shape.)
    n = args.prefill_len
    flops = cost.flops(n, 1, n * (n + 1) // 2)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "variant": variant,
        "decode_ms_per_step": round(ms_step, 3),
        "decode_tok_s": round(1e3 / ms_step, 1),
        "prefill_len": args.prefill_len,
        "prefill_ms": round(long_prefill * 1e3, 2),
        "prefill_TFLOPs": round(flops / long_prefill / 1e12, 1),
        "weight_bytes": info.weight_bytes,
        "read_weight_bytes": cost.read_weight_bytes,
        "graph_replay_ms": replay_ms,  # GPU time of one batch-1 step; the rest is host work
        "kernels": kernels,
        "prefill_kernels": prefill_kernels,
        # the profiled prefill's GPU activity, first start to last end (the rest of its wall
        # time is the host's, before the first launch and after the last kernel)
        "prefill_gpu_span_ms": prefill_span,
        "prefill_host": prefill_host,
    }


def _graph_replay_ms(llm: LLM) -> float | None:
    worker = getattr(llm.client.core.executor, "worker", None)  # type: ignore[attr-defined]
    graphs = worker.runner.graphs if worker is not None else None  # in this process only
    if graphs is None:
        return None
    graph = graphs.graphs[graphs.key(1, [1])]  # the one a short prompt's steps replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / 50, 3)


def _kernel_table(
    llm: LLM, prompt: list[int], steps: int = 16
) -> tuple[list[dict[str, Any]], float]:
    """GPU time per step by kernel, largest first: of ``steps`` decode steps after the prompt
    (eager, so each kernel is visible), or with ``steps=0`` of the prompt's prefill alone
    (outside the decode graphs; a piecewise graph's kernels are seen too); and the profiled
    call's GPU span in ms (``device_span_us``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _timed(llm, prompt, steps + 1)
    rows = kernel_rows(prof, max(steps, 1))[:20]
    table = [{**r, "us_per_step": round(r["us_per_step"], 1),
              "calls_per_step": round(r["calls_per_step"], 1)} for r in rows]  # fmt: skip
    return table, round(device_span_us(prof) / 1e3, 2)


def _prefill_host_table(llm: LLM, prompt: list[int], top: int = 25) -> list[dict[str, Any]]:
    """The host's functions during one long prefill (cProfile, which slows Python calls
    itself), by their own time, largest first: whether the host keeps the GPU fed."""
    import cProfile
    import pstats

    hot = cProfile.Profile()
    hot.runcall(_timed, llm, prompt, 1)
    stats = pstats.Stats(hot).stats  # type: ignore[attr-defined]
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls": calls,
             "own_ms": round(own * 1e3, 2), "cumulative_ms": round(cum * 1e3, 2)}
            for (file, line, name), (_, calls, own, cum, _) in stats.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--variants", nargs="+", default=["graphs", "eager", "unfused"], choices=list(VARIANTS)
    )
    p.add_argument(
        "--profile", action="store_true", help="kernel table of a decode step of each eager variant"
    )
    p.add_argument(
        "--profile-prefill", action="store_true",
        help="kernel table and host profile of one --prefill-len prefill of each variant",
    )  # fmt: skip
    p.add_argument("--output")
    args = p.parse_args()
    device = torch.device("cuda")
    model = str(write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape))
    results: dict[str, Any] = {"shape": args.shape, "args": vars(args)}
    results["variants"] = []
    limits(device, getattr(torch, args.dtype))  # before any engine holds the GPU
    for v in args.variants:
        results["variants"].append(measure(model, v, args))
    bandwidth, peak = limits(device, getattr(torch, args.dtype))  # the best of before and now
    # the roofline: every weight byte once per step; and the bytes a step does read (an
    # untied input-embedding table only by its token's row: 1.05 GB less on the 8B shape)
    roofline_ms = results["variants"][0]["weight_bytes"] / bandwidth * 1e3
    read_ms = results["variants"][0]["read_weight_bytes"] / bandwidth * 1e3
    results.update(
        copy_bandwidth_GBps=round(bandwidth / 1e9, 1),
        matmul_peak_TFLOPs=round(peak / 1e12, 1),
        limits_measured=[
            (round(b / 1e9, 1), round(p / 1e12, 1))
            for b, p in limits_seen(device, getattr(torch, args.dtype))
        ],
        roofline_ms_per_step=round(roofline_ms, 3),
        roofline_tok_s=round(1e3 / roofline_ms, 1),
        read_roofline_ms_per_step=round(read_ms, 3),
        gpu=torch.cuda.get_device_name(device),
    )
    if any(v.startswith("fp8") for v in args.variants):
        fp8_peak = fp8_matmul_peak(device)
        fast_peak = fp8_matmul_peak(device, fast_accumulation=True)
        results["fp8_matmul_peak_TFLOPs"] = round(fp8_peak / 1e12, 1)
        results["fp8_fast_matmul_peak_TFLOPs"] = round(fast_peak / 1e12, 1)
        for v in results["variants"]:
            if v["variant"].startswith("fp8"):
                # each against the peak of its own accumulation
                fast = VARIANTS[v["variant"]].get("fp8_fast_accumulation") is not False
                own = fast_peak if fast else fp8_peak
                v["fraction_of_fp8_matmul_peak"] = round(v["prefill_TFLOPs"] * 1e12 / own, 3)
    for v in results["variants"]:
        # each variant against the bytes its own step reads (an FP8 model's are its own)
        own_ms = v["read_weight_bytes"] / bandwidth * 1e3
        v["fraction_of_own_read_roofline"] = round(own_ms / v["decode_ms_per_step"], 3)
        v["fraction_of_roofline"] = round(roofline_ms / v["decode_ms_per_step"], 3)
        v["fraction_of_read_roofline"] = round(read_ms / v["decode_ms_per_step"], 3)
        v["fraction_of_matmul_peak"] = round(v["prefill_TFLOPs"] * 1e12 / peak, 3)
    print(json.dumps(results, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
