"""Drain: SIGTERM (what Kubernetes sends a pod it scales down or replaces) to a worker in the
middle of 16 streaming requests of disaggregated prompts. The worker stops taking new
requests at once (the scheduler routes around it), lets what runs there finish, a prefill
worker serves the pulls of the KV it still holds, and nothing fails: every output equals the
offline engine's. When the drain timeout is shorter than what runs, the rest ends with the
status the gateway resumes elsewhere, and still nothing fails."""

import json
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tests.e2e.conftest import (
    StreamLoad,
    internal_channel,
    long_prompt,
    running_cluster,
    scheduler_metric,
    wait_for,
    worker_health,
)

if TYPE_CHECKING:
    from baton import LLM

MAX_TOKENS = 24


def _setup(tiny_model: Path, tmp_path: Path, offline: "LLM", max_tokens: int = MAX_TOKENS):  # type: ignore[no-untyped-def]
    """Prompts of 100-156 tokens, every one disaggregated: P/D from 32 uncached tokens, a
    prefill queue that never counts as busy, and no pending entries (with the workers'
    --no-prefix-caching, a prompt seen before is not taken for cached on the decode side)."""
    from baton import SamplingParams

    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32, "max_prefill_queue": 64},
                                  "pending": {"ttl_s": 0}}))  # fmt: skip
    prompts = [long_prompt(tiny_model, 100 + 8 * k, f"drain-{k}") for k in range(8)]
    refs = {p: o.outputs[0].text for p, o in zip(prompts, offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens)), strict=True)}  # fmt: skip
    return policy, prompts, refs


def _resumes(cluster, stage: str) -> float:  # type: ignore[no-untyped-def]
    """The gateway's resumes of one stage (mid_stream: a stream cut short on its worker)."""
    base = (cluster.url or "").removesuffix("/v1")
    key = f'baton_gateway_resumes_total{{stage="{stage}"}}'
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def _drained_cleanly(load: StreamLoad, refs: dict[str, str], at: float) -> None:
    assert load.failed() == [], load.failed()[:3]
    assert all(o.text == refs[o.prompt] for o in load.ok()), "an output differs"
    assert [o for o in load.outcomes if o.start < at < o.end], "none in flight at the SIGTERM"


def test_sigterm_to_a_decode_worker_mid_stream_fails_nothing(
    tiny_model: Path, tmp_path: Path, offline: "LLM"
) -> None:
    policy, prompts, refs = _setup(tiny_model, tmp_path, offline)
    flags = ["--routing-policy", str(policy), "--no-prefix-caching"]
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "2",
                         *flags) as cluster:  # fmt: skip
        decode = cluster.procs["decode-0"]

        def prompt(c: int, i: int) -> str:
            return prompts[(c + i) % len(prompts)]

        with StreamLoad(
            cluster.url or "", clients=16, max_tokens=MAX_TOKENS, prompt=prompt
        ) as load:
            wait_for(lambda: len(load.ok()) >= 16, 60.0, "load to flow")
            wait_for(lambda: worker_health(cluster, "decode-0").num_running > 0, 10.0,
                     "requests running on decode-0")  # fmt: skip
            at = time.monotonic()
            decode.send_signal(signal.SIGTERM)
            decode.wait(timeout=40)  # it drained (its 30 s drain timeout is a bound, not a wait)
            drained_in = time.monotonic() - at
            wait_for(lambda: len(load.ok(since=at + drained_in)) >= 32, 60.0,
                     "requests after the drain")  # fmt: skip
        _drained_cleanly(load, refs, at)
        # what ran on decode-0 finished there: nothing was cut short and resumed elsewhere
        # (a request routed to it as it began draining is refused at once and resumed)
        assert _resumes(cluster, "mid_stream") == 0
        print(f"decode-0 drained in {drained_in:.2f} s; {len(load.ok())} requests, none failed; "
              f"{_resumes(cluster, 'refused'):.0f} refused while draining")  # fmt: skip


def test_sigterm_to_a_prefill_worker_holding_kv_fails_nothing(
    tiny_model: Path, tmp_path: Path, offline: "LLM"
) -> None:
    """prefill-0 gets SIGTERM while 16 streams run through the gateway and while it holds the
    KV of a finished prefill nobody has pulled yet: one the test made itself (a Prefill call
    with keep_kv and no decode leg), so that nothing else can pull it or let it go. It stays up
    while that KV is leased (new prompts go to prefill-1, or prefill on the decode worker),
    serves the pull when the decode leg comes, and only then exits: the hand-off's output
    equals the offline engine's, no pull fails, no request fails.

    (An earlier form held a decode worker with SIGSTOP so that prefill-0's leases for it
    waited; whether prefill-0 then held any such lease at the SIGTERM was up to routing and
    timing, and on a loaded 2-core machine it sometimes held only leases the other decode
    worker pulled a moment later, so it rightly exited.)"""
    from baton import SamplingParams
    from shared.protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from shared.text.tokenizer import TextTokenizer

    policy, prompts, refs = _setup(tiny_model, tmp_path, offline)
    ids = TextTokenizer(tiny_model).encode(long_prompt(tiny_model, 120, "held"))
    ref = offline.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]  # fmt: skip
    params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    flags = ["--routing-policy", str(policy), "--worker-metrics", "--no-prefix-caching"]
    with running_cluster(tiny_model, 0, "--prefill-workers", "2", "--decode-workers", "2",
                         *flags) as cluster:  # fmt: skip
        prefill = cluster.procs["prefill-0"]

        def prompt(c: int, i: int) -> str:
            return prompts[(c + i) % len(prompts)]

        with StreamLoad(cluster.url or "", clients=16, max_tokens=MAX_TOKENS,
                        prompt=prompt) as load:  # fmt: skip
            wait_for(lambda: len(load.ok()) >= 16, 60.0, "load to flow")
            with internal_channel(cluster.ready["prefill-0"]["address"]) as ch:
                handoff = worker_pb2_grpc.WorkerStub(ch).Prefill(
                    worker_pb2.PrefillRequest(request_id="held-p", prompt_token_ids=ids,
                                              params=params, keep_kv=True),
                    timeout=30,
                )  # fmt: skip
            assert handoff.HasField("kv_handle") and not handoff.finish_reason
            at = time.monotonic()
            prefill.send_signal(signal.SIGTERM)
            wait_for(lambda: not worker_health(cluster, "prefill-0").serving, 5.0, "draining")
            time.sleep(1.5)
            assert prefill.poll() is None, "prefill-0 left with its KV still leased"
            with internal_channel(cluster.ready["decode-0"]["address"]) as ch:
                responses = list(worker_pb2_grpc.WorkerStub(ch).Generate(
                    worker_pb2.GenerateRequest(
                        request_id="held", prompt_token_ids=ids, params=params,
                        remote_kv=handoff.kv_handle, first_token_id=handoff.first_token_id,
                    ),
                    timeout=30,
                ))  # fmt: skip
            prefill.wait(timeout=40)
            drained_in = time.monotonic() - at
            wait_for(lambda: len(load.ok(since=at + drained_in)) >= 32, 60.0,
                     "requests after the drain")  # fmt: skip
        decoded = [t for r in responses for d in r.deltas for t in d.token_ids]
        assert [handoff.first_token_id, *decoded] == list(ref.outputs[0].token_ids)
        assert not any(r.error for r in responses)
        _drained_cleanly(load, refs, at)
        failures = sum(scheduler_metric(cluster, "baton_worker_kv_pull_failures_total", name)
                       for name in ("decode-0", "decode-1"))  # fmt: skip
        assert failures == 0, f"{failures} pulls failed: the prefill worker left with KV leased"
        print(
            f"prefill-0 drained in {drained_in:.2f} s (its KV pulled after 1.5 s); "
            f"{len(load.ok())} requests, none failed"
        )


def test_a_drain_that_times_out_ends_the_rest_resumably(
    tiny_model: Path, tmp_path: Path, offline: "LLM"
) -> None:
    """A 0.5 s drain timeout against streams of 860 tokens (some 3 s of decode on a 2-core
    machine), sent while every client's stream is early in its decode: what is still running on
    the decode worker then ends with UNAVAILABLE, and the gateway resumes each on the other one
    (the client sees one stream, with the same text).

    The moment is chosen from what the clients hold, in rounds that start together, not from
    the worker's counters: those come with its heartbeat, up to a poll late, and a SIGTERM
    sent that late could land in the last half second of decode-0's streams, which then all
    finished inside the drain timeout and nothing was cut short (this failed in CI). Without
    rounds, a loaded machine could pass the first moment when every stream was early and
    never see another."""
    from shared.text.tokenizer import TextTokenizer

    max_tokens, clients = 860, 8  # the longest prompt (156) + 860 fits --max-model-len 1024
    policy, prompts, refs = _setup(tiny_model, tmp_path, offline, max_tokens=max_tokens)
    tok = TextTokenizer(tiny_model)
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "2",
                         "--routing-policy", str(policy), "--drain-timeout", "0.5",
                         "--max-restarts", "0", "--no-prefix-caching") as cluster:  # fmt: skip
        decode = cluster.procs["decode-0"]

        def prompt(c: int, i: int) -> str:
            return prompts[(c + i) % len(prompts)]

        def early_in_decode() -> bool:
            """decode-0 runs requests, and every client's stream has a few decoded tokens
            (counted by encoding its text so far; past its KV pull: a drain that ends a
            request before its first decoded token is a refusal) and at most 300 of its 860:
            whatever decode-0 runs is among them (a request it began since has no first chunk
            yet, and then not every client streams), with over 500 tokens to go, seconds past
            the drain timeout."""
            if worker_health(cluster, "decode-0").num_running == 0:
                return False
            streams = load.streaming()  # read after the worker's answer
            lengths = [len(tok.encode(o.text)) for o in streams]
            return len(streams) == clients and all(3 <= n <= 300 for n in lengths)

        with StreamLoad(cluster.url or "", clients=clients, max_tokens=max_tokens,
                        prompt=prompt, lockstep=True) as load:  # fmt: skip
            wait_for(early_in_decode, 60.0, "every stream early in its decode")
            at = time.monotonic()
            decode.send_signal(signal.SIGTERM)
            decode.wait(timeout=20)
            wait_for(lambda: len(load.ok(since=at)) >= 8, 120.0, "requests after the drain")
        _drained_cleanly(load, refs, at)
        assert _resumes(cluster, "mid_stream") >= 1, "the drain timeout cut no stream short"
