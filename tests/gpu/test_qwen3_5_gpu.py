"""Qwen3.5 (Gated DeltaNet hybrid), Qwen3-Next and Qwen3.5-MoE (the same with experts) on the
GPU (the CPU suites are tests/integration/test_qwen3_5.py, test_qwen3_next.py and
test_qwen3_5_moe.py): the Triton kernels of ``ops/gated_delta.py`` (the chunked prefill, the
recurrent decode step, the short convolution), the decode steps in CUDA graphs, against eager
execution and Hugging Face on the CPU (float32); in bfloat16 close to float32; no host sync
inside a step."""

from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM
from baton.tiny_model import make_tiny_model
from tests.gpu.common import (
    assert_bfloat16_close_to_float32,
    count_replays,
    greedy,
    hf_greedy,
    no_host_sync,
)
from tests.integration.test_qwen3_5 import GREEDY, MAX_NEW, PROMPTS, hf_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
KW: dict[str, Any] = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "show_progress": False}
# longer prompts too: the chunked kernel's several chunks of 64, a tail
LONG = [[(13 * i) % 900 + 4 for i in range(n)] for n in (150, 200)]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5's tiny checkpoint, Qwen3-Next's and Qwen3.5-MoE's (the same layers, with
    experts: the fused MoE kernel captured beside the Gated DeltaNet kernels)."""
    arch = request.param
    return make_tiny_model(tmp_path_factory.mktemp(f"{arch}-gpu") / "m", arch=arch)


def test_graphs_and_eager_equal_hugging_face(model: Path) -> None:
    want = hf_reference(str(model))[0] + hf_greedy(model, LONG, MAX_NEW)
    prompts = PROMPTS + LONG
    with LLM(model=str(model), dtype="float32", enforce_eager=True, **KW) as eager:
        assert greedy(eager, prompts, GREEDY) == want
    with LLM(model=str(model), dtype="float32", **KW) as graphs:
        replays = count_replays(graphs, pieces=False)  # (no piecewise graphs)
        assert greedy(graphs, prompts, GREEDY) == want
        assert greedy(graphs, prompts, GREEDY) == want  # again: prefix hits from checkpoints
        assert graphs.get_stats().prefix_hit_tokens > 0
    assert len(set(replays)) > 2  # decode batches of several sizes replayed their graphs


def test_bfloat16_is_close_to_float32(model: Path) -> None:
    assert_bfloat16_close_to_float32(model, PROMPTS + LONG, **KW)


def test_async_scheduling_steps_never_sync(model: Path) -> None:
    """The state pages' indices, the convolution and the delta rule read nothing back to the
    host inside a step (CUDA's sync check raises on any such call)."""
    with LLM(model=str(model), dtype="float32", **KW) as llm:
        assert llm.config.scheduler.async_scheduling
        want = greedy(llm, PROMPTS, GREEDY)  # warm: first-use allocations may sync
        with no_host_sync():
            got = greedy(llm, PROMPTS, GREEDY)
    assert got == want
