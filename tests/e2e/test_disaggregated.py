"""Disaggregated prefill/decode through the whole system: a prefill worker and a decode
worker (KV pulled over NIXL/UCX between the two processes), driven with the openai client.
Output must equal the offline engine's; leases end; a dead prefill worker costs nothing."""

import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from baton import LLM, SamplingParams
from baton.launcher import Cluster
from shared.protos.baton.v1 import worker_pb2
from tests.e2e.conftest import (
    disaggregated_routes,
    list_workers,
    long_prompt,
    running_cluster,
    scheduler_metric,
    wait_for,
    worker_health,
)

MODEL = "qwen3"


@pytest.fixture(scope="module")
def pd_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--routing-policy", str(policy)) as c:  # fmt: skip
        yield c


def test_long_prompts_are_disaggregated_and_equal_offline(
    pd_cluster: Cluster, offline: LLM, tiny_model: Path
) -> None:
    c = openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=60)
    before = disaggregated_routes(pd_cluster)
    for i in range(3):
        prompt = long_prompt(tiny_model, 100 + 40 * i, f"pd-{i}")
        ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=20, logprobs=2))
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                   logprobs=2)  # fmt: skip
        want_out = ref[0].outputs[0]
        assert out.choices[0].text == want_out.text
        lps = out.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
        want = [lp[t].logprob for lp, t in zip(want_out.logprobs or [], want_out.token_ids,
                                                 strict=True)]  # fmt: skip
        assert lps == pytest.approx(want, abs=1e-4)
        streamed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                        stream=True)  # fmt: skip
        assert "".join(ch.choices[0].text for ch in streamed) == ref[0].outputs[0].text
    # each prompt's first request is disaggregated; a repeat may prefill locally on the decode
    # worker once the directory knows it holds the prompt (that depends on heartbeat timing)
    assert disaggregated_routes(pd_cluster) >= before + 3
    # every lease ended: the prefill worker holds no blocks for anyone
    wait_for(lambda: worker_health(pd_cluster, "prefill-0").kv_usage == 0, 5.0, "leases to end")


def test_sequential_requests_do_not_fill_the_prefill_queue(
    pd_cluster: Cluster, tiny_model: Path
) -> None:
    """One request at a time never queues on the prefill worker, so none may overflow to a
    local prefill (``pool_busy``): the scheduler must learn that each finished, not count
    every route until the worker's next heartbeat (it did: the fifth of a quick run overflowed)."""
    c = openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=60)
    name = "baton_scheduler_prefill_decisions_total"

    def decisions(decision: str, reason: str) -> float:
        with contextlib.suppress(AssertionError):  # not exported until it first counts
            return scheduler_metric(
                pd_cluster, f'{name}{{decision="{decision}",reason="{reason}"}}'
            )
        return 0.0

    busy, remote = decisions("local", "pool_busy"), decisions("remote", "long_prompt")
    for i in range(10):
        prompt = long_prompt(tiny_model, 120, f"one-at-a-time-{i}")
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert decisions("local", "pool_busy") == busy
    assert decisions("remote", "long_prompt") == remote + 10


def test_seeded_n_equals_offline(pd_cluster: Cluster, offline: LLM, tiny_model: Path) -> None:
    c = openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=60)
    prompt = long_prompt(tiny_model, 120, "pd-seeded")
    kw = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 10, "seed": 5}
    ref = offline.generate([prompt], SamplingParams(n=2, **kw))[0]  # type: ignore[arg-type]
    out = c.completions.create(model=MODEL, prompt=prompt, n=2, **kw)  # type: ignore[arg-type]
    got = [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)]
    assert got == [o.text for o in ref.outputs]


def test_token_constraints_hold_across_the_hand_off(
    pd_cluster: Cluster, offline: LLM, tiny_model: Path
) -> None:
    """allowed_token_ids, bad_words and logit_bias: the prefill worker samples the first token
    under them (each request here changes it), the decode worker the rest: as the offline
    engine does."""
    before = disaggregated_routes(pd_cluster)
    prompt = long_prompt(tiny_model, 120, "pd-constrained")
    free = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    ids = list(free.token_ids)
    allowed = [t for t in range(100, 110) if t != ids[0]]  # the first token cannot be the same
    word = offline.tokenizer.decode(ids[:1]).strip()  # the first token's word, banned
    assert word, "the tiny model's first token here is a word"
    with openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=60) as c:
        bias = {allowed[0]: 100.0}  # the first token, and every other one
        for extra in ({"allowed_token_ids": allowed}, {"bad_words": [word]}, {"logit_bias": bias}):
            params = SamplingParams(temperature=0, max_tokens=12, **extra)  # type: ignore[arg-type]
            if "logit_bias" in extra:  # OpenAI's keys are strings
                extra = {"logit_bias": {str(t): b for t, b in bias.items()}}
            ref = offline.generate([prompt], params)[0].outputs[0]
            out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body=extra)  # fmt: skip
            assert out.choices[0].text == ref.text != free.text, extra
    assert disaggregated_routes(pd_cluster) >= before + 1


def test_short_prompts_prefill_locally(pd_cluster: Cluster, offline: LLM) -> None:
    c = openai.OpenAI(base_url=pd_cluster.url, api_key="x", max_retries=0, timeout=60)
    before = disaggregated_routes(pd_cluster)
    ref = offline.generate(["hi"], SamplingParams(temperature=0, max_tokens=8))[0]
    out = c.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0)
    assert out.choices[0].text == ref.outputs[0].text
    assert disaggregated_routes(pd_cluster) == before


def test_dead_prefill_worker_costs_nothing(tiny_model: Path, tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--routing-policy", str(policy)) as cluster:  # fmt: skip
        c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60)
        prompt = long_prompt(tiny_model, 150, "no-prefill-pool")
        first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        cluster.procs["prefill-0"].send_signal(signal.SIGKILL)
        for i in range(3):  # routed to the decode worker, which prefills locally
            out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            assert out.choices[0].text == first.choices[0].text, i


def test_client_disconnects_leak_no_blocks(pd_cluster: Cluster, tiny_model: Path) -> None:
    """Disconnect at random points (during the prefill leg, right after the first token,
    i.e. around the transfer, or later): both workers end with every block free, long before
    the 30 s lease and the 30 s transfer timeout."""
    import random

    rng = random.Random(3)
    for i in range(12):
        body = {"model": MODEL, "prompt": long_prompt(tiny_model, 80 + 10 * i, f"gone-{i}"),
                "max_tokens": 200, "stream": True, "ignore_eos": True}  # fmt: skip
        # every third client gives up a few ms in: in the route or the prefill leg
        early = i % 3 == 0
        timeout = httpx.Timeout(30, read=rng.uniform(0.002, 0.015) if early else 30)
        with (
            contextlib.suppress(httpx.ReadTimeout),
            httpx.Client(timeout=timeout) as http,
            http.stream("POST", f"{pd_cluster.url}/completions", json=body) as resp,
        ):
            lines = resp.iter_lines()
            for _ in range(rng.randint(1, 4)):
                next(lines)
    for name in ("prefill-0", "decode-0"):
        wait_for(
            lambda n=name: is_idle(worker_health(pd_cluster, n)),  # type: ignore[misc]
            10.0,
            f"{name} to be idle",
            state=lambda n=name: worker_health(pd_cluster, n),  # type: ignore[misc]
        )


def is_idle(h: worker_pb2.HealthResponse) -> bool:
    return h.kv_usage == 0 and h.num_running == 0 and h.num_waiting == 0


@pytest.mark.parametrize("recompute", [True, False], ids=["default-recompute", "opt-out-error"])
def test_prefill_worker_killed_during_transfer(
    tiny_model: Path, tmp_path: Path, offline: LLM, recompute: bool
) -> None:
    """The prefill worker dies after handing over its KV handle, before the decode worker has
    read the blocks. The decode worker is held (SIGSTOP) from the route until the prefill
    worker is dead, so its READ meets a gone peer. The request ends within its deadline with
    the same text as offline (by default: the decode worker recomputes the prompt), or with
    ``--no-kv-recompute-on-failure`` with a typed 502 (``kv_transfer_failed``); the decode
    worker stays healthy, leaks nothing, and serves what follows."""
    import threading
    import time

    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    extra = [] if recompute else ["--no-kv-recompute-on-failure"]
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--routing-policy", str(policy), *extra) as cluster:  # fmt: skip
        c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=30)
        warm = long_prompt(tiny_model, 120, "warm")  # the decode worker meets its peer
        c.completions.create(model=MODEL, prompt=warm, max_tokens=2, temperature=0)
        prompt = long_prompt(tiny_model, 150, "killed-mid-transfer")
        ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
        result: dict[str, object] = {}

        def request() -> None:
            start = time.monotonic()
            try:
                out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                           temperature=0)  # fmt: skip
                result["text"] = out.choices[0].text
            except openai.APIStatusError as e:
                result["error"] = e
            result["seconds"] = time.monotonic() - start

        decode, prefill = cluster.procs["decode-0"], cluster.procs["prefill-0"]
        decode.send_signal(signal.SIGSTOP)
        try:
            thread = threading.Thread(target=request)
            thread.start()
            # the prefill leg is done when its lease holds the prompt's blocks
            wait_for(lambda: worker_health(cluster, "prefill-0").kv_usage > 0, 10.0, "a lease")
            prefill.send_signal(signal.SIGKILL)
            prefill.wait(timeout=10)
        finally:
            decode.send_signal(signal.SIGCONT)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the request hung"
        assert float(result["seconds"]) < 10  # type: ignore[arg-type]
        if recompute:
            assert result.get("text") == ref.outputs[0].text, result
        else:
            err = result.get("error")
            assert isinstance(err, openai.APIStatusError), result
            assert err.status_code == 502
            assert err.body["code"] == "kv_transfer_failed"  # type: ignore[index]
        # the decode worker is healthy, holds nothing for the failed pull, and serves on
        wait_for(lambda: worker_health(cluster, "decode-0").num_running == 0, 5.0, "idle")
        assert worker_health(cluster, "decode-0").serving
        # (held > 1.5 s on a slow machine, the scheduler drops it until its heartbeat resumes)
        wait_for(
            lambda: any(w.registration.worker_id == "decode-0" for w in list_workers(cluster)),
            10.0,
            "decode-0 registered",
        )
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref.outputs[0].text


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_every_length_disaggregated_equals_offline(
    tiny_model: Path, tmp_path: Path, offline: LLM, scheduling: str
) -> None:
    """With the decider's threshold at 0 every request takes the P/D path: prompts shorter
    than a block (nothing to pull), exactly one block, several, and one that extends a prompt
    the decode worker already holds (it reuses its own blocks and reads only the rest). Once
    with the workers' engines one step at a time (the CPU default) and once with async
    scheduling (the GPU default)."""
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 0}}))
    pd = ["--prefill-workers", "1", "--decode-workers", "1", "--worker-metrics"]
    pd += ["--async-scheduling"] if scheduling == "async" else []
    with running_cluster(tiny_model, 0, *pd, "--routing-policy", str(policy)) as cluster:
        c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60)
        base = long_prompt(tiny_model, 70, "held")
        prompts = [long_prompt(tiny_model, n, f"len-{n}") for n in (3, 16, 33, 150)]
        prompts += [base, base + " and then some more words to extend it further"]
        before = disaggregated_routes(cluster)
        pulled = 0.0
        for prompt in prompts:
            ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
            out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
            assert out.choices[0].text == ref.outputs[0].text, prompt
            last, pulled = pulled, wait_for_counter(cluster, "decode-0", pulled)
        assert disaggregated_routes(cluster) == before + len(prompts)
        # the extension's first 4 blocks were the held prompt's: the decode worker read only
        # the rest (its whole prompt is 6 blocks)
        tokens = out.usage.prompt_tokens  # type: ignore[union-attr]
        assert 0 < pulled - last <= -(-tokens // 16) - 4
        wait_for(lambda: worker_health(cluster, "prefill-0").kv_usage == 0, 5.0, "leases to end")


def wait_for_counter(cluster: Cluster, worker: str, previous: float) -> float:
    """The decode worker's pulled-descriptor total, once it has moved past ``previous``."""

    def value() -> float:
        with contextlib.suppress(AssertionError):  # not exported until it first counts
            return scheduler_metric(cluster, "baton_worker_kv_pull_descriptors_total", worker)
        return 0.0

    wait_for(lambda: value() > previous, 5.0, "the decode worker's pull counters")
    return value()
