"""gpt-oss on the GPU (the CPU suite is tests/integration/test_gpt_oss.py): the tiny four-layer
checkpoint (a window of 8 tokens on two layers, sinks in every head) through the attention
backends' sliding-window and sink paths, with the fused rotary storing the keys, decode CUDA
graphs and piecewise graphs for prefill chunks, against eager execution and Hugging Face on the
CPU (float32). The experts have biases and a clamped SwiGLU, which the fused MoE kernel does
not compute: they run the plain path (each expert's tokens gathered; while a graph captures,
every expert on every token), and the kernel is never called. In bfloat16 close to float32;
two GPUs equal to one."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MAX_NEW = 24
_SHARED = [(11 * i) % 400 + 7 for i in range(37)]
# a long prompt (chunked at a budget of 64), two sharing a prefix, and short ones: decode
# batches of 1 to 10 rows replay several captured sizes; all but the short ones are longer
# than the window
PROMPTS = [[(3 * i) % 350 + 9 for i in range(150)], [*_SHARED, 50, 51], [*_SHARED, 80]] + [
    [21 + i, 22 + 2 * i, 23] for i in range(7)
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW: dict[str, Any] = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "show_progress": False}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss-gpu") / "m", arch="gpt_oss")


@pytest.fixture(scope="module")
def want(gpt_oss: Path) -> list[list[int]]:
    """Hugging Face's greedy tokens, float32 on the CPU."""
    model: Any = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32)
    out = []
    for ids in PROMPTS:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             min_new_tokens=MAX_NEW)  # fmt: skip
        out.append(seq[0, len(ids) :].tolist())
    return out


def greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The token count of every call of the fused MoE kernel."""
    from services.worker.engine.ops import fused_moe

    calls: list[int] = []
    kernel = fused_moe.fused_moe

    def counted(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *args, **kw)

    monkeypatch.setattr(fused_moe, "fused_moe", counted)
    yield calls


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_graphs_and_eager_equal_hugging_face(
    gpt_oss: Path, want: list[list[int]], backend: str, kernel_calls: list[int]
) -> None:
    if backend == "flash_attn":
        from services.worker.engine.attention.flash_attn_backend import available

        if not available():
            pytest.skip("FlashAttention-4 is not installed")
    eager = LLM(model=str(gpt_oss), dtype="float32", enforce_eager=True,
                attention_backend=backend, **KW)  # fmt: skip
    try:
        assert greedy(eager) == want
    finally:
        eager.shutdown()
    graphs = LLM(model=str(gpt_oss), dtype="float32", attention_backend=backend, **KW)
    try:
        runner = graphs.client.core.executor.worker.runner  # type: ignore[attr-defined]
        assert runner.graphs is not None and runner.pieces is not None
        assert greedy(graphs) == want
    finally:
        graphs.shutdown()
    assert kernel_calls == []  # (biases, the clamped SwiGLU: the plain path)


def test_bfloat16_is_close_to_float32(gpt_oss: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    bf16 = LLM(model=str(gpt_oss), **KW)
    try:
        assert bf16.config.model.dtype == "bfloat16"
        low = bf16.generate(prompts, params, use_tqdm=False)
    finally:
        bf16.shutdown()
    fp32 = LLM(model=str(gpt_oss), dtype="float32", **KW)
    try:
        high = fp32.generate(prompts, params, use_tqdm=False)
    finally:
        fp32.shutdown()
    for a, b in zip(low, high, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None
        shared = set(la[0]) & set(lb[0])
        assert len(shared) >= 3
        assert all(abs(la[0][t].logprob - lb[0][t].logprob) < 0.1 for t in shared)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_two_gpus_equal_hugging_face(gpt_oss: Path, want: list[list[int]], ep: bool) -> None:
    llm = LLM(model=str(gpt_oss), dtype="float32", tensor_parallel_size=2,
              enable_expert_parallel=ep, **KW)  # fmt: skip
    try:
        assert greedy(llm) == want
    finally:
        llm.shutdown()
