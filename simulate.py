"""
simulate.py: the project's real scheduler and KV cache at GPU scale, timed by a roofline cost model.

No model runs. Each step, the real `scheduler.Scheduler` (or `static_scheduler.StaticScheduler`)
and `kv_cache.BlockManager`, imported and never copied, decide which sequences run and how many
tokens each; a cost model of one GPU (A100-80GB, H100 SXM, H200) running a Llama config says how
long that step takes; the simulated clock advances by that much and every sequence whose chunk
reached its end gets one (meaningless) token. So a change to the scheduler shows up here with no
extra work, and thousands of concurrent sequences run in seconds on a laptop.

Owns: the GPU table, the model configs, the cost model, the workloads (ShareGPT/Alpaca-like length
statistics, uniform) with Poisson arrivals, the metrics, the sweep and the plots. Does not decide
anything the scheduler decides, and does not touch the engine, the kernels or the tokenizer.
A request stops at exactly its drawn output length (max_tokens = that length, like ignore_eos).
Prompts are distinct random tokens, so the prefix cache is off and lpm orders like fcfs; under
--scheduling-policy priority, request k gets priority k % 3.

  python simulate.py --gpu h100-sxm --model llama-3-8b --workload sharegpt --num-requests 1000
  python simulate.py roofline --gpu a100-80gb --model llama-2-13b --batch 32
"""
import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

from kv_cache import BlockManager, SwapIn, SwapOut
from scheduler import Scheduler, SchedulerConfig
from sequence import Sequence
from static_scheduler import StaticScheduler


# ------------------------------------------------------------------ hardware and models
@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float          # dense bf16 FLOP/s
    hbm_bandwidth: float       # bytes/s
    memory: float              # bytes
    pcie_bandwidth: float      # bytes/s host <-> device, what swap preemption pays


GPUS = {   # vendor datasheets; PCIe: Gen4 x16 on A100, Gen5 x16 on H100/H200 (about 80% of the link)
    "a100-80gb": GPU("A100-80GB", 312e12, 2.0e12, 80e9, 25e9),
    "h100-sxm": GPU("H100 SXM", 989e12, 3.35e12, 80e9, 50e9),
    "h200": GPU("H200", 989e12, 4.8e12, 141e9, 50e9),
}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2       # bf16 weights and KV cache

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv                 # q, o: h x h; k, v: h x (kv heads * head dim)
        mlp = 3 * h * self.intermediate_size               # gate, up, down (SwiGLU)
        per_layer = attention + mlp + 2 * h                # + two RMSNorm weights
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h   # untied embed/lm_head, final norm

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes   # K and V


MODELS = {   # the published Hugging Face configs
    "llama-2-7b": ModelConfig("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-13b": ModelConfig("Llama-2-13B", 40, 5120, 40, 40, 128, 13824, 32000),
    "llama-3-8b": ModelConfig("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelConfig("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
}

# ------------------------------------------------------------------ the fitted constants (stated once)
# Fitted once to published measurements and never tuned per test or per run.
MEM_EFFICIENCY = 0.70     # share of peak HBM bandwidth a decode step reaches. gpt-fast's README:
                          # Llama-2-7B bf16, batch 1, on an A100-80GB (power-limited to 330 W)
                          # runs 104.9 tok/s = 1,397 GB/s of the 2,000 GB/s peak -> 0.70.
FLOP_EFFICIENCY = 0.60    # share of peak bf16 FLOP/s a prefill-heavy step reaches. FlashAttention-2
                          # (Dao, 2023) reports 50-73% of A100 peak for the forward pass, and large
                          # GEMMs sit in that range; we take about its middle.
STEP_OVERHEAD_S = 0.002   # CPU time per step that the GPU waits for (schedule, build inputs, sample,
                          # detokenize). vLLM's v0.6.0 post (2024-09-05) profiled Llama-3-8B on one
                          # H100 and found the GPU busy only 38% of the time in v0.5.3; overlapping
                          # just the output processing gave +12% throughput (vLLM PR #7049), i.e.
                          # about 2 ms of the ~15-20 ms steps of that benchmark.


# ------------------------------------------------------------------ the cost model
def step_cost(model: ModelConfig, rows) -> tuple[float, float]:
    """(bytes moved, FLOPs) of one forward pass. rows: (num_new_tokens, num_cached_tokens) per
    row. Weights are read once; every row reads the K/V of its cached context and writes its new
    tokens' K/V. Linear layers cost 2 FLOPs per parameter per token; attention costs 4 FLOPs
    (QK^T and PV) per head dim per head per layer for every (query, key) pair it sees, causally."""
    num_tokens = sum(n for n, _ in rows)
    kv_tokens = sum(n + c for n, c in rows)                             # read c, write n
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in rows)              # query i sees c + i keys
    bytes_moved = model.weight_bytes + kv_tokens * model.kv_bytes_per_token
    flops = 2 * model.num_params * num_tokens + 4 * model.num_layers * model.num_heads * model.head_dim * pairs
    return bytes_moved, flops


def step_time(gpu: GPU, model: ModelConfig, rows, tp: int = 1, ideal: bool = False) -> float:
    """Seconds for one step on tp GPUs: the slower of memory and compute, at the fitted efficiencies,
    plus the per-step overhead. ideal=True is the bare roofline (efficiency 1, no overhead).
    Tensor parallelism splits bytes and FLOPs evenly; its all-reduces are not modelled."""
    bytes_moved, flops = step_cost(model, rows)
    mem_eff, flop_eff, overhead = (1.0, 1.0, 0.0) if ideal else (MEM_EFFICIENCY, FLOP_EFFICIENCY, STEP_OVERHEAD_S)
    return max(bytes_moved / (tp * gpu.hbm_bandwidth * mem_eff), flops / (tp * gpu.peak_flops * flop_eff)) + overhead


def kv_pool_bytes(gpu: GPU, model: ModelConfig, gpu_memory_utilization: float, tp: int = 1) -> float:
    """What the KV cache gets: the usable share of memory (vLLM's gpu_memory_utilization; the rest
    is the activation, CUDA-graph and context reserve) minus the weights."""
    return tp * gpu.memory * gpu_memory_utilization - model.weight_bytes


def roofline(gpu: GPU, model: ModelConfig, batch: int, context: int, tp: int = 1) -> dict:
    """A full decode batch: batch rows of one new token after `context` cached tokens each."""
    rows = [(1, context)] * batch
    bytes_moved, flops = step_cost(model, rows)
    out = {"gpu": gpu.name, "model": model.name, "batch": batch, "context": context, "tensor_parallel_size": tp,
           "weight_gb": model.weight_bytes / 1e9, "kv_read_gb": (bytes_moved - model.weight_bytes) / 1e9,
           "gflop": flops / 1e9,
           "bound": "memory" if bytes_moved / gpu.hbm_bandwidth >= flops / gpu.peak_flops else "compute"}
    for kind in ("ideal", "modelled"):
        t = step_time(gpu, model, rows, tp, ideal=(kind == "ideal"))
        out[kind] = {"step_ms": t * 1e3, "steps_per_s": 1 / t, "tok_s": batch / t}
    return out


# ------------------------------------------------------------------ workloads and arrivals
WORKLOADS = {   # (mean input, mean output) tokens: the vLLM paper's dataset statistics
    "sharegpt": (161, 338),
    "alpaca": (19.3, 58.5),
}
LENGTH_SIGMA = {"sharegpt": 1.0, "alpaca": 0.6}   # log-normal spread: ShareGPT has a long tail, Alpaca is narrow


@dataclass
class Request:
    """One simulated request; sits on its Sequence as seq.request."""
    arrival_time: float
    input_len: int
    output_len: int
    first_token_time: float = math.nan
    finish_time: float = math.nan


def lognormal_len(rng, mean, sigma, lo, hi) -> int:
    """A log-normal draw with the given mean (mu = ln(mean) - sigma^2 / 2), clipped to [lo, hi]."""
    return int(min(max(round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)), lo), hi))


def make_requests(args) -> list[Request]:
    """Seeded lengths and Poisson arrivals (rate inf: everyone at t=0)."""
    rng = random.Random(args.seed)
    t, reqs = 0.0, []
    for _ in range(args.num_requests):
        if args.workload == "uniform":
            i, o = args.input_len, args.output_len
        else:
            mean_in, mean_out = WORKLOADS[args.workload]
            sigma = LENGTH_SIGMA[args.workload]
            i = lognormal_len(rng, mean_in, sigma, 1, args.max_model_len // 2)
            o = lognormal_len(rng, mean_out, sigma, 1, args.max_model_len - i)
        if args.request_rate != math.inf:
            t += rng.expovariate(args.request_rate)
        reqs.append(Request(t, i, o))
    return reqs


# ------------------------------------------------------------------ the simulation
def build(args, num_blocks, num_host_blocks):
    cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, scheduler_mode=args.scheduler_mode,
                          static_batch_size=args.static_batch_size, scheduling_policy=args.scheduling_policy,
                          preemption_mode=args.preemption_mode)
    cfg.validate()
    blocks = BlockManager(num_blocks, args.block_size, enable_prefix_caching=False, num_host_blocks=num_host_blocks)
    sched = (StaticScheduler if args.scheduler_mode == "static" else Scheduler)(cfg, blocks)
    return sched, blocks


@dataclass
class Tally:
    """Step statistics, weighted by each step's simulated time."""
    block_size: int
    max_model_len: int
    timeline_every: int
    steps: int = 0
    busy: float = 0.0                 # simulated seconds spent in steps
    preemptions: int = 0
    peak_running: int = 0
    running_area: float = 0.0         # integral of running sequences over time
    waste_area: float = 0.0           # ... of the share of allocated slots holding no K/V
    contiguous_area: float = 0.0      # ... of the same, had each reserved prompt + max_tokens up front
    timeline: list = field(default_factory=list)   # (clock, KV usage, running), every timeline_every steps

    def record(self, clock, dt, batch, running, blocks):
        self.steps, self.busy, self.preemptions = self.steps + 1, self.busy + dt, self.preemptions + batch.num_preempted
        held = sum(s.num_computed_tokens for s in running)
        allocated = (blocks.num_blocks - blocks.num_free_blocks()) * self.block_size
        contiguous = sum(min(s.num_prompt_tokens + s.max_tokens, self.max_model_len) for s in running)
        self.running_area += len(running) * dt
        self.waste_area += (1 - held / allocated if allocated else 0.0) * dt
        self.contiguous_area += (1 - held / contiguous if contiguous else 0.0) * dt
        self.peak_running = max(self.peak_running, len(running))
        if self.steps % self.timeline_every == 0:
            self.timeline.append((clock, blocks.usage(), len(running)))


def simulate(args) -> dict:
    """Run the workload through the real scheduler, one step at a time, on the simulated clock."""
    gpu, model, tp = GPUS[args.gpu], MODELS[args.model], args.tensor_parallel_size
    block_bytes = model.kv_bytes_per_token * args.block_size
    num_blocks = int(kv_pool_bytes(gpu, model, args.gpu_memory_utilization, tp) // block_bytes)
    if num_blocks <= 0:
        raise ValueError(f"--model {args.model} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                         f"{tp} x {gpu.name} at --gpu-memory-utilization {args.gpu_memory_utilization}; "
                         f"raise --tensor-parallel-size")
    reqs = make_requests(args)
    sched, blocks = build(args, num_blocks, int(args.swap_space * 2**30 // block_bytes))
    longest = max(r.input_len + r.output_len for r in reqs)
    if blocks.blocks_needed(longest) > num_blocks - sched.watermark_blocks:
        raise ValueError(f"a request of {longest} tokens can never fit the KV pool ({num_blocks} blocks of "
                         f"{args.block_size}, {sched.watermark_blocks} kept free); "
                         f"raise --gpu-memory-utilization or shorten the requests")
    seqs = [Sequence(k, [k] * r.input_len, r.input_len, r.output_len, priority=k % 3 if args.scheduling_policy ==
                     "priority" else 0, arrival_time=r.arrival_time, request=r) for k, r in enumerate(reqs)]
    tally = Tally(args.block_size, args.max_model_len, args.timeline_every)
    started, started_cpu = time.perf_counter(), time.process_time()
    clock, arrived, done = 0.0, 0, 0
    while done < len(seqs):
        while arrived < len(seqs) and seqs[arrived].arrival_time <= clock:
            sched.add(seqs[arrived])
            arrived += 1
        batch = sched.schedule()
        if not batch.seqs:
            if arrived == len(seqs):
                raise RuntimeError(f"the scheduler scheduled nothing with {len(seqs) - done} requests unfinished")
            clock = max(clock, seqs[arrived].arrival_time)      # idle until the next arrival
            continue
        rows = [(n, seq.num_computed_tokens) for seq, n in zip(batch.seqs, batch.num_tokens)]
        swapped = sum(1 for op in batch.block_ops if isinstance(op, (SwapIn, SwapOut)))
        dt = step_time(gpu, model, rows, tp) + swapped * block_bytes / (tp * gpu.pcie_bandwidth)
        clock += dt
        for seq in sched.finish_step(batch):                    # their chunk reached the end: one token each
            if seq.num_output_tokens == 0 and math.isnan(seq.request.first_token_time):
                seq.request.first_token_time = clock
            seq.token_ids.append(0)
            if seq.num_output_tokens >= seq.max_tokens:
                seq.request.finish_time = clock
                sched.remove(seq)
                done += 1
        tally.record(clock, dt, batch, sched.running, blocks)
    assert blocks.num_free_blocks() == blocks.num_blocks, "blocks leaked: some KV block is still held"
    sim_s, sim_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    return report(args, reqs, clock, tally, num_blocks, sim_s, sim_cpu_s)


def percentiles(values) -> dict:
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {f"p{p}": v[min(len(v) - 1, int(p / 100 * len(v)))] for p in (50, 90, 99)}


def report(args, reqs, wall, tally: Tally, num_blocks, sim_s, sim_cpu_s) -> dict:
    out_tokens = sum(r.output_len for r in reqs)
    in_tokens = sum(r.input_len for r in reqs)
    return {
        "config": {k: (str(v) if v == math.inf else v) for k, v in vars(args).items() if k not in ("plot", "out")},
        "output_tok_s": out_tokens / wall, "total_tok_s": (in_tokens + out_tokens) / wall,
        "requests_per_s": len(reqs) / wall,
        "ttft_s": percentiles(r.first_token_time - r.arrival_time for r in reqs),
        "tpot_s": percentiles((r.finish_time - r.first_token_time) / (r.output_len - 1)
                              for r in reqs if r.output_len > 1),
        "e2e_s": percentiles(r.finish_time - r.arrival_time for r in reqs),
        "peak_running": tally.peak_running, "mean_running": tally.running_area / tally.busy,
        "kv_waste": tally.waste_area / tally.busy,          # allocated slots holding no K/V, time-averaged
        "kv_waste_contiguous": tally.contiguous_area / tally.busy,   # had each reserved prompt + max_tokens
        "num_preemptions": tally.preemptions, "num_steps": tally.steps, "mean_step_ms": 1e3 * tally.busy / tally.steps,
        "num_blocks": num_blocks, "kv_pool_tokens": num_blocks * args.block_size,
        "mean_input_len": in_tokens / len(reqs), "mean_output_len": out_tokens / len(reqs),
        "wall_s": wall, "sim_s": sim_s, "sim_cpu_s": sim_cpu_s, "timeline": tally.timeline,
    }


# ------------------------------------------------------------------ sweep, table, plots
def sweep(args) -> dict:
    """Every variant (mode or mode/policy) at every rate: {variant: [result, ...]}."""
    results = {}
    for variant in args.sweep_variants.split(","):
        mode, _, policy = variant.partition("/")
        results[variant] = [simulate(argparse.Namespace(**{**vars(args), "request_rate": rate, "scheduler_mode": mode,
                                                          "scheduling_policy": policy or args.scheduling_policy}))
                            for rate in args.sweep_rates]
    return results


def print_table(res: dict):
    rows = [("output tok/s", f"{res['output_tok_s']:.0f}"), ("total tok/s", f"{res['total_tok_s']:.0f}"),
            ("requests/s", f"{res['requests_per_s']:.2f}"),
            ("TTFT p50/p90/p99 s", "/".join(f"{v:.3f}" for v in res["ttft_s"].values())),
            ("TPOT p50/p90/p99 ms", "/".join(f"{1e3 * v:.1f}" for v in res["tpot_s"].values())),
            ("running peak/mean", f"{res['peak_running']}/{res['mean_running']:.0f}"),
            ("KV waste paged/contiguous", f"{res['kv_waste']:.1%}/{res['kv_waste_contiguous']:.1%}"),
            ("preemptions", res["num_preemptions"]), ("steps", res["num_steps"]),
            ("simulated s / real s (CPU s)", f"{res['wall_s']:.1f} / {res['sim_s']:.1f} ({res['sim_cpu_s']:.1f})")]
    c = res["config"]
    print(f"| {c['model']} on {c['gpu']}, {c['workload']}, {c['scheduler_mode']}/{c['scheduling_policy']}, "
          f"rate {c['request_rate']} | |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def plot(results: dict, directory: str):
    """kv_usage.png for every run; throughput_vs_rate.png when there is a sweep (finite rates only)."""
    import os
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(directory, exist_ok=True)
    fig, (ax_kv, ax_run) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, runs in results.items():
        t, usage, running = zip(*runs[-1]["timeline"]) if runs[-1]["timeline"] else ((), (), ())
        ax_kv.plot(t, [100 * u for u in usage], label=name)
        ax_run.plot(t, running, label=name)
    ax_kv.set(ylabel="KV blocks in use (%)", ylim=(0, 105), title="KV usage over time (last rate of each line)")
    ax_run.set(xlabel="simulated time (s)", ylabel="running (unfinished) sequences")
    ax_kv.legend()
    fig.tight_layout()
    fig.savefig(f"{directory}/kv_usage.png", dpi=110)
    plt.close(fig)
    finite = {n: [r for r in runs if r["config"]["request_rate"] != "inf"] for n, runs in results.items()}
    if max(len(r) for r in finite.values()) < 2:
        return
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in finite.items():
        rates = [r["config"]["request_rate"] for r in runs]
        ax_tp.plot(rates, [r["output_tok_s"] for r in runs], "o-", label=name)
        ax_ttft.plot(rates, [r["ttft_s"]["p99"] for r in runs], "o-", label=name)
    c = next(iter(results.values()))[0]["config"]
    ax_tp.set(xlabel="request rate (req/s)", ylabel="output tokens/s",
              title=f"{c['model']} on {c['gpu']}, {c['workload']}")
    ax_ttft.set(xlabel="request rate (req/s)", ylabel="p99 TTFT (s)", yscale="log", title="p99 time to first token")
    ax_tp.legend()
    fig.tight_layout()
    fig.savefig(f"{directory}/throughput_vs_rate.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ command line
def rate(value: str) -> float:
    r = float(value)
    if not r > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {value}")
    return r


def parse_run(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Simulate nanoserve's scheduler on a GPU (see the module docstring).")
    p.add_argument("--gpu", choices=GPUS, default="h100-sxm")
    p.add_argument("--model", choices=MODELS, default="llama-3-8b")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--workload", choices=["sharegpt", "alpaca", "uniform"], default="sharegpt")
    p.add_argument("--input-len", type=int, default=512, help="uniform workload only")
    p.add_argument("--output-len", type=int, default=128, help="uniform workload only")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--request-rate", type=rate, default=math.inf, help="Poisson arrivals per second, or inf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduler-mode", choices=["continuous", "static"], default="continuous")
    p.add_argument("--static-batch-size", type=int, default=8)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority", "lpm"], default="fcfs")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--swap-space", type=float, default=4, help="GiB of host memory per GPU for swapped blocks")
    p.add_argument("--sweep-rates", type=lambda s: [rate(x) for x in s.split(",")], default=None,
                   help="comma-separated rates; runs every --sweep-variants at each")
    p.add_argument("--sweep-variants", default="continuous/fcfs,continuous/priority,static/fcfs",
                   help="comma-separated scheduler modes, each optionally /policy")
    p.add_argument("--timeline-every", type=int, default=10, help="record KV usage every this many steps")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--plot", help="write PNG charts into this directory")
    args = p.parse_args(argv)
    checks = [("tensor_parallel_size", args.tensor_parallel_size >= 1, ">= 1"),
              ("gpu_memory_utilization", 0 < args.gpu_memory_utilization <= 1, "in (0, 1]"),
              ("num_requests", args.num_requests >= 1, ">= 1"),
              ("input_len", args.input_len >= 1, ">= 1"), ("output_len", args.output_len >= 1, ">= 1"),
              ("input_len + output_len", args.workload != "uniform" or args.input_len + args.output_len
               <= args.max_model_len, "<= --max-model-len"),
              ("static_batch_size", args.static_batch_size >= 1, ">= 1"),
              ("max_num_seqs", args.max_num_seqs >= 1, ">= 1"),
              ("max_num_batched_tokens", args.max_num_batched_tokens >= 1, ">= 1"),
              ("block_size", args.block_size >= 1, ">= 1"), ("swap_space", args.swap_space >= 0, ">= 0"),
              ("timeline_every", args.timeline_every >= 1, ">= 1")]
    for name, ok, allowed in checks:
        if not ok:
            p.error(f"--{name.replace('_', '-')} must be {allowed}")
    return args


def parse_roofline(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="simulate.py roofline", description="Decode step time of a full batch.")
    p.add_argument("--gpu", choices=GPUS, default="a100-80gb")
    p.add_argument("--model", choices=MODELS, default="llama-2-13b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=0, help="cached tokens per row (0: weights only)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    args = p.parse_args(argv)
    if args.batch < 1 or args.context < 0 or args.tensor_parallel_size < 1:
        p.error("--batch and --tensor-parallel-size must be >= 1, --context >= 0")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["roofline"]:
        a = parse_roofline(argv[1:])
        print(json.dumps(roofline(GPUS[a.gpu], MODELS[a.model], a.batch, a.context, a.tensor_parallel_size), indent=2))
        return
    args = parse_run(argv)
    try:
        results = sweep(args) if args.sweep_rates else {args.scheduler_mode: [simulate(args)]}
    except ValueError as e:                              # a configuration that cannot run: say why, no traceback
        sys.exit(f"simulate.py: error: {e}")
    for runs in results.values():
        for res in runs:
            print_table(res)
            print()
    if args.out:
        slim = {name: [{k: v for k, v in r.items() if k != "timeline"} for r in runs] for name, runs in results.items()}
        with open(args.out, "w") as f:
            json.dump(slim if args.sweep_rates else slim[args.scheduler_mode][0], f, indent=2)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
