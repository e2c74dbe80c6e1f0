"""Attention backends by name, imported lazily. An unknown name lists the known ones."""

import importlib

from services.worker.engine.attention.backend import AttentionBackend

_BACKENDS: dict[str, str] = {
    "torch": "services.worker.engine.attention.torch_ref:TorchAttentionBackend",
    "triton": "services.worker.engine.attention.triton_backend:TritonAttentionBackend",
}


def known_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: str) -> str:
    """Turn "auto" into the best backend for ``device``; check any other name."""
    if name == "auto":
        return "triton" if device == "cuda" else "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; known: auto, " + ", ".join(known_backends())
        )
    return name


def get_backend(name: str) -> type[AttentionBackend]:
    module, _, cls = _BACKENDS[resolve_backend_name(name, "cpu")].partition(":")
    return getattr(importlib.import_module(module), cls)
