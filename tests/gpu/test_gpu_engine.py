"""GPU-only checks (skipped without CUDA; run on the GPU machine). The HF parity suite and the
attention / fused-kernel unit tests also run on the GPU there; these cover what only a GPU has:
CUDA graphs against eager execution, bfloat16, and KV sizing from free memory."""

from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", "def f(x):\n    return x * 2\n" * 6]


def greedy(llm: LLM, n: int = 32) -> list[list[int]]:
    # 3 prompts × n, then 7 more: decode batches of 1..10 hit several captured graph sizes
    prompts = PROMPTS + [f"prompt number {i}" for i in range(7)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_cuda_graphs_equal_eager_and_the_cpu_reference(tiny_model: Path) -> None:
    path = str(tiny_model)
    cpu = greedy(LLM(model=path, device="cpu", show_progress=False))
    eager = LLM(model=path, dtype="float32", enforce_eager=True, show_progress=False)
    graphs = LLM(model=path, dtype="float32", show_progress=False)
    assert graphs.client.core.executor.worker.runner.graphs is not None  # type: ignore[attr-defined]
    assert eager.client.core.executor.worker.runner.graphs is None  # type: ignore[attr-defined]
    assert greedy(graphs) == greedy(eager) == cpu


def test_bfloat16_is_the_default_and_close_to_float32(tiny_model: Path) -> None:
    bf16 = LLM(model=str(tiny_model), show_progress=False)
    assert bf16.config.model.dtype == "bfloat16" and bf16.config.attention.backend == "triton"
    fp32 = LLM(model=str(tiny_model), dtype="float32", show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for a, b in zip(bf16.generate(PROMPTS, params), fp32.generate(PROMPTS, params), strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None
        shared = set(la[0]) & set(lb[0])
        assert len(shared) >= 3
        assert all(abs(la[0][t].logprob - lb[0][t].logprob) < 0.05 for t in shared)


def test_kv_cache_is_sized_from_free_memory(tmp_path: Path) -> None:
    # big enough per token (8 KiB) that the memory budget, not the block-count bound, decides
    path = make_tiny_model(
        tmp_path / "m", "llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4
    )
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(model=str(path), gpu_memory_utilization=0.3, show_progress=False)
    used = torch.cuda.memory_reserved(0)
    info = llm.get_model_info()
    kv = llm.get_stats().num_blocks * info.kv_bytes_per_token * llm.config.cache.block_size
    assert kv > 0.2 * total  # most of the allowance went to the cache
    assert used < 0.3 * total  # and the engine stayed inside it
    del llm
