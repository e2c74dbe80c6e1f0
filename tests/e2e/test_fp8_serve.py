"""``baton serve`` with an FP8 checkpoint and an FP8 KV cache: it answers like the offline engine
with the same settings, and ``/v1/models`` says what its workers serve."""

from pathlib import Path

import httpx
import openai

from baton import LLM, SamplingParams
from baton.tiny_model import make_tiny_model
from tests.e2e.conftest import serving, wait_for

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog"]


def test_serve_an_fp8_checkpoint_with_an_fp8_kv_cache(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "fp8", arch="qwen3", quantize="fp8-channel")
    kw = {"num_kv_blocks": 256, "max_model_len": 512}
    llm = LLM(model=str(path), kv_cache_dtype="fp8", show_progress=False, **kw)  # type: ignore[arg-type]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    llm.shutdown()
    with serving("--model", str(path), "--workers", "1", "--kv-cache-dtype", "fp8",
                 "--num-kv-blocks", "256", "--max-model-len", "512") as cluster:  # fmt: skip
        c = openai.OpenAI(base_url=cluster.url, api_key="x", max_retries=0, timeout=60)
        got = [c.completions.create(model="fp8", prompt=p, max_tokens=12, temperature=0)
               .choices[0].text for p in PROMPTS]  # fmt: skip
        assert got == want
        base = (cluster.url or "").removesuffix("/v1")

        def entry() -> dict:  # type: ignore[type-arg]
            return httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]

        wait_for(lambda: "quantization" in entry(), 5.0, "the workers' entry")
        model = entry()
        assert model["id"] == "fp8" and model["max_model_len"] == 512
        assert model["quantization"].startswith("fp8 (channel weights")
        assert model["kv_cache_dtype"] == "float8_e4m3fn"
