"""
What speculative decoding's host-side parts cost per step (spec_decode.py), for bench.py to call
(each returns a dict of numbers and prints a markdown table):

  bench_ngram_proposer   NgramProposer.propose at batch 1, 16 and 64 over sequences of 500 and
                         2,000 tokens, steady state (each step appends tokens, as decoding does),
                         on random tokens (no matches) and on text that quotes itself;
  bench_acceptance       verify at batch 64 with k = 4 drafts per row, all rejected and all
                         accepted, greedy and sampled, next to sampler.sample on [64, vocab].
Medians of repeated calls in one process. `python -m benchmarks.spec_decode` runs both.
"""
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


if __name__ == "__main__":
    torch.set_num_threads(2)
    bench_ngram_proposer()
    bench_acceptance()
