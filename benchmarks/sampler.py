"""Random sampling of a decode batch on a GPU: the engine's one-pass Gumbel-max kernel
(ops/gumbel.py) against the PyTorch exponential race it replaced (upcast, temperature,
softmax, an Exp(1) tensor, divide, argmax), on the same logits, in the same run, next to the
copy bandwidth: the kernel's floor is one read of the logits in the model's dtype.

    python benchmarks/sampler.py --rows 256 --vocab 151936 --output sampler.json
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.roofline import copy_bandwidth
from services.worker.engine.ops.gumbel import gumbel_argmax_triton, row_keys


def exponential_race(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    probs = (logits.float() / temperature.unsqueeze(1)).softmax(-1)
    q = torch.empty_like(probs).exponential_()
    return probs.div(q).argmax(-1)


def ms_per_call(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--output")
    args = p.parse_args()
    device = torch.device("cuda")
    logits = torch.randn(args.rows, args.vocab, device=device, dtype=torch.bfloat16) * 4
    temperature = torch.full((args.rows,), args.temperature, device=device)
    keys = torch.from_numpy(row_keys(np.arange(args.rows), np.zeros(args.rows))).to(device)
    torch_ms = ms_per_call(lambda: exponential_race(logits, temperature))
    kernel_ms = ms_per_call(lambda: gumbel_argmax_triton(logits, 1.0 / temperature, keys))
    bandwidth = copy_bandwidth(device)
    floor_ms = logits.numel() * logits.element_size() / bandwidth * 1e3
    result = {
        "rows": args.rows, "vocab": args.vocab, "dtype": "bfloat16",
        "torch_exponential_race_ms": round(torch_ms, 4), "gumbel_kernel_ms": round(kernel_ms, 4),
        "speedup": round(torch_ms / kernel_ms, 2), "logits_read_floor_ms": round(floor_ms, 4),
        "kernel_fraction_of_floor": round(floor_ms / kernel_ms, 3),
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "gpu": torch.cuda.get_device_name(),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
