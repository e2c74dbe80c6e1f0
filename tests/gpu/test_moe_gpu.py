"""Mixture-of-experts models on the GPU (the CPU suite is tests/integration/test_moe_models.py):
the experts through the fused Triton kernel (``ops/fused_moe.py``), captured in the decode
CUDA graphs and the piecewise graphs of prefill chunks; against eager execution and Hugging
Face on the CPU (float32); in bfloat16 close to float32; without a host sync in a step; FP8
experts against their dequantizing reference; two GPUs (each expert split, or half the experts
each) equal to one."""

from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM
from baton.tiny_model import make_tiny_model
from tests.gpu.common import (
    KW,
    PROMPTS,
    assert_async_steps_never_sync,
    assert_bfloat16_close_to_float32,
    assert_eager_and_graphs_equal,
    count_calls,
    greedy,
    hf_greedy,
)
from tests.helpers import (
    FP8_GPU_EXACT,
    FP8_GPU_MEDIAN_ATOL,
    FP8_GREEDY,
    FP8_PROMPTS,
    check_against_fp8_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"arch": "qwen3_moe", "num_layers": 3},  # layers 0, 2 MoE; 1 dense
    "mixtral": {"arch": "mixtral"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-gpu")
    return {name: make_tiny_model(root / name, **kw) for name, kw in ARCHS.items()}


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every eager call of the fused MoE kernel."""
    from services.worker.engine.ops import fused_moe

    return count_calls(monkeypatch, fused_moe, "fused_moe")


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_graphs_and_eager_equal_hugging_face(
    models: dict[str, Path], name: str, kernel_calls: list[int]
) -> None:
    """Eager, then decode CUDA graphs of several batch sizes (the kernel captured in them) and
    piecewise graphs for prefill chunks (mixed with decode rows): Hugging Face's tokens."""
    assert_eager_and_graphs_equal(
        models[name], hf_greedy(models[name], PROMPTS), kernel_calls, **KW
    )


def test_bfloat16_is_close_to_float32(models: dict[str, Path]) -> None:
    assert_bfloat16_close_to_float32(models["qwen3_moe"], PROMPTS, **KW)


def test_async_scheduling_steps_never_sync(models: dict[str, Path]) -> None:
    """Routing, the experts' alignment by expert and their GEMMs read nothing back to the host
    inside a step (CUDA's sync check raises on any such call)."""
    assert_async_steps_never_sync(models["qwen3_moe"], **KW)


@pytest.mark.parametrize(
    "kw",
    [{"quantize": "fp8-channel"},
     {"quantize": "fp8-block", "hidden_size": 128, "moe_intermediate_size": 128, "num_heads": 8}],
    ids=["fp8-channel", "fp8-block"],
)  # fmt: skip
def test_fp8_experts_match_their_dequantizing_reference(
    tmp_path: Path, kw: dict[str, Any], kernel_calls: list[int]
) -> None:
    """As the dense FP8 layers on a GPU (tests/gpu/test_fp8_kernels.py), in float32 as the
    reference computes: the kernel rounds activations exactly as the reference does; a
    near-tie may flip (``FP8_GPU_EXACT`` are the reference's argmax: on an H100 60 and 57 of
    64); the median logprob within what the tensor cores' accumulation moves it
    (``FP8_GPU_MEDIAN_ATOL``: on an H100 0.0026-0.0028 and 0.0074-0.0085)."""
    path = make_tiny_model(tmp_path / "fp8", arch="qwen3_moe", num_layers=3, **kw)
    llm = LLM(model=str(path), dtype="float32", show_progress=False)
    try:
        outs = llm.generate(FP8_PROMPTS, FP8_GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert kernel_calls  # the FP8 experts ran in the fused kernel
    fmt = kw["quantize"]
    exact = check_against_fp8_reference(path, outs, median_atol=FP8_GPU_MEDIAN_ATOL[fmt])
    assert exact >= FP8_GPU_EXACT[fmt] * len(FP8_PROMPTS) * (FP8_GREEDY.max_tokens or 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_two_gpus_equal_hugging_face(models: dict[str, Path], ep: bool) -> None:
    path = models["qwen3_moe"]
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2,
              enable_expert_parallel=ep, **KW)  # fmt: skip
    try:
        assert greedy(llm, PROMPTS) == hf_greedy(path, PROMPTS)
    finally:
        llm.shutdown()
