"""Tool calls out of a model's text, as it streams: each parser takes the reply's text piece by
piece (``feed``) and hands out the content and the calls it has seen so far, a call's arguments
as their JSON text arrives, so a client sees them streamed as OpenAI's tool-call deltas; ``finish``
ends the reply (a call cut short by ``max_tokens`` is handed back as content: it is no call;
streamed, its first deltas went out already).

- ``HermesParser``: Hermes and Qwen's ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``,
  any number of them among the content.
- ``Llama3JsonParser``: Llama 3.1's JSON tool calls, a reply that is ``{"name": …,
  "parameters": {…}}`` (after an optional ``<|python_tag|>``), several separated by ``;``.
- ``JsonArrayParser``: the reply of ``tool_choice: "required"``, which its grammar makes a JSON
  array of ``{"name": …, "parameters": {…}}`` (vLLM's shape; tools.py).
- ``ArgumentsParser``: the reply of a named ``tool_choice``, which is one call's arguments.

Both read a call as JSON, character by character (``_JsonScanner``): a call ends where its object
closes, so a closing tag inside an argument's string does not end it. Text inside a reasoning
block (``<think>…</think>``) is content: a call is never made of it. The chat endpoint reads a
reply with the parser ``baton gateway --tool-call-parser`` names (``PARSERS``) under
``tool_choice: "auto"`` (tools.ToolReader).
"""

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCallDelta:
    """A piece of one call: its first carries ``id`` and ``name``; ``arguments`` is JSON text
    to append to what came before (OpenAI's streamed ``tool_calls[i].function.arguments``)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


class CallParser(Protocol):
    """What every parser here is: ``feed`` the reply's text, ``finish`` at its end; ``calls``
    holds the calls read whole so far."""

    @property
    def calls(self) -> list[ToolCall]: ...

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _JsonScanner:
    """One JSON object read a character at a time: where it ends (strings and escapes
    respected), and, at its top level, the raw text of the value of ``stream_key`` as it comes
    (``take_streamed``)."""

    def __init__(self, stream_keys: tuple[str, ...]):
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self._stream_keys = stream_keys
        self._key: str | None = None  # the top-level key being read, or last read
        self._reading_key = False
        self._key_start = 0  # where the key being read starts in ``text``
        self._expect_value = False  # after a top-level key's colon
        self._streaming = False  # inside the streamed key's value
        self._value_depth = 0
        self._streamed = ""  # what the streamed value added since the last take

    def feed(self, ch: str) -> None:
        self.text += ch
        if self._streaming:
            self._streamed += ch
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self._reading_key:
                    self._reading_key = False
                    self._key = json.loads(self.text[self._key_start :])
                elif self._streaming and self._value_depth == 0:
                    self._streaming = False  # a string value ended
            return
        if ch == '"':
            self.in_string = True
            if self.depth == 1 and not self._expect_value and not self._streaming:
                self._reading_key, self._key_start = True, len(self.text) - 1
            elif self._expect_value:
                self._start_value(ch)
            return
        if ch.isspace():
            return
        if self._expect_value:
            self._start_value(ch)
        if ch in "{[":
            self.depth += 1
            if self._streaming:
                self._value_depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self._streaming:
                if self._value_depth == 0:  # the object closed on a bare value (a number)
                    self._streaming = False
                    self._streamed = self._streamed[:-1]
                else:
                    self._value_depth -= 1
                    if self._value_depth == 0:
                        self._streaming = False
            if self.depth == 0:
                self.done = True
        elif ch == ":" and self.depth == 1 and self._key is not None:
            self._expect_value = True
        elif ch == "," and self._streaming and self._value_depth == 0:
            self._streaming = False  # a bare value ended
            self._streamed = self._streamed[:-1]

    def _start_value(self, ch: str) -> None:
        self._expect_value = False
        if self._key in self._stream_keys:
            self._streaming, self._value_depth, self._streamed = True, 0, ch

    def take_streamed(self) -> str:
        out, self._streamed = self._streamed, ""
        return out

    @property
    def key(self) -> str | None:
        return self._key


class _CallReader:
    """One call's JSON object, its name as soon as it is read and its arguments streamed from
    then on (those before the name are held until it comes)."""

    def __init__(self, index: int, argument_keys: tuple[str, ...]):
        self.index = index
        self.scanner = _JsonScanner(argument_keys)
        self.argument_keys = argument_keys
        self.id = _call_id()
        self.name: str | None = None
        self.announced = False
        self.held = ""  # arguments read before the name
        self.sent = ""  # arguments handed out

    def feed(self, ch: str) -> list[ToolCallDelta]:
        self.scanner.feed(ch)
        self.held += self.scanner.take_streamed()
        if self.name is None and self.scanner.key == "name" and not self.scanner.in_string:
            self.name = self._name_so_far()
        if self.name is None or not (self.held or not self.announced):
            return []
        delta = ToolCallDelta(self.index, self.held)
        if not self.announced:
            delta.id, delta.name, self.announced = self.id, self.name, True
        self.sent += self.held
        self.held = ""
        return [delta]

    def feed_until_done(self, text: str) -> tuple[list[ToolCallDelta], int]:
        """Feed ``text`` until the call's object closes: (the deltas, characters used)."""
        deltas: list[ToolCallDelta] = []
        for used, ch in enumerate(text, 1):
            deltas += self.feed(ch)
            if self.scanner.done:
                return deltas, used
        return deltas, len(text)

    def _name_so_far(self) -> str | None:
        """The top-level name once its string value has closed (None before)."""
        text = self.scanner.text
        at = text.rfind('"name"')
        rest = text[at + len('"name"') :].lstrip()
        if not rest.startswith(":"):
            return None
        value = rest[1:].lstrip()
        if not value.startswith('"'):
            return None
        try:
            name, end = json.JSONDecoder().raw_decode(value)
        except json.JSONDecodeError:
            return None  # not closed yet
        return name if isinstance(name, str) and end <= len(value) else None

    def call(self) -> ToolCall | None:
        """The finished call, or None when its JSON is not a call (no name, arguments not an
        object)."""
        try:
            obj = json.loads(self.scanner.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args: object = next((obj[k] for k in self.argument_keys if k in obj), {})
        if not isinstance(args, dict):
            return None
        return ToolCall(self.id, obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``tags``."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` among content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    ARGUMENT_KEYS = ("arguments",)

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._thinking = False
        self._reader: _CallReader | None = None
        self._raw = ""  # the current call's text from its open tag, in case it is no call
        self._after_call = False  # a call's object closed: its close tag comes next

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._buffer:
            if self._reader is not None:
                out += self._read_call()
                if self._reader is not None:
                    break  # the call goes on in the next piece
            elif self._after_call:
                if not self._close_tag():
                    break
            else:
                content, stop = self._content()
                out.content += content
                if stop:
                    break
        return out

    def _content(self) -> tuple[str, bool]:
        """Content up to the next tag that changes state; (content, whether to wait for more)."""
        tags = (THINK_CLOSE,) if self._thinking else (self.OPEN, THINK_OPEN)
        found = [(self._buffer.find(t), t) for t in tags if t in self._buffer]
        if not found:
            keep = _held_prefix(self._buffer, tags)
            content = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(content) :]
            return content, True
        at, tag = min(found)
        if tag == self.OPEN:
            content, self._buffer = self._buffer[:at], self._buffer[at + len(tag) :]
            self._reader = _CallReader(len(self.calls), self.ARGUMENT_KEYS)
            self._raw = tag
            return content, False
        self._thinking = tag == THINK_OPEN
        content, self._buffer = self._buffer[: at + len(tag)], self._buffer[at + len(tag) :]
        return content, False

    def _read_call(self) -> ParsedDelta:
        reader = self._reader
        assert reader is not None
        out = ParsedDelta()
        if not reader.scanner.text:  # before the object: blanks, then "{" or it was content
            blanks = len(self._buffer) - len(self._buffer.lstrip())
            self._raw += self._buffer[:blanks]
            self._buffer = self._buffer[blanks:]
            if not self._buffer:
                return out
            if self._buffer[0] != "{":  # not JSON: the tag was content
                self._reader = None
                out.content += self._raw
                return out
        deltas, used = reader.feed_until_done(self._buffer)
        out.tool_calls += deltas
        self._raw += self._buffer[:used]
        self._buffer = self._buffer[used:]
        if reader.scanner.done:
            self._reader = None
            call = reader.call()
            if call is None and not reader.announced:
                out.content += self._raw  # not a call: it was content
            elif call is not None:
                self.calls.append(call)
                self._after_call = True
        return out

    def _close_tag(self) -> bool:
        """After a call: skip blanks and its close tag; False: wait for more text."""
        stripped = self._buffer.lstrip()
        if not stripped:
            self._buffer = ""
            return False
        if stripped.startswith(self.CLOSE):
            self._buffer, self._after_call = stripped[len(self.CLOSE) :], False
            return True
        if self.CLOSE.startswith(stripped):
            return False  # the tag is still coming
        self._after_call = False  # no close tag: what follows is content
        return True

    def finish(self) -> ParsedDelta:
        """The reply ended: what was held back is content, and so is a call cut short (its
        text from the open tag; streamed, its first deltas went out already: it is not in
        ``calls``)."""
        out = ParsedDelta()
        if self._reader is not None:
            out.content += self._raw + self._buffer
            self._reader = None
        elif not self._after_call:
            out.content += self._buffer
        self._buffer = ""
        return out


class Llama3JsonParser:
    """Llama 3.1's JSON tool calls: a reply that begins with ``{`` (after an optional
    ``<|python_tag|>``) is calls, ``{"name": "f", "parameters": {...}}`` separated by ``;``;
    any other reply is content."""

    PYTHON_TAG = "<|python_tag|>"
    ARGUMENT_KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._decided: bool | None = None  # None: not yet known whether it is calls
        self._reader: _CallReader | None = None
        self._text = ""  # everything fed, for a reply that turns out not to be calls

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        self._buffer += text
        out = ParsedDelta()
        if self._decided is None:
            head = self._buffer.lstrip()
            if head.startswith(self.PYTHON_TAG):
                head = head[len(self.PYTHON_TAG) :].lstrip()
            elif self.PYTHON_TAG.startswith(head) and head:
                return out  # the tag is still coming
            if not head:
                return out
            self._decided = head.startswith("{")
            self._buffer = head
            if not self._decided:
                out.content, self._buffer = self._text, ""
                return out
        if not self._decided:
            out.content, self._buffer = self._buffer, ""
            return out
        while self._buffer:
            if self._reader is None:
                stripped = self._buffer.lstrip().lstrip(";").lstrip()
                if not stripped:
                    self._buffer = ""
                    break
                if not stripped.startswith("{"):
                    out.content, self._buffer = stripped, ""  # text after the calls
                    break
                self._buffer = stripped
                self._reader = _CallReader(len(self.calls), self.ARGUMENT_KEYS)
            self._buffer, ended = _feed_call(self._reader, self._buffer, self.calls, out)
            if not ended:
                break
            self._reader = None
        return out

    def finish(self) -> ParsedDelta:
        """The reply ended: held text is content, and so is a call cut short (its text)."""
        out = ParsedDelta()
        if self._decided is None:
            out.content = self._text
        elif self._reader is not None:
            out.content = self._reader.scanner.text + self._buffer
        self._reader, self._buffer = None, ""
        return out


def _feed_call(
    reader: "_CallReader", buffer: str, calls: list[ToolCall], out: ParsedDelta
) -> tuple[str, bool]:
    """Feed ``buffer`` to the call being read: its deltas into ``out``, and once its JSON has
    ended the call into ``calls`` (or its text into the content: it was no call). The rest of
    the buffer, and whether the call ended."""
    deltas, used = reader.feed_until_done(buffer)
    out.tool_calls += deltas
    if not reader.scanner.done:
        return buffer[used:], False
    call = reader.call()
    if call is not None:
        calls.append(call)
    elif not reader.announced:  # not a call: it was content
        out.content += reader.scanner.text
    return buffer[used:], True


class JsonArrayParser:
    """``[{"name": "f", "parameters": {...}}, ...]``: each call streamed as its object is read;
    a reply that is not such an array (its grammar forbids it) is content."""

    ARGUMENT_KEYS = ("parameters",)

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._opened = False  # past the "["
        self._content = False  # not an array: everything is content
        self._reader: _CallReader | None = None

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while self._buffer:
            if self._content:
                out.content, self._buffer = out.content + self._buffer, ""
                break
            if self._reader is None:
                if not self._next_call():
                    break
                continue  # a call begins, or the rest is content
            self._buffer, ended = _feed_call(self._reader, self._buffer, self.calls, out)
            if not ended:
                break
            self._reader = None
        return out

    def _next_call(self) -> bool:
        """Skip to the next object; False: wait for more text (or the array ended)."""
        stripped = self._buffer.lstrip()
        if not self._opened:
            if not stripped:
                self._buffer = ""
                return False
            if not stripped.startswith("["):
                self._content = True
                return True
            self._opened, stripped = True, stripped[1:]
        stripped = stripped.lstrip().removeprefix(",").lstrip()
        if not stripped or stripped.startswith("]"):
            self._buffer = ""  # (after the "]": nothing the grammar allows)
            return False
        if not stripped.startswith("{"):
            self._buffer, self._content = stripped, True
            return True
        self._buffer = stripped
        self._reader = _CallReader(len(self.calls), self.ARGUMENT_KEYS)
        return True

    def finish(self) -> ParsedDelta:
        """The reply ended: a call cut short is content (its text)."""
        out = ParsedDelta()
        if self._reader is not None:
            out.content = self._reader.scanner.text + self._buffer
        elif self._content:
            out.content = self._buffer
        self._reader, self._buffer = None, ""
        return out


class ArgumentsParser:
    """The whole reply is one call's arguments (its grammar is the function's parameters):
    streamed as they come, the first delta with the call's id and name."""

    def __init__(self, name: str) -> None:
        self.name, self.id = name, _call_id()
        self._arguments = ""
        self._announced = False

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(self.id, self.name, self._arguments.strip() or "{}")]

    def feed(self, text: str) -> ParsedDelta:
        self._arguments += text
        if not text and self._announced:
            return ParsedDelta()
        delta = ToolCallDelta(0, text)
        if not self._announced:
            delta.id, delta.name, self._announced = self.id, self.name, True
        return ParsedDelta(tool_calls=[delta])

    def finish(self) -> ParsedDelta:
        """A reply with no text still makes its call (announced here)."""
        return self.feed("")


PARSERS: dict[str, type[HermesParser | Llama3JsonParser]] = {  # --tool-call-parser
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
