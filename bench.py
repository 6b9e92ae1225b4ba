"""
bench.py: every performance claim nanoserve makes, measured side by side in one run.

`python bench.py [SECTION ...] [--quick | --full] [--out results/ | --out FILE.json] [--plot DIR]` runs the
experiments (default: all) and prints a markdown table for each, then the targets; `--out results/` also writes
the run as results/<date>-<machine>-<commit>.md/.json/.png (benchmarks/report.py), and `python bench.py --readme`
rewrites the README's table from the newest of them. `python bench.py soak --minutes N` runs the server soak.
Each experiment is one function that states its question, its workload and its table, in the file of its
concept under benchmarks/: batching.py (batching, KV memory, caching), online.py (arrivals, chunked prefill,
HTTP through loadgen.py), hardware.py (roofline, kernel), peers.py (vLLM and transformers), hot.py and
structured.py. This file owns the sizes, the machine table, the targets and the command line; it never
changes what the engine does, and every number it prints is measured.
"""
import os
# OpenMP threads that spin without bound steal the other core from anything else running (2 shared cores),
# while a fully passive wait makes every small op pay a thread wake-up: measured here, an RMSNorm of a
# batch-64 decode step took 770 us passive vs 100 us with this short spin, and the whole step 1.3x longer.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
import sys
if not sys.stderr.isatty():
    # a progress bar in a log file: at most one update every 10 s from the bars of other libraries too
    # (transformers', vLLM's); tqdm reads TQDM_* defaults once, when it is first imported
    os.environ.setdefault("TQDM_MININTERVAL", "10")

import argparse
import importlib
import platform
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks import batching as bench_batching
from benchmarks import gpu as bench_gpu
from benchmarks import harness
from benchmarks import hardware as bench_hardware
from benchmarks import invariance as bench_invariance
from benchmarks import online as bench_online
from benchmarks import parallel as bench_tp
from benchmarks import peers as bench_peers
from benchmarks import report
from benchmarks import scaleout as bench_scaleout
from benchmarks import spec_decode as bench_spec_decode
from benchmarks import tiers as bench_tiers
from benchmarks.llamacpp import llamacpp_unavailable
from cpu_linear import cpu_flags, cpu_linear_path
from benchmarks.harness import bench_device, make_engine, md_table, section_header
from model import resolve_dtype
from paged_attention import resolve_backend


@dataclass
class Sizes:
    """How big each experiment is. The default fits a few minutes on 2 CPU cores (the vLLM peers workload at
    full size, the batching workloads with every length / 8); FULL is every workload at full size; QUICK is
    the smoke test, whose numbers only prove that each experiment runs."""
    name: str = "default"
    num_requests: int = 128
    out_range: tuple = (2, 64)           # full size 16-512, / 8: the same max/min spread of 32
    prompt_median: int = 12              # full size ~100, / 8: prefill stays the same share of the work
    static_sizes: tuple = (8, 32, 64)
    static_max_requests: tuple = ((8, 16), (32, 32))   # static bs=8 / 32 run only the first 16 / 32 requests
    max_num_seqs: int = 64
    kv_cache_memory: str = "512MiB"      # KV pool of every engine here unless an experiment sets its own
    mem_requests: int = 16
    mem_prompt_median: int = 100
    mem_max_model_len: int = 1024
    latency_requests: int = 8
    latency_out_range: tuple = (8, 32)
    latency_prompt_median: int = 100
    rate_fractions: tuple = (0.5, 1.0, 2.0, 4.0)
    long_prompt: int = 1024
    chunk_budget: int = 256              # max_num_batched_tokens of the chunked engine
    settle_steps: int = 12               # decode steps before the long prompt arrives
    http_prompts: int = 32
    http_len: int = 128                  # vllm bench serve --random-input-len = --random-output-len
    http_rate: float = float("inf")
    http_rounds: int = 3                 # rounds of each server (serve.py's in turns with the engine in process)
    peer_requests: int = 64              # 64 random-id prompts (~8.5k tokens), outputs 16-256 (~8.7k tokens)
    peer_out_range: tuple = (16, 256)
    peer_prompt_median: int = 111        # log-normal: mean ~133 tokens
    peer_max_num_seqs: int = 64
    peer_kv_cache_memory: str = "1GiB"
    b1_tokens: int = 64
    hf_requests: int = 8
    hf_batch_sizes: tuple = (8,)
    decode_batches: tuple = (1, 8, 32, 64)
    decode_prompt: int = 32
    kernel_batch: int = 64
    kernel_contexts: tuple = (512, 2048)
    kernel_e2e_batch: int = 16
    kernel_e2e_prompt: int = 32
    repeats: int = 3
    prefix_len: int = 256
    prefix_requests: int = 12
    prefix_out: int = 8
    tier_tenants: int = 32               # prefix-cache tiers: tenants cycling, each with its own system prompt
    tier_prefix_len: int = 1000
    conversations: int = 3
    turns: int = 3
    cow_prompt: int = 500
    cow_out: int = 32
    pressure_requests: int = 10
    pressure_out_range: tuple = (8, 32)
    pressure_prompt_median: int = 100
    api_rounds: int = 5                  # interleaved rounds per variant of the API-cost steps
    fused_compile: bool = True           # time torch.compile beside csrc's fused ops (tens of seconds to compile)
    fused_rounds: int = 3                # decode steps with each set of fused ops, taking turns
    gguf_rows: tuple = (1, 2, 4, 5, 8, 16)  # rows per pass over the linear layers, GGUF blocks vs float32
    gguf_batches: tuple = (1, 4)         # decode steps with and without the blocks, taking turns
    int8_rows: tuple = (1, 4, 16, 64)    # rows per pass over the linear layers, int8 vs float32 and GGUF blocks
    int8_batches: tuple = (1, 16)        # decode steps on an int8 and a float32 engine, taking turns
    panel_rows: tuple = (1, 8, 64, 256)  # rows per pass over the linear layers, panels vs oneDNN
    panel_batches: tuple = (16, 64)      # decode steps on an engine of each kind, taking turns
    spec_batches: tuple = (1, 4, 16, 64)  # speculative: requests run together
    spec_min_requests: int = 4           # a batch smaller than this runs this many, in turn
    spec_out: int = 64                   # output tokens a request
    spec_k: int = 4                      # num_speculative_tokens
    spec_kv_cache_memory: str = "1GiB"


FULL = Sizes(name="full", num_requests=128, out_range=(16, 512), prompt_median=100, static_max_requests=(),
             kv_cache_memory="2GiB", mem_requests=32, latency_requests=32, latency_out_range=(16, 512), long_prompt=2000,
             http_prompts=64, http_rounds=4, hf_requests=64, hf_batch_sizes=(8, 32, 64), decode_prompt=128, kernel_e2e_batch=64,
             kernel_e2e_prompt=128, repeats=5, prefix_len=1000, prefix_requests=64, pressure_requests=16)

QUICK = Sizes(name="quick", num_requests=6, out_range=(4, 12), prompt_median=16, static_sizes=(4,), static_max_requests=(),
              max_num_seqs=8, mem_requests=4, mem_prompt_median=32, mem_max_model_len=128, latency_requests=4,
              latency_out_range=(4, 8), latency_prompt_median=16, rate_fractions=(1.0,), long_prompt=96, chunk_budget=32, settle_steps=3,
              http_prompts=4, http_len=16, http_rounds=1, peer_requests=4, peer_out_range=(4, 8), peer_prompt_median=16,
              peer_max_num_seqs=8, peer_kv_cache_memory="128MiB", b1_tokens=8, hf_requests=2, hf_batch_sizes=(2,),
              decode_batches=(1, 4), decode_prompt=16, kernel_batch=8, kernel_contexts=(128,), kernel_e2e_batch=4,
              kernel_e2e_prompt=16, repeats=2, api_rounds=1, prefix_len=32, prefix_requests=3, prefix_out=4, conversations=2, turns=2,
              tier_tenants=8, tier_prefix_len=64,
              cow_prompt=40, cow_out=4, pressure_requests=3, pressure_out_range=(20, 28), pressure_prompt_median=16,
              fused_compile=False, fused_rounds=1, gguf_rows=(1, 4), gguf_batches=(1,), int8_rows=(1, 4), int8_batches=(1,), panel_rows=(1, 8),
              panel_batches=(4,), spec_batches=(2,), spec_min_requests=2, spec_out=12, spec_kv_cache_memory="128MiB")


# ----------------------------------------------------------------------------- measurements from other files

def optional(module, *names):
    """The first of `names` that `module` defines, or (None, why): those files may not be on this branch."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return None, f"{module}.py is not importable ({e})"
    fn = next((getattr(mod, n) for n in names if hasattr(mod, n)), None)
    return (fn, None) if fn else (None, f"{module}.py has none of {names}")


def print_flat(title, d, prefix=""):
    """A returned dict of measurements as a two-column table (nested keys joined with '.')."""
    def flat(x, p):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from flat(v, f"{p}{k}.")
        else:
            yield p[:-1], x
    section_header(title)
    print(md_table(["measurement", "value"], [[k, v] for k, v in flat(d, prefix)]))


def bench_step(sz, seed, results):
    """What does a batch-1 decode step cost outside its matmuls, per layer, and what did fusing RoPE with the
    KV-cache write take off it? (The hot section's first table; `bench.py step` runs it alone.)"""
    fn, why = optional("benchmarks.hot", "step_breakdown")
    title = "Hot path: the batch-1 decode step outside its matmuls, per layer (bench_hot.py)"
    if why:
        section_header(title, [f"skipped: {why}"])
        results["step"] = {"skipped": why}
        return
    d = results["step"] = fn(make_engine(kv_cache_memory="256MiB", enable_prefix_caching=False),
                             rounds=sz.fused_rounds, steps=2 * sz.b1_tokens // 8 or 4)
    before, after = d["modes"]["before"], d["modes"]["after"]
    section_header(title, [
        f"default engine ({d['path']} path, {d['dtype']} activations), {d['layers']} layers, batch {d['batch']}, "
        f"{d['context']} tokens of context; step: median of the engine's decode steps, best of {d['rounds']} rounds "
        "taking turns; matmuls: every linear layer alone at the same rows; ops: each alone at one layer's shapes",
        "before: RoPE and the KV-cache write as two ops (strided k and v copied for the write); after: one op"])
    rows = [["decode step (ms)", before["step_ms"], after["step_ms"]],
            ["matmuls alone (ms)", d["matmul_ms"], d["matmul_ms"]],
            ["outside the matmuls (ms)", before["outside_ms"], after["outside_ms"]],
            ["outside the matmuls, per layer (us)", before["outside_per_layer_us"], after["outside_per_layer_us"]]]
    for op in dict.fromkeys([*before["ops_us"], *after["ops_us"]]):
        rows.append([f"  {op} (us per layer)", before["ops_us"].get(op, "-"), after["ops_us"].get(op, "-")])
    print(md_table(["measurement", "before", "after"], rows))
    print_layer_op(results, sz)


def print_layer_op(results, sz):
    """The int8 engine's batch-1 step outside its matmuls: each layer as Python modules, then as one op."""
    title = "Hot path: the int8 engine's batch-1 decode step, each layer as Python modules or as one op (bench_hot.py)"
    try:                                       # int8 runs on the CPU only (the engine refuses it elsewhere)
        engine = make_engine(kv_cache_memory="256MiB", enable_prefix_caching=False, quantization="int8", dtype="float32")
    except Exception as e:
        section_header(title, [f"skipped: {e}"])
        results["layer_op"] = {"skipped": str(e)}
        return
    d = results["layer_op"] = optional("benchmarks.hot", "layer_op_breakdown")[0](
        engine, rounds=sz.fused_rounds, steps=2 * sz.b1_tokens // 8 or 4)
    before, after = d["modes"]["before"], d["modes"]["after"]
    section_header(title, [
        f"quantization {d['path']}, float32 activations, {d['layers']} layers, batch {d['batch']}, {d['context']} tokens of "
        f"context; step: median of the engine's decode steps, best of {d['rounds']} rounds taking turns; matmuls: every "
        f"linear layer alone at the same rows",
        "before: each layer as model.py's modules (~10 ops, views, 9 module calls); after: the layers as one op "
        f"(csrc/decoder_layer_cpu.cpp{'' if d['layer_op'] else ': NOT BUILT, both columns are the Python layers'})"])
    rows = [["decode step (ms)", before["step_ms"], after["step_ms"]],
            ["matmuls alone (ms)", d["matmul_ms"], d["matmul_ms"]],
            ["outside the matmuls (ms)", before["outside_ms"], after["outside_ms"]],
            ["outside the matmuls, per layer (us)", before["outside_per_layer_us"], after["outside_per_layer_us"]]]
    print(md_table(["measurement", "before", "after"], rows))


def bench_hot_path(sz, seed, results):
    """Does the paged-attention kernel read KV at memory speed (bench_hot.py's measurement)?"""
    bench_step(sz, seed, results)
    fn, why = optional("benchmarks.hot", "bench_kernel_bandwidth")
    if why:
        section_header("Hot path (bench_hot.py)", [f"skipped: {why}"])
        results["hot"] = {"skipped": why}
        return
    out = fn(batch=sz.kernel_batch, contexts=sz.kernel_contexts, repeats=sz.repeats)
    print_flat("Hot path: KV read speed of the paged-attention kernel (bench_hot.py)", out)
    results["hot"] = out
    fused, why = optional("benchmarks.hot", "fused_ops_vs_compile")
    results["fused_ops"] = {"skipped": why} if why else fused(
        rows=(sz.kernel_batch, 8 * sz.kernel_batch), batch=sz.kernel_batch, repeats=sz.repeats + 2,
        rounds=sz.fused_rounds, compile_ops=sz.fused_compile)
    print_fused_ops(results["fused_ops"])
    gguf, why = optional("benchmarks.hot", "gguf_blocks_vs_float32")
    results["gguf_blocks"] = {"skipped": why} if why else gguf(
        rows=sz.gguf_rows, batches=sz.gguf_batches, repeats=sz.repeats, rounds=sz.fused_rounds)
    print_gguf_blocks(results["gguf_blocks"])
    int8, why = optional("benchmarks.hot", "int8_vs_float32")
    results["int8"] = {"skipped": why} if why else int8(
        rows=sz.int8_rows, batches=sz.int8_batches, repeats=sz.repeats, rounds=sz.fused_rounds)
    print_int8(results["int8"])
    panels, why = optional("benchmarks.hot", "panels_vs_onednn")
    results["panels"] = {"skipped": why} if why else panels(
        rows=sz.panel_rows, batches=sz.panel_batches, repeats=sz.repeats, rounds=sz.fused_rounds)
    print_panels(results["panels"])


def print_fused_ops(f):
    """Residual add + RMSNorm, RoPE and SwiGLU: csrc/fused_cpu.cpp against torch.compile, and plain PyTorch."""
    title = "Hot path: fused ops, csrc/fused_cpu.cpp vs torch.compile (bench_hot.py)"
    if "skipped" in f:
        section_header(title, [f"skipped: {f['skipped']}"])
        return
    compiled = f["torch_compile"] == "run"
    section_header(title, [
        f"{f['dtype']}; per call, best of {f['repeats']} runs of {f['calls']} calls; torch.compile = model.py's plain references compiled with "
        f"dynamic shapes (as an engine option would: the row count changes every step)"
        + (f", {f['compile_s']:.0f} s to compile" if compiled else f": {f['torch_compile']}"),
        f"decode step at batch {f['batch']}: the engine with each set of ops, taking turns, best median of {f['rounds']} rounds"])
    rows = [[op, r["plain_us"], r["csrc_us"], r.get("compiled_us", "-"), r["plain_us"] / r["csrc_us"],
             r["compiled_us"] / r["csrc_us"] if compiled else "-"] for op, r in f["ops"].items()]
    st = f["step"]
    rows.append([f"decode step, batch {f['batch']} (ms)", st["plain_ms"], st["csrc_ms"], st.get("compiled_ms", "-"),
                 st["plain_ms"] / st["csrc_ms"], st["compiled_ms"] / st["csrc_ms"] if compiled else "-"])
    print(md_table(["op", "plain us", "csrc us", "torch.compile us", "plain / csrc", "torch.compile / csrc"], rows))
    if compiled:
        wins = sum(r["csrc_us"] < r["compiled_us"] for r in f["ops"].values())
        print(f"\ncsrc faster than torch.compile per call in **{wins} of {len(f['ops'])}** op rows; "
              f"fastest decode step: {f['fastest_step']}")


def print_linear_ab(title, d, lines, new, old):
    """A linear-layer A/B from bench_hot.py: ms per pass over all layers at each row count and per
    decode step at each batch; new and old are (key, column name), the ratio old / new."""
    if "skipped" in d:
        section_header(title, [f"skipped: {d['skipped']}"])
        return
    section_header(title, lines)
    (a, a_name), (b, b_name) = new, old
    rows = [[f"{r} rows, one pass over all linear layers (ms)", v[f"{a}_ms"], v[f"{b}_ms"], v[f"{b}_ms"] / v[f"{a}_ms"]]
            for r, v in d["per_pass"].items()]
    rows += [[f"decode step, batch {n} (ms)", v[f"{a}_ms"], v[f"{b}_ms"], v[f"{b}_ms"] / v[f"{a}_ms"]]
             for n, v in d["step"].items()]
    print(md_table(["measurement", a_name, b_name, f"{b_name} / {a_name}"], rows))


def print_gguf_blocks(g):
    """Few-row linear layers on the GGUF's own Q4_1/Q8_0 blocks (csrc/linear_cpu.cpp) vs the float32 weights."""
    print_linear_ab("Hot path: linear layers on the GGUF's Q4_1/Q8_0 blocks vs float32 weights (bench_hot.py)", g, [
        f"{g.get('log')}; the same float32 values either way (checked bit for bit when the blocks were written)",
        f"one pass over every linear layer: best of {g.get('repeats')}; decode step: the engine with and without "
        f"the blocks, taking turns, best median of {g.get('rounds')} rounds"], ("gguf", "GGUF blocks"), ("float32", "float32 weights"))


def bench_int8_kernels(sz, seed, results):
    """The hot section's integer-kernel table alone (quick): int8 and GGUF 8-bit activations vs float32."""
    int8, why = optional("benchmarks.hot", "int8_vs_float32")
    results["int8"] = {"skipped": why} if why else int8(
        rows=sz.int8_rows, batches=sz.int8_batches, repeats=sz.repeats, rounds=sz.fused_rounds)
    print_int8(results["int8"])


def print_int8(d):
    """quantization="int8" and GGUF 8-bit activations (csrc linear_q8) vs float32 and the GGUF's blocks,
    per pass and per decode step."""
    title = 'Hot path: linear layers, quantization="int8" vs float32 and GGUF blocks (bench_hot.py)'
    if "skipped" in d:
        section_header(title, [f"skipped: {d['skipped']}"])
        return
    isa = d.get("isa", {})
    section_header(title, [d["log"], f"one pass over the {d['layers']} layers int8 quantizes (lm_head left out), "
                   f"the kernels taking turns, best of {d['repeats']}; GGUF blocks: 8-bit activations against them "
                   f"(quantization=\"gguf\") and float32 sums (the float32 engine's kernel at 1-2 rows); decode step: an int8 and a "
                   f"float32 engine, taking turns, best median of {d['rounds']} rounds",
                   f"integer dot product: {isa.get('q8_dot', '-')} (NANOSERVE_CPU_ISA={isa.get('NANOSERVE_CPU_ISA', '-')}); "
                   f"float32: {isa.get('float32', '-')}, torch CPU capability {isa.get('torch_capability', '-')}"])
    rows = [[f"{r} rows, one pass (ms)", v["int8_ms"], v.get("gguf_q8_ms", "-"), v["float32_ms"], v.get("gguf_ms", "-"),
             v["float32_ms"] / v["int8_ms"], v["float32_ms"] / v["gguf_q8_ms"] if "gguf_q8_ms" in v else "-"]
            for r, v in d["per_pass"].items()]
    rows += [[f"decode step, batch {b} (ms)", v["int8_ms"], "-", v["float32_ms"], "-", v["float32_ms"] / v["int8_ms"], "-"]
             for b, v in d["step"].items()]
    print(md_table(["measurement", "int8", "GGUF blocks, 8-bit x", "float32 (panels or oneDNN)", "GGUF blocks, float32 sums",
                    "float32 / int8", "float32 / GGUF 8-bit x"], rows))


def print_panels(p):
    """Linear layers at the default dtype: csrc/linear_cpu.cpp's GEMM on weight panels vs oneDNN on its prepacked weight."""
    print_linear_ab(f"Hot path: {p.get('dtype', 'float32 or bfloat16')} linear layers, csrc GEMM on weight panels vs oneDNN (bench_hot.py)", p, [
        f"the same {p.get('dtype')} weights, GGUF blocks off; one pass over every linear layer: best of "
        f"{p.get('repeats')}; decode step: an engine of each kind, taking turns, best median of {p.get('rounds')} rounds"],
        ("panels", "panels"), ("onednn", "oneDNN"))


def bench_api_costs(sz, seed, results):
    """What do structured output and sampling cost per step (bench_structured.py / bench_sampler.py)?"""
    results["api"] = {}
    for key, names in (("structured_output", ("bench_structured_output_cost",)),
                       ("sampling", ("bench_sampling_overhead",))):
        fn, why = optional("benchmarks.structured", *names)
        if why:
            fn, why = optional("benchmarks.sampler", *names)
        if why:
            section_header(f"API cost: {key}", [f"skipped: {why}"])
            results["api"][key] = {"skipped": why}
            continue
        batch = min(32, sz.max_num_seqs) if key == "structured_output" else sz.max_num_seqs   # the targets' batch sizes
        results["api"][key] = fn(batch=batch, rounds=sz.api_rounds)
        print_flat(f"API cost: {key}", results["api"][key])


# ----------------------------------------------------------------------------- machine and targets

def cpu_flags_path():
    """Which fast path this CPU has for bfloat16 matmuls, from its flags (under an ISA cap, the capped ones)."""
    flags = cpu_flags()
    if not flags:
        return "unknown (no /proc/cpuinfo)"
    return ("AMX (amx_bf16)" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags
            else "AVX2 only" if "avx2" in flags else "no AVX2")


# what holds a run to a narrower ISA than the CPU's (an AVX-512 machine standing for CI's AVX2-only CPUs)
ISA_CAPS = ("NANOSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
MODEL_FREE = {"gpu_decode"}    # sections on random weights of their own: the embedded model is never read


def machine_info(sections):
    """(the run's header: date, machine, CPU model and flags, commit, dtype; the machine table bench.py prints).
    An engine on the embedded model tells the dtype, linear layers and backend it runs, built only when a
    section needs that model; otherwise they come from what Engine would resolve on this device."""
    engine = make_engine(kv_cache_memory="16MiB") if set(sections) - MODEL_FREE else None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    dtype_ = engine.dtype if engine else resolve_dtype("auto", bench_device())[0]
    dtype = str(dtype_).removeprefix("torch.")
    h = report.run_header(gpu, dtype)
    info = {"date": h["date"], "machine": h["machine"], "commit": h["commit"] + (" (uncommitted changes)" if h["dirty"] else ""),
            "cpu": h["cpu_model"] or platform.processor(), "cores": h["cores"], "gpu": gpu, "cpu flags": " ".join(h["cpu_flags"]),
            "cpu flags path": cpu_flags_path(), "nanoserve dtype (auto)": dtype
            + (f", quantization {engine.config.quantization} (auto_path.py)" if engine and engine.config.quantization else ""),
            "linear layers": f"{cpu_linear_path(dtype_)}; "
                             + (engine.model.gguf_log if engine else "model not loaded (no section of this run reads it)"),
            "attention backend": engine.attention_backend if engine else resolve_backend("auto", bench_device().type),
            "torch": torch.__version__, "torch threads": torch.get_num_threads(),
            "python": platform.python_version(), "vLLM": bench_peers.vllm_unavailable() or os.environ["VLLM_PYTHON"],
            "llama.cpp": llamacpp_unavailable() or os.environ["LLAMACPP_DIR"],
            "ISA caps": ", ".join(f"{v}={os.environ[v]}" for v in ISA_CAPS if os.environ.get(v)) or "none (the whole CPU)",
            "load avg at start": os.getloadavg()[0]}
    return h, info


def targets(results):
    """Every target that this run measured, met or missed; a target it could not measure says why."""
    rows = []
    t, p, r, h = (results.get(k) for k in ("throughput", "peers", "roofline", "http"))
    for tp in (results.get("invariance") or {}).get("throughput", []):
        rows.append((f"batch-invariant mode >= 0.9x the default's throughput ({tp['dtype']}, peers workload)",
                     tp["invariant_over_default"], 0.9))
    if t:
        rows.append(("continuous >= 2x best static batching (useful tok/s)", t["continuous_over_best_static"], 2.0))
        if "async_over_plain" in t and bench_device().type == "cpu":   # on CUDA: the http section's online target
            rows.append(("async scheduling on a CPU >= 0.97x the plain loop (useful tok/s)", t["async_over_plain"], 0.97))
    if p:
        vllm = p["vllm"]
        best = vllm.get(vllm.get("best_dtype", ""), {})
        why = vllm.get("skipped") or ("vLLM ran in no dtype" if not best else None)
        ours = p["nanoserve"]["default"]
        rows.append(("nanoserve default >= 2x vLLM CPU at its best dtype (useful tok/s, same requests)",
                     why or ours["useful_tok_s"] / best["useful_tok_s"], 2.0))
        rows.append(("batch-1 decode tok/s >= vLLM's batch 1",
                     why or ours["batch1_decode_tok_s"] / max(v["batch1_decode_tok_s"] for v in vllm.values()
                                                               if isinstance(v, dict) and "skipped" not in v), 1.0))
    if p:
        rows += integer_path_targets(p)
    if p and "gguf" in p["nanoserve"]:
        q, lc = p["nanoserve"]["gguf"], p.get("llamacpp", {})
        rows.append(('quantization="gguf" batch-1 decode >= 1.5x llama.cpp batch 1 (tok/s)',
                     q.get("skipped") or lc.get("skipped") or q["batch1_decode_tok_s"] / lc["batch1_decode_tok_s"], 1.5))
        rows.append(('quantization="gguf" peers workload >= 1.3x nanoserve default (useful tok/s)',
                     q.get("skipped") or q["useful_tok_s"] / p["nanoserve"]["default"]["useful_tok_s"], 1.3))
    if r:
        big = str(max(int(b) for b in r["decode"]))
        rows.append((f"decode step at batch {big} >= 50% of the {r['dtype']} matmul roofline",
                     r["decode"][big]["frac_of_matmul_roofline"], 0.5))
    if h:
        runs, base = h["runs"], h["runs"]["nanoserve engine, in process"]["output_tok_s"]
        ours, theirs = runs.get("serve.py", {}), runs.get("vllm serve", {})
        rows.append(("serve.py >= 90% of the engine in process (out tok/s)",
                     ours.get("skipped") or ours["output_tok_s"] / base, 0.9))
        rows.append(("serve.py >= 1.5x vllm serve (out tok/s, same client)",
                     ours.get("skipped") or theirs.get("skipped") or ours["output_tok_s"] / theirs["output_tok_s"], 1.5))
        q = runs.get("serve.py --quantization gguf", {})
        why = ours.get("skipped") or q.get("skipped")
        rows.append(("serve.py --quantization gguf >= serve.py default (out tok/s, same client)",
                     why or q["output_tok_s"] / ours["output_tok_s"], 1.0))
        rows.append(("serve.py --quantization gguf TPOT p50 lower than the default's (default / gguf > 1)",
                     why or ours["tpot_p50_s"] / q["tpot_p50_s"], 1.0))
    s = results.get("speculative")
    if s:
        grounded, rand = s["runs"]["input-grounded"], s["runs"]["random"]
        # GPU targets; a CPU keeps its own (2 cores: the batch-16 step is bound by arithmetic, see docs/spec_decode.md)
        for batch, need in ((1, 2.0), (16, 1.3)) if s.get("device", "cuda") == "cuda" else ((1, 1.4),):
            rows.append((f"ngram speculation, input-grounded, batch {batch} >= {need}x plain (tok/s)",
                         grounded[batch]["ratio"] if batch in grounded else f"batch {batch} not run", need))
        rows.append(("ngram speculation, random workload, every batch size >= 0.95x plain (worst)",
                     min(r_["ratio"] for r_ in rand.values()), 0.95))
    so = results.get("scaleout")
    if so:                                   # 2 one-thread cores; TPOT as colocated / 1:1, so higher is better here too
        rows.append(("scaleout: cache_aware >= 2x round_robin's prefix-hit rate", so["ratios"]["hit_rate"], 2.0))
        rows.append(("scaleout: cache_aware >= 1.3x round_robin's out tok/s", so["ratios"]["throughput"], 1.3))
        rows.append(("scaleout: disaggregated 1:1 TPOT p99 <= 0.6x colocated (colocated / 1:1 >= 1/0.6)",
                     1 / so["ratios"]["tpot_p99"], 1 / 0.6))
    t = results.get("tiers")
    if t:
        q = t["ratios"]
        rows.append(("tiers: prefix-hit rate with the host tier >= 0.8", q["hit_rate_host"], 0.8))
        rows.append(("tiers: TTFT p50 >= 2x better with the host tier (off / host)", q["ttft_p50_off_over_host"], 2.0))
        rows.append(("tiers: first request after a restart on disk, TTFT p50 >= 3x better than cold",
                     q["first_ttft_p50_cold_over_disk_restart"], 3.0))
        rows.append(("tiers: no reuse, out tok/s with the host tier >= 0.97x without", q["no_reuse_tok_s_host_over_off"], 0.97))
    notes = []
    if p and r and "lm_head_params" in r:
        # the most any engine could give on these requests here: every matmul FLOP at the best rate measured
        flops = 2 * (r["matmul_params"] - r["lm_head_params"]) * p["prompt_tokens"] + 2 * r["matmul_params"] * p["output_tokens"]
        ceiling = p["output_tokens"] / (flops / (r["peak_matmul_gflops"] * 1e9))
        notes.append(f"Compute ceiling of the peer workload on this machine: {flops / 1e12:.2f} TFLOP of matmuls at the "
                     f"best rate measured here ({r['peak_matmul_gflops']:.0f} GFLOP/s, {r['dtype']}) = {ceiling:.0f} useful "
                     "tok/s, attention and sampling not counted.")
        best = p["vllm"].get(p["vllm"].get("best_dtype", ""), {})
        if "useful_tok_s" in best:
            notes[-1] += f" Twice vLLM's best here is {2 * best['useful_tok_s']:.0f} tok/s."
    if p and r and "batch1_decode_tok_s" in p["nanoserve"].get("gguf", {}) and "batch1_decode_tok_s" in p.get("llamacpp", {}) \
            and "1" in r["decode"]:
        notes.append(gguf_batch1_ceiling(r, p))
    i8 = results.get("int8", {}).get("per_pass")
    if i8:                                   # the batched steps are bound by arithmetic: the kernels' own ratio caps them
        big = max(i8, key=int)
        v = i8[big]
        quant = {k[:-3]: t for k, t in v.items() if k != "float32_ms"}
        notes.append(f"Batched ceiling of the integer paths here: one pass over the linear layers at {big} rows takes "
                     + ", ".join(f"{t:.0f} ms in {k}" for k, t in quant.items())
                     + f" against {v['float32_ms']:.0f} ms on float32 layers (hot section), so a quantized engine's "
                     f"batched steps gain at most {v['float32_ms'] / min(quant.values()):.2f}x there.")
    section_header("Targets (measured in this run)", notes)
    print(md_table(["target", "measured", "needed", "result"],
                   [[n, m, need, ("met" if m >= need else "missed") if isinstance(m, float) else "not measured"]
                    for n, m, need in rows]))
    return [{"target": n, "measured": m, "needed": need, "met": isinstance(m, float) and m >= need} for n, m, need in rows]


def integer_path_targets(p):
    """The integer paths (quantization "int8" / "gguf", the faster of the two on each measure) on the peers
    workload against the float32 engine and vLLM at its best, and at batch 1 against llama.cpp on the same GGUF."""
    ours, vllm, lc = p["nanoserve"], p["vllm"], p.get("llamacpp", {})
    ran = {k: v for k, v in ours.items() if k in ("int8", "gguf") and "skipped" not in v}
    if not ran:
        return [("integer path targets", "no integer path ran here", 1.0)]
    best = max(ran, key=lambda k: ran[k]["useful_tok_s"])
    b1 = max(ran, key=lambda k: ran[k]["batch1_decode_tok_s"])
    f32 = ours.get("float32", {})
    vbest = vllm.get(vllm.get("best_dtype", ""), {})
    return [(f"integer path ({best}) peers workload >= 1.5x the float32 engine (useful tok/s)",
             f32.get("skipped") or ran[best]["useful_tok_s"] / f32["useful_tok_s"] if f32 else "float32 not run", 1.5),
            (f"integer path ({best}) peers workload >= 2x vLLM CPU at its best dtype (useful tok/s)",
             vllm.get("skipped") or ("vLLM ran in no dtype" if not vbest else ran[best]["useful_tok_s"] / vbest["useful_tok_s"]), 2.0),
            (f"integer path ({b1}) batch-1 decode >= 1.0x llama.cpp's on the same GGUF and threads (tok/s)",
             lc.get("skipped") or ran[b1]["batch1_decode_tok_s"] / lc["batch1_decode_tok_s"], 1.0)]


def gguf_batch1_ceiling(r, p):
    """The fastest batch 1 quantization="gguf" could reach here, from this run's numbers: the decode step's time
    outside its matmuls (roofline at batch 1; the default engine reads the same blocks at one row) plus every
    tensor of the GGUF file read once at the read bandwidth measured here, against llama.cpp's batch 1."""
    from gguf import GGUFReader
    from weights import embedded_gguf_path
    nbytes = sum(int(t.n_bytes) for t in GGUFReader(embedded_gguf_path()).tensors)
    d = r["decode"]["1"]
    other, read = d["step_s_median"] - d["matmul_floor_s"], nbytes / (r["bandwidth_gbs"] * 1e9)
    best, lc = 1 / (other + read), p["llamacpp"]["batch1_decode_tok_s"]
    return (f'Batch-1 ceiling of quantization="gguf" here: the decode step outside its matmuls ({other * 1e3:.1f} ms, '
            f"roofline at batch 1) + the GGUF's {nbytes / 1e6:.0f} MB of tensors read once at {r['bandwidth_gbs']:.1f} GB/s "
            f"({read * 1e3:.1f} ms) = {(other + read) * 1e3:.1f} ms a token: {best:.0f} tok/s, {best / lc:.2f}x llama.cpp's "
            f"batch 1 ({lc:.0f} tok/s), with kernels that cost nothing but their reads.")


# ----------------------------------------------------------------------------- command line

EXPERIMENTS = {"throughput": bench_batching.bench_throughput, "memory": bench_batching.bench_memory,
               "latency": bench_online.bench_latency, "chunked_prefill": bench_online.bench_chunked_prefill,
               "http": bench_online.bench_http, "peers": bench_peers.bench_peers,
               "roofline": bench_hardware.bench_roofline, "kernel": bench_hardware.bench_kernel,
               "prefix": bench_batching.bench_prefix, "tiers": bench_tiers.bench_tiers, "copy_on_write": bench_batching.bench_copy_on_write,
               "preemption": bench_batching.bench_preemption, "hot": bench_hot_path, "step": bench_step,
               "api": bench_api_costs,
               "gpu_decode": bench_gpu.bench_gpu, "parallel": bench_tp.bench_parallel,
               "invariance": bench_invariance.bench_invariance, "speculative": bench_spec_decode.bench_speculative,
               "scaleout": bench_scaleout.bench_scaleout, "int8": bench_int8_kernels}
ON_REQUEST = {"int8", "step"}  # parts of another section, alone: only when named (hot runs the step breakdown first)
SECTIONS = list(EXPERIMENTS)
DEFAULT_SECTIONS = [s for s in SECTIONS if s not in ON_REQUEST]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:                       # the server soak owns its own flags (--minutes N)
        fn, why = optional("benchmarks.soak", "main")
        if why:
            sys.exit(f"soak: skipped: {why}")
        return fn(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {SECTIONS}, {sorted(ON_REQUEST)} or soak; default: all but {sorted(ON_REQUEST)}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the smoke test (about a minute)")
    ap.add_argument("--full", action="store_true", help="every workload at full size (about 1.5 hours on 2 cores)")
    ap.add_argument("--out", default=None, metavar="DIR | FILE.json",
                    help="a directory (e.g. results/): write <date>-<machine>-<commit>.md (the printed tables), .json "
                         "(every figure) and PNG charts there; a path ending in .json: write only the JSON, there")
    ap.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    ap.add_argument("--readme", action="store_true",
                    help="run nothing: rewrite README.md's results table from the newest results/*.json (not --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="every in-process engine with async_scheduling on or off (default: the engine's, on with CUDA)")
    args = ap.parse_args(argv)
    if args.async_scheduling is not None:
        harness.ENGINE_OVERRIDES["async_scheduling"] = args.async_scheduling
    if args.readme:
        if args.sections or args.out or args.quick or args.full:
            ap.error("--readme runs nothing: run the bench with --out results/ first, then --readme alone")
        print(f"README.md: results table from {os.path.relpath(report.update_readme(), report.ROOT)}")
        return 0
    unknown = [s for s in args.sections if s not in EXPERIMENTS]
    if unknown:
        ap.error(f"section must be one of {list(EXPERIMENTS)} or soak, got {unknown}")
    if args.quick and args.full:
        ap.error("--quick and --full exclude each other")
    sz = QUICK if args.quick else FULL if args.full else Sizes()
    to_dir = args.out is not None and not args.out.endswith(".json")
    stdout = sys.stdout
    if to_dir:                                     # the .md is exactly what this run prints
        sys.stdout = report.Tee(stdout)
    try:
        results = run(args, sz, "python bench.py " + " ".join(argv))
    finally:
        printed, sys.stdout = getattr(sys.stdout, "copy", None), stdout
    if to_dir:
        print("results: " + ", ".join(report.write_run(results, printed.getvalue(), args.out)))
    elif args.out:
        report.write_json(results, args.out)
    return results


def run(args, sz, command):
    """Every section asked for, printed as it goes; returns every figure, headed by the run's date, machine
    and commit."""
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    header, info = machine_info(args.sections or DEFAULT_SECTIONS)
    results = header | {"sizes": asdict(sz), "sections": args.sections or DEFAULT_SECTIONS,
                        "command": command, "machine_table": info, "section_seconds": {}}
    print("# nanoserve benchmark" + ("" if sz.name == "default" else f" (--{sz.name})"))
    section_header("Machine")
    print(md_table(list(info), [list(info.values())]))
    for name in args.sections or DEFAULT_SECTIONS:
        t_section = time.perf_counter()
        EXPERIMENTS[name](sz, args.seed, results)
        results["section_seconds"][name] = time.perf_counter() - t_section
        print(f"\n({name}: {results['section_seconds'][name]:.0f} s)")
    results["targets"] = targets(results)
    results["runtime_s"] = time.perf_counter() - t0
    info["load avg at end"] = os.getloadavg()[0]
    print(f"\ntotal benchmark time {results['runtime_s']:.0f} s; 1-min load average {info['load avg at start']:.2f} "
          f"at start, {info['load avg at end']:.2f} at end (> {os.cpu_count()}: other work shared the cores)")
    if args.plot:
        print("charts: " + ", ".join(report.plot(results, args.plot)))
    return results


if __name__ == "__main__":
    r = main()
    sys.exit(r if isinstance(r, int) else 0)      # soak's exit status: 0 only when nothing was lost
