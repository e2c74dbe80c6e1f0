"""Gemma 3 (text) against Hugging Face ``transformers`` in float32, on a tiny checkpoint of six
layers (sliding, sliding, global, twice; a window of 8 tokens; the local and global rotary
bases apart; random norm weights; tied embeddings; soft-capped logits): greedy tokens equal
token for token and logprobs within 1e-4, on prompts five times the window, with whole prompts
and chunked prefill, with prefix hits (a prefix of 37 tokens that ends mid-block, of which the
32 of its whole blocks hit; a repeated two-block prompt, of which one block hits); the forward a
piecewise CUDA graph runner splits, run inline; two tensor-parallel ranks; the cache a request
holds as the engine reports it. A model with the window widened past every prompt gives other
tokens, so the window is really applied.
"""

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from tests.helpers import (
    assert_matches_reference,
    generate_in_three_batches,
    hf_greedy_with_rows,
)

WINDOW = 8  # the tiny gemma3's sliding window (baton/tiny_model.py)
MAX_NEW = 12
LOGPROB_ATOL = 1e-4
_SHARED = [(7 * i) % 300 + 5 for i in range(37)]  # 2 blocks of 16 and 5 tokens into a third
PROMPTS = [
    [11, 12, 13],  # inside the window
    [*_SHARED, 40, 41, 42, 43],
    [*_SHARED, 90, 91, 92],  # its hit: the 32 tokens of the shared prefix's whole blocks
    [(5 * i) % 250 + 3 for i in range(32)],  # two whole blocks ...
]
PROMPTS.append(PROMPTS[-1])  # ... again: a hit of one block (the last token is computed)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3") / "m", arch="gemma3",
                           tie_word_embeddings=True)  # fmt: skip


@cache
def hf_reference(path: str, **config: Any) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Hugging Face's greedy tokens and log-softmax rows for each prompt (``config``: fields
    of the checkpoint's config overridden)."""
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config)
    return hf_greedy_with_rows(model, PROMPTS, MAX_NEW)


def _generate(llm: LLM) -> list[Any]:
    return generate_in_three_batches(llm, PROMPTS, GREEDY)


def _assert_hugging_faces(path: Path, outs: list[Any]) -> None:
    assert_matches_reference(outs, *hf_reference(str(path)), LOGPROB_ATOL)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hugging_face(gemma3: Path, mode: str) -> None:
    llm = LLM(model=str(gemma3), show_progress=False, dtype="float32", **MODES[mode])
    try:
        assert llm.config.model.max_model_len > max(map(len, PROMPTS)) + MAX_NEW
        outs = _generate(llm)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    _assert_hugging_faces(gemma3, outs)
    assert stats.prefix_hit_tokens == 32 + 16
    assert stats.num_free_blocks == stats.num_blocks


def test_the_engine_reports_what_a_request_holds(gemma3: Path) -> None:
    """Its cache groups (the global layers' and, in pages of as many layers, the sliding
    ones') and the bytes a request of max_model_len holds: every token's K and V in the global
    layers, the two blocks a window of 8 can span in the sliding ones."""
    config = json.loads((gemma3 / "config.json").read_text())
    llm = LLM(model=str(gemma3), show_progress=False, dtype="float32", max_model_len=64)
    try:
        info = llm.get_model_info()
    finally:
        llm.shutdown()
    heads, dim = config["num_key_value_heads"], config["head_dim"]
    token = 2 * heads * dim * 4  # one layer's K and V of a token, float32
    assert info.kv_cache_groups == f"3 groups of 2 layers: full, window {WINDOW}, window {WINDOW}"
    assert info.kv_request_bytes == 2 * 64 * token + 4 * 2 * 16 * token
    assert info.kv_full_attention_request_bytes == 6 * 64 * token


def test_the_window_is_applied(gemma3: Path) -> None:
    """Hugging Face with the window widened past every sequence: other tokens once a
    sequence outgrows the window (so equal tokens above mean the engine's sliding layers saw
    only their window)."""
    windowed, _ = hf_reference(str(gemma3))
    wide, _ = hf_reference(str(gemma3), sliding_window=1024)
    # the 3-token prompt: its first 6 tokens come from positions 2..7, inside the window
    inside = WINDOW - len(PROMPTS[0]) + 1
    assert windowed[0][:inside] == wide[0][:inside] and windowed[0] != wide[0]
    assert all(a != b for a, b in zip(windowed[1:], wide[1:], strict=True))


def test_piecewise_split_forward_matches_hugging_face(gemma3: Path) -> None:
    """The forward a piecewise CUDA graph runner splits at each layer's attention call, run
    inline (CPU): sliding and global layers between the pieces, padding rows, mixed steps."""
    llm = LLM(model=str(gemma3), show_progress=False, dtype="float32",
              max_num_batched_tokens=24, max_num_seqs=4)  # fmt: skip
    try:
        runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
        runner.start_piecewise_graphs((8, 16, 24), capture=False)
        run, padded = runner.pieces.run, []

        def counted(inputs: Any, fill: Any = None) -> Any:
            hidden, rows = run(inputs, fill)
            padded.append(hidden.shape[0] > inputs.num_tokens)
            return hidden, rows

        runner.pieces.run = counted
        outs = _generate(llm)
    finally:
        llm.shutdown()
    _assert_hugging_faces(gemma3, outs)
    assert any(padded) and len(padded) > 10  # every step ran split, some padded


def test_two_ranks_equal_hugging_face(gemma3: Path) -> None:
    """Each rank one of the two KV heads and half the query heads, every sliding layer its
    window of them; chunked prefill and prefix hits as above."""
    llm = LLM(model=str(gemma3), show_progress=False, dtype="float32", tensor_parallel_size=2,
              **MODES["chunked-prefill"])  # fmt: skip
    try:
        outs = _generate(llm)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    _assert_hugging_faces(gemma3, outs)
    assert stats.prefix_hit_tokens == 32 + 16
