"""
Linear layers on the CPU: which kernel multiplies x by a weight, and the weight copies it reads.

Owns the choice between csrc/linear_cpu.cpp's kernels (a GEMM on weight panels, a small-M
kernel that streams the weight once, the GGUF's Q4_1/Q4_0/Q8_0 blocks at a few rows) and oneDNN on a
prepacked weight, made once per weight (`pack_weight`); `linear()` is F.linear with that choice,
and `Linear` is nn.Linear that keeps its packed copy. The integer paths (quantization="int8" and
"gguf") run csrc/int8_cpu.cpp's linear_q8, 8-bit activations against int8 weights or the GGUF's
blocks, at every row count: `Linear.q8_panels` is the rule. Also what this CPU multiplies natively
(`cpu_bf16_native`, read by model.resolve_dtype). Every choice below was measured; the numbers
are in the comments and in results/. On other devices and dtypes linear() is plain F.linear.
Batch-invariant mode (`invariant=True`, docs/batch-invariance.md) takes one kernel at every row
count, the panels, whose sums run along K in one fixed order: a row's result never depends on M.
Holds no model structure (model.py) and reads no files (weights.py attaches GGUF blocks).
"""
import functools
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import extensions


def cpu_flags() -> set[str]:
    """The CPU's flags; under NANOSERVE_CPU_ISA=avx2 (extensions.py) without AVX-512, AMX and VNNI."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((l for l in f if l.startswith("flags")), "")
    except OSError:
        return set()
    flags = set(line.partition(":")[2].split())
    if extensions.cpu_isa() == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx", "avx_vnni"))}
    return flags


@functools.cache
def cpu_bf16_native() -> tuple[bool, str]:
    """(does this CPU multiply bfloat16 natively, why we think so). AMX tiles or AVX-512 BF16
    dot products make bf16 matmuls run at twice fp32's rate (or more); without them oneDNN
    emulates bf16 by converting to fp32 and bf16 only adds conversions."""
    flags = cpu_flags()
    native = sorted(flags & {"amx_bf16", "avx512_bf16"})
    if native:
        return True, f"CPU flags {', '.join(native)}"
    if not flags:   # no /proc/cpuinfo (macOS, Windows): ask oneDNN, which checks CPUID itself
        ok = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        cap = torch.backends.cpu.get_cpu_capability()
        return (ok and cap == "AVX512"), f"no /proc/cpuinfo; oneDNN bf16 support {ok}, torch CPU capability {cap}"
    return False, "no amx_bf16 or avx512_bf16 in the CPU flags"


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
    flags = cpu_flags()
    return dtype == torch.bfloat16 and "avx512_bf16" in flags and "amx_bf16" not in flags


def panel_columns(dtype: torch.dtype) -> int:
    """Output columns per panel at `dtype` on this build: 16, or 32 for bf16 with AVX512_BF16."""
    return torch.ops.nanoserve_linear.panel_columns(dtype == torch.bfloat16)


def pack_kind(weight: torch.Tensor, invariant: bool = False) -> str | None:
    """Which copy of a weight [N, K] linear() reads: "panels" for our GEMM at every row count (see
    LINEAR_PANELS; always in batch-invariant mode, where the kernel is built and N fits), else
    "onednn" (its blocked copy, from a few rows up), or None where neither applies."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if (invariant or (LINEAR_PANELS and panels_available(weight.dtype))) and _cpu_linear_kernels()[0]:
        cols = panel_columns(weight.dtype)
        pair = 2 if cols == 32 else 1                            # AVX512_BF16 panels hold K's values in pairs
        if weight.shape[0] % cols == 0 and weight.shape[1] % pair == 0:
            return "panels"
    if invariant or not onednn_prepack_available() or (weight.dtype == torch.bfloat16 and not onednn_bf16_available()):
        return None
    return "onednn"


def pack_weight(weight: torch.Tensor, invariant: bool = False) -> torch.Tensor | None:
    """The copy pack_kind names: panels, oneDNN's blocked copy (a mkldnn tensor), or None."""
    kind = pack_kind(weight, invariant)
    if kind == "panels":
        return torch.ops.nanoserve_linear.pack_panels(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT) if kind == "onednn" else None


def cpu_linear_path(dtype: torch.dtype, invariant: bool = False) -> str:
    """Which kernels linear() runs on this CPU at `dtype` (the engine logs it, bench.py prints it)."""
    small_m, onednn = _cpu_linear_kernels()
    name = str(dtype).removeprefix('torch.')
    if invariant:
        if not small_m:
            return f"{name}, batch-invariant: F.linear one row at a time (csrc/linear_cpu.cpp not built; slow)"
        simd = "AVX512_BF16 pairs" if panel_columns(dtype) == 32 else "AVX2, bf16 widened in registers" \
            if dtype == torch.bfloat16 else "AVX2"
        return f"{name}, batch-invariant: csrc GEMM on weight panels ({simd}) at every row count"
    if LINEAR_PANELS and dtype in PANEL_COLUMNS and panels_available(dtype):
        simd = "AVX2" if dtype == torch.float32 else "AVX512_BF16"
        return f"{str(dtype).removeprefix('torch.')}: csrc GEMM on weight panels ({simd}) at every row count"
    if dtype == torch.bfloat16 and not (onednn and onednn_bf16_available()):
        return "bfloat16: F.linear (no oneDNN bf16 path on this CPU)"
    small = f"csrc small-M kernel below {SMALL_M_ROWS if dtype == torch.float32 else SMALL_M_ROWS_BF16} rows" if small_m else ""
    return f"{str(dtype).removeprefix('torch.')}: " + ", ".join(filter(None, [small, "oneDNN on prepacked weights" if onednn else "F.linear"]))


@dataclass
class GGUFBlocks:
    """A linear weight [N, K] from a GGUF file's Q4_1, Q4_0 or Q8_0 blocks (32 values along K
    each), in the lane layout csrc/linear_cpu.cpp reads (described there; weights.write_gguf_blocks
    makes it): Q4_1: qs uint8 [N, K/2], scales and mins float32 [N, K/32] (Q4_0: mins = -8 scales);
    Q8_0: qs int8 [N, K], scales."""
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    q8: "Q8Panels | None" = field(default=None, repr=False, compare=False)   # gguf_q8_panels' copy, made at first use


def to_lanes(q: torch.Tensor, q4: bool) -> torch.Tensor:
    """Values q [N, K] -> csrc/linear_cpu.cpp's lane layout: value 8i + L of each group (64
    values for Q4_1, 32 for Q8_0) goes to 32-bit lane L, at nibble i (Q4_1) or byte i (Q8_0)."""
    N, K = q.shape
    if not q4:
        return q.view(N, K // 32, 4, 8).transpose(-1, -2).reshape(N, K)
    q = q.view(N, K // 64, 4, 2, 8)                                   # value 8 * (2 * byte + half) + lane
    return (q[:, :, :, 0] | q[:, :, :, 1] << 4).transpose(-1, -2).reshape(N, K // 2)


def from_lanes(qs: torch.Tensor, q4: bool) -> torch.Tensor:
    """to_lanes undone: rows in the lane layout -> the values q [T, K] (uint8 0..15 or int8)."""
    T = qs.shape[0]
    if not q4:
        return qs.view(T, -1, 8, 4).transpose(-1, -2).reshape(T, -1)
    b = qs.view(T, -1, 8, 4).transpose(-1, -2)                       # [T, K/64, 4 bytes, 8 lanes]
    return torch.stack([b & 15, b >> 4], dim=3).reshape(T, -1)       # value 8 * (2 * byte + half) + lane


# Below this many rows a float32 layer with GGUF blocks reads them instead of its float32 weight
# (a sixth of the bytes, more arithmetic to unpack them). The kernel unpacks each block once for up
# to 8 rows, but on an AVX2 CPU without integer dot products each row still costs its float32 FMAs
# and a load of x per FMA, where the panels reuse each load in registers: past 2 rows the blocks
# are bound by arithmetic, not memory, and lose. CPU ms per pass over all 121 of SmolLM2-135M's
# linear layers, 1 thread (CPU time: the 2 Zen 1 cores were shared with a loaded machine),
# 2026-11-27, at M = 1 / 2 / 3 / 4 / 5 / 8 / 16: blocks 35.7 / 49.1 / 61.2 / 63.5 / 80.9 / 112.7 /
# 223.1, float32 panels 54.8 / 60.0 / 52.2 / 60.2 / 61.6 / 83.1 / 135.4 (lm_head alone, Q8_0, M = 1
# / 2 / 5: 8.3 / 10.5 / 17.7 against 10.8 / 10.5 / 10.2). So a speculative verification pass (5
# rows at batch 1) keeps reading the float32 panels here; 8-bit activations against the blocks
# (integer dot products) would be the way to flat cost in M (docs/quantization.md).
GGUF_ROWS = 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, gguf: GGUFBlocks | None = None,
           float_out: bool = False, invariant: bool = False) -> torch.Tensor:
    """F.linear, with faster kernels on CPU: the GGUF's blocks at a few rows where the layer has
    them; our GEMM on the weight's panels (pack_weight) at any row count, in float32 on AVX2
    CPUs and in bfloat16 on AVX512_BF16 ones without AMX;
    elsewhere our small-M kernel for few rows (oneDNN and MKL are slow there), then oneDNN on the
    prepacked weight, or on the plain one without it. float_out: return float32 whatever the dtype
    (the logits); the bf16 panels then skip rounding their float32 sums to bf16 and back.
    invariant (batch-invariant mode): the panels (pack_weight(..., invariant=True)) at every row
    count and never the GGUF blocks; without panels, F.linear one row at a time (slow, warned)."""
    if x.device.type != "cpu" or x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        out = F.linear(x, weight, bias)
        return out.float() if float_out else out
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                      # [M, K]
    (M, K), N = x2.shape, weight.shape[0]
    small_m, onednn = _cpu_linear_kernels()
    bf16 = x.dtype == torch.bfloat16
    if invariant:
        out = _linear_invariant(x2, weight, bias, packed, float_out)
    elif small_m and gguf is not None and not bf16 and M < GGUF_ROWS:
        out = torch.ops.nanoserve_linear.linear_gguf(x2, gguf.qs, gguf.scales, gguf.mins, bias)
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


def gguf_linear(x: torch.Tensor, blocks: GGUFBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 against a weight's GGUF blocks at any row count, float32 sums
    (csrc/linear_cpu.cpp's linear_gguf: every product the float32 reference's, only the order of
    the sums differs) -> [..., N] float32. quantization="gguf" with GGUF_Q8_ACTIVATIONS off."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                      # [M, K]
    out = torch.ops.nanoserve_linear.linear_gguf(x2, blocks.qs, blocks.scales, blocks.mins, bias)
    return out.view(*x.shape[:-1], out.shape[-1])                     # [..., N]


# The integer paths (quantization="gguf", and "int8"'s lm_head where the GGUF's blocks are attached)
# read the GGUF's blocks with 8-bit activations (csrc/int8_cpu.cpp's linear_q8, llama.cpp's Q8_1
# against Q4_1 / Q8_0) at every row count, so a row's result never depends on its batch. ms per pass
# over a quantization="gguf" engine's 121 linear layers (benchmarks/hot.py's matmul_only_ms), 2
# threads of an AVX-512/VNNI Xeon, quiet, 2026-11-28, at 1 / 64 rows: 8.8 / 74 against 21.2 / 194
# with the float32 sums; the AVX2 build, torch held to AVX2, 10.5 / 118 against 20.2 / 202 (the
# lm_head alone at 1 row 0.7 against 1.6 ms). They change the tokens: the bounds they hold instead
# (teacher-forced top-1 >= 0.95 against transformers' float32 greedy tokens, perplexity within 1%,
# for Q4_1, Q4_0 and Q8_0, on the AVX2 and the VNNI build) are in test_all.py and docs/quantization.md.
# False: the float32 sums (gguf_linear) there instead, the float32 reference's products; read when
# the model is loaded (weights.quantize_linear).
GGUF_Q8_ACTIVATIONS = True
GGUF_Q8_GROUP = 32                        # a GGUF block: one activation scale per 32 values, as the weight's


def gguf_linear_q8(x2: torch.Tensor, blocks: GGUFBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 float32 [M, K] -> [M, N]: each row quantized per block of 32 to int8 (max |x| / 127, round
    half to even; llama.cpp's Q8_1, with the block sums for the mins' term), exact integer dot products per
    block, one float order across blocks (csrc/int8_cpu.cpp). The mins' term takes the sums of
    the *rounded* x, so the result is the rounded x times the weight (d q + m). (Summing x itself
    there leaves the rounding error times d q, with q in 0..15 never centred: 2.6% perplexity on
    SmolLM2 against 0.6%, docs/quantization.md.)"""
    return int8_linear(x2, gguf_q8_panels(blocks), bias, GGUF_Q8_GROUP)


@dataclass
class Q8Panels:
    """A weight for csrc/int8_cpu.cpp's linear_q8 (8-bit activations, exact int32 sums; the layout
    is described there), made once by pack_q8: panels of 8 output columns, K in blocks of 32.
    w uint8 [ceil(N/8), ceil(K/32), 256] (8-bit weights as q + 128) or [..., 128] (Q4's nibbles);
    the GGUF's d (and Q4's m) float16 [ceil(N/8), ceil(K/32), 8]; or int8's per-channel scales sw
    float32 [ceil(N/8) * 8] (zeros pad N and K)."""
    w: torch.Tensor
    out_features: int
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    sw: torch.Tensor | None = None

    @property
    def group(self) -> int:
        """x's values per 8-bit scale this weight runs with: a GGUF block (d given), else INT8_GROUP."""
        return GGUF_Q8_GROUP if self.d is not None else INT8_GROUP


def pack_q8(q: torch.Tensor, d: torch.Tensor | None = None, m: torch.Tensor | None = None,
            sw: torch.Tensor | None = None) -> Q8Panels:
    """q [N, K]: int8 (int8 weights with sw [N], or Q8_0 with d [N, K/32]) or uint8 0..15 (Q4, with d
    and m [N, K/32]) -> Q8Panels."""
    N, K = q.shape
    P, nb = -(-N // 8), -(-K // 32)
    q = F.pad(q, (0, nb * 32 - K, 0, P * 8 - N))                      # [8P, 32 nb]
    if m is not None:                                                 # byte (t, c, j): values 4t + j | 16 + 4t + j << 4
        v = q.view(P, 8, nb, 2, 4, 4)                                 # [P, c, b, half, t, j]
        w = (v[:, :, :, 0] | v[:, :, :, 1] << 4).permute(0, 2, 3, 1, 4).reshape(P, nb, 128)
    else:
        v = (q.to(torch.int16) + 128).to(torch.uint8).view(P, 8, nb, 8, 4)   # [P, c, b, t, j]
        w = v.permute(0, 2, 3, 1, 4).reshape(P, nb, 256)
    def per_block(s):                                                 # [N, nb] -> float16 [P, nb, 8]
        return None if s is None else F.pad(s.float(), (0, 0, 0, P * 8 - N)).view(P, 8, nb).transpose(1, 2).half().contiguous()
    return Q8Panels(w.contiguous(), N, per_block(d), per_block(m),
                    None if sw is None else F.pad(sw.float(), (0, P * 8 - N)).contiguous())


def gguf_q8_panels(blocks: GGUFBlocks) -> Q8Panels:
    """The blocks repacked for linear_q8, once per GGUFBlocks (kept on it). d and m are the file's
    float16 halves, so the copy holds the same weights exactly."""
    if blocks.q8 is None:
        q4 = blocks.mins is not None
        blocks.q8 = pack_q8(from_lanes(blocks.qs, q4), blocks.scales, blocks.mins)
    return blocks.q8


def quantize_int8(weight: torch.Tensor) -> Q8Panels:
    """weight float [N, K] -> Q8Panels for quantization="int8": per output channel, symmetric,
    q = round(w / s) with s = max_k |w[n, k]| / 127 (round half to even, |q| <= 127; a zero row has s = 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(1)                                            # [N]
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)   # [N, K]
    return pack_q8(q, sw=amax / 127)


# Activation values per 8-bit scale in quantization="int8". vLLM's dynamic W8A8 takes one per token
# (INT8_GROUP >= K); on SmolLM2 that measured (2026-11-27, Zen 1) top-1 agreement 0.895 with the
# float32 greedy tokens (229/256, teacher-forced, the 8 parity prompts) and perplexity 1.0145x
# float32's on test_all's CORPUS: the outliers of the normed hidden states (qkv_proj's input) and
# of SwiGLU's output (down_proj's) flatten the small values beside them. Groups of 64 along K (as
# llama.cpp's 32-value blocks, coarser) measured docs/quantization.md's figures, within the 95%
# and 1%. The cost is one int-to-float fold per group of 64 in the kernel. (A multiple of 32.)
INT8_GROUP = 64


def int8_linear(x: torch.Tensor, w8: Q8Panels, bias: torch.Tensor | None = None,
                group: int | None = None) -> torch.Tensor:
    """x [..., K] float32 against a Q8Panels (quantize_int8's, or the GGUF blocks' gguf_q8_panels)
    -> [..., N] float32: each row of x quantized to 8 bits with a scale per `group` values (a
    multiple of 32, or >= K for one per row; max |x| / 127; default w8.group: INT8_GROUP, or 32 for
    the GGUF's blocks), exact int32 dot products per group, summed in float32 in a fixed order
    (csrc/int8_cpu.cpp's linear_q8). A row's result never depends on the rows beside it."""
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()               # [M, K]
    out = torch.ops.nanoserve_linear.linear_q8(x2, w8.w, w8.d, w8.m, w8.sw, w8.out_features,
                                               group or w8.group, bias)
    return out.view(*x.shape[:-1], w8.out_features)                  # [..., N]


def _linear_invariant(x2, weight, bias, packed, float_out):
    """x2 [M, K] -> [M, N], each row by the same kernel and in the same order at every M."""
    if packed is not None and not packed.is_mkldnn:
        return torch.ops.nanoserve_linear.linear_panels(x2, packed, bias, float_out)
    _warn_rows_alone(tuple(weight.shape), str(x2.dtype))
    # one row per call: every row takes the M = 1 path of whatever F.linear runs
    return torch.cat([F.linear(row, weight, bias) for row in x2.split(1)]) if len(x2) else F.linear(x2, weight, bias)


@functools.cache
def _warn_rows_alone(shape, dtype):
    warnings.warn(f"batch-invariant mode: no csrc panels for a {dtype} weight {list(shape)} (kernel not built, "
                  f"or N not a multiple of the panel width); it runs F.linear one row at a time (slow)",
                  RuntimeWarning)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose forward is linear() above, with the
    weight's packed copy (pack_weight) made at the first call and remade if the weight is
    replaced or changed, and the GGUF blocks weights.attach_gguf_blocks gave it (dropped if the
    weight changes); or, where weights.quantize_linear set `quantized`, only that."""
    _packed = (None, None)                    # (which weight it was made from, packed copy)
    _packed_invariant = (None, None)          # the same for batch-invariant mode, where the copy may differ
    _gguf = (None, None)                      # (the weight it matches, GGUFBlocks): weights.py
    # what forward reads instead of `weight`, at every row count (weights.quantize_linear): Q8Panels
    # (int8, or the GGUF's blocks with 8-bit activations) or GGUFBlocks (float32 sums)
    quantized: "GGUFBlocks | Q8Panels | None" = None
    batch_invariant = False                   # model.Llama.set_batch_invariant sets it

    def q8_panels(self, rows: int) -> tuple[Q8Panels, int] | None:
        """(the packed weight, x's values per 8-bit scale) this layer runs csrc/int8_cpu.cpp's
        linear_q8 with at `rows` rows, else None (linear() or the GGUF's float32 sums). The one
        rule forward and any fused op follow; today the same answer at every row count, so a row's
        result never depends on its batch."""
        q = self.quantized
        return (q, q.group) if isinstance(q, Q8Panels) else None

    def forward(self, x, float_out=False):
        q8 = self.q8_panels(x.numel() // x.shape[-1])
        if q8 is not None:                    # float32 out, the logits included
            return int8_linear(x, q8[0], self.bias, q8[1])
        if self.quantized is not None:
            return gguf_linear(x, self.quantized, self.bias)
        return linear(x, self.weight, self.bias, *self.prepared(), float_out=float_out,
                      invariant=self.batch_invariant)

    def weight_key(self):
        w = self.weight
        # inference tensors keep no version counter: for them only a new weight is noticed
        return (w.data_ptr(), w.dtype, w.device, None if w.is_inference() else w._version)

    def prepared(self) -> tuple[torch.Tensor | None, GGUFBlocks | None]:
        """(the packed copy, GGUF blocks) for the current weight, checked with one key per
        call (at batch 1 a step makes 121 of these calls): the copy is remade and the blocks
        dropped once the weight is replaced or changed."""
        if self.quantized is not None:        # no float32 weight read
            return None, self.gguf_blocks()
        key = self.weight_key()
        slot, other = ("_packed_invariant", self._packed) if self.batch_invariant else ("_packed", self._packed_invariant)
        if getattr(self, slot)[0] != key:
            # one copy for both modes where both read the same kind (float32 panels on AVX2): a model
            # shared by engines of both modes (bench.py) neither repacks per step nor holds it twice
            same = other[0] == key and pack_kind(self.weight, True) == pack_kind(self.weight, False)
            setattr(self, slot, (key, other[1] if same else pack_weight(self.weight, self.batch_invariant)))
        return getattr(self, slot)[1], self.gguf_blocks()

    def packed_weight(self) -> torch.Tensor | None:
        return self.prepared()[0]

    def gguf_blocks(self) -> GGUFBlocks | None:
        """The GGUF blocks this layer reads or was given for its current weight (packs nothing)."""
        if self.quantized is not None:
            return self.quantized if isinstance(self.quantized, GGUFBlocks) else None
        return self._gguf[1] if self._gguf[0] == self.weight_key() else None
