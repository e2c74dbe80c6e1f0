"""Builds the slim image for real, with buildah (no daemon: chroot isolation, vfs storage) on
the base docker/build-base.sh makes, and runs it: `baton gateway --help` and
`baton global-scheduler --help` work, it runs as uid 10001, and torch is not in it. Minutes of
work, so it runs with `make test-images`, not `make test` (which checks the Dockerfiles
statically: tests/chart/test_docker.py)."""

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/baton-base:bookworm"
IMAGE = "localhost/baton:test"

pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(shutil.which("buildah") is None, reason="needs buildah: make test-images"),
]


def buildah(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", "--storage-driver", "vfs", *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def container() -> Iterator[str]:
    base = subprocess.run([str(ROOT / "docker" / "build-base.sh"), BASE], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert base.returncode == 0, base.stderr
    built = buildah("bud", "--isolation", "chroot", "--network", "host", "-f",
                    str(ROOT / "docker" / "slim.Dockerfile"), "--build-arg", f"BASE={BASE}",
                    "-t", IMAGE, str(ROOT), timeout=900)  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    ctr = buildah("from", IMAGE).stdout.strip()
    yield ctr
    buildah("rm", ctr)


def run(ctr: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return buildah("run", "--isolation", "chroot", ctr, "--", *argv)


def test_the_entrypoint_serves_both_commands(container: str) -> None:
    for command, first_flag in (("gateway", "--model"), ("global-scheduler", "--host")):
        out = run(container, "baton", command, "--help")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: baton {command}") and first_flag in out.stdout


def test_non_root_and_no_torch(container: str) -> None:
    assert run(container, "id", "-u").stdout.strip() == "10001"
    probe = run(container, "python3", "-c", "import torch")
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    ok = run(container, "python3", "-c", "import services.gateway.main, "
             "services.global_scheduler.main, kubernetes.aio.client")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
