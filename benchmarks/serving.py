"""Serving benchmark: Poisson arrivals through the gateway, and the control plane's overhead.

1. Load: ``--num-prompts`` streamed completions, arrivals a Poisson process at
   ``--request-rate`` req/s (inf: all at once), random token prompts of uniform length in
   [min-len, max-len], ``--output-len`` tokens each (ignore_eos). Reports request and token
   throughput, TTFT / TPOT / ITL / E2E percentiles; writes JSON and a PNG plot.
2. Overhead: TTFT of one request at a time (max_tokens=1) through gateway + scheduler + gRPC +
   worker, against ``AsyncLLM`` in this process on the same model, interleaved, p50 and p99.
   Both engines run their core in a background process behind ZMQ, so the difference is the
   control plane (HTTP, routing, two gRPC hops, the worker front).

    python benchmarks/serving.py --model tiny-model --num-prompts 200 --request-rate 20

Starts its own cluster (``baton serve``'s launcher) unless ``--url`` points at one.
"""

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton.serving import serving


@dataclass
class Record:
    prompt_len: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": 1e3 * statistics.fmean(values) if values else float("nan"),
        **{f"p{q}_ms": 1e3 * pct(values, q) for q in (50, 90, 99)},
    }


def client(timeout_s: float = 600) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, as vLLM's serving benchmark uses. httpx
    costs ~0.9 ms more per streamed request here (benchmarks/rpc_floor.py times both), which
    would be counted as the server's."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)
    )


async def one_request(
    http: aiohttp.ClientSession, url: str, model: str, ids: list[int], output_len: int,
    rec: Record,
) -> None:  # fmt: skip
    body = {
        "model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    rec.start = time.perf_counter()
    try:
        async with http.post(f"{url}/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            async for raw in resp.content:  # to the end: the connection is reused
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = chunk["error"]["message"]
                elif chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"]:  # a token arrived (its text may still be held back)
                    rec.chunk_times.append(time.perf_counter())
    except (TimeoutError, aiohttp.ClientError) as e:
        rec.error = repr(e)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def run_load(
    url: str, model: str, args: argparse.Namespace, vocab: int, rate: float | None = None
) -> dict[str, Any]:
    rate = args.request_rate if rate is None else rate
    seed = args.seed + round(1000 * rate)  # fresh prompts at each rate: no prefix-cache hits
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab, seed)
    records = [Record(len(p)) for p in prompts]
    rng = random.Random(seed + 1)
    async with client() as http:
        start = time.perf_counter()
        tasks = []
        for ids, rec in zip(prompts, records, strict=True):
            tasks.append(
                asyncio.create_task(one_request(http, url, model, ids, args.output_len, rec))
            )
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in records if r.error is None and r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft <= args.slo_ttft_ms / 1e3 and r.output_tokens > 1
            and (r.e2e - r.ttft) / (r.output_tokens - 1) <= args.slo_tpot_ms / 1e3]  # fmt: skip
    return {
        "request_rate": rate,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "slo_attainment": len(good) / len(records),
        "goodput_req_s": len(good) / duration,  # requests that met both SLOs, per second
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "ttft": summary([r.ttft for r in ok]),
        "tpot": summary(tpot),
        "itl": summary(itl),
        "e2e": summary([r.e2e for r in ok]),
        "_records": ok,
    }


async def run_overhead(url: str, model_dir: str, model: str, args: argparse.Namespace,
                       vocab: int) -> dict[str, Any]:  # fmt: skip
    from baton import AsyncLLM, EngineArgs, SamplingParams

    engine = AsyncLLM.from_engine_args(
        EngineArgs(
            model=model_dir, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len
        )
    )
    prompts = random_prompts(2 * args.overhead_requests + 20, args.overhead_len,
                             args.overhead_len, vocab, args.seed + 7)  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0)
    gateway, local = [], []
    async with client(60) as http:
        for i in range(args.overhead_requests + 10):  # the first 10 of each warm up
            rec = Record(args.overhead_len)
            await one_request(http, url, model, prompts[2 * i], 1, rec)
            if rec.error:
                raise RuntimeError(rec.error)
            start = time.perf_counter()
            async for _ in engine.generate(
                {"prompt_token_ids": prompts[2 * i + 1]}, params, f"o{i}"
            ):
                ttft_local = time.perf_counter() - start
                break
            if i >= 10:
                gateway.append(rec.ttft)
                local.append(ttft_local)
    engine.shutdown()
    added = {q: 1e3 * (pct(gateway, q) - pct(local, q)) for q in (50, 99)}
    return {
        "requests": len(gateway),
        "prompt_len": args.overhead_len,
        "ttft_gateway": summary(gateway),
        "ttft_in_process": summary(local),
        "added_p50_ms": added[50],
        "added_p99_ms": added[99],
    }


def plot(load: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs: list[Record] = load["_records"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, values, title in (
        (axes[0], [1e3 * r.ttft for r in recs], "TTFT (ms)"),
        (axes[1], [1e3 * (b - a) for r in recs
                   for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)], "ITL (ms)"),
    ):  # fmt: skip
        values = sorted(values)
        ax.plot(values, [i / max(len(values) - 1, 1) for i in range(len(values))])
        ax.set_xlabel(title)
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    t0 = min(r.start for r in recs)
    axes[2].scatter([r.start - t0 for r in recs], [1e3 * r.e2e for r in recs], s=6)
    axes[2].set_xlabel("arrival (s)")
    axes[2].set_ylabel("end-to-end latency (ms)")
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"{load['requests']} requests, {load['output_tokens_per_s']:.0f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_pd(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, loads in runs.items():
        rates = [ld["request_rate"] for ld in loads]
        axes[0].plot(rates, [ld["goodput_req_s"] for ld in loads], "o-", label=label)
        axes[1].plot(rates, [ld["ttft"]["p90_ms"] for ld in loads], "o-", label=label)
        axes[2].plot(rates, [ld["tpot"]["p90_ms"] for ld in loads], "o-", label=label)
    axes[1].axhline(args.slo_ttft_ms, color="grey", ls="--", lw=1)
    axes[2].axhline(args.slo_tpot_ms, color="grey", ls="--", lw=1)
    for ax, title in zip(axes, ("goodput (req/s meeting both SLOs)", "TTFT p90 (ms)",
                                "TPOT p90 (ms)"), strict=True):  # fmt: skip
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{args.shape or Path(args.model).name}: {args.min_len}-{args.max_len} in / "
                 f"{args.output_len} out, SLO TTFT ≤ {args.slo_ttft_ms:.0f} ms, "
                 f"TPOT ≤ {args.slo_tpot_ms:.0f} ms")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


LAYOUTS = {  # name → ``baton serve`` flags: the same number of workers (GPUs) in both
    "colocated": ["--workers", "2"],
    "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1"],
}


def serve_flags(args: argparse.Namespace, layout: list[str]) -> list[str]:
    """``baton serve`` flags for this benchmark's cluster in ``layout``."""
    flags = ["--model", args.model, "--worker-metrics", *layout]
    flags += ["--no-generate-stream"] if args.no_generate_stream else []
    flags += ["--pin-cpus", args.pin_cpus] if args.pin_cpus else []
    for flag in ("num_kv_blocks", "max_model_len", "max_num_batched_tokens",
                 "gpu_memory_utilization", "load_format", "log_dir"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            flags += [f"--{flag.replace('_', '-')}", str(value)]
    return flags


async def warm_up(url: str, model: str, args: argparse.Namespace, vocab: int) -> None:
    """A few requests of the workload's shape first: kernels compiled, graphs warm."""
    prompts = random_prompts(args.warmup, args.min_len, args.max_len, vocab, args.seed + 99)
    async with client() as http:
        recs = [Record(len(p)) for p in prompts]
        await asyncio.gather(*(one_request(http, url, model, p, 8, r)
                               for p, r in zip(prompts, recs, strict=True)))  # fmt: skip
        errors = {r.error for r in recs if r.error}
        if errors:
            raise RuntimeError(f"warm-up failed: {errors}")


def compare_pd(args: argparse.Namespace, name: str, vocab: int) -> dict[str, Any]:
    """Each layout in turn, at each offered load: goodput under the SLOs, side by side."""
    rates = [float(r) for r in args.request_rates.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {}
    transfer: dict[str, float] = {}
    for label in args.layouts.split(","):
        layout = LAYOUTS[label]
        with serving(*serve_flags(args, layout)) as cluster:
            asyncio.run(warm_up(cluster.url, name, args, vocab))
            runs[label] = []
            for rate in rates:
                load = asyncio.run(run_load(cluster.url, name, args, vocab, rate))
                load["per_request_ttft_tpot_ms"] = [  # to recompute goodput at other SLOs
                    [round(1e3 * r.ttft, 2),
                     round(1e3 * (r.e2e - r.ttft) / max(r.output_tokens - 1, 1), 3)]
                    for r in load.pop("_records")
                ]  # fmt: skip
                runs[label].append(load)
                print(f"{label:14s} {rate:5.1f} req/s: goodput {load['goodput_req_s']:5.2f} "
                      f"req/s, SLO met {load['slo_attainment']:.0%}, TTFT p50 "
                      f"{load['ttft']['p50_ms']:.0f} ms, TPOT p50 {load['tpot']['p50_ms']:.1f} "
                      f"ms, failed {load['failed']}", flush=True)  # fmt: skip
            if label == "disaggregated":
                transfer = worker_counters(cluster, "decode-0")
    best = {label: max(ld["goodput_req_s"] for ld in loads) for label, loads in runs.items()}
    if len(runs) < 2:
        return {"runs": runs, "max_goodput_req_s": best, "kv_transfer": transfer}
    # DistServe's goodput: the highest offered load at which 90 % of requests meet both SLOs
    knee = {
        label: max([ld["request_rate"] for ld in loads if ld["slo_attainment"] >= 0.9] or [0.0])
        for label, loads in runs.items()
    }
    return {
        "runs": runs,
        "max_goodput_req_s": best,
        "goodput_ratio": best["disaggregated"] / best["colocated"] if best["colocated"] else None,
        "max_rate_at_90pct_slo": knee,
        "rate_ratio": knee["disaggregated"] / knee["colocated"] if knee["colocated"] else None,
        "kv_transfer": transfer,
    }


def worker_counters(cluster: Any, worker: str) -> dict[str, float]:
    """The decode worker's KV-transfer counters, and the mean pull's size, time and rate."""
    port = cluster.ready[worker]["metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    got = {}
    for line in text.splitlines():
        if line.startswith("baton_worker_kv_") and "_total " in line:
            name, value = line.split()
            got[name.removeprefix("baton_worker_").removesuffix("_total")] = float(value)
    pulls = got.get("kv_pulls", 0.0)
    if pulls:
        got["mean_pull_mb"] = got["kv_pull_bytes"] / pulls / 1e6
        got["mean_pull_ms"] = 1e3 * got["kv_pull_seconds"] / pulls
        got["mean_notify_ms"] = 1e3 * got.get("kv_notify_seconds", 0.0) / pulls
        got["pull_gb_s"] = got["kv_pull_bytes"] / got["kv_pull_seconds"] / 1e9
    return got


def main() -> None:
    # here, not at the top: service_cli sets gRPC's I/O manager for the process that imports
    # it, and rpc_floor imports this module for its HTTP client
    from baton.service_cli import add_pin_cpus_flag

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory")
    p.add_argument("--shape", default=None, help="a benchmarks/shapes.py shape, dummy weights")
    p.add_argument("--url", default=None, help="an already running gateway's /v1 URL")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=20.0)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument("--overhead-len", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized by memory")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--load-format", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument(
        "--no-generate-stream", action="store_true", help="the gateway calls Generate unary"
    )
    add_pin_cpus_flag(p)
    p.add_argument(
        "--compare-pd",
        action="store_true",
        help="2 colocated workers vs 1 prefill + 1 decode, at each --request-rates",
    )
    p.add_argument("--request-rates", default="1,2,4,6,8")
    p.add_argument("--layouts", default="colocated,disaggregated")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=30.0)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default="bench-results")
    p.add_argument("--replot", default=None, help="only redraw serving_pd.png from this JSON")
    args = p.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot_pd(saved["runs"], argparse.Namespace(**saved["args"]),
                Path(args.replot).with_suffix(".png"))  # fmt: skip
        return
    if args.shape:
        from benchmarks.shapes import write_shape

        args.model = str(write_shape(args.shape, Path(args.out) / f"shape-{args.shape}"))
        args.load_format = "dummy"
    if not args.model:
        p.error("--model or --shape is required")

    from services.worker.engine.model_config import load_arch_config

    vocab = load_arch_config(args.model).vocab_size
    name = Path(args.model).name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compare_pd:
        result = {"args": vars(args), **compare_pd(args, name, vocab)}
        (out / "serving_pd.json").write_text(json.dumps(result, indent=2))
        try:
            plot_pd(result["runs"], args, out / "serving_pd.png")
        except ImportError:  # a GPU host without matplotlib: --replot the JSON elsewhere
            print("matplotlib is missing: no plot (redraw with --replot serving_pd.json)")
        print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "args")}, indent=2))
        return
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            url = stack.enter_context(
                serving(*serve_flags(args, ["--workers", str(args.workers)]))
            ).url
        load = asyncio.run(run_load(url, name, args, vocab))
        overhead = (
            None
            if args.skip_overhead
            else asyncio.run(run_overhead(url, args.model, name, args, vocab))
        )
    try:
        plot(load, out / "serving.png")
    except ImportError:  # a GPU host without matplotlib: the JSON below still has every figure
        print("matplotlib is missing: no plot")
    result = {"args": vars(args), "load": {k: v for k, v in load.items() if k != "_records"},
              "overhead": overhead}  # fmt: skip
    (out / "serving.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
