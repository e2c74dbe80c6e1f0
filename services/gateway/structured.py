"""The grammar one request asks for, as the workers' ``common_pb2.StructuredOutput``: the engine
compiles it (xgrammar) and masks every token it does not allow.

    response_format      OpenAI's {"type": "json_object"} or {"type": "json_schema",
                         "json_schema": {"name", "schema", "strict"}} ("text": none)
    structured_outputs   vLLM's: exactly one of json (a schema, or its JSON text), regex,
                         choice, grammar (EBNF), json_object: true
    guided_json, guided_regex, guided_choice, guided_grammar     vLLM's older fields, the same
    tool_choice          chat: "required" or a named function (tools.py builds the schema)

At most one source per request (two are a 400 naming both). Each is checked here, before any
work: a schema by ``json_schema_check`` (what the engine would not enforce is a 400 naming the
keyword's path), a regex by its lint, choices are 1 to ``MAX_CHOICES`` non-empty strings, a
grammar a non-empty string; its size is bounded by the gateway's ``max_grammar_chars``
(limits.py). A grammar that still fails to compile comes back from the worker as a 400.
A ``strict: false`` JSON schema is enforced all the same, as vLLM does.
"""

import json
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic_core import PydanticCustomError

from services.gateway.errors import refuse
from services.gateway.json_schema_check import SchemaRefused, check_schema, serialize
from services.gateway.regex_check import regex_problem
from shared.protos.baton.v1 import common_pb2

MAX_CHOICES = 4096  # strings of a choice constraint (the workers' own bound)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip
KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' keys
# structured_outputs' other keys: ignored (one backend, nothing to fall back from), or refused
# unless at their default (Baton's grammar engine picks its whitespace and follows the schema)
IGNORED_KEYS = frozenset({"disable_fallback"})
DEFAULT_ONLY = {"disable_any_whitespace": False, "disable_additional_properties": False,
                "whitespace_pattern": None, "structural_tag": None}  # fmt: skip


@dataclass(frozen=True)
class Grammar:
    spec: common_pb2.StructuredOutput
    param: str  # the field that asked for it (``response_format.json_schema.schema``)
    chars: int  # its size: the schema's JSON text, the regex, the grammar, all the choices

    @property
    def source(self) -> str:
        """The request's top-level field that asked for it."""
        return self.param.split(".")[0]


class JsonSchemaFormat(Protocol):
    @property
    def schema_(self) -> Any: ...


class ResponseFormat(Protocol):
    @property
    def type(self) -> str: ...
    @property
    def json_schema(self) -> JsonSchemaFormat | None: ...


class GrammarFields(Protocol):
    """What of a request asks for a grammar (schemas._SamplingFields)."""

    @property
    def response_format(self) -> ResponseFormat | None: ...
    @property
    def structured_outputs(self) -> dict[str, Any] | None: ...


def resolve(body: GrammarFields) -> Grammar | None:
    """The request's one grammar, checked (raises ``refuse``: call it in a validator)."""
    return only(*_sources(body))


def only(*grammars: Grammar | None) -> Grammar | None:
    """The one grammar among ``grammars``; two are a 400 naming both fields."""
    found = [g for g in grammars if g is not None]
    if len(found) > 1:
        first, second = found[0].source, found[1].source
        raise refuse(second, f"{first} and {second} both constrain the output: send only one")
    return found[0] if found else None


def _sources(body: GrammarFields) -> list[Grammar | None]:
    out = [_response_format(body.response_format), _structured_outputs(body.structured_outputs)]
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            out.append(grammar(kind, value, name))
    return out


def _response_format(rf: ResponseFormat | None) -> Grammar | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Grammar(common_pb2.StructuredOutput(json_object=True), "response_format", 0)
    if rf.type != "json_schema":
        raise refuse("response_format.type", f"response_format type {rf.type[:40]!r} is not "
                     "supported: text, json_object or json_schema")  # fmt: skip
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise refuse("response_format.json_schema", "a json_schema response_format needs "
                     "json_schema.schema")  # fmt: skip
    return grammar("json", rf.json_schema.schema_, "response_format.json_schema.schema")


def _structured_outputs(value: dict[str, Any] | None) -> Grammar | None:
    if value is None:
        return None
    name = "structured_outputs"
    for key in value:
        if key not in KINDS and key not in IGNORED_KEYS and key not in DEFAULT_ONLY:
            raise refuse(f"{name}.{key}", f"unknown key {key[:40]!r}: structured_outputs takes "
                         "one of json, regex, choice, grammar, json_object")  # fmt: skip
    for key, default in DEFAULT_ONLY.items():
        if value.get(key, default) != default:
            raise refuse(f"{name}.{key}", f"{key} is not supported")
    asked = [k for k in KINDS if value.get(k) not in (None, False)]
    if len(asked) != 1:
        raise refuse(name, "structured_outputs takes exactly one of json, regex, choice, "
                     f"grammar, json_object; got {', '.join(asked) or 'none'}")  # fmt: skip
    return grammar(asked[0], value[asked[0]], f"{name}.{asked[0]}")


def grammar(kind: str, value: Any, param: str) -> Grammar:
    """One constraint of ``kind`` (json | regex | choice | grammar | json_object), checked."""
    spec = common_pb2.StructuredOutput
    if kind == "json":
        text = json_schema_text(value, param)
        return Grammar(spec(json_schema=text), param, len(text))
    if kind == "json_object":
        if value is not True:
            raise refuse(param, "json_object must be true")
        return Grammar(spec(json_object=True), param, 0)
    if kind == "choice":
        choices = _choices(value, param)
        return Grammar(spec(choice=common_pb2.ChoiceList(choices=choices)), param,
                       sum(len(c) for c in choices))  # fmt: skip
    if not isinstance(value, str) or not value:
        raise refuse(param, f"{'a regex' if kind == 'regex' else 'a grammar'} is a non-empty "
                     "string")  # fmt: skip
    if kind == "regex":
        problem = regex_problem(value)
        if problem is not None:
            raise refuse(param, problem)
        return Grammar(spec(regex=value), param, len(value))
    return Grammar(spec(grammar=value), param, len(value))


def json_schema_text(value: Any, param: str) -> str:
    """A schema (an object, a boolean, or its JSON text) checked, as compact JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise refuse(param, "the JSON schema's text is not valid JSON") from None
    return checked_schema_text(value, param)


def checked_schema_text(schema: Any, param: str) -> str:
    try:
        check_schema(schema)
        return serialize(schema)
    except SchemaRefused as e:
        raise _refusal(e, param) from None


def _refusal(e: SchemaRefused, param: str) -> PydanticCustomError:
    return refuse(e.where(param), e.message)


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
        raise refuse(param, f"choice is a list of 1 to {MAX_CHOICES} strings")
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise refuse(f"{param}.{i}", "a choice is a non-empty string")
    return value
