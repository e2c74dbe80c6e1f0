"""The gateway's request bodies: every field that would change the output and that Baton cannot
honour is a 400 whose ``param`` names it and whose message is clean (no pydantic prefixes),
non-text content parts say so, and the fields that change nothing are accepted."""

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from services.gateway import errors
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

P = {"model": "m", "prompt": "hi"}
C = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ASSISTANT_LAST = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]


def refusal(schema: type[BaseModel], body: dict[str, Any]) -> errors.APIError:
    """The error the app would send for ``body`` (as its validation handler maps it)."""
    with pytest.raises(ValidationError) as e:
        schema.model_validate_json(json.dumps(body))
    return errors.from_validation(e.value.errors(include_url=False))


# (schema, body, the param the 400 names)
REFUSED: list[tuple[type[BaseModel], dict[str, Any], str]] = [
    # cross-field checks: these said "Value error, ..." with param null
    (CompletionRequest, {**P, "logit_bias": {"1": 101}}, "logit_bias"),
    (CompletionRequest, {**P, "logit_bias": {"a": 1}}, "logit_bias"),
    (ChatCompletionRequest, {**C, "logit_bias": {"-1": 1}}, "logit_bias"),
    (CompletionRequest, {**P, "suffix": "x"}, "suffix"),
    (CompletionRequest, {**P, "best_of": 2}, "best_of"),
    (CompletionRequest, {**P, "stop": [""]}, "stop"),
    (CompletionRequest, {**P, "prompt": []}, "prompt"),
    (CompletionRequest, {**P, "stream_options": {"include_usage": True}}, "stream_options"),
    (ChatCompletionRequest, {**C, "top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, {**C, "tools": [{"type": "function"}]}, "tools"),
    (ChatCompletionRequest, {**C, "tool_choice": "required"}, "tool_choice"),
    (ChatCompletionRequest, {**C, "response_format": {"type": "xml"}}, "response_format.type"),
    # fields that were silently ignored and would change the output
    (ChatCompletionRequest, {**C, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (ChatCompletionRequest, {**C, "function_call": {"name": "f"}}, "function_call"),
    (ChatCompletionRequest, {**C, "modalities": ["text", "audio"]}, "modalities"),
    (ChatCompletionRequest, {**C, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (ChatCompletionRequest, {**C, "echo": True}, "echo"),
    (ChatCompletionRequest, {**C, "reasoning_effort": "low"}, "reasoning_effort"),
    (ChatCompletionRequest, {**C, "web_search_options": {}}, "web_search_options"),
    (ChatCompletionRequest, {**C, "chat_template": "{{ messages }}"}, "chat_template"),
    (ChatCompletionRequest, {**C, "documents": [{"text": "x"}]}, "documents"),
    (CompletionRequest, {**P, "use_beam_search": True}, "use_beam_search"),
    (ChatCompletionRequest, {**C, "use_beam_search": True}, "use_beam_search"),
    (CompletionRequest, {**P, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    (ChatCompletionRequest, {**C, "prompt_logprobs": 21}, "prompt_logprobs"),
    (ChatCompletionRequest, {**C, "max_tokens": 0}, "max_tokens"),
    (
        CompletionRequest,
        {**P, "structured_outputs": {"regex": "a+", "x": 1}},
        "structured_outputs.x",
    ),
    (CompletionRequest, {**P, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (ChatCompletionRequest, {**C, "structural_tag": "{}"}, "structural_tag"),
    (CompletionRequest, {**P, "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    (CompletionRequest, {**P, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    (
        ChatCompletionRequest,
        {**C, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    (
        ChatCompletionRequest,
        {**C, "messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]},
        "messages",  # (pydantic's: "messages.0.tool_calls.0.function: Field required")
    ),
    (
        ChatCompletionRequest,
        {**C, "messages": [{"role": "assistant", "function_call": {"name": "f"}}]},
        "messages.0.function_call",
    ),
    # the honoured fields' own bounds
    (CompletionRequest, {**P, "allowed_token_ids": []}, "allowed_token_ids"),
    (CompletionRequest, {**P, "allowed_token_ids": [-1]}, "allowed_token_ids"),
    (CompletionRequest, {**P, "bad_words": ["  "]}, "bad_words"),
    (CompletionRequest, {**P, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (ChatCompletionRequest, {**C, "continue_final_message": True}, "continue_final_message"),
    (
        ChatCompletionRequest,  # the last message is the user's
        {**C, "continue_final_message": True, "add_generation_prompt": False},
        "continue_final_message",
    ),
    (
        ChatCompletionRequest,
        {**C, "chat_template_kwargs": {"add_generation_prompt": True}},
        "chat_template_kwargs.add_generation_prompt",
    ),
    (
        ChatCompletionRequest,
        {**C, "chat_template_kwargs": {"bos_token": ""}},
        "chat_template_kwargs.bos_token",
    ),
    (
        ChatCompletionRequest,
        {**C, "chat_template_kwargs": {"not a name": 1}},
        "chat_template_kwargs",
    ),
    (
        ChatCompletionRequest,
        {**C, "chat_template_kwargs": {f"k{i}": i for i in range(33)}},
        "chat_template_kwargs",
    ),
    (
        ChatCompletionRequest,
        {**C, "chat_template_kwargs": {"k": "x" * 20000}},
        "chat_template_kwargs",
    ),
]


@pytest.mark.parametrize(("schema", "body", "param"), REFUSED)
def test_refusals_name_their_field_with_a_clean_message(
    schema: type[BaseModel], body: dict[str, Any], param: str
) -> None:
    e = refusal(schema, body)
    assert (e.status, e.param, e.type) == (400, param, "invalid_request_error")
    assert e.message and "Value error" not in e.message and "Assertion" not in e.message


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file", "video_url"])
def test_non_text_content_parts_are_refused_by_their_path(kind: str) -> None:
    part = {"type": kind, kind: {"url": "https://example.com/x"}}
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "look"}, part]}]  # fmt: skip
    e = refusal(ChatCompletionRequest, {**C, "messages": messages})
    assert e.param == "messages.1.content.1"
    assert e.message == f"content parts of type {kind!r} are not supported (text only)"


def test_text_parts_are_joined_and_a_text_part_needs_text() -> None:
    body = ChatCompletionRequest.model_validate_json(json.dumps({**C, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]}))  # fmt: skip
    assert body.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    bad = {**C, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert refusal(ChatCompletionRequest, bad).param == "messages.0.content.0.text"


def test_field_errors_keep_their_location() -> None:
    e = refusal(CompletionRequest, {**P, "max_tokens": "5"})
    assert e.param == "max_tokens" and e.message.startswith("max_tokens: ")


@pytest.mark.parametrize(
    ("schema", "body"),
    [
        # fields that change nothing in the output: accepted, documented as ignored
        (
            ChatCompletionRequest,
            {
                **C,
                "user": "u",
                "metadata": {"k": "v"},
                "store": False,
                "service_tier": "auto",
                "parallel_tool_calls": True,
                "prediction": {"type": "content", "content": "x"},
            },
        ),
        # their no-op values
        (
            ChatCompletionRequest,
            {
                **C,
                "modalities": ["text"],
                "tools": [],
                "functions": [],
                "function_call": "none",
                "tool_choice": "none",
                "response_format": {"type": "text"},
                "use_beam_search": False,
                "audio": None,
                "echo": False,
            },
        ),
        (
            CompletionRequest,
            {**P, "logit_bias": {}, "suffix": "", "best_of": 1, "return_token_ids": False},
        ),
        # honoured
        (
            CompletionRequest,
            {
                **P,
                "allowed_token_ids": [1, 2],
                "bad_words": ["x y"],
                "truncate_prompt_tokens": 3,
                "add_special_tokens": False,
            },
        ),
        (
            ChatCompletionRequest,
            {
                **C,
                "messages": ASSISTANT_LAST,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        ),
    ],
)
def test_accepted(schema: type[BaseModel], body: dict[str, Any]) -> None:
    schema.model_validate_json(json.dumps(body))
