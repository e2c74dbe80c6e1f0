"""Routing and failure handling of a running cluster: prefix-aware routing with real
``cached_tokens``, load spreading, a killed worker, a frozen worker, a worker killed in the
middle of a stream, and a client that disconnects. Waits poll the scheduler with a bound."""

import asyncio
import os
import signal
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from baton import LLM, SamplingParams
from baton.launcher import Cluster
from shared.protos.baton.v1 import worker_pb2, worker_pb2_grpc
from shared.text.tokenizer import TextTokenizer
from tests.e2e.conftest import (
    internal_channel,
    list_workers,
    long_prompt,
    running_cluster,
    wait_for,
    worker_health,
)

MODEL = "qwen3"


def test_shared_prefix_goes_to_the_worker_holding_it(cluster: Cluster, tiny_model: Path) -> None:
    c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0)
    prefix = long_prompt(tiny_model, 200, "prefix-routing")
    before = {w.registration.worker_id: w.num_cached_blocks for w in list_workers(cluster)}
    first = c.completions.create(model=MODEL, prompt=prefix + " first", max_tokens=4)
    assert first.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    # The directory learns of the new blocks from the next heartbeat.
    wait_for(
        lambda: any(w.num_cached_blocks >= before[w.registration.worker_id] + 12
                    for w in list_workers(cluster)),
        5.0, "the prompt's KV events to reach the scheduler",
    )  # fmt: skip
    for _ in range(4):  # every request sharing the prefix lands on that worker
        again = c.completions.create(model=MODEL, prompt=prefix + " second", max_tokens=4)
        assert again.usage is not None
        cached = again.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        assert cached >= 12 * 16, cached  # at least the 12 full blocks of the shared prefix


def test_load_spreads_when_prefixes_do_not_matter(cluster: Cluster, tiny_model: Path) -> None:
    before = {w.registration.worker_id: w.num_routed for w in list_workers(cluster)}

    async def burst() -> None:
        async with openai.AsyncOpenAI(base_url=cluster.url, api_key="x", max_retries=0) as c:
            await asyncio.gather(*(
                c.completions.create(model=MODEL, prompt=f"distinct prompt {i}", max_tokens=16)
                for i in range(12)
            ))  # fmt: skip

    asyncio.run(burst())
    routed = {w.registration.worker_id: w.num_routed - before[w.registration.worker_id]
              for w in list_workers(cluster)}  # fmt: skip
    assert sum(routed.values()) == 12
    assert min(routed.values()) >= 3, routed  # both workers took a fair share


def test_client_disconnect_aborts_on_the_worker(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "disconnect me", "max_tokens": 600, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{cluster.url}/completions",
                                                       json=body) as resp:  # fmt: skip
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # the request is running on some worker
        busy = [n for n in ("worker-0", "worker-1") if worker_health(cluster, n).num_running]
        assert busy
    wait_for(lambda: all(worker_health(cluster, n).num_running == 0 for n in busy), 10.0,
             "the abort to reach the engine")  # fmt: skip


@pytest.fixture()
def fresh_cluster(tiny_model: Path):  # type: ignore[no-untyped-def]
    """A cluster of its own: these tests kill or freeze its workers."""
    with running_cluster(tiny_model, 2) as c:
        yield c


def test_killed_worker_is_dropped_and_requests_succeed(fresh_cluster: Cluster) -> None:
    c = openai.OpenAI(base_url=fresh_cluster.url, api_key="x", max_retries=0)
    assert len(list_workers(fresh_cluster)) == 2
    fresh_cluster.procs["worker-1"].send_signal(signal.SIGKILL)
    took = wait_for(lambda: len(list_workers(fresh_cluster)) == 1, 5.0, "the dead worker to go")
    assert took < 2.5
    for i in range(6):
        out = c.completions.create(
            model=MODEL, prompt=f"after the kill {i}", max_tokens=4, extra_body={"ignore_eos": True}
        )  # (a random draw may stop)
        assert out.choices[0].finish_reason == "length"


def test_frozen_worker_is_dropped_by_heartbeat_timeout(fresh_cluster: Cluster) -> None:
    proc = fresh_cluster.procs["worker-0"]
    proc.send_signal(signal.SIGSTOP)  # alive, connection open, but silent
    try:
        took = wait_for(lambda: len(list_workers(fresh_cluster)) == 1, 5.0, "the timeout")
        assert 1.0 < took < 2.5  # heartbeat timeout 1.5 s + one sweep
        c = openai.OpenAI(base_url=fresh_cluster.url, api_key="x", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="still served", max_tokens=4).choices
    finally:
        proc.send_signal(signal.SIGCONT)
    # Thawed, it notices the scheduler dropped it and registers again.
    wait_for(lambda: len(list_workers(fresh_cluster)) == 2, 10.0, "re-registration")


def test_stream_survives_its_worker_being_killed(fresh_cluster: Cluster, tiny_model: Path) -> None:
    prompt, max_tokens = "a long answer", 400
    llm = LLM(model=str(tiny_model), num_kv_blocks=512, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].outputs[0].text
    llm.shutdown()
    c = openai.OpenAI(base_url=fresh_cluster.url, api_key="x", max_retries=0, timeout=60)
    stream = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, killed = "", False
    for chunk in stream:
        text += chunk.choices[0].text
        if not killed and len(text) > 20:
            busy = [n for n in ("worker-0", "worker-1")
                    if worker_health(fresh_cluster, n).num_running]  # fmt: skip
            assert len(busy) == 1
            fresh_cluster.procs[busy[0]].send_signal(signal.SIGKILL)
            killed = True
    assert killed
    assert text == expected  # greedy: resuming elsewhere changes nothing


def test_sigterm_drains_the_worker(fresh_cluster: Cluster, tiny_model: Path) -> None:
    """A worker told to stop finishes what it is running, takes nothing new, then leaves."""
    c = openai.OpenAI(base_url=fresh_cluster.url, api_key="x", max_retries=0, timeout=60)
    stream = c.completions.create(
        model=MODEL, prompt="drain me", max_tokens=300, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(stream))
    busy = [n for n in ("worker-0", "worker-1") if worker_health(fresh_cluster, n).num_running]
    assert len(busy) == 1
    proc = fresh_cluster.procs[busy[0]]
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: not worker_health(fresh_cluster, busy[0]).serving, 5.0, "draining")
    for i in range(4):  # new requests go to the other worker meanwhile
        assert c.completions.create(model=MODEL, prompt=f"new {i}", max_tokens=4).choices
    text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream)
    llm = LLM(model=str(tiny_model), num_kv_blocks=512, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    assert text == llm.generate(["drain me"], params)[0].outputs[0].text  # not cut, not resumed
    llm.shutdown()
    assert proc.wait(timeout=30) == 0
    assert [w.registration.worker_id for w in list_workers(fresh_cluster)] != [busy[0]]


def test_prefill_rpc_returns_the_first_token(cluster: Cluster, tiny_model: Path) -> None:
    from shared.protos.baton.v1 import common_pb2

    tok = TextTokenizer(tiny_model)
    ids = tok.encode("The quick brown fox")
    llm = LLM(model=str(tiny_model), num_kv_blocks=512, max_model_len=1024)
    ref = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1,
                                                                    logprobs=2))[0]  # fmt: skip
    llm.shutdown()
    with internal_channel(cluster.ready["worker-0"]["address"]) as ch:
        got = worker_pb2_grpc.WorkerStub(ch).Prefill(
            worker_pb2.PrefillRequest(
                request_id="prefill-test", prompt_token_ids=ids,
                params=common_pb2.SamplingParams(temperature=0, logprobs=2),
            ),
            timeout=10,
        )  # fmt: skip
    assert got.first_token_id == ref.outputs[0].token_ids[0]
    assert got.num_prompt_tokens == len(ids)
    assert got.first_logprobs.token_ids[0] == got.first_token_id
    assert got.first_logprobs.logprobs[0] == pytest.approx(
        ref.outputs[0].logprobs[0][got.first_token_id].logprob, abs=1e-5
    )


def test_a_prefill_that_ends_in_error_says_why(cluster: Cluster) -> None:
    """A prefill the engine ends in error (here a grammar that does not compile) is refused
    with its kind's status and the engine's message, not an INTERNAL "no token" (which the
    gateway turned into a 502 where the client's grammar deserves a 400)."""
    from shared.protos.baton.v1 import common_pb2

    params = common_pb2.SamplingParams(
        temperature=0, structured_output=common_pb2.StructuredOutput(regex="(ab")
    )
    request = worker_pb2.PrefillRequest(
        request_id="prefill-bad-grammar", prompt_token_ids=[1, 2, 3], params=params
    )
    with (
        internal_channel(cluster.ready["worker-0"]["address"]) as ch,
        pytest.raises(grpc.RpcError) as e,
    ):
        worker_pb2_grpc.WorkerStub(ch).Prefill(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the regex grammar does not compile" in (e.value.details() or "")


def test_one_request_id_in_every_services_logs(tiny_model: Path, tmp_path: Path) -> None:
    with running_cluster(tiny_model, 1, "--log-dir", str(tmp_path)) as cluster:
        resp = httpx.post(
            f"{cluster.url}/completions", headers={"x-request-id": "trace-4242"},
            json={"model": MODEL, "prompt": "follow me", "max_tokens": 3}, timeout=30,
        )  # fmt: skip
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-4242"
        logs = {name: (tmp_path / f"{name}.log") for name in ("gateway", "scheduler", "worker-0")}
        wait_for(lambda: all("[trace-4242]" in p.read_text() for p in logs.values()), 5.0,
                 "the request id in every log")  # fmt: skip


def _thread_cpus(pid: int) -> dict[int, list[int]]:
    return {int(t.name): sorted(os.sched_getaffinity(int(t.name)))
            for t in Path(f"/proc/{pid}/task").iterdir()}  # fmt: skip


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_pin_cpus_pins_every_service_thread_but_not_the_engine(tiny_model: Path) -> None:
    """``baton serve --pin-cpus CPU``: every thread of the scheduler, the worker's front and the
    gateway on that CPU, before and after serving a request; the engine core keeps them all."""
    allowed = sorted(os.sched_getaffinity(0))
    cpu = allowed[-1]
    with running_cluster(tiny_model, 1, "--pin-cpus", str(cpu)) as cluster:
        resp = httpx.post(f"{cluster.url}/completions", timeout=30,
                          json={"model": MODEL, "prompt": "pinned", "max_tokens": 3})  # fmt: skip
        assert resp.status_code == 200, resp.text
        services = {name: proc.pid for name, proc in cluster.procs.items()}
        assert set(services) == {"scheduler", "worker-0", "gateway"}
        for name, pid in services.items():
            threads = _thread_cpus(pid)
            assert len(threads) >= 2 and all(c == [cpu] for c in threads.values()), (name, threads)
        tasks = Path(f"/proc/{services['worker-0']}/task").iterdir()  # any thread may fork
        (core,) = (int(c) for t in tasks for c in (t / "children").read_text().split())
        assert all(c == allowed for c in _thread_cpus(core).values())
