"""
Speculative decoding (spec_decode.py) measured: what it gains end to end, and what its host-side parts
cost per step. bench_speculative is bench.py's `speculative` section; the others return a dict of
numbers and print a markdown table:

  bench_speculative      tok/s of the same requests with and without n-gram speculation, taking turns
                         step by step, at batch 1, 4, 16 and 64, on an input-grounded workload (prompts
                         that ask to repeat, edit or summarize a passage they contain) and on the peers'
                         random workload; acceptance length, the ratio, and a verify step's device
                         time against a plain step's (the break-even acceptance length);
  bench_ngram_proposer   NgramProposer.propose at batch 1, 16 and 64 over sequences of 500 and
                         2,000 tokens, steady state (each step appends tokens, as decoding does),
                         on random tokens (no matches) and on text that quotes itself;
  bench_acceptance       verify at batch 64 with k = 4 drafts per row, all rejected and all
                         accepted, greedy and sampled, next to sampler.sample on [64, vocab].
Medians of repeated calls in one process. `python -m benchmarks.spec_decode` runs the last two.
"""
import random
import time

import numpy as np
import torch

import spec_decode as sd
from sampler import SamplingParams, SamplingState, make_generator, sample


def quoting_text(rng, n):
    """Zipf-distributed tokens (frequent ones recur, as words do) with five passages quoted back."""
    t = (rng.zipf(1.3, n) % 49152).tolist()
    for _ in range(5):
        src, length = int(rng.integers(0, n // 2)), int(rng.integers(20, 100))
        at = int(rng.integers(n // 2, n - length))
        t[at:at + length] = t[src:src + length]
    return t


def bench_ngram_proposer(steps=30, k=4, min_n=2, max_n=5):
    rng, rows = np.random.default_rng(0), []
    config = sd.SpeculativeConfig.from_dict({"num_speculative_tokens": k, "prompt_lookup_min": min_n,
                                             "prompt_lookup_max": max_n})
    for kind in ("random", "quoting"):
        for batch in (1, 16, 64):
            for n in (500, 2000):
                seqs = [rng.integers(0, 49152, n).tolist() if kind == "random" else quoting_text(rng, n)
                        for _ in range(batch)]
                source = [int(rng.integers(0, n // 2)) for _ in range(batch)]   # what each row goes on to quote
                proposer, keys = sd.NgramProposer(config), list(range(batch))
                t0 = time.perf_counter()
                proposer.propose(keys, seqs)
                first, times, drafted = time.perf_counter() - t0, [], 0
                for step in range(steps):
                    for i, s in enumerate(seqs):
                        s.append(s[source[i] + step] if kind == "quoting" else int(rng.integers(0, 49152)))
                    t0 = time.perf_counter()
                    drafted += sum(map(len, proposer.propose(keys, seqs)))
                    times.append(time.perf_counter() - t0)
                rows.append(dict(tokens=kind, batch=batch, seq_len=n, step_ms=1e3 * float(np.median(times)),
                                 first_call_ms=1e3 * first, drafts_per_row=drafted / steps / batch))
    print("| tokens | batch | seq len | propose, ms/step (median) | first call, ms | drafts/row/step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['batch']} | {r['seq_len']} | {r['step_ms']:.3f} | {r['first_call_ms']:.2f} "
              f"| {r['drafts_per_row']:.2f} |")
    return {"ngram_proposer": rows}


def bench_acceptance(batch=64, k=4, vocab=49152, repeats=5):
    """verify on batch rows of k drafts each, drafts all rejected (random) or all accepted (each
    one the target's overwhelming favourite), against sampler.sample on the same rows' first
    positions: one plain step. Medians in ms; per emitted token is the figure that matters."""
    rng, out = np.random.default_rng(1), {}
    cases = (("greedy", dict(temperature=0.0)),
             ("T=0.8 top_p=0.9", dict(temperature=0.8, top_p=0.9)),
             ("T=0.8 top_p=0.9 penalties seeded", dict(temperature=0.8, top_p=0.9, frequency_penalty=0.5,
                                                        repetition_penalty=1.1, seed=0)))
    drafts = [rng.integers(0, vocab, k).tolist() for _ in range(batch)]
    logits = torch.randn(batch * (k + 1), vocab) * 3
    favoured = logits.clone()
    for i, d in enumerate(drafts):
        favoured[[i * (k + 1) + j for j in range(k)], d] = 100.0          # [T, vocab] drafts win
    first = logits[[i * (k + 1) for i in range(batch)]]                   # [batch, vocab]
    for name, knobs in cases:
        def states():
            return [SamplingState(SamplingParams(**knobs), [1, 2, 3], vocab, make_generator(knobs.get("seed"), i),
                                  set()) for i in range(batch)]
        g, times = torch.Generator().manual_seed(0), {"plain": [], "rejected": [], "accepted": []}
        for _ in range(repeats):
            for key, fn in (("plain", lambda s: sample(first.clone(), s, g)),
                            ("rejected", lambda s: sd.verify(logits, drafts, s, g)),
                            ("accepted", lambda s: sd.verify(favoured, drafts, s, g))):
                s = states()
                t0 = time.perf_counter()
                fn(s)
                times[key].append(time.perf_counter() - t0)
        out[name] = {key: 1e3 * float(np.median(v)) for key, v in times.items()}
    print(f"| batch {batch}, k {k}, vocab {vocab} | sampler.sample, ms | verify, all rejected, ms "
          f"| verify, all accepted, ms | per emitted token, accepted / plain |")
    print("|---|---|---|---|---|")
    for name, r in out.items():
        print(f"| {name} | {r['plain']:.1f} | {r['rejected']:.1f} | {r['accepted']:.1f} "
              f"| {r['accepted'] / (k + 1) / r['plain']:.2f} |")
    return {"acceptance": out}


# ---------------------------------------------------------------------------------------- end to end
PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening on weekdays. On Saturdays it "
    "opens at ten and closes at four. It is closed on Sundays and public holidays. Books may be borrowed for "
    "three weeks and renewed twice, online or at the front desk, unless another reader has reserved them.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
    "power light turns solid green, which can take up to two minutes. If the light blinks orange, hold the reset "
    "button on the back for ten seconds with a paper clip, then set up the network again from the start.",
    "def parse_config(path):\n    with open(path) as f:\n        lines = f.read().splitlines()\n    config = {}\n"
    "    for line in lines:\n        if not line or line.startswith('#'):\n            continue\n"
    "        key, value = line.split('=', 1)\n        config[key.strip()] = value.strip()\n    return config\n",
    "Our quarterly revenue grew by twelve percent, driven mostly by the new subscription plan. Costs rose by four "
    "percent because we hired two engineers and moved to a larger office. We expect growth to slow next quarter "
    "as the summer season starts, and we will focus on keeping existing customers rather than finding new ones.",
    "Preheat the oven to two hundred degrees. Mix the flour, sugar and salt in a large bowl. Rub in the cold "
    "butter until the mixture looks like breadcrumbs, then add the milk and stir until it forms a soft dough. "
    "Roll it out, cut it into rounds, and bake for twelve minutes until the tops are golden brown.",
    "The meeting on Tuesday agreed three things. First, the release moves from March to April so that the "
    "payment tests can finish. Second, Maria will own the migration plan and report every Friday. Third, any "
    "change to the public API needs a written review from two people outside the team before it is merged.",
    "Dear customer, thank you for your order. Your package left our warehouse this morning and should arrive "
    "within three to five working days. You can follow it with the tracking number in this email. If anything "
    "is missing or damaged, reply to this message within thirty days and we will send a replacement for free.",
    "The river rises in the northern hills and flows south for about two hundred kilometres before it reaches "
    "the sea. Its valley is narrow in the hills and wide near the coast, where farmers grow rice and vegetables. "
    "Three bridges cross it in the capital, and the oldest of them was built more than four hundred years ago.",
]
TASKS = [
    "Repeat the following text exactly, word for word.\n\n{}",
    "Rewrite the following text with every sentence on its own line. Change no words.\n\n{}",
    "Summarize the following text by quoting its most important sentences word for word.\n\n{}",
]


def grounded_workload(engine, n, max_tokens):
    """n chat prompts, each a task (repeat / edit / summarize) over a passage it contains: output that
    quotes its input, what prompt lookup is for. The i-th request is task i % 3 of passage i % 8."""
    from benchmarks.harness import BenchRequest
    tok = engine.tokenizer
    return [BenchRequest(tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": TASKS[i % len(TASKS)].format(PASSAGES[i % len(PASSAGES)])}],
        add_generation_prompt=True)), max_tokens) for i in range(n)]


class StepTimer:
    """The device time of an engine's decode-only forwards, verify steps (some row carries drafts)
    apart from plain ones: CUDA events around Engine.run_model on a GPU (read after the run, no sync
    in between), the wall clock on a CPU (whose forward is synchronous). Installed on the engine
    object for one run; close() takes it off."""

    def __init__(self, engine):
        self.engine, self.run_model = engine, engine.run_model
        self.samples = {"plain": [], "verify": []}
        engine.run_model = self.timed

    def timed(self, batch):
        decode = batch.seqs and all(n == 1 + s.num_spec_tokens and s.num_computed_tokens + 1 == len(s.token_ids)
                                    for s, n in zip(batch.seqs, batch.num_tokens))
        if not decode:
            return self.run_model(batch)
        kind = "verify" if any(s.spec_token_ids for s in batch.seqs) else "plain"
        if self.engine.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.run_model(batch)
            end.record()
            self.samples[kind].append((start, end))
            return out
        t0 = time.perf_counter()
        out = self.run_model(batch)
        self.samples[kind].append(1e3 * (time.perf_counter() - t0))
        return out

    def close(self) -> dict:
        """-> {kind: (median ms, steps)}; puts the engine's run_model back."""
        del self.engine.run_model                          # the bound method of the class again
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        out = {}
        for kind, xs in self.samples.items():
            ms = [x if isinstance(x, float) else x[0].elapsed_time(x[1]) for x in xs]
            out[kind] = (float(np.median(ms)) if ms else float("nan"), len(ms))
        return out


def speculative_runs(plain, spec, reqs, batch):
    """The requests in groups of `batch` (all of a group at once), each group run on both engines taking
    turns step by step. -> figures of the plain and the speculating engine, and the device time of a
    plain step (plain engine) and of a verify step (speculating engine)."""
    from benchmarks.harness import run_interleaved
    walls, tokens, same, before = [0.0, 0.0], 0, 0, spec.stats()
    uses = [{"graph_steps": {}, "eager_steps": {}} for _ in range(2)]     # plain's, spec's
    timers = StepTimer(plain), StepTimer(spec)
    try:
        for i in range(0, len(reqs), batch):
            group = reqs[i:i + batch]
            a, b = run_interleaved([(plain, group), (spec, group)], f"speculative, batch {batch}")
            same += sum(a["done"][x].outputs[0].token_ids == b["done"][y].outputs[0].token_ids
                        for x, y in zip(a["ids"], b["ids"]))
            walls[0], walls[1], tokens = walls[0] + a["wall_s"], walls[1] + b["wall_s"], tokens + a["useful_tokens"]
            for run, use in zip((a, b), uses):
                for key in use:
                    for k, n in run[key].items():
                        use[key][k] = use[key].get(k, 0) + n
    finally:
        (plain_ms, _), _ = timers[0].close().values()
        spec_times = timers[1].close()
    after = spec.stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    verify_ms, verify_steps = spec_times["verify"]
    return {"tokens": tokens, "plain_tok_s": tokens / walls[0], "spec_tok_s": tokens / walls[1],
            "ratio": walls[0] / walls[1], "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "draft_tokens": drafted,
            "identical_outputs": same, "requests": len(reqs), "plain_step_ms": plain_ms, "verify_step_ms": verify_ms,
            "verify_steps": verify_steps, "spec_plain_steps": spec_times["plain"][1],
            "steps_off": after.spec_decode_num_steps_off - before.spec_decode_num_steps_off,
            "plain_graph_use": uses[0], "spec_graph_use": uses[1]}


def bench_speculative(sz, seed, results):
    """How much faster is decoding with n-gram speculation, where the output quotes the input and where it
    does not? Same requests, same engine settings, with and without speculative_config, taking turns.
    Beside each ratio: what a verify step costs in device time against a plain step at that batch, so the
    break-even acceptance length (= that cost ratio) is visible on any machine."""
    from benchmarks.harness import (describe_graph_use, make_engine, make_workload, md_table, section_header,
                                    vocab_of, warm_up)
    config = {"method": "ngram", "num_speculative_tokens": sz.spec_k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # both engines run the plain loop: a speculating engine cannot overlap its steps yet (async_engine.py),
    # and the step timer wraps Engine.run_model, which the overlap loop does not call
    common = dict(max_num_seqs=max(sz.spec_batches), kv_cache_memory=sz.spec_kv_cache_memory, enable_prefix_caching=False,
                  async_scheduling=False)
    plain, spec = make_engine(**common), make_engine(speculative_config=config, **common)
    for e in (plain, spec):
        warm_up(e, sz)
    workloads = {"input-grounded": grounded_workload(plain, max(sz.spec_batches), sz.spec_out),
                 "random": make_workload(max(sz.spec_batches), seed + 3, (sz.spec_out, sz.spec_out),
                                         sz.peer_prompt_median, vocab_of(plain))}
    out, rows = {}, []
    for name, reqs in workloads.items():
        out[name] = {}
        for batch in sz.spec_batches:
            group = reqs[:max(batch, sz.spec_min_requests)]
            r = out[name][batch] = speculative_runs(plain, spec, group, batch)
            rows.append([name, batch, len(group), r["plain_tok_s"], r["spec_tok_s"], r["ratio"],
                         r["mean_acceptance_length"], r["plain_step_ms"], r["verify_step_ms"],
                         r["verify_step_ms"] / r["plain_step_ms"], f"{r['verify_steps']}/{r['spec_plain_steps']}",
                         f"{r['identical_outputs']}/{len(group)}"])
    dtype = str(spec.dtype).removeprefix("torch.")
    section_header("Speculative decoding: n-gram prompt lookup, with and without", [
        f"speculative_config={config} (adaptive: on); prefix caching off; greedy, EOS ignored, {sz.spec_out} output "
        f"tokens a request; {dtype} on {spec.device.type}.",
        "input-grounded: chat prompts asking to repeat, re-line or summarize (by quoting) a passage of 50-80 words "
        "they contain; random: the peers workload's random token ids.",
        "batch B: the requests in groups of B, each group submitted at once; the two engines take turns step by "
        "step. Step ms: median device time of a decode-only forward (CUDA events on a GPU, the wall clock on a CPU), "
        "a plain step on the plain engine, a verify step (1 + k query tokens a row) on the speculating one; their "
        "ratio is the acceptance length a verify step needs to break even. Steps: verify / plain decode steps "
        "of the speculating engine (adaptive speculation runs plain where verify steps do not pay).",
        "identical: greedy outputs equal token for token. In float32 on a CPU they are (the tests prove it, and in "
        "batch-invariant mode by construction); in bf16 a verify pass runs other kernels than a one-row step "
        "(other GEMM shapes, the prefill attention tiles), so a near-tie between bf16-spaced logits may break the "
        "other way (the tests check that each first divergence is within what one bf16 pass moves a gap, in float32).",
        "acceptance length: tokens per verifying row (1 + accepted / rows with drafts)."])
    print(md_table(["workload", "batch", "requests", "plain tok/s", "speculative tok/s", "ratio",
                    "mean acceptance length", "plain step ms", "verify step ms", "verify / plain step",
                    "steps verify/plain", "identical"], rows))
    print("\nCUDA graphs (model_runner.py), plain and speculating engine:")
    for name, runs in out.items():
        for batch, r in runs.items():
            print(f"- {name}, batch {batch}: plain {describe_graph_use(r['plain_graph_use'])} | speculative "
                  f"{describe_graph_use(r['spec_graph_use'])}")
    results["speculative"] = {"config": config, "dtype": dtype, "device": spec.device.type, "runs": out}


if __name__ == "__main__":
    torch.set_num_threads(2)
    bench_ngram_proposer()
    bench_acceptance()
