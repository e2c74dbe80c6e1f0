"""The images, checked statically (no container engine runs here: see docs/deploy.md): every
COPY source exists and is not left out by .dockerignore, the user is the chart's non-root
uid, the entrypoint is the `baton` command, both are on development's Python and no CUDA base,
the worker has the RDMA libraries and Ray, the slim image's pins are pyproject's and hold no
torch; and every command line the chart renders parses with Baton's own CLI."""

import fnmatch
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.helpers import SETS, objects

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def ignored(rel: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]  # fmt: skip
    return any(fnmatch.fnmatch(rel, p) or rel.split("/")[0] == p for p in patterns)


def test_there_are_two_images() -> None:
    assert [p.name for p in DOCKERFILES] == ["slim.Dockerfile", "worker.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_every_copy_source_exists_and_reaches_the_build(path: Path) -> None:
    copies = [rest.split() for word, rest in instructions(path) if word == "COPY"]
    assert copies
    for parts in copies:
        for src in [p for p in parts[:-1] if not p.startswith("--")]:
            assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such path"
            assert not ignored(src), f"{path.name}: COPY {src} is left out by .dockerignore"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.stem)
def test_non_root_and_the_baton_entrypoint(path: Path) -> None:
    steps = instructions(path)
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1].split(":")[0] == "10001"  # the chart's runAsUser
    runs_after_user = [w for w, _ in steps[[w for w, _ in steps].index("USER") :] if w == "RUN"]
    assert not runs_after_user  # nothing installs as that user
    (entry,) = [rest for word, rest in steps if word == "ENTRYPOINT"]
    assert entry == '["baton"]'
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["baton"] == "baton.cli:main"  # what `pip install` puts on the PATH
    values = yaml.safe_load((ROOT / "charts" / "baton" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001


def build_args(path: Path) -> dict[str, str]:
    """Each ``ARG NAME=default`` of a Dockerfile."""
    return dict(rest.partition("=")[::2] for word, rest in instructions(path) if word == "ARG")


def test_both_images_are_on_the_python_of_development() -> None:
    """One base for both, a python image of the minor version development runs (the venv's,
    pyproject's requires-python and mypy's), and neither on a CUDA base: torch's wheels bring
    the CUDA libraries."""
    bases = {build_args(path).get("BASE", "") for path in DOCKERFILES}
    assert len(bases) == 1, bases
    (base,) = bases
    match = re.fullmatch(r"python:(\d+)\.(\d+)-slim-\w+", base)
    assert match, base
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    minimum = re.fullmatch(r">=(\d+)\.(\d+)", project["project"]["requires-python"])
    assert minimum, project["project"]["requires-python"]
    version = (int(match[1]), int(match[2]))
    assert version == sys.version_info[:2] == (int(minimum[1]), int(minimum[2]))
    assert project["tool"]["mypy"]["python_version"] == f"{version[0]}.{version[1]}"
    for path in DOCKERFILES:
        froms = [rest for word, rest in instructions(path) if word == "FROM"]
        assert froms == ["${BASE}"], f"{path.name}: FROM {froms}"
        assert "nvidia/cuda" not in path.read_text(), f"{path.name} names a CUDA base"


def test_the_worker_image_has_rdma_libraries_ray_and_the_gpu_runtime_settings() -> None:
    """UCX (inside NIXL) reaches InfiniBand, RoCE and EFA through the RDMA user-space
    libraries; a tensor-parallel engine over several pods needs Ray; the NVIDIA container
    runtime mounts the driver's libcuda and NVML only for the capabilities named."""
    steps = instructions(ROOT / "docker" / "worker.Dockerfile")
    runs = [rest for word, rest in steps if word == "RUN"]
    (apt,) = [run for run in runs if "apt-get install" in run]
    assert "--no-install-recommends" in apt and "rm -rf /var/lib/apt/lists/*" in apt
    packages = set(apt.partition("apt-get install")[2].partition("&&")[0].split())
    assert {"ibverbs-providers", "librdmacm1", "ibverbs-utils"} <= packages, packages
    assert {"rdma-core", "libibverbs1"} & packages, packages
    assert any('pip install "/src[ray]"' in run for run in runs), runs
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [d.split("==")[0] for d in project["optional-dependencies"]["ray"]] == ["ray"]
    env = dict(item.partition("=")[::2] for word, rest in steps if word == "ENV"
               for item in rest.split())  # fmt: skip
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) >= {"compute", "utility"}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_the_slim_image_pins_what_pyproject_pins_and_no_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(d.split("==", 1) for d in project["dependencies"])
    slim = {}
    for line in (ROOT / "docker" / "requirements-slim.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            slim[name] = version
    for name, version in slim.items():
        assert pins.get(name) == version, f"{name}: {version} here, {pins.get(name)} in pyproject"
    assert not {"torch", "transformers", "triton", "safetensors", "numpy"} & set(slim)


def test_slim_requirements_cover_what_the_gateway_and_scheduler_import() -> None:
    """Run in a child: import both services and the CLI, and map every third-party module
    they loaded to its distribution; each must be in the slim requirements (or a dependency
    of one of them). Optional imports of packages absent there (grpc_tools, kubernetes_validate,
    sniffio: each import is guarded where it is made)
    are blocked in the child, as they fail in the image."""
    import importlib.metadata as md
    import subprocess
    import sys

    # the optional imports of grpc and kubernetes fail there, as they will in the image, and so
    # does requests' of chardet (the dev extras' lm_eval installs it; the image has requests'
    # own charset_normalizer)
    code = (
        "import sys, importlib\n"
        "sys.modules.update(dict.fromkeys(('grpc_tools', 'kubernetes_validate', 'sniffio',\n"
        "                                  'chardet')))\n"
        "for m in ('baton.cli', 'services.gateway.main', 'services.global_scheduler.main',\n"
        "          'services.global_scheduler.discovery', 'kubernetes.aio.client'):\n"
        "    importlib.import_module(m)\n"
        "print(' '.join(sorted({n.split('.')[0] for n, m in sys.modules.items() if m})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "torch" not in loaded
    top = md.packages_distributions()
    slim = {line.split("==")[0].lower() for line in
            (ROOT / "docker" / "requirements-slim.txt").read_text().splitlines()
            if line and not line.startswith("#")}  # fmt: skip
    from packaging.requirements import Requirement

    closure, todo = set(), list(slim)
    while todo:  # the slim pins and everything they require (here, on this Python)
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name.lower().replace("_", "-"))
    ours = {"baton", "services", "shared", "_distutils_hack"}  # (the venv's setuptools shim)
    for module in loaded - set(sys.stdlib_module_names) - ours:
        dists = {d.lower().replace("_", "-") for d in top.get(module, [])}
        if dists:
            assert dists & closure, f"{module} ({dists}) is not in the slim image"


@pytest.mark.parametrize("name", SETS)
def test_every_command_line_the_chart_renders_parses(name: str) -> None:
    from baton.cli import build_parser

    parser = build_parser()
    for o in objects(name):
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = o["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if not c["image"].startswith("ghcr.io/baton-serving/"):
                continue
            args = parser.parse_args(c["args"])  # exits (fails the test) on an unknown flag
            assert callable(args.func), c["args"]
