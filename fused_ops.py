"""
Fused per-layer ops: residual add + RMSNorm, RoPE in place, SwiGLU's silu(gate) * up.

Each layer's small elementwise ops cost a PyTorch dispatch and a temporary each (on a GPU, a
kernel launch each): ~10 per layer, 300 per decode step. csrc/fused_cpu.cpp does each group in one
pass over the rows; the same library holds the sampler's row kernels (argmax, exp, top-k/top-p
thresholds: sampler.py). On the CUDA attention backend csrc/fused_cuda.cu does the same in one
launch each (ops registered beside the attention ops: torch.ops.nanoserve_cuda). The plain-PyTorch
version beside each op is its reference (the tests' oracle) and what runs elsewhere, or where the
C++ build failed (after one warning). `fused` below: False (the reference), True (the CPU ops) or
the ops namespace to call. Owns no weights and no layers: model.py calls these with its own tensors.
"""
import functools

import torch
import torch.nn.functional as F

import extensions


@functools.cache
def _fused_cpu_built() -> bool:
    return extensions.try_load("fused_cpu", "RMSNorm, RoPE and SwiGLU run as separate PyTorch ops (slower)")


def fused_ops_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _fused_cpu_built()


def fused_kernels(device: torch.device, dtype: torch.dtype, attention_backend: str):
    """What model.py passes as `fused`: the CUDA library's ops on the CUDA attention backend (built
    with it; "cuda_emu" is its CPU emulation in tests), the CPU ops where they apply, else False."""
    if attention_backend in ("cuda", "cuda_emu") and dtype in (torch.float32, torch.bfloat16, torch.float16):
        return getattr(torch.ops, f"nanoserve_{attention_backend}")
    return fused_ops_available(device, dtype)


def _ops(fused):
    return torch.ops.nanoserve_fused if fused is True else fused


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (Hugging Face layout). x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, 1, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
        out = _ops(fused).rms_norm(x, weight, eps) if fused else rms_norm_reference(x, weight, eps)
        return out, x
    if fused:
        _ops(fused).add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def rope_(qkv, cos, sin, num_heads, head_dim, fused=False):
    """Rotate the first num_heads heads (q, then k) of every row of qkv [T, width] in place.
    cos/sin: float32 [T, head_dim/2]."""
    if fused:
        return _ops(fused).rope_(qkv, cos, sin, num_heads, head_dim)
    x = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)               # [T, heads, hd]
    x.copy_(apply_rope(x, cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)))


def silu_and_mul(gate_up, fused=False):
    """SwiGLU's middle: silu(gate) * up, for gate_up = [gate | up] [T, 2 * intermediate]."""
    if fused:
        return _ops(fused).silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)                                          # [T, intermediate] each
    return F.silu(gate) * up
