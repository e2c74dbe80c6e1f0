"""Structured outputs and tool calling with the official ``openai`` SDK against ``baton serve``.

SmolLM2-135M-Instruct (the trained model of ``make run``) on one prefill and one decode worker,
every prompt prefilled remotely, so the first token of every answer is sampled under its grammar
by the prefill worker and the rest by the decode worker: ``parse()`` returns objects that
validate for nested, array, enum, bounded-number, optional and ``$ref`` schemas, greedy and
seeded; regex and choice constraints hold on every output; tool calls parse with
``tool_choice="required"`` and with a named function, streamed and not, and a multi-turn
exchange with ``role: "tool"`` results works; greedy answers equal the engine's colocated (in
this process) token for token. Then, on the tiny model with two decode workers, one of them is
killed under constrained streams: every stream finishes, valid and identical."""

import enum
import json
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
import torch
from pydantic import BaseModel, Field

from baton import LLM, SamplingParams
from baton.launcher import Cluster
from services.worker.engine.params import StructuredOutputParams
from tests.e2e.conftest import disaggregated_routes, running_cluster, worker_health

NAME = "SmolLM2-135M-Instruct"


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: str = Field(max_length=20)


class Person(BaseModel):  # nested objects, arrays, enums, bounds, an optional field, $ref
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "London", "Tokyo"]
    pets: list[Pet] = Field(max_length=3)
    nickname: str | None


class Ingredient(BaseModel):
    name: str = Field(max_length=30)
    grams: float = Field(ge=0, le=5000)


class Recipe(BaseModel):
    title: str = Field(max_length=60)
    servings: int = Field(ge=1, le=12)
    vegetarian: bool
    ingredients: list[Ingredient] = Field(min_length=1, max_length=5)


class Sentiment(enum.StrEnum):
    positive = "positive"
    negative = "negative"
    neutral = "neutral"


class Review(BaseModel):
    sentiment: Sentiment
    confidence: float = Field(ge=0, le=1)


ASKS: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a person with two pets. Answer in JSON."),
    (Recipe, "Give me a short pancake recipe as JSON."),
    (Review, 'Classify the review "The food was wonderful!" as JSON.'),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
EMAIL = r"[a-z]{3,10}@[a-z]{3,10}\.(com|org|net)"


@pytest.fixture(scope="module")
def pd_cluster(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 0}}))
    flags = ["--prefill-workers", "1", "--decode-workers", "1", "--routing-policy", str(policy),
             "--served-model-name", NAME, "--tool-call-parser", "hermes"]  # fmt: skip
    with running_cluster(smollm2_gguf, 0, *flags) as c:
        yield c


@pytest.fixture(scope="module")
def client(pd_cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=300) as c:
        yield c


@pytest.mark.parametrize(("model", "ask"), ASKS, ids=[m.__name__ for m, _ in ASKS])
@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_parse_returns_objects_that_validate(
    client: openai.OpenAI, model: type[BaseModel], ask: str, seed: int | None
) -> None:
    sampling: dict[str, Any] = {"temperature": 0} if seed is None else {"seed": seed}
    out = client.chat.completions.parse(
        model=NAME, messages=[{"role": "user", "content": ask}], response_format=model,
        max_tokens=400, **sampling,
    )  # fmt: skip
    [choice] = out.choices
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)


def test_regex_and_choice_hold_on_every_output(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Write an email address for a bakery."}]
    out = client.chat.completions.create(
        model=NAME, messages=ask, n=4, seed=3, max_tokens=40,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"regex": EMAIL}},
    )  # fmt: skip
    assert len(out.choices) == 4
    for choice in out.choices:
        assert re.fullmatch(EMAIL, choice.message.content or ""), choice.message.content
    assert len({c.message.content for c in out.choices}) > 1
    colors = ["red", "green", "blue"]
    for seed in range(3):
        out = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Name a color."}], seed=seed,
            max_tokens=10, extra_body={"guided_choice": colors},
        )  # fmt: skip
        assert out.choices[0].message.content in colors


def _check_call(call: Any, name: str) -> dict[str, Any]:
    assert call.type == "function" and call.id and call.function.name == name
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    return args


def _streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None]:
    """The tool calls of a stream, put together from their deltas; the finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish, pieces = None, 0
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
                    pieces += bool(d.function.arguments)
            finish = choice.finish_reason or finish
    assert pieces > 1  # the arguments came as they were produced, not at the end
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_calls_a_tool(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = {
        "model": NAME, "messages": ASK_WEATHER, "tools": [WEATHER, TIME],
        "tool_choice": "required", "temperature": 0, "max_tokens": 200,
    }  # fmt: skip
    if not stream:
        [choice] = client.chat.completions.create(**kw).choices
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
        args = _check_call(choice.message.tool_calls[0], choice.message.tool_calls[0].function.name)  # type: ignore[union-attr]
        assert args
        return
    calls, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["id"] and call["name"] in ("get_weather", "get_time")
        assert isinstance(json.loads(call["arguments"]), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_is_called(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = {
        "model": NAME, "messages": ASK_WEATHER, "tools": [WEATHER, TIME], "max_tokens": 200,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 1,
    }  # fmt: skip
    if not stream:
        [choice] = client.chat.completions.create(**kw).choices
        assert choice.message.content is None and choice.message.tool_calls
        [call] = choice.message.tool_calls
        args = _check_call(call, "get_weather")
        assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["city"], str)
        return
    calls, _ = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    [call] = calls
    assert call["name"] == "get_weather"
    assert set(json.loads(call["arguments"])) == {"city", "unit"}


def test_a_multi_turn_exchange_with_tool_results(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=NAME, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=200, temperature=0,  # type: ignore[arg-type,list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    [call] = first.choices[0].message.tool_calls or []
    messages: list[Any] = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=60,  # type: ignore[list-item]
        temperature=0,
    )  # fmt: skip
    [choice] = answer.choices
    assert choice.message.content and not choice.message.tool_calls
    assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_disaggregated_answers_equal_colocated(
    client: openai.OpenAI, pd_cluster: Cluster, smollm2_gguf: Path
) -> None:
    """The engine in this process (one thread, as each worker) on the same chats and grammars."""
    schema = Person.model_json_schema()
    chat = [{"role": "user", "content": ASKS[0][1]}]
    email = [{"role": "user", "content": "Write an email address for a bakery."}]
    before = disaggregated_routes(pd_cluster)
    got = [
        client.chat.completions.create(
            model=NAME, messages=chat, temperature=0, max_tokens=300,  # type: ignore[arg-type]
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": schema}},
        ).choices[0].message.content,
        client.chat.completions.create(
            model=NAME, messages=email, temperature=0.8, seed=9, max_tokens=40,  # type: ignore[arg-type]
            extra_body={"guided_regex": EMAIL},
        ).choices[0].message.content,
    ]  # fmt: skip
    assert disaggregated_routes(pd_cluster) >= before + 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(model=str(smollm2_gguf), num_kv_blocks=512, max_model_len=1024,
                 show_progress=False) as llm:  # fmt: skip
            want = [o.outputs[0].text for o in llm.chat([chat, email], [
                SamplingParams(temperature=0, max_tokens=300,
                               structured_outputs=StructuredOutputParams(json=json.dumps(schema))),
                SamplingParams(temperature=0.8, seed=9, max_tokens=40,
                               structured_outputs=StructuredOutputParams(regex=EMAIL)),
            ], use_tqdm=False)]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert got == want
    Person.model_validate_json(got[0] or "")


# ---- a decode worker killed under constrained streams (the tiny model) ---------------------------

WORDS = r"([a-z]{2,6} ){30}[a-z]{2,6}\."  # long enough to be mid-stream at the kill


def test_a_decode_worker_killed_mid_stream_loses_nothing(tiny_model: Path, tmp_path: Path) -> None:
    prompts = [f"constrained stream {i}" for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=300,
                            structured_outputs=StructuredOutputParams(regex=WORDS))  # fmt: skip
    with LLM(model=str(tiny_model), num_kv_blocks=512, max_model_len=1024,
             show_progress=False) as llm:  # fmt: skip
        want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(re.fullmatch(WORDS, w) for w in want)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 0}}))
    flags = ["--prefill-workers", "1", "--decode-workers", "2", "--routing-policy", str(policy)]
    with running_cluster(tiny_model, 0, *flags) as cluster:
        texts: list[str] = [""] * len(prompts)
        mid = threading.Event()  # a stream is past its start
        errors: list[BaseException] = []

        def stream(i: int) -> None:
            try:
                with openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0,
                                   timeout=120) as c:  # fmt: skip
                    chunks = c.completions.create(
                        model=tiny_model.name, prompt=prompts[i], max_tokens=300, temperature=0,
                        stream=True, extra_body={"structured_outputs": {"regex": WORDS}},
                    )  # fmt: skip
                    for chunk in chunks:
                        texts[i] += chunk.choices[0].text
                        if len(texts[i]) > 15:
                            mid.set()
            except BaseException as e:  # (reported below)
                errors.append(e)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        assert mid.wait(120)  # kill the decode worker running the most streams
        busy = {n: worker_health(cluster, n).num_running for n in ("decode-0", "decode-1")}
        victim = max(busy, key=lambda n: busy[n])
        assert busy[victim] > 0
        cluster.procs[victim].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
    assert not errors, errors
    assert texts == want  # greedy, resumed under the grammar where it stopped
