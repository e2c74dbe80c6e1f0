"""The scheduler's side of scaling: the pool signals on /metrics, the planner's loop, and the
actuator that sets the Deployments' replicas through their scale subresource.

- ``publish_signals`` runs on every sweep: the ``baton_pool_*`` gauges are recomputed from the
  live registry, so a worker that left stops counting at once and an empty pool reads 0.
- ``plan_once`` asks the planner (planner.py), cordons the workers it is emptying and frees
  those it no longer needs, publishes ``baton_planner_desired_replicas``, and, with an
  actuator, acts.
- ``ScaleActuator`` marks drained pods as the ones to delete first
  (``controller.kubernetes.io/pod-deletion-cost``) and patches ``deployments/<name>/scale``
  when a pool's desired replicas change. RBAC: ``patch`` on ``deployments/scale`` and on
  ``pods`` (the chart grants it only when the planner scales).
"""

import asyncio
import json
import logging
from typing import Any

from services.global_scheduler import metrics
from services.global_scheduler.planner import PLANNER, Plan, Planner, PoolSignals, pool_signals
from services.global_scheduler.server import SchedulerServicer
from shared.ids import WorkerId

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"


def publish_signals(signals: dict[str, PoolSignals]) -> None:
    for pool, s in signals.items():
        metrics.POOL_WORKERS.labels(pool).set(s.workers)
        metrics.POOL_BACKLOG_S.labels(pool).set(s.backlog_s)
        metrics.POOL_KV_USAGE.labels(pool).set(s.kv_usage)
        metrics.POOL_RUNNING.labels(pool).set(s.running)
        metrics.POOL_WAITING.labels(pool).set(s.waiting)


class ScaleActuator:
    def __init__(self, api_client: Any, namespace: str, deployments: dict[str, str]):
        from kubernetes.aio import client

        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.deployments = deployments  # pool → Deployment name
        self.replicas: dict[str, int] = {}  # what was last set, per pool

    async def seed(self, planner: Planner, now: float) -> None:
        """Before the first plan: each pool's replicas as its Deployment has them."""
        for pool, name in self.deployments.items():
            if pool in self.replicas:
                continue
            resp = await self.apps.read_namespaced_deployment_scale_without_preload_content(
                name, self.namespace, _request_timeout=10.0
            )
            await _check(resp, f"read the scale of {name}")
            replicas = int((json.loads(await resp.read()).get("spec") or {}).get("replicas", 0))
            planner.seed(pool, replicas, now)
            self.replicas[pool] = replicas

    async def apply(self, plan: Plan) -> None:
        for pool, name in self.deployments.items():
            if pool not in plan.desired:
                continue
            for pod in plan.removable.get(pool, []):  # the pods to go first: the drained ones
                body = {"metadata": {"annotations": {DELETION_COST: "-1000"}}}
                resp = await self.core.patch_namespaced_pod_without_preload_content(
                    pod, self.namespace, body, _content_type=MERGE_PATCH, _request_timeout=10.0
                )
                await _check(resp, f"mark pod {pod}")
            want = plan.desired[pool]
            if self.replicas.get(pool) == want:
                continue
            resp = await self.apps.patch_namespaced_deployment_scale_without_preload_content(
                name, self.namespace, {"spec": {"replicas": want}},
                _content_type=MERGE_PATCH, _request_timeout=10.0,
            )  # fmt: skip
            await _check(resp, f"scale {name}")
            logger.info("planner: %s (pool %s) → %d replicas", name, pool, want)
            self.replicas[pool] = want


async def _check(resp: Any, what: str) -> None:
    body = await resp.read()
    if resp.status >= 400:
        raise RuntimeError(f"{what}: HTTP {resp.status}: {body[:200]!r}")


async def plan_once(
    planner: Planner,
    servicer: SchedulerServicer,
    now: float,
    actuator: ScaleActuator | None = None,
) -> Plan:
    if actuator is not None:
        await actuator.seed(planner, now)
    workers = servicer.worker_signals()
    signals = pool_signals(workers, planner.config.default_tokens_per_s)
    plan = planner.plan(now, signals, workers)
    emptying = {w for ws in plan.drain.values() for w in ws}
    for w in workers:
        if w.worker_id in emptying and not w.cordoned:
            logger.info("planner: emptying %s before its pool shrinks", w.worker_id)
            servicer.cordon(WorkerId(w.worker_id), PLANNER)
        elif w.cordoned == PLANNER and w.worker_id not in emptying:
            servicer.uncordon(WorkerId(w.worker_id), PLANNER)
    for pool, n in plan.desired.items():
        metrics.DESIRED_REPLICAS.labels(pool).set(n)
        metrics.PLANNER_DRAINING.labels(pool).set(len(plan.drain.get(pool, [])))
    if actuator is not None:
        await actuator.apply(plan)
    return plan


async def plan_forever(
    planner: Planner, servicer: SchedulerServicer, actuator: ScaleActuator | None
) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(planner.config.interval_s)
        try:
            await plan_once(planner, servicer, loop.time(), actuator)
        except Exception as e:  # the API server refusing a patch must not end planning
            logger.warning("planner: %s: %s", type(e).__name__, e)
