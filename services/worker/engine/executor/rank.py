"""One tensor-parallel rank: its ``Worker`` and the calls an executor makes on it.

The calls are msgspec structs of one tagged union (``RankCall``), encoded as msgpack: the
multiprocess executor sends them over ZMQ, the Ray executor as the bytes of an actor call; no
pickled object crosses either. Every rank gets every call, in the same order, so the ranks run
the same collectives in the same order.

    call                 answered by      answer
    NumBlocks            every rank       int: KV blocks that fit this rank (the core takes the min)
    InitializeCache      every rank       True
    Submit(sched)        every rank, only with KV transfer (else nobody: no round trip per step)
                                          TransferResults seen as the step was submitted
    Sample(bitmask)      nobody           (the last step submitted samples: constrained rows)
    Collect              rank 0           ModelRunnerOutput of the oldest submitted step
    PollTransfers        every rank       TransferResults
    GetTransferInfo      every rank       ConnectorInfo (``merge_infos``: the side channels joined)
    GetModelInfo         rank 0           ModelInfo (this rank's shard of the weights)
    Shutdown             nobody           the rank exits

A rank that fails a call answers ``RankReply(error=...)`` whatever the call and then exits: its
collectives are out of step with its peers', so it cannot go on.

With KV transfer every rank has its own connector, and ``TransferMerge`` makes one engine's
progress of theirs: a pull ends when it has ended on every rank (failed if it failed on any), a
lease when every rank's part of it has.
"""

import logging
from abc import abstractmethod
from collections import defaultdict, deque
from typing import Any

import msgspec

from services.worker.engine.config import EngineConfig
from services.worker.engine.distributed.parallel_state import (
    StoreSpec,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from services.worker.engine.executor.executor import Executor, RankFailedError, StepResult
from services.worker.engine.kv_transfer.connector import ConnectorInfo, TransferResults
from services.worker.engine.messages import ModelInfo
from services.worker.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from services.worker.engine.structured.bitmask import BitmaskWire, GrammarBitmask
from services.worker.engine.worker.worker import Worker, WorkerStep

logger = logging.getLogger(__name__)


class NumBlocks(msgspec.Struct, tag="num_blocks"):
    pass


class InitializeCache(msgspec.Struct, tag="init_cache"):
    num_blocks: int


class Submit(msgspec.Struct, tag="submit"):
    sched: SchedulerOutput


class Sample(msgspec.Struct, tag="sample"):
    grammar: BitmaskWire | None  # rank 0's (the others sample nothing: they get None)


class Collect(msgspec.Struct, tag="collect"):
    pass


class PollTransfers(msgspec.Struct, tag="poll"):
    pass


class GetTransferInfo(msgspec.Struct, tag="transfer_info"):
    pass


class GetModelInfo(msgspec.Struct, tag="model_info"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


RankCall = (
    NumBlocks | InitializeCache | Submit | Sample | Collect | PollTransfers | GetTransferInfo
    | GetModelInfo | Shutdown
)  # fmt: skip


class RankReply(msgspec.Struct):
    rank: int
    seq: int  # the call's number (0: the rank is up, its model loaded)
    error: str = ""
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack of the answer (nil when none)


# what each call's answer decodes as, at the executor
ANSWERS: dict[type, type] = {
    NumBlocks: int,
    InitializeCache: bool,
    Submit: TransferResults,
    Collect: ModelRunnerOutput,
    PollTransfers: TransferResults,
    GetTransferInfo: ConnectorInfo,
    GetModelInfo: ModelInfo,
}


def answered_by(call: object, world_size: int, kv_transfer: bool) -> range:
    """The ranks that answer ``call`` (the executor waits for exactly these)."""
    if isinstance(call, Shutdown | Sample) or (isinstance(call, Submit) and not kv_transfer):
        return range(0)
    if isinstance(call, Collect | GetModelInfo):
        return range(1)
    return range(world_size)


class TransferMerge:
    """The engine's transfer progress from its ranks'; each request id is reported once."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._ended: dict[str, dict[int, bool]] = defaultdict(dict)  # request → rank → ok
        self._released: dict[str, set[int]] = defaultdict(set)
        self.pulls = 0  # requests whose pull finished on every rank
        self.failures = 0  # requests whose pull failed on some rank

    def add(self, per_rank: dict[int, TransferResults]) -> TransferResults:
        if self.world_size == 1:
            return per_rank.get(0, TransferResults())
        out = TransferResults()
        for rank, res in per_rank.items():
            for rid in res.finished:
                self._ended[rid][rank] = True
            for rid in res.failed:
                self._ended[rid][rank] = False
            for rid in res.released:
                self._released[rid].add(rank)
        for rid, ends in list(self._ended.items()):
            if len(ends) == self.world_size:  # no rank still reads into its blocks
                ok = all(ends.values())
                (out.finished if ok else out.failed).append(rid)
                self.pulls += ok
                self.failures += not ok
                del self._ended[rid]
        for rid, ranks in list(self._released.items()):
            if len(ranks) == self.world_size:
                out.released.append(rid)
                del self._released[rid]
        return out


def merge_infos(infos: list[ConnectorInfo], merge: TransferMerge | None = None) -> ConnectorInfo:
    """One engine's connector info from its ranks' (in rank order): the side channels joined by
    commas (what a KV handle carries), the counters summed (bytes, descriptors, seconds: every
    rank's), except that pulls and failures count requests (``merge``'s), not rank reads."""
    stats: dict[str, int | float] = {}
    for info in infos:
        for key, value in info.stats.items():
            stats[key] = stats.get(key, 0) + value
    if merge is not None and merge.world_size > 1 and "kv_pulls" in stats:
        stats["kv_pulls"], stats["kv_pull_failures"] = merge.pulls, merge.failures
    channels = [info.side_channel for info in infos]
    return ConnectorInfo(
        ",".join(channels) if any(channels) else "",
        any(info.needs_idle_progress for info in infos),
        stats,
    )


class RankWorker:
    """The rank side: joins the group, builds and loads its shard of the model, answers calls."""

    def __init__(
        self, config: EngineConfig, rank: int, store: StoreSpec, local_device: int | None = None
    ):
        world = config.parallel.tensor_parallel_size
        self.config, self.rank, self.world_size = config, rank, world
        backend = "nccl" if config.device.device == "cuda" else "gloo"
        init_tensor_parallel(rank, world, store, backend)
        self.worker = Worker(config, rank if local_device is None else local_device)
        self.worker.load_model(show_progress=False)
        self.steps: deque[WorkerStep] = deque()  # submitted, not collected (at most two)

    def handle(self, call: object) -> object | None:
        """The answer to ``call`` (None: this rank sends none)."""
        w = self.worker
        answer: object
        if isinstance(call, Submit):
            step = w.submit(call.sched)
            self.steps.append(step)
            answer = step.transfers
        elif isinstance(call, Sample):
            w.sample(call.grammar.to_bitmask() if call.grammar is not None else None)
            answer = None
        elif isinstance(call, Collect):
            answer = self.steps.popleft().result()
        elif isinstance(call, NumBlocks):
            answer = w.determine_num_blocks()
        elif isinstance(call, InitializeCache):
            w.initialize_cache(call.num_blocks)
            answer = True
        elif isinstance(call, PollTransfers):
            answer = w.poll_transfers()
        elif isinstance(call, GetTransferInfo):
            answer = w.transfer_info()
        elif isinstance(call, GetModelInfo):
            answer = msgspec.structs.replace(
                w.runner.model_info(), tensor_parallel_size=self.world_size
            )
        else:
            raise ValueError(f"unknown call {type(call).__name__}")
        kv = self.config.kv_transfer.enabled
        return answer if self.rank in answered_by(call, self.world_size, kv) else None

    def close(self) -> None:
        self.worker.shutdown()
        destroy_tensor_parallel()


class RankExecutor(Executor):
    """The executor seam over ranks that answer ``RankCall``s: what the multiprocess and the Ray
    executors share. A subclass sends a call to every rank and waits for the ranks that answer
    it (``_call``), and stops them (``_stop``)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        self.kv_transfer = config.kv_transfer.enabled
        self.transfers = TransferMerge(self.world_size)
        self.failed: str | None = None  # why the ranks failed: every later call raises it
        self._closed = False

    @abstractmethod
    def _call(self, call: object, others: object | None = None) -> dict[int, Any]:
        """Send ``call`` to every rank (``others``, when given, to every rank but rank 0); the
        decoded answers of those ``answered_by`` names."""

    @abstractmethod
    def _stop(self) -> None:
        """Stop every rank and release what reaches them."""

    def determine_num_blocks(self) -> int:
        return min(self._call(NumBlocks()).values())

    def initialize_cache(self, num_blocks: int) -> None:
        self._call(InitializeCache(num_blocks))

    def submit(self, sched: SchedulerOutput) -> StepResult:
        return RankStep(self, self.transfers.add(self._call(Submit(sched))))

    def sample(self, grammar: GrammarBitmask) -> None:
        """Rank 0 gets the bitmask; the others only take part in the sampled ids' broadcast."""
        self._call(Sample(grammar.to_wire()), Sample(None))

    def poll_transfers(self) -> TransferResults:
        if not self.kv_transfer:
            return TransferResults()
        return self.transfers.add(self._call(PollTransfers()))

    def transfer_info(self) -> ConnectorInfo:
        infos = self._call(GetTransferInfo())
        return merge_infos([infos[r] for r in range(self.world_size)], self.transfers)

    def model_info(self) -> ModelInfo:
        info = self._call(GetModelInfo())[0]
        assert isinstance(info, ModelInfo)
        return info

    def collect(self) -> ModelRunnerOutput:
        """Rank 0's tokens of the oldest step not collected yet."""
        out = self._call(Collect())[0]
        assert isinstance(out, ModelRunnerOutput)
        return out

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop()

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise RankFailedError(self.failed)

    def _fail(self, why: str) -> None:
        self.failed = why
        logger.error("the engine's ranks failed: %s", why)
        self.shutdown()
        raise RankFailedError(why)


class RankStep:
    """A step submitted to the ranks; ``result()`` collects its tokens (once)."""

    def __init__(self, executor: RankExecutor, transfers: TransferResults):
        self.executor = executor
        self.transfers = transfers
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self.executor.collect()
        return self._output
