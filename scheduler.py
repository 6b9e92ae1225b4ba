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

A "static" mode does request-level batching instead, for comparison: take up to B
requests, reserve each one's maximum length up front, admit nothing until all finish. Like
Hugging Face `generate` and other static batchers, the batch is padded to its longest member:
prompts are padded to the longest prompt (each member computes that many throwaway rows at
the start), and a member that finishes keeps its slot as a padding row, recomputing a
throwaway token every step, until the last one ends.

Owns the queues and the decision. Does not build tensors or sample (engine.py) and does
not pick block ids (kv_cache.py). Everything is in tokens: a sequence is just token_ids
and num_computed_tokens, so prefill, chunked prefill, decode and recompute are one case.
"""
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from kv_cache import BlockManager


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]                  # prompt + generated so far
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0                     # lower runs first
    arrival_time: float = 0.0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)   # where it sits while swapped
    block_hashes: list[int] = field(default_factory=list)       # prefix-cache hash of each full block
    num_preemptions: int = 0
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache at admission
    waited_steps: int = 0                 # lpm: times it was passed over
    request: object = None                # engine.Request this sequence belongs to

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    mode: str = "continuous"             # or "static"
    static_batch_size: int = 8
    policy: str = "fcfs"                 # fcfs | priority | lpm
    preemption_mode: str = "recompute"   # recompute | swap
    watermark: float = 0.01              # share of blocks kept free at admission, so decodes can grow
    lpm_max_waited_steps: int = 32       # lpm: a request passed over this often goes first


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]                  # in batch order
    num_tokens: list[int]                 # tokens of each to compute this step
    num_preempted: int = 0
    padding: list[Sequence] = field(default_factory=list)   # static mode: finished rows still computed
    prompt_padding: list[tuple[Sequence, int]] = field(default_factory=list)   # static: (member, pad rows)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.padding: list[Sequence] = []        # static mode: finished members that keep their slot
        self.prompt_padding_owed: list[list] = []   # static: [member, pad rows its prompt still owes]
        self.num_preemptions = 0
        self.watermark_blocks = int(config.watermark * blocks.num_blocks)

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def remove(self, seq: Sequence):
        """A finished or aborted sequence leaves its queue and returns its blocks this step
        (in static mode: when its whole batch has ended)."""
        was_running = seq in self.running
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.host_block_table:
            self.blocks.free_host_blocks.extend(seq.host_block_table)
            seq.host_block_table = []
        seq.status = Status.FINISHED
        if self.config.mode == "static" and was_running and self.running:
            self.padding.append(seq)                       # keeps its blocks and its slot
            return
        self.blocks.free(seq)
        if not self.running:                               # the static batch has ended
            for pad in self.padding:
                self.blocks.free(pad)
            self.padding.clear()

    def fork(self, parent: Sequence, child: Sequence):
        """n > 1: a new sample starts running beside its parent, sharing its blocks."""
        self.blocks.fork(parent, child)
        child.status = Status.RUNNING
        self.running.append(child)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.config.max_num_batched_tokens
        if self.config.mode == "static" and not self.running:
            self._admit_static_batch()
        # 1) running sequences, best first: decodes (1 token) before chunks of prefill
        order = sorted(self.running, key=lambda s: (s.num_uncomputed > 1, self._rank(s)))
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:          # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            if not self._make_room(seq, n, batch):
                continue                                   # seq itself was preempted
            self.blocks.allocate_slots(seq, n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        if self.config.mode == "static":
            batch.padding = list(self.padding)
            self._schedule_prompt_padding(batch, budget)
            return batch
        if batch.num_preempted:
            return batch                                   # memory is short: admit nobody this step
        # 2) swapped sequences come back before new ones are admitted
        budget = self._swap_in(batch, budget)
        # 3) admit waiting sequences
        self._admit_waiting(batch, budget)
        return batch

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
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.num_preempted += 1
        if self.config.preemption_mode == "swap" and self.blocks.can_swap_out(seq):
            self.blocks.swap_out(seq)
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
            self.blocks.swap_in(seq)
            self.blocks.allocate_slots(seq, n)
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
            if not self._fits(seq, budget) and not self._preempt_for(seq, budget, batch):
                break
            self.waiting.remove(seq)
            cached = self.blocks.take_cached_prefix(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            n = min(seq.num_uncomputed, budget)
            self.blocks.allocate_slots(seq, n)
            self._start(seq, n, batch)
            budget -= n
        for seq in self.waiting:
            seq.waited_steps += 1

    def _fits(self, seq, budget) -> bool:
        """Can seq be admitted with its first chunk and still leave the watermark free?"""
        cached = self.blocks.num_cached_tokens(seq)
        needed = self.blocks.admission_cost(seq, min(len(seq.token_ids) - cached, budget))
        return needed + self.watermark_blocks <= self.blocks.num_free_blocks()

    def _preempt_for(self, seq, budget, batch) -> bool:
        """Priority policy: a waiting request may push out running ones of lower priority
        (not yet scheduled this step) to make room."""
        if self.config.policy != "priority":
            return False
        while not self._fits(seq, budget):
            victims = [s for s in self.running if s not in batch.seqs and s.priority > seq.priority]
            if not victims:
                return False
            self._preempt(max(victims, key=self._rank), batch)
        return True

    def _next_waiting(self) -> Sequence:
        policy = self.config.policy
        if policy == "fcfs":
            return self.waiting[0]
        if policy == "priority":
            return min(self.waiting, key=self._rank)
        # lpm: the longest cached prefix first, but anyone passed over too often goes first
        starving = [s for s in self.waiting if s.waited_steps >= self.config.lpm_max_waited_steps]
        if starving:
            return min(starving, key=self._rank)
        return max(self.waiting, key=lambda s: (self.blocks.num_cached_tokens(s), -s.arrival_time, -s.seq_id))

    # ------------------------------------------------------------------ static batching
    def _admit_static_batch(self):
        """Request-level batching: take up to B requests and reserve each one's whole length now."""
        while self.waiting and len(self.running) < self.config.static_batch_size:
            seq = self.waiting[0]
            full_len = min(seq.num_prompt_tokens + seq.max_tokens, self.config.max_model_len)
            if self.blocks.blocks_needed(full_len) > self.blocks.num_free_blocks():
                break
            self.waiting.popleft()
            seq.num_computed_tokens = 0
            self.blocks.allocate_slots(seq, full_len)
            seq.status = Status.RUNNING
            self.running.append(seq)
        longest = max((s.num_prompt_tokens for s in self.running), default=0)
        self.prompt_padding_owed = [[s, longest - s.num_prompt_tokens] for s in self.running]

    def _schedule_prompt_padding(self, batch, budget):
        """Left padding's cost: pad rows share the step's token budget with the real prompt chunks."""
        for entry in self.prompt_padding_owed:
            seq, n = entry[0], min(entry[1], budget)
            if n > 0 and seq.status is Status.RUNNING:
                batch.prompt_padding.append((seq, n))
                entry[1] -= n
                budget -= n
