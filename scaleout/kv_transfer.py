"""
KV transfer for disaggregated prefill and decode: the transport that moves a request's KV blocks from a
prefill core to a decode core, block by block, with torch.distributed point-to-point (gloo on CPUs).

Every engine core of a disaggregated server is a rank of one gloo group: prefill cores 0..P-1, decode
cores P..P+D-1. The front end (disaggregation.py) hosts the group's TCPStore, so the cores need only its
address and their rank, whichever machine they run on: the front end gives local cores theirs, and a core
that joins from another machine takes the next rank the front end left open for its role, from an atomic
counter in that store (join_as: torch.distributed's rendezvous, no home-made one). A transfer is one tag: the prefill core posts one
send per block, the decode core one receive per block into a staging buffer of the same shape, and copies
it into the block it allocated once it has arrived. Sends and receives are asynchronous: the core loop
polls them between steps (a small thread per transfer waits on gloo), so a transfer never stalls the
running batch, and a peer that dies fails the transfer (gloo raises) instead of hanging the core. Owns the group and the in-flight transfers; it never
allocates or frees a block (engine.py does: export_request/import_request) and never decides who sends
to whom (the front end does).
"""
import dataclasses
import datetime
import threading
import time

import torch
import torch.distributed as dist

from kv_cache import KVCachePool


@dataclasses.dataclass
class TransferGroup:
    """Where a core finds the group: the front end's TCPStore, and this core's rank in it."""
    host: str
    port: int
    rank: int
    world_size: int
    # gloo's per-operation limit. A receive is posted when the decode core allocates, and the send only
    # when the prefill core is between steps, so it must cover a long prefill step; a dead peer is noticed
    # sooner anyway, by the front end, through its pipe. This is the backstop.
    timeout_s: float = 300.0


@dataclasses.dataclass
class Transfer:
    request_id: str
    block_ids: list[int]               # this core's blocks, in the order the blocks travel
    buffers: list[torch.Tensor]        # per block [num_layers, 2, block_size, num_kv_heads, head_dim]
    works: list                        # one gloo Work per block
    started: float
    nbytes: int = 0
    finished: bool = False
    error: Exception | None = None

    def wait_all(self) -> None:
        """On the transfer's own thread: gloo's Work says it is complete only once wait() returned, so
        a thread waits (up to the group's timeout; a dead peer raises sooner) and the core loop polls."""
        try:
            for w in self.works:
                w.wait()
        except Exception as exc:
            self.error = exc
        self.finished = True

    def done(self) -> bool:
        """True once every block arrived or left; raises the transfer's failure if it failed."""
        if self.finished and self.error is not None:
            raise self.error
        return self.finished


class KVTransfer:
    def __init__(self, group: TransferGroup):
        timeout = datetime.timedelta(seconds=group.timeout_s)
        store = dist.TCPStore(group.host, group.port, None, False, timeout)
        self.rank = group.rank
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("kv", store), group.rank, group.world_size, timeout)
        self.sending: dict[str, Transfer] = {}
        self.receiving: dict[str, Transfer] = {}
        self.abandoned: list[Transfer] = []     # dropped mid-flight (abort, dead peer): kept until their thread
        self.bytes_sent = self.bytes_received = 0   # ends, so gloo never writes into a freed buffer

    def send(self, pool: KVCachePool, request_id: str, block_ids: list[int], dst: int, tag: int) -> None:
        buffers = [pool.read_block(b) for b in block_ids]
        works = [self.group.send([buf], dst, tag) for buf in buffers]   # in order: gloo matches per (pair, tag)
        self.sending[request_id] = self._start(request_id, block_ids, buffers, works)

    def receive(self, pool: KVCachePool, request_id: str, block_ids: list[int], src: int, tag: int) -> None:
        buffers = [pool.empty_block() for _ in block_ids]
        works = [self.group.recv([buf], src, tag) for buf in buffers]
        self.receiving[request_id] = self._start(request_id, block_ids, buffers, works)

    @staticmethod
    def _start(request_id, block_ids, buffers, works) -> Transfer:
        t = Transfer(request_id, block_ids, buffers, works, time.monotonic(),
                     sum(b.numel() * b.element_size() for b in buffers))
        threading.Thread(target=t.wait_all, name=f"kv-transfer-{request_id}", daemon=True).start()
        return t

    def poll(self, pool: KVCachePool) -> tuple[list[Transfer], list[Transfer], list[tuple[str, Exception]]]:
        """Transfers that ended since the last poll: (sent, received, failed). A received one's blocks
        are in the pool when it is returned."""
        sent, received, failed = [], [], []
        for table, out in ((self.sending, sent), (self.receiving, received)):
            for request_id, t in list(table.items()):
                try:
                    if not t.done():
                        continue
                except Exception as exc:    # the peer died or the group timed out
                    failed.append((request_id, exc))
                    self.abandoned.append(table.pop(request_id))
                    continue
                del table[request_id]
                out.append(t)
        for t in received:
            for block, buf in zip(t.block_ids, t.buffers):
                pool.write_block(block, buf)
            self.bytes_received += t.nbytes
        self.bytes_sent += sum(t.nbytes for t in sent)
        return sent, received, failed

    def drop(self, request_id: str) -> None:
        """The request was aborted: forget its transfer (its blocks are the engine's to free)."""
        for table in (self.sending, self.receiving):
            if request_id in table:
                self.abandoned.append(table.pop(request_id))

    def close(self) -> None:
        """The core ends: leave the group (its peers' pending operations on this rank fail at once)."""
        self.group.shutdown()

    def busy(self) -> bool:
        self.abandoned = [t for t in self.abandoned if not t.finished]
        return bool(self.sending or self.receiving)


def host_store(world_size: int, host: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
    """The front end's store: the cores (world_size of them) meet through it. port 0: a free one."""
    return dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)


def open_ranks(store: dist.TCPStore, world_size: int, remote: dict[str, list[int]]) -> None:
    """The front end: publish the group's size and, per role (both: a data-parallel replica; prefill,
    decode), the ranks left for cores joining from other machines; none for a role not named, so a core
    of the wrong kind is refused at once."""
    store.set("nanoserve/world_size", str(world_size))
    for role in ("both", "prefill", "decode"):
        store.set(f"nanoserve/open_ranks/{role}", ",".join(map(str, remote.get(role, ()))))


def join_as(role: str, host: str, port: int, timeout_s: float = 120.0) -> TransferGroup:
    """A core on another machine: wait for the front end's store, take the next open rank of `role`."""
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))   # retries till up
    world_size = int(store.get("nanoserve/world_size"))
    ranks = [int(r) for r in store.get(f"nanoserve/open_ranks/{role}").decode().split(",") if r]
    i = store.add(f"nanoserve/joined/{role}", 1) - 1
    if i >= len(ranks):
        raise RuntimeError(f"the front end at {host}:{port} expects {len(ranks)} remote {role} cores, and "
                           f"{i + 1} joined (see its --disaggregation-local)")
    return TransferGroup(host, port, ranks[i], world_size)
