"""The gateway and the global scheduler never import torch (or transformers, which would):
their images stay small and they start in a second. Nor does the worker service's front end,
whose engine core runs in another process: it resolves its config and tokenizes without them."""

import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.engine.config import _no_gpu_device_node


@pytest.mark.parametrize(
    "module",
    ["services.gateway.app", "services.global_scheduler.main", "baton.launcher", "baton.cli"],
)
def test_service_imports_no_torch(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.skipif(not _no_gpu_device_node(), reason="a GPU device node: auto asks torch")
def test_the_worker_front_end_imports_no_torch(tiny_model: Path) -> None:
    """The front end's modules, its config with device "auto" (the CPU here), its tokenizer and
    its input and output processing: no torch, no transformers (both cost seconds a start)."""
    code = f"""
import sys
import services.worker.main
from services.worker.engine.config import EngineArgs
from services.worker.engine.output_processor import OutputProcessor
from services.worker.engine.processor import InputProcessor
from shared.text.tokenizer import TextTokenizer
config = EngineArgs(model={str(tiny_model)!r}).create_engine_config()
tok = TextTokenizer(config.model.tokenizer)
InputProcessor(config.model, tok).tokenize("hello")
OutputProcessor(tok)
print(config.device.device, sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "cpu []", out.stdout
