"""Qwen3.5 (Gated DeltaNet hybrid) on the GPU (the CPU suite is
tests/integration/test_qwen3_5.py): the Triton kernels of ``ops/gated_delta.py`` (the chunked
prefill, the recurrent decode step, the short convolution), the decode steps in CUDA graphs,
against eager execution and Hugging Face on the CPU (float32); in bfloat16 close to float32;
no host sync inside a step."""

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from tests.integration.test_qwen3_5 import GREEDY, PROMPTS, hf_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
KW: dict[str, Any] = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "show_progress": False}
# longer prompts too: the chunked kernel's several chunks of 64, a tail
LONG = [[(13 * i) % 900 + 4 for i in range(n)] for n in (150, 200)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_5-gpu") / "m", arch="qwen3_5")


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_long(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for ids in LONG:
        seq = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                          min_new_tokens=GREEDY.max_tokens, do_sample=False)  # fmt: skip
        out.append(seq[0, len(ids) :].tolist())
    return out


def test_graphs_and_eager_equal_hugging_face(model: Path) -> None:
    want = hf_reference(str(model))[0] + hf_long(model)
    prompts = PROMPTS + LONG
    eager = LLM(model=str(model), dtype="float32", enforce_eager=True, **KW)
    try:
        assert greedy(eager, prompts) == want
    finally:
        eager.shutdown()
    graphs = LLM(model=str(model), dtype="float32", **KW)
    try:
        runner = graphs.client.core.executor.worker.runner  # type: ignore[attr-defined]
        assert runner.graphs is not None and runner.pieces is None  # (no piecewise graphs)
        replays: list[int] = []
        replay = runner.graphs.run

        def counted(inputs: Any, fill: Any = None) -> Any:
            replays.append(len(inputs.req_ids))
            return replay(inputs, fill)

        runner.graphs.run = counted
        assert greedy(graphs, prompts) == want
        assert greedy(graphs, prompts) == want  # again: prefix hits from the checkpoints
        assert graphs.get_stats().prefix_hit_tokens > 0
    finally:
        graphs.shutdown()
    assert len(set(replays)) > 2  # decode batches of several sizes replayed their graphs


def test_bfloat16_is_close_to_float32(model: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + LONG]
    bf16 = LLM(model=str(model), **KW)
    try:
        assert bf16.config.model.dtype == "bfloat16"
        low = bf16.generate(prompts, params, use_tqdm=False)
    finally:
        bf16.shutdown()
    fp32 = LLM(model=str(model), dtype="float32", **KW)
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


def test_async_scheduling_steps_never_sync(model: Path) -> None:
    """The state pages' indices, the convolution and the delta rule read nothing back to the
    host inside a step (CUDA's sync check raises on any such call)."""
    llm = LLM(model=str(model), dtype="float32", **KW)
    try:
        assert llm.config.scheduler.async_scheduling
        want = greedy(llm, PROMPTS)  # warm: first-use allocations may sync
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = greedy(llm, PROMPTS)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        llm.shutdown()
    assert got == want
