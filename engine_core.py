"""
The engine core: the loop that owns the Engine when it is served, in a process of its own.

serve.py's front end (HTTP, tokenizing, JSON and SSE: serve.py, engine_client.py, openai_api.py) and
this loop share nothing but a pipe, over which the small messages below travel in pickled form. The
reason is the GIL: in one process, every bit of Python the event loop ran (parsing a body, writing an
SSE chunk) paused the engine's step, and on 2 cores a batch-32 step took 104 ms in the server against
64 ms alone. vLLM's and SGLang's engine cores exist for the same reason.

One turn of the loop: take every command waiting on the pipe (add, abort), answer the adds at once,
step the engine once, send one CoreUpdate with what the step produced. Idle, it sleeps on the pipe.
An add whose grammar is not compiled yet waits outside the engine (holding no batch slot) while
structured_output.py's worker compiles it, and is answered when it is ready or past
--grammar-compile-timeout. It owns no HTTP, no client state and no protocol. A failed step fails every request in the engine; MAX_STEP_FAILURES in a row end the core,
which says why (CoreDied) if it can; the front end sees any end of the core as the pipe closing.
Tests run the same loop in a thread of their own process (engine_client.EngineClient.in_thread), over
the same pipe, so every message still pickles.
"""
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from engine import Engine, EngineConfig, EngineStats, PromptLimits, RequestOutput, SamplingParams
from llm import build_engine
from sequence import EngineError, InvalidRequest

log = logging.getLogger("nanoserve.engine_core")
MAX_STEP_FAILURES = 3      # consecutive engine.step() exceptions before the core gives up
COMPILE_POLL_S = 0.005     # idle but for grammars compiling: how often to look at them


# ----------------------------------------------------------------------------- messages

@dataclass
class AddRequests:
    """Front end -> core: one HTTP request's prompts (n > 1 prompts for a batch /v1/completions),
    added all or none."""
    key: int                            # names this add in the answer (CoreUpdate.admitted / rejected)
    request_ids: list[str]
    prompts: list[list[int]]            # token ids: the front end tokenizes
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None   # time.monotonic() when the HTTP request arrived: TTFT counts from it


@dataclass
class AbortRequests:
    """Front end -> core: these requests' clients are gone; free their blocks now."""
    request_ids: list[str]


@dataclass
class Stop:
    """Front end -> core: abort what is left and exit."""


@dataclass
class CoreUpdate:
    """Core -> front end, after a turn's adds and after its step: what happened, and the engine's state."""
    stats: EngineStats
    outputs: list[RequestOutput] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)                       # AddRequests keys
    rejected: list[tuple[int, Exception]] = field(default_factory=list)     # keys refused at add
    failed: list[tuple[str, Exception]] = field(default_factory=list)       # request ids an engine error ended
    # disaggregation: requests a prefill core exported; blocks a decode core wants (request id, indices,
    # tag); transfers that ended (request id, bytes, seconds)
    handoffs: list = field(default_factory=list)      # scaleout/handoff.py's Handoff records
    wanted: list[tuple[str, list[int], int]] = field(default_factory=list)
    sent: list[tuple[str, int, float]] = field(default_factory=list)
    received: list[tuple[str, int, float]] = field(default_factory=list)
    # block hashes the prefix cache evicted since the last update (kv_cache.BlockManager.take_evicted):
    # a cache_aware router forgets them; at most the pool's blocks, 32 bytes each
    evicted: list[bytes] = field(default_factory=list)


@dataclass
class CoreDied:
    """Core -> front end, last: why the core is ending on its own (a crash of the loop itself)."""
    reason: str


@dataclass
class EngineInfo:
    """Core -> front end, once at start: what the front end needs to know about an engine it cannot touch."""
    model_dir: str                      # the front end loads its own tokenizer from here
    limits: PromptLimits
    scheduling_policy: str
    max_num_seqs: int
    stats: EngineStats

    @staticmethod
    def of(engine: Engine) -> "EngineInfo":
        return EngineInfo(str(engine.model_dir), engine.prompt_limits, engine.config.scheduling_policy,
                          engine.config.max_num_seqs, engine.stats())


# ----------------------------------------------------------------------------- the loop

@dataclass
class Compiling:
    """An add waiting for its grammar: it holds no batch slot and no block until it is ready."""
    command: AddRequests
    future: object                      # concurrent.futures.Future of the compile
    deadline: float                     # time.monotonic() past which it is refused


class EngineCore:
    """The loop over one Engine. Scale-out's cores subclass it (scaleout/handoff.py: prefill and decode
    cores that move requests and their KV between them) through the hooks at the end."""

    def __init__(self, engine: Engine, conn: Connection, grammar_timeout: float = 10.0):
        self.engine, self.conn, self.grammar_timeout = engine, conn, grammar_timeout
        self.compiling: list[Compiling] = []

    def run(self) -> None:
        """Serve until the front end sends Stop or hangs up; then abort whatever is left."""
        try:
            self.serve()
        except BaseException as exc:    # the loop must never die silently: say why, then end
            log.exception("engine core died")
            with contextlib.suppress(OSError):
                self.conn.send(CoreDied(repr(exc)))
            raise
        finally:
            for request_id in list(self.engine.requests) + list(self.engine.exporting) + list(self.engine.importing):
                self.engine.abort_request(request_id)
            self.conn.close()       # the front end reads EOF: a thread-run core ends like a process

    def serve(self) -> None:
        failures = 0
        while True:
            update = CoreUpdate(stats=None)
            busy = bool(self.engine.requests)        # work outside the engine alone: poll it, no step to run
            pending = self.compiling or self.waiting_elsewhere()
            taken = self.take_commands(update, wait=0 if busy else COMPILE_POLL_S if pending else None)
            if taken is None:
                break
            self.admit_compiled(update)
            self.poll_elsewhere(update)
            if (update.admitted or update.rejected or update.wanted or update.sent or update.received
                    or update.failed or (taken and not self.engine.requests)):
                self.send(update)       # before the step: admission and the queue's length can't wait for it
                update = CoreUpdate(stats=None)
            if self.engine.requests:
                try:
                    update.outputs = self.engine.step()
                    failures = 0
                except Exception as exc:
                    failures += 1
                    self.step_failed(exc, failures, update)
                self.after_step(update)
                self.send(update)

    def send(self, update: CoreUpdate) -> None:
        update.stats = self.engine.stats()
        update.evicted = self.engine.blocks.take_evicted()
        self.conn.send(update)

    def take_commands(self, update: CoreUpdate, wait: float | None) -> int | None:
        """Apply every command on the pipe (waiting up to `wait` seconds for one, None: until one
        comes); returns how many, or None once told to stop."""
        taken = 0
        try:
            if wait != 0:
                self.conn.poll(wait)
            while self.conn.poll(0):
                command = self.conn.recv()
                taken += 1
                if isinstance(command, Stop):
                    return None
                if isinstance(command, AbortRequests):
                    self.abort(command.request_ids, update)
                elif not isinstance(command, AddRequests):
                    self.handle(command, update)
                elif command.params.structured_outputs is not None:
                    future = self.engine.grammar_compiler().prepare(command.params.structured_outputs)
                    self.compiling.append(Compiling(command, future, time.monotonic() + self.grammar_timeout))
                else:
                    self.add(command, update)
        except (EOFError, OSError):     # the front end is gone: nobody is left to serve
            return None
        return taken

    def abort(self, request_ids: list[str], update: CoreUpdate) -> None:
        gone = set(request_ids)
        for waiting in [c for c in self.compiling if gone & set(c.command.request_ids)]:
            self.compiling.remove(waiting)    # still compiling: answer the add, so the front end forgets it
            update.rejected.append((waiting.command.key, EngineError("aborted while its grammar compiled")))
        for request_id in request_ids:
            self.engine.abort_request(request_id)

    def admit_compiled(self, update: CoreUpdate) -> None:
        """Adds whose grammar is ready go in (the engine's compile is now a cache hit); those past the
        timeout are refused. The worker cannot be interrupted: a late compile still fills the cache."""
        now = time.monotonic()
        for waiting in list(self.compiling):
            if waiting.future.done():
                self.compiling.remove(waiting)
                self.add(waiting.command, update)
            elif now > waiting.deadline:
                self.compiling.remove(waiting)
                update.rejected.append((waiting.command.key, InvalidRequest(
                    "structured_outputs", f"structured_outputs did not compile within {self.grammar_timeout:g} s "
                                          f"(--grammar-compile-timeout)")))

    def add(self, command: AddRequests, update: CoreUpdate) -> None:
        added = []
        try:
            for request_id, prompt in zip(command.request_ids, command.prompts):
                self.engine.add_request(request_id, prompt, command.params, priority=command.priority,
                                        arrival_time=command.arrival_time, cache_salt=command.cache_salt)
                added.append(request_id)
        except Exception as exc:    # InvalidRequest: bad input (400); anything else fails only this request
            if not isinstance(exc, InvalidRequest):
                log.exception("add_request failed")
                exc = EngineError(f"add_request failed: {exc!r}")
            for request_id in added:
                self.engine.abort_request(request_id)
            update.rejected.append((command.key, exc))
            return
        update.admitted.append(command.key)

    # -- hooks for scale-out's cores (scaleout/handoff.py); a plain core has nothing outside its engine
    def handle(self, command, update: CoreUpdate) -> None:
        """A command other than add, abort and stop."""
        raise TypeError(f"engine core: unknown command {type(command).__name__}")

    def waiting_elsewhere(self) -> bool:
        """Work outside the engine (KV blocks in transit) that an idle loop must keep polling."""
        return False

    def poll_elsewhere(self, update: CoreUpdate) -> None:
        """Before each step: take in what finished outside the engine."""

    def after_step(self, update: CoreUpdate) -> None:
        """After each step: anything to hand on with the step's outputs."""

    def close(self) -> None:
        """The core ends: let go of what it holds beside the engine."""

    def step_failed(self, exc: Exception, failures: int, update: CoreUpdate) -> None:
        # We cannot tell which sequences the failing batch held, so every request in the engine fails.
        log.exception("engine.step() failed (%d in a row); failing %d requests", failures,
                      len(self.engine.requests))
        error = EngineError(f"engine step failed: {exc!r}")
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            update.failed.append((request_id, error))
        self.engine.check_invariants()  # an inconsistent engine must not keep serving
        if failures >= MAX_STEP_FAILURES or getattr(exc, "fatal", False):   # fatal: a tensor-parallel rank is lost
            self.send(update)           # the failed requests hear why before the pipe closes
            raise RuntimeError(f"engine.step() failed {failures} times in a row" if failures >= MAX_STEP_FAILURES
                               else f"engine.step() failed for good: {exc}") from exc


def core_lost_a_rank(reason: str) -> None:
    """A tensor-parallel worker died: a step in flight fails on its own (WorkerDied) within moments; give
    its error events that long, then end the core, idle or not. The front end sees the pipe close and
    reports 503; the remaining ranks end with the fork server."""
    log.error("tensor-parallel rank lost (%s): the engine core ends", reason)
    time.sleep(1.0)
    os._exit(1)


def run_core_process(config: EngineConfig, conn: Connection, grammar_timeout: float = 10.0,
                     make_core=EngineCore) -> None:
    """The engine core process's main: build the engine, say what it is, serve until told to stop.
    make_core(engine, conn, grammar_timeout) -> the loop (scale-out's cores join their group there)."""
    # Ctrl-C reaches the whole process group: the front end decides when the core stops (after draining).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build_engine(config)
    except Exception as exc:        # a bad flag value: the front end reports it and exits
        conn.send(exc if isinstance(exc, ValueError) else RuntimeError(repr(exc)))
        return
    try:
        core = make_core(engine, conn, grammar_timeout)
    except Exception as exc:
        conn.send(RuntimeError(f"starting the engine core failed: {exc!r}"))
        return
    conn.send(EngineInfo.of(engine))
    if engine.tp is not None:
        engine.tp.watch(core_lost_a_rank)
    try:
        core.run()
    finally:
        engine.shutdown()           # tensor-parallel workers stop with the core
        core.close()
