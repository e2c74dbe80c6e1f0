"""``baton global-scheduler``: lifecycle (shared/lifecycle.py)

start gRPC → sweep silent workers every ``sweep_interval_s`` (and publish the pool signals)
→ on Kubernetes: watch the worker pods, run the planner → SIGTERM → stop gRPC
"""

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from services.global_scheduler.directory import create_directory
from services.global_scheduler.discovery import PodDiscovery, kubernetes_api
from services.global_scheduler.planner import Planner, PlannerConfig, pool_signals
from services.global_scheduler.registry import WorkerRegistry
from services.global_scheduler.resilient import ResilientDirectory
from services.global_scheduler.routing import RoutingPolicy
from services.global_scheduler.scaling import ScaleActuator, plan_forever, publish_signals
from services.global_scheduler.server import SchedulerServicer
from services.global_scheduler.settings import SchedulerSettings, own_namespace, redacted
from shared import rpc
from shared.affinity import pin_threads
from shared.lifecycle import StopSignal, TaskOwner, export_task_count
from shared.probes import LoopTicker, start_probe_server
from shared.protos.baton.v1 import scheduler_pb2_grpc

logger = logging.getLogger(__name__)


async def serve(settings: SchedulerSettings, stop: StopSignal | None = None) -> None:
    stop = stop or StopSignal()
    stop.install()
    owner = TaskOwner("scheduler")
    export_task_count()
    if settings.redis_url:
        inner = create_directory("redis", url=settings.redis_url)
        logger.info("prefix directory in Redis at %s", redacted(settings.redis_url))
    else:
        inner = create_directory("memory")
    directory = ResilientDirectory(inner)
    # a sweep later than this means the scheduler itself stalled (one on time never is)
    stall_s = max(settings.heartbeat_timeout_s / 2, 3 * settings.sweep_interval_s)
    servicer = SchedulerServicer(
        WorkerRegistry(settings.heartbeat_timeout_s, stall_s),
        directory,
        RoutingPolicy(settings.routing_policy),
    )
    directory.on_recover = servicer.request_resync
    api_client: Any = None
    server = rpc.server()
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(servicer, server)
    port = rpc.add_port(server, f"{settings.host}:{settings.port}")
    await server.start()
    try:
        metrics_port = None
        ticker = LoopTicker()
        owner.spawn(ticker.run(), "loop-ticker")
        if settings.metrics_port is not None:  # with /health and /ready (it serves once here)
            metrics_port = start_probe_server(settings.host, settings.metrics_port,
                                              lambda: (True, "serving"), ticker.check)  # fmt: skip
        owner.spawn(_sweep_forever(servicer, settings.sweep_interval_s), "sweep")
        owner.spawn(directory.probe_forever(), "directory-probe")
        api_client = _start_kubernetes(settings, servicer, owner)
        address = f"{settings.host}:{port}"
        logger.info("global scheduler listening on %s", address)
        if settings.cpus:
            pin_threads(settings.cpus)
        if settings.ready_file:
            tmp = Path(settings.ready_file + ".tmp")
            tmp.write_text(json.dumps({"address": address, "metrics_port": metrics_port}))
            tmp.rename(settings.ready_file)
        await stop.wait()
    finally:
        await owner.cancel_all()
        if api_client is not None:
            await api_client.close()
        await server.stop(grace=1.0)
        await directory.close()
        logger.info("global scheduler stopped")


async def _sweep_forever(servicer: SchedulerServicer, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await servicer.sweep()
        publish_signals(pool_signals(servicer.worker_signals()))


def _start_kubernetes(settings: SchedulerSettings, servicer: SchedulerServicer,
                      owner: TaskOwner) -> Any:  # fmt: skip
    """Pod discovery and the planner, as configured; the API client to close (or None)."""
    api_client = None
    if settings.discovery == "kubernetes":
        from kubernetes.aio import client

        api_client = kubernetes_api(settings.kubernetes_api)
        namespace = settings.namespace or own_namespace()
        discovery = PodDiscovery(client.CoreV1Api(api_client), namespace, settings.pod_selector,
                                 servicer, settings.unregistered_after_s)  # fmt: skip
        owner.spawn(discovery.run_forever(), "pod-discovery")
        owner.spawn(discovery.check_forever(), "pod-registration-check")
        logger.info("pod discovery: namespace %s, pods %s", namespace, settings.pod_selector)
    if settings.planner is not None:
        actuator = None
        if settings.scale_deployments:
            actuator = ScaleActuator(api_client, settings.namespace or own_namespace(),
                                     dict(settings.scale_deployments))  # fmt: skip
        planner = Planner(PlannerConfig.from_dict(settings.planner), drains_first=bool(actuator))
        owner.spawn(plan_forever(planner, servicer, actuator), "planner")
        logger.info("planner on (%s)", "sets replicas" if actuator else "publishes only")
    return api_client
