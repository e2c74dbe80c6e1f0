"""Rows of a ``torch.profiler`` run, for the benchmarks' kernel tables."""

from typing import Any


def kernel_rows(prof: Any, steps: int = 1) -> list[dict[str, Any]]:
    """GPU kernels by their own device time, per step, largest first."""
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0 and e.device_type.name == "CUDA":
            rows.append({"kernel": e.key[:90], "us_per_step": us / steps,
                         "calls_per_step": e.count / steps})  # fmt: skip
    return sorted(rows, key=lambda r: -r["us_per_step"])


def device_span_us(prof: Any) -> float:
    """From the first GPU activity's start to the last one's end, in µs: beside the wall time
    around it, what the host adds before and after; beside the kernels' sum, the GPU's idle
    time in between."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type.name == "CUDA"]  # fmt: skip
    return max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0


def cpu_rows(prof: Any) -> list[dict[str, Any]]:
    """Host operators by their own CPU time, largest first."""
    rows = [{"op": e.key[:90], "ms": e.self_cpu_time_total / 1e3, "calls": e.count}
            for e in prof.key_averages() if e.device_type.name != "CUDA"]  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms"])
