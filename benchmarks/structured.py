"""
Two measurements of the sampler's cost, for bench.py to call (each returns a dict of numbers and
prints a markdown table):

  bench_sampling_overhead      a decode step at batch 64 and temperature 1 against a greedy one
                               (target: at most 10% more), and sampler.sample alone on [64, vocab]
                               logits next to the exponential race it replaced;
  bench_structured_output_cost a decode step at batch 32 whose rows all follow a JSON schema
                               against one whose rows are free (target: at most 10% more per token),
                               and what the grammar work of such a step costs piece by piece.

Both compare medians of steps interleaved in one process, so the ratio survives a noisy machine.
Owns nothing else; it never changes the engine. `python bench_structured.py` runs both.
"""
import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")    # as bench.py: short OpenMP spin (docs/http.md)

import statistics
import time
from dataclasses import asdict

import torch

from llm import LLM, SamplingParams, StructuredOutputsParams
from benchmarks.harness import time_fn
from sampler import SamplingState, sample, top_p_reference
from structured_output import (apply_token_bitmask_, apply_token_bitmask_reference,
                               fill_bitmasks)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


def exponential_race(logits, generators):
    """What sampler.sample did before: Exp(1) noise over the full vocabulary, one call per row."""
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1).tolist()


def time_call(fn, repeats):
    return time_fn(fn, repeats, warmup=0)[1]       # median seconds


def decode_step_times(llm, prompts, params, num_rows, steps):
    """Seconds of each engine step in which exactly num_rows rows each decode one token: the
    whole step ("step") and each of engine.phase_times' phases within it."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        before = asdict(engine.phase_times)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        s = engine.stats()
        if s.num_seqs_last_step == num_rows and s.num_batched_tokens_last_step == num_rows and len(times) < steps:
            times.append({"step": dt, **{k: v - before[k] for k, v in asdict(engine.phase_times).items()}})
    return times


def interleaved_medians(llm, runs: dict, num_rows, steps, rounds, part="step"):
    """Each variant runs `rounds` times, taking turns; the median step of each (or, with
    part=None, the median of the step and of each phase: {variant: {part: seconds}})."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (prompts, params) in runs.items():
            times[name] += decode_step_times(llm, prompts, params, num_rows, steps)
    medians = {name: {k: statistics.median(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}
    return medians if part is None else {name: m[part] for name, m in medians.items()}


def bench_sampling_overhead(llm=None, batch=64, vocab=None, steps=8, rounds=5, repeats=10, dtype=None):
    llm = llm or LLM(**({"dtype": dtype} if dtype else {}))
    vocab = vocab or llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen) * 3                          # [batch, vocab]

    def states(**kw):
        p = SamplingParams(**kw)
        return [SamplingState(p, [1], vocab, None, set()) for _ in range(batch)]
    greedy_s, temp_s = states(temperature=0.0), states(temperature=1.0)
    seeded_s = [SamplingState(SamplingParams(temperature=1.0, seed=i), [1], vocab, torch.Generator().manual_seed(i),
                              set()) for i in range(batch)]
    topk_s = states(temperature=1.0, top_k=50, top_p=0.9)
    topp_s = states(temperature=1.0, top_p=0.9)
    top_p = torch.full((batch,), 0.9)
    micro = {
        "greedy": time_call(lambda: sample(logits.clone(), greedy_s, gen), repeats),
        "temperature 1": time_call(lambda: sample(logits.clone(), temp_s, gen), repeats),
        "temperature 1, seeded rows": time_call(lambda: sample(logits.clone(), seeded_s, gen), repeats),
        "top_k 50 + top_p 0.9": time_call(lambda: sample(logits.clone(), topk_s, gen), repeats),
        "top_p 0.9": time_call(lambda: sample(logits.clone(), topp_s, gen), repeats),
        "top_p 0.9 filter by full sort (before)": time_call(lambda: top_p_reference(logits.clone(), top_p), 2),
        "exponential race (before)": time_call(lambda: exponential_race(logits.clone(), [gen] * batch), repeats),
    }
    prompts = [f"Tell me about the number {i}." for i in range(batch)]
    max_tokens = steps + 4
    step = interleaved_medians(llm, {
        "greedy": (prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)),
        "temperature 1": (prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)),
    }, batch, steps, rounds)
    ratio = step["temperature 1"] / step["greedy"]
    print(f"\n### Sampling overhead (batch {batch}, vocab {vocab})\n")
    print("| sampler.sample alone | ms |\n|---|---|")
    for name, t in micro.items():
        print(f"| {name} | {t * 1e3:.2f} |")
    print(f"\n| decode step at batch {batch} | ms |\n|---|---|")
    for name, t in step.items():
        print(f"| {name} | {t * 1e3:.1f} |")
    print(f"\ntemperature-1 step / greedy step = **{ratio:.3f}** (target <= 1.10)")
    return {"batch": batch, "vocab": vocab, "sample_ms": {k: v * 1e3 for k, v in micro.items()},
            "step_ms": {k: v * 1e3 for k, v in step.items()}, "sampling_step_ratio": ratio}


def bench_structured_output_cost(llm=None, batch=32, steps=8, rounds=5, dtype=None):
    # five short rounds each, taking turns: a burst of load from a neighbour spoils a round or two of
    # one variant, which moves the median of five less than it moved the median of two
    llm = llm or LLM(**({"dtype": dtype} if dtype else {}))
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON."}])
               for i in range(batch)]
    # greedy both ways, max_tokens past the measured steps; constrained rows stop only at EOS the
    # grammar allows, so only steps where all `batch` rows still decode are counted
    max_tokens = steps + 4
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    parts = interleaved_medians(llm, {"free": (prompts, free), "json schema": (prompts, constrained)},
                                batch, steps, rounds, part=None)
    step = {name: p["step"] for name, p in parts.items()}
    ratio = step["json schema"] / step["free"]
    pieces = grammar_step_breakdown(llm, prompts, constrained, steps)
    print(f"\n### Structured output cost (batch {batch}, every row constrained by a JSON schema)\n")
    # the grammar's work is all in sample (fill + apply) and update (advance); forward is the
    # same model call in both, so its difference is the noise of a shared machine
    print("| decode step | ms | ms per token | forward ms | sample ms | update ms |\n|---|---|---|---|---|---|")
    for name, p in parts.items():
        print(f"| {name} | {p['step'] * 1e3:.1f} | {p['step'] * 1e3 / batch:.2f} | {p['forward'] * 1e3:.1f} | "
              f"{p['sample'] * 1e3:.2f} | {p['update'] * 1e3:.2f} |")
    print(f"\n| grammar work of one step at batch {batch} (replayed on the same states) | ms |\n|---|---|")
    for name, t in pieces.items():
        print(f"| {name} | {t * 1e3:.2f} |")
    print(f"\nconstrained / free per token = **{ratio:.3f}** (target <= 1.10)")
    return {"batch": batch, "step_ms": {k: v * 1e3 for k, v in step.items()},
            "phase_ms": {name: {k: v * 1e3 for k, v in p.items() if k != "step"} for name, p in parts.items()},
            "grammar_ms": {k: v * 1e3 for k, v in pieces.items()}, "structured_cost_ratio": ratio}


def grammar_step_breakdown(llm, prompts, params, steps):
    """Median seconds per step of each piece of a constrained step's grammar work, on fresh
    grammars replaying the tokens the greedy run samples: llguidance filling every row's
    bitmask, applying it to [batch, vocab] logits (csrc op, and the plain-PyTorch reference
    for comparison) and advancing every matcher by its token."""
    token_ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    grammars = [llm.engine.grammars.compile(params.structured_outputs) for _ in prompts]
    vocab = llm.engine.model_config.vocab_size
    logits = torch.randn(len(prompts), vocab)                                     # [batch, vocab]
    rows = list(range(len(prompts)))
    times = {"fill bitmasks (llguidance)": [], "apply bitmask (csrc op)": [],
             "apply bitmask (plain PyTorch reference)": [], "advance matchers": []}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times[name].append(time.perf_counter() - t0)
        return out
    for k in range(min([steps] + [len(t) for t in token_ids])):
        bitmask = timed("fill bitmasks (llguidance)", lambda: fill_bitmasks(grammars, vocab))
        for name, apply in (("apply bitmask (csrc op)", apply_token_bitmask_),
                            ("apply bitmask (plain PyTorch reference)", apply_token_bitmask_reference)):
            x = logits.clone()
            timed(name, lambda: apply(x, bitmask, rows))
        timed("advance matchers", lambda: [(g.advance(t[k]), g.is_finished) for g, t in zip(grammars, token_ids)])
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    llm = LLM()
    bench_sampling_overhead(llm)
    bench_structured_output_cost(llm)
