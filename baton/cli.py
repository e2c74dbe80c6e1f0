"""The ``baton`` command. Sub-commands import their service lazily, so ``baton --help`` is fast
and ``baton gateway`` never imports the engine.

    cli (the parser) → service_cli (service flags → settings) → launcher (baton serve)
    serving (tests, benchmarks: ``baton serve FLAGS`` in this process) → cli, service_cli
"""

import argparse
import sys

from baton.service_cli import HelpFormatter, add_service_commands
from services.worker.engine.config import LOAD_FORMATS

# ``baton --help``: what a user needs first (the module docstring above is for its readers)
DESCRIPTION = """\
Baton serves language models behind an OpenAI-compatible API (/v1/completions,
/v1/chat/completions, /v1/models), with disaggregated prefill and decode workers.

start here:
  baton serve --model .models/SmolLM2-135M-Instruct.Q4_1.gguf
      the whole system on this machine serving SmolLM2 (the trained model that
      `make install` downloads; a GGUF file or a checkpoint directory will do),
      on http://127.0.0.1:8000/v1 once it prints 'Baton is serving ...'
  baton make-tiny-model tiny-model
      a small model with random weights, any architecture (its text is noise)
  baton COMMAND --help
      a command's flags, each with its default
"""


def _make_tiny_model(args: argparse.Namespace) -> None:
    from baton.tiny_model import make_tiny_model

    path = make_tiny_model(
        args.dir,
        args.arch,
        seed=args.seed,
        num_shards=args.shards,
        tie_word_embeddings=args.tie,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        quantize=args.quantize,
        kv_scales=args.kv_cache_scales,
        keep_float=tuple(args.keep_float),
    )
    fp8 = (
        f" ({args.quantize}{', KV cache scales' if args.kv_cache_scales else ''})"
        if args.quantize
        else ""
    )
    print(f"wrote a tiny {args.arch}{fp8} checkpoint to {path}")


# ``baton make-tiny-model --arch``: the architectures of baton/tiny_model.py's ARCHS (a test
# keeps the two lists equal; the CLI does not import transformers to print its help)
TINY_ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
              "deepseek_v2", "deepseek_v3", "gemma3", "gpt_oss", "qwen3_5",
              "qwen3_next", "qwen3_5_moe", "glm4_moe", "minimax_m2"]  # fmt: skip

DEMO_PROMPTS = ["The quick brown fox", "Return a new list containing", "This module provides"]
DEMO_CHAT = "What does the json module do?"


def _generate(args: argparse.Namespace) -> None:
    import textwrap

    from baton import LLM, SamplingParams

    llm = LLM(model=args.model, load_format=args.load_format, max_model_len=args.max_model_len)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    given = args.prompt or args.chat  # either: exactly those; neither: the samples
    prompts = args.prompt or ([] if given else DEMO_PROMPTS)
    chats = args.chat or ([] if given else [DEMO_CHAT])
    for out in llm.generate(prompts, params) if prompts else []:
        completion = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n    {completion.text!r} ({completion.finish_reason})")
    conversations = [[{"role": "user", "content": message}] for message in chats]
    for message, out in zip(chats, llm.chat(conversations, params) if chats else [], strict=True):
        reply = out.outputs[0]
        print(f"--- user: {message}\n{textwrap.indent(reply.text.strip(), '    ')}\n"
              f"    ({reply.finish_reason}, {len(reply.token_ids)} tokens)")  # fmt: skip
    stats = llm.get_stats()
    print(
        f"engine: {stats.num_blocks} KV blocks, prefix-cache hits {stats.prefix_hit_tokens} tokens"
    )
    llm.shutdown()


def _transports(args: argparse.Namespace) -> None:
    import os
    from pathlib import Path

    from baton.transports import run

    sys.exit(run(Path(args.sysfs), os.environ, as_json=args.json))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of these (baton COMMAND --help says more)")  # fmt: skip

    p = sub.add_parser(
        "make-tiny-model", help="write a small Hugging Face checkpoint with random weights "
        "(no download; its text is noise)", formatter_class=HelpFormatter,
        description="Write a small Hugging Face checkpoint with random weights and a real "
        "tokenizer: for trying Baton out and for tests (no download). Its weights are random, "
        "so the text it generates is noise.",
    )  # fmt: skip
    p.add_argument("dir", help="the directory to write (its name is the served model name)")
    p.add_argument(
        "--arch", default="llama", choices=TINY_ARCHS,
        help="the architecture (and tokenizer) of the model",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--shards", type=int, default=1, help="safetensors files to split it into")
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--hidden-size", type=int, default=64, help="the hidden size")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default 2; gemma3: 6, gpt_oss: 4)")  # fmt: skip
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--max-position-embeddings", type=int, default=1024,
                   help="its context length, in tokens")  # fmt: skip
    p.add_argument(
        "--quantize", choices=["fp8-tensor", "fp8-channel", "fp8-block", "mxfp4"], default=None,
        help="write an FP8 checkpoint: compressed-tensors with per-tensor (static activations) "
        "or per-channel scales, or the fp8 method's 128x128 blocks; or (gpt_oss) its experts "
        "in MXFP4, as openai publishes them (default: float weights)",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-scales", action="store_true",
        help="with --quantize fp8-tensor|fp8-channel: a key and a value scale per layer too "
        "(compressed-tensors kv_cache_scheme), calibrated on a text",
    )  # fmt: skip
    p.add_argument(
        "--keep-float", nargs="+", default=[], metavar="NAME",
        help="with an fp8 --quantize: layers left float and listed in the checkpoint's ignore "
        "list, by name or as re:PATTERN (llm-compressor's recipes: re:.*linear_attn.*, ...)",
    )  # fmt: skip
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser(
        "generate", help="generate text with the engine in this process (no server)",
        formatter_class=HelpFormatter, description="Generate text for prompts and chat "
        "messages with the engine in this process, and print it (no server, no gRPC).",
    )  # fmt: skip
    p.add_argument("--model", required=True,
                   help="the model: a Hugging Face checkpoint directory, or a GGUF file (or a "
                   "directory holding one)")  # fmt: skip
    p.add_argument("--prompt", action="append",
                   help="a prompt, continued as it is; repeatable (default, without --prompt "
                   "or --chat: three sample prompts and one chat message)")  # fmt: skip
    p.add_argument("--chat", action="append", metavar="MESSAGE",
                   help="a user's message, answered through the model's chat template (each "
                   "one a conversation of its own); repeatable")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=32,
                   help="the most tokens to generate per prompt or message")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None,
                   help="the sampling seed (default: none, different text each run)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest prompt plus completion, in tokens (default: the model's "
                   "context length)")  # fmt: skip
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="safetensors or gguf (auto: the model's own): its weights; dummy: "
                   "random ones")  # fmt: skip
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "transports", help="check which transport KV pulls between nodes take from this pod "
        "(RDMA or TCP)", formatter_class=HelpFormatter,
        description="Print this pod's RDMA ports (InfiniBand, RoCE, EFA) and their state, "
        "whether the RDMA libraries load, the UCX and NIXL environment, and a verdict: the "
        "transport UCX will use between nodes. Exits with 1 when UCX_TLS asks for an RDMA "
        "transport that no active port gives. Imports neither torch nor NIXL.",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--sysfs", default="/sys", help="where sysfs is mounted")
    p.set_defaults(func=_transports)

    add_service_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
