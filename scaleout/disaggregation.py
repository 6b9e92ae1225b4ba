"""
Disaggregated prefill and decode behind one server (--disaggregation P:D; Splitwise, DistServe).

P prefill cores compute each prompt's KV and first token (streamed at once); the request then moves,
with its sampling state (engine.export_request: seed stream, samples of n > 1, detokenizer, logprobs,
grammar), to one of D decode cores, and its prompt's blocks follow through kv_transfer.py. The hand-off,
as this front end drives it over the cores' pipes:
  prefill core: CoreUpdate.handoffs (blocks held)  ->  decode core: ImportRequest (blocks allocated,
  its own prefix-cache hits skipped)  ->  CoreUpdate.wanted  ->  prefill core: SendBlocks  ->  the blocks
  go rank to rank (gloo)  ->  the decode core runs the request; the prefill core frees its blocks.
A core that dies fails only the requests it held or was moving (error events); the other side of a
transfer frees its blocks. Cores may run on other machines (serve.py --headless --disaggregation-mode).
Owns which core takes each stage, the requests in transit and the transfer metrics; owns no transport
(kv_transfer.py), no block (engine.py) and no HTTP (serve.py).
"""
import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import os

from scaleout.data_parallel import DataParallelClient, accept_cores, dp_key
from engine import Engine, EngineConfig
from engine_client import EngineClient, Failed
from engine_core import CoreUpdate
from scaleout.handoff import HandoffCore, ImportRequest, SendBlocks
from scaleout.kv_transfer import KVTransfer, TransferGroup, host_store, open_ranks
from openai_api import APIError
from scaleout.router import Router, RouterConfig


def parse_disaggregation(value: str, least: int = 1) -> tuple[int, int]:
    """'P:D' -> (P, D), each >= least (--disaggregation: 1; --disaggregation-local: 0)."""
    try:
        p, d = (int(x) for x in value.split(":"))
    except ValueError:
        raise ValueError(f"--disaggregation must be P:D (prefill cores : decode cores), e.g. 1:1; got {value!r}")
    if p < least or d < least:
        raise ValueError(f"--disaggregation needs P and D >= {least} (prefill and decode cores); got {value!r}")
    return p, d


class DisaggregatedClient(DataParallelClient):
    """Cores 0..P-1 prefill, P..P+D-1 decode; a core's index is its rank in the transfer group."""

    def __init__(self, prefill: list[EngineClient], decode: list[EngineClient], store=None):
        super().__init__(prefill + decode, "least_loaded")
        self.num_prefill, self.store = len(prefill), store   # the store outlives the cores' group
        self.router = Router(RouterConfig("least_loaded"), range(len(prefill)))
        self.decode_router = Router(RouterConfig("least_loaded"), range(len(prefill), len(self.cores)))
        self.tags = itertools.count(1)
        self.transit: dict[str, tuple[int, int]] = {}     # request id -> (prefill core, decode core)
        self.kv_bytes = self.kv_blocks = self.kv_transfers = 0
        self.kv_seconds = 0.0

    @staticmethod
    def from_flags(config: EngineConfig, flag: str, local_flag: str | None, address: tuple[str, int],
                   grammar_timeout: float) -> "DisaggregatedClient":
        """serve.py's --disaggregation P:D [--disaggregation-local P:D]; remote cores need NANOSERVE_DP_KEY."""
        p, d = parse_disaggregation(flag)
        local = parse_disaggregation(local_flag, 0) if local_flag else (p, d)
        if local[0] > p or local[1] > d:
            raise ValueError(f"--disaggregation-local {local_flag} exceeds --disaggregation {flag}")
        return DisaggregatedClient.in_processes(config, p, d, grammar_timeout, local, address,
                                                dp_key() if local != (p, d) else b"")

    @staticmethod
    def in_processes(config: EngineConfig, num_prefill: int, num_decode: int, grammar_timeout: float = 10.0,
                     local: tuple[int, int] | None = None, address: tuple[str, int] | None = None,
                     authkey: bytes = b""):
        """serve.py: local = (prefill, decode) cores started here (default all), ranks 0.. and P.. of each
        role; the others join from other machines (serve.py --headless --disaggregation-mode ROLE): they
        take the open ranks from the group's TCPStore at address's host and port + 1, then connect to the
        listener at `address`, authenticated by `authkey`."""
        size = num_prefill + num_decode
        local_p, local_d = local or (num_prefill, num_decode)
        ranks = list(range(local_p)) + list(range(num_prefill, num_prefill + local_d))
        remote = {"prefill": list(range(local_p, num_prefill)), "decode": list(range(num_prefill + local_d, size))}
        num_remote = size - len(ranks)
        host = address[0] if num_remote else "127.0.0.1"
        store = host_store(size, host, address[1] + 1 if num_remote else 0)
        open_ranks(store, size, remote)
        threads = max(1, (config.num_threads or os.cpu_count()) // max(1, len(ranks)))
        role = lambda rank: "prefill" if rank < num_prefill else "decode"
        joining = lambda rank: functools.partial(HandoffCore.joining, TransferGroup(host, store.port, rank, size),
                                                 role(rank))
        starting = {rank: EngineClient.launch(dataclasses.replace(config, num_threads=threads), grammar_timeout,
                                              joining(rank)) for rank in ranks}
        joined = {}                         # rank -> (connection, address) of a remote core
        try:
            if num_remote:
                joined = accept_cores(address, authkey, remote)
            cores = [starting[rank]() if rank in starting else EngineClient.remote(*joined[rank])
                     for rank in range(size)]
        except BaseException:
            for conn, _ in joined.values():
                conn.close()                # the remote core reads EOF and ends
            for connect in starting.values():
                if connect.process.is_alive():
                    connect.process.kill()
                    connect.process.join(1)
            raise
        return DisaggregatedClient(cores[:num_prefill], cores[num_prefill:], store)

    @staticmethod
    def in_threads(prefill: list[Engine], decode: list[Engine], timeout_s: float = 30.0) -> "DisaggregatedClient":
        """Tests: the cores' loops in threads of this process, each with its own gloo group member."""
        engines = prefill + decode
        store = host_store(len(engines))
        groups = [TransferGroup("127.0.0.1", store.port, rank, len(engines), timeout_s) for rank in range(len(engines))]
        with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
            transfers = list(pool.map(KVTransfer, groups))    # each waits for all the others
        cores = [EngineClient.in_thread(e, functools.partial(HandoffCore, transfer=t,
                                                             role="prefill" if i < len(prefill) else "decode"))
                 for i, (e, t) in enumerate(zip(engines, transfers))]
        return DisaggregatedClient(cores[:len(prefill)], cores[len(prefill):], store)

    def abort(self, request_ids: list[str]) -> None:
        """A request may be on a prefill core, on a decode core or between them: every live core forgets it."""
        for core in self.cores:
            if core.alive():
                core.abort(request_ids)
        for request_id in request_ids:
            self.transit.pop(request_id, None)
        self._ended(request_ids)

    # -- the cores' hooks, on the event loop
    def _core_update(self, i: int, update: CoreUpdate) -> None:
        s = update.stats
        (self.router if i < self.num_prefill else self.decode_router).update_load(
            i, s.num_running + s.num_waiting + s.num_swapped + s.num_unforked_samples)
        if update.handoffs:    # after the prefill core's client has routed this update's first tokens
            asyncio.get_running_loop().call_soon(self._hand_off, i, update.handoffs)
        for request_id, indices, tag in update.wanted:
            if request_id in self.transit:
                self.kv_blocks += len(indices)
                self.cores[self.transit[request_id][0]].outbox.put(SendBlocks(request_id, indices, i, tag))
        for request_id, nbytes, seconds in update.received:
            self.transit.pop(request_id, None)
            self.kv_bytes, self.kv_seconds, self.kv_transfers = (self.kv_bytes + nbytes, self.kv_seconds + seconds,
                                                                 self.kv_transfers + 1)
        ended = [out.request_id for out in update.outputs if out.finished] + [r for r, _ in update.failed]
        for request_id in ended:
            self.transit.pop(request_id, None)
        self._ended(ended)

    def _hand_off(self, i: int, handoffs) -> None:
        prefill = self.cores[i]
        for h in handoffs:
            entry = prefill.tracked.pop(h.request_id, None)
            if entry is None:               # aborted while it prefilled: the core frees the held blocks
                prefill.abort([h.request_id])
                continue
            try:
                j = self.decode_router.route(h.prompt_token_ids)
            except Exception:               # no decode core left
                prefill.abort([h.request_id])
                entry.run.notify(Failed(APIError(503, "engine is dead: no decode core left", code="engine_dead")))
                continue
            self.cores[j].tracked[h.request_id] = entry
            self.owner[h.request_id] = (j, entry.run)
            self.transit[h.request_id] = (i, j)
            self.cores[j].outbox.put(ImportRequest(h, i, next(self.tags)))

    def _core_died(self, i: int, reason: str) -> None:
        (self.router if i < self.num_prefill else self.decode_router).remove_worker(i)
        error = APIError(503, f"engine is dead: core {i} died while the request's KV moved ({reason})",
                         code="engine_dead")
        for request_id, (p, d) in list(self.transit.items()):
            if i not in (p, d):
                continue
            other = self.cores[d if i == p else p]
            entry = self.cores[d].tracked.pop(request_id, None)
            other.abort([request_id])       # the survivor frees its side's blocks
            if entry is not None and i != d:   # a dead decode core's own client fails what it tracked
                entry.run.notify(Failed(error))
            del self.transit[request_id]
        self._ended([rid for rid, (core, _) in self.owner.items() if core == i])

    def _ended(self, request_ids: list[str]) -> None:
        for request_id in request_ids:      # loads come from the cores' reports alone here
            self.owner.pop(request_id, None)

    def metrics_lines(self, labels: str) -> list[str]:
        lines = super().metrics_lines(labels)
        lines += [f'nanoserve:routing_decisions_total{{{labels},policy="{p}",reason="decode",core="{w}"}} {n}'
                  for (p, r, w), n in sorted(self.decode_router.decision_counts().items())]
        for name, kind, help_text, value in [
                ("kv_transfer_bytes_total", "counter", "KV cache bytes moved from prefill to decode cores.", self.kv_bytes),
                ("kv_transfer_blocks_total", "counter", "KV blocks requested by decode cores.", self.kv_blocks),
                ("kv_transfers_total", "counter", "Requests whose KV arrived on a decode core.", self.kv_transfers),
                ("kv_transfer_seconds_total", "counter", "Time from receive posted to all blocks in, summed.",
                 self.kv_seconds)]:
            lines += [f"# HELP nanoserve:{name} {help_text}", f"# TYPE nanoserve:{name} {kind}",
                      f"nanoserve:{name}{{{labels}}} {value}"]
        return lines
