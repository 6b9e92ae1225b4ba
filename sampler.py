"""
Sampling: the per-request knobs (SamplingParams, vLLM's names and defaults), the state a
completion carries between steps (SamplingState: token counts, its random stream, its grammar),
and one vectorized function that turns a batch of logits into next tokens.

Owns: validation of every sampling field (an InvalidRequest that names the field and the
allowed range); in this order, as vLLM applies them: the grammar mask (structured_output.py
compiles it), allowed_token_ids and bad_words, min_tokens, logit_bias, repetition / frequency / presence penalties, then
temperature, top-k / top-p / min-p and the draw; per-request seeds; logprobs.
Does not touch sequences or stop conditions: the engine applies those to what this returns.
Each processor runs only on the rows that use it, so a batch of plain requests pays nothing.

Why inverse-CDF with one uniform per row: the cumulative mass of exp(logits/T) searched at
u * total draws exactly from softmax(logits/T), costs one exp and one add per logit (block sums,
then a cumsum of one block: see inverse_cdf), and takes a single random number per row. A seeded row draws that number from its own generator,
so it samples the same token whatever else is in the batch; unseeded rows share one call.
(Drawing Exp(1) noise for every logit, as the exponential race does, cost more than the model.)
"""
import dataclasses
import functools
import importlib.util
import json
import math
from dataclasses import dataclass

import torch

from extensions import fused_ops_available
from sequence import InvalidRequest, need

MAX_LOGPROBS = 20
MAX_CHOICES = 1999     # llguidance's Earley parser takes at most 2000 items in one row


@dataclass
class StructuredOutputsParams:
    """Exactly one of these constrains the output (as in vLLM 0.32's SamplingParams.structured_outputs)."""
    json: str | dict | None = None        # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None            # a Lark grammar (llguidance's dialect)
    json_object: bool | None = None       # any JSON object
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (shorter outputs)

    def validate(self):
        """Raise InvalidRequest('structured_outputs', ...) unless exactly one kind is set. Whether it
        compiles is GrammarCompiler's to say (off the engine's loop), under the same field name."""
        need(len(self.kinds()) == 1, "structured_outputs", "exactly one of json, regex, choice, grammar, "
                    "json_object", self.kinds())
        if importlib.util.find_spec("llguidance") is None:       # found, not imported: structured_output.py loads it
            raise InvalidRequest("structured_outputs", "structured outputs need the llguidance package "
                                                       "(pip install llguidance)")
        need(not isinstance(self.choice, list) or len(self.choice) <= MAX_CHOICES, "structured_outputs",
                    f"a choice list of at most {MAX_CHOICES} entries (llguidance's parser stops past that)",
                    f"{len(self.choice or ())} entries")

    def kinds(self) -> list[str]:
        return [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None]

    def cache_key(self) -> str:
        """The same schema, however it was written, compiles once. Computed once per request: it is
        as long as the schema."""
        if "_key" not in self.__dict__:
            fields = [getattr(self, f.name) for f in dataclasses.fields(self)]
            self.__dict__["_key"] = json.dumps(fields, sort_keys=True, default=repr)
        return self.__dict__["_key"]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0                  # EOS and stop_token_ids are masked until this many are out
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0        # OpenAI's additive rules, over output tokens only
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0      # CTRL's multiplicative rule, over prompt and output tokens
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None          # return the top-N logprobs of every sampled token
    prompt_logprobs: int | None = None   # and of every prompt token (top-N plus the token itself)
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None   # only these may be sampled
    bad_words: list[str] | None = None           # never completed (each as it tokenizes, with and without a space)
    include_stop_str_in_output: bool = False     # keep the stop string (or stop token's text) that ended the output
    skip_special_tokens: bool = True             # special tokens leave no text
    spaces_between_special_tokens: bool = True   # byte-level BPE puts none either way, as vLLM's fast detokenizer

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    # Built once per request (and shared by its n samples), never per step: a step's cost must
    # not grow with the size of a request's parameters.
    @functools.cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [b] int64, biases [b] float32) of logit_bias."""
        bias = self.logit_bias or {}
        return torch.tensor(list(bias), dtype=torch.int64), torch.tensor(list(bias.values()), dtype=torch.float32)

    @functools.cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)

    @functools.cached_property
    def stop_hold_chars(self) -> int:
        """Characters of streamed text held back because they could still begin a stop string."""
        return max((len(s) - 1 for s in self.stop), default=0)

    @functools.cached_property
    def allowed_token_ids_tensor(self) -> torch.Tensor:
        """[a] int64 ids of allowed_token_ids."""
        return torch.tensor(sorted(set(self.allowed_token_ids or ())), dtype=torch.int64)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self, vocab_size: int | None = None):
        def check(ok, field, allowed):
            need(ok, field, allowed, getattr(self, field))

        def number(x):   # finite: Infinity and NaN parse from JSON but mean nothing here
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        vocab = vocab_size or 2**31
        check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1")
        check(number(self.temperature) and self.temperature >= 0, "temperature", ">= 0")
        check(number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        check(isinstance(self.top_k, int) and -1 <= self.top_k < 2**31, "top_k",
             "-1 (off), 0 (off) or a positive integer below 2**31")
        check(number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"an integer in [0, max_tokens={self.max_tokens}]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "an integer or None")
        check(number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        check(number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        check(number(self.repetition_penalty) and 0 < self.repetition_penalty < float("inf"), "repetition_penalty",
             "a finite number > 0 (1 is off)")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            isinstance(t, int) and 0 <= t < vocab for t in self.logit_bias)), "logit_bias",
            f"a map from token ids in [0, {vocab}) to biases")
        check(self.logit_bias is None or all(number(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
             "logit_bias", "a map whose biases are in [-100, 100]")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), field,
                 f"an integer in [0, {MAX_LOGPROBS}] or None")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "a non-empty string or a list of them")
        check(all(isinstance(t, int) and 0 <= t < vocab for t in self.stop_token_ids),
             "stop_token_ids", f"token ids in [0, {vocab})")
        check(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
             and all(isinstance(t, int) and 0 <= t < vocab for t in self.allowed_token_ids)), "allowed_token_ids",
             f"a non-empty list of token ids in [0, {vocab})")
        check(self.bad_words is None or (isinstance(self.bad_words, list) and all(
            isinstance(w, str) and w.strip() for w in self.bad_words)), "bad_words", "a list of non-blank strings")
        if self.structured_outputs is not None:
            check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                 "a StructuredOutputsParams")
            self.structured_outputs.validate()


def bad_words_token_ids(words: list[str] | None, encode) -> list[list[int]]:
    """Each bad word as the token sequences that would write it, as vLLM builds them: the word
    alone (at the start of a text) and with a leading space (mid-text), the latter only where the
    space makes a different first token of the same length. encode: text -> ids, no special tokens."""
    out = []
    for word in words or ():
        alone = encode(word.lstrip())
        out.append(alone)
        spaced = encode(" " + word.lstrip())
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


def make_generator(seed: int | None, index: int = 0):
    """A private random stream for a seeded request; the i-th of n samples gets its own."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)


class SamplingState:
    """What the sampler remembers about one completion between steps. Kept incrementally by
    `append` (one scalar update per token), never recounted; tensors exist only when used."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int,
                 generator: torch.Generator | None, end_ids: set[int], grammar=None,
                 bad_words_token_ids: list[list[int]] | None = None):
        self.params, self.generator, self.grammar = params, generator, grammar
        self.num_output_tokens = 0
        self.slot = None                 # its row in sampling_slots.py's device tensors, once it joins
        # bad words: their token sequences, and the output so far to match their heads against
        self.bad_words_token_ids = bad_words_token_ids or []
        self.output_token_ids = [] if self.bad_words_token_ids else None
        self.output_counts = self.in_prompt = None
        if params.uses_penalties:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.int32)          # [vocab]
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)               # [vocab]
            self.in_prompt[torch.tensor(prompt_ids)] = True
        # masked until min_tokens: the engine's EOS ids (unless ignored) and the request's stop ids
        self.min_tokens_banned = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else end_ids))

    def append(self, token: int):
        self.num_output_tokens += 1
        if self.output_token_ids is not None:
            self.output_token_ids.append(token)
        if self.output_counts is not None:
            self.output_counts[token] += 1
        if self.grammar is not None:
            self.grammar.advance(token)


def sample(logits, states: list[SamplingState], generator: torch.Generator | None = None):
    """logits: [num_seqs, vocab] float32, one row per completion (modified in place).
    generator: the engine's stream for unseeded rows. Returns (tokens list[int],
    logprobs list[dict[int, float] | None]): logprobs are the model's, before any processing."""
    return sample_on_device(logits, states, generator).read()


def sample_on_device(logits, states: list[SamplingState], generator: torch.Generator | None = None) -> "Sampled":
    """sample() up to its one read from the device: the tokens stay there (async_engine.py feeds
    them to the next step's inputs) and their copy to the host starts without waiting."""
    params = [s.params for s in states]
    want = [p.logprobs for p in params]
    raw_logprobs = logits.log_softmax(dim=-1) if any(w is not None for w in want) else None   # [num_seqs, vocab]
    if any(s.grammar is not None for s in states):
        from structured_output import apply_grammar_masks   # llguidance loads with the first structured request
        apply_grammar_masks(logits, [s.grammar for s in states])
    apply_allowed_and_bad_words(logits, states)
    apply_min_tokens(logits, states)
    apply_logit_bias(logits, params)
    apply_penalties(logits, states)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows and len(rows) == len(states):                              # all sample: no copy, no argmax
        tokens = draw(logits, states, generator)                       # [num_seqs]
    else:
        tokens = greedy(logits)                                        # [num_seqs] greedy rows
        if rows:
            tokens[rows] = draw(logits[rows], [states[i] for i in rows], generator)
    packed = None if raw_logprobs is None else pack_logprobs(raw_logprobs, tokens, want)
    return Sampled(tokens, packed, want)


class Sampled:
    """A step's sampled tokens on the device [num_seqs] (and packed logprobs when asked), on their
    way to the host in one copy: started at construction (non_blocking into pinned memory on a
    GPU, with an event), read by read()."""
    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor | None, want: list[int | None]):
        self.tokens, self.want = tokens, want
        out = tokens if packed is None else packed                     # [num_seqs] or [num_seqs, 2 + 2 * top_n]
        self.event = None
        if out.device.type == "cuda":
            self.host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True).copy_(out, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=True)   # also ends the step's device span
            self.event.record()
        else:
            self.host = out.cpu()

    def read(self):
        """(tokens list[int], logprobs per row as top_logprobs gives them, or None): the step's one
        read from the device, which waits for it."""
        if self.event is not None:
            self.event.synchronize()
        if self.host.dim() == 1:
            return self.host.tolist(), [None] * len(self.want)
        return unpack_logprobs(self.host.tolist(), self.want)


def pack_logprobs(logprobs, tokens, want: list[int | None]) -> torch.Tensor:
    """float64 [num_rows, 2 + 2 * top_n]: each row's token, its logprob and the top max(want)
    (value, id) pairs, so one copy brings them all (ids are exact in float64)."""
    top_n = max(max(w or 0 for w in want if w is not None), 1)
    top_vals, top_ids = logprobs.topk(top_n, dim=-1)                  # [num_rows, top_n]
    chosen = logprobs.gather(1, tokens.unsqueeze(1))                   # [num_rows, 1]
    return torch.cat([tokens.unsqueeze(1).double(), chosen.double(), top_vals.double(), top_ids.double()], dim=1)


def unpack_logprobs(rows: list[list[float]], want: list[int | None]):
    """pack_logprobs' rows, read -> (tokens, logprobs per row as top_logprobs gives them)."""
    top_n = (len(rows[0]) - 2) // 2 if rows else 0
    token_list, out = [int(r[0]) for r in rows], []
    for r, tok, w in zip(rows, token_list, want):
        if w is None:
            out.append(None)
            continue
        d = dict(zip((int(i) for i in r[2 + top_n:2 + top_n + w]), r[2:2 + w]))
        d[tok] = r[1]
        out.append(d)
    return token_list, out


def csrc_ops(x) -> bool:
    """Whether csrc/fused_cpu.cpp's sampling ops take x: float32 rows on a CPU, the library built."""
    return x.dtype == torch.float32 and x.stride(-1) == 1 and fused_ops_available(x.device, x.dtype)


def greedy(logits):
    """torch.argmax(logits, -1) (first index of the maximum). On CPU csrc/fused_cpu.cpp's, which
    vectorizes: torch's is a scalar loop, 3 ms at [64, 49152] on 2 cores against 0.23 ms."""
    if csrc_ops(logits):
        return torch.ops.nanoserve_fused.argmax(logits)
    return logits.argmax(dim=-1)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`: on a GPU one copy from pinned memory that does not wait."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":                                          # meta (the tests' recording device)
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def row_filters(params, vocab: int) -> torch.Tensor:
    """float32 [k, 3]: each row's top_k (vocab where it filters nothing), top_p, min_p."""
    return torch.tensor([[p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p] for p in params],
                        dtype=torch.float32)


def draw(x, states, generator):
    """x: [k, vocab] logits of rows that sample (overwritten). Temperature, filters, then inverse CDF."""
    params = [s.params for s in states]
    # every per-row number (1/T, filters, the uniform) goes up in one copy
    host = torch.cat([1 / torch.tensor([[p.temperature] for p in params], dtype=torch.float32),
                      row_filters(params, x.shape[1]), uniforms(states, generator).unsqueeze(1)], dim=1)   # [k, 5]
    return draw_rows(x, params, upload(host, x.device))


def draw_rows(x, params, rows):
    """draw() with its per-row numbers already on x's device: rows [k, 5] float32 = 1/T, top_k (vocab:
    off), top_p, min_p, the uniform. params decide on the host which steps run (no device read)."""
    if x.is_cuda and hasattr(torch.ops.nanoserve_cuda, "sample"):    # built with the CUDA attention backend
        return torch.ops.nanoserve_cuda.sample(x.contiguous(), rows)   # csrc/sampling_cuda.cu: one launch, no sort
    inv_temp, filters, u = rows[:, :1], rows[:, 1:4], rows[:, 4]                                   # [k, 1], [k, 3], [k]
    scale_later = any(p.temperature != 1 for p in params)             # decided on the host: no device sync
    if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        x = apply_top_k_top_p_min_p(x.mul_(inv_temp), params, filters)   # [k, vocab]
        scale_later = False
    # exp((x - max) / T), in place (max(x / T) = max(x) / T); masked -> 0
    if csrc_ops(x):                                                    # torch.exp is slow below -87
        torch.ops.nanoserve_fused.exp_sub_max_(x, (inv_temp if scale_later else torch.ones_like(inv_temp)).view(-1))
    else:
        x = x.sub_(x.amax(dim=-1, keepdim=True))                       # [k, vocab]
        if scale_later:
            x = x.mul_(inv_temp)
        x = x.exp_()
    return inverse_cdf(x, u)


def inverse_cdf(probs, u, block=128):
    """probs: [k, vocab] unnormalized, u: [k] in [0, 1). The token where each row's cumulative mass
    first passes u * total. Two levels, because a full-vocabulary cumsum is a slow sequential
    scan: block sums (a fast reduction), the cumsum of those, then one block's own cumsum."""
    k, vocab = probs.shape
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, block - vocab % block))   # zero mass
    blocks = probs.view(k, -1, block)                                  # [k, num_blocks, block]
    block_cdf = blocks.sum(dim=-1).cumsum_(dim=-1)                     # [k, num_blocks]
    total = block_cdf[:, -1:]                                          # [k, 1]
    target = torch.minimum(u.unsqueeze(1) * total, total * (1 - 2**-20))   # strictly inside the mass
    b = torch.searchsorted(block_cdf, target, right=True)              # [k, 1] first block past target
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp_(min=0)), 0.0)
    rows = torch.arange(k, device=probs.device) * blocks.shape[1] + b.squeeze(1)   # [k] row of the chosen block
    inner_cdf = blocks.view(-1, block).index_select(0, rows).cumsum_(dim=-1)   # [k, block]
    rest = torch.minimum(target - before, inner_cdf[:, -1:] * (1 - 2**-20))
    j = torch.searchsorted(inner_cdf, rest, right=True)                # [k, 1] lands on a token with mass
    return (b * block + j).squeeze(1)


def uniforms(states, generator):
    """One U[0, 1) per row: a seeded row from its own stream, the rest in one call on the shared one.
    Drawn on the CPU whatever the device, so a seed gives the same numbers on a GPU."""
    u = torch.empty(len(states))
    shared = [i for i, s in enumerate(states) if s.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared), generator=generator)
    seeded = [i for i, s in enumerate(states) if s.generator is not None]
    if seeded:
        u[seeded] = torch.cat([torch.rand(1, generator=states[i].generator) for i in seeded])
    return u


def mask_below_(x, floor):
    """x [k, vocab] = -inf where below its row's floor [k, 1], in place."""
    if csrc_ops(x):
        torch.ops.nanoserve_fused.mask_below_(x, floor.reshape(-1).contiguous())
        return x
    return x.masked_fill_(x < floor, float("-inf"))


def apply_top_k_top_p_min_p(x, params, filters=None):
    """Mask filtered-out logits to -inf in x (in place, or a copy it returns), in vLLM's order:
    top-k, top-p over what top-k kept, min-p. No row pays for a filter it did not ask for, and
    nothing sorts the whole vocabulary on CPU. filters: row_filters already on x's device."""
    vocab = x.shape[1]
    # decided on the params (no device sync, no tensor op); the math uses device copies
    width = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
    any_top_p, any_min_p = any(p.top_p < 1 for p in params), any(p.min_p > 0 for p in params)
    dev = upload(row_filters(params, vocab), x.device) if filters is None else filters   # [k, 3]
    top_k, top_p, min_p = dev[:, 0].long(), dev[:, 1].contiguous(), dev[:, 2]
    if width:
        # each row's k-th best logit is its floor (ties with it stay, as in vLLM); rows without
        # top_k get -inf, so nothing of theirs goes. On CPU counted in csrc (same cost at any k),
        # elsewhere topk to the widest k asked.
        if csrc_ops(x):
            kth = torch.ops.nanoserve_fused.kth_largest(x, top_k).unsqueeze(1)                      # [k, 1]
        else:
            kth = x.topk(width, dim=-1).values.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
            kth = kth.masked_fill((top_k == vocab).unsqueeze(1), float("-inf"))
        x = mask_below_(x, kth)
    if any_top_p:
        if csrc_ops(x):
            torch.ops.nanoserve_fused.top_p_(x, top_p)                 # csrc/fused_cpu.cpp: no sort
        else:
            x = top_p_reference(x, top_p)
    if any_min_p:
        # p >= min_p * p_max  <=>  logit >= max logit + log(min_p): no softmax needed
        floor = x.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)     # amax: 20x faster than max on CPU
        x = mask_below_(x, floor)
    return x


def top_p_reference(x, top_p):
    """x: [k, vocab] logits, top_p: [k]. Sorted by logit, a token stays while the mass before it is
    below top_p (so the token that crosses it stays too). Rows with top_p = 1 are unchanged."""
    sorted_x, order = x.sort(dim=-1, descending=True)                  # [k, vocab]
    sorted_probs = sorted_x.softmax(dim=-1)
    # a top_p = 1 row would lose its tail where the float cumsum rounds past 1
    drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    return torch.full_like(x, float("-inf")).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))


def apply_allowed_and_bad_words(logits, states):
    """allowed_token_ids: every other id goes to -inf. bad_words: a word's last token goes to -inf
    where the output already ends with the tokens before it (a one-token word: always)."""
    for i in [i for i, s in enumerate(states) if s.params.allowed_token_ids or s.bad_words_token_ids]:
        s = states[i]
        if s.params.allowed_token_ids:
            ids = s.params.allowed_token_ids_tensor.to(logits.device)
            kept = logits[i, ids]                                      # [a]
            logits[i].fill_(float("-inf")).index_copy_(0, ids, kept)
        out = s.output_token_ids or []
        banned = [word[-1] for word in s.bad_words_token_ids
                  if len(word) == 1 or (len(out) >= len(word) - 1 and out[len(out) - len(word) + 1:] == word[:-1])]
        if banned:
            logits[i, banned] = float("-inf")


def apply_min_tokens(logits, states):
    """Rows still short of min_tokens cannot end: their EOS and stop ids go to -inf (as vLLM's
    MinTokensLogitsProcessor does, after the grammar's mask). A grammar row whose mask left nothing
    but those ids keeps them: the grammar is the harder rule, and the engine ends the row there."""
    rows, cols = [], []
    for i, s in enumerate(states):
        if s.num_output_tokens < s.params.min_tokens and not (s.grammar is not None and only_ends_allowed(logits[i], s)):
            rows += [i] * len(s.min_tokens_banned)
            cols += s.min_tokens_banned
    if rows:
        logits[rows, cols] = float("-inf")


def only_ends_allowed(row, state) -> bool:
    """row: [vocab] logits after the grammar mask. True when every token it allows is an end id.
    One pass over the row, only for grammar rows short of min_tokens."""
    banned = torch.tensor(state.min_tokens_banned, dtype=torch.int64)
    return int(torch.isfinite(row).sum()) == int(torch.isfinite(row[banned]).sum())


def apply_logit_bias(logits, params):
    """Each biased row adds its request's (ids, biases), tensors built once per request."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids, biases = p.logit_bias_tensors
            logits[i].index_add_(0, ids.to(logits.device, non_blocking=True),
                                 biases.to(logits.device, logits.dtype, non_blocking=True))


def apply_penalties(logits, states):
    """vLLM's order and rules, on the rows that have any penalty:
    repetition (prompt or output tokens): positive logits / r, negative logits * r;
    then frequency and presence (output tokens only): logit -= f * count + p * (count > 0)."""
    rows = [i for i, s in enumerate(states) if s.output_counts is not None]
    if not rows:
        return
    dev = logits.device          # the counts live on the CPU (one scalar add per token): one copy per step
    counts = torch.stack([states[i].output_counts for i in rows]).to(dev)   # [r, vocab] int32
    seen = torch.stack([states[i].in_prompt for i in rows]).to(dev)        # [r, vocab]
    params = [states[i].params for i in rows]
    rep, freq, pres = (torch.tensor([[getattr(p, name)] for p in params], dtype=torch.float32, device=dev)   # [r, 1] each
                       for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    logits[rows] = penalize(logits[rows], counts, seen, rep, freq, pres)


def penalize(x, counts, in_prompt, rep, freq, pres):
    """x: [r, vocab] logits, counts: [r, vocab] output counts, in_prompt: [r, vocab] bool; rep, freq,
    pres: [r, 1]. A row with rep 1, freq 0 and pres 0 comes back bit for bit."""
    seen = in_prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - (freq * counts + pres * (counts > 0))


def top_logprobs(logprobs, tokens: list[int], want: list[int | None]) -> list[dict[int, float] | None]:
    """logprobs: [num_rows, vocab]. For row i: its top want[i] entries plus tokens[i]'s own."""
    top_n = max(w or 0 for w in want if w is not None)
    top_vals, top_ids = logprobs.topk(max(top_n, 1), dim=-1)           # [num_rows, top_n]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        d = dict(zip(top_ids[i][:w], top_vals[i][:w]))
        d[tokens[i]] = chosen[i]
        out.append(d)
    return out
