"""
auto_path.py: which weights dtype="auto" with quantization=None runs on a GGUF model on the CPU.

Three paths hold the accuracy bounds (teacher-forced top-1 >= 0.95 against transformers' float32
greedy tokens, perplexity within 1%: test_quantization_int8_keeps_greedy_tokens_and_perplexity and
the gguf tests), so the fastest of them is picked: the float weights at the dtype resolve_dtype gives
(bfloat16 where the CPU multiplies it natively, float32 elsewhere), quantization="int8", and
quantization="gguf" (the file's own blocks). Which is fastest depends on the CPU and on the kernels
of the day, so it is measured here, on one decoder layer's real weights and the lm_head at 1, 64 and
256 rows, and the answer cached on disk per CPU flags, torch, kernel sources and model (like
extensions.py's builds): a machine keeps its pick, and so its tokens, until one of those changes.
Owns the measurement, the rule and the cache; the engine calls choose() once and logs its line.
"""
import hashlib
import json
import os
import time
from pathlib import Path

import torch

import cpu_linear as CL
import extensions

# batch-1 decode, a full decode batch, a prefill chunk. A batched workload spends about half its
# matmuls in prefill: measured at 1 and 16 rows only, int8 looked 1.4x faster than bfloat16 on an AMX
# Xeon whose bfloat16 engine then ran the peers workload 2.4x faster than int8's.
ROWS = (1, 64, 256)
HEAD_ROWS = 64                   # the lm_head sees only the sampled rows: at most a decode batch
LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def pick(step_ms: dict[str, dict[int, float]], float_dtype: str) -> tuple[str | None, str]:
    """The rule. step_ms: candidate -> rows -> ms of the model's linear layers at that many rows.
    -> (quantization for the engine: None, "int8" or "gguf"; the start-up line's reason). An integer
    path must be no slower than the float path at every row count (batch 1 and batched steps both
    gain); of those, the lowest mean of its time over the float path's wins; ties keep the float path."""
    fl = step_ms["float"]
    ratio = {c: sum(t[r] / fl[r] for r in ROWS) / len(ROWS) for c, t in step_ms.items()
             if all(t[r] <= fl[r] for r in ROWS)}
    best = min(ratio, key=lambda c: (ratio[c], c != "float"))
    shown = "; ".join(f"{'float ' + float_dtype if c == 'float' else c} "
                      + " / ".join(f"{step_ms[c][r]:.1f}" for r in ROWS) for c in step_ms)
    why = f"measured ms at {' / '.join(map(str, ROWS))} rows: {shown}"
    return (None if best == "float" else best), why


def choose(model_dir: str, float_dtype: torch.dtype) -> tuple[str | None, str]:
    """-> (quantization, why) for dtype="auto" on the converted GGUF in model_dir; cached on disk."""
    path = cache_dir() / f"{cache_key(model_dir, float_dtype)}.json"
    if path.exists():
        got = json.loads(path.read_text())
        return got["quantization"], got["why"] + " (cached for this CPU, kernels and model)"
    name = str(float_dtype).removeprefix("torch.")
    quantization, why = pick(measure(model_dir, float_dtype), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"quantization": quantization, "why": why}))
    os.replace(tmp, path)
    return quantization, why


def cache_dir() -> Path:
    return extensions.cache_root() / "auto_path"


def cache_key(model_dir: str, float_dtype: torch.dtype) -> str:
    """What the measurement depends on: the CPU (flags, torch's and oneDNN's ISA caps, threads),
    torch, the linear kernels' sources and build flags, this file, the model and the float dtype."""
    h = hashlib.sha1(f"{sorted(CL.cpu_flags())} {torch.__version__} {torch.get_num_threads()} {float_dtype} "
                     f"{os.path.realpath(model_dir)} {sorted(extensions.BUILDS['linear_cpu'].items())} "
                     f"{[os.environ.get(v) for v in ('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA')]}"
                     .encode())
    for src in extensions.BUILDS["linear_cpu"]["sources"]:
        h.update((extensions.CSRC / src).read_bytes())
    for f in (CL.__file__, __file__):
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def measure(model_dir: str, float_dtype: torch.dtype, repeats: int = 3) -> dict[str, dict[int, float]]:
    """candidate -> rows -> ms of every linear layer of the model at that many rows, estimated as
    num_layers x layer 0's (fused q/k/v and gate/up, as model.py runs them) + the lm_head, each
    candidate on the weights it would run ("float", and "int8" and "gguf" where their kernels built and
    the file has the blocks), the candidates taking turns, best of `repeats`."""
    from safetensors import safe_open
    from weights import GGUF_BLOCKS
    with open(os.path.join(model_dir, "config.json")) as f:
        num_layers = json.load(f)["num_hidden_layers"]
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as st:
        w = {n: st.get_tensor(f"model.layers.0.{n}.weight") for n in LAYER}
        head = st.get_tensor("lm_head.weight" if "lm_head.weight" in st.keys() else "model.embed_tokens.weight")
    with safe_open(os.path.join(model_dir, GGUF_BLOCKS), "pt") as sb:
        blk = {n: [sb.get_tensor(f"model.layers.0.{n}.weight.{p}") if f"model.layers.0.{n}.weight.{p}" in sb.keys()
                   else None for p in ("qs", "scales", "mins")] for n in LAYER}
    fused = [LAYER[:3], LAYER[3:4], LAYER[4:6], LAYER[6:]]                # qkv, o, gate_up, down
    weights = [torch.cat([w[n] for n in g]) for g in fused]               # [N, K] float32 each
    blocks = [CL.GGUFBlocks(*(None if blk[g[0]][i] is None else torch.cat([blk[n][i] for n in g]) for i in range(3)))
              for g in fused]
    layer = {"float": _float_layers(weights, float_dtype)}
    lm_head = {"float": _float_layers([head], float_dtype)}
    if CL._cpu_linear_kernels()[0]:               # the integer kernels built (else only the float path runs)
        layer["int8"], lm_head["int8"] = _int8_layers(weights), _float_layers([head], torch.float32)
        if all(b.qs is not None and b.scales is not None for b in blocks):
            # the lm_head: float32 sums over the embedding's blocks cost about what float32 does
            layer["gguf"], lm_head["gguf"] = _gguf_layers(blocks), lm_head["int8"]
    best = {(c, r, part): float("inf") for c in layer for r in ROWS for part in ("layer", "head")}
    xs = {r: {k: torch.randn(r, k) for k in {t.shape[1] for t in weights}} for r in ROWS}
    heads = {r: {head.shape[1]: torch.randn(min(r, HEAD_ROWS), head.shape[1])} for r in ROWS}
    for _ in range(repeats):                      # interleaved: the same load on each
        for c in layer:
            for r in ROWS:
                for part, run, x in (("layer", layer[c], xs[r]), ("head", lm_head[c], heads[r])):
                    run(x)                        # warm: the weights in cache as in a step
                    t = time.perf_counter()
                    run(x)
                    best[c, r, part] = min(best[c, r, part], time.perf_counter() - t)
    return {c: {r: (num_layers * best[c, r, "layer"] + best[c, r, "head"]) * 1e3 for r in ROWS} for c in layer}


def _float_layers(weights, dtype):
    """The float path: model.linear on the prepacked weight at `dtype`, as the engine's Linear runs it."""
    ws = [w.to(dtype) for w in weights]
    packed = [CL.pack_weight(w) for w in ws]
    return lambda xs: [CL.linear(xs[w.shape[1]].to(dtype), w, None, p) for w, p in zip(ws, packed)]


def _int8_layers(weights):
    w8 = [CL.quantize_int8(w) for w in weights]
    return lambda xs: [CL.int8_linear(xs[w.shape[1]], q) for w, q in zip(weights, w8)]


def _gguf_layers(blocks):
    """quantization="gguf"'s kernel, with the 8-bit activation rows the engine's choose_gguf_path would set."""
    q8_rows, _ = CL.choose_gguf_path(max(blocks, key=lambda b: b.qs.numel()), repeats=1)
    return lambda xs: [CL.gguf_linear(xs[b.scales.shape[1] * 32], b, None, q8_rows) for b in blocks]
