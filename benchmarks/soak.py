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

    python benchmarks/soak.py --model tiny-model --duration-s 1800 \
        --out docs/results/cpu-2026-12-01b/soak
"""

import argparse
import asyncio
import contextlib
import json
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
                    procs[key] = {"rss_mb": proc.memory_info().rss / 2**20,
                                  "fds": proc.num_fds()}  # fmt: skip
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
    stop_at: float, think_s: float, counts: dict[str, dict[str, int]],
) -> None:  # fmt: skip
    kinds, weights = zip(*MIX, strict=True)
    i = 0
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
                   args.think_ms / 1000, counts)
            for c in range(args.clients)
        ))  # fmt: skip
    return counts


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
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="baton-soak-"))
    out.mkdir(parents=True, exist_ok=True)
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
