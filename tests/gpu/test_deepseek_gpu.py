"""DeepSeek-V2/V3 on the GPU (the CPU suite is tests/integration/test_deepseek.py): the absorbed
MLA decode through the Triton kernel (``ops/mla_decode.py``), captured in the decode CUDA
graphs; prefill chunks in piecewise CUDA graphs, the latent attention run between the pieces;
against eager execution and Hugging Face on the CPU (float32), in bfloat16 close to float32,
and under async scheduling without a host sync in a step."""

from pathlib import Path

import pytest
import torch

from baton.tiny_model import make_tiny_model
from tests.gpu.common import (
    KW,
    PROMPTS,
    assert_async_steps_never_sync,
    assert_bfloat16_close_to_float32,
    assert_eager_and_graphs_equal,
    assert_flash_attention_close_to_float32,
    count_calls,
    hf_greedy,
    skip_unless_backend,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ARCHS = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek-gpu")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch size of every eager call of the MLA decode kernel."""
    from services.worker.engine.ops import mla_decode

    return count_calls(monkeypatch, mla_decode, "mla_decode")


@pytest.mark.parametrize("arch", ARCHS)
def test_graphs_and_eager_equal_hugging_face(
    models: dict[str, Path], arch: str, kernel_calls: list[int]
) -> None:
    """Eager, then decode CUDA graphs of several batch sizes (the kernel captured in them) and
    piecewise graphs for prefill chunks (mixed with decode rows): Hugging Face's tokens."""
    assert_eager_and_graphs_equal(
        models[arch], hf_greedy(models[arch], PROMPTS), kernel_calls, **KW
    )


def test_bfloat16_is_close_to_float32(models: dict[str, Path]) -> None:
    assert_bfloat16_close_to_float32(models["deepseek_v3"], PROMPTS, **KW)


def test_async_scheduling_steps_never_sync(models: dict[str, Path]) -> None:
    """The latent cache's writes, the chunks' gathers and the absorbed decode read nothing
    back to the host inside a step (CUDA's sync check raises on any such call)."""
    assert_async_steps_never_sync(models["deepseek_v3"], **KW)


def test_flash_attention_takes_the_prefill_at_deepseek_widths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With DeepSeek's head widths (keys 128 + 64 = 192 wide, values 128), the prefill chunks'
    attention over the decompressed context runs on FlashAttention-4 (its non-paged forward,
    each at its own width) in bfloat16, close to float32."""
    skip_unless_backend("flash_attn")  # (before building the checkpoint)
    path = make_tiny_model(tmp_path, arch="deepseek_v3", mla_widths=(128, 64, 128))
    seen = assert_flash_attention_close_to_float32(path, PROMPTS, monkeypatch)
    assert seen == {(None, False, 192, 128)}
