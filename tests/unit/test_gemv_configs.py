"""The measured GEMV launches per GPU (ops/gemv_configs.py): what a configuration
file may say, and that every kept one says only that. (The kernels themselves are tested in
the interpreter by test_fused_ops.py / test_fp8_kernels.py and on the GPU by tests/gpu.)"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine.ops import gemv_configs, tuned_configs

LAUNCH = {"block_n": 8, "block_k": 512, "warps": 4, "stages": 3}


def test_a_configuration_maps_shapes_to_launches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = {"gemv": {"6144x4096": LAUNCH}, "fp8_gemv": {"4096x14336": {**LAUNCH, "warps": 8}},
           "measured": {"anything": 1}}  # fmt: skip
    table = gemv_configs.parse(doc)
    assert table["gemv"][(6144, 4096)] == LAUNCH
    assert table["fp8_gemv"][(4096, 14336)]["warps"] == 8
    assert gemv_configs.as_keywords(LAUNCH) == {
        "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3,
    }  # fmt: skip
    # read from the directory by GPU name, as the attention kernels' are
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps(doc))
    tuned_configs.read.cache_clear()
    try:
        assert gemv_configs.parse(tuned_configs.read(tmp_path, "NVIDIA H200")) == table
        assert tuned_configs.read(tmp_path, "Another GPU") == {}
    finally:
        tuned_configs.read.cache_clear()
    # a CPU tensor never takes a GPU's launch (the interpreter's fixed tile)
    assert gemv_configs.launch("gemv", torch.zeros(1, 4096), 6144, 4096) is None


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"gemm": {}}, "unknown GEMV configuration kinds"),
        ({"gemv": {"6144-4096": LAUNCH}}, "a shape is 'NxK'"),
        ({"gemv": {"6144x4096": {**LAUNCH, "extra": 1}}}, "a launch is positive"),
        ({"gemv": {"6144x4096": {**LAUNCH, "warps": 0}}}, "a launch is positive"),
    ],
)
def test_a_malformed_configuration_is_refused(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gemv_configs.parse(doc)


GEMM = {"block_n": 64, "block_m": 32, "block_k": 128, "splits": 2, "warps": 4, "stages": 4}


def test_gemm_launches_hold_up_to_their_row_count() -> None:
    doc = {"fp8_gemm": {"4096x14336": {"32": GEMM, "256": {**GEMM, "block_m": 128}}}}
    gemv_configs.parse(doc)  # beside the GEMVs' kinds in one file
    by_rows = gemv_configs.parse_gemm(doc)[(4096, 14336)]
    picks = {m: gemv_configs.pick_rows(by_rows, m) for m in (2, 32, 33, 256, 257)}
    assert picks[2] == picks[32] == GEMM
    assert picks[33] is not None and picks[33]["block_m"] == 128 and picks[256] == picks[33]
    assert picks[257] is None  # more rows than any measured: cuBLASLt
    assert gemv_configs.gemm_keywords(GEMM) == {
        "BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "SPLITS": 2, "num_warps": 4,
        "num_stages": 4,
    }  # fmt: skip
    assert gemv_configs.gemm_launch(torch.zeros(2, 14336), 2, 4096, 14336) is None  # CPU


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"4096x4096": {"0": GEMM}}, "a row count is a positive integer"),
        ({"4096x4096": {"sixteen": GEMM}}, "a row count is a positive integer"),
        ({"4096x4096": {"16": {**GEMM, "splits": 0}}}, "a launch is positive"),
        ({"4096x4096": {"16": {**GEMM, "splits": True}}}, "a launch is positive"),
        ({"4096x4096": {"16": {k: v for k, v in GEMM.items() if k != "splits"}}}, "positive"),
        ({"4096x4096": {"16": {**GEMM, "block_n": 32}}}, "tiles below the tensor cores'"),
        ({"4096x4096": {"16": {**GEMM, "block_m": 8}}}, "tiles below the tensor cores'"),
        ({"4096": {"16": GEMM}}, "a shape is 'NxK'"),
    ],
)
def test_a_malformed_gemm_launch_is_refused(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gemv_configs.parse_gemm({"fp8_gemm": section})


def test_every_kept_configuration_is_valid() -> None:
    for path in sorted(gemv_configs.CONFIG_DIR.glob("*.json")):
        gemv_configs.parse(json.loads(path.read_text()))
        gemv_configs.parse_gemm(json.loads(path.read_text()))


def _tune(directory: Path, *args: str) -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_layer.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(script), "--smoke", "--tune", str(directory), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_experts_tuner_writes_the_fastest_launch_of_each_gemv(tmp_path: Path) -> None:
    """``benchmarks/moe_layer.py --tune`` (tiny shapes in the interpreter: every launch runs,
    host-timed) keeps each format's fastest GEMV 1 and GEMV 2 launch under its kind and the
    expert's [N, K] where it beats the engine's own launch by the margin, over what the file
    held (another kind's entry stays), in a file the kernels' parser takes; in blocks only K
    tiles within a block. (The margins here are -1 and 1, so that host timings decide nothing.)"""
    gpu_file = tmp_path / "cpu.json"
    gpu_file.write_text(json.dumps({"gemv": {"6144x4096": LAUNCH}}))
    _tune(tmp_path, "--formats", "bf16", "fp8-block", "--margin", "-1")
    doc = json.loads(gpu_file.read_text())
    table = gemv_configs.parse(doc)
    assert table["gemv"][(6144, 4096)] == LAUNCH
    shapes = {"moe_up": (128, 64), "moe_down": (64, 64), "moe_up_fp8_block": (128, 64),
              "moe_down_fp8_block": (64, 64)}  # fmt: skip
    assert {k for k in table if k.startswith("moe")} == set(shapes)
    for kind, (n, k) in shapes.items():
        launch = table[kind][(n, k)]
        us = dict(doc["measured"]["us"][f"{kind} {n}x{k}"])
        assert us.pop("engine") > 0 and len(us) == 2
        fastest = min(us, key=us.__getitem__)
        assert fastest == "-".join(str(launch[key]) for key in gemv_configs.KEYS)
        if kind.endswith("block"):
            assert 64 % launch["block_k"] == 0  # the smoke shape's blocks are 64 wide
    # a launch that must beat the engine's by 100 %: none does, the kept entries stay
    _tune(tmp_path / "fresh", "--formats", "bf16", "--margin", "1")
    fresh = json.loads((tmp_path / "fresh" / "cpu.json").read_text())
    assert not any(k.startswith("moe") and v for k, v in fresh.items())
    assert set(fresh["measured"]["us"]) == {"moe_up 128x64", "moe_down 64x64"}
