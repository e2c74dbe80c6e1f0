"""Pod discovery through the Kubernetes API: what the heartbeat cannot know in time.

The heartbeat registration stays the source of truth for which workers exist and what they
hold. On Kubernetes the API server knows two things sooner: that a pod is going away (it got
a ``deletionTimestamp``, or it is gone) and that a pod is Ready but has never registered. This
module lists and then watches the release's worker pods and tells the scheduler:

- a pod with a ``deletionTimestamp`` is **cordoned** at once: no new routes, before its
  heartbeat times out; what runs there finishes and its KV can still be pulled while it drains;
- a pod that is **gone** (deleted, or Failed/Succeeded) is removed from the registry and its
  blocks from the prefix directory at once: no route to it, no stranded index entries;
- a pod that is Ready for ``unregistered_after_s`` without registering is **reported** (a log
  line, and ``baton_scheduler_pods_unregistered``).

A pod is matched to a worker by name: the chart starts each worker with ``--worker-id`` set to
its pod's name. Pods are filtered by the label selector on the server and again here (only
equality terms, ``k=v,k2=v2``). The list is redone whenever the watch ends or fails (bounded
waits, backoff up to 10 s), and pods missing from a fresh list count as gone.

Off outside Kubernetes (``--discovery none``, the default).
"""

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from services.global_scheduler import metrics
from services.global_scheduler.planner import DELETING
from shared.ids import WorkerId

logger = logging.getLogger(__name__)


class WorkerSink(Protocol):
    """What discovery changes in the scheduler (SchedulerServicer implements it)."""

    def cordon(self, worker_id: WorkerId, why: str) -> None: ...

    async def forget(self, worker_id: WorkerId, why: str) -> None: ...

    def is_registered(self, worker_id: WorkerId) -> bool: ...


@dataclass
class PodView:
    name: str
    deleting: bool = False
    ready_since: float | None = None  # by the discovery's clock; None while not Ready
    reported: bool = False  # "Ready but not registered" was said already

    @property
    def ready(self) -> bool:
        return self.ready_since is not None


def parse_selector(selector: str) -> dict[str, str]:
    """``k=v,k2=v2`` (also ``k==v``); other selector forms are refused, since the same
    selector is applied again here."""
    terms: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, eq, value = term.replace("==", "=").partition("=")
        if not eq or not key or "!" in key or " " in key.strip():
            raise ValueError(f"pod selector {selector!r}: only k=v terms are supported")
        terms[key.strip()] = value.strip()
    return terms


def _matches(pod: dict[str, Any], terms: dict[str, str]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in terms.items())


def _is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _is_over(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")


class PodDiscovery:
    def __init__(
        self,
        api: Any,  # kubernetes.aio.client.CoreV1Api (or anything with its two raw calls)
        namespace: str,
        selector: str,
        sink: WorkerSink,
        unregistered_after_s: float = 120.0,
        watch_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.api, self.namespace, self.selector = api, namespace, selector
        self.terms = parse_selector(selector)
        self.sink = sink
        self.unregistered_after_s = unregistered_after_s
        self.watch_timeout_s = watch_timeout_s
        self.clock = clock
        self.pods: dict[str, PodView] = {}

    # -- the state machine (no I/O but the sink's) ---------------------------------------

    async def apply(self, kind: str, pod: dict[str, Any]) -> None:
        """One watch event (ADDED / MODIFIED / DELETED) or one listed pod (ADDED)."""
        name = str((pod.get("metadata") or {}).get("name") or "")
        if not name or not _matches(pod, self.terms):
            return  # not ours (kmock, for one, ignores the server-side selector)
        if kind == "DELETED" or _is_over(pod):
            await self._gone(name, "pod deleted" if kind == "DELETED" else "pod ended")
            return
        deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
        ready = _is_ready(pod) and not deleting
        view = self.pods.get(name)
        if view is None:
            view = self.pods[name] = PodView(name)
        if ready and view.ready_since is None:
            view.ready_since = self.clock()
        elif not ready:
            view.ready_since, view.reported = None, False
        if deleting and not view.deleting:
            logger.info("pod %s is being deleted: no new routes to it", name)
            metrics.DISCOVERY_EVENTS.labels("cordoned").inc()
            self.sink.cordon(WorkerId(name), DELETING)
        view.deleting = deleting

    async def _gone(self, name: str, why: str) -> None:
        if self.pods.pop(name, None) is None and not self.sink.is_registered(WorkerId(name)):
            return
        logger.info("%s: %s leaves the registry and the directory", why, name)
        metrics.DISCOVERY_EVENTS.labels("removed").inc()
        await self.sink.forget(WorkerId(name), why)

    async def reconcile(self, listed: list[dict[str, Any]]) -> None:
        """A fresh list: every pod in it applied, and every pod known here but missing from
        it gone (its DELETED event may have fallen between two watches)."""
        ours = [p for p in listed if _matches(p, self.terms)]
        names = {str((p.get("metadata") or {}).get("name") or "") for p in ours}
        for name in [n for n in self.pods if n not in names]:
            await self._gone(name, "pod no longer listed")
        for pod in ours:
            await self.apply("ADDED", pod)

    def unregistered(self) -> list[str]:
        """Pods Ready for ``unregistered_after_s`` that no worker registered as (each one is
        logged once per Ready spell)."""
        now, late = self.clock(), []
        for view in self.pods.values():
            if view.ready_since is None or now - view.ready_since < self.unregistered_after_s:
                continue
            if self.sink.is_registered(WorkerId(view.name)):
                view.reported = False
                continue
            late.append(view.name)
            if not view.reported:
                view.reported = True
                logger.warning("pod %s has been Ready for %.0f s but never registered with the "
                               "scheduler (its --worker-id must be its pod name)", view.name,
                               now - view.ready_since)  # fmt: skip
        metrics.PODS_UNREGISTERED.set(len(late))
        return late

    # -- I/O -----------------------------------------------------------------------------

    async def run_forever(self) -> None:
        backoff = 0.5
        while True:
            try:
                await self._list_and_watch()
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the API server unreachable, a 410, a bad line: list again
                logger.warning("pod watch failed (%s: %s); listing again in %.1f s",
                               type(e).__name__, e, backoff)  # fmt: skip
                metrics.DISCOVERY_EVENTS.labels("watch_failed").inc()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def check_forever(self, interval_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.unregistered()

    async def _list_and_watch(self) -> None:
        resp = await self.api.list_namespaced_pod_without_preload_content(
            self.namespace, label_selector=self.selector, _request_timeout=10.0
        )
        body = json.loads(await resp.read())
        _raise_for_status(resp, body)
        await self.reconcile(list(body.get("items") or []))
        version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        resp = await self.api.list_namespaced_pod_without_preload_content(
            self.namespace, label_selector=self.selector, watch=True,
            resource_version=version or None, allow_watch_bookmarks=True,
            timeout_seconds=int(self.watch_timeout_s),
            _request_timeout=self.watch_timeout_s + 10.0,  # the server ends it first
        )  # fmt: skip
        raw = getattr(resp, "response", resp)  # the aiohttp response
        try:
            if raw.status >= 400:
                _raise_for_status(raw, json.loads(await raw.read() or b"{}"))
            while line := await raw.content.readline():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                if kind == "ERROR":  # 410 Gone (resourceVersion too old) and the like
                    raise RuntimeError(f"watch error: {event.get('object')}")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    await self.apply(kind, event.get("object") or {})
        finally:
            raw.release()


def _raise_for_status(resp: Any, body: dict[str, Any]) -> None:
    if resp.status >= 400:
        raise RuntimeError(f"HTTP {resp.status}: {body.get('message') or body}")


def kubernetes_api(api_server: str | None = None) -> Any:
    """A CoreV1Api on the in-cluster service account, or on ``api_server`` (a URL, no
    authentication: for tests against an in-memory API)."""
    from kubernetes.aio import client, config

    if api_server:
        configuration = client.Configuration(host=api_server)
    else:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)
