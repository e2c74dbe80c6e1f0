"""The oracle: greedy output token for token equal to Hugging Face ``transformers`` on the same
checkpoint, for every supported family, in every engine mode that changes how the work is cut
(prefix caching on/off, chunked prefill, preemption). Logits agree within 1e-4 (float32).

On a CUDA machine the same tests run the engine on the GPU (Triton attention, fused kernels,
CUDA graphs) against Hugging Face on the CPU.
"""

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from baton import LLM, SamplingParams
from tests.conftest import TINY_MODELS

MAX_NEW = 24
LOGPROB_ATOL = 1e-4
_LONG = (
    "Return a new list containing all items from the iterable in ascending order. A custom key "
    "function can be supplied to customize the sort order, and the reverse flag can be set to "
    "request the result in descending order."
)
PROMPTS = [
    "Hi",  # shorter than a block
    "The quick brown fox jumps over the lazy dog",
    _LONG,
    _LONG + " The sort is stable.",  # shares a long prefix with the previous prompt
    "import os\nimport sys\n\ndef main():\n    return 0",
]

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    # 10 blocks of 16 hold one 160-token request but not the whole batch: forces preemption.
    "preemption": {"num_kv_blocks": 10, "max_model_len": 160},
}


@cache
def hf_reference(path: str) -> tuple[list[list[int]], list[list[list[float]]]]:
    """HF greedy tokens and per-step log-softmax rows for each prompt (computed once per model)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(
            ids,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, ids.shape[1] :].tolist())
        logprobs.append([step[0].float().log_softmax(-1).tolist() for step in out.logits])
    return tokens, logprobs


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def model_path(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> str:
    return str(tiny_models[request.param])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hugging_face(model_path: str, mode: str) -> None:
    expected, _ = hf_reference(model_path)
    llm = LLM(model=model_path, show_progress=False, dtype="float32", **MODES[mode])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    stats = llm.get_stats()
    if mode == "preemption":
        assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"
    if mode == "default":
        assert stats.prefix_hit_tokens > 0, "the shared-prefix prompt should hit the cache"
    assert stats.num_free_blocks == stats.num_blocks


def test_logprobs_match_hugging_face(model_path: str) -> None:
    expected_tokens, expected_rows = hf_reference(model_path)
    llm = LLM(model=model_path, show_progress=False, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5))
    for out, tokens, rows in zip(outs, expected_tokens, expected_rows, strict=True):
        lps = out.outputs[0].logprobs
        assert lps is not None and len(lps) == len(tokens)
        for position, row in zip(lps, rows, strict=True):
            for token_id, lp in position.items():
                assert abs(lp.logprob - row[token_id]) < LOGPROB_ATOL
            ranked = sorted(range(len(row)), key=lambda t: -row[t])[:5]
            top = sorted(position, key=lambda t: position[t].rank)
            assert set(ranked) <= set(position)
            assert top[0] == ranked[0]


@pytest.mark.parametrize("name", ["qwen3"])
def test_triton_path_matches_hugging_face(tiny_models: dict[str, Path], name: str) -> None:
    """The GPU code path — Triton attention and fused kernels — on CPU through Triton's
    interpreter (on the GPU machine, on the GPU): greedy tokens equal Hugging Face's."""
    path = str(tiny_models[name])
    expected, _ = hf_reference(path)
    llm = LLM(
        model=path,
        show_progress=False,
        attention_backend="triton",
        fused_ops=True,
        dtype="float32",
        max_num_batched_tokens=32,  # chunked prefill: queries over a cached prefix
        max_num_seqs=8,
    )
    # a quarter of the tokens of the other modes: every kernel still runs (chunked prefill over
    # a cached prefix, then decode), and the interpreter's steps are the suite's slowest
    n = MAX_NEW // 4
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n))
    assert [o.outputs[0].token_ids for o in outs] == [e[:n] for e in expected]
