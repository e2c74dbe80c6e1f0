"""Gemma 3 (text) on the GPU (the CPU suite is tests/integration/test_gemma3.py): the tiny
six-layer checkpoint (a window of 8 tokens on four layers) through the Triton and
FlashAttention backends' sliding-window paths, with the fused rotary storing the keys, decode
CUDA graphs and piecewise graphs for prefill chunks, against eager execution and Hugging Face
on the CPU (float32); in bfloat16 close to float32."""

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
_SHARED = [(7 * i) % 300 + 5 for i in range(37)]
# a long prompt (chunked at a budget of 64), two sharing a prefix, and short ones: decode
# batches of 1 to 10 rows replay several captured sizes; every prompt but the short ones is
# longer than the window
PROMPTS = [[(5 * i) % 250 + 3 for i in range(150)], [*_SHARED, 40, 41], [*_SHARED, 90]] + [
    [11 + i, 12 + 2 * i, 13] for i in range(7)
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW: dict[str, Any] = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "show_progress": False}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3-gpu") / "m", arch="gemma3",
                           tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def hf_greedy(gemma3: Path) -> list[list[int]]:
    model: Any = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32)
    out = []
    for ids in PROMPTS:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             min_new_tokens=MAX_NEW)  # fmt: skip
        out.append(seq[0, len(ids) :].tolist())
    return out


def greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _backend_available(name: str) -> bool:
    if name != "flash_attn":
        return True
    from services.worker.engine.attention.flash_attn_backend import available

    return available()


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_graphs_and_eager_equal_hugging_face(
    gemma3: Path, hf_greedy: list[list[int]], backend: str
) -> None:
    if not _backend_available(backend):
        pytest.skip("FlashAttention-4 is not installed")
    eager = LLM(model=str(gemma3), dtype="float32", enforce_eager=True, attention_backend=backend,
                **KW)  # fmt: skip
    try:
        assert eager.config.model.fused_ops  # (the fused rotary stores the keys)
        assert greedy(eager) == hf_greedy
    finally:
        eager.shutdown()
    graphs = LLM(model=str(gemma3), dtype="float32", attention_backend=backend, **KW)
    try:
        runner = graphs.client.core.executor.worker.runner  # type: ignore[attr-defined]
        assert runner.graphs is not None and runner.pieces is not None
        assert greedy(graphs) == hf_greedy
    finally:
        graphs.shutdown()


def test_bfloat16_is_close_to_float32(gemma3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    bf16 = LLM(model=str(gemma3), **KW)
    try:
        assert bf16.config.model.dtype == "bfloat16"
        low = bf16.generate(prompts, params, use_tqdm=False)
    finally:
        bf16.shutdown()
    fp32 = LLM(model=str(gemma3), dtype="float32", **KW)
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
