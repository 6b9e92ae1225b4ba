"""
The engine: one step of continuous batching, and the offline LLM front end.

Engine.step() is the whole loop body, in the order data flows:
  scheduler.schedule()  -> which sequences run and how many tokens each (scheduler.py)
  build the flat batch  -> input ids, positions, slot mapping, block tables, context lens,
                           query offsets (no padding: tokens of all sequences packed)
  model forward         -> logits for the last token of each sequence that completes its chunk
  sample                -> next tokens (sampler.py)
  update                -> append tokens, detokenize, check stop conditions, retire finished
                           sequences (their blocks return to the pool this very step)
LLM.generate() drives step() until every request is done; serve.py drives it from a thread.
Owns requests, their outputs and metrics; validates input at the edge (add_request).
"""
import itertools
import os
import time
from dataclasses import dataclass, field, fields

import torch

import paged_attention
from kv_cache import BlockManager, KVCachePool, bytes_per_block, parse_memory
from model import AttentionMetadata, load_model
from sampler import SamplingParams, make_generator, sample
from scheduler import Scheduler, SchedulerConfig, Sequence, Status
from tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]


@dataclass
class EngineConfig:
    model: str | None = None            # HF checkpoint dir or .gguf; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"                 # auto: float32 on CPU (no fast bf16 here), bfloat16 on CUDA
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str = "2GiB"
    kv_cache_dtype: str = "auto"        # auto = the model dtype
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512   # per-step token budget; prompts longer than it are chunked
    max_model_len: int | None = None    # default: the model's context length
    scheduler_mode: str = "continuous"  # continuous | static
    static_batch_size: int = 8
    scheduling_policy: str = "fcfs"     # fcfs | priority | lpm
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # recompute | swap
    swap_space: int | str = 0           # bytes of host memory for swapped-out blocks
    attention_backend: str = "auto"     # auto | cpu | cuda | torch
    num_threads: int | None = None      # default: all cores
    seed: int = 0                       # for unseeded sampling

    def validate(self):
        def need(ok, name, allowed):
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of two in [1, 128]")
        need(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        need(self.scheduler_mode in ("continuous", "static"), "scheduler_mode", "'continuous' or 'static'")
        need(self.static_batch_size >= 1, "static_batch_size", ">= 1")
        need(self.scheduling_policy in ("fcfs", "priority", "lpm"), "scheduling_policy", "'fcfs', 'priority' or 'lpm'")
        need(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "'recompute' or 'swap'")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "auto|float32|bfloat16|float16")
        need(self.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16"), "kv_cache_dtype",
             "auto|float32|bfloat16|float16")


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


@dataclass
class Completion:
    """One of a request's n samples as it is being generated."""
    index: int
    seq: Sequence | None
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
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

    @property
    def finished(self):
        return all(c.finish_reason is not None for c in self.completions)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = config or EngineConfig()
        for k, v in overrides.items():
            if k not in {f.name for f in fields(EngineConfig)}:
                raise ValueError(f"unknown engine argument {k!r}")
            setattr(config, k, v)
        config.validate()
        self.config = config
        torch.set_num_threads(config.num_threads or os.cpu_count())
        self.device = torch.device(config.device if config.device != "auto"
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = {"auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
                 "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]
        self.model, self.model_config, self.model_dir = load_model(config.model, dtype, self.device)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if not 1 <= self.max_model_len <= mc.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [1, {mc.max_position_embeddings}], got {self.max_model_len}")
        self.eos_token_ids = set(mc.eos_token_id) | {self.tokenizer.eos_token_id} - {None}
        self.attention_backend = paged_attention.resolve_backend(config.attention_backend, self.device.type)
        self._init_kv_cache(dtype)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, mode=config.scheduler_mode,
            static_batch_size=config.static_batch_size, policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode), self.blocks)
        self.requests: dict[str, Request] = {}
        self.seq_ids = itertools.count()
        self.generator = torch.Generator().manual_seed(config.seed)   # for unseeded sampling
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.last_step = {"num_seqs": 0, "num_batched_tokens": 0, "num_padding": 0, "num_prompt_padding": 0}

    def _init_kv_cache(self, dtype):
        c, mc = self.config, self.model_config
        kv_dtype = dtype if c.kv_cache_dtype == "auto" else getattr(torch, c.kv_cache_dtype)
        per_block = bytes_per_block(mc.num_hidden_layers, c.block_size, mc.num_key_value_heads, mc.head_dim, kv_dtype)
        num_blocks = parse_memory(c.kv_cache_memory) // per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory must hold at least 2 blocks of {per_block} bytes, got {c.kv_cache_memory!r}")
        num_host_blocks = parse_memory(c.swap_space) // per_block
        self.kv_pool = KVCachePool(mc.num_hidden_layers, num_blocks, c.block_size, mc.num_key_value_heads,
                                   mc.head_dim, kv_dtype, self.device, num_host_blocks)
        self.blocks = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching, num_host_blocks)

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None):
        """Validate and queue a request. Raises ValueError (naming the field) and changes nothing on bad input."""
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, ids = self._tokenize(prompt)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                             f"the context length max_model_len={self.max_model_len}")
        usable = self.blocks.num_blocks - self.scheduler.watermark_blocks
        if self.blocks.blocks_needed(total) > usable:
            raise ValueError(f"prompt + max_tokens = {total} tokens can never fit the KV cache "
                             f"({usable} blocks of {self.config.block_size}); raise kv_cache_memory or lower max_tokens")
        now = time.monotonic() if arrival_time is None else arrival_time
        req = Request(request_id, text, ids, params, [], RequestMetrics(now, num_prompt_tokens=len(ids)))
        for i in range(params.n):
            req.completions.append(Completion(i, None, IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True),
                                              make_generator(params.seed, i) or self.generator))
        seq = Sequence(next(self.seq_ids), list(ids), len(ids), params.max_tokens, priority, now, request=req)
        req.completions[0].seq = seq                # samples 1..n-1 fork from it after its prefill
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _tokenize(self, prompt):
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size}), got {bad[0]}")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt must not be empty")
        return text, ids

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
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.kv_pool.run(self.blocks.pending_ops)           # swaps and copy-on-write, before the forward
        self.blocks.pending_ops.clear()
        self.last_step = {"num_seqs": len(batch.seqs), "num_batched_tokens": sum(batch.num_tokens),
                          "num_padding": len(batch.padding),
                          "num_prompt_padding": sum(n for _, n in batch.prompt_padding)}
        if not batch.seqs:
            return []
        input_ids, positions, meta, sampled_seqs, logits_indices = self._build_batch(batch)
        logits = self.model(input_ids, positions, self.kv_pool.kv_caches, meta, logits_indices)  # [num_sampled, vocab]
        self.totals["steps"] += 1
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.blocks.cache_full_blocks(seq)
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.totals["prompt_tokens"] += n
        return self._sample_and_update(logits, sampled_seqs)

    def _build_batch(self, batch):
        """Pack the scheduled tokens of every sequence into flat tensors (no padding)."""
        bs = self.config.block_size
        input_ids, positions, slots, ctx_lens, qsl = [], [], [], [], [0]
        sampled_seqs, sample_idx = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            ctx_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            if start + n == len(seq.token_ids):            # chunk reaches the end: sample a token
                sampled_seqs.append(seq)
                sample_idx.append(qsl[-1] - 1)
        for seq in batch.padding:                           # static mode: a finished row still costs a
            p = max(seq.num_computed_tokens - 1, 0)         # token; it recomputes its last cached one into
            input_ids.append(seq.token_ids[p])              # the same slot, and nothing is sampled from it
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            ctx_lens.append(p + 1)
            qsl.append(qsl[-1] + 1)
        for seq, n in batch.prompt_padding:                 # static mode: left padding of a short prompt,
            p = len(seq.block_table) * bs - 1               # n throwaway rows that attend to each other and
            input_ids += [seq.token_ids[0]] * n             # write one slot its member never uses (its
            positions += [p] * n                            # reservation's last, past its last computed token)
            slots += [seq.block_table[p // bs] * bs + p % bs] * n
            ctx_lens.append(n)
            qsl.append(qsl[-1] + n)
        rows = batch.seqs + batch.padding + [seq for seq, _ in batch.prompt_padding]
        width = max(max(len(s.block_table) for s in rows), -(-max(ctx_lens) // bs))   # pad rows may read past theirs
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in rows]
        dev = self.device
        as_tensor = lambda x, dt: torch.tensor(x, dtype=dt).to(dev, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots, torch.int64), block_tables=as_tensor(tables, torch.int32),
            context_lens=as_tensor(ctx_lens, torch.int32), query_start_loc=as_tensor(qsl, torch.int32),
            backend=self.attention_backend)
        return (as_tensor(input_ids, torch.int64), as_tensor(positions, torch.int64), meta,
                sampled_seqs, as_tensor(sample_idx, torch.int64))

    def _sample_and_update(self, logits, seqs):
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
        params = [c.seq.request.params for c in completions]
        tokens, logprobs = sample(logits[rows], params, [c.generator for c in completions])
        now = time.monotonic()
        touched = {}
        for c, tok, lp in zip(completions, tokens, logprobs):
            self._append_token(c, tok, lp, now)
            touched[c.seq.request.request_id] = c.seq.request
        return [self._make_output(req) for req in touched.values()]

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
        self.totals["generation_tokens"] += 1
        req.metrics.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if logprob is not None:
            c.logprobs = c.logprobs or []
            c.logprobs.append(logprob)
        p = req.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return self._finish(c, "stop", token, now)
        c.text += c.detok.step(token)
        for stop in p.stop:                                 # search only where a new match can start
            at = c.text.find(stop, max(0, c.emitted_text - len(stop) + 1))
            if at != -1:
                c.text = c.text[:at]
                return self._finish(c, "stop", stop, now)
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
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, req.metrics)

    # ------------------------------------------------------------------ introspection
    def all_sequences(self):
        s = self.scheduler
        return list(s.running) + list(s.waiting) + list(s.swapped) + list(s.padding)

    def check_invariants(self):
        self.blocks.check_invariants(self.all_sequences())
        for seq in self.scheduler.running:
            assert len(seq.block_table) * self.config.block_size >= seq.num_computed_tokens

    def stats(self) -> dict:
        s, b = self.scheduler, self.blocks
        return {
            "num_running": len(s.running), "num_waiting": len(s.waiting), "num_swapped": len(s.swapped),
            "num_preemptions": s.num_preemptions, "kv_usage": b.usage(),
            "num_free_blocks": b.num_free_blocks(), "num_blocks": b.num_blocks,
            "prompt_tokens_total": self.totals["prompt_tokens"],
            "generation_tokens_total": self.totals["generation_tokens"],
            "num_seqs_last_step": self.last_step["num_seqs"],
            "num_batched_tokens_last_step": self.last_step["num_batched_tokens"],
            "num_padding_last_step": self.last_step["num_padding"],
            "num_prompt_padding_last_step": self.last_step["num_prompt_padding"],
            "prefix_cache_hit_rate": b.hit_rate(),
        }


class LLM:
    """Offline generation: `LLM().generate(prompts, SamplingParams(...))`, names as in vLLM."""

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = Engine(EngineConfig(model=model), **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _add_all(self, prompts, sampling_params, priority):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        priority = priority or [0] * len(prompts)
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                ids.append(f"llm-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p or SamplingParams(), prio)
        except ValueError:
            for rid in ids:                                 # all or nothing: no half-added batch
                self.engine.abort_request(rid)
            raise
        return ids

    def stream(self, prompts, sampling_params=None, priority=None):
        """Yield RequestOutputs (with delta_text/delta_token_ids) as tokens are produced."""
        ids = set(self._add_all(prompts, sampling_params, priority))
        try:
            while ids and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in ids:
                        yield out
                        if out.finished:
                            ids.discard(out.request_id)
        finally:
            for rid in ids:                                 # a consumer that stops early aborts the rest
                self.engine.abort_request(rid)

    def generate(self, prompts, sampling_params=None, use_tqdm=False, priority=None) -> list[RequestOutput]:
        ids = self._add_all(prompts, sampling_params, priority)
        final, bar = {}, None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar:
                            bar.update(1)
        finally:
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
            if bar:
                bar.close()
        return [final[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, use_tqdm=False) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in convs]
        return self.generate(prompts, sampling_params, use_tqdm)
