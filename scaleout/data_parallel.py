"""
Data parallel serving: several engine cores behind one server (vLLM's --data-parallel-size).

A DataParallelClient holds N EngineClients (engine_client.py), each driving an engine core of its own
(a process with its own KV pool and its own share of the host's threads), and a Router (router.py)
that picks the core for each HTTP request: round_robin | least_loaded | cache_aware. It has the
EngineClient's face (submit, abort, stats, metrics, alive, stop, kill), so serve.py drives one core or
N the same way. The router's load contract: each core's reported running + waiting sequences replace
its count on every update; finish() when a request's last prompt ends. A core that dies fails only
its own requests (its EngineClient sends them error events) and leaves the router; the others keep
serving, and /health says "degraded". run_headless is the other machine's side (serve.py --headless):
cores that take their ranks from this front end's TCPStore and connect to its listener (accept_cores),
authenticated by NANOSERVE_DP_KEY (dp_key); disaggregation.py's remote cores join the same way.
Owns the request -> core map and the per-core /metrics lines;
owns no HTTP (serve.py), no pipe (engine_client.py) and no routing policy (router.py).
"""
import collections
import dataclasses
import functools
import logging
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener

import kv_offload
from engine import Engine, EngineConfig, EngineStats
from engine_client import EngineClient, Run, ServerMetrics
from engine_core import CoreUpdate, EngineCore, Stop, run_core_process
from scaleout.handoff import HandoffCore
from scaleout.kv_transfer import host_store, join_as, open_ranks
from openai_api import APIError
from scaleout.router import Router, RouterConfig

log = logging.getLogger("nanoserve.serve")


class DataParallelClient:
    def __init__(self, cores: list[EngineClient], policy: str = "round_robin"):
        self.cores = cores
        self.info, self.tokenizer = cores[0].info, cores[0].tokenizer
        limits = self.info.limits
        # a tree forgets the blocks its core reports evicted, and never holds more than the core's pool can
        self.router = Router(RouterConfig(policy, max_tree_tokens=limits.usable_blocks * limits.block_size,
                                          block_size=limits.block_size), range(len(cores)))
        self.metrics = ServerMetrics()       # one set for the server: every core's outputs count in it
        self.owner: dict[str, tuple[int, Run]] = {}   # request id -> (core, its run), until it ends
        self.store = None                    # remote cores' rendezvous (kv_transfer.open_ranks), while they serve
        for i, core in enumerate(cores):
            core.metrics = self.metrics
            core.on_update = functools.partial(self._core_update, i)
            core.on_died = functools.partial(self._core_died, i)

    @staticmethod
    def in_processes(config: EngineConfig, size: int, policy: str, grammar_timeout: float = 10.0,
                     local: int | None = None, address: tuple[str, int] | None = None, authkey: bytes = b""):
        """serve.py: `local` core processes here (default all `size`), the host's threads split between them
        (one each at least); the other size - local join from other machines (serve.py --headless) through
        a listener at `address`, authenticated by `authkey`."""
        local = size if local is None else local
        threads = max(1, (config.num_threads or os.cpu_count()) // max(1, local))
        starting = [EngineClient.launch(dataclasses.replace(config, num_threads=threads), grammar_timeout)
                    for _ in range(local)]    # the engines build at once
        cores, joined, store = [], {}, None
        try:
            for connect in starting:
                cores.append(connect())
            if size > local:              # remote cores take their ranks (core indices) from a TCPStore
                store = host_store(size, address[0], address[1] + 1)
                open_ranks(store, size, {"both": list(range(local, size))})
                joined = accept_cores(address, authkey, {"both": list(range(local, size))})
                cores += [EngineClient.remote(*joined[rank]) for rank in range(local, size)]
        except BaseException:
            for conn, _ in joined.values():
                conn.close()              # a remote core reads EOF and ends
            for connect in starting:
                if connect.process.is_alive():
                    connect.process.kill()
                    connect.process.join(1)
            raise
        client = DataParallelClient(cores, policy)
        client.store = store
        return client

    @staticmethod
    def in_threads(engines: list[Engine], policy: str = "round_robin") -> "DataParallelClient":
        """Tests: each core loop in a thread beside an Engine the test holds."""
        return DataParallelClient([EngineClient.in_thread(e) for e in engines], policy)

    # -- what serve.py reads
    @property
    def stats(self) -> EngineStats:
        """The cores' stats summed (kv_usage over all blocks, hit rate: the mean of the live cores')."""
        live = [c.stats for c in self.cores if c.alive()] or [c.stats for c in self.cores]
        counts = ("graph_steps", "eager_steps")                      # dicts of counts: summed key by key
        total = {f.name: sum(getattr(s, f.name) for s in live) for f in dataclasses.fields(EngineStats)
                 if f.name != "kv_offload" and f.name not in counts}
        total |= {name: dict(sum((collections.Counter(getattr(s, name)) for s in live), collections.Counter()))
                  for name in counts}
        total["kv_offload"] = kv_offload.merge_stats([s.kv_offload for s in live])
        total["kv_usage"] = 1 - total["num_free_blocks"] / max(1, total["num_blocks"])
        total["prefix_cache_hit_rate"] /= len(live)
        total["spec_decode_mean_acceptance_length"] /= len(live)
        return EngineStats(**total)

    @property
    def num_pending_adds(self) -> int:
        return sum(c.num_pending_adds for c in self.cores if c.alive())

    @property
    def dead_reason(self) -> str | None:
        """None while any core serves; the server is dead only when every core is."""
        return None if self.alive() else "; ".join(f"core {i}: {c.dead_reason}" for i, c in enumerate(self.cores))

    def alive(self) -> bool:
        return any(c.alive() for c in self.cores)

    def dead_cores(self) -> dict[int, str]:
        return {i: c.dead_reason or "not running" for i, c in enumerate(self.cores) if not c.alive()}

    def num_waiting(self) -> int:
        return sum(c.num_waiting() for c in self.cores if c.alive())

    # -- lifecycle, on the event loop
    def start(self) -> None:
        for core in self.cores:
            core.start()

    def stop(self) -> None:
        for core in self.cores:            # all told first, so they stop together, not one after another
            core.stopping = True
            core.outbox.put(Stop())
        for core in self.cores:
            core.stop()

    def kill(self) -> None:
        for core in self.cores:
            core.kill()

    # -- requests
    def submit(self, run: Run) -> None:
        """Route the run (all its prompts go to one core: the core adds them all or none) by its first prompt."""
        if not self.alive() or not self.router.loads():   # no core left, or none left for this stage
            raise APIError(503, f"engine is dead: {self.dead_reason or 'no core left to take requests'}",
                           code="engine_dead")
        i = self.router.route(run.prompts[0], run.cache_salt)
        self.cores[i].submit(run)
        for request_id in run.request_ids:
            self.owner[request_id] = (i, run)

    def abort(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self.owner:
                by_core.setdefault(self.owner[request_id][0], []).append(request_id)
        for i, ids in by_core.items():
            self.cores[i].abort(ids)
            self._ended(ids)

    # -- called by the cores' EngineClients, on the event loop, before each applies an update
    def _core_update(self, i: int, update: CoreUpdate) -> None:
        core = self.cores[i]
        ended = [out.request_id for out in update.outputs if out.finished]
        ended += [request_id for request_id, _ in update.failed]
        for key, _ in update.rejected:
            ended += core.adding[key].request_ids
        self._ended(ended)
        s = update.stats
        self.router.update_load(i, s.num_running + s.num_waiting + s.num_swapped + s.num_unforked_samples)
        if update.evicted:
            self.router.evicted_blocks(i, update.evicted)

    def _core_died(self, i: int, reason: str) -> None:
        self.router.remove_worker(i)
        self._ended([rid for rid, (core, _) in self.owner.items() if core == i])
        alive = sum(c.alive() for c in self.cores)
        log.error("engine core %d died (%s): %d of %d cores still serve", i, reason, alive, len(self.cores))

    def _ended(self, request_ids: list[str]) -> None:
        """Forget these requests; a run whose last prompt ended leaves its core's load."""
        for request_id in request_ids:
            entry = self.owner.pop(request_id, None)
            if entry is not None and not any(r in self.owner for r in entry[1].request_ids):
                self.router.finish(entry[0])

    # -- /metrics
    def metrics_lines(self, labels: str) -> list[str]:
        """Per-core gauges and the router's decisions, in Prometheus text."""
        series = [("engine_core_alive", "gauge", "1 while the engine core serves.", lambda c: int(c.alive())),
                  ("core_num_requests_running", "gauge", "Requests in the core's running batch.",
                   lambda c: c.stats.num_running),
                  ("core_num_requests_waiting", "gauge", "Requests waiting in the core.", lambda c: c.stats.num_waiting),
                  ("core_kv_cache_usage_perc", "gauge", "Fraction of the core's KV blocks in use.",
                   lambda c: c.stats.kv_usage),
                  ("core_prefix_cache_hit_rate", "gauge", "The core's prefix cache hit rate.",
                   lambda c: c.stats.prefix_cache_hit_rate)]
        lines = []
        for name, kind, help_text, value in series:
            lines += [f"# HELP nanoserve:{name} {help_text}", f"# TYPE nanoserve:{name} {kind}"]
            lines += [f'nanoserve:{name}{{{labels},core="{i}"}} {value(c)}' for i, c in enumerate(self.cores)]
        lines += ["# HELP nanoserve:routing_decisions_total Requests routed, by policy, branch taken and core.",
                  "# TYPE nanoserve:routing_decisions_total counter"]
        lines += [f'nanoserve:routing_decisions_total{{{labels},policy="{p}",reason="{r}",core="{w}"}} {n}'
                  for (p, r, w), n in sorted(self.router.decision_counts().items())]
        lines += ["# HELP nanoserve:router_expected_hit_rate cache_aware: prompt tokens its trees matched on the "
                  "chosen core / prompt tokens routed.", "# TYPE nanoserve:router_expected_hit_rate gauge",
                  f"nanoserve:router_expected_hit_rate{{{labels}}} {self.router.expected_hit_rate()}",
                  "# HELP nanoserve:router_forgotten_blocks_total cache_aware: blocks the cores evicted that cut a "
                  "core's prefix tree.", "# TYPE nanoserve:router_forgotten_blocks_total counter",
                  f"nanoserve:router_forgotten_blocks_total{{{labels}}} {self.router.forgotten_blocks}"]
        return lines


@dataclass
class JoinCore:
    """Remote core -> front end, first on its connection: the rank it took (kv_transfer.join_as)."""
    rank: int
    role: str



def accept_cores(address: tuple[str, int], authkey: bytes, remote: dict[str, list[int]]) -> dict:
    """The front end's side of a remote join: each core took an open rank of its role from the front end's
    TCPStore (kv_transfer.join_as), connects to the listener at `address` (authenticated: the messages
    are pickles) and says which (JoinCore). Returns {rank: (connection, peer address)}; every rank once."""
    joined = {}
    try:
        with Listener(address, authkey=authkey) as listener:
            log.info("waiting for remote engine cores (serve.py --headless) on %s:%d: %s", *address,
                     {role: len(ranks) for role, ranks in remote.items() if ranks})
            while len(joined) < sum(map(len, remote.values())):
                conn = listener.accept()
                join = conn.recv()
                if not isinstance(join, JoinCore) or join.rank not in remote.get(join.role, ()) or join.rank in joined:
                    conn.close()
                    raise RuntimeError(f"a core joined that takes no open rank: {join!r:.200}")
                joined[join.rank] = (conn, listener.last_accepted)
    except BaseException:
        for conn, _ in joined.values():
            conn.close()                      # the remote core reads EOF and ends
        raise
    return joined


def dp_key() -> bytes:
    key = os.environ.get("NANOSERVE_DP_KEY", "")
    if not key:   # the cores' messages are pickles: an unauthenticated port would run anyone's code
        raise ValueError("remote engine cores need NANOSERVE_DP_KEY (the same secret on every machine)")
    return key.encode()


def run_headless(config: EngineConfig, local: int, address: tuple[str, int], key: bytes,
                 grammar_timeout: float, role: str = "both") -> None:
    """serve.py --headless: `local` engine cores for a front end on another machine, sharing this host's
    threads; exits when they all end (the front end stopped, or hung up). role: both (data-parallel
    replicas) or prefill | decode (cores of a disaggregated front end: disaggregation.py)."""
    config.num_threads = max(1, (config.num_threads or os.cpu_count()) // local)
    context = multiprocessing.get_context("spawn")
    cores = [context.Process(target=run_remote_core, args=(config, address, key, grammar_timeout, 120.0, role),
                             name=f"nanoserve-engine-core-{i}") for i in range(local)]
    for core in cores:
        core.start()
    log.info("%d headless %sengine cores serving the front end at %s:%d", local,
             "" if role == "both" else role + " ", *address)
    for sig in (signal.SIGINT, signal.SIGTERM):    # the cores end when the front end stops them
        signal.signal(sig, lambda *_: [c.kill() for c in cores])
    for core in cores:
        core.join()
    sys.exit(max(0, *(c.exitcode or 0 for c in cores)))


def run_remote_core(config: EngineConfig, address: tuple[str, int], authkey: bytes, grammar_timeout: float = 10.0,
                    wait_s: float = 120.0, role: str = "both") -> None:
    """serve.py --headless: one engine core on this machine serving a front end on another. It connects
    to the front end's listener (authenticated: the messages are pickles), retrying while the front end
    starts, then runs exactly as a local core does over its pipe. First it takes its rank (its core index;
    for a prefill or decode core, its rank in the KV-transfer group too) from the front end's TCPStore
    at the next port, and says which on the connection."""
    group = join_as(role, address[0], address[1] + 1, wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn = Client(address, authkey=authkey)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no front end listening at {address[0]}:{address[1]} after {wait_s:g} s")
            time.sleep(0.5)
    conn.send(JoinCore(group.rank, role))
    make_core = EngineCore if role == "both" else functools.partial(HandoffCore.joining, group, role)
    run_core_process(config, conn, grammar_timeout, make_core)
