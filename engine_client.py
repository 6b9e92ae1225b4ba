"""
The front end's side of the engine core: serve.py's handle on an engine that runs elsewhere.

An EngineClient starts the engine core (engine_core.py: in a process of its own for serve.py, in a
thread for tests), sends it add and abort commands, and routes each CoreUpdate it answers with to the
Run of the HTTP request it belongs to, on the event loop. Two small threads move the pickled messages,
so the event loop never blocks on the pipe. A Run keeps only the newest output per prompt (deltas
merged), so a slow reader costs bounded memory and stalls no one. Also the server's latency
histograms and request counters. Owns no HTTP and no protocol: serve.py owns routes, admission and
shutdown, openai_api.py the request and answer shapes, engine_core.py the Engine.
"""
import asyncio
import collections
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time

from fastapi import Request

from engine import Engine, EngineConfig, RequestOutput, SamplingParams
from engine_core import AbortRequests, AddRequests, CoreDied, CoreUpdate, EngineCore, EngineInfo, Stop, \
    run_core_process
from openai_api import APIError
from sequence import EngineError
from tokenizer import Tokenizer

log = logging.getLogger("nanoserve.serve")
DISCONNECT_POLL_S = 0.5    # how often a non-streamed request checks whether its client is gone
STOP_WAIT_S = 1.0          # at shutdown, how long the core may finish its step before it is killed


# ----------------------------------------------------------------------------- metrics

class Histogram:
    def __init__(self, name: str, help_text: str, buckets: list[float]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts, self.sum, self.count = [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, le in enumerate(self.buckets):
            self.counts[i] += value <= le
        self.sum += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
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


# ----------------------------------------------------------------------------- one HTTP request

class ClientGone(Exception):
    """The client of a non-streamed request hung up; nobody is left to answer."""


@dataclasses.dataclass
class Admitted:
    """Notice to a Run: the engine core added all of its prompts."""


@dataclasses.dataclass
class Failed:
    """Notice to a Run: it ends with this error (refused at add, engine failure, shutdown)."""
    error: Exception


@dataclasses.dataclass
class Left:
    """Notice to a Run: its client hung up."""


Notice = Admitted | Failed | Left


def api_error(exc: Exception) -> Exception:
    """An engine failure as the HTTP error it becomes; bad input (InvalidRequest) stays as it is, for the
    Exchange to name the field as its endpoint does."""
    return APIError(500, str(exc), code=exc.code) if isinstance(exc, EngineError) else exc


class Run:
    """One HTTP request's sequences (one engine request per prompt) and what the engine sent them.

    Outputs coalesce: only the newest output of each prompt waits to be read, with the deltas the
    reader has not taken yet merged in front, so a client that reads slowly holds one output per
    prompt however far behind it is, and never slows the engine or anyone else."""

    def __init__(self, client: "EngineClient", request_ids: list[str], prompts: list[list[int]],
                 params: SamplingParams, priority: int, cache_salt: str | None, active: set):
        self.client, self.request_ids, self.prompts = client, request_ids, prompts
        self.params, self.priority, self.cache_salt = params, priority, cache_salt
        self.notices: collections.deque[Notice] = collections.deque()   # in order
        self.pending: dict[int, RequestOutput] = {}  # prompt index -> newest unread output
        self.ready = asyncio.Event()
        self.arrival = time.monotonic()
        self.unfinished = set(request_ids)
        self.error: Exception | None = None
        self.active = active                       # the server's runs in flight (shutdown drains them)
        self.closed = False
        self.num_seqs = len(request_ids) * (params.n if params is not None else 1)   # what admission counts
        active.add(self)

    def notify(self, notice: Notice) -> None:
        """On the event loop: admission, an error or a hang-up (from the core, a watcher or shutdown)."""
        self.notices.append(notice)
        self.ready.set()

    def deliver(self, index: int, out: RequestOutput) -> None:
        """On the event loop: prompt `index`'s newest output, merged with what is still unread."""
        self.pending[index] = merge_unread(self.pending.get(index), out)
        self.ready.set()

    async def next(self) -> Notice | tuple[int, RequestOutput]:
        while not (self.notices or self.pending):
            self.ready.clear()
            await self.ready.wait()
        if self.notices:
            return self.notices.popleft()
        index = next(iter(self.pending))
        return index, self.pending.pop(index)

    async def outputs(self):
        """Every (prompt index, RequestOutput) until all prompts have finished; raises what the engine sent."""
        while self.unfinished:
            item = await self.next()
            if isinstance(item, Left):
                raise ClientGone()
            if isinstance(item, Failed):
                self.error = item.error
                raise item.error
            index, out = item
            if out.finished:
                self.unfinished.discard(out.request_id)
            yield index, out

    async def watch_disconnect(self, request: Request) -> None:
        """For non-streamed requests, which Starlette does not cancel when the client leaves."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.notify(Left())

    async def admitted(self) -> None:
        notice = await self.next()
        if isinstance(notice, Failed):
            raise notice.error

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
            self.client.abort(list(self.unfinished))
        self.unfinished.clear()
        self.client.metrics.requests[outcome] += 1


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
    first_token_seen: bool = False


# ----------------------------------------------------------------------------- the engine core's client

class RemoteCore:
    """A core process on another machine, as EngineClient sees it: alive until its connection closes."""

    def __init__(self, address):
        self.address, self.exitcode = address, f"unknown: the connection from {address} closed"

    def is_alive(self) -> bool:
        return True                        # the reader's EOF (EngineClient.died) says when it is not

    def join(self, timeout=None) -> None:
        pass


class EngineClient:
    """The front end's handle on the engine core: submit and abort from the event loop; a reader thread
    hands each CoreUpdate to the event loop, which routes it to the Runs. All client state (tracked,
    adding, metrics) is touched on the event loop only."""

    def __init__(self, info: EngineInfo, tokenizer: Tokenizer, conn, core):
        self.info, self.tokenizer, self.conn, self.core = info, tokenizer, conn, core  # core: Process or Thread
        self.metrics = ServerMetrics()
        self.stats = info.stats            # the newest the core sent; read by /metrics and admission
        self.dead_reason: str | None = None
        self.stopping = False
        self.keys = itertools.count()
        self.adding: dict[int, Run] = {}   # AddRequests key -> run, until the core admits or rejects it
        self.num_pending_adds = 0          # their sequences (prompts x n): the queue before the engine's own
        self.tracked: dict[str, Tracked] = {}
        self.outbox = queue.SimpleQueue()  # commands for the writer thread: a big prompt never blocks the loop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_update = lambda update: None   # data_parallel.py's hooks: it sees each update before the Runs
        self.on_died = lambda reason: None

    @staticmethod
    def in_process(config: EngineConfig, grammar_timeout: float = 10.0) -> "EngineClient":
        """serve.py: the engine core in a process of its own; returns once its engine is built.
        Raises the core's ValueError for a bad engine flag."""
        return EngineClient.launch(config, grammar_timeout)()

    @staticmethod
    def launch(config: EngineConfig, grammar_timeout: float = 10.0, make_core=EngineCore):
        """Start the core process; returns the call that waits for its engine and gives its client (so
        several cores build their engines at once: data_parallel.py). make_core: engine_core.run_core_process's."""
        context = multiprocessing.get_context("spawn")   # never fork a process that may hold OpenMP threads
        conn, core_conn = context.Pipe()
        core = context.Process(target=run_core_process, args=(config, core_conn, grammar_timeout, make_core),
                               name="nanoserve-engine-core", daemon=True)
        core.start()
        core_conn.close()                  # ours is the only end left here, so the core's exit reads as EOF

        def connect() -> "EngineClient":
            try:
                info = conn.recv()
            except EOFError:
                raise RuntimeError(f"the engine core exited while starting (exit code {core.join(5) or core.exitcode})")
            if isinstance(info, Exception):
                core.join(5)
                raise info
            return EngineClient(info, Tokenizer.from_dir(info.model_dir), conn, core)
        connect.process = core
        return connect

    @staticmethod
    def remote(conn, address) -> "EngineClient":
        """A remote engine core (serve.py --headless on another machine) connected from `address` to the
        front end's listener (data_parallel.accept_cores); the same messages then travel over that
        socket instead of a pipe. Returns once its engine is built."""
        info = conn.recv()
        if isinstance(info, Exception):
            raise info
        return EngineClient(info, Tokenizer.from_dir(info.model_dir), conn, RemoteCore(address))

    @staticmethod
    def in_thread(engine: Engine, make_core=EngineCore, grammar_timeout: float = 10.0) -> "EngineClient":
        """Tests: the same core loop over the same pipe, in a thread beside an Engine the test holds."""
        conn, core_conn = multiprocessing.Pipe()
        core = threading.Thread(target=make_core(engine, core_conn, grammar_timeout).run, name="engine-core",
                                daemon=True)
        return EngineClient(EngineInfo.of(engine), engine.tokenizer, conn, core)

    # -- called on the event loop
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if isinstance(self.core, threading.Thread):
            self.core.start()
        threading.Thread(target=self._read, name="core-reader", daemon=True).start()
        threading.Thread(target=self._write, name="core-writer", daemon=True).start()

    def stop(self) -> None:
        """Stop the core (requests still in it are aborted) and wait for it."""
        self.stopping = True
        self.outbox.put(Stop())
        self.core.join(timeout=STOP_WAIT_S)     # the core stops after the step it is in
        if isinstance(self.core, multiprocessing.process.BaseProcess) and self.core.is_alive():
            log.warning("the engine core did not stop within %g s; killing it", STOP_WAIT_S)
            self.kill()

    def kill(self) -> None:
        """End the core process now (a second signal, a refused start); a core thread cannot be."""
        self.stopping = True
        if isinstance(self.core, multiprocessing.process.BaseProcess) and self.core.is_alive():
            self.core.kill()
            self.core.join(1)

    def alive(self) -> bool:
        return self.dead_reason is None and self.core.is_alive()

    def dead_cores(self) -> dict[int, str]:
        """/health: cores that are gone while the server still serves (one core: never)."""
        return {}

    def metrics_lines(self, labels: str) -> list[str]:
        """/metrics beyond the server's own series: per-core ones (one core: none)."""
        return []

    def num_waiting(self) -> int:
        """Sequences waiting for the engine (prompts x n): what admission counts against --max-waiting."""
        s = self.stats
        return s.num_waiting + s.num_swapped + s.num_unforked_samples + self.num_pending_adds

    def submit(self, run: Run) -> None:
        if self.dead_reason is not None:
            raise APIError(503, f"engine is dead: {self.dead_reason}", code="engine_dead")
        key = next(self.keys)
        self.adding[key] = run
        self.num_pending_adds += run.num_seqs
        for index, request_id in enumerate(run.request_ids):
            self.tracked[request_id] = Tracked(run, index)
        self.outbox.put(AddRequests(key, run.request_ids, run.prompts, run.params, run.priority, run.cache_salt,
                                    arrival_time=run.arrival))

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.tracked.pop(request_id, None)
        self.outbox.put(AbortRequests(request_ids))

    # -- the pipe's two threads
    def _write(self) -> None:
        while True:
            command = self.outbox.get()
            try:
                self.conn.send(command)
            except OSError:
                return                     # the core is gone; the reader reports it
            if isinstance(command, Stop):
                return

    def _read(self) -> None:
        try:
            while True:
                update = self.conn.recv()
                if isinstance(update, CoreDied):
                    self.loop.call_soon_threadsafe(self.died, update.reason)
                    return
                self.loop.call_soon_threadsafe(self.apply, update)   # one wake-up of the loop per step
        except (EOFError, OSError):
            pass
        except BaseException as exc:       # a message that does not unpickle: the pipe can no longer be trusted
            log.exception("reading from the engine core failed")
            self.loop.call_soon_threadsafe(self.died, repr(exc))
            return
        if not self.stopping:
            if isinstance(self.core, multiprocessing.process.BaseProcess):
                self.core.join(1)          # reap it: its exit code is None until then
            code = getattr(self.core, "exitcode", None)
            self.loop.call_soon_threadsafe(self.died, f"the engine core exited (exit code {code})")

    # -- back on the event loop
    def apply(self, update: CoreUpdate) -> None:
        """Route one turn of the core to the Runs: admissions, refusals, outputs, failures."""
        self.on_update(update)
        self.stats = update.stats
        for key in update.admitted:
            run = self.adding.pop(key)
            self.num_pending_adds -= run.num_seqs
            run.notify(Admitted())
        for key, exc in update.rejected:
            run = self.adding.pop(key)
            self.num_pending_adds -= run.num_seqs
            for request_id in run.request_ids:
                self.tracked.pop(request_id, None)
            run.notify(Failed(api_error(exc)))
        for out in update.outputs:
            entry = self.tracked.get(out.request_id)
            if entry is None:
                continue  # aborted while the step ran
            try:
                self._route(entry, out)
            except Exception as exc:  # a bug with one output fails that request, not the server
                log.exception("routing output of %s failed", out.request_id)
                self.abort([out.request_id])
                entry.run.notify(Failed(APIError(500, f"output processing failed: {exc!r}")))
        for request_id, exc in update.failed:
            entry = self.tracked.pop(request_id, None)
            if entry is not None:
                entry.run.notify(Failed(api_error(exc)))

    def _route(self, entry: Tracked, out: RequestOutput) -> None:
        """Hand the output to its Run; the latency histograms take the engine's own RequestMetrics,
        which count from when the HTTP request arrived (AddRequests.arrival_time)."""
        metrics, m = self.metrics, out.metrics
        if not entry.first_token_seen and m.ttft is not None:
            entry.first_token_seen = True
            metrics.ttft.observe(m.ttft)
        entry.run.deliver(entry.index, out)
        if not out.finished:
            return
        del self.tracked[out.request_id]
        metrics.e2e.observe(m.e2e_latency)
        if m.tpot is not None:
            metrics.tpot.observe(m.tpot)
        metrics.finished.update(c.finish_reason for c in out.outputs)

    def died(self, reason: str) -> None:
        """The core is gone: every run still waiting on it ends with a 503, and so does new work."""
        log.error("engine core died: %s", reason)
        self.dead_reason = reason
        self.on_died(reason)
        error = APIError(503, f"engine is dead: {reason}", code="engine_dead")
        runs = {entry.run for entry in self.tracked.values()} | set(self.adding.values())
        self.tracked.clear()
        self.adding.clear()
        self.num_pending_adds = 0
        for run in runs:
            run.notify(Failed(error))
