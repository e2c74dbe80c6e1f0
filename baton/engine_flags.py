"""The engine's flags on ``baton worker`` and ``baton serve``: the ``EngineArgs`` fields they
set (type, default and choices from ``EngineArgs`` itself, help text here), read back into
``EngineArgs`` for a worker, or passed on as flags from ``baton serve`` to its workers."""

import argparse
import dataclasses
import typing
from typing import Any

from services.worker.engine.config import (
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    EngineArgs,
)

# EngineArgs fields that are flags of ``baton worker`` and ``baton serve`` (``--field-name``).
# Type, default and choices come from EngineArgs itself, the help text from ENGINE_HELP; a bool
# that defaults to True or None becomes ``--<name>/--no-<name>`` (without its ``enable_``).
ENGINE_FLAGS = (
    "served_model_name", "dtype", "load_format", "seed", "max_model_len", "block_size",
    "num_kv_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs",
    "max_num_batched_tokens", "attention_backend", "device", "enable_prefix_caching",
    "enforce_eager", "async_scheduling", "kv_lease_seconds", "kv_recompute_on_failure",
    "tensor_parallel_size", "distributed_executor_backend", "enable_expert_parallel",
    "quantization", "kv_cache_dtype", "fp8_fast_accumulation", "piecewise_cuda_graph_tokens",
    "grammar_compile_threads", "grammar_compile_timeout_s", "grammar_max_whitespace",
)  # fmt: skip
ENGINE_HELP = {
    "served_model_name": "the model's name in the API: the model field of requests, "
    "/v1/models (default: the checkpoint directory's name)",
    "dtype": "the weights' and activations' type: auto (the checkpoint's bfloat16 or float16 "
    "on a GPU, float32 on CPU), float32, float16 (or half) or bfloat16",
    "load_format": "how weights are read: safetensors (a checkpoint directory's files), gguf "
    "(a llama.cpp .gguf file, dequantized as it loads; auto picks the one the model is) or "
    "dummy (random weights of the checkpoint's shapes, for tests and benchmarks)",
    "seed": "the engine's random seed: given, requests without a seed of their own sample the "
    "same in every run (and in every worker given it); by default each worker draws from a "
    "random state of its own. A request's own seed samples the same everywhere either way",
    "max_model_len": "the longest prompt plus completion, in tokens (default: the model's "
    "context length)",
    "block_size": "tokens per KV cache block, the prefix cache's unit (128 prefills long "
    "prompts faster, at coarser prefix hits)",
    "num_kv_blocks": "the KV cache's size in blocks of --block-size tokens (default: sized "
    "from --kv-cache-memory-bytes, else from free GPU memory, else 1 GiB on CPU)",
    "kv_cache_memory_bytes": "the KV cache's size in bytes (default: free GPU memory times "
    "--gpu-memory-utilization, less weights and activations; 1 GiB on CPU)",
    "gpu_memory_utilization": "the fraction of the GPU's memory the engine may use in all "
    "(weights, activations, KV cache) when it sizes its KV cache",
    "max_num_seqs": "the most sequences (requests) one engine step runs together",
    "max_num_batched_tokens": "the most tokens one engine step computes, prefill chunks and "
    "decodes together (default: 8192, or --max-num-seqs if larger)",
    "attention_backend": "auto (FlashAttention-4 on a Hopper GPU where it is installed, else "
    "Triton; torch on CPU), triton, flash_attn or torch (the plain-PyTorch reference)",
    "device": "where the engine runs: auto (cuda when a GPU is visible, else cpu)",
    "enable_prefix_caching": "reuse the KV cache of a prompt's prefix that an earlier request "
    "computed",
    "enforce_eager": "run every step eagerly, without CUDA graphs (slower decode on a GPU; "
    "no effect on CPU)",
    "async_scheduling": "schedule the next step while the device runs this one (default: on "
    "with CUDA, off on CPU)",
    "kv_lease_seconds": "prefill side: seconds a prompt's KV cache waits for its decode worker "
    "to pull it before it is freed",
    "kv_recompute_on_failure": "decode side, when pulling a prompt's KV cache from its "
    "prefill worker fails (that worker died): recompute the prompt on this worker, so the "
    "client never sees the failure; --no-kv-recompute-on-failure fails the request with a "
    "502 (kv_transfer_failed) instead",
    "kv_cache_dtype": "auto: the KV cache in the model's dtype; fp8: in e4m3, one byte an "
    "element, with a scale per layer",
    "fp8_fast_accumulation": "FP8 models: batched products accumulate in the tensor cores' own "
    "precision instead of float32 (default: on; faster, less exact over long rows)",
    "piecewise_cuda_graph_tokens": "steps of up to N tokens that the decode graphs do not "
    "take (prefill, mixed) replay CUDA graphs split at each attention call (0: eager; "
    "default: 8192 on one GPU, 0 at tensor_parallel_size > 1)",
    "quantization": "fp8: quantize a float checkpoint's linear layers to FP8 at load (an FP8 "
    "checkpoint is read as it is, without this flag)",
    "tensor_parallel_size": "split the model over N ranks (GPUs), one process each "
    "(baton serve gives each worker N GPUs)",
    "enable_expert_parallel": "mixture-of-experts models: each of the --tensor-parallel-size "
    "ranks holds a 1/N share of the experts, whole, instead of a 1/N slice of every expert",
    "grammar_compile_threads": "threads compiling the grammars of structured outputs (JSON "
    "schemas, regexes, tools)",
    "grammar_compile_timeout_s": "seconds a request may wait for its grammar to compile "
    "before it fails (a 400)",
    "grammar_max_whitespace": "JSON output: whitespace characters allowed between two of its "
    "tokens (0: compact JSON only); a bound, or a weak model may fill its answer with them",
    "distributed_executor_backend": "how the ranks run: uni (in the engine core, one rank), mp "
    "(a process per rank) or ray (a Ray actor per rank; RAY_ADDRESS names the cluster) "
    "(default: uni at one rank, else mp)",
}
_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _flag(name: str) -> str:
    """The flag that sets ``name`` off its default: ``--no-<name>`` for a bool on by default
    (``--<name>`` sets it on, as it is)."""
    field = _FIELDS[name]
    if field.type is bool and field.default is True:
        return "--no-" + name.removeprefix("enable_").replace("_", "-")
    return "--" + name.replace("_", "-")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    for name in ENGINE_FLAGS:
        field, flag = _FIELDS[name], _flag(name)
        kw: dict[str, Any] = {"dest": name, "default": field.default, "help": ENGINE_HELP.get(name)}
        if field.type is bool and field.default is True:  # --x/--no-x: the help says it is on
            flag = "--" + name.removeprefix("enable_").replace("_", "-")
            kw["action"] = argparse.BooleanOptionalAction
        elif field.type is bool:
            kw["action"] = "store_true"
        elif typing.get_args(field.type) == (bool, type(None)):
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(field.type) is typing.Literal:
            kw["choices"] = typing.get_args(field.type)
        else:  # str, int, float, or one of them | None
            kw["type"] = next(t for t in (*typing.get_args(field.type), field.type)
                              if t in (str, int, float))  # fmt: skip
        if name == "load_format":
            kw["choices"] = LOAD_FORMATS
        if name == "distributed_executor_backend":
            kw["choices"] = EXECUTOR_BACKENDS
        if name == "quantization":
            kw["choices"] = ("fp8",)
        if name == "kv_cache_dtype":
            kw["choices"] = KV_CACHE_DTYPES
        p.add_argument(flag, **kw)
    p.add_argument("--grammar-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="read the tokenizer's vocabulary for the grammar compiler at start, in "
                   "the background, so that the first request with a JSON schema, regex or "
                   "tools does not wait for it (0.5-2 s)")  # fmt: skip


def engine_args(args: argparse.Namespace) -> EngineArgs:
    role = getattr(args, "role", "both")
    return EngineArgs(
        model=args.model,
        kv_transfer=role in ("prefill", "decode") or getattr(args, "kv_transfer", False),
        grammar_warmup=getattr(args, "grammar_warmup", True),
        **{name: getattr(args, name) for name in ENGINE_FLAGS},
    )


def engine_flags_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags as given (those off their default), to pass on to ``baton worker``."""
    argv = []
    for name in ENGINE_FLAGS:
        value, default, flag = getattr(args, name), _FIELDS[name].default, _flag(name)
        if value == default:
            continue
        if isinstance(value, bool) and isinstance(default, bool):
            argv.append(flag)
        elif isinstance(value, bool):  # --x / --no-x
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    if not getattr(args, "grammar_warmup", True):
        argv.append("--no-grammar-warmup")
    return argv
