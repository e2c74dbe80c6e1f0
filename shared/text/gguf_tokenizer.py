"""The tokenizer a GGUF file (llama.cpp's one-file checkpoint) describes in its metadata, as a
``tokenizers.Tokenizer`` that cuts text as llama.cpp does: a GGUF has no tokenizer.json, only
these keys (read with ``shared/gguf_header.read_header``, memory-mapped; numpy, no torch):

    tokenizer.ggml.model        gpt2: byte-level BPE (the only model built here)
    tokenizer.ggml.pre          how text is split before the merges (PRE_TOKENIZERS)
    tokenizer.ggml.tokens       id → token, in GPT-2's byte alphabet ("Ġthe")
    tokenizer.ggml.merges       "Ġ t", best first
    tokenizer.ggml.token_type   1 normal, 3 control, 4 user-defined (llama.cpp's llama_token_type)
    tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token
    tokenizer.chat_template

Control tokens are special (matched whole in text, left out of decoding on request),
user-defined ones are matched whole and always decoded, as in ``transformers``. The split
regexes are llama.cpp's (``llm_tokenizer_bpe`` in src/llama-vocab.cpp), spelled as the models'
own tokenizer.json spell them (llama.cpp rewrites ``(?i:...)`` for std::regex). Where
``transformers``' GGUF loader does not know a ``pre`` (5.x has no ``smollm``), it splits as
GPT-2 does, and gives other ids than llama.cpp and the model's own tokenizer.json wherever a
digit follows whitespace ("a   1"): the engine takes this tokenizer too
(services/worker/engine/tokenizer.py).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values matched whole in text

# GPT-2's split (ByteLevel's own regex; llama.cpp's unicode_regex_split_custom_gpt2)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


class UnsupportedTokenizer(ValueError):
    """The file's tokenizer is one Baton cannot rebuild; the message names what it found."""


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's split for a family of ``tokenizer.ggml.pre`` values: each regex in turn
    cuts every piece so far, keeping both the matches and the text between them."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a token as a whole is that token (Llama 3)
    add_bos: bool = False  # llama.cpp's default where the file has no add_bos_token


_GPT2_SPLIT = PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))  # StarCoder's tokenizer and its heirs
_LLAMA3_SPLIT = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_SPLIT = PreTokenizer((_QWEN2,))

# tokenizer.ggml.pre → split, by the names llama.cpp gives each family (llama_vocab::impl::load)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), _GPT2_SPLIT),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), _DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
TOKENIZER_MODELS = ("gpt2",)  # tokenizer.ggml.model values built here


@dataclass(frozen=True)
class TokenizerParts:
    """What ``TextTokenizer`` is made of, read from a GGUF file or a checkpoint directory."""

    tokenizer: Tokenizer  # the Rust tokenizer: splits, merges, special tokens, BOS/EOS, decoder
    special_tokens: dict[str, str | None]  # bos_token, eos_token, unk_token, pad_token (text)
    chat_template: str | None


def load_gguf_tokenizer(path: Path) -> TokenizerParts:
    meta = _tokenizer_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise UnsupportedTokenizer(
            f"{path}: tokenizer.ggml.model {model!r} is not one Baton builds "
            f"(known: {', '.join(TOKENIZER_MODELS)})"
        )
    pre_name = meta.get("tokenizer.ggml.pre")
    pre = PRE_TOKENIZERS.get(pre_name) if isinstance(pre_name, str) else None
    if pre is None:
        raise UnsupportedTokenizer(
            f"{path}: tokenizer.ggml.pre {pre_name!r} is not a pre-tokenizer Baton knows "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges", []), pre)
    specials = {
        name: _token(tokens, meta.get(f"tokenizer.ggml.{key}_token_id"))
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                          ("unk_token", "unknown"), ("pad_token", "padding"))
    }  # fmt: skip
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = _bos_eos(
        tokenizer, specials["bos_token"] if add_bos else None,
        specials["eos_token"] if add_eos else None,
    )  # fmt: skip
    template = meta.get("tokenizer.chat_template")
    return TokenizerParts(tokenizer, specials, template if isinstance(template, str) else None)


def _tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The file's ``tokenizer.*`` values (numbers, strings, lists of them): read with
    ``read_header`` (0.1 s for SmolLM2's 49,152 tokens and merges), not ``gguf.GGUFReader``
    (2.7 s: a numpy view for every part of every value), which the gateway's and each worker's
    start waited for."""
    from shared.gguf_header import read_header  # numpy and gguf load only for a GGUF model

    fields = read_header(path).fields
    return {k: v for k, v in fields.items() if k.startswith("tokenizer.")}


def _byte_level_bpe(
    tokens: list[str], types: list[int], merges: list[str], pre: PreTokenizer
) -> Tokenizer:
    """Byte-level BPE over the file's vocabulary. A normal token spelled outside the byte
    alphabet is respelled in it (as ``transformers`` does); control and user-defined tokens
    keep their text, which the added-token matcher looks for in the input as it is."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(piece for piece, _ in to_bytes.pre_tokenize_str(token))
        vocab.setdefault(token, i)
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    for kind, special in ((_CONTROL, True), (_USER_DEFINED, False)):
        whole = [AddedToken(t, special=special, normalized=False)
                 for t, k in zip(tokens, types, strict=True) if k == kind]  # fmt: skip
        tokenizer.add_tokens(whole)
    return tokenizer


def _bos_eos(tokenizer: Tokenizer, bos: str | None, eos: str | None) -> Any:
    """The post-processor that puts BOS before and EOS after a text, each when given (as
    ``transformers`` builds it from add_bos_token and add_eos_token)."""

    def around(seq: str, type_id: int) -> str:
        first = [f"{bos}:{type_id}"] if bos is not None else []
        return " ".join([*first, seq, *([f"{eos}:{type_id}"] if eos is not None else [])])

    return processors.TemplateProcessing(
        single=around("$A:0", 0),
        pair=f"{around('$A:0', 0)} {around('$B:1', 1)}",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t is not None],
    )


def _token(tokens: list[str], token_id: object) -> str | None:
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None
