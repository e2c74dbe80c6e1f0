"""Programmatic dependent launch (PDL) for the engine's Triton kernels, at one token.

On Hopper and later GPUs a kernel launched with PDL may be scheduled while the kernel before
it in the stream is still running: its programs start, then wait (``griddepcontrol.wait``)
until that kernel has finished and its writes are visible. A batch-1 decode step is some 350
short kernels in one CUDA graph (eleven a layer, every one of them ours: the linear layers go
through the Triton GEMV at one token); with PDL each one's launch and ramp-up overlap the tail
of the one before, instead of following it. Measured on an H200 (Llama-3.1-8B shape; the
``latency.py`` variant without PDL was dropped once the A/B was settled): 4.00–4.06 ms a step
with PDL, 4.33–4.35 ms without (docs/performance.md, "batch-1 decode").

Only one-token launches use it. With more tokens the linear layers are cuBLAS GEMMs between
our kernels and the kernels are long; PDL on every launch measured no faster above 128 rows,
1–3 % slower at 2–128 rows and 4–5 % slower on prefill steps
(docs/performance.md, "Where the time goes": PDL at more tokens). A launch of more tokens
compiles to the same PTX as
before PDL existed here (checked for ``_decode`` and ``_silu_mul``: ``USE_PDL`` is a
constexpr, so its branch compiles away).

The rule every kernel here keeps: ``await_inputs`` comes before any read of what an earlier
kernel wrote and before any write, in every program (the GEMV reads its first weight tile
first: no kernel of a step writes weights). Since every program of a kernel waits, a kernel ends
only after the one before it has, and dependencies two or more kernels back hold as well.
Kernels launched without PDL (PyTorch's, cuBLAS's) keep ordinary stream order on both sides.
"""

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def await_inputs(USE_PDL: tl.constexpr):
    """Let the next kernel be scheduled, then wait for the previous one to finish."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def launch_options(x: torch.Tensor) -> dict[str, bool]:
    """The keyword arguments of a launch whose input is ``x`` ([tokens, ...]): ``USE_PDL``
    for the kernel's ``await_inputs`` and, for one token on a device with PDL, Triton's
    ``launch_pdl``."""
    if x.shape[0] != 1 or not x.is_cuda:
        return {"USE_PDL": False}
    if not supported(x.get_device()):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


@functools.cache
def supported(device_index: int) -> bool:
    """Compute capability 9.0 (Hopper) or later."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9
