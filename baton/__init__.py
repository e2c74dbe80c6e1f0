"""Baton: disaggregated prefill/decode LLM serving. The offline API mirrors vLLM's:

from baton import LLM, SamplingParams

The names are imported lazily (PEP 562), so ``baton gateway`` and ``baton global-scheduler``,
which run from this package too, never import the engine and its torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncLLM": "services.worker.engine.async_llm",
    "EngineArgs": "services.worker.engine.config",
    "LLM": "services.worker.engine.llm",
    "CompletionOutput": "services.worker.engine.outputs",
    "Logprob": "services.worker.engine.outputs",
    "RequestOutput": "services.worker.engine.outputs",
    "RequestOutputKind": "services.worker.engine.params",
    "SamplingParams": "services.worker.engine.params",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]

if TYPE_CHECKING:
    from services.worker.engine.async_llm import AsyncLLM
    from services.worker.engine.config import EngineArgs
    from services.worker.engine.llm import LLM
    from services.worker.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from services.worker.engine.params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'baton' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
