"""The scheduler → model runner hand-off for one step, and the runner's answer.

The runner keeps per-request state between steps, so the scheduler sends a request's prompt
and parameters once (``NewRequestData``) and afterwards only what changed (``CachedRequestData``).
"""

from dataclasses import dataclass, field

from services.worker.engine.kv_cache.manager import BlockIds
from services.worker.engine.kv_transfer.params import KVLoad
from services.worker.engine.messages import SampleLogprobs
from services.worker.engine.params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt, plus any output tokens it arrives with
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: BlockIds  # the whole block table so far, per KV cache group
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hits)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: BlockIds  # per group, blocks to append; the whole tables when resumed
    num_computed_tokens: int  # before this step
    resumed_from_preemption: bool  # the runner must replace, not extend, its block table


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req id → tokens this step
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_loads: list[KVLoad] = field(default_factory=list)  # KV pulls to start (decode side)
    # requests that sample under a grammar this step: the runner runs the step's forward pass
    # and waits for their bitmask (``Executor.sample``) before it samples
    structured_req_ids: list[str] = field(default_factory=list)


@dataclass
class PromptLogprobsChunk:
    """The logprobs a step computed for a part of one prompt: ``entries[i]`` is about the prompt
    token at position ``start + i + 1``, predicted at position ``start + i`` (that token first,
    then the top-N; ``sampled_rank`` is its rank)."""

    start: int
    entries: list[SampleLogprobs]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)  # in the order the runner batched them
    sampled_token_ids: list[list[int]] = field(default_factory=list)  # empty: a prefill chunk
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)
    # requests that asked for prompt logprobs and ran prompt tokens this step
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
