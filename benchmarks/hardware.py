"""
bench_hardware.py: the experiments that hold the engine against this machine's ceilings.

Owns two experiments: the roofline (matmul FLOP/s and read bandwidth measured here, against a decode
step whose phases come from `engine.phase_times`) and the paged-attention kernel (each backend timed
and checked against the PyTorch reference, then the engine's decode with each). It measures; it never
changes a kernel or the engine, and batching experiments live in bench_batching.py.
"""
import torch

from benchmarks.harness import bench_device, decode_kernel_inputs, make_engine, md_table, model_dtype, section_header, steady_decode, time_fn, warm_up


def model_linear_shapes(engine):
    """(in, out) of every matmul one token goes through, fused as model.py fuses them: qkv, o, gate_up, down
    per layer, then the lm head."""
    mc = engine.model_config
    h, hd, inter = mc.hidden_size, mc.head_dim, mc.intermediate_size
    per_layer = [(h, (mc.num_attention_heads + 2 * mc.num_key_value_heads) * hd), (mc.num_attention_heads * hd, h),
                 (h, 2 * inter), (inter, h)]
    return per_layer * mc.num_hidden_layers + [(h, mc.vocab_size)]


def matmul_gflops(m, k, n, dtype, repeats):
    """GFLOP/s of y = a @ w.T: the faster of torch.mm and model.linear on the weight's packed copy
    (the engine's path: on an AVX2 CPU in float32, our GEMM on weight panels)."""
    from cpu_linear import linear, pack_weight
    dev = bench_device()
    a, w = torch.randn(m, k, dtype=dtype, device=dev), torch.randn(n, k, dtype=dtype, device=dev)
    packed = pack_weight(w)
    best = min(time_fn(lambda: a @ w.T, repeats, warmup=2)[0], time_fn(lambda: linear(a, w, packed=packed), repeats, warmup=2)[0])
    return 2 * m * k * n / best / 1e9


def memory_bandwidth(repeats, nbytes=512 * 2**20):
    x = torch.ones(nbytes // 4, device=bench_device())
    return nbytes / time_fn(lambda: x.sum(), repeats, warmup=1)[0] / 1e9


def matmul_forward_time(engine, shapes, batch, dtype, repeats):
    """Seconds for only the linear layers of one forward at `batch` tokens: the attainable floor, taken as
    the faster of torch.mm on the same shapes and dtype and the engine's own layers (model.Linear: its
    prepacked weights, and the GGUF blocks below model.GGUF_ROWS rows where it has them)."""
    from cpu_linear import Linear
    dev = bench_device()
    ws = [torch.randn(n, k, dtype=dtype, device=dev) for k, n in shapes]
    layers = [m for m in engine.model.modules() if isinstance(m, Linear)]
    xs = {k: torch.randn(batch, k, dtype=dtype, device=dev) for k, _ in shapes}

    def own_layers():
        with torch.inference_mode():
            for layer in layers:
                layer(xs[layer.in_features])
    return min(time_fn(lambda: [torch.mm(xs[k], w.T) for (k, _), w in zip(shapes, ws)], repeats)[0],
               time_fn(own_layers, repeats)[0])


def bench_roofline(sz, seed, results):
    """How close does a decode step come to the time its matmuls alone need on this machine, and where does the rest go?"""
    engine = make_engine(kv_cache_memory=sz.kv_cache_memory, max_num_seqs=max(sz.decode_batches))
    dtype, shapes, mc = next(engine.model.parameters()).dtype, model_linear_shapes(engine), engine.model_config
    h, inter = mc.hidden_size, mc.intermediate_size
    mm = {f"[64,{h}]x[{h},{inter}]": matmul_gflops(64, h, inter, dtype, sz.repeats),
          f"[64,{h}]x[{h},{mc.vocab_size}] (lm head)": matmul_gflops(64, h, mc.vocab_size, dtype, sz.repeats),
          f"[1,{h}]x[{h},{inter}]": matmul_gflops(1, h, inter, dtype, sz.repeats),
          f"[512,{h}]x[{h},{inter}] (near this device's peak)": matmul_gflops(512, h, inter, dtype, sz.repeats)}
    bw, params = memory_bandwidth(sz.repeats), sum(k * n for k, n in shapes)
    warm_up(engine, sz)
    per_batch = {}
    for b in sz.decode_batches:
        d = steady_decode(engine, b, steps=max(4, 2 * sz.repeats), prompt_len=sz.decode_prompt)
        t_mm = matmul_forward_time(engine, shapes, b, dtype, sz.repeats)
        per_batch[b] = d | {"decode_tok_s": b / d["step_s_median"], "matmul_floor_s": t_mm,
                            "frac_of_matmul_roofline": t_mm / d["step_s_median"],
                            "gflops": 2 * params * b / d["step_s_median"] / 1e9}
    section_header("Roofline: this machine's ceilings vs the engine's decode step", [
        f"model dtype {model_dtype(engine)}; matmuls in nn.Linear layout at that dtype, the faster of torch.mm and "
        f"model.linear (the engine's kernels), best of {sz.repeats}: "
        + "; ".join(f"{k} {g:.1f} GFLOP/s" for k, g in mm.items()),
        f"memory read bandwidth (sum of a 512 MiB tensor): {bw:.1f} GB/s; {params / 1e6:.1f} M matmul params per token.",
        "matmul roofline = time of only the model's linear layers at that batch (the faster of torch.mm on the same "
        "shapes and dtype and the engine's own layers, GGUF blocks included) / engine step time; phases from "
        "engine.phase_times, ms per step."])
    phases = list(next(iter(per_batch.values()))["phases_s"])
    print(md_table(["batch", "step ms (median)", "decode tok/s", "matmul GFLOP/s", "matmul-only ms", "of matmul roofline"]
                   + [f"{p} ms" for p in phases],
                   [[b, d["step_s_median"] * 1e3, d["decode_tok_s"], d["gflops"], d["matmul_floor_s"] * 1e3,
                     d["frac_of_matmul_roofline"]] + [d["phases_s"][p] * 1e3 for p in phases] for b, d in per_batch.items()]))
    results["roofline"] = {"dtype": model_dtype(engine), "matmul_gflops": mm, "peak_matmul_gflops": max(mm.values()),
                           "bandwidth_gbs": bw, "matmul_params": params, "lm_head_params": h * mc.vocab_size, "decode": {str(b): d for b, d in per_batch.items()}}
    results["roofline"]["sampling"] = sampling_vs_greedy(engine, max(sz.decode_batches), steps=max(6, 4 * sz.repeats))


def sampling_vs_greedy(engine, batch, steps) -> dict:
    """What temperature 0.8 with top_p 0.9 costs over greedy in a batch-`batch` decode step, in the plain
    loop and the overlapped one (benchmarks/hot.py's sampling_cost), with each step's phases."""
    from benchmarks.hot import sampling_cost
    out = sampling_cost(batch=batch, engine=engine, steps=steps)
    runs = [k for k in out if not k.startswith("top_p_over")]
    phases = list(out[runs[0]]["phase_ms"])
    print(f"\nSampling at batch {batch}: greedy against temperature 0.8, top_p 0.9 (seeded), {steps} decode steps "
          f"each, plain loop and async scheduling; ms per step\n")
    print(md_table(["run", "step ms (median)"] + [f"{p} ms" for p in phases],
                   [[k, out[k]["step_ms_median"]] + [out[k]["phase_ms"][p] for p in phases] for k in runs]))
    print(f"top_p 0.9 over greedy: **{out['top_p_over_greedy_ms']:.3f} ms** plain, "
          f"**{out['top_p_over_greedy_ms async']:.3f} ms** async (target on an H100: <= 0.1 ms)")
    return out


def bench_kernel(sz, seed, results):
    """How fast does each paged-attention backend read the KV cache, against the bandwidth measured here?"""
    import paged_attention as pa
    bw, rows, rec, skipped = memory_bandwidth(sz.repeats), [], {}, []
    kernel = bench_device().type          # the compiled backend for this device: "cpu" or "cuda"
    for ctx in sz.kernel_contexts:
        for kv_dtype in (torch.float32, torch.bfloat16):
            inp = decode_kernel_inputs(sz.kernel_batch, ctx, kv_dtype)
            kv_bytes = 2 * inp[1].numel() * inp[1].element_size()
            ref = pa.paged_attention_reference(inp[0].float(), inp[1].float(), inp[2].float(), *inp[3:], 1 / 8)
            base = None
            for backend in ("torch", kernel):
                name = f"ctx={ctx} {str(kv_dtype)[6:]} {backend}"
                try:
                    # the CUDA kernel runs on a plan made once, as the model runner makes it per step
                    plan = pa.host_cuda_plan(inp[0], inp[1], inp[4], inp[5], backend) if backend == "cuda" else None
                    call = lambda: pa.paged_attention(*inp, 1 / 8, backend=backend, cuda_plan=plan)   # noqa: E731
                    err = (call().float() - ref).abs().max().item()
                except Exception as e:       # a backend that cannot build here is reported, never faked
                    skipped.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                best = time_fn(call, sz.repeats)[0]
                base = base or best
                rec[name] = {"best_s": best, "kv_gbs": kv_bytes / best / 1e9, "speedup_vs_torch": base / best,
                             "max_abs_diff_vs_fp32_reference": err}
                rows.append([ctx, str(kv_dtype)[6:], backend, best * 1e3, base / best, kv_bytes / best / 1e9,
                             kv_bytes / best / 1e9 / bw, err])
    e2e = {}
    for backend in ("torch", kernel):
        engine = make_engine(kv_cache_memory=sz.kv_cache_memory, attention_backend=backend, max_num_seqs=sz.kernel_e2e_batch)
        warm_up(engine, sz)
        d = steady_decode(engine, sz.kernel_e2e_batch, steps=3, prompt_len=sz.kernel_e2e_prompt)
        e2e[backend] = {"step_s_median": d["step_s_median"], "decode_tok_s": sz.kernel_e2e_batch / d["step_s_median"],
                        "resolved_backend": engine.attention_backend}
    section_header(f"Kernel: paged attention decode, batch {sz.kernel_batch}, 9 query / 3 KV heads x 64, block 16", [
        f"best of {sz.repeats}; KV GB/s = K+V bytes read / best time, against a plain read of {bw:.1f} GB/s in this run; "
        "max abs diff against the PyTorch reference in float32 on the same (rounded) inputs."]
        + [f"skipped {s}" for s in skipped])
    print(md_table(["context", "KV dtype", "backend", "ms best", "speedup vs torch", "KV GB/s", "of read bandwidth",
                    "max abs diff"], rows))
    print(f"\nEngine decode at {sz.kernel_e2e_batch} concurrent requests (prompt {sz.kernel_e2e_prompt}):\n")
    print(md_table(["attention_backend", "resolved", "step ms", "decode tok/s"],
                   [[k, v["resolved_backend"], v["step_s_median"] * 1e3, v["decode_tok_s"]] for k, v in e2e.items()]))
    results["kernel"] = {"read_bandwidth_gbs": bw, "attention": rec, "engine_decode": e2e} | (
        {"skipped_backends": skipped} if skipped else {})
