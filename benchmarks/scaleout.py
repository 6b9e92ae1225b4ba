"""
Engine cores behind one front end, for bench.py's `scaleout` section: data-parallel routing policies
(data_parallel.py, router.py) and disaggregated prefill/decode (disaggregation.py, kv_transfer.py).

Every core is a process of its own with one thread (2 cores on a 2-core machine); the colocated baseline
is one core with both threads. Requests go through the same clients serve.py uses (no HTTP: the routing
and the hand-off are what is measured). The model is a random Llama of SmolLM2-135M's width with fewer
layers (benchmarks/parallel.py's checkpoint): the experiments measure prefill saved and decode stalls,
which any weights show.
  routing: 2 replicas; T tenants (system prompts) x Q questions, shuffled, queued at once; per policy the
    prefix-hit rate (1 - prompt tokens computed / prompt tokens sent) and output tok/s. Each core's KV pool
    holds about 5 of the 8 tenants' system prompts: the pressure under which the routing matters (with
    room for all 8, round_robin computes each system prompt once per core and its hit rate is already
    within 1.2x of cache_aware's: 0.66 against 0.81 at 4096 tokens per core).
  disaggregation: steady decodes while long prompts arrive (Poisson); the steady requests' inter-token
    gaps (TPOT p50/p99, as their client sees them) and the long prompts' TTFT, colocated (chunked prefill
    on) against 1:1.
"""
import asyncio
import dataclasses
import random
import statistics
import tempfile
import time

from benchmarks.harness import md_table, section_header
from benchmarks.parallel import make_checkpoint


@dataclasses.dataclass
class Shape:
    layers: int
    tenants: int
    questions: int
    system_len: int
    question_len: int
    out_len: int
    kv_tokens: int                      # per core, for routing
    steady: int                         # disaggregation: steady decodes
    steady_out: int
    long_prompts: int
    long_len: int
    long_rate: float                    # long prompts per second (Poisson)
    chunk: int                          # colocated: max_num_batched_tokens


def shape_for(sz) -> Shape:
    if sz.name == "quick":
        return Shape(2, 4, 3, 128, 16, 4, 1024, 2, 24, 2, 256, 4.0, 64)
    return Shape(8, 8, 8 if sz.name == "default" else 32, 500, 32, 16, 2560, 4, 600, 5, 1000, 1.0, 256)


def params(max_tokens: int):
    from engine import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def drive(client, requests) -> list[dict]:
    """requests: (delay s, prompt, max_tokens); each submitted at its delay after the start, as serve.py
    does. Returns per request: ttft, token arrival times, prompt length."""
    from engine_client import Run
    client.start()
    active, t0 = set(), time.monotonic()

    async def one(i, delay, prompt, max_tokens):
        await asyncio.sleep(delay)
        run = Run(client, [f"r{i}"], [prompt], params(max_tokens), 0, None, active)
        client.submit(run)
        await run.admitted()
        sent, times = time.monotonic(), []
        async for _, out in run.outputs():
            times += [time.monotonic()] * len(out.outputs[0].delta_token_ids)
        run.close()
        return {"ttft": times[0] - sent, "times": times, "prompt_len": len(prompt), "start": sent - t0}
    try:
        return await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
    finally:
        client.stop()


def run_routing(model_dir: str, shape: Shape, policy: str, seed: int) -> dict:
    from scaleout.data_parallel import DataParallelClient
    from engine import EngineConfig
    rng = random.Random(seed)
    systems = [[rng.randrange(300, 40_000) for _ in range(shape.system_len)] for _ in range(shape.tenants)]
    work = [(t, q) for t in range(shape.tenants) for q in range(shape.questions)]
    rng.shuffle(work)
    prompts = [systems[t] + [rng.randrange(300, 40_000) for _ in range(shape.question_len)] for t, _ in work]
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", num_threads=2, max_num_seqs=8,
                          kv_cache_memory=shape.kv_tokens * kv_bytes_per_token(model_dir))
    client = DataParallelClient.in_processes(config, 2, policy)
    t0 = time.perf_counter()
    asyncio.run(drive(client, [(0.0, p, shape.out_len) for p in prompts]))
    wall = time.perf_counter() - t0
    computed = sum(c.stats.prompt_tokens_total for c in client.cores)
    sent = sum(map(len, prompts))
    return {"policy": policy, "hit_rate": 1 - computed / sent, "out_tok_s": len(prompts) * shape.out_len / wall,
            "wall_s": wall, "per_core_requests": [n for _, n in sorted(per_core(client).items())],
            "forgotten_blocks": client.router.forgotten_blocks}


def per_core(client) -> dict:
    counts = {}
    for (_, _, w), n in client.router.decision_counts().items():
        counts[w] = counts.get(w, 0) + n
    return counts


def kv_bytes_per_token(model_dir: str) -> int:
    from weights import read_config
    _, mc = read_config(model_dir)
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * (mc.hidden_size // mc.num_attention_heads) * 4


def run_disaggregation(model_dir: str, shape: Shape, mode: str, seed: int) -> dict:
    from scaleout.disaggregation import DisaggregatedClient
    from engine import EngineConfig
    from engine_client import EngineClient
    rng = random.Random(seed)
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", num_threads=2, kv_cache_memory="256MiB",
                          max_num_batched_tokens=shape.chunk if mode == "colocated" else 2048)
    client = (EngineClient.in_process(config) if mode == "colocated" else DisaggregatedClient.in_processes(config, 1, 1))
    steady = [(0.0, [rng.randrange(300, 40_000) for _ in range(32)], shape.steady_out) for _ in range(shape.steady)]
    arrivals, at = [], 1.0                      # the steady decodes run a second alone first
    for _ in range(shape.long_prompts):
        arrivals.append((at, [rng.randrange(300, 40_000) for _ in range(shape.long_len)], 2))
        at += rng.expovariate(shape.long_rate)
    out = asyncio.run(drive(client, steady + arrivals))
    gaps = [b - a for r in out[:shape.steady] for a, b in zip(r["times"], r["times"][1:])]
    q = statistics.quantiles(gaps, n=100)
    ttfts = [r["ttft"] for r in out[shape.steady:]]
    return {"mode": mode, "tpot_p50_ms": 1e3 * statistics.median(gaps), "tpot_p99_ms": 1e3 * q[98],
            "long_ttft_p50_s": statistics.median(ttfts), "long_ttft_max_s": max(ttfts),
            "kv_bytes": getattr(client, "kv_bytes", 0)}


def bench_scaleout(sz, seed, results):
    shape = shape_for(sz)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(tmp, shape.layers)
        policies = ("round_robin", "cache_aware") if sz.name == "quick" else ("round_robin", "least_loaded", "cache_aware")
        routing = [run_routing(model_dir, shape, p, seed) for p in policies]
        rr, ca = routing[0], routing[-1]
        ratios = {"hit_rate": ca["hit_rate"] / max(rr["hit_rate"], 1e-9), "throughput": ca["out_tok_s"] / rr["out_tok_s"]}
        print_routing(shape, routing, ratios)
        disagg = [run_disaggregation(model_dir, shape, m, seed) for m in ("colocated", "1:1")]
    ratios |= {"tpot_p99": disagg[1]["tpot_p99_ms"] / disagg[0]["tpot_p99_ms"],
               "long_ttft_p50": disagg[1]["long_ttft_p50_s"] / disagg[0]["long_ttft_p50_s"]}
    print_disaggregation(shape, disagg, ratios)
    results["scaleout"] = {"shape": dataclasses.asdict(shape), "routing": routing, "disaggregation": disagg,
                           "ratios": ratios}


def print_routing(shape: Shape, routing: list[dict], ratios: dict) -> None:
    section_header("Scale-out: data-parallel routing", [
        f"2 engine cores (processes, 1 thread each); a random Llama of SmolLM2's width, {shape.layers} layers, float32; "
        f"{shape.tenants} system prompts of {shape.system_len} tokens x {shape.questions} questions of "
        f"{shape.question_len} tokens, shuffled, queued at once, {shape.out_len} output tokens each; each core's KV pool "
        f"holds {shape.kv_tokens} tokens.",
        "hit rate = 1 - prompt tokens computed / prompt tokens sent (both cores; a preempted request's recompute "
        "counts as computed). Evicted blocks forgotten: blocks the cores reported evicted that cut cache_aware's trees."])
    print(md_table(["policy", "hit rate", "out tok/s", "wall s", "requests per core", "evicted blocks forgotten"],
                   [[r["policy"], r["hit_rate"], r["out_tok_s"], r["wall_s"], str(r["per_core_requests"]),
                     r["forgotten_blocks"]] for r in routing]))
    print(f"\ncache_aware / round_robin: hit rate **{ratios['hit_rate']:.2f}x** (target >= 2), throughput "
          f"**{ratios['throughput']:.2f}x** (target >= 1.3)")


def print_disaggregation(shape: Shape, disagg: list[dict], ratios: dict) -> None:
    section_header("Scale-out: disaggregated prefill and decode", [
        f"{shape.steady} steady decodes ({shape.steady_out} tokens) while {shape.long_prompts} prompts of "
        f"{shape.long_len} tokens arrive (Poisson, {shape.long_rate}/s). colocated: one core with 2 threads, chunked "
        f"prefill at {shape.chunk} tokens; 1:1: a prefill core and a decode core, 1 thread each, KV over gloo.",
        "TPOT: the steady requests' gaps between tokens as their client sees them; TTFT: the long prompts'."])
    print(md_table(["mode", "TPOT p50 ms", "TPOT p99 ms", "long TTFT p50 s", "long TTFT max s", "KV bytes moved"],
                   [[r["mode"], r["tpot_p50_ms"], r["tpot_p99_ms"], r["long_ttft_p50_s"], r["long_ttft_max_s"],
                     r["kv_bytes"]] for r in disagg]))
    print(f"\n1:1 / colocated: TPOT p99 **{ratios['tpot_p99']:.2f}x** (target <= 0.6), long-prompt TTFT p50 "
          f"{ratios['long_ttft_p50']:.2f}x")
