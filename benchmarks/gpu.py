"""
The GPU section of bench.py: how close a decode step on the CUDA path comes to the HBM roofline, for
models big enough that the GPU, not the host, sets the time.

A 135M model is latency-bound on any GPU (its row here checks the host's cost per step), so this section
also builds Llama-3.2-1B and Llama-3-8B shaped models; all three come from model.py with random bf16
weights (their values do not change the time: no model file is read) and decode at
batch 1, 8, 32, 64 and 128 after a fixed context, through model_runner.py (host plan, persistent
buffers), replaying the captured CUDA graph and eagerly. For each: the step time against the HBM
roofline (weight bytes + the KV bytes the step reads, over the read bandwidth measured here), the
paged-attention kernel alone (CUDA events, the same plan), and the host's cost of one graph replay
(cost_model.fit_host_overhead reads it). Then the decode kernel alone at 2,048 tokens of context (the
issue's target: >= 50% of the read bandwidth), replayed from a CUDA graph so no host cost sits between
its launches. Skips, saying why, where there is no CUDA device.
Owns only measuring; changes nothing in the engine.
"""
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.harness import md_table, section_header

SHAPES = {   # model.ModelConfig fields (Hugging Face's configs of these models)
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "Llama-3.2-1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=131072),
    "Llama-3-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                       max_position_embeddings=8192),
}
KERNEL_ONLY_SHAPES = {   # the decode kernel alone also at SmolLM2-135M's attention (9 query / 3 KV heads x 64)
    "SmolLM2-135M": dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64),
}
BATCHES = (1, 8, 32, 64, 128)
BLOCK_SIZE = 16
KERNEL_CONTEXT = 2048        # the decode kernel's bandwidth target is set at this context
L2_FLUSH_BYTES = 512 << 20   # KV the kernel-alone calls cycle through: far more than any L2 (H100: 50 MB)


@dataclass
class GpuSizes:
    context: int = 1024          # cached tokens per row when the timed steps run
    steps: int = 20              # timed decode steps per (model, batch, mode)
    kernel_repeats: int = 50


def cuda_time(fn, repeats: int) -> float:
    """Median seconds of fn() on the GPU between CUDA events (host costs excluded once queued)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def read_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """HBM read bandwidth: bytes of a bf16 tensor far larger than L2 over the time of summing it."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    return nbytes / cuda_time(lambda: x.sum(dtype=torch.float32), 10) / 1e9


def graph_time_per_call(call, calls: int, repeats: int) -> float:
    """Median seconds per call of call(0), ..., call(calls - 1), captured in one CUDA graph and
    replayed between CUDA events: the GPU's time alone, with no host cost between the launches."""
    call(0)                                   # builds and loads the kernels, warms the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    return cuda_time(graph.replay, repeats) / calls


def bench_kernel_alone(shape: dict, batch: int, context: int, repeats: int, bandwidth_gbs: float) -> dict:
    """One layer's decode attention for `batch` rows of `context` tokens (bf16 KV), alone: the K/V
    bytes it must read over its time, against the measured read bandwidth. Successive calls read
    disjoint copies of the batch's KV, together over L2_FLUSH_BYTES, so even batch 1 streams from HBM."""
    import paged_attention as pa
    kv_heads, head_dim = shape["num_key_value_heads"], shape["head_dim"]
    per_row = -(-context // BLOCK_SIZE)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2             # K and V, bf16
    copies = max(4, -(-L2_FLUSH_BYTES // kv_bytes))
    num_blocks = copies * batch * per_row
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(copies, batch, per_row)  # scattered blocks
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, shape["num_attention_heads"], head_dim, dtype=torch.bfloat16, device="cuda")
    plan = pa.host_cuda_plan(q, k_cache, ctx, qsl, "cuda")              # one plan: every copy has these contexts
    s = graph_time_per_call(lambda i: pa.paged_attention(q, k_cache, v_cache, tables[i], ctx, qsl, head_dim ** -0.5,
                                                         "cuda", plan), copies, repeats)
    # the PyTorch reference (gather + SDPA per row; it reads the batch back, so eager), a few calls
    ref_s = cuda_time(lambda: pa.paged_attention_reference(q, k_cache, v_cache, tables[0], ctx, qsl, head_dim ** -0.5),
                      max(2, repeats // 10))
    return {"kernel_s": s, "kv_bytes": kv_bytes, "kernel_gbs": kv_bytes / s / 1e9,
            "kernel_frac_of_bandwidth": kv_bytes / s / 1e9 / bandwidth_gbs, "max_parts": plan.max_parts,
            "partition": int(plan.plan[0]), "reference_s": ref_s, "kernel_over_reference": ref_s / s}


FUSED_SHAPES = {"add_rms_norm_": (64, 4096), "silu_and_mul": (64, 2 * 14336),   # Llama-3-8B, batch 64
                "rope_and_cache_": (64, (32 + 2 * 8) * 128)}                     # its qkv rows: 32 q, 8 k, 8 v heads x 128


def bench_fused_ops(repeats: int, bandwidth_gbs: float) -> dict:
    """The fused per-layer ops (csrc/fused_cuda.cu) alone at Llama-3-8B's batch-64 shapes, bf16: us per
    call (a CUDA graph of calls over copies larger than L2) beside their bytes at the read bandwidth,
    and their references (model.py's PyTorch versions; the unfused CUDA pair for rope_and_cache_)."""
    import model as FO
    import paged_attention as pa
    pa.resolve_backend("cuda", "cuda")
    ops = torch.ops.nanoserve_cuda
    out = {}
    for name, (rows, width) in FUSED_SHAPES.items():
        copies = max(4, -(-L2_FLUSH_BYTES // (rows * width * 2)))
        x = torch.randn(copies, rows, width, dtype=torch.bfloat16, device="cuda")
        if name == "add_rms_norm_":
            residual, weight = torch.randn_like(x), torch.ones(width, dtype=torch.bfloat16, device="cuda")
            nbytes = 4 * rows * width * 2                                          # read x, residual; write both
            fused = lambda i: ops.add_rms_norm_(x[i], residual[i], weight, 1e-5)  # noqa: E731
            ref = lambda i: FO.rms_norm(x[i], weight, 1e-5, residual[i])          # noqa: E731
        elif name == "silu_and_mul":
            nbytes = rows * width * 2 * 3 // 2                                     # read gate and up; write half
            fused = lambda i: ops.silu_and_mul(x[i])                               # noqa: E731
            ref = lambda i: FO.silu_and_mul(x[i])                                  # noqa: E731
        else:
            fused, ref, nbytes = rope_and_cache_calls(ops, x, copies)
        s = graph_time_per_call(fused, copies, repeats)
        ref_s = graph_time_per_call(ref, copies, repeats)
        out[name] = {"shape": [rows, width], "us": s * 1e6, "reference_us": ref_s * 1e6, "bytes": nbytes,
                     "roofline_us": nbytes / (bandwidth_gbs * 1e9) * 1e6}
    return out


def rope_and_cache_calls(ops, qkv, copies: int):
    """RoPE + KV write at Llama-3-8B's batch-64 qkv rows: the fused op, and the two unfused CUDA ops it
    replaces (rope_, then reshape_and_cache), each copy writing its own 64 slots."""
    rows, heads, kv_heads, head_dim = qkv.shape[1], 32, 8, 128
    cos, sin = (torch.rand(rows, head_dim // 2, device="cuda") for _ in range(2))
    caches = [torch.zeros(copies * rows // BLOCK_SIZE + 1, BLOCK_SIZE, kv_heads, head_dim, dtype=qkv.dtype,
                          device="cuda") for _ in range(2)]
    slots = torch.arange(copies * rows, device="cuda").view(copies, rows)
    nbytes = rows * (qkv.shape[2] + (heads + kv_heads) * head_dim + 2 * kv_heads * head_dim) * 2   # read, rotate, cache

    def unfused(i):
        ops.rope_(qkv[i], cos, sin, heads + kv_heads, head_dim)
        k, v = qkv[i][:, heads * head_dim:].view(rows, 2 * kv_heads, head_dim).split(kv_heads, dim=1)
        ops.reshape_and_cache(k, v, *caches, slots[i])
    return lambda i: ops.rope_and_cache_(qkv[i], cos, sin, *caches, slots[i], heads), unfused, nbytes


def random_model(shape: dict):
    """model.Llama of this shape on the GPU, bf16, random normal weights (norms at 1)."""
    import model as M
    cfg = M.ModelConfig(**shape)
    with torch.device("meta"):
        net = M.Llama(cfg)
    net = net.to(torch.bfloat16).to_empty(device="cuda").eval()
    for name, p in net.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0, 0.02)
    net.inv_freq = M.rope_inv_freq(cfg).to("cuda")
    return net


def decode_batch(batch: int, context: int):
    """batch rows decoding after `context` cached tokens, each with its own run of blocks."""
    from scheduler import ScheduledBatch
    from sequence import Sequence
    per_row = -(-(context + 1) // BLOCK_SIZE)
    seqs = []
    for i in range(batch):
        seq = Sequence(i, [1] * (context + 1), context + 1, 1)
        seq.block_table = list(range(i * per_row, (i + 1) * per_row))
        seq.num_computed_tokens = context
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * batch, sample_rows=list(range(batch)))


def bench_shape(name: str, shape: dict, gs: GpuSizes, bandwidth_gbs: float) -> dict:
    from kv_cache import KVCachePool
    from model_runner import ModelRunner
    import paged_attention as pa
    net = random_model(shape)
    cfg = net.config
    per_row = -(-(gs.context + 1) // BLOCK_SIZE)
    pool = KVCachePool(cfg.num_hidden_layers, max(BATCHES) * per_row, BLOCK_SIZE, cfg.num_key_value_heads,
                       cfg.head_dim, torch.bfloat16, "cuda")
    runner = ModelRunner(net, pool, BLOCK_SIZE, torch.device("cuda"), pa.resolve_backend("cuda", "cuda"),
                         max_num_seqs=max(BATCHES), max_num_batched_tokens=max(BATCHES),
                         max_model_len=gs.context + BLOCK_SIZE)
    t0 = time.perf_counter()
    runner.capture_graphs()
    capture_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    kv_token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    rows = {}
    for b in BATCHES:
        batch = decode_batch(b, gs.context)
        kv_bytes = b * (gs.context + 1) * kv_token_bytes
        roofline_s = (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9)
        out = {"roofline_s": roofline_s, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
        for mode in ("graph", "eager"):
            def step():
                inputs = runner.prepare(batch)
                if mode == "eager":
                    inputs.graph = None
                return runner.forward(inputs).argmax(-1).tolist()    # the sampler's one read
            step()
            times = []
            for _ in range(gs.steps):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            out[f"{mode}_step_s"] = statistics.median(times)
            out[f"{mode}_over_roofline"] = out[f"{mode}_step_s"] / roofline_s
        inputs = runner.prepare(batch)
        graph = inputs.graph
        if graph is not None:
            torch.cuda.synchronize()
            replays = []
            for _ in range(gs.steps):
                t = time.perf_counter()
                graph.graph.replay()
                replays.append(time.perf_counter() - t)
                torch.cuda.synchronize()
            out["graph_replay_host_s"] = statistics.median(replays)
        q = torch.randn(b, cfg.num_attention_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
        k_cache, v_cache = pool.kv_caches[0]
        m = inputs.meta
        kernel_s = cuda_time(lambda: pa.paged_attention(q, k_cache, v_cache, m.block_tables, m.context_lens,
                                                         m.query_start_loc, cfg.head_dim ** -0.5, "cuda",
                                                         m.cuda_plan), gs.kernel_repeats)
        layer_kv = kv_bytes / cfg.num_hidden_layers
        out |= {"kernel_s": kernel_s, "kernel_gbs": layer_kv / kernel_s / 1e9,
                "kernel_frac_of_bandwidth": layer_kv / kernel_s / 1e9 / bandwidth_gbs}
        rows[str(b)] = out
    del runner, pool, net
    torch.cuda.empty_cache()
    return {"capture_s": capture_s, "batches": rows}


def bench_gpu(sz, seed, results):
    """How close does a decode step on the CUDA path come to the HBM roofline, graphs against eager?"""
    title = "GPU: decode step against the HBM roofline (CUDA graphs vs eager)"
    if not torch.cuda.is_available():
        why = f"no CUDA device (torch {torch.__version__})"
        section_header(title, [f"skipped: {why}"])
        results["gpu_decode"] = {"skipped": why}
        return
    gs = GpuSizes(steps=3, kernel_repeats=5) if sz.name == "quick" else GpuSizes()
    bw = read_bandwidth_gbs()
    out = {"device": torch.cuda.get_device_name(), "read_bandwidth_gbs": bw, "context": gs.context, "models": {}}
    for name, shape in SHAPES.items():
        out["models"][name] = bench_shape(name, shape, gs, bw)
    for name, shape in {**SHAPES, **KERNEL_ONLY_SHAPES}.items():
        out["models"].setdefault(name, {"batches": {}})["kernel_at_context"] = {
            str(b): bench_kernel_alone(shape, b, KERNEL_CONTEXT, gs.kernel_repeats, bw) for b in BATCHES}
        torch.cuda.empty_cache()
    out["fused_ops"] = bench_fused_ops(gs.kernel_repeats, bw)
    replays = [r["graph_replay_host_s"] for m in out["models"].values() for r in m["batches"].values()
               if "graph_replay_host_s" in r]
    if replays:
        out["graph_replay_s"] = statistics.median(replays)
    section_header(title, [
        f"{out['device']}; HBM read bandwidth {bw:.0f} GB/s (sum of a 2 GiB bf16 tensor); random bf16 weights; "
        f"each row decodes after {gs.context} cached tokens.",
        "roofline = (weight bytes + KV bytes read) / read bandwidth; a step = prepare + forward + argmax read "
        "back (host wall time, median); kernel = one layer's paged attention alone, CUDA events."])
    print(md_table(["model", "batch", "roofline ms", "graph step ms", "graph / roofline", "eager step ms",
                    "eager / roofline", "kernel us", "kernel of HBM bw"],
                   [[name, b, r["roofline_s"] * 1e3, r["graph_step_s"] * 1e3, r["graph_over_roofline"],
                     r["eager_step_s"] * 1e3, r["eager_over_roofline"], r["kernel_s"] * 1e6,
                     r["kernel_frac_of_bandwidth"]]
                    for name, m in out["models"].items() for b, r in m["batches"].items()]))
    print(f"\nThe decode kernel alone at {KERNEL_CONTEXT:,} tokens of context (one layer, bf16 KV; a CUDA graph of "
          "calls over disjoint KV copies, so no host cost and no L2 reuse); target >= 0.80 of the read bandwidth (0.70 at SmolLM2's shape):\n")
    print_kernel_tables(out)
    results["gpu_decode"] = out


def print_kernel_tables(out: dict):
    print(md_table(["model", "batch", "partition x parts", "kernel us", "KV MB read", "GB/s", "of HBM bw",
                    "PyTorch reference us", "kernel speedup"],
                   [[name, b, f"{min(r['partition'], KERNEL_CONTEXT)} x {r['max_parts']}", r["kernel_s"] * 1e6,
                     r["kv_bytes"] / 1e6, r["kernel_gbs"], r["kernel_frac_of_bandwidth"], r["reference_s"] * 1e6,
                     r["kernel_over_reference"]]
                    for name, m in out["models"].items() for b, r in m["kernel_at_context"].items()]))
    print("\nThe fused ops alone (Llama-3-8B shapes, batch 64, bf16; a CUDA graph of calls); targets: add + RMSNorm "
          "<= 4 us, SiLU-and-mul <= 6 us. Reference: model.py's PyTorch version; for rope_and_cache_, the two "
          "CUDA ops it fuses (rope_, then reshape_and_cache):\n")
    print(md_table(["op", "shape", "us per call", "bytes at read bandwidth, us", "reference us"],
                   [[name, "x".join(map(str, r["shape"])), r["us"], r["roofline_us"], r["reference_us"]]
                    for name, r in out["fused_ops"].items()]))


def main():
    """`python -m benchmarks.gpu`: the decode kernel alone at 2,048 tokens (Llama-3 and SmolLM2 shapes,
    batch 1 to 128, against the PyTorch reference) and the fused ops, without the whole-model steps:
    about a minute on an H100. Writes kernels.json into the directory given (default: the current one)."""
    import json
    import sys
    from pathlib import Path
    bw = read_bandwidth_gbs()
    out = {"device": torch.cuda.get_device_name(), "read_bandwidth_gbs": bw, "models": {}}
    print(f"{out['device']}; HBM read bandwidth {bw:.0f} GB/s")
    for name, shape in {**SHAPES, **KERNEL_ONLY_SHAPES}.items():
        out["models"][name] = {"kernel_at_context": {
            str(b): bench_kernel_alone(shape, b, KERNEL_CONTEXT, 20, bw) for b in BATCHES}}
        torch.cuda.empty_cache()
    out["fused_ops"] = bench_fused_ops(20, bw)
    print_kernel_tables(out)
    (Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")).joinpath("kernels.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
