"""
Static (request-level) batching: the baseline that continuous batching is measured against.
A reader learning the Orca loop can skip this file; nothing in engine.py or scheduler.py knows it exists.

Take up to static_batch_size waiting requests, reserve each one's whole length
(prompt + max_tokens) up front, and admit nothing until every member has finished. Like
Hugging Face `generate` and other static batchers, the batch is padded to its longest member:
  - prompts are left-padded to the longest prompt: each shorter member owes that many
    throwaway rows, computed by a pad Sequence that shares the step's token budget with
    the real prompt chunks;
  - a member that finishes keeps its blocks and its slot, and costs one throwaway row every
    step until the last member ends.
Both kinds are the ScheduledBatch's scratch rows (its last num_scratch_rows): the engine computes
them like any other row, writes none of their K/V and samples none of them. This file owns their
bookkeeping: it advances its own pad rows (finish_step) and counts them for EngineStats (step_counts).
"""
from scheduler import ScheduledBatch, Scheduler, StepBounds
from sequence import Sequence, Status


class StaticScheduler(Scheduler):
    def __init__(self, config, blocks):
        super().__init__(config, blocks)
        self.finished_members: list[Sequence] = []   # done, but hold their blocks until the batch ends
        self.prompt_pads: list[Sequence] = []        # one per short prompt: its left padding still owed

    def schedule(self) -> ScheduledBatch:
        if not self.running:
            self._admit_batch()
        batch = ScheduledBatch([], [])
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        batch.sample_rows = self._rows_to_sample(batch)
        scratch = [(seq, 1) for seq in self.finished_members]        # one throwaway row each
        for pad in self.prompt_pads:                                 # left padding shares the token budget
            n = min(pad.num_uncomputed, budget)
            if n > 0:
                scratch.append((pad, n))
                budget -= n
        for seq, n in scratch:
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
        batch.num_scratch_rows = len(scratch)
        return batch

    def step_bounds(self) -> StepBounds:
        """Rows: the members, running or finished (B admitted, and n > 1 forks while max_num_seqs allows:
        M = max(B, max_num_seqs)), plus a prompt pad for each admitted prompt but the longest (B - 1): 2B - 1
        when B = max_num_seqs. Tokens: the budget (real rows and prompt pads share it) plus a row for each
        finished member (M - 1)."""
        b, members = self.config.static_batch_size, max(self.config.static_batch_size, self.config.max_num_seqs)
        return StepBounds(members + b - 1, self.config.max_num_batched_tokens + members - 1)

    def finish_step(self, batch: ScheduledBatch) -> list[Sequence]:
        """The real rows as usual; the pad rows computed this step are counted here (the engine
        leaves scratch rows alone)."""
        ready = super().finish_step(batch)
        real = batch.num_real_rows
        for seq, n in zip(batch.seqs[real:], batch.num_tokens[real:]):
            if seq.status is not Status.FINISHED:                    # a prompt pad, not a finished member
                seq.num_computed_tokens += n
        self.prompt_pads = [p for p in self.prompt_pads if p.num_uncomputed > 0]
        return ready

    def step_counts(self, batch: ScheduledBatch) -> dict:
        rows = list(zip(batch.seqs, batch.num_tokens))[batch.num_real_rows:]
        return super().step_counts(batch) | dict(
            num_padding_last_step=sum(n for s, n in rows if s.status is Status.FINISHED),
            num_prompt_padding_last_step=sum(n for s, n in rows if s.status is not Status.FINISHED))

    def all_sequences(self) -> list[Sequence]:
        return super().all_sequences() + self.finished_members

    def remove(self, seq: Sequence):
        """A member that ends while others still run becomes a scratch row and keeps its blocks;
        when the last member ends, every block of the batch returns to the pool."""
        if seq in self.running and len(self.running) > 1:
            self.running.remove(seq)
            seq.status = Status.FINISHED
            self.finished_members.append(seq)
        else:
            super().remove(seq)
        if not self.running:                               # the static batch has ended
            for member in self.finished_members:
                self.blocks.free(member)
            self.finished_members.clear()
            self.prompt_pads.clear()

    def _admit_batch(self):
        """Take up to B requests and reserve each one's whole length now."""
        while self.waiting and len(self.running) < self.config.static_batch_size:
            seq = self.waiting[0]
            full_len = min(seq.num_prompt_tokens + seq.max_tokens, self.config.max_model_len)
            if self.blocks.blocks_needed(full_len) > self.blocks.num_free_blocks():
                break
            self.waiting.popleft()
            seq.num_computed_tokens = 0
            self.blocks.allocate_slots(seq, full_len)      # fresh blocks: no copy-on-write to run
            seq.status = Status.RUNNING
            self.running.append(seq)
        longest = max((s.num_prompt_tokens for s in self.running), default=0)
        # a pad row reads its member's blocks (its output is thrown away) and writes nothing
        self.prompt_pads = [
            Sequence(-1, [s.token_ids[0]] * (longest - s.num_prompt_tokens), longest - s.num_prompt_tokens, 0,
                     status=Status.RUNNING, block_table=s.block_table)
            for s in self.running if s.num_prompt_tokens < longest]
