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
- refused (``REFUSED`` below, and the checks in the validators): ``suffix``,
  tools and functions, non-text ``response_format``, structured outputs, beam search, non-text
  modalities and content parts, and the other vLLM and OpenAI fields Baton cannot honour;
- accepted and ignored, because they change nothing in the output: ``user``, ``metadata``,
  ``store``, ``service_tier``, ``parallel_tool_calls`` (no tools), ``prediction`` (a latency
  hint), ``safety_identifier``, ``prompt_cache_key``, ``priority``, ``request_id``,
  ``length_penalty`` (beam search only), ``spaces_between_special_tokens`` (no effect with fast
  tokenizers), ``include_reasoning`` (no reasoning parser), ``guided_decoding_backend`` and
  ``guided_whitespace_pattern`` (nothing to guide), ``mm_processor_kwargs`` (no media), and
  any field neither OpenAI nor vLLM defines.

Every number is bounded by what the wire to the workers can carry (the protobuf field's type:
``max_tokens``, ``min_tokens``, token ids are uint32, ``top_k`` int32, ``seed`` int64) and
every float is finite, so a value never fails while the request is built; counts (prompts,
stop strings, messages, stop token ids, bad words, allowed token ids) are bounded by the
gateway's ``InputLimits`` (``limits.py``), checked before any work is done, and the model's own
limits (context length, vocabulary) by the handler. A refusal raised here carries its field's
path (``errors.refuse``).
"""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.errors import refuse

MAX_N = 16
MAX_LOGPROBS = 20
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
MAX_TEMPLATE_KWARGS = 32  # keys in chat_template_kwargs
MAX_TEMPLATE_KWARGS_CHARS = 16384  # chat_template_kwargs as JSON: what the template may walk
# the chat template's own inputs, which chat_template_kwargs may not replace (vLLM refuses
# chat_template and tokenize; tools and documents are refused as fields of their own)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "chat_template", "tokenize", "raise_exception", "bos_token", "eos_token", "unk_token",
    "pad_token",
})  # fmt: skip

# Fields whose presence (anything but null, false or empty) asks for what Baton cannot do.
STRUCTURED = "structured outputs are not supported"
REFUSED_COMMON = {
    "use_beam_search": "beam search is not supported",
    "structured_outputs": STRUCTURED,
    "guided_json": STRUCTURED,
    "guided_regex": STRUCTURED,
    "guided_choice": STRUCTURED,
    "guided_grammar": STRUCTURED,
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
    "tools": "tools are not supported",
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


class ResponseFormat(_Body):
    type: str


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
    # refused when set (REFUSED_COMMON): declared so that their presence is seen
    use_beam_search: bool = False
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    vllm_xargs: Any = None
    thinking_token_budget: Any = None

    @model_validator(mode="after")
    def _check_common(self) -> "_SamplingFields":
        _refuse_set(self, REFUSED_COMMON)
        if self.response_format is not None and self.response_format.type != "text":
            raise refuse("response_format", "response_format other than 'text' is not supported")
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


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # refused: the template would never see them
    function_call: Any = None  # refused, as tool_calls

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes its own special tokens, as vLLM
    chat_template_kwargs: dict[str, Any] | None = None
    # refused when set (REFUSED_CHAT)
    tools: list[dict[str, Any]] | None = None
    functions: list[Any] | None = None
    audio: Any = None
    echo: bool = False
    chat_template: Any = None
    documents: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        _refuse_set(self, REFUSED_CHAT)
        if self.web_search_options is not None:  # {} asks for search with its defaults
            raise refuse("web_search_options", "web search is not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):  # no tools: "auto" calls none
                raise refuse(name, f"{name} is not supported")
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
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _check_message(i: int, message: ChatMessage) -> None:
    for name in ("tool_calls", "function_call"):
        if getattr(message, name):
            raise refuse(f"messages.{i}.{name}", f"{name} in messages are not supported")
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
