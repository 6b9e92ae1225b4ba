"""
The sampler's state on the device, as vLLM's persistent input batch keeps it: every completion that
samples holds a slot from its first sampled token until it finishes, and the slot's row of persistent
device tensors holds its sampling parameters and, once any request has penalties, its output-token
counts and the mask of its prompt's tokens. Preemption keeps the slot: counts survive a recompute or
a swap. Rows change only when a completion joins; the counts change on the device, by the sampled ids.

A step stages into the model runner's packed upload (model_runner.py's InputBuffers) only what is new:
  - each sampled row's slot, and its logits row where n > 1 samples share one;
  - the rows that draw and their uniforms (greedy rows take an argmax only);
  - the grammar rows' bitmasks (llguidance fills them in the pinned buffer itself);
  - the parameters, prompt tokens and output counts of the completions that join.
sample() then runs on the device: joins written; grammar masks; penalties from the counts;
temperature, top-k, top-p, min-p and the draw (sampler.draw_rows: one CUDA launch, no sort); the
counts take the sampled ids (index_put_, accumulate); sampler.Sampled brings ids and logprobs down in
one copy. What shapes the work (which processors run, which rows draw) is decided on the host from
the params, never read back. logit_bias, allowed_token_ids, bad_words and min_tokens still run
sampler.py's host-indexed functions (copies of their own), on the rows that use them only. Seeded
streams stay CPU generators, so a seed gives the same tokens on any device: their uniforms go up.
Owns the slots and their tensors; the engine says when a completion leaves (release).
"""
from dataclasses import dataclass

import numpy as np
import torch

import sampler
from sampler import Sampled, SamplingState

INV_TEMP, TOP_K, TOP_P, MIN_P, REP, FREQ, PRES = range(7)     # columns of SamplingSlots.params
NUM_PARAMS = 8


@dataclass
class StagedSampling:
    """One step's sampler inputs: the rows' states (host) and device views of the packed upload."""
    states: list[SamplingState]
    slots: torch.Tensor                      # [k] int64, each row's slot
    rows: torch.Tensor | None                # [k] int64 logits row of each (None: row i is logits row i)
    draw: list[int]                          # the rows that draw (temperature > 0), on the host
    draw_rows: torch.Tensor | None           # [d] int64 (None when every row draws, or none)
    uniforms: torch.Tensor | None            # [d] float32
    grammar_rows: torch.Tensor | None        # [g] int64
    bitmask: torch.Tensor | None             # [g, vocab / 32] int32
    joins: tuple | None                      # (slots [j], params [j, 8], prompt [2, m], counts [3, c])


class SamplingSlots:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64):
        self.vocab, self.device = vocab_size, device
        self.params = torch.zeros((capacity, NUM_PARAMS), dtype=torch.float32, device=device)   # [cap, 8]
        self.counts = self.in_prompt = None          # [cap, vocab] int32 and bool, from the first penalties
        self.free = list(range(capacity - 1, -1, -1))

    @staticmethod
    def upload_bytes(max_rows: int, vocab_size: int, max_model_len: int) -> int:
        """What a step stages at most, in the usual case: per row a slot, a logits row, a draw row, a
        uniform, a grammar row and its bitmask, a join's parameters; the prompts of joins. Past it,
        InputBuffers sends the rest in a copy of its own (and says so)."""
        per_row = 8 * 4 + 4 + 4 * NUM_PARAMS + 4 * (-(-vocab_size // 32))
        return max_rows * per_row + 16 * 2 * max_model_len + 16 * 16

    # ------------------------------------------------------------------ host: slots and staging
    def release(self, state: SamplingState):
        """A completion left (finished, aborted, handed off): its slot is free. Safe one step ahead:
        the slot's next owner is written by a later step's upload, after every launched use."""
        if state.slot is not None:
            self.free.append(state.slot)
            state.slot = None

    def take(self) -> int:
        if not self.free:                                # grow: a rare join, when many wait preempted
            cap = len(self.params)
            self.params = torch.cat([self.params, torch.zeros_like(self.params)])
            if self.counts is not None:
                self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
                self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.free = list(range(2 * cap - 1, cap - 1, -1))
        return self.free.pop()

    def stage(self, buffers, states: list[SamplingState], rows: list[int] | None, generator) -> StagedSampling:
        """Stage a step's sampler inputs into buffers (model_runner.InputBuffers) before its flush.
        rows: each state's logits row (None: row i). The uniforms are drawn here, in the order
        sampler.sample draws them."""
        k = len(states)
        joins = self.join([s for s in states if s.slot is None], buffers)
        slots = buffers.stage_extra(np.fromiter((s.slot for s in states), dtype=np.int64, count=k))
        rows = None if rows is None or rows == list(range(k)) else buffers.stage_extra(np.asarray(rows, dtype=np.int64))
        draw = [i for i, s in enumerate(states) if s.params.temperature > 0]
        u = buffers.stage_extra(sampler.uniforms([states[i] for i in draw], generator)) if draw else None
        draw_rows = buffers.stage_extra(np.asarray(draw, dtype=np.int64)) if 0 < len(draw) < k else None
        grammar = [i for i, s in enumerate(states) if s.grammar is not None]
        grammar_rows = bitmask = None
        if grammar:
            from structured_output import fill_bitmasks           # llguidance: loaded with the first grammar
            host, bitmask = buffers.reserve((len(grammar), -(-self.vocab // 32)), torch.int32)
            fill_bitmasks([states[i].grammar for i in grammar], self.vocab, out=host)
            grammar_rows = buffers.stage_extra(np.asarray(grammar, dtype=np.int64))
        return StagedSampling(states, slots, rows, draw, draw_rows, u, grammar_rows, bitmask, joins)

    def join(self, states: list[SamplingState], buffers):
        """Give each new completion a slot; stage its parameters, and with penalties its prompt's
        tokens and its output counts so far (none, unless it was handed over mid-output)."""
        if not states:
            return None
        if self.counts is None and any(s.params.uses_penalties for s in states):
            self.counts = torch.zeros((len(self.params), self.vocab), dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros((len(self.params), self.vocab), dtype=torch.bool, device=self.device)
        for s in states:
            s.slot = self.take()
        params = [s.params for s in states]
        table = torch.zeros((len(states), NUM_PARAMS), dtype=torch.float32)         # [j, 8]
        table[:, INV_TEMP] = 1 / torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        table[:, TOP_K:MIN_P + 1] = sampler.row_filters(params, self.vocab)
        table[:, REP:PRES + 1] = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                               for p in params])
        prompt, counts = [np.zeros((2, 0), dtype=np.int64)], [np.zeros((3, 0), dtype=np.int64)]
        for s in states:                  # numpy finds the ids: no torch op, so nothing reads like a device
            if s.output_counts is not None:
                ids = np.flatnonzero(s.in_prompt.numpy())                            # [m] distinct prompt ids
                prompt.append(np.stack([np.full_like(ids, s.slot), ids]))
                out = s.output_counts.numpy()
                seen = np.flatnonzero(out)                                           # [c]
                counts.append(np.stack([np.full_like(seen, s.slot), seen, out[seen].astype(np.int64)]))
        slots = torch.tensor([s.slot for s in states], dtype=torch.int64)
        return tuple(buffers.stage_extra(t) for t in (slots, table, np.concatenate(prompt, 1), np.concatenate(counts, 1)))

    # ------------------------------------------------------------------ device: one step's sampling
    def write_joins(self, joins):
        """The joining slots' rows, on the device: parameters; counts and prompt mask reset, then set."""
        slots, table, prompt, counts = joins
        self.params.index_copy_(0, slots, table)
        if self.counts is None:
            return
        self.counts.index_fill_(0, slots, 0)
        self.in_prompt.index_fill_(0, slots, False)
        if prompt.shape[1]:
            self.in_prompt.index_put_((prompt[0], prompt[1]), torch.ones_like(prompt[0], dtype=torch.bool))
        if counts.shape[1]:
            self.counts.index_put_((counts[0], counts[1]), counts[2].int())

    def sample(self, logits: torch.Tensor, st: StagedSampling) -> Sampled:
        """logits: [num_logits, vocab] float32 (modified in place). sampler.sample_on_device's rules
        and order, on the slots' tensors; -> the step's Sampled (one copy down, started)."""
        if st.joins is not None:
            self.write_joins(st.joins)
        x = logits if st.rows is None else logits.index_select(0, st.rows)           # [k, vocab]
        states, params = st.states, [s.params for s in st.states]
        want = [p.logprobs for p in params]
        raw = x.log_softmax(dim=-1) if any(w is not None for w in want) else None   # [k, vocab]
        if st.bitmask is not None:
            from structured_output import apply_token_bitmask_rows_
            apply_token_bitmask_rows_(x, st.bitmask, st.grammar_rows)
        sampler.apply_allowed_and_bad_words(x, states)
        sampler.apply_min_tokens(x, states)
        sampler.apply_logit_bias(x, params)
        p = self.params.index_select(0, st.slots)                                    # [k, 8]
        if any(q.uses_penalties for q in params):       # rows without penalties come back unchanged
            x = sampler.penalize(x, self.counts.index_select(0, st.slots), self.in_prompt.index_select(0, st.slots),
                                 p[:, REP:REP + 1], p[:, FREQ:FREQ + 1], p[:, PRES:PRES + 1])
        tokens = self.draw(x, p, st, params)                                         # [k] int64
        if self.counts is not None:                    # the ids join their slots' counts on the device
            self.counts.index_put_((st.slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        packed = None if raw is None else sampler.pack_logprobs(raw, tokens, want)
        return Sampled(tokens, packed, want)

    @staticmethod
    def draw(x, p, st: StagedSampling, params) -> torch.Tensor:
        """Greedy rows: argmax only. Rows that draw: 1/T and filters from their slots, the staged uniforms."""
        k = len(params)
        if not st.draw:
            return sampler.greedy(x)
        if len(st.draw) == k:
            return sampler.draw_rows(x, params, torch.cat([p[:, :MIN_P + 1], st.uniforms.unsqueeze(1)], dim=1))
        tokens = sampler.greedy(x)                                                   # [k]
        d = st.draw_rows
        rows = torch.cat([p.index_select(0, d)[:, :MIN_P + 1], st.uniforms.unsqueeze(1)], dim=1)   # [d, 5]
        return tokens.index_copy_(0, d, sampler.draw_rows(x.index_select(0, d), [params[i] for i in st.draw], rows))
