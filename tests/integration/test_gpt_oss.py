"""gpt-oss against Hugging Face ``transformers`` in float32, on a tiny checkpoint of four layers
(sliding, full, twice; a window of 8 tokens; a sink per head; 8 experts, 4 a token, with biases
and a clamped SwiGLU; YaRN without truncation): greedy tokens equal token for token and
logprobs within 1e-4, on prompts up to five times the window, with whole prompts and chunked
prefill, with prefix hits longer than the window (a 37-token prefix ending mid-block, of which
its 32 tokens of whole blocks hit; a repeated two-block prompt, of which one block hits); the
forward a piecewise CUDA graph runner splits, run inline; two tensor-parallel ranks (half the
heads and their sinks each, and a slice of every expert or half the experts whole). Hugging
Face with the window widened past every prompt, or the sinks at -inf, gives other tokens, so
both are really applied; the router spreads a prompt's tokens over most experts.
"""

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from tests.helpers import assert_matches_reference, generate_in_three_batches

MAX_NEW = 12
LOGPROB_ATOL = 1e-4
_SHARED = [(11 * i) % 400 + 7 for i in range(37)]  # 2 blocks of 16 and 5 tokens into a third
PROMPTS = [
    [21, 22, 23, 24],  # inside the window
    [*_SHARED, 50, 51, 52],
    [*_SHARED, 80, 81, 82, 83],  # its hit: the 32 tokens of the shared prefix's whole blocks
    [(3 * i) % 350 + 9 for i in range(32)],  # two whole blocks ...
]
PROMPTS.append(PROMPTS[-1])  # ... again: a hit of one block (the last token is computed)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt_oss") / "m", arch="gpt_oss")


def _hf_model(path: str, **config: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config)


def _hf_generate(model: Any) -> tuple[list[list[int]], list[list[list[float]]]]:
    tokens, rows = [], []
    for ids in PROMPTS:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             min_new_tokens=MAX_NEW, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        tokens.append(out.sequences[0, len(ids) :].tolist())
        rows.append([step[0].float().log_softmax(-1).tolist() for step in out.logits])
    return tokens, rows


@cache
def hf_reference(path: str) -> tuple[list[list[int]], list[list[list[float]]]]:
    """Hugging Face's greedy tokens and log-softmax rows for each prompt."""
    return _hf_generate(_hf_model(path))


def _generate(llm: LLM) -> list[Any]:
    return generate_in_three_batches(llm, PROMPTS, GREEDY)


def _assert_hugging_faces(path: Path, outs: list[Any]) -> None:
    assert_matches_reference(outs, *hf_reference(str(path)), LOGPROB_ATOL)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hugging_face(gpt_oss: Path, mode: str) -> None:
    llm = LLM(model=str(gpt_oss), show_progress=False, dtype="float32", **MODES[mode])
    try:
        assert llm.config.model.max_model_len > max(map(len, PROMPTS)) + MAX_NEW
        outs = _generate(llm)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    _assert_hugging_faces(gpt_oss, outs)
    assert stats.prefix_hit_tokens == 32 + 16
    assert stats.num_free_blocks == stats.num_blocks


def test_the_window_and_the_sinks_are_applied(gpt_oss: Path) -> None:
    """Hugging Face with the window widened past every prompt, and with the sinks at -inf
    (no sink): other tokens on the long prompts (so equal tokens above mean the engine's
    sliding layers saw only their window, and every head its sink)."""
    windowed, _ = hf_reference(str(gpt_oss))
    wide, _ = _hf_generate(_hf_model(str(gpt_oss), sliding_window=1024))
    # the 4-token prompt: its first 5 tokens come from contexts inside the window (the same)
    assert windowed[0][:5] == wide[0][:5]
    assert all(a != b for a, b in zip(windowed, wide, strict=True))
    sinkless = _hf_model(str(gpt_oss))
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    tokens, _ = _hf_generate(sinkless)
    assert all(a != b for a, b in zip(windowed, tokens, strict=True))


def test_a_prompts_tokens_spread_over_most_experts(gpt_oss: Path) -> None:
    """Routing that sent every token to the same few experts would leave most experts'
    weights (their loading from the stacked tensors, their slicing over ranks) untested."""
    model = _hf_model(str(gpt_oss))
    used: dict[int, set[int]] = {}
    for i, layer in enumerate(model.model.layers):  # its router returns (logits, weights, ids)
        layer.mlp.router.register_forward_hook(
            lambda mod, args, out, i=i: used.setdefault(i, set()).update(out[2].flatten().tolist())
        )
    with torch.no_grad():
        model(torch.tensor([PROMPTS[1]]))
    assert sorted(used) == [0, 1, 2, 3]
    assert all(len(chosen) >= 0.75 * model.config.num_local_experts for chosen in used.values())


def test_piecewise_split_forward_matches_hugging_face(gpt_oss: Path) -> None:
    """The forward a piecewise CUDA graph runner splits at each layer's attention call, run
    inline (CPU): sliding and full layers between the pieces, padding rows, mixed steps."""
    llm = LLM(model=str(gpt_oss), show_progress=False, dtype="float32",
              max_num_batched_tokens=24, max_num_seqs=4)  # fmt: skip
    try:
        runner = llm.client.core.executor.worker.runner  # type: ignore[attr-defined]
        runner.start_piecewise_graphs((8, 16, 24), capture=False)
        outs = _generate(llm)
    finally:
        llm.shutdown()
    _assert_hugging_faces(gpt_oss, outs)


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "expert-parallel"])
def test_two_ranks_equal_hugging_face(gpt_oss: Path, ep: bool) -> None:
    """Each rank one of the two KV heads, half the query heads and their sinks, and half of
    every expert's intermediate columns (the down bias added by rank 0 alone) or half the
    experts whole; chunked prefill and prefix hits as above."""
    llm = LLM(model=str(gpt_oss), show_progress=False, dtype="float32", tensor_parallel_size=2,
              enable_expert_parallel=ep, **MODES["chunked-prefill"])  # fmt: skip
    try:
        outs = _generate(llm)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    _assert_hugging_faces(gpt_oss, outs)
    assert stats.prefix_hit_tokens == 32 + 16
