"""What the GPU model tests share: each file runs one architecture's tiny checkpoint on the GPU
against Hugging Face's float32 greedy tokens on the CPU, in eager mode and with CUDA graphs
(counting the graphs replayed), in bfloat16 against float32, and under CUDA's sync check."""

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from tests import helpers

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# a budget of 64: a long prompt's prefill runs in chunks (mixed with decode rows)
KW: dict[str, Any] = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "show_progress": False}


_SHARED = [(7 * i) % 300 + 5 for i in range(37)]
# a long prompt (chunked at the budget), two sharing a prefix (a hit), and short ones: decode
# batches of 1 to 10 rows replay several captured sizes
PROMPTS = [[(5 * i) % 250 + 3 for i in range(150)], [*_SHARED, 40, 41], [*_SHARED, 90]] + [
    [11 + i, 12 + 2 * i, 13] for i in range(7)
]


def hf_greedy(path: Path, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """Hugging Face's greedy tokens, float32 on the CPU (``tests/helpers.hf_greedy``)."""
    return helpers.hf_greedy(path, prompts, max_new)


def greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """The first dimension of the first argument of every call of ``module.name`` (a kernel's
    rows), from now on."""
    calls: list[int] = []
    kernel = getattr(module, name)

    def counted(x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        calls.append(x.shape[0])
        return kernel(x, *args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def count_replays(llm: LLM, pieces: bool = True) -> list[int]:
    """From now on, every CUDA graph ``llm``'s runner replays: a decode graph as its batch
    size, a piecewise prefill as minus its token count. ``pieces``: the runner has piecewise
    graphs (a model whose layers refuse them has decode graphs only)."""
    runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
    assert runner.graphs is not None and (runner.pieces is not None) == pieces
    replays: list[int] = []
    replay = runner.graphs.run

    def decode(inputs: Any, fill: Any = None) -> Any:
        replays.append(len(inputs.req_ids))
        return replay(inputs, fill)

    runner.graphs.run = decode
    if pieces:
        split = runner.pieces.run

        def prefill(inputs: Any, fill: Any = None) -> Any:
            replays.append(-inputs.num_tokens)
            return split(inputs, fill)

        runner.pieces.run = prefill
    return replays


def assert_eager_and_graphs_equal(
    path: Path, want: list[list[int]], batched: list[int], **kw: Any
) -> None:
    """``PROMPTS``' greedy tokens equal ``want`` in eager mode, where ``batched`` (a kernel's
    ``count_calls``) must see a call of several rows, and with CUDA graphs, where decode graphs
    of two batch sizes or more and piecewise prefill graphs must be replayed (seen on an H100:
    sizes 8 and 10, prefill chunks of 64 and 26 tokens)."""
    with LLM(model=str(path), dtype="float32", enforce_eager=True, **kw) as eager:
        assert greedy(eager, PROMPTS) == want
    assert batched and max(batched) > 1  # the kernel ran eagerly, on a batch
    with LLM(model=str(path), dtype="float32", **kw) as graphs:
        replays = count_replays(graphs)
        assert greedy(graphs, PROMPTS) == want
    assert len({n for n in replays if n > 0}) >= 2 and any(n < 0 for n in replays)


def skip_unless_backend(name: str) -> None:
    if name == "flash_attn":
        from services.worker.engine.attention.flash_attn_backend import available

        if not available():
            pytest.skip("FlashAttention-4 is not installed")


def assert_bfloat16_close_to_float32(path: Path, prompts: list[list[int]], **kw: Any) -> None:
    """The first token's top-5 logprobs of every prompt in the default dtype (bfloat16 on a
    GPU) within 0.1 of float32's, on at least 3 shared tokens."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    asks = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model=str(path), **kw) as bf16:
        assert bf16.config.model.dtype == "bfloat16"
        low = bf16.generate(asks, params, use_tqdm=False)
    with LLM(model=str(path), dtype="float32", **kw) as fp32:
        high = fp32.generate(asks, params, use_tqdm=False)
    for a, b in zip(low, high, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None
        shared = set(la[0]) & set(lb[0])
        assert len(shared) >= 3
        assert all(abs(la[0][t].logprob - lb[0][t].logprob) < 0.1 for t in shared)


def assert_flash_attention_close_to_float32(
    path: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> set[tuple[int | None, bool, int, int]]:
    """The checkpoint at ``path`` in bfloat16 on the FlashAttention backend within
    ``assert_bfloat16_close_to_float32``'s bound of float32 (the Triton kernels). Returns what
    FlashAttention-4 was called with: each call's (``window_size_left``, has sinks, the keys'
    width, the values' width). (Its paged path takes 64-, 128- and 256-wide heads, not the tiny
    models' own 16 and 32: give the checkpoint wider ones.)"""
    skip_unless_backend("flash_attn")
    from flash_attn.cute import interface

    real = interface._flash_attn_fwd
    seen: set[tuple[int | None, bool, int, int]] = set()

    @functools.wraps(real)  # (the backend reads its signature: it takes ``out``)
    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> Any:
        sinks = kw.get("learnable_sink") is not None
        seen.add((kw.get("window_size_left"), sinks, k.shape[-1], v.shape[-1]))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(interface, "_flash_attn_fwd", spy)
    assert_bfloat16_close_to_float32(path, prompts, attention_backend="flash_attn", **KW)
    return seen


def assert_async_steps_never_sync(path: Path, **kw: Any) -> None:
    """``PROMPTS``' greedy tokens under async scheduling, with CUDA's sync check raising on any
    call inside a step that waits for the device, equal the one-step-at-a-time engine's."""
    with LLM(model=str(path), dtype="float32", async_scheduling=False, **kw) as serial:
        want = greedy(serial, PROMPTS)
    with LLM(model=str(path), dtype="float32", **kw) as llm:
        assert llm.config.scheduler.async_scheduling
        greedy(llm, PROMPTS)  # warm: first-use allocations may sync
        with no_host_sync():
            got = greedy(llm, PROMPTS)
    assert got == want


@contextmanager
def no_host_sync() -> Iterator[None]:
    """CUDA's sync check raising on any call that waits for the device, inside."""
    with warnings.catch_warnings():  # "a prototype feature", says torch: we know
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
