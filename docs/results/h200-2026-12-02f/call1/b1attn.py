"""Batch-1 decode attention at short contexts: one CUDA graph of 32 layers' _decode (+combine),
launched as the engine launches them (PDL), per split count and BLOCK_N; us per layer."""

import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
from services.worker.engine.attention import triton_backend
from services.worker.engine.attention.backend import AttentionMetadata
from services.worker.engine.attention.triton_backend import TritonAttentionBackend
from services.worker.engine.kv_cache.layout import KVCacheLayout, layer_views

dev = torch.device("cuda")
L, KVH, H, D, BS = 32, 8, 32, 128, 16
res = []
for kvd in ("auto", "fp8"):
    for ctx in (128, 256, 512, 1024, 2048, 4096):
        nb = -(-ctx // BS)
        kv = KVCacheLayout(L, KVH, D, BS, torch.bfloat16).allocate(nb + 1, dev).normal_()
        if kvd == "fp8":
            kv = kv.to(torch.float8_e4m3fn)
        views = [layer_views(kv, layer) for layer in range(L)]
        for v in views:
            if kvd == "fp8":
                v.k_scale = v.v_scale = 0.5
        meta = AttentionMetadata(
            num_tokens=1,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
            block_tables=torch.randperm(nb, device=dev).to(torch.int32)[None],
            slot_mapping=torch.zeros(1, dtype=torch.int64, device=dev),
            query_start_loc_cpu=[0, 1],
            seq_lens_cpu=[ctx],
            max_query_len=1,
            max_seq_len=ctx,
        )
        meta.decode_order = None
        q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        be = TritonAttentionBackend(H, KVH, D, D**-0.5)
        be._tune(q)
        rule_splits = triton_backend.num_decode_splits(1, KVH, ctx, be._sms(q), **be._split_rule)
        base = (
            be.DECODE_BLOCK_N,
            be.DECODE_WARPS,
            be.DECODE_STAGES,
            be.DECODE_SPLIT_BLOCK_N,
            be.DECODE_SPLIT_WARPS,
            be.DECODE_SPLIT_STAGES,
        )
        rule = triton_backend.num_decode_splits
        for splits, (bn, w, st) in itertools.product(
            (1, 2, 4, 8, 16), ((16, 2, 2), (32, 4, 2), (64, 4, 2), (128, 8, 4), (32, 2, 3))
        ):
            if bn * splits > 2 * ctx and splits > 1:
                continue
            be.DECODE_BLOCK_N = be.DECODE_SPLIT_BLOCK_N = bn
            be.DECODE_WARPS = be.DECODE_SPLIT_WARPS = w
            be.DECODE_STAGES = be.DECODE_SPLIT_STAGES = st
            triton_backend.num_decode_splits = lambda *_, n=splits, **__: n
            try:
                for v in views[:2]:
                    be._decode(q, v, meta, out)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for v in views:
                        be._decode(q, v, meta, out)
                g.replay()
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ts = []
                for _ in range(5):
                    s.record()
                    for _ in range(20):
                        g.replay()
                    e.record()
                    e.synchronize()
                    ts.append(s.elapsed_time(e) / 20 / L * 1e3)
                r = {
                    "kv": kvd,
                    "ctx": ctx,
                    "splits": splits,
                    "launch": f"{bn}-{w}-{st}",
                    "us": round(min(ts), 2),
                }
            except Exception as ex:
                r = {
                    "kv": kvd,
                    "ctx": ctx,
                    "splits": splits,
                    "launch": f"{bn}-{w}-{st}",
                    "error": repr(ex)[:300],
                }
                print(r, flush=True)
            finally:
                triton_backend.num_decode_splits = rule
            res.append(r)
        oks = [r for r in res if r["ctx"] == ctx and r["kv"] == kvd and "us" in r]
        if not oks:
            sys.exit(1)
        best = min(
            (r for r in res if r["ctx"] == ctx and r["kv"] == kvd and "us" in r),
            key=lambda r: r["us"],
        )
        dflt = [
            r["us"]
            for r in res
            if r["ctx"] == ctx
            and r["kv"] == kvd
            and r["splits"] == rule_splits
            and r["launch"] == ("64-4-2" if rule_splits == 1 else "128-8-4")
        ]
        print(kvd, ctx, "rule splits", rule_splits, "default us", dflt, "best", best, flush=True)
        del kv, views
Path(sys.argv[1]).write_text(json.dumps(res, indent=0))
