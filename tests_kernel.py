"""Tests of the paged-attention kernels (csrc/) against the pure-PyTorch reference."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import ctypes
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import paged_attention as pa

CSRC = Path(__file__).resolve().parent / "csrc"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |kernel - reference| allowed; the reference reads the same stored (rounded) KV values,
# so the gap is only float32 summation order and, for bf16 queries, output rounding
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}


def make_batch(q_lens, ctx_lens, num_kv_heads=3, group=3, head_dim=64, block_size=16,
               kv_dtype=torch.float32, q_dtype=torch.float32, seed=0):
    """A ragged batch: sequence i has q_lens[i] new rows at the end of ctx_lens[i] cached
    tokens, its blocks scattered through a shuffled pool (block 0 unused)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(kv_dtype)
    value_cache = torch.randn(shape, generator=g).to(kv_dtype)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g).to(q_dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, ctx, qsl, head_dim ** -0.5


def check_against_reference(attention, batch, atol):
    expected = pa.paged_attention_reference(*batch)
    actual = attention(*batch)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= atol, f"max abs error {err:.2e} > {atol:.0e}"


@pytest.fixture(scope="module")
def cpu_backend():
    assert pa.resolve_backend("cpu", "cpu") == "cpu", "CPU kernel failed to build"
    return lambda *batch: pa.paged_attention(*batch, backend="cpu")


# ---- CPU kernel ---------------------------------------------------------------------------

MIXED = ([1, 7, 1, 33, 1], [1, 40, 300, 33, 129])   # decode rows and prefill chunks, ragged


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_cpu_kernel_matches_reference_on_mixed_batches(cpu_backend, kv_dtype, block_size, head_dim, group):
    batch = make_batch(*MIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, kv_dtype=kv_dtype, seed=block_size + group)
    check_against_reference(cpu_backend, batch, ATOL[kv_dtype])


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([1] * 8, [4096, 1, 2, 17, 511, 512, 513, 2048]),     # decode only, 1..4096 tokens
    ([300], [4096]),                                       # long prefill chunk at the end of a long prefix
    ([257, 1, 64], [257, 3000, 1000]),                     # first chunk (no prefix) + decode + chunk
])
def test_cpu_kernel_matches_reference_on_long_contexts(cpu_backend, kv_dtype, q_lens, ctx_lens):
    batch = make_batch(q_lens, ctx_lens, kv_dtype=kv_dtype, block_size=16)
    check_against_reference(cpu_backend, batch, ATOL[kv_dtype])


def test_cpu_kernel_keeps_bfloat16_queries(cpu_backend):
    batch = make_batch(*MIXED, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    # the reference computes in bf16; the kernel in float32 then rounds: compare at bf16 precision
    check_against_reference(cpu_backend, batch, 2e-2)


def test_cpu_kernel_skips_sequences_without_new_tokens(cpu_backend):
    batch = make_batch([3, 0, 1], [10, 20, 30])
    check_against_reference(cpu_backend, batch, 2e-5)


def test_cpu_kernel_rejects_block_table_too_short(cpu_backend):
    query, kc, vc, tables, ctx, qsl, scale = make_batch([1], [40], block_size=16)
    with pytest.raises(RuntimeError, match="block_tables has"):
        pa.paged_attention(query, kc, vc, tables[:, :2], ctx, qsl, scale, backend="cpu")


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_reshape_and_cache_writes_rows_to_their_slots(cpu_backend, backend, kv_dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 3, 64
    key, value = torch.randn(2, 9, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:9]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    pa.reshape_and_cache(key, value, *caches, slots, backend=backend)
    expected = [torch.zeros_like(c) for c in caches]
    pa.reshape_and_cache_reference(key, value, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    flat = caches[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots], key.to(kv_dtype))       # slot = block * block_size + offset


def test_reshape_and_cache_rejects_out_of_range_slots(cpu_backend):
    caches = [torch.zeros(2, 4, 1, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="outside"):
        pa.reshape_and_cache(torch.randn(1, 1, 64), torch.randn(1, 1, 64), *caches,
                             torch.tensor([8]), backend="cpu")


# ---- backend selection --------------------------------------------------------------------

def test_resolve_backend_honours_env_and_rejects_unknown(monkeypatch):
    monkeypatch.setenv("NANOSERVE_ATTENTION_BACKEND", "torch")
    assert pa.resolve_backend("cpu", "cpu") == "torch"
    monkeypatch.setenv("NANOSERVE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="attention_backend"):
        pa.resolve_backend("auto", "cpu")
    monkeypatch.delenv("NANOSERVE_ATTENTION_BACKEND")
    with pytest.raises(ValueError, match="cannot run on device"):
        pa.resolve_backend("cuda", "cpu")


def test_resolve_backend_falls_back_with_one_warning(monkeypatch):
    def broken(kind):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(pa, "_load_extension", broken)
    monkeypatch.setattr(pa, "_failed", {})
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert pa.resolve_backend("auto", "cpu") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # a second warning would raise
        assert pa.resolve_backend("auto", "cpu") == "torch"
