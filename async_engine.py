"""
Overlapped scheduling (vLLM's async_scheduling): the host plans step N+1 while the device runs step N.

Engine.plain_step runs schedule -> run -> postprocess, each waiting for the one before, so the
device idles while the host schedules, builds inputs and processes outputs. One step() here runs
the same calls in another order, split where the device takes over:
  1. schedule N+1 and build its inputs. A sequence whose token from step N is still on the device
     ends its token_ids with PLACEHOLDER, so the scheduler sees one more token to compute, as if
     it had been appended;
  2. launch N+1's forward and sampling; rows whose input is N's token take it from N's sampled
     ids on the device (feed), with no round trip through the host;
  3. read N's tokens (the first wait for the device) and postprocess them: placeholders give way
     to tokens, stop strings, EOS and max_tokens retire sequences, outputs are built, one step late;
  4. mark N+1's tokens computed (land) and give its sampled rows their placeholders.
A sequence retired in 3 was computed once more in N+1: that token is dropped. Its blocks are
back in the pool already, which is safe: the device finishes N+1 before any later step that
reuses them (one stream), and the slot N+1 wrote lies past every token the block's next owner
or the prefix cache holds.
Penalty counts are kept on the device (sampling_slots.py), so penalties overlap. What needs the
host's copy of one token before the next step is planned (grammars, min_tokens, bad_words, prompt logprobs, the fork of n > 1 samples, speculative decoding, the static baseline,
tensor parallelism) runs Engine.plain_step for that step, after the pending step is postprocessed,
and says why once. Owns only the pending step; the requests, queues and blocks are Engine's.
"""
import functools
import sys
from dataclasses import dataclass, field

import numpy as np

from sampler import Sampled, sample_on_device
from scheduler import ScheduledBatch
from sequence import Completion, Status

PLACEHOLDER = -1      # a token id that is still on the device (never a real id: those are >= 0)


@dataclass
class InFlight:
    """A step launched on the device and not yet postprocessed."""
    batch: ScheduledBatch
    completions: list[Completion]            # one per sampled row, in row order
    sampled: Sampled                         # their tokens on the device, on their way to the host
    start: object = None                     # CUDA: an event before its first upload (PhaseTimes.device)
    row_of: dict[int, int] = field(default_factory=dict)   # seq_id -> row in sampled.tokens, placeholders only


class OverlapLoop:
    def __init__(self, engine):
        self.engine = engine
        engine.use_device_sampler()                          # penalty counts and the feed live on the device
        self.pending: InFlight | None = None
        self.num_overlapped = self.num_plain = 0             # steps of each kind (tests read them)

    def step(self):
        e = self.engine
        why = self.needs_plain_step()
        if why:
            _say_once(f"nanoserve: async_scheduling: plain steps while {why}")
            self.num_plain += 1
            return self.drain() + e.plain_step()
        batch = e.schedule()
        if not batch.seqs:                                   # everyone was preempted: only the swaps run
            e.kv_pool.run(batch.block_ops)
            return self.drain()
        launched = self.launch(batch)
        self.num_overlapped += 1
        outputs = self.drain()                               # step N's outputs while N+1 runs
        self.land(launched)
        self.pending = launched
        return outputs

    def needs_plain_step(self) -> str | None:
        """Why this step cannot overlap the last one, or None."""
        e = self.engine
        if e.speculator is not None:
            return "speculative decoding (drafts are proposed from the last token on the host)"
        if e.config.scheduler_mode == "static":
            return "scheduler_mode is 'static' (the baseline)"
        if e.config.tensor_parallel_size > 1:
            return "tensor parallelism (the ranks get token ids from the host)"
        if e.exporting or e.importing:
            return "requests are handed between engines"
        return next((why for req in e.requests.values() if (why := host_bound(req))), None)

    def launch(self, batch: ScheduledBatch) -> InFlight:
        """Inputs up, forward and sampling queued on the device; nothing read back."""
        e = self.engine
        start = e.phase_times.mark(e.device)
        completions = [c for i in batch.sample_rows for c in batch.seqs[i].request.completions
                       if c.seq is batch.seqs[i]]
        states = [c.sampling for c in completions]

        def stage(buffers):                                  # the feed and the sampler ride in the one upload
            feed = self.stage_feed(buffers, batch)
            sampling = e.device_sampler.stage(buffers, states, None, e.generator) if states else None
            return feed, sampling
        with e.phase_times.phase("prepare"):
            inputs = e.runner.prepare(batch, [], stage)
            feed, staged = inputs.extra
            if feed is not None:                             # N's tokens into N+1's inputs, on the device
                dst, src = feed
                inputs.input_ids.index_copy_(0, dst, self.pending.sampled.tokens.index_select(0, src))
        with e.phase_times.phase("forward"):
            logits = e.runner.forward(inputs)                # [num_sampled, vocab]
        with e.phase_times.phase("sample"):
            sampled = e.device_sampler.sample(logits, staged) if staged else sample_on_device(logits, [], e.generator)
        return InFlight(batch, completions, sampled, start=start)

    def stage_feed(self, buffers, batch: ScheduledBatch):
        """Where a row's last input is the pending step's token (its token_ids end with PLACEHOLDER):
        -> (positions in input_ids, rows of the pending step's sampled ids) staged in the upload, or None."""
        p = self.pending
        if p is None:
            return None
        dst, src, end = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            end += n
            if seq.token_ids[-1] == PLACEHOLDER:
                assert seq.num_computed_tokens + n == len(seq.token_ids), "a placeholder must be the row's last input"
                dst.append(end - 1)
                src.append(p.row_of[seq.seq_id])
        if not dst:
            return None
        return buffers.stage_extra(np.asarray(dst, dtype=np.int64)), buffers.stage_extra(np.asarray(src, dtype=np.int64))

    def drain(self) -> list:
        """Postprocess the pending step: its tokens replace their placeholders, then Engine.apply_tokens.
        A row whose sequence finished or was aborted since it was launched is dropped."""
        p, self.pending = self.pending, None
        if p is None:
            return []
        e = self.engine
        with e.phase_times.phase("wait"):
            tokens, logprobs = p.sampled.read()
        e.phase_times.add_device_span(p.start, p.sampled.event)
        live = []
        for c, tok, lp in zip(p.completions, tokens, logprobs):
            if c.seq.seq_id in p.row_of and c.finish_reason is None:
                assert c.seq.token_ids.pop() == PLACEHOLDER
                live.append((c, [tok], [lp]))
        if not live:
            return []
        completions, runs, lps = zip(*live)
        return e.apply_tokens(list(completions), list(runs), list(lps))

    def land(self, launched: InFlight):
        """The launched step's tokens are computed (in stream order); its live sampled rows hold placeholders."""
        e = self.engine
        with e.phase_times.phase("update"):
            e.finish_step(launched.batch)
            for row, c in enumerate(launched.completions):
                if c.seq.status is not Status.FINISHED:
                    c.seq.token_ids.append(PLACEHOLDER)
                    launched.row_of[c.seq.seq_id] = row


def host_bound(req) -> str | None:
    """Why a request's next step needs its last token on the host first, or None."""
    p = req.params
    if p.structured_outputs is not None:
        return "a grammar constrains a request (its mask follows the last token)"
    if p.min_tokens:
        return "a request has min_tokens"
    if p.bad_words:
        return "a request has bad_words (banned after its last tokens)"
    if p.prompt_logprobs is not None:
        return "a request asks for prompt logprobs"
    if p.n > 1 and req.completions[1].seq is None:
        return "n > 1 samples fork from their prompt"
    return None


@functools.cache
def _say_once(message: str):
    print(message, file=sys.stderr, flush=True)
