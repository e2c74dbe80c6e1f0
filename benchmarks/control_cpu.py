"""CPU each service spends per request: sequential streamed completions (one token each,
or ``--max-tokens``) through
``baton serve`` (one colocated worker), each process's user + system time read from /proc
before and after (Linux).

This machine's speed drifts by tens of percent within minutes, and every process's CPU per
request moves with it. The global scheduler does the same work per request whatever the
gateway and the worker do, so its CPU per request is the yardstick: compare the other
services in scheduler-units between runs of two versions, alternating.

    python benchmarks/control_cpu.py --model tiny-model --requests 2000
"""

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import client

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


async def drive(
    url: str, model: str, n: int, prompt_len: int, vocab: int, seed: int, max_tokens: int = 1
) -> float:
    rng = random.Random(seed)
    async with client(60) as http:
        start = time.perf_counter()
        for _ in range(n):
            ids = [rng.randrange(300, vocab) for _ in range(prompt_len)]
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            async with http.post(f"{url}/completions", json=body) as resp:
                async for _ in resp.content:  # to the end: the connection is reused
                    pass
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1, help="tokens per request, streamed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    from baton.serving import serving
    from services.worker.engine.model_config import load_arch_config

    vocab = load_arch_config(args.model).vocab_size
    model = Path(args.model).name
    with serving("--model", args.model, "--workers", "1") as cluster:
        assert cluster.url is not None
        pids = {name: proc.pid for name, proc in cluster.procs.items()}
        (core,) = children(pids["worker-0"])  # the worker's engine core process
        pids["engine-core"] = core

        def run(n: int, seed: int) -> float:
            url = cluster.url
            assert url is not None
            return asyncio.run(drive(url, model, n, args.prompt_len, vocab, seed, args.max_tokens))

        run(args.warmup, args.seed)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        seconds = run(args.requests, args.seed + 1)
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    per_request = {n: 1e3 * (after[n] - before[n]) / args.requests for n in pids}
    yardstick = per_request["scheduler"]
    result = {
        "requests": args.requests,
        "requests_per_s": round(args.requests / seconds, 1),
        "cpu_ms_per_request": {n: round(v, 3) for n, v in per_request.items()},
        "scheduler_units": {n: round(v / yardstick, 3) for n, v in per_request.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **result}, indent=2))


if __name__ == "__main__":
    main()
