"""What users get back, shaped like vLLM's so code can switch: ``RequestOutput`` with
``.prompt_token_ids``, ``.prompt_logprobs`` (None for the first prompt token, then one
{token_id: Logprob} dict per prompt token) and ``.outputs[i]`` (``CompletionOutput``: token_ids,
text, finish_reason, logprobs as one {token_id: Logprob} dict per generated token)."""

from dataclasses import dataclass, field

from services.worker.engine.kv_transfer.params import RemoteKV
from services.worker.engine.messages import ErrorCode


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token at that position
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    error_code: ErrorCode | None = None  # why it ended in error
    metrics: dict[str, float] = field(default_factory=dict)
    kv_handle: RemoteKV | None = None  # a finished prefill leg: where its KV waits
    # with SamplingParams.prompt_logprobs, once the whole prompt has run (with the first output
    # of a DELTA request, with every output of a CUMULATIVE one)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
