"""Attention backends by name, imported lazily (resolving a name imports no torch: the worker
service's front end resolves its config without it). An unknown name lists the known ones."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.engine.attention.backend import AttentionBackend

_BACKENDS: dict[str, str] = {
    "torch": "services.worker.engine.attention.torch_ref:TorchAttentionBackend",
    "triton": "services.worker.engine.attention.triton_backend:TritonAttentionBackend",
    "flash_attn": "services.worker.engine.attention.flash_attn_backend:FlashAttnBackend",
}


def known_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: str) -> str:
    """Turn "auto" into the best backend for ``device``; check any other name. On CUDA: the
    FlashAttention backend on Hopper when FlashAttention-4 is installed (its prefill is the
    faster one on long prompts: docs/performance.md), else Triton."""
    if name == "auto":
        if device != "cuda":
            return "torch"
        from services.worker.engine.attention.flash_attn_backend import available

        return "flash_attn" if available() else "triton"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; known: auto, " + ", ".join(known_backends())
        )
    return name


def get_backend(name: str) -> "type[AttentionBackend]":
    module, _, cls = _BACKENDS[resolve_backend_name(name, "cpu")].partition(":")
    return getattr(importlib.import_module(module), cls)
