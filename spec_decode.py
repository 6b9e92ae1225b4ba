"""
Speculative decoding: cheap proposals of the next k tokens, and the exact acceptance rule that
lets the target model verify all of them in one forward pass without changing what it samples
(Leviathan et al., 2023; Chen et al., 2023).

Owns SpeculativeConfig (vLLM's names, validated at the edge), the n-gram (prompt-lookup)
proposer and its per-sequence token history, the arithmetic of rolling KV slots back,
per-completion acceptance tracking, the online measure of whether a verify step pays
(StepCosts), and Speculator, the engine's hooks over all of it. Does not schedule, allocate
blocks, run a model or append tokens: the engine (Engine.postprocess) and scheduler
(Scheduler._fit_drafts, accept_drafts) call in here and act on what comes back; the draft model
lives in draft_model.py, one-pass verification (each drafted position processed after its drafted
prefix, rejection sampling) in verify.py.

How the engine uses it, one step (only decode rows speculate; a row with no drafts is a plain row):
 1. propose   After a step's tokens are appended, for each running decode completion that
              speculation_enabled(config, num_running), StepCosts (a verify step at this many
              rows has paid, measured) and its AcceptanceTracker allow:
              NgramProposer.propose(seq_ids, token_ids, max_drafts), max_drafts from the tracker's
              num_drafts (a draft only while rate^j pays for its row) and draft_budget (never past
              max_tokens or max_model_len), then trim_drafts (drafts its grammar
              forbids go before they cost a forward; nothing is drafted past a stop id). Drafts
              live beside the sequence (seq.spec_token_ids), never in token_ids, so neither
              detokenizer, stop checks nor prefix-cache hashes see them; preemption drops them.
              n > 1: each fork is its own sequence (its own key, history and drafts).
 2. schedule  A row with k drafts costs 1 + k tokens of the budget and allocate_slots(seq, 1 + k).
              If the budget or the pool is short, drop the drafts (k = 0): drafts never preempt.
 3. forward   input ids token_ids[num_computed:] + drafts; positions and slots as for any
              multi-token query; logits at all 1 + k positions of each speculating row, rows in
              batch order: logits [T, vocab], T = sum(k_i + 1). On a GPU a step of decode rows
              pads each to 1 + k tokens and replays a captured verify graph (model_runner.py).
 4. accept    verify(logits, drafts, states, generator) -> SpecOutput (verify.py, one pass, one
              read back): per row the emitted tokens
              (accepted drafts + one target token) and, where asked, their logprobs (the model's,
              as sampler.sample gives them). Position j of a row is processed as plain decoding
              would after emitting drafts[:j]: grammar state, min_tokens count, penalty counts.
 5. rollback  finish_step counts only a row's non-draft tokens in num_computed_tokens (so its
              cache_full_blocks never sees a draft); after acceptance num_computed_tokens +=
              num_accepted, and kv_cache.rollback_num_blocks(...) tail blocks are released (allocated this
              step, refcount 1, never registered). Rejected drafts' slots in kept blocks lie past
              num_computed_tokens: attention never reads them, the next tokens overwrite them.
              Blocks that accepted drafts filled are registered by the next finish_step, once
              their tokens are in token_ids: a block is cached only when full of computed,
              accepted tokens. Then append the emitted tokens one by one (EOS, stop strings and
              max_tokens inside the run end it there; the rest is dropped); tracker.record and
              stats.observe.
Seeds: a seeded row draws every random number from its own generator, so its tokens do not
depend on the batch; verify.py leaves the generator where plain decoding would after the emitted
tokens, so with n-gram drafts a seeded request gives the tokens it gives without speculation (but
for a token whose uniform sits within float rounding of a CDF edge: the verification forward's
logits may differ from a one-token step's in the last bits). A draft model draws its drafts from
the row's generator too.
"""
import os
import time
from dataclasses import dataclass, field, fields

import numpy as np
import torch

import sampler
from sequence import need
from verify import SpecOutput, verify   # noqa: F401  (one-pass verification: verify.py)

MAX_SPECULATIVE_TOKENS = 16      # more drafts than this are almost never all accepted, yet each is verified
MAX_PROMPT_LOOKUP = 64


# ---------------------------------------------------------------------------------------- config
@dataclass
class SpeculativeConfig:
    """LLM(speculative_config={...}) and serve.py's --speculative-config, in vLLM's names."""
    method: str = "ngram"                     # ngram | draft_model
    num_speculative_tokens: int = 4           # k: tokens drafted per step per row
    prompt_lookup_min: int | None = None      # ngram: shortest suffix that may match (vLLM: = max if unset)
    prompt_lookup_max: int | None = None      # ngram: longest suffix tried (vLLM: = min if unset; both unset: 5)
    model: str | None = None                  # draft_model: a checkpoint dir or .gguf with the target's tokenizer
    disable_by_batch_size: int | None = None  # no speculation in a step with at least this many running rows
    min_acceptance_rate: float = 0.2          # below it a completion pauses drafting (k = 4 at 0.2: ~1.25 tokens a step)
    adaptive: bool = True                     # measure verify steps against plain ones; speculate only where they pay

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        """Validate a user's dict; InvalidRequest names the field (speculative_config.<name>)."""
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            d = {f.name: getattr(d, f.name) for f in fields(cls)}
        need(isinstance(d, dict), "speculative_config", "a dict (JSON object)", d)
        known = {f.name for f in fields(cls)}
        for key in d:
            need(key in known, f"speculative_config.{key}", f"one of {sorted(known)}", key)
        config = cls(**d)
        config.validate()
        return config

    def validate(self):
        def check(ok, name, allowed):
            need(ok, f"speculative_config.{name}", allowed, getattr(self, name))

        def integer(x):
            return isinstance(x, int) and not isinstance(x, bool)
        check(self.method in ("ngram", "draft_model"), "method", "'ngram' or 'draft_model'")
        check(integer(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             "num_speculative_tokens", f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        check(self.disable_by_batch_size is None or (integer(self.disable_by_batch_size)
                                                    and self.disable_by_batch_size >= 2),
             "disable_by_batch_size", "None or an integer >= 2")
        check(isinstance(self.min_acceptance_rate, (int, float)) and not isinstance(self.min_acceptance_rate, bool)
             and 0 <= self.min_acceptance_rate <= 1, "min_acceptance_rate", "a number in [0, 1]")
        check(isinstance(self.adaptive, bool), "adaptive", "true or false")
        if self.method == "ngram":
            check(self.model is None, "model", "None with method 'ngram' (it drafts from the sequence itself)")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                check(value is None or (integer(value) and 1 <= value <= MAX_PROMPT_LOOKUP), name,
                     f"None or an integer in [1, {MAX_PROMPT_LOOKUP}]")
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5     # vLLM's defaults
            self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
            self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
            check(self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
                 f"<= prompt_lookup_max={self.prompt_lookup_max}")
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                check(getattr(self, name) is None, name, "None with method 'draft_model' (only ngram looks up)")
            m = self.model
            check(isinstance(m, str) and ((m.endswith(".gguf") and os.path.isfile(m))
                                         or os.path.isfile(os.path.join(m, "config.json"))),
                 "model", "a checkpoint directory with config.json or a .gguf file (method 'draft_model')")


def speculation_enabled(config: SpeculativeConfig | None, num_running: int) -> bool:
    """vLLM's disable_by_batch_size: a big batch is compute-bound, and verifying drafts that
    are then rejected costs more than the accepted ones save."""
    return config is not None and (config.disable_by_batch_size is None or num_running < config.disable_by_batch_size)


def draft_budget(k: int, num_output_tokens: int, max_tokens: int, num_tokens: int, max_model_len: int) -> int:
    """Drafts a row may verify this step: its 1 + drafts emitted tokens never pass max_tokens,
    and its sequence never grows past max_model_len."""
    return max(0, min(k, max_tokens - num_output_tokens - 1, max_model_len - num_tokens - 1))


# ---------------------------------------------------------------------------------------- n-gram proposer
def ngram_propose(histories: list[np.ndarray], max_drafts: list[int], min_n: int, max_n: int) -> list[list[int]]:
    """Prompt lookup for a batch. For each sequence t (prompt + output): the longest suffix of
    between min_n and max_n tokens that also ends earlier in t, and the up-to-max_drafts tokens
    that followed its most recent earlier occurrence (cut where t ends).

    Why the most recent: the nearest context is the likeliest to continue the same way (the latest
    copy of an edited line, the passage the output is quoting right now), and it is vLLM's choice.
    Vectorized over the whole batch at once: only positions holding each sequence's last token
    are candidates, and they are extended backwards together, one suffix length per pass."""
    rows = [i for i, (t, k) in enumerate(zip(histories, max_drafts)) if k > 0 and len(t) > min_n]
    out = [[] for _ in histories]
    if not rows:
        return out
    seqs = [histories[i] for i in rows]
    lens = np.array([len(t) for t in seqs])
    ends = np.cumsum(lens)                                             # [B] one past each row's last token
    starts = ends - lens
    flat = np.concatenate(seqs)                                        # [N] every row's tokens, end to end
    eq = flat == np.repeat(flat[ends - 1], lens)                       # [N] holds its row's last token
    eq[ends - 1] = False                                               # the suffix itself is not earlier
    cand = np.flatnonzero(eq)                                          # [C] where an earlier occurrence ends
    row = np.searchsorted(ends, cand, side="right")                    # [C] which row each lies in
    length = np.ones(len(cand), dtype=np.int64)                        # [C] matched suffix length so far
    alive = np.ones(len(cand), dtype=bool)
    for i in range(1, max_n):                                          # extend every live match by a token
        alive &= cand - i >= starts[row]
        a, b = np.where(alive, cand - i, 0), np.where(alive, ends[row] - 1 - i, 0)
        alive &= flat[a] == flat[b]
        length += alive
        if not alive.any():
            break
    keep = length >= min_n
    cand, row, length = cand[keep], row[keep], length[keep]
    order = np.lexsort((cand, length, row))                            # per row: longest, then latest, last
    best = order[np.r_[row[order][1:] != row[order][:-1], True]] if len(order) else order
    for j in best:
        r = row[j]
        stop = min(cand[j] + 1 + max_drafts[rows[r]], ends[r])
        out[rows[r]] = flat[cand[j] + 1:stop].tolist()
    return out


class TokenHistory:
    """One sequence's tokens as a growing NumPy array, so a step copies only its new tokens
    (a whole 2,000-token list is ~30 us to convert; 64 of them per step would be 2 ms)."""

    def __init__(self):
        self.buf, self.len = np.empty(64, dtype=np.int32), 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """token_ids only ever grows (drafts are never in it): append what is new."""
        n = len(token_ids)
        assert n >= self.len, "a sequence's token_ids shrank; remove() it first"
        if n > len(self.buf):
            grown = np.empty(max(n, 2 * len(self.buf)), dtype=np.int32)
            grown[:self.len] = self.buf[:self.len]
            self.buf = grown
        self.buf[self.len:n] = token_ids[self.len:n]
        self.len = n
        return self.buf[:n]


class NgramProposer:
    """Prompt-lookup drafts for many sequences; keeps each sequence's TokenHistory by key
    (the engine's seq_id) until remove(key), which the engine calls when the sequence ends."""

    def __init__(self, config: SpeculativeConfig):
        self.k, self.min_n, self.max_n = (config.num_speculative_tokens, config.prompt_lookup_min,
                                          config.prompt_lookup_max)
        self.histories: dict = {}

    def propose(self, keys: list, token_ids: list[list[int]], max_drafts: list[int] | None = None) -> list[list[int]]:
        """Per row, up to min(k, max_drafts[i]) drafts (possibly none)."""
        limits = [self.k if m is None else min(self.k, m) for m in (max_drafts or [None] * len(keys))]
        arrays = [self.histories.setdefault(key, TokenHistory()).sync(ids) for key, ids in zip(keys, token_ids)]
        return ngram_propose(arrays, limits, self.min_n, self.max_n)

    def remove(self, key):
        self.histories.pop(key, None)


def trim_drafts(drafts: list[int], state) -> list[int]:
    """What is worth verifying of one row's drafts: none its grammar forbids (llguidance checks
    them against the row's state without advancing it), none after one that would end the
    completion (EOS unless ignored, or a stop id, once min_tokens is met: the very ids
    SamplingState.min_tokens_banned lists). state: the row's SamplingState."""
    if state.grammar is not None and drafts:
        drafts = drafts[:state.grammar.matcher.validate_tokens(drafts)]
    ends = set(state.min_tokens_banned)
    for j, t in enumerate(drafts):
        if t in ends and state.num_output_tokens + j >= state.params.min_tokens:
            return drafts[:j + 1]
    return drafts


# ---------------------------------------------------------------------------------------- adaptivity and metrics
@dataclass
class AcceptanceTracker:
    """One completion's recent acceptance (an exponential average over its verifying steps). Below
    min_acceptance_rate it stops drafting for a while, then probes again; each failed probe doubles
    the pause (8, 16, ... 128 steps), a good one ends it. A row without drafts costs nothing extra."""
    rate: float = 1.0
    pause: int = 0
    backoff: int = 8
    WEIGHT = 0.3                      # the latest step's share: "recent" is about the last 3-5 drafting steps
    MIN_BACKOFF, MAX_BACKOFF = 8, 128

    def should_draft(self) -> bool:
        """Called once per step; counts a paused step down."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def num_drafts(self, k: int, min_rate: float) -> int:
        """Drafts worth verifying now: draft j counts only if the j - 1 before it were accepted too,
        about rate^j of the time; each costs a query row whether accepted or not, so verify it only
        while that chance is at least min_rate (rate 0.9: all of k = 4; 0.5: 2; a probe at min_rate: 1)."""
        n, chance = 0, self.rate
        while n < k and chance >= min_rate:
            n, chance = n + 1, chance * self.rate
        return n

    def record(self, num_drafts: int, num_accepted: int, min_rate: float):
        if num_drafts == 0:
            return
        self.rate += self.WEIGHT * (num_accepted / num_drafts - self.rate)
        if self.rate < min_rate:
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_BACKOFF)
            self.rate = min_rate      # a probe that does well lifts it back over at once
        else:
            self.backoff = self.MIN_BACKOFF


class StepCosts:
    """Does a verify step pay at this batch size, on this machine, now? Measured online: per bucket
    of running rows (1, 2, 4, 8, ...), an exponential average of the tokens per second of decode-only
    steps with drafts and without (a step's wall time, plus the proposing that fed it). Speculation
    runs in a bucket while its rate is at least the plain one. A bucket's first decode step is plain,
    its next speculates; every PROBE_EVERY steps the side not chosen is forgotten and measured
    afresh (its old figure may come from another workload), so a change of acceptance or of batch
    moves the choice back. What a step costs is the engine's to say: this
    only compares what it is told (no device figures are written in here)."""
    PROBE_EVERY = 32
    WEIGHT = 0.25                     # the latest step's share of a bucket's rate

    def __init__(self):
        self.rates: dict[int, list] = {}          # bucket -> [plain tok/s or None, speculative tok/s or None]
        self.steps: dict[int, int] = {}           # bucket -> decisions made there
        self.num_steps_off = 0                    # decisions that held speculation off: it did not pay
        self.last_gain = 0.0                      # speculative / plain rate at the last decision (0: unmeasured)

    @staticmethod
    def bucket(num_rows: int) -> int:
        return 1 << max(0, num_rows - 1).bit_length()

    def allows(self, num_rows: int) -> bool:
        """Speculate in the coming step of num_rows rows?"""
        b = self.bucket(num_rows)
        plain, spec = self.rates.setdefault(b, [None, None])
        n = self.steps[b] = self.steps.get(b, 0) + 1
        if plain is None or spec is None:
            return plain is not None                              # measure plain first, then speculative
        self.last_gain = spec / plain
        choice = spec >= plain
        if n % self.PROBE_EVERY == 0:                             # forget the side not chosen: measured afresh
            self.rates[b][not choice] = None                      # (a probe in which no row drafts probes on)
            return not choice
        self.num_steps_off += not choice
        return choice

    def observe(self, num_rows: int, speculated: bool, seconds: float, num_tokens: int):
        """A decode-only step: its rows, whether any row verified drafts, its time and tokens emitted."""
        if seconds <= 0 or num_rows == 0:
            return
        rate, pair = num_tokens / seconds, self.rates.setdefault(self.bucket(num_rows), [None, None])
        old = pair[speculated]
        pair[speculated] = rate if old is None else old + self.WEIGHT * (rate - old)


@dataclass
class SpecDecodeStats:
    """Counters for EngineStats and /metrics (nanoserve:spec_decode_*), vLLM's meanings."""
    num_drafts: int = 0               # rows that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0       # accepted + 1 per verifying row (before a stop cuts a run short)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def observe(self, draft_token_ids: list[list[int]], out: SpecOutput):
        """After verify: the drafts it was given and what it returned."""
        for d, a in zip(draft_token_ids, out.num_accepted):
            if d:
                self.num_drafts += 1
                self.num_draft_tokens += len(d)
                self.num_accepted_tokens += a
                self.num_emitted_tokens += a + 1
                for j in range(a):
                    self.num_accepted_tokens_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying row: 1 + accepted / drafts (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


# ---------------------------------------------------------------------------------------- the engine's hooks
class Speculator:
    """What the engine holds when it speculates: the proposer, each sequence's AcceptanceTracker
    (and draft_model's q of its drafts), and the counters. Engine.postprocess samples through
    sample() (verify; a row without drafts is plain sampling) and calls propose() once the step's
    tokens are appended; Scheduler.accept_drafts rolls the cache back; remove() when a sequence ends."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None):
        self.config, self.max_model_len = config, max_model_len
        self.proposer = draft if draft is not None else NgramProposer(config)
        self.trackers: dict[int, AcceptanceTracker] = {}
        self.draft_probs: dict[int, torch.Tensor] = {}     # draft_model, seq_id -> [k, vocab] (sampled rows only)
        self.stats, self.last_step = SpecDecodeStats(), SpecDecodeStats()
        self.costs = StepCosts() if config.adaptive else None
        self.propose_seconds = 0.0                         # the last propose(): part of the next step's cost

    def observe_step(self, num_rows: int, speculated: bool, seconds: float, num_tokens: int):
        """The engine's figures of a decode-only step that just ran (before its propose())."""
        if self.costs is not None:
            self.costs.observe(num_rows, speculated, seconds + (self.propose_seconds if speculated else 0), num_tokens)

    def propose(self, completions: list, num_running: int, generator: torch.Generator | None = None):
        """Set seq.spec_token_ids for each unfinished completion that may draft this step."""
        t0 = time.perf_counter()
        try:
            self._propose(completions, num_running, generator)
        finally:
            self.propose_seconds = time.perf_counter() - t0

    def _propose(self, completions: list, num_running: int, generator: torch.Generator | None):
        if not speculation_enabled(self.config, num_running) or not completions:
            return
        if self.costs is not None and not self.costs.allows(num_running):
            return
        rows, limits = [], []
        for c in completions:
            seq = c.seq
            if seq.num_uncomputed != 1:          # not decoding: an n > 1 fork queued for a slot (Scheduler.fork)
                continue
            tracker = self.trackers.setdefault(seq.seq_id, AcceptanceTracker())
            limit = draft_budget(tracker.num_drafts(self.config.num_speculative_tokens, self.config.min_acceptance_rate),
                                 seq.num_output_tokens, seq.max_tokens, len(seq.token_ids), self.max_model_len)
            if limit > 0 and tracker.should_draft():
                rows.append(c)
                limits.append(limit)
        if not rows:
            return
        keys, ids = [c.seq.seq_id for c in rows], [c.seq.token_ids for c in rows]
        if isinstance(self.proposer, NgramProposer):
            drafts, probs = self.proposer.propose(keys, ids, limits), [None] * len(rows)
        else:
            drafts, probs = self.proposer.propose(keys, ids, limits, [c.sampling for c in rows], generator)
        for c, d, q in zip(rows, drafts, probs):
            c.seq.spec_token_ids = trim_drafts(d, c.sampling)
            if q is not None:
                self.draft_probs[c.seq.seq_id] = q

    def sample(self, logits, completions: list, generator: torch.Generator | None) -> SpecOutput:
        """logits: [sum(1 + k_i), vocab], each completion's 1 + k_i rows in order (k_i = len of its
        seq.spec_token_ids). verify, then count: stats, per-request metrics, trackers."""
        drafts = [c.seq.spec_token_ids for c in completions]
        states = [c.sampling for c in completions]
        out = verify(logits, drafts, states, generator, self._draft_probs(completions, drafts, logits))
        self.last_step = SpecDecodeStats()
        self.last_step.observe(drafts, out)
        self.stats.observe(drafts, out)
        for c, d, a in zip(completions, drafts, out.num_accepted):
            if d:
                self.trackers[c.seq.seq_id].record(len(d), a, self.config.min_acceptance_rate)
                m = c.seq.request.metrics
                m.num_spec_steps, m.num_draft_tokens, m.num_accepted_tokens = (
                    m.num_spec_steps + 1, m.num_draft_tokens + len(d), m.num_accepted_tokens + a)
        return out

    def _draft_probs(self, completions, drafts, logits):
        """[sum(k_i), vocab] q of every draft, or None where no drafted row samples (point masses:
        n-gram drafts, and greedy rows, whose q verify never reads: zeros stand in for them)."""
        qs = [self.draft_probs.pop(c.seq.seq_id, None) for c in completions]
        if all(q is None for q, d in zip(qs, drafts) if d):
            return None
        vocab = logits.shape[-1]
        return torch.cat([q[:len(d)] if q is not None else torch.zeros(len(d), vocab, device=logits.device) for q, d in zip(qs, drafts)])

    def remove(self, seq_id: int):
        """A sequence ended (finished or aborted): forget its history, tracker and draft cache."""
        self.trackers.pop(seq_id, None)
        self.draft_probs.pop(seq_id, None)
        self.proposer.remove(seq_id)

    def check_invariants(self, live_seq_ids: set):
        """Per-sequence state only for sequences that still exist; the draft pool's own invariants."""
        assert set(self.trackers) <= live_seq_ids, "a tracker outlived its sequence"
        assert set(self.draft_probs) <= live_seq_ids, "a draft distribution outlived its sequence"
        if isinstance(self.proposer, NgramProposer):
            assert set(self.proposer.histories) <= live_seq_ids, "an n-gram history outlived its sequence"
        else:
            self.proposer.check_invariants(live_seq_ids)

    def engine_stats(self) -> dict:
        """EngineStats' spec_decode_* fields."""
        s, last = self.stats, self.last_step
        return dict(spec_decode_num_drafts=s.num_drafts, spec_decode_num_draft_tokens=s.num_draft_tokens,
                    spec_decode_num_accepted_tokens=s.num_accepted_tokens,
                    spec_decode_num_emitted_tokens=s.num_emitted_tokens,
                    spec_decode_mean_acceptance_length=s.mean_acceptance_length,
                    spec_decode_draft_tokens_last_step=last.num_draft_tokens,
                    spec_decode_accepted_tokens_last_step=last.num_accepted_tokens,
                    spec_decode_emitted_tokens_last_step=last.num_emitted_tokens,
                    spec_decode_num_steps_off=self.costs.num_steps_off if self.costs else 0,
                    spec_decode_step_gain=self.costs.last_gain if self.costs else 0.0)
