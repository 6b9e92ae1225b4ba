"""
The engine: one step of continuous batching, and the requests it serves.

Engine.step() is the loop body, three calls in the order data flows (as nano-vllm's):
  schedule()     -> scheduler.py picks the rows: which sequences run, how many tokens each,
                    which block copies run first and which rows sample a token
  run_model()    -> model_runner.py packs the rows into flat tensors (no padding between rows)
                    and runs the model: logits for the rows that sample (and prompt-logprob rows)
  postprocess()  -> sampler.py draws the next tokens (penalties, logit_bias, min_tokens and
                    grammar masks on just the rows that ask); then append tokens, detokenize,
                    check stop conditions and retire finished sequences (their blocks return to
                    the pool this very step), and build each touched request's RequestOutput
With speculative_config (spec_decode.py), a decode row also carries drafts: postprocess verifies
them (spec_decode.Speculator.sample), rolls the cache back (Scheduler.accept_drafts), appends the
accepted run token by token, then proposes the next step's drafts.
With async_scheduling (on with CUDA), step() hands over to async_engine.py, which runs the same
calls in a two-slot pipeline: step N+1 is planned and launched before step N's outputs are processed.
llm.py's LLM.generate() drives step() until every request is done; serve.py drives it from
engine_core.py, in a process of its own. Owns requests and their outputs (sequence.py holds the
records); validates input once, at the edge (add_request). Its model, KV pool, model runner, scheduler
and speculator come from a builder (builder.py): the engine never asks how many ranks run them.
"""
import contextlib
import functools
import itertools
import os
import sys
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

import paged_attention
from builder import EngineBuilder
from cpu_linear import cpu_linear_path
from kv_cache import BlockManager, bytes_per_block, parse_memory
from model import resolve_dtype
from sampler import (SamplingParams, SamplingState, StructuredOutputsParams, bad_words_token_ids, make_generator,
                     sample_on_device, top_logprobs)
from scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from sequence import (Completion, CompletionOutput, InvalidRequest, Request, RequestMetrics, RequestOutput, Sequence,
                      need)
from tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:                       # optional parts, loaded by the builder only when a config asks
    from spec_decode import SpeculativeConfig
    from structured_output import GrammarCompiler

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
    kv_cache_dtype: str = "auto"        # auto = the model dtype; bfloat16 on the CPU's integer paths (kv_dtype_auto)
    enable_prefix_caching: bool = True
    swap_space: int | str = 0           # bytes of host memory for swapped-out blocks
    # the prefix cache's tiers below the device (kv_offload.py): evicted blocks go to host memory,
    # and from there to files under kv_offload_dir, and come back on a hit
    kv_offload_memory: int | str = 0
    kv_offload_dir: str | None = None
    kv_offload_disk: int | str = 0
    attention_backend: str = "auto"     # auto | cpu | cuda | torch
    enforce_eager: bool = False         # no CUDA graphs: every decode step runs eagerly (vLLM's name)
    num_threads: int | None = None      # default: all cores (under tensor parallelism: shared by the ranks)
    tensor_parallel_size: int = 1       # ranks that split each layer (parallel.py)
    seed: int = 0                       # for unseeded sampling
    # same tokens and logprobs whatever the batch, chunking or prefix cache (docs/batch-invariance.md);
    # CPU only. Default from vLLM's VLLM_BATCH_INVARIANT=1 or NANOSERVE_BATCH_INVARIANT=1.
    batch_invariant: bool = field(default_factory=lambda: any(
        os.environ.get(v, "0") not in ("", "0") for v in ("VLLM_BATCH_INVARIANT", "NANOSERVE_BATCH_INVARIANT")))
    speculative_config: "dict | SpeculativeConfig | None" = None   # vLLM's: {"method": "ngram", ...}
    # "gguf": only a GGUF's own Q4_0/Q4_1/Q8_0 blocks, at every batch; "int8": dynamic W8A8 from any
    # float checkpoint, exact int32 sums (batch-invariant too): docs/quantization.md
    quantization: str | None = None
    # overlapped scheduling (async_engine.py): the host plans step N+1 while the device runs step N.
    # None = on where a device runs apart from the host (CUDA); off on a CPU, where they are one
    async_scheduling: bool | None = None

    @classmethod
    def with_overrides(cls, config: "EngineConfig | None", overrides: dict) -> "EngineConfig":
        """config (or the defaults) with these fields set, validated; an unknown name is refused."""
        config = config or cls()
        for k, v in overrides.items():
            if k not in {f.name for f in fields(cls)}:
                raise InvalidRequest(k, f"unknown engine argument {k!r}")
            setattr(config, k, v)
        config.validate()
        return config

    def validate(self):
        super().validate()
        if self.speculative_config is not None:          # optional: spec_decode.py loads only when asked for
            from spec_decode import SpeculativeConfig
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        need(self.speculative_config is None or self.scheduler_mode == "continuous", "speculative_config",
             "None with scheduler_mode 'static' (the baseline does not speculate)", self.speculative_config)
        dtypes = ("auto", "float32", "bfloat16", "float16")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of two in [1, 128]",
             self.block_size)
        need(self.dtype in dtypes, "dtype", "|".join(dtypes), self.dtype)
        need(self.kv_cache_dtype in dtypes, "kv_cache_dtype", "|".join(dtypes), self.kv_cache_dtype)
        need(self.quantization in (None, "gguf", "int8"), "quantization", "None, 'gguf' or 'int8'", self.quantization)
        need(not (self.quantization and self.tensor_parallel_size > 1), "quantization",
             "None under tensor parallelism (each rank reads its float32 slice)", self.quantization)
        need(not (self.quantization == "gguf" and self.batch_invariant), "quantization",
             "None or 'int8' in batch-invariant mode (the gguf block kernel's sums depend on the rows beside them)",
             self.quantization)
        need(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
             "tensor_parallel_size", "an integer >= 1", self.tensor_parallel_size)


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
    num_seqs_last_step: int             # real rows of the last step (scratch rows are counted below)
    num_batched_tokens_last_step: int   # their tokens
    num_padding_last_step: int = 0      # static_scheduler.py's scratch rows: finished members still computed
    num_prompt_padding_last_step: int = 0   # and left padding of short prompts
    num_unforked_samples: int = 0       # samples 2..n of requests still in prefill: sequences yet to come
    spec_decode_num_drafts: int = 0             # speculative decoding, since start: rows that verified drafts,
    spec_decode_num_draft_tokens: int = 0       # their drafts,
    spec_decode_num_accepted_tokens: int = 0    # the accepted ones,
    spec_decode_num_emitted_tokens: int = 0     # and tokens those rows emitted (accepted + 1 each)
    spec_decode_mean_acceptance_length: float = 0.0   # emitted / verifying rows
    spec_decode_draft_tokens_last_step: int = 0
    spec_decode_accepted_tokens_last_step: int = 0
    spec_decode_emitted_tokens_last_step: int = 0
    spec_decode_num_steps_off: int = 0          # steps speculation sat out: a verify step there did not pay
    spec_decode_step_gain: float = 0.0          # measured speculative / plain tokens per second, last decision
    kv_offload: dict = field(default_factory=dict)   # per tier: hits, bytes, seconds, evictions (kv_offload.py)
    graph_steps: dict = field(default_factory=dict)  # since start, steps that replayed a CUDA graph, by kind
    eager_steps: dict = field(default_factory=dict)  # and steps that ran eagerly, by reason (model_runner.py)


@dataclass(frozen=True)
class PromptLimits:
    """What any prompt must fit on this engine, checked at add_request. serve.py's front end reads
    the numbers (its default max_tokens, /v1/models) from the copy the engine core sends it."""
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
                                           f"max_model_len={limit}", "context_length_exceeded")
        if total > limit:
            raise InvalidRequest("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {total} "
                                               f"exceeds the context length max_model_len={limit}; use at most "
                                               f"{limit - len(ids)}", "context_length_exceeded")
        if -(-total // self.block_size) > self.usable_blocks:
            raise InvalidRequest("prompt", f"prompt + max_tokens = {total} tokens can never fit the KV cache "
                                           f"({self.usable_blocks} blocks of {self.block_size}); raise "
                                           f"kv_cache_memory or lower max_tokens")


@dataclass
class PhaseTimes:
    """Seconds spent in each phase of Engine.step, summed over steps (bench.py reads them).
    On a GPU `forward` and `sample` count the host's launches; `wait` is the host blocked on the
    device (reading the sampled ids back), and `device` the device's own time per step, from the
    first upload to the sampled ids' copy (CUDA events: not a host phase, not in the step's sum)."""
    schedule: float = 0.0
    prepare: float = 0.0                # block copies and building the flat batch tensors
    forward: float = 0.0
    sample: float = 0.0
    wait: float = 0.0                   # the host waits for the device's sampled ids
    update: float = 0.0                 # append tokens, detokenize, stop checks, outputs
    device: float = 0.0                 # CUDA only: the device's span of the step, not a host phase

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)

    @staticmethod
    def mark(device: torch.device):
        """A timing event recorded on device's stream now (None off CUDA): a step's start."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add_device_span(self, start, end):
        """After `end` completed: the device's time from start to end (both events, or None)."""
        if start is not None and end is not None:
            self.device += start.elapsed_time(end) / 1e3


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, builder: EngineBuilder | None = None,
                 loaded_model=None, **overrides):
        """builder: makes the model, KV pool and model runner (builder.py; llm.build_engine picks it).
        loaded_model: a (model, model_config, model_dir) from weights.load_model to share instead of
        loading again (bench.py runs many engines on one set of read-only weights)."""
        self.config = config = EngineConfig.with_overrides(config, overrides)
        self.builder = builder or EngineBuilder()
        try:
            self._build(config, loaded_model)
        except BaseException:               # a start that fails after the builder started workers stops them
            self.builder.shutdown()
            raise

    def _build(self, config: EngineConfig, loaded_model):
        torch.set_num_threads(config.num_threads or os.cpu_count())
        self.device = torch.device(config.device if config.device != "auto"
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        need(not (config.batch_invariant and self.device.type == "cuda"), "batch_invariant",
             "off on CUDA: the GPU kernels' reduction order still depends on the batch (docs/batch-invariance.md)",
             config.batch_invariant)
        dtype, why = resolve_dtype(config.dtype, self.device)
        if auto_path_applies(config, self.device):
            dtype, why = auto_path(config, dtype, why, loaded_model)
        self.dtype = dtype                                  # what ran; bench.py prints it
        _log_once(f"nanoserve: dtype {str(dtype).removeprefix('torch.')}"
                  f"{f', quantization {config.quantization}' if config.quantization else ''} ({why})")
        self.attention_backend = paged_attention.resolve_backend(config.attention_backend, self.device.type)
        self.model, self.model_config, self.model_dir = self.builder.load_model(config, dtype, self.device,
                                                                                self.attention_backend, loaded_model)
        need(getattr(self.model, "quantization", None) == config.quantization, "loaded_model",
             f"a model loaded with quantization={config.quantization!r}", getattr(self.model, "quantization", None))
        if self.device.type == "cpu":
            path = "" if config.quantization else f"{cpu_linear_path(dtype, config.batch_invariant)}; "
            _log_once(f"nanoserve: linear layers {path}{self.model.gguf_log}")
        self.model = self.model.with_batch_invariant(config.batch_invariant)   # a shared model is not switched
        self.model.prepare()     # not in the first request (the first after serve.py says it is up)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        mc = self.model_config
        config.max_model_len = config.max_model_len or mc.max_position_embeddings
        need(1 <= config.max_model_len <= mc.max_position_embeddings, "max_model_len",
             f"in [1, {mc.max_position_embeddings}]", config.max_model_len)
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(mc.eos_token_id) | {self.tokenizer.eos_token_id} - {None}
        self._init_kv_cache(dtype)
        self.scheduler = self.builder.scheduler(config, self.blocks)
        bounds = self.scheduler.step_bounds()     # the runner's buffers hold any step this scheduler makes
        runner_args = (self.model, self.kv_pool, config.block_size, self.device, self.attention_backend,
                       bounds.max_rows, bounds.max_tokens, self.max_model_len, config.enforce_eager)
        spec_k = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        self.runner = self.builder.runner(*runner_args, num_speculative_tokens=spec_k)
        self.speculator = self.builder.speculator(config, dtype, self.device, self.attention_backend, self.blocks,
                                                  self.model_config.vocab_size, self.max_model_len, bounds)
        use_async = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self.device_sampler = None
        if self.device.type != "cpu" or use_async:
            self.use_device_sampler()
        self.runner.capture_graphs()       # decode (and verify) steps at every batch-size bucket (CUDA backend only)
        self.prompt_limits = PromptLimits(mc.vocab_size, self.max_model_len, config.block_size,
                                          self.blocks.num_blocks - self.scheduler.watermark_blocks)
        self.requests: dict[str, Request] = {}
        # disaggregation (scaleout/handoff.py): prompts whose blocks are on their way out, and on their way in
        self.exporting: dict[str, Sequence] = {}
        self.importing: dict[str, tuple[Request, Sequence]] = {}
        self.seq_ids = itertools.count()
        self.generator = torch.Generator().manual_seed(config.seed)   # for unseeded sampling
        self.grammars: "GrammarCompiler | None" = None                  # built at the first structured request
        self.num_steps = self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_step = self.scheduler.step_counts(ScheduledBatch([], []))
        self.phase_times = PhaseTimes()
        self.step_start = None                              # the running step's first event (CUDA)
        self.step_wall, self.step_probe = time.perf_counter(), None   # speculation's measure of a decode step
        self.overlap = self.builder.overlap_loop(self) if use_async else None   # async_scheduling: async_engine.py

    def use_device_sampler(self):
        """Sample from state kept on the device (sampling_slots.py), its inputs in the runner's one
        upload: on a GPU and under async scheduling. A CPU's plain loop keeps sampler.py's host path
        (host and device are one memory), as do speculative decoding and tensor parallelism."""
        if self.device_sampler is None and self.speculator is None and self.config.tensor_parallel_size == 1:
            vocab, bounds = self.model_config.vocab_size, self.scheduler.step_bounds()
            self.device_sampler = self.builder.device_sampler(vocab, self.device)
            self.runner.reserve_upload(self.device_sampler.upload_bytes(bounds.max_rows, vocab, self.max_model_len))

    def _init_kv_cache(self, dtype):
        c, mc = self.config, self.model.config      # the model's own: under tensor parallelism this rank's heads
        kv_dtype = kv_dtype_auto(dtype, c.quantization, self.device) if c.kv_cache_dtype == "auto" \
            else getattr(torch, c.kv_cache_dtype)
        per_block = bytes_per_block(mc.num_hidden_layers, c.block_size, mc.num_key_value_heads, mc.head_dim, kv_dtype)
        num_blocks = parse_memory(c.kv_cache_memory) // per_block
        need(num_blocks >= 2, "kv_cache_memory", f"enough for at least 2 blocks of {per_block} bytes",
             c.kv_cache_memory)
        num_host_blocks = parse_memory(c.swap_space) // per_block
        self.kv_pool = self.builder.kv_pool(mc.num_hidden_layers, num_blocks, c.block_size, mc.num_key_value_heads,
                                            mc.head_dim, kv_dtype, self.device, num_host_blocks)
        self.blocks = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching, num_host_blocks)
        model_id = f"{os.path.basename(os.path.normpath(str(self.model_dir)))} {c.quantization} {self.model_config}"
        self.offload = self.builder.offloader(c, self.kv_pool, self.blocks, model_id, kv_dtype)
        if self.device.type == "cpu":
            _log_once(f"nanoserve: KV pool on {self.kv_pool.pages}")

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None):
        """Validate and queue a request: the one place input is checked. Raises InvalidRequest
        (naming the field) and changes nothing on bad input. arrival_time (time.monotonic(), which
        every process shares) lets a front end count TTFT from when its client's request arrived."""
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
            state = self.sampling_state(params, ids, i)
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
            req.completions.append(Completion(i, None, detok, state))
        seq = Sequence(next(self.seq_ids), list(ids), len(ids), params.max_tokens, priority, now, request=req)
        req.completions[0].seq = seq                # samples 1..n-1 fork from it after its prefill
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def grammar_compiler(self) -> "GrammarCompiler":
        """Built at the first structured request; engine_core.py compiles ahead on its worker thread."""
        if self.grammars is None:
            from structured_output import GrammarCompiler    # llguidance: loaded with the first structured request
            self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self.grammars

    def sampling_state(self, params: SamplingParams, prompt_ids: list[int], index: int) -> SamplingState:
        """Sample `index` of a request: its seed stream, penalty counts, grammar (compiled here) and
        bad words (as the token sequences that would write them)."""
        structured = params.structured_outputs
        grammar = None if structured is None else self.grammar_compiler().compile(structured)
        return SamplingState(params, prompt_ids, self.model_config.vocab_size, make_generator(params.seed, index),
                             self.eos_token_ids, grammar, bad_words_token_ids(params.bad_words, self.tokenizer.encode))

    def _tokenize(self, prompt):
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest("prompt", "prompt must be a string or a list of token ids")

    def abort_request(self, request_id: str):
        """Drop a request (e.g. its client went away); its blocks return to the pool now."""
        for held in (self.exporting.pop(request_id, None), self.importing.pop(request_id, (None, None))[1]):
            if held is not None:
                self.blocks.free(held)
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for c in req.completions:
            if c.seq is not None:
                self.remove_sequence(c.seq)
            if c.finish_reason is None:
                c.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.exporting or self.importing)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()   # the sampler edits the model's logits in place: they are inference tensors
    def step(self) -> list[RequestOutput]:
        if self.overlap is not None:                        # async_scheduling: a two-slot pipeline around
            return self.overlap.step()                      # the same three calls (async_engine.py)
        return self.plain_step()

    @torch.inference_mode()
    def plain_step(self) -> list[RequestOutput]:
        self.step_wall = time.perf_counter()
        batch = self.schedule()
        logits, prompt_rows, staged = self.run_model(batch)   # [num_sampled + prompt rows, vocab]
        return self.postprocess(batch, logits, prompt_rows, staged)

    def schedule(self) -> ScheduledBatch:
        with self.phase_times.phase("schedule"):
            batch = self.scheduler.schedule()
            self.last_step = self.scheduler.step_counts(batch)
            if self.offload is not None:
                self.offload.step_done(batch.block_ops)
        return batch

    def run_model(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, "PromptLogprobRows", object]:
        """The forward: logits of the rows that sample, then of the prompt-logprob rows that ride on
        it (prompt_rows says which), and the device sampler's inputs, staged in the same upload (or
        None). A step with no rows (everyone was preempted) runs only its swaps."""
        self.step_start = self.phase_times.mark(self.device)
        prompt_rows = self.prompt_logprob_rows(batch)
        if not batch.seqs:
            self.kv_pool.run(batch.block_ops)
            return None, prompt_rows, None
        for seq, lo, hi in prompt_rows.skipped:             # positions a prefix-cache hit skipped: extra forwards
            for a, b, logits in self.runner.forward_cached(seq, lo, hi):   # in chunks the runner's buffers hold
                self.record_prompt_logprobs(logits, [(seq.request, a, b)])
        with self.phase_times.phase("prepare"):
            inputs = self.runner.prepare(batch, prompt_rows.rows, self.sampler_stage(batch))
        with self.phase_times.phase("forward"):
            return self.runner.forward(inputs), prompt_rows, inputs.extra

    def sampler_stage(self, batch: ScheduledBatch):
        """The device sampler's part of the step's upload: a function of the runner's buffers (None:
        sampler.py's host path, or nothing samples)."""
        if self.device_sampler is None or not batch.sample_rows:
            return None
        rows, completions = self.sample_targets([batch.seqs[i] for i in batch.sample_rows], fork=False)
        states = [c.sampling for c in completions]
        return lambda buffers: self.device_sampler.stage(buffers, states, rows, self.generator)

    def postprocess(self, batch: ScheduledBatch, logits, prompt_rows: "PromptLogprobRows",
                    staged=None) -> list[RequestOutput]:
        """Record prompt logprobs, mark the scheduled tokens computed, sample one token for every
        completion whose sequence finished its chunk, and apply each token."""
        if not batch.seqs:
            return []
        num_sampled = len(batch.sample_rows) + sum(batch.seqs[i].num_spec_tokens for i in batch.sample_rows)
        if prompt_rows.rows:
            self.record_prompt_logprobs(logits[num_sampled:], prompt_rows.plan)
            logits = logits[:num_sampled]
        speculated, generated = any(s.spec_token_ids for s in batch.seqs), self.num_generation_tokens
        prompt_before = self.num_prompt_tokens
        ready = self.finish_step(batch)                     # the sequences that sample a token now
        completions, tokens, logprobs = self._sample(logits, ready, staged)
        decode_only = self.num_prompt_tokens == prompt_before and not prompt_rows.rows
        self.step_probe = (len(batch.seqs), speculated, generated) if decode_only else None
        return self.apply_tokens(completions, tokens, logprobs)

    def finish_step(self, batch: ScheduledBatch) -> list[Sequence]:
        """Count the step and mark its scheduled tokens computed; returns the sequences that sample."""
        self.num_steps += 1
        real = batch.num_real_rows
        self.num_prompt_tokens += sum(min(n, max(s.num_prompt_tokens - s.num_computed_tokens, 0))
                                      for s, n in zip(batch.seqs[:real], batch.num_tokens[:real]))
        return self.scheduler.finish_step(batch)

    def apply_tokens(self, completions: list[Completion], tokens: list[list[int]], logprobs) -> list[RequestOutput]:
        """Append each completion's run of tokens (stop checks, detokenizing, retiring the finished)
        and return the touched requests' outputs."""
        with self.phase_times.phase("update"):
            now, touched = time.monotonic(), {}
            for c, run, lps in zip(completions, tokens, logprobs):
                if c.seq.spec_token_ids:                    # verified: keep the accepted drafts' K/V
                    self.scheduler.accept_drafts(c.seq, len(run) - 1)
                for tok, lp in zip(run, lps):               # EOS, a stop or max_tokens may end the run early
                    self._append_token(c, tok, lp, now)
                    if c.finish_reason is not None:
                        break
                touched[c.seq.request.request_id] = c.seq.request
            if self.speculator:
                if self.step_probe is not None:             # a decode-only step: what it cost, what it gave
                    rows, speculated, generated = self.step_probe
                    self.speculator.observe_step(rows, speculated, time.perf_counter() - self.step_wall,
                                                 self.num_generation_tokens - generated)
                    self.step_probe = None
                self.speculator.propose([c for c in completions if c.finish_reason is None],
                                        len(self.scheduler.running), self.generator)
            return [self._make_output(req) for req in touched.values()]

    def _sample(self, logits, seqs: list[Sequence], staged=None):
        """One sampled row per completion (1 + k rows with k drafts): a sequence that just finished its
        prompt's prefill with n > 1 forks its other samples here, and all n draw from the same row of
        logits. staged: the device sampler's inputs for these rows (sampling_slots.py), else sampler.py's
        host path. Returns, per completion, the tokens it emits and their logprobs (None: not asked for)."""
        rows, completions = self.sample_targets(seqs, fork=True)
        if staged is not None:
            with self.phase_times.phase("sample"):
                sampled = self.device_sampler.sample(logits, staged)
        else:
            if rows != list(range(len(logits))):            # n > 1 repeats rows; else skip the [rows, vocab] copy
                logits = logits[rows]
            if self.speculator:
                with self.phase_times.phase("sample"):
                    out = self.speculator.sample(logits, completions, self.generator)
                return completions, out.token_ids, [lp or [None] * len(t) for lp, t in zip(out.logprobs, out.token_ids)]
            with self.phase_times.phase("sample"):
                sampled = sample_on_device(logits, [c.sampling for c in completions], self.generator)
        with self.phase_times.phase("wait"):                # the step's one read from the device
            tokens, logprobs = sampled.read()
        self.phase_times.add_device_span(self.step_start, sampled.event)
        return completions, [[t] for t in tokens], [[lp] for lp in logprobs]

    def sample_targets(self, seqs: list[Sequence], fork: bool) -> tuple[list[int], list[Completion]]:
        """(each completion's logits row, the completions) that sample from these sequences' rows;
        fork: start the n > 1 samples of a prompt whose prefill just ended (before the step's forward,
        staging names them without forking)."""
        rows, completions, first = [], [], 0
        for seq in seqs:
            req, span = seq.request, range(first, first + 1 + seq.num_spec_tokens)
            first = span.stop
            if req.params.n > 1 and req.completions[1].seq is None:
                if fork:
                    self._fork_samples(req, seq)
                targets = req.completions
            else:
                targets = [c for c in req.completions if c.seq is seq]
            rows += list(span) * len(targets)
            completions += targets
        return rows, completions

    def prompt_logprob_rows(self, batch: ScheduledBatch) -> "PromptLogprobRows":
        """Prompt logprobs ride on the prefill the request already does: the logits of prompt
        position p give token p+1's logprob. Returns the flat-batch rows to add to this step's
        logits with, per request, the positions [lo, hi) they cover, and the positions a prefix-cache
        hit skipped (they need a forward of their own). A recompute after preemption finds its
        positions already recorded and adds nothing."""
        out, offset = PromptLogprobRows([], [], []), 0
        for seq, n in zip(batch.seqs[:batch.num_real_rows], batch.num_tokens):
            req, start = seq.request, seq.num_computed_tokens
            if req.prompt_logprobs is not None:
                needed, last = len(req.prompt_logprobs) - 1, seq.num_prompt_tokens - 1   # next position; end
                if needed < min(start, last):               # a cache hit skipped [needed, start)
                    out.skipped.append((seq, needed, min(start, last)))
                lo, hi = max(start, needed), min(start + n, last)
                if lo < hi:
                    out.rows += range(offset + lo - start, offset + hi - start)
                    out.plan.append((req, lo, hi))
            offset += n
        return out

    def record_prompt_logprobs(self, logits, plan):
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
        # min_tokens: no stop id, EOS or stop string before, unless the grammar has ended (it allowed only an end)
        grammar_ended = c.sampling.grammar is not None and c.sampling.grammar.is_finished
        can_stop = seq.num_output_tokens >= p.min_tokens or grammar_ended
        if can_stop and (token in p.stop_token_id_set or (token in self.eos_token_ids and not p.ignore_eos)):
            if p.include_stop_str_in_output:               # the stop token's text (none if skipped as special)
                c.text += c.detok.step(token)
            return self._finish(c, "stop", token, now)
        c.text += c.detok.step(token)
        # search only where a new match can start; one token may complete several stop strings,
        # and the one that starts earliest in the text wins (not the first listed)
        hits = [(at, i) for i, stop in enumerate(p.stop if can_stop else ())
                if (at := c.text.find(stop, max(0, c.emitted_text - len(stop) + 1))) != -1]
        if hits:
            at, i = min(hits)
            c.text = c.text[:at + len(p.stop[i]) if p.include_stop_str_in_output else at]
            return self._finish(c, "stop", p.stop[i], now)
        if grammar_ended:                                   # nothing but EOS could follow
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
        self.remove_sequence(c.seq)                                 # blocks go back to the pool this step
        if req.finished:
            req.metrics.finished_time = now

    def remove_sequence(self, seq: Sequence):
        """Take a sequence out of the batch (finished, aborted or handed to another core); its blocks return now."""
        self.scheduler.remove(seq)
        if self.device_sampler is not None and seq.request is not None:
            for c in seq.request.completions:
                if c.seq is seq:
                    self.device_sampler.release(c.sampling)
        if self.speculator:
            self.speculator.remove(seq.seq_id)

    def _make_output(self, req: Request) -> RequestOutput:
        outs = []
        for c in req.completions:
            # hold back the tail that could still become a stop string, so streamed deltas never
            # show text that the final output cuts
            hold = 0 if c.finish_reason else req.params.stop_hold_chars
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

    @property
    def tp(self):
        """The tensor-parallel group the builder started (scaleout/parallel.py), or None."""
        return self.builder.tp

    def shutdown(self):
        """Stop what the builder started: tensor-parallel workers and their group (nothing on one rank)."""
        self.builder.shutdown()

    # ------------------------------------------------------------------ introspection
    def check_invariants(self):
        held = list(self.exporting.values()) + [seq for _, seq in self.importing.values()]
        self.blocks.check_invariants(self.scheduler.all_sequences() + held)
        for seq in self.scheduler.running:
            assert len(seq.block_table) * self.config.block_size >= seq.num_computed_tokens
        if self.speculator:
            self.speculator.check_invariants({s.seq_id for s in self.scheduler.all_sequences()})

    def stats(self) -> EngineStats:
        s, b = self.scheduler, self.blocks
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            num_preemptions=s.num_preemptions, kv_usage=b.usage(), num_free_blocks=b.num_free_blocks(),
            num_blocks=b.num_blocks, prefix_cache_hit_rate=b.hit_rate(), num_steps=self.num_steps,
            prompt_tokens_total=self.num_prompt_tokens, generation_tokens_total=self.num_generation_tokens,
            num_unforked_samples=sum(r.params.n - 1 for r in self.requests.values()
                                     if r.params.n > 1 and r.completions[1].seq is None),
            **self.last_step, **(self.speculator.engine_stats() if self.speculator else {}),
            kv_offload=self.offload.stats() if self.offload is not None else {},
            graph_steps=dict(self.runner.graph_steps), eager_steps=dict(self.runner.eager_steps))


def auto_path_applies(config: EngineConfig, device: torch.device) -> bool:
    """dtype "auto" and no quantization asked, on a GGUF model on one CPU rank: the engine picks the
    fastest of the float, int8 and gguf paths (auto_path.py). Batch-invariant mode keeps the float path."""
    gguf = config.model is None or str(config.model).endswith(".gguf")
    return (config.dtype == "auto" and config.quantization is None and device.type == "cpu" and gguf
            and config.tensor_parallel_size == 1 and not config.batch_invariant)


def auto_path(config: EngineConfig, dtype: torch.dtype, why: str, loaded_model) -> tuple[torch.dtype, str]:
    """Sets config.quantization to the path auto_path.choose measured fastest (or the shared loaded
    model's); -> (the dtype it runs: float32 for the integer paths, the start-up line's reason)."""
    if loaded_model is not None:        # engines sharing weights run the path they were loaded for
        config.quantization = getattr(loaded_model[0], "quantization", None)
        reason = "the path of the model it shares"
    else:
        from auto_path import choose    # loaded only here: `from llm import LLM` stays small
        from weights import resolve_model_dir
        config.quantization, measured = choose(resolve_model_dir(config.model), dtype)
        reason = f"the fastest path here within the accuracy bounds, {measured}"
    path = f"quantization={config.quantization!r}" if config.quantization else f"{str(dtype).removeprefix('torch.')} weights"
    return (torch.float32 if config.quantization else dtype), f"{why}; path {path}: {reason}"


@functools.cache
def kv_dtype_auto(dtype: torch.dtype, quantization: str | None, device: torch.device) -> torch.dtype:
    """kv_cache_dtype "auto": the model's dtype, but bfloat16 where quantization="int8" or "gguf" runs on
    the CPU. Those paths take float32 activations only because their kernels do (the weights and the
    activations they multiply are 8-bit), and a decode batch's attention reads its whole cache every
    step: a 16-bit cache halves those bytes, which bound it (it streams the cache near memory speed),
    and keeps the paths' accuracy bounds (test_quantization_int8_keeps_greedy_tokens_and_perplexity).
    llama.cpp's default cache is 16-bit too. Ask for float32 to get float32."""
    return torch.bfloat16 if quantization and device.type == "cpu" and dtype == torch.float32 else dtype


def _log_once(message: str):
    print(message, file=sys.stderr, flush=True)


@dataclass
class PromptLogprobRows:
    """Where one step's prompt logprobs come from (Engine.prompt_logprob_rows)."""
    rows: list[int]                                  # flat-batch rows whose logits give prompt logprobs
    plan: list[tuple[Request, int, int]]             # per request, the positions [lo, hi) those rows cover
    skipped: list[tuple[Sequence, int, int]]         # positions [lo, hi) a prefix-cache hit skipped
