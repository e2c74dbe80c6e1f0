"""Tool calling on /v1/chat/completions: a request's ``tools`` and ``tool_choice`` checked
(``plan``), what the chat template sees of them, the grammar that ``"required"`` and a named
function constrain the reply with, and each reply read back as OpenAI's tool calls
(``ToolReader``, streamed or not).

    tool_choice "none"       the tools are rendered; the reply is content
                "auto"       (the default with tools) the tools are rendered; the reply is read
                             by the gateway's ``--tool-call-parser`` into content and calls
                             (none set: a 400, as vLLM); free, but with a ``strict: true``
                             tool every call the model starts follows its tool's schema
                             (``auto_grammar``: the parser's format as triggered tags)
                "required"   the reply is a JSON array of one or more calls (one when
                             parallel_tool_calls is false), ``[{"name": …, "parameters": {…}}]``
                             (vLLM's shape), each call's parameters following its tool's schema;
                             finish_reason "tool_calls"
                {"type": "function", "function": {"name": …}}   the reply is that function's
                             arguments, following its parameters schema; finish_reason "stop",
                             as OpenAI's
"""

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.gateway.errors import refuse
from services.gateway.structured import Grammar, checked_schema_text
from services.gateway.tool_parsers import (
    PARSERS,
    ArgumentsParser,
    CallParser,
    JsonArrayParser,
    ParsedDelta,
    ToolCall,
)
from shared.protos.baton.v1 import common_pb2

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# a parser's call, as (trigger, begin with the name's JSON, end): the tags "auto" constrains a
# strict tool's call with (the formats the parsers read, as Qwen's and Llama 3.1's templates
# show them)
CALL_TAGS = {
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": ', '{{"name": {name}, "parameters": ', "}"),
}
# keys of a schema whose values are data, not schemas: a "$ref" in them is no reference
DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


class Function(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str | None: ...
    @property
    def parameters(self) -> dict[str, Any] | None: ...
    @property
    def strict(self) -> bool | None: ...


class Tool(Protocol):
    @property
    def type(self) -> str: ...
    @property
    def function(self) -> Function: ...


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: Sequence[Tool] = field(hash=False)
    function: str | None = None  # the named function
    parallel: bool = True  # more than one call per reply

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as Hugging Face chat templates take them (vLLM renders them under "none"
        too)."""
        out = []
        for tool in self.tools:
            fn: dict[str, Any] = {"name": tool.function.name}
            if tool.function.description is not None:
                fn["description"] = tool.function.description
            if tool.function.parameters is not None:
                fn["parameters"] = tool.function.parameters
            out.append({"type": "function", "function": fn})
        return out

    def grammar(self) -> Grammar | None:
        """The constraint of "required" or a named function (its schema checked: refuses)."""
        if self.mode == "named":
            i, tool = next((i, t) for i, t in enumerate(self.tools)
                           if t.function.name == self.function)  # fmt: skip
            text = checked_schema_text(_parameters(tool), f"tools.{i}.function.parameters")
        elif self.mode == "required":
            for i, tool in enumerate(self.tools):
                checked_schema_text(_parameters(tool), f"tools.{i}.function.parameters")
            text = json.dumps(required_schema(self.tools, self.parallel), separators=(",", ":"))
        else:
            if self.mode == "auto":  # a strict tool's schema is enforced (``auto_grammar``)
                for i, tool in enumerate(self.tools):
                    if tool.function.strict:
                        checked_schema_text(_parameters(tool), f"tools.{i}.function.parameters")
            return None
        return Grammar(common_pb2.StructuredOutput(json_schema=text), "tool_choice", len(text))

    def auto_grammar(self, parser: str) -> Grammar | None:
        """Under "auto" with a ``strict`` tool: the reply is free text, and from the parser's
        trigger on (``<tool_call>`` for hermes, ``{"name": `` for llama3_json) a call of one of
        the tools, a strict tool's arguments following its parameters schema, another's any
        object (xgrammar's structural tag, triggered tags). None without a strict tool."""
        if self.mode != "auto" or not any(t.function.strict for t in self.tools):
            return None
        trigger, begin, end = CALL_TAGS[parser]
        tags = [
            {"begin": begin.format(name=json.dumps(t.function.name)),
             "content": {"type": "json_schema",
                         "json_schema": _parameters(t) if t.function.strict else ANY_OBJECT},
             "end": end}
            for t in self.tools
        ]  # fmt: skip
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [trigger], "tags": tags,
            "at_least_one": False, "stop_after_first": not self.parallel,
        }}  # fmt: skip
        text = json.dumps(tag, separators=(",", ":"))
        return Grammar(common_pb2.StructuredOutput(structural_tag=text), "tools", len(text))


def plan(tools: Sequence[Tool] | None, choice: str | dict[str, Any] | None,
         parallel: bool | None) -> ToolPlan | None:  # fmt: skip
    """The request's tool calling, checked (raises ``refuse``: call it in a validator); None:
    no tools."""
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise refuse("tool_choice", f"tool_choice {choice[:40]!r} is not one of none, auto, "
                         "required or a named function")  # fmt: skip
        mode, function = choice, None
    else:
        mode, function = "named", _named(choice)
    if not tools:
        if mode != "none":
            raise refuse("tool_choice", "tool_choice is only allowed when tools are given")
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(i, tool)
        if name in names:
            raise refuse(f"tools.{i}.function.name", f"two tools are named {name!r}")
        names.add(name)
    if function is not None and function not in names:
        raise refuse("tool_choice.function.name", f"no tool named {function[:64]!r} in tools")
    return ToolPlan(mode, tools, function, parallel is not False)


def _named(choice: dict[str, Any]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise refuse("tool_choice", 'a named tool_choice is {"type": "function", "function": '
                     '{"name": ...}}')  # fmt: skip
    return name


def _check_tool(i: int, tool: Tool) -> str:
    if tool.type != "function":
        raise refuse(f"tools.{i}.type", f"tools of type {tool.type[:40]!r} are not supported "
                     "(function only)")  # fmt: skip
    name = tool.function.name
    if not NAME.fullmatch(name):
        raise refuse(f"tools.{i}.function.name", "a function name is 1 to 64 letters, digits, "
                     "underscores or dashes")  # fmt: skip
    parameters = tool.function.parameters
    if parameters is not None and parameters.get("type", "object") != "object":
        raise refuse(f"tools.{i}.function.parameters.type", "a function's parameters are an "
                     "object's schema")  # fmt: skip
    return name


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for "required": an array of calls, each one tool's name and parameters.
    Each tool's parameters move under ``$defs/tool{i}``, their local ``$ref``s rebased there
    ("#/$defs/x" → "#/$defs/tool0/$defs/x"), so that no two tools' definitions collide."""
    defs, calls = {}, []
    for i, tool in enumerate(tools):
        defs[f"tool{i}"] = _rebase(_parameters(tool), f"#/$defs/tool{i}")
        calls.append({
            "type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "parameters": {"$ref": f"#/$defs/tool{i}"}},
            "required": ["name", "parameters"], "additionalProperties": False,
        })  # fmt: skip
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


def _rebase(node: Any, base: str) -> Any:
    if isinstance(node, list):
        return [_rebase(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        else:
            out[key] = value if key in DATA_KEYS else _rebase(value, base)
    return out


class ToolReader:
    """One choice's reply read as OpenAI's content and tool calls, as it streams: ``feed``
    each piece of text, ``finish`` at its end; ``calls`` then holds the calls."""

    def __init__(self, tool_plan: ToolPlan, parser: str | None):
        self.plan = tool_plan
        self._parser: CallParser
        if tool_plan.mode == "named":
            self._parser = ArgumentsParser(tool_plan.function or "")
        elif tool_plan.mode == "required":
            self._parser = JsonArrayParser()
        else:
            assert parser is not None  # (the handler refuses "auto" without one)
            self._parser = PARSERS[parser]()

    @property
    def calls(self) -> list[ToolCall]:
        calls = self._parser.calls
        return calls if self.plan.parallel else calls[:1]

    def feed(self, text: str) -> ParsedDelta:
        return self._first_only(self._parser.feed(text))

    def finish(self) -> ParsedDelta:
        return self._first_only(self._parser.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "stop" for a named function, "tool_calls" when the reply called tools
        (a reply cut short keeps "length")."""
        if reason != "stop" or self.plan.mode == "named" or not self.calls:
            return reason
        return "tool_calls"

    def _first_only(self, parsed: ParsedDelta) -> ParsedDelta:
        if not self.plan.parallel:  # parallel_tool_calls false: the first call only
            parsed.tool_calls = [d for d in parsed.tool_calls if d.index == 0]
        return parsed
