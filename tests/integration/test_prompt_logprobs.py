"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) computed in the engine's own
steps: on SmolLM2-135M-Instruct in float32 they equal Hugging Face transformers' per-token
log-probabilities on the same weights within 1e-4, whole or in chunks (chunked prefill), when
the prompt sits in the prefix cache, on three tensor-parallel ranks, and with
``max_tokens=0`` (the prompt alone); the top-N and ranks are the model's. A request that asks
for them skips the prefix cache (a cached block holds keys and values, not logits) but leaves
its blocks there for the next.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from services.worker.engine.messages import SampleLogprobs
from services.worker.engine.request import RequestStatus
from services.worker.engine.sched.output import PromptLogprobsChunk
from tests.helpers import fake_run, make_request, make_scheduler
from tests.smollm2 import transformers_model, transformers_tokenizer

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness."
)
TOP = 3


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' log-softmax at every position (float32)."""
    ids = transformers_tokenizer(smollm2_gguf)(TEXT)["input_ids"]
    model = transformers_model(smollm2_gguf)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, logits.log_softmax(-1)


def _llm(path: Path, **kw: Any) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", max_model_len=512,
               show_progress=False, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> Iterator[LLM]:
    engine = _llm(smollm2_gguf, num_kv_blocks=64)
    yield engine
    engine.shutdown()


def _run(llm: LLM, ids: list[int], **params: Any) -> Any:
    sp = SamplingParams(temperature=0, **params)
    return llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]


def _check(out: Any, ids: list[int], want: torch.Tensor) -> None:
    """Every prompt token's entry: its logprob and rank, and the top ``TOP``, as transformers'."""
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for pos in range(1, len(ids)):
        row, entry = want[pos - 1], lps[pos]
        token = ids[pos]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(TOP)
        by_rank = {lp.rank: (t, lp.logprob) for t, lp in entry.items() if t != token}
        for r, (t, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
            if t == token:
                continue  # (shown once, with its own rank)
            assert by_rank[r + 1][0] == t and by_rank[r + 1][1] == pytest.approx(value, abs=1e-4)


def test_the_prompts_logprobs_equal_transformers(llm: LLM, reference: Any) -> None:
    ids, want = reference
    out = _run(llm, ids, prompt_logprobs=TOP, max_tokens=4)
    _check(out, ids, want)
    assert len(out.outputs[0].token_ids) == 4  # the answer goes on as without them
    assert out.outputs[0].token_ids == _run(llm, ids, max_tokens=4).outputs[0].token_ids


def test_max_tokens_0_runs_the_prompt_alone(llm: LLM, reference: Any) -> None:
    ids, want = reference
    out = _run(llm, ids, prompt_logprobs=TOP, max_tokens=0)
    _check(out, ids, want)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    plain = _run(llm, ids, max_tokens=0)  # without logprobs too: nothing generated
    assert plain.outputs[0].token_ids == [] and plain.prompt_logprobs is None


def test_a_cached_prompt_still_gets_its_logprobs(llm: LLM, reference: Any) -> None:
    ids, want = reference
    llm.reset_prefix_cache()
    assert _run(llm, ids, max_tokens=1).num_cached_tokens == 0
    assert _run(llm, ids, max_tokens=1).num_cached_tokens > 0  # the prompt is cached now
    out = _run(llm, ids, prompt_logprobs=TOP, max_tokens=1)
    assert out.num_cached_tokens == 0  # computed again, for its logits
    _check(out, ids, want)
    llm.reset_prefix_cache()
    _run(llm, ids, prompt_logprobs=0, max_tokens=0)
    assert _run(llm, ids, max_tokens=1).num_cached_tokens > 0  # it left its blocks cached


def test_chunked_prefill_and_n(smollm2_gguf: Path, reference: Any) -> None:
    """Prompt chunks of 16 tokens, in steps beside other requests' decodes; n = 2 reports the
    prompt's logprobs once, with the same values."""
    ids, want = reference
    llm = _llm(smollm2_gguf, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        prompts = [{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:20]}]
        sp = [SamplingParams(temperature=0, prompt_logprobs=TOP, max_tokens=3),
              SamplingParams(temperature=0, max_tokens=8)]  # fmt: skip
        out = llm.generate(prompts, sp, use_tqdm=False)
        _check(out[0], ids, want)
        assert out[1].prompt_logprobs is None
        two = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(n=2, temperature=0.8, seed=1, prompt_logprobs=TOP,
                                          max_tokens=2), use_tqdm=False)[0]  # fmt: skip
        assert len(two.outputs) == 2
        _check(two, ids, want)
    finally:
        llm.shutdown()


def test_three_ranks_compute_them_as_one(smollm2_gguf: Path, reference: Any) -> None:
    """Every rank runs the LM head (it gathers the vocabulary's thirds); rank 0 reports."""
    ids, want = reference
    llm = _llm(smollm2_gguf, num_kv_blocks=64, tensor_parallel_size=3)
    try:
        _check(_run(llm, ids, prompt_logprobs=TOP, max_tokens=1), ids, want)
    finally:
        llm.shutdown()


def _entries(start: int, n: int) -> PromptLogprobsChunk:
    return PromptLogprobsChunk(
        start, [SampleLogprobs([p], [-float(p)], 1) for p in range(start, start + n)]
    )


def test_a_chunk_computed_again_after_a_preemption_is_reported_once() -> None:
    """The scheduler reports each prompt position once, whatever the runner computed again."""
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 12, prompt_logprobs=0))
    step = sched.schedule()  # 8 of the 12 prompt tokens: positions 0..7 predict tokens 1..8
    result = fake_run(sched, step)
    result.prompt_logprobs["a"] = _entries(0, 8)
    outs = sched.update_from_output(step, result)
    assert [lp.token_ids for lp in outs[0].new_prompt_logprobs or []] == [[p] for p in range(8)]
    request = sched.requests["a"]  # type: ignore[index]
    sched.running.remove(request)
    sched._preempt(request)  # recomputed from the start
    assert request.status == RequestStatus.PREEMPTED
    step = sched.schedule()
    result = fake_run(sched, step)
    result.prompt_logprobs["a"] = _entries(0, 8)
    assert sched.update_from_output(step, result) == []  # nothing new: nothing reported
    step = sched.schedule()  # the last 4 tokens: positions 8..10 predict tokens 9..11
    result = fake_run(sched, step)
    result.prompt_logprobs["a"] = _entries(8, 3)
    (out,) = sched.update_from_output(step, result)
    assert [lp.token_ids for lp in out.new_prompt_logprobs or []] == [[8], [9], [10]]
    assert out.new_token_ids == [7]  # and its first sampled token
