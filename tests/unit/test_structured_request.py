"""Structured outputs at the gateway, without a cluster: every way a request asks for a grammar
becomes one ``StructuredOutput`` for the workers; what the engine's grammar compiler (xgrammar)
would not enforce is a 400 naming the keyword's path, and each such rule is held to xgrammar's
own behaviour (it lets a breaking value through); a resumed request replays its tokens."""

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from services.gateway import errors
from services.gateway.json_schema_check import SchemaRefused, check_schema
from services.gateway.limits import check_limits
from services.gateway.orchestrator import Job, generate_request
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.settings import InputLimits
from shared.protos.baton.v1 import common_pb2, worker_pb2

P = {"model": "m", "prompt": "hi"}
C = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def parse(schema: type[BaseModel], body: dict[str, Any]) -> Any:
    return schema.model_validate_json(json.dumps(body))


def refusal(schema: type[BaseModel], body: dict[str, Any]) -> errors.APIError:
    with pytest.raises(ValidationError) as e:
        parse(schema, body)
    return errors.from_validation(e.value.errors(include_url=False))


def spec(**kind: Any) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(**kind)


# (the request's fields, the spec the workers get, the field it came from)
FORMS: list[tuple[dict[str, Any], common_pb2.StructuredOutput, str]] = [
    ({"response_format": {"type": "json_object"}}, spec(json_object=True), "response_format"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
            }
        },
        spec(json_schema=COMPACT),
        "response_format.json_schema.schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA, "strict": False},
            }
        },
        spec(json_schema=COMPACT),
        "response_format.json_schema.schema",
    ),
    (
        {"structured_outputs": {"json": SCHEMA}},
        spec(json_schema=COMPACT),
        "structured_outputs.json",
    ),
    (
        {"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},
        spec(json_schema=COMPACT),
        "structured_outputs.json",
    ),
    ({"structured_outputs": {"regex": "[a-z]+"}}, spec(regex="[a-z]+"), "structured_outputs.regex"),
    (
        {"structured_outputs": {"choice": ["yes", "no"], "disable_fallback": True}},
        spec(choice=common_pb2.ChoiceList(choices=["yes", "no"])),
        "structured_outputs.choice",
    ),
    (
        {"structured_outputs": {"grammar": 'root ::= "a"', "json": None}},
        spec(grammar='root ::= "a"'),
        "structured_outputs.grammar",
    ),
    (
        {"structured_outputs": {"json_object": True, "regex": None}},
        spec(json_object=True),
        "structured_outputs.json_object",
    ),
    (
        {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
        spec(json_schema=COMPACT),
        "guided_json",
    ),
    ({"guided_json": json.dumps(SCHEMA)}, spec(json_schema=COMPACT), "guided_json"),
    ({"guided_regex": r"\d{3}"}, spec(regex=r"\d{3}"), "guided_regex"),
    (
        {"guided_choice": ["a", "b c"]},
        spec(choice=common_pb2.ChoiceList(choices=["a", "b c"])),
        "guided_choice",
    ),
    ({"guided_grammar": 'root ::= "x"'}, spec(grammar='root ::= "x"'), "guided_grammar"),
]


@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize(("fields", "expected", "param"), FORMS)
def test_every_form_becomes_one_spec(
    schema: type[BaseModel], fields: dict[str, Any], expected: Any, param: str
) -> None:
    body = parse(schema, {**(P if schema is CompletionRequest else C), **fields})
    assert body.grammar.spec == expected
    assert body.grammar.param == param


def test_no_grammar_asked() -> None:
    assert parse(CompletionRequest, {**P, "response_format": {"type": "text"}}).grammar is None
    assert parse(ChatCompletionRequest, C).grammar is None


# (endpoint's schema, body, the param the 400 names, words of its message)
REFUSED: list[tuple[type[BaseModel], dict[str, Any], str, str]] = [
    # two sources at once
    (
        ChatCompletionRequest,
        {
            **C,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            "guided_regex": "a+",
        },
        "guided_regex",
        "response_format and guided_regex",
    ),
    (
        CompletionRequest,
        {**P, "guided_json": SCHEMA, "guided_choice": ["a"]},
        "guided_choice",
        "guided_json and guided_choice",
    ),
    (
        CompletionRequest,
        {**P, "structured_outputs": {"regex": "a"}, "guided_regex": "b"},
        "guided_regex",
        "structured_outputs and guided_regex",
    ),
    # structured_outputs: one known kind
    (
        CompletionRequest,
        {**P, "structured_outputs": {"regex": "a", "backend": "outlines"}},
        "structured_outputs.backend",
        "unknown key",
    ),
    (
        CompletionRequest,
        {**P, "structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "exactly one",
    ),
    (CompletionRequest, {**P, "structured_outputs": {}}, "structured_outputs", "exactly one"),
    (
        CompletionRequest,
        {**P, "structured_outputs": {"json_object": "yes"}},
        "structured_outputs.json_object",
        "must be true",
    ),
    (
        CompletionRequest,
        {**P, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
        "not supported",
    ),
    (CompletionRequest, {**P, "structured_outputs": "a+"}, "structured_outputs", "an object"),
    (
        CompletionRequest,
        {**P, "guided_whitespace_pattern": r"\s*"},
        "guided_whitespace_pattern",
        "not supported",
    ),
    # each kind's own shape
    (
        CompletionRequest,
        {**P, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "needs json_schema.schema",
    ),
    (
        CompletionRequest,
        {**P, "response_format": {"type": "yaml"}},
        "response_format.type",
        "not supported",
    ),
    (CompletionRequest, {**P, "guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (CompletionRequest, {**P, "guided_json": [1]}, "guided_json", "object or a boolean"),
    (CompletionRequest, {**P, "guided_regex": 5}, "guided_regex", "non-empty string"),
    (CompletionRequest, {**P, "guided_regex": ""}, "guided_regex", "non-empty string"),
    (CompletionRequest, {**P, "guided_regex": "(?=a)a"}, "guided_regex", "lookaround"),
    (CompletionRequest, {**P, "guided_grammar": ["root"]}, "guided_grammar", "non-empty string"),
    (CompletionRequest, {**P, "guided_choice": []}, "guided_choice", "1 to 4096"),
    (CompletionRequest, {**P, "guided_choice": ["a", ""]}, "guided_choice.1", "non-empty"),
    (CompletionRequest, {**P, "guided_choice": ["a"] * 4097}, "guided_choice", "1 to 4096"),
    (CompletionRequest, {**P, "guided_choice": "a"}, "guided_choice", "1 to 4096"),
    # the issue's example: a length beside a pattern would be dropped
    (
        ChatCompletionRequest,
        {
            **C,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "schema": {
                        "type": "object",
                        "properties": {
                            "code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 3}
                        },
                    },
                },
            },
        },
        "response_format.json_schema.schema.properties.code.minLength",
        "minLength beside pattern",
    ),
    (
        CompletionRequest,
        {
            **P,
            "guided_json": {
                "$defs": {"t": {"type": "array", "uniqueItems": True}},
                "$ref": "#/$defs/t",
            },
        },
        "guided_json.$defs.t.uniqueItems",
        "uniqueItems",
    ),
]


@pytest.mark.parametrize(("schema", "body", "param", "words"), REFUSED)
def test_refusals_name_the_field(
    schema: type[BaseModel], body: dict[str, Any], param: str, words: str
) -> None:
    e = refusal(schema, body)
    assert (e.status, e.param) == (400, param), e.message
    assert words in e.message


# ---- the schema checker, held to xgrammar ----------------------------------------------------

# (schema, a value that breaks the keyword, the path refused): xgrammar lets the value through
NOT_ENFORCED: list[tuple[Any, Any, str]] = [
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "ab", "minLength"),
    ({"type": "string", "format": "email", "maxLength": 5}, "abc@example.com", "maxLength"),
    ({"type": "string", "format": "email", "pattern": "^a"}, "b@example.com", "pattern"),
    ({"type": "string", "format": "iri"}, "no pe", "format"),
    ({"type": "string", "pattern": "^(?=.*[A-Z]).*$"}, "abc", "pattern"),
    ({"type": "string", "contentEncoding": "base64"}, "!!!", "contentEncoding"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ({"type": "integer", "multipleOf": 5000}, 4, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, [2], "contains"),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1},
        "dependentRequired",
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["b"],
            "additionalProperties": True,
        },
        {"a": 1},
        "required.0",
    ),
    (
        {
            "type": "object",
            "properties": {"abc": {"type": "integer"}},
            "propertyNames": {"maxLength": 2},
        },
        {"abc": 1},
        "propertyNames",
    ),
    ({"type": "integer", "not": {"const": 1}}, 1, "not"),
    ({"type": "integer", "if": {"minimum": 1}, "then": {"maximum": 5}}, 7, "if"),
    ({"allOf": [{"type": "integer", "minimum": 1}, {"maximum": 5}]}, 7, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 5, "oneOf"),
    ({"type": "integer", "anyOf": [{"maximum": 5}, {"minimum": 10}]}, 7, "type"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5}, 1, "minimum"),
    ({"enum": [1, 2, 3], "minimum": 2}, 1, "minimum"),
    ({"type": "string", "enum": ["a", 1]}, 1, "enum.1"),
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 5}, 1, "minimum"),
    ({"$ref": "https://example.com/s.json"}, "s", "$ref"),
    ({"minimum": 5}, 1, "minimum"),
    ({"required": ["a"]}, {}, "required"),
    (
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^a$", "maxLength": 1},
                }
            },
        },
        {"a": ["a"]},
        "properties.a.items.maxLength",
    ),
]
# (schema, a value that breaks it): kept, and xgrammar refuses the value
ENFORCED: list[tuple[Any, Any]] = [
    ({"type": "string", "minLength": 3, "maxLength": 5}, "ab"),
    ({"type": "string", "pattern": "^[a-z]+$"}, "A"),
    ({"type": "string", "format": "date-time"}, "yesterday"),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 9}, 9),
    ({"type": "integer", "multipleOf": 3}, 4),
    ({"type": "number", "minimum": 0.5}, 0.25),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [1, 2]),
    (SCHEMA, {"a": "x"}),
    ({**SCHEMA, "additionalProperties": False}, {"a": 1, "b": 2}),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"x1": "s"}),
    (
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        {"a": 1, "b": 2},
    ),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, True),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True),
    ({"oneOf": [{"const": 1}, {"enum": [2, 3]}]}, 4),
    (
        {
            "$defs": {"A": {"type": "integer"}, "B": {"type": "string"}},
            "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
        },
        True,
    ),
    (
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ]
        },
        {"k": "c"},
    ),
    ({"allOf": [{"type": "integer", "minimum": 1}]}, 0),
    ({"type": "string", "enum": ["a", "b"]}, "c"),
    ({"type": "integer", "const": 3, "description": "three"}, 4),
    ({"definitions": {"x": {"type": "integer"}}, "$ref": "#/definitions/x", "title": "t"}, "s"),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
        },
        {"a": 1, "b": "x"},
    ),
    (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                    "required": ["c"],
                }
            },
            "$ref": "#/$defs/n",
        },
        {"c": [{"c": [1]}]},
    ),
    ({"type": ["integer", "null"], "minimum": 0}, -1),
    (
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "propertyNames": {"pattern": "^x"},
        },
        {"a": 1},
    ),
    ({"type": "string", "pattern": "(?i)^a$"}, "b"),
]


def _xgrammar_accepts(schema: Any, value: Any) -> bool:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema))  # as the engine compiles it
    return bool(_is_grammar_accept_string(grammar, json.dumps(value)))


@pytest.mark.parametrize(("schema", "value", "path"), NOT_ENFORCED)
def test_what_xgrammar_would_not_enforce_is_refused(schema: Any, value: Any, path: str) -> None:
    with pytest.raises(SchemaRefused) as e:
        check_schema(schema)
    assert ".".join(map(str, e.value.path)) == path, e.value.message
    assert _xgrammar_accepts(schema, value), "xgrammar enforces it now: the rule can go"


@pytest.mark.parametrize(("schema", "value"), ENFORCED)
def test_what_xgrammar_enforces_is_kept(schema: Any, value: Any) -> None:
    check_schema(schema)
    assert not _xgrammar_accepts(schema, value)


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ([], ()),
        ({"type": "object", "properties": {"a": 5}}, ("properties", "a")),
        ({"type": "strung"}, ("type",)),
        ({"$ref": "#/$defs/missing"}, ("$ref",)),
        ({"enum": []}, ("enum",)),
        ({"anyOf": []}, ("anyOf",)),
        ({"type": "array", "items": [{"type": "integer"}]}, ("items",)),
        ({"type": "integer", "minimum": 1.5}, ("minimum",)),
        ({"type": "integer", "maximum": 2**64}, ("maximum",)),
        ({"type": "object", "required": [1]}, ("required",)),
        ({"type": "string", "format": []}, ("format",)),  # (not a name: unhashable, was a 500)
        ({"type": "string", "format": {}}, ("format",)),
        ({"$defs": {"a": [{"type": "integer"}]}, "$ref": "#/$defs/a/\u00b2"}, ("$ref",)),
        ({"$defs": {"a": [{"type": "integer"}]}, "$ref": "#/$defs/a/" + "9" * 5000}, ("$ref",)),
    ],
)
def test_malformed_schemas_are_refused_where_they_are(schema: Any, path: tuple) -> None:
    with pytest.raises(SchemaRefused) as e:
        check_schema(schema)
    assert e.value.path == path


def test_a_value_nested_past_the_bound_is_refused_not_a_recursion_error() -> None:
    """Nesting inside a const (not a subschema) is bounded too: a schema sent as text is
    parsed by ``json.loads``, which takes ~1,000 levels where the request body's parser stops
    at 200, and the oneOf proof and ``serialize`` recurse into values."""
    deep = json.loads("[" * 600 + "]" * 600)
    body = {**P, "guided_json": json.dumps({"oneOf": [{"const": deep}, {"const": 1}]})}
    with pytest.raises(ValidationError, match="nests deeper than 128 JSON levels"):
        CompletionRequest.model_validate(body)
    check_schema({"const": json.loads("[" * 120 + "]" * 120)})  # within the bound


def _shared_enum_union(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """An array of oneOfs, each of two object definitions that differ only in the const of
    their 16th required property, the other 15 one large shared enum."""
    keys = [f"k{i}" for i in range(16)]

    def branch(tag: str) -> dict[str, Any]:
        props: dict[str, Any] = {k: {"$ref": "#/$defs/big"} for k in keys[:15]}
        return {"type": "object", "required": keys, "properties": {**props, "k15": {"const": tag}}}

    defs = {"big": {"enum": [f"v{i}" for i in range(5000)]}}
    defs.update({name: branch(name) for pair in pairs for name in pair})
    one = [{"oneOf": [{"$ref": f"#/$defs/{a}"}, {"$ref": f"#/$defs/{b}"}]} for a, b in pairs]
    return {"type": "array", "prefixItems": one, "$defs": defs}


def test_the_oneof_proofs_are_bounded() -> None:
    """Each oneOf is proved by comparing its branches' const/enum values. 450 oneOfs of the
    same two branches are proved once (each proof compares 150,000 values; proved every time,
    30 of them held the gateway's event loop 4.5 s); oneOfs of ever other branches are
    refused once their comparisons pass MAX_ONEOF_WORK."""
    check_schema(_shared_enum_union([("a", "b")] * 450))
    distinct = _shared_enum_union([(f"b{i}", f"b{i + 1}") for i in range(10)])
    with pytest.raises(SchemaRefused, match="too many or too large to prove disjoint"):
        check_schema(distinct)


def test_ref_chains_count_in_the_oneof_work() -> None:
    """Branches behind long $ref chains, each oneOf listing them in another order (so that no
    proof is reused): following the chains counts as work, and the schema is refused before
    it costs the gateway seconds (it was accepted, 11 s at 1,500 such oneOfs)."""
    hops = 30  # (with the branch's own $ref, 31: within MAX_REF_HOPS)
    tag = {"type": "object", "required": ["k"]}
    defs: dict[str, Any] = {f"t{i}": {**tag, "properties": {"k": {"const": i}}} for i in range(100)}
    for i in range(100):
        for h in range(hops):
            nxt = f"t{i}" if h == hops - 1 else f"c{i}_{h + 1}"
            defs[f"c{i}_{h}"] = {"$ref": f"#/$defs/{nxt}"}
    one = [{"oneOf": [{"$ref": f"#/$defs/c{(i + r) % 100}_0"} for i in range(100)]}
           for r in range(30)]  # fmt: skip
    with pytest.raises(SchemaRefused, match="too many or too large to prove disjoint"):
        check_schema({"type": "array", "prefixItems": one, "$defs": defs})
    check_schema({"type": "array", "prefixItems": one[:2], "$defs": defs})  # two are proved


def test_depth_is_bounded_and_each_ref_is_walked_once() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(60):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaRefused, match="deeper"):
        check_schema(deep)
    # a chain of definitions each referring to the next twice: 2^40 paths, 40 targets
    defs = {
        f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}] * 2}
        for i in range(40)
    }
    defs["d40"] = {"type": "integer"}
    check_schema({"$defs": defs, "$ref": "#/$defs/d0"})


# ---- limits -----------------------------------------------------------------------------------


def test_grammar_size_is_bounded_by_max_grammar_chars() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
    body = parse(CompletionRequest, {**P, "guided_json": big})
    assert body.grammar.chars > 65536
    with pytest.raises(errors.APIError) as e:
        check_limits(InputLimits(), body)
    assert (e.value.status, e.value.param) == (400, "guided_json")
    check_limits(InputLimits(max_grammar_chars=body.grammar.chars), body)
    choices = parse(CompletionRequest, {**P, "guided_choice": ["x" * 40000, "y" * 30000]})
    with pytest.raises(errors.APIError, match="70000 characters of grammar"):
        check_limits(InputLimits(), choices)


def test_tools_are_bounded_in_number_and_schema_size() -> None:
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    body = parse(ChatCompletionRequest, {**C, "tools": many, "tool_choice": "none"})
    with pytest.raises(errors.APIError) as e:
        check_limits(InputLimits(), body)
    assert (e.value.param, e.value.message) == ("tools", "129 tools: at most 128 are allowed")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": wide}}
    body = parse(ChatCompletionRequest, {**C, "tools": [tool], "tool_choice": "none"})
    with pytest.raises(errors.APIError, match="characters of tool parameter schemas"):
        check_limits(InputLimits(), body)


# ---- a resumed request replays what it generated ------------------------------------------------


def _job(params: common_pb2.SamplingParams) -> Job:
    return Job(
        request_id="r",
        model="m",
        prompt_ids=[1, 2, 3],
        params=params,
        n=1,
        stop=[],
        include_stop=False,
        skip_special_tokens=True,
        cache_salt=None,
        deadline=0.0,
        block_size=16,
    )


def test_resume_replays_generated_tokens_but_the_decode_leg_does_not() -> None:
    grammar = parse(CompletionRequest, {**P, "guided_regex": "[a-z]+"}).grammar.spec
    params = common_pb2.SamplingParams(max_tokens=10, structured_output=grammar)
    resumed = generate_request(_job(params), 0, params, [7, 8])
    assert list(resumed.prompt_token_ids) == [1, 2, 3, 7, 8]
    assert resumed.params.structured_output.replay_tokens == 2
    assert resumed.params.structured_output.regex == "[a-z]+"
    assert resumed.params.max_tokens == 8
    handoff = worker_pb2.PrefillResponse(first_token_id=7)
    decode = generate_request(_job(params), 0, params, [7], handoff)
    assert decode.params.structured_output.replay_tokens == 0
    plain = common_pb2.SamplingParams(max_tokens=10)
    assert not generate_request(_job(plain), 0, plain, [7]).params.HasField("structured_output")
