"""``make demo`` as the README describes it: SmolLM2-135M-Instruct, the engine in one process,
answers "What is the capital of France?" with Paris and writes a poem of several lines. Run as
a user runs it, in a directory holding the repository's Makefile and what ``make install``
made (``.venv``, ``.models``)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_S = 300.0  # about 9 s on an idle 2-core VM: imports, loading, two answers


def test_make_demo_answers_in_words(smollm2_gguf: Path, tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.fail("make is missing: the README's `make demo` needs it")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / ".models").symlink_to(smollm2_gguf.parent)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BATON_", "OMP_")) and k != "TRITON_INTERPRET"}  # fmt: skip
    demo = subprocess.run(["make", "demo"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=DEMO_S)  # fmt: skip
    assert demo.returncode == 0, demo.stdout + demo.stderr
    # "--- user: MESSAGE", then the reply's lines and "(finish reason, N tokens)", indented
    replies = dict(re.findall(r"^--- user: (.*)\n((?:    .*\n)+)", demo.stdout, re.M))
    assert list(replies) == ["What is the capital of France?", "Write a haiku about the sea."]
    capital, haiku = replies.values()
    assert "Paris" in capital, demo.stdout
    assert len(haiku.splitlines()) >= 3, demo.stdout  # two lines of verse or more, then the end
    assert all(r.splitlines()[-1].strip().startswith("(stop, ") for r in replies.values())
