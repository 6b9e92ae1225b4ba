"""
simulate_cluster.py: several simulated engines serving one workload: data parallel behind router.py,
or disaggregated prefill and decode, with each request's KV moved between them.

Every engine is simulate.py's: the real Scheduler and BlockManager, steps timed by cost_model. An
event loop (arrivals, step ends, KV transfers' ends) keeps one clock, and each engine steps whenever
it has work. Data parallel: N full engines; router.Router picks one per request at its arrival, and
with cache_aware its prefix trees meet each engine's own prefix cache. Disaggregated P:D: a request
prefills on one of P engines (its first token there is its TTFT); then one of D decode engines
reserves blocks for its prompt's KV, the KV crosses the link (bytes / bandwidth + latency, one
transfer at a time per sender and per receiver), the prefill engine holds its blocks until the
transfer ends, and the request decodes on the decode engine.
Owns the cluster loop, its report and the DistServe-style goodput sweep (docs/disaggregation.md).
Calls only the scheduler's and block manager's public methods, except join_running (below).
"""
import argparse
import heapq
import itertools
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

from sim import simulate as sim
from sim.cost_model import GPUS, MODELS, resolve_link
from kv_cache import SwapIn, SwapOut
from scaleout.router import Router, RouterConfig
from sequence import Sequence, Status


@dataclass(eq=False)
class Engine:
    name: str
    role: str                       # colocated | prefill | decode
    sched: object                   # scheduler.Scheduler
    blocks: object                  # kv_cache.BlockManager
    batch: object = None            # the step in flight, None when idle
    steps: int = 0
    busy_s: float = 0.0
    decode_rows: int = 0            # rows computing a generated token's KV: a prefill engine never has one
    pending: deque = field(default_factory=deque)   # decode: (seq, sender, holder) waiting for blocks
    incoming: int = 0               # decode: transfers under way, their blocks reserved
    link_free: float = 0.0          # the engine's KV link is busy until then (sending or receiving)


def join_running(sched, seq):
    """A sequence whose prompt KV arrived computed joins the running queue, as vLLM's KV connector
    does. The scheduler has no method for it yet; this is the only line here
    that reaches into the scheduler's queues."""
    seq.status = Status.RUNNING
    sched.running.append(seq)


class Cluster:
    def __init__(self, args):
        self.args, self.step_s = args, sim.step_clock(args)
        gpu, model = GPUS[args.gpu], MODELS[args.model]
        self.num_blocks = sim.pool_blocks(args)
        self.block_bytes = model.kv_bytes_per_token * args.block_size
        self.kv_bytes_per_token, self.tp = model.kv_bytes_per_token, args.tensor_parallel_size
        self.link = resolve_link(args.kv_link, gpu)
        if args.disaggregation:
            p, d = args.disaggregation
            entry = [self.engine(f"prefill{i}", "prefill") for i in range(p)]
            self.decoders = {e.name: e for e in (self.engine(f"decode{i}", "decode") for i in range(d))}
        else:
            entry = [self.engine(f"engine{i}", "colocated") for i in range(args.data_parallel_size)]
            self.decoders = {}
        self.entry = {e.name: e for e in entry}
        tree_tokens = self.num_blocks * args.block_size                # a tree mirrors one engine's pool
        self.router = Router(RouterConfig(args.routing, max_tree_tokens=tree_tokens), list(self.entry))
        self.decode_router = Router(RouterConfig("least_loaded"), list(self.decoders)) if self.decoders else None
        self.events, self.order = [], itertools.count()
        self.done = 0
        self.transfers = {"count": 0, "bytes": 0, "link_s": 0.0, "wait_s": 0.0}

    def engine(self, name, role) -> Engine:
        sched, blocks = sim.build(self.args, self.num_blocks, int(self.args.swap_space * 2**30 // self.block_bytes))
        return Engine(name, role, sched, blocks)

    def push(self, t, kind, *data):
        heapq.heappush(self.events, (t, next(self.order), kind, data))

    # ---------------------------------------------------------------- the loop
    def run(self, reqs) -> float:
        for k, r in enumerate(reqs):
            self.push(r.arrival_time, "arrive", k, r)
        now = 0.0
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            getattr(self, kind)(now, *data)
        if self.done < len(reqs):
            raise RuntimeError(f"the cluster stalled with {len(reqs) - self.done} requests unfinished")
        return now

    def arrive(self, now, k, r):
        tokens = sim.prompt_tokens(k, r, self.args.system_prompt_len)
        e = self.entry[self.router.route(tokens)]
        max_tokens = 1 if e.role == "prefill" else r.output_len
        e.sched.add(Sequence(k, tokens, r.input_len, max_tokens, arrival_time=r.arrival_time, request=r))
        self.kick(e, now)

    def kick(self, e: Engine, now):
        """An idle engine with work starts its next step."""
        if e.batch is not None:
            return
        batch = e.sched.schedule()
        if not batch.seqs:
            return
        rows = [(n, s.num_computed_tokens) for s, n in zip(batch.seqs, batch.num_tokens)]
        dt = self.step_s(rows, sum(1 for op in batch.block_ops if isinstance(op, (SwapIn, SwapOut))))
        e.batch, e.steps, e.busy_s = batch, e.steps + 1, e.busy_s + dt
        e.decode_rows += sum(1 for s in batch.seqs if s.num_computed_tokens >= s.num_prompt_tokens)
        self.push(now + dt, "step_end", e)

    def step_end(self, now, e: Engine):
        batch, e.batch = e.batch, None
        for seq in e.sched.finish_step(batch):             # their chunk reached the end: one token each
            r = seq.request
            if seq.num_output_tokens == 0 and math.isnan(r.first_token_time):
                r.first_token_time = now
            seq.token_ids.append(0)
            if seq.num_output_tokens < seq.max_tokens:
                continue
            e.sched.remove(seq)
            if e.role == "prefill" and r.output_len > 1:
                self.router.finish(e.name)
                self.hand_off(e, seq, now)
            else:
                r.finish_time = now
                (self.decode_router if e.role == "decode" else self.router).finish(e.name)
                self.done += 1
        if e.role == "decode":
            self.admit_transfers(e, now)
        self.kick(e, now)

    # ---------------------------------------------------------------- disaggregation's KV transfer
    def hand_off(self, pe: Engine, seq, now):
        """seq's prefill ended on pe: a holder keeps its blocks on pe until the transfer ends, and a
        decode engine queues it for blocks of its own."""
        n = seq.num_prompt_tokens
        holder = Sequence(-1 - seq.seq_id, [0] * n, n, 0)
        pe.blocks.allocate_slots(holder, n)                # the blocks remove() just freed: always room
        dseq = Sequence(seq.seq_id, list(seq.token_ids), n, seq.request.output_len,
                        arrival_time=seq.arrival_time, request=seq.request)
        de = self.decoders[self.decode_router.route(dseq.token_ids)]
        de.pending.append((dseq, pe, holder))
        self.admit_transfers(de, now)

    def admit_transfers(self, de: Engine, now):
        """Start transfers while de has a free sequence slot and blocks for the prompt plus one token."""
        while de.pending:
            dseq, pe, holder = de.pending[0]
            n = dseq.num_prompt_tokens
            if (len(de.sched.running) + de.incoming >= self.args.max_num_seqs
                    or not de.blocks.can_allocate(dseq, n + 1, reserve=de.sched.watermark_blocks)):
                return
            de.pending.popleft()
            de.blocks.allocate_slots(dseq, n)              # the prompt's KV lands here
            de.incoming += 1
            nbytes = n * self.kv_bytes_per_token
            start = max(now, pe.link_free, de.link_free)
            end = start + nbytes / (self.link.bandwidth * self.tp) + self.link.latency_s   # tp GPUs send their shards
            pe.link_free = de.link_free = end
            t = self.transfers
            t["count"], t["bytes"], t["link_s"], t["wait_s"] = (t["count"] + 1, t["bytes"] + nbytes,
                                                              t["link_s"] + end - start, t["wait_s"] + start - now)
            self.push(end, "received", de, dseq, pe, holder)

    def received(self, now, de: Engine, dseq, pe: Engine, holder):
        pe.blocks.free(holder)
        self.kick(pe, now)
        de.incoming -= 1
        dseq.num_computed_tokens = dseq.num_prompt_tokens
        join_running(de.sched, dseq)
        self.kick(de, now)

    def engines(self) -> list[Engine]:
        return [*self.entry.values(), *self.decoders.values()]


# ------------------------------------------------------------------ one run and its report
def num_gpus(args) -> int:
    engines = sum(args.disaggregation) if args.disaggregation else args.data_parallel_size
    return engines * args.tensor_parallel_size


def simulate_cluster(args) -> dict:
    reqs = sim.make_requests(args)
    cluster = Cluster(args)
    for e in cluster.engines():
        sim.check_fits(reqs, e.blocks, e.sched)
    started, started_cpu = time.perf_counter(), time.process_time()
    wall = cluster.run(reqs)
    for e in cluster.engines():
        assert e.blocks.num_free_blocks() == e.blocks.num_blocks, f"{e.name} leaked KV blocks"
    return cluster_report(args, cluster, reqs, wall, time.perf_counter() - started, time.process_time() - started_cpu)


def request_latencies(reqs) -> list:
    """(TTFT, TPOT) per request; TPOT is nan for a single-token output."""
    return [(r.first_token_time - r.arrival_time,
             (r.finish_time - r.first_token_time) / (r.output_len - 1) if r.output_len > 1 else math.nan)
            for r in reqs]


def cluster_report(args, cluster: Cluster, reqs, wall, sim_s, sim_cpu_s) -> dict:
    out_tokens, in_tokens = sum(r.output_len for r in reqs), sum(r.input_len for r in reqs)
    lat = request_latencies(reqs)
    engines = cluster.engines()
    queries = sum(e.blocks.prefix_queries for e in engines)
    t = cluster.transfers
    return {
        "config": {k: (str(v) if v == math.inf else v) for k, v in vars(args).items() if k not in ("plot", "out")},
        "num_gpus": num_gpus(args),
        "output_tok_s": out_tokens / wall, "total_tok_s": (in_tokens + out_tokens) / wall,
        "requests_per_s": len(reqs) / wall,
        "ttft_s": sim.percentiles(a for a, _ in lat), "tpot_s": sim.percentiles(b for _, b in lat),
        "e2e_s": sim.percentiles(r.finish_time - r.arrival_time for r in reqs),
        "prefix_hit_rate": sum(e.blocks.prefix_hits for e in engines) / queries if queries else 0.0,
        "engines": {e.name: {"role": e.role, "steps": e.steps, "busy": e.busy_s / wall, "decode_rows": e.decode_rows,
                             "preemptions": e.sched.num_preemptions, "prefix_hit_rate": e.blocks.hit_rate()}
                    for e in engines},
        "routing": {f"{policy}/{reason}/{w}": n for (policy, reason, w), n in sorted(cluster.router.decision_counts().items())},
        "kv_transfer": {"count": t["count"], "gb": t["bytes"] / 1e9, "link": cluster.link.name,
                        "mean_ms": 1e3 * t["link_s"] / max(t["count"], 1), "mean_wait_ms": 1e3 * t["wait_s"] / max(t["count"], 1)},
        "num_steps": sum(e.steps for e in engines), "num_preemptions": sum(e.sched.num_preemptions for e in engines),
        "wall_s": wall, "sim_s": sim_s, "sim_cpu_s": sim_cpu_s, "latencies": lat, "timeline": [],
    }


def print_table(res: dict):
    c = res["config"]
    shape = (f"disaggregated {c['disaggregation'][0]}:{c['disaggregation'][1]} over {res['kv_transfer']['link']}"
             if c["disaggregation"] else f"data parallel x{c['data_parallel_size']}, {c['routing']}")
    print(f"| {c['model']} on {res['num_gpus']} x {c['gpu']}, {c['workload']}, {shape}, rate {c['request_rate']} | |")
    print("|---|---|")
    for name, value in [("output tok/s", f"{res['output_tok_s']:.0f}"), ("requests/s", f"{res['requests_per_s']:.2f}"),
                        ("TTFT p50/p90/p99 s", "/".join(f"{v:.3f}" for v in res["ttft_s"].values())),
                        ("TPOT p50/p90/p99 ms", "/".join(f"{1e3 * v:.1f}" for v in res["tpot_s"].values())),
                        ("prefix hit rate", f"{res['prefix_hit_rate']:.1%}"),
                        ("preemptions", res["num_preemptions"]), ("steps", res["num_steps"])]:
        print(f"| {name} | {value} |")
    for name, e in res["engines"].items():
        print(f"| {name} ({e['role']}) | {e['steps']} steps, busy {e['busy']:.0%}, hit rate {e['prefix_hit_rate']:.1%} |")
    for key, n in res["routing"].items():
        print(f"| routed {key} | {n} |")
    if c["disaggregation"]:
        t = res["kv_transfer"]
        print(f"| KV transfers | {t['count']}, {t['gb']:.2f} GB, {t['mean_ms']:.2f} ms each on the link, "
              f"{t['mean_wait_ms']:.2f} ms waiting for it |")
    print(f"| simulated s / real s (CPU s) | {res['wall_s']:.1f} / {res['sim_s']:.1f} ({res['sim_cpu_s']:.1f}) |")


# ------------------------------------------------------------------ DistServe's question: goodput per GPU
SWEEP_WORKLOADS = {   # simulate.py workload: (TTFT SLO s, TPOT SLO s, per-GPU request rates)
    "long-prompt": (1.0, 0.035, (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4)),
    "short-prompt": (0.25, 0.035, (1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32)),
}
SWEEP_SYSTEMS = {     # name: the flags that make it (colocated: a step's token budget, as max_num_batched_tokens)
    "colocated, budget 8192": ["--data-parallel-size", "2"],
    "colocated, budget 512": ["--data-parallel-size", "2", "--max-num-batched-tokens", "512"],
    "disaggregated 1:1": ["--disaggregation", "1:1"],
    "disaggregated 2:1": ["--disaggregation", "2:1"],
    "disaggregated 1:2": ["--disaggregation", "1:2"],
    "disaggregated 1:1, InfiniBand": ["--disaggregation", "1:1", "--kv-link", "infiniband"],
    "disaggregated 1:1, 25 GbE": ["--disaggregation", "1:1", "--kv-link", "ethernet-25g"],
}
SLO_SCALES = (0.75, 1, 1.5, 2, 3)


def attainment(latencies, ttft_slo, tpot_slo) -> float:
    """Share of requests that meet both SLOs (a single-token output has no TPOT to miss)."""
    ok = sum(1 for ttft, tpot in latencies if ttft <= ttft_slo and not tpot > tpot_slo)
    return ok / len(latencies)


def goodput(rates, attained, target) -> float:
    """The per-GPU rate where attainment first falls below target, linear between the grid's rates:
    0 when the lowest rate already misses, the highest rate when none does."""
    prev_r, prev_a = 0.0, 1.0
    for r, a in zip(rates, attained):
        if a < target:
            return prev_r + (r - prev_r) * (prev_a - target) / (prev_a - a) if prev_r else 0.0
        prev_r, prev_a = r, a
    return rates[-1]


def disagg_sweep(a) -> dict:
    """Every system at each workload's per-GPU rates, lowest first: the per-request latencies, kept once
    and judged against every SLO scale afterwards. A system stops once even the loosest SLO scale misses
    the target: every goodput has been crossed by then, so higher rates could change none."""
    runs = {}
    for wl, (ttft, tpot, rates) in SWEEP_WORKLOADS.items():
        for system, flags in SWEEP_SYSTEMS.items():
            base = sim.parse_run(["--gpu", a.gpu, "--model", a.model, "--workload", wl, "--max-model-len", "8192",
                                  "--num-requests", str(a.num_requests), "--seed", str(a.seed),
                                  "--host-overhead", a.host_overhead, *flags])
            out = []
            for rate in rates:
                args = argparse.Namespace(**vars(base))
                args.request_rate = rate * num_gpus(args)
                args.num_requests = max(a.num_requests, math.ceil(args.request_rate * a.min_seconds))   # steady state
                res = simulate_cluster(args)
                out.append({"rate_per_gpu": rate, "num_gpus": res["num_gpus"], "latencies": res["latencies"],
                            "preemptions": res["num_preemptions"], "kv_transfer_ms": res["kv_transfer"]["mean_ms"],
                            "e2e_p50_s": res["e2e_s"]["p50"], "arrival_span_s": res["wall_s"]})
                if attainment(res["latencies"], SLO_SCALES[-1] * ttft, SLO_SCALES[-1] * tpot) < a.target:
                    break
            runs[(wl, system)] = out
    return runs


def summarize(runs, target) -> dict:
    """goodput per GPU for every (workload, system, SLO scale)."""
    table = {}
    for (wl, system), out in runs.items():
        ttft, tpot, rates = SWEEP_WORKLOADS[wl]
        for scale in SLO_SCALES:
            att = [attainment(o["latencies"], scale * ttft, scale * tpot) for o in out]
            table[(wl, system, scale)] = goodput(rates[:len(att)], att, target)
    return table


def write_docs(a, runs, table, directory, seconds):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(directory, exist_ok=True)
    fig, axes = plt.subplots(2, len(SWEEP_WORKLOADS), figsize=(12, 8))
    for col, (wl, (ttft, tpot, rates)) in enumerate(SWEEP_WORKLOADS.items()):
        top, bottom = axes[0][col], axes[1][col]
        for system in SWEEP_SYSTEMS:
            style = "o-" if system.startswith("disagg") else "s--"
            out = runs[(wl, system)]
            top.plot(rates[:len(out)], [100 * attainment(o["latencies"], ttft, tpot) for o in out], style, label=system)
            bottom.plot(SLO_SCALES, [table[(wl, system, s)] for s in SLO_SCALES], style, label=system)
        top.axhline(100 * a.target, color="grey", lw=0.8)
        top.set(title=f"{wl}: TTFT <= {ttft} s, TPOT <= {1e3 * tpot:.0f} ms",
                xlabel="request rate per GPU (req/s)", ylabel="requests meeting both SLOs (%)", ylim=(0, 102))
        bottom.set(title=f"{wl}: goodput per GPU against the SLO scale", xlabel="SLO scale (x both SLOs)",
                   ylabel=f"goodput per GPU (req/s at {a.target:.0%})")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{MODELS[a.model].name} on {GPUS[a.gpu].name}: disaggregated against colocated", fontsize=11)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "disaggregation.png"), dpi=110)
    plt.close(fig)
    with open(os.path.join(directory, "disaggregation.md"), "w") as f:
        f.write(docs_text(a, runs, table, seconds))


def docs_text(a, runs, table, seconds) -> str:
    model, gpu = MODELS[a.model], GPUS[a.gpu]
    lines = [
        "# Disaggregated prefill/decode against colocated: goodput per GPU (simulated)", "",
        f"`python -m sim disagg-sweep --out docs/` wrote this page, the plot and disaggregation.json "
        f"({seconds:.0f} s on this machine). Every engine is nanoserve's real scheduler and block manager, timed "
        f"by cost_model.py: {model.name} on {gpu.name}, one GPU per engine, host overhead `{a.host_overhead}`, "
        f"Poisson arrivals, seed {a.seed}, max({a.num_requests}, {a.min_seconds:g} s x the rate) requests per point (so the "
        "highest rates reach a steady state). Colocated = data parallel x2 "
        "(least loaded) with the scheduler's mixed prefill+decode steps; disaggregated P:D = P prefill GPUs and "
        "D decode GPUs, each request's KV moved after its prefill (NVLink unless named). Goodput per GPU = the "
        f"highest request rate per GPU at which {a.target:.0%} of requests meet both SLOs (linear between the "
        "rates tried), DistServe's measure. TTFT ends at the prefill engine's first token; TPOT includes the "
        "transfer and any wait for decode blocks.", "",
    ]
    for wl, (ttft, tpot, rates) in SWEEP_WORKLOADS.items():
        base_coloc = max(table[(wl, s, 1)] for s in SWEEP_SYSTEMS if s.startswith("colocated"))
        lines += [f"## {wl}: mean {sim.WORKLOADS[wl][0]:g} prompt / {sim.WORKLOADS[wl][1]:g} output tokens, "
                  f"log-normal (sigma {sim.LENGTH_SIGMA[wl]})", "",
                  f"SLO scale 1: TTFT <= {ttft} s, TPOT <= {1e3 * tpot:.0f} ms. Goodput per GPU (req/s); "
                  "the last column is scale 1 against the better colocated row.", "",
                  "| system | GPUs | " + " | ".join(f"SLO x{s:g}" for s in SLO_SCALES) + " | at x1 vs colocated | KV transfer ms |",
                  "|---|---|" + "---|" * len(SLO_SCALES) + "---|---|"]
        kv_gb = sim.WORKLOADS[wl][0] * model.kv_bytes_per_token / 1e9
        for system in SWEEP_SYSTEMS:
            out = runs[(wl, system)]
            cells = []
            for s in SLO_SCALES:
                best = max(table[(wl, x, s)] for x in SWEEP_SYSTEMS)
                v = table[(wl, system, s)]
                text = (">= " if v == rates[-1] else "") + f"{v:.2f}"     # never missed within the rates tried
                cells.append(f"**{text}**" if v == best and v > 0 else text)
            ratio = table[(wl, system, 1)] / base_coloc if base_coloc else math.nan
            lines.append(f"| {system} | {out[0]['num_gpus']} | " + " | ".join(cells) +
                         f" | {ratio:.2f}x | {out[0]['kv_transfer_ms']:.1f} |")
        lines += ["", f"The KV of a mean prompt is {kv_gb:.2f} GB: " + ", ".join(
            f"{resolve_link(k, gpu).name} {1e3 * (kv_gb * 1e9 / resolve_link(k, gpu).bandwidth):.0f} ms"
            for k in ("nvlink", "pcie", "infiniband", "ethernet-25g")) + " on the link.", ""]
        for s in SLO_SCALES:
            coloc = max(table[(wl, x, s)] for x in SWEEP_SYSTEMS if x.startswith("colocated"))
            name, dis = max(((x, table[(wl, x, s)]) for x in SWEEP_SYSTEMS if x.startswith("disagg")), key=lambda t: t[1])
            if min(dis, coloc) == rates[-1]:
                lines.append(f"- SLO x{s:g}: not resolved: both meet it at every rate tried (up to {rates[-1]:g} per GPU)")
                continue
            verdict = ("wins" if dis > 1.05 * coloc else "loses" if dis < 0.95 * coloc else "ties")
            lines.append(f"- SLO x{s:g}: disaggregation {verdict}: best disaggregated ({name}) {dis:.2f} against best "
                         f"colocated {coloc:.2f} req/s per GPU ({dis / coloc if coloc else math.inf:.2f}x)")
        lines.append("")
    lines += ["![goodput](disaggregation.png)", "",
              "What the model leaves out: the KV transfer overlaps compute fully and costs the engines nothing; "
              "decode engines run without a prefix cache; one GPU per engine (no tensor parallelism); the colocated "
              "baseline is nanoserve's own scheduler, which already mixes decodes into prefill steps (chunked when "
              "a prompt exceeds the step's token budget), a stronger baseline than DistServe's vLLM of 2024.", ""]
    return "\n".join(lines)


def disagg_sweep_main(argv):
    import json
    p = argparse.ArgumentParser(prog="python -m sim disagg-sweep",
                                description="DistServe's comparison: goodput per GPU, disaggregated against colocated.")
    p.add_argument("--gpu", choices=GPUS, default="a100-80gb")
    p.add_argument("--model", choices=MODELS, default="llama-2-13b")
    p.add_argument("--host-overhead", default="vllm")
    p.add_argument("--num-requests", type=int, default=300, help="requests per point, at least")
    p.add_argument("--min-seconds", type=float, default=60,
                   help="... and at least this many seconds of arrivals, so high rates reach a steady state")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.9, help="share of requests that must meet both SLOs")
    p.add_argument("--out", default="docs", help="directory for disaggregation.md, .png and .json")
    a = p.parse_args(argv)
    if a.num_requests < 10 or a.min_seconds < 0 or not 0 < a.target <= 1:
        p.error("--num-requests must be >= 10, --min-seconds >= 0, --target in (0, 1]")
    started = time.perf_counter()
    runs = disagg_sweep(a)
    table = summarize(runs, a.target)
    seconds = time.perf_counter() - started
    write_docs(a, runs, table, a.out, seconds)
    with open(os.path.join(a.out, "disaggregation.json"), "w") as f:
        json.dump({"config": vars(a), "slo": {wl: {"ttft_s": ttft, "tpot_s": tpot, "rates_per_gpu": rates}
                           for wl, (ttft, tpot, rates) in SWEEP_WORKLOADS.items()},
                   "goodput_per_gpu": [{"workload": wl, "system": s, "slo_scale": k, "req_s": v}
                                       for (wl, s, k), v in table.items()],
                   "points": [{"workload": wl, "system": s, **{k: v for k, v in o.items() if k != "latencies"}}
                              for (wl, s), out in runs.items() for o in out]}, f, indent=1)
    print(docs_text(a, runs, table, seconds))
