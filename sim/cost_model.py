"""
cost_model.py: what one engine's step costs on GPUs that nanoserve cannot reach from here.

Owns the hardware tables (GPUs and their links), the Llama model configs, the constants fitted to
published measurements, and the cost of one step: the HBM and FLOP roofline, the ring all-reduces of
tensor parallelism, and the host's overhead per step and per launch, eager or replayed as a CUDA
graph (fitted to the one H100 run, or to a bench.py results JSON of another). Also the TP scaling
table: where adding GPUs to one engine stops paying. Pure arithmetic: no scheduler, no engine, no
torch. simulate.py and simulate_cluster.py time every simulated step with step_time.

  python -m sim roofline --gpu h100-sxm --model llama-3-8b --batch 64 --context 1024
  python -m sim tp-sweep
"""
import json
import statistics
from dataclasses import dataclass


# ------------------------------------------------------------------ hardware and models
@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float          # dense bf16 FLOP/s
    hbm_bandwidth: float       # bytes/s
    memory: float              # bytes
    pcie_bandwidth: float      # bytes/s host <-> device, what swap preemption pays
    nvlink: str = "nvlink4"    # the LINKS entry each link family means on this GPU
    pcie: str = "pcie5"
    infiniband: str = "ib-ndr"


GPUS = {   # vendor datasheets; PCIe: Gen4 x16 on A100, Gen5 x16 on H100/H200 (about 80% of the link)
    "a100-80gb": GPU("A100-80GB", 312e12, 2.0e12, 80e9, 25e9, "nvlink3", "pcie4", "ib-hdr"),
    "h100-sxm": GPU("H100 SXM", 989e12, 3.35e12, 80e9, 50e9),
    "h200": GPU("H200", 989e12, 4.8e12, 141e9, 50e9),
}


@dataclass(frozen=True)
class Link:
    """A GPU's link to its peers: what one GPU sends per second (one direction, what NCCL reaches,
    not the line rate) and the latency of one hop (one step of a ring, or one message)."""
    name: str
    bandwidth: float           # bytes/s
    latency_s: float


LINKS = {
    # nccl-tests issue #149/#178: ring all-reduce bus bandwidth ~200-210 GB/s on 8 x A100-SXM (600 GB/s line, both ways)
    "nvlink3": Link("NVLink 3 (A100)", 200e9, 2e-6),
    # nccl-tests issue #212 (NCCL's maintainer): 450 GB/s line, ~370 GB/s effective for a ring on H100
    "nvlink4": Link("NVLink 4 (H100)", 370e9, 2e-6),
    "pcie4": Link("PCIe Gen4 x16", 25e9, 5e-6),          # 32 GB/s line, ~80%, as GPU.pcie_bandwidth
    "pcie5": Link("PCIe Gen5 x16", 50e9, 5e-6),
    "ib-hdr": Link("InfiniBand HDR 200 Gb/s", 21e9, 5e-6),   # one NIC per GPU, ~85% of 25 GB/s
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s", 42e9, 5e-6),   # ~85% of 50 GB/s
    "ethernet-25g": Link("Ethernet 25 Gb/s (TCP)", 2.5e9, 50e-6),   # no RDMA: a slow KV path, ~80% of 3.1 GB/s
    # Per-hop latencies are assumptions: with 2(N-1) hops they give 8-GPU small all-reduces of ~30 us
    # on NVLink, the order nccl-tests prints for a ring; no measurement of ours backs them.
}


def resolve_link(name: str, gpu: GPU) -> Link:
    """A LINKS key, or a family (nvlink | pcie | infiniband) that means this GPU's generation of it."""
    if name in ("nvlink", "pcie", "infiniband"):
        name = getattr(gpu, name)
    return LINKS[name]


LINK_CHOICES = ["nvlink", "pcie", "infiniband", *LINKS]


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


# ------------------------------------------------------------------ the host's overhead
@dataclass(frozen=True)
class HostOverhead:
    """What the host adds to a step. The serial part (schedule, build inputs, sample, update) runs while
    the GPU waits: per_step_s + per_seq_s per scheduled sequence. Launching the forward overlaps the
    GPU's work, so the step pays the longer of the two: in eager mode every op's launch
    (launches_per_layer per layer, plus 2 all-reduces per layer under tensor parallelism) at
    per_launch_s each; a decode-only step replayed as a CUDA graph pays graph_replay_s once."""
    per_step_s: float = 0.0
    per_seq_s: float = 0.0
    per_launch_s: float = 0.0
    launches_per_layer: float = 0.0
    graph_replay_s: float = 0.0

    def time(self, model: "ModelConfig", num_seqs: int, tp: int, graph: bool) -> tuple[float, float]:
        """(serial seconds, launch seconds) of one step."""
        launches = model.num_layers * (self.launches_per_layer + (2 if tp > 1 else 0))
        return self.per_step_s + self.per_seq_s * num_seqs, self.graph_replay_s if graph else launches * self.per_launch_s


# The one GPU run (README, "The GPU run (2026-11-24)"): SmolLM2-135M (30 layers) on an H100, eager, the
# roofline section's decode steps, in the shape bench.py --out writes (results["roofline"]["decode"]).
H100_RUN_2026_11_24 = {"roofline": {"num_layers": 30, "launches_per_step": 1430, "decode": {
    str(b): {"step_s_median": step / 1e3, "matmul_floor_s": mm / 1e3,
             "phases_s": {k: v / 1e3 for k, v in zip(("schedule", "prepare", "forward", "sample", "update"), ph)}}
    for b, step, mm, ph in [(1, 23.4, 2.46, (0.0342, 0.461, 22.8, 0.082, 0.0436)),
                            (8, 25.4, 2.61, (0.06, 0.52, 24.5, 0.102, 0.132)),
                            (32, 25.5, 2.46, (0.138, 0.606, 24.0, 0.151, 0.338)),
                            (64, 25.9, 2.53, (0.234, 0.7, 23.9, 0.207, 0.586))]}}}
# The CUDA-graph run (2026-11-27, SmolLM2-135M bf16 on an H100, bench.py roofline): the sampler's read
# is the first sync after the replay, so its "sample" phase is the wait for the device, counted as device time
# (step - the host phases). Host: 0.42 ms at batch 1, 1.31 ms at 64; device: 1.44 and 1.59 ms.
H100_GRAPHS_2026_11_27 = {b: dict(step_s=step / 1e3, host_s=(sch + prep + fwd + upd) / 1e3)
                          for b, step, sch, prep, fwd, upd in [(1, 1.86, 0.02, 0.36, 0.02, 0.02),
                                                                (64, 2.90, 0.23, 0.56, 0.02, 0.50)]}
# async scheduling (async_engine.py): what a step adds to max(host, device) when the host plans it while
# the device runs the last one (the event wait's wake-up, the copy and gather that feed the last step's
# tokens in). Fitted to the H100's graph run: its batch-64 step was 2.90 ms plain with 1.31 ms of host
# phases (so 1.59 ms of device), and 1.58 ms with async scheduling
# (results/2026-11-27-h100-xeon-amx-16c-e0914b8.md): max(host, device) alone, no constant above the noise.
OVERLAP_SYNC_S = 0.0
GRAPH_REPLAY_S = 20e-6    # assumed, not measured (no graph run exists yet): torch.cuda.CUDAGraph.replay()
                          # from Python, one launch of a captured graph plus the binding's overhead


def fit_host_overhead(results: dict) -> HostOverhead:
    """Fit HostOverhead to a bench.py results JSON of a GPU run. Reads results["roofline"]:
    decode.<batch>.phases_s.{schedule, prepare, sample, update} (the serial part: a least-squares line
    in the batch size gives per_step_s and per_seq_s), decode.<batch>.phases_s.forward and
    .matmul_floor_s (a host-bound forward is its launches: per_launch_s = median forward /
    launches_per_step), and, when present, launches_per_step (default 1430, the close read of one
    SmolLM2-135M decode step on the H100 run, docs/gpu-run.md), num_layers (default 30) and graph_replay_s (default: the
    host's time for one CUDA graph replay that bench.py's gpu section measured, results["gpu_decode"], when the
    run has one; else GRAPH_REPLAY_S)."""
    r = results["roofline"]
    runs = sorted((int(b), d) for b, d in r["decode"].items())
    xs = [b for b, _ in runs]
    ys = [sum(d["phases_s"][p] for p in ("schedule", "prepare", "sample", "update")) for _, d in runs]
    per_seq = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
    per_step = statistics.mean(ys) - per_seq * statistics.mean(xs)
    forward = statistics.median(d["phases_s"]["forward"] for _, d in runs)
    matmuls = statistics.median(d["matmul_floor_s"] for _, d in runs)
    if forward < 2 * matmuls:
        raise ValueError(f"the run's forward ({forward * 1e3:.2f} ms) is within 2x of its matmuls alone "
                         f"({matmuls * 1e3:.2f} ms): not host-bound, so no launch cost can be read from it")
    launches = r.get("launches_per_step", 1430)
    return HostOverhead(per_step_s=max(per_step, 0.0), per_seq_s=max(per_seq, 0.0), per_launch_s=forward / launches,
                        launches_per_layer=launches / r.get("num_layers", 30),
                        graph_replay_s=r.get("graph_replay_s", results.get("gpu_decode", {}).get("graph_replay_s", GRAPH_REPLAY_S)))


def fit_graph_run(run: dict) -> HostOverhead:
    """HostOverhead of a CUDA-graph run given as {batch: {step_s, host_s}}: host_s is a line in the batch;
    the replay's launch is the forward phase already inside host_s."""
    xs, ys = zip(*sorted((b, d["host_s"]) for b, d in run.items()))
    per_seq = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    return HostOverhead(per_step_s=ys[0] - per_seq * xs[0], per_seq_s=per_seq, graph_replay_s=0.0)


HOST_OVERHEADS = {
    "vllm": HostOverhead(per_step_s=STEP_OVERHEAD_S),           # the constant above; graphs or not, the same
    "nanoserve-h100-graphs": fit_graph_run(H100_GRAPHS_2026_11_27),   # ~0.41 ms + 14 us/seq; with graphs
    "nanoserve-h100": fit_host_overhead(H100_RUN_2026_11_24),  # ~0.6 ms + 18 us/seq; 16.7 us per launch
    "none": HostOverhead(),
}


def host_overhead(name_or_path: str) -> HostOverhead:
    """A HOST_OVERHEADS preset, or the fit to a bench.py results JSON at that path."""
    if name_or_path in HOST_OVERHEADS:
        return HOST_OVERHEADS[name_or_path]
    with open(name_or_path) as f:
        return fit_host_overhead(json.load(f))


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


def kv_shards(model: ModelConfig, tp: int) -> int:
    """Ways the KV cache splits under tensor parallelism: past the KV heads' count they are replicated."""
    return min(tp, model.num_kv_heads)


def check_tensor_parallel(model: ModelConfig, tp: int):
    """vLLM's rule: query heads divide by tp; KV heads divide by tp, or tp by them (then replicated)."""
    if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
        ok = [n for n in range(1, model.num_heads + 1) if not model.num_heads % n
              and not (model.num_kv_heads % n and n % model.num_kv_heads)]
        raise ValueError(f"--tensor-parallel-size {tp} does not split {model.name}'s {model.num_heads} query / "
                         f"{model.num_kv_heads} KV heads; sizes that do: {ok}")


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of nbytes over n GPUs: reduce-scatter then all-gather, 2(n-1) steps, each
    sending nbytes / n over the link and paying one hop's latency."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency_s


def tp_comm_time(model: ModelConfig, num_tokens: int, tp: int, link: Link) -> float:
    """Megatron-style tensor parallelism: two all-reduces per layer (after o_proj and after down), each
    of the [tokens, hidden] activations. The vocabulary-parallel embedding and lm_head are left out."""
    return 2 * model.num_layers * all_reduce_time(model.hidden_size * num_tokens * model.dtype_bytes, tp, link)


def step_time(gpu: GPU, model: ModelConfig, rows, tp: int = 1, ideal: bool = False, *,
              host: HostOverhead = HOST_OVERHEADS["vllm"], graphs: bool = False, link: Link | None = None,
              overlap: bool = False) -> float:
    """Seconds for one step on tp GPUs. GPU time: the slower of memory and compute at the fitted
    efficiencies (weights split tp ways, KV kv_shards ways, FLOPs tp ways) plus the all-reduces over
    link (default: the GPU's NVLink). Then the host: its serial part, and the longer of the GPU time
    and the launches (one graph replay when graphs and the step is decode-only). ideal=True is the
    bare roofline: efficiency 1, no host, no communication. overlap=True (async scheduling): the host's
    whole part runs while the device runs the step before, so a step is the longer of the two plus
    OVERLAP_SYNC_S."""
    bytes_moved, flops = step_cost(model, rows)
    gpu_bytes = model.weight_bytes / tp + (bytes_moved - model.weight_bytes) / kv_shards(model, tp)
    if ideal:
        return max(gpu_bytes / gpu.hbm_bandwidth, flops / (tp * gpu.peak_flops))
    gpu_s = max(gpu_bytes / (gpu.hbm_bandwidth * MEM_EFFICIENCY), flops / (tp * gpu.peak_flops * FLOP_EFFICIENCY))
    gpu_s += tp_comm_time(model, sum(n for n, _ in rows), tp, link or resolve_link("nvlink", gpu))
    serial, launch = host.time(model, len(rows), tp, graph=graphs and all(n == 1 for n, _ in rows))
    if overlap:
        return max(serial + launch, gpu_s) + OVERLAP_SYNC_S
    return serial + max(gpu_s, launch)


def kv_pool_bytes(gpu: GPU, model: ModelConfig, gpu_memory_utilization: float, tp: int = 1) -> float:
    """What the KV cache gets on tp GPUs together: the usable share of memory (vLLM's
    gpu_memory_utilization; the rest is the activation, CUDA-graph and context reserve) minus the
    weights. Past the KV heads' count a token's KV is replicated: see kv_pool_tokens."""
    return tp * gpu.memory * gpu_memory_utilization - model.weight_bytes


def kv_pool_tokens(gpu: GPU, model: ModelConfig, gpu_memory_utilization: float, tp: int = 1) -> int:
    return int(kv_pool_bytes(gpu, model, gpu_memory_utilization, tp) * kv_shards(model, tp) / tp
               // model.kv_bytes_per_token)


NVME_BANDWIDTH = 7e9      # bytes/s, one PCIe Gen4 x4 NVMe drive reading sequentially (datasheets: 6.5-7.4 GB/s)


def restore_vs_recompute(gpu: GPU, model: ModelConfig, context: int, tier_bandwidth: float,
                         new_tokens: int = 16) -> dict:
    """The prefix cache's tiers (kv_offload.py) at GPU scale: a request whose first `context` tokens'
    KV sits in a tier read at tier_bandwidth (the GPU's PCIe for host memory, NVME_BANDWIDTH for a
    drive) either brings it back, then computes its new tokens, or computes everything again. The
    restore is not overlapped with compute here: an upper bound on its cost."""
    kv_bytes = context * model.kv_bytes_per_token
    restore_s = kv_bytes / tier_bandwidth + step_time(gpu, model, [(new_tokens, context)])
    recompute_s = step_time(gpu, model, [(context + new_tokens, 0)])
    return {"kv_bytes": kv_bytes, "restore_s": restore_s, "recompute_s": recompute_s,
            "speedup": recompute_s / restore_s}


def tiers_main(argv):
    """`python -m sim tiers`: per context, recompute a prefix or restore its KV from host memory (over the
    GPU's PCIe) or from a drive; the bandwidths are flags, so a fork can ask about its own machine."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m sim tiers", description="When restoring a prefix beats recompute.")
    p.add_argument("--gpu", default="h100-sxm", choices=list(GPUS))
    p.add_argument("--model", default="llama-3-8b", choices=list(MODELS))
    p.add_argument("--contexts", default="16,256,1024,4096,16384", help="cached prefix lengths, comma-separated")
    p.add_argument("--host-bandwidth", type=float, default=None, help="bytes/s host -> GPU (default: the GPU's PCIe)")
    p.add_argument("--disk-bandwidth", type=float, default=NVME_BANDWIDTH, help="bytes/s drive -> GPU")
    a = p.parse_args(argv)
    gpu, model = GPUS[a.gpu], MODELS[a.model]
    host = a.host_bandwidth or gpu.pcie_bandwidth
    if host <= 0 or a.disk_bandwidth <= 0:
        p.error("--host-bandwidth and --disk-bandwidth must be > 0")
    print(f"{model.name} on {gpu.name}: host tier at {host / 1e9:.1f} GB/s, disk tier at {a.disk_bandwidth / 1e9:.1f} GB/s\n")
    print("| context | KV MB | recompute ms | host restore ms | speedup | disk restore ms | speedup |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for context in (int(x) for x in a.contexts.split(",")):
        h, d = restore_vs_recompute(gpu, model, context, host), restore_vs_recompute(gpu, model, context, a.disk_bandwidth)
        rows.append({"context": context, "host": h, "disk": d})
        print(f"| {context} | {h['kv_bytes'] / 1e6:.1f} | {1e3 * h['recompute_s']:.2f} | {1e3 * h['restore_s']:.2f} | "
              f"{h['speedup']:.2f}x | {1e3 * d['restore_s']:.2f} | {d['speedup']:.2f}x |")
    return rows


def roofline(gpu: GPU, model: ModelConfig, batch: int, context: int, tp: int = 1, **timing) -> dict:
    """A full decode batch: batch rows of one new token after `context` cached tokens each.
    timing: step_time's host, graphs and link."""
    rows = [(1, context)] * batch
    bytes_moved, flops = step_cost(model, rows)
    out = {"gpu": gpu.name, "model": model.name, "batch": batch, "context": context, "tensor_parallel_size": tp,
           "weight_gb": model.weight_bytes / 1e9, "kv_read_gb": (bytes_moved - model.weight_bytes) / 1e9,
           "gflop": flops / 1e9,
           "bound": "memory" if bytes_moved / gpu.hbm_bandwidth >= flops / gpu.peak_flops else "compute",
           "all_reduce_ms": 1e3 * tp_comm_time(model, batch, tp, timing.get("link") or resolve_link("nvlink", gpu))}
    timing.pop("overlap", None)
    for kind, extra in (("ideal", dict(ideal=True)), ("modelled", {}), ("modelled_async_scheduling", dict(overlap=True))):
        t = step_time(gpu, model, rows, tp, **extra, **timing)
        out[kind] = {"step_ms": t * 1e3, "steps_per_s": 1 / t, "tok_s": batch / t}
    return out


# ------------------------------------------------------------------ where tensor parallelism stops paying
def tp_scaling(gpu: GPU, model: ModelConfig, link: Link, sizes=(1, 2, 4, 8), context: int = 1024,
               prompt_len: int = 2048, max_num_seqs: int = 256, gpu_memory_utilization: float = 0.9, **timing) -> list:
    """One engine on n GPUs for each n: a batch-1 decode step (latency), a decode step at the largest
    batch whose KV (context tokens each) fits the pool, capped at max_num_seqs (throughput), and one
    prompt_len-token prefill. timing: step_time's host and graphs."""
    out = []
    for n in sizes:
        row = {"tp": n, "fits": False}
        out.append(row)
        try:
            check_tensor_parallel(model, n)
        except ValueError:
            continue
        pool = kv_pool_tokens(gpu, model, gpu_memory_utilization, n)
        if pool < context + 1:
            continue
        batch = min(max_num_seqs, pool // (context + 1))
        t1 = step_time(gpu, model, [(1, context)], n, link=link, **timing)
        tb = step_time(gpu, model, [(1, context)] * batch, n, link=link, **timing)
        row |= {"fits": True, "batch1_ms": 1e3 * t1, "all_reduce_share": tp_comm_time(model, 1, n, link) / t1,
                "max_batch": batch, "step_ms": 1e3 * tb, "tok_s": batch / tb, "tok_s_per_gpu": batch / tb / n,
                "prefill_ms": 1e3 * step_time(gpu, model, [(prompt_len, 0)], n, link=link, **timing)}
    return out


def where_tp_stops(rows: list, min_gain: float) -> dict:
    """latency_n: the last n reached while every doubling cut the batch-1 step by min_gain or more;
    throughput_n: the n with the most output tokens/s per GPU."""
    fit = [r for r in rows if r["fits"]]
    if not fit:
        return {"latency_n": None, "throughput_n": None}
    latency_n = fit[0]["tp"]
    for prev, cur in zip(fit, fit[1:]):
        if prev["batch1_ms"] / cur["batch1_ms"] < min_gain:
            break
        latency_n = cur["tp"]
    return {"latency_n": latency_n, "throughput_n": max(fit, key=lambda r: r["tok_s_per_gpu"])["tp"]}


def tp_sweep_main(argv):
    import argparse
    p = argparse.ArgumentParser(prog="python -m sim tp-sweep", description="Where tensor parallelism stops paying.")
    p.add_argument("--models", default="llama-3-8b,llama-3-70b")
    p.add_argument("--gpus", default="a100-80gb,h100-sxm")
    p.add_argument("--links", default="nvlink,pcie", help="comma-separated LINKS keys or families")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per decoding sequence")
    p.add_argument("--prompt-len", type=int, default=2048, help="the prefill column's prompt")
    p.add_argument("--host-overhead", default="vllm", help=f"{list(HOST_OVERHEADS)} or a results JSON")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--min-gain", type=float, default=1.2, help="a doubling of GPUs must cut the batch-1 step this much")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    pick = lambda s, table, flag: [x if x in table else p.error(f"{flag}: {x!r} is not one of {list(table)}")
                                   for x in s.split(",")]
    models, gpus = pick(a.models, MODELS, "--models"), pick(a.gpus, GPUS, "--gpus")
    links = pick(a.links, {k: 0 for k in ("nvlink", "pcie", "infiniband", *LINKS)}, "--links")
    sizes = [int(x) for x in a.sizes.split(",")]
    if min(sizes) < 1 or a.context < 0 or a.prompt_len < 1 or a.min_gain <= 1:
        p.error("--sizes must be >= 1, --context >= 0, --prompt-len >= 1, --min-gain > 1")
    timing = {"host": host_overhead(a.host_overhead), "graphs": not a.enforce_eager}
    results = []
    print(f"Decode after {a.context} cached tokens and one {a.prompt_len}-token prefill; host overhead "
          f"{a.host_overhead}, {'eager' if a.enforce_eager else 'CUDA graphs for decode'}; max batch = what the KV "
          f"pool holds (<= 256).\n")
    for m in models:
        for g in gpus:
            for l in links:
                gpu, link = GPUS[g], resolve_link(l, GPUS[g])
                rows = tp_scaling(gpu, MODELS[m], link, sizes, a.context, a.prompt_len, **timing)
                stop = where_tp_stops(rows, a.min_gain)
                results.append({"model": m, "gpu": g, "link": link.name, "rows": rows, **stop})
                print_tp_table(MODELS[m], gpu, link, rows, stop, a.min_gain)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)


def print_tp_table(model, gpu, link, rows, stop, min_gain):
    print(f"#### {model.name} on {gpu.name}, {link.name}\n")
    print("| tp | batch-1 step ms | speedup | all-reduce share | max batch | step ms | tok/s | tok/s per GPU | prefill ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = next((r for r in rows if r["fits"]), None)
    for r in rows:
        if not r["fits"]:
            print(f"| {r['tp']} | does not fit (or heads do not split) | | | | | | | |")
            continue
        print(f"| {r['tp']} | {r['batch1_ms']:.2f} | {base['batch1_ms'] / r['batch1_ms']:.2f}x | "
              f"{r['all_reduce_share']:.0%} | {r['max_batch']} | {r['step_ms']:.1f} | {r['tok_s']:,.0f} | "
              f"{r['tok_s_per_gpu']:,.0f} | {r['prefill_ms']:.0f} |")
    print(f"\nlatency pays up to tp={stop['latency_n']} (each doubling >= {min_gain}x faster at batch 1); "
          f"output tok/s per GPU peaks at tp={stop['throughput_n']}\n")
