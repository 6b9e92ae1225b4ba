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
(csrc/paged_attention_cuda.cu), the kernels JIT-built on first use by extensions.py.

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
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"attention backend must be one of ['torch', 'cpu', 'cuda'], got {backend!r}")
    extensions.load(backend)
    return getattr(torch.ops, f"nanoserve_{backend}")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, backend="torch"):
    """Write this step's K/V rows into their cache slots with the chosen backend."""
    if backend == "torch":
        return reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    _ops(backend).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                    scale, backend="torch", batch_invariant=False):
    """Dispatch to a backend. Every backend computes exactly what the reference does.
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
    return _ops(backend).paged_attention(query, key_cache, value_cache, block_tables,
                                         context_lens, query_start_loc, float(scale))


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
