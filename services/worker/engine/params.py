"""``SamplingParams``: how one request samples and when it stops. A msgspec struct, so it crosses
the ZMQ boundary to the engine core as plain msgpack. Validated on construction: a bad value is a
``ValueError`` naming the field, never a crash deeper in.
"""

import enum
import math

import msgspec

GREEDY_EPS = 1e-5  # temperatures below this sample greedily
MAX_LOGPROBS = 20
# The engine's own bounds on the token constraints (every front end: the gateway's input limits
# are lower by default): each bad word is matched on every step of its request.
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 4096
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_LOGIT_BIAS = 1 << 16  # tokens one request may bias
LOGIT_BIAS_BOUND = 100.0  # OpenAI's: each bias in [-100, 100]
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or EBNF grammar (the gateway's bound is lower)
MAX_CHOICES = 4096  # strings of a choice constraint
_TEXT_KINDS = ("json", "regex", "grammar", "structural_tag")  # a grammar given as one string


class StructuredOutputParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A grammar the output must follow (vLLM's ``structured_outputs``): exactly one of
    ``json`` (a JSON Schema as JSON text), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of these strings) or ``grammar`` (EBNF). The engine compiles it against its
    tokenizer off the step loop and masks, at every sampled position, the tokens it does not
    allow (engine/structured/)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # xgrammar's structural tag (JSON text): free text, and after a trigger one of its tags
    # (begin, a grammar for the content, end): tool calls that follow their tools' schemas
    structural_tag: str | None = None
    # the prompt's last tokens that were generated under this grammar by an earlier worker (a
    # resumed request): accepted by the matcher before the first sample
    replay_tokens: int = 0

    def __post_init__(self) -> None:
        kinds = [k for k in (*_TEXT_KINDS, "choice") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {', '.join(kinds) or 'none'}"
            )
        for name in _TEXT_KINDS:
            text = getattr(self, name)
            if text is not None and not (
                isinstance(text, str) and 0 < len(text) <= MAX_GRAMMAR_CHARS
            ):
                raise ValueError(f"structured_outputs.{name} must be 1 to {MAX_GRAMMAR_CHARS} "
                                 "characters")  # fmt: skip
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be strings")
            if sum(len(c) for c in self.choice) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.choice: at most {MAX_GRAMMAR_CHARS} "
                                 "characters in all")  # fmt: skip
        _check_int("structured_outputs.replay_tokens", self.replay_tokens, lo=0)

    @property
    def kind(self) -> str:
        """json | json_object | regex | choice | grammar | structural_tag."""
        if self.json_object:
            return "json_object"
        return next(k for k in (*_TEXT_KINDS, "choice") if getattr(self, k) is not None)

    def key(self) -> tuple[str, str]:
        """What the grammar is, whatever the request (the compile cache's key)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, msgspec.json.encode(self.choice).decode()
        return kind, getattr(self, kind)


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # each output carries everything generated so far
    DELTA = 1  # each output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length; 0: only the prompt runs
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one always)
    # vLLM's: top-N logprobs at every prompt token after the first (the prompt's own token
    # always), computed in the steps that run the prompt (model_runner.prompt_logprobs)
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled; None: any token
    # OpenAI's: token id → a bias added to its logit before sampling (not to the logprobs, which
    # are the model's raw distribution, as vLLM reports them)
    logit_bias: dict[int, float] | None = None
    # vLLM's: never generate these words (sample/constraints.py); the input processor tokenizes
    # them into bad_words_token_ids, which is what the sampler reads
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # vLLM's: a grammar the output must follow (StructuredOutputParams)
    structured_outputs: StructuredOutputParams | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (the worker service; the gateway decodes)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check_int("n", self.n, lo=1)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, lo=0)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=0)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) > max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids[]", tok, lo=0)
        self._check_token_constraints()
        self.output_kind = RequestOutputKind(self.output_kind)

    def _check_token_constraints(self) -> None:
        if self.allowed_token_ids is not None:
            if not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(
                    f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, "
                    f"got {len(self.allowed_token_ids)}"
                )  # (an empty list would mask every token)
            for tok in self.allowed_token_ids:
                _check_int("allowed_token_ids[]", tok, lo=0)
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got "
                                 f"{len(self.logit_bias)}")  # fmt: skip
            for tok, bias in self.logit_bias.items():
                _check_int("logit_bias token id", tok, lo=0)
                _check_float("logit_bias", bias, lo=-LOGIT_BIAS_BOUND, hi=LOGIT_BIAS_BOUND)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words: at most {MAX_BAD_WORDS}, got {len(self.bad_words)}")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(
                    f"bad_words must be strings of 1 to {MAX_BAD_WORD_CHARS} characters, "
                    "not only whitespace"
                )
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise ValueError(f"bad_words_token_ids: at most {2 * MAX_BAD_WORDS} sequences")
        for seq in self.bad_words_token_ids:
            if not isinstance(seq, list) or not seq:
                raise ValueError("bad_words_token_ids must be non-empty lists of token ids")
            for tok in seq:
                _check_int("bad_words_token_ids[][]", tok, lo=0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def clone(self, **changes: object) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: object, lo: float, hi: float | None = None) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")
