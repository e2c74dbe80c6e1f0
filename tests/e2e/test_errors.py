"""Bad input gets the right OpenAI error JSON and status, never a 500 or a crash; API keys."""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from baton.launcher import Cluster, free_port
from tests.e2e.conftest import service_group

MODEL = "qwen3"
OK_PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (endpoint, body, status, the field the error names or None)
BAD_BODIES = [
    ("completions", {**OK_PROMPT, "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {**OK_PROMPT, "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {**OK_PROMPT, "max_tokens": True}, 400, "max_tokens"),
    ("completions", {**OK_PROMPT, "temperature": -1}, 400, "temperature"),
    ("completions", {**OK_PROMPT, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**OK_PROMPT, "top_p": 0}, 400, "top_p"),
    ("completions", {**OK_PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**OK_PROMPT, "n": 0}, 400, "n"),
    ("completions", {**OK_PROMPT, "logprobs": 99}, 400, "logprobs"),
    ("completions", {**OK_PROMPT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {**OK_PROMPT, "seed": "x"}, 400, "seed"),
    ("completions", {**OK_PROMPT, "stop": [""]}, 400, "stop"),
    ("completions", {**OK_PROMPT, "stop": 5}, 400, "stop"),
    ("completions", {**OK_PROMPT, "prompt": []}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "prompt": ""}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "prompt": [1, -2]}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "prompt": [10**9]}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "prompt": "word " * 2000}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "max_tokens": 5000}, 400, "max_tokens"),
    ("completions", {**OK_PROMPT, "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("completions", {**OK_PROMPT, "logit_bias": {str(10**6): 1}}, 400, "logit_bias"),
    (
        "completions",
        {**OK_PROMPT, "logit_bias": {str(i): 1 for i in range(1025)}},
        400,
        "logit_bias",
    ),
    ("completions", {**OK_PROMPT, "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("completions", {**OK_PROMPT, "suffix": "x"}, 400, "suffix"),
    ("completions", {**OK_PROMPT, "best_of": 2}, 400, "best_of"),
    ("completions", {**OK_PROMPT, "min_tokens": 5}, 400, "min_tokens"),
    (
        "completions",
        {**OK_PROMPT, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("completions", {"prompt": "no model"}, 400, "model"),
    ("completions", {**OK_PROMPT, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    (
        "chat/completions",
        {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    ("chat/completions", {**OK_CHAT, "messages": [{"content": "x"}]}, 400, "messages"),
    ("chat/completions", {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    (
        "chat/completions",
        {**OK_CHAT, "response_format": {"type": "xml"}},
        400,
        "response_format.type",
    ),
    ("chat/completions", {**OK_CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("chat/completions", {**OK_CHAT, "model": "unknown"}, 404, "model"),
    # numbers past what the wire to the workers carries (uint32, int32, int64), and the model
    ("completions", {**OK_PROMPT, "max_tokens": 2**32}, 400, "max_tokens"),
    ("completions", {**OK_PROMPT, "min_tokens": 2**32}, 400, "min_tokens"),
    ("completions", {**OK_PROMPT, "top_k": 2**31}, 400, "top_k"),
    ("completions", {**OK_PROMPT, "seed": 2**63}, 400, "seed"),
    ("completions", {**OK_PROMPT, "prompt": [2**32]}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "prompt": [[5], [2**40]]}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "stop_token_ids": [2**32]}, 400, "stop_token_ids"),
    ("completions", {**OK_PROMPT, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("completions", {**OK_PROMPT, "n": 17}, 400, "n"),
    ("chat/completions", {**OK_CHAT, "max_tokens": 2**32}, 400, "max_tokens"),
    # fields that change the output and cannot be honoured: refused, never ignored
    (
        "chat/completions",
        {**OK_CHAT, "functions": [{"name": "f", "parameters": {}}]},
        400,
        "functions",
    ),
    ("chat/completions", {**OK_CHAT, "function_call": {"name": "f"}}, 400, "function_call"),
    ("chat/completions", {**OK_CHAT, "use_beam_search": True}, 400, "use_beam_search"),
    ("completions", {**OK_PROMPT, "use_beam_search": True}, 400, "use_beam_search"),
    ("chat/completions", {**OK_CHAT, "modalities": ["text", "audio"]}, 400, "modalities"),
    ("chat/completions", {**OK_CHAT, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ("completions", {**OK_PROMPT, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    # structured outputs and tools: what the grammar engine would not enforce, two grammars,
    # an unknown key, a grammar too large, a tool_choice without its tool, "auto" on a gateway
    # without a tool call parser
    (
        "chat/completions",
        {
            **OK_CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "code",
                    "schema": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 3},
                },
            },
        },
        400,
        "response_format.json_schema.schema.minLength",
    ),
    (
        "completions",
        {**OK_PROMPT, "structured_outputs": {"regex": "a+", "choices": ["a"]}},
        400,
        "structured_outputs.choices",
    ),
    (
        "chat/completions",
        {**OK_CHAT, "guided_json": {"type": "object"}, "guided_regex": "a+"},
        400,
        "guided_regex",
    ),
    (
        "completions",
        {**OK_PROMPT, "guided_choice": ["x" * 40000, "y" * 30000]},
        400,
        "guided_choice",
    ),
    ("chat/completions", {**OK_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    (
        "chat/completions",
        {
            **OK_CHAT,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice.function.name",
    ),
    ("chat/completions", {**OK_CHAT, "tools": [TOOL]}, 400, "tool_choice"),
    ("chat/completions", {**OK_CHAT, "reasoning_effort": "low"}, 400, "reasoning_effort"),
    (
        "chat/completions",
        {
            **OK_CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                    ],
                }
            ],
        },
        400,
        "messages.0.content.0",
    ),
    (
        "chat/completions",
        {
            **OK_CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {"type": "input_audio", "input_audio": {}},
                    ],
                }
            ],
        },
        400,
        "messages.0.content.1",
    ),
    # the bounds of the honoured vLLM fields
    ("completions", {**OK_PROMPT, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("completions", {**OK_PROMPT, "allowed_token_ids": [10**6]}, 400, "allowed_token_ids"),
    (
        "completions",
        {**OK_PROMPT, "allowed_token_ids": list(range(4097))},
        400,
        "allowed_token_ids",
    ),
    ("completions", {**OK_PROMPT, "bad_words": [" "]}, 400, "bad_words"),
    ("completions", {**OK_PROMPT, "bad_words": ["a"] * 65}, 400, "bad_words"),
    ("completions", {**OK_PROMPT, "bad_words": ["x" * 257]}, 400, "bad_words"),
    ("completions", {**OK_PROMPT, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("completions", {**OK_PROMPT, "truncate_prompt_tokens": 1025}, 400, "truncate_prompt_tokens"),
    (
        "chat/completions",
        {**OK_CHAT, "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    (
        "chat/completions",
        {**OK_CHAT, "continue_final_message": True, "add_generation_prompt": False},
        400,
        "continue_final_message",
    ),
    (
        "chat/completions",
        {**OK_CHAT, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs.messages",
    ),
    # counts past the gateway's input limits (settings.InputLimits)
    ("completions", {**OK_PROMPT, "prompt": [[5, 6]] * 65}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "prompt": ["hi"] * 65}, 400, "prompt"),
    ("completions", {**OK_PROMPT, "stop": ["a"] * 17}, 400, "stop"),
    ("completions", {**OK_PROMPT, "stop": ["x" * 257]}, 400, "stop"),
    ("completions", {**OK_PROMPT, "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    (
        "chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": "a"}] * 2049},
        400,
        "messages",
    ),
]


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url or "", timeout=30) as c:
        yield c


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), BAD_BODIES)
def test_bad_body_gets_openai_error(
    http: httpx.Client, endpoint: str, body: dict, status: int, param: str | None
) -> None:
    resp = http.post(f"/{endpoint}", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert not error["message"].startswith(("Value error", "Assertion")), error
    assert error["param"] == param, error


def test_malformed_json_and_wrong_content(http: httpx.Client) -> None:
    nan = b'{"model": "qwen3", "prompt": "hi", "temperature": NaN}'
    for content in (b"{not json", b"[1, 2]", b"null", b"", nan):
        resp = http.post("/completions", content=content,
                         headers={"content-type": "application/json"})  # fmt: skip
        assert resp.status_code == 400, (content, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = json.dumps({**OK_PROMPT, "prompt": "x" * (5 * 1024 * 1024)})
    resp = http.post("/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def _requests_counted(http: httpx.Client, outcome: str) -> float:
    text = httpx.get(str(http.base_url).removesuffix("/v1/") + "/metrics", timeout=5).text
    key = f'baton_gateway_requests_total{{endpoint="/v1/completions",outcome="{outcome}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def test_client_leaving_in_the_middle_of_its_body_is_no_error(http: httpx.Client) -> None:
    """Found by the soak: a client that closes its connection while the gateway reads its body
    ended in the unexpected-error handler (a 500 in the metrics, a traceback in the log)."""
    import socket
    import time

    host, port = http.base_url.host, http.base_url.port
    errors, gone = _requests_counted(http, "500"), _requests_counted(http, "disconnected")
    for _ in range(3):
        with socket.create_connection((host, port or 80), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                      b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                      b'{"model": "qw')  # fmt: skip
            time.sleep(0.2)
    deadline = time.monotonic() + 5
    while _requests_counted(http, "disconnected") < gone + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _requests_counted(http, "disconnected") == gone + 3
    assert _requests_counted(http, "500") == errors
    assert http.post("/completions", json=OK_PROMPT).status_code == 200


def test_limits_at_their_bound_are_served(http: httpx.Client) -> None:
    """The counts at the limit pass (the refusals above are about the limit, not the kind)."""
    body = {**OK_PROMPT, "prompt": [[5, 6]] * 64, "max_tokens": 1, "stop": ["a"] * 16}
    resp = http.post("/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 64
    words = {"bad_words": ["w" * 256] * 64, "allowed_token_ids": [5, 6] * 2048}
    assert http.post("/completions", json={**OK_PROMPT, **words}).status_code == 200


def test_openapi_describes_every_request_body(http: httpx.Client) -> None:
    schema = httpx.get(str(http.base_url).removesuffix("/v1/") + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):  # fmt: skip
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        fields = schema["components"]["schemas"][model]["properties"]
        assert {"model", "max_tokens", "stop", "temperature"} <= set(fields)
    max_tokens = schema["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]
    assert {"maximum": 2**32 - 1, "minimum": 0, "type": "integer"} in max_tokens["anyOf"]


def test_unknown_path_and_method_are_json_errors(http: httpx.Client) -> None:
    assert http.get("/nope").json()["error"]["message"]
    assert http.get("/completions").status_code == 405


def test_the_server_still_serves_after_bad_input(http: httpx.Client) -> None:
    resp = http.post("/completions", json=OK_PROMPT)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"]
    assert resp.headers["x-request-id"]
    assert http.post("/chat/completions", json=OK_CHAT).status_code == 200


@pytest.fixture(scope="module")
def keyed_gateway(cluster: Cluster, tiny_model: Path) -> Iterator[str]:
    """A second gateway on the same scheduler, with API keys."""
    group, port = service_group(tiny_model), free_port()
    try:
        group.spawn("gateway", [
            "gateway", "--model", str(tiny_model), "--port", str(port), "--scheduler",
            cluster.ready["scheduler"]["address"], "--api-key", "k1", "--api-key", "k2",
        ], ready=False)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        group.wait_http("gateway", f"{url}/ready", 60)
        yield url
    finally:
        group.stop()


@pytest.mark.parametrize(
    ("header", "status"),
    [(None, 401), ("Bearer wrong", 401), ("Basic k1", 401), ("Bearer k1", 200), ("Bearer k2", 200)],
)
def test_api_keys(keyed_gateway: str, header: str | None, status: int) -> None:
    headers = {"authorization": header} if header else {}
    resp = httpx.post(
        f"{keyed_gateway}/v1/completions", json=OK_PROMPT, headers=headers, timeout=30
    )
    assert resp.status_code == status
    if status == 401:
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_gateway}/health").status_code == 200  # health needs no key
