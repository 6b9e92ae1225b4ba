"""
What batch-invariant mode (docs/batch-invariance.md) costs and what it buys, for bench.py's `invariance`
section:

  throughput   the peers workload (bench_peers' requests) on an engine with and without
               batch_invariant, at the default dtype, taking turns step by step (and in bfloat16 too
               where oneDNN has a bf16 path); target: the mode keeps >= 0.9x of the default;
  agreement    N prompts sharing a one-block prefix, greedy with logprobs, in bfloat16 (float32 in
               --quick where bf16 is not native), run alone (batch 1) and in five other configurations (in a batch with unrelated requests, after a
               prefix-cache hit, in chunks of 64 and of 512 tokens, after a recompute preemption): how
               many outputs differ from alone in a token or a logprob's bits, with and without the flag.
Engines share one set of weights per dtype (harness.make_engine); a shared model follows the mode of
whichever engine steps (Engine.step), so the two engines can take turns.
"""
import random

import torch

from benchmarks.harness import (greedy, make_engine, make_workload, md_table, model_dtype, random_prompt,
                                run_interleaved, run_timed, section_header, warm_up)
from kv_cache import bytes_per_block


def throughput(sz, seed, dtype):
    """useful tok/s of the peers workload with the default kernels and in batch-invariant mode, in turn."""
    reqs = make_workload(sz.peer_requests, seed + 3, sz.peer_out_range, sz.peer_prompt_median, 49152)
    engines = {flag: make_engine(kv_cache_memory=sz.peer_kv_cache_memory, max_num_seqs=sz.peer_max_num_seqs,
                                 enable_prefix_caching=False, dtype=dtype, batch_invariant=flag)
               for flag in (False, True)}
    for e in engines.values():
        warm_up(e, sz)
    runs = run_interleaved([(e, reqs) for e in engines.values()], f"invariance: {dtype} default and invariant, in turn")
    default, invariant = (r["useful_tok_s"] for r in runs)
    return {"dtype": model_dtype(engines[False]), "num_requests": len(reqs), "default_tok_s": default,
            "invariant_tok_s": invariant, "invariant_over_default": invariant / default}


def agreement_prompts(sz, seed):
    """N prompts of a shared 24-token prefix plus 6 tokens of their own: two blocks of 16, which their
    4 output tokens grow into a third (so a small pool preempts them)."""
    rng = random.Random(seed)
    prefix = random_prompt(rng, 24, 49152)
    n = 4 if sz.name == "quick" else 16
    return prefix, [prefix + random_prompt(rng, 6, 49152) for _ in range(n)]


def agreement_dtype(sz):
    """bfloat16, the serving dtype whose rounding makes batches disagree; --quick takes float32 where the CPU
    has no native bf16 (F.linear in bf16 is several times slower there, and the smoke test only needs the path)."""
    import cpu_linear
    return "float32" if sz.name == "quick" and not cpu_linear.cpu_bf16_native()[0] else "bfloat16"


def configurations(prefix, prompts, batch_invariant, crowd, dtype):
    """{configuration: [(tokens, logprobs)] of `prompts`}, greedy with 2 logprobs, 4 tokens."""
    params = greedy(4)
    params.logprobs = 2
    kw = dict(dtype=dtype, kv_cache_memory="256MiB", enable_prefix_caching=False, batch_invariant=batch_invariant)

    def outputs(engine, ps, p=params):
        outs, _, _ = run_timed(engine, ps, [p] * len(ps), "agree")
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    alone = make_engine(**kw)
    runs = {"alone": [outputs(alone, [p])[0] for p in prompts]}
    mixed = [x for pair in zip(crowd, prompts + [None] * len(crowd)) for x in pair if x is not None]
    got = outputs(alone, mixed, params)
    runs[f"in a batch of {len(mixed)}"] = [got[mixed.index(p)] for p in prompts]
    cached = make_engine(**{**kw, "enable_prefix_caching": True})
    outputs(cached, [prefix + [300, 301]])                         # caches the shared prefix's full block
    runs["prefix cache hit"] = outputs(cached, prompts)
    for budget in (64, 512):
        runs[f"chunks of {budget}"] = outputs(make_engine(**{**kw, "max_num_batched_tokens": budget}), prompts)
    small = make_engine(**{**kw, "kv_cache_memory": 8 * bytes_per_block(30, 16, 3, 64, getattr(torch, dtype)),
                           "max_num_batched_tokens": 64})
    runs["after recompute preemption"] = outputs(small, prompts)
    if small.scheduler.num_preemptions == 0:
        raise RuntimeError("the small pool preempted nothing: the preemption configuration did not run")
    return {name: sum(a != b for a, b in zip(outs, runs["alone"])) for name, outs in runs.items() if name != "alone"}


def bench_invariance(sz, seed, results):
    """What does batch-invariant mode cost in throughput, and does it make every configuration agree?"""
    tp = [throughput(sz, seed, "auto")]
    if tp[0]["dtype"] != "bfloat16" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        tp.append(throughput(sz, seed, "bfloat16"))
    prefix, prompts = agreement_prompts(sz, seed)
    batch = 16 if sz.name == "quick" else 64          # bf16 runs F.linear where the CPU has no bf16 path: slow
    crowd = [random_prompt(random.Random(seed + i), 5 + 3 * (i % 6), 49152) for i in range(batch - len(prompts))]
    dtype = agreement_dtype(sz)
    differ = {flag: configurations(prefix, prompts, flag, crowd, dtype) for flag in (True, False)}
    section_header("Batch-invariant mode: its cost and what it buys", [
        f"throughput: the peers workload ({tp[0]['num_requests']} requests, greedy, prefix caching off), an engine "
        "with and one without batch_invariant taking turns step by step.",
        f"agreement: {len(prompts)} prompts of 30 random ids sharing a 24-token prefix, greedy, 4 tokens, 2 logprobs, "
        f"{dtype}; an output differs if a token or a logprob's bits differ from the prompt run alone (batch 1)."])
    print(md_table(["dtype", "default tok/s", "batch-invariant tok/s", "invariant / default"],
                   [[t["dtype"], t["default_tok_s"], t["invariant_tok_s"], t["invariant_over_default"]] for t in tp]))
    print()
    print(md_table(["configuration", f"differing of {len(prompts)}, batch-invariant", "differing, default"],
                   [[name, differ[True][name], differ[False][name]] for name in differ[True]]))
    results["invariance"] = {"throughput": tp, "num_prompts": len(prompts), "agreement_dtype": dtype,
                             "differing": {"batch_invariant": differ[True], "default": differ[False]}}
