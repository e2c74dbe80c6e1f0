"""Attention on its own, outside the model.

Decode (the default): the Triton decode kernel at a serving-sized batch, for several launch
configurations and (``--splits``) numbers of context splits, as achieved GB/s of KV read
against the copy bandwidth measured in the same run. Picks TritonAttentionBackend's DECODE_*
defaults and the split rule (``num_decode_splits``).

``--kv-cache-dtypes auto fp8`` sweeps a bf16 cache and an e4m3 one in turn (the KV bytes a
step reads are counted in the cache's own width).

The requests are taken longest context first, as the engine's runner orders them
(``AttentionMetadata.decode_order``); the default configuration is also timed in batch order,
alternating with the first, ``--rounds`` times.

    python benchmarks/kernels/attention_sweep.py --batch 256 --min-ctx 100 --max-ctx 1024
    python benchmarks/kernels/attention_sweep.py --batch 1 --min-ctx 32768 --max-ctx 32768 \
        --heads 32 --layers 32 --splits 8 16 32 64

Prefill (``--prefill``): one prompt of each ``--lengths`` attended causally over the paged
cache by each ``--backends`` at each ``--block-sizes`` (KV page size), as TFLOP/s (causal: half
the square, 4 · head_dim FLOPs per query-key pair per head) against the matmul peak measured
in the same run; with ``--configs``, the Triton prefill kernel's launch configurations at the
first length (picks PREFILL_*).

    python benchmarks/kernels/attention_sweep.py --prefill --heads 32 --kv-heads 8 --layers 32 \
        --lengths 2048 8192 16384 32768 --backends triton flash_attn --block-sizes 16 128
"""

import argparse
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.roofline import copy_bandwidth, matmul_peak
from services.worker.engine.attention import triton_backend
from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.attention.registry import get_backend
from services.worker.engine.attention.triton_backend import TritonAttentionBackend
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views
from services.worker.engine.ops import tuned_configs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--min-ctx", type=int, default=100)
    p.add_argument("--max-ctx", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)  # the cache's layout stride, as in a model
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--splits", type=int, nargs="*", default=[], help="decode: split counts to time")
    p.add_argument(
        "--kv-cache-dtypes", nargs="+", choices=("auto", "fp8"), default=["auto"],
        help="decode: the cache's dtypes, each swept in turn (auto: bf16; fp8: e4m3)",
    )  # fmt: skip
    p.add_argument("--prefill", action="store_true")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    p.add_argument("--backends", nargs="+", default=["triton", "flash_attn"])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16])
    p.add_argument("--configs", action="store_true", help="prefill: sweep the Triton kernel")
    p.add_argument("--tune", metavar="DIR", help="measure this GPU's configuration, write it")
    p.add_argument(
        "--tune-split-decode", metavar="DIR",
        help="measure only the split-context decode launch and rule, over the kept config",
    )  # fmt: skip
    p.add_argument("--output")
    args = p.parse_args()
    if args.prefill:
        prefill(args)
        return
    if args.tune:
        tune(args)
        return
    if args.tune_split_decode:
        tune_split_decode(args)
        return
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    summaries, everything = {}, {}
    for kv_dtype in args.kv_cache_dtypes:
        summaries[kv_dtype], everything[kv_dtype] = decode_sweep(args, dev, bandwidth, kv_dtype)
    print(json.dumps(summaries, indent=1))
    if args.output:
        record = {"summary": summaries, "all": everything}
        Path(args.output).write_text(json.dumps(record, indent=1))


def decode_sweep(
    args: argparse.Namespace, dev: torch.device, bandwidth: float, kv_dtype: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every decode launch configuration on one batch over a cache of ``kv_dtype``: a summary
    (the fastest, the default's, by request order and split count) and every result."""
    rng = random.Random(0)
    lens = [rng.randint(args.min_ctx, args.max_ctx) for _ in range(args.batch)]
    q, meta, cache, kv_bytes = decode_case(lens, args, dev, kv_dtype=kv_dtype)
    longest_first = torch.argsort(meta.seq_lens, descending=True, stable=True).to(torch.int32)
    meta.decode_order = longest_first
    out = torch.empty_like(q)
    results = []
    backend = TritonAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    backend._tuned = True  # this sweep sets the configurations itself
    # one stream a program (a tile over the warps), and the context in a lane per warp
    launches = [(*c, 1) for c in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3))]
    launches += [(16, 4, 2, 4), (16, 4, 3, 4), (32, 4, 2, 4), (16, 2, 2, 2)]
    for block_n, warps, stages, lanes in launches:
        backend.DECODE_BLOCK_N, backend.DECODE_WARPS, backend.DECODE_STAGES = block_n, warps, stages
        backend.DECODE_LANES = lanes
        launch = {"block_n": block_n, "warps": warps, "stages": stages, "lanes": lanes}
        try:
            ms = triton.testing.do_bench(
                lambda: backend._decode(q, cache, meta, out), return_mode="median"
            )
        except Exception as e:  # a configuration the compiler rejects (shared memory)
            results.append({**launch, "error": str(e)[:80]})
            continue
        results.append({
            **launch, "us": round(ms * 1e3, 1), "GBps": round(kv_bytes / ms / 1e6, 1),
            "fraction_of_copy": round(kv_bytes / ms / 1e-3 / bandwidth, 3),
        })  # fmt: skip
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    default = (
        TritonAttentionBackend.DECODE_BLOCK_N,
        TritonAttentionBackend.DECODE_WARPS,
        TritonAttentionBackend.DECODE_STAGES,
        TritonAttentionBackend.DECODE_LANES,
    )
    backend.DECODE_BLOCK_N, backend.DECODE_WARPS, backend.DECODE_STAGES = default[:3]
    backend.DECODE_LANES = default[3]
    orders: dict[str, list[float]] = {"longest_first": [], "batch_order": []}
    for _ in range(args.rounds):
        for name, order in (("longest_first", longest_first), ("batch_order", None)):
            meta.decode_order = order
            ms = triton.testing.do_bench(
                lambda: backend._decode(q, cache, meta, out), return_mode="median"
            )
            orders[name].append(round(kv_bytes / ms / 1e6, 1))
    rule = triton_backend.num_decode_splits
    by_splits = [
        {"splits": n, "us": round(ms * 1e3, 1),
         "fraction_of_copy": round(kv_bytes / ms / 1e-3 / bandwidth, 3)}
        for n, ms in decode_ms_by_splits(backend, q, cache, meta, out, args.splits).items()
    ]  # fmt: skip
    summary = {
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "kv_MB": round(kv_bytes / 1e6, 1),
        "rule_splits": rule(args.batch, args.kv_heads, max(lens), backend._sms(q.device)),
        "by_splits": by_splits,
        "best": ok[:5],
        "default": [
            r for r in ok if (r["block_n"], r["warps"], r["stages"], r["lanes"]) == default
        ],
        "default_GBps_by_order": orders,
    }
    return summary, results


def decode_ms_by_splits(
    impl: Any, q: torch.Tensor, cache: Any, meta: AttentionMetadata, out: Any, counts: Any
) -> dict[int, float]:
    """Median milliseconds of the decode kernel with each number of context splits."""
    rule, times = triton_backend.num_decode_splits, {}
    try:
        for n in counts:
            triton_backend.num_decode_splits = lambda *_, n=n: n  # type: ignore[misc]
            times[n] = triton.testing.do_bench(
                lambda: impl._decode(q, cache, meta, out), return_mode="median"
            )
    finally:
        triton_backend.num_decode_splits = rule
    return times


def decode_case(
    lens: list[int],
    args: argparse.Namespace,
    dev: torch.device,
    bs: int = 16,
    kv_dtype: str = "auto",
) -> tuple[torch.Tensor, AttentionMetadata, Any, int]:
    """One decode query per context length, over a paged cache (bf16, or e4m3 with
    ``kv_dtype="fp8"``) whose blocks are shuffled: queries, metadata (longest first, as the
    runner orders them), the layer's cache view and the KV bytes a step reads."""
    nblocks = [-(-n // bs) for n in lens]
    layout = KVCacheLayout(args.layers, args.kv_heads, args.head_dim, bs, torch.bfloat16)
    kv = layout.allocate(sum(nblocks) + 1, dev).normal_()
    if kv_dtype == "fp8":
        kv = kv.to(torch.float8_e4m3fn)
    perm = torch.randperm(sum(nblocks)).tolist()
    tables, i = [], 0
    for n in nblocks:
        tables.append(perm[i : i + n] + [0] * (max(nblocks) - n))
        i += n
    batch = len(lens)
    meta = AttentionMetadata(
        num_tokens=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=dev),
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=lens,
        max_query_len=1,
        max_seq_len=max(lens),
    )
    meta.decode_order = torch.argsort(meta.seq_lens, descending=True, stable=True).to(torch.int32)
    q = torch.randn(batch, args.heads, args.head_dim, device=dev, dtype=torch.bfloat16)
    kv_bytes = sum(lens) * args.kv_heads * args.head_dim * 2 * kv.element_size()  # K and V
    view = layer_views(kv, args.layers // 2)
    if kv_dtype == "fp8":  # scales as a calibrated cache's: the values keep their spread
        view.k_scale = view.v_scale = 0.5
    return q, meta, view, kv_bytes


def prefill_case(
    n: int, args: argparse.Namespace, block_size: int, dev: torch.device
) -> tuple[torch.Tensor, AttentionMetadata, object]:
    """One prompt of ``n`` tokens whose keys and values are already in a paged cache (its blocks
    shuffled, as a busy cache's are): queries, metadata and the layer's cache view."""
    nblocks = -(-n // block_size)
    layout = KVCacheLayout(args.layers, args.kv_heads, args.head_dim, block_size, torch.bfloat16)
    kv = layout.allocate(nblocks, dev).normal_()
    table = torch.randperm(nblocks, device=dev).to(torch.int32)[None]
    meta = AttentionMetadata(
        num_tokens=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=table,
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=dev),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )
    q = torch.randn(n, args.heads, args.head_dim, device=dev, dtype=torch.bfloat16)
    return q, meta, layer_views(kv, args.layers // 2)


def prefill_ms(impl: Any, q: torch.Tensor, cache: Any, meta: AttentionMetadata, out: Any) -> float:
    """Median milliseconds of the backend's prefill of the case's one request."""
    ms: float = triton.testing.do_bench(
        lambda: impl._prefill(q, cache, meta, out, 1), return_mode="median"
    )
    return ms


def prefill(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    peak = matmul_peak(dev, torch.bfloat16)
    rows, configs = [], []

    def tflops(n: int, ms: float) -> float:
        return round(4 * args.head_dim * args.heads * n * (n + 1) // 2 / ms / 1e9, 1)

    for block_size in args.block_sizes:
        for n in args.lengths:
            q, meta, cache = prefill_case(n, args, block_size, dev)
            out = torch.empty_like(q)
            for name in args.backends:
                impl = get_backend(name)(
                    args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5
                )
                ms = prefill_ms(impl, q, cache, meta, out)
                rate = tflops(n, ms)
                rows.append({"backend": name, "block_size": block_size, "prompt": n,
                             "ms": round(ms, 3), "TFLOPs": rate,
                             "fraction_of_matmul_peak": round(rate * 1e12 / peak, 3)})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del q, meta, cache, out
            torch.cuda.empty_cache()
    if args.configs:
        n = args.lengths[0]
        q, meta, cache = prefill_case(n, args, args.block_sizes[0], dev)
        out = torch.empty_like(q)
        impl = TritonAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
        impl._tuned = True  # this sweep sets the configurations itself
        for bm, bn, warps, stages in itertools.product(
            (64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4)
        ):
            impl.PREFILL_BLOCK_M, impl.PREFILL_BLOCK_N = bm, bn
            impl.PREFILL_WARPS, impl.PREFILL_STAGES = warps, stages
            row: dict[str, object] = {
                "block_m": bm,
                "block_n": bn,
                "warps": warps,
                "stages": stages,
            }
            try:
                ms = prefill_ms(impl, q, cache, meta, out)
                row.update(ms=round(ms, 3), TFLOPs=tflops(n, ms))
            except Exception as e:  # a configuration the compiler rejects (shared memory)
                row["error"] = str(e)[:80]
            configs.append(row)
        configs.sort(key=lambda r: r.get("ms", 1e9))  # type: ignore[arg-type,return-value]
        print(json.dumps({"prompt": n, "best_configs": configs[:8]}, indent=1))
    summary = {"matmul_peak_TFLOPs": round(peak / 1e12, 1), "prefill": rows, "configs": configs,
               "gpu": torch.cuda.get_device_name(dev)}  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=1))


PREFILL_GRID = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))
DECODE_CASES = [(1, 32768), (4, 32768), (16, 32768), (1, 8192), (32, 4096), (256, 1024)]
SPLIT_RULES = list(itertools.product((1, 2, 4), (16, 32, 64), (32, 256, 512)))


def tune(args: argparse.Namespace) -> None:
    """This GPU's launch configuration for ``--head-dim``, written into the directory ``--tune``
    under the name the backend reads (services/worker/engine/ops/configs/attention/ keeps them):

    - prefill: every PREFILL_GRID configuration on a prompt of ``--lengths[0]`` tokens; the
      four fastest again on each of ``--lengths``; the one with the least summed time relative
      to each length's best;
    - decode: the split rule (``num_decode_splits``: waves of programs, most splits, fewest
      tokens per split) with the least summed time, relative to each case's best split count,
      over DECODE_CASES (batch, context), every power-of-two split count timed per case."""
    dev = torch.device("cuda")
    impl = TritonAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    impl._tuned = True  # this sweep sets the configurations itself
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev)}

    def prefill_times(n: int, grid: list[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
        q, meta, cache = prefill_case(n, args, 16, dev)
        out, times = torch.empty_like(q), {}
        for cfg in grid:
            impl.PREFILL_BLOCK_M, impl.PREFILL_BLOCK_N, impl.PREFILL_WARPS = cfg[:3]
            impl.PREFILL_STAGES = cfg[3]
            try:
                times[cfg] = prefill_ms(impl, q, cache, meta, out)
            except Exception:  # a configuration the compiler rejects (shared memory)
                continue
        return times

    first = prefill_times(args.lengths[0], PREFILL_GRID)
    finalists = sorted(first, key=first.__getitem__)[:4]
    default = (64, 64, 4, 2)
    finalists += [] if default in finalists else [default]
    per_length = {n: prefill_times(n, finalists) for n in args.lengths}
    inf = float("inf")
    score = {
        c: sum(t.get(c, inf) / min(t.values()) for t in per_length.values()) for c in finalists
    }
    best = min(score, key=score.__getitem__)
    report["prefill_ms"] = {
        str(n): {"-".join(map(str, c)): round(t[c], 3) for c in finalists if c in t}
        for n, t in per_length.items()
    }
    print(json.dumps(report["prefill_ms"], indent=1), flush=True)

    sms = impl._sms(dev)
    measured = []
    for batch, ctx in DECODE_CASES:
        q, meta, cache, _ = decode_case([ctx] * batch, args, dev)
        out = torch.empty_like(q)
        times = decode_ms_by_splits(impl, q, cache, meta, out, (1, 2, 4, 8, 16, 32, 64))
        measured.append((batch, ctx, times))
        del q, meta, cache, out
        torch.cuda.empty_cache()
    report["decode_us_by_splits"] = {
        f"{b}x{c}": {str(k): round(v * 1e3, 1) for k, v in t.items()} for b, c, t in measured
    }
    print(json.dumps(report["decode_us_by_splits"], indent=1), flush=True)

    def rule_score(waves: int, most: int, fewest: int) -> float:
        return sum(
            t[triton_backend.num_decode_splits(b, args.kv_heads, c, sms, waves, most, fewest)]
            / min(t.values())
            for b, c, t in measured
        )

    # ties go to the rule the backend had before it was measured (the first in SPLIT_RULES)
    rules = sorted(SPLIT_RULES, key=lambda r: (r != (1, 16, 512), r))
    waves, most, fewest = min(rules, key=lambda r: rule_score(*r))
    report["split_rule_scores"] = {"-".join(map(str, r)): round(rule_score(*r), 3) for r in rules}
    key = f"head_dim_{args.head_dim}"
    config = {
        "prefill": {key: dict(zip(("block_m", "block_n", "warps", "stages"), best, strict=True))},
        "decode": {key: {"waves": waves, "max_splits": most, "tokens_per_split": fewest}},
        "measured": report,
    }
    print(json.dumps({k: config[k] for k in ("prefill", "decode")}, indent=1))
    print("wrote", tuned_configs.write(Path(args.tune), report["gpu"], config))


# the long contexts that split, and two batched ones whose best count is 2 or 4 (a rule that
# fills the GPU once gives them 1 or 2): the rule must not trade those for the long ones
SPLIT_CASES = [(1, 32768), (4, 32768), (1, 8192), (32, 4096), (16, 32768)]
# the old default and the fastest of a sweep of BLOCK_N 64-256 x 4|8 warps x 2-4 stages at
# 1 x 32k, 4 x 32k and 1 x 8k on an H200 (docs/performance.md, "Long context": the tuned
# split-context decode, 128 keys a tile, 8 warps, 4 stages)
SPLIT_LAUNCHES = [(64, 4, 2), (64, 8, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 4)]
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)


class SplitChoice:
    """The split launch and rule a sweep's times pick, each case timed as the engine launches
    it: a case whose context is at most ``long_context`` with the one-range launch ``one``
    whatever the candidate (``TritonAttentionBackend.DECODE_LONG_CONTEXT``), a longer one with
    the candidate; at the split count the rule gives it. ``times[launch][case][splits]``:
    seconds, from a sweep of every launch at every count of SPLIT_COUNTS (a count not measured
    is never chosen)."""

    def __init__(
        self,
        times: dict[tuple[int, ...], list[dict[int, float]]],
        cases: list[tuple[int, int]],
        kv_heads: int,
        sms: int,
        one: tuple[int, ...],
        long_context: int | None,
    ) -> None:
        self.times, self.cases, self.kv_heads, self.sms = times, cases, kv_heads, sms
        self.one, self.long_context = one, long_context
        # each case's best as the engine can launch it
        self.best = [
            min(min(self.times[la][i].values()) for la in self._launches(i))
            for i in range(len(cases))
        ]

    def _short(self, case: int) -> bool:
        """The engine runs this case's split context with the one-range launch."""
        return self.long_context is not None and self.cases[case][1] <= self.long_context

    def _launches(self, case: int) -> list[tuple[int, ...]]:
        return [self.one] if self._short(case) else list(self.times)

    def time(self, launch: tuple[int, ...], rule: tuple[int, int, int], case: int) -> float:
        batch, ctx = self.cases[case]
        launch = self.one if self._short(case) else launch
        n = triton_backend.num_decode_splits(batch, self.kv_heads, ctx, self.sms, *rule)
        return self.times[launch][case].get(n, float("inf"))

    def score(self, launch: tuple[int, ...], rule: tuple[int, int, int]) -> float:
        return sum(self.time(launch, rule, i) / b for i, b in enumerate(self.best))

    def pick(
        self, rules: list[tuple[int, int, int]], now: tuple[int, int, int]
    ) -> tuple[tuple[int, ...], tuple[int, int, int]]:
        """The (launch, rule) of least score; ties go to the kept rule, then the first."""
        ordered = sorted(rules, key=lambda r: (r != now, r))
        pairs = [(la, r) for la in self.times for r in ordered]
        return min(pairs, key=lambda lr: self.score(*lr))


def tune_split_decode(args: argparse.Namespace) -> None:
    """The decode kernel's launch when it splits the context (one or a few long requests), and
    the split rule with it: every SPLIT_LAUNCHES (BLOCK_N, warps, stages) at 1 to 32 splits on
    each SPLIT_CASES; the launch and rule with the least summed time relative to each case's
    best, over the measured split counts, each case launched as the engine would
    (``SplitChoice``: the kept ``long_context`` keeps the candidates to the longer cases).
    Merged into the kept configuration of this GPU (or a new one) and written into
    ``--tune-split-decode``.

    The kernel is timed alone. At short contexts that misjudged the engine's step: there the
    deep launch it picked cost a batch-1 step 0.12–0.36 ms, where alone it was within 1–2 µs
    a layer (docs/performance.md, "Batch-1 decode: the split launch by context");
    ``long_context`` was set from the step's times."""
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    key = f"head_dim_{args.head_dim}"
    kept = triton_backend.tuned_config(gpu)
    rule_now = kept.get("decode", {}).get(key, {})
    now = (rule_now.get("waves", 1), rule_now.get("max_splits", 16),
           rule_now.get("tokens_per_split", 512))  # fmt: skip
    # the kept launches: split contexts up to long_context take the one-range launch
    engine = TritonAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    engine._tuned = True
    engine.apply_config(kept)
    one, split_now = engine.decode_launches()
    launches = list(dict.fromkeys([*SPLIT_LAUNCHES, one, split_now]))
    # the sweep times every launch as a split launch, whatever the context
    impl = TritonAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    impl._tuned = True  # this sweep sets the configurations itself
    sms = impl._sms(dev)
    counts = SPLIT_COUNTS
    times: dict[tuple[int, ...], list[dict[int, float]]] = {}
    for batch, ctx in SPLIT_CASES:
        q, meta, cache, _ = decode_case([ctx] * batch, args, dev)
        out = torch.empty_like(q)
        for launch in launches:
            impl.DECODE_SPLIT_BLOCK_N, impl.DECODE_SPLIT_WARPS, impl.DECODE_SPLIT_STAGES = launch
            try:
                t = decode_ms_by_splits(impl, q, cache, meta, out, counts)
            except Exception:  # a configuration the compiler rejects (shared memory)
                t = dict.fromkeys(counts, float("inf"))
            times.setdefault(launch, []).append(t)
        del q, meta, cache, out
        torch.cuda.empty_cache()
    long = engine.DECODE_LONG_CONTEXT
    choice = SplitChoice(times, SPLIT_CASES, args.kv_heads, sms, one, long)
    picked, rule = choice.pick(SPLIT_RULES, now)
    best_case, chosen = choice.best, choice.time
    report = {
        "cases": [f"{b}x{c}" for b, c in SPLIT_CASES],
        "best_us": [round(b * 1e3, 1) for b in best_case],
        "chosen_us": [round(chosen(picked, rule, i) * 1e3, 1) for i in range(len(SPLIT_CASES))],
        "before_us": [round(chosen(split_now, now, i) * 1e3, 1) for i in range(len(SPLIT_CASES))],
        "long_context": long,
        "us_by_launch_and_splits": {
            "-".join(map(str, la)): [{str(k): round(v * 1e3, 1) for k, v in t.items()} for t in ts]
            for la, ts in times.items()
        },
    }  # fmt: skip
    config = {k: v for k, v in kept.items()} if kept else {"prefill": {}, "decode": {}}
    decode = dict(config.get("decode", {}).get(key, {}))
    decode.update(zip(("waves", "max_splits", "tokens_per_split"), rule, strict=True))
    decode.update(zip(("split_block_n", "split_warps", "split_stages"), picked, strict=True))
    config.setdefault("decode", {})[key] = decode
    config.setdefault("measured", {})["split_decode"] = report
    print(json.dumps({k: report[k] for k in ("cases", "best_us", "chosen_us", "before_us")}))
    print(json.dumps(config["decode"], indent=1))
    print("wrote", tuned_configs.write(Path(args.tune_split_decode), gpu, config))


if __name__ == "__main__":
    main()
