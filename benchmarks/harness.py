"""
benchmarks/harness.py: the workloads and engine drivers every bench experiment shares (test_all.py uses them too).

Owns: seeded request workloads, building engines on one shared set of weights (Engine's `loaded_model`),
driving engines offline, step by step in turn, at timed arrivals, or in steady decode, and the small table
and statistics helpers the experiments print with. Timing comes from the engine's own hooks
(`engine.phase_times`, `engine.stats()`) and wall clocks around `engine.step()`: nothing here patches a
module. It never changes what the engine does and holds no experiment of its own (bench.py and the
other files of benchmarks/ do).
"""
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from kv_cache import zeros_on_huge_pages


# ----------------------------------------------------------------------------- printing and statistics

class LineProgress:
    """A progress bar for a log file: a plain line at most every `interval` seconds across all bars (a bar
    shorter than that prints nothing), and a last line at close for a bar that printed; no carriage returns."""
    last_print = 0.0                     # shared by every bar

    def __init__(self, total, desc, unit, interval=10.0, clock=time.perf_counter):
        self.total, self.desc, self.unit, self.interval, self.clock = total, desc, unit, interval, clock
        self.n, self.start, self.n_printed = 0, clock(), None

    def update(self, n=1):
        self.n += n
        if self.clock() - max(LineProgress.last_print, self.start) >= self.interval:
            self._print()

    def _print(self):
        now = self.clock()
        rate = self.n / max(now - self.start, 1e-9)
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}, {now - self.start:.0f} s, {rate:.1f} {self.unit}/s",
              file=sys.stderr, flush=True)
        LineProgress.last_print, self.n_printed = now, self.n

    def close(self):
        if self.n_printed is not None and self.n_printed != self.n:
            self._print()


def progress(total, desc, unit):
    """tqdm on a terminal; on a pipe or a log file, LineProgress (tqdm would write an update per step,
    each after a carriage return, thousands of them in a run)."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
    return LineProgress(total, desc, unit)


def md_table(headers, rows):
    """A markdown table; floats get 3 significant-ish digits so the README can paste it."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def section_header(title, notes=()):
    print(f"\n## {title}\n")
    for n in notes:
        print(f"- {n}")
    if notes:
        print()


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def bench_device() -> torch.device:
    """Where the engine's device "auto" runs, and so where the kernel and matmul measurements run."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync():
    """GPU work is asynchronous: wait for it before reading the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_fn(fn, repeats, warmup=1):
    """min and median seconds of fn() over repeats, after warm-up calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


# ----------------------------------------------------------------------------- workloads

@dataclass
class BenchRequest:
    prompt: list        # token ids
    max_tokens: int


def make_workload(n, seed, out_range, prompt_median, vocab_size, max_prompt=1024):
    """n seeded requests: log-normal prompt lengths (median prompt_median), output lengths uniform in out_range.

    Prompts are random ids in the vocabulary above the special tokens; with greedy decoding and
    ignore_eos the amount of work is fixed by the lengths alone, which is what every contender shares.
    """
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = int(min(max(rng.lognormvariate(math.log(prompt_median), 0.6), 8), max_prompt))
        reqs.append(BenchRequest([rng.randrange(256, vocab_size) for _ in range(plen)], rng.randint(*out_range)))
    return reqs


def random_prompt(rng, n, vocab):
    return [rng.randrange(256, vocab) for _ in range(n)]


def greedy(max_tokens):
    from engine import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


_ids = iter(range(10 ** 9))


def new_id(tag):
    return f"{tag}-{next(_ids)}"


def decode_kernel_inputs(batch, ctx, kv_dtype, heads=9, kv_heads=3, head_dim=64, block=16, seed=0):
    """A decode batch (one query row per sequence) over scattered blocks, SmolLM2's head shape, drawn on
    the CPU (the same numbers on any device). q comes in the KV's dtype, as a model of that dtype hands it
    over (the default engine never pairs float32 q with bf16 KV). K and V sit in memory like the engine's
    pool (on a CPU, kv_cache.zeros_on_huge_pages), so the kernel is timed on the pages it reads in the engine."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = (ctx + block - 1) // block
    num_blocks = batch * blocks_per_seq
    q = torch.randn(batch, heads, head_dim, generator=g).to(kv_dtype)                   # [batch, heads, head_dim]
    kv = [torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(kv_dtype) for _ in "kv"]
    if bench_device().type == "cpu":
        pool, _ = zeros_on_huge_pages((2, num_blocks, block, kv_heads, head_dim), kv_dtype)
        kv = [pool[i].copy_(t) for i, t in enumerate(kv)]                               # [blocks, block, kv_heads, hd]
    tables = torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq).to(torch.int32)   # scattered blocks
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    return [t.to(bench_device()) for t in (q, *kv, tables, lens, qsl)]


# ----------------------------------------------------------------------------- engines

ENGINE_OVERRIDES = {}   # bench.py's engine flags (--async-scheduling), under each section's own settings
_weights = {}   # make_engine's key -> (model, model_config, model_dir), loaded by the first engine


def make_engine(**overrides):
    """An Engine on the embedded model with every core, like every other contender.

    The first engine of a (model, dtype, device) loads the weights; later ones share them through
    Engine(loaded_model=...), since the model is read-only at inference: a section pays for its KV pool,
    not for a reload.
    """
    from engine import Engine, EngineConfig
    cfg = EngineConfig(num_threads=os.cpu_count(), **{**ENGINE_OVERRIDES, **overrides})
    # quantization="gguf" keeps other weights; and an engine that may take the automatic path (dtype
    # and quantization left to it: engine.auto_path) runs what the first one picked, so it shares only
    # with those: batch-invariant mode takes no automatic path, and runs the plain weights
    auto = cfg.dtype == "auto" and cfg.quantization is None and not cfg.batch_invariant
    key = (cfg.model, cfg.dtype, cfg.device, cfg.quantization, auto)
    engine = Engine(cfg, loaded_model=_weights.get(key))
    _weights.setdefault(key, (engine.model, engine.model_config, engine.model_dir))
    return engine


def vocab_of(engine):
    return int(engine.model_config.vocab_size)


def model_dtype(engine):
    return str(next(engine.model.parameters()).dtype).removeprefix("torch.")


def drain(engine, rids):
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():       # aborted requests leave on the next step if they must
        engine.step()


# ----------------------------------------------------------------------------- driving engines

def run_offline(engine, reqs, desc):
    """Submit every request at once and step until done. Returns timings plus per-step stats."""
    return run_interleaved([(engine, reqs)], desc)[0]


def run_interleaved(jobs, desc):
    """Run (engine, requests) jobs to completion, one step of each in turn, every job's requests submitted at
    once. A job's wall time is the sum of its own steps: taking turns step by step lets the noise of a shared
    machine hit every contender alike, instead of whichever happened to run during a slow minute."""
    states = []
    for engine, reqs in jobs:
        ids = {new_id("off"): r for r in reqs}
        for rid, r in ids.items():
            engine.add_request(rid, r.prompt, greedy(r.max_tokens))
        states.append({"engine": engine, "reqs": reqs, "ids": ids, "steps": [], "done": {}, "wall": 0.0,
                       "before": engine.stats()})
    bar = progress(sum(r.max_tokens for _, reqs in jobs for r in reqs), desc, "tok")
    while any(st["engine"].has_unfinished_requests() for st in states):
        for st in (st for st in states if st["engine"].has_unfinished_requests()):
            t0 = time.perf_counter()
            outs = st["engine"].step()
            st["wall"] += time.perf_counter() - t0
            st["steps"].append((outs, st["engine"].stats()))
            for o in outs:
                bar.update(len(o.outputs[0].delta_token_ids))
                if o.finished:
                    st["done"][o.request_id] = o
    bar.close()
    return [offline_result(st) for st in states]


def offline_result(st):
    useful = sum(len(o.outputs[0].token_ids) for o in st["done"].values())
    expected = sum(r.max_tokens for r in st["reqs"])
    if useful != expected:
        raise RuntimeError(f"engine produced {useful} output tokens, expected {expected} (ignore_eos, max_tokens)")
    prompt_tokens, wall, steps = sum(len(r.prompt) for r in st["reqs"]), st["wall"], st["steps"]
    return {"wall_s": wall, "useful_tokens": useful, "useful_tok_s": useful / wall,
            "total_tok_s": (useful + prompt_tokens) / wall, "num_steps": len(steps),
            "preemptions": steps[-1][1].num_preemptions if steps else 0, "steps": steps, "ids": st["ids"],
            "done": st["done"], **graph_use(st["before"], steps[-1][1] if steps else st["before"])}


def graph_use(before, after) -> dict:
    """Steps between two EngineStats that replayed a CUDA graph (by kind) and that ran eagerly (by
    reason): {"graph_steps": {...}, "eager_steps": {...}}."""
    def delta(a, b):
        return {k: n - a.get(k, 0) for k, n in b.items() if n - a.get(k, 0)}
    return {"graph_steps": delta(before.graph_steps, after.graph_steps),
            "eager_steps": delta(before.eager_steps, after.eager_steps)}


def describe_graph_use(run: dict) -> str:
    """'graph steps: N (decode a, mixed b); eager steps: M (reason m)': whether a GPU run replayed graphs."""
    def part(name, counts):
        inner = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
        return f"{name}: {sum(counts.values())}" + (f" ({inner})" if inner else "")
    return f"{part('graph steps', run['graph_steps'])}; {part('eager steps', run['eager_steps'])}"


def warm_up(engine, sz, n=4):
    """Exercise prefill and decode once so first-call costs don't land in a timed run (not in --quick,
    whose numbers only prove that every section runs)."""
    if sz.name != "quick":
        run_offline(engine, make_workload(n, 999, (4, 4), 48, vocab_of(engine)), "warm-up")


def steady_decode(engine, batch, steps, prompt_len):
    """Step time of `batch` sequences all in steady decode, and where it goes (engine.phase_times per step)."""
    rng = random.Random(batch)
    rids = [new_id("dec") for _ in range(batch)]
    for rid in rids:
        engine.add_request(rid, random_prompt(rng, prompt_len, vocab_of(engine)),
                           greedy(engine.max_model_len - prompt_len - 1))
    for _ in range(10_000):                      # prefill until every sequence decodes
        engine.step()
        s = engine.stats()
        if s.num_waiting == 0 and s.num_seqs_last_step == batch == s.num_batched_tokens_last_step:
            break
    before, times = asdict(engine.phase_times), []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    phases = {k: (v - before[k]) / steps for k, v in asdict(engine.phase_times).items()}
    drain(engine, rids)
    return {"step_s_median": statistics.median(times), "step_s_min": min(times), "phases_s": phases}


def run_arrivals(engine, reqs, offsets, clock, desc):
    """Add each request at its arrival time (stamped in the engine's clock), step while work exists."""
    order = sorted(range(len(reqs)), key=lambda i: offsets[i])
    done, nxt = {}, 0
    bar = progress(len(reqs), desc, "req")
    t0 = clock()
    while len(done) < len(reqs):
        now = clock()
        while nxt < len(order) and t0 + offsets[order[nxt]] <= now:
            i = order[nxt]
            engine.add_request(new_id("lat"), reqs[i].prompt, greedy(reqs[i].max_tokens), arrival_time=t0 + offsets[i])
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + offsets[order[nxt]] - clock()))
            continue
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
                bar.update(1)
    bar.close()
    return list(done.values()), clock() - t0


def run_timed(engine, prompts, params_list, desc):
    """Queue every prompt at once, step to completion; per-request outputs, the wall time, peak blocks used."""
    ids = [new_id(desc) for _ in prompts]
    for rid, p, sp in zip(ids, prompts, params_list):
        engine.add_request(rid, p, sp)
    done, peak_blocks = {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        s = engine.stats()
        peak_blocks = max(peak_blocks, s.num_blocks - s.num_free_blocks)
    wall = time.perf_counter() - t0
    engine.check_invariants()
    return [done[i] for i in ids], wall, peak_blocks


def latency_stats(outs):
    """p50/p90/p99 of TTFT, TPOT and e2e latency, plus every request's values (for the distribution plots)."""
    m = [o.metrics for o in outs]
    values = {"ttft": [x.ttft for x in m], "tpot": [x.tpot for x in m if x.num_generated_tokens > 1],
              "e2e": [x.e2e_latency for x in m]}
    st = {f"{name}_{q}": pct(v, int(q[1:])) for name, v in values.items() for q in ("p50", "p90", "p99")}
    return st | {f"{name}_values": sorted(v) for name, v in values.items()}
