"""What quality harnesses call, through the OpenAI SDK against SmolLM2-135M-Instruct served by a
disaggregated cluster (one prefill and one decode worker, float32): ``/v1/completions`` with
``echo`` and ``logprobs`` (``max_tokens: 0``: the prompt alone) and vLLM's ``prompt_logprobs``
give transformers' per-token log-probabilities of the prompt within 1e-4, whether the prompt is
prefilled on the prefill worker (and its KV handed over) or locally on the decode worker; the
echoed tokens' strings join to the echoed text and their offsets point into it, streamed or not.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from baton.launcher import Cluster
from tests.e2e.conftest import disaggregated_routes, running_cluster
from tests.smollm2 import transformers_model, transformers_tokenizer

MODEL = "smollm2"
LONG = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity."
)  # over the policy's 32 uncached tokens: prefilled on the prefill worker
SHORT = "The capital of France is Paris, and"  # prefilled where it decodes


@pytest.fixture(scope="module")
def pd_smollm2(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    with running_cluster(smollm2_gguf, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--routing-policy", str(policy), "--dtype", "float32",
                         "--served-model-name", MODEL) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def client(pd_smollm2: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd_smollm2.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def transformers_logprobs(smollm2_gguf: Path) -> Any:
    """text → (ids, the log-softmax at every position), as transformers computes them."""
    tok = transformers_tokenizer(smollm2_gguf)
    model = transformers_model(smollm2_gguf)

    def run(text: str) -> tuple[list[int], torch.Tensor]:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            return ids, model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


def _prompt_values(ids: list[int], table: torch.Tensor) -> list[float]:
    return [table[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.mark.parametrize("text", [LONG, SHORT], ids=["prefill-worker", "decode-worker"])
def test_echo_with_max_tokens_0_gives_the_prompts_logprobs(
    pd_smollm2: Cluster, client: openai.OpenAI, transformers_logprobs: Any, text: str
) -> None:
    ids, table = transformers_logprobs(text)
    before = disaggregated_routes(pd_smollm2)
    out = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out.choices
    assert choice.text == text and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(ids)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(_prompt_values(ids, table), abs=1e-4)
    for i in range(1, len(ids)):  # the top two are the model's two most likely tokens
        top = lp.top_logprobs[i]
        assert top is not None and len(top) == 2
        assert sorted(top.values(), reverse=True) == pytest.approx(
            table[i - 1].topk(2).values.tolist(), abs=1e-4
        )
    routed = disaggregated_routes(pd_smollm2) - before
    assert routed == (1 if text == LONG else 0)


def test_echo_goes_on_into_the_answer(client: openai.OpenAI, transformers_logprobs: Any) -> None:
    """Prompt then answer: one list of entries, the answer's offsets after the prompt's text;
    streamed, the same entries in pieces."""
    ids, table = transformers_logprobs(LONG)
    kw: dict[str, Any] = dict(model=MODEL, prompt=LONG, echo=True, logprobs=1, max_tokens=6,
                              temperature=0)  # fmt: skip
    out = client.completions.create(**kw)
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert lp.token_logprobs is not None
    assert choice.text.startswith(LONG) and len(choice.text) > len(LONG)
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(ids) + 6
    assert lp.text_offset[len(ids)] == len(LONG)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(_prompt_values(ids, table), abs=1e-4)
    assert all(v is not None for v in lp.token_logprobs[len(ids) :])
    text, tokens, offsets, values = "", [], [], []
    for chunk in client.completions.create(**kw, stream=True):
        piece = chunk.choices[0]
        text += piece.text
        if piece.logprobs is not None:
            tokens += piece.logprobs.tokens or []
            offsets += piece.logprobs.text_offset or []
            values += piece.logprobs.token_logprobs or []
    assert (text, tokens, offsets) == (choice.text, lp.tokens, lp.text_offset)
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_vllms_prompt_logprobs_field(client: openai.OpenAI, transformers_logprobs: Any) -> None:
    ids, table = transformers_logprobs(LONG)
    out = client.completions.create(
        model=MODEL, prompt=LONG, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    entries = out.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        own = entries[i][str(ids[i])]
        assert own["logprob"] == pytest.approx(table[i - 1, ids[i]].item(), abs=1e-4)
        assert own["rank"] == int((table[i - 1] > table[i - 1, ids[i]]).sum()) + 1
        best = int(table[i - 1].argmax())
        assert entries[i][str(best)]["rank"] == 1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    shown = chat.model_dump()["prompt_logprobs"]
    assert shown[0] is None and len(shown) == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(len(e) == 1 for e in shown[1:])  # the prompt's token alone


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_values_are_refused(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/completions", body={"model": MODEL, **body}, cast_to=dict)
    assert e.value.body["param"] == param  # type: ignore[index]
