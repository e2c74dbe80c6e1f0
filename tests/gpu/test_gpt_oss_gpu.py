"""gpt-oss on the GPU (the CPU suite is tests/integration/test_gpt_oss.py): the tiny four-layer
checkpoint (a window of 8 tokens on two layers, sinks in every head) through the attention
backends' sliding-window and sink paths, with the fused rotary storing the keys, decode CUDA
graphs and piecewise graphs for prefill chunks, against eager execution and Hugging Face on the
CPU (float32). The experts' biases and clamped SwiGLU run in the fused MoE kernels (the
grouped GEMMs, and the GEMVs at a few tokens). In bfloat16 close to float32; two GPUs equal to
one.

Hugging Face's gpt-oss differs between transformers versions: on a GPU host with 5.17.0 the
reference's tokens differ from the first, while the engine on that host's CPU and GPU agree
(docs/results/h100-2026-12-05d); the CPU suite holds the engine to the pinned version."""

from pathlib import Path

import pytest
import torch

from baton import LLM
from baton.tiny_model import make_tiny_model
from tests.gpu.common import (
    KW,
    assert_bfloat16_close_to_float32,
    assert_flash_attention_close_to_float32,
    count_calls,
    greedy,
    hf_greedy,
    skip_unless_backend,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_SHARED = [(11 * i) % 400 + 7 for i in range(37)]
# a long prompt (chunked at a budget of 64), two sharing a prefix, and short ones: decode
# batches of 1 to 10 rows replay several captured sizes; all but the short ones are longer
# than the window
PROMPTS = [[(3 * i) % 350 + 9 for i in range(150)], [*_SHARED, 50, 51], [*_SHARED, 80]] + [
    [21 + i, 22 + 2 * i, 23] for i in range(7)
]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss-gpu") / "m", arch="gpt_oss")


@pytest.fixture(scope="module")
def want(gpt_oss: Path) -> list[list[int]]:
    return hf_greedy(gpt_oss, PROMPTS)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every call of the fused MoE kernel."""
    from services.worker.engine.ops import fused_moe

    return count_calls(monkeypatch, fused_moe, "fused_moe")


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_graphs_and_eager_equal_hugging_face(
    gpt_oss: Path, want: list[list[int]], backend: str, kernel_calls: list[int]
) -> None:
    skip_unless_backend(backend)
    with LLM(model=str(gpt_oss), dtype="float32", enforce_eager=True, attention_backend=backend,
             **KW) as eager:  # fmt: skip
        assert greedy(eager, PROMPTS) == want
    with LLM(model=str(gpt_oss), dtype="float32", attention_backend=backend, **KW) as graphs:
        runner = graphs.client.core.executor.worker.runner  # type: ignore[attr-defined]
        assert runner.graphs is not None and runner.pieces is not None
        assert greedy(graphs, PROMPTS) == want
    assert kernel_calls and max(kernel_calls) > 1  # (biases, the clamped SwiGLU: the kernels)


def test_bfloat16_is_close_to_float32(gpt_oss: Path) -> None:
    assert_bfloat16_close_to_float32(gpt_oss, PROMPTS, **KW)


def test_flash_attention_takes_the_window_and_the_sinks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The windowed layers (8 tokens: 7 to the left) and the full ones, all with sinks,
    through FlashAttention-4 in bfloat16, close to float32."""
    skip_unless_backend("flash_attn")  # (before building the checkpoint)
    path = make_tiny_model(tmp_path, arch="gpt_oss", head_dim=64)  # (heads FlashAttention takes)
    seen = assert_flash_attention_close_to_float32(path, PROMPTS, monkeypatch)
    assert seen == {(7, True, 64, 64), (None, True, 64, 64)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_two_gpus_equal_hugging_face(gpt_oss: Path, want: list[list[int]], ep: bool) -> None:
    with LLM(model=str(gpt_oss), dtype="float32", tensor_parallel_size=2,
             enable_expert_parallel=ep, **KW) as llm:  # fmt: skip
        assert greedy(llm, PROMPTS) == want
