"""Offline throughput: N prompts of random token ids with random input/output lengths (the
nano-vllm workload: 256 sequences, lengths uniform in [100, 1024], ignore_eos), reporting output
tokens/s. ``--compare-hf`` runs Hugging Face ``generate`` on the same prompts in the same process
and prints the ratio.

HF cannot stop sequences of one batch at different lengths when EOS is ignored, so it runs
batches of ``--hf-batch-size`` prompts (left-padded) for the longest requested output of the
batch; only the requested tokens count as its output, as for Baton.

    python benchmarks/throughput.py --model tiny-model --num-prompts 32 --max-len 256 --compare-hf
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton import LLM, EngineArgs, SamplingParams
from benchmarks.roofline import ModelCost, limits, limits_seen


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    lo, hi = args.min_len, args.max_len
    prompts = [
        [rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(lo, hi))]
        for _ in range(args.num_prompts)
    ]
    outputs = [rng.randint(lo, hi) for _ in range(args.num_prompts)]
    return prompts, outputs


def run_baton(
    args: argparse.Namespace, async_scheduling: bool | None = None
) -> tuple[dict[str, Any], list[list[int]], list[int]]:
    llm = LLM(
        async_scheduling=async_scheduling,
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_model_len=2 * args.max_len + 8,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,  # random prompts share nothing; measure the engine itself
        seed=args.seed,
        multiprocess=not args.inproc,  # detokenization overlaps the core's next step
        show_progress=False,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        distributed_executor_backend=getattr(args, "executor", None),
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        fp8_fast_accumulation=getattr(args, "fp8_fast_accumulation", None),
        piecewise_cuda_graph_tokens=getattr(args, "piecewise_cuda_graph_tokens", None),
    )
    prompts, out_lens = make_workload(args, llm.config.model.arch.vocab_size)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:2], params[:2], use_tqdm=False)  # warm-up
    trace = StepTrace(llm.client.core.scheduler) if args.step_trace else None  # type: ignore[attr-defined]
    before = llm.get_stats()
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    end = time.perf_counter()
    elapsed = end - start
    after, info = llm.get_stats(), llm.get_model_info()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), "every request must produce exactly max_tokens"
    cost = ModelCost(info, llm.config.model.arch)
    llm.shutdown()
    device, dtype = torch.device(info.device), getattr(torch, info.dtype)
    bandwidth, peak = limits(device, dtype)  # the best of this and the one before the engine
    result = _result("baton", produced, sum(map(len, prompts)), elapsed)
    # what ran, as the engine says it (an FP8 model's layers, the KV cache's element type)
    result.update(quantization=info.quantization, kv_cache_dtype=info.kv_cache_dtype,
                  piecewise_graph_sizes=list(llm.config.device.piecewise_graph_sizes))  # fmt: skip
    result.update(_bounds(before, after, cost, elapsed, produced, bandwidth, peak))
    result["copy_bandwidth_GBps_measured"] = [
        round(b / 1e9, 1) for b, _ in limits_seen(device, dtype)
    ]
    if trace is not None:
        result["step_trace"] = trace.summary(end, cost, bandwidth, peak)
    return result, prompts, out_lens


class StepTrace:
    """Each step of an in-process engine, recorded as the scheduler makes it: rows, tokens,
    sampled rows, context read, query–key pairs, and when. A step's time is taken as the time
    to the next step's scheduling, which in steady state is one step of the device."""

    def __init__(self, scheduler: Any) -> None:
        self.steps: list[tuple[float, int, int, int, int, int, bool]] = []
        inner = scheduler.schedule

        def schedule() -> Any:
            out = inner()
            if out.total_num_scheduled_tokens:
                self.steps.append((time.perf_counter(), *self._count(scheduler, out)))
            return out

        scheduler.schedule = schedule

    @staticmethod
    def _count(scheduler: Any, out: Any) -> tuple[int, int, int, int, int, bool]:
        tokens = sampled = context = pairs = 0
        prefill = False
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            stop = request.num_computed_tokens  # already advanced by this step
            begin = stop - n
            tokens += n
            sampled += stop >= request.num_prompt_tokens
            context += stop
            pairs += n * begin + n * (n + 1) // 2  # causal: query i sees begin + i + 1 keys
            prefill |= n > 1
        return len(out.num_scheduled_tokens), tokens, sampled, context, pairs, prefill

    def summary(self, end: float, cost: ModelCost, bandwidth: float, peak: float) -> dict[str, Any]:
        """Per kind of step (prefill or mixed; decode by batch size): seconds, and the time the
        machine needs at least: bytes ÷ copy bandwidth, and the per-step roofline
        max(bytes read ÷ bandwidth, FLOPs ÷ matmul peak), and the serial bound (the linear
        layers at their roofline, then attention at its own: ``ModelCost.serial_seconds``).
        ``memory_bound_fraction_at_serial_bound`` is the most of the memory bound a run of
        these steps can reach when each runs at its serial bound."""
        keys = ("steps", "seconds", "memory_s", "roofline_s", "serial_s")
        bins: dict[str, dict[str, float]] = {}
        times = [s[0] for s in self.steps] + [end]
        for (t, rows, tokens, sampled, context, pairs, prefill), t_next in zip(
            self.steps, times[1:], strict=True
        ):
            kind = "prefill or mixed" if prefill else _batch_bin(rows)
            b = bins.setdefault(kind, dict.fromkeys(keys, 0.0))
            b["steps"] += 1
            b["seconds"] += t_next - t
            b["memory_s"] += cost.must_read_bytes(context, rows) / bandwidth
            b["roofline_s"] += max(
                cost.read_bytes(context, rows, tokens) / bandwidth,
                cost.flops(tokens, sampled, pairs) / peak,
            )
            b["serial_s"] += cost.serial_seconds(tokens, sampled, context, pairs, bandwidth, peak)
        total = {k: sum(b[k] for b in bins.values()) for k in keys}
        out: dict[str, Any] = {"copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
                               "matmul_peak_TFLOPs": round(peak / 1e12, 1)}  # fmt: skip
        for kind, b in [*sorted(bins.items()), ("all", total)]:
            out[kind] = {
                "steps": int(b["steps"]),
                "seconds": round(b["seconds"], 3),
                # three significant digits: a tiny model on a CPU is at 1e-4 of its bounds
                "memory_bound_fraction": _sig(b["memory_s"] / b["seconds"]),
                "roofline_fraction": _sig(b["roofline_s"] / b["seconds"]),
                "serial_bound_fraction": _sig(b["serial_s"] / b["seconds"]),
                "memory_bound_fraction_at_serial_bound": _sig(b["memory_s"] / b["serial_s"]),
            }
        return out


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def _batch_bin(rows: int) -> str:
    for top in (16, 64, 128, 192):
        if rows <= top:
            return f"decode, <= {top} rows"
    return "decode, > 192 rows"


def _bounds(
    before: Any,
    after: Any,
    cost: ModelCost,
    elapsed: float,
    sampled: int,
    bandwidth: float,
    peak: float,
) -> dict[str, Any]:
    """The run against the machine: every step must read all weights plus the KV cache of every
    scheduled request (the issue's bound); an untied input-embedding table is in fact read only
    by the rows of its tokens (``read_`` figures). Every token costs 2 FLOPs per weight that
    multiplies it."""
    steps = after.num_steps - before.num_steps
    model_s = after.model_seconds - before.model_seconds
    kv_tokens = after.context_tokens_read - before.context_tokens_read
    tokens = after.computed_tokens - before.computed_tokens
    # summed over steps: each step's weights, plus the KV of its context
    # (a recurrent state is read and written once a sampled row, about once a request a step)
    kv = kv_tokens * cost.kv_bytes_per_token + sampled * cost.state_bytes
    must_read = steps * cost.must_read_bytes(0, 0) + kv
    read = steps * cost.read_bytes(0, 0) + kv  # (one token's experts a step: a floor for MoE)
    flops = cost.flops(tokens, sampled, 0)  # the weights' FLOPs; attention's not counted
    return {
        "steps": steps,
        "model_seconds": round(model_s, 3),  # inside the executor; the rest is host work
        "model_time_fraction": round(model_s / elapsed, 3),
        "bytes_must_read": must_read,
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),  # the best measured, see limits()
        "memory_bound_fraction": round(must_read / bandwidth / elapsed, 3),
        "read_bytes_must_read": read,
        "read_memory_bound_fraction": round(read / bandwidth / elapsed, 3),
        "matmul_peak_TFLOPs": round(peak / 1e12, 3),
        "weight_TFLOPs_achieved": round(flops / elapsed / 1e12, 4),
        "matmul_peak_fraction": round(flops / elapsed / peak, 3),
    }


def run_hf(
    args: argparse.Namespace, prompts: list[list[int]], out_lens: list[int]
) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if args.device in ("cuda", "auto") and torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):  # random init on the GPU: an 8B model on the host takes minutes
        if args.load_format == "dummy":
            config = AutoConfig.from_pretrained(args.model)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model = model.to(device).eval()
    pad = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch, lens = prompts[i : i + args.hf_batch_size], out_lens[i : i + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=True,
                temperature=0.6,
                pad_token_id=pad,
            )
    elapsed = time.perf_counter() - start
    return _result("hf", sum(out_lens), sum(map(len, prompts)), elapsed)


def _result(name: str, out_tokens: int, in_tokens: int, elapsed: float) -> dict[str, Any]:
    return {
        "engine": name,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 2),
        "total_tok_s": round((out_tokens + in_tokens) / elapsed, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--inproc", action="store_true", help="run the engine core in this process")
    p.add_argument(
        "--step-trace",
        action="store_true",
        help="record every step (implies --inproc) and report the time and the machine's bound "
        "per kind of step",
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="run HF on the first N of the same prompts only (its rate is per batch; a GPU "
        "run of all 256 takes many minutes)",
    )
    p.add_argument(
        "--compare-sync",
        action="store_true",
        help="also run the engine one step at a time (async scheduling off), in this process",
    )
    p.add_argument("--shape", help="a model shape from benchmarks/shapes.py instead of --model")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument(
        "--checkpoint", choices=["fp8-block"], default=None,
        help="with --shape: the shape's config as an FP8 checkpoint of this format stores it "
        "(benchmarks/shapes.CHECKPOINT_FORMATS)",
    )  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument(
        "--fp8-fast-accumulation", action=argparse.BooleanOptionalAction,
        help="FP8: batched products without float32 promotion (default: on)",
    )  # fmt: skip
    p.add_argument(
        "--piecewise-cuda-graph-tokens", type=int, default=None,
        help="steps of up to N tokens outside the decode graphs replay piecewise CUDA graphs "
        "(0: none; default: the engine's)",
    )  # fmt: skip
    p.add_argument(
        "--executor", choices=["uni", "mp", "ray"], default=None,
        help="how the ranks run (default: uni at TP=1, mp above); mp at TP=1 measures what the "
        "multiprocess executor costs",
    )  # fmt: skip
    p.add_argument("--output", help="write the results as JSON here")
    args = p.parse_args()
    if args.shape:
        import tempfile

        from benchmarks.shapes import write_shape

        tmp = Path(tempfile.mkdtemp()) / args.shape
        args.model = str(write_shape(args.shape, tmp, args.checkpoint))
        args.load_format = "dummy"
    if not args.model:
        p.error("give --model or --shape")
    args.inproc = args.inproc or args.step_trace
    config = EngineArgs(model=args.model, dtype=args.dtype, device=args.device)
    resolved = config.create_engine_config()
    limits(torch.device(resolved.device.device), getattr(torch, resolved.model.dtype))  # no engine

    baton, prompts, out_lens = run_baton(args)
    results = {"workload": vars(args), "baton": baton, "torch_threads": torch.get_num_threads()}
    print(json.dumps(baton))
    if args.compare_sync:
        sync, _, _ = run_baton(args, async_scheduling=False)
        results["baton_sync"] = sync
        print(json.dumps({"async_scheduling": False, **sync}))
        results["ratio_async_over_sync"] = round(baton["output_tok_s"] / sync["output_tok_s"], 3)
        print(f"async / sync scheduling output tokens/s: {results['ratio_async_over_sync']}x")
    if args.compare_hf:
        k = args.hf_num_prompts or len(prompts)
        hf = run_hf(args, prompts[:k], out_lens[:k])
        hf["num_prompts"] = k
        print(json.dumps(hf))
        results["hf"] = hf
        results["ratio_output_tok_s"] = round(baton["output_tok_s"] / hf["output_tok_s"], 2)
        print(f"baton / hf output tokens/s: {results['ratio_output_tok_s']}x")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
