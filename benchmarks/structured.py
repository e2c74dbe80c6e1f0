"""What grammar-constrained decoding costs (engine/structured/), side by side in one run:

1. Decode step time with every row under a JSON schema against none, per model and batch size.
   The schema is an array of at least 5,000 small objects: no row can finish within the run,
   so every row decodes as many steps as asked (``ignore_eos``). Each configuration runs at two
   output lengths T1 < T2; step time = (t(T2) - t(T1)) / (T2 - T1), so prefill and start-up
   cancel; rounds alternate none/json, the median is reported. Every constrained output is
   checked to be a prefix of a valid document (a matcher accepts each of its tokens), and every
   row must have produced T tokens. Beside it, the host's bitmask fill alone
   (``StructuredOutputManager.fill`` for B matchers, no model), replayed over the run's own
   tokens: what a step waits for before it samples.
2. Time to first token added by compiling a 50-field schema: cold (one property renamed each
   trial, so never seen), cached (the same schema again), against no schema; (a) colocated,
   one engine, ``max_tokens=1``; (b) P/D, a prefill and a decode engine with ``kv_transfer``:
   the prefill leg, the decode leg to its first new token (it compiles while it pulls the KV
   cache) and the total. Also the compile alone on this host.

The decode rows sample at temperature 1 with ``grammar_max_whitespace=0`` by default: a random
model otherwise spends most tokens on the whitespace JSON allows, which masks cheaply. Dummy
shapes take SmolLM2's tokenizer (49,152 tokens; the shapes' own has 1,024) so the masks are
computed over a real vocabulary. Every engine runs its core in a process of its own
(``multiprocess=True``, as a worker does); without CUDA each gets one OpenMP thread unless
``OMP_NUM_THREADS`` says otherwise (two on a 2-core VM wait for each other whenever the other
process runs: steps 3-10 times slower, at random; the Makefile's ``demo`` says the same).

    python benchmarks/structured.py --quick                       # CPU, about 1.5 minutes
    python benchmarks/structured.py --out bench-results/structured.json   # one H200
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton import LLM, RequestOutput, SamplingParams  # noqa: E402
from baton.tiny_model import train_tokenizer  # noqa: E402
from benchmarks.shapes import SHAPES, write_shape  # noqa: E402
from services.worker.engine.kv_transfer.params import KVTransferParams  # noqa: E402
from services.worker.engine.params import StructuredOutputParams  # noqa: E402
from services.worker.engine.structured.manager import StructuredOutputManager  # noqa: E402

SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# --quick's model: small enough for a CPU step in milliseconds, SmolLM2's vocabulary
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "eos_token_id": 2,
}  # fmt: skip
DECODE_SCHEMA = json.dumps({
    "type": "array", "minItems": 5000,
    "items": {"type": "object", "required": ["id", "name"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999999},
                             "name": {"type": "string", "maxLength": 8}}},
})  # fmt: skip
# the 50 fields of part 2 cycle through these (what extraction and tool schemas hold)
FIELD_KINDS: list[dict[str, Any]] = [
    {"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0, "maximum": 100000},
    {"type": "number"}, {"type": "boolean"}, {"enum": ["draft", "active", "archived"]},
    {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
    {"type": "object", "required": ["street", "zip"],
     "properties": {"street": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    {"type": ["string", "null"]}, {"type": "string", "format": "date"},
]  # fmt: skip
TEXT = (
    "Extract every field of the customer record below as JSON. The customer opened the "
    "account in March, moved twice, and asked for the invoices to go to the new address. "
)
FILL_REPEATS = 3  # each step's bitmask filled this many times, the least kept
QUICK = {"model": "tiny", "batch": "8", "lengths": "16,96", "rounds": 5, "trials": 5}
FULL = {
    "model": "llama-3.1-8b,qwen3-0.6b",
    "batch": "64,256",
    "lengths": "32,160",
    "rounds": 3,
    "trials": 5,
}


def wide_schema(tag: str, fields: int = 50) -> str:
    """A ``fields``-property object schema; ``tag`` renames its first property (a new grammar)."""
    props = {
        f"field_{i}" + (f"_{tag}" if i == 0 else ""): FIELD_KINDS[i % len(FIELD_KINDS)]
        for i in range(fields)
    }
    return json.dumps(
        {
            "type": "object",
            "properties": props,
            "required": list(props),
            "additionalProperties": False,
        }
    )


def resolve_model(name: str, tokenizer: str, root: Path) -> dict[str, Any]:
    """``LLM`` keyword arguments for a named shape (dummy weights) or a checkpoint path."""
    if name not in SHAPES and name != "tiny":
        return {"model": name, **({"tokenizer": tokenizer} if tokenizer != "auto" else {})}
    if name == "tiny":
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(TINY))
    else:
        out = write_shape(name, root / name)
    if tokenizer == "auto":
        tokenizer = str(SMOLLM2) if SMOLLM2.exists() else ""
        if not tokenizer:
            print(f"warning: {SMOLLM2} is missing: {name} masks over the shape's own tokenizer "
                  "of 1,024 tokens (`make install` fetches SmolLM2)", file=sys.stderr)  # fmt: skip
    if not tokenizer and not (out / "tokenizer.json").exists():
        train_tokenizer(out)
    return {
        "model": str(out),
        "load_format": "dummy",
        **({"tokenizer": tokenizer} if tokenizer else {}),
    }


def text_prompt(llm: LLM, n: int, shift: int = 0) -> list[int]:
    """``n`` tokens of plain text (random ids can split a character: noise in the outputs)."""
    ids = llm.tokenizer.encode(TEXT * (1 + (n + shift) // 8), add_special_tokens=False)
    if len(ids) < shift + n:
        raise RuntimeError(f"the prompt text is too short for {n} tokens")
    return ids[shift : shift + n]


def timed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[RequestOutput]]:
    start = time.perf_counter()  # (the engine's core is another process: its outputs are back)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[0]}")
    return seconds, outs


def grammar_manager(model: Any, args: argparse.Namespace, rows: int) -> StructuredOutputManager:
    """A grammar manager of an engine's vocabulary (``model``: its ``ModelConfig``), in this
    process, as the engine sets its own up: to check outputs and to time its work alone."""
    return StructuredOutputManager(
        model.tokenizer, model.arch.vocab_size, model.arch.eos_token_ids, rows,
        args.grammar_threads, 120.0, 256 << 20, args.max_whitespace,
    )  # fmt: skip


# ---- 1. decode step time --------------------------------------------------------------------
def decode_rounds(llm: LLM, args: argparse.Namespace, batch: int) -> tuple[dict, list]:
    """Rounds of none/json at T1 and T2; each round's step time per mode, the outputs seen."""
    t1, t2 = args.t1, args.t2
    prompts = [text_prompt(llm, args.prompt_len, i) for i in range(batch)]
    modes = {"none": None, "json": StructuredOutputParams(json=DECODE_SCHEMA)}
    params = {
        (m, t): SamplingParams(temperature=1.0, max_tokens=t, ignore_eos=True, structured_outputs=s)
        for m, s in modes.items()
        for t in (t1, t2)
    }
    for m in modes:  # warm-up: graphs, allocator, the compiler and the grammar
        timed(llm, prompts, params[m, t1])
    steps: dict[str, list[float]] = {m: [] for m in modes}
    seen: list[tuple[int, list[RequestOutput]]] = []
    for _ in range(args.rounds):
        for m in modes:
            (a, outs1), (b, outs2) = (timed(llm, prompts, params[m, t]) for t in (t1, t2))
            steps[m].append((b - a) / (t2 - t1))
            for t, outs in ((t1, outs1), (t2, outs2)):
                check_lengths(outs, t, f"{m} batch {batch}")
                if m == "json":
                    seen.append((t, outs))
    return steps, seen


def check_lengths(outs: list[RequestOutput], want: int, label: str) -> None:
    short = [len(o.outputs[0].token_ids) for o in outs if len(o.outputs[0].token_ids) != want]
    if short:
        raise RuntimeError(f"{label}: {len(short)} rows did not produce {want} tokens: {short[:8]}")


def check_and_fill(manager: StructuredOutputManager, llm: LLM, seen: list) -> list[float]:
    """Every constrained output follows the grammar (a prefix: it never ends here); the bitmask
    fill of the last T2 batch timed step by step over its own tokens (seconds each)."""
    spec = StructuredOutputParams(json=DECODE_SCHEMA)
    for _, outs in seen:
        for o in outs:
            grammar = manager.request_grammar(spec, [0])
            grammar.future.result()
            tokens = o.outputs[0].token_ids
            text = str(llm.tokenizer.decode(tokens)).lstrip()
            if not grammar.ready(list(tokens)) or grammar.terminated or not text.startswith("["):
                raise RuntimeError(f"an output breaks the grammar ({grammar.error}): {text[:80]!r}")
    longest = max(t for t, _ in seen)
    last = [outs for t, outs in seen if t == longest][-1]
    rows = [manager.request_grammar(spec, [0]) for _ in last]
    for g in rows:
        g.future.result()
        g.ready([])
    ids, times = [str(i) for i in range(len(rows))], []
    for k in range(longest):
        best = float("inf")
        for _ in range(FILL_REPEATS):  # the same state: the least is the fill, not the noise
            start = time.perf_counter()
            manager.fill(ids, list(rows))
            best = min(best, time.perf_counter() - start)
        times.append(best)
        for g, o in zip(rows, last, strict=True):
            g.accept(o.outputs[0].token_ids[k])
    return times


def decode_part(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    results = []
    for name in args.model.split(","):
        kwargs = resolve_model(name, args.tokenizer, root)
        blocks = max(args.batches) * -(-(args.prompt_len + args.t2 + 16) // 16) + 16
        llm = LLM(
            **kwargs,
            max_num_seqs=max(args.batches),
            # prefill in chunks of 2,048 tokens: fewer piecewise graphs to capture at start-up;
            # prefill cancels out of the step time anyway
            max_num_batched_tokens=max(2048, max(args.batches)),
            num_kv_blocks=blocks,
            max_model_len=args.prompt_len + args.t2 + 16,
            enable_prefix_caching=False,
            seed=0,
            multiprocess=True,
            show_progress=False,
            async_scheduling=args.async_scheduling,
            grammar_compile_threads=args.grammar_threads,
            grammar_max_whitespace=args.max_whitespace,
        )
        manager = None  # (made after the first rounds: its set-up would share their CPU)
        for batch in args.batches:
            steps, seen = decode_rounds(llm, args, batch)
            manager = manager or grammar_manager(llm.config.model, args, max(args.batches))
            fills = check_and_fill(manager, llm, seen)
            results.append(decode_row(llm, name, batch, steps, fills))
            print(f"  {name} batch {batch}: {results[-1]['step_ms']}", file=sys.stderr)
        if manager is not None:
            manager.shutdown()
        llm.shutdown()
    return results


def decode_row(llm: LLM, name: str, batch: int, steps: dict, fills: list[float]) -> dict:
    none, js = (statistics.median(steps[m]) * 1e3 for m in ("none", "json"))
    return {
        "model": name,
        "batch": batch,
        "vocab_size": llm.config.model.arch.vocab_size,
        "tokenizer_vocab": len(llm.tokenizer),
        "tokenizer": llm.config.model.tokenizer,
        "async_scheduling": llm.config.scheduler.async_scheduling,
        "step_ms": {"none": round(none, 3), "json": round(js, 3)},
        "json_over_none": round(js / none, 3),
        "added_ms": round(js - none, 3),
        "fill_ms": {
            "median": round(statistics.median(fills) * 1e3, 3),
            "mean": round(statistics.fmean(fills) * 1e3, 3),
            "max": round(max(fills) * 1e3, 3),
        }
        if fills
        else None,
        "rounds_step_ms": {m: [round(s * 1e3, 3) for s in v] for m, v in steps.items()},
    }


# ---- 2. time to first token with a schema to compile ---------------------------------------
Leg = Callable[[StructuredOutputParams | None], dict[str, float]]  # one request: ms by part


def ttft_trials(args: argparse.Namespace, leg: Leg) -> dict[str, Any]:
    """none, cold, cached in turn, ``args.trials`` times, after a warm-up of each (the first
    grammar also builds the engine's compiler: reported as ``first_grammar_ms``). Each mode's
    median, and what a grammar adds: the median of each trial's difference to its own none."""
    nonce = uuid.uuid4().hex[:8]
    leg(None)
    first = leg(StructuredOutputParams(json=wide_schema(f"warm{nonce}")))
    runs: dict[str, list[dict[str, float]]] = {"none": [], "cold": [], "cached": []}
    for i in range(args.trials):
        spec = StructuredOutputParams(json=wide_schema(f"{nonce}{i}"))
        runs["none"].append(leg(None))
        runs["cold"].append(leg(spec))
        runs["cached"].append(leg(spec))
    parts = list(first)
    return {
        "ms": {m: {k: ms(statistics.median(r[k] for r in v)) for k in parts}
               for m, v in runs.items()},
        "added_ms": {m: {k: ms(statistics.median(r[k] - n[k] for r, n in
                                                 zip(runs[m], runs["none"], strict=True)))
                         for k in parts}
                     for m in ("cold", "cached")},
        "first_grammar_ms": {k: ms(x) for k, x in first.items()},
        "trials_ms": {m: [{k: ms(x) for k, x in r.items()} for r in v] for m, v in runs.items()},
    }  # fmt: skip


def ms(x: float) -> float:
    return round(x, 2)


def colocated_ttft(args: argparse.Namespace, llm: LLM) -> dict[str, Any]:
    """One engine; a request of one token: its wall time (``total``)."""
    ids = text_prompt(llm, args.ttft_prompt_len)

    def leg(spec: StructuredOutputParams | None) -> dict[str, float]:
        params = SamplingParams(temperature=0, max_tokens=1, structured_outputs=spec)
        return {"total": timed(llm, [ids], params)[0] * 1e3}

    trials = ttft_trials(args, leg)
    llm.shutdown()
    return trials


def pd_ttft(args: argparse.Namespace, model: dict[str, Any]) -> dict[str, Any]:
    """The two legs as the gateway runs them (tests/helpers.py ``disaggregated``): the prefill
    engine's one token, then the decode engine's first new one (it pulls the KV cache and
    compiles the grammar meanwhile)."""
    prefill, decode = (LLM(**model, **ttft_engine(args), kv_transfer=True) for _ in range(2))
    ids = text_prompt(prefill, args.ttft_prompt_len)

    def leg(spec: StructuredOutputParams | None) -> dict[str, float]:
        params = SamplingParams(temperature=0, max_tokens=2, structured_outputs=spec)
        start = time.perf_counter()
        first = prefill.generate(
            [{"prompt_token_ids": ids, "kv_transfer": KVTransferParams(do_remote_decode=True)}],
            params.clone(max_tokens=1),
            use_tqdm=False,
        )[0]
        mid = time.perf_counter()
        if first.kv_handle is None or first.error:
            raise RuntimeError(f"the prefill leg left no KV handle: {first.error}")
        hand_off = KVTransferParams(
            remote=first.kv_handle, first_token_id=first.outputs[0].token_ids[0]
        )
        rest = decode.generate(
            [{"prompt_token_ids": ids, "kv_transfer": hand_off}], params, use_tqdm=False
        )[0]
        end = time.perf_counter()
        if rest.error or len(rest.outputs[0].token_ids) != 1:
            raise RuntimeError(f"the decode leg did not produce one token: {rest.error}")
        return {"prefill": (mid - start) * 1e3, "decode": (end - mid) * 1e3,
                "total": (end - start) * 1e3}  # fmt: skip

    trials = ttft_trials(args, leg)
    for e in (prefill, decode):
        e.shutdown()
    return trials


def ttft_engine(args: argparse.Namespace) -> dict[str, Any]:
    """One request at a time: few decode graphs and prefill graphs to capture at start-up."""
    blocks = 4 * -(-(args.ttft_prompt_len + 16) // 16) + 16
    return {
        "max_model_len": args.ttft_prompt_len + 16,
        "max_num_seqs": 4,
        "max_num_batched_tokens": max(256, args.ttft_prompt_len + 16),
        "num_kv_blocks": blocks,
        "enable_prefix_caching": False,
        "multiprocess": True,
        "show_progress": False,
        "async_scheduling": args.async_scheduling,
        "grammar_compile_threads": args.grammar_threads,
        "grammar_max_whitespace": args.max_whitespace,
    }


def compile_alone(args: argparse.Namespace, cfg: Any) -> dict[str, float]:
    """The wide schema compiled cold on this host, no engine (``cfg``: an engine's
    ``ModelConfig``): the compiler's set-up, then the median of ``trials`` new schemas."""
    manager = grammar_manager(cfg, args, 1)
    start = time.perf_counter()
    manager.request_grammar(StructuredOutputParams(json_object=True), [0]).future.result()
    setup = time.perf_counter() - start
    times, nonce = [], uuid.uuid4().hex[:8]
    for i in range(args.trials):
        start = time.perf_counter()
        manager.request_grammar(
            StructuredOutputParams(json=wide_schema(f"{nonce}{i}")), [0]
        ).future.result()
        times.append(time.perf_counter() - start)
    manager.shutdown()
    return {
        "compiler_setup_ms": round(setup * 1e3, 1),
        "compile_ms": round(statistics.median(times) * 1e3, 2),
    }


def ttft_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model = resolve_model(args.ttft_model, "auto", root)  # (its own tokenizer)
    out: dict[str, Any] = {
        "model": args.ttft_model,
        "schema_fields": 50,
        "schema_chars": len(wide_schema("x")),
    }
    llm = LLM(**model, **ttft_engine(args))
    out["colocated"] = colocated_ttft(args, llm)  # (shuts it down)
    out.update(compile_alone(args, llm.config.model))
    print(f"  colocated: {out['colocated']['ms']}", file=sys.stderr)
    if not args.no_pd:
        out["pd"] = pd_ttft(args, model)
        print(f"  P/D: {out['pd']['ms']}", file=sys.stderr)
    return out


# ---- output ---------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    """The figures to read first, for a terminal."""
    head = ("model", "batch", "none ms", "json ms", "ratio", "+ms", "fill ms")
    lines = ["", "decode step, every row under a JSON schema vs none",
             f"{head[0]:<16}" + "".join(f"{h:>9}" for h in head[1:])]  # fmt: skip
    for r in result.get("decode", []):
        fill = r["fill_ms"]["median"] if r["fill_ms"] else float("nan")
        row = (r["step_ms"]["none"], r["step_ms"]["json"], r["json_over_none"],
               r["added_ms"], fill)  # fmt: skip
        model = Path(r["model"]).name[:15]
        lines.append(f"{model:<16}{r['batch']:>9}" + "".join(f"{c:>9.3f}" for c in row))
    t = result.get("ttft")
    if not t:
        return "\n".join(lines)
    cols = ("none", "cold", "cached", "+cold", "+cached")
    lines += ["", f"first token, {t['schema_fields']}-field schema ({Path(t['model']).name}; "
              f"compile alone {t['compile_ms']} ms)",
              f"{'ms':<16}" + "".join(f"{c:>9}" for c in cols)]  # fmt: skip
    for setup in ("colocated", "pd"):
        for part in t[setup]["ms"]["none"] if setup in t else ():
            ms_, added = t[setup]["ms"], t[setup]["added_ms"]
            cells = [ms_[m][part] for m in cols[:3]] + [added[m][part] for m in cols[1:3]]
            label = "colocated" if setup == "colocated" else f"P/D {part}"
            lines.append(f"{label:<16}" + "".join(f"{c:>9.1f}" for c in cells))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help=f"small defaults for a CPU: {QUICK}")
    p.add_argument("--model", help=f"comma-separated paths or shapes ({', '.join(SHAPES)}, tiny)")
    p.add_argument("--tokenizer", default="auto", help="auto: SmolLM2's for dummy shapes")
    p.add_argument("--batch", help="comma-separated batch sizes")
    p.add_argument("--lengths", help="T1,T2: the two output lengths")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, help="rounds of none/json at T1 and T2")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--grammar-threads", type=int, default=2, help="grammar_compile_threads")
    p.add_argument("--max-whitespace", type=int, default=0, help="grammar_max_whitespace")
    p.add_argument("--ttft-model", default=str(SMOLLM2))
    p.add_argument("--ttft-prompt-len", type=int, default=128)
    p.add_argument("--trials", type=int, help="TTFT trials of none, cold, cached")
    p.add_argument("--skip", choices=["decode", "ttft"], help="leave one part out")
    p.add_argument("--no-pd", action="store_true", help="TTFT colocated only (no NIXL)")
    p.add_argument("--out")
    args = p.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.batches = [int(b) for b in args.batch.split(",")]
    args.t1, args.t2 = (int(t) for t in args.lengths.split(","))
    if not 0 < args.t1 < args.t2:
        p.error("--lengths needs 0 < T1 < T2")
    named = args.ttft_model in SHAPES or args.ttft_model == "tiny"
    if args.skip != "ttft" and not named and not Path(args.ttft_model).exists():
        p.error(f"--ttft-model {args.ttft_model} is missing (SmolLM2: `make install` fetches it)")
    args.async_scheduling = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    return args


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:  # (read by the engines' processes when they start)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    result: dict[str, Any] = {
        "benchmark": "structured", "device": "cuda" if cuda else "cpu", "device_name": name,
        "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__, "xgrammar": version("xgrammar"), "args": dict(vars(args)),
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="structured-bench-") as tmp:
        for part, run in (("decode", decode_part), ("ttft", ttft_part)):
            if args.skip != part:
                start = time.perf_counter()
                result[part] = run(args, Path(tmp))
                result[f"{part}_seconds"] = round(time.perf_counter() - start, 1)
    print(table(result), file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text)


if __name__ == "__main__":
    main()
