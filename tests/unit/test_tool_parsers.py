"""The tool-call parsers on adversarial text, each fed whole and a character at a time (as a
stream would feed them): a closing tag inside an argument, two calls in one message, a call
cut short by max_tokens, a call inside a reasoning block, arguments before the name, escapes;
the streamed deltas add up to the calls, the first of each carrying its id and name."""

import json
from typing import Any

import pytest

from services.gateway.tool_parsers import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    ParsedDelta,
)

Parser = HermesParser | Llama3JsonParser | JsonArrayParser


def run(parser: Parser, text: str, step: int) -> tuple[str, list[tuple[str, Any]], ParsedDelta]:
    """Feed ``text`` in pieces of ``step`` characters (0: at once): (the content, the calls as
    (name, arguments), every delta handed out)."""
    seen = ParsedDelta()
    pieces = [text] if step == 0 else [text[i : i + step] for i in range(0, len(text), step)]
    for piece in pieces:
        seen += parser.feed(piece)
    seen += parser.finish()
    calls = [(c.name, json.loads(c.arguments)) for c in parser.calls]
    return seen.content, calls, seen


def streamed_calls(seen: ParsedDelta) -> list[tuple[str, Any]]:
    """The calls as a client of the stream puts them together from the deltas."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids: dict[int, str] = {}
    for d in seen.tool_calls:
        if d.name is not None:
            assert d.index not in names and d.id is not None  # the first delta, once
            names[d.index], ids[d.index] = d.name, d.id
        assert d.index in names  # never arguments before the name
        args[d.index] = args.get(d.index, "") + d.arguments
    assert len(set(ids.values())) == len(ids)
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


STEPS = [0, 1, 3, 7]
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)


@pytest.mark.parametrize("step", STEPS)
def test_hermes_one_call_among_content(step: int) -> None:
    content, calls, seen = run(HermesParser(), f"Let me look. {CALL} Done.", step)
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]
    assert content == "Let me look.  Done."
    assert streamed_calls(seen) == calls


@pytest.mark.parametrize("step", STEPS)
def test_hermes_a_closing_tag_inside_an_argument(step: int) -> None:
    # as JSON text: an escaped quote before a brace, and a backslash just before the quote
    # that ends the string
    code = "print('</tool_call>')  # a brace }, a quote \\\"} and a backslash \\\\"
    text = '<tool_call>{"name": "run", "arguments": {"code": "' + code + '"}}</tool_call>'
    content, calls, seen = run(HermesParser(), text, step)
    assert calls == [("run", {"code": json.loads(f'"{code}"')})]
    assert content == "" and streamed_calls(seen) == calls


@pytest.mark.parametrize("step", STEPS)
def test_hermes_two_calls_in_one_message(step: int) -> None:
    second = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    content, calls, seen = run(HermesParser(), f"{CALL}\nand\n{second}", step)
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    assert content == "\nand\n" and streamed_calls(seen) == calls


@pytest.mark.parametrize("step", STEPS)
def test_hermes_a_call_cut_short_is_content(step: int) -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, _ = run(HermesParser(), text, step)
    assert calls == [] and content == text


@pytest.mark.parametrize("step", STEPS)
def test_hermes_no_call_from_a_reasoning_block(step: int) -> None:
    text = f"<think>I could write {CALL} here.</think>The answer is 4."
    content, calls, seen = run(HermesParser(), text, step)
    assert calls == [] and seen.tool_calls == [] and content == text


@pytest.mark.parametrize("step", STEPS)
def test_hermes_a_tag_without_json_is_content(step: int) -> None:
    text = "Use <tool_call> tags like this: <tool_call>name</tool_call>."
    content, calls, _ = run(HermesParser(), text, step)
    assert calls == [] and content == text


@pytest.mark.parametrize("step", STEPS)
def test_hermes_arguments_before_the_name(step: int) -> None:
    text = '<tool_call>{"arguments": {"q": "a, b: {c}"}, "name": "search"}</tool_call>'
    _, calls, seen = run(HermesParser(), text, step)
    assert calls == [("search", {"q": "a, b: {c}"})] and streamed_calls(seen) == calls


def test_hermes_streams_the_arguments_as_they_come() -> None:
    """Streamed, the arguments go out before the call's object closes."""
    parser = HermesParser()
    head = '<tool_call>{"name": "f", "arguments": {"text": "a long value'
    seen = parser.feed(head)
    assert [d.name for d in seen.tool_calls][:1] == ["f"]
    assert "".join(d.arguments for d in seen.tool_calls).startswith('{"text": "a long')
    assert parser.calls == []


@pytest.mark.parametrize("step", STEPS)
def test_llama3_json_calls(step: int) -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {}}')  # fmt: skip
    content, calls, seen = run(Llama3JsonParser(), text, step)
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert content == "" and streamed_calls(seen) == calls


@pytest.mark.parametrize("step", STEPS)
def test_llama3_json_plain_text_and_a_cut_call_are_content(step: int) -> None:
    text = "The capital of France is Paris. {not a call}"
    assert run(Llama3JsonParser(), text, step)[:2] == (text, [])
    cut = '{"name": "get_weather", "parameters": {"city": "Pa'
    assert run(Llama3JsonParser(), cut, step)[:2] == (cut, [])


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser])
def test_a_call_whose_json_is_not_a_call_is_none(parser: type[Parser]) -> None:
    body = '{"arguments": {"x": 1}}'  # no name
    text = f"<tool_call>{body}</tool_call>" if parser is HermesParser else body
    for step in STEPS:
        content, calls, _ = run(parser(), text, step)
        assert calls == [] and content == text  # handed back as content, not lost


@pytest.mark.parametrize("step", STEPS)
def test_json_array_calls(step: int) -> None:
    """tool_choice "required"'s reply: brackets and commas inside strings are no separators."""
    text = (
        '\n[ {"name": "say", "parameters": {"text": "a], [b, \\"c\\"}"}} ,'
        '{"name": "get_time", "parameters": {}} ]'
    )
    content, calls, seen = run(JsonArrayParser(), text, step)
    assert calls == [("say", {"text": 'a], [b, "c"}'}), ("get_time", {})]
    assert content == "" and streamed_calls(seen) == calls


@pytest.mark.parametrize("step", STEPS)
def test_json_array_cut_short_and_not_an_array(step: int) -> None:
    cut = '[{"name": "say", "parameters": {"text": "hel'
    content, calls, _ = run(JsonArrayParser(), cut, step)
    assert calls == [] and content == cut[1:]
    assert run(JsonArrayParser(), "no calls here", step)[:2] == ("no calls here", [])
