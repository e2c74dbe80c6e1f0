"""The engine core's grammar bookkeeping (engine/structured/manager.py) on the tiny model's
tokenizer: compilation shared and cleaned of xgrammar's source locations, matchers that
replay the tokens a request already has, the bitmask of a step's rows, and JSON strings that
keep JSON's rule for control characters."""

import json
import time
from pathlib import Path

import msgspec
import pytest
import torch

from services.worker.engine.params import StructuredOutputParams
from services.worker.engine.structured.bitmask import BitmaskWire, apply_bitmask
from services.worker.engine.structured.manager import StructuredOutputManager, choice_grammar
from shared.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def manager(tiny_model: Path) -> StructuredOutputManager:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return StructuredOutputManager(str(tiny_model), vocab, (0,), 4, 2, 30.0, 1 << 24)


def compiled(manager: StructuredOutputManager, prompt: list[int] | None = None, **spec: object):  # type: ignore[no-untyped-def]
    grammar = manager.request_grammar(StructuredOutputParams(**spec), prompt or [1])  # type: ignore[arg-type]
    grammar.future.result(timeout=30)
    return grammar


def test_one_compilation_per_grammar(manager: StructuredOutputManager) -> None:
    a = manager.request_grammar(StructuredOutputParams(regex="[ab]+c"), [1])
    b = manager.request_grammar(StructuredOutputParams(regex="[ab]+c", replay_tokens=1), [1])
    assert a.future is b.future
    assert (
        manager.request_grammar(StructuredOutputParams(regex="[ab]+d"), [1]).future is not a.future
    )


def test_a_compile_error_says_what_without_where(manager: StructuredOutputManager) -> None:
    grammar = manager.request_grammar(StructuredOutputParams(regex="(ab"), [1])
    with pytest.raises(ValueError) as e:
        grammar.future.result(timeout=30)
    assert str(e.value).startswith("the regex grammar does not compile: Regex parsing error")
    assert "/project" not in str(e.value) and ".cc" not in str(e.value)
    assert not grammar.ready([]) and grammar.error == str(e.value)


def test_a_grammar_past_its_bound_is_the_clients_fault_only_if_its_compile_ran() -> None:
    """Past the compile bound: a compilation that has itself run for the bound is the
    grammar's fault (400); one that never started, queued behind other grammars, the
    engine's (503: retry); one that started late gets the bound from its start."""
    from services.worker.engine.messages import ErrorCode
    from services.worker.engine.structured.manager import Compilation, RequestGrammar

    now = time.monotonic()
    cases = [(None, ErrorCode.OVERLOADED, "did not start within 30 s"),
             (now - 31.0, ErrorCode.INVALID_REQUEST, "took longer than 30 s")]  # fmt: skip
    for began, code, words in cases:
        grammar = RequestGrammar(Compilation(began=began), [], now - 1.0, 30.0)
        assert not grammar.ready([])
        assert grammar.error_code == code and words in (grammar.error or "")
    late = RequestGrammar(Compilation(began=now - 2.0), [], now - 1.0, 30.0)  # queued 29 s
    assert not late.ready([]) and late.error is None  # still waiting: it has run 2 s
    within = RequestGrammar(Compilation(), [], now + 60.0, 30.0)
    assert not within.ready([]) and within.error is None


def test_choices_with_quotes_and_newlines(
    manager: StructuredOutputManager, tiny_model: Path
) -> None:
    choices = ['say "hi"', "a\\b", "two\nlines", "ünï"]
    assert choice_grammar(choices).startswith('root ::= "say \\"hi\\"" | ')
    tok = TextTokenizer(tiny_model)
    for choice in choices:
        grammar = compiled(manager, choice=choices)
        assert grammar.ready([])
        assert all(grammar.accept(t) for t in tok.encode(choice, add_special_tokens=False))
        assert grammar.accept(0) and grammar.terminated  # then the stop token ends it


def test_replay_then_the_mask_allows_only_what_follows(
    manager: StructuredOutputManager, tiny_model: Path
) -> None:
    tok = TextTokenizer(tiny_model)
    done = tok.encode("abc", add_special_tokens=False)
    prompt = [5, 6, *done[:1]]  # the prompt ends with a token generated earlier
    grammar = compiled(manager, prompt, regex="abc(d|e)", replay_tokens=1)
    assert grammar.ready(done[1:])  # a decode leg's tokens: the handed-over first ones
    bits = manager.fill(["x", "gone"], [grammar, None]).bits
    allowed = {t for t in range(manager.vocab_size) if bits[0, t // 32] >> (t % 32) & 1}
    assert allowed and all(tok.decode([t]) in ("d", "e") for t in allowed)
    assert (bits[1] == -1).all()  # a request that ended meanwhile: nothing masked
    logits = torch.zeros(2, manager.vocab_size)
    wire = msgspec.msgpack.encode(manager.fill(["x", "gone"], [grammar, None]).to_wire())
    mask = msgspec.msgpack.decode(wire, type=BitmaskWire).to_bitmask()  # as a rank gets it
    apply_bitmask(logits, mask, [1, 0], manager.vocab_size)  # rows placed where they sample
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == allowed
    assert torch.isfinite(logits[0]).all()


def test_replayed_tokens_off_the_grammar_fail(manager: StructuredOutputManager) -> None:
    grammar = compiled(manager, [7, 7, 7], regex="abc", replay_tokens=2)
    grammar.future.result()
    assert not grammar.ready([]) and "does not follow the grammar" in (grammar.error or "")
    with pytest.raises(ValueError, match="longer than the prompt"):
        manager.request_grammar(StructuredOutputParams(regex="a", replay_tokens=3), [1, 2])


def test_bounded_json_strings_refuse_raw_control_characters(
    manager: StructuredOutputManager,
) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}}
    grammar = compiled(manager, json=json.dumps(schema))
    assert grammar.ready([])
    matcher = grammar.matcher
    assert matcher.accept_string('{"s": "a')
    assert not matcher.accept_string("\x03")  # JSON: control characters only escaped
    assert matcher.accept_string('b"}')


def test_a_padded_vocabulary_masks_the_padding(tiny_model: Path) -> None:
    """A model whose vocabulary is wider than its tokenizer's (padded, as Qwen's and Llama's
    are): the compiler knows the tokenizer's ids only (xgrammar takes the padding for special
    tokens, which makes every accepted token cost ~16 times as much), and the padding ids are
    never allowed."""
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    padded = StructuredOutputManager(str(tiny_model), vocab + 100, (0,), 4, 2, 30.0, 1 << 24)
    grammar = compiled(padded, regex="[a-z]+")
    assert grammar.ready([])
    bits = padded.fill(["x"], [grammar]).bits
    assert bits.shape == (1, -(-(vocab + 100) // 32))
    allowed = {t for t in range(vocab + 100) if bits[0, t // 32] >> (t % 32) & 1}
    assert allowed and max(allowed) < vocab
    padded.shutdown()


def test_a_structural_tag_leaves_text_free_and_constrains_the_calls(
    manager: StructuredOutputManager,
) -> None:
    """What the gateway sends under tool_choice "auto" with a strict tool (tools.py)."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"],
        "tags": [{"begin": '<tool_call>\n{"name": "f", "arguments": ',
                  "content": {"type": "json_schema", "json_schema": {
                      "type": "object", "properties": {"n": {"type": "integer"}},
                      "required": ["n"], "additionalProperties": False}},
                  "end": "}\n</tool_call>"}],
    }}  # fmt: skip
    grammar = compiled(manager, structural_tag=json.dumps(tag))
    assert grammar.ready([])
    assert grammar.matcher.accept_string('Sure. <tool_call>\n{"name": "f", "arguments": {"n": 3')
    assert not grammar.matcher.accept_string(".5")  # an integer
    assert grammar.matcher.accept_string("}}\n</tool_call> done")
    bad = manager.request_grammar(StructuredOutputParams(structural_tag="{}"), [1])
    with pytest.raises(ValueError, match="the structural tag grammar does not compile"):
        bad.future.result(timeout=30)
