"""Pod discovery against an in-memory Kubernetes API (kmock): pods appearing, becoming Ready,
getting a deletionTimestamp and disappearing; the scheduler's registry follows within a bound.
kmock ignores label selectors (the discovery filters again on its side: a foreign pod must be
ignored) and keeps no real resourceVersion (the discovery lists again after each watch)."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client import REGISTRY

from services.global_scheduler.directory import create_directory
from services.global_scheduler.discovery import PodDiscovery, kubernetes_api
from services.global_scheduler.planner import DELETING, PLANNER, Planner, PlannerConfig
from services.global_scheduler.registry import WorkerRegistry, WorkerState
from services.global_scheduler.routing import RoutingPolicy
from services.global_scheduler.scaling import ScaleActuator, plan_once
from services.global_scheduler.server import SchedulerServicer
from shared.ids import BlockHash, WorkerId
from shared.kv_events import BlockStored, KVEventBatch

NS = "serving"
LABELS = {"app.kubernetes.io/instance": "rel", "app.kubernetes.io/component": "decode"}
SELECTOR = ",".join(f"{k}={v}" for k, v in LABELS.items())
BOUND_S = 2.0  # the registry follows the API within this


def pod(name: str, labels: dict[str, str] | None = None, hold: bool = False) -> dict[str, Any]:
    """``hold``: with a finalizer, so that a deletionTimestamp leaves it in place (as a pod
    in its grace period is); kmock deletes an object with one and no finalizer at once."""
    meta = {"name": name, "namespace": NS, "labels": labels or LABELS,
            "finalizers": ["test/hold"] if hold else []}  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "worker", "image": "baton"}]},
            "status": {"phase": "Pending", "conditions": []}}  # fmt: skip


async def until(cond: Callable[[], bool], what: str, bound_s: float = BOUND_S) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > bound_s:
            raise AssertionError(f"not within {bound_s} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def worker(name: str) -> WorkerState:
    return WorkerState(WorkerId(name), "inc-1", "decode", "10.0.0.1:1", "m", 512, 16, 64)


@pytest.fixture
async def servicer() -> SchedulerServicer:
    return SchedulerServicer(WorkerRegistry(30.0), create_directory("memory"), RoutingPolicy())


@pytest.fixture
async def http(kmock: Any) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session:
        yield session


async def test_the_registry_follows_the_pods(kmock: Any, http: aiohttp.ClientSession,
                                             servicer: SchedulerServicer) -> None:  # fmt: skip
    api = kubernetes_api(str(kmock.url))
    from kubernetes.aio import client

    discovery = PodDiscovery(client.CoreV1Api(api), NS, SELECTOR, servicer,
                             unregistered_after_s=0.3, watch_timeout_s=1.0)  # fmt: skip
    task = asyncio.get_running_loop().create_task(discovery.run_forever())
    path = f"/api/v1/namespaces/{NS}/pods"
    try:
        await http.post(path, json=pod("other", {"app.kubernetes.io/instance": "another"}))
        await http.post(path, json=pod("decode-a", hold=True))
        await until(lambda: "decode-a" in discovery.pods, "the pod seen")
        assert "other" not in discovery.pods  # filtered here too
        assert not discovery.pods["decode-a"].ready

        # Ready, but no worker registers as it: reported
        ready = {"status": {"phase": "Running",
                            "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
        await http.patch(f"{path}/decode-a", json=ready)
        await until(lambda: discovery.pods["decode-a"].ready, "the pod Ready")
        await asyncio.sleep(0.35)
        assert discovery.unregistered() == ["decode-a"]
        assert REGISTRY.get_sample_value("baton_scheduler_pods_unregistered") == 1
        servicer.registry.register(worker("decode-a"))
        await servicer.directory.apply(WorkerId("decode-a"), "inc-1", KVEventBatch(1, [
            BlockStored([BlockHash(1), BlockHash(2)], None, 16)]))  # fmt: skip
        assert discovery.unregistered() == []

        # a deletionTimestamp: no new routes at once, still registered (it drains)
        deleting = {"metadata": {"deletionTimestamp": "2026-12-01T00:00:00Z"}}
        await http.patch(f"{path}/decode-a", json=deleting)
        took = await until(lambda: servicer.registry.get(WorkerId("decode-a")).cordoned,  # type: ignore[union-attr]
                           "the pod cordoned")  # fmt: skip
        assert servicer.worker_signals()[0].cordoned == DELETING
        assert servicer.is_registered(WorkerId("decode-a"))
        print(f"cordoned {took * 1000:.0f} ms after its deletionTimestamp")

        # gone (its grace period over): out of the registry and the directory at once
        await http.patch(f"{path}/decode-a", json={"metadata": {"finalizers": []}})
        await until(lambda: not servicer.is_registered(WorkerId("decode-a")), "the pod removed")
        assert await servicer.directory.num_blocks(WorkerId("decode-a"), "inc-1") == 0
        assert "decode-a" not in discovery.pods
        assert servicer.registry.cordoned() == {}  # nothing kept for a pod that is gone
    finally:
        task.cancel()
        await api.close()


async def test_a_pod_gone_between_two_watches_is_removed(servicer: SchedulerServicer) -> None:
    """A DELETED event that never arrived (the watch was down): the next list lacks the pod."""
    discovery = PodDiscovery(None, NS, SELECTOR, servicer)
    servicer.registry.register(worker("decode-b"))
    await discovery.reconcile([pod("decode-b")])
    assert "decode-b" in discovery.pods
    await discovery.reconcile([])
    assert not servicer.is_registered(WorkerId("decode-b"))


async def test_the_planner_scales_a_deployment_after_emptying_a_worker(
    kmock: Any, http: aiohttp.ClientSession, servicer: SchedulerServicer
) -> None:
    """The actuator: the drained pod is marked to go first, then deployments/<name>/scale is
    patched (kmock's /scale is a plain merge: the requests it got are what is checked)."""
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "rel-baton-decode", "namespace": NS},
              "spec": {"replicas": 2}}  # fmt: skip
    await http.post(f"/apis/apps/v1/namespaces/{NS}/deployments", json=deploy)
    for name in ("decode-0", "decode-1"):
        await http.post(f"/api/v1/namespaces/{NS}/pods", json=pod(name))
        servicer.registry.register(worker(name))
    scale = f"/apis/apps/v1/namespaces/{NS}/deployments/rel-baton-decode/scale"
    kmock[f"get {scale}"] << {"kind": "Scale", "spec": {"replicas": 2}}  # a subresource
    api = kubernetes_api(str(kmock.url))
    cfg = PlannerConfig(scale_down_stabilization_s=30, scale_down_period_s=30)
    planner = Planner(cfg, drains_first=True)
    actuator = ScaleActuator(api, NS, {"decode": "rel-baton-decode"})
    try:
        plans = [await plan_once(planner, servicer, t * 15.0, actuator) for t in range(4)]
        assert [p.desired["decode"] for p in plans][-1] == 1
        cordoned = servicer.registry.cordoned()
        assert list(cordoned.values()) == [PLANNER]
        victim = next(iter(cordoned))
        patches = list(kmock["patch"])
        # read first (2 replicas: nothing to set), then the drained pod marked, then 1 replica
        assert len(kmock[f"get {scale}"]) == 1
        assert [str(r.url.path) for r in patches] == [f"/api/v1/namespaces/{NS}/pods/{victim}",
                                                       scale]  # fmt: skip
        assert patches[0].data["metadata"]["annotations"] == {
            "controller.kubernetes.io/pod-deletion-cost": "-1000"}  # fmt: skip
        assert patches[1].data == {"spec": {"replicas": 1}}
    finally:
        await api.close()
