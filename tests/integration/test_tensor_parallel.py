"""Tensor parallelism on CPU for real: two (or four) rank processes over gloo give the same
greedy tokens as one rank, and logprobs within 1e-4 (float32), for every tiny family (untied and
tied embeddings, q/k/v bias, q/k norm, a sharded checkpoint), with chunked prefill and without,
with prefix hits; seeded sampling too. The same through Ray actors. A rank that dies fails the
engine with an error naming it, within a bound; sizes that cannot split are refused up front.
"""

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from services.worker.engine.config import EngineArgs
from services.worker.engine.executor.executor import RankFailedError
from services.worker.engine.executor.multiproc import MultiprocExecutor
from services.worker.engine.params import StructuredOutputParams

MAX_NEW = 12
LOGPROB_ATOL = 1e-4
_LONG = (
    "Return a new list containing all items from the iterable in ascending order. A custom key "
    "function can be supplied to customize the sort order."
)
PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog", _LONG, _LONG + " It is stable."]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
MODES: dict[str, dict[str, Any]] = {
    "whole-prompts": {"enable_chunked_prefill": False},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
}


# a grammar's bitmask reaches rank 0 alone (``Sample``), the others sample nothing
CONSTRAINED = SamplingParams(
    temperature=0, max_tokens=MAX_NEW, logprobs=3,
    structured_outputs=StructuredOutputParams(regex=r"[a-z]{2,9}@[a-z]{2,9}\.(com|org)"),
)  # fmt: skip


def _run(llm: LLM) -> list[Any]:
    params = [GREEDY] * len(PROMPTS) + [SEEDED, CONSTRAINED]
    first = llm.generate([*PROMPTS, PROMPTS[1], PROMPTS[2]], params, use_tqdm=False)
    again = llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)  # prefix hits on both
    return [o.outputs[0] for o in first + again]


def _assert_same(tp_out: list[Any], ref: list[Any]) -> None:
    for got, want in zip(tp_out, ref, strict=True):
        assert got.token_ids == want.token_ids
        if want.logprobs is None:
            continue
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert set(g) == set(w)
            for tok in w:
                a, b = g[tok].logprob, w[tok].logprob  # (-inf: a token a grammar masks)
                assert a == b or abs(a - b) <= LOGPROB_ATOL


def _reference(path: Path, mode: dict[str, Any]) -> list[Any]:
    llm = LLM(model=str(path), show_progress=False, **mode)
    try:
        return _run(llm)
    finally:
        llm.shutdown()


# every family with chunked prefill (whole prompts run too: those shorter than the budget); a
# budget that never chunks on two of them
CASES = [
    (n, "chunked-prefill") for n in ("llama", "llama3-tied", "mistral", "qwen2-sharded", "qwen3")
] + [("llama", "whole-prompts"), ("qwen2-sharded", "whole-prompts")]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_tp2_equals_tp1(tiny_models: dict[str, Path], name: str, mode: str) -> None:
    ref = _reference(tiny_models[name], MODES[mode])
    llm = LLM(model=str(tiny_models[name]), tensor_parallel_size=2, show_progress=False,
              **MODES[mode])  # fmt: skip
    try:
        assert isinstance(llm.client.core.executor, MultiprocExecutor)  # type: ignore[attr-defined]
        out = _run(llm)
        stats = llm.client.call_utility("get_stats")
    finally:
        llm.shutdown()
    _assert_same(out, ref)
    assert stats.prefix_hit_tokens > 0  # the second round really read cached blocks


def test_tp2_with_async_scheduling_equals_tp1(tiny_models: dict[str, Path]) -> None:
    """Submit N+1 before collecting N (the GPU default): each rank sees the same order."""
    ref = _reference(tiny_models["qwen3"], {})
    llm = LLM(model=str(tiny_models["qwen3"]), tensor_parallel_size=2, async_scheduling=True,
              show_progress=False, max_num_batched_tokens=16, max_num_seqs=4)  # fmt: skip
    try:
        assert llm.config.scheduler.async_scheduling
        out = _run(llm)
    finally:
        llm.shutdown()
    _assert_same(out, ref)


def test_more_ranks_than_kv_heads_replicates_them(tiny_models: dict[str, Path]) -> None:
    """4 ranks, 4 query heads, 2 KV heads: each KV head lives on two ranks."""
    ref = _reference(tiny_models["llama"], {})
    llm = LLM(model=str(tiny_models["llama"]), tensor_parallel_size=4, show_progress=False)
    try:
        out = _run(llm)
        info = llm.client.call_utility("get_model_info")
    finally:
        llm.shutdown()
    _assert_same(out, ref)
    assert info.tensor_parallel_size == 4
    # rank 0's cache: one of the two KV heads (2 layers × K,V × 1 head × 16 dims × 4 bytes)
    assert info.kv_bytes_per_token == 2 * 2 * 1 * 16 * 4


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray = pytest.importorskip("ray")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_executor_equals_tp1(tiny_models: dict[str, Path], local_ray: Any) -> None:
    from services.worker.engine.executor.ray_executor import RayExecutor

    ref = _reference(tiny_models["qwen2-sharded"], {})
    llm = LLM(model=str(tiny_models["qwen2-sharded"]), tensor_parallel_size=2,
              distributed_executor_backend="ray", show_progress=False)  # fmt: skip
    try:
        assert isinstance(llm.client.core.executor, RayExecutor)  # type: ignore[attr-defined]
        out = _run(llm)
    finally:
        llm.shutdown()
    _assert_same(out, ref)


def test_ray_rank_killed_fails_the_engine(tiny_model: Path, local_ray: Any) -> None:
    llm = LLM(model=str(tiny_model), tensor_parallel_size=2, distributed_executor_backend="ray",
              show_progress=False)  # fmt: skip
    try:
        local_ray.kill(llm.client.core.executor.actors[1])  # type: ignore[attr-defined]
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()


# (the rank killed, seconds before the next call): right away, the call reaches its dying
# socket; a second later the socket has no peer, where an unbounded send would wait forever
@pytest.mark.parametrize(("rank", "settle"), [(0, 0.0), (1, 0.0), (1, 1.0)])
def test_a_rank_killed_fails_the_engine_within_a_bound(
    tiny_model: Path, rank: int, settle: float
) -> None:
    llm = LLM(model=str(tiny_model), tensor_parallel_size=2, show_progress=False)
    executor = llm.client.core.executor  # type: ignore[attr-defined]
    try:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        os.kill(executor.procs[rank].pid, signal.SIGKILL)
        time.sleep(settle)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=f"rank {rank} .* exited with code -9"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
        # the other rank is stopped too, and the sockets' directory is gone
        assert all(p.poll() is not None for p in executor.procs)
        assert not Path(executor.tmp).exists()
    finally:
        llm.shutdown()


def test_rank_processes_end_with_the_engine(tiny_model: Path) -> None:
    llm = LLM(model=str(tiny_model), tensor_parallel_size=2, show_progress=False)
    executor = llm.client.core.executor  # type: ignore[attr-defined]
    llm.shutdown()
    assert [p.poll() for p in executor.procs] == [0, 0]
    assert not Path(executor.tmp).exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 3}, "num_attention_heads=4 does not split"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "mp or ray"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "x"}, "one of uni, mp"),
        ({"tensor_parallel_size": 2, "kv_transfer": True, "kv_connector": "fake"}, "tp=1 only"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ],
)
def test_sizes_that_cannot_split_are_refused(
    tiny_model: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_model), **kwargs).create_engine_config()
