"""OpenAI request bodies (pydantic, strict types: ``"5"`` is not a number) and their checks.

Every field that changes the output is honoured or refused with a 400 naming it, never silently
ignored:

- honoured: OpenAI's sampling fields, and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
  ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
  ``skip_special_tokens``, ``cache_salt``, ``allowed_token_ids``, ``bad_words``, OpenAI's
  ``logit_bias``,
  ``truncate_prompt_tokens``, ``add_special_tokens``, ``prompt_logprobs`` (not streamed), for
  completions ``echo`` (with ``logprobs``: the prompt's too) and ``max_tokens: 0``, and for chat
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``;
- structured outputs (structured.py; a JSON schema checked by json_schema_check.py): OpenAI's
  ``response_format`` (``text``, ``json_object``, ``json_schema``: enforced whatever its
  ``strict``), vLLM's ``structured_outputs`` (one of ``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``; ``disable_fallback`` ignored, any other key refused) and its
  ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``; one per request;
- tool calling on chat (tools.py): ``tools`` (functions), ``tool_choice`` (``none``, ``auto``
  with the gateway's ``--tool-call-parser``, ``required``, a named function: the last two
  constrained by their schemas), ``parallel_tool_calls``, assistant ``tool_calls`` and ``tool``
  messages (through the chat template). Under ``required`` and a named function the calls
  follow every tool's schema; under ``auto`` the reply is free, but with a ``strict`` tool any
  call the model starts (in the parser's format) follows its schema;
- refused (``REFUSED`` below, and the checks in the validators): ``suffix``,
  legacy ``functions``/``function_call``, ``guided_whitespace_pattern``, ``structural_tag``,
  beam search, non-text modalities and content parts, and the other vLLM and OpenAI fields
  Baton cannot honour;
- accepted and ignored, because they change nothing in the output: ``user``, ``metadata``,
  ``store``, ``service_tier``, ``prediction`` (a latency hint), ``safety_identifier``,
  ``prompt_cache_key``, ``priority``, ``request_id``, ``length_penalty`` (beam search only),
  ``spaces_between_special_tokens`` (no effect with fast tokenizers), ``include_reasoning`` (no
  reasoning parser), ``guided_decoding_backend`` (one grammar engine: xgrammar),
  ``mm_processor_kwargs`` (no media), and any field neither OpenAI nor vLLM defines.

Every number is bounded by what the wire to the workers can carry (the protobuf field's type:
``max_tokens``, ``min_tokens``, token ids are uint32, ``top_k`` int32, ``seed`` int64) and
every float is finite, so a value never fails while the request is built; counts (prompts,
stop strings, messages, stop token ids, bad words, allowed token ids, tools, a grammar's
characters) are bounded by the gateway's ``InputLimits`` (``limits.py``), checked before any
work is done, and the model's own limits (context length, vocabulary) by the handler. A
refusal raised here carries its field's path (``errors.refuse``).
"""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from services.gateway import structured, tools
from services.gateway.errors import refuse
from services.gateway.structured import Grammar
from services.gateway.tools import ToolPlan

MAX_N = 16
MAX_LOGPROBS = 20
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
MAX_TEMPLATE_KWARGS = 32  # keys in chat_template_kwargs
MAX_TEMPLATE_KWARGS_CHARS = 16384  # chat_template_kwargs as JSON: what the template may walk
# the chat template's own inputs, which chat_template_kwargs may not replace (vLLM refuses
# chat_template and tokenize; tools come in their own field, documents are refused)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "chat_template", "tokenize", "raise_exception", "bos_token", "eos_token", "unk_token",
    "pad_token",
})  # fmt: skip

# Fields whose presence (anything but null, false or empty) asks for what Baton cannot do.
REFUSED_COMMON = {
    "use_beam_search": "beam search is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (the grammar "
    "engine picks the whitespace)",
    "structural_tag": "structural tags are not supported",
    "logits_processors": "custom logits processors are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "return_token_ids": "return_token_ids is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "thinking_token_budget": "thinking_token_budget is not supported",
}
REFUSED_COMPLETION = {
    "suffix": "suffix is not supported",
    "prompt_embeds": "prompt_embeds are not supported",
}
REFUSED_CHAT = {
    "functions": "functions (legacy function calling) are not supported",
    "audio": "audio output is not supported",
    "echo": "echo is not supported on chat completions",
    "chat_template": "a chat template in the request is not supported",
    "documents": "documents are not supported",
    "reasoning_effort": "reasoning_effort is not supported (chat_template_kwargs reaches "
    "the chat template)",
    "verbosity": "verbosity is not supported",
}


def _refuse_set(body: BaseModel, fields: dict[str, str]) -> None:
    for name, why in fields.items():
        value = getattr(body, name)
        if not (value is None or value is False or value == [] or value == {} or value == ""):
            raise refuse(name, why)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema`` (``strict`` or not, the schema is enforced)."""

    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str  # text | json_object | json_schema (structured.py)
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    response_format: ResponseFormat | None = None
    # vLLM's: the top-N logprobs at each prompt token (the prompt's own token always), as
    # ``prompt_logprobs`` beside the choices; not while streaming, as vLLM
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None
    # OpenAI's: token id (as a string) → a bias in [-100, 100] added to its logit
    logit_bias: dict[str, float] | None = None
    # a grammar the output follows (structured.py): vLLM's structured outputs and its older
    # guided_* fields (guided_json: a schema or its JSON text; guided_regex, guided_grammar:
    # strings; guided_choice: strings); checked by ``structured.resolve``
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # refused when set (REFUSED_COMMON): declared so that their presence is seen
    use_beam_search: bool = False
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    vllm_xargs: Any = None
    thinking_token_budget: Any = None
    _grammar: Grammar | None = PrivateAttr(None)  # set by the validators

    @model_validator(mode="after")
    def _check_common(self) -> "_SamplingFields":
        _refuse_set(self, REFUSED_COMMON)
        self._grammar = structured.resolve(self)
        if self.best_of is not None and self.best_of != self.n:
            raise refuse("best_of", "best_of must equal n (no server-side best-of selection)")
        if self.prompt_logprobs is not None and self.stream:
            raise refuse("prompt_logprobs", "prompt_logprobs are not available when stream=true")
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "stream_options is only allowed with stream=true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise refuse("stream_options.continuous_usage_stats",
                         "continuous_usage_stats is not supported")  # fmt: skip
        if any(not s for s in self.stop_strings):
            raise refuse("stop", "stop strings must not be empty")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise refuse("allowed_token_ids", "allowed_token_ids must not be empty")
        if any(not w.strip() for w in self.bad_words or ()):
            raise refuse("bad_words", "bad words must not be empty or only whitespace")
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= UINT32_MAX):
                raise refuse("logit_bias", f"logit_bias keys are token ids, got {key[:40]!r}")
            if not -100 <= bias <= 100:  # (finite: the body's floats are)
                raise refuse("logit_bias", f"a bias is in [-100, 100], got {bias}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def grammar(self) -> Grammar | None:
        """The one grammar the output follows, checked (structured.py), or None."""
        return self._grammar


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=UINT32_MAX)  # 0: only the prompt (echo)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before each choice's text (with logprobs: the prompt's too)
    add_special_tokens: bool = True  # text prompts: the tokenizer's BOS, as vLLM
    suffix: str | None = None
    prompt_embeds: Any = None

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        _refuse_set(self, REFUSED_COMPLETION)
        if isinstance(self.prompt, list) and not self.prompt:
            raise refuse("prompt", "prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string, strings, one token list, or token lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):  # validated: a list holds one kind
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Body):
    """A part of a message's content; only text is supported (checked by the request, which
    knows the part's path)."""

    type: str
    text: str | None = None


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object's)
    strict: bool | None = None  # enforced: under auto, the calls the model starts (tools.py)


class FunctionTool(_Body):
    type: str  # "function" (tools.py refuses others)
    function: FunctionDefinition


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text of an object


class MessageToolCall(_Body):
    """A call an earlier assistant message made (it goes back through the chat template)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    function_call: Any = None  # refused (legacy function calling)

    def as_template_input(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates take it: a call's arguments as an
        object (as vLLM passes them; templates write ``arguments | tojson``)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(call: MessageToolCall) -> Any:
    """A call's arguments as an object ("" is none); validated by ``_check_message``."""
    return json.loads(call.function.arguments) if call.function.arguments.strip() else {}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # tool calling (tools.py): function tools, which one to call ("none", "auto", "required" or
    # {"type": "function", "function": {"name": ...}}), more than one call per reply
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes its own special tokens, as vLLM
    chat_template_kwargs: dict[str, Any] | None = None
    # refused when set (REFUSED_CHAT)
    functions: list[Any] | None = None
    audio: Any = None
    echo: bool = False
    chat_template: Any = None
    documents: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    _tools: ToolPlan | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        _refuse_set(self, REFUSED_CHAT)
        if self.web_search_options is not None:  # {} asks for search with its defaults
            raise refuse("web_search_options", "web search is not supported")
        if self.function_call not in (None, "none", "auto"):  # no functions: "auto" calls none
            raise refuse("function_call", "function_call is not supported")
        self._tools = tools.plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self._tools is not None:
            if self._tools.mode == "auto" and self._grammar is not None:
                raise refuse(self._grammar.source, f"{self._grammar.source} with tools and "
                             "tool_choice 'auto' would keep the model from calling them: use "
                             "tool_choice 'none' or 'required'")  # fmt: skip
            self._grammar = structured.only(self._grammar, self._tools.grammar())
        if any(m != "text" for m in self.modalities or ()):
            raise refuse("modalities", "only the text modality is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise refuse("top_logprobs", "top_logprobs requires logprobs=true")
        for i, message in enumerate(self.messages):
            _check_message(i, message)
        if self.continue_final_message:
            _check_continue(self)
        if self.chat_template_kwargs is not None:
            _check_template_kwargs(self.chat_template_kwargs)
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_plan(self) -> ToolPlan | None:
        """The request's tool calling (tools.py), or None: no tools."""
        return self._tools

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _check_message(i: int, message: ChatMessage) -> None:
    if message.function_call:
        raise refuse(f"messages.{i}.function_call", "function_call in messages is not "
                     "supported (use tool_calls)")  # fmt: skip
    if message.tool_calls and message.role != "assistant":
        raise refuse(f"messages.{i}.tool_calls", "only an assistant's message has tool_calls")
    for j, call in enumerate(message.tool_calls or ()):
        try:
            args = _arguments(call)
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise refuse(f"messages.{i}.tool_calls.{j}.function.arguments", "a call's "
                         "arguments are the JSON text of an object")  # fmt: skip
    for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
        where = f"messages.{i}.content.{j}"
        if part.type != "text":
            kind = part.type[:40]
            raise refuse(where, f"content parts of type {kind!r} are not supported (text only)")
        if part.text is None:
            raise refuse(f"{where}.text", "a text content part needs its text")


def _check_continue(body: ChatCompletionRequest) -> None:
    """As vLLM: the generation prompt would open a new turn instead of continuing this one."""
    name = "continue_final_message"
    if body.add_generation_prompt:
        raise refuse(name, f"{name} requires add_generation_prompt=false")
    final = body.messages[-1]
    if final.role != "assistant" or not final.as_template_input()["content"].strip():
        raise refuse(name, f"{name} continues the last message: it must be the assistant's, "
                     "with content")  # fmt: skip


def _check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """Bounded (the template walks every value) and never one of the template's own inputs."""
    name = "chat_template_kwargs"
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise refuse(name, f"{len(kwargs)} keys: at most {MAX_TEMPLATE_KWARGS} are allowed")
    for key in kwargs:
        if not key.isidentifier():
            raise refuse(name, f"{key[:40]!r} is not a name a template can use")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise refuse(f"{name}.{key}", f"{key!r} is the chat template's own input")
    size = len(json.dumps(kwargs, separators=(",", ":")))
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise refuse(name, f"{size} characters as JSON: at most {MAX_TEMPLATE_KWARGS_CHARS}")
