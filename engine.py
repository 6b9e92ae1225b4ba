"""
The engine: one step of continuous batching.

Engine.step() is the whole loop body, in the order data flows:
  scheduler.schedule()  -> which sequences run and how many tokens each (scheduler.py)
  build the flat batch  -> input ids, positions, slot mapping, block tables, context lens,
                           query offsets (no padding: tokens of all sequences packed)
  model forward         -> logits for the last token of each sequence that completes its chunk
  sample                -> next tokens (sampler.py: penalties, logit_bias, min_tokens and grammar
                           masks from structured_output.py, each on just the rows that ask)
  update                -> append tokens, detokenize, check stop conditions, retire finished
                           sequences (their blocks return to the pool this very step)
llm.py's LLM.generate() drives step() until every request is done; serve.py drives it from engine_core.py,
in a process of its own.
Owns requests, their outputs and metrics (prompt logprobs included: extra logits rows of the
prefill the request already does); validates input at the edge (add_request).
"""
import functools
import itertools
import os
import sys
import time
from dataclasses import dataclass, field, fields

import numpy as np
import torch

import paged_attention
from errors import InvalidRequest, need
from kv_cache import BlockManager, KVCachePool, bytes_per_block, parse_memory
from cpu_linear import cpu_linear_path
from model import resolve_dtype
from paged_attention import AttentionMetadata
from sampler import SamplingParams, SamplingState, make_generator, sample, top_logprobs
from scheduler import ScheduledBatch, Scheduler, SchedulerConfig, Sequence, Status
from static_scheduler import StaticScheduler
from structured_output import GrammarCompiler, StructuredOutputsParams
from tokenizer import IncrementalDetokenizer, Tokenizer
from weights import load_model

__all__ = ["Engine", "EngineConfig", "EngineStats", "InvalidRequest", "PromptLimits", "SamplingParams",
           "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]


@dataclass
class EngineConfig(SchedulerConfig):
    """Everything LLM(...) and serve.py accept; the scheduler's fields come from SchedulerConfig."""
    model: str | None = None            # HF checkpoint dir or .gguf; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"                 # auto: bfloat16 on CUDA and on CPUs with AMX/avx512_bf16, else float32
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str = "2GiB"
    kv_cache_dtype: str = "auto"        # auto = the model dtype
    enable_prefix_caching: bool = True
    swap_space: int | str = 0           # bytes of host memory for swapped-out blocks
    attention_backend: str = "auto"     # auto | cpu | cuda | torch
    num_threads: int | None = None      # default: all cores
    seed: int = 0                       # for unseeded sampling

    def validate(self):
        super().validate()
        dtypes = ("auto", "float32", "bfloat16", "float16")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of two in [1, 128]",
             self.block_size)
        need(self.dtype in dtypes, "dtype", "|".join(dtypes), self.dtype)
        need(self.kv_cache_dtype in dtypes, "kv_cache_dtype", "|".join(dtypes), self.kv_cache_dtype)


@dataclass
class EngineStats:
    """A snapshot of the engine for /metrics (serve.py) and bench.py."""
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_hit_rate: float
    num_steps: int
    prompt_tokens_total: int            # prompt tokens computed (cache hits are not)
    generation_tokens_total: int
    num_seqs_last_step: int             # real rows of the last step (padding rows are counted below)
    num_batched_tokens_last_step: int   # their tokens
    num_padding_last_step: int          # static batching: finished members still computed
    num_prompt_padding_last_step: int   # static batching: left-padding rows of short prompts


@dataclass(frozen=True)
class PromptLimits:
    """What any prompt must fit on this engine. The engine checks it at add_request; serve.py's front
    end, which has no Engine, checks the same numbers before queueing, so a bad request fails before
    its stream starts."""
    vocab_size: int
    max_model_len: int
    block_size: int
    usable_blocks: int                  # the whole pool less the scheduler's watermark

    def check(self, ids: list[int], max_tokens: int):
        """Can a prompt of these token ids, with max_tokens more, ever run here?"""
        vocab = self.vocab_size
        if not ids:
            raise InvalidRequest("prompt", "prompt must not be empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"prompt token ids must be in [0, {vocab}), got {bad}")
        total, limit = len(ids) + max_tokens, self.max_model_len
        if len(ids) >= limit:
            raise InvalidRequest("prompt", f"prompt has {len(ids)} tokens; the context length is "
                                           f"max_model_len={limit}")
        if total > limit:
            raise InvalidRequest("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {total} "
                                               f"exceeds the context length max_model_len={limit}; use at most "
                                               f"{limit - len(ids)}")
        if -(-total // self.block_size) > self.usable_blocks:
            raise InvalidRequest("prompt", f"prompt + max_tokens = {total} tokens can never fit the KV cache "
                                           f"({self.usable_blocks} blocks of {self.block_size}); raise "
                                           f"kv_cache_memory or lower max_tokens")


@dataclass
class PhaseTimes:
    """Seconds spent in each phase of Engine.step, summed over steps (bench.py reads it).
    On a GPU `forward` only counts the launch unless the sampler's .tolist() syncs first."""
    schedule: float = 0.0
    prepare: float = 0.0                # block ops and building the flat batch tensors
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0                 # append tokens, detokenize, stop checks, outputs


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self):
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self):
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self):
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None   # None for the first prompt token


@dataclass
class Completion:
    """One of a request's n samples as it is being generated."""
    index: int
    seq: Sequence | None
    detok: IncrementalDetokenizer
    sampling: SamplingState           # its seed's generator, token counts for penalties, its grammar
    text: str = ""
    emitted_text: int = 0             # chars of text already sent as deltas
    emitted_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None   # filled chunk by chunk during prefill; entry j is token j's
    cache_salt: str | None = None         # prefix-cache blocks are shared only between requests with the same salt

    @property
    def finished(self):
        return all(c.finish_reason is not None for c in self.completions)


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, loaded_model=None, **overrides):
        """loaded_model: a (model, model_config, model_dir) from weights.load_model to share instead of
        loading again (bench.py runs many engines on one set of read-only weights)."""
        config = config or EngineConfig()
        for k, v in overrides.items():
            if k not in {f.name for f in fields(EngineConfig)}:
                raise InvalidRequest(k, f"unknown engine argument {k!r}")
            setattr(config, k, v)
        config.validate()
        self.config = config
        torch.set_num_threads(config.num_threads or os.cpu_count())
        self.device = torch.device(config.device if config.device != "auto"
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype, why = resolve_dtype(config.dtype, self.device)
        self.dtype = dtype                                  # what ran; bench.py prints it
        _log_once(f"nanoserve: dtype {str(dtype).removeprefix('torch.')} ({why})")
        self.model, self.model_config, self.model_dir = loaded_model or load_model(config.model, dtype, self.device)
        if self.device.type == "cpu":
            _log_once(f"nanoserve: linear layers {cpu_linear_path(dtype)}; {self.model.gguf_log}")
        self.model.prepare()     # not in the first request (the first after serve.py says it is up)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        mc = self.model_config
        config.max_model_len = config.max_model_len or mc.max_position_embeddings
        need(1 <= config.max_model_len <= mc.max_position_embeddings, "max_model_len",
             f"in [1, {mc.max_position_embeddings}]", config.max_model_len)
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(mc.eos_token_id) | {self.tokenizer.eos_token_id} - {None}
        self.attention_backend = paged_attention.resolve_backend(config.attention_backend, self.device.type)
        self._init_kv_cache(dtype)
        self.scheduler = (StaticScheduler if config.scheduler_mode == "static" else Scheduler)(config, self.blocks)
        self.prompt_limits = PromptLimits(mc.vocab_size, self.max_model_len, config.block_size,
                                          self.blocks.num_blocks - self.scheduler.watermark_blocks)
        self.requests: dict[str, Request] = {}
        self.seq_ids = itertools.count()
        self.generator = torch.Generator().manual_seed(config.seed)   # for unseeded sampling
        self.grammars: GrammarCompiler | None = None                   # built at the first structured request
        self.num_steps = self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_step = step_counts(ScheduledBatch([], []))
        self.phase_times = PhaseTimes()

    def _init_kv_cache(self, dtype):
        c, mc = self.config, self.model_config
        kv_dtype = dtype if c.kv_cache_dtype == "auto" else getattr(torch, c.kv_cache_dtype)
        per_block = bytes_per_block(mc.num_hidden_layers, c.block_size, mc.num_key_value_heads, mc.head_dim, kv_dtype)
        num_blocks = parse_memory(c.kv_cache_memory) // per_block
        need(num_blocks >= 2, "kv_cache_memory", f"enough for at least 2 blocks of {per_block} bytes",
             c.kv_cache_memory)
        num_host_blocks = parse_memory(c.swap_space) // per_block
        self.kv_pool = KVCachePool(mc.num_hidden_layers, num_blocks, c.block_size, mc.num_key_value_heads,
                                   mc.head_dim, kv_dtype, self.device, num_host_blocks)
        self.blocks = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching, num_host_blocks)
        if self.device.type == "cpu":
            _log_once(f"nanoserve: KV pool on {self.kv_pool.pages}")

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None):
        """Validate and queue a request. Raises InvalidRequest (naming the field) and changes nothing on bad input."""
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        need(request_id not in self.requests, "request_id", "unused", request_id)
        need(isinstance(priority, int), "priority", "an integer", priority)
        need(cache_salt is None or (isinstance(cache_salt, str) and cache_salt), "cache_salt",
             "a non-empty string or None", cache_salt)
        text, ids = self._tokenize(prompt)
        self.prompt_limits.check(ids, params.max_tokens)
        now = time.monotonic() if arrival_time is None else arrival_time
        req = Request(request_id, text, ids, params, [], RequestMetrics(now, num_prompt_tokens=len(ids)),
                      None if params.prompt_logprobs is None else [None], cache_salt)
        for i in range(params.n):             # each of n samples: its own seed stream, counts and grammar state
            state = SamplingState(params, ids, self.model_config.vocab_size, make_generator(params.seed, i),
                                  self.eos_token_ids, self._grammar(params.structured_outputs))
            req.completions.append(Completion(i, None, IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True),
                                              state))
        seq = Sequence(next(self.seq_ids), list(ids), len(ids), params.max_tokens, priority, now, request=req)
        req.completions[0].seq = seq                # samples 1..n-1 fork from it after its prefill
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _grammar(self, structured: StructuredOutputsParams | None):
        if structured is None:
            return None
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self.grammars.compile(structured)

    def _tokenize(self, prompt):
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest("prompt", "prompt must be a string or a list of token ids")

    def abort_request(self, request_id: str):
        """Drop a request (e.g. its client went away); its blocks return to the pool now."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for c in req.completions:
            if c.seq is not None:
                self.scheduler.remove(c.seq)
            if c.finish_reason is None:
                c.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()   # the sampler edits the model's logits in place: they are inference tensors
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self.last_step = step_counts(batch)
        t1 = time.perf_counter()
        self.kv_pool.run(batch.block_ops)                   # swaps and copy-on-write, before the forward
        if not batch.seqs:
            return []
        input_ids, positions, meta, logits_indices = self._build_batch(batch)
        prompt_indices, prompt_plan = self._prompt_logprob_rows(batch)
        num_sampled = len(logits_indices)
        if prompt_indices:                                  # prompt logprobs: more rows of the same forward
            logits_indices = torch.cat([logits_indices, torch.tensor(prompt_indices, device=self.device)])
        t2 = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_pool.kv_caches, meta, logits_indices)  # [num_sampled (+ prompt rows), vocab]
        if prompt_indices:
            self._record_prompt_logprobs(logits[num_sampled:], prompt_plan)
            logits = logits[:num_sampled]
        t3 = time.perf_counter()
        self.num_steps += 1
        self.num_prompt_tokens += sum(min(n, max(s.num_prompt_tokens - s.num_computed_tokens, 0))
                                      for s, n in zip(batch.seqs, batch.num_tokens) if not s.is_padding)
        ready = self.scheduler.finish_step(batch)           # the sequences that sample a token now
        outputs = self._sample_and_update(logits, ready)
        p = self.phase_times
        p.schedule, p.prepare, p.forward = p.schedule + t1 - t0, p.prepare + t2 - t1, p.forward + t3 - t2
        return outputs

    def _build_batch(self, batch):
        """Pack the scheduled tokens of every row into flat tensors (no padding between rows).
        Per-row Python only: positions and slots for all tokens are computed as tensors."""
        bs, seqs = self.config.block_size, batch.seqs
        starts = [s.num_computed_tokens for s in seqs]
        input_ids = [t for s, a, n in zip(seqs, starts, batch.num_tokens) for t in s.token_ids[a:a + n]]
        q_lens = torch.tensor(batch.num_tokens)                                   # [num_rows]
        ctx_lens = torch.tensor(starts) + q_lens                                  # [num_rows]
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])                                      # [num_rows + 1]
        # numpy's repeat: ~3 us; torch.repeat_interleave on CPU takes 0.3-2 ms (it goes parallel)
        row = torch.from_numpy(np.repeat(np.arange(len(seqs)), batch.num_tokens))   # [num_tokens] row of each token
        positions = ctx_lens[row] - q_lens[row] + (torch.arange(len(row)) - qsl[row])   # [num_tokens]
        # padding rows (static batching) may read past their own table: width covers every context
        width = max(max(len(s.block_table) for s in seqs), -(-int(ctx_lens.max()) // bs))
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                              dtype=torch.int64)                                  # [num_rows, width]
        slots = tables[row, positions // bs] * bs + positions % bs              # [num_tokens]
        padding = torch.tensor([s.is_padding for s in seqs])
        if padding.any():
            slots[padding[row]] = -1                                             # computed, never cached
        sampled = [i for i, s in enumerate(seqs)
                   if not s.is_padding and starts[i] + batch.num_tokens[i] == len(s.token_ids)]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), block_tables=tables.to(dev, torch.int32),
            context_lens=ctx_lens.to(dev, torch.int32), query_start_loc=qsl.to(dev, torch.int32),
            backend=self.attention_backend)
        logits_indices = qsl[1:][sampled] - 1                                    # last token of each sampled row
        return torch.tensor(input_ids).to(dev), positions.to(dev), meta, logits_indices.to(dev)

    def _sample_and_update(self, logits, seqs):
        t0 = time.perf_counter()
        rows, completions = [], []                          # one sampled row per completion
        for i, seq in enumerate(seqs):
            req = seq.request
            if req.params.n > 1 and req.completions[1].seq is None:
                self._fork_samples(req, seq)
                targets = req.completions                   # all n sample from the prompt's logits
            else:
                targets = [c for c in req.completions if c.seq is seq]
            rows += [i] * len(targets)
            completions += targets
        if rows != list(range(len(logits))):                # n > 1 repeats rows; else skip the [rows, vocab] copy
            logits = logits[rows]
        tokens, logprobs = sample(logits, [c.sampling for c in completions], self.generator)
        t1 = time.perf_counter()
        now = time.monotonic()
        touched = {}
        for c, tok, lp in zip(completions, tokens, logprobs):
            self._append_token(c, tok, lp, now)
            touched[c.seq.request.request_id] = c.seq.request
        outputs = [self._make_output(req) for req in touched.values()]
        self.phase_times.sample += t1 - t0
        self.phase_times.update += time.perf_counter() - t1
        return outputs

    def _prompt_logprob_rows(self, batch):
        """Prompt logprobs ride on the prefill the request already does: the logits of prompt
        position p give token p+1's logprob. Returns the flat-batch rows to add to this step's
        logits and, per request, the positions [lo, hi) they cover. Positions a prefix-cache hit
        skipped are recomputed here first (`_forward_cached_positions`); a recompute after
        preemption finds them already recorded and adds nothing."""
        rows, plan, offset = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            req, start = seq.request, seq.num_computed_tokens
            if not seq.is_padding and req is not None and req.prompt_logprobs is not None:
                needed, last = len(req.prompt_logprobs) - 1, seq.num_prompt_tokens - 1   # next position; end
                if needed < min(start, last):               # a cache hit skipped [needed, start)
                    hi = min(start, last)
                    self._record_prompt_logprobs(self._forward_cached_positions(seq, needed, hi), [(req, needed, hi)])
                lo, hi = max(start, len(req.prompt_logprobs) - 1), min(start + n, last)
                if lo < hi:
                    rows += range(offset + lo - start, offset + hi - start)
                    plan.append((req, lo, hi))
            offset += n
        return rows, plan

    def _forward_cached_positions(self, seq, lo: int, hi: int):
        """Logits at positions [lo, hi) of seq, whose K/V already sit in its cached blocks: one extra
        forward that reads the cache and writes nothing (slot -1)."""
        dev, q = self.device, hi - lo
        meta = AttentionMetadata(
            slot_mapping=torch.full((q,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([seq.block_table], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([hi], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, q], dtype=torch.int32, device=dev), backend=self.attention_backend)
        return self.model(torch.tensor(seq.token_ids[lo:hi], device=dev), torch.arange(lo, hi, device=dev),
                          self.kv_pool.kv_caches, meta, torch.arange(q, device=dev))    # [q, vocab]

    def _record_prompt_logprobs(self, logits, plan):
        """logits: [rows, vocab], the rows of plan's (request, lo, hi) ranges in order."""
        logprobs = logits.float().log_softmax(dim=-1).cpu()                             # [rows, vocab]
        offset = 0
        for req, lo, hi in plan:
            targets = req.prompt_token_ids[lo + 1:hi + 1]
            req.prompt_logprobs += top_logprobs(logprobs[offset:offset + hi - lo], targets,
                                                [req.params.prompt_logprobs] * (hi - lo))
            offset += hi - lo

    def _fork_samples(self, req: Request, parent: Sequence):
        """Prefill done once for n samples: the other n-1 start here, sharing the prompt's blocks."""
        for c in req.completions[1:]:
            c.seq = Sequence(next(self.seq_ids), list(parent.token_ids), parent.num_prompt_tokens,
                             parent.max_tokens, parent.priority, parent.arrival_time,
                             num_computed_tokens=parent.num_computed_tokens, request=req)
            self.scheduler.fork(parent, c.seq)

    def _append_token(self, c: Completion, token: int, logprob, now):
        seq, req = c.seq, c.seq.request
        seq.token_ids.append(token)
        c.sampling.append(token)
        self.num_generation_tokens += 1
        req.metrics.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if logprob is not None:
            c.logprobs = c.logprobs or []
            c.logprobs.append(logprob)
        p = req.params
        can_stop = seq.num_output_tokens >= p.min_tokens    # min_tokens: no stop id, EOS or stop string before
        if can_stop and (token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)):
            return self._finish(c, "stop", token, now)
        c.text += c.detok.step(token)
        # search only where a new match can start; one token may complete several stop strings,
        # and the one that starts earliest in the text wins (not the first listed)
        hits = [(at, i) for i, stop in enumerate(p.stop if can_stop else ())
                if (at := c.text.find(stop, max(0, c.emitted_text - len(stop) + 1))) != -1]
        if hits:
            at, i = min(hits)
            c.text = c.text[:at]
            return self._finish(c, "stop", p.stop[i], now)
        if c.sampling.grammar is not None and c.sampling.grammar.is_finished:   # nothing but EOS could follow
            return self._finish(c, "stop", None, now)
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(c, "length", None, now)

    def _finish(self, c: Completion, reason, stop_reason, now):
        c.finish_reason, c.stop_reason = reason, stop_reason
        if not isinstance(stop_reason, str):               # a cut at a stop string drops the tail anyway
            c.text += c.detok.flush()
        req = c.seq.request
        req.metrics.num_preemptions += c.seq.num_preemptions
        req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, c.seq.num_cached_tokens)
        self.scheduler.remove(c.seq)                        # blocks go back to the pool this step
        if req.finished:
            req.metrics.finished_time = now

    def _make_output(self, req: Request) -> RequestOutput:
        outs = []
        for c in req.completions:
            # hold back the tail that could still become a stop string, so streamed deltas never
            # show text that the final output cuts
            hold = 0 if c.finish_reason else max((len(s) - 1 for s in req.params.stop), default=0)
            visible = max(c.emitted_text, len(c.text) - hold)
            ids = c.seq.token_ids[c.seq.num_prompt_tokens:] if c.seq else []
            logprobs = None if c.logprobs is None else list(c.logprobs)   # a snapshot: other threads read it
            outs.append(CompletionOutput(c.index, c.text[:visible], ids, c.finish_reason, logprobs,
                                         c.text[c.emitted_text:visible], ids[c.emitted_tokens:], c.stop_reason))
            c.emitted_text, c.emitted_tokens = visible, len(ids)
        if req.finished:
            self.requests.pop(req.request_id, None)
        prompt_logprobs = None if req.prompt_logprobs is None else list(req.prompt_logprobs)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, req.metrics,
                             prompt_logprobs)

    # ------------------------------------------------------------------ introspection
    def all_sequences(self):
        """Every sequence that may hold blocks (finished static-batch members included)."""
        s = self.scheduler
        return (list(s.running) + list(s.waiting) + list(s.swapped)
                + list(getattr(s, "finished_members", [])))

    def check_invariants(self):
        self.blocks.check_invariants(self.all_sequences())
        for seq in self.scheduler.running:
            assert len(seq.block_table) * self.config.block_size >= seq.num_computed_tokens

    def stats(self) -> EngineStats:
        s, b = self.scheduler, self.blocks
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            num_preemptions=s.num_preemptions, kv_usage=b.usage(), num_free_blocks=b.num_free_blocks(),
            num_blocks=b.num_blocks, prefix_cache_hit_rate=b.hit_rate(), num_steps=self.num_steps,
            prompt_tokens_total=self.num_prompt_tokens, generation_tokens_total=self.num_generation_tokens,
            **self.last_step)


@functools.cache
def _log_once(message: str):
    print(message, file=sys.stderr, flush=True)


def step_counts(batch: ScheduledBatch) -> dict:
    """The last step's rows, as EngineStats names them (taken before the step retires anyone)."""
    rows = list(zip(batch.seqs, batch.num_tokens))
    return dict(num_seqs_last_step=sum(1 for s, _ in rows if not s.is_padding),
                num_batched_tokens_last_step=sum(n for s, n in rows if not s.is_padding),
                num_padding_last_step=sum(n for s, n in rows if s.is_padding and s.status is Status.FINISHED),
                num_prompt_padding_last_step=sum(n for s, n in rows if s.is_padding and s.status is not Status.FINISHED))
