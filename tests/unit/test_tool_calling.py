"""Tool calling on /v1/chat/completions without a cluster: tools and tool_choice checked, the
grammars of "required" and a named function (held to xgrammar), the chat template given the
tools and the earlier calls and tool replies (as ``transformers`` renders them), and replies
read into tool calls by the handler — streamed and not — as the openai SDK parses them."""

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from pydantic import ValidationError

from services.gateway import errors
from services.gateway.catalog import ModelLimits
from services.gateway.choice import ChoiceDelta
from services.gateway.handler import Handler
from services.gateway.orchestrator import Job
from services.gateway.schemas import ChatCompletionRequest
from services.gateway.settings import InputLimits
from services.gateway.tools import ToolReader, required_schema
from shared.text.tokenizer import TextTokenizer

C = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
CITY = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/City"}},
    "required": ["city"],
    "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
}
COUNT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": CITY,
        "strict": True,
    },
}
COUNTER = {"type": "function", "function": {"name": "count", "parameters": COUNT}}
NAMED = {"type": "function", "function": {"name": "count"}}

# Qwen2.5's chat template, as Qwen's tokenizer_config.json has it (the tools part)
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "user", "content": "And Rome?"},
]


def parse(body: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def refusal(body: dict[str, Any]) -> errors.APIError:
    with pytest.raises(ValidationError) as e:
        parse(body)
    return errors.from_validation(e.value.errors(include_url=False))


# ---- tools and tool_choice -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({}, None),
        ({"tools": [WEATHER]}, "auto"),
        ({"tools": [WEATHER], "tool_choice": "none"}, "none"),
        ({"tools": [], "tool_choice": "none"}, None),
        ({"tool_choice": "none"}, None),
        ({"tools": [WEATHER, COUNTER], "tool_choice": "required"}, "required"),
        ({"tools": [WEATHER, COUNTER], "tool_choice": NAMED}, "named"),
    ],
)
def test_tool_choice_modes(fields: dict[str, Any], mode: str | None) -> None:
    plan = parse({**C, **fields}).tool_plan
    assert (plan.mode if plan is not None else None) == mode


TIGHT = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2}},
}
REFUSED = [
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"tool_choice": NAMED}, "tool_choice", "only allowed when tools"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "not one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "named"),
    ({"tools": [WEATHER], "tool_choice": NAMED}, "tool_choice.function.name", "'count'"),
    (
        {"tools": [{"type": "code_interpreter", "function": {"name": "x"}}]},
        "tools.0.type",
        "function only",
    ),
    ({"tools": [{"type": "function"}]}, "tools", "Field required"),
    (
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools.0.function.name",
        "1 to 64",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "two tools"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools.0.function.parameters.type",
        "object",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": TIGHT}}],
            "tool_choice": "required",
        },
        "tools.0.function.parameters.properties.code.minLength",
        "minLength beside pattern",
    ),
    (
        {"tools": [WEATHER], "response_format": {"type": "json_object"}},
        "response_format",
        "keep the model from calling",
    ),
    (
        {"tools": [COUNTER], "tool_choice": NAMED, "guided_regex": "a"},
        "tool_choice",
        "guided_regex and tool_choice",
    ),
    (
        {"messages": [{"role": "user", "tool_calls": HISTORY[1]["tool_calls"]}]},
        "messages.0.tool_calls",
        "only an assistant",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                }
            ]
        },
        "messages.0.tool_calls.0.function.arguments",
        "JSON text of an object",
    ),
]


@pytest.mark.parametrize(("fields", "param", "words"), REFUSED)
def test_refusals(fields: dict[str, Any], param: str, words: str) -> None:
    e = refusal({**C, **fields})
    assert (e.status, e.param) == (400, param), e.message
    assert words in e.message


def test_a_tools_schema_is_checked_only_where_it_constrains() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": TIGHT}}
    assert parse({**C, "tools": [tool], "tool_choice": "none"}).grammar is None
    named = {"type": "function", "function": {"name": "f"}}
    assert refusal({**C, "tools": [tool], "tool_choice": named}).param.endswith("minLength")


def test_named_function_constrains_to_its_parameters() -> None:
    body = parse({**C, "tools": [WEATHER, COUNTER], "tool_choice": NAMED})
    assert body.grammar is not None and body.grammar.param == "tool_choice"
    assert json.loads(body.grammar.spec.json_schema) == COUNT
    empty = {"type": "function", "function": {"name": "ping"}}
    ping = {"type": "function", "function": {"name": "ping"}}
    body = parse({**C, "tools": [empty], "tool_choice": ping})
    assert json.loads(body.grammar.spec.json_schema) == {"type": "object", "properties": {}}


def test_required_schema_is_vllms_shape_with_each_tools_refs_rebased() -> None:
    plan = parse({**C, "tools": [WEATHER, COUNTER], "tool_choice": "required"}).tool_plan
    assert plan is not None
    schema = required_schema(plan.tools, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, _ = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"const": "get_weather"}
    assert first["required"] == ["name", "parameters"]
    assert first["properties"]["parameters"] == {"$ref": "#/$defs/tool0"}
    city = schema["$defs"]["tool0"]["properties"]["city"]
    assert city == {"$ref": "#/$defs/tool0/$defs/City"}
    assert schema["$defs"]["tool1"] == COUNT
    one = required_schema(plan.tools[:1], parallel=False)
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"]["const"] == "get_weather"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_grammar_accepts_calls_and_nothing_else(parallel: bool) -> None:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    body = parse(
        {
            **C,
            "tools": [WEATHER, COUNTER],
            "tool_choice": "required",
            "parallel_tool_calls": parallel,
        }
    )
    grammar = xgr.Grammar.from_json_schema(body.grammar.spec.json_schema)
    one = {"name": "get_weather", "parameters": {"city": "Paris"}}
    two = {"name": "count", "parameters": {"n": 3}}
    cases = [
        ([one], True),
        ([one, two], parallel),
        ([], False),
        ([{"name": "get_weather", "parameters": {"city": "Oslo"}}], False),
        ([{"name": "count", "parameters": {"city": "Paris"}}], False),
        ([{"name": "other", "parameters": {}}], False),
    ]
    for calls, accepted in cases:
        assert _is_grammar_accept_string(grammar, json.dumps(calls)) == accepted, calls


# ---- the chat template sees the tools, the calls and the tool replies --------------------------


@pytest.fixture(scope="module")
def qwen_tools_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with Qwen2.5's chat template, which renders tools."""
    out = tmp_path_factory.mktemp("qwen-tools")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_template_renders_tools_calls_and_replies_as_transformers(qwen_tools_model: Path) -> None:
    from transformers import AutoTokenizer

    body = parse({**C, "messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    assert body.tool_plan is not None
    tools = body.tool_plan.template_tools()
    assert tools == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY},
        }
    ]
    messages = [m.as_template_input() for m in body.messages]
    ours = TextTokenizer(qwen_tools_model).render_chat_template(messages, True, tools=tools)
    # transformers given what vLLM gives it: the arguments as an object
    history = json.loads(json.dumps(HISTORY))
    history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    theirs = AutoTokenizer.from_pretrained(qwen_tools_model).apply_chat_template(
        history, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert ours == theirs
    assert (
        '"name": "get_weather"' in ours
        and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
        and "<tool_response>\n22 C, sunny\n</tool_response>" in ours
    )


def test_smollm2_template_takes_the_tool_turns(smollm2_gguf: Path) -> None:
    """SmolLM2's template has no tools section: the tools change nothing, a tool's reply is a
    turn of its own."""
    tok = TextTokenizer(smollm2_gguf)
    body = parse({**C, "messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    messages = [m.as_template_input() for m in body.messages]
    assert body.tool_plan is not None
    text = tok.render_chat_template(messages, True, tools=body.tool_plan.template_tools())
    assert text == tok.render_chat_template(messages, True)
    assert "<|im_start|>tool\n22 C, sunny<|im_end|>" in text


# ---- replies read into tool calls -----------------------------------------------------------


def read(reader: ToolReader, text: str, step: int) -> tuple[str, list, list]:
    content, deltas = "", []
    for i in range(0, len(text), step):
        parsed = reader.feed(text[i : i + step])
        content += parsed.content
        deltas += parsed.tool_calls
    parsed = reader.finish()
    return content + parsed.content, deltas + parsed.tool_calls, reader.calls


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_required_reply_is_read_as_calls(step: int) -> None:
    plan = parse({**C, "tools": [WEATHER, COUNTER], "tool_choice": "required"}).tool_plan
    assert plan is not None
    text = (
        ' [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "count", '
        '"parameters": {"n": 2}}]'
    )
    content, deltas, calls = read(ToolReader(plan, None), text, step)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}),
        ("count", {"n": 2}),
    ]
    args = {0: "", 1: ""}
    for d in deltas:
        args[d.index] += d.arguments
    assert [json.loads(a) for a in args.values()] == [{"city": "Rome"}, {"n": 2}]
    assert [d.name for d in deltas if d.id is not None] == ["get_weather", "count"]


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    plan = parse({**C, "tools": [WEATHER, COUNTER], "parallel_tool_calls": False}).tool_plan
    assert plan is not None and not plan.parallel
    two = "".join(HERMES_REPLY) + '<tool_call>{"name": "count", "arguments": {"n": 1}}</tool_call>'
    content, deltas, calls = read(ToolReader(plan, "hermes"), two, 3)
    assert [c.name for c in calls] == ["get_weather"] and {d.index for d in deltas} == {0}
    assert content == "Let me check. "


def test_finish_reasons() -> None:
    required = parse({**C, "tools": [COUNTER], "tool_choice": "required"}).tool_plan
    named = parse({**C, "tools": [COUNTER], "tool_choice": NAMED}).tool_plan
    assert required is not None and named is not None
    reader = ToolReader(required, None)
    read(reader, '[{"name": "count", "parameters": {"n": 1}}]', 5)
    assert reader.finish_reason("stop") == "tool_calls"
    assert reader.finish_reason("length") == "length"
    reader = ToolReader(named, None)
    read(reader, '{"n": 1}', 3)
    assert reader.finish_reason("stop") == "stop"  # as OpenAI's for a named function
    assert [(c.name, c.arguments) for c in reader.calls] == [("count", '{"n": 1}')]


# ---- through the handler, as the openai SDK reads it --------------------------------------------


class FakeCatalog:
    def __init__(self, tok: TextTokenizer):
        self.tokenizers = {"m": tok}

    async def limits(self, model: str) -> ModelLimits:
        return ModelLimits(max_model_len=4096, block_size=16, num_workers=1)


class FakeOrchestrator:
    """Each job's one choice says ``pieces``, one token each, ending with ``finish``."""

    def __init__(self, pieces: list[str], finish: str = "stop"):
        self.pieces, self.finish, self.jobs = pieces, finish, list[Job]()

    async def run(self, job: Job, num_logprobs: int | None) -> AsyncIterator[ChoiceDelta]:
        self.jobs.append(job)
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield ChoiceDelta(0, piece, [5], finish_reason=self.finish if last else None)


def handler(tok: TextTokenizer, pieces: list[str], parser: str | None = "hermes") -> Any:
    orchestrator = FakeOrchestrator(pieces)
    return Handler(orchestrator, FakeCatalog(tok), 30.0, InputLimits(), parser), orchestrator  # type: ignore[arg-type]


def sdk(responses: list[Any]) -> openai.OpenAI:
    """An openai client whose server answers with ``responses`` (a body, or SSE lines)."""

    def answer(request: httpx.Request) -> httpx.Response:
        body = responses.pop(0)
        if isinstance(body, dict):
            return httpx.Response(200, json=body)
        return httpx.Response(
            200, content="".join(body).encode(), headers={"content-type": "text/event-stream"}
        )

    client = httpx.Client(transport=httpx.MockTransport(answer))
    return openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=client)


HERMES_REPLY = [
    "Let me check. ",
    '<tool_call>\n{"name": "get_',
    'weather", "arguments": ',
    '{"city": "Rome"}}\n</tool_call>',
]


async def serve(h: Handler, body: dict[str, Any]) -> Any:
    request = parse(body)
    plan = await h.plan(request, "req")
    if request.stream:
        return [line async for line in h.stream(plan, request.include_usage)]
    return await h.complete(plan)


async def test_auto_reply_through_the_handler_and_the_sdk(qwen_tools_model: Path) -> None:
    tok = TextTokenizer(qwen_tools_model)
    body = {**C, "tools": [WEATHER]}
    h, orchestrator = handler(tok, HERMES_REPLY)
    whole = await serve(h, body)
    lines = await serve(h, {**body, "stream": True})
    prompt = tok.decode(orchestrator.jobs[0].prompt_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt  # the tools reached the template
    # auto: free text, but the call of a strict tool follows its schema
    assert orchestrator.jobs[0].params.structured_output.WhichOneof("kind") == "structural_tag"
    client = sdk([whole])
    message = client.chat.completions.create(model="m", messages=[]).choices[0].message
    assert message.content == "Let me check. "
    call = message.tool_calls[0]  # type: ignore[index]
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    state = ChatCompletionStreamState()
    for line in lines[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(line.removeprefix("data: ")))
    assert lines[-1] == "data: [DONE]\n\n"
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == "Let me check. "
    streamed = final.message.tool_calls[0]  # type: ignore[index]
    assert streamed.function.name == "get_weather" and streamed.id.startswith("call_")
    assert json.loads(streamed.function.arguments) == {"city": "Rome"}


async def test_named_and_required_through_the_handler(qwen_tools_model: Path) -> None:
    tok = TextTokenizer(qwen_tools_model)
    h, orchestrator = handler(tok, ['{"n"', ": 4}"], parser=None)
    body = {**C, "tools": [WEATHER, COUNTER], "tool_choice": NAMED}
    whole = await serve(h, body)
    assert json.loads(orchestrator.jobs[0].params.structured_output.json_schema) == COUNT
    message = sdk([whole]).chat.completions.create(model="m", messages=[]).choices[0]
    assert message.finish_reason == "stop" and message.message.content is None
    assert message.message.tool_calls[0].function.arguments == '{"n": 4}'  # type: ignore[index]
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in (await serve(h, {**body, "stream": True}))[:-1]
    ]
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None
    assert first["tool_calls"][0]["function"] == {"name": "count", "arguments": '{"n"'}
    assert chunks[1]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": ": 4}"}}
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    h, _ = handler(tok, ['[{"name": "count", ', '"parameters": {"n": 1}}]'], parser=None)
    whole = await serve(h, {**C, "tools": [WEATHER, COUNTER], "tool_choice": "required"})
    choice = sdk([whole]).chat.completions.create(model="m", messages=[]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.arguments == '{"n": 1}'  # type: ignore[index]


async def test_auto_without_a_parser_is_a_400(qwen_tools_model: Path) -> None:
    h, _ = handler(TextTokenizer(qwen_tools_model), ["x"], parser=None)
    with pytest.raises(errors.APIError) as e:
        await serve(h, {**C, "tools": [WEATHER]})
    assert (e.value.status, e.value.param) == (400, "tool_choice")
    assert "--tool-call-parser" in e.value.message
    assert (await serve(h, {**C, "tools": [WEATHER], "tool_choice": "none"}))["choices"]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
async def test_auto_constrains_the_calls_of_strict_tools(
    qwen_tools_model: Path, parser: str
) -> None:
    """Under auto, a strict tool's call follows its schema in the parser's format (a structural
    tag: free text until the trigger), a tool that is not strict takes any object; without a
    strict tool nothing is constrained."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    tok = TextTokenizer(qwen_tools_model)
    h, orchestrator = handler(tok, ["x"], parser=parser)
    await serve(h, {**C, "tools": [COUNTER]})
    assert not orchestrator.jobs[0].params.HasField("structured_output")
    await serve(h, {**C, "tools": [WEATHER, COUNTER]})
    spec = orchestrator.jobs[1].params.structured_output
    grammar = xgr.Grammar.from_structural_tag(spec.structural_tag)

    def call(name: str, args: dict[str, Any]) -> str:
        if parser == "hermes":
            return (
                f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
            )
        return f'{{"name": "{name}", "parameters": {json.dumps(args)}}}'

    cases = [
        ("Let me check. " + call("get_weather", {"city": "Rome"}), True),
        ("No tool needed here.", True),
        (call("get_weather", {"city": "Oslo"}), False),  # not in the strict tool's enum
        (call("count", {"anything": [1, 2]}), True),  # not strict: any object
        (call("other", {}), False),
    ]
    for text, accepted in cases:
        assert _is_grammar_accept_string(grammar, text) == accepted, text
    # the parser reads it back (Llama 3.1's calls are the whole reply)
    reply = cases[0][0] if parser == "hermes" else call("get_weather", {"city": "Rome"})
    h2, _ = handler(tok, [reply], parser=parser)
    whole = await serve(h2, {**C, "tools": [WEATHER, COUNTER]})
    [got] = whole["choices"][0]["message"]["tool_calls"]
    assert got["function"]["name"] == "get_weather"
    assert json.loads(got["function"]["arguments"]) == {"city": "Rome"}
