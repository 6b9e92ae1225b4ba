"""
Structured outputs: a JSON schema, a regex, a list of choices or a Lark grammar turned into a
per-token mask, so that every sampled token keeps the output inside the grammar.

Owns the compilation of each kind of StructuredOutputsParams (sampler.py) into an
llguidance grammar, one Grammar (an llguidance matcher) per completion that advances with every
token, and the batched mask: one bitmask row per constrained completion (32 tokens per int32 word),
applied in place to just those rows of the logits by csrc/grammar_mask_cpu.cpp on the CPU (a
plain-PyTorch reference elsewhere). Does not sample (sampler.py) or decide when a request stops
(engine.py ends a completion at EOS or once its grammar can take nothing more).

Why llguidance rather than xgrammar: both are maintained and used by vLLM; llguidance is one
Rust wheel with no Python dependencies, while xgrammar pulls in transformers and triton (about
a gigabyte here) for a runtime that needs neither. llguidance builds its token trie from our
tokenizer's bytes and fills the masks of a batch in its own threads (bench_structured.py measures the cost).

Compiling is slow (a 5,000-choice list: ~0.4 s) and must never stall a step: GrammarCompiler keeps
compiled grammars in a cache keyed by the request's schema (each completion gets a cheap copy), and
`prepare` compiles into it on a worker thread (llguidance releases the GIL while it compiles), so
the engine core admits a structured request only once its grammar is ready.
"""
from __future__ import annotations      # StructuredOutputsParams is sampler.py's: named, not imported

import collections
import concurrent.futures
import json
import os
import threading
from typing import TYPE_CHECKING

import torch

import extensions
from sequence import InvalidRequest, clipped, need

if TYPE_CHECKING:
    from sampler import StructuredOutputsParams

try:
    import llguidance      # not llguidance.torch: its import runs torch.compile, ~5 s per process
except ImportError:   # only structured requests need it; they get a clear error (see validate)
    llguidance = None


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of whichever kind of StructuredOutputsParams is set."""
    M = llguidance.LLMatcher
    options = {"whitespace_flexible": not params.disable_any_whitespace}
    try:
        if params.json is not None:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            return M.grammar_from_json_schema(schema, defaults=options)
        if params.json_object:
            return M.grammar_from_json_schema({"type": "object"}, defaults=options)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest("structured_outputs", f"structured_outputs json is not a JSON schema: "
                                                          f"{exc}") from None
    if params.regex is not None:
        need(isinstance(params.regex, str), "structured_outputs", "a regex string", params.regex)
        return M.grammar_from_regex(params.regex)
    if params.choice is not None:
        need(isinstance(params.choice, list) and params.choice and all(isinstance(c, str) and c
                                                                           for c in params.choice),
                    "structured_outputs", "a non-empty list of non-empty strings as choice", params.choice)
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    need(isinstance(params.grammar, str), "structured_outputs", "a Lark grammar string", params.grammar)
    return M.grammar_from_lark(params.grammar)


class TokenBytes:
    """What llguidance reads from a tokenizer: every token's bytes, EOS and how to encode text."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        n = min(vocab_size, tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]

    def __call__(self, text: bytes) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8", errors="replace"))


class GrammarCompiler:
    """One per engine: the llguidance tokenizer (built once, ~0.5 s, at the first compile), a cache
    of compiled grammars by schema (a compile error is cached too), and a worker thread that fills it.
    `compile` gives each completion its own matcher: a copy of the cached one (microseconds)."""
    CACHE_SIZE = 64

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltokenizer = None
        self.lock = threading.Lock()           # the worker and the engine's thread both fill the cache
        self.cache: collections.OrderedDict[str, object] = collections.OrderedDict()   # key -> matcher or error
        self.worker = None

    @property
    def lltokenizer(self):
        with self.lock:
            if self._lltokenizer is None:
                wrapper = llguidance.TokenizerWrapper(TokenBytes(self.tokenizer, self.vocab_size))
                self._lltokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size)
            return self._lltokenizer

    def prepare(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """Compile into the cache on the worker thread; the future is done when `compile` is instant."""
        if params.cache_key() in self.cache:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler",
                                                                initializer=_lowest_priority)
        return self.worker.submit(self._compiled, params)

    def compile(self, params: StructuredOutputsParams) -> "Grammar":
        """This completion's own matcher; raises InvalidRequest('structured_outputs') if it does not compile."""
        compiled = self._compiled(params)
        if isinstance(compiled, InvalidRequest):
            raise InvalidRequest(compiled.field, str(compiled), compiled.code)
        return Grammar(compiled.deep_copy())

    def _compiled(self, params: StructuredOutputsParams):
        key = params.cache_key()
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        try:
            matcher = llguidance.LLMatcher(self.lltokenizer, to_grammar(params))
            compiled = matcher if not matcher.is_error() else InvalidRequest(
                "structured_outputs", f"structured_outputs is not a valid {params.kinds()[0]}: "
                                      f"{clipped(matcher.get_error())}")
        except InvalidRequest as exc:
            compiled = exc
        except Exception as exc:            # llguidance refuses some inputs by raising
            compiled = InvalidRequest("structured_outputs", f"structured_outputs is not a valid "
                                                                   f"{params.kinds()[0]}: {clipped(str(exc))}")
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > self.CACHE_SIZE:
                self.cache.popitem(last=False)
        return compiled


def _lowest_priority():
    """The compiler thread takes only the CPU the engine leaves: on 2 cores a compile beside a step
    otherwise stalls the step's OpenMP threads (Linux: a thread id is a process id to setpriority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass                                # elsewhere it just runs at the engine's priority


class Grammar:
    """One completion's position in its grammar; `advance` after every token it samples."""

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token: int):
        # the mask allowed only tokens the grammar accepts, and the processors after it never
        # leave a row nothing (min_tokens keeps the end ids of a row the grammar allows only those)
        self.matcher.consume_token(token)

    @property
    def is_finished(self) -> bool:
        return self.matcher.is_stopped()


_executor = None


def apply_grammar_masks(logits, grammars: list):
    """logits: [num_rows, vocab]. Rows with a grammar get -inf wherever it forbids a token;
    rows without one are not touched, and a batch without any costs one list scan."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    bitmask = fill_bitmasks([grammars[i] for i in rows], logits.shape[1])       # [g, words] int32
    apply_token_bitmask_(logits, bitmask, rows)


def fill_bitmasks(grammars: list, vocab: int, parallel: bool | None = None, out=None):
    """Every grammar's next-token bitmask, one row each: bit t % 32 of word t // 32 is set iff
    token t is allowed. llguidance computes each row without the GIL. parallel (default: with 4
    or more CPUs) hands all rows to llguidance's thread pool in one call; its pool has 80% of the
    CPUs, so on 2 CPUs that is one worker and only adds a hand-off, and on a 2-core machine the
    calling thread filled 32 JSON-schema rows in ~1.2 ms against ~1.4 ms through the pool. out: a
    contiguous [rows, words] int32 host tensor to fill (a slice of the packed upload), else a new one."""
    bitmask = torch.empty(len(grammars), (vocab + 31) // 32, dtype=torch.int32) if out is None else out   # all written
    if parallel is None:
        parallel = (os.cpu_count() or 1) >= 4
    row_bytes = bitmask.shape[1] * 4
    if not parallel:
        for j, g in enumerate(grammars):
            g.matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), row_bytes)
        return bitmask
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(g.matcher, j) for j, g in enumerate(grammars)], bitmask.data_ptr(),
                                      row_bytes, len(grammars))
    return bitmask


def apply_token_bitmask_(logits, bitmask, rows: list[int]):
    """logits[rows[j], t] = -inf wherever bit t of bitmask[j] is clear. On the CPU one pass of
    csrc/grammar_mask_cpu.cpp writes only the banned logits in place; the reference expands the
    bitmask to [g, vocab] bools and gathers and scatters the rows (bench_structured times both:
    0.3-0.5 ms against 5-15 ms at batch 32 here)."""
    if logits.device.type == "cpu" and _grammar_cpu_built():
        torch.ops.nanoserve_grammar.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
    else:
        apply_token_bitmask_reference(logits, bitmask, rows)


def apply_token_bitmask_reference(logits, bitmask, rows: list[int]):
    """Plain PyTorch: unpack every bit, then mask the chosen rows (on any device)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = bitmask.to(logits.device, non_blocking=True)                         # [g, words]
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool()                       # [g, words, 32]
    allowed = allowed.view(len(rows), -1)[:, :vocab]                            # [g, vocab]
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask_rows_(logits, bitmask, rows):
    """apply_token_bitmask_ with bitmask [g, words] int32 and rows [g] int64 already on the logits'
    device (the packed upload's views): no copy and no host list on the way."""
    if logits.device.type == "cpu" and _grammar_cpu_built():
        torch.ops.nanoserve_grammar.apply_token_bitmask_(logits, bitmask, rows)
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :logits.shape[1]]   # [g, vocab]
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))


def _grammar_cpu_built() -> bool:
    return extensions.try_load("grammar_cpu", "grammar masks are applied with plain PyTorch ops (slower)")
