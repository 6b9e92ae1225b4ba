"""
benchmarks/llamacpp.py: llama.cpp as a CPU peer, on the very GGUF file nanoserve loads, with the same threads.

Owns finding a llama.cpp build (LLAMACPP_DIR: the build folder, or the folder above it), running its
`llama-batched-bench` at the peer workload's shapes and reading the JSON lines it prints, and the command
line of its `llama-server` (online.py starts it, waits for /health and drives it with loadgen.py). llama.cpp reads
the GGUF's quantized blocks as they are, which is what makes it the peer to beat at batch 1 (fewer bytes
per token than nanoserve's bf16 or float32 weights). It never imports llama.cpp, never changes nanoserve,
and a missing build is a skip that says why. The build: docs/benchmark.md.
"""
import json
import os
import subprocess

LLAMACPP_SETUP = ("pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36; in its vendor/llama.cpp: "
                  "cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF "
                  "-DCMAKE_BUILD_TYPE=Release && cmake --build build -j --target llama-batched-bench llama-server; "
                  "then LLAMACPP_DIR=.../vendor/llama.cpp/build python bench.py peers")


def llamacpp_binary(name: str) -> str | None:
    """The path of one llama.cpp program under LLAMACPP_DIR (its bin/ or build/bin/), or None."""
    root = os.environ.get("LLAMACPP_DIR")
    if not root:
        return None
    for sub in ("bin", os.path.join("build", "bin"), ""):
        path = os.path.join(root, sub, name)
        if os.access(path, os.X_OK):
            return path
    return None


def binary_unavailable(name: str) -> str | None:
    """Why llama.cpp's program `name` cannot run here, or None."""
    if not os.environ.get("LLAMACPP_DIR"):
        return "LLAMACPP_DIR is not set (docs/benchmark.md has the build)"
    if llamacpp_binary(name) is None:
        return f"no {name} under LLAMACPP_DIR={os.environ['LLAMACPP_DIR']} (bin/ or build/bin/)"
    return None


def llamacpp_unavailable() -> str | None:
    """Why llama-batched-bench (the peers section's llama.cpp) cannot run here, or None."""
    return binary_unavailable("llama-batched-bench")


def llama_server_unavailable() -> str | None:
    """Why llama-server (the http section's llama.cpp) cannot run here, or None."""
    return binary_unavailable("llama-server")


def llama_server_command(gguf: str, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """llama-server on the GGUF as it is: `slots` sequences decoded together (continuous batching, its
    default, said explicitly), each with ctx_per_slot tokens of KV (-c is the total, split evenly across the
    slots), the same threads for decode and prefill, on 127.0.0.1 only, the web UI off (it may fetch from the
    network), served under the name "smollm2" (what /v1/models says, and loadgen sends back)."""
    binary = llamacpp_binary("llama-server")
    if binary is None:
        raise RuntimeError(llama_server_unavailable())
    return [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching", "--no-webui",
            "--host", "127.0.0.1", "--port", str(port), "-a", "smollm2"]


def batched_bench(gguf: str, threads: int, prompt_len: int, out_len: int, parallel: list[int],
                  timeout: float = 1800) -> list[dict]:
    """One llama-batched-bench run: for each number of parallel sequences, pl prompts of prompt_len random
    tokens prefilled together, then out_len decode steps of pl tokens each. Returns its JSON lines
    (pp, tg, pl, t_pp, t_tg, t, speed_tg: decode tokens/s, ...). The KV size fits the largest pl exactly."""
    n_ctx = max(parallel) * (prompt_len + out_len)
    cmd = [llamacpp_binary("llama-batched-bench"), "-m", gguf, "-t", str(threads), "-tb", str(threads),
           "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(out_len),
           "-npl", ",".join(map(str, parallel)), "--output-format", "jsonl"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line) for line in (p.stdout + p.stderr).splitlines() if line.startswith('{"n_kv_max"')]
    if p.returncode != 0 or len(rows) != len(parallel):
        raise RuntimeError(f"llama-batched-bench exited {p.returncode}: {(p.stderr or p.stdout)[-400:]}")
    return rows


def llamacpp_runs(sz, reqs, gguf: str, threads: int, b1_repeats: int = 1) -> dict:
    """llama.cpp on the peer workload's shapes: batch 1 (decode tok/s, as nanoserve's batch-1 figure) and
    max_num_seqs sequences at the workload's mean prompt and output lengths (output tokens over the whole
    run, as nanoserve's useful tok/s). Fixed shapes, where nanoserve's workload is ragged: the header says so."""
    why = llamacpp_unavailable()
    if why:
        return {"skipped": why}
    prompt_len = round(sum(len(r.prompt) for r in reqs) / len(reqs))
    out_len = round(sum(r.max_tokens for r in reqs) / len(reqs))
    pl = min(sz.peer_max_num_seqs, len(reqs))
    try:
        b1 = max((batched_bench(gguf, threads, 32, sz.b1_tokens, [1])[0] for _ in range(b1_repeats)),
                 key=lambda row: row["speed_tg"])                        # as nanoserve's: the best run
        batch = batched_bench(gguf, threads, prompt_len, out_len, [pl])[0]
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"skipped": str(e)[-400:]}
    return {"file": os.path.basename(gguf), "prompt_len": prompt_len, "out_len": out_len, "parallel": pl,
            "batch1_decode_tok_s": b1["speed_tg"], "useful_tok_s": pl * out_len / batch["t"], "raw": [b1, batch]}
