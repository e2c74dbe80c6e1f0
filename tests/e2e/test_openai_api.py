"""The OpenAI API of a running cluster (gateway + scheduler + 2 workers as processes), driven
with the official ``openai`` client; greedy output must equal the engine's offline output."""

from collections.abc import Iterator

import openai
import pytest

from baton import LLM, SamplingParams
from baton.launcher import Cluster

PROMPTS = ["The quick brown fox", "Return a new list containing", "This module provides"]
MODEL = "qwen3"  # tiny_model's directory name is its served name


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completions_equal_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == ref.outputs[0].text
        assert got.choices[0].finish_reason == "length"
        assert got.usage is not None
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == 24


def test_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_greedy_equals_offline_and_streams(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "What does the json module do?"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=16, temperature=0
    )  # type: ignore[arg-type]
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.usage is not None and got.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text


def test_n_with_seed_is_reproducible_and_equals_offline(
    client: openai.OpenAI, offline: LLM
) -> None:
    kw = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 12, "seed": 7}
    ref = offline.generate([PROMPTS[1]], SamplingParams(n=3, **kw))[0]  # type: ignore[arg-type]
    a = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=3, **kw)  # type: ignore[arg-type]
    b = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=3, **kw)  # type: ignore[arg-type]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in ref.outputs]
    assert len(set(texts)) > 1  # the n samples differ
    assert a.usage is not None and a.usage.completion_tokens == 36


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) > 0
    cut = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_stop_token_ids(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10))[0]
    stop_id = ids.outputs[0].token_ids[3]
    expected = ids.outputs[0].token_ids.index(stop_id) + 1
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == expected


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.top_logprobs is not None
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert value == pytest.approx(max(top.values()))  # greedy: the sampled one is the top
        assert all(v <= 0 for v in top.values())
    assert lp.text_offset == sorted(lp.text_offset or [])


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    # each token's own bytes: joined they are the text, also where a character spans tokens
    joined = b"".join(bytes(entry.bytes or []) for entry in content)
    assert joined.decode("utf-8", errors="replace") == out.choices[0].message.content


def test_penalties_and_sampling_knobs_are_accepted(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 8,
                    "ignore_eos": True},
    )  # fmt: skip
    assert out.usage is not None and out.usage.completion_tokens == 8


def test_batch_of_prompts_in_one_completion_request(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, n=2))
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    by_index = {c.index: c.text for c in out.choices}
    for p, ref in enumerate(expected):
        for i in range(2):
            assert by_index[p * 2 + i] == ref.outputs[i].text
