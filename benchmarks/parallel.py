"""
Tensor parallelism on this machine (parallel.py), for bench.py's `parallel` section: the same requests
at tp = 1, 2 and 3, with the same total threads (tp ranks share them; on 2 cores tp = 3 cannot, and
gets one thread per rank: 3 on 2 cores, said in the table). The model is a random Llama shaped like
SmolLM2-135M except for its heads (12 query, 6 KV: they split over 2 and 3 ranks; SmolLM2's 9 do not
split over 2). Reported: output tok/s and its ratio to tp = 1, the decode step time, and rank 0's
seconds in collectives per step (the all-reduces after o_proj and down_proj, the embedding's, and
lm_head's gather: waiting for the slowest rank is part of it). One machine's cores split among ranks
do the same FLOPs as one process using them all, plus the collectives: no gain is expected from the
FLOPs. A last row, tp = 1 with one thread, is the control for what one-thread ranks avoid: OpenMP's
barriers between the threads of one process, where a thread descheduled on busy cores stalls the rest.
"""
import os
import shutil
import tempfile
import time

import torch

from benchmarks.harness import greedy, md_table, section_header


def make_checkpoint(out_dir: str, layers: int) -> str:
    """A random Llama checkpoint in Hugging Face's layout (config.json + model.safetensors, tied embeddings),
    written directly: the runtime requirements alone build it (transformers is only a test oracle). Weights
    normal(0, 0.02), norms at 1, as transformers initialises a Llama; their values do not change the time."""
    import json
    from safetensors.torch import save_file
    from weights import resolve_model_dir
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
               intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=6,
               max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]            # KV heads x head_dim
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    tensors = {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
               for name, shape in shapes.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shutil.copy(os.path.join(resolve_model_dir(None), "gguf_tokenizer.json"), out_dir)   # SmolLM2's tokenizer
    return out_dir


def run_one(model_dir: str, tp: int, threads: int, batch: int, prompt_len: int, out_len: int) -> dict:
    from llm import LLM
    llm = LLM(model_dir, tensor_parallel_size=tp, num_threads=threads, dtype="float32", device="cpu",
              kv_cache_memory="64MiB")
    engine = llm.engine
    try:
        prompts = [[(7 * i + j) % 40000 + 100 for j in range(prompt_len)] for i in range(batch)]
        llm.generate(prompts[:2], greedy(4))                         # warm: first calls, packed weights
        comm = engine.tp.comm if engine.tp else None
        seconds0, calls0 = (comm.seconds, comm.calls) if comm else (0.0, 0)
        steps0, forward0 = engine.num_steps, engine.phase_times.forward
        t0 = time.perf_counter()
        llm.generate(prompts, greedy(out_len))
        wall = time.perf_counter() - t0
        steps = engine.num_steps - steps0
        return {"tp": tp, "threads_per_rank": max(1, threads // tp),
                "out_tok_s": batch * out_len / wall, "wall_s": wall, "steps": steps,
                "forward_ms_per_step": 1e3 * (engine.phase_times.forward - forward0) / steps,
                "collective_ms_per_step": 1e3 * ((comm.seconds - seconds0) if comm else 0.0) / steps,
                "collectives_per_step": ((comm.calls - calls0) if comm else 0) / steps}
    finally:
        engine.shutdown()


def bench_parallel(sz, seed, results):
    quick = sz.name == "quick"
    layers, batch, prompt_len, out_len = (4, 4, 16, 8) if quick else (30, 8, 64, 32)
    threads = os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(tmp, layers)
        # the last row is a control: one process with one thread, no OpenMP barriers between threads
        # (on busy shared cores a descheduled thread stalls the other at every barrier; ranks of one
        # thread each do not have them)
        rows = [run_one(model_dir, tp, n, batch, prompt_len, out_len) for tp, n in ((1, threads), (2, threads),
                                                                                  (3, threads), (1, 1))]
    base = rows[0]["out_tok_s"]
    for r in rows:
        r["ratio_to_tp1"] = r["out_tok_s"] / base
    section_header("Tensor parallelism on this machine (gloo, one process per rank)", [
        f"A random Llama of SmolLM2-135M's shape with 12 query / 6 KV heads, {layers} layers, float32; {batch} "
        f"requests of {prompt_len} prompt tokens and {out_len} output tokens at once; {threads} threads in all "
        f"(tp = 3 gets one per rank: {3 if threads < 3 else threads // 3 * 3} threads on {threads} cores).",
        "Collective ms/step: rank 0's time in all-reduce and gather, waiting for the slowest rank included. "
        "Ranks on one machine split the same cores: no gain is expected from the FLOPs, only the collectives' cost; "
        "the last row (tp = 1, one thread) shows what one process loses to its threads' OpenMP barriers here."])
    cols = ["tp", "threads_per_rank", "out_tok_s", "ratio_to_tp1", "forward_ms_per_step", "collective_ms_per_step",
            "collectives_per_step"]
    print(md_table(["tp", "threads/rank", "out tok/s", "vs tp=1", "forward ms/step", "collectives ms/step",
                    "collectives/step"], [[r[c] for c in cols] for r in rows]))
    results["parallel"] = {"layers": layers, "batch": batch, "prompt_len": prompt_len, "out_len": out_len,
                           "threads": threads, "rows": rows}
