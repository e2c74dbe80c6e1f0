"""``GatewaySettings``: what ``baton gateway`` is configured with, built once and frozen."""

from dataclasses import dataclass, field

from services.gateway.tool_parsers import PARSERS


@dataclass(frozen=True)
class InputLimits:
    """How many of each repeated thing one request may carry (enforced by limits.py; each a
    ``baton gateway --max-…`` flag; docs/security.md lists them)."""

    max_prompts: int = 64  # prompts in one completions request (a batch)
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters in one stop string
    max_stop_token_ids: int = 64
    max_messages: int = 2048  # messages in one chat request
    max_bad_words: int = 64  # bad_words (each is matched on every generated token)
    max_bad_word_chars: int = 256  # characters in one bad word
    max_allowed_token_ids: int = 4096  # allowed_token_ids (a mask built every step)
    max_logit_bias: int = 1024  # logit_bias entries (added to the logits every step)
    # characters of a grammar (a JSON schema as JSON text, a regex, an EBNF grammar, all of a
    # choice's strings), and of all the tools' parameter schemas: the engine compiles them
    max_grammar_chars: int = 65536
    max_tools: int = 128  # tools in one chat request (each rendered into the prompt)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class EdgeLimits:
    """What one client may hold at the gateway's HTTP edge (enforced by http_edge.py and the
    app's body read; each a ``baton gateway`` flag; docs/security.md, "Hostile clients")."""

    # a request head (request line and headers) must be complete this long after the
    # connection was accepted (a later request on it: after its first byte), else it is closed
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # a request body must be read within this: else a 408
    # open connections at once; past it a new one is answered 503 and closed. Each holds a file
    # descriptor and, streaming, up to a 64 KiB write buffer and its kernel socket buffers:
    # 4096 of them stay well inside the chart's 4 GiB (http_edge.connection_cap fits it to
    # the process's descriptor limit)
    max_connections: int = 4096
    # a response the client has not read from for this long (its write buffer full all that
    # time) is abandoned, which aborts its request on the workers
    stream_write_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class GatewaySettings:
    scheduler_address: str
    models: dict[str, str] = field(hash=False)  # served model name → checkpoint dir or .gguf
    host: str = "127.0.0.1"
    port: int = 8000
    # /health, /ready and /metrics on this port of ``host`` as well (no key: kubelet probes and
    # Prometheus carry none), and /metrics off the API port; None: /metrics on the API port,
    # behind the API keys when there are some
    metrics_port: int | None = None
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 600.0  # no request runs longer than this
    # a worker that sends a stream nothing for this long is treated as failed (the stream
    # resumes elsewhere); the wait for a first token adds prefill_progress_s_per_token per
    # prompt token the worker must compute (orchestrator.Progress)
    progress_timeout_s: float = 10.0
    prefill_progress_s_per_token: float = 0.01
    generate_stream: bool = True  # Generate over one long-lived stream per worker (else unary)
    log_level: str = "info"
    cpus: tuple[int, ...] = ()  # pin every thread here once serving (shared/affinity.py)
    limits: InputLimits = field(default_factory=InputLimits)  # counts per request (limits.py)
    edge: EdgeLimits = field(default_factory=EdgeLimits)  # time and connection bounds per client
    # how tool_choice "auto" replies are read into tool calls (tool_parsers.PARSERS); None:
    # "auto" is refused, as vLLM without --tool-call-parser ("required" and a named function
    # need no parser)
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; known: "
                             f"{', '.join(sorted(PARSERS))}")  # fmt: skip
        if not self.models:
            raise ValueError("the gateway needs at least one model (name → tokenizer dir)")
        if self.max_body_bytes <= 0 or self.request_timeout_s <= 0:
            raise ValueError("max_body_bytes and request_timeout_s must be > 0")
        if self.progress_timeout_s <= 0 or self.prefill_progress_s_per_token < 0:
            raise ValueError("progress_timeout_s must be > 0, prefill_progress_s_per_token >= 0")
