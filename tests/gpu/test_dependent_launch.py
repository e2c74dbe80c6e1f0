"""Programmatic dependent launch (ops/dependent_launch.py): a kernel that may start before
the one it reads from has finished must still read that kernel's output. A chain of the
engine's one-token kernels, each reading what the one before wrote, replayed as a CUDA graph
(as a decode step is) with new inputs each time, gives the same bits as the same chain launched
without PDL. The first kernel is a long GEMV, so a kernel after it that did not wait would
read its output buffer as the previous replay left it."""

from unittest import mock

import pytest
import torch

from services.worker.engine.ops import dependent_launch
from services.worker.engine.ops.fused_ops import (
    add_rms_norm,
    rms_norm,
    rotary_,
    silu_and_mul,
)
from services.worker.engine.ops.gemv import gemv

pytestmark = pytest.mark.gpu

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * shape[-1] ** -0.5).bfloat16()

    angles = torch.rand(64, HEAD_DIM, generator=g, device="cuda") * 6.28
    return {
        "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER),
        "qkv": w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": w(HIDDEN, HEADS * HEAD_DIM),
        "norm": (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16(),
        "cos": angles.cos(), "sin": angles.sin(),
    }  # fmt: skip


def _chain(w: dict[str, torch.Tensor], x: torch.Tensor, residual: torch.Tensor,
           position: torch.Tensor) -> torch.Tensor:  # fmt: skip
    h = silu_and_mul(gemv(x, w["gate_up"]))
    h, residual = add_rms_norm(gemv(h, w["down"]), residual, w["norm"], 1e-6)
    qkv = gemv(h, w["qkv"])
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    rotary_(position, q.view(1, HEADS, HEAD_DIM), k.view(1, KV_HEADS, HEAD_DIM), w["cos"], w["sin"])
    out = gemv(rms_norm(q, w["norm"][: HEADS * HEAD_DIM], 1e-6), w["o"])
    return torch.cat([out, residual, k], dim=-1)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, HIDDEN, generator=g, device="cuda").bfloat16()
    residual = torch.randn(1, HIDDEN, generator=g, device="cuda").bfloat16()
    return x, residual, torch.tensor([seed % 64], device="cuda")


def test_dependent_launches_read_what_the_kernel_before_wrote() -> None:
    if not dependent_launch.supported(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    w = _weights()
    static = [t.clone() for t in _inputs(0)]
    for _ in range(2):  # warm-up (GEMV autotuning, compilation), outside the capture
        _chain(w, *[t.clone() for t in static])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(w, *static)
    for seed in range(1, 9):
        x, residual, position = _inputs(seed)
        with mock.patch.object(dependent_launch, "supported", lambda device_index: False):
            expected = _chain(w, x, residual.clone(), position)
        for dst, src in zip(static, (x, residual, position), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {seed} differs from the serial chain"


def test_launch_options_follow_the_device() -> None:
    x = torch.zeros(1, device="cuda")
    options = dependent_launch.launch_options(x)
    assert options["USE_PDL"] == options.get("launch_pdl", False)
    assert options["USE_PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    assert dependent_launch.launch_options(torch.zeros(2, device="cuda")) == {"USE_PDL": False}
    with mock.patch.object(dependent_launch, "supported", lambda device_index: False):
        assert dependent_launch.launch_options(x) == {"USE_PDL": False}
