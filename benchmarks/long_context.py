"""Long context, each attention backend in one run: prefill of one prompt of each ``--lengths``
(the whole prompt in one step, one output token) as milliseconds and TFLOP/s, attention's own
TFLOP/s on the same prompt outside the model (``kernels.attention_sweep.prefill_case``: the same
kernel call on a paged cache of the same shape), and decode at ``--decode-context`` tokens of
context for each ``--decode-batches`` as ms/step against the bandwidth bound of what a step
must read: the weights once and every request's KV.

TFLOP/s are counted as ``benchmarks/latency.py`` counts them: every weight that multiplies each
token (the LM head only the sampled row) and causal attention over half the square.

    python benchmarks/long_context.py --shape llama-3.1-8b --variants triton flash_attn \\
        flash_attn_p128

Variants are an attention backend and a KV page size (``_p128``: 128-token pages). Decode runs
the same Triton kernel for every backend, so it is measured for the variants listed in
``--decode-variants`` only. The decode prompts are computed once (a warm-up that fills the
prefix cache) and then hit that cache, so a decode measurement pays one block of prefill per
request, not the whole prompt; that block is timed alone and taken off.
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
from benchmarks.kernels.attention_sweep import prefill_case, prefill_ms
from benchmarks.profiling import device_span_us, kernel_rows
from benchmarks.roofline import ModelCost, limits
from benchmarks.shapes import write_shape
from services.worker.engine.config import state_block_size
from services.worker.engine.kv_cache.groups import KVCacheGroups
from services.worker.engine.model_config import load_arch_config

VARIANTS: dict[str, dict[str, Any]] = {
    "triton": {"attention_backend": "triton"},
    "flash_attn": {"attention_backend": "flash_attn"},
    "triton_p128": {"attention_backend": "triton", "block_size": 128},
    # an FP8 (e4m3) KV cache; with FP8 weights too
    "triton_fp8kv": {"attention_backend": "triton", "kv_cache_dtype": "fp8"},
    "fp8_fp8kv": {"attention_backend": "triton", "kv_cache_dtype": "fp8", "quantization": "fp8"},
    # FP8 weights over a bf16 cache: a 27B hybrid's 32k batch beside its weights on one 80 GB GPU
    "fp8": {"attention_backend": "triton", "quantization": "fp8"},
    "flash_attn_p128": {"attention_backend": "flash_attn", "block_size": 128},
    # flash_attn, its result copied into the step's output (the public wrapper) instead of
    # written in place: the A/B of FlashAttnBackend.WRITE_IN_PLACE
    "flash_attn_copy": {"attention_backend": "flash_attn"},
}


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return time.perf_counter() - start


def _hit_run(llm: LLM, prompts: list[list[int]], max_tokens: int, hit_tokens: list[int]) -> float:
    """``_generate``, its prefix-cache hits (tokens) appended to ``hit_tokens``."""
    before = llm.get_stats().prefix_hit_tokens
    seconds = _generate(llm, prompts, max_tokens)
    hit_tokens.append(llm.get_stats().prefix_hit_tokens - before)
    return seconds


def _prompt(n: int, seed: int) -> list[int]:
    """``n`` tokens no other seed's prompt shares a block with (its first token differs)."""
    return [seed + 1] + [(seed * 7919 + i) % 30000 + 1 for i in range(n - 1)]


def _isolated_attention(llm: LLM, n: int, block_size: int) -> dict[str, Any]:
    """The engine's own backend object for layer 0, timed on its own over a paged cache (none
    for latent attention: its prefill decompresses the latents first, timed in the model); its
    FLOPs the keys each query sees, under layer 0's window where it has one."""
    arch = llm.config.model.arch
    if arch.mla is not None:
        return {}
    args = argparse.Namespace(
        layers=len(llm.client.core.executor.worker.runner.model.attention_layers()),  # type: ignore[attr-defined]
        kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        heads=arch.num_heads,
    )  # fmt: skip
    impl = llm.client.core.executor.worker.runner.model.attention_layers()[0].attn  # type: ignore[attr-defined]
    q, meta, cache = prefill_case(n, args, block_size, torch.device("cuda"))
    out = torch.empty_like(q)
    ms = prefill_ms(impl, q, cache, meta, out)
    w = min(impl.sliding_window or n, n)  # (a windowed layer 0, gpt-oss's: the keys it sees)
    visible = w * (w + 1) // 2 + (n - w) * w  # Σ min(i + 1, W) over the queries
    flops = 4 * arch.head_dim * arch.num_heads * visible
    del q, meta, cache, out
    torch.cuda.empty_cache()
    return {"attention_layer_ms": round(ms, 3), "attention_TFLOPs": round(flops / ms / 1e9, 1),
            "attention_window": impl.sliding_window}  # fmt: skip


def measure(model: str, variant: str, args: argparse.Namespace, decode: bool) -> dict[str, Any]:
    from services.worker.engine.attention.flash_attn_backend import FlashAttnBackend

    FlashAttnBackend.WRITE_IN_PLACE = variant != "flash_attn_copy"  # this process's engine
    spec = VARIANTS[variant]
    # (a model with recurrent layers: the block size the engine raises it to)
    bs = state_block_size(load_arch_config(model), spec.get("block_size", 16), 1, 2)
    top = max([*args.lengths, args.decode_context])
    max_len = top + 2 * bs + args.decode_steps
    batches = args.decode_batches if decode else []
    reqs = max([1, *batches])
    # every request's blocks in every KV cache group at once, and for each recurrent group two
    # checkpoints besides (the one a repeat of the prompt resumes from, and the one its decode
    # leaves at the next boundary): with less, one request's new pages evict another's
    # checkpoint, and a repeat recomputes its whole prompt
    groups = KVCacheGroups.plan(load_arch_config(model).layer_cache_kinds())
    checkpoints = 2 * sum(g.recurrent for g in groups.groups)
    per_request = groups.blocks_per_request(max_len, bs) + checkpoints
    # (and a prompt computed in one step: a windowed group holds its blocks under the whole chunk)
    blocks = reqs * per_request + 2 * groups.blocks_per_request(top, bs, chunk=top) + 16
    llm = LLM(
        model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_len,
        max_num_seqs=reqs, num_kv_blocks=blocks, show_progress=False,
        max_num_batched_tokens=top, enable_prefix_caching=True, **spec,
    )  # fmt: skip
    info = llm.get_model_info()
    cost = ModelCost(info, llm.config.model.arch)
    seed = iter(range(1, 1 << 20))
    for n in args.lengths:  # warm-up: compile kernels, settle the allocator
        _generate(llm, [_prompt(n, next(seed))], 1)
    prefill = []
    for n in args.lengths:
        seconds = min(_generate(llm, [_prompt(n, next(seed))], 1) for _ in range(args.repeats))
        flops = cost.flops(n, 1, n * (n + 1) // 2)
        prefill.append({
            "prompt": n, "ms": round(seconds * 1e3, 2),
            "TFLOPs": round(flops / seconds / 1e12, 1),
            **_isolated_attention(llm, n, bs),
        })  # fmt: skip
        if args.profile:
            prefill[-1].update(_kernel_table(llm, _prompt(n, next(seed))))
        print(variant, json.dumps({k: v for k, v in prefill[-1].items() if k != "kernels"}),
              flush=True)  # fmt: skip
    rows = []
    ctx = args.decode_context
    for batch in batches:
        prompts = [_prompt(ctx, next(seed)) for _ in range(batch)]
        _generate(llm, prompts, 1)  # computes the prompts and leaves them in the prefix cache
        hit_tokens: list[int] = []
        hits = [_hit_run(llm, prompts, 1, hit_tokens) for _ in range(2)]  # the last block
        wholes = [_hit_run(llm, prompts, 1 + args.decode_steps, hit_tokens) for _ in range(2)]
        hit, whole = min(hits), min(wholes)
        # each run must hit all but the prompts' last blocks, or it timed a prefill too
        if min(hit_tokens) < batch * (ctx - 2 * bs):
            print(f"warning: a run recomputed prompts (hit tokens {hit_tokens})", flush=True)
        ms = (whole - hit) / args.decode_steps * 1e3
        context = batch * (ctx + args.decode_steps // 2)  # the mean context over the steps
        must_read = cost.read_bytes(context, batch)
        rows.append({
            "batch": batch, "context": ctx, "ms_per_step": round(ms, 3),
            "tok_s": round(batch * 1e3 / ms, 1), "read_GB_per_step": round(must_read / 1e9, 2),
            "kv_GB_per_step": round(context * cost.kv_bytes_per_token / 1e9, 2),
            "_read_bytes": must_read,
            # every run, s: the figure is a difference of the two minima
            "hit_runs_s": [round(t, 4) for t in hits],
            "whole_runs_s": [round(t, 4) for t in wholes],
            "hit_tokens_per_run": hit_tokens,  # (the two hit runs, the two whole runs)
        })  # fmt: skip
        print(variant, json.dumps(rows[-1]), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "variant": variant, "block_size": bs, "prefill": prefill, "decode": rows,
    }  # fmt: skip


def _kind(kernel: str) -> str:
    """A kernel's share of the step: attention (FlashAttention's or our ``_prefill``), the
    matrix products (cuBLAS, CUTLASS), or the rest (norms, rotary, SiLU·mul, sampling...)."""
    name = kernel.lower()
    if "flash" in name or name.startswith("_prefill"):
        return "attention"
    if any(s in name for s in ("nvjet", "gemm", "xmma", "cutlass")):
        return "matmul"
    return "other"


def _kernel_table(llm: LLM, prompt: list[int]) -> dict[str, Any]:
    """GPU time of one prefill by kernel, largest first, and summed by kind, beside the GPU's
    span from its first kernel to its last: where the step goes besides attention and the
    matrix products."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _generate(llm, [prompt], 1)
    rows = kernel_rows(prof)
    by_kind = dict.fromkeys(("matmul", "attention", "other"), 0.0)
    for r in rows:
        by_kind[_kind(r["kernel"])] += r["us_per_step"] / 1e3
    return {
        "gpu_span_ms": round(device_span_us(prof) / 1e3, 2),
        "kernel_ms": {k: round(v, 2) for k, v in by_kind.items()},
        "kernels": [{**r, "us_per_step": round(r["us_per_step"], 1),
                     "calls_per_step": round(r["calls_per_step"], 1)} for r in rows[:24]],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--variants", nargs="+", default=["triton", "flash_attn"], choices=VARIANTS)
    p.add_argument("--decode-variants", nargs="*", default=None, help="default: the first")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    p.add_argument("--decode-context", type=int, default=32768)
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16])
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--profile", action="store_true", help="each prefill once more, profiled: kernels by kind"
    )
    p.add_argument("--output")
    args = p.parse_args()
    decode_variants = args.variants[:1] if args.decode_variants is None else args.decode_variants
    device = torch.device("cuda")
    model = str(write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape))
    limits(device, torch.bfloat16)  # before any engine holds the GPU
    results: dict[str, Any] = {"shape": args.shape, "args": vars(args), "variants": []}
    for v in args.variants:
        results["variants"].append(measure(model, v, args, v in decode_variants))
    bandwidth, peak = limits(device, torch.bfloat16)
    for v in results["variants"]:
        for row in v["prefill"]:
            row["fraction_of_matmul_peak"] = round(row["TFLOPs"] * 1e12 / peak, 3)
        for row in v["decode"]:
            bound_ms = row.pop("_read_bytes") / bandwidth * 1e3
            row["bound_ms_per_step"] = round(bound_ms, 3)
            row["fraction_of_bandwidth_bound"] = round(bound_ms / row["ms_per_step"], 3)
    results.update(
        copy_bandwidth_GBps=round(bandwidth / 1e9, 1),
        matmul_peak_TFLOPs=round(peak / 1e12, 1),
        gpu=torch.cuda.get_device_name(device),
    )
    print(json.dumps(results, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
