"""``WorkerSettings``: everything ``baton worker`` is configured with, built once and frozen."""

import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Literal

from services.worker.engine.config import EngineArgs

Role = Literal["prefill", "decode", "both"]

DNS_PREFIX = "dns:"


@dataclass(frozen=True)
class SchedulerDns:
    """``--scheduler dns:NAME:PORT``: the global-scheduler replicas are every address NAME
    resolves to (a Kubernetes headless Service), at PORT; so a worker's arguments do not
    depend on how many replicas run."""

    name: str
    port: int

    @staticmethod
    def parse(addresses: tuple[str, ...]) -> "SchedulerDns | None":
        """The name in ``scheduler_addresses`` (None: a fixed list); ValueError if malformed."""
        entries = [a for a in addresses if a.startswith(DNS_PREFIX)]
        if not entries:
            return None
        if len(addresses) > 1:
            raise ValueError("a scheduler dns:NAME:PORT names every replica: give it alone")
        name, _, port = entries[0].removeprefix(DNS_PREFIX).rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"scheduler {entries[0]!r}: expected dns:NAME:PORT")
        return SchedulerDns(name, int(port))


@dataclass(frozen=True)
class WorkerSettings:
    engine: EngineArgs
    role: Role = "both"
    host: str = "127.0.0.1"  # where the gRPC server listens
    port: int = 0  # 0: a free port, chosen at start
    advertise_host: str | None = None  # what the scheduler tells the gateway; default host
    # host:port of each replica, or one dns:NAME:PORT (SchedulerDns); () runs alone
    scheduler_addresses: tuple[str, ...] = ()
    scheduler_resolve_interval_s: float = 5.0  # dns:NAME:PORT: how often NAME is looked up
    worker_id: str = ""  # default: hostname-pid
    metrics_port: int | None = None  # Prometheus /metrics; None: off
    heartbeat_interval_s: float = 0.5
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may finish
    # registered with no scheduler replica for this long: stop, for the supervisor to restart
    # the worker (0: never); long enough to ride out a scheduler restart
    unregistered_exit_s: float = 300.0
    # the engine has work and shows no progress (no output, no step) for this long: it is hung
    # (watchdog.py); the worker turns not live, leaves the schedulers and exits. 0: never. Above
    # every bound of its own that a wait in a step has (a KV pull's 35 s, a grammar's 30 s),
    # below the collectives' 120 s (see watchdog.py)
    step_timeout_s: float = 60.0
    ready_file: str | None = None  # written with the bound address once serving (for launchers)
    cpus: tuple[int, ...] = ()  # pin the front's threads here once serving; not the engine core

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{socket.gethostname()}-{os.getpid()}")
        if self.heartbeat_interval_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("heartbeat_interval_s must be > 0 and drain_timeout_s >= 0")
        if self.unregistered_exit_s < 0:
            raise ValueError("unregistered_exit_s must be >= 0 (0: never)")
        if self.step_timeout_s < 0:
            raise ValueError("step_timeout_s must be >= 0 (0: never)")
        if self.scheduler_resolve_interval_s <= 0:
            raise ValueError("scheduler_resolve_interval_s must be > 0")
        SchedulerDns.parse(self.scheduler_addresses)  # a malformed name fails here, at start

    def replace(self, **changes: object) -> "WorkerSettings":
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def new_incarnation() -> str:
    """A fresh id for one process start, or for a worker that comes back after the schedulers
    dropped it (watchdog.Reincarnation). The directory counts KV-event sequence numbers per
    incarnation from the first batch it sees of one, so the engine's numbering need not restart
    with it: a registration's first message carries the engine's re-announcement (all
    cleared, then every cached block), the picture the later batches change."""
    return uuid.uuid4().hex
