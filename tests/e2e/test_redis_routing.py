"""The Redis prefix directory in running clusters: two scheduler replicas sharing one Redis
agree on every route, and Redis dying under load fails no request (routing falls back to
load, the degraded metric rises and falls, and cache-aware routing comes back)."""

import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shared.block_hash import hash_blocks
from shared.protos.baton.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from shared.text.tokenizer import TextTokenizer
from tests.e2e.conftest import (
    StreamLoad,
    directory_is_whole,
    internal_channel,
    long_prompt,
    running_cluster,
    scheduler_metric,
    service_group,
    start_replicas,
    wait_for,
)
from tests.redis_server import RedisServer

MODEL = "qwen3"


@pytest.fixture()
def replicas(tiny_model: Path, redis_server: RedisServer, tmp_path: Path) -> Iterator[dict]:
    """Two scheduler replicas on one Redis; two workers heartbeating to both. They record no
    pending entries (``pending: {ttl_s: 0}``): a route of one would change what the other then
    sees, and the test below asks whether two replicas given the same state choose alike
    (``test_back_to_back.py`` runs replicas with pending entries)."""
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"pending": {"ttl_s": 0}}))
    group = service_group(tiny_model)
    try:
        addrs, workers = start_replicas(
            group, tiny_model, redis_server.url, "--routing-policy", str(policy)
        )
        yield {"schedulers": addrs, "workers": workers}
    finally:
        group.stop()


def route(address: str, request_id: str, ids: list[int]) -> scheduler_pb2.RouteResponse:
    with internal_channel(address) as ch:
        return scheduler_pb2_grpc.GlobalSchedulerStub(ch).Route(
            scheduler_pb2.RouteRequest(
                request_id=request_id, model=MODEL, block_hashes=hash_blocks(ids, 16),
                num_prompt_tokens=len(ids),
            ),
            timeout=5,
        )  # fmt: skip


def cached_blocks(address: str) -> dict[str, int]:
    with internal_channel(address) as ch:
        resp = scheduler_pb2_grpc.GlobalSchedulerStub(ch).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5
        )
    return {w.registration.worker_id: w.num_cached_blocks for w in resp.workers}


def heard_since(a: str, b: str, since: float) -> bool:
    """Both replicas heard every worker's heartbeat after ``since`` (time.monotonic() here),
    which zeroes what each routed to it before, and hold the same load for each."""
    views = []
    for address in (a, b):
        with internal_channel(address) as ch:
            workers = (
                scheduler_pb2_grpc.GlobalSchedulerStub(ch)
                .ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
                .workers
            )
        elapsed = time.monotonic() - since
        if any(w.seconds_since_heartbeat >= elapsed for w in workers):
            return False
        views.append({w.registration.worker_id: w.load.SerializeToString() for w in workers})
    return views[0] == views[1]


def test_two_replicas_sharing_redis_route_alike(replicas: dict, tiny_model: Path) -> None:
    a, b = replicas["schedulers"]
    wait_for(lambda: len(cached_blocks(a)) == 2 and len(cached_blocks(b)) == 2, 10.0,
             "both workers on both replicas")  # fmt: skip
    ids = TextTokenizer(tiny_model).encode(long_prompt(tiny_model, 160, "replicas"))
    with internal_channel(replicas["workers"][1]) as ch:  # w1 computes the prompt
        for _ in worker_pb2_grpc.WorkerStub(ch).Generate(
            worker_pb2.GenerateRequest(request_id="warm", prompt_token_ids=ids,
                                       params=common_pb2.SamplingParams(max_tokens=1)),
            timeout=30,
        ):  # fmt: skip
            pass
    wait_for(lambda: cached_blocks(a).get("w1", 0) >= 10, 5.0, "w1's blocks in Redis")
    assert cached_blocks(b)["w1"] == cached_blocks(a)["w1"]  # one shared picture
    last = time.monotonic()
    for i in range(12):  # the prefix holder, and ties broken alike
        prompt = ids if i % 2 == 0 else [7 + i, *ids[1:]]
        # Loads reach each replica on its own heartbeat streams: compare decisions made from
        # the same inputs, i.e. once both replicas heard from every worker since the last pair.
        wait_for(functools.partial(heard_since, a, b, last), 5.0, "replicas to hear workers")
        ra, rb = route(a, f"r{i}", prompt), route(b, f"r{i}", prompt)
        last = time.monotonic()
        assert (ra.decode.worker_id, ra.decode.matched_blocks) == (
            rb.decode.worker_id, rb.decode.matched_blocks)  # fmt: skip
        if i % 2 == 0:
            assert ra.decode.worker_id == "w1" and ra.decode.matched_blocks == len(ids) // 16


def test_redis_killed_under_load_fails_nothing(tiny_model: Path) -> None:
    """16 streams; Redis is killed under them (routing on load alone: no request fails), the
    load stops, and Redis comes back empty: without any traffic the directory is whole again
    within 2 s (the scheduler's probe sees Redis, every worker re-announces at once, and the
    stale pooled connections are retried once instead of failing); then cache-aware again."""
    redis = RedisServer.start()
    try:
        with running_cluster(tiny_model, 2, "--redis-url", redis.url) as cluster:
            with StreamLoad(cluster.url or "", clients=16) as load:
                wait_for(lambda: len(load.ok()) >= 32, 60.0, "load to flow")
                assert scheduler_metric(cluster, "baton_scheduler_directory_degraded") == 0
                redis.kill()
                wait_for(lambda: scheduler_metric(cluster, "baton_scheduler_directory_degraded")
                         == 1, 10.0, "degraded")  # fmt: skip
                down = time.monotonic()
                wait_for(lambda: len(load.ok(since=down)) >= 32, 60.0, "requests, Redis down")
            assert load.failed() == []
            redis.restart()  # empty; no traffic from here until the directory is whole
            took = wait_for(lambda: directory_is_whole(cluster), 2.0, "the directory whole")
            assert scheduler_metric(cluster, "baton_scheduler_directory_degraded") == 0
            print(f"directory whole {took:.2f} s after Redis came back")
            with StreamLoad(cluster.url or "", clients=16) as load:
                wait_for(lambda: len(load.ok()) >= 32, 60.0, "requests after recovery")
            assert load.failed() == []
            # Cache-aware again: a shared prefix lands where its blocks are.
            c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60)
            prefix = long_prompt(tiny_model, 200, "after-recovery")
            c.completions.create(model=MODEL, prompt=prefix + " one", max_tokens=2)

            def hit() -> bool:
                out = c.completions.create(model=MODEL, prompt=prefix + " two", max_tokens=2)
                return out.usage.prompt_tokens_details.cached_tokens >= 192  # type: ignore[union-attr]

            wait_for(hit, 10.0, "cache-aware routing after recovery")
    finally:
        redis.stop()
