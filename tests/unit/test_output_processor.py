"""OutputProcessor with hand-made core outputs: stop strings, output kinds, n folding, errors."""

from pathlib import Path

import pytest

from services.worker.engine.messages import EngineCoreOutput, EngineCoreRequest
from services.worker.engine.output_processor import OutputProcessor, fan_out
from services.worker.engine.params import RequestOutputKind, SamplingParams
from services.worker.engine.request import FinishReason
from services.worker.engine.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from shared.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module", params=["transformers", "text"])
def tokenizer(tiny_model: Path, request: pytest.FixtureRequest) -> Tokenizer:
    """Both kinds the front ends use: LLM's (transformers) and the worker service's."""
    if request.param == "text":
        return TextTokenizer(tiny_model)
    return HFTokenizer(load_tokenizer(str(tiny_model)))


def start(
    tok: Tokenizer, params: SamplingParams, rid: str = "r"
) -> tuple[OutputProcessor, list[str]]:
    proc = OutputProcessor(tok)
    request = EngineCoreRequest(rid, tok.encode("prompt"), params, 0.0)
    children = fan_out(request)
    proc.add_request("prompt", request, children)
    return proc, [c.request_id for c in children]


def test_stop_string_wins_over_a_simultaneous_length_finish(
    tokenizer: Tokenizer,
) -> None:
    proc, [cid] = start(tokenizer, SamplingParams(stop=["STOP"]))
    ids = tokenizer.encode("alpha STOP beta")
    res = proc.process_outputs([EngineCoreOutput(cid, ids, finish_reason=FinishReason.LENGTH)])
    [c] = res.request_outputs[0].outputs
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", "STOP", "alpha ")
    assert res.reqs_to_abort == []  # the core already finished it
    assert not proc.has_unfinished()


def test_stop_string_mid_stream_asks_the_core_to_abort(tokenizer: Tokenizer) -> None:
    proc, [cid] = start(tokenizer, SamplingParams(stop=["STOP"]))
    res = proc.process_outputs([EngineCoreOutput(cid, tokenizer.encode("x STOP"))])
    assert res.reqs_to_abort == [cid] and res.request_outputs[0].finished


@pytest.mark.parametrize(
    ("kind", "texts"),
    [
        (RequestOutputKind.CUMULATIVE, ["one", "one two", "one two three"]),
        (RequestOutputKind.DELTA, ["one", " two", " three"]),
        (RequestOutputKind.FINAL_ONLY, ["one two three"]),
    ],
)
def test_output_kinds(tokenizer: Tokenizer, kind: RequestOutputKind, texts: list[str]) -> None:
    proc, [cid] = start(tokenizer, SamplingParams(output_kind=kind))
    seen = []
    pieces = ["one", " two", " three"]
    for i, piece in enumerate(pieces):
        finish = FinishReason.LENGTH if i == len(pieces) - 1 else None
        out = EngineCoreOutput(cid, tokenizer.encode(piece), finish_reason=finish)
        seen += [r.outputs[0].text for r in proc.process_outputs([out]).request_outputs]
    assert seen == texts


def test_n_samples_fold_into_one_output(tokenizer: Tokenizer) -> None:
    proc, ids = start(tokenizer, SamplingParams(n=2, seed=10))
    assert ids == ["0_r", "1_r"]
    first = proc.process_outputs([EngineCoreOutput("1_r", [5], finish_reason=FinishReason.STOP)])
    assert not first.request_outputs[0].finished
    last = proc.process_outputs(
        [EngineCoreOutput("0_r", [6, 7], finish_reason=FinishReason.LENGTH)]
    )
    out = last.request_outputs[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [[6, 7], [5]]


def test_children_get_distinct_reproducible_seeds() -> None:
    request = EngineCoreRequest("r", [1], SamplingParams(n=3, seed=100), 0.0)
    assert [c.sampling_params.seed for c in fan_out(request)] == [100, 101, 102]
    unseeded = EngineCoreRequest("u", [1], SamplingParams(n=2), 0.0)
    assert [c.sampling_params.seed for c in fan_out(unseeded)] == [None, None]


def test_error_output_carries_the_message(tokenizer: Tokenizer) -> None:
    proc, [cid] = start(tokenizer, SamplingParams())
    res = proc.process_outputs(
        [EngineCoreOutput(cid, [], finish_reason=FinishReason.ERROR, error="boom")]
    )
    out = res.request_outputs[0]
    assert out.finished and out.error == "boom" and out.outputs[0].finish_reason == "error"


def test_outputs_for_unknown_or_aborted_requests_are_ignored(
    tokenizer: Tokenizer,
) -> None:
    proc, [cid] = start(tokenizer, SamplingParams())
    assert proc.abort("r") == [cid]
    assert proc.process_outputs([EngineCoreOutput(cid, [5])]).request_outputs == []
