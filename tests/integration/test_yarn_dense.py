"""YaRN rotary scaling on a dense decoder (Qwen3 with ``rope_type: yarn``, as its long-context
configs set it): greedy tokens and logprobs equal to Hugging Face float32, with the table scale
derived from the factor and with an ``attention_factor`` the config gives."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model

PROMPTS = ["The quick brown fox jumps over the lazy dog", "import os\nimport sys\n\ndef main():"]


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 0.8}], ids=["derived", "given"])
def test_dense_yarn_matches_hugging_face(tmp_path: Path, extra: dict) -> None:
    model = make_tiny_model(tmp_path / "qwen3-yarn", arch="qwen3")
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 256, **extra}  # fmt: skip
    (model / "config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    llm = LLM(model=str(model), dtype="float32", num_kv_blocks=64)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, logprobs=1))
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
            logits = hf(ref).logits[0, ids.shape[1] - 1 : -1].float().log_softmax(-1)
        want = ref[0, ids.shape[1] :].tolist()
        got = out.outputs[0].token_ids
        assert got == want
        lps = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs or [], got, strict=True)]
        ref_lps = logits[torch.arange(len(want)), torch.tensor(want)].tolist()
        assert lps == pytest.approx(ref_lps, abs=1e-4)
