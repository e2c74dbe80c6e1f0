"""The gateway and the global scheduler never import torch (or transformers, which would):
their images stay small and they start in a second."""

import subprocess
import sys

import pytest


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
