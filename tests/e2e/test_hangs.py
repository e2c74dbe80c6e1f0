"""Hangs under load: ``baton serve`` (1 prefill + 2 decode workers) under 16 concurrent
streams of short and long (disaggregated) prompts while one process is stopped (SIGSTOP) and
later continued: a decode worker (its service and its engine core), a decode worker's engine
core alone (the worker still answers heartbeats), the prefill worker during prefill legs, and
the global scheduler for 10 s. Not one request fails, every output equals the offline engine's
(a resumed stream is token-identical), and no stream waits for a chunk longer than the
gateway's progress bound plus 2 s."""

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from tests.e2e.conftest import (
    StreamLoad,
    disaggregated_routes,
    long_prompt,
    running_cluster,
    scheduler_metric,
    wait_for,
)

if TYPE_CHECKING:
    from baton import LLM
    from baton.launcher import Cluster

PROGRESS_S = 3.0  # the gateway's --progress-timeout here
HELD_S = 8.0  # how long the process stays stopped: past the bound and the heartbeat timeout
SLACK_S = 2.0
MAX_TOKENS = 24
EXPIRED = 'baton_scheduler_worker_events_total{event="expired"}'


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> list[str]:
    short = [f"hang test client prompt {k}" for k in range(6)]
    long = [long_prompt(tiny_model, 100 + 8 * k, f"hang-{k}") for k in range(6)]
    return short + long


class References(dict[str, str]):
    """The offline engine's greedy output for each prompt, computed when first asked."""

    def __init__(self, offline: "LLM"):
        super().__init__()
        self.offline = offline

    def of(self, prompts: list[str]) -> "References":
        from baton import SamplingParams

        todo = sorted({p for p in prompts if p not in self})
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        for p, o in zip(todo, self.offline.generate(todo, greedy), strict=True):
            self[p] = o.outputs[0].text
        return self


@pytest.fixture(scope="module")
def refs(offline: "LLM") -> References:
    return References(offline)


@pytest.fixture
def pd(tiny_model: Path, tmp_path: Path) -> Iterator["Cluster"]:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "2",
                         "--routing-policy", str(policy),
                         "--progress-timeout", str(PROGRESS_S),
                         "--prefill-progress-ms-per-token", "1") as cluster:  # fmt: skip
        yield cluster


def engine_core(cluster: "Cluster", name: str) -> psutil.Process:
    (core,) = psutil.Process(cluster.procs[name].pid).children(recursive=True)
    return core


def held(procs: list[psutil.Process], seconds: float) -> None:
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)


def under_load(cluster: "Cluster", prompt: Callable[[int, int], str], refs: References,
               fault: Callable[[], None]) -> StreamLoad:  # fmt: skip
    """16 streams; ``fault`` once they flow; then more requests after it. Every request ok,
    every output the reference, no wait for a chunk past the bound (+ slack)."""
    with StreamLoad(cluster.url or "", clients=16, max_tokens=MAX_TOKENS,
                    prompt=prompt) as load:  # fmt: skip
        wait_for(lambda: len(load.ok()) >= 32, 90.0, "load to flow")
        start = time.monotonic()
        fault()
        after = time.monotonic()
        wait_for(lambda: len(load.ok(since=after)) >= 32, 90.0, "requests after the fault")
    assert load.failed() == [], load.failed()[:3]
    refs.of([o.prompt for o in load.ok()])
    assert all(o.text == refs[o.prompt] for o in load.ok()), "an output changed"
    during = [o for o in load.outcomes if o.start < after and o.end > start]
    assert len(during) >= 16, "no load met the fault"
    worst = max(load.outcomes, key=lambda o: o.max_gap)
    print(f"{len(load.outcomes)} requests, {len(during)} met the fault; the longest wait for a "
          f"chunk {worst.max_gap:.2f} s")  # fmt: skip
    assert worst.max_gap <= PROGRESS_S + 0.3 + SLACK_S, worst  # (+ the first token's allowance)
    return load


def expirations(cluster: "Cluster") -> float:
    """Workers the scheduler dropped for missed heartbeats (0 before the first)."""
    try:
        return scheduler_metric(cluster, EXPIRED)
    except AssertionError:  # not exported before it first counts
        return 0.0


def cycled(prompts: list[str]) -> Callable[[int, int], str]:
    return lambda c, i: prompts[(c + i) % len(prompts)]


def test_a_stopped_decode_worker_costs_seconds(
    pd: "Cluster", prompts: list[str], refs: References
) -> None:
    worker = psutil.Process(pd.procs["decode-0"].pid)
    fault = lambda: held([worker, engine_core(pd, "decode-0")], HELD_S)  # noqa: E731
    load = under_load(pd, cycled(prompts), refs, fault)
    # the scheduler's notice (missed heartbeats: ~1.5 s) moved its streams before their
    # progress bound would have
    assert max(o.max_gap for o in load.outcomes) < PROGRESS_S


def test_a_stopped_engine_core_costs_seconds(
    pd: "Cluster", prompts: list[str], refs: References
) -> None:
    """The worker's service runs on and answers heartbeats; its engine makes no step."""
    under_load(pd, cycled(prompts), refs, lambda: held([engine_core(pd, "decode-1")], HELD_S))


def test_a_stopped_prefill_worker_costs_seconds(
    pd: "Cluster", tiny_model: Path, refs: References
) -> None:
    """Every prompt new (its own first block): each is a prefill leg on the prefill worker."""
    text = long_prompt(tiny_model, 110, "prefill-hang")

    def fresh(c: int, i: int) -> str:
        return f"client {c} request {i}: {text}"

    worker = psutil.Process(pd.procs["prefill-0"].pid)
    routed = disaggregated_routes(pd)
    under_load(pd, fresh, refs, lambda: held([worker, engine_core(pd, "prefill-0")], HELD_S))
    assert disaggregated_routes(pd) - routed >= 16  # the prompts did go to the prefill worker


def test_a_stopped_scheduler_leaves_streams_running(
    pd: "Cluster", prompts: list[str], refs: References
) -> None:
    """Streams in flight need no scheduler; a new request waits for a route at most the
    gateway's route timeout, then gets a clean 5xx; once the scheduler runs again it drops no
    worker for the heartbeats it could not read while stopped."""
    scheduler = psutil.Process(pd.procs["scheduler"].pid)
    expired = expirations(pd)
    with StreamLoad(pd.url or "", clients=16, max_tokens=MAX_TOKENS,
                    prompt=cycled(prompts)) as load:  # fmt: skip
        wait_for(lambda: len(load.ok()) >= 32, 90.0, "load to flow")
        # the streams run in waves on two cores: stop it while one is streaming, not between
        # (the time read first, so that a stream seen streaming after it was at that time)
        stopped = 0.0

        def streaming() -> bool:
            nonlocal stopped
            stopped = time.monotonic()
            return any(o.first is not None and o.first < stopped for o in load.streaming())

        wait_for(streaming, 10.0, "a stream in flight")
        held([scheduler], 10.0)
        resumed = time.monotonic()
        wait_for(lambda: len(load.ok(since=resumed + 1.0)) >= 32, 60.0, "requests after it")
    in_flight = [o for o in load.outcomes if o.first is not None and o.first < stopped < o.end]
    assert in_flight and all(o.status == 200 and not o.error for o in in_flight)
    refs.of([o.prompt for o in load.ok()])
    assert all(o.text == refs[o.prompt] for o in load.ok())
    assert expirations(pd) == expired  # its own stop is no worker's fault
    for o in load.failed():  # only requests that needed a route while it was stopped
        assert stopped - 1.0 < o.start < resumed and o.status in (503, 504), o
        assert o.end - o.start <= 5.0 + SLACK_S, o  # the route timeout bounds the wait
    assert all(o.status == 200 and not o.error for o in load.outcomes if o.start > resumed + 1.0)
