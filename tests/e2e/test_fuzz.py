"""A bounded schemathesis run against the gateway of a running cluster: request bodies drawn
from its own /openapi.json — valid ones (positive) and ones that break the schema (negative) —
must never get a 5xx. The model is set to the served one in most cases so the draws reach past
the model check; output lengths are capped (and set where a draw leaves them out) so a draw's
work stays small: the run is bounded in examples, each call in time. The draws are derandomized
(the same every run: a regression check that cannot flake); widen EXAMPLES, or drop
``derandomize``, to explore further by hand."""

from collections.abc import Callable
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.launcher import Cluster

MODEL = "qwen3"
EXAMPLES = 50  # per operation and mode
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}


def bounded(body: Any, keep_model: bool) -> Any:
    if isinstance(body, dict):
        if not keep_model:
            body["model"] = MODEL
        for key, cap in CAPS.items():
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = min(body[key], cap)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = CAPS["max_tokens"]  # (chat's default: the whole context)
    return body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE])  # fmt: skip
def test_no_body_gets_a_server_error(
    cluster: Cluster, path: str, mode: schemathesis.GenerationMode
) -> None:
    base = (cluster.url or "").removesuffix("/v1")
    operation = schemathesis.openapi.from_url(f"{base}/openapi.json")[path]["POST"]
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode), keep_model=st.booleans())
    def check(case: Any, keep_model: bool) -> None:
        case.body = bounded(case.body, keep_model and mode == schemathesis.GenerationMode.NEGATIVE)
        response = case.call(base_url=base, session=session, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
        if response.status_code != 200:  # (a 200 may be an SSE stream)
            assert "error" in response.json()  # OpenAI's error JSON

    run: Callable[[], None] = check
    # one session, closed at the end: a session per call left sockets for the garbage
    # collector, whose ResourceWarning (an error here) could surface in any later test
    with requests.Session() as session:
        run()
    assert sum(seen.values()) >= EXAMPLES // 2  # it really called the server
    if mode == schemathesis.GenerationMode.POSITIVE:
        assert seen.get(200, 0) > 0  # and some draws were served, not only refused
