"""The machine's physical limits, measured in the same run as the benchmark that uses them.

- copy bandwidth: a large device-to-device (or DRAM-to-DRAM) copy, counted as bytes read plus
  bytes written per second — the usual "copy bandwidth" (4.3 TB/s on an H200).
- matmul peak: an n×n×n matrix product in the benchmark's dtype (≈ 790 TFLOP/s bf16 on an H200).
"""

import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """Bytes/s, read + written."""
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / seconds


def matmul_peak(
    device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 10
) -> float:
    """FLOP/s of a square matrix product."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_time(lambda: a @ b, device, reps)
    return 2 * n**3 / seconds
