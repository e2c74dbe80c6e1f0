"""KV cache bytes one request holds, with the engine's KV cache groups against a cache that keeps
every layer's K and V for every token (what the groups save on a hybrid model; a model's
recurrent layers, kept as attention layers would be, against their states of two pages at most).

The same classes the engine sizes its cache with: the shape's config read as the engine reads it
(``load_arch_config``), its layers grouped (``KVCacheGroups.plan``), a block's bytes from the
engine's layout (``KVCacheLayout``). No weights and no device: the figures are arithmetic over
the configs, and the engine logs the same numbers for its ``max_model_len`` when it starts.

    python benchmarks/kv_memory.py --shapes gpt-oss-20b gemma-3-12b --contexts 32768
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.shapes import SHAPES
from services.worker.engine.config import state_block_size
from services.worker.engine.kv_cache.groups import KVCacheGroups
from services.worker.engine.kv_cache.layout import KVCacheLayout
from services.worker.engine.model_config import load_arch_config

DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def measure(shape: str, context: int, block_size: int, dtype: str) -> dict[str, object]:
    arch = load_arch_config("", dict(SHAPES[shape]))
    # (a model with recurrent layers: the block size the engine raises to fit a state a slot)
    block_size = state_block_size(arch, block_size, 1, 1 if dtype == "fp8" else 2)
    groups = KVCacheGroups.plan(arch.layer_cache_kinds())
    parts, heads, dim = arch.kv_cache_entry()
    layout = KVCacheLayout(groups.page_layers, heads, dim, block_size, DTYPES[dtype], parts)
    held = groups.request_bytes(context, block_size, layout.bytes_per_block)
    full = groups.full_attention_bytes(context, block_size, layout.bytes_per_block)
    return {
        "shape": shape,
        "context": context,
        "kv_dtype": dtype,
        "block_size": block_size,
        "groups": groups.describe(),
        "bytes_per_block": layout.bytes_per_block,
        "blocks_per_request": groups.blocks_per_request(context, block_size),
        "request_bytes": held,
        "every_layer_full_bytes": full,
        "fraction": round(held / full, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["gpt-oss-20b", "gemma-3-12b", "qwen3.5-27b"],
                    choices=sorted(SHAPES))  # fmt: skip
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--output", help="write the results as JSON here")
    args = ap.parse_args()
    rows = [measure(s, c, args.block_size, args.dtype) for s in args.shapes for c in args.contexts]
    print(
        f"{'shape':<16}{'context':>9}{'held MiB':>11}{'all-full MiB':>14}{'fraction':>10}  groups"
    )
    for r in rows:
        held, full = int(r["request_bytes"]), int(r["every_layer_full_bytes"])  # type: ignore[call-overload]
        print(f"{r['shape']:<16}{r['context']:>9}{held / 2**20:>11.1f}{full / 2**20:>14.1f}"
              f"{r['fraction']:>10}  {r['groups']}")  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
