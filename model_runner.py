"""
The model runner: one step's ScheduledBatch in, logits out.

It packs the scheduled tokens of every row into flat tensors, with no padding between rows:
input ids, positions, and the AttentionMetadata every layer reads (slot mapping, block tables,
context lengths, query offsets). Then it runs the block copies the scheduler asked for and the
model, with logits only for the rows that need them (the rows that sample, plus any prompt-
logprob rows the engine names). Owns the step's device inputs and the KV pool's tensors; does
not decide what runs (scheduler.py), pick blocks (kv_cache.py) or sample (sampler.py).
"""
from dataclasses import dataclass

import numpy as np
import torch

from kv_cache import KVCachePool
from paged_attention import AttentionMetadata
from scheduler import ScheduledBatch
from sequence import Sequence


@dataclass
class StepInputs:
    """One forward pass's inputs, on the device."""
    input_ids: torch.Tensor         # [num_tokens]
    positions: torch.Tensor         # [num_tokens]
    meta: AttentionMetadata
    logits_rows: torch.Tensor       # [num_logits] flat-batch rows that get logits


class ModelRunner:
    def __init__(self, model, kv_pool: KVCachePool, block_size: int, device: torch.device, attention_backend: str):
        self.model, self.kv_pool, self.block_size = model, kv_pool, block_size
        self.device, self.attention_backend = device, attention_backend

    def prepare(self, batch: ScheduledBatch, extra_rows: list[int] = ()) -> StepInputs:
        """Run the step's block copies (swaps, copy-on-write: before the forward reads the blocks),
        then pack the scheduled tokens of every row into flat tensors. Logits go to the last token of
        each row to sample, then to the flat-batch rows in extra_rows (prompt logprobs), in that order.
        Per-row Python only: positions and slots for all tokens are computed as tensors."""
        self.kv_pool.run(batch.block_ops)
        bs, seqs = self.block_size, batch.seqs
        starts = [s.num_computed_tokens for s in seqs]
        # a row with drafts (spec_decode.py) is a decode: its last token, then its drafts
        # (its slice of token_ids stops at the end: n counts the drafts too)
        input_ids = [t for s, a, n in zip(seqs, starts, batch.num_tokens) for t in s.token_ids[a:a + n] + s.spec_token_ids]
        q_lens = torch.tensor(batch.num_tokens)                                   # [num_rows]
        ctx_lens = torch.tensor(starts) + q_lens                                  # [num_rows]
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])                                      # [num_rows + 1]
        # numpy's repeat: ~3 us; torch.repeat_interleave on CPU takes 0.3-2 ms (it goes parallel)
        row = torch.from_numpy(np.repeat(np.arange(len(seqs)), batch.num_tokens))   # [num_tokens] row of each token
        positions = ctx_lens[row] - q_lens[row] + (torch.arange(len(row)) - qsl[row])   # [num_tokens]
        # a scratch row may read past its own table: the width covers every context
        width = max(max(len(s.block_table) for s in seqs), -(-int(ctx_lens.max()) // bs))
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                              dtype=torch.int64)                                  # [num_rows, width]
        slots = tables[row, positions // bs] * bs + positions % bs              # [num_tokens]
        if batch.num_scratch_rows:
            slots[qsl[batch.num_real_rows]:] = -1                                # computed, never cached
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), block_tables=tables.to(dev, torch.int32),
            context_lens=ctx_lens.to(dev, torch.int32), query_start_loc=qsl.to(dev, torch.int32),
            backend=self.attention_backend)
        logits_rows = torch.cat([self.sample_logits_rows(batch, qsl), torch.tensor(extra_rows, dtype=torch.int64)])
        return StepInputs(torch.tensor(input_ids).to(dev), positions.to(dev), meta, logits_rows.to(dev))

    @staticmethod
    def sample_logits_rows(batch: ScheduledBatch, qsl) -> torch.Tensor:
        """The flat-batch rows whose logits sample: each sampled row's last token, and for a row with
        k drafts its last 1 + k tokens (verification reads the target at every drafted position)."""
        ends = qsl[1:][batch.sample_rows]                                         # [num_sampled] one past each row
        spans = [batch.seqs[i].num_spec_tokens for i in batch.sample_rows]
        if not any(spans):
            return ends - 1
        return torch.cat([torch.arange(e - 1 - k, e) for e, k in zip(ends.tolist(), spans)])   # [sum(1 + k)]

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Float32 logits [num_logits, vocab]."""
        return self.model(inputs.input_ids, inputs.positions, self.kv_pool.kv_caches, inputs.meta, inputs.logits_rows)

    def forward_cached(self, seq: Sequence, lo: int, hi: int) -> torch.Tensor:
        """Logits [hi - lo, vocab] at positions [lo, hi) of seq, whose K/V already sit in its cached
        blocks: one extra forward that reads the cache and writes nothing (slot -1)."""
        dev, q = self.device, hi - lo
        meta = AttentionMetadata(
            slot_mapping=torch.full((q,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([seq.block_table], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([hi], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, q], dtype=torch.int32, device=dev), backend=self.attention_backend)
        return self.model(torch.tensor(seq.token_ids[lo:hi], device=dev), torch.arange(lo, hi, device=dev),
                          self.kv_pool.kv_caches, meta, torch.arange(q, device=dev))
