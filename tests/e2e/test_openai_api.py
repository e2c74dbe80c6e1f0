"""The OpenAI API of a running cluster (gateway + scheduler + 2 workers as processes), driven
with the official ``openai`` client; greedy output must equal the engine's offline output."""

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from baton import LLM, SamplingParams
from baton.launcher import Cluster, free_port
from baton.tiny_model import CHAT_TEMPLATE
from services.worker.engine.sample.constraints import tokenize_bad_words
from shared.text.tokenizer import TextTokenizer
from tests.e2e.conftest import service_group

PROMPTS = ["The quick brown fox", "Return a new list containing", "This module provides"]
MODEL = "qwen3"  # tiny_model's directory name is its served name


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_one_and_404_for_an_unknown_id(client: openai.OpenAI) -> None:
    """``GET /v1/models/{id}``: the SDK's ``models.retrieve``; an unknown id, slashes and all
    (``org/name``), is OpenAI's 404 ``model_not_found``."""
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "baton")
    assert model.model_extra is not None and model.model_extra["max_model_len"] == 1024
    for unknown in ("no-such-model", "org/no-such-model"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(unknown)
        error = caught.value.response.json()["error"]
        assert (error["code"], error["type"]) == ("model_not_found", "invalid_request_error")
        assert unknown in error["message"]


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


# ---- vLLM's fields that change the output: honoured (issue 45) ----------------------------
GREEDY: dict = {"model": MODEL, "temperature": 0}


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _tokens(offline: LLM) -> TextTokenizer:
    return TextTokenizer(offline.config.model.tokenizer)


def test_allowed_token_ids_are_the_only_ones_generated(client: openai.OpenAI, offline: LLM) -> None:
    free = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0]
    allowed = sorted(set(free.outputs[0].token_ids[4:10]) - {free.outputs[0].token_ids[0]})
    params = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed)
    ref = offline.generate([PROMPTS[0]], params)[0].outputs[0]
    assert set(ref.token_ids) <= set(allowed)
    got = client.completions.create(
        **GREEDY, prompt=PROMPTS[0], max_tokens=12, extra_body={"allowed_token_ids": allowed}
    )
    assert got.choices[0].text == ref.text != free.outputs[0].text
    chat = client.chat.completions.create(
        **GREEDY, messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True,
        extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    encode = _tokens(offline).encode
    assert content and all(encode(e.token, False)[0] in allowed for e in content)


def test_bad_words_are_never_generated(client: openai.OpenAI, offline: LLM) -> None:
    """A word of the free greedy output, banned: none of its token sequences (with and without
    a leading space, as vLLM tokenizes them) appears, and the text equals the offline engine's."""
    encode = _tokens(offline).encode
    free = offline.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24))[0]
    ids = list(free.outputs[0].token_ids)

    def sequences(word: str) -> list[list[int]]:
        return tokenize_bad_words([word], lambda t: encode(t, False))

    words = [offline.tokenizer.decode(ids[k : k + 1]).strip() for k in range(1, len(ids))]
    word = next(w for w in words if w and any(_contains(ids, s) for s in sequences(w)))
    params = SamplingParams(temperature=0, max_tokens=24, bad_words=[word])
    ref = offline.generate([PROMPTS[2]], params)[0].outputs[0]
    assert not any(_contains(list(ref.token_ids), s) for s in sequences(word))
    extra = {"bad_words": [word]}
    got = client.completions.create(**GREEDY, prompt=PROMPTS[2], max_tokens=24, extra_body=extra)
    assert got.choices[0].text == ref.text != free.outputs[0].text
    streamed = client.completions.create(
        **GREEDY, prompt=PROMPTS[2], max_tokens=24, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == ref.text


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI, offline: LLM) -> None:
    tokens = _tokens(offline)
    ids = tokens.encode(PROMPTS[1])
    keep3 = {"truncate_prompt_tokens": 3}
    cut = client.completions.create(**GREEDY, prompt=PROMPTS[1], max_tokens=10, extra_body=keep3)
    last = client.completions.create(**GREEDY, prompt=ids[-3:], max_tokens=10)
    whole = client.completions.create(**GREEDY, prompt=PROMPTS[1], max_tokens=10)
    assert cut.choices[0].text == last.choices[0].text != whole.choices[0].text
    assert cut.usage is not None and cut.usage.prompt_tokens == 3
    ids_cut = client.completions.create(**GREEDY, prompt=ids, max_tokens=10, extra_body=keep3)
    assert ids_cut.choices[0].text == last.choices[0].text
    # chat: the rendered prompt's last tokens
    messages = [{"role": "user", "content": "What does the json module do?"}]
    rendered = tokens.apply_chat_template(messages)
    chat = client.chat.completions.create(
        **GREEDY, messages=messages, max_tokens=10, extra_body={"truncate_prompt_tokens": 5}
    )
    plain = client.completions.create(**GREEDY, prompt=rendered[-5:], max_tokens=10)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage is not None and chat.usage.prompt_tokens == 5


def test_continue_final_message_continues_the_assistant_text(
    client: openai.OpenAI, offline: LLM
) -> None:
    messages = [
        {"role": "user", "content": "What does the json module do?"},
        {"role": "assistant", "content": "The json module"},
    ]
    # the tiny model's template, by hand: no end of turn after the assistant's text
    prompt = (
        "<|im_start|>user\nWhat does the json module do?<|im_end|>\n"
        "<|im_start|>assistant\nThe json module"
    )
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    got = client.chat.completions.create(
        **GREEDY, messages=messages, max_tokens=12, extra_body=go_on
    )
    ids = _tokens(offline).encode(prompt, False)
    ref = client.completions.create(**GREEDY, prompt=ids, max_tokens=12)
    assert got.choices[0].message.content == ref.choices[0].text
    assert got.usage is not None and got.usage.prompt_tokens == len(ids)
    closed = client.chat.completions.create(
        **GREEDY, messages=messages, max_tokens=12, extra_body={"add_generation_prompt": False}
    )
    assert closed.usage is not None and closed.usage.prompt_tokens > len(ids)


THINKING_TEMPLATE = (  # the tiny model's template, and a variable the request may set
    CHAT_TEMPLATE + "{% if add_generation_prompt and enable_thinking is defined and "
    "enable_thinking %}<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_gateway(
    cluster: Cluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    """A second gateway on the same workers whose tokenizer's chat template reads
    ``enable_thinking`` (served under the same name: the checkpoint's directory name)."""
    copy = tmp_path_factory.mktemp("thinking") / tiny_model.name
    shutil.copytree(tiny_model, copy)
    (copy / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    group, port = service_group(copy), free_port()
    scheduler = cluster.ready["scheduler"]["address"]
    try:
        argv = ["gateway", "--model", str(copy), "--port", str(port), "--scheduler", scheduler]
        group.spawn("gateway", argv, ready=False)
        group.wait_http("gateway", f"http://127.0.0.1:{port}/ready", 60)
        url = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
            yield c
    finally:
        group.stop()


def test_chat_template_kwargs_reach_the_template(
    thinking_gateway: openai.OpenAI, client: openai.OpenAI, offline: LLM
) -> None:
    messages = [{"role": "user", "content": "What does the json module do?"}]
    prompt = "<|im_start|>user\nWhat does the json module do?<|im_end|>\n<|im_start|>assistant\n"
    for thinking, text in ((True, prompt + "<think>\n"), (False, prompt)):
        got = thinking_gateway.chat.completions.create(
            **GREEDY, messages=messages, max_tokens=10,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        )  # fmt: skip
        ids = _tokens(offline).encode(text, False)
        ref = client.completions.create(**GREEDY, prompt=ids, max_tokens=10)
        assert got.usage is not None and got.usage.prompt_tokens == len(ids)
        assert got.choices[0].message.content == ref.choices[0].text
    with pytest.raises(openai.BadRequestError) as caught:
        thinking_gateway.chat.completions.create(
            **GREEDY, messages=messages, max_tokens=2,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )  # fmt: skip
    assert caught.value.param == "chat_template_kwargs.add_generation_prompt"


def test_output_changing_fields_are_refused_not_ignored(client: openai.OpenAI) -> None:
    """Each used to get a 200 with the output as if it were absent."""
    hi = [{"role": "user", "content": "hi"}]
    for extra, param in [
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**GREEDY, messages=hi, max_tokens=2, extra_body=extra)
        assert caught.value.param == param
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    parts = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**GREEDY, messages=parts, max_tokens=2)
    assert caught.value.param == "messages.0.content.1"
    assert "'image_url' are not supported" in caught.value.body["message"]  # type: ignore[index]


def test_structured_outputs_and_tool_calls_colocated(client: openai.OpenAI) -> None:
    """The colocated worker (one engine does the whole request) under each kind of grammar: the
    random model's text follows it whatever it samples."""
    email = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
    out = client.completions.create(
        model=MODEL, prompt="contact:", max_tokens=60, n=3, seed=4,
        extra_body={"structured_outputs": {"regex": email}},
    )  # fmt: skip
    assert all(re.fullmatch(email, c.text) for c in out.choices), [c.text for c in out.choices]
    colors = ["red", "green", "blue"]
    chat = [{"role": "user", "content": "a color"}]
    out2 = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=8, extra_body={"guided_choice": colors},  # type: ignore[arg-type]
    )  # fmt: skip
    assert out2.choices[0].message.content in colors
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
        "additionalProperties": False}}}  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        out3 = client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=400, tools=[tool], tool_choice=choice,  # type: ignore[arg-type,list-item]
            temperature=0,
        )  # fmt: skip
        [call, *_] = out3.choices[0].message.tool_calls or []
        assert call.function.name == "pick"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments)["k"] in ("a", "b")  # type: ignore[union-attr]
