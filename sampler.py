"""
Sampling: the per-request knobs (SamplingParams, vLLM's names and defaults) and one
vectorized function that turns a batch of logits into next tokens.

Owns: validation of every sampling field (an InvalidRequest that names the field and the
allowed range), temperature / top-k / top-p / min-p, per-request seeds, logprobs.
Does not touch sequences or stop conditions: the engine applies those to what this returns.

Why an exponential race instead of torch.multinomial: argmax(p / E) with E ~ Exp(1) draws
exactly from p, and lets each seeded row take its noise from its own generator while the
arithmetic stays one batched op. A seeded request thus samples the same tokens whatever
else is in the batch.
"""
from dataclasses import dataclass

import torch

import errors

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None          # return the top-N logprobs of every sampled token

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self, vocab_size: int | None = None):
        def need(ok, field, allowed):
            errors.need(ok, field, allowed, getattr(self, field))
        need(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1")
        need(isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", ">= 0")
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "-1 (off), 0 (off) or a positive integer")
        need(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        need(self.seed is None or isinstance(self.seed, int), "seed", "an integer or None")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             "logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "a non-empty string or a list of them")
        vocab = vocab_size or 2**31
        need(all(isinstance(t, int) and 0 <= t < vocab for t in self.stop_token_ids),
             "stop_token_ids", f"token ids in [0, {vocab})")


def make_generator(seed: int | None, index: int = 0):
    """A private random stream for a seeded request; the i-th of n samples gets its own."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)


def sample(logits, params: list[SamplingParams], generators: list):
    """logits: [num_seqs, vocab] float32. Returns (tokens [num_seqs] list[int],
    logprobs list[dict[int, float] | None]) — logprobs are the model's, before temperature."""
    num_seqs, vocab = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy = temps == 0
    tokens = logits.argmax(dim=-1)                                     # [num_seqs]
    if not greedy.all():
        x = logits / temps.clamp(min=1e-5).unsqueeze(1)                # [num_seqs, vocab]
        x = apply_top_k_top_p_min_p(x, params)
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs)                                # Exp(1) noise, one row per sequence
        for i, g in enumerate(generators):
            if not greedy[i]:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
    tokens = tokens.tolist()
    return tokens, gather_logprobs(logits, tokens, params)


def apply_top_k_top_p_min_p(x, params):
    """Mask filtered-out logits to -inf; the sort runs only when some row asks for top-k/top-p."""
    top_k = torch.tensor([p.top_k if p.top_k > 0 else x.shape[1] for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    if (top_k < x.shape[1]).any() or (top_p < 1).any():
        sorted_x, order = x.sort(dim=-1, descending=True)              # [num_seqs, vocab]
        ranks = torch.arange(x.shape[1]).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        sorted_probs = sorted_x.softmax(dim=-1)
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)  # keep the token that crosses p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if (min_p > 0).any():
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def gather_logprobs(logits, tokens, params):
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return [None] * len(params)
    logprobs = logits.log_softmax(dim=-1)                              # [num_seqs, vocab]
    top_n = max(w or 0 for w in want)
    top_vals, top_ids = logprobs.topk(max(top_n, 1), dim=-1)
    out = []
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        d = dict(zip(top_ids[i, :w].tolist(), top_vals[i, :w].tolist()))
        d[tokens[i]] = logprobs[i, tokens[i]].item()
        out.append(d)
    return out
