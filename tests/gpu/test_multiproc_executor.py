"""The multiprocess executor on a GPU (skipped without CUDA; run on the GPU machine): at TP=1
its one rank runs in a process of its own, through the same parallel layers (a world of one),
with CUDA graphs and async scheduling, and gives exactly the tokens of the in-process rank.
On a host with two GPUs, TP=2 over NCCL (captured inside the decode graphs) gives them too."""

from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "def f(x):\n    return x\n" * 6]


def greedy(llm: LLM) -> list[list[int]]:
    prompts = PROMPTS + [f"prompt number {i}" for i in range(7)]  # decode batches of 1..10
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_multiproc_tp1_equals_uniproc(tiny_model: Path) -> None:
    kw = {"dtype": "float32", "show_progress": False}
    uni = LLM(model=str(tiny_model), **kw)  # type: ignore[arg-type]
    want = greedy(uni)
    uni.shutdown()
    mp = LLM(model=str(tiny_model), distributed_executor_backend="mp", **kw)  # type: ignore[arg-type]
    try:
        assert mp.config.scheduler.async_scheduling and mp.config.device.cuda_graph_batch_sizes
        assert greedy(mp) == want
    finally:
        mp.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_over_nccl_equals_tp1(tiny_model: Path) -> None:
    kw = {"dtype": "float32", "show_progress": False}
    one = LLM(model=str(tiny_model), **kw)  # type: ignore[arg-type]
    want = greedy(one)
    one.shutdown()
    two = LLM(model=str(tiny_model), tensor_parallel_size=2, **kw)  # type: ignore[arg-type]
    try:
        assert greedy(two) == want
    finally:
        two.shutdown()
