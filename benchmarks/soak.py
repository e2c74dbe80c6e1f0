"""Soak: ``baton serve`` (P/D, Redis directory) under a steady moderate load for a long time,
sampling every process for leaks.

The load is ``--clients`` clients, each sending one request after another with a pause of
``--think-ms``, drawn from a fixed mix: streamed short prompts, streamed long prompts (these
are disaggregated: prefill worker → KV pull → decode worker), streams the client abandons after
the first chunk, streams abandoned before it, non-streamed requests, and bad inputs (each must
get a 400). Every ``--sample-s`` seconds: each process's RSS and open file descriptors (the
launcher's children and their children: the engine cores), each service's asyncio tasks
(``baton_asyncio_tasks`` on its /metrics) and each worker's KV blocks in use. At the end the
load stops and the workers must hold no KV block within ``--idle-s``.

Targets (issue 20): RSS growth < 5 % after warm-up (the first ``--warmup-frac`` of the run),
file descriptors and tasks flat, KV blocks back to zero when idle, zero 5xx.

For the gateway's memory (issue 50): ``--memory-s N`` records the gateway's memory by kind
(RSS, malloc in use and free, pymalloc) every N seconds from inside it into ``OUT/memory``, and
with ``--tracemalloc`` snapshots of its Python heap from the end of the warm-up
(``benchmarks/gateway_memory.py`` says what grew); ``--malloc-arena-max N`` sets glibc's
``MALLOC_ARENA_MAX`` in every service. Each prompt carries a number, so two caches in the
gateway fill up over a long run: its tokenizer's (``tokenizers``' BPE model keeps up to 10,000
distinct words, ~0.3 KiB each for these, in Rust memory) and pydantic-core's JSON string cache
(16,384 strings shorter than 64 bytes, Python objects). ``--unique-numbers`` gives every
request a number of its own (by default each client counts from 1, so the numbers repeat across
clients); ``--fill-caches`` first sends two requests that fill both caches and are refused
(``fill_caches``), so that a leak is not hidden behind them. Each sample also splits RSS into
anonymous and file-backed memory.

    python benchmarks/soak.py --model tiny-model --duration-s 1800 \
        --out docs/results/cpu-2026-12-01b/soak
    python benchmarks/soak.py --duration-s 1200 --clients 4 --memory-s 20 --fill-caches \
        --out /tmp/soak && python benchmarks/gateway_memory.py /tmp/soak/memory
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton.launcher import Cluster, free_port
from baton.serving import serving
from benchmarks import gateway_memory

MIX = [  # (kind, weight)
    ("stream", 40), ("long-stream", 20), ("abandon-after-first", 10),
    ("abandon-before-first", 5), ("unary", 15), ("bad-input", 10),
]  # fmt: skip
BAD_BODIES = [  # "M": the served model's name
    {"model": "M", "prompt": "x", "max_tokens": 2**40},
    {"model": "M", "prompt": [[2**40]]},
    {"model": "M", "prompt": "x", "stop": ["s"] * 10_000},
    {"model": "M", "prompt": "x", "temperature": "hot"},
    {"model": "nope", "prompt": "x"},
    {"model": "M"},
]


ERRORS: list[str] = []  # the error events streams ended with (the first ones are reported)


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


class Sampler:
    """Every ``every_s``: RSS, fds of each process; tasks of each service; KV use per worker."""

    def __init__(self, cluster: Cluster, every_s: float):
        self.cluster, self.every_s = cluster, every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _metrics_urls(self) -> dict[str, str]:
        urls = {"gateway": (self.cluster.url or "").removesuffix("/v1") + "/metrics"}
        for name, ready in self.cluster.ready.items():
            if ready.get("metrics_port"):
                urls[name] = f"http://127.0.0.1:{ready['metrics_port']}/metrics"
        return urls

    def sample(self) -> dict[str, Any]:
        procs: dict[str, dict[str, float]] = {}
        for name, p in list(self.cluster.procs.items()):
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(p.pid)
                for i, proc in enumerate([top, *top.children(recursive=True)]):
                    key = name if i == 0 else f"{name}/core"
                    mem = proc.memory_info()
                    procs[key] = {"rss_mb": mem.rss / 2**20, "fds": proc.num_fds(),
                                  "anon_mb": (mem.rss - mem.shared) / 2**20}  # fmt: skip
        tasks, kv = {}, {}
        for name, url in self._metrics_urls().items():
            try:
                text = httpx.get(url, timeout=5).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                if line.startswith("baton_asyncio_tasks "):
                    tasks[name] = float(line.split()[1])
                elif line.startswith("baton_worker_kv_usage "):
                    kv[name] = float(line.split()[1])
        return {"t": time.monotonic() - self.start, "procs": procs, "tasks": tasks, "kv": kv}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.every_s)


async def client(
    http: httpx.AsyncClient, url: str, model: str, rng: random.Random, long_text: str,
    stop_at: float, think_s: float, counts: dict[str, dict[str, int]], first: int = 0,
) -> None:  # fmt: skip
    """Requests one after another; the i-th one's prompt carries the number ``first + i``."""
    kinds, weights = zip(*MIX, strict=True)
    i = first
    while time.monotonic() < stop_at:
        kind = rng.choices(kinds, weights)[0]
        i += 1
        status = await one(http, url, model, kind, rng, long_text, i)
        bucket = counts.setdefault(kind, {})
        bucket[status] = bucket.get(status, 0) + 1
        await asyncio.sleep(think_s)


async def one(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    kind: str,
    rng: random.Random,
    long_text: str,
    i: int,
) -> str:
    if kind == "bad-input":
        bad = rng.choice(BAD_BODIES)
        bad = {**bad, "model": model} if bad["model"] == "M" else bad
        resp = await http.post(f"{url}/completions", json=bad)
        return str(resp.status_code)
    long = kind in ("long-stream", "abandon-before-first")
    prompt = f"{long_text} {i}" if long else f"soak request {i}: tell me"
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(8, 48),
            "temperature": rng.choice([0, 0.8]), "stream": kind != "unary"}  # fmt: skip
    if kind == "unary":
        return str((await http.post(f"{url}/completions", json=body)).status_code)
    if kind == "abandon-before-first":
        try:
            async with asyncio.timeout(0.03):  # (during the prefill leg)
                async with http.stream("POST", f"{url}/completions", json=body) as resp:
                    await resp.aread()
        except TimeoutError:
            return "abandoned"
        return "finished-first"
    async with http.stream("POST", f"{url}/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return str(resp.status_code)
        async for line in resp.aiter_lines():
            if line.startswith('data: {"error"'):  # an error event (not a token "error")
                ERRORS.append(line[:300])
                return "stream-error"
            if kind == "abandon-after-first" and line.startswith("data: "):
                return "abandoned"
    return "200"


async def drive(
    url: str, model: str, args: argparse.Namespace, long_text: str
) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    stop_at = time.monotonic() + args.duration_s
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(
            client(http, url, model, random.Random(args.seed + c), long_text, stop_at,
                   args.think_ms / 1000, counts, c * 10**6 if args.unique_numbers else 0)
            for c in range(args.clients)
        ))  # fmt: skip
    return counts


def fill_caches(url: str, model: str) -> list[int]:
    """The gateway's two caches of distinct strings filled, by two requests it refuses (the
    statuses): a prompt of the numbers 0-9899, each a word of its own as in the soak's prompts
    (tokenized, then too long), and 20,000 distinct short strings as ``logit_bias`` keys
    (parsed, then not token ids)."""
    numbers = {"model": model, "prompt": " ".join(str(n) for n in range(9900)), "max_tokens": 1}
    keys = {f"soak request {n}: tell me": 0 for n in range(10**7, 10**7 + 20_000)}
    strings = {"model": model, "prompt": "x", "logit_bias": keys}
    return [httpx.post(f"{url}/completions", json=body, timeout=60).status_code
            for body in (numbers, strings)]  # fmt: skip


def summarize(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Per process: RSS after warm-up → at the end (growth %), fds and tasks first → last."""
    after = [s for s in samples if s["t"] >= warmup_s] or samples
    first, last = after[0], after[-1]
    out: dict[str, Any] = {"rss_growth_pct": {}, "fds": {}, "tasks": {}}
    for name in last["procs"]:
        if name in first["procs"]:
            a, b = first["procs"][name]["rss_mb"], last["procs"][name]["rss_mb"]
            out["rss_growth_pct"][name] = round(100 * (b - a) / a, 2)
            out["fds"][name] = [first["procs"][name]["fds"], last["procs"][name]["fds"]]
    for name in last["tasks"]:
        out["tasks"][name] = [first["tasks"].get(name), last["tasks"][name]]
    return out


def plot(samples: list[dict[str, Any]], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 12), sharex=True)
    names = sorted({n for s in samples for n in s["procs"]})
    minutes = [s["t"] / 60 for s in samples]
    for name in names:
        axes[0].plot(minutes, [s["procs"].get(name, {}).get("rss_mb") for s in samples],
                     label=name)  # fmt: skip
        axes[1].plot(minutes, [s["procs"].get(name, {}).get("fds") for s in samples], label=name)
    for name in sorted({n for s in samples for n in s["tasks"]}):
        axes[2].plot(minutes, [s["tasks"].get(name) for s in samples], label=name)
    for name in sorted({n for s in samples for n in s["kv"]}):
        axes[3].plot(minutes, [100 * s["kv"][name] if name in s["kv"] else None
                               for s in samples], label=name)  # fmt: skip
    titles = ["RSS (MiB)", "open file descriptors", "asyncio tasks", "KV blocks in use (%)"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_ylabel(title)
        ax.axvline(warmup_s / 60, color="grey", linestyle=":", linewidth=1)
        ax.legend(fontsize=7, ncol=3)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes (dotted: end of warm-up; load stops at the last minute)")
    fig.suptitle("baton serve soak: P/D, Redis, mixed load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def instrument(args: argparse.Namespace, out: Path) -> None:
    """The environment ``baton serve``'s children inherit, for the memory options."""
    if args.malloc_arena_max:
        os.environ["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    if args.memory_s:
        hook = gateway_memory.hook_dir(Path(tempfile.mkdtemp(prefix="baton-soak-hook-")))
        root = str(Path(__file__).resolve().parent.parent)
        paths = [str(hook), root, os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        os.environ[gateway_memory.DIR_ENV] = str((out / "memory").resolve())
        os.environ[gateway_memory.EVERY_ENV] = str(args.memory_s)
        if args.tracemalloc:
            warmup_s = args.duration_s * args.warmup_frac
            os.environ[gateway_memory.TRACE_AFTER_ENV] = str(warmup_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-model")
    p.add_argument("--duration-s", type=float, default=1800)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--think-ms", type=float, default=50)
    p.add_argument("--sample-s", type=float, default=10)
    p.add_argument("--warmup-frac", type=float, default=0.1)
    p.add_argument("--idle-s", type=float, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a directory for soak.json and soak.png")
    p.add_argument(
        "--memory-s",
        type=float,
        default=0,
        help="record the gateway's memory this often into OUT/memory (0: off)",
    )
    p.add_argument(
        "--tracemalloc",
        action="store_true",
        help="with --memory-s: tracemalloc snapshots from the end of the warm-up",
    )
    p.add_argument(
        "--unique-numbers",
        action="store_true",
        help="no two requests' prompts carry the same number (default: per client)",
    )
    p.add_argument(
        "--fill-caches",
        action="store_true",
        help="fill the gateway's caches of distinct strings before the load",
    )
    p.add_argument(
        "--malloc-arena-max",
        type=int,
        default=0,
        help="MALLOC_ARENA_MAX for every service (0: glibc's default)",
    )
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="baton-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    instrument(args, out)
    redis, redis_url = start_redis()
    policy = out / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    flags = ["--model", args.model, "--prefill-workers", "1", "--decode-workers", "1",
             "--redis-url", redis_url, "--routing-policy", str(policy), "--worker-metrics",
             "--num-kv-blocks", "512", "--max-num-seqs", "16",
             "--max-model-len", "1024"]  # fmt: skip
    long_text = " ".join(f"word{i}" for i in range(120))  # ~500 tokens: disaggregated
    try:
        with serving(*flags) as cluster, Sampler(cluster, args.sample_s) as sampler:
            if args.fill_caches:
                print("caches filled:", fill_caches(cluster.url or "", cluster.model_name))
            counts = asyncio.run(drive(cluster.url or "", cluster.model_name, args, long_text))
            loaded_s = time.monotonic() - sampler.start
            deadline = time.monotonic() + args.idle_s
            while time.monotonic() < deadline:  # idle: every block back
                kv = sampler.sample()["kv"]
                if kv and all(v == 0 for v in kv.values()):
                    break
                time.sleep(1)
            idle = sampler.sample()
            sampler.samples.append(idle)
            restarts = dict(cluster.restarts)
    finally:
        redis.kill()
    warmup_s = args.duration_s * args.warmup_frac
    total = {k: sum(v.values()) for k, v in counts.items()}
    five_xx = sum(n for v in counts.values() for s, n in v.items() if s.startswith("5"))
    bad_not_400 = {s: n for s, n in counts.get("bad-input", {}).items() if not s.startswith("4")}
    result = {
        "args": vars(args), "loaded_s": round(loaded_s, 1), "requests": total,
        "outcomes": counts, "five_xx": five_xx, "stream_errors": sum(
            v.get("stream-error", 0) for v in counts.values()),
        "bad_input_not_4xx": bad_not_400, "first_stream_errors": ERRORS[:10], "restarts": restarts,
        "kv_when_idle": idle["kv"], "summary": summarize(sampler.samples, warmup_s),
        "samples": sampler.samples,
    }  # fmt: skip
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(sampler.samples, out / "soak.png", warmup_s)
    brief = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
