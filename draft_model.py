"""
The draft model of speculative decoding (speculative_config method "draft_model"): a smaller Llama
with the target's tokenizer, on a paged KV cache of its own in the same engine, that proposes each
row's next k tokens by running k short steps of its own before the target's one verification pass.

Owns the draft model, its KV pool and block manager, and one draft Sequence per target sequence
(a copy of the target's token ids and the draft cache's own computed count). Its forwards go
through ModelRunner, like the target's. Does not schedule, verify or touch the target's cache:
spec_decode.Speculator calls propose() and remove(); spec_decode.verify accepts the returned q.
One propose(): a first forward catches every row up on the tokens the target appended since its last
proposal (accepted drafts are recomputed: simpler than keeping their K/V, and a few more query tokens
cost a small model little; rows far behind first catch up in forwards within the target's token
budget), then one-token forwards until each row has its drafts. On a GPU those one-token
forwards replay CUDA graphs (ModelRunner.capture_graphs).
Drafts come from q = softmax(logits / T) drawn with the row's own generator (greedy rows: argmax).
A row that finds no room in the draft pool, even after the sequences not drafting now gave theirs
back, drafts less (or nothing) this step.
"""
import torch

import sampler
from kv_cache import BlockManager, KVCachePool
from model_runner import ModelRunner
from scheduler import ScheduledBatch, StepBounds
from sequence import Sequence, need
from weights import load_model


class DraftModelProposer:
    def __init__(self, path: str, dtype, device, attention_backend: str, num_blocks: int, block_size: int,
                 vocab_size: int, bounds: StepBounds, max_model_len: int, enforce_eager: bool = False):
        """bounds, max_model_len: the target engine's (its scheduler's step_bounds): a draft step has at most
        its rows, and catch-up forwards are cut to its tokens, so the draft runner's buffers hold every step."""
        model, mc, _ = load_model(path, dtype, device)
        need(mc.vocab_size == vocab_size, "speculative_config.model",
             f"a model with the target's vocabulary ({vocab_size} tokens)", mc.vocab_size)
        model.prepare()
        pool = KVCachePool(mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim,
                           dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, pool, block_size, device, attention_backend, bounds.max_rows,
                                  bounds.max_tokens, max_model_len, enforce_eager)
        self.runner.capture_graphs()      # its one-token steps replay graphs, as the target's decode steps do
        self.seqs: dict[int, Sequence] = {}                 # target seq_id -> its draft-cache record

    def propose(self, keys: list, token_ids: list[list[int]], max_drafts: list[int], states: list,
                generator: torch.Generator | None):
        """Per row up to max_drafts[i] drafts, and q [k_i, vocab] of a sampled row (None: greedy or none)."""
        rows = [self._sync(key, ids) for key, ids in zip(keys, token_ids)]
        drafts, probs = [[] for _ in keys], [[] for _ in keys]
        live = [i for i, m in enumerate(max_drafts) if m > 0]
        self._catch_up([rows[i] for i in live], keys)
        while live:
            live = [i for i in live if self._make_room(rows[i], keys)]
            if not live:
                break
            seqs = [rows[i] for i in live]
            batch = ScheduledBatch(seqs, [s.num_uncomputed for s in seqs], sample_rows=list(range(len(seqs))))
            logits = self.runner.forward(self.runner.prepare(batch))           # [len(live), vocab]
            tokens, q = self._draw(logits, [states[i] for i in live], generator)
            for n, (i, s) in enumerate(zip(live, seqs)):
                s.num_computed_tokens = len(s.token_ids)
                s.token_ids.append(tokens[n])
                drafts[i].append(tokens[n])
                if q[n] is not None:
                    probs[i].append(q[n])
            live = [i for i in live if len(drafts[i]) < max_drafts[i]]
        for s, ids in zip(rows, token_ids):                 # keep the K/V of the real tokens, not the drafts'
            self._rewind(s, len(ids))
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _catch_up(self, seqs: list[Sequence], drafting: list):
        """Rows far behind (one new to the draft cache: its whole prompt) first compute all but their last
        token, in forwards of at most the runner's tokens, so the first drafting forward (every row's
        remaining tokens) fits the runner's buffers too. These forwards sample nothing."""
        limit = self.runner.buffers.max_tokens
        while sum(s.num_uncomputed for s in seqs) > limit:
            chunk, budget = [], limit
            for s in seqs:
                n = min(s.num_uncomputed - 1, budget)
                if n > 0 and self._make_room(s, drafting):
                    chunk.append((s, n))
                    budget -= n
                if budget == 0:
                    break
            if not chunk:                                   # no room: the drafting loop drops those rows
                return
            batch = ScheduledBatch([s for s, _ in chunk], [n for _, n in chunk])      # no sample rows
            self.runner.forward(self.runner.prepare(batch))
            for s, n in chunk:
                s.num_computed_tokens += n

    def _make_room(self, s: Sequence, drafting: list) -> bool:
        """Slots for s's next tokens, taken now. When the pool is short, sequences not drafting this
        step (paused, preempted, waiting) give their draft caches back: they catch up when they draft."""
        drafting = set(drafting)
        for key in [k for k in self.seqs if k not in drafting]:
            if self.blocks.can_allocate(s, s.num_uncomputed):
                break
            self.remove(key)
        if not self.blocks.can_allocate(s, s.num_uncomputed):
            return False
        copies = self.blocks.allocate_slots(s, s.num_uncomputed)
        assert not copies, "draft sequences never share a block, so nothing is copied on write"
        return True

    def _sync(self, key, ids: list[int]) -> Sequence:
        s = self.seqs.get(key)
        if s is None:
            s = self.seqs[key] = Sequence(key, [], len(ids), 0)
        s.token_ids = list(ids)
        s.num_computed_tokens = min(s.num_computed_tokens, len(ids) - 1)   # at least the last token runs
        return s

    def _rewind(self, s: Sequence, num_tokens: int):
        del s.token_ids[num_tokens:]
        s.num_computed_tokens = min(s.num_computed_tokens, num_tokens)
        self.blocks.free_tail(s, len(s.block_table) - self.blocks.blocks_needed(s.num_computed_tokens))

    @staticmethod
    def _draw(logits, states, generator):
        """logits [n, vocab] -> (tokens, q): greedy rows take the argmax (q None: a point mass); sampled
        rows draw from q = softmax(logits / T), one uniform from the row's stream (sampler.uniforms)."""
        tokens = sampler.greedy(logits).tolist()
        q = [None] * len(states)
        rows = [n for n, s in enumerate(states) if s.params.temperature > 0]
        if rows:
            temps = torch.tensor([[states[n].params.temperature] for n in rows], device=logits.device)   # [r, 1]
            p = (logits[rows] / temps).softmax(dim=-1)                                   # [r, vocab]
            drawn = sampler.inverse_cdf(p, sampler.uniforms([states[n] for n in rows], generator).to(p.device))
            for m, (n, t) in enumerate(zip(rows, drawn.tolist())):
                tokens[n], q[n] = t, p[m]
        return tokens, q

    def check_invariants(self, live_keys: set):
        assert set(self.seqs) <= live_keys, "a draft cache outlived its sequence"
        self.blocks.check_invariants(list(self.seqs.values()))

    def remove(self, key):
        s = self.seqs.pop(key, None)
        if s is not None:
            self.blocks.free(s)
