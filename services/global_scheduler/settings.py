"""``SchedulerSettings``: what ``baton global-scheduler`` is configured with, frozen; and the
Redis URL, which may hold a password, from a flag, a file or the environment."""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

REDIS_URL_ENV = "BATON_REDIS_URL"


@dataclass(frozen=True)
class SchedulerSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, chosen at start
    heartbeat_timeout_s: float = 1.5  # a silent worker is dropped after this (+ one sweep)
    sweep_interval_s: float = 0.25
    metrics_port: int | None = None
    routing_policy: dict[str, Any] | None = field(default=None, hash=False)  # None: default
    # the shared prefix directory; None: in this process. (Not in the repr: it may hold a
    # password; ``redacted`` is how it is printed)
    redis_url: str | None = field(default=None, repr=False)
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


def redis_url(url: str | None, path: str | None) -> str | None:
    """The prefix directory's Redis URL: ``--redis-url``, else the text of the file
    ``--redis-url-file`` names (a mounted Secret, stripped), else $BATON_REDIS_URL; None: none
    (the directory in the scheduler's memory). A file that cannot be read or holds nothing is
    a ``ValueError`` naming it (never the URL)."""
    if path is None:
        return url or os.environ.get(REDIS_URL_ENV) or None
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"--redis-url-file {path}: {e.strerror or e}") from None
    if not text:
        raise ValueError(f"--redis-url-file {path} is empty")
    return text


def redacted(url: str) -> str:
    """``url`` fit for a log line: its password, if any, as ``***``. ``redis://user:secret@h``
    is shown ``redis://user:***@h``; ``redis://secret@h`` ``redis://***@h`` (a lone name may be
    a password); a ``password=`` in the query ``password=***``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # (a malformed address: nothing of it is safe to show)
        return url.partition("://")[0] + "://***"
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        parts = parts._replace(netloc=f"{user}:***@{host}" if colon else f"***@{host}")
    query = "&".join("password=***" if q.startswith("password=") else q
                     for q in parts.query.split("&"))  # fmt: skip
    return urlunsplit(parts._replace(query=query))
