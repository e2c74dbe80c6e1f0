"""The executor seam between the engine core and its workers.

``UniprocExecutor`` runs the single worker in the core's own process (tp=1). A multiprocess
executor for tensor parallelism keeps the same four calls, broadcasting the scheduler output.
"""

from abc import ABC, abstractmethod
from typing import Protocol

from services.worker.engine.config import EngineConfig
from services.worker.engine.messages import ModelInfo
from services.worker.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from services.worker.engine.worker.worker import Worker


class StepResult(Protocol):
    def result(self) -> ModelRunnerOutput: ...

    def take_transfers(self) -> tuple[list[str], list[str], list[str]]: ...


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum across ranks)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache on every worker; called once, before the first step."""

    @abstractmethod
    def submit(self, sched: SchedulerOutput) -> StepResult:
        """Start one step without waiting for it; ``result()`` waits for rank 0's tokens."""

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

    def model_info(self) -> ModelInfo:
        return self.worker.runner.model_info()

    @property
    def side_channel(self) -> str:
        """The KV-transfer handshake address ("" when KV transfer is off)."""
        return self.worker.side_channel

    def shutdown(self) -> None:
        self.worker.shutdown()
