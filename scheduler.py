"""
The continuous-batching policy: which sequences run in the next forward pass, and how many
of their tokens.

Every step (Orca's iteration-level scheduling): each running sequence that is decoding gets
exactly one token; the rest of the token budget (max_num_batched_tokens) goes to prefill
work, chunked, so a long prompt is spread over several steps while decodes keep flowing;
waiting sequences are admitted while max_num_seqs and the KV pool (minus a small
watermark) allow. When a running sequence needs a block and none is free, the worst
running sequence (lowest priority, then latest arrival) is preempted: swapped to the host
pool when it has room, else its blocks are freed and it is recomputed later (prompt plus
the tokens it already generated), so nothing is lost and no output changes.

Owns the queues, the decision and the scheduler's part of the configuration. Does not build
tensors or sample (engine.py) and does not pick block ids (kv_cache.py): block operations
(copy-on-write copies, swaps) come back from the block manager and travel to the engine in
the ScheduledBatch. Everything is in tokens: a sequence is just token_ids and
num_computed_tokens, so prefill, chunked prefill, decode and recompute are one case.
Speculative decoding (spec_decode.py): a decode row with k drafts (seq.spec_token_ids) costs
1 + k tokens and slots; drafts are dropped, never a reason to preempt (_fit_drafts), and
accept_drafts rolls a verified row's cache back to what was accepted.
The request-level baseline that this loop replaces lives apart, in static_scheduler.py.
"""
from collections import deque
from dataclasses import dataclass, field

from kv_cache import BlockManager, BlockOp, rollback_num_blocks
from sequence import Sequence, Status, need


@dataclass
class SchedulerConfig:
    """The scheduler's part of the engine's configuration (EngineConfig extends it)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512    # per-step token budget; prompts longer than it are chunked
    max_model_len: int | None = None     # default: the model's context length (the engine fills it in)
    scheduler_mode: str = "continuous"   # continuous | static (static_scheduler.py, the baseline)
    static_batch_size: int = 8
    scheduling_policy: str = "fcfs"      # fcfs | priority | lpm
    preemption_mode: str = "recompute"   # recompute | swap
    watermark: float = 0.01              # share of blocks kept free at admission, so decodes can grow
    lpm_max_waited_steps: int = 32       # lpm: a request passed over this often goes first

    def validate(self):
        for name, ok, allowed in [
                ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
                ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
                ("scheduler_mode", self.scheduler_mode in ("continuous", "static"), "'continuous' or 'static'"),
                ("static_batch_size", self.static_batch_size >= 1, ">= 1"),
                ("scheduling_policy", self.scheduling_policy in ("fcfs", "priority", "lpm"),
                 "'fcfs', 'priority' or 'lpm'"),
                ("preemption_mode", self.preemption_mode in ("recompute", "swap"), "'recompute' or 'swap'"),
                ("watermark", 0 <= self.watermark < 1, "in [0, 1)")]:
            need(ok, name, allowed, getattr(self, name))


@dataclass
class ScheduledBatch:
    """One step's work, in batch order. The engine computes every row; it writes the K/V of all
    but the scratch rows and samples a token for each of sample_rows."""
    seqs: list[Sequence]
    num_tokens: list[int]                 # tokens of each to compute this step
    block_ops: list[BlockOp] = field(default_factory=list)   # copies and swaps to run before the forward
    num_preempted: int = 0
    sample_rows: list[int] = field(default_factory=list)     # rows whose chunk reaches the end of their tokens
    num_scratch_rows: int = 0             # trailing rows computed and thrown away: no K/V written, never sampled

    @property
    def num_real_rows(self) -> int:
        return len(self.seqs) - self.num_scratch_rows


@dataclass(frozen=True)
class StepBounds:
    """The most rows and tokens any step of a scheduler can hold: the model runner sizes its persistent
    buffers and CUDA graph buckets from these once, so no step outgrows them."""
    max_rows: int
    max_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.watermark_blocks = int(config.watermark * blocks.num_blocks)

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def remove(self, seq: Sequence):
        """A finished or aborted sequence leaves its queue and returns its blocks this step."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.blocks.free_host(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def fork(self, parent: Sequence, child: Sequence):
        """n > 1: a new sample starts running beside its parent, sharing its blocks, if max_num_seqs
        leaves it a slot. Else it waits like any sequence (first in line: it arrived with its
        parent), its prompt uncomputed; at admission the prefix cache gives it the prompt's full
        blocks, so only the tail is computed again."""
        if len(self.running) >= self.config.max_num_seqs:
            child.num_computed_tokens = 0
            self.waiting.appendleft(child)
            return
        self.blocks.fork(parent, child)
        child.status = Status.RUNNING
        self.running.append(child)

    def step_bounds(self) -> StepBounds:
        """Rows: only running sequences run, and admission, swap-in and fork stop at max_num_seqs. Tokens:
        every row's tokens, drafts included (_fit_drafts), come out of the max_num_batched_tokens budget."""
        return StepBounds(self.config.max_num_seqs, self.config.max_num_batched_tokens)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.num_preempted:                        # memory is short: admit nobody this step
            budget = self._swap_in(batch, budget)          # swapped sequences come back before new ones
            self._admit_waiting(batch, budget)
        batch.sample_rows = self._rows_to_sample(batch)
        return batch

    def _rows_to_sample(self, batch) -> list[int]:
        return [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if seq.num_computed_tokens + n - seq.num_spec_tokens == len(seq.token_ids)]

    def _schedule_running(self, batch, budget) -> int:
        """Running sequences, best first: decodes (1 token) before chunks of prefill."""
        order = sorted(self.running, key=lambda s: (s.num_uncomputed > 1, self._rank(s)))
        num_decodes = sum(1 for s in order if s.num_uncomputed == 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:          # preempted earlier in this loop
                continue
            num_decodes -= seq.num_uncomputed == 1
            n = min(seq.num_uncomputed, budget)
            if seq.spec_token_ids:
                n += self._fit_drafts(seq, budget, num_decodes)
            if not self._make_room(seq, n, batch):
                continue                                   # seq itself was preempted
            batch.block_ops += self.blocks.allocate_slots(seq, n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return budget

    def _fit_drafts(self, seq, budget, num_decodes_left) -> int:
        """How many of a decode row's drafts run this step: as many as the budget holds after one
        token for itself and for each decode still to schedule, and none unless their slots fit
        in free blocks with one block to spare per such decode. Drafts never preempt anyone."""
        assert seq.num_uncomputed == 1, "only a decode row carries drafts"
        del seq.spec_token_ids[max(0, budget - 1 - num_decodes_left):]
        if not self.blocks.can_allocate(seq, 1 + seq.num_spec_tokens, reserve=num_decodes_left):
            seq.spec_token_ids = []
        return seq.num_spec_tokens

    def finish_step(self, batch: ScheduledBatch) -> list[Sequence]:
        """After the forward pass: the scheduled tokens are in the cache. Returns the sequences
        of sample_rows: each samples its next token now. A row's drafts are not counted computed
        (so no prefix-cache block ever holds one): accept_drafts counts the accepted ones."""
        real = batch.num_real_rows
        for seq, n in zip(batch.seqs[:real], batch.num_tokens[:real]):
            if seq.status is Status.FINISHED:           # async scheduling: retired while its step ran
                continue
            seq.num_computed_tokens += n - seq.num_spec_tokens
            self.blocks.cache_full_blocks(seq)
        return [batch.seqs[i] for i in batch.sample_rows]

    def accept_drafts(self, seq: Sequence, num_accepted: int):
        """After verification: the accepted drafts' K/V are valid; blocks that only rejected drafts
        reached go back to the pool. Rejected slots in kept blocks lie past num_computed_tokens:
        nobody reads them and the next tokens overwrite them. The accepted ones' full blocks are
        registered by the next finish_step, once their tokens are in token_ids."""
        drop = rollback_num_blocks(seq.num_computed_tokens, num_accepted, self.blocks.block_size,
                                   len(seq.block_table))
        self.blocks.free_tail(seq, drop)
        seq.num_computed_tokens += num_accepted
        seq.spec_token_ids = []

    def step_counts(self, batch: ScheduledBatch) -> dict:
        """The step's rows and tokens, as EngineStats names them (taken before the step retires anyone)."""
        real = batch.num_real_rows
        return dict(num_seqs_last_step=real, num_batched_tokens_last_step=sum(batch.num_tokens[:real]))

    def all_sequences(self) -> list[Sequence]:
        """Every sequence that may hold blocks (check_invariants counts their tables)."""
        return list(self.running) + list(self.waiting) + list(self.swapped)

    def _rank(self, seq):
        """Order for running and for picking victims: lower priority value and earlier arrival win."""
        return (seq.priority, seq.arrival_time, seq.seq_id)

    def _make_room(self, seq, n, batch) -> bool:
        """Preempt the worst running sequences until seq can get blocks for n more tokens.
        Returns False if seq itself had to be preempted."""
        while not self.blocks.can_allocate(seq, n):
            victim = max((s for s in self.running if s not in batch.seqs), key=self._rank)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq, batch):
        self.running.remove(seq)
        seq.spec_token_ids = []                            # drafts never outlive a preemption
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.num_preempted += 1
        if self.config.preemption_mode == "swap" and self.blocks.can_swap_out(seq):
            batch.block_ops += self.blocks.swap_out(seq)
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
        else:                                              # recompute: drop the KV, keep the tokens
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    def _swap_in(self, batch, budget) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed, budget)
            extra = self.blocks.blocks_needed(seq.num_computed_tokens + n) - len(seq.host_block_table)
            if not self.blocks.can_swap_in(seq, reserve=max(extra, 0) + self.watermark_blocks):
                break
            self.swapped.popleft()
            batch.block_ops += self.blocks.swap_in(seq)
            batch.block_ops += self.blocks.allocate_slots(seq, n)
            self._start(seq, n, batch)
            budget -= n
        return budget

    def _start(self, seq, n, batch):
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_tokens.append(n)

    def _admit_waiting(self, batch, budget):
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._next_waiting()
            if not self._fits(seq, budget):
                budget = self._preempt_for(seq, budget, batch)
                if budget is None:
                    break
            self.waiting.remove(seq)
            cached = self.blocks.take_cached_prefix(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            n = min(seq.num_uncomputed, budget)
            batch.block_ops += self.blocks.allocate_slots(seq, n)
            self._start(seq, n, batch)
            budget -= n
        for seq in self.waiting:
            seq.waited_steps += 1

    def _fits(self, seq, budget) -> bool:
        """Can seq be admitted with its first chunk and still leave the watermark free?"""
        cached = self.blocks.num_cached_tokens(seq)
        needed = self.blocks.admission_cost(seq, min(len(seq.token_ids) - cached, budget))
        return needed + self.watermark_blocks <= self.blocks.num_free_blocks()

    def _preempt_for(self, seq, budget, batch) -> int | None:
        """Priority policy: a waiting request may push out running ones of lower priority to make
        room. A victim already scheduled this step leaves the batch and gives its tokens back to the
        budget (its block ops still run: they copy into blocks nobody reads). Returns the budget
        once seq fits, None if it cannot be made to."""
        if self.config.scheduling_policy != "priority":
            return None
        while not self._fits(seq, budget):
            victims = [s for s in self.running if s.priority > seq.priority]
            if not victims:
                return None
            victim = max(victims, key=self._rank)
            if victim in batch.seqs:
                row = batch.seqs.index(victim)
                budget += batch.num_tokens.pop(row)
                batch.seqs.pop(row)
            self._preempt(victim, batch)
        return budget

    def _next_waiting(self) -> Sequence:
        policy = self.config.scheduling_policy
        if policy == "fcfs":
            return self.waiting[0]
        if policy == "priority":
            return min(self.waiting, key=self._rank)
        # lpm: the longest cached prefix first, but anyone passed over too often goes first
        starving = [s for s in self.waiting if s.waited_steps >= self.config.lpm_max_waited_steps]
        if starving:
            return min(starving, key=self._rank)
        return max(self.waiting, key=lambda s: (self.blocks.num_cached_tokens(s), -s.arrival_time, -s.seq_id))
