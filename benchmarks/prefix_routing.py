"""Prefix-aware routing against round-robin on a multi-turn workload, in one run.

``--conversations`` conversations of ``--turns`` turns share one system prompt; turn t's prompt
is the system prompt plus every earlier user message and reply plus the new user message (the
replies are fixed token strings standing in for the model's, so every prompt is known in
advance). Each policy gets a fresh cluster of ``--workers`` workers; conversations run
concurrently, turns in order. Reported per policy: prompt tokens the engines served from their
prefix caches as a fraction of the **oracle** (for each request, the full blocks of its prompt
that some request sent before it had in its own prompt, capped as the engine caps a hit), and
TTFT p50/p99. Writes JSON and a PNG.

Policies: ``cache-aware`` (the default: prefix + queue + kv_usage, with pending entries),
``events-only`` (the same without pending entries: the directory learns of blocks from KV
events alone, as before pending entries existed) and ``round-robin``.

``--doc-len`` gives each conversation's first message a document of its own (what makes a
conversation's prefix worth following); ``--conversation-rate`` and ``--think-ms`` spread the
load over time (default: all conversations at once, no pause: each turn is sent as soon as the
previous answer is back); ``--burst K`` sends each turn as K requests at once, K questions over
the same history (``n`` parallel requests, an agent's tool calls), the conversation going on
from the first.

    make bench-prefix   # the three workloads below, 4 workers, each under the three policies
    python benchmarks/prefix_routing.py --model bench-model --workers 4 --doc-len 1024 \
        --conversation-rate 1 --think-ms 1000 --num-kv-blocks 2048 --name think-1s
    ... --think-ms 0 --name zero-think;   ... --think-ms 0 --burst 4 --name burst-4
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.block_hash import hash_blocks

POLICIES = {
    "cache-aware": None,  # the default policy: prefix + queue + kv_usage, pending entries
    "events-only": {"pending": {"ttl_s": 0}},  # the same, waiting for KV events
    "round-robin": {"filters": ["role", "healthy"], "picker": "round_robin"},
}


def conversations(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(300, vocab) for _ in range(n)]

    system = tokens(args.system_len)
    convs = []
    for _ in range(args.conversations):
        history, turns = system + tokens(args.doc_len), []
        for _ in range(args.turns):
            asks = [tokens(args.user_len) for _ in range(args.burst)]
            turns.append([history + ask for ask in asks])  # the burst: K questions at once
            history += asks[0] + tokens(args.reply_len)  # the first's reply carries on
        convs.append(turns)
    return convs


async def run_policy(
    url: str, model: str, convs: list[list[list[list[int]]]], block: int, args: argparse.Namespace
) -> dict:
    seen: set[bytes] = set()  # block hashes of every prompt sent so far
    records: list[dict[str, float]] = []

    async def one(http: httpx.AsyncClient, ids: list[int]) -> None:
        hashes = hash_blocks(ids, block)
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        oracle = min(matched, (len(ids) - 1) // block) * block
        seen.update(hashes)
        body = {
            "model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        start, ttft, cached = time.perf_counter(), None, 0
        async with http.stream("POST", "/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                elif chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
        records.append({"ttft": ttft or float("nan"), "cached": cached, "oracle": oracle,
                        "prompt": len(ids)})  # fmt: skip

    async def conversation(
        http: httpx.AsyncClient, turns: list[list[list[int]]], at: float
    ) -> None:
        await asyncio.sleep(at)
        for turn, burst in enumerate(turns):
            if turn and args.think_ms:
                await asyncio.sleep(args.think_ms / 1e3)  # the user reads, then types
            await asyncio.gather(*(one(http, ids) for ids in burst))

    rng = random.Random(args.seed + 1)
    starts, t = [], 0.0
    for _ in convs:  # conversations arrive as a Poisson process (all at once: inf)
        starts.append(t)
        if args.conversation_rate != float("inf"):
            t += rng.expovariate(args.conversation_rate)

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(
            *(conversation(http, p, at) for p, at in zip(convs, starts, strict=True))
        )
        duration = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in records)
    cached, oracle = sum(r["cached"] for r in records), sum(r["oracle"] for r in records)
    return {
        "requests": len(records),
        "duration_s": duration,
        "prompt_tokens": sum(r["prompt"] for r in records),
        "cached_tokens": cached,
        "oracle_tokens": oracle,
        "fraction_of_oracle": cached / oracle if oracle else float("nan"),
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "_ttfts": ttfts,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    a.bar(names, [100 * results[n]["fraction_of_oracle"] for n in names])
    a.set_ylabel("cached tokens, % of the oracle")
    for n in names:
        xs = [1e3 * t for t in results[n]["_ttfts"]]
        b.plot(xs, [i / max(len(xs) - 1, 1) for i in range(len(xs))], label=n)
    b.set_xscale("log")
    b.set_xlabel("TTFT (ms)")
    b.set_ylabel("CDF")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--doc-len", type=int, default=0, help="a per-conversation context at turn 1")
    p.add_argument(
        "--conversation-rate",
        type=float,
        default=float("inf"),
        help="conversations start as a Poisson process at this rate (per second)",
    )
    p.add_argument("--think-ms", type=float, default=0.0, help="pause before each next turn")
    p.add_argument("--burst", type=int, default=1, help="requests sent at once per turn")
    p.add_argument("--name", default="prefix_routing", help="stem of the JSON and PNG files")
    p.add_argument("--user-len", type=int, default=48)
    p.add_argument("--reply-len", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results")
    args = p.parse_args()

    from baton.serving import serving
    from services.worker.engine.model_config import load_arch_config

    arch = load_arch_config(args.model)
    convs = conversations(args, arch.vocab_size)
    longest = max(len(ids) for c in convs for ids in c[-1]) + 4
    if longest > arch.max_position_embeddings:
        limit = arch.max_position_embeddings
        p.error(f"prompts reach {longest} tokens but {args.model} takes {limit}: remake it "
                "(make clean; make bench-prefix)")  # fmt: skip
    results: dict[str, Any] = {}
    for name, policy in POLICIES.items():
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(policy or {}, f)
        flags = ["--model", args.model, "--workers", str(args.workers),
                 "--num-kv-blocks", str(args.num_kv_blocks)]  # fmt: skip
        if policy is not None:
            flags += ["--routing-policy", f.name]
        with serving(*flags) as cluster:
            results[name] = asyncio.run(
                run_policy(cluster.url, Path(args.model).name, convs, 16, args)
            )
        print(name, {k: v for k, v in results[name].items() if not k.startswith("_")}, flush=True)
    aware, rr = results["cache-aware"], results["round-robin"]
    summary = {
        "ttft_p50_speedup": rr["ttft_p50_ms"] / aware["ttft_p50_ms"],
        "ttft_p50_speedup_over_events_only": results["events-only"]["ttft_p50_ms"]
        / aware["ttft_p50_ms"],
        **{f"cached_fraction_{n.replace('-', '_')}": r["fraction_of_oracle"]
           for n, r in results.items()},
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / f"{args.name}.png")
    clean = {n: {k: v for k, v in r.items() if k[0] != "_"} for n, r in results.items()}
    (out / f"{args.name}.json").write_text(
        json.dumps({"args": vars(args), "results": clean, "summary": summary}, indent=2)
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
