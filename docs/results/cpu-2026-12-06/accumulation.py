"""Is the GPU's FP8 MoE logprob gap (median 0.0026 per channel, 0.0085 in blocks, against the
dequantizing reference) of the order the tensor cores' FP8 accumulation gives? The engine on
CPU (the reference's own arithmetic) against the reference with FP8 products summed with every
partial sum cut to BITS mantissa bits in the rows the GPU sums on its tensor cores: the
experts' prompt rows (grouped GEMMs; their decode rows, at most 4 tokens, go to the float32
GEMVs) and the attention projections' rows, emulated not at all, in the prompt only, or in
every row (the test decodes its 4 prompts together: more than one row, the FP8 GEMM).
Run from the repo root: python docs/results/cpu-2026-12-06/accumulation.py OUT.json"""

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from baton import tiny_fp8
from baton.tiny_model import make_tiny_model
from services.worker.engine.quantization.fp8_math import quantize_activations
from tests.helpers import FP8_PROMPTS, fp8_generate

ACC = {"bits": 23, "nearest": False, "prompt_len": 0, "on": False, "dense": "exact"}


def cut(v: torch.Tensor) -> torch.Tensor:
    drop = 23 - ACC["bits"]
    if drop == 0:
        return v
    i = v.view(torch.int32) + ((1 << (drop - 1)) if ACC["nearest"] else 0)
    return (i & ~((1 << drop) - 1)).view(torch.float32)


def linear(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """F.linear, its ``rows`` summed with the accumulation cut to BITS bits."""
    y = F.linear(x, w)
    if ACC["on"] and rows.any():
        prods = x[rows, None, :].float() * w[None].float()
        acc = torch.zeros(prods.shape[:2])
        for k in range(prods.shape[-1]):
            acc = cut(acc + prods[..., k])
        y = y.clone()
        y[rows] = acc
    return y


def rounding_experts(experts, scheme, block):  # tiny_fp8._rounding_experts, through ``linear``
    def forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(experts.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                prompt = token < ACC["prompt_len"]
                x = quantize_activations(hidden[token], scheme, block, None)
                gate, up = linear(x, experts.gate_up_proj[e], prompt).chunk(2, dim=-1)
                h = quantize_activations(experts.act_fn(gate) * up, scheme, block, None)
                y = linear(h, experts.down_proj[e], prompt) * top_k_weights[token, slot, None]
                out.index_add_(0, token, y)
        return out

    experts.forward = forward


def attention_projection(mod, args, out):  # q, k, v, o
    if not ACC["on"] or ACC["dense"] == "exact":
        return out
    x = args[0].reshape(-1, args[0].shape[-1])
    rows = torch.arange(x.shape[0]) < ACC["prompt_len"]
    if ACC["dense"] == "every row":
        rows = torch.ones_like(rows)
    return linear(x, mod.weight, rows).reshape(out.shape)


def gaps(path: Path, outs: list) -> tuple[float, float]:
    ref = tiny_fp8.dequantized_reference(path)
    for name, lin in tiny_fp8._linears(ref).items():
        if name.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin.register_forward_hook(attention_projection)
    tok = AutoTokenizer.from_pretrained(path)
    found = []
    for prompt, out in zip(FP8_PROMPTS, outs, strict=True):
        ids = tok(prompt)["input_ids"]
        gen = out.outputs[0].token_ids
        ACC.update(prompt_len=len(ids), on=True)
        with torch.no_grad():
            lps = ref(torch.tensor([ids + gen])).logits[0].log_softmax(-1)
        ACC["on"] = False
        for step, t in enumerate(gen):
            ref_lp = float(lps[len(ids) - 1 + step, t])
            found.append(abs(out.outputs[0].logprobs[step][t].logprob - ref_lp))
    return statistics.median(found), max(found)


tiny_fp8._rounding_experts = rounding_experts
torch.set_num_threads(1)
results = []
tmp = Path(tempfile.mkdtemp())
for fmt, kw in (
    ("fp8-channel", {}),
    ("fp8-block", {"hidden_size": 128, "moe_intermediate_size": 128, "num_heads": 8}),
):
    # the checkpoints of tests/gpu/test_moe_gpu.py::test_fp8_experts_match_...
    path = make_tiny_model(tmp / fmt, arch="qwen3_moe", num_layers=3, quantize=fmt, **kw)
    outs = fp8_generate(path, dtype="float32")
    for bits, nearest in ((23, False), (16, False), (14, False), (14, True), (13, False)):
        for dense in ("exact", "prompt rows", "every row"):
            ACC.update(bits=bits, nearest=nearest, dense=dense)
            median, largest = gaps(path, outs)
            results.append(
                {
                    "checkpoint": fmt,
                    "bits": bits,
                    "rounding": "nearest" if nearest else "truncate",
                    "attention_projections": dense,
                    "median": round(median, 5),
                    "max": round(largest, 5),
                }
            )
            print(results[-1], flush=True)
columns = list(results[0])
table = {"columns": columns, "rows": [[r[c] for c in columns] for r in results]}
Path(sys.argv[1]).write_text(json.dumps(table, separators=(",", ":")))
