"""benchmarks/kernels/kernel_sass.py: the engine's kernels compiled for sm_90 on this machine
(Triton's bundled ptxas and nvdisasm; no GPU), and its reading of the main loop. The compiling
runs in a process of its own: this one's kernels are made for Triton's interpreter
(tests/conftest.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.kernels import kernel_sass

ROOT = Path(__file__).resolve().parents[2]


def _reports(tmp_path: Path, *names: str) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/kernels/kernel_sass.py", "--kernels", *names,
         "--output", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_loops_found_are_the_kernels_main_loops(tmp_path: Path) -> None:
    """The GEMV at 8 rows × 2,048 codes over 4 warps: a thread multiplies 8 × 512 words × 4
    codes / 128 threads = 128 weights a tile, so its loop holds 128 FFMA. The decode
    attention's loop runs its two products on the tensor cores."""
    got = _reports(tmp_path, "fp8_gemv_codes", "decode_bf16")
    gemv, decode = got["fp8_gemv_codes"], got["decode_bf16"]
    assert gemv["loop_mix"]["FFMA"] == 128 and gemv["loop_instructions"] > 128
    assert 0 < gemv["registers"] <= 255 and gemv["local"] == 0
    assert decode["loop_mix"].get("HMMA", 0) > 0
    assert decode["shared_dynamic"] > 0  # the K/V tiles' pipeline buffers


def test_the_longest_backward_branch_is_the_loop() -> None:
    sass = """
        /*0000*/ MOV R1, c[0x0][0x28] ;
    .L_x_0:
        /*0010*/ FFMA R2, R3, R4, R2 ;
    .L_x_1:
        /*0020*/ @P0 LDG.E R5, desc[UR4][R6.64] ;
        /*0030*/ @P1 BRA `(.L_x_1) ;
        /*0040*/ HADD2.F32 R7, -RZ, R8.H0_H0 ;
        /*0050*/ BRA `(.L_x_0) ;
        /*0060*/ EXIT ;
    .L_x_2:
        /*0070*/ BRA `(.L_x_2) ;
    """
    assert kernel_sass.loop_mix(sass) == {"FFMA": 1, "LDG": 1, "BRA": 2, "HADD2": 1}


def test_a_preset_naming_no_argument_of_its_kernel_is_refused() -> None:
    bad = kernel_sass.Preset(
        kernel_sass.PRESETS["fp8_gemv"].kernel, {"NOT_AN_ARG": "*fp32"}, {}, warps=4, stages=2
    )
    with pytest.raises(ValueError, match="NOT_AN_ARG"):
        kernel_sass.compile_sm90(bad)


def test_the_fused_kernels_store_group_codes_in_words(tmp_path: Path) -> None:
    """RMSNorm and SiLU·mul writing a block layer's codes store them as wide as the layer's
    own pass does, never a byte a thread: a first form reshaped its pointers, lost their
    contiguity and stored bytes, 32 a thread in RMSNorm (on an H200 the 8B block
    checkpoint's 2k prefill went from 32.17 to 39.55 ms, docs/performance.md, "FP8": the
    first form was slower)."""
    got = _reports(tmp_path, "rms_norm_codes", "rms_norm_group_codes", "silu_mul_group_codes",
                   "quantize_groups")  # fmt: skip
    widths = {name: set(r["global_stores"]) for name, r in got.items()}
    for name, stores in widths.items():
        assert "STG.E.U8" not in stores, (name, stores)
    assert "STG.E.128" in widths["rms_norm_group_codes"]  # as per token: 16 bytes a store
    assert widths["silu_mul_group_codes"] == widths["quantize_groups"]


def test_the_mla_prefill_stores_only_the_values_columns(tmp_path: Path) -> None:
    """MLA's prefill (192-wide keys, 128-wide values: ``_prefill``'s HEAD_DV) compiles for
    sm_90 with both products on the tensor cores and no spills, and writes 64 query rows × 128
    value columns × 2 bytes over 256 threads: four 16-byte stores a thread (the values padded
    to the keys' 256-wide tile stored eight); the dense prefill at its tuned launch beside it."""
    got = _reports(tmp_path, "prefill_mla", "prefill_bf16")
    for report in got.values():
        assert report["loop_mix"].get("HGMMA", 0) > 0 and report["local"] == 0
    assert got["prefill_mla"]["global_stores"] == {"STG.E.128": 4}
    assert got["prefill_bf16"]["global_stores"] == {"STG.E.128": 16}  # 128 × 128 × 2 / 128 / 16
