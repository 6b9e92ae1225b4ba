"""
simulate.py: the project's real scheduler and KV cache at GPU scale, timed by a roofline cost model.

No model runs. Each step, the real `scheduler.Scheduler` (or `static_scheduler.StaticScheduler`)
and `kv_cache.BlockManager`, imported and never copied, decide which sequences run and how many
tokens each; cost_model.step_time says how long that step takes on one GPU (A100-80GB, H100 SXM,
H200), or tp of them under tensor parallelism, running a Llama config, host overhead included; the
simulated clock advances by that much and every sequence whose chunk reached its end gets one
(meaningless) token. So a change to the scheduler shows up here with no extra work, and thousands
of sequences run in seconds.

Owns: one engine under a workload. The workloads (ShareGPT/Alpaca-like length statistics, long
prompts, uniform, tenants sharing system prompts) with Poisson arrivals, the simulation loop, the
metrics, the table and the plots. Several engines (data parallel behind router.py, disaggregated
prefill/decode) live in simulate_cluster.py; the command line that picks one or the other is cli.py
(`python -m sim`); the hardware, the models and the step's cost live in cost_model.py. Does not decide
anything the scheduler decides, and does not touch the engine, the kernels or the tokenizer.
A request stops at exactly its drawn output length (max_tokens = that length, like ignore_eos).
Prompts are distinct tokens except the tenants' shared system prompts; under
--scheduling-policy priority, request k gets priority k % 3.

The commands that run it: cli.py.
"""
import argparse
import math
import os
import random
import time
from dataclasses import dataclass, field

# re-exported too: test_all.py reads the cost model's names as simulate.X
from sim.cost_model import (FLOP_EFFICIENCY, GPUS, HOST_OVERHEADS, LINK_CHOICES, MEM_EFFICIENCY, MODELS,  # noqa: F401
                            STEP_OVERHEAD_S, check_tensor_parallel, host_overhead, kv_pool_bytes, kv_pool_tokens,
                            resolve_link, roofline, step_cost, step_time)
from kv_cache import BlockManager, SwapIn, SwapOut
from scheduler import Scheduler, SchedulerConfig
from sequence import Sequence
from static_scheduler import StaticScheduler


# ------------------------------------------------------------------ workloads and arrivals
WORKLOADS = {   # (mean input, mean output) tokens: the vLLM paper's dataset statistics ...
    "sharegpt": (161, 338),
    "alpaca": (19.3, 58.5),
    "long-prompt": (1500, 100),   # ... and ours: long documents, short answers (summarization-like),
    "short-prompt": (150, 100),   # and the same answers after a tenth of the prompt (chat-like)
}
LENGTH_SIGMA = {"sharegpt": 1.0, "alpaca": 0.6, "long-prompt": 0.4, "short-prompt": 0.4}   # log-normal spread
WORKLOAD_CHOICES = [*WORKLOADS, "uniform", "tenants"]   # tenants: a shared system prompt per tenant + a question


@dataclass
class Request:
    """One simulated request; sits on its Sequence as seq.request."""
    arrival_time: float
    input_len: int
    output_len: int
    tenant: int = -1                  # tenants workload: whose system prompt opens the prompt
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
        tenant = -1
        if args.workload == "uniform":
            i, o = args.input_len, args.output_len
        elif args.workload == "tenants":
            tenant, i, o = rng.randrange(args.num_tenants), args.system_prompt_len + args.input_len, args.output_len
        else:
            mean_in, mean_out = WORKLOADS[args.workload]
            sigma = LENGTH_SIGMA[args.workload]
            i = lognormal_len(rng, mean_in, sigma, 1, args.max_model_len // 2)
            o = lognormal_len(rng, mean_out, sigma, 1, args.max_model_len - i)
        if args.request_rate != math.inf:
            t += rng.expovariate(args.request_rate)
        reqs.append(Request(t, i, o, tenant))
    return reqs


def prompt_tokens(k: int, r: Request, system_prompt_len: int) -> list[int]:
    """Request k's prompt: token k repeated, after its tenant's system prompt (token -1 - tenant repeated)
    when it has one. No model reads these ids; only the prefix cache and the router compare them."""
    if r.tenant < 0:
        return [k] * r.input_len
    return [-1 - r.tenant] * system_prompt_len + [k] * (r.input_len - system_prompt_len)


# ------------------------------------------------------------------ the simulation
def build(args, num_blocks, num_host_blocks):
    cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, scheduler_mode=args.scheduler_mode,
                          static_batch_size=args.static_batch_size, scheduling_policy=args.scheduling_policy,
                          preemption_mode=args.preemption_mode)
    cfg.validate()
    blocks = BlockManager(num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                          num_host_blocks=num_host_blocks)
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


def step_clock(args):
    """The step timer of one engine built from args: (rows, blocks swapped) -> seconds. Swapped blocks
    cross PCIe, each GPU of the tp group moving its share."""
    gpu, model, tp = GPUS[args.gpu], MODELS[args.model], args.tensor_parallel_size
    check_tensor_parallel(model, tp)
    timing = dict(host=host_overhead(args.host_overhead), graphs=not args.enforce_eager,
                  link=resolve_link(args.tp_link, gpu), overlap=args.async_scheduling)
    block_bytes = model.kv_bytes_per_token * args.block_size

    def clock(rows, swapped=0):
        return step_time(gpu, model, rows, tp, **timing) + swapped * block_bytes / (tp * gpu.pcie_bandwidth)
    return clock


def pool_blocks(args) -> int:
    """KV blocks of one engine (tp GPUs together), or the reason it cannot run."""
    gpu, model, tp = GPUS[args.gpu], MODELS[args.model], args.tensor_parallel_size
    num_blocks = kv_pool_tokens(gpu, model, args.gpu_memory_utilization, tp) // args.block_size
    if num_blocks <= 0:
        raise ValueError(f"--model {args.model} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                         f"{tp} x {gpu.name} at --gpu-memory-utilization {args.gpu_memory_utilization}; "
                         f"raise --tensor-parallel-size")
    return num_blocks


def check_fits(reqs, blocks, sched):
    longest = max(r.input_len + r.output_len for r in reqs)
    if blocks.blocks_needed(longest) > blocks.num_blocks - sched.watermark_blocks:
        raise ValueError(f"a request of {longest} tokens can never fit the KV pool ({blocks.num_blocks} blocks of "
                         f"{blocks.block_size}, {sched.watermark_blocks} kept free); "
                         f"raise --gpu-memory-utilization or shorten the requests")


def simulate(args) -> dict:
    """Run the workload through the real scheduler, one step at a time, on the simulated clock."""
    step_s, num_blocks = step_clock(args), pool_blocks(args)
    reqs = make_requests(args)
    block_bytes = MODELS[args.model].kv_bytes_per_token * args.block_size
    sched, blocks = build(args, num_blocks, int(args.swap_space * 2**30 // block_bytes))
    check_fits(reqs, blocks, sched)
    seqs = [Sequence(k, prompt_tokens(k, r, args.system_prompt_len), r.input_len, r.output_len,
                     priority=k % 3 if args.scheduling_policy == "priority" else 0, arrival_time=r.arrival_time,
                     request=r) for k, r in enumerate(reqs)]
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
        dt = step_s(rows, sum(1 for op in batch.block_ops if isinstance(op, (SwapIn, SwapOut))))
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
    return report(args, reqs, clock, tally, num_blocks, sim_s, sim_cpu_s) | {"prefix_hit_rate": blocks.hit_rate()}


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


# ------------------------------------------------------------------ table, plots
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


def add_engine_args(p):
    """The flags that say what one engine runs on and how its steps are timed."""
    p.add_argument("--gpu", choices=GPUS, default=p.get_default("gpu") or "h100-sxm")
    p.add_argument("--model", choices=MODELS, default=p.get_default("model") or "llama-3-8b")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--tp-link", choices=LINK_CHOICES, default="nvlink",
                   help="the tensor-parallel all-reduces' link (a family means this GPU's generation of it)")
    p.add_argument("--host-overhead", default="vllm", metavar="{" + ",".join(HOST_OVERHEADS) + "} or PATH",
                   help="the host's cost per step and launch: a preset, or the fit to a bench.py results JSON of a "
                        "GPU run (fit_host_overhead says which fields it reads)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: decode steps pay every launch (graphs replay decode-only steps)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the host plans each step while the GPU runs the last: a step is max(host, GPU) + a sync")


def check_engine_args(p, args):
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be >= 1")
    if args.host_overhead not in HOST_OVERHEADS and not os.path.isfile(args.host_overhead):
        p.error(f"--host-overhead must be one of {list(HOST_OVERHEADS)} or a results JSON file, got {args.host_overhead!r}")


def disaggregation(value: str) -> tuple[int, int]:
    p, sep, d = value.partition(":")
    if not (sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(f"--disaggregation must be P:D with P, D >= 1 (e.g. 1:1), got {value!r}")
    return int(p), int(d)


def parse_run(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Simulate nanoserve's scheduler on a GPU (see the module docstring).")
    add_engine_args(p)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--workload", choices=WORKLOAD_CHOICES, default="sharegpt")
    p.add_argument("--input-len", type=int, default=512, help="uniform workload; tenants: the question after the system prompt")
    p.add_argument("--output-len", type=int, default=128, help="uniform and tenants workloads only")
    p.add_argument("--num-tenants", type=int, default=8, help="tenants workload only")
    p.add_argument("--system-prompt-len", type=int, default=500, help="tenants workload only")
    p.add_argument("--enable-prefix-caching", action="store_true", help="each engine's BlockManager shares full blocks")
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
    p.add_argument("--data-parallel-size", type=int, default=1, help="full engine replicas behind a router")
    p.add_argument("--routing", choices=["round_robin", "least_loaded", "cache_aware"], default="least_loaded",
                   help="router.py's policy across replicas (and, disaggregated, across prefill engines)")
    p.add_argument("--disaggregation", type=disaggregation, default=None, metavar="P:D",
                   help="P prefill engines and D decode engines; each request's KV moves after its prefill")
    p.add_argument("--kv-link", choices=LINK_CHOICES, default="nvlink", help="the KV transfer's link, disaggregated")
    p.add_argument("--sweep-rates", type=lambda s: [rate(x) for x in s.split(",")], default=None,
                   help="comma-separated rates; runs every --sweep-variants at each")
    p.add_argument("--sweep-variants", default="continuous/fcfs,continuous/priority,static/fcfs",
                   help="comma-separated scheduler modes, each optionally /policy")
    p.add_argument("--timeline-every", type=int, default=10, help="record KV usage every this many steps")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--plot", help="write PNG charts into this directory")
    args = p.parse_args(argv)
    check_engine_args(p, args)
    cluster = args.data_parallel_size > 1 or args.disaggregation
    checks = [("gpu_memory_utilization", 0 < args.gpu_memory_utilization <= 1, "in (0, 1]"),
              ("num_requests", args.num_requests >= 1, ">= 1"),
              ("input_len", args.input_len >= 1, ">= 1"), ("output_len", args.output_len >= 1, ">= 1"),
              ("input_len + output_len", args.workload != "uniform" or args.input_len + args.output_len
               <= args.max_model_len, "<= --max-model-len"),
              ("num_tenants", args.num_tenants >= 1, ">= 1"), ("system_prompt_len", args.system_prompt_len >= 1, ">= 1"),
              ("system_prompt_len + input_len + output_len", args.workload != "tenants" or args.system_prompt_len
               + args.input_len + args.output_len <= args.max_model_len, "<= --max-model-len"),
              ("static_batch_size", args.static_batch_size >= 1, ">= 1"),
              ("max_num_seqs", args.max_num_seqs >= 1, ">= 1"),
              ("max_num_batched_tokens", args.max_num_batched_tokens >= 1, ">= 1"),
              ("block_size", args.block_size >= 1, ">= 1"), ("swap_space", args.swap_space >= 0, ">= 0"),
              ("data_parallel_size", args.data_parallel_size >= 1, ">= 1"),
              ("data_parallel_size", args.data_parallel_size == 1 or not args.disaggregation,
               "1 with --disaggregation (P:D already counts the engines)"),
              ("scheduler_mode", not cluster or args.scheduler_mode == "continuous",
               "continuous with --data-parallel-size or --disaggregation"),
              ("timeline_every", args.timeline_every >= 1, ">= 1")]
    for name, ok, allowed in checks:
        if not ok:
            p.error(f"--{name.replace('_', '-')} must be {allowed}")
    return args


def parse_roofline(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sim roofline", description="Decode step time of a full batch.")
    p.set_defaults(gpu="a100-80gb", model="llama-2-13b")
    add_engine_args(p)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=0, help="cached tokens per row (0: weights only)")
    args = p.parse_args(argv)
    check_engine_args(p, args)
    if args.batch < 1 or args.context < 0:
        p.error("--batch must be >= 1, --context >= 0")
    return args
