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

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0 or self.sweep_interval_s <= 0:
            raise ValueError("heartbeat_timeout_s and sweep_interval_s must be > 0")


def load_policy(path: str) -> dict[str, Any]:
    """A routing policy from a YAML or JSON file (see routing.py for its shape)."""
    text = Path(path).read_text()
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a routing policy is a mapping with filters/scorers/picker")
    return data
