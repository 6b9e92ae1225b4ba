"""
benchmarks/report.py: where a bench run's numbers go, and the README's one table made from them.

Owns naming a run (date, machine slug, commit), writing results/<date>-<machine>-<commit>.md (the
tables bench.py printed, exactly), .json (every figure) and PNG charts, finding the newest results
file, and rewriting the README's results table from it between two marker comments, so the table
cannot drift from a committed run. It measures nothing and never changes what the engine does.
"""
import glob
import io
import json
import math
import os
import platform
import re
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "results")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- results:begin (python bench.py --readme writes this table) -->", "<!-- results:end -->"

# The /proc/cpuinfo flags that decide which kernels run (SIMD width, bf16/int8 dot products, matrix tiles).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
             "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "sve2", "bf16", "i8mm")


# ----------------------------------------------------------------------------- naming a run

def cpu_info():
    """The first processor's fields of /proc/cpuinfo as a dict ({} where there is none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if info:
                        break
                    continue
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def isa_flags(info):
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return [f for f in ISA_FLAGS if f in flags]


def amd_core(family, model):
    """AMD's core generation from the CPU family and model numbers (AMD's published ranges)."""
    if family == 23:
        return "zen2" if model >= 0x30 else "zen"
    if family == 25:
        return "zen4" if 0x10 <= model <= 0x1f or 0x60 <= model <= 0x7f or 0xa0 <= model <= 0xaf else "zen3"
    if family == 26:
        return "zen5"
    return f"f{family}m{model}"


def cpu_slug(info):
    """'epyc-zen4', 'xeon-amx', 'aarch64': the vendor's line and what decides the kernels."""
    name, flags = info.get("model name", ""), set(isa_flags(info))
    if info.get("vendor_id") == "AuthenticAMD":
        line = next((w.lower() for w in ("EPYC", "Ryzen", "Threadripper") if w in name), "amd")
        return f"{line}-{amd_core(int(info.get('cpu family', 0)), int(info.get('model', 0)))}"
    if info.get("vendor_id") == "GenuineIntel":
        line = "xeon" if "Xeon" in name else "intel"
        isa = "amx" if "amx_bf16" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "x86"
        return f"{line}-{isa}"
    return platform.machine().lower() or "cpu"


def gpu_slug(gpu_name):
    """'NVIDIA H100 80GB HBM3' -> 'h100': the first word with a digit in it."""
    words = gpu_name.replace("NVIDIA", "").split()
    return next((w.split("-")[0].lower() for w in words if any(c.isdigit() for c in w)), "gpu")


def machine_slug(info, cores, gpu_name="none"):
    """A short name for the machine a run measured, e.g. 'epyc-zen4-2c' or 'h100-xeon-amx-16c'."""
    cpu = f"{cpu_slug(info)}-{cores}c"
    return cpu if gpu_name in ("", "none", None) else f"{gpu_slug(gpu_name)}-{cpu}"


def git_commit():
    """(short commit, whether tracked code differs from it); ('unknown', False) outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "--short=7", "HEAD")
        if head.returncode:
            return "unknown", False
        code = git("status", "--porcelain", "--untracked-files=no", "--", "*.py", "csrc", "requirements*.txt")
        return head.stdout.strip(), bool(code.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def run_header(gpu_name, dtype):
    """What every results file opens with: when, where, which code."""
    info = cpu_info()
    commit, dirty = git_commit()
    cores = os.cpu_count()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": machine_slug(info, cores, gpu_name), "cpu_model": info.get("model name", platform.processor()),
            "cpu_flags": isa_flags(info), "cores": cores, "gpu": gpu_name, "commit": commit, "dirty": dirty,
            "dtype": dtype}


# ----------------------------------------------------------------------------- writing a run

class Tee(io.TextIOBase):
    """stdout as it was, plus a copy of everything written, so the .md is what the run printed."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, s):
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()

    @property
    def encoding(self):
        return self.stream.encoding


def json_safe(x):
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(results, path):
    with open(path, "w") as f:
        json.dump(json_safe(results), f, indent=1, default=str)
        f.write("\n")


def run_stem(results):
    """<date>-<machine>-<commit>[-dirty][-quick|-full]: the name of a run's files."""
    stem = f"{results['date'][:10]}-{results['machine']}-{results['commit']}"
    stem += "-dirty" if results.get("dirty") else ""
    name = results.get("sizes", {}).get("name", "default")
    return stem + ("" if name == "default" else f"-{name}")


def write_run(results, printed, out_dir):
    """results/<stem>.md (what was printed), .json (every figure) and the charts; a name already taken gets -2, -3..."""
    os.makedirs(out_dir, exist_ok=True)
    stem, n = run_stem(results), 1
    base = stem
    while glob.glob(os.path.join(out_dir, stem + ".*")):
        n += 1
        stem = f"{base}-{n}"
    md, js = os.path.join(out_dir, stem + ".md"), os.path.join(out_dir, stem + ".json")
    with open(md, "w") as f:
        f.write(printed)
    written = plot(results, out_dir, prefix=stem + "-")
    results["charts"] = [os.path.basename(p) for p in written]
    write_json(results, js)
    return [md, js, *written]


def plot(results, out_dir, prefix=""):
    """throughput.png (decode tok/s by batch, static vs continuous) and latency.png (each request's TTFT,
    TPOT and e2e, one CDF per arrival rate), for the sections that ran."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    written = []
    t, r, lat = results.get("throughput"), results.get("roofline"), results.get("latency")
    if t or r:
        fig, ax = plt.subplots(figsize=(6, 4))
        if r:
            bs = sorted(int(b) for b in r["decode"])
            ax.plot(bs, [r["decode"][str(b)]["decode_tok_s"] for b in bs], "o-", label="steady decode tok/s")
        if t:
            st = sorted((int(k.split("=")[1]), v["useful_tok_s"]) for k, v in t["modes"].items() if k.startswith("static"))
            ax.plot([b for b, _ in st], [v for _, v in st], "s--", label="static batching, useful tok/s")
            ax.axhline(t["modes"]["continuous"]["useful_tok_s"], color="g", label="continuous batching, useful tok/s")
        ax.set(xscale="log", xlabel="concurrent sequences", ylabel="output tokens/s", title="throughput vs concurrency")
        ax.legend()
        written.append(os.path.join(out_dir, f"{prefix}throughput.png"))
        fig.tight_layout()
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    if lat:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for ax, key in zip(axes, ("ttft", "tpot", "e2e")):
            for st in lat["rates"]:
                v = st[f"{key}_values"]
                ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=f"{st['rate_rps']:.2f} req/s")
            ax.set(xlabel=f"{key} (s)", ylabel="share of requests", title=key)
            ax.legend(fontsize=8)
        written.append(os.path.join(out_dir, f"{prefix}latency.png"))
        fig.tight_layout()
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


# ----------------------------------------------------------------------------- the README's table

HEADLINE_SECTIONS = ("throughput", "peers")     # a run that measured these can head the README


def newest_results(results_dir=RESULTS_DIR):
    """The newest run in results/ by its recorded date that measured the headline sections, leaving out
    --quick runs (their numbers only prove that every section runs) and runs of a few other sections
    (`python bench.py parallel --out results/`), which keep their own files."""
    runs = []
    for path in glob.glob(os.path.join(results_dir, "*.json")):
        with open(path) as f:
            r = json.load(f)
        if r.get("sizes", {}).get("name") not in ("quick", "soak") and all(s in r for s in HEADLINE_SECTIONS):
            runs.append((r["date"], os.path.basename(path), path))
    if not runs:
        raise FileNotFoundError(f"no results/*.json of a default or --full run with {HEADLINE_SECTIONS} in {results_dir}")
    return max(runs)[2]


def fmt(v):
    if isinstance(v, str):
        return v
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def target_of(results, prefix, unit=""):
    """The needed ratio and 'met' / 'missed' of the run's target whose name starts with prefix, or '-'."""
    t = next((t for t in results.get("targets", []) if t["target"].startswith(prefix)), None)
    if t is None:
        return "-"
    if isinstance(t["measured"], str):
        return f">= {fmt(t['needed'])}{unit}: not measured"
    return f">= {fmt(t['needed'])}{unit}: {'met' if t['met'] else 'missed'}"


def at_most(ratio, limit):
    return f"<= {limit}: {'met' if ratio <= limit else 'missed'}"


def summary_rows(r):
    """One row per headline figure the run measured: [experiment, nanoserve, compared with, ratio, target]."""
    rows = []
    p = r.get("peers")
    if p:
        ours, vllm = p["nanoserve"]["default"], p["vllm"]
        best = vllm.get(vllm.get("best_dtype", ""), {})
        runs = {d: v for d, v in vllm.items() if isinstance(v, dict) and "batch1_decode_tok_s" in v}
        n = f"{p['num_requests']} requests"
        if "useful_tok_s" in best:
            rows.append([f"offline, {n} (useful out tok/s)", ours["useful_tok_s"],
                         f"vLLM CPU {vllm['best_dtype']}: {fmt(best['useful_tok_s'])}",
                         f"{ours['useful_tok_s'] / best['useful_tok_s']:.2f}x", target_of(r, "nanoserve default >= 2x vLLM", "x")])
            b1 = max(v["batch1_decode_tok_s"] for v in runs.values())
            rows.append(["batch-1 decode (tok/s)", ours["batch1_decode_tok_s"], f"vLLM: {fmt(b1)}",
                         f"{ours['batch1_decode_tok_s'] / b1:.2f}x", target_of(r, "batch-1 decode", "x")])
        else:
            rows.append([f"offline, {n} (useful out tok/s)", ours["useful_tok_s"], "vLLM not run", "-", "-"])
    t = r.get("throughput")
    if t:
        rows.append(["continuous batching (useful out tok/s)", t["modes"]["continuous"]["useful_tok_s"],
                     f"{t['best_static']}: {fmt(t['modes'][t['best_static']]['useful_tok_s'])}",
                     f"{t['continuous_over_best_static']:.2f}x", target_of(r, "continuous >= 2x", "x")])
    rf = r.get("roofline")
    if rf:
        b = str(max(int(k) for k in rf["decode"]))
        d = rf["decode"][b]
        rows.append([f"decode step, batch {b} (ms)", d["step_s_median"] * 1e3, f"its matmuls alone: {fmt(d['matmul_floor_s'] * 1e3)}",
                     f"{d['frac_of_matmul_roofline']:.2f} of roofline", target_of(r, "decode step at batch")])
    h = r.get("http")
    if h:
        runs = h["runs"]
        base, ours, vs = runs["nanoserve engine, in process"], runs.get("serve.py", {}), runs.get("vllm serve", {})
        if "output_tok_s" in ours:
            rows.append([f"serve.py, {h['num_requests']} streamed requests (out tok/s)", ours["output_tok_s"],
                         f"engine in process: {fmt(base['output_tok_s'])}", f"{ours['output_tok_s'] / base['output_tok_s']:.2f}",
                         target_of(r, "serve.py >= 90%")])
            if "output_tok_s" in vs:
                rows.append(["serve.py vs vllm serve, same client (out tok/s)", ours["output_tok_s"],
                             f"vllm serve: {fmt(vs['output_tok_s'])}", f"{ours['output_tok_s'] / vs['output_tok_s']:.2f}x",
                             target_of(r, "serve.py >= 1.5x", "x")])
    pre = r.get("prefix")
    if pre:
        rows.append(["prefix caching, shared system prompt (useful out tok/s)", pre["shared_prefix_caching_on"]["useful_tok_s"],
                     f"caching off: {fmt(pre['shared_prefix_caching_off']['useful_tok_s'])}",
                     f"{pre['speedup']['shared_prefix']:.2f}x", "-"])
    c = r.get("chunked_prefill")
    if c:
        ch = next(v for k, v in c.items() if k.startswith("chunked"))
        un = next(v for k, v in c.items() if k.startswith("unchunked"))
        rows.append(["chunked prefill, worst decode gap (s)", ch["gap_max_s"], f"unchunked: {fmt(un['gap_max_s'])}",
                     f"{c['max_gap_unchunked_over_chunked']:.2f}x lower", "-"])
    m = r.get("memory")
    if m:
        rows.append(["paged KV, sequences at one KV budget", m["paged_peak_running"],
                     f"contiguous reservations: {fmt(m['fit_contiguous_request_max'])}",
                     f"{m['paged_peak_running'] / m['fit_contiguous_request_max']:.2f}x", "-"])
    k = r.get("kernel")
    if k:
        ctx = max(int(re.match(r"ctx=(\d+)", n).group(1)) for n in k["attention"])
        row = next((v for n, v in k["attention"].items() if n.startswith(f"ctx={ctx} bfloat16") and not n.endswith("torch")), None)
        if row:
            rows.append([f"paged-attention decode, bf16 KV, {ctx} tokens (GB/s)", row["kv_gbs"],
                         f"plain memory read: {fmt(k['read_bandwidth_gbs'])}",
                         f"{row['kv_gbs'] / k['read_bandwidth_gbs']:.2f}", "-"])
    a = r.get("api", {})
    if "structured_cost_ratio" in a.get("structured_output", {}):
        s = a["structured_output"]
        rows.append([f"JSON-schema decode step, batch {s['batch']} (ms)", s["step_ms"]["json schema"],
                     f"unconstrained: {fmt(s['step_ms']['free'])}", f"{s['structured_cost_ratio']:.2f}", at_most(s["structured_cost_ratio"], 1.1)])
    if "sampling_step_ratio" in a.get("sampling", {}):
        s = a["sampling"]
        rows.append([f"temperature-1 decode step, batch {s['batch']} (ms)", s["step_ms"]["temperature 1"],
                     f"greedy: {fmt(s['step_ms']['greedy'])}", f"{s['sampling_step_ratio']:.2f}", at_most(s["sampling_step_ratio"], 1.1)])
    return rows


def readme_table(path):
    """The README's results section: which run, then one table of its headline figures."""
    with open(path) as f:
        r = json.load(f)
    name = os.path.relpath(path, ROOT)
    md = name.removesuffix(".json") + ".md"
    flags = " ".join(r["cpu_flags"]) or "no SIMD flags listed"
    gpu = "" if r.get("gpu") in (None, "", "none") else f", {r['gpu']}"
    lines = [f"`python bench.py` of {r['date'][:16]} UTC on `{r['machine']}` ({r['cpu_model']}, {r['cores']} cores{gpu}; "
             f"{flags}), commit `{r['commit']}`{' with uncommitted changes' if r.get('dirty') else ''}, {r['dtype']}, "
             f"{r['sizes']['name']} sizes: [figures]({name}), [tables as printed]({md})"
             + (", transcribed from an earlier README." if r.get("transcribed") else ".")]
    lines += ["", "| experiment | nanoserve | compared with | ratio | target |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in summary_rows(r)]
    return "\n".join(lines)


def readme_section(readme_text, results_dir=RESULTS_DIR):
    """(the README's current table text, the text the newest results file gives)."""
    i, j = readme_text.index(BEGIN) + len(BEGIN), readme_text.index(END)
    return readme_text[i:j].strip("\n"), readme_table(newest_results(results_dir))


def update_readme(readme=README, results_dir=RESULTS_DIR):
    """Rewrite the text between the README's two markers from the newest results file; returns that file."""
    with open(readme) as f:
        text = f.read()
    i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
    path = newest_results(results_dir)
    with open(readme, "w") as f:
        f.write(text[:i] + "\n" + readme_table(path) + "\n" + text[j:])
    return path
