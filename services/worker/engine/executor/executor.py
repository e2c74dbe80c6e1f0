"""The executor seam between the engine core and its workers.

    UniprocExecutor    the one worker in the core's own process (tp=1, the default)
    MultiprocExecutor  one process per tensor-parallel rank on this host (executor/multiproc.py)
    RayExecutor        one Ray actor per rank, for ranks across machines (executor/ray_executor.py)

The core reaches its workers, and their KV connectors, only through these calls;
``make_executor`` (executor/factory.py) picks one from
``ParallelConfig.distributed_executor_backend``. This module imports none of the executors built
on it (they import it), so it takes part in no import circle.
"""

from abc import ABC, abstractmethod
from typing import Protocol

from services.worker.engine.config import EngineConfig
from services.worker.engine.kv_transfer.connector import ConnectorInfo, TransferResults
from services.worker.engine.messages import ModelInfo
from services.worker.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from services.worker.engine.structured.bitmask import GrammarBitmask
from services.worker.engine.worker.worker import Worker


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died, failed a call or stopped answering: the engine cannot go on."""


class StepResult(Protocol):
    # KV-transfer progress seen as the step was submitted: the core applies it at once
    transfers: TransferResults

    def result(self) -> ModelRunnerOutput:
        """Wait for rank 0's sampled tokens of this step."""
        ...


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum across ranks)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache on every worker (and its KV connector, when KV transfer is
        on); called once, before the first step."""

    @abstractmethod
    def submit(self, sched: SchedulerOutput) -> StepResult:
        """Start one step without waiting for it: the model's work is queued, this step's KV
        pulls started and the transfers polled."""

    @abstractmethod
    def sample(self, grammar: GrammarBitmask) -> None:
        """Let the step submitted last, which has rows constrained by a grammar
        (``SchedulerOutput.structured_req_ids``), sample with their bitmask; its forward pass
        may be running meanwhile."""

    @abstractmethod
    def poll_transfers(self) -> TransferResults:
        """Progress the KV connector between steps (an idle engine); empty without one."""

    @abstractmethod
    def transfer_info(self) -> ConnectorInfo:
        """The KV connector's side channel, idle-progress need and counters."""

    @abstractmethod
    def model_info(self) -> ModelInfo:
        """Sizes of the model and its KV cache (rank 0's view)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and their device memory; idempotent."""


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.worker = Worker(config)
        self.worker.load_model(show_progress)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def submit(self, sched: SchedulerOutput) -> StepResult:
        return self.worker.submit(sched)

    def sample(self, grammar: GrammarBitmask) -> None:
        self.worker.sample(grammar)

    def poll_transfers(self) -> TransferResults:
        return self.worker.poll_transfers()

    def transfer_info(self) -> ConnectorInfo:
        return self.worker.transfer_info()

    def model_info(self) -> ModelInfo:
        return self.worker.runner.model_info()

    def shutdown(self) -> None:
        self.worker.shutdown()
