"""Logprobs through a running cluster describe exactly the text they come with: the tiny model,
sampling at temperature 1 from a byte-level vocabulary, splits characters across tokens and
emits stray bytes; the logprob tokens still join to the text, their offsets point into it,
and a stream carries the same entries as the whole response (a seed makes both the same)."""

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from baton.launcher import Cluster

MODEL = "qwen3"
SAMPLED = {"model": MODEL, "temperature": 1.0, "seed": 3, "max_tokens": 48, "ignore_eos": True}
PROMPT = "héllo wörld — 日本語 🎉"


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, timeout=60) as c:
        yield c


def streamed(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The choices of a streamed request's chunks."""
    chunks = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return [c["choices"][0] for c in chunks if c["choices"]]


def check_completion(text: str, lp: dict[str, Any]) -> None:
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token
    for token, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert top.get(token, value) == value  # the sampled token, where in the top-2, as shown


@pytest.mark.parametrize("stop", [None, "cut"])
def test_completion_logprob_tokens_are_the_text(http: httpx.Client, stop: str | None) -> None:
    body: dict[str, Any] = {**SAMPLED, "prompt": PROMPT, "logprobs": 2}
    whole = http.post("/completions", json=body).json()["choices"][0]
    if stop == "cut":  # again, cut by a stop string in the middle of that text
        text = whole["text"]
        body["stop"] = [text[len(text) // 2 : len(text) // 2 + 2]]
        whole = http.post("/completions", json=body).json()["choices"][0]
        assert whole["finish_reason"] == "stop" and len(whole["text"]) < len(text)
    lp = whole["logprobs"]
    check_completion(whole["text"], lp)
    assert "" in lp["tokens"]  # the model did split a character (or emit a stray byte)
    parts = streamed(http, "/completions", body)
    assert "".join(p["text"] for p in parts) == whole["text"]
    pieces = [p["logprobs"] for p in parts if p["logprobs"]]
    assert [t for p in pieces for t in p["tokens"]] == lp["tokens"]
    assert [o for p in pieces for o in p["text_offset"]] == lp["text_offset"]


def test_chat_logprob_tokens_are_the_content(http: httpx.Client) -> None:
    body = {**SAMPLED, "messages": [{"role": "user", "content": PROMPT}], "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    whole = http.post("/chat/completions", json=body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == whole["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] is not None for e in content)
    parts = streamed(http, "/chat/completions", body)
    assert [e for p in parts if p["logprobs"] for e in p["logprobs"]["content"]] == content
