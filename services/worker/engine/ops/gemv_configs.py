"""Measured launches of the one-token GEMVs (``ops/gemv.py``, ``ops/fp8_linear.py``, and the
experts' two of ``ops/moe_gemv.py``) per GPU model and weight shape, kept in
``configs/linear/<GPU name>.json`` and written by ``benchmarks/kernels/gemv.py --tune`` (the
experts': ``benchmarks/moe_layer.py --tune``). A shape without one takes Triton's autotuner
instead.

Beside them, ``fp8_gemm``: per projection shape and row count, the launch of
``fp8_linear._fp8_gemm_kernel`` where it measured faster than cuBLASLt's FP8 GEMM
(``benchmarks/kernels/fp8_mm.py --tune``); a key M holds for row counts up to M above the next
smaller key, and a product of more rows than the largest, or of a shape with none, goes to
cuBLASLt.

The autotuner times one weight, which fits in L2 for the smaller projections of an 8B model,
and launches each call alone, where a decode step's CUDA graph runs them back to back. On an
H200 it chose FP8 GEMV configurations 9 % slower per layer than a sweep over weights read from
HBM inside a graph (docs/performance.md, "FP8": one token). The tuner measures the latter way.

    {"gemv": {"6144x4096": {"block_n": 8, "block_k": 512, "warps": 4, "stages": 3}, ...},
     "fp8_gemv": {...}, "fp8_gemv_codes": {...}, "fp8_gemv_codes_fast": {...},
     "moe_up": {"1536x2048": {...}}, "moe_down": {"2048x768": {...}}, "moe_up_fp8": {...}, ...
     "fp8_gemm": {"4096x14336": {"64": {"block_n": 64, "block_m": 64, "block_k": 128,
                                        "splits": 2, "warps": 4, "stages": 4}, ...}, ...},
     "measured": {...}}
"""

import functools
from typing import Any

import torch

from services.worker.engine.ops import tuned_configs

CONFIG_DIR = tuned_configs.CONFIG_DIR / "linear"


def moe_kind(stage: str, fp8: bool, block: int | None) -> str:
    """The table's kind of an experts' GEMV: ``stage`` "up" or "down"."""
    return f"moe_{stage}" + ("_fp8" if fp8 else "") + ("_block" if block else "")


# the experts' GEMV 1 (keyed by one expert's w13, [2·I, H]) and GEMV 2 (its w2, [H, I]) at one
# token, bf16, FP8 per channel and FP8 in blocks (the key holds no top_k and no biases, which
# the autotuner's does: models of one expert shape share an entry)
MOE_KINDS = tuple(
    moe_kind(stage, fp8, block)
    for fp8, block in ((False, None), (True, None), (True, 128))
    for stage in ("up", "down")
)
# fp8_gemv_codes: its activation quantized before; _fast: its products summed in float16
KINDS = ("gemv", "fp8_gemv", "fp8_gemv_codes", "fp8_gemv_codes_fast", *MOE_KINDS)
KEYS = ("block_n", "block_k", "warps", "stages")
GEMM = "fp8_gemm"
GEMM_KEYS = ("block_n", "block_m", "block_k", "splits", "warps", "stages")

Table = dict[str, dict[tuple[int, int], dict[str, int]]]
GemmTable = dict[tuple[int, int], dict[int, dict[str, int]]]  # (N, K) → {up to M rows: launch}


def parse(doc: dict[str, Any]) -> Table:
    """A configuration document as {kind: {(N, K): launch}}; anything else is an error (the
    ``measured`` record is kept for people, not read)."""
    unknown = set(doc) - {*KINDS, GEMM, "measured"}
    if unknown:
        raise ValueError(f"unknown GEMV configuration kinds {sorted(unknown)}")
    table: Table = {}
    for kind in KINDS:
        for shape, launch in doc.get(kind, {}).items():
            table.setdefault(kind, {})[_shape(kind, shape)] = _launch(kind, shape, launch, KEYS)
    return table


def parse_gemm(doc: dict[str, Any]) -> GemmTable:
    """The document's ``fp8_gemm`` launches as {(N, K): {M: launch}}: keys are row counts,
    BLOCK_N and BLOCK_K at least the tensor cores' 64 and 32, BLOCK_M at least 16."""
    table: GemmTable = {}
    for shape, by_rows in doc.get(GEMM, {}).items():
        nk = _shape(GEMM, shape)
        for rows, launch in by_rows.items():
            if not rows.isdigit() or int(rows) < 1:
                raise ValueError(f"{GEMM} {shape}: a row count is a positive integer, got {rows!r}")
            entry = _launch(GEMM, shape, launch, GEMM_KEYS)
            if entry["block_n"] < 64 or entry["block_k"] < 32 or entry["block_m"] < 16:
                raise ValueError(f"{GEMM} {shape} {rows}: tiles below the tensor cores' {launch}")
            table.setdefault(nk, {})[int(rows)] = entry
    return table


def _shape(kind: str, shape: str) -> tuple[int, int]:
    n, _, k = shape.partition("x")
    if not (n.isdigit() and k.isdigit()):
        raise ValueError(f"{kind}: a shape is 'NxK', got {shape!r}")
    return int(n), int(k)


def _launch(kind: str, shape: str, launch: Any, keys: tuple[str, ...]) -> dict[str, int]:
    if (
        not isinstance(launch, dict)
        or set(launch) != set(keys)
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in launch.values()
        )
    ):
        raise ValueError(f"{kind} {shape}: a launch is positive {', '.join(keys)}")
    return dict(launch)


@functools.cache
def _for_device(index: int) -> Table:
    return parse(tuned_configs.read(CONFIG_DIR, torch.cuda.get_device_name(index)))


@functools.cache
def _gemm_for_device(index: int) -> GemmTable:
    return parse_gemm(tuned_configs.read(CONFIG_DIR, torch.cuda.get_device_name(index)))


def gemm_launch(x: torch.Tensor, m: int, n: int, k: int) -> dict[str, int] | None:
    """The measured ``fp8_gemm`` launch of this GPU for ``m`` rows through an [N, K] weight, as
    ``fp8_linear.fp8_gemm``'s config, or None (cuBLASLt then)."""
    if not x.is_cuda:
        return None
    entry = pick_rows(_gemm_for_device(x.get_device()).get((n, k), {}), m)
    return None if entry is None else gemm_keywords(entry)


def pick_rows(by_rows: dict[int, dict[str, int]], m: int) -> dict[str, int] | None:
    """The entry of the smallest row count at least ``m``, or None above them all."""
    fits = [rows for rows in by_rows if rows >= m]
    return by_rows[min(fits)] if fits else None


def gemm_keywords(entry: dict[str, int]) -> dict[str, int]:
    return {"BLOCK_N": entry["block_n"], "BLOCK_M": entry["block_m"],
            "BLOCK_K": entry["block_k"], "SPLITS": entry["splits"],
            "num_warps": entry["warps"], "num_stages": entry["stages"]}  # fmt: skip


def launch(kind: str, x: torch.Tensor, n: int, k: int) -> dict[str, int] | None:
    """The measured launch of this GPU for an [N, K] weight as kernel keywords, or None."""
    if not x.is_cuda:
        return None
    entry = _for_device(x.get_device()).get(kind, {}).get((n, k))
    return None if entry is None else as_keywords(entry)


def as_keywords(entry: dict[str, int]) -> dict[str, int]:
    return {"BLOCK_N": entry["block_n"], "BLOCK_K": entry["block_k"],
            "num_warps": entry["warps"], "num_stages": entry["stages"]}  # fmt: skip
