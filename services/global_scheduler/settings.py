"""``SchedulerSettings``: what ``baton global-scheduler`` is configured with, frozen."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class SchedulerSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, chosen at start
    heartbeat_timeout_s: float = 1.5  # a silent worker is dropped after this (+ one sweep)
    sweep_interval_s: float = 0.25
    metrics_port: int | None = None
    routing_policy: dict[str, Any] | None = field(default=None, hash=False)  # None: default
    redis_url: str | None = None  # the shared prefix directory; None: in this process
    ready_file: str | None = None
    cpus: tuple[int, ...] = ()  # pin every thread here once serving (shared/affinity.py)
    # Kubernetes (discovery.py, planner.py, scaling.py)
    discovery: str = "none"  # none | kubernetes
    namespace: str = ""  # "": the pod's own (from its service account)
    pod_selector: str = ""  # the worker pods' labels, k=v,k2=v2
    kubernetes_api: str | None = None  # a URL without authentication (tests); None: in-cluster
    unregistered_after_s: float = 120.0
    planner: dict[str, Any] | None = field(default=None, hash=False)  # None: no planner
    scale_deployments: tuple[tuple[str, str], ...] = ()  # (pool, Deployment): planner acts

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0 or self.sweep_interval_s <= 0:
            raise ValueError("heartbeat_timeout_s and sweep_interval_s must be > 0")
        if self.discovery not in ("none", "kubernetes"):
            raise ValueError(f"discovery {self.discovery!r}: none or kubernetes")
        if self.discovery == "kubernetes" and not self.pod_selector:
            raise ValueError("discovery kubernetes needs a pod selector (the workers' labels)")
        if self.scale_deployments and self.planner is None:
            raise ValueError("the planner scales Deployments only with a planner config")
        if self.scale_deployments and self.discovery != "kubernetes":
            raise ValueError("the planner scales Deployments only with discovery kubernetes")


def load_policy(path: str, what: str = "a routing policy") -> dict[str, Any]:
    """A routing policy (or a planner config) from a YAML or JSON file (see routing.py and
    planner.py for their shapes)."""
    text = Path(path).read_text()
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} is a mapping")
    return data


def own_namespace() -> str:
    """The namespace this pod runs in (its service account says), else ``default``."""
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.exists() else "default"
