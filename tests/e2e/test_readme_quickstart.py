"""The README's quickstart, run as written: ``make run`` (the Makefile's own target, in a fresh
directory that holds only the Makefile and what ``make install`` made: ``.venv`` and the
SmolLM2 file in ``.models``), the ready line the README says to wait for, then the README's curl
and its ``openai`` snippet, whose answers must name Paris. Only the port is changed, the way the
README says a user changes it (``make run PORT=…``), so that the test cannot meet another server
on 8000."""

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from baton.launcher import free_port
from tests.conftest import SMOLLM2

ROOT = Path(__file__).resolve().parents[2]
README_PORT = "8000"  # the port the README's commands name
READY_S = 240.0  # four services starting on a shared 2-core machine (6-13 s measured)
QUESTION = "What is the capital of France?"
STOP_S = 60.0


def quickstart_blocks(readme: str) -> dict[str, str]:
    """Each fenced block that follows a ``<!-- quickstart:NAME … -->`` marker, by NAME."""
    found = re.finditer(r"<!-- quickstart:([\w-]+)[^>]*-->\s*```\w*\n(.*?)```", readme, re.S)
    return {m.group(1): m.group(2) for m in found}


def shell_commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    lines = [re.sub(r"(^|\s)#.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line]


def on_port(text: str, port: int) -> str:
    return text.replace(f":{README_PORT}", f":{port}")


@dataclass
class Server:
    """``make run`` as a user starts it in a terminal: its output, line by line."""

    proc: subprocess.Popen[str]
    lines: "queue.Queue[str]"
    seen: list[str]

    def wait_for_line(self, wanted: str, timeout_s: float) -> float:
        start = time.monotonic()
        while True:
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                pytest.fail(f"no {wanted!r} within {timeout_s} s; output:\n" + self.output())
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    pytest.fail(f"make run exited ({self.proc.returncode}) before {wanted!r}; "
                                "output:\n" + self.output())  # fmt: skip
                continue
            if line.rstrip("\n") == wanted:
                return time.monotonic() - start

    def output(self) -> str:
        return "".join(self.seen[-200:])

    def stop(self) -> None:
        """Ctrl-C, as in the terminal: SIGINT to the foreground process group (make and the
        launcher, which stops its services); killed if it has not ended within the bound."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            pytest.fail(f"make run did not stop within {STOP_S} s of Ctrl-C")


@pytest.fixture
def readme() -> dict[str, str]:
    blocks = quickstart_blocks((ROOT / "README.md").read_text())
    missing = {"serve", "ready", "request", "python"} - set(blocks)
    assert not missing, f"README.md lacks the quickstart blocks {sorted(missing)}"
    return blocks


@pytest.fixture
def make_run(
    readme: dict[str, str], tmp_path: Path, smollm2_gguf: Path
) -> Iterator[tuple[Server, int, Path]]:
    """The quickstart's ``serve`` block run in a directory holding the repository's Makefile, its
    ``.venv`` and its ``.models`` (``make install`` is done: the tests run in that venv, and
    the ``smollm2_gguf`` fixture says the model is in place)."""
    if shutil.which("make") is None or shutil.which("curl") is None:
        pytest.skip("needs make and curl")
    commands = shell_commands(readme["serve"])
    assert commands == ["make install", "make run"], commands
    assert (ROOT / ".venv" / "bin" / "python").exists()
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / ".models").symlink_to(ROOT / ".models")
    port = free_port()
    # a user's environment: no internal token (baton serve makes one), no test switches
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("BATON_") and k != "TRITON_INTERPRET"}  # fmt: skip
    proc = subprocess.Popen(["bash", "-c", f"make run PORT={port}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    server = Server(proc, queue.Queue(), [])

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            server.seen.append(line)
            server.lines.put(line)

    reader = threading.Thread(target=read, daemon=True, name="make-run-output")
    reader.start()
    try:
        yield server, port, tmp_path
    finally:
        server.stop()
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_readme_quickstart_runs_as_written(
    readme: dict[str, str], make_run: tuple[Server, int, Path]
) -> None:
    server, port, workdir = make_run
    [ready_line] = readme["ready"].strip().splitlines()
    served = ready_line.split()[3]  # "Baton is serving NAME at URL ..."
    server.wait_for_line(on_port(ready_line, port), READY_S)

    # the ready line's promise: a request sent at once is answered (no retry, no /ready first)
    body = {"model": served, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    first = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text

    assert QUESTION in readme["request"] and QUESTION in readme["python"]
    request = subprocess.run(["bash", "-c", on_port(readme["request"], port)], cwd=workdir,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert request.returncode == 0, request.stderr
    completion = json.loads(request.stdout)  # an error would be {"error": …} with its status
    assert completion.get("object") == "chat.completion", completion
    [choice] = completion["choices"]
    assert "Paris" in choice["message"]["content"], completion  # a trained model's answer
    assert choice["finish_reason"] == "stop", completion  # it ended its answer itself

    snippet = subprocess.run([sys.executable, "-c", on_port(readme["python"], port)],
                             cwd=workdir, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert snippet.returncode == 0, snippet.stderr
    assert f"id='{served}'" in snippet.stdout, snippet.stdout
    assert "Paris" in snippet.stdout, snippet.stdout

    server.stop()
    assert "baton serve: stopped" in server.output(), server.output()


def test_the_quickstart_names_the_model_make_run_serves(readme: dict[str, str]) -> None:
    """Without a server: the model the README's requests name is the one ``make run`` serves
    (SmolLM2's file, under its ``--served-model-name``), and the ready line names it too."""
    run = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    model = re.search(r"serve --model (\S+)", run.stdout)
    served = re.search(r"--served-model-name (\S+)", run.stdout)
    assert model and served, run.stdout
    assert (ROOT / model.group(1)).resolve() == SMOLLM2.resolve()  # what `make install` put
    name = served.group(1)
    assert f"--port {README_PORT}" in run.stdout
    assert f'"model": "{name}"' in readme["request"]
    assert f'"{name}"' in readme["python"]
    assert readme["ready"].startswith(f"Baton is serving {name} at ")
