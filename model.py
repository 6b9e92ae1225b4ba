"""
The Llama-family decoder, run on a ragged batch.

forward() takes the tokens of many sequences packed into one flat tensor [num_tokens]
with their positions: no padding anywhere. Each layer writes its new K/V into the paged
pool and attends through paged_attention.py; logits are computed only for the rows the
engine will sample from (the last token of each sequence that finishes its chunk).
This file owns the math, the layers and the compute dtype ("auto": bfloat16 where the CPU
multiplies bf16 natively, see cpu_bf16_native). On CPU the linear layers and the fused
per-layer ops (residual add + RMSNorm, RoPE, SwiGLU) run C++ kernels from csrc/, each
with a plain-PyTorch reference beside it. It does not know about blocks, queues or
sampling: the engine hands it flat tensors (input ids, positions, an AttentionMetadata).

weights.py loads the weights (and the GGUF blocks linear() reads at a few rows).
"""
import functools
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import extensions
import paged_attention


@dataclass
class ModelConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None          # Llama-3 style: {"rope_type": "llama3", "factor", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False              # Qwen2 puts a bias on q/k/v
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        supported = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
        if archs[0] not in supported:
            raise ValueError(f"unsupported architecture {archs[0]!r}: nanoserve runs {list(supported)}")
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 nests rope settings in "rope_parameters"; older configs keep them on top
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)), rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", archs[0] == "Qwen2ForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[] if eos is None else (eos if isinstance(eos, list) else [eos]))


@dataclass
class AttentionMetadata:
    """What every layer's attention needs to find its sequences in the flat batch and the pool."""
    slot_mapping: torch.Tensor      # [num_tokens] int64: where each new token's K/V is written
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor      # [num_seqs] int32, cached tokens including this step's
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    backend: str = "torch"


# ---------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3's long-context rescaling when configured.
    Built on the CPU even under weights.load_model's meta device (a meta arange imports torch._dynamo: 2.6 s)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return inv_freq.float()
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    out = torch.where(wavelen < old_len / high, inv_freq, out)
    return out.float()


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (Hugging Face layout). x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, 1, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# ---------------------------------------------------------------------------- fused ops
# Each layer's small elementwise ops (residual add + RMSNorm, RoPE, SwiGLU) cost a PyTorch
# dispatch and a temporary each: ~10 per layer, 300 per decode step. csrc/fused_cpu.cpp does
# each group in one pass over the rows. The plain-PyTorch versions below are the references
# (and what runs on GPUs, in float16, or where the C++ build failed, after one warning).

@functools.cache
def _fused_cpu_built() -> bool:
    return extensions.try_load("fused_cpu", "RMSNorm, RoPE and SwiGLU run as separate PyTorch ops (slower)")


def fused_ops_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _fused_cpu_built()


def rms_norm_reference(x, weight, eps):
    # normalise in float32 like transformers, whatever the compute dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rms_norm(x, weight, eps, residual=None, fused=False):
    """RMSNorm of x, or of residual + x when residual is given. -> (normed, new residual).
    The new residual is x itself, or the sum; fused, the sum is written into `residual` and
    the norm into `x` (both are this step's own temporaries)."""
    if residual is None:
        out = torch.ops.nanoserve_fused.rms_norm(x, weight, eps) if fused else rms_norm_reference(x, weight, eps)
        return out, x
    if fused:
        torch.ops.nanoserve_fused.add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def rope_(qkv, cos, sin, num_heads, head_dim, fused=False):
    """Rotate the first num_heads heads (q, then k) of every row of qkv [T, width] in place.
    cos/sin: float32 [T, head_dim/2]."""
    if fused:
        return torch.ops.nanoserve_fused.rope_(qkv, cos, sin, num_heads, head_dim)
    x = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)               # [T, heads, hd]
    x.copy_(apply_rope(x, cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)))


def silu_and_mul(gate_up, fused=False):
    """SwiGLU's middle: silu(gate) * up, for gate_up = [gate | up] [T, 2 * intermediate]."""
    if fused:
        return torch.ops.nanoserve_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)                                          # [T, intermediate] each
    return F.silu(gate) * up


# ---------------------------------------------------------------------------- dtype

def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((l for l in f if l.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


@functools.cache
def cpu_bf16_native() -> tuple[bool, str]:
    """(does this CPU multiply bfloat16 natively, why we think so). AMX tiles or AVX-512 BF16
    dot products make bf16 matmuls run at twice fp32's rate (or more); without them oneDNN
    emulates bf16 by converting to fp32 and bf16 only adds conversions."""
    flags = _cpu_flags()
    native = sorted(flags & {"amx_bf16", "avx512_bf16"})
    if native:
        return True, f"CPU flags {', '.join(native)}"
    if not flags:   # no /proc/cpuinfo (macOS, Windows): ask oneDNN, which checks CPUID itself
        ok = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        cap = torch.backends.cpu.get_cpu_capability()
        return (ok and cap == "AVX512"), f"no /proc/cpuinfo; oneDNN bf16 support {ok}, torch CPU capability {cap}"
    return False, "no amx_bf16 or avx512_bf16 in the CPU flags"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """dtype "auto": bfloat16 on CUDA and on CPUs with native bf16 math, float32 elsewhere.
    -> (dtype, why), for the engine to log and bench.py to print."""
    if requested != "auto":
        return DTYPES[requested], "requested"
    if device.type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    native, why = cpu_bf16_native() if device.type == "cpu" else (False, f"device {device.type}")
    return (torch.bfloat16 if native else torch.float32), f"auto: {why}"


# ---------------------------------------------------------------------------- layers

# Below this many rows csrc/linear_cpu.cpp streams the weight once and beats oneDNN on its
# prepacked weight (see PACK_ROWS_HINT); from it on oneDNN wins. ms per pass over SmolLM2-135M's
# 30 layers, cold cache, 2 Zen 4 cores, quiet (2026-11-23), at M = 1 / 2 / 3 / 4 / 5 / 6 / 8:
# float32 kernel 21.6 / 19.1 / 20.9 / 23.4 / 25.6 / 27.2 / 31.1, packed oneDNN 26.1 / 26.1 / 24.5 /
# 25.8 / 22.8 / 22.6 / 28.0; bfloat16 kernel 15.9 / 16.0 / 17.0 / 17.7 / 18.5 / 18.9 / 20.8,
# packed oneDNN 17.4 / 16.9 / 16.0 / 15.1 / 16.6 / 16.9 / 19.1.
SMALL_M_ROWS = 5
SMALL_M_ROWS_BF16 = 3   # the bf16 kernel, where no bf16 panels run: AMX CPUs (dot products), AVX2 ones (shift and FMA)


@functools.cache
def _cpu_linear_kernels() -> tuple[bool, bool]:
    """(small-M kernel built, oneDNN linear present); warns once for each that is missing."""
    small_m = extensions.try_load("linear_cpu", "small-batch linear layers use oneDNN or F.linear (slower)")
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if not onednn:
        warnings.warn("torch has no oneDNN (mkldnn) linear; CPU linear layers use F.linear (slower)",
                      RuntimeWarning)
    return small_m, onednn


# F.linear hands oneDNN a plain [N, K] weight, and oneDNN reorders it into its blocked layout on
# every call: at 64 rows that reorder is a third of the matmul. Reordering once, at a layer's
# first call (into the layout oneDNN picks for PACK_ROWS_HINT rows, which suits 16-512 rows
# here), and calling _linear_pointwise on the packed copy removes it: a batch-64 pass over all SmolLM2-135M weights
# took 84 ms plain and 55 ms packed in bfloat16, 151 and 106 ms in float32 (2 Zen 4 cores,
# 2026-11-23; hints 128-1024 were within noise of each other, 64 was slower). The cost is a
# second copy of each weight, since the small-M kernel reads the plain one.
PACK_ROWS_HINT = 512


@functools.cache
def onednn_prepack_available() -> bool:
    ok = _cpu_linear_kernels()[1] and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    if _cpu_linear_kernels()[1] and not ok:
        warnings.warn("this torch cannot prepack oneDNN weights; CPU linear layers reorder them on "
                      "every call (slower)", RuntimeWarning)
    return ok


@functools.cache
def onednn_bf16_available() -> bool:
    """oneDNN runs bfloat16 only where the CPU has AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an
    AVX2-only CPU its bf16 reorder raises, and bf16 layers there run F.linear (slower; dtype auto
    never picks bf16 on such a CPU)."""
    ok = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if not ok:
        warnings.warn("oneDNN has no bfloat16 path on this CPU; bfloat16 linear layers use F.linear "
                      "(slower: float32 is the fast dtype here)", RuntimeWarning)
    return ok


# On an AVX2 CPU (no AVX-512) float32 layers run csrc/linear_cpu.cpp's register-blocked GEMM on
# the weight repacked into panels of 16 columns, at every row count, instead of oneDNN on its
# prepacked copy and the small-M kernel. ms per pass over all 121 of SmolLM2-135M's linear layers,
# 2 AVX2 Zen 3 cores, 2026-11-24, at M = 1 / 4 / 8 / 16 / 32 / 64: panels 22.4 / 22.7 / 27.9 / 44.2
# / 71.5 / 124.8, oneDNN 31.2 / 33.9 / 44.8 / 62.8 / 96.6 / 150.5 (small-M kernel at 1 / 4 rows
# 21.8 / 24.7). With AVX-512, oneDNN's float32 matmul has 16-lane FMAs and this 8-lane kernel
# does not, so oneDNN stays there.
# Where the CPU has AVX512_BF16 and no AMX, bfloat16 layers run the same GEMM in bf16 (panels of
# 32 columns, AVX-512 BF16 dot products), at every row count. ms per pass over the 121 layers, 2
# Zen 4 cores, 2026-11-24 20:49 UTC, taking turns, at M = 1 / 8 / 16 / 32 / 64 / 128 / 512: panels
# 8.4 / 9.3 / 14.4 / 24.9 / 48.4 / 87.6 / 350.1, oneDNN 14.2 / 16.6 / 21.0 / 31.3 / 57.4 / 94.9 /
# 338.6: the weights stream at memory speed up to ~8 rows, where oneDNN reaches 60% of it. At 512
# rows (a prefill step) oneDNN is 0-8% faster from one measurement to the next (the 120 layers
# without lm_head: 303 against 327 ms at 21:49 UTC, 263 against 263 at 21:52): not worth a third
# copy of every weight. With AMX, oneDNN's tile kernels do the bf16 matmuls (not measured here:
# no AMX CPU).
# LINEAR_PANELS = False turns the panels off (bench.py compares).
LINEAR_PANELS = True
PANEL_COLUMNS = {torch.float32: 16, torch.bfloat16: 32}   # output columns per panel (N must divide)


@functools.cache
def panels_available(dtype: torch.dtype) -> bool:
    """Whether csrc's panel GEMM runs `dtype` on this CPU: float32 on AVX2 CPUs, bfloat16 on
    CPUs with AVX512_BF16 and no AMX (see LINEAR_PANELS)."""
    if not _cpu_linear_kernels()[0]:
        return False
    if dtype == torch.float32:
        return torch.backends.cpu.get_cpu_capability() == "AVX2"
    flags = _cpu_flags()
    return dtype == torch.bfloat16 and "avx512_bf16" in flags and "amx_bf16" not in flags


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of a CPU float32/bfloat16 weight [N, K] that linear() reads: panels for our GEMM
    at every row count (see LINEAR_PANELS), else oneDNN's blocked copy (a mkldnn tensor) from a
    few rows up, or None where neither applies."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    pair = 2 if weight.dtype == torch.bfloat16 else 1                # bf16 panels hold K's values in pairs
    if LINEAR_PANELS and panels_available(weight.dtype) and weight.shape[0] % PANEL_COLUMNS[weight.dtype] == 0 \
            and weight.shape[1] % pair == 0:
        return torch.ops.nanoserve_linear.pack_panels(weight.detach())
    if not onednn_prepack_available() or (weight.dtype == torch.bfloat16 and not onednn_bf16_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def cpu_linear_path(dtype: torch.dtype) -> str:
    """Which kernels linear() runs on this CPU at `dtype` (the engine logs it, bench.py prints it)."""
    small_m, onednn = _cpu_linear_kernels()
    if LINEAR_PANELS and dtype in PANEL_COLUMNS and panels_available(dtype):
        simd = "AVX2" if dtype == torch.float32 else "AVX512_BF16"
        return f"{str(dtype).removeprefix('torch.')}: csrc GEMM on weight panels ({simd}) at every row count"
    if dtype == torch.bfloat16 and not (onednn and onednn_bf16_available()):
        return "bfloat16: F.linear (no oneDNN bf16 path on this CPU)"
    small = f"csrc small-M kernel below {SMALL_M_ROWS if dtype == torch.float32 else SMALL_M_ROWS_BF16} rows" if small_m else ""
    return f"{str(dtype).removeprefix('torch.')}: " + ", ".join(filter(None, [small, "oneDNN on prepacked weights" if onednn else "F.linear"]))


@dataclass
class GGUFBlocks:
    """A linear weight [N, K] from a GGUF file's Q4_1 or Q8_0 blocks (32 values along K each),
    in the lane layout csrc/linear_cpu.cpp reads (described there; weights.write_gguf_blocks makes it):
    Q4_1: qs uint8 [N, K/2], scales and mins float32 [N, K/32];  Q8_0: qs int8 [N, K], scales."""
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None


# Below this many rows a float32 layer with GGUF blocks reads them instead of its float32 weight
# (a sixth of the bytes, more arithmetic to unpack them; the kernel takes rows in pairs, so 3 rows
# cost two passes over the blocks). ms per pass over all 121 of SmolLM2-135M's linear layers, 2
# AVX2 Zen 3 cores, 2026-11-24 (bench_hot.py gguf), at M = 1 / 2 / 3 / 4 / 8: blocks 18.1 / 17.6 /
# 27.1 / 26.4 / 49.6, the float32 panels (LINEAR_PANELS) 27.3 / 26.1 / 24.7 / 25.1 / 32.2.
GGUF_ROWS = 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, gguf: GGUFBlocks | None = None,
           float_out: bool = False) -> torch.Tensor:
    """F.linear, with faster kernels on CPU: the GGUF's blocks at a few rows where the layer has
    them; our GEMM on the weight's panels (pack_weight) at any row count, in float32 on AVX2
    CPUs and in bfloat16 on AVX512_BF16 ones without AMX;
    elsewhere our small-M kernel for few rows (oneDNN and MKL are slow there), then oneDNN on the
    prepacked weight, or on the plain one without it. float_out: return float32 whatever the dtype
    (the logits); the bf16 panels then skip rounding their float32 sums to bf16 and back."""
    if x.device.type != "cpu" or x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        out = F.linear(x, weight, bias)
        return out.float() if float_out else out
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                      # [M, K]
    (M, K), N = x2.shape, weight.shape[0]
    small_m, onednn = _cpu_linear_kernels()
    bf16 = x.dtype == torch.bfloat16
    if small_m and gguf is not None and not bf16 and M < GGUF_ROWS:
        out = torch.ops.nanoserve_linear.linear_small_m_gguf(x2, gguf.qs, gguf.scales, gguf.mins, bias)
    elif packed is not None and not packed.is_mkldnn:                    # panels, any M
        out = torch.ops.nanoserve_linear.linear_panels(x2, packed, bias, float_out)
    elif small_m and bf16 and M < SMALL_M_ROWS_BF16 and K % 32 == 0 and N % 4 == 0:
        out = torch.ops.nanoserve_linear.linear_small_m_bf16(x2, weight.contiguous(), bias)
    elif small_m and not bf16 and M < SMALL_M_ROWS and K % 8 == 0 and N % 4 == 0:
        out = torch.ops.nanoserve_linear.linear_small_m(x2, weight.contiguous(), bias)
    elif packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    elif onednn and not bf16:
        out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    else:
        out = F.linear(x2, weight, bias)
    out = out.float() if float_out else out                           # a no-op where it already is
    return out.view(*x.shape[:-1], N)                                 # [..., N]


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose forward is linear() above, with the
    weight's packed copy (pack_weight) made at the first call and remade if the weight is
    replaced or changed, and the GGUF blocks weights.attach_gguf_blocks gave it (dropped if the
    weight changes)."""
    _packed = (None, None)                    # (which weight it was made from, packed copy)
    _gguf = (None, None)                      # (the weight it matches, GGUFBlocks): weights.py

    def forward(self, x, float_out=False):
        return linear(x, self.weight, self.bias, *self.prepared(), float_out=float_out)

    def weight_key(self):
        w = self.weight
        # inference tensors keep no version counter: for them only a new weight is noticed
        return (w.data_ptr(), w.dtype, w.device, None if w.is_inference() else w._version)

    def prepared(self) -> tuple[torch.Tensor | None, GGUFBlocks | None]:
        """(the packed copy, GGUF blocks) for the current weight, checked with one key per
        call (at batch 1 a step makes 121 of these calls): the copy is remade and the blocks
        dropped once the weight is replaced or changed."""
        key = self.weight_key()
        if self._packed[0] != key:
            self._packed = (key, pack_weight(self.weight))
        return self._packed[1], (self._gguf[1] if self._gguf[0] == key else None)

    def packed_weight(self) -> torch.Tensor | None:
        return self.prepared()[0]

    def gguf_blocks(self) -> GGUFBlocks | None:
        return self.prepared()[1]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None, fused=False):
        return rms_norm(x, self.weight, self.eps, residual, fused)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q, k and v share one matmul: one pass over the activations instead of three
        self.qkv_proj = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, fused=False):
        T = x.shape[0]
        qkv = self.qkv_proj(x)                                        # [T, (nh + 2*nkv) * hd]
        rope_(qkv, cos, sin, self.n_heads + self.n_kv, self.head_dim, fused)   # q and k sit side by side
        q, k, v = qkv.split([self.n_heads * self.head_dim, self.n_kv * self.head_dim,
                             self.n_kv * self.head_dim], dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)                    # [T, nh, hd]
        k = k.view(T, self.n_kv, self.head_dim)                       # [T, nkv, hd]
        v = v.view(T, self.n_kv, self.head_dim)
        k_cache, v_cache = kv_cache
        paged_attention.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        o = paged_attention.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                            meta.query_start_loc, self.scale, backend=meta.backend)
        return self.o_proj(o.reshape(T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, fused=False):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), fused))   # [T, 2 * inter] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, kv_cache, meta, fused=False, keep=None):
        """x: the last block's output, not yet added to residual (None before the first layer).
        keep: rows to carry past attention (the last layer passes the rows that get logits).
        -> (this layer's MLP output, residual stream without it): the add is fused into the next norm."""
        x, residual = self.input_layernorm(x, residual, fused)
        x = self.self_attn(x, cos, sin, kv_cache, meta, fused)
        if keep is not None:                  # [T, hidden] -> [num_sampled, hidden]
            x, residual = x[keep], residual[keep]
        x, residual = self.post_attention_layernorm(x, residual, fused)
        return self.mlp(x, fused), residual


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # from_pretrained skips the random init: on weights.load_model's meta device it imports torch._dynamo
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # a plain attribute, not a buffer: module.to(dtype) would round the RoPE angles to bf16
        self.inv_freq = rope_inv_freq(cfg)
        self.use_fused_ops = True     # csrc/fused_cpu.cpp where it applies (bench turns it off to compare)
        self.gguf_log = ""            # which layers read GGUF blocks: weights.load_model says

    def prepare(self):
        """Do now what the first forward pass would: make every linear layer's packed copy (~0.2 s)
        and load the fused ops' library (built here on a first run)."""
        for layer in self.modules():
            if isinstance(layer, Linear):
                layer.prepared()
        fused_ops_available(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_indices):
        """input_ids, positions: [num_tokens]; kv_caches: per layer (k_cache, v_cache);
        logits_indices: [num_sampled] rows of the flat batch to compute logits for.
        Returns float32 logits [num_sampled, vocab]."""
        x = self.embed_tokens(input_ids)                                  # [T, hidden]
        fused = self.use_fused_ops and fused_ops_available(x.device, x.dtype)
        freqs = positions.unsqueeze(1).float() * self.inv_freq            # [T, head_dim/2]
        cos, sin = freqs.cos(), freqs.sin()                               # float32 [T, head_dim/2]
        residual = None
        # Past the last layer's attention only the rows that get logits matter: every token's K
        # and V are cached by then, so a prompt chunk's other rows skip that layer's MLP.
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            keep = logits_indices if i == last else None
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, fused, keep)
        x, _ = self.norm(x, residual, fused)                              # [num_sampled, hidden]
        return self.lm_head(x, float_out=True)                            # [num_sampled, vocab]
