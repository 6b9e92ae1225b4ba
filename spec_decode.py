"""
Speculative decoding: cheap proposals of the next k tokens, and the exact acceptance rule that
lets the target model verify all of them in one forward pass without changing what it samples
(Leviathan et al., 2023; Chen et al., 2023).

Owns SpeculativeConfig (vLLM's names, validated at the edge), the n-gram (prompt-lookup)
proposer and its per-sequence token history, the processing of every drafted position with the
drafted prefix, rejection sampling, the arithmetic of rolling KV slots back, and per-completion
acceptance tracking. Does not schedule, allocate blocks, run a model or append tokens: the
engine and scheduler call in here and act on what comes back.

How the engine uses it, one step (only decode rows speculate; a row with no drafts is a plain row):
 1. propose   After a step's tokens are appended, for each running decode completion that
              `speculation_enabled(config, num_running)` and its AcceptanceTracker allow:
              NgramProposer.propose(keys, token_ids, max_drafts) with max_drafts from
              `draft_budget` (never past max_tokens or max_model_len), then `trim_drafts`
              (drafts its grammar forbids go now, before they cost a forward; nothing is drafted
              past a stop id). Drafts live beside the sequence (seq.spec_token_ids), never in
              token_ids, so neither detokenizer, stop checks nor prefix-cache hashes see them.
 2. schedule  A row with k drafts costs 1 + k tokens of the budget and allocate_slots(seq, 1 + k).
              If the budget or the pool is short, drop the drafts (k = 0): drafts never preempt.
 3. forward   input ids token_ids[num_computed:] + drafts; positions and slots as for any
              multi-token query; logits at all 1 + k positions of each speculating row, rows in
              batch order: logits [T, vocab], T = sum(k_i + 1).
 4. accept    raw = logits.log_softmax(-1) if any row wants logprobs (the model's, as today);
              apply_processors_with_drafts(logits, states, drafts): position j of a row is
              processed as if drafts[:j] had been emitted (grammar state, min_tokens count,
              penalty counts); then rejection_sample(logits, drafts, states, generator) ->
              SpecOutput: per row the emitted tokens (accepted drafts + one target token) and
              the logits row each came from (logprobs: raw[index]).
 5. rollback  finish_step counts only a row's non-draft tokens in num_computed_tokens; after
              acceptance num_computed_tokens += num_accepted, and `rollback_num_blocks` tail
              blocks are released (they were allocated this step, refcount 1, never registered).
              Rejected drafts' slots inside kept blocks lie past num_computed_tokens: attention
              never reads them and the next tokens overwrite them. A block enters the prefix
              cache only once full of computed tokens, all in token_ids, so a draft never does.
              Then append the emitted tokens one by one (EOS, stop strings and max_tokens inside
              the run end it there; the rest is dropped), and tracker.record / stats.observe.
Seeds: a seeded row draws every random number from its own generator, so its tokens do not
depend on the batch; with n-gram drafts it draws exactly one uniform per emitted token, the one
plain sampling would draw, so a seeded request gives the same tokens with or without speculation.
"""
import os
from dataclasses import dataclass, field, fields

import numpy as np
import torch

import errors
import sampler
from structured_output import apply_token_bitmask_

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
    min_acceptance_rate: float = 0.2          # a completion whose recent rate falls below pauses drafting

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        """Validate a user's dict; InvalidRequest names the field (speculative_config.<name>)."""
        if d is None:
            return None
        if isinstance(d, SpeculativeConfig):
            d = {f.name: getattr(d, f.name) for f in fields(cls)}
        errors.need(isinstance(d, dict), "speculative_config", "a dict (JSON object)", d)
        known = {f.name for f in fields(cls)}
        for key in d:
            errors.need(key in known, f"speculative_config.{key}", f"one of {sorted(known)}", key)
        config = cls(**d)
        config.validate()
        return config

    def validate(self):
        def need(ok, name, allowed):
            errors.need(ok, f"speculative_config.{name}", allowed, getattr(self, name))

        def integer(x):
            return isinstance(x, int) and not isinstance(x, bool)
        need(self.method in ("ngram", "draft_model"), "method", "'ngram' or 'draft_model'")
        need(integer(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             "num_speculative_tokens", f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        need(self.disable_by_batch_size is None or (integer(self.disable_by_batch_size)
                                                    and self.disable_by_batch_size >= 2),
             "disable_by_batch_size", "None or an integer >= 2")
        need(isinstance(self.min_acceptance_rate, (int, float)) and not isinstance(self.min_acceptance_rate, bool)
             and 0 <= self.min_acceptance_rate <= 1, "min_acceptance_rate", "a number in [0, 1]")
        if self.method == "ngram":
            need(self.model is None, "model", "None with method 'ngram' (it drafts from the sequence itself)")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                need(value is None or (integer(value) and 1 <= value <= MAX_PROMPT_LOOKUP), name,
                     f"None or an integer in [1, {MAX_PROMPT_LOOKUP}]")
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5     # vLLM's defaults
            self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
            self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
            need(self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
                 f"<= prompt_lookup_max={self.prompt_lookup_max}")
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                need(getattr(self, name) is None, name, "None with method 'draft_model' (only ngram looks up)")
            m = self.model
            need(isinstance(m, str) and ((m.endswith(".gguf") and os.path.isfile(m))
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


# ---------------------------------------------------------------------------------------- processing drafted positions
class DraftedState:
    """A SamplingState as it would be after a row emitted drafts[:j]: what sampler's processors
    read (min_tokens count, penalty counts). The grammar is handled apart, by advancing it."""
    __slots__ = ("params", "generator", "grammar", "num_output_tokens", "output_counts", "in_prompt",
                 "min_tokens_banned")

    def __init__(self, state, prefix: list[int]):
        self.params, self.generator, self.grammar = state.params, state.generator, None
        self.num_output_tokens = state.num_output_tokens + len(prefix)
        self.in_prompt, self.min_tokens_banned = state.in_prompt, state.min_tokens_banned
        self.output_counts = state.output_counts
        if state.output_counts is not None and prefix:
            self.output_counts = state.output_counts.clone()
            self.output_counts.index_add_(0, torch.tensor(prefix), torch.ones(len(prefix), dtype=torch.int32))


def apply_processors_with_drafts(logits, states: list, draft_token_ids: list[list[int]]):
    """logits: [T, vocab], row i's 1 + k_i positions in order, T = sum(k_i + 1) (edited in place).
    The sampler's processors in its order (grammar mask, min_tokens, logit_bias, penalties), each
    position seeing the row's drafts before it as emitted: p at position j is the distribution
    plain decoding would use after those j tokens, which is what exactness needs.
    Temperature and top-k/top-p/min-p are rejection_sample's. Drafts must be grammar-valid
    (trim_drafts); grammars are advanced through them and rolled back."""
    positions = [s if j == 0 else DraftedState(s, d[:j])
                 for s, d in zip(states, draft_token_ids) for j in range(len(d) + 1)]   # [T]
    apply_grammar_masks_with_drafts(logits, states, draft_token_ids)
    sampler.apply_min_tokens(logits, positions)
    sampler.apply_logit_bias(logits, [p.params for p in positions])
    sampler.apply_penalties(logits, positions)


def apply_grammar_masks_with_drafts(logits, states: list, draft_token_ids: list[list[int]]):
    """Each constrained row's mask at each of its positions: the matcher's mask, then it
    consumes that position's draft; rolled back to where it was once the row is done."""
    rows, grammars, offset = [], [], 0
    for s, d in zip(states, draft_token_ids):
        if s.grammar is not None:
            rows += range(offset, offset + len(d) + 1)
            grammars.append((s.grammar.matcher, d))
        offset += len(d) + 1
    if not rows:
        return
    bitmask = torch.empty(len(rows), (logits.shape[1] + 31) // 32, dtype=torch.int32)   # [g, words]
    row_bytes, j = bitmask.shape[1] * 4, 0
    for matcher, drafts in grammars:
        for token in drafts + [None]:
            matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), row_bytes)
            j += 1
            if token is not None and not matcher.consume_token(token):
                raise ValueError(f"draft {token} is one the grammar forbids: trim_drafts first")
        matcher.rollback(len(drafts))
    apply_token_bitmask_(logits, bitmask, rows)


# ---------------------------------------------------------------------------------------- exact acceptance
@dataclass
class SpecOutput:
    """What verification emits, per row in batch order. Logprobs of the emitted tokens, as the
    engine reports them today (the model's, before processing): with raw = logits.log_softmax(-1)
    taken before any processor, sampler.top_logprobs(raw[flat indices], flat tokens, want)."""
    token_ids: list[list[int]]        # accepted drafts, then one token of the target's (correction or bonus)
    num_accepted: list[int]           # drafts accepted: len(token_ids[i]) - 1
    logits_indices: list[list[int]]   # the logits row each emitted token was drawn from (for its logprobs)


def acceptance_probability(p_x, q_x):
    """min(1, p(x) / q(x)); q(x) = 0 (a draft its own distribution could not give) accepts iff p(x) > 0."""
    return torch.where(q_x > 0, (p_x / q_x.clamp(min=1e-30)).clamp(max=1), (p_x > 0).float())


def residual_probs(p, q):
    """normalize(max(p - q, 0)), rows [n, vocab]. Where p <= q everywhere (a rejection that has
    probability 0 but float rounding let through) p itself, the only sensible fallback."""
    r = (p - q).clamp_(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def target_weights(x, params: list) -> torch.Tensor:
    """x: [n, vocab] processed logits, overwritten; params: one SamplingParams per row. Temperature,
    top-k / top-p / min-p, then exp((x - max) / T): the target's distribution, unnormalized, by the
    very steps of sampler.draw (which should expose them; here they are repeated), so a draw from
    it with the same uniform picks the same token as plain sampling."""
    inv_temp = 1 / torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device).unsqueeze(1)   # [n, 1]
    scale_later = any(p.temperature != 1 for p in params)
    if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        x = sampler.apply_top_k_top_p_min_p(x.mul_(inv_temp), params)     # [n, vocab]
        scale_later = False
    if sampler.csrc_ops(x):
        torch.ops.nanoserve_fused.exp_sub_max_(x, (inv_temp if scale_later else torch.ones_like(inv_temp)).view(-1))
        return x
    x = x.sub_(x.amax(dim=-1, keepdim=True))
    return (x.mul_(inv_temp) if scale_later else x).exp_()


def draw_uniforms(states: list, counts: list[int], generator) -> tuple[torch.Tensor, list]:
    """counts[i] uniforms for row i, flat [sum(counts)]: a seeded row's from its own generator (so
    they do not depend on the batch), the rest from the shared one in one call. Also returns each
    seeded row's generator state before the draw, so replay_uniforms can consume only what it used."""
    u = torch.empty(sum(counts))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    shared = [j for i, s in enumerate(states) if s.generator is None for j in range(offsets[i], offsets[i + 1])]
    if shared:
        u[shared] = torch.rand(len(shared), generator=generator)
    snapshots = [None] * len(states)
    for i, s in enumerate(states):
        if s.generator is not None and counts[i]:
            snapshots[i] = s.generator.get_state()
            u[offsets[i]:offsets[i + 1]] = torch.rand(counts[i], generator=s.generator)
    return u, snapshots


def replay_uniforms(states: list, snapshots: list, used: list[int]):
    """Rewind each seeded row's generator and draw only the `used` uniforms it consumed
    (torch.rand(n) on a CPU generator is the same stream as n draws of one)."""
    for s, snap, n in zip(states, snapshots, used):
        if snap is not None:
            s.generator.set_state(snap)
            torch.rand(n, generator=s.generator)


def rejection_sample(logits, draft_token_ids: list[list[int]], states: list,
                     generator: torch.Generator | None = None, draft_probs=None) -> SpecOutput:
    """logits: [T, vocab] float32, processed by apply_processors_with_drafts (and overwritten here,
    as sampler.sample does: take raw logprobs before); row i owns rows
    starts[i] .. starts[i] + k_i (T = sum(k_i + 1)). draft_token_ids: row i's k_i drafts (k_i = 0:
    a plain row, it just samples). states: SamplingStates (params, generator). generator: the
    engine's stream for unseeded rows. draft_probs: [sum(k_i), vocab], the distribution each
    draft was sampled from (draft_model); None for n-gram drafts, which are point masses.

    Greedy rows (temperature 0) accept while a draft equals the target's argmax; the first
    mismatch is replaced by the argmax, and if all match the argmax after them is a bonus.
    Sampled rows, point-mass drafts: the target samples every position by inverse CDF with one
    uniform each, and drafts are accepted while they equal its samples. This is the rule
    min(1, p(x)/q(x)) with q(x) = 1: x is accepted with probability p(x), and a rejection's token
    is p's sample given it is not x, i.e. normalize(max(p - q, 0)). Only the uniforms of emitted
    tokens are consumed, so a seeded row replays plain sampling token for token.
    Sampled rows, drafted distributions: x_j is accepted iff u_j < min(1, p(x_j)/q(x_j)); at the
    first rejection the token comes from residual_probs(p, q), after k acceptances from p at
    position k (the bonus); k_i + 1 uniforms per row, all consumed."""
    num_drafts = [len(d) for d in draft_token_ids]
    starts = np.concatenate([[0], np.cumsum([k + 1 for k in num_drafts])])      # [rows + 1]
    assert logits.shape[0] == starts[-1], f"logits has {logits.shape[0]} rows, drafts need {starts[-1]}"
    spans = [range(starts[i], starts[i + 1]) for i in range(len(states))]
    greedy_rows = [i for i, s in enumerate(states) if s.params.temperature == 0]
    sampled_rows = [i for i, s in enumerate(states) if s.params.temperature > 0]
    target = [0] * int(starts[-1])                     # the target's own token at every position it decides
    if greedy_rows:
        pos = [j for i in greedy_rows for j in spans[i]]
        x = logits if len(pos) == len(target) else logits[pos]                  # no [T, vocab] copy if all are
        for j, t in zip(pos, sampler.greedy(x).tolist()):
            target[j] = t
    accepted = {i: _first_mismatch(draft_token_ids[i], target[starts[i]:starts[i + 1]]) for i in greedy_rows}
    if sampled_rows:
        pos = [j for i in sampled_rows for j in spans[i]]
        x = logits if len(pos) == len(target) else logits[pos]
        weights = target_weights(x, [states[i].params for i in sampled_rows for _ in spans[i]])   # [Ts, vocab]
        rows_states = [states[i] for i in sampled_rows]
        u, snapshots = draw_uniforms(rows_states, [len(spans[i]) for i in sampled_rows], generator)   # [Ts]
        if draft_probs is None:
            for j, t in zip(pos, sampler.inverse_cdf(weights, u).tolist()):
                target[j] = t
            for i in sampled_rows:
                accepted[i] = _first_mismatch(draft_token_ids[i], target[starts[i]:starts[i + 1]])
            replay_uniforms(rows_states, snapshots, [accepted[i] + 1 for i in sampled_rows])
        else:
            probs = weights.div_(weights.sum(dim=-1, keepdim=True))           # [Ts, vocab] normalized p
            local = dict(zip(pos, range(len(pos))))                             # logits row -> row of probs
            accepted.update(_accept_drafted_distributions(probs, draft_probs, u, local, sampled_rows,
                                                          draft_token_ids, starts, target))
    token_ids, logits_indices = [], []
    for i, d in enumerate(draft_token_ids):
        a = accepted[i]
        token_ids.append(d[:a] + [target[starts[i] + a]])
        logits_indices.append(list(range(starts[i], starts[i] + a + 1)))
    return SpecOutput(token_ids, [accepted[i] for i in range(len(states))], logits_indices)


def _first_mismatch(drafts: list[int], target: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    return next((j for j, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))


def _accept_drafted_distributions(probs, draft_probs, u, local, rows, draft_token_ids, starts, target) -> dict:
    """The general rule for rows whose drafts were sampled from q (draft_probs, rows in draft order):
    coins u_j < min(1, p(x_j)/q(x_j)) for j < k, then one draw with u_k from the residual (at the
    first rejection) or from p at position k (the bonus). Writes each row's drawn token into target
    at its position; returns {row: accepted}. One gather per tensor for the whole batch."""
    draft_offsets = np.concatenate([[0], np.cumsum([len(d) for d in draft_token_ids])])
    at = torch.tensor([local[starts[i] + j] for i in rows for j in range(len(draft_token_ids[i]))],
                      dtype=torch.int64)                                        # [D] probs rows of the drafts
    qs = torch.tensor([draft_offsets[i] + j for i in rows for j in range(len(draft_token_ids[i]))],
                      dtype=torch.int64)                                        # [D] their q rows
    x = torch.tensor([t for i in rows for t in draft_token_ids[i]], dtype=torch.int64)   # [D] the drafts
    p_x, q_x = probs[at, x], draft_probs[qs, x]                                 # [D] each
    coins = (u[at] < acceptance_probability(p_x, q_x)).tolist()                 # [D]
    accepted, rejected_p, rejected_q, bonus_p, draw_u, final_pos, offset = {}, [], [], [], [], [], 0
    for i in rows:
        k = len(draft_token_ids[i])
        a = next((j for j, ok in enumerate(coins[offset:offset + k]) if not ok), k)
        offset += k
        accepted[i] = a
        draw_u.append(local[starts[i] + k])                                    # the row's last uniform draws
        final_pos.append(starts[i] + a)
        if a < k:
            rejected_p.append(local[starts[i] + a])
            rejected_q.append(draft_offsets[i] + a)
        else:
            bonus_p.append(local[starts[i] + k])
    # rows in `rows` order: rejected ones from the residual, the rest from p (stacked back in order)
    dists = torch.empty(len(rows), probs.shape[1], dtype=probs.dtype, device=probs.device)   # [rows, vocab]
    rejected = [n for n, i in enumerate(rows) if accepted[i] < len(draft_token_ids[i])]
    bonus = [n for n, i in enumerate(rows) if accepted[i] == len(draft_token_ids[i])]
    if rejected:
        dists[rejected] = residual_probs(probs[rejected_p], draft_probs[rejected_q])
    if bonus:
        dists[bonus] = probs[bonus_p]
    for j, t in zip(final_pos, sampler.inverse_cdf(dists, u[draw_u]).tolist()):
        target[j] = t
    return accepted


# ---------------------------------------------------------------------------------------- rollback
def rollback_num_blocks(num_computed_tokens: int, num_accepted: int, block_size: int, num_blocks: int) -> int:
    """Tail blocks to release after verification. num_computed_tokens counts the row's computed
    tokens without its drafts (finish_step adds only the non-draft tokens); the accepted drafts'
    K/V are now valid too. The table was grown for every draft; blocks that only rejected drafts
    reached go back (when the rollback crosses a block boundary)."""
    keep = -(-(num_computed_tokens + num_accepted) // block_size)
    assert num_blocks >= keep, "the block table does not cover the accepted tokens"
    return num_blocks - keep


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

    def record(self, num_drafts: int, num_accepted: int, min_rate: float):
        if num_drafts == 0:
            return
        self.rate += self.WEIGHT * (num_accepted / num_drafts - self.rate)
        if self.rate < min_rate:
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_BACKOFF)
            self.rate = min_rate      # a probe that does well lifts it back over at once
        else:
            self.backoff = self.MIN_BACKOFF


@dataclass
class SpecDecodeStats:
    """Counters for EngineStats and /metrics (nanoserve:spec_decode_*), vLLM's meanings."""
    num_drafts: int = 0               # rows that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0       # accepted + 1 per verifying row (before a stop cuts a run short)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def observe(self, draft_token_ids: list[list[int]], out: SpecOutput):
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
