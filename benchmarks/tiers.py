"""
benchmarks/tiers.py: the prefix cache's tiers below the device (kv_offload.py), measured.

Owns one experiment: many tenants, each with a long system prompt, requests cycling through them,
and a device KV pool that holds about a quarter of the prompts. It compares the tier-less engine
with a host tier (hit rate, TTFT), a restarted engine on the disk tier against a cold one (first
request per tenant), and the cost of the tiers when nothing is reused (throughput, taking turns).
Drives the engine only through its public API and benchmarks/harness.py.
"""
import random
import shutil
import tempfile

from benchmarks.harness import greedy, make_engine, md_table, pct, random_prompt, run_timed, section_header, vocab_of


def _block_bytes(engine) -> int:
    return engine.kv_pool.pool[:, :, 0].numel() * engine.kv_pool.pool.element_size()


def _requests(sz, seed, vocab):
    """Each tenant's system prompt, and one measured round of requests: tenant i's prompt + a new question."""
    rng = random.Random(seed)
    systems = [random_prompt(rng, sz.tier_prefix_len, vocab) for _ in range(sz.tier_tenants)]
    return systems, [s + random_prompt(rng, 16, vocab) for s in systems]


def _one_at_a_time(engine, prompts, desc):
    """Each prompt alone (the cycle reaches a tenant after every other): TTFTs and cached-token counts."""
    outs = [run_timed(engine, [p], [greedy(4)], desc)[0][0] for p in prompts]
    hit = sum(o.metrics.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs)
    return {"ttft_p50_s": pct([o.metrics.ttft for o in outs], 50), "hit_rate": hit,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def _tenant_cycle(sz, seed, pool_blocks, block, **tiers):
    """Round 0 sees every system prompt once (untimed); the measured round cycles through the tenants again."""
    engine = make_engine(kv_cache_memory=pool_blocks * block, max_num_seqs=sz.max_num_seqs, **tiers)
    systems, measured = _requests(sz, seed, vocab_of(engine))
    _one_at_a_time(engine, [s + [300] for s in systems], "tier-warm")
    row = _one_at_a_time(engine, measured, "tier")
    row["tiers"] = engine.stats().kv_offload
    return row


def _restart(sz, seed, pool_blocks, block):
    """An engine serves every tenant once, then unrelated prompts push its blocks out to disk; a second
    engine on the same directory serves each tenant's first request."""
    path = tempfile.mkdtemp(prefix="nanoserve-tiers-")
    try:
        tiers = dict(kv_offload_memory=max(pool_blocks // 8, 1) * block, kv_offload_dir=path,
                     kv_offload_disk=4 * pool_blocks * block * 2)
        first = make_engine(kv_cache_memory=pool_blocks * block, **tiers)
        systems, measured = _requests(sz, seed, vocab_of(first))
        _one_at_a_time(first, [s + [300] for s in systems], "disk-warm")
        rng = random.Random(seed + 7)
        fill = -(-(pool_blocks * 9 // 8 + 8) * first.config.block_size // sz.tier_prefix_len)
        _one_at_a_time(first, [random_prompt(rng, sz.tier_prefix_len, vocab_of(first)) for _ in range(fill)], "disk-fill")
        second = make_engine(kv_cache_memory=pool_blocks * block, **tiers)
        row = _one_at_a_time(second, measured, "restart")
        row["tiers"] = second.stats().kv_offload
        return row
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _no_reuse(sz, seed, pool_blocks, block, host_bytes):
    """Random prompts queued together, no prefix shared: output tokens/s with and without the host tier,
    taking turns (best of sz.repeats each)."""
    walls = {"off": [], "host": []}
    engines = {"off": make_engine(kv_cache_memory=pool_blocks * block, max_num_seqs=sz.max_num_seqs),
               "host": make_engine(kv_cache_memory=pool_blocks * block, max_num_seqs=sz.max_num_seqs,
                                   kv_offload_memory=host_bytes)}
    for r in range(sz.repeats):
        for name, engine in engines.items():
            rng = random.Random(seed + 100 + r * 2 + (name == "host"))   # fresh prompts each run: no hit anywhere
            prompts = [random_prompt(rng, sz.tier_prefix_len, vocab_of(engine)) for _ in range(sz.tier_tenants // 2)]
            _, wall, _ = run_timed(engine, prompts, [greedy(8)] * len(prompts), f"noreuse-{name}")
            walls[name].append(wall)
    tokens = (sz.tier_tenants // 2) * (sz.tier_prefix_len + 8)
    return {name: {"tok_s": tokens / min(w), "wall_s_best": min(w)} for name, w in walls.items()}


def bench_tiers(sz, seed, results):
    """Does a host tier under the prefix cache serve a working set 4x the device pool, and a disk tier a restart?"""
    probe = make_engine(kv_cache_memory="64MiB")
    block, bs = _block_bytes(probe), probe.config.block_size
    pool_blocks = sz.tier_tenants * sz.tier_prefix_len // bs // 4                      # a quarter of the prompts
    host_bytes = 2 * sz.tier_tenants * (sz.tier_prefix_len // bs + 2) * block          # every prompt, twice over
    off = _tenant_cycle(sz, seed, pool_blocks, block)
    host = _tenant_cycle(sz, seed, pool_blocks, block, kv_offload_memory=host_bytes)
    restart = _restart(sz, seed, pool_blocks, block)
    noreuse = _no_reuse(sz, seed, pool_blocks, block, host_bytes)
    # restored prefixes take the same path (prefix from cache, question computed); the cold row computes it
    # all in one chunk, which in bfloat16 can round a near-tie the other way on random tokens
    same = {"host_vs_disk_restart": sum(a == b for a, b in zip(host["tokens"], restart["tokens"])) / len(off["tokens"]),
            "host_vs_device_only": sum(a == b for a, b in zip(host["tokens"], off["tokens"])) / len(off["tokens"])}
    ratios = {"hit_rate_host": host["hit_rate"], "hit_rate_off": off["hit_rate"],
              "ttft_p50_off_over_host": off["ttft_p50_s"] / host["ttft_p50_s"],
              "first_ttft_p50_cold_over_disk_restart": off["ttft_p50_s"] / restart["ttft_p50_s"],
              "no_reuse_tok_s_host_over_off": noreuse["host"]["tok_s"] / noreuse["off"]["tok_s"]}
    section_header("Prefix cache tiers: host memory and disk under the device pool", [
        f"{sz.tier_tenants} tenants, each a {sz.tier_prefix_len}-token system prompt + a 16-token question, 4 output "
        f"tokens, one request at a time cycling through the tenants; device pool {pool_blocks} blocks (a quarter of "
        "the prompts). Round 0 (untimed) sees every tenant once; the rows time the next round.",
        "disk restart: an engine with a small host tier serves every tenant, unrelated prompts push its blocks to "
        "disk, and a new engine on the same directory serves each tenant's next request (cold = the tier-less row, "
        "whose blocks were all evicted).",
        f"no reuse: {sz.tier_tenants // 2} random prompts queued together, with and without the host tier, "
        f"best of {sz.repeats} runs each, taking turns.",
        f"greedy outputs identical, host tier vs disk restart: {same['host_vs_disk_restart']:.0%} of requests; "
        f"host tier vs device only: {same['host_vs_device_only']:.0%} (tokens identical in float32: test_all.py)"])
    rows = [["device only", off["hit_rate"], off["ttft_p50_s"], "", ""],
            ["+ host tier", host["hit_rate"], host["ttft_p50_s"], host["tiers"]["host"]["hits"], host["tiers"]["host"]["read_s"]],
            ["disk, after restart", restart["hit_rate"], restart["ttft_p50_s"], restart["tiers"]["disk"]["hits"],
             restart["tiers"]["disk"]["read_s"]]]
    print(md_table(["tier", "hit rate", "TTFT p50 s", "blocks restored from the tier", "tier read s"], rows))
    print(f"\nno reuse: {noreuse['host']['tok_s']:.0f} tok/s with the host tier, {noreuse['off']['tok_s']:.0f} without "
          f"(**{ratios['no_reuse_tok_s_host_over_off']:.3f}x**); TTFT p50 without / with the host tier "
          f"**{ratios['ttft_p50_off_over_host']:.2f}x**; cold / disk restart **{ratios['first_ttft_p50_cold_over_disk_restart']:.2f}x**")
    for row in (off, host, restart):
        row.pop("tokens")
    results["tiers"] = {"device_only": off, "host": host, "disk_restart": restart, "no_reuse": noreuse,
                        "ratios": ratios, "same_tokens": same, "pool_blocks": pool_blocks}
