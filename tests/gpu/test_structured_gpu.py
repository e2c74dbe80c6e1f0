"""Structured outputs on the GPU (skipped without CUDA; run on the GPU machine): the bitmask
applied by xgrammar's Triton kernel to logits from CUDA-graph decode steps, filled while the
device runs the forward pass (async scheduling, the GPU default). Every output follows its
grammar, and the tokens equal an eager one-step-at-a-time engine's on the same device; the
trained model's JSON validates against a nested schema with $ref, enums and bounds."""

import json
from pathlib import Path

import jsonschema
import pytest

from baton import LLM, SamplingParams
from services.worker.engine.params import StructuredOutputParams
from tests.integration.test_structured_outputs import PROMPTS, SPECS, follows

pytestmark = pytest.mark.gpu

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"enum": ["Paris", "London", "Tokyo", "New York"]},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 3},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
    "$defs": {
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string"}},
            "required": ["kind", "name"],
        }
    },
}


def _run(path: Path, **kw: object) -> list[tuple[str, list[int], str]]:
    kinds = sorted(SPECS) * 2
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=200,
                       structured_outputs=SPECS[k])
        for i, k in enumerate(kinds)
    ] + [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)]  # fmt: skip
    with LLM(
        model=str(path),
        show_progress=False,
        max_model_len=512,
        grammar_max_whitespace=0,
        dtype="float32",
        **kw,
    ) as llm:  # type: ignore[arg-type]
        outs = llm.generate((PROMPTS * 4)[: len(params)], params)
    return [(k, list(o.outputs[0].token_ids), o.outputs[0].text)
            for k, o in zip([*kinds, None], outs, strict=True)]  # type: ignore[list-item]  # fmt: skip


def test_graphs_and_async_scheduling_follow_every_grammar(tiny_model: Path) -> None:
    fast = _run(tiny_model)  # CUDA graphs, async scheduling
    plain = _run(tiny_model, enforce_eager=True, async_scheduling=False)
    assert [t for _, t, _ in fast] == [t for _, t, _ in plain]
    for kind, _, text in fast[:-1]:
        assert follows(kind, text), (kind, text)


def test_the_trained_models_json_validates(smollm2_gguf: Path) -> None:
    chat = [{"role": "user", "content": "Describe a person who has two pets, as JSON."}]
    spec = StructuredOutputParams(json=json.dumps(PERSON))
    with LLM(model=str(smollm2_gguf), show_progress=False, max_model_len=1024,
             dtype="bfloat16") as llm:  # fmt: skip
        outs = llm.chat([chat] * 4, [
            SamplingParams(temperature=t, seed=s, max_tokens=300, structured_outputs=spec)
            for t, s in ((0, 0), (0.7, 1), (0.7, 2), (1.0, 3))
        ])  # fmt: skip
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
