"""What the executors cost: batch-1 decode ms/step and a batch's output tokens/s for each way
of running the ranks, engines built one after another in this process and measured in turn,
round after round (A B C A B C ...), so the ratios are side by side.

    uni      UniprocExecutor: the one rank inside the engine core (the TP=1 default)
    mp       MultiprocExecutor at TP=1: the same rank in a process of its own (the messages'
             cost: the issue's bound is 2 % against uni)
    mp-tp2   MultiprocExecutor at TP=2 (gloo on CPU, NCCL on GPUs)
    ray-tp2  RayExecutor at TP=2 (a local Ray)

    python benchmarks/executors.py --model tiny-model --device cpu
    python benchmarks/executors.py --shape llama-3.1-8b --variants uni mp    # the H200
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton import LLM, SamplingParams
from benchmarks.shapes import write_shape

VARIANTS: dict[str, dict[str, Any]] = {
    "uni": {"distributed_executor_backend": "uni"},
    "mp": {"distributed_executor_backend": "mp"},
    "mp-tp2": {"distributed_executor_backend": "mp", "tensor_parallel_size": 2},
    "ray-tp2": {"distributed_executor_backend": "ray", "tensor_parallel_size": 2},
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return time.perf_counter() - start


def one_round(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    prompt = [list(range(1, args.input_len + 1))]
    first = min(_generate(llm, prompt, 1) for _ in range(3))
    whole = _generate(llm, prompt, args.output_len)
    batch = [[(i * 7 + j) % 500 + 1 for j in range(args.input_len)] for i in range(args.batch)]
    batch_s = _generate(llm, batch, args.output_len)
    return {
        "decode_ms_per_step": (whole - first) / (args.output_len - 1) * 1e3,
        "batch_tok_s": args.batch * args.output_len / batch_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a checkpoint directory (or --shape, dummy weights)")
    p.add_argument("--shape")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--variants", nargs="+", default=["uni", "mp", "mp-tp2"], choices=VARIANTS)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output")
    args = p.parse_args()
    extra: dict[str, Any] = {}
    if args.shape:
        args.model = str(write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape))
        extra["load_format"] = "dummy"
    if not args.model:
        p.error("give --model or --shape")
    if "ray-tp2" in args.variants:
        import os

        import ray

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ray.init(include_dashboard=False, log_to_driver=False)
    if args.device != "cpu" and torch.cuda.is_available():
        # every engine is alive at once (alternating rounds): each sizes its KV cache for the
        # batch, not from the free memory (which the engines before it hold)
        per_request = -(-(args.input_len + args.output_len + 16) // 16)
        extra["num_kv_blocks"] = 2 * args.batch * per_request
    engines = {
        v: LLM(model=args.model, device=args.device, max_model_len=args.input_len +
               args.output_len + 16, enable_prefix_caching=False, show_progress=False,
               **extra, **VARIANTS[v])
        for v in args.variants
    }  # fmt: skip
    for llm in engines.values():  # warm-up: compile, settle the allocator
        one_round(llm, argparse.Namespace(**{**vars(args), "output_len": 8}))
    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in engines}
    for _ in range(args.rounds):
        for v, llm in engines.items():
            rounds[v].append(one_round(llm, args))
    results: dict[str, Any] = {"args": vars(args), "torch_threads": torch.get_num_threads()}
    base = None
    for v, runs in rounds.items():
        ms = statistics.median(r["decode_ms_per_step"] for r in runs)
        tok_s = statistics.median(r["batch_tok_s"] for r in runs)
        base = base or (ms, tok_s)
        results[v] = {
            "decode_ms_per_step": round(ms, 3),
            "batch_tok_s": round(tok_s, 1),
            "decode_ms_vs_first": round(ms / base[0], 3),
            "batch_tok_s_vs_first": round(tok_s / base[1], 3),
            "rounds": [{k: round(x, 3) for k, x in r.items()} for r in runs],
        }
    for llm in engines.values():
        llm.shutdown()
    print(json.dumps({k: v for k, v in results.items() if k != "args"}, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
