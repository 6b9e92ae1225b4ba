"""
OpenAI-compatible HTTP server over one continuous-batching Engine: /v1/completions,
/v1/chat/completions, /v1/models, /health and /metrics (Prometheus text), and its CLI.

One request, HTTP to sampler and back: a route reads the body (413 over --max-request-bytes),
openai_api.py parses it and tokenizes (off the event loop) into an Exchange, OpenAIServer.start
admits it as a Run through the EngineClient (engine_client.py), which sends it over a pipe to the
engine core (engine_core.py: the process that owns the Engine and steps it) and routes each
RequestOutput the core sends back to the Run; the route answers with a JSON body or an SSE stream
built by the Exchange. This process owns routes, admission (API key, body size, queue bound),
disconnects, graceful shutdown and /metrics; it never holds the Engine: the engine core process does,
so the GIL this process's Python holds never pauses a step.
"""
import os

# The engine core process inherits this: a step is hundreds of small OpenMP ops, and a short spin
# between them (bench.py's) beats a passive wait's wake-up per op; docs/http.md has the numbers.
# An OMP_WAIT_POLICY or GOMP_SPINCOUNT you set wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine import Engine, EngineConfig, InvalidRequest
from engine_client import ClientGone, EngineClient, Failed, Run
from openai_api import APIError, ChatExchange, ChatRequest, CompletionExchange, CompletionRequest, Exchange, \
    OpenAIProtocol, RequestLimits
import launcher

log = logging.getLogger("nanoserve.serve")


# ----------------------------------------------------------------------------- the server

class OpenAIServer:
    """The route handlers: admission through the EngineClient, then a JSON body or an SSE stream."""

    def __init__(self, client: EngineClient, served_model_name: str, max_waiting: int, max_request_bytes: int,
                 limits: RequestLimits = RequestLimits(), body_timeout: float = 30.0):
        self.client, self.model_name, self.max_waiting = client, served_model_name, max_waiting
        self.max_request_bytes, self.body_timeout = max_request_bytes, body_timeout
        info = client.info
        # a request bigger than the whole queue could never be admitted: a 400, not a 503 forever
        limits = dataclasses.replace(limits, max_seqs_per_request=min(limits.max_seqs_per_request, max_waiting))
        self.api = OpenAIProtocol(client.tokenizer, info.limits, info.scheduling_policy, served_model_name, limits)
        self.runs: set[Run] = set()       # admitted (or being admitted) and not yet closed
        self.accepting = True             # False once shutdown began: new work gets 503

    async def completions(self, request: Request):
        return await self.answer(request, CompletionRequest, CompletionExchange)

    async def chat_completions(self, request: Request):
        return await self.answer(request, ChatRequest, ChatExchange)

    async def answer(self, request: Request, schema: type, exchange_type: type):
        """Admit the request, then stream the run as SSE or wait for all of it; the run is aborted
        however this ends early. Everything before admission is cheap and costs the engine nothing."""
        requests = self.client.metrics.requests
        requests["received"] += 1
        try:
            self.check_accepting()
            body = await read_body(request, self.max_request_bytes, self.body_timeout)
            # parsing a big body, tokenizing and templating a long prompt take a while: off the event loop,
            # so others keep streaming
            exchange = await asyncio.to_thread(lambda: exchange_type(self.api, self.api.parse(body, schema)))
            self.check_capacity(len(exchange.prompts) * exchange.params.n)   # sequences, as the engine holds them
        except BaseException:
            requests["rejected"] += 1
            raise
        run = await self.start(exchange)  # from here on the run counts how the request ends
        if exchange.req.stream:
            return EventStream(exchange.events(run.outputs()), run)
        watcher = asyncio.create_task(run.watch_disconnect(request))
        try:
            outs = [None] * len(run.prompts)
            async for index, out in run.outputs():
                outs[index] = out
            return JSONResponse(exchange.body(outs))
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        finally:
            watcher.cancel()
            run.close()

    def check_accepting(self) -> None:
        if not self.accepting:
            raise APIError(503, "server is shutting down; retry on another replica", code="shutting_down",
                           headers={"Retry-After": "5"})

    def check_capacity(self, num_seqs: int) -> None:
        if self.client.num_waiting() + num_seqs > self.max_waiting:
            raise APIError(503, f"too many waiting requests (max {self.max_waiting}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})

    async def start(self, exchange: Exchange) -> Run:
        """Admit one HTTP request into the engine; a refusal is counted as rejected, a hang-up as aborted."""
        ids = [f"{exchange.request_id}-{i}" for i in range(len(exchange.prompts))]
        run = Run(self.client, ids, exchange.prompts, exchange.params, exchange.req.priority, exchange.req.cache_salt,
                  self.runs)
        try:
            self.client.submit(run)
            await run.admitted()
        except InvalidRequest as exc:  # the engine rejected the input at add time
            run.unfinished.clear()
            run.close("rejected")
            raise exchange.engine_error(exc) from None
        except BaseException as exc:   # engine dead (503), add failed (500), or the client left while queued
            run.close("aborted" if isinstance(exc, asyncio.CancelledError)
                      else "rejected" if isinstance(exc, APIError) else "failed")
            raise
        return run

    def abort_all(self, error: APIError) -> None:
        """Shutdown's last word: every run still in flight ends with this error."""
        for run in list(self.runs):
            run.notify(Failed(error))

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "nanoserve", "max_model_len": self.api.max_model_len}]}

    async def health(self):
        if not self.accepting:            # draining: a load balancer should send new traffic elsewhere
            return APIError(503, "draining: the server is shutting down", code="shutting_down").response()
        if self.client.alive():   # some cores dead, some serving: 200, so traffic still comes, and the body says so
            dead = self.client.dead_cores()
            return JSONResponse({"status": "degraded", "dead_cores": dead} if dead else {"status": "ok"})
        reason = self.client.dead_reason or "the engine core is not running"
        return APIError(503, f"unhealthy: {reason}", code="engine_dead").response()

    async def prometheus(self):
        return Response(render_metrics(self), media_type="text/plain; version=0.0.4")


async def read_body(request: Request, limit: int, timeout: float = 30.0) -> bytes:
    """The request body, refused (413) as soon as it is known to be over the limit: a 5 MB prompt
    is never parsed, tokenized or queued. A body that takes over `timeout` seconds to arrive gets 408
    (a client trickling bytes holds a connection and nothing else); a client that hangs up mid-upload
    is one log line."""
    declared = request.headers.get("content-length", "")
    size, chunks = int(declared) if declared.isdigit() else 0, []
    if size <= limit:
        size = 0
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        break
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"request body not received within {timeout:g} s (--timeout-body)", "body",
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            log.info("client %s hung up while sending its request body", request.client and request.client.host)
            raise APIError(499, "client disconnected", code="client_disconnected") from None
    if size > limit:
        raise APIError(413, f"request body is over {limit} bytes (--max-request-bytes)", "body",
                       code="request_too_large")
    return b"".join(chunks)


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


def render_metrics(server: OpenAIServer) -> str:
    stats, client, labels = server.client.stats, server.client, f'model_name="{server.model_name}"'
    occupancy = stats.num_seqs_last_step / client.info.max_num_seqs
    series = [  # (name, type, help, value)
        ("num_requests_running", "gauge", "Requests in the running batch.", stats.num_running),
        ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.num_waiting),
        ("num_requests_swapped", "gauge", "Preempted requests swapped out to CPU.", stats.num_swapped),
        ("num_preemptions_total", "counter", "Preemptions since start.", stats.num_preemptions),
        ("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0..1).", stats.kv_usage),
        ("num_free_blocks", "gauge", "Free KV cache blocks.", stats.num_free_blocks),
        ("num_total_blocks", "gauge", "All KV cache blocks.", stats.num_blocks),
        ("prompt_tokens_total", "counter", "Prompt tokens processed.", stats.prompt_tokens_total),
        ("generation_tokens_total", "counter", "Tokens generated.", stats.generation_tokens_total),
        ("batch_occupancy", "gauge", "Sequences in the last step / max_num_seqs.", occupancy),
        ("num_batched_tokens_last_step", "gauge", "Tokens in the last step.",
         stats.num_batched_tokens_last_step),
        ("queue_depth", "gauge", "Requests accepted over HTTP but not yet handed to the engine.",
         client.num_pending_adds),
        ("prefix_cache_hit_rate", "gauge", "Prefix cache hit rate (0..1).", stats.prefix_cache_hit_rate),
        ("requests_received_total", "counter", "Generation requests received (= finished + aborted + rejected "
         "+ failed once they end).", client.metrics.requests["received"]),
        ("requests_finished_total", "counter", "Requests that ran to their end.", client.metrics.requests["finished"]),
        ("request_aborted_total", "counter", "Admitted requests aborted unfinished: the client left, or shutdown.",
         client.metrics.requests["aborted"]),
        ("requests_rejected_total", "counter", "Requests refused before they ran (4xx, 503).",
         client.metrics.requests["rejected"]),
        ("request_failures_total", "counter", "Admitted requests failed by an engine error.",
         client.metrics.requests["failed"]),
        ("requests_in_flight", "gauge", "Admitted requests not yet ended.", len(server.runs)),
        ("spec_decode_num_drafts_total", "counter", "Speculative decoding: rows that verified drafts.",
         stats.spec_decode_num_drafts),
        ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", stats.spec_decode_num_draft_tokens),
        ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
         stats.spec_decode_num_accepted_tokens),
        ("spec_decode_num_emitted_tokens_total", "counter", "Tokens emitted by verifying rows (accepted + 1 each).",
         stats.spec_decode_num_emitted_tokens),
        ("spec_decode_mean_acceptance_length", "gauge", "Tokens per verifying row: 1 + accepted / rows.",
         stats.spec_decode_mean_acceptance_length),
        ("spec_decode_num_steps_off_total", "counter", "Steps speculation sat out: a verify step did not pay there.",
         stats.spec_decode_num_steps_off),
        ("spec_decode_step_gain", "gauge", "Measured tokens/s of speculative over plain steps, last decision.",
         stats.spec_decode_step_gain),
        ("spec_decode_draft_tokens_last_step", "gauge", "Draft tokens verified in the last step.",
         stats.spec_decode_draft_tokens_last_step),
        ("spec_decode_accepted_tokens_last_step", "gauge", "Draft tokens accepted in the last step.",
         stats.spec_decode_accepted_tokens_last_step),
    ]
    lines = []
    for name, kind, help_text, value in series:
        lines += [f"# HELP nanoserve:{name} {help_text}", f"# TYPE nanoserve:{name} {kind}",
                  f"nanoserve:{name}{{{labels}}} {value}"]
    lines += kv_offload_lines(stats.kv_offload, labels)
    lines += ["# HELP nanoserve:finished_sequences_total Finished choices (n per request) by finish_reason.",
              "# TYPE nanoserve:finished_sequences_total counter"]
    lines += [f'nanoserve:finished_sequences_total{{{labels},finished_reason="{reason}"}} {count}'
              for reason, count in sorted(client.metrics.finished.items(), key=lambda kv: str(kv[0]))]
    for histogram in (client.metrics.ttft, client.metrics.tpot, client.metrics.e2e):
        lines += histogram.render(labels)
    lines += client.metrics_lines(labels)             # a data-parallel client's per-core series; else none
    return "\n".join(lines) + "\n"


def kv_offload_lines(tiers: dict, labels: str) -> list[str]:
    """The prefix cache's offload tiers (kv_offload.py), one series per figure with a tier label."""
    if not tiers:
        return []
    lines = []
    for name, help_text in [("hits", "Blocks restored to the device from the tier."),
                            ("bytes_read", "Bytes read from the tier."), ("bytes_written", "Bytes written to the tier."),
                            ("read_s", "Seconds spent reading the tier."), ("write_s", "Seconds spent writing the tier."),
                            ("evictions", "Blocks the tier dropped (host: moved on to disk when there is one)."),
                            ("errors", "Files skipped and failed reads or writes."), ("blocks", "Blocks the tier holds.")]:
        metric = f"kv_offload_{name.removesuffix('_s')}" + ("_seconds" if name.endswith("_s") else "") + \
            ("" if name == "blocks" else "_total")
        kind = "gauge" if name == "blocks" else "counter"
        lines += [f"# HELP nanoserve:{metric} {help_text}", f"# TYPE nanoserve:{metric} {kind}"]
        lines += [f'nanoserve:{metric}{{{labels},tier="{tier}"}} {t[name]}' for tier, t in tiers.items()
                  if isinstance(t, dict)]
    lines += ["# HELP nanoserve:kv_offload_restored_blocks_last_step Blocks brought back to the device in the last step.",
              "# TYPE nanoserve:kv_offload_restored_blocks_last_step gauge",
              f"nanoserve:kv_offload_restored_blocks_last_step{{{labels}}} {tiers['restored_blocks_last_step']}"]
    return lines


# ----------------------------------------------------------------------------- app and CLI

def build_app(engine: Engine | EngineClient, served_model_name: str, max_waiting: int = 256,
              api_key: str | None = None, max_request_bytes: int = 1 << 20, limits: RequestLimits = RequestLimits(),
              body_timeout: float = 30.0, metrics_require_key: bool = False) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine core. serve.py passes the client of a
    core process; tests may pass an Engine, whose core then runs in a thread of this process."""
    client = EngineClient.in_thread(engine) if hasattr(engine, "step") else engine   # an Engine (or a test's wrapper)
    server = OpenAIServer(client, served_model_name, max_waiting, max_request_bytes, limits, body_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        yield
        client.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.server = server
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    if api_key:
        app.add_middleware(RequireAPIKey, api_key=api_key, metrics=metrics_require_key)
    return app


class RequireAPIKey:
    """ASGI middleware: every /v1/* route and the API docs (/docs, /redoc, /openapi.json) need
    `Authorization: Bearer <key>` (401 in OpenAI's error shape otherwise), and so does /metrics with
    --metrics-require-key (its token counters reveal prefix-cache hits); /health stays open. The key
    is compared in constant time, so the time to answer reveals nothing about how much of a guess was right."""
    DOCS = ("/docs", "/redoc", "/openapi.json")

    def __init__(self, app, api_key: str, metrics: bool = False):
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.guarded = self.DOCS + (("/metrics",) if metrics else ())

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or path.startswith(self.guarded)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                body = error.body()
                body["error"]["type"] = "invalid_request_error"   # OpenAI's type for a bad key
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


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
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model's directory or file name)")
    p.add_argument("--max-num-seqs", type=int, help=f"max sequences in one batch (default {default.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget per step; longer prompts are prefilled in chunks "
                        f"(default {default.max_num_batched_tokens})")
    p.add_argument("--block-size", type=int, help=f"tokens per KV cache block (default {default.block_size})")
    p.add_argument("--kv-cache-memory", help=f"KV cache size, bytes or e.g. 512MiB (default {default.kv_cache_memory})")
    p.add_argument("--max-model-len", type=int, help="max prompt + output tokens (default: the model's context length)")
    p.add_argument("--dtype", help=f"model dtype: auto, float32, bfloat16, float16 (default {default.dtype})")
    p.add_argument("--device", help=f"auto, cpu or cuda (default {default.device})")
    p.add_argument("--attention-backend", help=f"auto, torch, cpu or cuda (default {default.attention_backend})")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs: run every decode step eagerly (default: graphs on the CUDA backend)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 while the device runs step N (default: on with CUDA, off on a CPU)")
    p.add_argument("--kv-cache-dtype", help=f"KV cache dtype, auto = model dtype (default {default.kv_cache_dtype})")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=f"reuse KV blocks of shared prompt prefixes (default {default.enable_prefix_caching})")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="same tokens and logprobs whatever the batch, chunking or prefix cache; CPU only "
                        "(default: on if VLLM_BATCH_INVARIANT=1 or NANOSERVE_BATCH_INVARIANT=1)")
    p.add_argument("--scheduling-policy", help=f"fcfs, priority or lpm (default {default.scheduling_policy})")
    p.add_argument("--preemption-mode", help=f"recompute or swap (default {default.preemption_mode})")
    p.add_argument("--swap-space",
                   help=f"host memory for --preemption-mode swap, bytes or e.g. 1GiB (default {default.swap_space})")
    p.add_argument("--kv-offload-memory",
                   help="host memory that keeps evicted prefix-cache blocks, bytes or e.g. 4GiB (default: none)")
    p.add_argument("--kv-offload-dir", help="a directory for evicted blocks below host memory; survives restarts")
    p.add_argument("--kv-offload-disk", help="the disk budget in --kv-offload-dir, e.g. 20GiB")
    p.add_argument("--tensor-parallel-size", type=int,
                   help="ranks that split each layer; under torchrun, its number of processes (default 1)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine cores, each a full replica with its own KV cache and share of the threads (default 1)")
    p.add_argument("--routing", choices=launcher.ROUTING_POLICIES, default="cache_aware",
                   help="with --data-parallel-size > 1: which core serves a request (default cache_aware)")
    p.add_argument("--data-parallel-size-local", type=int, default=None,
                   help="engine cores started on this machine (default: all of --data-parallel-size; with "
                        "--headless: 1); the others join with serve.py --headless from other machines")
    p.add_argument("--data-parallel-address", default="127.0.0.1",
                   help="the front end's address, where remote cores connect (default 127.0.0.1)")
    p.add_argument("--data-parallel-rpc-port", type=int, default=13345,
                   help="the port remote cores connect to (default 13345); both sides need NANOSERVE_DP_KEY, "
                        "a shared secret that authenticates them")
    p.add_argument("--headless", action="store_true",
                   help="run only engine cores (--data-parallel-size-local of them), serving the front end at "
                        "--data-parallel-address:--data-parallel-rpc-port; no HTTP")
    p.add_argument("--disaggregation", metavar="P:D", default=None,
                   help="P prefill cores and D decode cores; each request's KV moves from one to the other")
    p.add_argument("--disaggregation-local", metavar="P:D", help="with --disaggregation: the cores started here "
                   "(default all); the others join: serve.py --headless --disaggregation-mode on other machines")
    p.add_argument("--disaggregation-mode", choices=["prefill", "decode"],
                   help="with --headless: run prefill or decode cores for a disaggregated front end (SGLang's name)")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, ...}\' (default off)')
    p.add_argument("--quantization", choices=["gguf", "int8"], default=None,
                   help="gguf: the .gguf's own Q4_0/Q4_1/Q8_0 blocks, no float32 copy; int8: W8A8 from any model (default off)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for the engine; beyond that: 503 with Retry-After (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body accepted; bigger ones get 413 before they are parsed (default 1 MiB)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or os.environ.get("NANOSERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: $VLLM_API_KEY or "
                        "$NANOSERVE_API_KEY; none: open)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="with --api-key, /metrics needs the key too (its token counters reveal prefix-cache hits)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests may still run before they are aborted; "
                        "new ones and /health get 503 meanwhile; the process exits within this + 2 s, and at "
                        "once on a second signal (default 30)")
    g = p.add_argument_group("connections", "what a slow, idle or flooding client may hold")
    g.add_argument("--timeout-header", type=float, default=30.0,
                   help="seconds a connection may take to send a request's headers; then it is closed (default 30)")
    g.add_argument("--timeout-body", type=float, default=30.0,
                   help="seconds a request's body may take to arrive; then 408 (default 30)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5, uvicorn's and vLLM's)")
    g.add_argument("--limit-concurrency", type=int, default=512,
                   help="open connections (and requests in flight) past which new requests get 503 (default 512)")
    d, r = RequestLimits(), p.add_argument_group("per-request limits", "each past-limit request gets a 400 "
                                                                       "naming the field")
    r.add_argument("--max-seqs-per-request", type=int, default=d.max_seqs_per_request,
                   help=f"prompts x n of one request (default {d.max_seqs_per_request}; at most --max-waiting)")
    r.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias,
                   help=f"logit_bias entries (default {d.max_logit_bias}, OpenAI's)")
    r.add_argument("--max-stop-strings", type=int, default=d.max_stop,
                   help=f"stop strings, and bad_words (default {d.max_stop})")
    r.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help=f"characters of one stop string (default {d.max_stop_chars})")
    r.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                   help=f"stop_token_ids entries (default {d.max_stop_token_ids})")
    r.add_argument("--max-grammar-bytes", type=int, default=d.max_grammar_bytes,
                   help=f"a structured-output schema, regex, grammar or choice list as JSON "
                        f"(default {d.max_grammar_bytes})")
    r.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request bring its own chat_template (vLLM's flag; default: 400 naming it)")
    r.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="seconds a structured-output grammar may take to compile (off the engine's loop); "
                        "then 400 (default 10)")
    return p.parse_args(argv)


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(args.max_seqs_per_request, args.max_logit_bias, args.max_stop_strings, args.max_stop_chars,
                         args.max_stop_token_ids, args.max_grammar_bytes, args.trust_request_chat_template)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Only flags the user gave override EngineConfig, so the engine's defaults stay the single source."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    given = {name: value for name, value in vars(args).items() if name in fields and value is not None}
    for name in ("kv_cache_memory", "swap_space", "kv_offload_memory", "kv_offload_disk"):  # "1073741824" means bytes; "1GiB" stays a string
        if isinstance(given.get(name), str) and given[name].isdigit():
            given[name] = int(given[name])
    return EngineConfig(**given)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol plus a deadline for each request's headers. uvicorn times out only
    an idle keep-alive connection after a response: one that connects and sends nothing, or trickles
    its headers, would hold a socket (and a --limit-concurrency place) forever. The deadline is armed
    when the connection opens and after each response, and disarmed by the next request's headers."""
    header_timeout = 30.0   # serve.py sets --timeout-header on the class (uvicorn builds one per connection)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        if getattr(self, "header_deadline", None) is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if getattr(self, "header_deadline", None) is not None:
            self.header_deadline.cancel()
        waiting_for = self.cycle          # a new request's headers replace the cycle
        self.header_deadline = self.loop.call_later(self.header_timeout, self._header_deadline_passed, waiting_for)

    def _header_deadline_passed(self, waiting_for) -> None:
        if self.cycle is waiting_for and not self.transport.is_closing():
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains before it stops: new requests and /health
    get 503 with Retry-After, in-flight ones get --shutdown-timeout seconds to finish, the rest end with
    an error event (or a 503), and then uvicorn shuts down and the process exits 0, all within the
    timeout + 2 s. A second signal ends the engine core and the process at once (exit status 1)."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer, shutdown_timeout: float):
        super().__init__(config)
        self.server, self.shutdown_timeout = server, shutdown_timeout
        self.drain_task = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_task is not None:
            self.exit_now(f"signal {sig} again", 1)
        if not self.started:
            return super().handle_exit(sig, frame)
        log.info("signal %d: draining %d requests (--shutdown-timeout %gs)", sig, len(self.server.runs),
                 self.shutdown_timeout)
        # the promise, whatever a slow step or teardown does: out within the timeout + 2 s
        watchdog = threading.Timer(self.shutdown_timeout + EXIT_GRACE_S, self.exit_now, ("shutdown took too long",))
        watchdog.daemon = True
        watchdog.start()
        loop = asyncio.get_running_loop()   # the handler runs on the loop's thread; the self-pipe wakes it
        self.drain_task = loop.call_soon_threadsafe(lambda: loop.create_task(self.drain()))

    def exit_now(self, why: str, status: int = 0) -> None:
        log.warning("%s: ending the engine core and exiting now", why)
        self.server.client.kill()
        logging.shutdown()
        os._exit(status)

    async def drain(self) -> None:
        server = self.server
        server.accepting = False
        await wait_until(lambda: not server.runs, self.shutdown_timeout)
        if server.runs:
            log.warning("aborting %d requests still running after --shutdown-timeout", len(server.runs))
            server.abort_all(APIError(503, f"server shut down: the request was still running after "
                                           f"--shutdown-timeout={self.shutdown_timeout:g}s and was aborted",
                                      code="shutting_down"))
            await wait_until(lambda: not server.runs, 0.5)   # their error events go out
        self.should_exit = True


EXIT_GRACE_S = 1.5     # after --shutdown-timeout: the error events, uvicorn's close and the core's stop


async def wait_until(done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if launcher.run_tensor_parallel_worker(args.device or "auto"):   # torchrun's other ranks: only rank 0 serves HTTP
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.headless:
        return launcher.run_headless(engine_config(args), args)
    try:
        client = launcher.launch_client(engine_config(args), args)
    except ValueError as exc:  # a bad flag value: say which, without a traceback
        sys.exit(f"serve.py: error: {exc}")
    default_name = os.path.basename(os.path.normpath(args.model or "SmolLM2-135M-Instruct")).removesuffix(".gguf")
    name = args.served_model_name or default_name
    check_fits_one_sequence(args, client)
    app = build_app(client, name, args.max_waiting, args.api_key, args.max_request_bytes, request_limits(args),
                    args.timeout_body, args.metrics_require_key)
    log.info("serving %s on http://%s:%d%s", name, args.host, args.port, " (API key required)" if args.api_key else "")
    HeaderTimeoutProtocol.header_timeout = args.timeout_header
    # the drain already waited --shutdown-timeout; uvicorn's own graceful wait only lets the last bytes out
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=0.5,
                            http=HeaderTimeoutProtocol, timeout_keep_alive=args.timeout_keep_alive,
                            limit_concurrency=args.limit_concurrency)
    # uvicorn re-raises a signal it was stopped by; a no-op handler turns that into a normal exit (status 0).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    DrainingServer(config, app.state.server, args.shutdown_timeout).run()
    # Everything is closed: connections, the engine core. The interpreter's own teardown (torch's
    # modules, idle pools) took seconds here, past the --shutdown-timeout + 2 s promise: skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_fits_one_sequence(args: argparse.Namespace, client: EngineClient) -> None:
    """An explicit --max-model-len must fit one sequence in the KV pool, as vLLM demands at start-up;
    left to its default, the chat endpoint's default max_tokens is capped at what the pool holds instead."""
    limits = client.info.limits
    pool_tokens = limits.usable_blocks * limits.block_size
    if args.max_model_len is not None and args.max_model_len > pool_tokens:
        client.kill()
        sys.exit(f"serve.py: error: --max-model-len {args.max_model_len} cannot fit one sequence in the KV cache: "
                 f"{limits.usable_blocks} usable blocks x {limits.block_size} tokens = {pool_tokens} tokens; raise "
                 f"--kv-cache-memory or lower --max-model-len to at most {pool_tokens}")


if __name__ == "__main__":
    main()
