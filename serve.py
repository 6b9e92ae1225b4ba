"""
OpenAI-compatible HTTP server over one continuous-batching Engine: /v1/completions,
/v1/chat/completions, /v1/models, /health and /metrics (Prometheus text).

The Engine is not thread-safe, so one background thread (EngineLoop) owns it: HTTP handlers
hand add/abort commands to that thread through a locked deque, and it routes every
RequestOutput back to the handler's asyncio.Queue with loop.call_soon_threadsafe.
This file owns request parsing, OpenAI response formats, HTTP errors and metrics; it never
touches scheduling, sampling or KV blocks (engine.py and below own those).
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 shared cores: spinning OpenMP threads starve the event loop

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import math
import re
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Literal, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import Engine, EngineConfig, SamplingParams

log = logging.getLogger("nanoserve.serve")
MAX_N = 16                 # choices per prompt; more would let one request crowd out the batch
MAX_STEP_FAILURES = 3      # consecutive engine.step() exceptions before the engine is declared dead
DISCONNECT_POLL_S = 0.5    # how often a non-streamed request checks whether its client is gone


# ----------------------------------------------------------------------------- errors

class APIError(Exception):
    """An error that reaches the client as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "not_found_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation_error(errors: list[dict], skip_prefix: bool = False) -> APIError:
    """Map the first pydantic error to a 400 naming the offending top-level field."""
    err = errors[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"Invalid JSON body: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json")
    loc = [str(x) for x in err["loc"]][1 if skip_prefix else 0:]
    where = ".".join(loc) or "body"
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unsupported field '{where}'", loc[0], code="unsupported_field")
    return APIError(400, f"{where}: {err['msg']}", loc[0] if loc else None)


def param_of(message: str, aliases: dict[str, str]) -> str | None:
    """Engine/SamplingParams errors start with the field name ("top_p must be in (0, 1]")."""
    word = re.match(r"\s*([A-Za-z_]+)", message)
    field = word.group(1) if word else None
    if field in aliases:
        return aliases[field]
    return field if field in SAMPLING_FIELDS else None


SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt", "priority", "messages"}


# ----------------------------------------------------------------------------- request schemas

class Strict(BaseModel):
    # Unknown fields are rejected, never silently ignored; "5" is not an int.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
    """Fields shared by completions and chat; None means "use the SamplingParams default"."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = 0
    frequency_penalty: float | None = None   # accepted only as 0: the sampler has no penalties
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                  # the caller's end-user id for its own bookkeeping


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ----------------------------------------------------------------------------- metrics

class Histogram:
    def __init__(self, name: str, help_text: str, buckets: list[float]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts, self.sum, self.count = [0] * len(buckets), 0.0, 0
        self.lock = threading.Lock()  # observed on the step thread, rendered on the event loop

    def observe(self, value: float) -> None:
        with self.lock:
            for i, le in enumerate(self.buckets):
                self.counts[i] += value <= le
            self.sum += value
            self.count += 1

    def render(self, labels: str) -> list[str]:
        with self.lock:
            lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
            lines += [f'{self.name}_bucket{{{labels},le="{le}"}} {c}' for le, c in zip(self.buckets, self.counts)]
            lines += [f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}',
                      f"{self.name}_sum{{{labels}}} {self.sum}", f"{self.name}_count{{{labels}}} {self.count}"]
        return lines


class ServerMetrics:
    """Latency histograms and request counters the engine's stats() does not keep."""

    def __init__(self):
        self.ttft = Histogram("nanoserve:time_to_first_token_seconds", "Time from HTTP arrival to first token.",
                              [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80])
        self.tpot = Histogram("nanoserve:time_per_output_token_seconds", "Mean time between output tokens.",
                              [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5])
        self.e2e = Histogram("nanoserve:e2e_request_latency_seconds", "Time from HTTP arrival to last token.",
                             [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320])
        self.finished = collections.Counter()  # finish_reason -> requests
        self.failed = 0
        self.aborted = 0  # requests whose client left (or that failed) before they finished


# ----------------------------------------------------------------------------- engine thread

class ClientGone(Exception):
    """The client of a non-streamed request hung up; nobody is left to answer."""


class Run:
    """One HTTP request's sequences (one engine request per prompt) and the queue their outputs reach."""

    def __init__(self, request_ids: list[str], prompts: list[list[int]], params: SamplingParams, priority: int):
        self.request_ids, self.prompts, self.params, self.priority = request_ids, prompts, params, priority
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()   # ("admitted"|"output"|"error"|"gone", payload)
        self.arrival = time.monotonic()
        self.unfinished = set(request_ids)
        self.engine_loop: "EngineLoop | None" = None

    async def next(self):
        """The next (prompt index, RequestOutput)."""
        kind, payload = await self.queue.get()
        if kind == "gone":
            raise ClientGone()
        if kind == "error":
            raise payload
        index, out = payload
        if out.finished:
            self.unfinished.discard(out.request_id)
        return index, out

    async def watch_disconnect(self, request: Request) -> None:
        """For non-streamed requests, which Starlette does not cancel when the client leaves."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.queue.put_nowait(("gone", None))

    async def admitted(self) -> None:
        kind, payload = await self.queue.get()
        if kind == "error":
            raise payload

    def close(self) -> None:
        """Abort whatever has not finished (client gone, error, shutdown); safe to call twice."""
        if self.unfinished and self.engine_loop:
            self.engine_loop.abort(list(self.unfinished))
        self.unfinished.clear()


@dataclasses.dataclass
class Tracked:
    run: Run
    index: int                         # which prompt of the run
    first_token_time: float | None = None


class EngineLoop:
    """Owns the Engine: one thread drains add/abort commands, steps, and routes outputs to asyncio queues."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.metrics = ServerMetrics()
        self.stats = engine.stats()          # refreshed by the step thread; read by /metrics and admission
        self.dead_reason: str | None = None
        self.commands = collections.deque()  # ("add", Run) | ("abort", [request_id])
        self.num_pending_adds = 0
        self.lock = threading.Lock()         # guards commands, num_pending_adds and dead_reason
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.tracked: dict[str, Tracked] = {}  # step thread only
        self.thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)

    # -- called from the event loop
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout=30)

    def alive(self) -> bool:
        return self.dead_reason is None and self.thread.is_alive()

    def num_waiting(self) -> int:
        return self.stats.get("num_waiting", 0) + self.stats.get("num_swapped", 0) + self.num_pending_adds

    def submit(self, run: Run) -> None:
        with self.lock:
            if self.dead_reason is not None:
                raise APIError(503, f"engine is dead: {self.dead_reason}", code="engine_dead")
            run.engine_loop = self
            self.commands.append(("add", run))
            self.num_pending_adds += len(run.request_ids)
        self.wake.set()

    def abort(self, request_ids: list[str]) -> None:
        with self.lock:
            self.commands.append(("abort", request_ids))
        self.wake.set()

    # -- the step thread
    def _main(self) -> None:
        outbox: list = []
        try:
            self._serve(outbox)
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop died")
            with self.lock:
                self.dead_reason = repr(exc)
                leftover = [run for kind, run in self.commands if kind == "add"]
                self.commands.clear()
            dead = APIError(503, f"engine is dead: {exc!r}", code="engine_dead")
            self._fail_all(dead, outbox)
            outbox += [(run, ("error", dead)) for run in leftover]
            self._deliver(outbox)
            return
        self._fail_all(APIError(503, "server is shutting down", code="shutting_down"), outbox)
        self._deliver(outbox)

    def _serve(self, outbox: list) -> None:
        failures = 0
        while not self.stopping.is_set():
            self._drain(outbox)
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                    failures = 0
                except Exception as exc:
                    failures = self._step_failed(exc, failures + 1, outbox)
                    outputs = []
                self._route(outputs, outbox)
            self.stats = self.engine.stats()
            self._deliver(outbox)
            outbox.clear()
            if not self.engine.has_unfinished_requests():
                self.wake.wait(timeout=0.5)
                self.wake.clear()  # commands queued before this clear are drained next iteration

    def _step_failed(self, exc: Exception, failures: int, outbox: list) -> int:
        # We cannot tell which sequences the failing batch held, so every request in the engine fails.
        log.exception("engine.step() failed (%d in a row); failing %d requests", failures, len(self.tracked))
        self._fail_all(APIError(500, f"engine step failed: {exc!r}", code="engine_error"), outbox)
        self.engine.check_invariants()  # an inconsistent engine must not keep serving
        if failures >= MAX_STEP_FAILURES:
            raise RuntimeError(f"engine.step() failed {failures} times in a row") from exc
        return failures

    def _drain(self, outbox: list) -> None:
        with self.lock:
            commands = list(self.commands)
            self.commands.clear()
        num_added = 0
        for kind, payload in commands:
            if kind == "add":
                self._add(payload, outbox)
                num_added += len(payload.request_ids)
            else:
                for request_id in payload:
                    if self.tracked.pop(request_id, None) is not None:
                        self.engine.abort_request(request_id)
                        self.metrics.aborted += 1
        self.stats = self.engine.stats()  # before the pending count drops, so admission never undercounts
        with self.lock:
            self.num_pending_adds -= num_added

    def _add(self, run: Run, outbox: list) -> None:
        added = []
        try:
            for index, (request_id, prompt) in enumerate(zip(run.request_ids, run.prompts)):
                self.engine.add_request(request_id, prompt, run.params, priority=run.priority)
                added.append(request_id)
                self.tracked[request_id] = Tracked(run, index)
        except Exception as exc:  # ValueError: bad input (400); anything else fails only this request (500)
            if not isinstance(exc, ValueError):
                log.exception("add_request failed")
            for request_id in added:
                self.tracked.pop(request_id, None)
                self.engine.abort_request(request_id)
            outbox.append((run, ("error", exc)))
            return
        outbox.append((run, ("admitted", None)))

    def _route(self, outputs: list, outbox: list) -> None:
        now = time.monotonic()
        for out in outputs:
            entry = self.tracked.get(out.request_id)
            if entry is None:
                continue  # aborted while the step ran
            try:
                self._route_one(entry, out, outbox, now)
            except Exception as exc:  # a bug with one output fails that request, not the loop
                log.exception("routing output of %s failed", out.request_id)
                self.tracked.pop(out.request_id, None)
                self.engine.abort_request(out.request_id)
                outbox.append((entry.run, ("error", APIError(500, f"output processing failed: {exc!r}"))))

    def _route_one(self, entry: Tracked, out, outbox: list, now: float) -> None:
        if entry.first_token_time is None and any(c.token_ids for c in out.outputs):
            entry.first_token_time = now
            self.metrics.ttft.observe(now - entry.run.arrival)
        outbox.append((entry.run, ("output", (entry.index, out))))
        if out.finished:
            del self.tracked[out.request_id]
            self._observe_finished(entry, out, now)

    def _observe_finished(self, entry: Tracked, out, now: float) -> None:
        self.metrics.e2e.observe(now - entry.run.arrival)
        num_tokens = max(len(c.token_ids) for c in out.outputs)
        if entry.first_token_time is not None and num_tokens > 1:
            self.metrics.tpot.observe((now - entry.first_token_time) / (num_tokens - 1))
        for c in out.outputs:
            self.metrics.finished[c.finish_reason] += 1

    def _fail_all(self, exc: Exception, outbox: list) -> None:
        for request_id, entry in self.tracked.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request(%s) failed", request_id)
            outbox.append((entry.run, ("error", exc)))
            self.metrics.failed += 1
        self.tracked.clear()

    @staticmethod
    def _deliver(outbox: list) -> None:
        by_loop = collections.defaultdict(list)
        for run, item in outbox:
            by_loop[run.loop].append((run.queue, item))
        for loop, items in by_loop.items():  # one wake-up of the event loop per step, not one per sequence
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more


def put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


# ----------------------------------------------------------------------------- response formats

def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0  # JSON has no -Infinity


def top_entries(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]


def usage(prompts: list[list[int]], outs: list) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outs if out for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChoiceCursor:
    """What of one choice has been streamed so far: tokens sent, the text offset reached, and the
    echoed prompt still to send in front of the first text."""

    def __init__(self, echo: str = ""):
        self.num_tokens, self.text_offset, self.finished, self.echo = 0, len(echo), False, echo


# ----------------------------------------------------------------------------- the server

class OpenAIServer:
    def __init__(self, engine: Engine, served_model_name: str, max_waiting: int):
        self.engine, self.model_name, self.max_waiting = engine, served_model_name, max_waiting
        self.loop = EngineLoop(engine)
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.token_text_cache: dict[int, str] = {}

    # -- shared request plumbing
    async def parse(self, request: Request, schema: type[BaseModel]):
        try:
            req = schema.model_validate_json(await request.body())
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           "model", code="model_not_found")
        reject_unsupported(req)
        return req

    def token_ids(self, prompt: str | list[int], field: str) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, f"{field} must not be empty", field)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{field} token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", field)
        return ids

    def check_context(self, prompts: list[list[int]], max_tokens: int, prompt_field: str, max_field: str):
        limit = self.engine.max_model_len
        longest = max(len(p) for p in prompts)
        if longest >= limit:
            raise APIError(400, f"{prompt_field} has {longest} tokens; the maximum context length is {limit}",
                           prompt_field, code="context_length_exceeded")
        if longest + max_tokens > limit:
            raise APIError(400, f"{max_field}={max_tokens} plus the {longest} prompt tokens exceeds the maximum "
                           f"context length {limit}; use at most {limit - longest}", max_field,
                           code="context_length_exceeded")

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                        aliases: dict[str, str]) -> SamplingParams:
        if req.n is not None and req.n > MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {req.n}", "n")
        if req.seed is not None and not 0 <= req.seed < 2**32:  # the engine overflows on huge seeds
            raise APIError(400, f"seed must be an integer in [0, 2**32), got {req.seed}", "seed")
        names = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids")
        given = {name: getattr(req, name) for name in names if getattr(req, name) is not None}
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs, **given)
        try:
            params.validate(self.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), param_of(str(exc), aliases)) from None
        if req.priority and self.engine.config.scheduling_policy != "priority":
            raise APIError(400, "priority needs --scheduling-policy priority", "priority")
        return params

    async def start(self, request_prefix: str, prompts: list[list[int]], params: SamplingParams,
                    req: SamplingRequest, aliases: dict[str, str]) -> Run:
        """Admit one HTTP request into the engine; raises 503 when the waiting queue is full."""
        if self.loop.num_waiting() + len(prompts) > self.max_waiting:
            raise APIError(503, f"too many waiting requests (max {self.max_waiting}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        ids = [f"{request_prefix}-{i}" for i in range(len(prompts))]
        run = Run(ids, prompts, params, req.priority)
        self.loop.submit(run)
        try:
            await run.admitted()
        except ValueError as exc:  # the engine rejected the input at add time
            run.unfinished.clear()
            raise APIError(400, str(exc), param_of(str(exc), aliases)) from None
        except BaseException:
            run.close()
            raise
        return run

    async def finish(self, request: Request, run: Run, stream: bool, events, collect):
        """Stream the run as SSE or wait for all of it; the run is aborted however this ends early."""
        if stream:
            return EventStream(events(run), run)
        watcher = asyncio.create_task(run.watch_disconnect(request))
        try:
            outs = [None] * len(run.prompts)
            while run.unfinished:
                index, out = await run.next()
                outs[index] = out
            return JSONResponse(collect(outs))
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        finally:
            watcher.cancel()
            run.close()

    def token_text(self, token_id: int) -> str:
        text = self.token_text_cache.get(token_id)
        if text is None:
            text = self.token_text_cache[token_id] = self.tokenizer.decode([token_id])
        return text

    # -- /v1/completions
    async def completions(self, request: Request):
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported: the engine computes no prompt logprobs", "echo")
        texts = normalize_prompts(req.prompt)
        prompts = [self.token_ids(p, "prompt") for p in texts]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens   # OpenAI's legacy default
        aliases = {}
        params = self.sampling_params(req, max_tokens, req.logprobs, aliases)
        self.check_context(prompts, max_tokens, "prompt", "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        run = await self.start(request_id, prompts, params, req, aliases)
        echoes = [(t if isinstance(t, str) else self.tokenizer.decode(t)) if req.echo else "" for t in texts]
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        return await self.finish(request, run, req.stream,
                                 lambda r: self.completion_events(r, head, echoes, req),
                                 lambda outs: self.completion_body(outs, head, echoes, req, prompts))

    def completion_body(self, outs: list, head: dict, echoes: list[str], req: CompletionRequest, prompts) -> dict:
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                lp = self.legacy_logprobs(c, 0, len(c.token_ids), 0, req.logprobs) if req.logprobs is not None else None
                choices.append({"index": i * len(out.outputs) + c.index, "text": echoes[i] + c.text,
                                "logprobs": lp and lp[0], "finish_reason": c.finish_reason})
        return {**head, "choices": choices, "usage": usage(prompts, outs)}

    def legacy_logprobs(self, c, start: int, end: int, text_offset: int, top_n: int) -> tuple[dict, int]:
        """OpenAI's completions logprobs for tokens [start, end) of choice c, and the text offset after them."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, logprobs in zip(c.token_ids[start:end], c.logprobs[start:end]):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(finite(logprobs[token_id]))
            top.append({self.token_text(t): finite(v) for t, v in top_entries(logprobs, top_n)})
            offsets.append(text_offset)
            text_offset += len(text)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
        return body, text_offset

    async def completion_events(self, run: Run, head: dict, echoes: list[str], req: CompletionRequest):
        n = run.params.n
        cursors = {}
        outs = [None] * len(run.prompts)
        try:
            while run.unfinished:
                index, out = await run.next()
                outs[index] = out
                for c in out.outputs:
                    cursor = cursors.setdefault(index * n + c.index, ChoiceCursor(echoes[index]))
                    chunk = self.completion_chunk(c, cursor, req.logprobs)
                    if chunk is not None:
                        yield sse({**head, "choices": [{"index": index * n + c.index, **chunk}]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(run.prompts, outs)})
        except APIError as exc:
            yield sse(exc.body())
        yield "data: [DONE]\n\n"

    def completion_chunk(self, c, cursor: ChoiceCursor, top_n: int | None) -> dict | None:
        end = len(c.token_ids)
        if cursor.finished or (not c.delta_text and not cursor.echo and c.finish_reason is None
                               and end == cursor.num_tokens):
            return None
        echo, cursor.echo = cursor.echo, ""
        logprobs = None
        if top_n is not None:
            logprobs, cursor.text_offset = self.legacy_logprobs(c, cursor.num_tokens, end, cursor.text_offset, top_n)
        cursor.num_tokens, cursor.finished = end, c.finish_reason is not None
        return {"text": echo + c.delta_text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    # -- /v1/chat/completions
    async def chat_completions(self, request: Request):
        req: ChatRequest = await self.parse(request, ChatRequest)
        if not req.messages:
            raise APIError(400, "messages must contain at least one message", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        prompt = self.render_chat(req.messages)
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(prompt))  # OpenAI: up to the context length
        aliases = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_field}
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, aliases)
        self.check_context([prompt], max_tokens, "messages", max_field)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = await self.start(request_id, [prompt], params, req, aliases)
        head = {"id": request_id, "object": "chat.completion.chunk" if req.stream else "chat.completion",
                "created": int(time.time()), "model": self.model_name}
        return await self.finish(request, run, req.stream, lambda r: self.chat_events(r, head, req),
                                 lambda outs: self.chat_body(outs[0], head, req, [prompt]))

    def render_chat(self, messages: list[ChatMessage]) -> list[int]:
        plain = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                  else "".join(part.text for part in m.content)} for m in messages]
        try:
            rendered = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True)
        except Exception as exc:  # a template may reject e.g. an unexpected role order
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}", "messages") from None
        return self.token_ids(rendered, "messages")

    def chat_body(self, out, head: dict, req: ChatRequest, prompts: list[list[int]]) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0) if req.logprobs else None,
                    "finish_reason": c.finish_reason} for c in out.outputs]
        return {**head, "choices": choices, "usage": usage(prompts, [out])}

    def chat_logprobs(self, c, start: int, end: int, top_n: int) -> dict:
        def entry(token_id, logprob):  # bytes are exact even where a token holds half a UTF-8 character
            return {"token": self.token_text(token_id), "logprob": finite(logprob),
                    "bytes": list(self.tokenizer.token_bytes(token_id))}
        content = [{**entry(t, lps[t]), "top_logprobs": [entry(k, v) for k, v in top_entries(lps, top_n)]}
                   for t, lps in zip(c.token_ids[start:end], c.logprobs[start:end])]
        return {"content": content}

    async def chat_events(self, run: Run, head: dict, req: ChatRequest):
        cursors = [ChoiceCursor() for _ in range(run.params.n)]
        out = None
        try:
            for i in range(run.params.n):  # OpenAI opens every choice with the role alone
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            while run.unfinished:
                _, out = await run.next()
                for c in out.outputs:
                    chunk = self.chat_chunk(c, cursors[c.index], req)
                    if chunk is not None:
                        yield sse({**head, "choices": [{"index": c.index, **chunk}]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(run.prompts, [out])})
        except APIError as exc:
            yield sse(exc.body())
        yield "data: [DONE]\n\n"

    def chat_chunk(self, c, cursor: ChoiceCursor, req: ChatRequest) -> dict | None:
        end = len(c.token_ids)
        if cursor.finished or (not c.delta_text and c.finish_reason is None and end == cursor.num_tokens):
            return None
        logprobs = self.chat_logprobs(c, cursor.num_tokens, end, req.top_logprobs or 0) if req.logprobs else None
        cursor.num_tokens, cursor.finished = end, c.finish_reason is not None
        delta = {"content": c.delta_text} if c.delta_text or c.finish_reason is None else {}
        return {"delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason}

    # -- small endpoints
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "nanoserve", "max_model_len": self.engine.max_model_len}]}

    async def health(self):
        if self.loop.alive():
            return JSONResponse({"status": "ok"})
        reason = self.loop.dead_reason or "the engine loop is not running"
        return APIError(503, f"unhealthy: {reason}", code="engine_dead").response()

    async def prometheus(self):
        return Response(render_metrics(self), media_type="text/plain; version=0.0.4")


class EventStream(StreamingResponse):
    """SSE response that aborts its run however the stream ends: done, client gone, or server stopping.

    Closing here (not only in the generator's finally) also covers a generator that never started."""

    def __init__(self, events, run: Run):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def normalize_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def reject_unsupported(req: SamplingRequest) -> None:
    """OpenAI fields we parse but cannot honour: accepted at their neutral value, rejected otherwise."""
    for field in ("frequency_penalty", "presence_penalty"):
        if getattr(req, field):
            raise APIError(400, f"{field} is not supported (only 0)", field)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of is not supported (must equal n)", "best_of")


def render_metrics(server: OpenAIServer) -> str:
    stats, loop, labels = server.loop.stats, server.loop, f'model_name="{server.model_name}"'
    occupancy = stats.get("num_seqs_last_step", 0) / server.engine.config.max_num_seqs
    series = [  # (name, type, help, value)
        ("num_requests_running", "gauge", "Requests in the running batch.", stats.get("num_running", 0)),
        ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.get("num_waiting", 0)),
        ("num_requests_swapped", "gauge", "Preempted requests swapped out to CPU.", stats.get("num_swapped", 0)),
        ("num_preemptions_total", "counter", "Preemptions since start.", stats.get("num_preemptions", 0)),
        ("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0..1).", stats.get("kv_usage", 0.0)),
        ("num_free_blocks", "gauge", "Free KV cache blocks.", stats.get("num_free_blocks", 0)),
        ("num_total_blocks", "gauge", "All KV cache blocks.", stats.get("num_blocks", 0)),
        ("prompt_tokens_total", "counter", "Prompt tokens processed.", stats.get("prompt_tokens_total", 0)),
        ("generation_tokens_total", "counter", "Tokens generated.", stats.get("generation_tokens_total", 0)),
        ("batch_occupancy", "gauge", "Sequences in the last step / max_num_seqs.", occupancy),
        ("num_batched_tokens_last_step", "gauge", "Tokens in the last step.",
         stats.get("num_batched_tokens_last_step", 0)),
        ("queue_depth", "gauge", "Requests accepted over HTTP but not yet handed to the engine.",
         loop.num_pending_adds),
        ("prefix_cache_hit_rate", "gauge", "Prefix cache hit rate (0..1).", stats.get("prefix_cache_hit_rate", 0.0)),
        ("request_failures_total", "counter", "Requests failed by an engine error.", loop.metrics.failed),
        ("request_aborted_total", "counter", "Requests aborted unfinished (client gone).", loop.metrics.aborted),
    ]
    lines = []
    for name, kind, help_text, value in series:
        lines += [f"# HELP nanoserve:{name} {help_text}", f"# TYPE nanoserve:{name} {kind}",
                  f"nanoserve:{name}{{{labels}}} {value}"]
    lines += ["# HELP nanoserve:finished_sequences_total Finished choices (n per request) by finish_reason.",
              "# TYPE nanoserve:finished_sequences_total counter"]
    lines += [f'nanoserve:finished_sequences_total{{{labels},finished_reason="{reason}"}} {count}'
              for reason, count in sorted(loop.metrics.finished.items(), key=lambda kv: str(kv[0]))]
    for histogram in (loop.metrics.ttft, loop.metrics.tpot, loop.metrics.e2e):
        lines += histogram.render(labels)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- app and CLI

def build_app(engine: Engine, served_model_name: str, max_waiting: int = 256) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread (tests may run it in-process)."""
    server = OpenAIServer(engine, served_model_name, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.server = server
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    return app


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc.errors(), skip_prefix=True).response()  # 400 in OpenAI's shape, not 422


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail)).response()


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("request failed: %r", exc, exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", code="internal_error").response()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default = EngineConfig()
    p = argparse.ArgumentParser(description="nanoserve: an OpenAI-compatible server over a continuous-batching "
                                            "engine (vLLM's flag names; engine defaults shown).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the model's name)")
    p.add_argument("--max-num-seqs", type=int, help=f"max sequences in one batch (default {default.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help=f"token budget per step; prompts are prefilled in chunks (default {default.max_num_batched_tokens})")
    p.add_argument("--block-size", type=int, help=f"tokens per KV cache block (default {default.block_size})")
    p.add_argument("--kv-cache-memory", help=f"KV cache size, bytes or e.g. 512MiB (default {default.kv_cache_memory})")
    p.add_argument("--max-model-len", type=int, help="max prompt + output tokens (default: the model's context length)")
    p.add_argument("--dtype", help=f"model dtype: auto, float32, bfloat16, float16 (default {default.dtype})")
    p.add_argument("--attention-backend", help=f"auto, torch, cpu or cuda (default {default.attention_backend})")
    p.add_argument("--kv-cache-dtype", help=f"KV cache dtype, auto = model dtype (default {default.kv_cache_dtype})")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=f"reuse KV blocks of shared prompt prefixes (default {default.enable_prefix_caching})")
    p.add_argument("--scheduling-policy", help=f"fcfs, priority or lpm (default {default.scheduling_policy})")
    p.add_argument("--preemption-mode", help=f"recompute or swap (default {default.preemption_mode})")
    p.add_argument("--swap-space", help=f"CPU swap space for preemption-mode swap, e.g. 1GiB (default {default.swap_space})")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for the engine; beyond that: 503 with Retry-After (default 256)")
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Only flags the user gave override EngineConfig, so the engine's defaults stay the single source."""
    names = ["model", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "max_model_len",
             "dtype", "attention_backend", "kv_cache_dtype", "enable_prefix_caching", "scheduling_policy",
             "preemption_mode", "swap_space"]
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    for name in ("kv_cache_memory", "swap_space"):  # "1073741824" means bytes; "1GiB" stays a string
        if isinstance(given.get(name), str) and given[name].isdigit():
            given[name] = int(given[name])
    return EngineConfig(**given)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(engine_config(args))
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model or "SmolLM2-135M-Instruct"))
    app = build_app(engine, name, args.max_waiting)
    # uvicorn re-raises the signal it shut down on; a no-op handler turns that into a normal exit (status 0).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
