"""
The Llama-family decoder, run on a ragged batch.

forward() takes the tokens of many sequences packed into one flat tensor [num_tokens] with their
positions: no padding anywhere. Each layer writes its new K/V into the paged pool and attends
through paged_attention.py; logits are computed only for the rows the engine will sample from
(the last token of each sequence that finishes its chunk).
This file owns the math and the layers (Llama, Qwen2 and Mistral share them), the RoPE tables
and the compute dtype ("auto": bfloat16 where the CPU multiplies bf16 natively). The linear
layers' CPU kernels live in cpu_linear.py; the fused per-layer ops are at the end of this file. It does
not know about blocks, queues or sampling: model_runner.py hands it flat tensors (input ids,
positions, an AttentionMetadata); weights.py loads the weights.
"""
import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import paged_attention
from cpu_linear import Linear, cpu_bf16_native
from extensions import decoder_layer_op_available, fused_ops_available
from paged_attention import AttentionMetadata


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


# ---------------------------------------------------------------------------- dtype

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
        self.batch_invariant = False          # Llama.set_batch_invariant
        self.fused_cache = True               # RoPE + KV-cache write as one op where it applies (bench compares)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, fused=False):
        T = x.shape[0]
        qkv = self.qkv_proj(x)                                        # [T, (nh + 2*nkv) * hd]
        k_cache, v_cache = kv_cache
        rope_and_cache_(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, self.n_heads, self.n_kv,
                        self.head_dim, fused, meta.backend, one_op=self.fused_cache)
        q = qkv[:, :self.n_heads * self.head_dim].view(T, self.n_heads, self.head_dim)   # [T, nh, hd], a view of qkv
        o = paged_attention.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                            meta.query_start_loc, self.scale, backend=meta.backend,
                                            cuda_plan=meta.cuda_plan, batch_invariant=self.batch_invariant)
        return self.o_proj(o.reshape(T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, fused=False):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), fused))   # [T, 2 * inter] -> [T, hidden]


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP. Where every linear of the layer runs 8-bit activations (int8, or
    the GGUF's blocks from q8_rows rows on) on the CPU attention backend, the whole layer runs as ONE
    op, csrc/decoder_layer_cpu.cpp's decoder_layer, which calls the same kernels in the same order:
    at one row a layer's int8 matmuls take ~400 us, and the ~10 ops, views and 9 module calls around
    them cost ~145-220 us a layer of Python and dispatch, ~90-140 us as one op (this Xeon, native and
    held to AVX2, `bench.py step`, results/*-4ccfb78*; ~250 us a layer on the bf16 path earlier). forward() below is that op's readable reference, and the path
    everywhere else."""
    layer_op = True                           # the one-op path where it applies (bench.py step turns it off)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self._op_weights = None               # (the Q8Panels they came from, weights, ints): layer_op_weights

    def forward(self, x, residual, cos, sin, kv_cache, meta, fused=False, keep=None):
        """x: the last block's output, not yet added to residual (None before the first layer).
        keep: rows to carry past attention (the last layer passes the rows that get logits).
        -> (this layer's MLP output, residual stream without it): the add is fused into the next norm."""
        op = self.layer_op_weights(x, meta, fused)
        if op is not None:
            attn = self.self_attn
            return torch.ops.nanoserve_layer.decoder_layer(
                x, residual, *op, self.input_layernorm.eps, cos, sin, *kv_cache, meta.slot_mapping,
                meta.block_tables, meta.context_lens, meta.query_start_loc, attn.scale, attn.n_heads, attn.n_kv,
                attn.head_dim, attn.batch_invariant, keep)
        x, residual = self.input_layernorm(x, residual, fused)
        x = self.self_attn(x, cos, sin, kv_cache, meta, fused)
        if keep is not None:                  # [T, hidden] -> [num_sampled, hidden]
            x, residual = x[keep], residual[keep]
        x, residual = self.post_attention_layernorm(x, residual, fused)
        return self.mlp(x, fused), residual

    def linears(self) -> tuple[Linear, ...]:
        return self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj

    def layer_op_weights(self, x, meta, fused) -> tuple[list, list[int]] | None:
        """(weights, ints) for csrc/decoder_layer_cpu.cpp where the layer runs as one op, else None: CPU
        attention and fused ops, float32 activations, the two norms on one eps, and every linear on
        linear_q8 at x's rows (cpu_linear.Linear.q8_panels, the rule each linear's own forward follows;
        other linear classes keep the Python path). weights: the two norms', then each linear's
        (w, d, m, sw, bias); ints: each linear's (out_features, group). Made once, kept while the
        layer holds the same packed weights."""
        if not (self.layer_op and fused is True and meta.backend == "cpu" and x.dtype == torch.float32
                and self.self_attn.fused_cache and decoder_layer_op_available()
                and self.input_layernorm.eps == self.post_attention_layernorm.eps):
            return None
        args = [linear.q8_panels(x.shape[0]) if isinstance(linear, Linear) else None for linear in self.linears()]
        if None in args:
            return None
        panels = [p for p, _ in args]
        if self._op_weights is None or any(a is not b for a, b in zip(self._op_weights[0], panels)):
            weights = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
            for (p, _), linear in zip(args, self.linears()):
                weights += [p.w, p.d, p.m, p.sw, linear.bias]
            self._op_weights = panels, weights, [v for p, group in args for v in (p.out_features, group)]
        return self._op_weights[1:]


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
        self.batch_invariant = False  # set_batch_invariant
        self.rope_table = None        # batch-invariant mode: (cos, sin) [max_position_embeddings, head_dim/2]
        self._layers_op = None        # (each layer's op weights, joined weights, joined ints): layers_op_args

    def set_batch_invariant(self, on: bool):
        """Batch-invariant mode (docs/batch-invariance.md): every linear layer and attention call takes
        its batch-invariant kernel, and RoPE reads cos/sin from a table made once: torch's cos() of a
        whole step may split it between threads at a point where one thread's vector tail, computed
        by the scalar libm, meets the other's vector code, and the two can round apart."""
        for m in self.modules():
            if isinstance(m, (Linear, Attention)):
                m.batch_invariant = on
        self.batch_invariant = on
        if on and self.rope_table is None:   # kept when turned off: engines sharing the model take turns
            pos = torch.arange(self.config.max_position_embeddings, device=self.embed_tokens.weight.device)
            freqs = pos.unsqueeze(1).float() * self.inv_freq.to(pos.device)              # [max_pos, head_dim/2]
            self.rope_table = (freqs.cos(), freqs.sin())

    def with_batch_invariant(self, on: bool) -> "Llama":
        """This model in batch-invariant mode `on`, chosen once, when an engine is built. A model engines
        share (bench.py runs several on one set of weights) is never switched under another engine: an
        engine in the other mode gets a copy of the module tree over the very same tensors."""
        model = self if self.batch_invariant == on else copy_module_tree(self)
        model.set_batch_invariant(on)
        return model

    def prepare(self):
        """Do now what the first forward pass would: make every linear layer's packed copy (~0.2 s)
        and load the fused ops' library (built here on a first run)."""
        for layer in self.modules():
            if isinstance(layer, Linear):
                layer.prepared()
        fused_ops_available(self.embed_tokens.weight.device, self.embed_tokens.weight.dtype)

    def layers_op_args(self, x, meta, fused) -> tuple[list, list[int]] | None:
        """(weights, ints) for csrc/decoder_layer_cpu.cpp's decoder_layers where every layer runs as one
        op (DecoderLayer.layer_op_weights), else None: each layer's in turn, joined once and kept while
        the layers keep the same ones. A loop of one op per layer from Python cost ~90 us a layer here
        between the ops, in statements that run slowly after a layer's matmuls (bench.py step)."""
        per_layer = [layer.layer_op_weights(x, meta, fused) for layer in self.layers]
        if any(op is None for op in per_layer):
            return None
        cached = self._layers_op
        if cached is None or any(a is not b for a, (b, _) in zip(cached[0], per_layer)):
            weights = [t for w, _ in per_layer for t in w]
            self._layers_op = cached = ([w for w, _ in per_layer], weights, [v for _, ints in per_layer for v in ints])
        return cached[1], cached[2]

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_indices):
        """input_ids, positions: [num_tokens]; kv_caches: per layer (k_cache, v_cache);
        logits_indices: [num_sampled] rows of the flat batch to compute logits for.
        Returns float32 logits [num_sampled, vocab]."""
        x = self.embed_tokens(input_ids)                                  # [T, hidden]
        fused = self.use_fused_ops and fused_kernels(x.device, x.dtype, meta.backend)
        if self.batch_invariant:
            cos, sin = (t.index_select(0, positions) for t in self.rope_table)   # float32 [T, head_dim/2]
        else:
            freqs = positions.unsqueeze(1).float() * self.inv_freq        # [T, head_dim/2]
            cos, sin = freqs.cos(), freqs.sin()                           # float32 [T, head_dim/2]
        # Past the last layer's attention only the rows that get logits matter: every token's K
        # and V are cached by then, so a prompt chunk's other rows skip that layer's MLP.
        one_op = self.layers_op_args(x, meta, fused)
        if one_op is not None:                # every layer as one op: the loop below, in C++
            attn = self.layers[0].self_attn
            x, residual = torch.ops.nanoserve_layer.decoder_layers(
                x, *one_op, self.layers[0].input_layernorm.eps, cos, sin, [k for k, _ in kv_caches],
                [v for _, v in kv_caches], meta.slot_mapping, meta.block_tables, meta.context_lens,
                meta.query_start_loc, attn.scale, attn.n_heads, attn.n_kv, attn.head_dim, attn.batch_invariant,
                logits_indices)
        else:
            residual, last = None, len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                keep = logits_indices if i == last else None
                x, residual = layer(x, residual, cos, sin, kv_cache, meta, fused, keep)
        x, _ = self.norm(x, residual, fused)                              # [num_sampled, hidden]
        return self.lm_head(x, float_out=True)                            # [num_sampled, vocab]


def copy_module_tree(module: nn.Module) -> nn.Module:
    """A new object for every module (so each copy keeps its own flags), over the same parameters,
    buffers and packed weights: no tensor is copied."""
    clone = copy.copy(module)
    clone.__dict__.update(_parameters=dict(module._parameters), _buffers=dict(module._buffers),
                          _modules={name: m and copy_module_tree(m) for name, m in module._modules.items()})
    return clone


# Fused per-layer ops: residual add + RMSNorm, RoPE in place (and with the KV-cache write), SwiGLU's
# silu(gate) * up.
#
# Each layer's small elementwise ops cost a PyTorch dispatch and a temporary each (on a GPU, a
# kernel launch each): ~10 per layer, 300 per decode step. csrc/fused_cpu.cpp does each group in one
# pass over the rows; the same library holds the sampler's row kernels (argmax, exp, top-k/top-p
# thresholds: sampler.py). On the CUDA attention backend csrc/fused_cuda.cu does the same in one
# launch each (ops registered beside the attention ops: torch.ops.nanoserve_cuda). The plain-PyTorch
# version beside each op is its reference (the tests' oracle) and what runs elsewhere, or where the
# C++ build failed (after one warning). `fused` below: False (the reference), True (the CPU ops) or
# the ops namespace to call. Owns no weights and no layers: model.py calls these with its own tensors.

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


def rope_and_cache_(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                    fused=False, backend="torch", one_op=True):
    """RoPE on q and k of qkv [T, (nh + 2 nkv) hd] in place, then each row's k and v into its slot of the
    paged cache (slot -1: not cached). Fused, one op (one_op=False: bench.py's before): the CUDA
    library's kernel (a pass over qkv instead of two), or the CPU op where the cache has qkv's dtype (or
    is bfloat16 under float32 qkv);
    else rope_ then the attention backend's reshape_and_cache, its reference."""
    if one_op and not isinstance(fused, bool):                                   # the CUDA ops
        return fused.rope_and_cache_(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads)
    if fused is True and one_op and key_cache.dtype == value_cache.dtype and (
            key_cache.dtype == qkv.dtype or (qkv.dtype, key_cache.dtype) == (torch.float32, torch.bfloat16)):
        return torch.ops.nanoserve_fused.rope_and_cache_(qkv, cos, sin, key_cache, value_cache, slot_mapping,
                                                         num_heads, num_kv_heads, head_dim)
    rope_(qkv, cos, sin, num_heads + num_kv_heads, head_dim, fused)   # q and k sit side by side
    T, q_width, kv_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_width:q_width + kv_width].view(T, num_kv_heads, head_dim)         # [T, nkv, hd], strided views
    v = qkv[:, q_width + kv_width:].view(T, num_kv_heads, head_dim)
    paged_attention.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, backend=backend)


def silu_and_mul(gate_up, fused=False):
    """SwiGLU's middle: silu(gate) * up, for gate_up = [gate | up] [T, 2 * intermediate]."""
    if fused:
        return _ops(fused).silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)                                          # [T, intermediate] each
    return F.silu(gate) * up
