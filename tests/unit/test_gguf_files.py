"""Where a GGUF model lies (shared/gguf_files.py), and the name it is served under."""

from pathlib import Path

import pytest

from shared.gguf_files import default_model_name, gguf_path


def test_a_gguf_model_is_a_file_or_a_directory_holding_one(tmp_path: Path) -> None:
    file = tmp_path / "m" / "model.Q4_1.gguf"
    file.parent.mkdir()
    file.write_bytes(b"GGUF")
    assert gguf_path(file) == file
    assert gguf_path(file.parent) == file
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "stray.gguf").write_bytes(b"GGUF")
    assert gguf_path(hf) is None  # a Hugging Face checkpoint, whatever else lies beside it
    assert gguf_path(tmp_path / "absent") is None
    (file.parent / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        gguf_path(file.parent)


def test_the_default_name_drops_the_suffix_of_a_file_only() -> None:
    assert default_model_name(".models/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    assert default_model_name("checkpoints/Qwen3-0.6B") == "Qwen3-0.6B"
    assert default_model_name("checkpoints/Qwen3-0.6B/") == "Qwen3-0.6B"
