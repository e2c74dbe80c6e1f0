"""The cache a 32k-token request holds on the hybrid shapes (``benchmarks/kv_memory.py``, the
figures of docs/performance.md) against the bytes counted by hand from each published config:
K and V of every token in the full-attention layers, and in the windowed ones only the blocks
that a window of W tokens can span (those of its W - 1 tokens before the newest, and the
newest's). The engine sizes and reports its cache with the same classes."""

import pytest

from benchmarks.kv_memory import measure

MiB = 2**20
CONTEXT, BLOCK = 32768, 16


def kv_bytes(layers: int, tokens: int, kv_heads: int, head_dim: int) -> int:
    return layers * tokens * 2 * kv_heads * head_dim * 2  # K and V, bf16


# (shape, full layers, windowed layers, window, KV heads, head dim, performance.md's MiB held,
# its fraction)
CASES = [
    ("gpt-oss-20b", 12, 12, 128, 8, 64, 771.4, 0.502),
    ("gemma-3-12b", 8, 40, 1024, 8, 256, 2373.0, 0.193),
]


@pytest.mark.parametrize(
    ("shape", "full", "windowed", "window", "heads", "dim", "held_mib", "fraction"), CASES,
    ids=[c[0] for c in CASES],
)  # fmt: skip
def test_a_request_holds_its_full_layers_and_its_windows_only(
    shape: str, full: int, windowed: int, window: int, heads: int, dim: int, held_mib: float,
    fraction: float,
) -> None:  # fmt: skip
    row = measure(shape, CONTEXT, BLOCK, "bfloat16")
    window_tokens = (-(-(window - 1) // BLOCK) + 1) * BLOCK  # the blocks W tokens can span
    held = kv_bytes(full, CONTEXT, heads, dim) + kv_bytes(windowed, window_tokens, heads, dim)
    every_layer = kv_bytes(full + windowed, CONTEXT, heads, dim)
    assert row["request_bytes"] == held
    assert row["every_layer_full_bytes"] == every_layer
    assert round(held / MiB, 1) == held_mib and row["fraction"] == pytest.approx(fraction, abs=5e-4)
