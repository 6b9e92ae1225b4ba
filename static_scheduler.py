"""
Static (request-level) batching: the baseline that continuous batching is measured against.
A reader learning the Orca loop can skip this file.

Take up to static_batch_size waiting requests, reserve each one's whole length
(prompt + max_tokens) up front, and admit nothing until every member has finished. Like
Hugging Face `generate` and other static batchers, the batch is padded to its longest member:
  - prompts are left-padded to the longest prompt: each shorter member owes that many
    throwaway rows, computed by a padding Sequence that shares the step's token budget with
    the real prompt chunks;
  - a member that finishes keeps its blocks and its slot, and costs one throwaway row every
    step until the last member ends.
Padding rows are ordinary rows of the ScheduledBatch whose Sequence has is_padding=True: the
engine computes them like any other, writes none of their K/V (slot -1), samples none of
them and leaves their num_computed_tokens alone (this file advances its own pad rows).
"""
from scheduler import ScheduledBatch, Scheduler, Sequence, Status


class StaticScheduler(Scheduler):
    def __init__(self, config, blocks):
        super().__init__(config, blocks)
        self.finished_members: list[Sequence] = []   # done, but hold their blocks until the batch ends
        self.prompt_pads: list[Sequence] = []        # one per short prompt: its left padding still owed
        self.last_pad_rows: list[tuple[Sequence, int]] = []

    def schedule(self) -> ScheduledBatch:
        self._advance_prompt_pads()
        if not self.running:
            self._admit_batch()
        batch = ScheduledBatch([], [])
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        for seq in self.finished_members:                  # one throwaway row each
            batch.seqs.append(seq)
            batch.num_tokens.append(1)
        for pad in self.prompt_pads:                       # left padding shares the token budget
            n = min(pad.num_uncomputed, budget)
            if n > 0:
                batch.seqs.append(pad)
                batch.num_tokens.append(n)
                self.last_pad_rows.append((pad, n))
                budget -= n
        return batch

    def remove(self, seq: Sequence):
        """A member that ends while others still run becomes a padding row and keeps its blocks;
        when the last member ends, every block of the batch returns to the pool."""
        if seq in self.running and len(self.running) > 1:
            self._retire(seq)
        else:
            super().remove(seq)
        if not self.running:                               # the static batch has ended
            for member in self.finished_members:
                self.blocks.free(member)
            self.finished_members.clear()
            self.prompt_pads.clear()

    def _retire(self, seq):
        self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.is_padding = True
        self.finished_members.append(seq)

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
                     status=Status.RUNNING, block_table=s.block_table, is_padding=True)
            for s in self.running if s.num_prompt_tokens < longest]

    def _advance_prompt_pads(self):
        """The engine leaves padding rows alone, so the pad rows computed last step are counted here."""
        for pad, n in self.last_pad_rows:
            pad.num_computed_tokens += n
        self.last_pad_rows.clear()
        self.prompt_pads = [p for p in self.prompt_pads if p.num_uncomputed > 0]
