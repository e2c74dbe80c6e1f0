"""Baton: disaggregated prefill/decode LLM serving. The offline API mirrors vLLM's:

from baton import LLM, SamplingParams
"""

from services.worker.engine.async_llm import AsyncLLM
from services.worker.engine.config import EngineArgs
from services.worker.engine.llm import LLM
from services.worker.engine.outputs import CompletionOutput, Logprob, RequestOutput
from services.worker.engine.params import RequestOutputKind, SamplingParams

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
