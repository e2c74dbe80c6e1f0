"""Gemma 3 (text) on the GPU (the CPU suite is tests/integration/test_gemma3.py): the tiny
six-layer checkpoint (a window of 8 tokens on four layers) through the Triton and
FlashAttention backends' sliding-window paths, with the fused rotary storing the keys, decode
CUDA graphs and piecewise graphs for prefill chunks, against eager execution and Hugging Face
on the CPU (float32); in bfloat16 close to float32. Every prompt of ``common.PROMPTS`` but the
short ones is longer than the window."""

from pathlib import Path

import pytest
import torch

from baton import LLM
from baton.tiny_model import make_tiny_model
from tests.gpu.common import (
    KW,
    PROMPTS,
    assert_bfloat16_close_to_float32,
    assert_flash_attention_close_to_float32,
    greedy,
    hf_greedy,
    skip_unless_backend,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3-gpu") / "m", arch="gemma3",
                           tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def want(gemma3: Path) -> list[list[int]]:
    return hf_greedy(gemma3, PROMPTS)


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_graphs_and_eager_equal_hugging_face(
    gemma3: Path, want: list[list[int]], backend: str
) -> None:
    skip_unless_backend(backend)
    with LLM(model=str(gemma3), dtype="float32", enforce_eager=True, attention_backend=backend,
             **KW) as eager:  # fmt: skip
        assert eager.config.model.fused_ops  # (the fused rotary stores the keys)
        assert greedy(eager, PROMPTS) == want
    with LLM(model=str(gemma3), dtype="float32", attention_backend=backend, **KW) as graphs:
        runner = graphs.client.core.executor.worker.runner  # type: ignore[attr-defined]
        assert runner.graphs is not None and runner.pieces is not None
        assert greedy(graphs, PROMPTS) == want


def test_bfloat16_is_close_to_float32(gemma3: Path) -> None:
    assert_bfloat16_close_to_float32(gemma3, PROMPTS, **KW)


def test_flash_attention_takes_the_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The five windowed layers (8 tokens: 7 to the left) and the global one through
    FlashAttention-4 in bfloat16, close to float32."""
    skip_unless_backend("flash_attn")  # (before building the checkpoint)
    path = make_tiny_model(tmp_path, arch="gemma3", head_dim=64)  # (heads FlashAttention takes)
    seen = assert_flash_attention_close_to_float32(path, PROMPTS, monkeypatch)
    assert seen == {(7, False, 64, 64), (None, False, 64, 64)}
