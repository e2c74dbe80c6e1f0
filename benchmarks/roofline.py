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


def _times(fn, device: torch.device, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds per call after a warm-up: CUDA events on a GPU, a host clock on CPU."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """Bytes/s, read + written, of one large copy (4 GiB each way on a GPU, as KINDS.md did)."""
    nbytes = nbytes or (4 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    # a ceiling: the best of the runs (medians of one size varied 10% between processes)
    seconds = min(_times(lambda: dst.copy_(src), device, reps))
    return 2 * nbytes / seconds


def matmul_peak(
    device: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 10
) -> float:
    """FLOP/s of a square matrix product."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = min(_times(lambda: a @ b, device, reps))
    return 2 * n**3 / seconds
