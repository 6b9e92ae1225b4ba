"""
Attention over the paged KV pool, for a ragged batch.

One call serves a whole step: decode rows (1 query token against a long cached
context) and prefill chunks (many query tokens that attend causally to their
cached prefix plus themselves), packed back to back with no padding.
This file owns the attention math and the KV write; it does not allocate blocks
(kv_cache.py does) and does not decide what runs (scheduler.py does).

The signature below is the contract every backend keeps. The pure-PyTorch
reference here is the oracle that the C++/CUDA kernels are tested against.
Backends: "torch" (the reference), "cpu" (csrc/paged_attention_cpu.cpp) and "cuda"
(csrc/paged_attention_cuda.cu), the kernels JIT-built on first use by extensions.py; "cuda_emu"
(tests only) is the CUDA binding run on the CPU through csrc/cuda_emu.h. The CUDA kernels take a
launch plan made on the host once per step (plan_cuda_launch): they read nothing back.

Layout conventions (vLLM's names):
  query            [num_tokens, num_heads, head_dim]      new tokens of all sequences, packed
  key_cache/value  [num_blocks, block_size, num_kv_heads, head_dim]   one layer of the pool
  block_tables     [num_seqs, max_blocks_per_seq] int32   physical block ids, row i = sequence i
  context_lens     [num_seqs] int32   tokens of sequence i in the cache *including* this step's
  query_start_loc  [num_seqs + 1] int32   sequence i owns query rows [qsl[i], qsl[i+1])
Query row j of sequence i sits at absolute position context_len - q_len + j and may
attend to cached positions 0..that position (causal). Decode is simply q_len == 1.
"""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import extensions


@dataclass
class AttentionMetadata:
    """What every layer's attention needs to find its sequences in the flat batch and the pool
    (model_runner.py builds it once per step; every layer reads the same one)."""
    slot_mapping: torch.Tensor      # [num_tokens] int64: where each new token's K/V is written (-1: nowhere)
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor      # [num_seqs] int32, cached tokens including this step's
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    backend: str = "torch"
    cuda_plan: "CudaPlan | None" = None   # the CUDA kernels' launch plan (model_runner.py makes it)


# ---- the CUDA kernels' launch plan, made on the host ------------------------------------------
# csrc/paged_attention_cuda.cu's constants: decode blocks of 4 warps x 32-token chunks, prefill
# tiles of 16 (row, head) vectors.
MIN_PARTITION = 128        # context tokens per decode block at least: fewer leave warps idle
NO_SPLIT = 1 << 30         # the partition size of a step that needs no split
BLOCKS_PER_SM = 4          # decode blocks resident per SM (the kernel's __launch_bounds__ occupancy)
TILE_VECTORS = 16
EMULATED_SMS = 4           # what the cuda_emu backend plans for: small, so short contexts get split


@dataclass
class CudaPlan:
    """One step's launch plan for the CUDA kernels. The grids follow from the ints alone (rows x
    max_parts decode blocks, a reduce when max_parts > 1, num_prefill_items tiles), so a decode step
    at one batch size always launches the same grids; the data-dependent part, the partition size,
    is read by the kernels from `plan` on the device."""
    plan: torch.Tensor         # int32 [2 + 2 * num_prefill_items]: partition size, 0, then (row, first query row) per prefill tile (row -1: empty)
    max_parts: int             # decode blocks per row (0: the step has no decode row)
    num_prefill_items: int


def num_parts(context_len: int, partition: int) -> int:
    return 1 if context_len <= partition else -(-context_len // partition)


def part_pages(context_len: int, partition: int, block_size: int) -> list[int]:
    """Pages (KV blocks) of each decode part of a row, as the kernel cuts it: the row's pages split
    evenly at page boundaries, part i taking pages [i * pages // n, (i + 1) * pages // n)."""
    pages, n = -(-context_len // block_size), num_parts(context_len, partition)
    return [(i + 1) * pages // n - i * pages // n for i in range(n)]


def wave_parts(num_rows: int, num_kv_heads: int, num_sms: int, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """Decode blocks per row that keep rows x parts x KV heads within one wave of resident blocks
    (1: the rows alone fill the GPU, no split)."""
    return max(1, blocks_per_sm * num_sms // max(1, num_rows * num_kv_heads))


def bucket_max_parts(num_seqs: int, num_kv_heads: int, num_sms: int, max_model_len: int,
                     blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """Decode blocks per row of a fixed grid (a CUDA graph's batch-size bucket): one wave at most,
    no more than a max_model_len context can use. Depends on no context: the bucket's grid is fixed."""
    return min(wave_parts(num_seqs, num_kv_heads, num_sms, blocks_per_sm), max(1, -(-max_model_len // MIN_PARTITION)))


def choose_partition(longest: int, max_parts: int, block_size: int) -> int:
    """Context tokens per decode block: whole pages, at least MIN_PARTITION tokens, few enough parts
    for the longest row to fit max_parts, then evened out so its parts differ by at most a page."""
    pages, min_pages = -(-longest // block_size), -(-MIN_PARTITION // block_size)
    per_part = max(min_pages, -(-pages // max(1, max_parts)))
    parts = -(-pages // per_part)
    if parts <= 1:
        return NO_SPLIT
    return -(-pages // parts) * block_size


def bucket_prefill_items(num_tokens: int, max_rows: int, group: int) -> int:
    """The most prefill tiles a step of num_tokens tokens in at most max_rows rows can need (a graph
    bucket's fixed prefill grid): P rows of q_i >= 2 tokens need sum ceil(q_i / r) <= (T + P (r - 1)) / r
    tiles of r = TILE_VECTORS / group rows, with P <= min(max_rows, T / 2)."""
    rows_per_tile = TILE_VECTORS // group
    prefill_rows = min(max_rows, num_tokens // 2)
    return (num_tokens + prefill_rows * (rows_per_tile - 1)) // rows_per_tile


def plan_cuda_launch(q_lens: list[int], ctx_lens: list[int], num_kv_heads: int, group: int, num_sms: int,
                     max_parts: int | None = None, *, block_size: int, blocks_per_sm: int = BLOCKS_PER_SM,
                     num_prefill_items: int | None = None) -> tuple[list[int], int, int]:
    """The ints of a CudaPlan from the host's lists -> (plan ints, max_parts, num_prefill_items).
    One wave: while decode rows x KV heads leave SMs idle, rows are split into parts (at page
    boundaries, within a page of each other) so that rows x parts x KV heads fill at most
    blocks_per_sm x num_sms blocks. max_parts None: the grid is as wide as the longest row needs;
    given (a graph bucket's fixed grid, bucket_max_parts), the partition adapts to it.
    num_prefill_items given (a bucket's, bucket_prefill_items): the tiles padded to that many with
    empty items (sequence -1; the kernel exits), so the prefill grid is fixed too."""
    decode_ctx = [c for q, c in zip(q_lens, ctx_lens) if q == 1]
    if max_parts is None:
        cap = wave_parts(len(decode_ctx), num_kv_heads, num_sms, blocks_per_sm)
        partition = choose_partition(max(decode_ctx, default=0), cap, block_size)
        max_parts = max((num_parts(c, partition) for c in decode_ctx), default=0)
    else:
        partition = choose_partition(max(decode_ctx, default=0), max_parts, block_size)
    rows_per_tile = TILE_VECTORS // group
    tiles = [x for i, q in enumerate(q_lens) if q > 1 and ctx_lens[i] >= q for r in range(0, q, rows_per_tile)
             for x in (i, r)]                                # a row of context 0 is a bucket's padding: no tile
    if num_prefill_items is not None:
        if len(tiles) // 2 > num_prefill_items:
            raise ValueError(f"{len(tiles) // 2} prefill tiles exceed the bucket's {num_prefill_items}")
        tiles += [-1, 0] * (num_prefill_items - len(tiles) // 2)
    return [partition, 0, *tiles], max_parts, len(tiles) // 2


def num_sms(device: torch.device, backend: str) -> int:
    if backend == "cuda_emu":
        return EMULATED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def host_cuda_plan(query, key_cache, context_lens, query_start_loc, backend) -> CudaPlan:
    """A plan for a standalone call (tests, benchmarks): it reads the batch back to the host, a
    sync; the engine's model runner plans from the lists it already holds."""
    q_lens = query_start_loc.diff().tolist()
    group = query.shape[1] // key_cache.shape[2]
    ints, max_parts, tiles = plan_cuda_launch(q_lens, context_lens.tolist(), key_cache.shape[2], group,
                                              num_sms(query.device, backend), block_size=key_cache.shape[1])
    return CudaPlan(torch.tensor(ints, dtype=torch.int32, device=query.device), max_parts, tiles)


def reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping):
    """Scatter this step's K/V rows into their slots (slot = block * block_size + offset).

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64.
    A slot of -1 leaves its row uncached (static batching's padding rows).
    The cache may be stored in a narrower dtype than the model computes in.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    keep = slot_mapping >= 0
    if not keep.all():
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_kv(cache, block_table, context_len):
    """The first context_len cached rows of one sequence, in order. -> [context_len, num_kv_heads, head_dim]"""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]          # [num_blocks, block_size, kv_heads, head_dim]
    return blocks.flatten(0, 1)[:context_len]


def paged_attention_reference(query, key_cache, value_cache, block_tables, context_lens,
                              query_start_loc, scale):
    """Reference: gather each sequence's K/V from its blocks, then scaled_dot_product_attention.

    Returns [num_tokens, num_heads, head_dim] in query's dtype.
    """
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads                        # query heads per KV head (GQA)
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    for i in range(len(ctx)):
        q = query[qsl[i]:qsl[i + 1]]                         # [q_len, num_heads, head_dim]
        q_len, ctx_len = q.shape[0], ctx[i]
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[i], ctx_len).to(query.dtype)
        v = gather_kv(value_cache, block_tables[i], ctx_len).to(query.dtype)
        k = k.repeat_interleave(group, dim=1)                # [ctx_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        # causal with an offset: query j (absolute position ctx_len - q_len + j) sees keys <= it
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)   # [q_len, 1]
        mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= q_pos             # [q_len, ctx_len]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [heads, len, head_dim]
            attn_mask=mask, scale=scale)
        out[qsl[i]:qsl[i + 1]] = o.transpose(0, 1)
    return out


# ---- compiled backends ------------------------------------------------------------------

BACKENDS = ("auto", "torch", "cpu", "cuda")
COMPILED = ("cpu", "cuda", "cuda_emu")


def resolve_backend(requested="auto", device="cpu"):
    """Pick the attention backend for this process: "cuda", "cpu" or "torch".

    requested: auto | torch | cpu | cuda (env NANOSERVE_ATTENTION_BACKEND overrides it).
    auto picks the compiled kernel for the device; a kernel that cannot be built falls
    back to "torch" with one warning.
    """
    requested = os.environ.get("NANOSERVE_ATTENTION_BACKEND", requested) or "auto"
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(BACKENDS)}, got {requested!r}")
    device_type = torch.device(device).type
    if requested == "torch":
        return "torch"
    kind = device_type if requested == "auto" else requested
    if kind not in ("cpu", "cuda"):
        return "torch"    # e.g. mps: only the reference runs there
    if kind != device_type:
        raise ValueError(f"attention_backend {requested!r} cannot run on device {device_type!r}; "
                         f"allowed: auto, torch, {device_type}")
    return kind if extensions.try_load(kind, "falling back to the pure-PyTorch reference (slow)") else "torch"


def _ops(backend):
    """torch.ops namespace of a compiled backend, building it if resolve_backend has not."""
    if backend not in COMPILED:
        raise ValueError(f"attention backend must be one of ['torch', 'cpu', 'cuda'], got {backend!r}")
    if backend != "cuda_emu":       # the tests build and load the emulation themselves
        extensions.load(backend)
    return getattr(torch.ops, f"nanoserve_{backend}")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, backend="torch"):
    """Write this step's K/V rows into their cache slots with the chosen backend."""
    if backend == "torch":
        return reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    _ops(backend).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                    scale, backend="torch", cuda_plan: CudaPlan | None = None, batch_invariant=False):
    """Dispatch to a backend. Every backend computes exactly what the reference does. The CUDA
    backends take the step's cuda_plan; without one, a plan is made here from a host copy.
    batch_invariant: each query row's result depends only on its sequence's KV and its position,
    never on the batch or the chunk it came in (docs/batch-invariance.md); CPU backends only."""
    if backend == "torch":
        if batch_invariant:
            return _reference_row_by_row(query, key_cache, value_cache, block_tables, context_lens,
                                         query_start_loc, scale)
        return paged_attention_reference(query, key_cache, value_cache, block_tables,
                                         context_lens, query_start_loc, scale)
    if backend == "cpu":
        return _ops(backend).paged_attention(query, key_cache, value_cache, block_tables,
                                             context_lens, query_start_loc, float(scale), batch_invariant)
    if batch_invariant:
        raise ValueError(f"batch-invariant attention is not implemented for backend {backend!r}")
    plan = cuda_plan or host_cuda_plan(query, key_cache, context_lens, query_start_loc, backend)
    return _ops(backend).paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                         query_start_loc, plan.plan, float(scale), plan.max_parts,
                                         plan.num_prefill_items)


def _reference_row_by_row(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale):
    """The reference, one query row per call: SDPA's blocking depends on the query length, so a
    row computed alone (as a decode row at its position) is what every chunking must give."""
    out = torch.empty_like(query)
    qsl, ctx = query_start_loc.tolist(), context_lens.tolist()
    one = torch.tensor([0, 1], dtype=query_start_loc.dtype, device=query.device)   # query_start_loc of one row
    for i in range(len(ctx)):
        for j in range(qsl[i], qsl[i + 1]):
            pos = ctx[i] - (qsl[i + 1] - j)                  # absolute position of row j
            out[j:j + 1] = paged_attention_reference(query[j:j + 1], key_cache, value_cache, block_tables[i:i + 1],
                                                     context_lens.new_tensor([pos + 1]), one, scale)
    return out
