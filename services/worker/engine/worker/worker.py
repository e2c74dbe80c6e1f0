"""``Worker``: owns one device — seeds it, loads the model, sizes and allocates the KV cache, and
runs steps through its ModelRunner. The executor talks to one Worker per tensor-parallel rank.
"""

import logging

import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.kv_transfer.connector import (
    NO_CONNECTOR,
    ConnectorInfo,
    KVConnector,
    RankPlacement,
    TransferResults,
    compat_hash,
    make_connector,
)
from services.worker.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from services.worker.engine.structured.bitmask import GrammarBitmask
from services.worker.engine.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on CPU: 1 GiB
MAX_BLOCKS = 1 << 20  # the block pool keeps a Python object per block: bound its bookkeeping
CUDA_GRAPH_RESERVE_BYTES = 512 << 20  # decode graphs' private pool (activations of ≤ 512 rows)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        on_gpu = config.device.device == "cuda"
        self.device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, self.device)
        self.connector: KVConnector | None = None  # KV transfer (worker half), when enabled

    def load_model(self, show_progress: bool = True) -> None:
        self.runner.load_model(show_progress)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the budget: an explicit count, an explicit byte budget, or the device
        default. On a GPU every byte of the budget goes to the cache (what running requests do
        not hold serves as prefix cache); on CPU, whose default budget is only a guess, no more
        than max_num_seqs full-length requests can use at once."""
        cache, sched = self.config.cache, self.config.scheduler
        per_block = self.runner.layout.bytes_per_block
        groups = self.runner.kv_groups
        # what one request of max_model_len holds over every group at its largest step (a
        # windowed group: a window's blocks and the step's chunk, whatever the context)
        chunked = sched.enable_chunked_prefill
        chunk = sched.max_num_batched_tokens if chunked else sched.max_model_len
        needed = groups.blocks_per_request(sched.max_model_len, cache.block_size, chunk)
        if cache.num_blocks is not None:
            num = cache.num_blocks
        else:
            num = min(self._kv_budget_bytes() // per_block, MAX_BLOCKS)
            if self.device.type == "cpu" and cache.kv_cache_memory_bytes is None:
                num = min(num, needed * sched.max_num_seqs)
        if num < needed:
            raise ValueError(
                f"the KV cache holds {num} blocks of {cache.block_size} tokens but one "
                f"request of max_model_len={sched.max_model_len} needs {needed} "
                f"({groups.describe()}); give it more memory or lower max_model_len"
            )
        n, bs = sched.max_model_len, cache.block_size
        logger.info(
            "KV cache: %d blocks of %.1f KiB (%s); a request of %d tokens holds %.1f MiB "
            "decoding (%.1f MiB were every layer to keep every token)",
            num, per_block / 1024, groups.describe(), n,
            groups.request_bytes(n, bs, per_block) / (1 << 20),
            groups.full_attention_bytes(n, bs, per_block) / (1 << 20),
        )  # fmt: skip
        return num

    def _kv_budget_bytes(self) -> int:
        explicit = self.config.cache.kv_cache_memory_bytes
        if explicit is not None:
            return explicit
        if self.device.type == "cpu":
            return CPU_KV_CACHE_BYTES
        # What the engine may use, minus: the weights (allocated now), the peak of the largest
        # step (profiled), memory outside PyTorch's allocator (CUDA context, cuBLAS), graphs.
        peak = self.runner.profile_peak_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        allowed = int(total * self.config.cache.gpu_memory_utilization)
        graphs = CUDA_GRAPH_RESERVE_BYTES + self.runner.piecewise_reserve_bytes(peak)
        return max(0, allowed - weights - peak - outside_torch - graphs)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        transfer = self.config.kv_transfer
        if transfer.enabled:
            assert self.runner.kv_cache is not None
            model, arch = self.config.model, self.config.model.arch
            kv_dtype = str(self.runner.kv_cache.dtype).removeprefix("torch.")
            fp8_kv = self.runner.kv_cache.dtype == torch.float8_e4m3fn  # (its scales matter)
            parts, heads, dim = arch.kv_cache_entry()
            tp = self.runner.tp
            groups = self.runner.kv_groups.describe()
            if self.runner.kv_groups.has_recurrent:  # a rank's state page holds its heads'
                groups += f"; recurrent states of {tp.world_size} rank(s)"
            compat = compat_hash(
                model.served_model_name, kv_dtype, self.config.cache.block_size,
                arch.num_layers, heads, dim, self.runner.kv_scales() if fp8_kv else (), parts,
                groups,
            )  # fmt: skip
            placement = RankPlacement(tp.rank, tp.world_size, heads)
            self.connector = make_connector(
                transfer.connector, transfer.engine_id, self.runner.kv_cache, compat,
                transfer.side_channel_host, placement,
            )  # fmt: skip

    def submit(self, sched: SchedulerOutput) -> "WorkerStep":
        """One step: queue the model's work, start this step's KV pulls, poll the transfers.

        The pulls start after the step before this one has finished on the device: blocks
        freed while it ran (a request that finished or was aborted) may be this step's pull
        targets, and that step could still write its last token's KV into them.
        """
        previous = self.runner.last_step
        step = self.runner.submit(sched)
        if self.connector is None:
            return WorkerStep(step, TransferResults())
        if sched.kv_loads and previous is not None:
            previous.wait()
        failed = self.connector.start_loads(sched.kv_loads)
        results = self.connector.poll()
        results.failed = failed + results.failed
        return WorkerStep(step, results)

    def sample(self, grammar: GrammarBitmask | None) -> None:
        """The step submitted last samples, its constrained rows under ``grammar`` (None on a
        rank other than 0, which holds no logits)."""
        self.runner.sample(grammar)

    def poll_transfers(self) -> TransferResults:
        return self.connector.poll() if self.connector is not None else TransferResults()

    def transfer_info(self) -> ConnectorInfo:
        return self.connector.info() if self.connector is not None else NO_CONNECTOR

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self.connector = None
        self.runner.release()


class WorkerStep:
    """A submitted step and the KV-transfer progress seen when it was submitted (the core
    applies ``transfers`` at once, not when the step's tokens come back)."""

    def __init__(self, step: StepHandle, transfers: TransferResults):
        self.step = step
        self.transfers = transfers

    def result(self) -> ModelRunnerOutput:
        return self.step.result()
