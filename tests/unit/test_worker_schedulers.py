"""The scheduler replicas a worker registers with (services/worker/schedulers.py): ``--scheduler``
as a list or as ``dns:NAME:PORT``, the set following a resolver's answers (no real DNS: a fake
resolver, and heartbeats that talk to nobody), readiness with one replica of two, the
registration watch over a set that changes; and one real worker, started with
``--scheduler dns:localhost:PORT``, registering with a real scheduler on loopback."""

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from services.global_scheduler.directory import create_directory
from services.global_scheduler.registry import WorkerRegistry
from services.global_scheduler.routing import RoutingPolicy
from services.global_scheduler.server import SchedulerServicer
from services.worker import main as worker_main
from services.worker.engine.config import EngineArgs
from services.worker.heartbeat import Heartbeat
from services.worker.schedulers import SchedulerSet
from services.worker.settings import SchedulerDns, WorkerSettings
from shared import rpc
from shared.ids import WorkerId
from shared.lifecycle import StopSignal, TaskOwner
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc

NAME = "baton-scheduler-headless.serving.svc"
DNS = (f"dns:{NAME}:50051",)


class Engine:
    async def resync_kv_events(self) -> None:
        pass


class Beat(Heartbeat):
    """A heartbeat that talks to nobody: the test connects it, as a replica's answer would."""

    def __init__(self, address: str, peers: dict[str, frozenset[str]]):
        super().__init__(address, scheduler_pb2.WorkerRegistration(), Engine(),
                         scheduler_pb2.WorkerLoad, 1.0, peers.__setitem__)  # fmt: skip
        self.stopped = False
        self.hangs = False  # stopped, its run still waits until cancelled (no answer)
        self.finished = False  # its run returned
        self._stop = asyncio.Event()

    async def run(self) -> None:
        await self._stop.wait()
        if self.hangs:
            await asyncio.Event().wait()  # until cancelled
        self.finished = True

    def stop(self) -> None:
        self.stopped = True
        self._stop.set()
        super().stop()

    def connect(self) -> None:
        self.connected.set()
        self.disconnected_at = None

    def disconnect(self) -> None:
        self.connected.clear()
        self.disconnected_at = time.monotonic()


class Resolver:
    """Answers with ``answer``: addresses, or an exception to raise."""

    def __init__(self, *answer: str):
        self.answer: list[str] | Exception = list(answer)
        self.calls = 0

    async def __call__(self, name: str, port: int) -> list[str]:
        assert (name, port) == (NAME, 50051)
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


@dataclass
class World:
    resolver: Resolver
    owner: TaskOwner = field(default_factory=lambda: TaskOwner("test"))
    peers: dict[str, frozenset[str]] = field(default_factory=dict)  # the servicer's KV peers
    beats: dict[str, Beat] = field(default_factory=dict)  # every heartbeat made, by address

    def __post_init__(self) -> None:
        self.schedulers = SchedulerSet(self._beat, self.owner, self.resolver)

    def _beat(self, address: str, tls_name: str | None = None) -> Beat:
        beat = self.beats[address] = Beat(address, self.peers)
        return beat


@contextlib.asynccontextmanager
async def world(*answer: str) -> AsyncIterator[World]:
    w = World(Resolver(*answer))
    try:
        yield w
    finally:
        w.schedulers.stop()
        await w.owner.cancel_all()


async def until(cond: Callable[[], bool], what: str, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        await asyncio.sleep(0.01)


# --- --scheduler: a list or dns:NAME:PORT ---


@pytest.mark.parametrize(
    ("addresses", "want"),
    [
        ((), None),
        (("a:50051", "b:50051"), None),
        (DNS, SchedulerDns(NAME, 50051)),
        (("dns:localhost:1",), SchedulerDns("localhost", 1)),
    ],
)
def test_a_list_or_a_dns_name(addresses: tuple[str, ...], want: SchedulerDns | None) -> None:
    assert SchedulerDns.parse(addresses) == want
    WorkerSettings(engine=EngineArgs(model="m"), scheduler_addresses=addresses)


@pytest.mark.parametrize(
    "addresses",
    [("dns:sched",), ("dns::50051",), ("dns:sched:0",), ("dns:sched:x",), ("dns:a:1", "b:1")],
)
def test_a_malformed_dns_name_fails_at_start(addresses: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="dns:NAME:PORT"):
        WorkerSettings(engine=EngineArgs(model="m"), scheduler_addresses=addresses)


def test_the_resolve_interval_is_positive() -> None:
    assert WorkerSettings(engine=EngineArgs(model="m")).scheduler_resolve_interval_s == 5.0
    with pytest.raises(ValueError, match="scheduler_resolve_interval_s"):
        WorkerSettings(engine=EngineArgs(model="m"), scheduler_resolve_interval_s=0)


# --- the set follows the name ---


async def test_a_fixed_list_is_the_set_and_never_resolved() -> None:
    async with world() as w:
        await w.schedulers.start(("a:1", "b:2"), 0.01)
        await asyncio.sleep(0.05)
        assert w.schedulers.addresses == ["a:1", "b:2"] and w.resolver.calls == 0


async def test_the_set_follows_the_answer() -> None:
    """A new address gets a heartbeat, a kept one keeps its own, a vanished one has its
    heartbeat stopped and the KV peers its replica named forgotten."""
    async with world("10.0.0.1", "10.0.0.2") as w:
        await w.schedulers.start(DNS, 3600.0)
        assert w.schedulers.addresses == ["10.0.0.1:50051", "10.0.0.2:50051"]
        kept, leaving = w.beats["10.0.0.1:50051"], w.beats["10.0.0.2:50051"]
        leaving.on_kv_peers(leaving.address, frozenset({"tcp://prefill:1"}))
        w.resolver.answer = ["10.0.0.3", "10.0.0.1"]
        await w.schedulers.refresh(SchedulerDns(NAME, 50051))
        assert sorted(w.schedulers.addresses) == ["10.0.0.1:50051", "10.0.0.3:50051"]
        assert list(w.schedulers) == [kept, w.beats["10.0.0.3:50051"]]
        assert leaving.stopped and not kept.stopped
        assert w.peers == {"10.0.0.2:50051": frozenset()}


async def test_ipv6_addresses_are_bracketed() -> None:
    async with world("fd00::7", "10.0.0.7") as w:
        await w.schedulers.start(DNS, 3600.0)
        assert w.schedulers.addresses == ["[fd00::7]:50051", "10.0.0.7:50051"]


async def test_a_failed_or_empty_answer_keeps_the_set(caplog: pytest.LogCaptureFixture) -> None:
    async with world("10.0.0.1", "10.0.0.2") as w:
        await w.schedulers.start(DNS, 3600.0)
        before = list(w.schedulers)
        with caplog.at_level(logging.WARNING, logger="services.worker.schedulers"):
            failed: list[list[str] | Exception] = [
                socket.gaierror(-2, "Name or service not known"),
                TimeoutError(),
                [],
            ]
            for answer in failed:
                w.resolver.answer = answer
                await w.schedulers.refresh(SchedulerDns(NAME, 50051))
                assert list(w.schedulers) == before
        assert not any(b.stopped for b in w.beats.values())
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "Name or service not known" in warnings[0]  # rate-limited


async def test_the_name_is_looked_up_again_every_interval() -> None:
    async with world("10.0.0.1") as w:
        await w.schedulers.start(DNS, 0.01)
        w.resolver.answer = ["10.0.0.1", "10.0.0.2"]
        await until(lambda: len(w.schedulers.addresses) == 2, "the new replica followed", 2)


# --- readiness: registered with one replica at least ---


async def test_ready_with_one_replica_of_two() -> None:
    async with world() as w:
        assert w.schedulers.registration()[0]  # none configured: nothing to wait for
        await w.schedulers.start(("a:1", "b:2"), 5.0)
        ok, why = w.schedulers.registration()
        assert not ok and "a:1" in why and "b:2" in why
        w.beats["b:2"].connect()
        ok, why = w.schedulers.registration()
        assert ok and "a:1" in why and "b:2" not in why
        w.beats["a:1"].connect()
        w.beats["b:2"].disconnect()
        assert w.schedulers.registration()[0]
        w.beats["a:1"].disconnect()
        assert not w.schedulers.registration()[0]


async def test_not_ready_while_the_name_resolves_to_nothing() -> None:
    async with world() as w:
        await w.schedulers.start(DNS, 3600.0)
        assert w.schedulers.registration() == (False, "no global scheduler replica found yet")


async def test_serving_waits_for_the_first_registration_only() -> None:
    async with world() as w:
        await w.schedulers.start(("a:1", "b:2"), 5.0)
        assert not await w.schedulers.wait_registered(0.05)
        asyncio.get_running_loop().call_later(0.05, w.beats["b:2"].connect)
        start = time.monotonic()
        assert await w.schedulers.wait_registered(5.0)
        assert time.monotonic() - start < 1.0 and not w.beats["a:1"].connected.is_set()


async def test_a_worker_whose_name_never_resolved_stops_past_the_bound() -> None:
    """The first lookup failed: no heartbeat at all, and the worker stops (for its supervisor)
    past the bound as one no replica knows."""
    async with world() as w:
        w.resolver.answer = socket.gaierror(-2, "Name or service not known")
        await w.schedulers.start(DNS, 3600.0)
        stop, code = StopSignal(), [0]
        watch = w.owner.spawn(worker_main.watch_registration(w.schedulers, stop, 0.2, code), "w")
        await until(lambda: watch.done(), "stopped", 3)
        assert stop.event.is_set() and code == [1]


async def test_the_registration_watch_follows_the_set() -> None:
    """Registered with the one replica: no stop. The name then answers another replica, which
    never has the registration: the worker stops past the bound."""
    async with world("10.0.0.1") as w:
        await w.schedulers.start(DNS, 3600.0)
        w.beats["10.0.0.1:50051"].connect()
        stop, code = StopSignal(), [0]
        watch = w.owner.spawn(worker_main.watch_registration(w.schedulers, stop, 0.2, code), "w")
        await asyncio.sleep(2 * worker_main.REGISTRATION_POLL_S)
        assert not watch.done()
        w.resolver.answer = ["10.0.0.2"]
        await w.schedulers.refresh(SchedulerDns(NAME, 50051))
        await until(lambda: watch.done(), "stopped", 3)
        assert code == [1]


# --- a real worker, a real scheduler ---


@contextlib.asynccontextmanager
async def scheduler() -> AsyncIterator[tuple[SchedulerServicer, int]]:
    servicer = SchedulerServicer(WorkerRegistry(5.0), create_directory("memory"), RoutingPolicy())
    server = rpc.server()
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(servicer, server)
    port = rpc.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(0)


@pytest.mark.slow
async def test_a_real_worker_finds_the_scheduler_by_name(tiny_model: Path, tmp_path: Path) -> None:
    """``baton worker --scheduler dns:localhost:PORT`` registers with the scheduler at the
    address the name resolves to (not through gRPC's own ``dns:`` target) and is ready."""
    ready_file, log = tmp_path / "ready.json", tmp_path / "worker.log"
    async with scheduler() as (servicer, port):
        argv = [sys.executable, "-m", "baton.cli", "worker", "--model", str(tiny_model),
                "--num-kv-blocks", "64", "--max-model-len", "256", "--worker-id", "w-dns",
                "--scheduler", f"dns:localhost:{port}", "--metrics-port", "0",
                "--ready-file", str(ready_file)]  # fmt: skip
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
        try:
            await until(lambda: ready_file.exists() or proc.poll() is not None, "ready", 60)
            assert proc.poll() is None, log.read_text()
            assert servicer.is_registered(WorkerId("w-dns"))
            metrics_port = json.loads(ready_file.read_text())["metrics_port"]
            async with httpx.AsyncClient() as client:
                ready = await client.get(f"http://127.0.0.1:{metrics_port}/ready")
            assert ready.status_code == 200, ready.text
            assert "registered with every replica" in ready.json()["detail"]
            assert f"registered with the global scheduler at 127.0.0.1:{port}" in log.read_text()
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)


async def test_stopping_waits_for_the_goodbyes_within_a_bound() -> None:
    """``ended`` returns once every heartbeat has ended its stream after ``stop`` (their
    goodbyes sent), and a replica that never answers holds it no longer than its bound."""
    async with world() as w:
        await w.schedulers.start(("a:1", "b:2"), 0.01)
        hung = w.beats["b:2"]
        hung.hangs = True  # a replica that does not answer: its stream never ends
        w.schedulers.stop()
        start = time.monotonic()
        await w.schedulers.ended(0.3)
        waited = time.monotonic() - start
        assert 0.3 <= waited < 2.0 and hung.stopped
        assert w.beats["a:1"].finished
