"""SmolLM2-135M-Instruct's GGUF file on the GPU (skipped without CUDA; run on the GPU machine):
in float32 with CUDA graphs its greedy chat answers and its prompt logprobs equal Hugging Face
transformers' on the same dequantized weights (the prompt's steps run eagerly beside decode
steps that replay graphs); in bfloat16, with FP8 weights and with an FP8 KV cache it still
scores the answer "The capital of France is Paris." as transformers does, within a bound, and
" Paris" first where it stands."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from tests.smollm2 import chat_prompts, transformers_model, transformers_tokenizer

pytestmark = pytest.mark.gpu

MAX_NEW = 24
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity."
)


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> Iterator[tuple[Any, Any]]:
    tok = transformers_tokenizer(smollm2_gguf)
    model = transformers_model(smollm2_gguf).cuda()
    yield tok, model
    del model
    torch.cuda.empty_cache()


def _llm(path: Path, **kw: Any) -> LLM:
    return LLM(model=str(path), max_model_len=1024, show_progress=False, **kw)


def test_float32_with_graphs_answers_and_scores_prompts_as_transformers(
    smollm2_gguf: Path, reference: Any
) -> None:
    tok, model = reference
    prompts = chat_prompts(tok)
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW,
                                 do_sample=False)  # fmt: skip
            want.append(out[0, len(ids) :].tolist())
        ids = tok(TEXT)["input_ids"]
        table = model(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
    llm = _llm(smollm2_gguf, dtype="float32")
    try:
        assert llm.client.core.executor.worker.runner.graphs is not None  # type: ignore[attr-defined]
        greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
        # the chats decode (graphs) while the text's prompt runs with its logprobs (eager)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": ids}],
            [greedy] * len(prompts) + [SamplingParams(temperature=0, max_tokens=1,
                                                      prompt_logprobs=2)],
            use_tqdm=False,
        )  # fmt: skip
        assert [list(o.outputs[0].token_ids) for o in outs[:-1]] == want
        got = outs[-1].prompt_logprobs
        assert got is not None and got[0] is None
        values = [got[i][ids[i]].logprob for i in range(1, len(ids))]
        expected = [table[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert values == pytest.approx(expected, abs=1e-3)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("kw", "bound"),
    [
        ({"dtype": "bfloat16"}, 0.1),
        ({"quantization": "fp8"}, 0.4),
        ({"kv_cache_dtype": "fp8"}, 0.4),
    ],
    ids=["bf16", "fp8-weights", "fp8-kv"],
)
def test_reduced_precision_keeps_the_answer(
    smollm2_gguf: Path, reference: Any, kw: dict[str, Any], bound: float
) -> None:
    """Teacher-forced: the answer "The capital of France is Paris." scored with prompt logprobs
    stays within ``bound`` (mean absolute difference per token) of transformers' float32, and
    " Paris" stays the most likely token where it stands. (Greedy decoding itself may flip at
    a near tie: in bf16 on the H200 this model opened its answer with "L'" instead.)"""
    tok, model = reference
    prompt = chat_prompts(tok)[0]  # What is the capital of France?
    answer = tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    ids = prompt + answer
    with torch.no_grad():
        table = model(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
    llm = _llm(smollm2_gguf, **kw)
    try:
        scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
        out = llm.generate([{"prompt_token_ids": ids}], scored, use_tqdm=False)
    finally:
        llm.shutdown()
    lps = out[0].prompt_logprobs
    assert lps is not None
    span = range(len(prompt), len(ids))
    diffs = [abs(lps[i][ids[i]].logprob - table[i - 1, ids[i]].item()) for i in span]
    assert sum(diffs) / len(diffs) < bound, diffs
    (paris,) = [i for i in span if tok.decode([ids[i]]).strip() == "Paris"]
    assert int(table[paris - 1].argmax()) == ids[paris]  # transformers' choice there
    assert lps[paris][ids[paris]].rank == 1
