"""
Verification of speculative drafts in one pass: every drafted position of every row is processed
and sampled in one batched call, and one array comes back to the host, which finds each row's
first rejection (Leviathan et al., 2023; Chen et al., 2023).

Owns verify() and what it needs: the per-position sampling state (DraftedState), the acceptance
rule's arithmetic (acceptance_probability, residual_probs, target_weights) and SpecOutput. Does
not propose, schedule or roll the cache back (spec_decode.py and the scheduler do); the
processors and the inverse-CDF draw are sampler.py's, called on all positions at once.

Why one pass: a wave per accepted draft costs a host round trip each (an index upload, a
.tolist()), up to 2 (1 + k) synchronizations a step on a GPU. Here the drafts are known before
the forward, so position j of a row is processed as plain decoding would process it after
emitting drafts[:j] (its grammar mask, min_tokens count and penalty counts), every position
draws its token, and the host reads [T, 2 (+ logprobs)] once, T = sum(1 + k_i). The positions
after a rejection were computed for nothing; they are the price of not waiting.

Seeds: a sampled row draws 1 + k_i uniforms from its stream up front; once the host knows how
many plain decoding would have drawn for the tokens emitted, the stream is set back and moved
on by exactly that many, so a seeded request leaves speculation with its generator where plain
decoding leaves it. Point-mass drafts (n-gram, and every greedy row): position j's uniform is
the one plain sampling draws for its j-th token. Drafted distributions q (draft_model): draft j
is accepted iff u_j < min(1, p/q); a rejection at j draws from normalize(max(p - q, 0)) with
u_{j+1}, the next number of the stream, as the wave-by-wave rule did; the bonus uses u_k.
"""
from dataclasses import dataclass

import numpy as np
import torch

import sampler
from structured_output import apply_token_bitmask_, fill_bitmasks

NEUTRAL = sampler.SamplingParams(temperature=1.0)   # what a greedy position's draw column is computed with


class DraftedState:
    """A row's SamplingState as plain decoding would hold it after emitting drafts[:j]: what the
    sampler reads (params, generator, min_tokens count, penalty counts, grammar). The grammar is
    the row's own matcher (verify computes its masks itself, advancing and rolling it back)."""
    __slots__ = ("params", "generator", "grammar", "num_output_tokens", "output_counts", "in_prompt",
                 "min_tokens_banned", "bad_words_token_ids", "output_token_ids")

    def __init__(self, state, prefix: list[int]):
        self.params, self.generator, self.grammar = state.params, state.generator, state.grammar
        self.num_output_tokens = state.num_output_tokens + len(prefix)
        self.in_prompt, self.min_tokens_banned = state.in_prompt, state.min_tokens_banned
        self.output_counts = state.output_counts
        self.bad_words_token_ids = state.bad_words_token_ids
        self.output_token_ids = None if state.output_token_ids is None else state.output_token_ids + list(prefix)
        if state.output_counts is not None and prefix:
            self.output_counts = state.output_counts.clone()                     # [vocab]
            self.output_counts.index_add_(0, torch.tensor(prefix), torch.ones(len(prefix), dtype=torch.int32))


@dataclass
class SpecOutput:
    """What verification emits, per row in batch order."""
    token_ids: list[list[int]]           # accepted drafts, then one target token (the correction or the bonus)
    num_accepted: list[int]              # drafts accepted: len(token_ids[i]) - 1
    logprobs: list[list[dict] | None]    # per emitted token, as sampler.sample gives them (None: not asked for)


@dataclass
class VerifyPlan:
    """Everything about a verify step known before its logits: per position (T of them, rows in
    batch order, 1 + k_i each) its state and its row of the host table the device reads."""
    num_drafts: list[int]
    starts: np.ndarray                   # [rows + 1] first position of each row
    states: list                         # [T] DraftedState (or the row's own state at j = 0)
    table: torch.Tensor                  # [T, 8] float64: draft (-1 at the bonus), u, next u, 1/T, top_k, top_p, min_p, q row
    greedy: list[bool]                   # [T]
    saved: dict                          # row -> its seeded generator's state before the draws


def plan(draft_token_ids: list[list[int]], states: list, generator, vocab: int) -> VerifyPlan:
    """Per-position states, and the one host table: 1 + k_i uniforms per sampled row (a seeded row's
    from its own stream, saved first so verify can set it back; the rest in one shared call)."""
    num_drafts = [len(d) for d in draft_token_ids]
    starts = np.concatenate([[0], np.cumsum([k + 1 for k in num_drafts])]).astype(np.int64)
    total = int(starts[-1])
    pos_states = [s if j == 0 else DraftedState(s, d[:j]) for s, d in zip(states, draft_token_ids)
                  for j in range(len(d) + 1)]
    table = torch.zeros(total, 8, dtype=torch.float64)
    table[:, 0] = torch.tensor([t for d in draft_token_ids for t in d + [-1]], dtype=torch.float64)
    sampled = [i for i, s in enumerate(states) if s.params.temperature > 0]
    u = torch.zeros(total + 1, dtype=torch.float64)          # the last: u_{k+1} of the last row, never read
    shared = [i for i in sampled if states[i].generator is None]
    if shared:
        draws = torch.rand(sum(num_drafts[i] + 1 for i in shared), generator=generator).double()
        at = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in shared])
        u[at] = draws
    saved = {}
    for i in sampled:
        g = states[i].generator
        if g is not None:
            saved[i] = g.get_state()
            u[int(starts[i]):int(starts[i + 1])] = torch.rand(num_drafts[i] + 1, generator=g).double()
    table[:, 1], table[:, 2] = u[:-1], u[1:]
    greedy = [s.params.temperature == 0 for s in pos_states]
    params = [NEUTRAL if g else s.params for s, g in zip(pos_states, greedy)]   # greedy: their argmax, no draw
    table[greedy, 1] = 2.0                                   # no uniform is 2: the device tells greedy rows by it
    table[:, 3] = torch.tensor([1 / p.temperature for p in params], dtype=torch.float64)
    table[:, 4:7] = sampler.row_filters(params, vocab).double()
    q_rows = np.cumsum([0] + num_drafts)                     # row i's q rows start at sum(k_<i)
    table[:, 7] = torch.tensor([q_rows[i] + min(j, num_drafts[i] - 1) for i in range(len(states))
                                for j in range(num_drafts[i] + 1)], dtype=torch.float64)
    return VerifyPlan(num_drafts, starts, pos_states, table, greedy, saved)


def grammar_masks(x, draft_token_ids, states, starts):
    """Each grammar row's mask at each of its positions, as its matcher stands after the drafts
    before it (drafts past the first the grammar forbids are never reached: those positions get
    the last valid state's mask). The matchers are rolled back."""
    rows = [i for i, s in enumerate(states) if s.grammar is not None]
    if not rows:
        return
    masks, positions = [], []
    for i in rows:
        m, d = states[i].grammar.matcher, draft_token_ids[i]
        valid = m.validate_tokens(d) if d else 0
        consumed = 0
        try:
            for j in range(len(d) + 1):
                masks.append(fill_bitmasks([states[i].grammar], x.shape[1]))           # [1, words]
                positions.append(int(starts[i]) + j)
                if j < valid:
                    m.consume_token(d[j])
                    consumed += 1
        finally:
            if consumed:
                m.rollback(consumed)
    apply_token_bitmask_(x, torch.cat(masks), positions)


def verify(logits, draft_token_ids: list[list[int]], states: list, generator: torch.Generator | None = None,
           draft_probs=None) -> SpecOutput:
    """Exact acceptance of every row's drafts against the target's logits, in one pass.

    logits: [T, vocab], the target's raw logits at each row's 1 + k_i positions in batch order
    (T = sum(k_i + 1); overwritten, as sampler.sample does). draft_token_ids: row i's k_i drafts
    (k_i = 0: a plain row, it just samples). states: the rows' SamplingStates (nothing changes
    but seeded generators, which end where plain decoding leaves them). generator: the engine's
    stream for unseeded rows. draft_probs: [sum(k_i), vocab], the distribution each draft was drawn
    from (draft_model); None for n-gram drafts, which are point masses."""
    T, vocab = logits.shape
    if not states:
        return SpecOutput([], [], [])
    p = plan(draft_token_ids, states, generator, vocab)
    assert T == p.starts[-1], f"logits has {T} rows, the drafts need {p.starts[-1]}"
    want = [s.params.logprobs for s in p.states]
    raw = logits.log_softmax(dim=-1) if any(w is not None for w in want) else None   # [T, vocab] the model's
    x = logits
    grammar_masks(x, draft_token_ids, states, p.starts)
    sampler.apply_allowed_and_bad_words(x, p.states)
    sampler.apply_min_tokens(x, p.states)
    sampler.apply_logit_bias(x, [s.params for s in p.states])
    sampler.apply_penalties(x, p.states)
    dev = sampler.upload(p.table, x.device)                                # [T, 8] the step's one upload
    tokens, accepted = _sample_positions(x, p, dev, draft_probs)            # [T], [T]
    cols = [tokens.double(), accepted.double()]
    top_n = max([w for w in want if w is not None] + [1])
    if raw is not None:
        top_vals, top_ids = raw.topk(top_n, dim=-1)                        # [T, top_n]
        cols += [raw.gather(1, tokens.unsqueeze(1)).squeeze(1).double(), *top_vals.double().T, *top_ids.double().T]
    host = torch.stack(cols, dim=1).cpu().tolist()                         # [T, 2 (+ 1 + 2 top_n)]: the one read
    return _resolve(host, p, draft_token_ids, states, want, top_n, draft_probs is not None)


def _sample_positions(x, p: VerifyPlan, dev, draft_probs):
    """x: [T, vocab] processed logits (overwritten). -> (tokens [T] int64, accepted [T] bool) on the
    device: greedy positions their argmax; sampled ones their draw from p (point-mass drafts) or, with
    drafted q, the draft if its coin accepts it, else the residual's draw."""
    drafts = dev[:, 0].long()                                              # [T] -1 at the bonus
    argmax = sampler.greedy(x) if any(p.greedy) else None                  # before the draw overwrites x
    if all(p.greedy):
        return argmax, argmax == drafts
    params = [NEUTRAL if g else s.params for s, g in zip(p.states, p.greedy)]
    w = target_weights(x, params, dev[:, 3:4].float(), dev[:, 4:7].float())   # [T, vocab] unnormalized p
    u, u_next = dev[:, 1].float(), dev[:, 2].float()
    if draft_probs is None:                                                # point masses: plain draws
        tokens = sampler.inverse_cdf(w, u)
        accepted = tokens == drafts
    else:
        w = w.div_(w.sum(dim=-1, keepdim=True))                            # [T, vocab] the target's p
        has_draft = drafts >= 0
        xs = drafts.clamp(min=0).unsqueeze(1)                              # [T, 1]
        q = draft_probs.to(x.device).index_select(0, dev[:, 7].long().clamp(min=0)) if len(draft_probs) \
            else torch.zeros_like(w)                                       # [T, vocab] q of each draft
        coin = u < acceptance_probability(w.gather(1, xs).squeeze(1), q.gather(1, xs).squeeze(1))
        accepted = has_draft & coin
        dist = torch.where(has_draft.unsqueeze(1), residual_probs(w, q), w)   # [T, vocab]
        drawn = sampler.inverse_cdf(dist, torch.where(has_draft, u_next, u))
        tokens = torch.where(accepted, drafts, drawn)
    if argmax is None:
        return tokens, accepted
    greedy = dev[:, 1] > 1                                                 # [T] greedy positions carry u = 2
    return torch.where(greedy, argmax, tokens), torch.where(greedy, argmax == drafts, accepted)


def _resolve(host, p: VerifyPlan, draft_token_ids, states, want, top_n, drafted_q: bool) -> SpecOutput:
    """On the host: each row's emitted run up to its first rejection, its logprobs, and its seeded
    stream set to where plain decoding leaves it."""
    tokens, num_accepted, logprobs = [], [], []
    for i, d in enumerate(draft_token_ids):
        run, lps, s = [], [] if states[i].params.logprobs is not None else None, int(p.starts[i])
        for j in range(len(d) + 1):
            r = host[s + j]
            run.append(int(r[0]))
            if lps is not None:
                w = want[s + j]
                lp = dict(zip((int(t) for t in r[3 + top_n:3 + top_n + w]), r[3:3 + w]))
                lp[int(r[0])] = r[2]
                lps.append(lp)
            if j == len(d) or not r[1]:
                break
        tokens.append(run)
        num_accepted.append(len(run) - 1)
        logprobs.append(lps)
        if i in p.saved:                   # the draws plain decoding makes: one per token, and the fresh one of a rejection
            used = len(run) + (1 if drafted_q and len(run) <= len(d) else 0)
            g = states[i].generator
            g.set_state(p.saved[i])
            torch.rand(used, generator=g)
    return SpecOutput(tokens, num_accepted, logprobs)


def acceptance_probability(p_x, q_x):
    """min(1, p(x) / q(x)); q(x) = 0 (a draft its own distribution could not give) accepts iff p(x) > 0."""
    return torch.where(q_x > 0, (p_x / q_x.clamp(min=1e-30)).clamp(max=1), (p_x > 0).to(p_x.dtype))


def residual_probs(p, q):
    """normalize(max(p - q, 0)), rows [n, vocab]. Where p <= q everywhere (a rejection that has
    probability 0 but float rounding let through) p itself, the only sensible fallback."""
    r = (p - q).clamp_(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def target_weights(x, params: list, inv_temp=None, filters=None) -> torch.Tensor:
    """x: [n, vocab] processed logits, overwritten; params: one SamplingParams per row; inv_temp
    [n, 1] and filters [n, 3] already on x's device (built here when not given). Temperature,
    top-k / top-p / min-p, then exp((x - max) / T): the target's distribution, unnormalized, by
    the steps of sampler.draw."""
    if inv_temp is None:
        inv_temp = 1 / torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device).unsqueeze(1)
    scale_later = any(p.temperature not in (0, 1) for p in params)
    if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        x = sampler.apply_top_k_top_p_min_p(x.mul_(inv_temp), params, filters)     # [n, vocab]
        scale_later = False
    if sampler.csrc_ops(x):
        torch.ops.nanoserve_fused.exp_sub_max_(x, (inv_temp if scale_later else torch.ones_like(inv_temp)).view(-1))
        return x
    x = x.sub_(x.amax(dim=-1, keepdim=True))
    return (x.mul_(inv_temp) if scale_later else x).exp_()
