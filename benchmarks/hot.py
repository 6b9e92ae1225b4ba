"""
Measurements of the hot path that bench.py calls and prints: the batch-1 decode step outside its
matmuls, per layer and per op (step_breakdown), the paged-attention
kernel's KV read speed against plain memory bandwidth, the per-phase cost of Engine.step as
the batch grows, a batch-64 decode step against the matmul roofline at the engine's dtype,
and the offline workload's useful output tokens/s. Each function returns a plain dict (every
ratio measured in one process, interleaved, because the machine is shared); none prints.

Owns only measuring. Does not change the engine or pick settings; bench.py owns the tables,
the peers and the targets. `python bench_hot.py` prints every dict, for a quick look.
"""
import contextlib
import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")   # as bench.py: brief spin, then sleep

import random
import statistics
import time

import torch

import extensions
import cpu_linear as CL
import model as M
from benchmarks.harness import bench_device, decode_kernel_inputs, random_prompt, time_fn
import paged_attention as pa


def read_bandwidth_gbs(nbytes=512 * 2**20, repeats=3) -> float:
    """Plain read bandwidth: best GB/s of summing a tensor far larger than the caches."""
    x = torch.ones(nbytes // 4, device=bench_device())
    x.sum()
    return nbytes / time_fn(x.sum, repeats, warmup=0)[0] / 1e9


def bench_kernel_bandwidth(batch=64, contexts=(512, 1024, 2048), kv_dtype=torch.bfloat16, repeats=5,
                           backend=None) -> dict:
    """KV bytes read per second by the paged-attention kernel at decode, against the plain read
    bandwidth measured between its runs. -> {"read_gbs", "contexts": {ctx: {"ms", "kv_gbs",
    "read_gbs", "ratio", "max_abs_diff"}}}; the diff is against the PyTorch reference in float32 on
    the first 4 sequences (q in the KV's dtype, as decode_kernel_inputs makes it)."""
    backend = backend or bench_device().type     # the compiled kernel of the device the engine runs on
    out = {"batch": batch, "kv_dtype": str(kv_dtype).removeprefix("torch."), "backend": backend, "contexts": {}}
    reads = []
    for ctx in contexts:
        q, k, v, tables, lens, qsl = decode_kernel_inputs(batch, ctx, kv_dtype)
        plan = pa.host_cuda_plan(q, k, lens, qsl, backend) if backend == "cuda" else None   # once, as per step
        call = lambda: pa.paged_attention(q, k, v, tables, lens, qsl, 0.125, backend=backend, cuda_plan=plan)  # noqa: E731
        got = call()
        ref = pa.paged_attention_reference(q[:4].float(), k.float(), v.float(), tables[:4], lens[:4], qsl[:5], 0.125)
        kv_bytes = 2 * k.numel() * k.element_size()            # every block of K and V is read once
        best = float("inf")
        read = 0.0
        for _ in range(repeats):                                # interleaved: same load on both
            best = min(best, time_fn(call, 1, warmup=0)[0])
            read = max(read, read_bandwidth_gbs(repeats=1))
        reads.append(read)
        out["contexts"][ctx] = {"ms": best * 1e3, "kv_gbs": kv_bytes / best / 1e9, "read_gbs": read,
                                "ratio": kv_bytes / best / 1e9 / read,
                                "max_abs_diff": (got[:4].float() - ref).abs().max().item()}
    out["read_gbs"] = max(reads)
    out["min_ratio"] = min(c["ratio"] for c in out["contexts"].values())
    return out


# ---------------------------------------------------------------------------- engine steps

def _engine(**overrides):
    from engine import Engine
    cfg = dict(kv_cache_memory="1GiB", enable_prefix_caching=False, max_num_seqs=64)
    return Engine(**{**cfg, **overrides})


def decode_steps(engine, batch, prompt_len=32, steps=6, temperature=0.0, top_p=1.0) -> dict:
    """Run `batch` sequences to decode, then time `steps` pure decode steps: median wall ms
    and the engine's own phase split (engine.phase_times) per step. Leaves no request behind."""
    from engine import SamplingParams
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=steps + 8, ignore_eos=True,
                            seed=1 if temperature else None)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, random_prompt(rng, prompt_len, vocab), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()                                        # one warm decode step
    before = dict(vars(engine.phase_times))
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    phases = {k: (v - before[k]) / steps * 1e3 for k, v in vars(engine.phase_times).items()}
    for rid in ids:
        engine.abort_request(rid)
    return {"batch": batch, "step_ms_median": statistics.median(walls) * 1e3, "step_ms_min": min(walls) * 1e3,
            "phase_ms": phases}


def phase_breakdown(batches=(1, 8, 64), engine=None, steps=6) -> dict:
    """Per-phase ms of a decode step (schedule / prepare / forward / sample / update) at each
    batch, and the Python phases (all but forward) per sequence: flat per-step Python work
    shows as per-sequence cost that does not grow with the batch."""
    engine = engine or _engine()
    out = {}
    for b in batches:
        r = decode_steps(engine, b, steps=steps)
        host = sum(v for k, v in r["phase_ms"].items() if k not in ("forward", "wait", "device"))
        r["python_ms"] = host
        r["python_us_per_seq"] = host / b * 1e3
        out[b] = r
    return out


def sampling_cost(batch=64, engine=None, steps=20) -> dict:
    """A batch-`batch` decode step greedy, then at temperature 0.8 and top_p 0.9, with and without
    async scheduling: the step's median ms and its phases (what top-p costs over greedy)."""
    from async_engine import OverlapLoop
    engine = engine or _engine()
    out, own = {}, engine.overlap
    for overlap in (False, True):
        engine.overlap = (own or OverlapLoop(engine)) if overlap else None
        for name, kw in {"greedy": {}, "top_p_0.9": dict(temperature=0.8, top_p=0.9)}.items():
            out[f"{name}{' async' if overlap else ''}"] = decode_steps(engine, batch, steps=steps, **kw)
    engine.overlap = own                                  # the engine's own setting again
    for suffix in ("", " async"):
        out[f"top_p_over_greedy_ms{suffix}"] = (out[f"top_p_0.9{suffix}"]["step_ms_median"]
                                                - out[f"greedy{suffix}"]["step_ms_median"])
    return out


def matmul_only_ms(engine, batch, repeats=3) -> float:
    """Time of only the model's linear layers at `batch` rows, in the engine's dtype, through each
    layer's own forward (prepacked weight, GGUF blocks or int8: the path the engine takes): the
    matmul roofline of a decode step."""
    layers = [m for m in engine.model.modules() if isinstance(m, CL.Linear)]
    xs = {m.in_features: torch.randn(batch, m.in_features, dtype=m.weight.dtype, device=m.weight.device) for m in layers}
    run = lambda: [m(xs[m.in_features]) for m in layers]   # noqa: E731   (each layer's own path: float, int8 or blocks)
    with torch.inference_mode():
        run()
        return time_fn(run, repeats, warmup=0)[0] * 1e3


def decode_vs_roofline(batch=64, engine=None, steps=6) -> dict:
    """A batch-`batch` decode step against the matmul-only time at the engine's dtype."""
    engine = engine or _engine()
    r = decode_steps(engine, batch, steps=steps)
    mm = matmul_only_ms(engine, batch)
    return {"batch": batch, "dtype": str(engine.dtype).removeprefix("torch."), "step_ms": r["step_ms_median"],
            "matmul_only_ms": mm, "of_matmul_roofline": mm / r["step_ms_median"], "phase_ms": r["phase_ms"]}


def step_breakdown(engine=None, batch=1, prompt_len=32, steps=12, rounds=3, calls=50) -> dict:
    """The decode step at `batch` outside its matmuls, per layer, before and after RoPE + KV-cache write
    became one op (model.Attention.fused_cache): the engine's step with each, taking turns `rounds` times
    (best median), minus the matmul-only time of the same rows (matmul_only_ms); then that per layer,
    split into the per-layer ops timed alone at one layer's shapes (best of 3 runs of `calls` calls) and
    what is left (module calls, views, Python). -> {"dtype", "path", "layers", "matmul_ms", "modes":
    {"before" | "after": {"step_ms", "forward_ms", "outside_ms", "outside_per_layer_us", "ops_us": {...}}}}"""
    engine = engine or _engine()
    net, cfg = engine.model, engine.model_config
    attn = [m for m in net.modules() if isinstance(m, M.Attention)]
    steps_ms = {m: [] for m in ("before", "after")}
    fwd = {m: [] for m in steps_ms}
    M.DecoderLayer.layer_op = False                            # both sides the Python layers (layer_op_breakdown: the op)
    try:
        for _ in range(rounds):                                # interleaved: the same load on each
            for mode in steps_ms:
                for a in attn:
                    a.fused_cache = mode == "after"
                r = decode_steps(engine, batch, prompt_len=prompt_len, steps=steps)
                steps_ms[mode].append(r["step_ms_median"])
                fwd[mode].append(r["phase_ms"]["forward"])
    finally:
        M.DecoderLayer.layer_op = True
        for a in attn:
            a.fused_cache = True
    matmul = matmul_only_ms(engine, batch, repeats=5)
    ops = _layer_op_us(engine, batch, prompt_len + steps, calls)
    L = cfg.num_hidden_layers
    modes = {}
    for mode in steps_ms:
        step = min(steps_ms[mode])
        per_layer = (step - matmul) / L * 1e3
        timed = {k: v for k, v in ops.items() if k != ("RoPE + KV-cache write, one op" if mode == "before"
                                                     else "RoPE, then KV-cache write")}
        modes[mode] = {"step_ms": step, "forward_ms": min(fwd[mode]), "outside_ms": step - matmul,
                       "outside_per_layer_us": per_layer,
                       "ops_us": timed | {"the rest (module calls, views, Python)": per_layer - sum(timed.values())}}
    return {"batch": batch, "dtype": str(engine.dtype).removeprefix("torch."),
            "path": engine.config.quantization or str(engine.dtype).removeprefix("torch."), "layers": L,
            "context": prompt_len + steps, "rounds": rounds, "matmul_ms": matmul, "modes": modes}


def layer_op_breakdown(engine=None, batch=1, prompt_len=32, steps=12, rounds=3) -> dict:
    """The int8 engine's decode step at `batch` outside its matmuls, per layer, before (each layer as
    Python modules and ~10 ops) and after (the layers as one op, csrc/decoder_layer_cpu.cpp:
    model.DecoderLayer.layer_op), taking turns `rounds` times (best median), minus the matmul-only time.
    -> {"path", "layers", "matmul_ms", "layer_op", "modes": {"before" | "after": {"step_ms", "outside_ms",
    "outside_per_layer_us"}}}"""
    engine = engine or _engine(quantization="int8", dtype="float32")
    L = engine.model_config.num_hidden_layers
    steps_ms = {"before": [], "after": []}
    try:
        for _ in range(rounds):                                # interleaved: the same load on each
            for mode in steps_ms:
                M.DecoderLayer.layer_op = mode == "after"
                steps_ms[mode].append(decode_steps(engine, batch, prompt_len=prompt_len, steps=steps)["step_ms_median"])
    finally:
        M.DecoderLayer.layer_op = True
    matmul = matmul_only_ms(engine, batch, repeats=5)
    modes = {m: {"step_ms": min(t), "outside_ms": min(t) - matmul, "outside_per_layer_us": (min(t) - matmul) / L * 1e3}
             for m, t in steps_ms.items()}
    return {"batch": batch, "path": engine.config.quantization, "layers": L, "context": prompt_len + steps,
            "rounds": rounds, "matmul_ms": matmul, "layer_op": extensions.decoder_layer_op_available(), "modes": modes}


def _layer_op_us(engine, batch, ctx, calls) -> dict:
    """us per layer of each op outside the matmuls at `batch` rows, on SmolLM2-shaped inputs in the
    engine's dtype, with the engine's fused-op setting: 2 norms, RoPE and the cache write (two ops
    and one), attention over `ctx` tokens of KV, SwiGLU."""
    cfg, dtype = engine.model_config, engine.dtype
    fused = engine.model.use_fused_ops and M.fused_kernels(engine.device, dtype, engine.attention_backend)
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(batch)
    x, res = (torch.randn(batch, H, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(H, generator=g).to(dtype) + 0.5
    qkv = torch.randn(batch, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    ang = torch.rand(batch, hd // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    gate_up = torch.randn(batch, 2 * cfg.intermediate_size, generator=g).to(dtype)
    q, kc, vc, tables, lens, qsl = decode_kernel_inputs(batch, ctx, dtype, nh, nkv, hd)
    slots = torch.arange(batch) * 16
    backend = engine.attention_backend
    cases = {
        "residual add + RMSNorm (x2)": lambda: [M.rms_norm(x, w, cfg.rms_norm_eps, res, fused) for _ in range(2)],
        "RoPE, then KV-cache write": lambda: M.rope_and_cache_(qkv, cos, sin, kc, vc, slots, nh, nkv, hd, fused,
                                                               backend, one_op=False),
        "RoPE + KV-cache write, one op": lambda: M.rope_and_cache_(qkv, cos, sin, kc, vc, slots, nh, nkv, hd, fused,
                                                                   backend),
        f"attention over {ctx} tokens": lambda: pa.paged_attention(q, kc, vc, tables, lens, qsl, hd ** -0.5,
                                                                    backend=backend),
        "SwiGLU": lambda: M.silu_and_mul(gate_up, fused)}
    out = {}
    with torch.inference_mode():
        for name, fn in cases.items():
            loop = lambda fn=fn: [fn() for _ in range(calls)]         # noqa: E731
            out[name] = time_fn(loop, 3)[0] / calls * 1e6
    return out


def fused_op_cases(rows, dtype, hidden=576, inter=1536, heads=9, kv_heads=3, head_dim=64, eps=1e-5):
    """SmolLM2's three fused per-layer ops at `rows` rows: name -> (plain fn, csrc fn), each
    over its own inputs. The in-place ops rewrite their inputs every call, as in the engine."""
    g = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))           # [T, hidden]
    w = torch.rand(hidden, generator=g).to(dtype) + 0.5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)      # [T, 960]
    ang = torch.rand(rows, head_dim // 2, generator=g) * 6.28
    cos, sin = ang.cos(), ang.sin()                                                        # float32 [T, head_dim/2]
    gate_up = torch.randn(rows, 2 * inter, generator=g).to(dtype)                           # [T, 2 * inter]
    return {"residual add + RMSNorm": (lambda: M.rms_norm(x, w, eps, res), lambda: M.rms_norm(x, w, eps, res, True)),
            "RoPE on q and k (in place)": (lambda: M.rope_(qkv, cos, sin, heads + kv_heads, head_dim),
                                           lambda: M.rope_(qkv, cos, sin, heads + kv_heads, head_dim, True)),
            "SwiGLU": (lambda: M.silu_and_mul(gate_up), lambda: M.silu_and_mul(gate_up, True))}


def _compile_fused_ops(rows, dtype) -> tuple[dict, str | None, float | None]:
    """model.py's three plain-PyTorch fused-op references under torch.compile with dynamic shapes
    (the engine's row count changes every step), compiled here at each row count, not inside a
    timing. -> (name -> compiled fn, why not run, seconds to compile)."""
    try:
        t = time.perf_counter()
        compiled = {name: torch.compile(getattr(M, name), dynamic=True) for name in ("rms_norm", "rope_", "silu_and_mul")}
        with torch.inference_mode(), _swapped(compiled):
            for r in rows:
                for plain, _ in fused_op_cases(r, dtype).values():
                    plain()
        return compiled, None, time.perf_counter() - t
    except Exception as e:                                  # e.g. no C++ compiler for inductor's CPU code
        return {}, f"not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})", None


def fused_ops_vs_compile(rows=(64, 512), batch=64, engine=None, steps=6, calls=20, repeats=5, rounds=3,
                         compile_ops=True) -> dict:
    """The fused ops three ways: plain PyTorch, csrc/fused_cpu.cpp, and torch.compile of the plain
    ones. Per call (us, best of `repeats` runs of `calls` calls) at each row count, then a whole
    decode step at `batch` with each, `rounds` times taking turns (the best median of each).
    compile_ops=False, or a compile that fails, leaves torch.compile out and says why."""
    engine = engine or _engine()
    dtype = engine.dtype
    if not extensions.fused_ops_available(engine.device, dtype):
        return {"skipped": f"csrc/fused_cpu.cpp does not run here ({engine.device.type}, {dtype}, or its build failed)"}
    compiled, why_not, compile_s = ({}, "not run (--quick: compiling takes tens of seconds)", None) if not compile_ops \
        else _compile_fused_ops(rows, dtype)
    per_op = {}
    with torch.inference_mode():
        for r in rows:
            for name, (plain, fused) in fused_op_cases(r, dtype).items():
                loop = lambda fn: lambda: [fn() for _ in range(calls)]            # noqa: E731
                row = {"plain_us": time_fn(loop(plain), repeats)[0] / calls * 1e6,
                       "csrc_us": time_fn(loop(fused), repeats)[0] / calls * 1e6}
                if compiled:
                    with _swapped(compiled):
                        row["compiled_us"] = time_fn(loop(plain), repeats)[0] / calls * 1e6
                per_op[f"{name}, {r} rows"] = row
    modes = {"csrc": (True, {}), "plain": (False, {})} | ({"compiled": (False, compiled)} if compiled else {})
    times = {m: [] for m in modes}
    for _ in range(rounds):                                 # interleaved: the same load on each
        for m, (fused, swap) in modes.items():
            engine.model.use_fused_ops = fused
            with _swapped(swap):
                times[m].append(decode_steps(engine, batch, steps=steps)["step_ms_median"])
    engine.model.use_fused_ops = True
    step = {f"{m}_ms": min(t) for m, t in times.items()}
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "calls": calls, "repeats": repeats, "rounds": rounds,
            "compile_s": compile_s, "torch_compile": why_not or "run", "ops": per_op, "step": step,
            "fastest_step": min(times, key=lambda m: min(times[m]))}


def gguf_blocks_vs_float32(rows=(1, 2, 4, 5, 8, 16), batches=(1, 4), engine=None, steps=6, repeats=3, rounds=2) -> dict:
    """Linear layers reading the GGUF's Q4_1/Q8_0 blocks (csrc/linear_cpu.cpp) against the
    float32 path model.linear takes without them (the panels on AVX2; elsewhere the small-M
    float32 kernel, or oneDNN on the prepacked weight): ms of one pass over every Linear of the
    model at each row count, then a decode step at each batch, the engine with and without
    blocks taking turns `rounds` times."""
    # on the dtype auto picks, named: dtype auto alone may take the integer path (engine.auto_path),
    # whose layers hold 8-bit panels, not the float32 path through the blocks timed here
    engine = engine or _engine(dtype=str(M.resolve_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch."))
    layers = [m for m in engine.model.modules() if isinstance(m, CL.Linear)]
    if not any(m.gguf_blocks() is not None for m in layers):
        return {"skipped": engine.model.gguf_log or "no layer has GGUF blocks"}
    off = {"GGUF_ROWS": 0}                                    # cpu_linear.linear() never takes the blocks
    per_pass = {}
    for r in rows:
        xs = {m.in_features: torch.randn(r, m.in_features) for m in layers}
        run = lambda: [CL.linear(xs[m.in_features], m.weight, m.bias, *m.prepared()) for m in layers]   # noqa: E731
        with _swapped({"GGUF_ROWS": max(r + 1, CL.GGUF_ROWS)}, CL):   # the blocks at every row count here
            run()
            blocks_ms = time_fn(run, repeats, warmup=0)[0] * 1e3
        with _swapped(off, CL):
            run()
            float32_ms = time_fn(run, repeats, warmup=0)[0] * 1e3
        per_pass[r] = {"gguf_ms": blocks_ms, "float32_ms": float32_ms}
    times = {(b, mode): [] for b in batches for mode in ("gguf", "float32")}
    for _ in range(rounds):                                   # interleaved: the same load on each
        for b in batches:
            for mode in ("gguf", "float32"):
                with _swapped({} if mode == "gguf" else off, CL):
                    times[b, mode].append(decode_steps(engine, b, steps=steps)["step_ms_median"])
    step = {b: {f"{mode}_ms": min(times[b, mode]) for mode in ("gguf", "float32")} for b in batches}
    return {"log": engine.model.gguf_log, "gguf_rows": CL.GGUF_ROWS, "repeats": repeats, "rounds": rounds,
            "per_pass": per_pass, "step": step}


def int8_vs_float32(rows=(1, 4, 16, 64), batches=(1, 16), steps=6, repeats=3, rounds=2) -> dict:
    """quantization="int8" (csrc/int8_cpu.cpp's linear_q8) against the float32 engine's kernel (panels
    or oneDNN) and the GGUF's blocks (8-bit activations against them, quantization="gguf"'s linear_q8, and float32
    sums, the float32 engine's kernel at 1-2 rows) on the same layers: ms of one pass
    over the 120 linear layers int8 quantizes (lm_head left out) at each
    row count, the three taking turns; then a decode step at each batch, an int8 engine and a
    float32 one taking turns `rounds` times."""
    from weights import quantization_unavailable
    why = quantization_unavailable("int8", torch.float32, bench_device().type)
    if why:                                   # the engine's own refusal, before any engine is built
        return {"skipped": f"quantization={why} (the engines here run on {bench_device().type})"}
    if not CL._cpu_linear_kernels()[0]:
        return {"skipped": f"csrc/linear_cpu.cpp did not build: {extensions.failed.get('linear_cpu')}"}
    engines = {"int8": _engine(dtype="float32", quantization="int8"), "float32": _engine(dtype="float32")}
    net = engines["float32"].model
    layers = [m for m in net.modules() if isinstance(m, CL.Linear) and m is not net.lm_head]
    w8 = [CL.quantize_int8(m.weight) for m in layers]
    packed = [m.packed_weight() for m in layers]
    blocks = [m.gguf_blocks() for m in layers]
    kernels = {"int8": lambda x, i: CL.int8_linear(x, w8[i]),
               "float32": lambda x, i: CL.linear(x, layers[i].weight, None, packed[i])}   # the float32 engine's kernel
    # (panels on AVX2, oneDNN on its prepacked weight elsewhere: linear_panels refuses a oneDNN-packed weight)
    if all(b is not None for b in blocks):
        kernels["gguf"] = lambda x, i: torch.ops.nanoserve_linear.linear_gguf(x, blocks[i].qs, blocks[i].scales, blocks[i].mins, None)
        kernels["gguf_q8"] = lambda x, i: CL.gguf_linear_q8(x, blocks[i])
        for b in blocks:
            CL.gguf_q8_panels(b)                                          # repacked once, as at load
    per_pass = {}
    for r in rows:
        xs = [torch.randn(r, m.in_features) for m in layers]
        times = {k: float("inf") for k in kernels}
        for _ in range(repeats):                                          # interleaved: the same load on each
            for k, fn in kernels.items():
                run = lambda fn=fn: [fn(x, i) for i, x in enumerate(xs)]   # noqa: E731
                run()
                times[k] = min(times[k], time_fn(run, 1, warmup=0)[0])
        per_pass[r] = {f"{k}_ms": t * 1e3 for k, t in times.items()}
    steps_ms = {(b, k): [] for b in batches for k in engines}
    for _ in range(rounds):
        for b in batches:
            for k, e in engines.items():
                steps_ms[b, k].append(decode_steps(e, b, steps=steps)["step_ms_median"])
    step = {b: {f"{k}_ms": min(steps_ms[b, k]) for k in engines} for b in batches}
    return {"log": engines["int8"].model.gguf_log, "layers": len(layers), "repeats": repeats, "rounds": rounds,
            "int8_group": CL.INT8_GROUP, "per_pass": per_pass, "step": step,
            "isa": {"q8_dot": torch.ops.nanoserve_linear.q8_dot(), "float32": CL.cpu_linear_path(torch.float32),
                    "torch_capability": torch.backends.cpu.get_cpu_capability(),
                    "NANOSERVE_CPU_ISA": os.environ.get("NANOSERVE_CPU_ISA", "native")}}


def panels_vs_onednn(rows=(1, 8, 64, 256), batches=(16, 64), steps=6, repeats=3, rounds=2) -> dict:
    """Linear layers on csrc/linear_cpu.cpp's weight panels (model.LINEAR_PANELS: float32 on AVX2,
    bfloat16 on AVX512_BF16 without AMX) against oneDNN on its prepacked weight, at the dtype that
    dtype auto picks here: ms of one pass over every Linear of the model at each row count (GGUF
    blocks off on both sides), then a decode step at each batch, an engine of each kind taking
    turns `rounds` times."""
    if bench_device().type != "cpu":          # its engines would run on the GPU, its layers timed on the CPU
        return {"skipped": f"CPU linear layers: the engines here run on {bench_device().type}"}
    dtype, why = M.resolve_dtype("auto", torch.device("cpu"))
    name = str(dtype).removeprefix("torch.")
    if not CL.panels_available(dtype):
        return {"skipped": f"no {name} panels here (dtype {why}; float32 panels run on AVX2 only, bfloat16 "
                           f"ones with AVX512_BF16 and no AMX): torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                           f"linear_cpu.cpp {extensions.failed.get('linear_cpu', 'built')}"}
    engines = {}
    for mode in ("panels", "onednn"):
        with _swapped({"LINEAR_PANELS": mode == "panels"}, CL):   # the engine's layers pack at their first call
            engines[mode] = _engine(dtype=name)
            decode_steps(engines[mode], 1, steps=1)
    layers = {mode: [m for m in e.model.modules() if isinstance(m, CL.Linear)] for mode, e in engines.items()}
    per_pass = {}
    for r in rows:
        xs = {m.in_features: torch.randn(r, m.in_features, dtype=dtype) for m in layers["panels"]}
        per_pass[r] = {}
        for mode, ls in layers.items():
            run = lambda: [CL.linear(xs[m.in_features], m.weight, m.bias, m.prepared()[0]) for m in ls]   # noqa: E731
            run()
            per_pass[r][f"{mode}_ms"] = time_fn(run, repeats, warmup=0)[0] * 1e3
    times = {(b, mode): [] for b in batches for mode in engines}
    for _ in range(rounds):                                   # interleaved: the same load on each
        for b in batches:
            for mode, engine in engines.items():
                times[b, mode].append(decode_steps(engine, b, steps=steps)["step_ms_median"])
    step = {b: {f"{mode}_ms": min(times[b, mode]) for mode in engines} for b in batches}
    return {"dtype": name, "repeats": repeats, "rounds": rounds, "per_pass": per_pass, "step": step}


def compiled_forward_step(batch=64, steps=6, rounds=2, freeze=True) -> dict:
    """torch.compile of the whole model forward, the engine option the alternative would be,
    against the eager engine with csrc's fused ops: decode step ms at `batch`, two engines taking
    turns. Inductor cannot lower the oneDNN-packed weights model.linear keeps (it wants them as
    graph constants), so the compiled model's layers are plain nn.Linear; with freeze, inductor
    packs their weights itself. Not in bench.py: compiling takes minutes on 2 cores."""
    import torch._inductor.config as inductor_config
    eager, compiled = _engine(), _engine()
    _register_fake_attention_ops(eager.attention_backend)
    model = compiled.model
    model.use_fused_ops = False                  # inductor fuses the plain references itself
    for mod in model.modules():
        if isinstance(mod, CL.Linear):
            mod.__class__ = torch.nn.Linear      # same parameters, F.linear forward
    inner = torch.compile(M.Llama.forward.__wrapped__, dynamic=True)   # inference_mode tensors trip dynamo

    def forward(*args):
        with torch.no_grad():
            return inner(model, *args)
    model.forward = forward
    times = {"eager_csrc_ms": [], "compiled_ms": []}
    with inductor_config.patch(freezing=freeze):  # any recompile freezes too; the process setting is restored
        t = time.perf_counter()
        decode_steps(compiled, batch, steps=1)    # compiles (a prefill and a decode shape)
        compile_s = time.perf_counter() - t
        for _ in range(rounds):
            for key, engine in (("eager_csrc_ms", eager), ("compiled_ms", compiled)):
                times[key].append(decode_steps(engine, batch, steps=steps)["step_ms_median"])
    return {"batch": batch, "dtype": str(eager.dtype).removeprefix("torch."), "freeze": freeze,
            "compile_s": compile_s, **times, "compiled_over_eager": min(times["compiled_ms"]) / min(times["eager_csrc_ms"])}


def _register_fake_attention_ops(backend):
    """Shapes of the attention ops' outputs for torch.compile's tracing (the C++ ops have none)."""
    if backend != "cpu" or getattr(_register_fake_attention_ops, "done", False):
        return
    torch.library.register_fake("nanoserve_cpu::paged_attention")(
        lambda query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale: torch.empty_like(query))
    torch.library.register_fake("nanoserve_cpu::reshape_and_cache")(
        lambda key, value, key_cache, value_cache, slot_mapping: None)
    _register_fake_attention_ops.done = True


@contextlib.contextmanager
def _swapped(replacements, module=M):
    """A module's globals (model.py's by default) replaced by `replacements` (name -> value) for the duration."""
    saved = {name: getattr(module, name) for name in replacements}
    for name, fn in replacements.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


# ---------------------------------------------------------------------------- the offline peer workload

def peer_workload(num_requests=64, seed=0, vocab=49152):
    """64 random token-id prompts (~133 tokens on average), outputs 16-256: the shape bench_peers.py runs against vLLM."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(67, 200), vocab) for _ in range(num_requests)]
    return prompts, [rng.randint(16, 256) for _ in range(num_requests)]


def offline_throughput(num_requests=64, **engine_overrides) -> dict:
    """Useful output tokens/s of LLM.generate on that workload: greedy, EOS ignored,
    max_num_seqs=64, prefix caching off; one short warm-up first."""
    from llm import LLM, SamplingParams
    llm = LLM(kv_cache_memory="1GiB", enable_prefix_caching=False, max_num_seqs=64, **engine_overrides)
    prompts, outs = peer_workload(num_requests, vocab=llm.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    llm.generate(prompts[:4], params[:4])                 # warm-up: builds, first-touch allocations
    t = time.perf_counter()
    done = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in done)
    return {"dtype": str(llm.engine.dtype).removeprefix("torch."), "requests": num_requests,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall}


def bf16_linear_table(rows=(1, 8, 32, 64, 128, 512), repeats=3) -> dict:
    """ms of one pass over SmolLM2's per-layer linear shapes: float32 and bfloat16 through
    model.linear with prepacked weights (the engine's path) and without, vs bfloat16 through
    F.linear and oneDNN's _linear_pointwise."""
    import torch.nn.functional as F
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    ws = {dt: [torch.randn(n, k).to(dt) for k, n in shapes] for dt in (torch.float32, torch.bfloat16)}
    packs = {id(w): CL.pack_weight(w) for dt in ws for w in ws[dt]}
    prepacked = lambda x, w: CL.linear(x, w, packed=packs[id(w)])   # noqa: E731
    paths = {"float32 model.linear": (torch.float32, prepacked),
             "float32 unpacked": (torch.float32, CL.linear),
             "bfloat16 model.linear": (torch.bfloat16, prepacked),
             "bfloat16 unpacked": (torch.bfloat16, CL.linear),
             "bfloat16 F.linear": (torch.bfloat16, F.linear),
             "bfloat16 onednn": (torch.bfloat16,
                                 lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))}
    out = {}
    for m in rows:
        out[m] = {}
        for name, (dt, fn) in paths.items():
            xs = [torch.randn(m, k).to(dt) for k, _ in shapes]
            run = lambda: [fn(x, w) for x, w in zip(xs, ws[dt])]   # noqa: E731
            run()
            out[m][name] = time_fn(run, repeats, warmup=0)[0] * 1e3
    return out


if __name__ == "__main__":
    import json
    torch.set_num_threads(os.cpu_count())
    import sys
    parts = sys.argv[1:] or ["step", "kernel", "phases", "roofline", "fused", "gguf", "int8", "panels", "linear", "offline"]   # and compile_forward
    calls = {"step": step_breakdown, "kernel": bench_kernel_bandwidth, "phases": phase_breakdown, "roofline": decode_vs_roofline,
             "fused": fused_ops_vs_compile, "gguf": gguf_blocks_vs_float32, "int8": int8_vs_float32, "panels": panels_vs_onednn, "compile_forward": compiled_forward_step, "linear": bf16_linear_table,
             "sampling": sampling_cost, "offline": lambda: [offline_throughput(), offline_throughput(dtype="float32")]}
    for part in parts:
        print(part, json.dumps(calls[part](), indent=1), flush=True)
