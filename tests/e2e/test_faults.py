"""Faults injected into a running ``baton serve`` under 16 concurrent streams: the global
scheduler killed (``baton serve`` restarts it: streams in flight finish, new requests get a 503
that says when to retry while it is down, and succeed again soon after; the directory is whole
again without traffic), a prefill worker killed (with default settings no request fails
and every output equals the offline engine's), and a client that leaves before its first
chunk (the request is aborted while its prefill is still running)."""

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest

from tests.e2e.conftest import (
    StreamLoad,
    directory_is_whole,
    long_prompt,
    running_cluster,
    wait_for,
    worker_health,
)

if TYPE_CHECKING:
    from baton import LLM

MODEL = "qwen3"
DOWN_S = 4.0  # the restart delay: long enough to see the scheduler gone


def test_scheduler_killed_and_restarted_under_load(tiny_model: Path) -> None:
    with running_cluster(tiny_model, 2, "--restart-delay", str(DOWN_S)) as cluster:
        base = (cluster.url or "").removesuffix("/v1")
        sched = cluster.procs["scheduler"]
        ready = httpx.get(f"{base}/ready", timeout=5)
        assert ready.status_code == 200 and ready.json()["models"] == {MODEL: True}
        with StreamLoad(cluster.url or "", clients=16, max_tokens=24) as load:
            wait_for(lambda: len(load.ok()) >= 32, 60.0, "load to flow")
            # kill it while a stream is past its first chunk: that stream must finish whole
            wait_for(lambda: bool(load.streaming()), 10.0, "a stream in flight")
            killed = time.monotonic()
            sched.send_signal(signal.SIGKILL)
            sched.wait(timeout=10)
            # while it is down: not ready, and new requests refused with a 503 to retry
            wait_for(lambda: httpx.get(f"{base}/ready", timeout=5).status_code == 503, 6.0,
                     "the gateway to turn not ready")  # fmt: skip
            refused = [o for o in load.failed() if o.start > killed]
            wait_for(lambda: bool([o for o in load.failed() if o.start > killed]), 5.0,
                     "a request refused while the scheduler is down")  # fmt: skip
            assert httpx.get(f"{base}/health", timeout=5).status_code == 200  # alive all along
            wait_for(lambda: cluster.restarts.get("scheduler") == 1, 10.0, "the restart")
            wait_for(lambda: "scheduler" not in _starting(cluster), 30.0, "the scheduler back")
            back = time.monotonic()
            wait_for(lambda: len(load.ok(since=back)) >= 16, 10.0, "requests to succeed again")
        refused = [o for o in load.failed() if o.start > killed]
        assert refused, "no request met the outage"
        for o in load.failed():  # every failure is the outage's clean refusal, nothing else
            assert o.status == 503 and o.retry_after == "1" and o.error, o
        # the streams in flight when it died finished, with every token
        in_flight = [o for o in load.outcomes if o.first is not None and o.first < killed < o.end]
        assert in_flight and all(o.status == 200 and not o.error for o in in_flight)
        assert all(len(o.text) > 0 for o in load.ok())
        # without traffic, the restarted scheduler's directory is whole again within 2 s
        # of the restart (the workers re-register with every cached block)
        took = wait_for(lambda: directory_is_whole(cluster), 2.0, "the directory to be whole")
        print(f"scheduler back after {back - killed:.1f} s; {len(refused)} requests refused "
              f"meanwhile; directory whole {time.monotonic() - back:.2f} s after it was back "
              f"(polled {took:.2f} s)")  # fmt: skip
        assert httpx.get(f"{base}/ready", timeout=5).status_code == 200


def _starting(cluster) -> set[str]:  # type: ignore[no-untyped-def]
    return {n for n, c in cluster.children.items() if c.starting is not None or c.due is not None}


def test_client_leaving_before_its_first_chunk_aborts_the_prefill(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The prefill worker's engine core is held (SIGSTOP) so the prefill leg cannot answer,
    while the worker itself answers heartbeats (so nobody declares it lost, and the leg waits
    on its progress bound, longer than this client); the client leaves. The gateway gives up on
    the request while the core is still held (it no longer waits for a first chunk nobody will
    read), and once the core runs again the worker ends the request: no request left running,
    no lease held, and the decode worker never got it."""
    import json

    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--routing-policy", str(policy)) as cluster:  # fmt: skip
        base = (cluster.url or "").removesuffix("/v1")
        body = {"model": MODEL, "prompt": long_prompt(tiny_model, 300, "leave-early"),
                "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
        warm = {**body, "prompt": long_prompt(tiny_model, 300, "warm"), "max_tokens": 2}
        assert httpx.post(f"{cluster.url}/completions", json=warm, timeout=30).status_code == 200
        (prefill,) = psutil.Process(cluster.procs["prefill-0"].pid).children(recursive=True)
        received = worker_health(cluster, "decode-0")
        prefill.send_signal(signal.SIGSTOP)
        try:
            with (
                pytest.raises(httpx.ReadTimeout),
                httpx.Client(timeout=1.0) as http,
                http.stream("POST", f"{cluster.url}/completions", json=body) as resp,
            ):
                resp.read()
            wait_for(lambda: _disconnected(base) >= 1, 5.0,
                     "the gateway to give the request up")  # fmt: skip
        finally:
            prefill.send_signal(signal.SIGCONT)
        wait_for(lambda: _idle(worker_health(cluster, "prefill-0")), 10.0, "the prefill to end")
        assert _idle(worker_health(cluster, "decode-0"))
        assert worker_health(cluster, "decode-0").num_cached_blocks == received.num_cached_blocks


def _idle(h) -> bool:  # type: ignore[no-untyped-def]
    return h.num_running == 0 and h.num_waiting == 0 and h.kv_usage == 0


def _disconnected(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    key = 'baton_gateway_requests_total{endpoint="/v1/completions",outcome="disconnected"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def test_prefill_worker_killed_under_load_fails_nothing(
    tiny_model: Path, tmp_path: Path, offline: "LLM"
) -> None:
    """16 streams of long (disaggregated) prompts; the prefill worker is SIGKILLed in the middle
    of them, with default settings. Requests whose prefill leg it held fall back to a local
    prefill, pulls it was serving are recomputed by the decode worker, and ``baton serve``
    starts it again: not one request fails, and every output equals the offline engine's."""
    import json

    from baton import SamplingParams

    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"decider": {"min_uncached_tokens": 32}}))
    prompts = [long_prompt(tiny_model, 120 + 8 * k, f"pd-load-{k}") for k in range(8)]
    refs = {p: o.outputs[0].text for p, o in zip(prompts, offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16)), strict=True)}  # fmt: skip
    with running_cluster(tiny_model, 0, "--prefill-workers", "1", "--decode-workers", "1",
                         "--routing-policy", str(policy)) as cluster:  # fmt: skip

        def prompt(c: int, i: int) -> str:
            return prompts[(c + i) % len(prompts)]

        with StreamLoad(cluster.url or "", clients=16, max_tokens=16, prompt=prompt) as load:
            wait_for(lambda: len(load.ok()) >= 16, 60.0, "load to flow")
            killed = time.monotonic()
            cluster.procs["prefill-0"].send_signal(signal.SIGKILL)
            wait_for(lambda: len(load.ok(since=killed)) >= 32, 60.0, "requests after the kill")
            wait_for(lambda: cluster.restarts.get("prefill-0") == 1
                     and "prefill-0" not in _starting(cluster), 60.0, "the restart")  # fmt: skip
            back = time.monotonic()
            wait_for(lambda: len(load.ok(since=back)) >= 16, 60.0, "requests after the restart")
        assert load.failed() == []
        assert all(o.text == refs[o.prompt] for o in load.ok())
        assert [o for o in load.outcomes if o.start < killed < o.end], "none in flight at the kill"
