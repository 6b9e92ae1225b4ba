"""
bench_batching.py: the experiments about how requests share the engine: batching, KV memory, caching.

Owns five experiments, each a question with its workload and its table: static vs continuous batching,
the paged pool vs a contiguous reservation, prefix caching (shared prefix and multi-turn), copy-on-write
for n = 4 samples, and swap vs recompute preemption. They drive the engine only through its public API
and bench_engine.py; hardware ceilings live in bench_hardware.py and HTTP in bench_online.py.
"""
import random
import statistics

from benchmarks.harness import (ENGINE_OVERRIDES, bench_device, describe_graph_use, greedy, make_engine, make_workload,
                                md_table, pct, random_prompt, run_interleaved, run_timed, section_header, vocab_of,
                                warm_up)


def static_waste_closed_form(lengths, batch_size):
    """1 - (useful rows / rows computed) when batches are consecutive groups padded to their longest."""
    useful = reserved = 0
    for i in range(0, len(lengths), batch_size):
        lens = lengths[i:i + batch_size]
        useful += sum(lens)
        reserved += len(lens) * max(lens)
    return 1 - useful / reserved


def measured_padding(steps, field, useful_rows):
    """Share of rows computed for nothing, as the engine counted them (EngineStats `field` per step)."""
    padding = sum(getattr(stats, field) for _, stats in steps)
    return padding / (padding + useful_rows)


def bench_throughput(sz, seed, results):
    """How much more useful work does continuous batching do than static batching on identical requests?"""
    # the continuous engine twice: with its async_scheduling (on with CUDA, off on a CPU, or bench.py's flag)
    # and with the other setting, so one run compares the overlapped loop with the plain one
    overlap = ENGINE_OVERRIDES.get("async_scheduling", bench_device().type == "cuda")
    twin = f"continuous, async scheduling {'off' if overlap else 'on'}"
    contenders = [("continuous", {}), (twin, dict(async_scheduling=not overlap))] + [
        (f"static bs={b}", dict(scheduler_mode="static", static_batch_size=b)) for b in sz.static_sizes]
    caps, jobs, reqs = dict(sz.static_max_requests), [], None
    for name, kw in contenders:   # prefix caching off: no mode may find another's prompts cached
        engine = make_engine(kv_cache_memory=sz.kv_cache_memory, enable_prefix_caching=False,
                             max_num_seqs=max(kw.get("static_batch_size", 0), sz.max_num_seqs), **kw)
        reqs = reqs or make_workload(sz.num_requests, seed, sz.out_range, sz.prompt_median, vocab_of(engine))
        warm_up(engine, sz)
        jobs.append((engine, reqs[:caps.get(kw.get("static_batch_size"), len(reqs))]))
    runs = run_interleaved(jobs, "continuous and static, step by step in turn")
    out = {}
    for (name, kw), (_, mine), r in zip(contenders, jobs, runs):
        rec = {k: r[k] for k in ("wall_s", "useful_tokens", "useful_tok_s", "total_tok_s", "num_steps", "preemptions",
                                 "graph_steps", "eager_steps")}
        rec["num_requests"] = len(mine)
        if b := kw.get("static_batch_size"):
            rec["slot_waste_measured"] = measured_padding(r["steps"], "num_padding_last_step", r["useful_tokens"])
            rec["slot_waste_closed_form"] = static_waste_closed_form([q.max_tokens for q in mine], b)
            rec["prompt_padding_measured"] = measured_padding(r["steps"], "num_prompt_padding_last_step",
                                                              sum(len(q.prompt) for q in mine))
            rec["prompt_padding_closed_form"] = static_waste_closed_form([len(q.prompt) for q in mine], b)
        out[name] = rec
    best = max((k for k in out if k.startswith("static")), key=lambda k: out[k]["useful_tok_s"])
    ratio = out["continuous"]["useful_tok_s"] / out[best]["useful_tok_s"]
    section_header("Throughput: static vs continuous batching", [
        f"{len(reqs)} requests, prompt lengths log-normal (median {sz.prompt_median}), outputs uniform "
        f"{sz.out_range[0]}-{sz.out_range[1]} ({sz.name} sizes); greedy, ignore_eos: identical useful work in every mode.",
        f"continuous: max_num_seqs={sz.max_num_seqs}; static: a batch is admitted together, prompts padded to the "
        "longest and finished members computing a throwaway token until the last ends (Hugging Face generate).",
        "static runs may take only the first requests (a static batch's speed does not depend on earlier batches).",
        f"KV pool {sz.kv_cache_memory}, prefix caching off; engines warmed up, then all run taking turns step by step.",
        "waste: padding rows / (padding + useful rows), counted by the engine, next to 1 - mean/max per batch."])
    cols = ["num_requests", "useful_tok_s", "total_tok_s", "wall_s", "num_steps", "slot_waste_measured",
            "slot_waste_closed_form", "prompt_padding_measured", "prompt_padding_closed_form", "preemptions"]
    print(md_table(["mode", "requests", "useful out tok/s", "total tok/s", "wall s", "steps", "slot waste measured",
                    "closed form", "prompt padding measured", "closed form", "preemptions"],
                   [[k] + [v.get(c, "-") for c in cols] for k, v in out.items()]))
    async_ratio = out[twin]["useful_tok_s"] / out["continuous"]["useful_tok_s"]
    if overlap:
        async_ratio = 1 / async_ratio
    print(f"\ncontinuous / best static ({best}): **{ratio:.2f}x** useful output tokens/s")
    print(f"continuous with async scheduling / without: **{async_ratio:.3f}x** useful output tokens/s "
          f"(the same engine and requests; target on a CPU >= 0.97x, on CUDA >= 1.15x online)")
    for name, rec in out.items():               # on a GPU: did the steps replay CUDA graphs (model_runner.py)
        print(f"- {name}: {describe_graph_use(rec)}")
    results["throughput"] = {"num_requests": len(reqs), "modes": out, "best_static": best,
                             "continuous_over_best_static": ratio, "async_over_plain": async_ratio,
                             "async_scheduling": overlap}


def kv_bytes_per_token(engine):
    mc, kv = engine.model_config, engine.kv_pool.kv_caches[0][0]
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * kv.element_size()


def paged_waste(run, block):
    """1 - tokens in cache / allocated block slots, over decode-only steps where every running sequence reported."""
    lens = {rid: len(req.prompt) for rid, req in run["ids"].items()}
    used = alloc = 0
    for outs, s in run["steps"]:
        alive = [o for o in outs if not o.finished]
        if s.num_batched_tokens_last_step == s.num_seqs_last_step and alive and len(alive) == s.num_running:
            used += sum(lens[o.request_id] + len(o.outputs[0].token_ids) - 1 for o in alive)
            alloc += (s.num_blocks - s.num_free_blocks) * block
    return 1 - used / alloc if alloc else float("nan")


def bench_memory(sz, seed, results):
    """At one KV budget, how many more sequences run at once with a paged pool than with contiguous reservations?"""
    probe = make_engine(kv_cache_memory="64MiB")
    vocab, per_token, block = vocab_of(probe), kv_bytes_per_token(probe), probe.config.block_size
    reqs = make_workload(sz.mem_requests, seed + 1, sz.out_range, sz.mem_prompt_median, vocab)
    max_model_len = max(sz.mem_max_model_len, max(len(r.prompt) + r.max_tokens for r in reqs))
    reserve = statistics.mean(len(r.prompt) + r.max_tokens for r in reqs)   # contiguous: prompt + max_tokens each
    live = statistics.mean(len(r.prompt) + r.max_tokens / 2 for r in reqs)  # tokens actually held, averaged over life
    budget = 2 * max_model_len * per_token                                  # two max-length reservations
    fit_request_max = max(1, int(2 * max_model_len // reserve))
    engines = [make_engine(kv_cache_memory=budget, max_model_len=max_model_len, max_num_seqs=seqs,
                           enable_prefix_caching=False) for seqs in (sz.max_num_seqs, fit_request_max)]
    for e in engines:
        warm_up(e, sz)
    paged, contig = run_interleaved([(e, reqs) for e in engines], "memory: paged and contiguous, in turn")
    slots = engines[0].stats().num_blocks * block
    peak = {k: max(s.num_running for _, s in r["steps"]) for k, r in (("paged", paged), ("contig", contig))}
    gain = paged["useful_tok_s"] / contig["useful_tok_s"]
    section_header("Memory: paged pool vs contiguous reservation at one KV budget", [
        f"KV budget {budget / 2**20:.0f} MiB = {slots} token slots ({per_token} B/token, block {block}); "
        f"max_model_len {max_model_len}; {len(reqs)} requests of the throughput workload's shape (seed+1).",
        "contiguous-equivalent: the same engine capped at the sequences a prompt+max_tokens reservation fits "
        "(ignoring that a contiguous allocator also fragments, so it flatters contiguous); both take turns step by step.",
        "KV waste: contiguous = 1 - tokens held (prompt + half the output, averaged over a life) / reserved; "
        "paged = measured on decode-only steps, 1 - tokens in cache / allocated block slots."])
    print(md_table(["allocator", "sequences that fit / peak running", "KV waste", "useful out tok/s", "preemptions"], [
        ["contiguous, reserve max_model_len", slots // max_model_len, 1 - live / max_model_len, "-", "-"],
        ["contiguous, reserve prompt+max_tokens", fit_request_max, 1 - live / reserve, "-", "-"],
        ["contiguous-equivalent run", peak["contig"], "-", contig["useful_tok_s"], contig["preemptions"]],
        ["paged (measured)", peak["paged"], paged_waste(paged, block), paged["useful_tok_s"], paged["preemptions"]]]))
    print(f"\npaged peak concurrency {peak['paged']} vs {fit_request_max} reserved; throughput paged / "
          f"contiguous-equivalent: **{gain:.2f}x**")
    results["memory"] = {"kv_budget_bytes": budget, "kv_bytes_per_token": per_token, "pool_slots": slots,
                         "fit_contiguous_max_model_len": slots // max_model_len, "fit_contiguous_request_max": fit_request_max,
                         "paged_peak_running": peak["paged"], "paged_waste_measured": paged_waste(paged, block),
                         "contiguous_waste_request_max": 1 - live / reserve, "paged_over_contiguous_throughput": gain}


def cached_run(sz, caching, batches):
    """Run `batches()` (a generator of prompt lists, each sent once the previous finished) on a fresh engine."""
    engine = make_engine(kv_cache_memory=sz.kv_cache_memory, enable_prefix_caching=caching, max_num_seqs=sz.max_num_seqs)
    warm_up(engine, sz)
    wall = tokens = 0
    ttft, outs = [], None
    gen = batches(engine)
    prompts = next(gen)
    while prompts is not None:
        outs, w, _ = run_timed(engine, prompts, [greedy(sz.prefix_out)] * len(prompts), "prefix")
        wall, tokens, ttft = wall + w, tokens + sum(len(o.outputs[0].token_ids) for o in outs), ttft + [o.metrics.ttft for o in outs]
        prompts = gen.send(outs)
    return {"wall_s": wall, "useful_tok_s": tokens / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "hit_rate": engine.stats().prefix_cache_hit_rate}


def bench_prefix(sz, seed, results):
    """How much faster are requests that share a prefix (a system prompt, a conversation) with prefix caching?"""
    def shared(engine):                 # an earlier request saw the system prompt (untimed); then every question
        rng, vocab = random.Random(seed), vocab_of(engine)
        system = random_prompt(rng, sz.prefix_len, vocab)
        run_timed(engine, [system + [300]], [greedy(1)], "earlier")
        yield [system + random_prompt(rng, rng.randint(8, 24), vocab) for _ in range(sz.prefix_requests)]
        yield None
    def multi_turn(engine):             # each turn resends the conversation so far plus a new question
        rng, vocab = random.Random(seed + 1), vocab_of(engine)
        histories = [random_prompt(rng, 64, vocab) for _ in range(sz.conversations)]
        for _ in range(sz.turns):
            outs = yield histories
            histories = [h + o.outputs[0].token_ids + random_prompt(rng, 16, vocab) for h, o in zip(histories, outs)]
        yield None
    out = {f"{name}_caching_{'on' if c else 'off'}": cached_run(sz, c, fn)
           for name, fn in (("shared_prefix", shared), ("multi_turn", multi_turn)) for c in (False, True)}
    speedup = {k: out[f"{k}_caching_on"]["useful_tok_s"] / out[f"{k}_caching_off"]["useful_tok_s"]
               for k in ("shared_prefix", "multi_turn")}
    section_header("Prefix caching", [
        f"shared prefix: a {sz.prefix_len}-token system prompt, {sz.prefix_requests} different 8-24 token questions, "
        f"{sz.prefix_out} output tokens each, all queued at once after one earlier request with the same system prompt.",
        f"multi-turn: {sz.conversations} conversations x {sz.turns} turns, each resending the history plus 16 tokens.",
        "hit rate = prompt tokens served from the cache / prompt tokens (the earlier request included)."])
    print(md_table(["workload", "useful out tok/s", "wall s", "TTFT p50 s", "TTFT p90 s", "hit rate"],
                   [[k, v["useful_tok_s"], v["wall_s"], v["ttft_p50_s"], v["ttft_p90_s"], v["hit_rate"]]
                    for k, v in out.items()]))
    print("\ncaching on / off: " + ", ".join(f"{k} **{v:.2f}x**" for k, v in speedup.items()) + " useful output tokens/s")
    results["prefix"] = out | {"speedup": speedup}


def bench_copy_on_write(sz, seed, results):
    """Do n = 4 samples of one prompt hold the prompt's blocks once (copy-on-write), as the closed form says?"""
    from engine import SamplingParams
    engine = make_engine(kv_cache_memory=sz.kv_cache_memory, enable_prefix_caching=False)
    prompt, bs = random_prompt(random.Random(seed), sz.cow_prompt, vocab_of(engine)), engine.config.block_size
    def sample(n):
        return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=sz.cow_out, ignore_eos=True)
    _, _, cow_peak = run_timed(engine, [prompt], [sample(4)], "cow")
    _, _, sep_peak = run_timed(engine, [prompt] * 4, [sample(1)] * 4, "sep")
    full, tail = divmod(len(prompt), bs)      # full prompt blocks are shared; each sample owns its last block on
    closed = {"one_prompt_plus_4_tails": full + 4 * -(-(tail + sz.cow_out) // bs),
              "four_copies": 4 * -(-(len(prompt) + sz.cow_out) // bs)}
    section_header("Memory for n = 4 samples", [
        f"a {sz.cow_prompt}-token prompt, 4 samples of {sz.cow_out} tokens, block size {bs}, prefix caching off so "
        "only copy-on-write shares blocks."])
    print(md_table(["", "peak KV blocks", "closed form"],
                   [["n=4, copy-on-write", cow_peak, closed["one_prompt_plus_4_tails"]],
                    ["4 separate requests", sep_peak, closed["four_copies"]]]))
    results["copy_on_write"] = {"cow_peak_blocks": cow_peak, "separate_peak_blocks": sep_peak, **closed}


def bench_preemption(sz, seed, results):
    """When the KV pool is too small, is swapping preempted sequences to host memory faster than recomputing them?"""
    probe = make_engine(kv_cache_memory="64MiB")
    per_block, bs = kv_bytes_per_token(probe) * probe.config.block_size, probe.config.block_size
    reqs = make_workload(sz.pressure_requests, seed, sz.pressure_out_range, sz.pressure_prompt_median, vocab_of(probe))
    blocks = [-(-(len(r.prompt) + r.max_tokens) // bs) for r in reqs]
    pool = max(sum(blocks) // 3, max(blocks) + 1)       # a third of the need; the largest request must fit
    out = {}
    for mode in ("recompute", "swap"):
        engine = make_engine(kv_cache_memory=pool * per_block, preemption_mode=mode, enable_prefix_caching=False,
                             swap_space="1GiB" if mode == "swap" else 0)
        warm_up(engine, sz)
        outs, wall, _ = run_timed(engine, [r.prompt for r in reqs], [greedy(r.max_tokens) for r in reqs], mode)
        pre = [o.metrics.e2e_latency for o in outs if o.metrics.num_preemptions]
        out[mode] = {"wall_s": wall, "useful_tok_s": sum(r.max_tokens for r in reqs) / wall,
                     "preemptions": engine.stats().num_preemptions, "preempted_requests": len(pre),
                     "preempted_e2e_p50_s": pct(pre, 50), "preempted_e2e_max_s": max(pre, default=float("nan"))}
    section_header("Preemption under memory pressure: swap vs recompute", [
        f"{len(reqs)} requests whose KV needs {sum(blocks)} blocks, in a pool of {pool}; swap space 1 GiB of host memory."])
    cols = ["useful_tok_s", "wall_s", "preemptions", "preempted_requests", "preempted_e2e_p50_s", "preempted_e2e_max_s"]
    print(md_table(["preemption mode", "useful out tok/s", "wall s", "preemptions", "preempted requests",
                    "their e2e p50 s", "their e2e max s"], [[k] + [v[c] for c in cols] for k, v in out.items()]))
    results["preemption"] = out
