"""``EngineArgs`` (what a user or CLI passes) → frozen ``EngineConfig`` (what the engine reads).

Every "auto" is resolved here, once, before freezing; each component then takes the narrowest
sub-config it needs. Nothing downstream mutates a config: values discovered later (the number of
KV blocks that fit in memory) travel as explicit constructor arguments instead.
"""

import dataclasses
import glob
import os
import secrets
import sys
import uuid
from dataclasses import dataclass
from typing import Literal

from services.worker.engine.model_config import ArchConfig, load_arch_config, load_hf_config
from services.worker.engine.models.registry import applies_sliding_window, check_architecture
from services.worker.engine.quantization.config import (
    QuantConfig,
    check_expert_slice,
    parse_quantization,
)
from shared.gguf_files import default_model_name, gguf_path

DTYPES = ("float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # checkpoint directory, or a GGUF file (or a directory holding one)
    tokenizer: str  # tokenizer directory (defaults to the checkpoint)
    served_model_name: str
    dtype: str  # one of DTYPES, resolved
    load_format: str  # safetensors | gguf | dummy, resolved
    seed: int  # dummy weights and torch's generator: EngineArgs.seed, or 0
    # the random state that requests without their own seed draw from: EngineArgs.seed, or 63
    # random bits drawn once per engine (EngineArgs.seed says why)
    sampling_seed: int
    max_model_len: int  # prompt + output tokens per request
    arch: ArchConfig
    fused_ops: bool  # Triton kernels for norm / rotary / SiLU·mul (ops/fused_ops.py)
    quantization: QuantConfig | None = None  # how the linear layers are kept (quantization/)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    enable_prefix_caching: bool
    num_blocks: int | None  # explicit block count; None: size from the memory budget
    kv_cache_memory_bytes: int | None  # explicit budget; None: device default
    gpu_memory_utilization: float  # fraction of GPU memory the engine may use in all
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (e4m3, a scale per layer)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # running requests per step
    max_num_batched_tokens: int  # token budget per step
    enable_chunked_prefill: bool  # split long prompts across steps
    max_model_len: int
    async_scheduling: bool = False  # schedule step N+1 while step N runs (core.py)


EXECUTOR_BACKENDS = ("uni", "mp", "ray")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # uni: the one rank in the core's process | mp: a process per rank | ray: a Ray actor per rank
    distributed_executor_backend: str = "uni"
    # a mixture-of-experts model's experts split whole over the ranks (each rank E/tp of them),
    # not each expert's intermediate dimension (models/layers/moe.py); no effect on a dense one
    enable_expert_parallel: bool = False


@dataclass(frozen=True)
class AttentionConfig:
    backend: str  # a name in attention.registry, resolved from "auto"


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # "cpu" | "cuda"
    cuda_graph_batch_sizes: tuple[int, ...]  # decode batch sizes captured; () = eager only
    piecewise_graph_sizes: tuple[int, ...] = ()  # token counts of piecewise graphs; () = none


@dataclass(frozen=True)
class KVTransferConfig:
    enabled: bool  # a NIXL agent with the KV cache registered; P/D requests accepted
    engine_id: str  # this engine's NIXL agent name (unique per process)
    side_channel_host: str  # where the handshake socket listens (its port is chosen at start)
    lease_seconds: float  # prefill side: how long finished blocks wait to be pulled
    recompute_on_failure: bool  # decode side: a failed pull recomputes the prompt locally
    connector: str = "nixl"  # the worker half, a name in kv_transfer/connector.CONNECTORS


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Grammar-constrained decoding (engine/structured/)."""

    compile_threads: int = 2  # the compiling pool's threads (and xgrammar's own per grammar)
    compile_timeout_s: float = 30.0  # a request whose grammar is not ready by then fails
    cache_bytes: int = 256 << 20  # compiled grammars kept (xgrammar's cache, per engine)
    # JSON: whitespace characters allowed between two of its tokens (a pretty-printed object's
    # newline and indentation); 0: none beyond the single spaces of ", " and ": "
    max_whitespace: int = 32
    warmup: bool = False  # read the vocabulary for the compiler at start (off the step loop)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    attention: AttentionConfig
    device: DeviceConfig
    kv_transfer: KVTransferConfig = KVTransferConfig(False, "", "127.0.0.1", 30.0, False)
    structured: StructuredOutputConfig = StructuredOutputConfig()


def _check_block_experts(
    arch: ArchConfig, quant: QuantConfig | None, parallel: ParallelConfig
) -> None:
    """Each rank's slice of every expert (no expert parallelism) must suit the experts' weight
    format (``check_expert_slice``): refused here, before any rank starts."""
    moe = arch.moe
    if moe is None or parallel.enable_expert_parallel:
        return
    check_expert_slice(quant, moe.intermediate_size, parallel.tensor_parallel_size)


@dataclass
class EngineArgs:
    """Keyword arguments of ``LLM(...)``/``AsyncLLM`` and flags of ``baton worker``."""

    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    # None: requests without a seed of their own draw from a random state of this engine's own
    # (os.urandom), so two workers, or two runs, never repeat each other's samples; dummy
    # weights are those of seed 0. A seed makes a run reproducible, vLLM's LLM(seed=...):
    # unseeded requests then draw the same in every engine given it.
    seed: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: uni at tp=1, else mp
    # MoE models: each rank holds E/tp whole experts instead of 1/tp of every expert
    enable_expert_parallel: bool = False
    attention_backend: str = "auto"
    fused_ops: bool | None = None  # None: on for CUDA, off for CPU
    enforce_eager: bool = False  # no CUDA graphs
    max_cuda_graph_batch_size: int = 256
    # steps of up to this many tokens that the decode graphs do not take (prefill chunks, mixed
    # steps) replay piecewise CUDA graphs (worker/piecewise_graphs.py), capped at the step's
    # token budget; 0: they run eagerly. None: up to PIECEWISE_DEFAULT_TOKENS on one GPU
    # (tensor_parallel_size=1; above it, only when asked for: not yet measured there)
    piecewise_cuda_graph_tokens: int | None = None
    async_scheduling: bool | None = None  # None: on for CUDA (hides host work), off for CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    kv_transfer: bool = False  # disaggregated prefill/decode over NIXL
    kv_lease_seconds: float = 30.0
    kv_side_channel_host: str = "127.0.0.1"
    kv_recompute_on_failure: bool = True  # a failed pull: prompt recomputed (False: an error)
    kv_connector: str = "nixl"  # nixl | fake (in-process tensor copies, for tests)
    quantization: str | None = None  # fp8: quantize a float checkpoint's linear layers at load
    kv_cache_dtype: str = "auto"  # fp8: the KV cache in e4m3 (1 byte an element)
    # FP8 linear layers: products of more than one row accumulate in the tensor cores' own
    # precision, not promoted to float32 (faster; sums over long rows less exact: measured in
    # docs/performance.md). None: on for an FP8 model (as the FP8 GEMMs of other servers run)
    fp8_fast_accumulation: bool | None = None
    # structured outputs: threads compiling grammars, how long a request may wait for its
    # grammar, the bytes of compiled grammars kept
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 30.0
    grammar_cache_bytes: int = 256 << 20
    # JSON output: whitespace characters allowed between two tokens (a bound: a weak model
    # otherwise may fill its answer with whitespace); 0: compact JSON only
    grammar_max_whitespace: int = 32
    # prepare the grammar compiler (the tokenizer's vocabulary, ~0.5-2 s) in the background at
    # start, not with the first request that has a grammar (``baton worker`` turns it on)
    grammar_warmup: bool = False

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        hf_config = load_hf_config(self.model)  # config.json, or a GGUF file's metadata
        arch = load_arch_config(self.model, hf_config)
        check_architecture(arch.architecture)
        device = _resolve_device(self.device)
        max_model_len = _resolve_max_model_len(self.max_model_len, arch)
        _check_positive(
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        parallel = self._parallel_config(arch, device)
        quantization = parse_quantization(hf_config, self.quantization, self.fp8_fast_accumulation)
        _check_block_experts(arch, quantization, parallel)
        from services.worker.engine.kv_transfer.connector import CONNECTORS

        if self.kv_connector not in CONNECTORS:
            known = ", ".join(sorted(CONNECTORS))
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}; known: {known}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        budget = self.max_num_batched_tokens or max(8192, self.max_num_seqs)
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)
        if budget < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        from services.worker.engine.attention.registry import resolve_backend_name

        backend = resolve_backend_name(self.attention_backend, device)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")  # fmt: skip
        if self.kv_cache_dtype == "fp8" and arch.linear_attention is not None:
            raise ValueError(
                f"kv_cache_dtype='fp8' is not supported for {arch.architecture}: its Gated "
                "DeltaNet layers keep their recurrent state in the cache's pages, in the "
                "model's dtype (use 'auto')"
            )
        if self.kv_cache_dtype == "fp8" and arch.mla is not None:
            raise ValueError(
                f"kv_cache_dtype='fp8' is not supported for {arch.architecture}: its multi-head "
                "latent attention caches latents, kept in the model's dtype (use 'auto')"
            )

        recurrent = arch.linear_attention is not None
        dtype = _resolve_dtype(self.dtype, arch, device)
        itemsize = 4 if dtype == "float32" else 2  # (an FP8 cache is refused above)
        block_size = state_block_size(arch, self.block_size, parallel.tensor_parallel_size,
                                      itemsize)  # fmt: skip
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer or self.model,
                served_model_name=self.served_model_name or default_model_name(self.model),
                dtype=dtype,
                load_format=_resolve_load_format(self.load_format, self.model),
                seed=self.seed if self.seed is not None else 0,
                sampling_seed=self.seed if self.seed is not None else secrets.randbits(63),
                max_model_len=max_model_len,
                arch=arch,
                fused_ops=device == "cuda" if self.fused_ops is None else self.fused_ops,
                quantization=quantization,
            ),
            cache=CacheConfig(
                block_size=block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_model_len=max_model_len,
                async_scheduling=(
                    device == "cuda" if self.async_scheduling is None else self.async_scheduling
                ),
            ),
            parallel=parallel,
            attention=AttentionConfig(backend=backend),
            device=DeviceConfig(
                device,
                self._graph_sizes(device),
                self.piecewise_graph_sizes(
                    device, budget, parallel.tensor_parallel_size, recurrent=recurrent
                ),
            ),
            structured=self._structured_config(),
            kv_transfer=KVTransferConfig(
                enabled=self.kv_transfer,
                engine_id=f"baton-{uuid.uuid4().hex[:12]}",
                side_channel_host=self.kv_side_channel_host,
                lease_seconds=self.kv_lease_seconds,
                recompute_on_failure=self.kv_recompute_on_failure,
                connector=self.kv_connector,
            ),
        )

    def _structured_config(self) -> StructuredOutputConfig:
        _check_positive(grammar_compile_threads=self.grammar_compile_threads,
                        grammar_cache_bytes=self.grammar_cache_bytes)  # fmt: skip
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be > 0")
        if self.grammar_max_whitespace < 0:
            raise ValueError("grammar_max_whitespace must be >= 0")
        return StructuredOutputConfig(
            self.grammar_compile_threads, self.grammar_compile_timeout_s, self.grammar_cache_bytes,
            self.grammar_max_whitespace, self.grammar_warmup,
        )  # fmt: skip

    def _parallel_config(self, arch: ArchConfig, device: str) -> ParallelConfig:
        """The ranks' executor, once the model's sizes are known to split over them."""
        tp = self.tensor_parallel_size
        backend = self.distributed_executor_backend or ("uni" if tp == 1 else "mp")
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {backend!r}"
            )
        ep = self.enable_expert_parallel
        if tp == 1:
            return ParallelConfig(1, backend, ep)
        if backend == "uni":
            raise ValueError("tensor_parallel_size > 1 needs the mp or ray executor, not uni")
        for name, size in self._splits(arch).items():
            if size % tp:
                raise ValueError(f"{name}={size} does not split over tensor_parallel_size={tp}")
        kv = arch.num_kv_heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"num_key_value_heads={kv} and tensor_parallel_size={tp}: one must divide the "
                "other (KV heads are split across ranks, or each replicated on tp/kv ranks)"
            )
        if device == "cuda" and backend == "mp":
            import torch

            if tp > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={tp} but this process sees "
                    f"{torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES)"
                )
        if self.kv_transfer and self.kv_connector == "fake":
            raise ValueError("the fake KV connector copies within one process: tp=1 only")
        return ParallelConfig(tp, backend, ep)

    def _splits(self, arch: ArchConfig) -> dict[str, int]:
        """The sizes tensor parallelism divides by its ranks: heads, the dense MLPs'
        intermediate dimension, and a mixture of experts' experts (with expert parallelism)
        or one expert's intermediate dimension (without), and the shared experts'."""
        splits = {"num_attention_heads": arch.num_heads}
        if arch.linear_attention is not None:
            splits["linear_num_key_heads"] = arch.linear_attention.num_key_heads
            splits["linear_num_value_heads"] = arch.linear_attention.num_value_heads
        moe = arch.moe
        if moe is None or len(moe.sparse_layers) < arch.num_layers:  # (some layer is dense)
            splits["intermediate_size"] = arch.intermediate_size
        if moe is None:
            return splits
        if self.enable_expert_parallel:
            splits["num_experts (enable_expert_parallel)"] = moe.num_experts
        else:
            splits["moe_intermediate_size"] = moe.intermediate_size
        if moe.shared_intermediate_size:
            splits["the shared experts' intermediate size"] = moe.shared_intermediate_size
        return splits

    def piecewise_graph_sizes(
        self, device: str, budget: int, tp: int, recurrent: bool = False
    ) -> tuple[int, ...]:
        """Token counts of the piecewise graphs (``piecewise_sizes``), up to the budget."""
        tokens = self.piecewise_cuda_graph_tokens
        if tokens is not None and tokens < 0:
            raise ValueError("piecewise_cuda_graph_tokens must be >= 0 (0: none)")
        if device != "cuda" or self.enforce_eager:
            return ()
        if recurrent:  # (its Gated DeltaNet layers are no split point: they run in the pieces)
            if tokens:
                raise ValueError(
                    "piecewise_cuda_graph_tokens: not supported for a model with Gated "
                    "DeltaNet layers (their prefill kernels launch per request)"
                )
            return ()
        if tokens is None:
            tokens = PIECEWISE_DEFAULT_TOKENS if tp == 1 else 0
        return piecewise_sizes(min(tokens, budget))

    def _graph_sizes(self, device: str) -> tuple[int, ...]:
        """1, 2, 4, 8, then every multiple of 16, up to the largest decode batch."""
        if device != "cuda" or self.enforce_eager:
            return ()
        top = min(self.max_cuda_graph_batch_size, self.max_num_seqs)
        ladder = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
        if ladder[-1] != top:
            ladder.append(top)
        return tuple(ladder)


# the default top of the piecewise graphs: a step of more tokens is bound by its GPU work,
# not by the host's launches (on an H200 a 2,048-token FP8 prefill step runs 25.5 ms of
# kernels: 29.2 ms replayed, 32-45 ms launched one by one), and every size costs memory
PIECEWISE_DEFAULT_TOKENS = 8192


def piecewise_sizes(top: int) -> tuple[int, ...]:
    """16, 32, 64, 128, 256, then steps of 128 up to 2,048, of 256 up to 4,096, of 512 up to
    8,192 (an eighth of the power of two below), ... up to ``top`` (itself included): above
    1,024 tokens a step is padded by less than an eighth of its tokens."""
    ladder = [s for s in (16, 32, 64, 128, 256) if s < top]
    size = 384
    while size < top:
        ladder.append(size)
        size += max(128, (1 << (size.bit_length() - 1)) // 8)
    return (*ladder, top) if top >= 1 else ()


def state_block_size(arch: ArchConfig, block_size: int, tp: int, cache_itemsize: int) -> int:
    """The block size of a model with Gated DeltaNet layers: the smallest multiple of
    ``block_size`` whose page holds one layer's recurrent state (float32, on one of ``tp``
    ranks) in each of its layer slots of ``cache_itemsize``-byte values, as vLLM raises its
    attention block size for Mamba layers: every KV cache group's pages are the same bytes.
    Others keep ``block_size``."""
    la = arch.linear_attention
    if la is None:
        return block_size
    parts, heads, dim = arch.kv_cache_entry()
    per_token = parts * max(1, heads // tp) * dim * cache_itemsize  # a layer slot's bytes
    tokens = -(-la.state_elements(tp) * 4 // per_token)
    return max(block_size, -(-tokens // block_size) * block_size)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu" or (device == "auto" and _no_gpu_device_node()):
        return "cpu"
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _no_gpu_device_node() -> bool:
    """A Linux machine with no NVIDIA device node (``/dev/nvidia<N>``, or WSL's ``/dev/dxg``),
    where CUDA cannot be available: "auto" is the CPU without importing torch, which the worker
    service's front end (it builds this config and runs no model) otherwise imports for this
    question alone, 3 s of its start on a 2-core VM."""
    if sys.platform != "linux":
        return False
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"))


def _resolve_dtype(dtype: str, arch: ArchConfig, device: str) -> str:
    if dtype == "auto":
        if device == "cpu":
            return "float32"  # CPU matmuls in half precision are slow and diverge from the oracle
        return arch.torch_dtype if arch.torch_dtype in ("bfloat16", "float16") else "bfloat16"
    if dtype == "half":
        return "float16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def _resolve_load_format(load_format: str, model: str) -> str:
    """auto: gguf for a GGUF model (a file, or a directory holding one), else safetensors."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    found = "gguf" if gguf_path(model) is not None else "safetensors"
    if load_format in ("safetensors", "gguf") and load_format != found:
        raise ValueError(f"load_format={load_format!r}, but {model} is a {found} checkpoint")
    return found if load_format == "auto" else load_format


def _resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    limit = arch.max_position_embeddings
    # (Gemma 3 writes the context its scaling gives already: 128k, 32k × 8)
    scaled = arch.rope.rope_type in ("linear", "dynamic") and arch.rope.factor > 1
    if scaled and arch.model_type != "gemma3_text":
        limit = int(limit * arch.rope.factor)
    if arch.sliding_window is not None and not applies_sliding_window(arch.architecture):
        # A model without sliding-window attention: full attention equals it only within the
        # window.
        limit = min(limit, arch.sliding_window)
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(
            f"max_model_len={requested} is outside [1, {limit}] (the model's context length)"
        )
    return requested
