"""
Measurements of the hot path (issue 10) that bench.py calls and prints: the paged-attention
kernel's KV read speed against plain memory bandwidth, the per-phase cost of Engine.step as
the batch grows, a batch-64 decode step against the matmul roofline at the engine's dtype,
and the offline workload's useful output tokens/s. Each function returns a plain dict (every
ratio measured in one process, interleaved, because the machine is shared); none prints.

Owns only measuring. Does not change the engine or pick settings; bench.py owns the tables,
the peers and the targets. `python bench_hot.py` prints every dict, for a quick look.
"""
import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")   # as bench.py: brief spin, then sleep

import random
import statistics
import time

import torch

import model as M
import paged_attention as pa


def _best_median(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def read_bandwidth_gbs(nbytes=512 * 2**20, repeats=3) -> float:
    """Plain read bandwidth: best GB/s of summing a tensor far larger than the caches."""
    x = torch.ones(nbytes // 4)
    x.sum()
    return nbytes / _best_median(x.sum, repeats)[0] / 1e9


def decode_kernel_inputs(batch, ctx, kv_dtype, heads=9, kv_heads=3, head_dim=64, block=16, seed=0):
    """A decode batch (one query row per sequence) over scattered blocks, SmolLM2's head shape."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-ctx // block)
    num_blocks = batch * blocks_per_seq
    q = torch.randn(batch, heads, head_dim, generator=g)                       # [batch, heads, head_dim]
    k = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(kv_dtype)
    v = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(kv_dtype)
    tables = torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    return q, k, v, tables, lens, qsl


def bench_kernel_bandwidth(batch=64, contexts=(512, 1024, 2048), kv_dtype=torch.bfloat16, repeats=5,
                           backend="cpu") -> dict:
    """KV bytes read per second by the paged-attention kernel at decode, against the plain read
    bandwidth measured between its runs. -> {"read_gbs", "contexts": {ctx: {"ms", "kv_gbs",
    "read_gbs", "ratio", "max_abs_diff"}}}; the diff is against the PyTorch reference on the
    first 4 sequences."""
    out = {"batch": batch, "kv_dtype": str(kv_dtype).removeprefix("torch."), "backend": backend, "contexts": {}}
    reads = []
    for ctx in contexts:
        q, k, v, tables, lens, qsl = decode_kernel_inputs(batch, ctx, kv_dtype)
        call = lambda: pa.paged_attention(q, k, v, tables, lens, qsl, 0.125, backend=backend)  # noqa: E731
        got = call()
        ref = pa.paged_attention_reference(q[:4], k, v, tables[:4], lens[:4], qsl[:5], 0.125)
        kv_bytes = 2 * k.numel() * k.element_size()            # every block of K and V is read once
        best = float("inf")
        read = 0.0
        for _ in range(repeats):                                # interleaved: same load on both
            best = min(best, _best_median(call, 1)[0])
            read = max(read, read_bandwidth_gbs(repeats=1))
        reads.append(read)
        out["contexts"][ctx] = {"ms": best * 1e3, "kv_gbs": kv_bytes / best / 1e9, "read_gbs": read,
                                "ratio": kv_bytes / best / 1e9 / read,
                                "max_abs_diff": (got[:4] - ref).abs().max().item()}
    out["read_gbs"] = max(reads)
    out["min_ratio"] = min(c["ratio"] for c in out["contexts"].values())
    return out


if __name__ == "__main__":
    import json
    torch.set_num_threads(os.cpu_count())
    print(json.dumps(bench_kernel_bandwidth(), indent=1))
