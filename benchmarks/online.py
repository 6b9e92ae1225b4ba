"""
bench_online.py: the experiments about requests that arrive over time, in process and over HTTP.

Owns three experiments: latency under Poisson arrivals (TTFT/TPOT/e2e and goodput, engine in process),
chunked prefill's effect on running decodes, and the HTTP path: serve.py (default, and with
--quantization gguf), `vllm serve` when VLLM_PYTHON is set and llama.cpp's `llama-server` when LLAMACPP_DIR
is set, each driven by loadgen.py in its own process, beside the in-process engine on the same requests.
It starts and stops the servers it measures (each in its own process group); it never changes serve.py or
the engine.
"""
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from benchmarks import loadgen
from benchmarks.harness import (drain, greedy, latency_stats, make_engine, make_workload, md_table, model_dtype,
                          new_id, pct, random_prompt, run_arrivals, run_offline, section_header, vocab_of, warm_up)

TTFT_TARGET_S = 2.0      # latency target for goodput: p90 time to first token ...
TPOT_TARGET_S = 0.25     # ... and p90 time per output token (4 tok/s per user, faster than reading)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)                     # serve.py runs from the repository root


def bench_latency(sz, seed, results):
    """Up to what arrival rate do p90 TTFT and TPOT stay within target (goodput)?"""
    engine = make_engine(kv_cache_memory=sz.kv_cache_memory, max_num_seqs=sz.max_num_seqs)
    warm_up(engine, sz)
    reqs = make_workload(sz.latency_requests, seed + 2, sz.latency_out_range, sz.latency_prompt_median, vocab_of(engine))
    cap = run_offline(engine, reqs, "latency capacity")["useful_tok_s"]   # all at once: saturated, on these requests
    capacity_rps = cap / statistics.mean(r.max_tokens for r in reqs)
    rng, rates, goodput, failed = np.random.default_rng(seed), [], 0.0, False
    for f in sorted(sz.rate_fractions):
        offsets = np.cumsum(rng.exponential(1 / (f * capacity_rps), len(reqs))).tolist()
        outs, wall = run_arrivals(engine, reqs, offsets, time.monotonic, f"rate x{f}")
        st = latency_stats(outs)
        ok = st["ttft_p90"] < TTFT_TARGET_S and st["tpot_p90"] < TPOT_TARGET_S
        failed = failed or not ok
        goodput = goodput if failed else f * capacity_rps      # every rate up to this one met the target
        rates.append(st | {"rate_rps": f * capacity_rps, "meets_target": ok,
                           "useful_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall})
    section_header("Latency under load (Poisson arrivals, engine in process)", [
        f"{len(reqs)} requests per rate (output {sz.latency_out_range[0]}-{sz.latency_out_range[1]} tokens, median "
        f"prompt {sz.latency_prompt_median}); rates are fractions {list(sz.rate_fractions)} of the saturated capacity "
        f"measured on them, {capacity_rps:.2f} req/s ({cap:.0f} tok/s). RequestOutput.metrics, seconds.",
        f"goodput target: p90 TTFT < {TTFT_TARGET_S} s and p90 TPOT < {TPOT_TARGET_S} s."])
    keys = [f"{k}_{q}" for k in ("ttft", "tpot", "e2e") for q in ("p50", "p90", "p99")]
    print(md_table(["rate req/s", "out tok/s", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "e2e p50", "p90",
                    "p99", "meets target"], [[f"{st['rate_rps']:.2f}", st["useful_tok_s"]] + [st[k] for k in keys]
                                             + ["yes" if st["meets_target"] else "no"] for st in rates]))
    print(f"\ngoodput (highest tested rate with it and every lower rate meeting the target): **{goodput:.2f} req/s**")
    results["latency"] = {"targets": {"ttft_p90_s": TTFT_TARGET_S, "tpot_p90_s": TPOT_TARGET_S},
                          "capacity_rps": capacity_rps, "rates": rates, "goodput_rps": goodput}


def decode_gaps(engine, long_len, settle_steps, num_running=8):
    """Inter-token gaps of running decodes, before and while one long prompt is prefilled, and its TTFT."""
    rng, vocab = random.Random(7), vocab_of(engine)
    running = [new_id("run") for _ in range(num_running)]
    for rid in running:
        engine.add_request(rid, random_prompt(rng, 64, vocab), greedy(engine.max_model_len - 65))
    last, gaps = {}, {"before": [], "during": []}
    long_id, t_arrive, ttft = None, None, None
    for step in range(10_000):
        if long_id is None and step >= settle_steps and gaps["before"]:   # steady decode recorded (outputs come
            # a step late under async scheduling); now the long prompt arrives
            long_id, t_arrive = new_id("long"), time.perf_counter()
            engine.add_request(long_id, random_prompt(rng, long_len, vocab), greedy(4))
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            if o.request_id == long_id:
                ttft = ttft or (t - t_arrive if o.outputs[0].token_ids else None)
            else:
                if o.request_id in last:
                    gaps["before" if long_id is None else "during"].append(t - last[o.request_id])
                last[o.request_id] = t
        if ttft is not None:
            break
    drain(engine, running + [long_id])
    return {"gap_baseline_median_s": statistics.median(gaps["before"]), "gap_max_s": max(gaps["during"]),
            "gap_p99_s": pct(gaps["during"], 99), "long_prompt_ttft_s": ttft}


def bench_chunked_prefill(sz, seed, results):
    """Does chunking a long prompt's prefill keep the running decodes' worst inter-token gap short?"""
    chunk = {}
    for name, budget in ((f"chunked (max_num_batched_tokens={sz.chunk_budget})", sz.chunk_budget), ("unchunked (8192)", 8192)):
        engine = make_engine(kv_cache_memory=sz.kv_cache_memory, max_num_batched_tokens=budget, max_num_seqs=16)
        warm_up(engine, sz)
        chunk[name] = decode_gaps(engine, sz.long_prompt, sz.settle_steps)
    c, u = chunk.values()
    section_header("Chunked prefill", [f"8 running decodes while a {sz.long_prompt}-token prompt arrives (seconds)."])
    print(md_table(["mode", "baseline gap median", "max gap", "p99 gap", "long prompt TTFT"],
                   [[k, v["gap_baseline_median_s"], v["gap_max_s"], v["gap_p99_s"], v["long_prompt_ttft_s"]]
                    for k, v in chunk.items()]))
    print(f"\nchunking lowers the worst inter-token gap **{u['gap_max_s'] / c['gap_max_s']:.2f}x**")
    results["chunked_prefill"] = chunk | {"max_gap_unchunked_over_chunked": u["gap_max_s"] / c["gap_max_s"]}


# ----------------------------------------------------------------------------- HTTP

def random_text_requests(engine, n, input_len, output_len, range_ratio, seed, variant):
    """vLLM's `--dataset-name random`: lengths uniform in [(1 - r) L, (1 + r) L], prompts decoded from random ids.
    Returns the loadgen requests (text) and the same prompts as our tokenizer's ids, for the in-process run. Each
    `variant` has the same lengths and other random ids: a fresh set for an engine whose prefix cache saw the last."""
    lens, ids = random.Random(seed), random.Random(f"{seed}/{variant}")
    vocab, tok = vocab_of(engine), engine.tokenizer
    reqs = []
    for _ in range(n):
        prompt_len = lens.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)))
        out_len = lens.randint(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio)))
        reqs.append({"prompt": tok.decode(random_prompt(ids, prompt_len, vocab)), "output_len": out_len})
    return reqs, [tok.encode(r["prompt"]) for r in reqs]


def in_process(engine, reqs, prompts):
    """The same requests, all at once, in process: per-token arrival times, summarized by loadgen's arithmetic."""
    ids = {new_id("inproc"): i for i in range(len(reqs))}
    outs = [{"ttft": None, "itl": [], "latency": None, "output_tokens": None, "error": None} for _ in reqs]
    t0 = time.perf_counter()
    for rid, i in ids.items():
        engine.add_request(rid, prompts[i], greedy(reqs[i]["output_len"]))
    last = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            now, rec = time.perf_counter(), outs[ids[o.request_id]]
            if o.outputs[0].delta_token_ids:
                if rec["ttft"] is None:
                    rec["ttft"] = now - t0
                else:
                    rec["itl"].append(now - last[o.request_id])
                last[o.request_id], rec["latency"] = now, now - t0
            if o.finished:
                rec["output_tokens"] = len(o.outputs[0].token_ids)
    return loadgen.summarize(reqs, outs, time.perf_counter() - t0)


@contextlib.contextmanager
def server(cmd, port, env, startup_s):
    """Start a server in a process group of its own, wait for /health (200: llama-server answers 503 while it
    loads), yield the process, then stop the whole group (SIGTERM, then SIGKILL): no worker outlives it."""
    log = tempfile.TemporaryFile()
    # the group is out of reach of a signal to ours (`timeout` signals its whole group): a SIGTERM to this process
    # unwinds it instead, as Ctrl-C does, so the finally below still stops the server
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    main = threading.current_thread() is threading.main_thread()          # only it may set a handler
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm) if main else None
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"{os.path.basename(cmd[0])} did not become healthy: {log.read()[-400:].decode(errors='replace')}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            time.sleep(1)
        yield proc
    finally:
        stop_group(proc)
        log.close()
        if main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def stop_group(proc, grace_s=30):
    """SIGTERM to the server's process group, SIGKILL to what is left after grace_s; reaps the leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):          # the leader's children, or a leader that hung
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drive(port, reqs, rate, seed):
    """loadgen.py in its own process against 127.0.0.1:port; its summary."""
    model = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10))["data"][0]["id"]
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "reqs.json"), "w") as f:
            json.dump(reqs, f)
        subprocess.run([sys.executable, os.path.join(HERE, "loadgen.py"), "--url", f"http://127.0.0.1:{port}/v1/completions",
                        "--model", model, "--requests", f.name, "--request-rate", str(rate), "--ignore-eos",
                        "--temperature", "0", "--seed", str(seed), "--out", os.path.join(d, "out.json")],
                       check=True, capture_output=True, timeout=3600)
        res = json.load(open(os.path.join(d, "out.json")))
    res.pop("requests")
    return res | {"requested_tokens": sum(r["output_len"] for r in reqs)}


def llama_server_slots(sz):
    """llama-server's slots and KV tokens per slot for the HTTP workload. Slots: as many requests as run at once
    (all of them at rate inf), capped at max_num_seqs as nanoserve's are. Per slot: the longest prompt and output
    random_text_requests makes (1.5x the length each), the prompt with 25% more for the text's re-tokenization
    (measured: 192 random ids came back as up to 204 tokens), plus 64, in multiples of 64."""
    longest = math.floor(sz.http_len * 1.5)
    return min(sz.http_prompts, sz.max_num_seqs), 64 * math.ceil((int(2.25 * longest) + 64) / 64)


def serve_commands(sz, engine):
    """(name, command, env, startup seconds) of each server to measure, each on a free port of its own, or
    (name, reason skipped)."""
    from benchmarks.llamacpp import llama_server_command, llama_server_unavailable
    from benchmarks.peers import export_hf_layout, vllm_env, vllm_unavailable
    from weights import embedded_gguf_path
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}     # serve.py picks its own wait policy
    def ours():
        return [sys.executable, "serve.py", "--port", str(free_port()), "--max-num-seqs", str(sz.max_num_seqs),
                "--kv-cache-memory", sz.kv_cache_memory]
    yield "serve.py", ours() + ["--dtype", engine.config.dtype], env, 300
    if engine.device.type == "cuda":               # async scheduling is on by default there: the loop without it
        yield "serve.py --no-async-scheduling", ours() + ["--dtype", engine.config.dtype, "--no-async-scheduling"], env, 300
    if engine.device.type == "cpu":                # the blocks' kernels are CPU code (float32 activations)
        yield "serve.py --quantization gguf", ours() + ["--quantization", "gguf", "--dtype", "float32"], env, 300
    else:
        yield "serve.py --quantization gguf", f"GGUF blocks run on the CPU; this run's servers are on {engine.device.type}"
    why = llama_server_unavailable()
    if why:
        yield "llama-server", why
    else:
        yield "llama-server", llama_server_command(embedded_gguf_path(), free_port(), os.cpu_count(),
                                                   *llama_server_slots(sz)), env, 120
    why = vllm_unavailable() or ("not run in --quick (vLLM starts in minutes)" if sz.name == "quick" else None)
    if why:
        yield "vllm serve", why
        return
    vllm = os.path.join(os.path.dirname(os.environ["VLLM_PYTHON"]), "vllm")
    # the dtype serve.py runs here (bfloat16 only where the CPU multiplies it natively): an AVX2-only CPU
    # would otherwise time vLLM's emulated bfloat16 against our float32
    yield "vllm serve", [vllm, "serve", export_hf_layout(engine.model_dir), "--port", str(free_port()),
                         "--dtype", model_dtype(engine), "--max-num-seqs", str(sz.max_num_seqs),
                         "--kv-cache-memory-bytes", str(1 << 30), "--max-model-len", "4096",
                         "--served-model-name", "smollm2"], vllm_env(os.cpu_count()), 1800


def best_round(rounds):
    """The round with the most output tok/s, with every round's figure beside it."""
    return max(rounds, key=lambda r: r["output_tok_s"]) | {"rounds_tok_s": [r["output_tok_s"] for r in rounds]}


TAKE_TURNS = ("serve.py", "serve.py --quantization gguf")   # up together, their rounds in turn with the engine's


def failure(e):
    return {"skipped": f"{type(e).__name__}: {str(e)[-300:]}"}


def measure_group(group, sz, seed, request_set, engine, inproc):
    """Start every server of the group (name, command, env, startup seconds) and warm each up; then sz.http_rounds
    rounds, each one fresh request set sent to the engine in process (when serve.py is in the group) and to every
    server in turn. Returns each server's best round, or why it was skipped; stops them all."""
    runs, rounds, up = {}, {}, {}
    with contextlib.ExitStack() as stack:
        for name, cmd, env, startup in group:
            port = int(cmd[cmd.index("--port") + 1])
            try:
                stack.enter_context(server(cmd, port, env, startup))
                drive(port, request_set()[0][:2], float("inf"), seed)      # warm-up, as every contender gets
                up[name] = port
            except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                runs[name] = failure(e)
        for _ in range(sz.http_rounds if up else 0):
            reqs, prompts = request_set()
            if "serve.py" in up:
                inproc.append(in_process(engine, reqs, prompts))
            for name, port in list(up.items()):
                try:
                    rounds.setdefault(name, []).append(drive(port, reqs, sz.http_rate, seed))
                except (RuntimeError, subprocess.SubprocessError, OSError) as e:
                    runs[name] = failure(e)
                    del up[name]
    return runs | {name: best_round(rounds[name]) for name in up}


def bench_http(sz, seed, results):
    """What does a client of `vllm bench serve`'s kind see from serve.py (default, and on the GGUF's blocks),
    against the same engine in process, `llama-server` and `vllm serve` on the same requests? Host noise on a
    shared machine moves a run by a fifth from minute to minute, so both serve.py servers stay up together and
    take turns with the engine in process, sz.http_rounds rounds of the same requests each (llama-server and
    `vllm serve` run their rounds alone), and each path reports its best round: the ratios among the turn-takers
    compare rounds taken in the same minutes."""
    engine = make_engine(kv_cache_memory=sz.kv_cache_memory, max_num_seqs=sz.max_num_seqs)
    # every round gets a set of prompts no engine has seen (prefix caching stays on, as served): same lengths, other ids
    variants = iter(range(1000))

    def request_set():
        return random_text_requests(engine, sz.http_prompts, sz.http_len, sz.http_len, 0.5, seed + 4, next(variants))

    warm_up(engine, sz)
    specs = [(name, *spec) for name, *spec in serve_commands(sz, engine)]
    runs = {name: {"skipped": spec[0]} for name, *spec in specs if len(spec) == 1}
    startable = [spec for spec in specs if len(spec) == 4]
    inproc = []
    for group in [[s for s in startable if s[0] in TAKE_TURNS]] + [[s] for s in startable if s[0] not in TAKE_TURNS]:
        runs |= measure_group(group, sz, seed, request_set, engine, inproc)
    runs = {name: runs[name] for name, *_ in specs}                  # the order of serve_commands
    if not inproc:
        inproc.append(in_process(engine, *request_set()))
    runs = {"nanoserve engine, in process": best_round(inproc)} | runs
    base = runs["nanoserve engine, in process"]["output_tok_s"]
    section_header("HTTP: loadgen.py (vllm bench serve's requests) against each server, beside the engine in process", [
        f"{sz.http_prompts} requests like `vllm bench serve --dataset-name random --random-input-len {sz.http_len} "
        f"--random-output-len {sz.http_len} --random-range-ratio 0.5 --request-rate {sz.http_rate} --ignore-eos "
        "--temperature 0`: streaming /v1/completions with stream_options.include_usage and repetition_penalty 1.0.",
        "the load generator runs in its own process; in process = the same prompts (our tokenizer's ids) all at once.",
        "every run sends prompts no engine has seen (same lengths, new random ids), so no prefix cache helps a later round.",
        f"serve.py and vllm serve run {model_dtype(engine)} (nanoserve's dtype auto on this machine); serve.py "
        "--quantization gguf and llama-server read the embedded GGUF's own blocks (float32 activations in nanoserve).",
        "llama-server: {} slots of {} KV tokens (-np, -c = their product), continuous batching, {} threads (-t, -tb), "
        "web UI off; the same client and text prompts (each server tokenizes them with the GGUF's vocabulary)".format(
            *llama_server_slots(sz), os.cpu_count()),
        "TPOT = (latency - TTFT) / (output tokens - 1); ITL = gaps between streamed chunks (a closing chunk with no "
        "text is not a token); seconds.",
        f"both serve.py servers are up together and take turns with the engine in process, {sz.http_rounds} rounds of "
        f"the same requests each (llama-server, vllm serve: {sz.http_rounds} rounds of their own, after them); a row "
        "is its path's best round, every round's tok/s in the last column."]
        + [f"{k}: " + (f"skipped ({v['skipped']})" if "skipped" in v else v["first_error"]) for k, v in runs.items()
           if "skipped" in v or v.get("failed")]
        + [f"{k}: {v['output_tokens']} output tokens came back, {v['requested_tokens']} were asked for"
           for k, v in runs.items() if v.get("requested_tokens", v.get("output_tokens")) != v.get("output_tokens")])
    keys = [f"{m}_p{q}_s" for m in ("ttft", "tpot", "itl") for q in loadgen.PERCENTILES]
    print(md_table(["path", "completed", "failed", "out tok/s", "of in process"]
                   + [f"{m} p{q}" for m in ("TTFT", "TPOT", "ITL") for q in loadgen.PERCENTILES] + ["rounds tok/s"],
                   [[k, v["completed"], v["failed"], v["output_tok_s"], v["output_tok_s"] / base] + [v[c] for c in keys]
                    + [" / ".join(f"{x:.0f}" for x in v["rounds_tok_s"])] for k, v in runs.items() if "skipped" not in v]))
    q, lc = runs.get("serve.py --quantization gguf", {}), runs.get("llama-server", {})
    if "output_tok_s" in q and "output_tok_s" in lc:
        print(f"\nserve.py --quantization gguf against llama-server, same GGUF: **{q['output_tok_s'] / lc['output_tok_s']:.2f}x** "
              f"out tok/s; TPOT p50 {q['tpot_p50_s'] * 1e3:.1f} vs {lc['tpot_p50_s'] * 1e3:.1f} ms, "
              f"TTFT p50 {q['ttft_p50_s']:.2f} vs {lc['ttft_p50_s']:.2f} s")
    results["http"] = {"num_requests": sz.http_prompts, "runs": runs}
