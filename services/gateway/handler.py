"""One OpenAI request end to end, independent of HTTP: validate against the model's limits,
tokenize (chat template for chat), build one ``Job`` per prompt, run them through the
orchestrator, and produce the response body or the stream of chunks.

    body ──▶ prompts (token ids) ──▶ Jobs ──▶ Orchestrator.run ×P ──▶ merged ChoiceDeltas
                                                                      ├─▶ Formatter.response
                                                                      └─▶ Formatter.chunk (SSE)

A chat request with tools reads each choice's text through a ``tools.ToolReader`` on the way
out: content and tool calls (streamed as OpenAI's tool-call deltas).
"""

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace

from services.gateway import errors, metrics
from services.gateway.catalog import ModelCatalog
from services.gateway.choice import ChoiceDelta, TokenLogprob
from services.gateway.limits import check_limits
from services.gateway.merge import merge
from services.gateway.orchestrator import Job, Orchestrator
from services.gateway.responses import Choice, Formatter, Usage
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.settings import InputLimits
from services.gateway.tool_parsers import ToolCallDelta
from services.gateway.tools import ToolPlan, ToolReader
from shared.protos.baton.v1 import common_pb2
from shared.text.detokenizer import TokenText, token_texts
from shared.text.tokenizer import ChatTemplateError, TextTokenizer

Body = CompletionRequest | ChatCompletionRequest
logger = logging.getLogger(__name__)


@dataclass
class Plan:
    jobs: list[Job]
    formatter: Formatter
    num_logprobs: int | None
    echo: list[str]  # completions with echo: each prompt's text, prepended to its choices
    n: int
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, beside the choices
    # echo with logprobs: each prompt's tokens with the text each adds (they join to its echo)
    echo_tokens: list[list[TokenText]] | None = None
    tools: ToolPlan | None = None  # chat with tools: how replies are read (tools.py)
    tool_parser: str | None = None  # the gateway's --tool-call-parser

    def tool_reader(self) -> ToolReader | None:
        """A reader for one choice's reply, when tools may be called."""
        if self.tools is None or self.tools.mode == "none":
            return None
        return ToolReader(self.tools, self.tool_parser)

    def echo_logprobs(self, p: int, prompt: list[TokenLogprob] | None) -> list[TokenLogprob]:
        """Prompt ``p``'s echoed logprobs, one per token: the first has none; each shows the
        top ``num_logprobs`` and the text its token adds to the echoed prompt."""
        assert self.echo_tokens is not None
        if prompt is None:  # (a worker that does not know the field)
            raise errors.APIError(502, "the worker sent no prompt logprobs",
                                  type="server_error", code="upstream_error")  # fmt: skip
        first = self.jobs[p].prompt_ids[0]
        entries = [TokenLogprob(first, None, []), *(replace(lp) for lp in prompt)]
        for lp, t in zip(entries, self.echo_tokens[p], strict=True):
            lp.text, lp.offset, lp.top = t.text, t.offset, lp.top[: self.num_logprobs or 0]
        return entries


class Handler:
    def __init__(
        self,
        orchestrator: Orchestrator,
        catalog: ModelCatalog,
        timeout_s: float,
        limits: InputLimits,
        tool_call_parser: str | None = None,
    ):
        self.orchestrator = orchestrator
        self.catalog = catalog
        self.timeout_s = timeout_s
        self.limits = limits
        self.tool_call_parser = tool_call_parser  # tool_parsers.PARSERS' name, or None

    async def plan(self, body: Body, request_id: str) -> Plan:
        check_limits(self.limits, body)
        if body.model not in self.catalog.tokenizers:
            raise errors.model_not_found(body.model, self.catalog.served)
        tok = self.catalog.tokenizers[body.model]
        limits = await self.catalog.limits(body.model)
        if limits is None:
            raise errors.no_worker(f"no live worker serves model {body.model!r}")
        chat = isinstance(body, ChatCompletionRequest)
        keep = _truncation(body.truncate_prompt_tokens, limits.max_model_len)
        tool_plan = None
        if isinstance(body, ChatCompletionRequest):
            tool_plan = self._tool_plan(body)
            messages = [m.as_template_input() for m in body.messages]
            try:
                text = tok.render_chat_template(messages, body.add_generation_prompt,
                    body.continue_final_message, body.chat_template_kwargs,
                    tool_plan.template_tools() if tool_plan is not None else None)  # fmt: skip
            except ChatTemplateError as e:
                raise errors.bad_request(str(e), "messages") from None
            prompts = [_encode(tok, text, body.add_special_tokens, keep)]
            limit, num_logprobs, echo = body.output_limit, body.num_logprobs, False
        else:
            prompts = [
                _encode(tok, p, body.add_special_tokens, keep) if isinstance(p, str)
                else p[-keep:] if keep is not None else p
                for p in body.prompts()
            ]  # fmt: skip
            limit, num_logprobs, echo = body.max_tokens, body.logprobs, body.echo
        deadline = time.monotonic() + self.timeout_s
        echo_logprobs = echo and num_logprobs is not None
        wanted = [n for n in (body.prompt_logprobs, num_logprobs if echo_logprobs else None)
                  if n is not None]  # fmt: skip
        params = _params(body, limit, num_logprobs, max(wanted, default=None))
        if tool_plan is not None and self.tool_call_parser is not None:
            strict = tool_plan.auto_grammar(self.tool_call_parser)
            if strict is not None:  # (its schemas were checked with the request's)
                params.structured_output.CopyFrom(strict.spec)
        biased = [int(k) for k in body.logit_bias or ()]
        fields = {"stop_token_ids": body.stop_token_ids,
                  "allowed_token_ids": body.allowed_token_ids, "logit_bias": biased}  # fmt: skip
        _check_vocabulary(prompts, fields, limits.vocab_size)
        jobs = []
        for i, ids in enumerate(prompts):
            _check_length(ids, limit, limits.max_model_len)
            jobs.append(
                Job(
                    request_id=f"{request_id}-{i}-{uuid.uuid4().hex[:6]}",
                    model=body.model, prompt_ids=ids, params=params, n=body.n,
                    stop=body.stop_strings, include_stop=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens, cache_salt=body.cache_salt,
                    deadline=deadline, block_size=limits.block_size, trace_id=request_id,
                )
            )  # fmt: skip
        prefix = "chatcmpl" if chat else "cmpl"
        formatter = Formatter(f"{prefix}-{request_id}", body.model, chat, tok)
        echo_tokens = None
        if echo_logprobs:  # the echoed text is what its tokens' entries add up to
            echo_tokens = [token_texts(tok.tokenizer, ids) for ids in prompts]
            echo_texts = ["".join(t.text for t in tokens) for tokens in echo_tokens]
        else:
            echo_texts = [tok.decode(ids) for ids in prompts] if echo else []
        return Plan(jobs, formatter, num_logprobs, echo_texts, body.n, body.prompt_logprobs,
                    echo_tokens, tool_plan, self.tool_call_parser)  # fmt: skip

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        tool_plan = body.tool_plan
        if tool_plan is not None and tool_plan.mode == "auto" and self.tool_call_parser is None:
            raise errors.bad_request(
                'tool_choice "auto" (the default with tools) needs a tool call parser: start '
                "the gateway with --tool-call-parser (hermes or llama3_json); tool_choice "
                '"required", a named function and "none" need none', "tool_choice",
            )  # fmt: skip
        return tool_plan

    async def complete(self, plan: Plan) -> dict:
        choices = [Choice(i) for i in range(len(plan.jobs) * plan.n)]
        usage = _usage(plan)
        async for p, d in self._merged(plan):
            choices[p * plan.n + d.index].add(d)
            _count(usage, d)
        for choice in choices:
            reader = plan.tool_reader()
            if reader is not None:  # the whole reply at once: the same calls as streamed
                parsed = reader.feed(choice.text)
                parsed += reader.finish()
                choice.text, choice.tool_calls = parsed.content, reader.calls
                choice.finish_reason = reader.finish_reason(choice.finish_reason)
        for p, text in enumerate(plan.echo):
            for i in range(plan.n):
                choice = choices[p * plan.n + i]
                if plan.echo_tokens is not None:
                    _shift(choice.logprobs, len(text))
                    echoed = plan.echo_logprobs(p, choice.prompt_logprobs)
                    choice.logprobs = echoed + choice.logprobs
                choice.text = text + choice.text
        return plan.formatter.response(choices, usage, plan.prompt_logprobs)

    async def stream(self, plan: Plan, include_usage: bool) -> AsyncGenerator[str, None]:
        """SSE lines; raises APIError (the caller turns one before the first line into a
        status, and a later one into an error event)."""
        usage = _usage(plan)
        started: set[int] = set()
        readers: dict[int, ToolReader | None] = {}
        want_logprobs = plan.num_logprobs is not None
        async for p, d in self._merged(plan):
            index = p * plan.n + d.index
            _count(usage, d)
            first = index not in started
            if plan.echo_tokens is not None:  # the choice's text follows the echoed prompt's
                _shift(d.logprobs, len(plan.echo[p]))
                if first:
                    d.logprobs = plan.echo_logprobs(p, d.prompt_logprobs) + d.logprobs
            if first and plan.echo:
                d.text = plan.echo[p] + d.text
            if first:
                readers[index] = plan.tool_reader()
            reader = readers[index]
            calls = _read_tools(reader, d) if reader is not None else []
            if not (d.text or calls or d.finish_reason or d.logprobs or first):
                continue
            started.add(index)
            yield sse(plan.formatter.chunk(index, d, first, want_logprobs, calls))
        if include_usage:
            yield sse(plan.formatter.usage_chunk(usage))
        yield SSE_DONE

    async def _merged(self, plan: Plan) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Deltas of every job, tagged with the job's index, with TTFT/ITL/E2E recorded."""
        start = time.perf_counter()
        last: float | None = None
        sources = [self.orchestrator.run(j, plan.num_logprobs) for j in plan.jobs]
        async for p, d in merge(sources):
            now = time.perf_counter()
            if d.token_ids:
                if last is None:
                    metrics.TTFT.observe(now - start)
                else:
                    metrics.ITL.observe(now - last)
                last = now
            yield p, d
        seconds = time.perf_counter() - start
        metrics.E2E.observe(seconds)
        logger.info("%s done: %d prompt(s) × n=%d in %.1f ms", plan.formatter.id, len(plan.jobs),
                    plan.n, 1e3 * seconds)  # fmt: skip


def _read_tools(reader: ToolReader, d: ChoiceDelta) -> list[ToolCallDelta]:
    """A streamed delta's text read for tool calls: ``d`` keeps the content, its finish reason
    becomes OpenAI's; the tool-call deltas it carries are returned."""
    parsed = reader.feed(d.text)
    if d.finish_reason is not None:
        parsed += reader.finish()
        d.finish_reason = reader.finish_reason(d.finish_reason)
    d.text = parsed.content
    return parsed.tool_calls


def _shift(logprobs: list[TokenLogprob], by: int) -> None:
    for lp in logprobs:
        lp.offset += by


def _params(
    body: Body, limit: int | None, num_logprobs: int | None, prompt_logprobs: int | None
) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        n=1, top_k=max(body.top_k or 0, 0), min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos, allowed_token_ids=body.allowed_token_ids or [],
        bad_words=body.bad_words or [],
    )  # fmt: skip
    for name in ("temperature", "top_p", "repetition_penalty", "seed"):
        value = getattr(body, name)
        if value is not None:
            setattr(p, name, value)
    if limit is not None:
        p.max_tokens = limit
    if num_logprobs is not None:
        p.logprobs = num_logprobs
    if prompt_logprobs is not None:
        p.prompt_logprobs = prompt_logprobs
    for token, bias in (body.logit_bias or {}).items():
        p.logit_bias[int(token)] = bias
    if body.grammar is not None:
        p.structured_output.CopyFrom(body.grammar.spec)
    if limit is not None and body.min_tokens > limit:
        raise errors.bad_request(
            f"min_tokens ({body.min_tokens}) > max_tokens ({limit})", "min_tokens"
        )
    return p


def _truncation(keep: int | None, max_model_len: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens``, checked against the context as vLLM does."""
    if keep is not None and keep > max_model_len:
        raise errors.bad_request(
            f"truncate_prompt_tokens ({keep}) is greater than the model's maximum context length "
            f"({max_model_len})", "truncate_prompt_tokens",
        )  # fmt: skip
    return keep


def _encode(tok: TextTokenizer, text: str, add_special_tokens: bool, keep: int | None) -> list[int]:
    """``text``'s token ids; with ``keep``, only its last ``keep``, as vLLM truncates (Hugging
    Face's left truncation): the tokenizer's own leading tokens (a BOS) stay, the text's first
    tokens go.

        ids:   [BOS] t0 t1 … t(n-k+1) … t(n-1)      keep = k
        kept:  [BOS]         t(n-k+1) … t(n-1)      (k tokens in all)
    """
    ids = tok.encode(text, add_special_tokens)
    if keep is None or len(ids) <= keep:
        return ids
    if add_special_tokens:
        plain = tok.encode(text, False)
        lead = len(ids) - len(plain)
        if 0 < lead < keep and ids[lead:] == plain:
            return ids[:lead] + plain[len(plain) - (keep - lead) :]
    return ids[-keep:]


def _check_vocabulary(
    prompts: list[list[int]], fields: dict[str, list[int] | None], vocab: int
) -> None:
    """Token ids the model has (``vocab``: 0 when its workers do not say)."""
    if not vocab:
        return
    named = [(param, ids or []) for param, ids in fields.items()]
    for param, ids in [*(("prompt", p) for p in prompts), *named]:
        if ids and max(ids) >= vocab:  # (max runs in C: a long prompt costs microseconds)
            bad = next(t for t in ids if t >= vocab)
            raise errors.bad_request(
                f"token id {bad} is outside the model's vocabulary [0, {vocab})", param
            )


def _check_length(ids: list[int], limit: int | None, max_model_len: int) -> None:
    if not ids:
        raise errors.bad_request("the prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise errors.bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(ids)} tokens, which leaves no room to generate", "prompt",
        )  # fmt: skip
    if limit is not None and len(ids) + limit > max_model_len:
        raise errors.bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids) + limit} tokens ({len(ids)} in the prompt, {limit} in the "
            "completion). Please reduce the prompt or max_tokens.", "max_tokens",
        )  # fmt: skip


def _usage(plan: Plan) -> Usage:
    usage = Usage(prompt_tokens=sum(len(j.prompt_ids) for j in plan.jobs))
    metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
    return usage


def _count(usage: Usage, d: ChoiceDelta) -> None:
    usage.completion_tokens += len(d.token_ids)
    metrics.COMPLETION_TOKENS.inc(len(d.token_ids))
    if d.num_cached_tokens is not None and d.index == 0:
        usage.cached_tokens += d.num_cached_tokens
        metrics.CACHED_TOKENS.inc(d.num_cached_tokens)


SSE_DONE = "data: [DONE]\n\n"


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
