"""Measured launches of the one-token GEMVs (``layers/gemv.py``, ``layers/fp8_linear.py``) per
GPU model and projection shape, kept in ``configs/<GPU name>.json`` beside this file and written
by ``benchmarks/gemv.py --tune``. A shape without one takes Triton's autotuner instead.

The autotuner times one weight, which fits in L2 for the smaller projections of an 8B model,
and launches each call alone, where a decode step's CUDA graph runs them back to back. On an
H200 it chose FP8 GEMV configurations 9 % slower per layer than a sweep over weights read from
HBM inside a graph (docs/results/h200-2026-12-02/NOTES.md). The tuner measures the latter way.

    {"gemv": {"6144x4096": {"block_n": 8, "block_k": 512, "warps": 4, "stages": 3}, ...},
     "fp8_gemv": {...}, "fp8_gemv_codes": {...}, "measured": {...}}
"""

import functools
from pathlib import Path
from typing import Any

import torch

from services.worker.engine import tuned_configs

CONFIG_DIR = Path(__file__).parent / "configs"
KINDS = ("gemv", "fp8_gemv", "fp8_gemv_codes")  # the last: its activation quantized before
KEYS = ("block_n", "block_k", "warps", "stages")

Table = dict[str, dict[tuple[int, int], dict[str, int]]]


def parse(doc: dict[str, Any]) -> Table:
    """A configuration document as {kind: {(N, K): launch}}; anything else is an error (the
    ``measured`` record is kept for people, not read)."""
    unknown = set(doc) - {*KINDS, "measured"}
    if unknown:
        raise ValueError(f"unknown GEMV configuration kinds {sorted(unknown)}")
    table: Table = {}
    for kind in KINDS:
        for shape, launch in doc.get(kind, {}).items():
            n, _, k = shape.partition("x")
            if not (n.isdigit() and k.isdigit()):
                raise ValueError(f"{kind}: a shape is 'NxK', got {shape!r}")
            if set(launch) != set(KEYS) or not all(
                isinstance(v, int) and v > 0 for v in launch.values()
            ):
                raise ValueError(f"{kind} {shape}: a launch is positive {', '.join(KEYS)}")
            table.setdefault(kind, {})[(int(n), int(k))] = dict(launch)
    return table


@functools.cache
def _for_device(index: int) -> Table:
    return parse(tuned_configs.read(CONFIG_DIR, torch.cuda.get_device_name(index)))


def launch(kind: str, x: torch.Tensor, n: int, k: int) -> dict[str, int] | None:
    """The measured launch of this GPU for an [N, K] weight as kernel keywords, or None."""
    if not x.is_cuda:
        return None
    entry = _for_device(x.get_device()).get(kind, {}).get((n, k))
    return None if entry is None else as_keywords(entry)


def as_keywords(entry: dict[str, int]) -> dict[str, int]:
    return {"BLOCK_N": entry["block_n"], "BLOCK_K": entry["block_k"],
            "num_warps": entry["warps"], "num_stages": entry["stages"]}  # fmt: skip
