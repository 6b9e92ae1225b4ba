"""
The engine thread behind serve.py: the one thread that owns the (not thread-safe) Engine.

HTTP handlers hand it add/abort commands through a locked deque; it steps the engine and routes
every RequestOutput back to the handler's Run on the event loop with loop.call_soon_threadsafe
(one wake-up per step). A Run keeps only the newest output per prompt (deltas merged), so a
slow reader costs bounded memory and stalls no one. Also the server's latency histograms and
request counters. Owns no HTTP and no protocol: serve.py owns routes, admission and shutdown,
openai_api.py the request and answer shapes, engine.py and below scheduling, sampling and KV blocks.
"""
import asyncio
import collections
import dataclasses
import logging
import threading
import time

from fastapi import Request

from engine import Engine, InvalidRequest, RequestOutput, SamplingParams
from openai_api import APIError

log = logging.getLogger("nanoserve.serve")
MAX_STEP_FAILURES = 3      # consecutive engine.step() exceptions before the engine is declared dead
DISCONNECT_POLL_S = 0.5    # how often a non-streamed request checks whether its client is gone


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
        self.ttft = Histogram("nanoserve:time_to_first_token_seconds",
                              "Time from request admission to its first token.",
                              [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80])
        self.tpot = Histogram("nanoserve:time_per_output_token_seconds", "Mean time between output tokens.",
                              [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5])
        self.e2e = Histogram("nanoserve:e2e_request_latency_seconds",
                             "Time from request admission to its last token.",
                             [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320])
        self.finished = collections.Counter()  # finish_reason -> choices
        # HTTP requests to the generation routes, counted on the event loop:
        # received = finished + aborted (client left, or shutdown) + rejected (never admitted) + failed (engine error)
        self.requests = collections.Counter()


# ----------------------------------------------------------------------------- engine thread

class ClientGone(Exception):
    """The client of a non-streamed request hung up; nobody is left to answer."""


class Run:
    """One HTTP request's sequences (one engine request per prompt) and what the engine sent them.

    Outputs coalesce: only the newest output of each prompt waits to be read, with the deltas the
    reader has not taken yet merged in front, so a client that reads slowly holds one output per
    prompt however far behind it is, and never slows the engine thread or anyone else."""

    def __init__(self, engine_loop: "EngineLoop", request_ids: list[str], prompts: list[list[int]],
                 params: SamplingParams, priority: int, cache_salt: str | None, active: set):
        self.engine_loop, self.request_ids, self.prompts = engine_loop, request_ids, prompts
        self.params, self.priority, self.cache_salt = params, priority, cache_salt
        self.loop = asyncio.get_running_loop()
        self.notices = collections.deque()         # ("admitted" | "error" | "gone", payload), in order
        self.pending: dict[int, RequestOutput] = {}  # prompt index -> newest unread output
        self.ready = asyncio.Event()
        self.arrival = time.monotonic()
        self.unfinished = set(request_ids)
        self.error: Exception | None = None
        self.active = active                       # the server's runs in flight (shutdown drains them)
        self.closed = False
        active.add(self)

    def put(self, kind: str, payload) -> None:
        """On the event loop: one message from the engine thread (or a watcher, or shutdown)."""
        if kind == "output":
            index, out = payload
            self.pending[index] = merge_unread(self.pending.get(index), out)
        else:
            self.notices.append((kind, payload))
        self.ready.set()

    async def next(self) -> tuple[str, object]:
        while not (self.notices or self.pending):
            self.ready.clear()
            await self.ready.wait()
        if self.notices:
            return self.notices.popleft()
        index = next(iter(self.pending))
        return "output", (index, self.pending.pop(index))

    async def outputs(self):
        """Every (prompt index, RequestOutput) until all prompts have finished; raises what the engine sent."""
        while self.unfinished:
            kind, payload = await self.next()
            if kind == "gone":
                raise ClientGone()
            if kind == "error":
                self.error = payload
                raise payload
            index, out = payload
            if out.finished:
                self.unfinished.discard(out.request_id)
            yield index, out

    async def watch_disconnect(self, request: Request) -> None:
        """For non-streamed requests, which Starlette does not cancel when the client leaves."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.put("gone", None)

    async def admitted(self) -> None:
        kind, payload = await self.next()
        if kind == "error":
            raise payload

    def close(self, outcome: str | None = None) -> None:
        """Abort whatever has not finished (client gone, error, shutdown) and count how the request
        ended, once; safe to call again."""
        if self.closed:
            return
        self.closed = True
        self.active.discard(self)
        if outcome is None:
            shutdown = isinstance(self.error, APIError) and self.error.code == "shutting_down"
            outcome = ("finished" if not self.unfinished else "aborted" if self.error is None or shutdown
                       else "failed")
        if self.unfinished:
            self.engine_loop.abort(list(self.unfinished))
        self.unfinished.clear()
        self.engine_loop.metrics.requests[outcome] += 1


def merge_unread(unread: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    """new, with the deltas of an output nobody has read yet in front of its own (the rest of an
    output is cumulative already: text, token ids, logprobs)."""
    if unread is None:
        return new
    outputs = [dataclasses.replace(c, delta_text=u.delta_text + c.delta_text,
                                   delta_token_ids=u.delta_token_ids + c.delta_token_ids)
               for u, c in zip(unread.outputs, new.outputs)]
    return dataclasses.replace(new, outputs=outputs)


@dataclasses.dataclass
class Tracked:
    run: Run
    index: int                         # which prompt of the run
    first_token_time: float | None = None


class EngineLoop:
    """Owns the Engine: one thread drains add/abort commands, steps, and routes outputs to the Runs."""

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
        return self.stats.num_waiting + self.stats.num_swapped + self.num_pending_adds

    def submit(self, run: Run) -> None:
        with self.lock:
            if self.dead_reason is not None:
                raise APIError(503, f"engine is dead: {self.dead_reason}", code="engine_dead")
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
        leftover = []  # runs submitted but never added: only a dead engine leaves them to fail
        try:
            self._serve(outbox)
            error = APIError(503, "server is shutting down", code="shutting_down")
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine loop died")
            with self.lock:
                self.dead_reason = repr(exc)
                leftover = [run for kind, run in self.commands if kind == "add"]
                self.commands.clear()
            error = APIError(503, f"engine is dead: {exc!r}", code="engine_dead")
        self._fail_all(error, outbox)
        self._deliver(outbox + [(run, ("error", error)) for run in leftover])

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
        self.stats = self.engine.stats()  # before the pending count drops, so admission never undercounts
        with self.lock:
            self.num_pending_adds -= num_added

    def _add(self, run: Run, outbox: list) -> None:
        added = []
        try:
            for index, (request_id, prompt) in enumerate(zip(run.request_ids, run.prompts)):
                self.engine.add_request(request_id, prompt, run.params, priority=run.priority,
                                        cache_salt=run.cache_salt)
                added.append(request_id)
                self.tracked[request_id] = Tracked(run, index)
        except Exception as exc:  # InvalidRequest: bad input (400); anything else fails only this request (500)
            if not isinstance(exc, InvalidRequest):
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
        metrics = self.metrics
        if entry.first_token_time is None and any(c.token_ids for c in out.outputs):
            entry.first_token_time = now
            metrics.ttft.observe(now - entry.run.arrival)
        outbox.append((entry.run, ("output", (entry.index, out))))
        if not out.finished:
            return
        del self.tracked[out.request_id]
        metrics.e2e.observe(now - entry.run.arrival)
        num_tokens = max(len(c.token_ids) for c in out.outputs)
        if entry.first_token_time is not None and num_tokens > 1:
            metrics.tpot.observe((now - entry.first_token_time) / (num_tokens - 1))
        metrics.finished.update(c.finish_reason for c in out.outputs)

    def _fail_all(self, exc: Exception, outbox: list) -> None:
        for request_id, entry in self.tracked.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request(%s) failed", request_id)
            outbox.append((entry.run, ("error", exc)))
        self.tracked.clear()

    @staticmethod
    def _deliver(outbox: list) -> None:
        by_loop = collections.defaultdict(list)
        for run, item in outbox:
            by_loop[run.loop].append((run, item))
        for loop, items in by_loop.items():  # one wake-up of the event loop per step, not one per sequence
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more


def put_all(items: list) -> None:
    for run, (kind, payload) in items:
        run.put(kind, payload)
