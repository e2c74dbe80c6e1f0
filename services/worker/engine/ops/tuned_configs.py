"""Launch configurations measured per GPU model, kept as JSON files beside the kernels they
configure (``ops/configs/attention/``, ``ops/configs/linear/``): one file per model, named by
``config_file``, read once per process. The kernel labs that measure them write them
(``benchmarks/kernels/attention_sweep.py --tune``, ``benchmarks/kernels/gemv.py --tune``,
``benchmarks/kernels/fp8_mm.py --tune``, ``benchmarks/moe_layer.py --tune``)."""

import functools
import json
import re
from pathlib import Path
from typing import Any

# one folder per table: attention/ (ops/attention.py's launches, read by the Triton backend) and
# linear/ (the GEMVs' and the FP8 GEMM's, ops/gemv_configs.py)
CONFIG_DIR = Path(__file__).parent / "configs"


def config_file(device_name: str) -> str:
    """The file name of a GPU model's configuration: "NVIDIA H200" → "NVIDIA_H200.json"."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@functools.cache
def read(directory: Path, device_name: str) -> dict[str, Any]:
    """The measured configuration of a GPU model in ``directory`` ({} when none was)."""
    path = directory / config_file(device_name)
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def write(directory: Path, device_name: str, doc: dict[str, Any]) -> Path:
    """Write a GPU model's measured configuration into ``directory`` (a kernel lab's
    ``--tune``); returns the file's path."""
    path = Path(directory) / config_file(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
