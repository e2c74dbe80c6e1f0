"""The global-scheduler replicas a worker registers with, one ``Heartbeat`` each (``main`` fans
the engine's KV events out to them and asks them for KV peers):

    --scheduler a:1,b:1         a fixed set, made at start
    --scheduler dns:NAME:PORT   every A/AAAA record of NAME (a Kubernetes headless Service),
                                looked up at start and every ``resolve_interval_s``

A looked-up address not in the set gets a heartbeat; one gone from the answer has its heartbeat
retired (the stream ends, the replica drops the worker, the KV peers it named stop counting). A
failed or empty answer changes nothing, so a DNS hiccup never unregisters a worker. Adding a
scheduler replica thus changes no worker's arguments: no restart, no model reload.

The worker counts as registered while at least one replica has its registration
(``registration``): one replica down leaves it serving through the others.
"""

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator

from services.worker.heartbeat import Heartbeat
from services.worker.settings import SchedulerDns
from shared.lifecycle import TaskOwner

logger = logging.getLogger(__name__)

# (name, port) → the IP addresses it resolves to, bare (IPv6 without brackets)
Resolve = Callable[[str, int], Awaitable[list[str]]]

RESOLVE_TIMEOUT_S = 2.0  # a lookup that takes longer counts as failed
RESOLVE_WARN_S = 60.0  # while lookups fail, a warning this often
RETIRE_BOUND_S = 5.0  # a retired heartbeat's task is cancelled if its stream has not ended
WAIT_POLL_S = 0.05  # how often wait_registered looks


async def resolve_dns(name: str, port: int) -> list[str]:
    """Every address ``name`` has (A and AAAA records, as the system resolver answers)."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(name, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
    )
    return [str(sockaddr[0]) for _family, _type, _proto, _name, sockaddr in infos]


def host_port(ip: str, port: int) -> str:
    """A gRPC target: ``10.0.0.7:50051``, ``[fd00::7]:50051``."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class SchedulerSet:
    """The heartbeats, one per replica address; iterating yields the current ones (callers
    iterate anew each time: the set changes while a DNS name is followed).

    ``new_heartbeat(address, tls_name)`` makes the heartbeat for an address (``tls_name``: the
    DNS name followed, which the replica's certificate names; None for a fixed list); its ``run``
    is spawned in ``owner``, which cancels it at the worker's stop. The event loop's only, but
    for ``registration``, which the probe server's thread calls too (it reads one snapshot of
    the set)."""

    def __init__(
        self,
        new_heartbeat: Callable[[str, str | None], Heartbeat],
        owner: TaskOwner,
        resolve: Resolve = resolve_dns,
    ):
        self._new_heartbeat = new_heartbeat
        self._tls_name: str | None = None  # the DNS name followed: what TLS checks (start)
        self._owner = owner
        self._resolve = resolve
        self._beats: dict[str, Heartbeat] = {}  # address → its heartbeat
        self._tasks: dict[str, asyncio.Task[None]] = {}  # address → its heartbeat's run
        self._configured = False  # any replica given (a fixed address or a DNS name)
        self._stopped = False
        self._warned_at = -RESOLVE_WARN_S

    def __iter__(self) -> Iterator[Heartbeat]:
        return iter(list(self._beats.values()))

    @property
    def addresses(self) -> list[str]:
        return list(self._beats)

    async def start(self, addresses: tuple[str, ...], resolve_interval_s: float) -> None:
        """Heartbeats for ``WorkerSettings.scheduler_addresses``: a fixed list, or one
        ``dns:NAME:PORT``, looked up now and then every ``resolve_interval_s`` (a task of
        the owner's)."""
        self._configured = bool(addresses)
        dns = SchedulerDns.parse(addresses)
        self._tls_name = dns.name if dns else None
        if dns is None:
            self.update(addresses)
            return
        await self.refresh(dns)
        self._owner.spawn(self._follow(dns, resolve_interval_s), f"resolve-{dns.name}")

    def update(self, addresses: Iterable[str]) -> None:
        """Exactly one heartbeat per address in ``addresses`` from now on."""
        if self._stopped:
            return
        wanted = dict.fromkeys(addresses)
        for address in [a for a in self._beats if a not in wanted]:
            logger.info("scheduler replica %s left the set: retiring its heartbeat", address)
            self._retire(self._beats.pop(address), self._tasks.pop(address))
        for address in wanted:
            if address not in self._beats:
                beat = self._beats[address] = self._new_heartbeat(address, self._tls_name)
                self._tasks[address] = self._owner.spawn(beat.run(), f"heartbeat-{address}")

    async def refresh(self, dns: SchedulerDns) -> None:
        """Look ``dns`` up once and follow the answer; a failed or empty one keeps the set."""
        try:
            ips = await self._resolve(dns.name, dns.port)
        except Exception as e:  # gaierror, a timeout, a name the codec refuses: all alike
            self._warn(f"resolving {dns.name} failed ({e!r})")
            return
        if not ips:
            self._warn(f"{dns.name} resolved to no address")
            return
        self.update(host_port(ip, dns.port) for ip in ips)

    def registration(self) -> tuple[bool, str]:
        """/ready's part: registered with at least one replica (a worker given none needs
        none), and which replicas are not connected."""
        beats = list(self)
        missing = [b.address for b in beats if not b.connected.is_set()]
        if not self._configured:
            return True, "no global scheduler configured"
        if not beats:
            return False, "no global scheduler replica found yet"
        if len(missing) == len(beats):
            return False, f"registered with no global scheduler replica ({missing})"
        if missing:
            return True, f"registered; not connected to {missing}"
        return True, "registered with every replica"

    async def wait_registered(self, bound_s: float) -> bool:
        """Until a replica has our registration, at most ``bound_s``; whether one has."""
        deadline = time.monotonic() + bound_s
        while not self.registration()[0]:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(WAIT_POLL_S)
        return True

    def stop(self) -> None:
        """Stop every heartbeat (each says goodbye: the replicas drop the worker at once) and
        change no more."""
        self._stopped = True
        for beat in self:
            beat.stop()

    async def ended(self, bound_s: float) -> None:
        """Until every heartbeat has ended its stream (after ``stop``: its goodbye sent), at
        most ``bound_s`` (a replica that does not answer is not waited for longer)."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=bound_s)

    async def _follow(self, dns: SchedulerDns, interval_s: float) -> None:
        while not self._stopped:
            await asyncio.sleep(interval_s)
            await self.refresh(dns)

    @staticmethod
    def _retire(beat: Heartbeat, task: asyncio.Task[None]) -> None:
        beat.retire()  # its stream ends after the next message
        # a replica that is gone may never answer (a connection attempt waits up to 20 s)
        asyncio.get_running_loop().call_later(RETIRE_BOUND_S, task.cancel)

    def _warn(self, what: str) -> None:
        """Log a failed lookup, at most every ``RESOLVE_WARN_S``."""
        now = time.monotonic()
        if now - self._warned_at >= RESOLVE_WARN_S:
            self._warned_at = now
            logger.warning("%s: keeping the scheduler replicas %s", what, self.addresses)
