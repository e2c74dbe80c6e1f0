"""The engine core's side of grammar-constrained decoding.

    request arrives ──▶ compile (thread pool; cache keyed by the grammar) ─┐
                                                                           ▼
    scheduler: waits in the queue, unscheduled, until ``RequestGrammar.ready()`` (bounded)
                                                                           ▼
    each step: ``fill(requests)`` → the bitmask of the rows it samples → the runner masks them
    each token: ``RequestGrammar.accept(token)`` (scheduler.update_from_output)

One compiler per engine (so per tokenizer): xgrammar's own cache holds compiled grammars up to
a byte bound, and ``_compiled`` (futures, bounded in count) lets concurrent requests with the
same grammar share one compilation. A request's matcher is made when its grammar is ready; it
first accepts the tokens the request already has that were generated under the grammar (a
decode leg's first token, sampled by the prefill worker; a resumed request's earlier output,
``StructuredOutputParams.replay_tokens`` at the prompt's end). Nothing is rolled back: a
preempted request keeps its output tokens, so its matcher stays where it was.
"""

import concurrent.futures as cf
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from services.worker.engine.messages import ErrorCode
from services.worker.engine.params import StructuredOutputParams
from services.worker.engine.structured.bitmask import GrammarBitmask

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
MAX_COMPILED_FUTURES = 4096  # grammars whose compilation is remembered (xgrammar bounds bytes)
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"  # (as xgrammar 0.2.9 prints it)
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: str,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_rows: int,
        threads: int,
        timeout_s: float,
        cache_bytes: int,
        max_whitespace: int = 32,
        pin_memory: bool = False,
    ):
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace
        self.pin_memory = pin_memory
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._compiled: OrderedDict[tuple[str, str], Compilation] = OrderedDict()
        self._lock = threading.Lock()
        self._threads = threads
        # the tokenizer's vocabulary, read once, off the step loop too
        self._tokenizer_size = vocab_size  # (the tokenizer's, once read)
        self._compiler = self._pool.submit(
            self._make_compiler, tokenizer, vocab_size, stop_token_ids, threads, cache_bytes
        )
        self._bits: torch.Tensor | None = None
        self._fill_bits = torch.empty(0)
        self._max_rows = max_rows
        self._batch: Any = None
        self.num_compiled = 0
        self.compile_seconds = 0.0

    def _make_compiler(
        self, tokenizer: str, vocab_size: int, stop: tuple[int, ...], threads: int,
        cache_bytes: int,
    ) -> "xgr.GrammarCompiler":  # fmt: skip
        import xgrammar as xgr

        from services.worker.engine.tokenizer import load_tokenizer

        start = time.perf_counter()
        hf = load_tokenizer(tokenizer)
        vocab = hf.get_vocab()
        # The tokenizer's own ids, not the model's padded vocabulary: xgrammar 0.2.9 counts the
        # padding as special tokens, and advancing a matcher by one token then costs ~16 times
        # as much (1.3 vs 20.7 µs for a 49,152-token vocabulary padded to 151,936). The ids
        # past the tokenizer's are masked all the same (``fill`` leaves their bits 0).
        size = min(vocab_size, max(len(vocab), max(vocab.values(), default=0) + 1))
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=size, stop_token_ids=[t for t in stop if t < size]
        )
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_limit_bytes=cache_bytes)
        self._tokenizer_size = size
        logger.info("grammar compiler ready in %.2f s (vocabulary of %d of the model's %d, %s)",
                    time.perf_counter() - start, size, vocab_size,
                    info.vocab_type.name)  # fmt: skip
        return compiler

    # ---- compiling -----------------------------------------------------------------------
    def request_grammar(
        self, params: StructuredOutputParams, prompt: list[int]
    ) -> "RequestGrammar":
        """The grammar state of a new request: its compilation started (or shared)."""
        if params.replay_tokens > len(prompt):
            raise ValueError(
                f"structured_outputs.replay_tokens ({params.replay_tokens}) is longer than the "
                f"prompt ({len(prompt)} tokens)"
            )
        key = params.key()
        with self._lock:
            compilation = self._compiled.get(key)
            failed = compilation is not None and compilation.future.done() and (
                compilation.future.exception() is not None)  # fmt: skip
            if compilation is None or failed:
                compilation = Compilation()
                compilation.future = self._pool.submit(self._compile, params, compilation)
                self._compiled[key] = compilation
                while len(self._compiled) > MAX_COMPILED_FUTURES:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        prior = prompt[len(prompt) - params.replay_tokens :] if params.replay_tokens else []
        return RequestGrammar(compilation, prior, time.monotonic() + self.timeout_s, self.timeout_s)

    def _compile(
        self, params: StructuredOutputParams, compilation: "Compilation"
    ) -> "xgr.CompiledGrammar":
        compiler = self._compiler.result()
        compilation.began = time.monotonic()  # (the wait in the queue and for the compiler over)
        start = time.perf_counter()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else '{"type": "object"}'
                assert schema is not None
                compiled = compiler.compile_grammar(self._json_grammar(schema))
            elif kind == "regex":
                assert params.regex is not None
                compiled = compiler.compile_regex(params.regex)
            elif kind == "structural_tag":
                assert params.structural_tag is not None
                compiled = compiler.compile_structural_tag(params.structural_tag)
            elif kind == "choice":
                assert params.choice is not None
                compiled = compiler.compile_grammar(choice_grammar(params.choice))
            else:
                assert params.grammar is not None
                compiled = compiler.compile_grammar(params.grammar)
        except Exception as e:  # xgrammar's own errors are RuntimeError/ValueError subclasses
            label = {"json": "JSON schema", "json_object": "JSON object", "grammar": "EBNF",
                     "structural_tag": "structural tag"}  # fmt: skip
            raise GrammarError(
                f"the {label.get(kind, kind)} grammar does not compile: {_first_line(e)}"
            ) from None
        seconds = time.perf_counter() - start
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += seconds
        return compiled

    def _json_grammar(self, schema: str) -> str:
        """A JSON schema's grammar, as EBNF. xgrammar's rule for the characters of a string
        with a length bound lets control characters through unescaped (its rule for other
        strings does not), which JSON forbids and strict parsers (Python's, Pydantic's) refuse:
        that one character class is replaced by the other rule's."""
        import xgrammar as xgr

        ws = self.max_whitespace
        grammar = xgr.Grammar.from_json_schema(
            schema, any_whitespace=ws > 0, max_whitespace_cnt=ws or None
        )
        return str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)

    def wait_any(self, grammars: list["RequestGrammar"], timeout_s: float) -> None:
        """Block until one of these grammars is compiled, or ``timeout_s`` passed (an engine
        with nothing else to run waits here instead of spinning)."""
        pending = [g.future for g in grammars if not g.future.done()]
        if pending:
            cf.wait(pending, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    # ---- each step -----------------------------------------------------------------------
    def fill(self, req_ids: list[str], grammars: list["RequestGrammar | None"]) -> GrammarBitmask:
        """The bitmask of one step's constrained rows: each live matcher's next allowed tokens
        (filled by xgrammar's threads); a row whose request ended meanwhile (its token will be
        dropped) or whose grammar has ended allows everything."""
        import xgrammar as xgr

        rows = len(req_ids)
        if self._bits is None or self._bits.shape[0] < rows:
            n = max(rows, self._max_rows)
            words = -(-self._tokenizer_size // 32)
            # pinned where the device is this process's (one rank): the runner's copy to the
            # device then leaves the host at once
            self._bits = torch.zeros(
                (n, -(-self.vocab_size // 32)), dtype=torch.int32, pin_memory=self.pin_memory
            )
            # xgrammar fills rows as wide as the tokenizer's vocabulary; the model's padding
            # ids beyond it stay masked (0)
            narrow = words < self._bits.shape[1]
            self._fill_bits = torch.zeros((n, words), dtype=torch.int32) if narrow else self._bits
            # (xgrammar's "auto", half the cores, took 3-4 ms for 64 rows on a 16-core host;
            # two threads 0.4 ms)
            self._batch = xgr.BatchGrammarMatcher(max_threads=self._threads)
        bits, filled = self._bits[:rows], self._fill_bits[:rows]
        matchers, index = [], []
        for i, grammar in enumerate(grammars):
            matcher = grammar.matcher if grammar is not None else None
            if matcher is None or matcher.is_terminated():
                filled[i].fill_(-1)  # (the padding ids too: the row's token is dropped)
            else:
                matchers.append(matcher)
                index.append(i)
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, self._fill_bits, index)
        if filled is not bits:
            words = filled.shape[1]
            bits[:, :words] = filled
            bits[:, words:] = 0
        return GrammarBitmask(list(req_ids), bits)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarError(ValueError):
    """A grammar that cannot be compiled, took too long, or rejects a request's own tokens."""


@dataclass
class Compilation:
    """A grammar's compilation, shared by the requests that ask for that grammar: its result,
    and when it began (``time.monotonic``; None while it waits for a compile thread)."""

    future: "cf.Future[Any]" = field(default_factory=cf.Future)
    began: float | None = None


class RequestGrammar:
    """One request's grammar: its compilation, then its matcher."""

    def __init__(self, compilation: Compilation, prior: list[int], deadline: float, bound: float):
        self.compilation = compilation
        self.prior = prior  # tokens generated under this grammar elsewhere (at the prompt's end)
        self.deadline = deadline  # the request's arrival + bound
        self.bound = bound
        self.matcher: Any = None
        self.error: str | None = None
        self.error_code = ErrorCode.INVALID_REQUEST  # (with ``error``) whose fault it is

    @property
    def future(self) -> "cf.Future[Any]":
        return self.compilation.future

    def ready(self, output_token_ids: list[int]) -> bool:
        """Whether the request can run: its matcher exists (made now if its grammar has just
        compiled, having accepted ``prior`` and ``output_token_ids``). False with ``error``
        set: it never will."""
        if self.matcher is not None:
            return True
        if self.error is not None:
            return False
        if not self.future.done():  # (bounded: by twice the bound after the request came)
            now, began = time.monotonic(), self.compilation.began
            if began is None and now > self.deadline:  # queued behind other grammars all along
                self.error = (
                    f"the engine's grammar compiler was busy: this grammar's "
                    f"compilation did not start within {self.bound:g} s; retry"
                )
                self.error_code = ErrorCode.OVERLOADED
            elif began is not None and now > max(self.deadline, began + self.bound):
                self.error = f"compiling the grammar took longer than {self.bound:g} s"
            return False
        failure = self.future.exception()
        if failure is not None:
            self.error = str(failure)
            return False
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.future.result())
        for token in [*self.prior, *output_token_ids]:
            if not matcher.accept_token(token):
                self.error = f"token {token}, generated earlier, does not follow the grammar"
                return False
        self.matcher = matcher
        return True

    def accept(self, token: int) -> bool:
        """Advance the matcher by a sampled token; False: the grammar does not allow it."""
        assert self.matcher is not None
        return bool(self.matcher.accept_token(token))

    @property
    def completed(self) -> bool:
        """The text so far is a whole sentence of the grammar (its stop token may come)."""
        return self.matcher is not None and bool(self.matcher.is_completed())

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing may follow."""
        return self.matcher is not None and bool(self.matcher.is_terminated())


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON's string escapes are the grammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(e: BaseException) -> str:
    """xgrammar's message without its time and source location."""
    text = str(e).strip() or type(e).__name__
    return _LOCATION.sub("", text.splitlines()[0])[:500]
