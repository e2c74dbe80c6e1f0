"""Where a request's time goes on its way through the services: one request at a time through
``baton serve`` (one colocated worker), every service run with ``BATON_HOP_TRACE=1``
(``shared/hop_trace.py``), and the p50 of each hop between consecutive timestamps:

    client → gateway (ASGI) → app → Route call → scheduler in/out → routed → Generate call
      → worker in → engine core in → core output → worker output → gateway response
      → first SSE chunk → client

    python benchmarks/hops.py --model tiny-model --requests 200

The timestamps are CLOCK_MONOTONIC in every process, so hops between processes compare.
"""

import argparse
import asyncio
import collections
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import client

ORDER = [
    "gateway.asgi", "gateway.app", "gateway.route_call", "scheduler.route_in",
    "scheduler.route_out", "gateway.routed", "gateway.generate_call", "worker.generate_in",
    "core.request_in", "core.output", "worker.output", "gateway.generate_response",
    "gateway.first_chunk",
]  # fmt: skip


async def drive(url: str, model: str, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.seed)
    sent: dict[str, tuple[int, int]] = {}
    async with client(60) as http:
        for i in range(args.requests + args.warmup):
            ids = [rng.randrange(300, vocab) for _ in range(args.prompt_len)]
            body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                    "stream": True}  # fmt: skip
            rid, start, first = f"hop{i}", time.monotonic_ns(), 0
            async with http.post(f"{url}/completions", json=body,
                                 headers={"x-request-id": rid}) as resp:  # fmt: skip
                async for line in resp.content:  # to the end: the connection is reused
                    if line.startswith(b"data: ") and not first:
                        first = time.monotonic_ns()
            if i >= args.warmup and first:
                sent[rid] = (start, first)
    return sent


def breakdown(log_dir: Path, sent: dict[str, tuple[int, int]]) -> dict[str, float]:
    marks: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for log in log_dir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("HOP "):
                _, rid, point, ns = line.split()
                m = re.match(r"(hop\d+)", rid)  # the engine's ids extend the client's
                if m:
                    marks[m.group(1)].setdefault(point, int(ns))
    hops: dict[str, list[float]] = collections.defaultdict(list)
    for rid, (start, first) in sent.items():
        prev, t = "client", start
        for point in ORDER:
            if point in marks[rid]:
                hops[f"{prev} → {point}"].append((marks[rid][point] - t) / 1e6)
                prev, t = point, marks[rid][point]
        hops[f"{prev} → client"].append((first - t) / 1e6)
        hops["total (TTFT)"].append((first - start) / 1e6)
    return {k: statistics.median(v) for k, v in hops.items()}


def main() -> None:
    from baton.service_cli import add_pin_cpus_flag

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the p50s as JSON here")
    p.add_argument(
        "--no-generate-stream", action="store_true", help="the gateway calls Generate unary"
    )
    add_pin_cpus_flag(p)
    args = p.parse_args()

    from baton.serving import serving
    from services.worker.engine.model_config import load_arch_config

    os.environ["BATON_HOP_TRACE"] = "1"  # the services inherit it
    log_dir = Path(tempfile.mkdtemp(prefix="baton-hops-"))
    extra = ["--no-generate-stream"] if args.no_generate_stream else []
    extra += ["--pin-cpus", args.pin_cpus] if args.pin_cpus else []
    with serving("--model", args.model, "--workers", "1", "--num-kv-blocks", "4096",
                 "--log-dir", str(log_dir), *extra) as cluster:  # fmt: skip
        vocab = load_arch_config(args.model).vocab_size
        sent = asyncio.run(drive(cluster.url, Path(args.model).name, args, vocab))
    p50 = breakdown(log_dir, sent)
    for hop, ms in p50.items():
        print(f"{hop:55s} {ms:7.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "p50_ms": p50}, indent=2))


if __name__ == "__main__":
    main()
