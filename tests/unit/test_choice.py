"""One choice's state in the gateway: an engine's error kind (the protos' ErrorCode) becomes
the client's HTTP status, and token deltas become text."""

from pathlib import Path

import pytest

from services.gateway import errors
from services.gateway.choice import ChoiceState
from shared.protos.baton.v1 import worker_pb2
from shared.text.detokenizer import IncrementalDetokenizer
from shared.text.tokenizer import TextTokenizer


@pytest.fixture
def state(tiny_model: Path) -> ChoiceState:
    tok = TextTokenizer(tiny_model)
    return ChoiceState(0, IncrementalDetokenizer(tok.tokenizer, tok.encode("Hi"), ["xyz"]), None)


@pytest.mark.parametrize(
    ("code", "status", "body_code"),
    [
        (worker_pb2.ERROR_CODE_INVALID_REQUEST, 400, None),
        (worker_pb2.ERROR_CODE_KV_TRANSFER_FAILED, 502, "kv_transfer_failed"),
        (worker_pb2.ERROR_CODE_OVERLOADED, 503, "overloaded"),
        (worker_pb2.ERROR_CODE_UNSPECIFIED, 500, "engine_error"),
    ],
)
def test_engine_error_kinds_map_to_http(
    state: ChoiceState, code: worker_pb2.ErrorCode, status: int, body_code: str | None
) -> None:
    with pytest.raises(errors.APIError) as e:
        state.apply(worker_pb2.GenerateResponse(error="boom", error_code=code))
    assert e.value.status == status and e.value.code == body_code and e.value.message == "boom"


def test_deltas_accumulate_tokens_and_text(state: ChoiceState, tiny_model: Path) -> None:
    ids = TextTokenizer(tiny_model).encode(" hello world")
    resp = worker_pb2.GenerateResponse(
        deltas=[worker_pb2.CompletionDelta(token_ids=ids)], num_cached_tokens=3
    )
    [delta] = state.apply(resp)
    assert delta.token_ids == ids and state.generated == ids
    assert delta.num_cached_tokens == 3 and delta.finish_reason is None
