"""Grammar-constrained decoding (structured outputs) through the offline ``LLM`` on the tiny
random model, whose unconstrained text is noise: whatever it samples, every output must follow
its grammar (a JSON schema, a regex, a choice, an EBNF grammar), and the grammar must change
nothing else — async scheduling, preemption, chunked prefill, ``n > 1`` and a resumed request
give the outputs of the plain engine. The P/D hand-off is in test_pd_transfer.py; the
trained model through the API in tests/e2e/test_structured_api.py."""

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from baton import LLM, SamplingParams
from services.worker.engine.messages import ErrorCode
from services.worker.engine.params import StructuredOutputParams
from shared.text.tokenizer import TextTokenizer

PROMPTS = ["The quick brown fox", "def f(x):\n    return", "This module provides"]
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)"
CHOICES = ["red", "green", "blue", 'cyan "quoted"', "two\nlines"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 99},
        "tag": {"enum": ["a", "b", "c"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/word"}, "maxItems": 3},
        "opt": {"type": "string", "maxLength": 5},
    },
    "required": ["ok", "n", "tag", "items"],
    "additionalProperties": False,
    "$defs": {"word": {"type": "string", "maxLength": 4}},
}
GRAMMAR = 'root ::= "(" num ("," num)? ("," num)? ")"\nnum ::= [0-9] [0-9]?'
SPECS = {
    "json": StructuredOutputParams(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputParams(regex=REGEX),
    "choice": StructuredOutputParams(choice=CHOICES),
    "grammar": StructuredOutputParams(grammar=GRAMMAR),
}
# compact JSON: the random model would otherwise fill every gap with whitespace (the trained
# model's pretty-printed JSON is in test_structured_smollm2.py)
KW = {"show_progress": False, "max_model_len": 512, "grammar_max_whitespace": 0}


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\(\d\d?(,\d\d?){0,2}\)", text) is not None


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Iterator[LLM]:
    engine = LLM(model=str(tiny_model), **KW)  # type: ignore[arg-type]
    yield engine
    engine.shutdown()


def params(kind: str, **extra: object) -> SamplingParams:
    base: dict[str, object] = {"temperature": 0, "max_tokens": 200}
    return SamplingParams(**{**base, **extra}, structured_outputs=SPECS[kind])  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_output_follows_its_grammar(llm: LLM, kind: str, sampling: str) -> None:
    extra = {"temperature": 1.0, "seed": 7} if sampling == "seeded" else {}
    outs = llm.generate(PROMPTS, params(kind, **extra))
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        assert follows(kind, c.text), c.text
    if kind == "json" and sampling == "seeded":  # really sampled: not one fixed answer
        assert len({o.outputs[0].text for o in outs}) > 1


def test_n_choices_each_follow_it(llm: LLM) -> None:
    [out] = llm.generate(PROMPTS[0], params("regex", n=4, temperature=1.0, seed=3))
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(REGEX, t) for t in texts) and len(set(texts)) > 1


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    kinds = ("json", "regex", "choice")
    mixed = llm.generate(PROMPTS * 2, [free] * 3 + [params(k) for k in kinds])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert all(follows(k, o.outputs[0].text) for k, o in zip(kinds, mixed[3:], strict=True))


def test_logprobs_are_of_the_constrained_distribution(llm: LLM) -> None:
    choices = ["red", "green"]
    p = SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                       structured_outputs=StructuredOutputParams(choice=choices))  # fmt: skip
    [out] = llm.generate(PROMPTS[0], p)
    first = out.outputs[0].logprobs[0]  # type: ignore[index]
    allowed = [lp for lp in first.values() if lp.logprob > -math.inf]
    assert allowed and sum(math.exp(lp.logprob) for lp in allowed) == pytest.approx(1, abs=1e-4)
    assert all(any(c.startswith(lp.decoded_token or "") for c in choices) for lp in allowed)


def test_max_tokens_cuts_a_grammar_short(llm: LLM) -> None:
    [out] = llm.generate(PROMPTS[0], params("json", max_tokens=3))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_a_grammar_that_does_not_compile_is_an_invalid_request(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputParams(regex="(ab"))
    good = params("regex")
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [bad, good])
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].error_code == ErrorCode.INVALID_REQUEST
    assert "regex" in (outs[0].error or "") and "parenthesis" in (outs[0].error or "")
    assert follows("regex", outs[1].outputs[0].text)  # the other request is not affected


def test_a_resumed_request_replays_its_tokens(llm: LLM, tiny_model: Path) -> None:
    """What a worker that takes over a request does: the prompt plus the tokens generated so
    far, ``replay_tokens`` of them; the rest equals the uninterrupted output."""
    ids = TextTokenizer(tiny_model).encode(PROMPTS[1])
    for kind in ("json", "grammar"):
        [whole] = llm.generate([{"prompt_token_ids": ids}], params(kind))
        tokens = list(whole.outputs[0].token_ids)
        k = len(tokens) // 2
        spec = StructuredOutputParams(**{**_fields(SPECS[kind]), "replay_tokens": k})
        resumed = SamplingParams(temperature=0, max_tokens=200 - k, structured_outputs=spec)
        [rest] = llm.generate([{"prompt_token_ids": ids + tokens[:k]}], resumed)
        assert list(rest.outputs[0].token_ids) == tokens[k:]


def test_replayed_tokens_that_break_the_grammar_are_refused(llm: LLM, tiny_model: Path) -> None:
    ids = TextTokenizer(tiny_model).encode("some text that is not an email")
    spec = StructuredOutputParams(regex=REGEX, replay_tokens=3)
    [out] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(structured_outputs=spec))
    assert out.outputs[0].finish_reason == "error" and "does not follow" in (out.error or "")


def test_a_grammar_past_its_compile_bound_fails(tiny_model: Path) -> None:
    """At a bound of a microsecond the compilation may not even have started when the bound
    passes (then the engine's fault, 503; test_structured_manager tells the two apart)."""
    with LLM(model=str(tiny_model), grammar_compile_timeout_s=1e-6, **KW) as engine:  # type: ignore[arg-type]
        [out] = engine.generate(PROMPTS[0], params("json"))
    assert out.outputs[0].finish_reason == "error"
    assert "took longer than 1e-06 s" in (out.error or "") or "did not start within 1e-06 s" in (
        out.error or "")  # fmt: skip


def test_async_scheduling_preemption_and_chunks_change_nothing(tiny_model: Path) -> None:
    """Constrained and free requests together on a cache too small for all of them (they are
    preempted and recomputed) and a small token budget (prompts in chunks), one step ahead
    (async scheduling) or not: the same tokens as a roomy one-step-at-a-time engine."""
    prompts = [p * (i + 1) for i, p in enumerate(PROMPTS * 3)]
    kinds = ["json", "regex", "choice", "grammar", "json", None, "json", None, None]
    ps = [params(k, seed=i, temperature=0.7) if k else
          SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
          for i, k in enumerate(kinds)]  # fmt: skip

    def run(**kw: object) -> tuple[list[list[int]], int]:
        with LLM(model=str(tiny_model), **{**KW, "max_model_len": 256}, **kw) as engine:  # type: ignore[arg-type]
            outs = engine.generate(prompts, ps)
            return [list(o.outputs[0].token_ids) for o in outs], engine.get_stats().num_preemptions

    want, _ = run()
    tight = {"num_kv_blocks": 16, "max_num_batched_tokens": 32, "max_num_seqs": 8}
    for async_scheduling in (False, True):
        got, preemptions = run(async_scheduling=async_scheduling, **tight)
        assert got == want
        assert preemptions > 0


def _fields(spec: StructuredOutputParams) -> dict[str, object]:
    return {k: getattr(spec, k) for k in spec.__struct_fields__ if k != "replay_tokens"}


def test_the_compiler_can_be_ready_before_the_first_grammar(tiny_model: Path) -> None:
    """``grammar_warmup`` (``baton worker``'s default): the vocabulary is read at start, in the
    background; without it, an engine that never sees a grammar never reads it."""
    with LLM(model=str(tiny_model), grammar_warmup=True, **KW) as warm:  # type: ignore[arg-type]
        manager = warm.client.core.structured  # type: ignore[attr-defined]
        assert manager is not None and manager._compiler.result(timeout=60) is not None
    with LLM(model=str(tiny_model), **KW) as cold:  # type: ignore[arg-type]
        cold.generate(PROMPTS[0], SamplingParams(max_tokens=2))
        assert cold.client.core.structured is None  # type: ignore[attr-defined]
