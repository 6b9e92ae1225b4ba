"""
auto_path.py: which weights dtype="auto" with quantization=None runs on a GGUF model on the CPU.

Three paths hold the accuracy bounds (teacher-forced top-1 >= 0.95 against transformers' float32
greedy tokens, perplexity within 1%: test_quantization_int8_keeps_greedy_tokens_and_perplexity and
the gguf tests), so the fastest of them is picked: the float weights at the dtype resolve_dtype gives
(bfloat16 where the CPU multiplies it natively, float32 elsewhere), quantization="int8", and
quantization="gguf" (the file's own blocks). Which is fastest depends on the CPU and on the kernels
of the day, so it is measured here, on one decoder layer's real weights and the lm_head at 1, 64 and
256 rows, each path's layers made and run as the engine's (weights.quantize_linear, Linear.forward:
the integer paths' 8-bit activations, the float path's GGUF blocks at a few rows), and the answer cached on disk per CPU flags, torch, kernel sources and model (like
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
    torch, the linear kernels' sources and build flags, the files that say which kernel each layer
    runs (cpu_linear.py, weights.py) and this one, the model and the float dtype."""
    import weights
    h = hashlib.sha1(f"{sorted(CL.cpu_flags())} {torch.__version__} {torch.get_num_threads()} {float_dtype} "
                     f"{os.path.realpath(model_dir)} {sorted(extensions.BUILDS['linear_cpu'].items())} "
                     f"{[os.environ.get(v) for v in ('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA')]}"
                     .encode())
    for src in extensions.BUILDS["linear_cpu"]["sources"]:
        h.update((extensions.CSRC / src).read_bytes())
    for f in (CL.__file__, weights.__file__, __file__):
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def measure(model_dir: str, float_dtype: torch.dtype, repeats: int = 3) -> dict[str, dict[int, float]]:
    """candidate -> rows -> ms of every linear layer of the model at that many rows, estimated as
    num_layers x layer 0's (fused q/k/v and gate/up, as model.py runs them) + the lm_head, each
    candidate's layers made as the engine makes them (layer(): "float", and "int8" and "gguf" where
    their kernels built and the file has the blocks) and run through their own forward, the
    candidates taking turns, best of `repeats`."""
    num_layers, parts, (head, head_blocks) = layer0_and_head(model_dir)
    candidates = {"float": None}
    if CL._cpu_linear_kernels()[0]:               # the integer kernels built (else only the float path runs)
        candidates["int8"] = "int8"
        if all(b is not None for _, b in parts):
            candidates["gguf"] = "gguf"
    layers = {c: [layer(w, b, q, float_dtype) for w, b in parts] for c, q in candidates.items()}
    lm_head = {c: [layer(head, head_blocks, q, float_dtype, lm_head=True)] for c, q in candidates.items()}
    dtypes = {c: torch.float32 if q else float_dtype for c, q in candidates.items()}
    xs = {(r, dt): {k: torch.randn(r, k).to(dt) for k in {w.shape[1] for w, _ in parts}}
          for r in ROWS for dt in set(dtypes.values())}
    heads = {(r, dt): {head.shape[1]: torch.randn(min(r, HEAD_ROWS), head.shape[1]).to(dt)}
             for r in ROWS for dt in set(dtypes.values())}
    best = {(c, r, part): float("inf") for c in candidates for r in ROWS for part in ("layer", "head")}
    with torch.inference_mode():
        for _ in range(repeats):                  # interleaved: the same load on each
            for c in candidates:
                for r in ROWS:
                    for part, mods, x in (("layer", layers[c], xs[r, dtypes[c]]), ("head", lm_head[c], heads[r, dtypes[c]])):
                        run = lambda: [m(x[m.in_features], float_out=part == "head") for m in mods]   # noqa: E731
                        run()                     # warm: the weights in cache as in a step
                        t = time.perf_counter()
                        run()
                        best[c, r, part] = min(best[c, r, part], time.perf_counter() - t)
    return {c: {r: (num_layers * best[c, r, "layer"] + best[c, r, "head"]) * 1e3 for r in ROWS} for c in candidates}


def layer0_and_head(model_dir: str):
    """-> (num_layers, [(weight [N, K] float32, its GGUFBlocks or None)] for layer 0's qkv, o, gate_up
    and down, fused as model.py runs them, (lm_head's weight, its GGUFBlocks or None)), read from the
    converted GGUF in model_dir (weights.convert_gguf's float32 weights and write_gguf_blocks' blocks)."""
    from safetensors import safe_open
    from weights import GGUF_BLOCKS
    with open(os.path.join(model_dir, "config.json")) as f:
        num_layers = json.load(f)["num_hidden_layers"]
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as st:
        w = {n: st.get_tensor(f"model.layers.0.{n}.weight") for n in LAYER}
        head_name = "lm_head.weight" if "lm_head.weight" in st.keys() else "model.embed_tokens.weight"
        head = st.get_tensor(head_name)
    with safe_open(os.path.join(model_dir, GGUF_BLOCKS), "pt") as sb:
        def blocks(names):                        # GGUFBlocks of the rows of `names` concatenated, or None
            got = [[sb.get_tensor(f"{n}.{p}") if f"{n}.{p}" in sb.keys() else None for n in names]
                   for p in ("qs", "scales", "mins")]
            if any(t is None for t in got[0] + got[1]):
                return None
            return CL.GGUFBlocks(*(None if any(t is None for t in ts) else torch.cat(ts) for ts in got))
        fused = [LAYER[:3], LAYER[3:4], LAYER[4:6], LAYER[6:]]            # qkv, o, gate_up, down
        parts = [(torch.cat([w[n] for n in g]), blocks([f"model.layers.0.{n}.weight" for n in g])) for g in fused]
        return num_layers, parts, (head, blocks([head_name]))


def layer(weight: torch.Tensor, blocks: "CL.GGUFBlocks | None", quantization: str | None, float_dtype: torch.dtype,
           lm_head: bool = False) -> CL.Linear:
    """One Linear as the engine makes it on a path: quantization None, the float weight at float_dtype
    with the GGUF's blocks attached in float32 (weights.attach_gguf_blocks; linear() reads them at a
    few rows); "int8" or "gguf", those blocks attached and then weights.quantize_linear, as load_model does."""
    from weights import quantize_linear
    dtype = torch.float32 if quantization else float_dtype
    lin = CL.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    if blocks is not None and dtype == torch.float32:
        lin._gguf = (lin.weight_key(), blocks)
    if quantization:
        quantize_linear(lin, quantization, lm_head=lm_head, keep_weight=lm_head)
    return lin
