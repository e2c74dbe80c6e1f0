"""Perplexity of a fixed public-domain text: Baton offline (``LLM`` with ``prompt_logprobs``)
and through the OpenAI API (``/v1/completions`` with ``echo``, ``logprobs`` and
``max_tokens: 0``), for bf16, FP8 weights and an FP8 KV cache, beside Hugging Face
transformers on the same weights (the reference: float32, and bf16).

    python benchmarks/quality.py --out docs/results/<run>/quality.json          # CPU or GPU
    python benchmarks/quality.py --configs bf16,fp8,fp8-kv --url http://HOST:PORT/v1

The text is chapter I of *Alice's Adventures in Wonderland* (``benchmarks/data/``, its
provenance beside it; 2,900 tokens of SmolLM2's tokenizer), tokenized once, without a BOS: every
path scores the same token ids. It is cut into windows of at most ``--window`` tokens (default:
the model's context, less one) that start every ``--stride`` tokens; a window scores only the
tokens that no earlier window scored, with everything before them in the window as context
(as Hugging Face's perplexity guide does). The text's first token is never scored.
Perplexity = exp(mean negative log-likelihood of the scored tokens).

Each engine configuration runs offline in this process and then through a cluster that this
script starts with ``baton serve``'s launcher (one colocated worker), or through ``--url``'s
server, which must serve that configuration already: give it one configuration at a time.
Against the reference, each row reports its perplexity's relative gap and its per-token
log-probabilities' mean and largest absolute differences.

Configurations: float32 (the CPU's default dtype), bf16, fp8 (``quantization="fp8"``: the
weights quantized per row at load, activations per token, bf16 otherwise), fp8-kv
(``kv_cache_dtype="fp8"``, bf16). Default: all four on a CPU, bf16, fp8 and fp8-kv on a GPU. On
a CPU the engine runs FP8 through its plain PyTorch path (``quantization/fp8.py``'s reference:
activations and weights rounded through e4m3 as an FP8 GEMM sees them, then multiplied in bf16
by ``F.linear``), not the GPU's kernels: the GPU's figures are the ones to quote for FP8.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton import LLM, SamplingParams  # noqa: E402
from baton.serving import serving  # noqa: E402
from services.worker.engine.config import EngineArgs  # noqa: E402
from services.worker.engine.tokenizer import load_tokenizer  # noqa: E402

TEXT = ROOT / "benchmarks" / "data" / "alice_chapter1.txt"
TEXT_SHA256 = "421d2bd1407d0d63f4d7a59af5deb5eabe79bcad83e56b6655554f09d3ba2dc6"
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIGS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "fp8": {"dtype": "bfloat16", "quantization": "fp8"},
    "fp8-kv": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"},
}
DEFAULT_CONFIGS = {"cpu": "float32,bf16,fp8,fp8-kv", "cuda": "bf16,fp8,fp8-kv"}
BLOCK = 16  # the engine's default block size: the KV blocks a window needs
API_TIMEOUT_S = 600.0  # one window's request (a long prompt on a CPU)


@dataclass
class Window:
    """Tokens [start, start + len(ids)) of the text; it scores those from ``first`` on (an
    index into ``ids``, >= 1: the logprob of ids[i] is predicted from ids[:i])."""

    start: int
    ids: list[int]
    first: int


def windows(ids: Sequence[int], window: int, stride: int) -> list[Window]:
    """Windows of at most ``window`` tokens, one every ``stride`` (less than ``window``: a
    window's first token has no context in it), each scoring the tokens after those that the
    previous ones scored; together they score every token but the text's first, once."""
    if not 0 < stride < window:
        raise ValueError(f"need 0 < stride < window, got stride {stride}, window {window}")
    out: list[Window] = []
    start, done = 0, 1  # the tokens before ``done`` are scored (or the text's first)
    while done < len(ids):
        end = min(start + window, len(ids))
        out.append(Window(start, list(ids[start:end]), done - start))
        start, done = start + stride, end
    return out


@dataclass
class Row:
    engine: str  # baton | transformers
    path: str  # offline | api
    config: str
    tokens: int = 0
    nll: float = 0.0  # mean negative log-likelihood a scored token
    ppl: float = 0.0
    seconds: float = 0.0
    ppl_gap: float | None = None  # (ppl - reference ppl) / reference ppl
    mean_abs_diff: float | None = None  # of the per-token logprobs, against the reference's
    max_abs_diff: float | None = None
    logprobs: list[float] = field(default_factory=list, repr=False)

    def finish(self, logprobs: list[float], seconds: float) -> "Row":
        self.logprobs, self.seconds = logprobs, round(seconds, 2)
        self.tokens = len(logprobs)
        self.nll = -math.fsum(logprobs) / len(logprobs)
        self.ppl = math.exp(self.nll)
        return self

    def compare(self, ref: "Row") -> None:
        if len(ref.logprobs) != len(self.logprobs):
            raise AssertionError(f"{self.label}: {self.tokens} tokens, reference {ref.tokens}")
        diffs = [abs(a - b) for a, b in zip(self.logprobs, ref.logprobs, strict=True)]
        self.ppl_gap = (self.ppl - ref.ppl) / ref.ppl
        self.mean_abs_diff, self.max_abs_diff = math.fsum(diffs) / len(diffs), max(diffs)

    @property
    def label(self) -> str:
        return f"{self.engine} {self.path} {self.config}"

    def summary(self) -> dict[str, Any]:
        row = {k: v for k, v in asdict(self).items() if k != "logprobs"}
        for k in ("nll", "ppl", "ppl_gap", "mean_abs_diff", "max_abs_diff"):
            if row[k] is not None:
                row[k] = float(f"{row[k]:.6g}")
        return row


def scored(per_window: list[list[float | None]], wins: list[Window]) -> list[float]:
    """The scored tokens' logprobs, in the text's order, from each window's per-token logprobs
    (one a window token, the first None)."""
    out: list[float] = []
    for lps, w in zip(per_window, wins, strict=True):
        if len(lps) < len(w.ids):
            raise AssertionError(f"{len(lps)} logprobs for a window of {len(w.ids)} tokens")
        values = lps[w.first : len(w.ids)]
        if any(v is None for v in values):
            raise AssertionError("a scored token without a logprob")
        out += [float(v) for v in values if v is not None]
    return out


# ---- transformers ------------------------------------------------------------------------------


def transformers_logprobs(
    model_path: Path, wins: list[Window], dtype: str, device: str
) -> tuple[list[list[float | None]], float]:
    """Each window's per-token logprobs from Hugging Face transformers: a GGUF file read as
    ``baton/transformers_gguf.py`` reads it (dequantized, q/k un-permuted), a checkpoint
    directory with ``from_pretrained``. Log-softmax in float32 over the model's logits."""
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if model_path.suffix == ".gguf":
        from baton.transformers_gguf import transformers_model

        model = transformers_model(model_path, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype).eval()
    model.to(device)
    out: list[list[float | None]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for w in wins:
            ids = torch.tensor([w.ids], device=device)
            logits = model(ids).logits[0, :-1].float()
            lps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append([None, *lps.tolist()])
    return out, time.perf_counter() - start


# ---- Baton -------------------------------------------------------------------------------------


def engine_kwargs(config: str, device: str, wins: list[Window]) -> dict[str, Any]:
    """The engine's arguments for a configuration: a context of the longest window (and one
    token to spare), room in the KV cache for every window at once (they run together)."""
    longest = max(len(w.ids) for w in wins) + 1
    blocks = max(sum(-(-len(w.ids) // BLOCK) for w in wins), -(-longest // BLOCK)) + 1
    return {**CONFIGS[config], "device": device, "max_model_len": longest,
            "num_kv_blocks": blocks}  # fmt: skip


def offline_logprobs(
    model: str, tokenizer: str | None, kwargs: dict[str, Any], wins: list[Window]
) -> tuple[list[list[float | None]], float]:
    """``LLM.generate`` with ``prompt_logprobs=0`` (each prompt token's own logprob) and
    ``max_tokens=0`` (only the prompt runs)."""
    llm = LLM(model=model, tokenizer=tokenizer, show_progress=False, **kwargs)
    try:
        params = SamplingParams(prompt_logprobs=0, max_tokens=0, temperature=0)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": w.ids} for w in wins], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    per_window: list[list[float | None]] = []
    for out, w in zip(outs, wins, strict=True):
        if out.prompt_logprobs is None:
            raise AssertionError(f"no prompt logprobs: {out.error}")
        row: list[float | None] = []
        for tok, entry in zip(w.ids, out.prompt_logprobs, strict=True):
            row.append(None if entry is None else entry[tok].logprob)
        per_window.append(row)
    return per_window, seconds


def api_logprobs(url: str, wins: list[Window]) -> tuple[list[list[float | None]], float]:
    """``POST {url}/completions`` with the window's token ids, ``echo``, ``logprobs: 0`` and
    ``max_tokens: 0``: ``choices[0].logprobs.token_logprobs``, the first None."""
    model = served_model(url)
    per_window: list[list[float | None]] = []
    start = time.perf_counter()
    with httpx.Client(timeout=API_TIMEOUT_S) as http:
        for w in wins:
            body = {"model": model, "prompt": w.ids, "echo": True, "logprobs": 0,
                    "max_tokens": 0, "temperature": 0}  # fmt: skip
            resp = http.post(f"{url}/completions", json=body)
            if resp.status_code != 200:
                raise AssertionError(f"HTTP {resp.status_code}: {resp.text[:500]}")
            choice = resp.json()["choices"][0]
            per_window.append(choice["logprobs"]["token_logprobs"])
    return per_window, time.perf_counter() - start


def served_model(url: str) -> str:
    (model,) = httpx.get(f"{url}/models", timeout=30).json()["data"]
    return str(model["id"])


def serve_flags(model: str, tokenizer: str | None, kwargs: dict[str, Any]) -> list[str]:
    flags = ["--model", model, "--workers", "1"]
    if tokenizer:
        raise SystemExit("--tokenizer: baton serve takes the model's own tokenizer")
    for key, value in kwargs.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


# ---- the run -----------------------------------------------------------------------------------


def table(rows: list[Row], ref: Row) -> str:
    head = f"{'engine':<13}{'path':<9}{'config':<9}{'tokens':>7}{'ppl':>10}{'vs ref':>9}"
    head += f"{'mean|Δlp|':>11}{'max|Δlp|':>10}{'seconds':>9}"
    lines = [f"reference: {ref.label}", head]
    for r in rows:
        gap = "" if r.ppl_gap is None else f"{100 * r.ppl_gap:+.3f}%"
        mean = "" if r.mean_abs_diff is None else f"{r.mean_abs_diff:.2e}"
        top = "" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}"
        lines.append(f"{r.engine:<13}{r.path:<9}{r.config:<9}{r.tokens:>7}{r.ppl:>10.4f}"
                     f"{gap:>9}{mean:>11}{top:>10}{r.seconds:>9.1f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(SMOLLM2), help="a GGUF file or a checkpoint directory")
    p.add_argument("--tokenizer", help="offline only: another tokenizer than the model's")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--configs", help="comma-separated: " + ", ".join(CONFIGS))
    p.add_argument("--paths", default="offline,api", help="offline, api or both")
    p.add_argument("--hf-dtypes", default="float32,bfloat16",
                   help="transformers' runs (the first is the reference; none: '')")  # fmt: skip
    p.add_argument("--url", help="the OpenAI API of a running server (…/v1): no cluster started")
    p.add_argument("--window", type=int, help="tokens a window (default: the context, less 1)")
    p.add_argument("--stride", type=int, help="tokens between window starts (default: half)")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()

    if hashlib.sha256(TEXT.read_bytes()).hexdigest() != TEXT_SHA256:
        raise SystemExit(f"{TEXT} is not the text the figures name (its SHA-256 differs)")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = (args.configs or DEFAULT_CONFIGS[device]).split(",")
    paths = [x for x in args.paths.split(",") if x]
    unknown = set(configs) - set(CONFIGS) | set(paths) - {"offline", "api"}
    if unknown:
        raise SystemExit(f"unknown configuration or path: {', '.join(sorted(unknown))}")
    if args.url and "api" in paths and len(configs) > 1:
        raise SystemExit("--url serves one configuration: give --configs one")

    context = EngineArgs(model=args.model, device=device).create_engine_config().model
    window = args.window or context.max_model_len - 1
    if window >= context.max_model_len:
        raise SystemExit(f"--window {window}: the context is {context.max_model_len}")
    tok = load_tokenizer(args.tokenizer or args.model)
    ids = tok(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    wins = windows(ids, window, args.stride or max(1, window // 2))
    print(f"{TEXT.name}: {len(ids)} tokens, {len(wins)} window(s) of at most {window}; "
          f"{args.model} on {device}", flush=True)  # fmt: skip

    rows: list[Row] = []

    def measure(row: Row, scores: tuple[list[list[float | None]], float]) -> None:
        rows.append(row.finish(scored(scores[0], wins), scores[1]))
        print(f"  {row.label}: ppl {row.ppl:.4f} ({row.seconds:.1f} s)", flush=True)

    model = Path(args.model)
    for dtype in [d for d in args.hf_dtypes.split(",") if d]:
        measure(Row("transformers", "offline", dtype),
                transformers_logprobs(model, wins, dtype, device))  # fmt: skip
    for config in configs:
        kwargs = engine_kwargs(config, device, wins)
        if "offline" in paths:
            measure(Row("baton", "offline", config),
                    offline_logprobs(args.model, args.tokenizer, kwargs, wins))  # fmt: skip
        if "api" in paths:
            if args.url:
                measure(Row("baton", "api", config), api_logprobs(args.url.rstrip("/"), wins))
                continue
            with serving(*serve_flags(args.model, args.tokenizer, kwargs)) as cluster:
                assert cluster.url is not None  # (started)
                measure(Row("baton", "api", config), api_logprobs(cluster.url, wins))

    ref = rows[0]
    for r in rows[1:]:
        r.compare(ref)
    print(table(rows, ref))
    result = {
        "text": {
            "file": str(TEXT.relative_to(ROOT)),
            "sha256": TEXT_SHA256,
            "tokens": len(ids),
            "scored_tokens": ref.tokens,
        },
        "model": Path(args.model).name,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "window": window,
        "stride": args.stride or max(1, window // 2),
        "windows": [
            {"start": w.start, "tokens": len(w.ids), "scored": len(w.ids) - w.first} for w in wins
        ],
        "reference": ref.label,
        "rows": [r.summary() for r in rows],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, separators=(",", ":")) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
