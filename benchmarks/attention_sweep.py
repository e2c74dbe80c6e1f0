"""Decode attention on its own: the Triton decode kernel at a serving-sized batch, for several
launch configurations, as achieved GB/s of KV read against the copy bandwidth measured in the
same run. Picks TritonAttentionBackend's DECODE_* defaults.

The requests are taken longest context first, as the engine's runner orders them
(``AttentionMetadata.decode_order``); the default configuration is also timed in batch order,
alternating with the first, ``--rounds`` times.

    python benchmarks/attention_sweep.py --batch 256 --min-ctx 100 --max-ctx 1024
"""

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import copy_bandwidth
from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.attention.triton_backend import TritonAttentionBackend
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views


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
    p.add_argument("--output")
    args = p.parse_args()
    dev, bs = torch.device("cuda"), 16
    rng = random.Random(0)
    lens = [rng.randint(args.min_ctx, args.max_ctx) for _ in range(args.batch)]
    nblocks = [-(-n // bs) for n in lens]
    layout = KVCacheLayout(args.layers, args.kv_heads, args.head_dim, bs, torch.bfloat16)
    kv = layout.allocate(sum(nblocks) + 1, dev).normal_()
    perm = torch.randperm(sum(nblocks)).tolist()
    tables, i = [], 0
    for n in nblocks:
        tables.append(perm[i : i + n] + [0] * (max(nblocks) - n))
        i += n
    cache = layer_views(kv, 3)
    meta = AttentionMetadata(
        num_tokens=args.batch,
        query_start_loc=torch.arange(args.batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        slot_mapping=torch.zeros(args.batch, dtype=torch.int64, device=dev),
        query_start_loc_cpu=list(range(args.batch + 1)),
        seq_lens_cpu=lens,
        max_query_len=1,
        max_seq_len=max(lens),
    )
    longest_first = torch.argsort(meta.seq_lens, descending=True, stable=True).to(torch.int32)
    meta.decode_order = longest_first
    q = torch.randn(args.batch, args.heads, args.head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = sum(lens) * args.kv_heads * args.head_dim * 2 * 2  # K and V, bf16
    bandwidth = copy_bandwidth(dev)
    results = []
    backend = TritonAttentionBackend(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    for block_n, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3)):
        backend.DECODE_BLOCK_N, backend.DECODE_WARPS, backend.DECODE_STAGES = block_n, warps, stages
        try:
            ms = triton.testing.do_bench(
                lambda: backend._decode(q, cache, meta, out), return_mode="median"
            )
        except Exception as e:  # a configuration the compiler rejects (shared memory)
            results.append(
                {"block_n": block_n, "warps": warps, "stages": stages, "error": str(e)[:80]}
            )
            continue
        results.append({
            "block_n": block_n, "warps": warps, "stages": stages, "us": round(ms * 1e3, 1),
            "GBps": round(kv_bytes / ms / 1e6, 1),
            "fraction_of_copy": round(kv_bytes / ms / 1e-3 / bandwidth, 3),
        })  # fmt: skip
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    default = (
        TritonAttentionBackend.DECODE_BLOCK_N,
        TritonAttentionBackend.DECODE_WARPS,
        TritonAttentionBackend.DECODE_STAGES,
    )
    backend.DECODE_BLOCK_N, backend.DECODE_WARPS, backend.DECODE_STAGES = default
    orders: dict[str, list[float]] = {"longest_first": [], "batch_order": []}
    for _ in range(args.rounds):
        for name, order in (("longest_first", longest_first), ("batch_order", None)):
            meta.decode_order = order
            ms = triton.testing.do_bench(
                lambda: backend._decode(q, cache, meta, out), return_mode="median"
            )
            orders[name].append(round(kv_bytes / ms / 1e6, 1))
    summary = {
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "kv_MB": round(kv_bytes / 1e6, 1),
        "best": ok[:5],
        "default": [r for r in ok if (r["block_n"], r["warps"], r["stages"]) == default],
        "default_GBps_by_order": orders,
    }
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps({"summary": summary, "all": results}, indent=1))


if __name__ == "__main__":
    main()
