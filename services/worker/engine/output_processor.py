"""Turns the core's token-level outputs into user-facing ``RequestOutput``s: detokenizes, applies
stop strings (and reports which requests the core must then abort), gathers logprobs, honours
the output kind (cumulative, delta, final only), and folds the ``n`` samples of one request back
together.

A request with ``n > 1`` runs in the core as n child requests ``"{i}_{request_id}"``; child *i*
of a seeded request uses ``seed + i``, so the n samples differ yet stay reproducible.
"""

from dataclasses import dataclass, field

from services.worker.engine.kv_transfer.params import RemoteKV
from services.worker.engine.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ErrorCode,
    SampleLogprobs,
)
from services.worker.engine.outputs import CompletionOutput, Logprob, RequestOutput
from services.worker.engine.params import RequestOutputKind, SamplingParams
from services.worker.engine.tokenizer import Tokenizer
from shared.text.detokenizer import IncrementalDetokenizer


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The core requests for one user request: itself, or n children."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for i in range(params.n):
        seed = params.seed + i if params.seed is not None else None
        # the prompt is the same for all: the first child alone reports its logprobs (the
        # others may take their prompt from the prefix cache)
        prompt_logprobs = params.prompt_logprobs if i == 0 else None
        child = params.clone(n=1, seed=seed, prompt_logprobs=prompt_logprobs)
        children.append(
            EngineCoreRequest(
                f"{i}_{request.request_id}",
                request.prompt_token_ids,
                child,
                request.arrival_time,
                request.cache_salt,
            )
        )
    return children


@dataclass
class _Sample:
    """One of the n samples of a request, as the output processor tracks it."""

    index: int
    detok: IncrementalDetokenizer | None  # None when the request asked for token ids only
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _Sample]  # core request id → sample
    num_cached_tokens: int = 0
    queued_seconds: float = 0.0
    error: str | None = None
    error_code: ErrorCode | None = None
    kv_handle: RemoteKV | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # when asked for
    prompt_logprobs_sent: bool = False  # with the first output of a DELTA request

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # core request ids that a stop string ended


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._core_to_request: dict[str, str] = {}

    def add_request(
        self, prompt: str | None, request: EngineCoreRequest, core_requests: list[EngineCoreRequest]
    ) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        samples = {
            c.request_id: _Sample(
                index=i,
                detok=self._detokenizer(request.prompt_token_ids, c.sampling_params),
                logprobs=[] if c.sampling_params.logprobs is not None else None,
            )
            for i, c in enumerate(core_requests)
        }
        params = request.sampling_params
        self._requests[request.request_id] = _RequestState(
            request.request_id, prompt, request.prompt_token_ids, params, samples,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )  # fmt: skip
        for c in core_requests:
            self._core_to_request[c.request_id] = request.request_id

    def _detokenizer(
        self, prompt_ids: list[int], p: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if not p.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer.tokenizer,
            prompt_ids,
            p.stop,
            p.include_stop_str_in_output,
            p.skip_special_tokens,
        )

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the core request ids to abort."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        for core_id in state.samples:
            self._core_to_request.pop(core_id, None)
        return list(state.samples)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        changed: dict[str, list[str]] = {}
        to_abort: list[str] = []
        for out in outputs:
            rid = self._core_to_request.get(out.request_id)
            if rid is None:
                continue  # aborted meanwhile
            state = self._requests[rid]
            if self._apply(state, state.samples[out.request_id], out):
                to_abort.append(out.request_id)
            if out.new_token_ids or out.finish_reason is not None:  # not a prompt chunk alone
                changed.setdefault(rid, []).append(out.request_id)
        results = []
        for rid, core_ids in changed.items():
            state = self._requests[rid]
            result = self._make_output(state, core_ids)
            if result is not None:
                results.append(result)
            if state.finished:
                self.abort(rid)
        return ProcessedOutputs(results, to_abort)

    def _apply(self, state: _RequestState, sample: _Sample, out: EngineCoreOutput) -> bool:
        """Fold one core output into a sample; True when a stop string ended it here."""
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        state.queued_seconds = max(state.queued_seconds, out.queued_seconds)
        if out.kv_handle is not None:
            state.kv_handle = out.kv_handle
        if out.error is not None:
            state.error, state.error_code = out.error, out.error_code
        decode = sample.detok is not None
        if state.prompt_logprobs is not None and out.new_prompt_logprobs:
            state.prompt_logprobs += [
                self._logprob_dict(lp, decode) for lp in out.new_prompt_logprobs
            ]
        sample.token_ids += out.new_token_ids
        if sample.logprobs is not None and out.new_logprobs:
            sample.logprobs += [self._logprob_dict(lp, decode) for lp in out.new_logprobs]
        stop = sample.detok.update(out.new_token_ids) if sample.detok is not None else None
        if stop is not None:  # the text was cut here, whatever else ended the request
            sample.finish_reason, sample.stop_reason = "stop", stop
            return out.finish_reason is None  # still running in the core: abort it
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = str(out.finish_reason), out.stop_reason
        return False

    def _logprob_dict(self, lp: SampleLogprobs, decode: bool) -> dict[int, Logprob]:
        ranks = [lp.sampled_rank, *range(1, len(lp.token_ids))]
        return {
            tok: Logprob(value, rank, self.tokenizer.token_text(tok) if decode else None)
            for tok, value, rank in zip(lp.token_ids, lp.logprobs, ranks, strict=True)
        }

    def _make_output(self, state: _RequestState, changed: list[str]) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        ids = changed if kind == RequestOutputKind.DELTA else list(state.samples)
        completions = [
            self._completion(state.samples[i], delta=kind == RequestOutputKind.DELTA) for i in ids
        ]
        prompt_logprobs = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA and state.prompt_logprobs_sent:
            prompt_logprobs = None
        state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=sorted(completions, key=lambda c: c.index),
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            error=state.error,
            error_code=state.error_code,
            metrics={"queued_seconds": state.queued_seconds},
            kv_handle=state.kv_handle,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _completion(s: _Sample, delta: bool) -> CompletionOutput:
        done = s.finish_reason is not None
        new_text = s.detok.new_text(done) if s.detok is not None else ""
        if delta:
            start, s.num_sent_tokens = s.num_sent_tokens, len(s.token_ids)
            token_ids, text = s.token_ids[start:], new_text
            logprobs = s.logprobs[start:] if s.logprobs is not None else None
        else:
            token_ids, logprobs = list(s.token_ids), s.logprobs
            text = s.detok.released_text if s.detok is not None else ""
        return CompletionOutput(s.index, text, token_ids, s.finish_reason, s.stop_reason, logprobs)
