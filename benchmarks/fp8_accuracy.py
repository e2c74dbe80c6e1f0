"""FP8 against float on the tiny checkpoints: the cosine of each position's logits between the
FP8 reference (dequantized weights, activations rounded through e4m3) and the float model each
FP8 checkpoint was made from, for every format (the engine equals that reference:
tests/integration/test_fp8.py).

    python benchmarks/fp8_accuracy.py --output docs/results/<run>/fp8_cosine.json
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton.tiny_fp8 import dequantized_reference
from baton.tiny_model import make_tiny_model

TEXT = ("Hi The quick brown fox jumps over the lazy dog import os\nimport sys\n\n Return a new "
        "list containing all items from the iterable in ascending order.")  # fmt: skip
CASES = [("fp8-tensor", "llama"), ("fp8-tensor", "qwen2"), ("fp8-channel", "mistral"),
         ("fp8-channel", "qwen3"), ("fp8-block", "llama"), ("fp8-block", "qwen3")]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = []
    root = Path(tempfile.mkdtemp())
    for fmt, arch in CASES:
        path = make_tiny_model(root / f"{fmt}-{arch}", arch=arch, quantize=fmt,
                               hidden_size=256 if fmt == "fp8-block" else 64)  # fmt: skip
        fp8 = dequantized_reference(path)
        full = AutoModelForCausalLM.from_pretrained(str(path / "unquantized"), dtype=torch.float32)
        ids = AutoTokenizer.from_pretrained(str(path))(TEXT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            cos = torch.nn.functional.cosine_similarity(fp8(ids).logits[0], full(ids).logits[0],
                                                        dim=-1)  # fmt: skip
        rows.append({"format": fmt, "arch": arch, "positions": int(cos.numel()),
                     "cosine_mean": round(float(cos.mean()), 4),
                     "cosine_min": round(float(cos.min()), 4)})  # fmt: skip
        print(json.dumps(rows[-1]))
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
