"""
The model runner: one step's ScheduledBatch in, logits out.

It packs the scheduled tokens of every row into flat host arrays, with no padding between rows:
input ids, positions, and the AttentionMetadata every layer reads (slot mapping, block tables,
context lengths, query offsets). It checks them once, plans the CUDA kernels' launch on the host
(paged_attention.plan_cuda_launch), and uploads them all into persistent device buffers with one
copy (InputBuffers, at the end of this file: non_blocking, from pinned memory, on a GPU; of the block tables only the rows
that changed, and whatever a caller stages beside them: the sampler's numbers), so the forward reads
nothing back. The buffers are sized once, from the most rows and tokens any step of the engine's
scheduler can hold (Scheduler.step_bounds); a step past them (none the engine's scheduler makes) runs
eagerly on one-off buffers, and the persistent buffers and graphs stay. On a GPU every step replays a CUDA
graph captured at the smallest bucket that fits (select_graph): decode-only steps (static
batching's scratch rows included) by rows, verify steps by rows of 1 + k tokens, and any other
step, prefill and decode mixed, by its total tokens; padding has slot -1 and context 0 and its
logits are never read. A step no bucket takes runs eagerly on the same buffers, counted by reason
(eager_steps); on a CPU every step runs eagerly. Then the model runs, with logits only for the
rows that need them (the rows that sample, plus any prompt-logprob rows the engine names). Owns
the step's device inputs, the graphs and the KV pool's tensors; does not decide what runs
(scheduler.py), pick blocks (kv_cache.py) or sample (sampler.py).
"""
import collections
import functools
import math
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

import paged_attention as pa
from kv_cache import KVCachePool
from paged_attention import AttentionMetadata, CudaPlan
from scheduler import ScheduledBatch
from sequence import Sequence

@dataclass
class StepInputs:
    """One forward pass's inputs, on the device (views of the runner's persistent buffers)."""
    input_ids: torch.Tensor         # [num_tokens] (padded to the graph's bucket when graph is set)
    positions: torch.Tensor         # [num_tokens]
    meta: AttentionMetadata
    logits_rows: torch.Tensor       # [num_logits] flat-batch rows that get logits
    num_logits: int = 0             # rows of logits the engine reads (the rest are padding)
    graph: "CapturedStep | None" = None
    extra: object = None            # what the upload's stage_more staged (the sampler's device inputs)


@dataclass
class CapturedStep:
    """A step captured at one bucket: replay it after filling the buffers."""
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor            # [bucket's logits rows, vocab], rewritten by each replay


def uses_cuda_graphs(device: torch.device, attention_backend: str, enforce_eager: bool) -> bool:
    """Decode steps replay CUDA graphs on a GPU with the CUDA kernels (the torch reference reads
    context lengths back to the host: it cannot be captured), unless enforce_eager."""
    return device.type == "cuda" and attention_backend == "cuda" and not enforce_eager


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets captured as CUDA graphs: 1, 2, 4, 8, 16, 32, then every 16, up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_num_seqs]
    sizes += range(48, max_num_seqs, 16)
    return sizes + [max_num_seqs]


def graph_token_sizes(max_tokens: int) -> list[int]:
    """Token buckets of mixed steps: 8, 16, ... 512, then four a doubling (640, 768, 896, 1024, 1280...),
    up to max_tokens: padding costs at most a quarter past 512 tokens, and a few dozen graphs cover 64K."""
    sizes, t = [], 8
    while t < max_tokens:
        sizes.append(t)
        t = t * 2 if t < 512 else t + (1 << (t.bit_length() - 1)) // 4
    return sizes + [max_tokens]


# Why a step ran eagerly (ModelRunner.eager_steps; bench.py prints them beside the graph steps).
GRAPHS_OFF = "graphs off"                            # a CPU, the torch backend, or enforce_eager
PAST_BOUNDS = "past the runner's bounds"             # more rows or tokens than the caller declared
MORE_LOGITS = "more logits rows than its bucket's"   # prompt logprobs beside the sampled rows
NOT_CAPTURED = "bucket not captured"


@dataclass
class HostBatch:
    """A step's inputs as host arrays, checked (check_batch), before they are uploaded."""
    input_ids: np.ndarray           # [num_tokens] int64
    positions: np.ndarray           # [num_tokens] int64
    slot_mapping: np.ndarray        # [num_tokens] int64
    block_tables: np.ndarray        # [num_rows, width] int32 (a mixed bucket's padding rows have none: never read)
    context_lens: np.ndarray        # [num_rows] int32
    query_start_loc: np.ndarray     # [num_rows + 1] int32
    logits_rows: np.ndarray         # [num_logits] int64
    q_lens: list[int]
    owners: list = field(default_factory=list)   # per row its Sequence (None: padding): whose table row it is


class ModelRunner:
    def __init__(self, model, kv_pool: KVCachePool, block_size: int, device: torch.device, attention_backend: str,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int = 2048,
                 enforce_eager: bool = False, num_speculative_tokens: int = 0):
        """max_num_seqs, max_num_batched_tokens: the most rows and tokens of any step this runner gets
        (the engine passes its scheduler's step_bounds: 2B - 1 rows for static batching)."""
        self.model, self.kv_pool, self.block_size = model, kv_pool, block_size
        self.device, self.attention_backend = device, attention_backend
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        cfg = model.config
        self.num_kv_heads, self.group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
        self.cuda = attention_backend in ("cuda", "cuda_emu")
        self.num_sms = pa.num_sms(device, attention_backend) if self.cuda else 0
        # a verify step (spec_decode.py) gives every row 1 + k query tokens: its padding may reach k past the end
        self.verify_width = 1 + num_speculative_tokens if num_speculative_tokens else 0
        width = -(-(max_model_len + num_speculative_tokens) // block_size)   # [max_num_seqs, blocks of a context]
        # one row more than a step's: a mixed bucket's padding tokens go in a row of their own
        self.buffers = InputBuffers(max(max_num_batched_tokens, max_num_seqs * max(1, self.verify_width)),
                                    max_num_seqs + 1, width, device)
        self.max_logits = max_num_seqs * max(1, self.verify_width)   # rows sampled in a step at most
        self.use_graphs = uses_cuda_graphs(device, attention_backend, enforce_eager)
        self.graphs: dict[int, CapturedStep] = {}
        self.verify_graphs: dict[int, CapturedStep] = {}   # rows -> a verify step of rows x verify_width tokens
        self.mixed_graphs: dict[int, CapturedStep] = {}    # tokens -> any step of at most that many tokens
        self.graph_pool = None
        self.graph_pool_bytes = 0
        self.mixed_logits = None                           # [max_logits, vocab]: every mixed graph's output
        self.graph_steps: collections.Counter = collections.Counter()   # kind -> steps that replayed one
        self.eager_steps: collections.Counter = collections.Counter()   # reason -> steps that ran eagerly
        self.warned_oversize = False

    def reserve_upload(self, extra_bytes: int):
        """Room at the packed upload's tail for what another part stages each step (the device
        sampler's inputs): the buffers are made again, before any graph reads them."""
        assert not (self.graphs or self.verify_graphs or self.mixed_graphs), "reserve_upload after capture_graphs"
        b = self.buffers
        self.buffers = InputBuffers(b.max_tokens, b.max_seqs, b.width, self.device, extra_bytes)

    # ------------------------------------------------------------------ host side
    def build(self, batch: ScheduledBatch, extra_rows=()) -> HostBatch:
        """The step's flat inputs as host arrays. Per-row Python only to read each sequence's
        tokens and table; positions and slots for all tokens are computed as arrays. Logits go to the
        last token of each row to sample, then to the flat-batch rows in extra_rows, in that order."""
        bs, seqs = self.block_size, batch.seqs
        q_lens = np.array(batch.num_tokens, dtype=np.int64)                      # [num_rows]
        ctx = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64) + q_lens
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])                                           # [num_rows + 1]
        row = np.repeat(np.arange(len(seqs)), q_lens)                            # [num_tokens] row of each token
        positions = ctx[row] - q_lens[row] + (np.arange(len(row)) - qsl[row])    # [num_tokens]
        # a scratch row may read past its own table: the width covers every context
        width = max(max(len(s.block_table) for s in seqs), -(-int(ctx.max()) // bs))
        tables = np.zeros((len(seqs), width), dtype=np.int32)                    # [num_rows, width]
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        slots = tables[row, positions // bs].astype(np.int64) * bs + positions % bs   # [num_tokens]
        if batch.num_scratch_rows:
            slots[qsl[batch.num_real_rows]:] = -1                                # computed, never cached
        # a row with drafts (spec_decode.py) is a decode: its last token, then its drafts
        # (its slice of token_ids stops at the end: n counts the drafts too)
        input_ids = np.fromiter((t for s, a, n in zip(seqs, ctx - q_lens, batch.num_tokens)
                                 for t in s.token_ids[a:a + n] + s.spec_token_ids), dtype=np.int64, count=len(row))
        logits_rows = np.concatenate([self.sample_logits_rows(batch, qsl), np.asarray(extra_rows, dtype=np.int64)])
        host = HostBatch(input_ids, positions, slots, tables, ctx.astype(np.int32), qsl.astype(np.int32),
                         logits_rows.astype(np.int64), batch.num_tokens, list(seqs))
        self.check_batch(host)
        return host

    @staticmethod
    def sample_logits_rows(batch: ScheduledBatch, qsl: np.ndarray) -> np.ndarray:
        """The flat-batch rows whose logits sample: each sampled row's last token, and for a row with
        k drafts its last 1 + k tokens (verification reads the target at every drafted position)."""
        ends = qsl[1:][batch.sample_rows]                                         # [num_sampled] one past each row
        spans = [batch.seqs[i].num_spec_tokens for i in batch.sample_rows]
        if not any(spans):
            return ends - 1
        return np.concatenate([np.arange(e - 1 - k, e) for e, k in zip(ends.tolist(), spans)])   # [sum(1 + k)]

    def check_batch(self, host: HostBatch):
        """Once per step, on the host arrays, what the kernels would otherwise check in every layer
        on the device's copy: block ids and slots inside the pool, every context inside its table."""
        num_blocks, bs = self.kv_pool.kv_caches[0][0].shape[0], self.block_size
        tables, ctx = host.block_tables, host.context_lens
        bad = ((tables < 0) | (tables >= num_blocks)).any() or (host.slot_mapping < -1).any() \
            or (host.slot_mapping >= num_blocks * bs).any() or (ctx > tables.shape[1] * bs).any() \
            or (np.asarray(host.q_lens) > ctx).any()
        if bad:
            raise RuntimeError(f"model runner built an invalid batch: block tables {tables.tolist()}, context "
                               f"lens {ctx.tolist()}, slots {host.slot_mapping.tolist()} for {num_blocks} blocks")

    # ------------------------------------------------------------------ graph buckets
    def decode_sizes(self) -> list[int]:
        return [b for b in graph_batch_sizes(self.max_num_seqs) if b <= self.buffers.max_seqs]

    def verify_sizes(self) -> list[int]:
        w = self.verify_width
        return [b for b in self.decode_sizes() if w and b * w <= self.buffers.max_tokens]

    def mixed_sizes(self) -> list[int]:
        return graph_token_sizes(self.buffers.max_tokens)

    def mixed_rows(self, tokens: int) -> int:
        """Rows of a mixed bucket of `tokens` tokens: a step's rows (at most one a token, at most
        max_num_seqs) and the padding row."""
        return min(tokens, self.max_num_seqs + 1)

    def mixed_logits_rows(self, tokens: int) -> int:
        return min(tokens, self.max_logits)

    def select_graph(self, batch: ScheduledBatch, host: HostBatch) -> tuple[str, int, HostBatch] | str:
        """The bucket this step replays, as (kind, bucket, the padded batch), or why it runs eagerly (a
        reason of the ones above). Decode-only steps take a decode bucket, verify steps a verify bucket,
        any other step (or one those refuse) the mixed bucket of its tokens. Whether the graphs are
        captured is prepare's business: this answers for the buckets this runner would capture."""
        if not self.buffers.fits_host(host) or len(host.context_lens) > self.max_num_seqs:
            return PAST_BOUNDS
        if (bucket := self.bucket(batch, host)) is not None:
            return "decode", bucket, self.pad(host, bucket)
        if (bucket := self.verify_bucket(batch, host)) is not None:
            padded = self.pad_verify(host, bucket, self.verify_width)
            if self.buffers.fits_host(padded):
                return "verify", bucket, padded
        tokens = min(t for t in self.mixed_sizes() if t >= len(host.input_ids))
        if len(host.logits_rows) > self.mixed_logits_rows(tokens):
            return MORE_LOGITS
        return "mixed", tokens, self.pad_mixed(host, tokens)

    def bucket(self, batch: ScheduledBatch, host: HostBatch) -> int | None:
        """The decode batch size this step replays, or None: decode-only steps whose rows each get one
        row of logits."""
        n, num_logits = len(batch.seqs), len(host.logits_rows)
        # the leading rows sample; trailing scratch rows (static batching's) are computed and never read
        if n > self.max_num_seqs or any(q != 1 for q in host.q_lens) or num_logits > n \
                or not np.array_equal(host.logits_rows, np.arange(num_logits)):
            return None
        return min(b for b in self.decode_sizes() if b >= n)

    @staticmethod
    def pad(host: HostBatch, bucket: int) -> HostBatch:
        """Pad a decode batch to `bucket` rows: token 0 at position 0, slot -1 (not cached), context 0
        (attends to nothing), an all-zero table; its logits are computed and never read."""
        n, extra = len(host.q_lens), bucket - len(host.q_lens)
        zeros = np.zeros(extra, dtype=np.int64)
        return HostBatch(np.concatenate([host.input_ids, zeros]), np.concatenate([host.positions, zeros]),
                         np.concatenate([host.slot_mapping, zeros - 1]),
                         np.concatenate([host.block_tables, np.zeros((extra, host.block_tables.shape[1]), np.int32)]),
                         np.concatenate([host.context_lens, zeros.astype(np.int32)]),
                         np.arange(bucket + 1, dtype=np.int32), np.arange(bucket, dtype=np.int64),
                         host.q_lens + [1] * extra, host.owners + [None] * extra)

    def verify_bucket(self, batch: ScheduledBatch, host: HostBatch) -> int | None:
        """The verify step this step replays, or None: every row a decode row (its last token, then its
        drafts, at most verify_width - 1 of them), some row drafting, each row's 1 + k_i positions
        sampled, nothing more."""
        n, w = len(batch.seqs), self.verify_width
        if not w or n > self.max_num_seqs or batch.num_scratch_rows \
                or len(batch.sample_rows) != n or len(host.logits_rows) != len(host.input_ids):
            return None
        if any(q != 1 + s.num_spec_tokens or q > w for q, s in zip(host.q_lens, batch.seqs)) or all(q == 1 for q in host.q_lens):
            return None
        return min((b for b in self.verify_sizes() if b >= n), default=None)

    def pad_verify(self, host: HostBatch, bucket: int, width: int) -> HostBatch:
        """Pad a verify batch to `bucket` rows of exactly `width` query tokens: a row with k_i < width - 1
        drafts gets positions past its last (slot -1: never cached; its context grows by as many,
        and causal attention keeps its real positions from seeing them; RoPE reads the last real
        position again), a padding row is `width` tokens at positions 0.. with slot -1. Logits rows:
        the real positions first, in the batch's order (what verify reads), then the padding ones."""
        q = np.asarray(host.q_lens, dtype=np.int64)                              # [rows] 1 + k_i
        rows, extra = len(q), bucket - len(q)
        real = np.arange(width)[None, :] < q[:, None]                            # [rows, width] a real position
        def grid(values, fill):                                                  # ragged [sum q] -> [rows, width]
            out = np.full((rows, width), fill, dtype=values.dtype)
            out[real] = values
            return out
        last = host.positions[np.cumsum(q) - 1]                                  # [rows] each row's last position
        ids, slots = grid(host.input_ids, 0), grid(host.slot_mapping, -1)
        positions = np.where(real, grid(host.positions, 0), last[:, None])       # [rows, width]
        ctx = host.context_lens.astype(np.int64) + width - q                     # [rows] the padding counts in
        cols = max(host.block_tables.shape[1], -(-int(ctx.max(initial=width)) // self.block_size))
        tables = np.zeros((bucket, cols), dtype=np.int32)
        tables[:rows, :host.block_tables.shape[1]] = host.block_tables
        pad_ids = np.zeros((extra, width), dtype=np.int64)
        flat_real = np.flatnonzero(np.concatenate([real.reshape(-1), np.zeros(extra * width, bool)]))
        flat_pad = np.setdiff1d(np.arange(bucket * width), flat_real)
        return HostBatch(np.concatenate([ids.reshape(-1), pad_ids.reshape(-1)]),
                         np.concatenate([positions.reshape(-1), np.tile(np.arange(width), extra)]),
                         np.concatenate([slots.reshape(-1), pad_ids.reshape(-1) - 1]), tables,
                         np.concatenate([ctx, np.full(extra, width)]).astype(np.int32),
                         (np.arange(bucket + 1) * width).astype(np.int32),
                         np.concatenate([flat_real, flat_pad]).astype(np.int64), [width] * bucket,
                         host.owners + [None] * extra)

    def pad_mixed(self, host: HostBatch, tokens: int) -> HostBatch:
        """Pad any step to a mixed bucket: `tokens` tokens in mixed_rows(tokens) rows. The padding tokens
        (token 0 at position 0, slot -1: never cached) form one row of context 0 after the real rows,
        which attends to nothing and gets no prefill tile (its attention output is never written, and
        every op after attention keeps rows apart); the rows after it have no tokens. Their block
        tables are not sent: no kernel reads a row of context 0. Logits rows: the real ones, then
        row 0 again up to the bucket's (computed, never read)."""
        t, r = len(host.input_ids), len(host.q_lens)
        extra, rows = tokens - t, self.mixed_rows(tokens)
        q_pad = ([extra] if extra else []) + [0] * (rows - r - bool(extra))
        zeros = np.zeros(extra, dtype=np.int64)
        logits = np.zeros(self.mixed_logits_rows(tokens), dtype=np.int64)
        logits[:len(host.logits_rows)] = host.logits_rows
        return HostBatch(np.concatenate([host.input_ids, zeros]), np.concatenate([host.positions, zeros]),
                         np.concatenate([host.slot_mapping, zeros - 1]), host.block_tables,
                         np.concatenate([host.context_lens, np.zeros(rows - r, np.int32)]),
                         np.concatenate([host.query_start_loc, t + np.cumsum(q_pad)]).astype(np.int32),
                         logits, host.q_lens + q_pad, host.owners + [None] * (rows - r))

    # ------------------------------------------------------------------ upload
    def prepare(self, batch: ScheduledBatch, extra_rows: list[int] = (), stage_more=None) -> StepInputs:
        """Run the step's block copies (swaps, copy-on-write: before the forward reads the blocks),
        then build, check, plan and upload the step's inputs (with stage_more's: see upload): padded to
        the bucket of a captured graph, or as they are (eagerly, its reason counted)."""
        self.kv_pool.run(batch.block_ops)
        host = self.build(batch, extra_rows)
        num_logits = len(host.logits_rows)
        choice = self.select_graph(batch, host) if self.use_graphs else GRAPHS_OFF
        graph = None
        if not isinstance(choice, str):
            kind, bucket, padded = choice
            graph = self.graphs_of(kind).get(bucket)
            choice = kind if graph is not None else NOT_CAPTURED
        if graph is None:
            self.eager_steps[choice] += 1
            inputs = self.upload(host, stage_more=stage_more)
        else:
            self.graph_steps[choice] += 1
            inputs = self.upload(padded, *self.fixed_grid(choice, bucket), stage_more=stage_more)
        inputs.num_logits, inputs.graph = num_logits, graph
        return inputs

    def graphs_of(self, kind: str) -> dict[int, CapturedStep]:
        return {"decode": self.graphs, "verify": self.verify_graphs, "mixed": self.mixed_graphs}[kind]

    def fixed_grid(self, kind: str, bucket: int) -> tuple[int | None, int | None]:
        """(max_parts, num_prefill_items) of a bucket's fixed grid; None: as the step needs (a verify
        bucket's tiles follow from its rows x width alone)."""
        if kind == "decode":
            return self.graph_max_parts(bucket), None
        if kind == "verify":
            return None, None
        rows = min(bucket, self.max_num_seqs)
        return self.graph_max_parts(rows), pa.bucket_prefill_items(bucket, rows, self.group)

    def upload(self, host: HostBatch, max_parts: int | None = None, num_prefill_items: int | None = None,
               stage_more=None) -> StepInputs:
        """The step's one copy (InputBuffers): every input, the block-table rows that changed, and
        what stage_more(buffers) stages (the sampler's numbers; its return value is StepInputs.extra);
        the CUDA plan from the host arrays (a fixed grid when max_parts and num_prefill_items are
        given). A step past the buffers' bounds gets one-off buffers of its own size, and runs eagerly."""
        b = self.buffers
        if not b.fits_host(host):
            b = self.one_off_buffers(len(host.input_ids), len(host.context_lens), host.block_tables.shape[1])
        b.reuse_staging()
        owners = host.owners or [None] * len(host.q_lens)
        tables = b.stage_tables([None if s is None else id(s) for s in owners],
                                [None if s is None else s.block_table for s in owners], host.block_tables)
        plan = None
        if self.cuda:
            ints, parts, tiles = pa.plan_cuda_launch(host.q_lens, host.context_lens.tolist(), self.num_kv_heads,
                                                     self.group, self.num_sms, max_parts, block_size=self.block_size,
                                                     num_prefill_items=num_prefill_items)
            plan = CudaPlan(b.stage("plan", np.asarray(ints, dtype=np.int32)), parts, tiles)
        slot_mapping, context_lens = b.stage("slot_mapping", host.slot_mapping), b.stage("context_lens", host.context_lens)
        query_start_loc = b.stage("query_start_loc", host.query_start_loc)
        inputs = StepInputs(b.stage("input_ids", host.input_ids), b.stage("positions", host.positions), None,
                            b.stage("logits_rows", host.logits_rows), len(host.logits_rows))
        inputs.extra = stage_more(b) if stage_more is not None else None
        b.flush()
        inputs.meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=b.gather_tables(*tables),
                                        context_lens=context_lens, query_start_loc=query_start_loc,
                                        backend=self.attention_backend, cuda_plan=plan)
        return inputs

    def one_off_buffers(self, num_tokens: int, num_seqs: int, width: int) -> "InputBuffers":
        """Buffers for one step past the declared bounds (a caller that sized this runner too small):
        self.buffers and the graphs that read them stay as they are. Said once, with the sizes."""
        if not self.warned_oversize:
            self.warned_oversize = True
            b = self.buffers
            print(f"nanoserve: a step of {num_tokens} tokens, {num_seqs} rows, {width} blocks a row exceeds the "
                  f"model runner's bounds ({b.max_tokens}, {b.max_seqs}, {b.width}): it runs eagerly on one-off "
                  f"buffers (graphs kept)", file=sys.stderr, flush=True)
        return InputBuffers(num_tokens, num_seqs, width, self.device)

    # ------------------------------------------------------------------ forward
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Float32 logits [num_logits, vocab]: a graph's replay, or the model run eagerly."""
        if inputs.graph is not None:
            inputs.graph.graph.replay()
            return inputs.graph.logits[:inputs.num_logits]
        return self.model(inputs.input_ids, inputs.positions, self.kv_pool.kv_caches, inputs.meta, inputs.logits_rows)

    def forward_cached(self, seq: Sequence, lo: int, hi: int):
        """Yields (a, b, logits [b - a, vocab]) for positions [lo, hi) of seq, whose K/V already sit in
        its cached blocks, in chunks of at most the buffers' tokens: extra forwards that read the cache
        and write nothing (slot -1)."""
        for a in range(lo, hi, self.buffers.max_tokens):
            b = min(a + self.buffers.max_tokens, hi)
            q = b - a
            host = HostBatch(np.asarray(seq.token_ids[a:b], dtype=np.int64), np.arange(a, b, dtype=np.int64),
                             np.full(q, -1, dtype=np.int64), np.asarray([seq.block_table], dtype=np.int32),
                             np.asarray([b], dtype=np.int32), np.asarray([0, q], dtype=np.int32),
                             np.arange(q, dtype=np.int64), [q], [seq])
            self.check_batch(host)
            yield a, b, self.forward(self.upload(host))

    # ------------------------------------------------------------------ CUDA graphs
    def graph_max_parts(self, bucket: int) -> int:
        return pa.bucket_max_parts(bucket, self.num_kv_heads, self.num_sms, self.max_model_len)

    def capture_graphs(self):
        """Capture a decode step at every batch-size bucket, when speculating a verify step (rows x
        verify_width tokens) at every bucket whose tokens fit the buffers, and a mixed step at every
        token bucket: largest first, all in one memory pool (a smaller graph's temporaries fit in what
        the larger left; a decode or verify graph keeps only its logits, the mixed graphs write theirs
        into one shared buffer). The captured forward reads nothing back: its inputs sit in the
        persistent buffers and its grids are fixed per bucket. graph_pool_bytes: what the pool took."""
        if not self.use_graphs:
            return
        empty = HostBatch(*(np.zeros(0, np.int64) for _ in range(3)), np.zeros((0, self.buffers.width), np.int32),
                          np.zeros(0, np.int32), np.zeros(1, np.int32), np.zeros(0, np.int64), [])
        w = self.verify_width
        steps = [(b, "decode", b) for b in self.decode_sizes()] + [(b * w, "verify", b) for b in self.verify_sizes()]
        steps += [(t, "mixed", t) for t in self.mixed_sizes()]
        reserved = torch.cuda.memory_reserved if self.device.type == "cuda" else (lambda device: 0)
        before = reserved(self.device)
        self.mixed_logits = torch.empty(self.mixed_logits_rows(max(self.mixed_sizes())), self.model.config.vocab_size,
                                        dtype=torch.float32, device=self.device)
        for _, kind, bucket in sorted(steps, reverse=True):
            host = {"decode": lambda: self.pad(empty, bucket), "verify": lambda: self.pad_verify(empty, bucket, w),
                    "mixed": lambda: self.pad_mixed(empty, bucket)}[kind]()
            inputs = self.upload(host, *self.fixed_grid(kind, bucket))
            forward = functools.partial(self.model, inputs.input_ids, inputs.positions, self.kv_pool.kv_caches,
                                        inputs.meta, inputs.logits_rows)
            if kind == "mixed":
                out = self.mixed_logits[:len(host.logits_rows)]
                forward = functools.partial(lambda f, out: out.copy_(f()), forward, out)
            self.graphs_of(kind)[bucket] = self.capture(forward)
        self.graph_pool_bytes = reserved(self.device) - before
        print(f"nanoserve: CUDA graphs: {len(self.graphs)} decode, {len(self.verify_graphs)} verify and "
              f"{len(self.mixed_graphs)} mixed steps in one pool of {self.graph_pool_bytes / 2**20:.0f} MiB",
              file=sys.stderr, flush=True)

    def capture(self, forward) -> CapturedStep:
        """One CUDA graph of forward(), warmed up eagerly first (cuBLAS picks its kernels, the
        allocator fills the pool)."""
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = forward()
        torch.cuda.synchronize()
        return CapturedStep(graph, logits)


# ------------------------------------------------------------------ the packed upload
# The packed upload: every device input of a step goes up in one host->device copy.
#
# InputBuffers owns one byte buffer on the device and its host twin (pinned on a GPU; on a CPU the
# twin is the buffer itself). Its head holds the regions a captured graph reads, each at a fixed
# address and sized once at its largest (input ids, positions, slots, logits rows, context lengths,
# query offsets, the CUDA plan, and each row's slot in the persistent block table); its tail is
# filled per step by whoever has inputs for it (stage_extra: the changed block-table rows, the
# sampler's per-row numbers, grammar bitmasks, new requests' sampling parameters). flush() copies
# the staged bytes, non_blocking, in one copy.
#
# The block tables stay on the device between steps (BlockTableRows): each sequence keeps a row of a
# persistent table, and a step uploads only the rows whose contents changed (a row index and the
# row), then gathers its rows into the [rows, width] table the kernels read. Owns no scheduling,
# block choice or sampling: the runner above and sampling_slots.py say what to stage.
ALIGN = 16                  # bytes: every view starts on a 16-byte boundary


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device, extra_bytes: int = 0):
        """extra_bytes: the tail's size, for what other parts stage per step (sampling_slots.py)."""
        i32, i64 = torch.int32, torch.int64
        shapes = dict(input_ids=((max_tokens,), i64), positions=((max_tokens,), i64),
                      slot_mapping=((max_tokens,), i64), logits_rows=((max_tokens,), i64),
                      context_lens=((max_seqs,), i32), query_start_loc=((max_seqs + 1,), i32),
                      plan=((2 + 2 * max_tokens,), i32), table_slots=((max_seqs,), i64))
        self.device, self.max_tokens, self.max_seqs, self.width = device, max_tokens, max_seqs, width
        self.offsets, total = {}, 0
        for name, (shape, dt) in shapes.items():
            self.offsets[name] = total
            total += aligned(math.prod(shape) * dt.itemsize)
        self.tail = total                                                  # where stage_extra starts
        # the tail holds a step's changed table rows (each row's index and contents) besides the extras
        total += aligned(max_seqs * 8) + aligned(max_seqs * width * 4) + aligned(extra_bytes)
        self.dev_bytes = torch.zeros(total, dtype=torch.uint8, device=device)   # [total]
        self.host_bytes = self.dev_bytes if device.type == "cpu" else \
            torch.zeros(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
        def views(buf):
            return {k: buf[self.offsets[k]:self.offsets[k] + math.prod(shape) * dt.itemsize].view(dt).view(shape)
                    for k, (shape, dt) in shapes.items()}
        self.dev, self.host = views(self.dev_bytes), views(self.host_bytes)
        # what the kernels read (a graph at this address), gathered each step from the persistent rows
        self.block_tables = torch.zeros((max_seqs, width), dtype=torch.int32, device=device)   # [max_seqs, width]
        self.table = BlockTableRows(2 * max_seqs + 1, width, device)
        self.end = 0                        # bytes staged this step
        self.cursor = self.tail             # the tail's next free byte
        self.spilled = []                   # (host, device) tensors past the tail: copied on their own
        self.uploaded = None                # CUDA event after the last step's copy
        self.warned_spill = False

    def fits(self, num_tokens: int, num_seqs: int, width: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and width <= self.width

    def fits_host(self, host) -> bool:
        return self.fits(len(host.input_ids), len(host.context_lens), host.block_tables.shape[1])

    def reuse_staging(self):
        """Before a step writes the pinned twin: wait for the copy that last read it (under async
        scheduling the host is a step ahead of the device)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def stage(self, name: str, values: np.ndarray) -> torch.Tensor:
        """values into the leading slice of region `name`'s host twin; returns the device slice they go to."""
        values = values.reshape(-1)
        self.host[name].view(-1)[:len(values)].copy_(torch.from_numpy(values))
        self.end = max(self.end, self.offsets[name] + values.nbytes)
        return self.dev[name].view(-1)[:len(values)]

    def reserve(self, shape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) views of the next free bytes of the tail, for the caller to fill on the host
        (llguidance writes bitmasks straight into it). A step whose extras pass the tail gets a
        one-off pair, copied at flush on its own (said once, with the sizes)."""
        nbytes = math.prod(shape) * dtype.itemsize
        at = self.cursor
        if at + nbytes > self.dev_bytes.numel():
            if not self.warned_spill:
                self.warned_spill = True
                print(f"nanoserve: a step's inputs passed the packed upload's {self.dev_bytes.numel()} bytes: "
                      f"{nbytes} bytes go up in a copy of their own", file=sys.stderr, flush=True)
            pin = self.device.type == "cuda"
            pair = (torch.empty(shape, dtype=dtype, pin_memory=pin), torch.empty(shape, dtype=dtype, device=self.device))
            if self.device.type == "cpu":
                pair = (pair[0], pair[0])
            self.spilled.append(pair)
            return pair
        self.cursor = at + aligned(nbytes)
        self.end = max(self.end, at + nbytes)
        return tuple(buf[at:at + nbytes].view(dtype).view(shape) for buf in (self.host_bytes, self.dev_bytes))

    def stage_extra(self, values) -> torch.Tensor:
        """A host array (numpy or torch) into the tail; returns its device view."""
        values = torch.as_tensor(values)
        host, dev = self.reserve(tuple(values.shape), values.dtype)
        host.copy_(values)
        return dev

    def stage_tables(self, keys: list, own: list, tables: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tables: [rows, w] int32; keys: each row's owner (None: a padding row, all zeros); own: each
        row's block ids as its owner holds them (what is compared). Stages the rows' slots and the rows
        that changed; -> (slots, changed slots, changed rows [changed, w]) device views."""
        slots, changed = self.table.assign(keys, own)
        dev_slots = self.stage("table_slots", np.asarray(slots, dtype=np.int64))
        return dev_slots, self.stage_extra(np.asarray([slots[i] for i in changed], dtype=np.int64)), \
            self.stage_extra(np.ascontiguousarray(tables[changed]))

    def flush(self):
        """The step's one copy: every staged byte, non_blocking from the pinned twin on a GPU."""
        if self.host_bytes is not self.dev_bytes:
            self.dev_bytes[:self.end].copy_(self.host_bytes[:self.end], non_blocking=True)
            for host, dev in self.spilled:
                dev.copy_(host, non_blocking=True)
            if self.device.type == "cuda":
                self.uploaded = torch.cuda.Event()
                self.uploaded.record()
        self.end, self.cursor, self.spilled = 0, self.tail, []

    def gather_tables(self, slots: torch.Tensor, changed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """On the device, after flush: write the changed rows into the persistent table, then gather
        the step's rows. -> the [num_rows, width] table the kernels read."""
        w = rows.shape[1] if rows.dim() == 2 else 0
        if len(changed):
            self.table.rows[:, :w].index_copy_(0, changed, rows)           # [num_slots, w] <- [changed, w]
        out = self.block_tables[:len(slots)]
        torch.index_select(self.table.rows, 0, slots, out=out)             # [num_rows, width]
        return out


class BlockTableRows:
    """The persistent block table on the device: a row per sequence, slot 0 kept all zeros for
    padding rows. The host keeps what each row holds, so a step sends only the rows that changed
    (a decode step: the rows that crossed into a new block). A key is only a cache: contents are
    compared, so a recycled key or slot can never leave a stale row."""
    def __init__(self, num_slots: int, width: int, device: torch.device):
        self.rows = torch.zeros((num_slots, width), dtype=torch.int32, device=device)   # [num_slots, width]
        self.slot_of: dict = {}
        self.held: list = [None] * num_slots          # per slot: the row it holds on the device, as a list
        self.free = list(range(num_slots - 1, 0, -1))

    def assign(self, keys: list, own: list) -> tuple[list[int], list[int]]:
        """-> (each row's slot, the rows whose contents must go up). A changed row is written at the
        step's width, zero-padded; nothing reads a row past its context."""
        slots, changed = [], []
        for i, (key, blocks) in enumerate(zip(keys, own)):
            if key is None:
                slots.append(0)
                continue
            slot = self.slot_of.get(key)
            if slot is None:
                if not self.free:                     # evict the sequences this step does not run
                    step_keys = set(keys)
                    for k in [k for k in self.slot_of if k not in step_keys]:
                        self.free.append(self.slot_of.pop(k))
                slot = self.slot_of[key] = self.free.pop()
            if self.held[slot] != blocks:             # list compare: a decode row changes once a block
                self.held[slot] = list(blocks)
                changed.append(i)
            slots.append(slot)
        return slots, changed


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
