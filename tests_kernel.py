"""Tests of the paged-attention kernels (csrc/) against the pure-PyTorch reference."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import ctypes
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import paged_attention as pa

CSRC = Path(__file__).resolve().parent / "csrc"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |kernel - reference| per KV dtype. Both sides compute in float32 from the same stored
# (already rounded) KV values, so even bf16/fp16 caches differ only by summation order and the
# kernel's polynomial exp (~1e-7 relative); observed errors stay below 2e-6.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
ATOL_BF16_QUERY = 2e-2   # bf16 queries: the reference computes in bf16, the kernels in float32


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
    pa._load_extension("cpu")     # builds on first use; a build error fails here with its log
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
    check_against_reference(cpu_backend, batch, ATOL_BF16_QUERY)


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


# ---- CUDA kernel: compile check, emulated execution, real GPU --------------------------------

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # the launchers' codes


def test_cuda_kernel_compiles_for_sm80_and_sm90_without_warnings(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: cannot compile-check csrc/paged_attention_cuda.cu")
    cmd = [nvcc, "-c", "-o", str(tmp_path / "paged_attention_cuda.o"), "-std=c++17", "-O3",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror", str(CSRC / "paged_attention_cuda.cu")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def emulated_cuda(tmp_path_factory):
    """csrc/paged_attention_cuda.cu built by the host compiler against csrc/cuda_emu.h."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the CUDA emulation")
    so = tmp_path_factory.mktemp("cuda_emu") / "paged_attention_cuda_emu.so"
    subprocess.run([cxx, "-std=c++20", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-pthread", "-shared",
                    "-fPIC", "-x", "c++", str(CSRC / "paged_attention_cuda.cu"), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.paged_attention_workspace_floats.argtypes = [I] * 6
    lib.paged_attention_workspace_floats.restype = ctypes.c_int64
    lib.paged_attention_launch.argtypes = [P] * 8 + [I] * 9 + [F, I, P]
    lib.paged_attention_launch.restype = ctypes.c_char_p
    lib.reshape_and_cache_launch.argtypes = [P] * 5 + [I] * 4 + [P]
    lib.reshape_and_cache_launch.restype = ctypes.c_char_p
    return lib


def emulated_attention(lib, partition_size, query, key_cache, value_cache, block_tables, context_lens,
                       query_start_loc, scale):
    """What the torch binding does, with host pointers."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_seqs, max_blocks = block_tables.shape
    out = torch.empty_like(query)
    workspace = torch.empty(lib.paged_attention_workspace_floats(
        num_seqs, query.shape[1], head_dim, block_size, max_blocks, partition_size))
    err = lib.paged_attention_launch(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), query_start_loc.data_ptr(), workspace.data_ptr(), num_seqs, query.shape[0],
        query.shape[1], num_kv_heads, head_dim, block_size, max_blocks, DTYPE_CODE[query.dtype],
        DTYPE_CODE[key_cache.dtype], scale, partition_size, None)
    assert err is None, err.decode()
    return out


@pytest.mark.parametrize("name, q_lens, ctx_lens, partition_size, group, head_dim, block_size, kv_dtype", [
    ("decode", [1, 1, 1], [1, 45, 200], 0, 3, 64, 16, torch.float32),
    ("decode-split", [1, 1, 1, 1], [1, 64, 65, 300], 64, 4, 128, 8, torch.bfloat16),
    ("decode-split-fp16", [1, 1], [130, 33], 32, 8, 64, 1, torch.float16),
    ("prefill-tiles", [1, 20, 6], [50, 70, 6], 0, 3, 64, 16, torch.float32),
    ("prefill-gqa1", [9, 1], [40, 97], 32, 1, 32, 32, torch.bfloat16),
])
def test_emulated_cuda_kernel_matches_reference(emulated_cuda, name, q_lens, ctx_lens, partition_size, group,
                                                head_dim, block_size, kv_dtype):
    batch = make_batch(q_lens, ctx_lens, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, kv_dtype=kv_dtype)
    check_against_reference(lambda *b: emulated_attention(emulated_cuda, partition_size, *b), batch, 2e-5)


def test_emulated_cuda_kernel_keeps_bfloat16_queries(emulated_cuda):
    batch = make_batch([1, 12], [80, 12], q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    check_against_reference(lambda *b: emulated_attention(emulated_cuda, 32, *b), batch, ATOL_BF16_QUERY)


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_emulated_cuda_reshape_and_cache_matches_reference(emulated_cuda, kv_dtype):
    key, value = torch.randn(2, 5, 2, 64)
    slots = torch.tensor([7, 0, 3, 12, 9])
    caches = [torch.zeros(4, 4, 2, 64, dtype=kv_dtype) for _ in range(4)]
    err = emulated_cuda.reshape_and_cache_launch(key.data_ptr(), value.data_ptr(), caches[0].data_ptr(),
                                                 caches[1].data_ptr(), slots.data_ptr(), 5, 2 * 64,
                                                 DTYPE_CODE[key.dtype], DTYPE_CODE[kv_dtype], None)
    assert err is None, err.decode()
    pa.reshape_and_cache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.fixture(scope="module")
def cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: real CUDA kernel not run")
    assert pa.resolve_backend("cuda", "cuda") == "cuda", "CUDA kernel failed to build"


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_reference_on_gpu(cuda_backend, kv_dtype, q_dtype):
    for q_lens, ctx_lens in [MIXED, ([1] * 8, [4096, 1, 2, 17, 511, 512, 513, 2048]), ([300], [4096])]:
        batch = [t.cuda() if isinstance(t, torch.Tensor) else t
                 for t in make_batch(q_lens, ctx_lens, group=3, kv_dtype=kv_dtype, q_dtype=q_dtype)]
        check_against_reference(lambda *b: pa.paged_attention(*b, backend="cuda"), batch,
                                ATOL_BF16_QUERY if q_dtype == torch.bfloat16 else 1e-4)
    key, value = torch.randn(2, 9, 3, 64, device="cuda", dtype=q_dtype)
    slots = torch.randperm(96, device="cuda")[:9]
    caches = [torch.zeros(6, 16, 3, 64, device="cuda", dtype=kv_dtype) for _ in range(4)]
    pa.reshape_and_cache(key, value, caches[0], caches[1], slots, backend="cuda")
    pa.reshape_and_cache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# ---- backend selection --------------------------------------------------------------------

def test_resolve_backend_honours_env_and_rejects_unknown(cpu_backend, monkeypatch):
    monkeypatch.setenv("NANOSERVE_ATTENTION_BACKEND", "torch")
    assert pa.resolve_backend("cpu", "cpu") == "torch"
    monkeypatch.setenv("NANOSERVE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="attention_backend"):
        pa.resolve_backend("auto", "cpu")
    monkeypatch.delenv("NANOSERVE_ATTENTION_BACKEND")
    with pytest.raises(ValueError, match="cannot run on device"):
        pa.resolve_backend("cuda", "cpu")


def test_resolve_backend_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv("NANOSERVE_ATTENTION_BACKEND", raising=False)
    def broken(kind):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(pa, "_load_extension", broken)
    monkeypatch.setattr(pa, "_failed", {})
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert pa.resolve_backend("auto", "cpu") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # a second warning would raise
        assert pa.resolve_backend("auto", "cpu") == "torch"
