"""``RayExecutor``: one Ray actor per tensor-parallel rank, for ranks that span machines.

The engine core's process is the Ray driver: it joins the cluster named by ``RAY_ADDRESS`` (or
starts a local Ray), serves the ranks' ``TCPStore`` on its node's address, and creates one actor
per rank (a GPU each on CUDA). A call is the same msgpack ``RankCall`` the multiprocess executor
sends over ZMQ, passed as the bytes of one actor call; answers come back as msgpack bytes. Ray
runs each actor's calls in the order they were made, so every rank sees the same sequence.

Every wait is bounded: the executor waits for the answering ranks and, at the same time, for
the result of every call no rank answers (a failed ``Submit`` shows up there), so a rank that
raises or an actor that dies fails the engine within ``POLL_S`` with ``RankFailedError``.
"""

import contextlib
import logging
import os
import time
from typing import Any

import msgspec

from services.worker.engine.config import EngineConfig
from services.worker.engine.distributed.parallel_state import COLLECTIVE_TIMEOUT, StoreSpec
from services.worker.engine.executor.rank import (
    ANSWERS,
    RankCall,
    RankExecutor,
    RankWorker,
    answered_by,
)

logger = logging.getLogger(__name__)

POLL_S = 0.2
START_TIMEOUT_S = 1800.0
CALL_TIMEOUT_S = 300.0
FORWARDED_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "UCX_NET_DEVICES")


class RayRank:
    """The actor: a ``RankWorker`` behind one bytes-in, bytes-out method."""

    def __init__(self, config_json: bytes, rank: int, store: str, env: dict[str, str]):
        os.environ.update(env)
        config = msgspec.json.decode(config_json, type=EngineConfig)
        # Ray hands each actor its own GPU as CUDA_VISIBLE_DEVICES: it is device 0 in here
        local = 0 if config.device.device == "cuda" else None
        self.worker = RankWorker(config, rank, StoreSpec(store), local)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(RankCall)

    def ready(self) -> int:
        return self.worker.rank

    def call(self, raw: bytes) -> bytes | None:
        answer = self.worker.handle(self.decoder.decode(raw))
        return self.encoder.encode(answer) if answer is not None else None

    def close(self) -> None:
        self.worker.close()


class RayExecutor(RankExecutor):
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        import ray
        import torch.distributed as dist

        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        super().__init__(config)
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(
            host, 0, None, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
        )
        store = f"tcp:{host}:{self.store.port}"
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        on_gpu = config.device.device == "cuda"
        actor = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(RayRank)
        payload = msgspec.json.encode(config)
        self.actors: list[Any] = [
            actor.remote(payload, r, store, env) for r in range(self.world_size)
        ]
        self._unanswered: list[Any] = []  # refs of calls no rank answers: checked for errors
        self._wait({r: a.ready.remote() for r, a in enumerate(self.actors)}, START_TIMEOUT_S)
        self.encoder = msgspec.msgpack.Encoder()
        logger.info("%d tensor-parallel rank(s) up as Ray actors", self.world_size)

    def _stop(self) -> None:
        for a in self.actors:
            with contextlib.suppress(Exception):  # an actor already gone
                self.ray.kill(a)
        self.actors = []

    def _call(self, call: object, others: object | None = None) -> dict[int, Any]:
        self._check_usable()
        raw = self.encoder.encode(call)
        rest = raw if others is None else self.encoder.encode(others)
        refs = [a.call.remote(raw if r == 0 else rest) for r, a in enumerate(self.actors)]
        answering = answered_by(call, self.world_size, self.kv_transfer)
        self._unanswered += [ref for r, ref in enumerate(refs) if r not in answering]
        got = self._wait({r: refs[r] for r in answering}, CALL_TIMEOUT_S)
        if not got:
            return {}
        kind = ANSWERS[type(call)]
        return {r: msgspec.msgpack.decode(raw, type=kind) for r, raw in got.items()}

    def _wait(self, refs: dict[int, Any], timeout_s: float) -> dict[int, Any]:
        ray = self.ray
        rank_of = {ref: r for r, ref in refs.items()}
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(refs):
            pending = [ref for ref in rank_of if rank_of[ref] not in got] + self._unanswered
            ready, _ = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in ready:
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayError as e:
                    self._fail(f"a tensor-parallel rank failed: {type(e).__name__}: {e}")
                if ref in rank_of:
                    got[rank_of[ref]] = value
                else:
                    self._unanswered.remove(ref)
            if not ready and time.monotonic() > deadline:
                missing = sorted(set(refs) - set(got))
                self._fail(f"tensor-parallel rank(s) {missing} did not answer within "
                           f"{timeout_s:.0f} s")  # fmt: skip
        return got
