"""GPU-only checks (skipped without CUDA; run on the GPU machine). The HF parity suite and the
attention / fused-kernel unit tests also run on the GPU there; these cover what only a GPU has:
CUDA graphs against eager execution, bfloat16, and KV sizing from free memory."""

from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from tests.gpu.common import no_host_sync

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


def test_decode_graphs_of_two_context_bounds_equal_eager(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split launch for contexts above 48 tokens (``DECODE_LONG_CONTEXT``) and contexts split
    from 8 tokens on: every size whose rows split the context is captured for contexts up to
    48 and up to max_model_len, each step replays the graph of its longest context, and the
    greedy tokens are eager's (which launches by the step's real contexts)."""
    from services.worker.engine.attention import triton_backend

    cls = triton_backend.TritonAttentionBackend
    monkeypatch.setattr(triton_backend, "TOKENS_PER_SPLIT", 8)
    for name, value in (("DECODE_SPLIT_BLOCK_N", 32), ("DECODE_SPLIT_WARPS", 2),
                        ("DECODE_SPLIT_STAGES", 3), ("DECODE_LONG_CONTEXT", 48)):  # fmt: skip
        monkeypatch.setattr(cls, name, value)
    path = str(tiny_model)
    kw = {"dtype": "float32", "attention_backend": "triton", "show_progress": False}
    eager = LLM(model=path, enforce_eager=True, **kw)  # type: ignore[arg-type]
    graphs = LLM(model=path, **kw)  # type: ignore[arg-type]
    runner = graphs.client.core.executor.worker.runner.graphs  # type: ignore[attr-defined]
    top = graphs.config.model.max_model_len
    arch = graphs.config.model.arch
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for size in runner.sizes:  # the default rule: fill the GPU once
        split = triton_backend.num_decode_splits(size, arch.num_kv_heads, top, sms) > 1
        assert runner.contexts[size] == ([48, top] if split else [top]), size
    assert runner.contexts[1] == [48, top]
    assert set(runner.graphs) == {(s, c) for s, bounds in runner.contexts.items() for c in bounds}
    keys: list[tuple[int, int]] = []
    key = runner.key

    def counted(batch: int, seq_lens: list[int]) -> tuple[int, int]:
        keys.append(key(batch, seq_lens))
        return keys[-1]

    runner.key = counted
    short = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(["Hi", "Hello there"], short)]
    got = [o.outputs[0].token_ids for o in graphs.generate(["Hi", "Hello there"], short)]
    assert got == want
    assert greedy(graphs) == greedy(eager)  # the long prompt's contexts pass 48 tokens
    assert {c for _, c in keys} == {48, top}


def test_bfloat16_is_the_default_and_close_to_float32(tiny_model: Path) -> None:
    bf16 = LLM(model=str(tiny_model), show_progress=False)
    from services.worker.engine.attention.flash_attn_backend import available

    auto = "flash_attn" if available() else "triton"  # FlashAttention-4 on Hopper when installed
    assert bf16.config.model.dtype == "bfloat16" and bf16.config.attention.backend == auto
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


def test_async_scheduling_never_waits_for_the_device_but_for_its_tokens(tiny_model: Path) -> None:
    """On a GPU the host schedules step N+1 while N runs. Any synchronizing call inside a step
    (a copy from pageable memory, ``.item()``, a boolean mask) would make it wait for N and undo
    that: the whole generation runs under CUDA's sync check, and must equal the one-step-at-a-
    time engine's output for greedy, seeded, penalized, logprob and min_tokens requests."""
    path = str(tiny_model)
    prompts = PROMPTS + [f"prompt number {i}" for i in range(7)]
    kinds = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            seed=5,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            max_tokens=18,
        ),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=8, stop_token_ids=[1, 2, 3]),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    want = tokens(LLM(model=path, dtype="float32", async_scheduling=False, show_progress=False))
    llm = LLM(model=path, dtype="float32", show_progress=False)
    assert llm.config.scheduler.async_scheduling  # the default on CUDA
    tokens(llm)  # warm: first-use allocations may sync
    with no_host_sync():
        got = tokens(llm)
    assert got == want


COMPILES_AFTER_START = r"""
import json, os, sys
from pathlib import Path
from baton import LLM, SamplingParams

def kernels():
    return {p.parent.name + "/" + p.stem
            for p in Path(os.environ["TRITON_CACHE_DIR"]).glob("*/*.json")
            if not p.name.startswith("__grp__")}

llm = LLM(model=sys.argv[1], max_num_batched_tokens=256, show_progress=False)
started = kernels()
# block tables 1 to 40 blocks wide (a row stride of 1, of 16, of neither), chunked prompts
# mixed with decode rows, and every kind of sampling
prompts = [{"prompt_token_ids": list(range(1, n + 1))} for n in (3, 9, 250, 257, 300, 640, 17)]
kinds = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, min_p=0.1, seed=1, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.6, presence_penalty=0.5, logprobs=2, max_tokens=20),
    SamplingParams(temperature=0, min_tokens=10, max_tokens=20),
]
for round_ in range(2):
    llm.generate(prompts, [kinds[(i + round_) % len(kinds)] for i in range(len(prompts))])
print(json.dumps(sorted(kernels() - started)))
"""


def test_nothing_compiles_after_start_up(tiny_model: Path, tmp_path: Path) -> None:
    """Start-up compiles every Triton kernel variant a step can need: a fresh engine (empty
    kernel cache, as in a new container) compiles nothing more while it serves steps of every
    shape and sampling kind. A variant compiled mid-serving stalls every running request."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    run = subprocess.run(
        [sys.executable, "-c", COMPILES_AFTER_START, str(tiny_model)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


def test_piecewise_graphs_equal_eager(tiny_model: Path) -> None:
    """Prefill chunks and mixed steps replayed from piecewise CUDA graphs (every step of up
    to 64 tokens: the budget) give the eager engine's greedy tokens (float32, as the decode
    graphs' test: in bf16 a padded product's other cuBLAS kernel may swap near-tied tokens),
    and the graphs ran: one piece more than layers per size, replayed for padded steps."""
    path = str(tiny_model)
    kw = {
        "dtype": "float32",
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "show_progress": False,
    }
    eager = LLM(model=path, enforce_eager=True, **kw)  # type: ignore[arg-type]
    pieces = LLM(model=path, piecewise_cuda_graph_tokens=64, **kw)  # type: ignore[arg-type]
    runner = pieces.client.core.executor.worker.runner  # type: ignore[attr-defined]
    assert runner.pieces is not None and runner.pieces.captured
    assert runner.pieces.sizes == [16, 32, 64]
    layers = len(runner.model.attention_layers())
    assert all(len(runner.pieces.pieces[s]) == layers + 1 for s in runner.pieces.sizes)
    used: list[int] = []
    run = runner.pieces.run

    def counted(inputs, fill=None):  # type: ignore[no-untyped-def]
        used.append(inputs.num_tokens)
        return run(inputs, fill)

    runner.pieces.run = counted
    assert greedy(pieces) == greedy(eager)
    assert used and any(n not in (16, 32, 64) for n in used)  # padded steps replayed
