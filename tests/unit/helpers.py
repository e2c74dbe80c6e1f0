"""Builders for engine bookkeeping tests (no model, no torch)."""

from services.worker.engine.config import CacheConfig, SchedulerConfig
from services.worker.engine.kv_transfer.scheduler_side import KVTransferBookkeeping
from services.worker.engine.params import SamplingParams
from services.worker.engine.request import Request
from services.worker.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from services.worker.engine.sched.scheduler import Scheduler
from shared.ids import RequestId

EOS = 0


def make_request(
    rid: str, prompt_len: int, max_tokens: int = 4, first_token: int = 1, **params: object
) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(RequestId(rid), prompt, sp, (EOS,), block_size=4, max_model_len=256)


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 32,
    max_num_seqs: int = 8,
    chunked: bool = True,
    caching: bool = True,
    transfer: KVTransferBookkeeping | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, budget, chunked, max_model_len=256),
        CacheConfig(4, caching, num_blocks, None, 0.9),
        num_blocks,
        transfer,
    )


def fake_run(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a model runner would report for the step just scheduled: a token for every request
    the step computes up to its end (the scheduler counted it as a placeholder)."""
    ids = [r.req_id for r in out.new_reqs] + [r.req_id for r in out.cached_reqs]
    sampled = []
    for rid in ids:
        req = sched.requests[RequestId(rid)]
        samples = req.num_computed_tokens == req.num_tokens_with_placeholders - 1
        sampled.append([token] if req.num_output_placeholders and samples else [])
    return ModelRunnerOutput(ids, sampled, [None] * len(ids))
