"""
The tiered prefix cache: where the KV of an evicted prefix-cache block goes, and how it comes back.

Owns: HostTier (block-sized slots in host memory, pinned on a GPU), DiskTier (one file per block
under a directory, each checked against the model, dtype, block size, layer shape and a checksum),
TierPolicy (which entry a full tier drops, which blocks a tier keeps: LRU by default, the class a
research fork swaps), and the Offloader that joins them under the device pool.
Does not decide when a block is evicted or a prefix admitted: kv_cache.BlockManager calls in here
when it reclaims a full, hashed block (evicted) and when a prefix lookup runs past the device blocks
(lookup, fetch). The KV goes back through a Restore block op, run by KVCachePool.run in the order
the scheduler issued it, before the forward that reads it.
An entry is one block's KV plus what verifies it: its hash, its tokens, the cache_salt and its
parent's content id (the BlockManager's registration id, which a block coming back keeps), so a
tier hit is checked token for token and link by link along its chain, as a device hit is.
Faults (a bad file, a full disk, an I/O error) cost a recompute, never a wrong token or a request:
they are logged once each. Invariants in Offloader.check_invariants().
"""
import json
import os
import struct
import sys
import tempfile
import time
import zlib
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, asdict

import torch

from kv_cache import parse_memory
from sequence import need

MAGIC = b"nskvblk1"                      # file format: MAGIC, u32 header length, JSON header, payload, u32 crc32
SUFFIX = ".kv"


@dataclass
class Entry:
    """One block in a tier: where its KV is, and the content it must match to be served."""
    key: bytes                           # the block hash (kv_cache.block_hash)
    uid: int                             # content id: the registration id it had on the device
    parent: int | None                   # the parent block's content id (None: the first block)
    tokens: tuple
    salt: str | None
    slot: int = -1                       # HostTier: its slot
    nbytes: int = 0                      # DiskTier: its file's size

    def matches(self, parent, tokens, salt) -> bool:
        return (self.parent, self.tokens, self.salt) == (parent, tokens, salt)


@dataclass
class TierStats:
    hits: int = 0                        # blocks served back to the device
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    evictions: int = 0                   # entries dropped (host: moved to disk if there is one)
    errors: int = 0                      # disk: files skipped (bad, foreign) and failed reads or writes


class TierPolicy:
    """LRU over each tier's index (an OrderedDict, least recently used first), everything admitted,
    and a block read from disk kept in the host tier too. A fork overrides these to try another
    policy: keep system prompts, skip one-off tails, prefetch a chain's next blocks."""

    def admit(self, tier: str, entry: Entry) -> bool:
        """Keep this block in tier ('host' or 'disk')?"""
        return True

    def touch(self, index: OrderedDict, key: bytes):
        index.move_to_end(key)

    def victim(self, index: OrderedDict) -> bytes:
        return next(iter(index))

    def promote(self, entry: Entry) -> bool:
        """After a disk hit: also keep the block in the host tier?"""
        return True


def copy_block(dst: torch.Tensor, src: torch.Tensor):
    """dst[...] = src for one block [L, 2, bs, h, d]. Between CPU tensors a layer at a time: each copy
    stays under torch's parallel grain, since handing one block to the thread pool costs tens of ms on
    busy cores (0.15 ms alone); to or from a GPU one copy."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        for layer in range(dst.shape[0]):
            dst[layer].copy_(src[layer])
    else:
        dst.copy_(src)


def _log_once(seen: set, kind: str, message: str):
    if kind not in seen:
        seen.add(kind)
        print(f"nanoserve: kv offload: {message} (logged once)", file=sys.stderr, flush=True)


class HostTier:
    """num_slots blocks of host memory, [num_slots, *block_shape], and an index of what they hold."""

    def __init__(self, num_slots: int, block_shape: tuple, dtype, pin: bool, policy: TierPolicy):
        self.data = torch.empty((num_slots,) + block_shape, dtype=dtype, pin_memory=pin)
        self.num_slots, self.policy = num_slots, policy
        self.free = deque(range(num_slots))
        self.index: OrderedDict[bytes, Entry] = OrderedDict()
        self.stats = TierStats()

    def get(self, key: bytes) -> Entry | None:
        return self.index.get(key)

    def take_slot(self, key: bytes) -> tuple[int, Entry | None]:
        """A slot for key's block: its old one, a free one, or the policy's victim's (returned, still
        holding its data, for the caller to move down before overwriting)."""
        if key in self.index:
            return self.index.pop(key).slot, None
        if self.free:
            return self.free.popleft(), None
        victim = self.index.pop(self.policy.victim(self.index))
        self.stats.evictions += 1
        return victim.slot, victim

    def put(self, entry: Entry, slot: int, block: torch.Tensor):
        t0 = time.perf_counter()
        copy_block(self.data[slot], block)
        self.stats.write_s += time.perf_counter() - t0
        self.stats.bytes_written += block.numel() * block.element_size()
        entry.slot = slot
        self.index[entry.key] = entry

    def check_invariants(self):
        slots = [e.slot for e in self.index.values()]
        assert len(set(slots)) == len(slots), "host tier: a slot holds two entries"
        assert not set(slots) & set(self.free), "host tier: a slot both free and used"
        assert len(slots) + len(self.free) == self.num_slots, "host tier: slots leaked"
        assert all(k == e.key for k, e in self.index.items())


class DiskTier:
    """One file per block in `path`, named by its hash, at most `budget` bytes of them (this process's
    count: writers sharing a directory each keep their own). Files are written to a temporary name and
    renamed, so a reader (this process after a restart, or another core) sees a whole file or none."""

    def __init__(self, path: str, budget: int, meta: dict, block_shape: tuple, dtype, policy: TierPolicy):
        self.path, self.budget, self.meta, self.policy = path, budget, meta, policy
        self.block_shape, self.dtype = block_shape, dtype
        self.index: OrderedDict[bytes, Entry] = OrderedDict()
        self.used = 0
        self.stats = TierStats()
        self.logged: set = set()
        os.makedirs(path, exist_ok=True)
        self.reader = ThreadPoolExecutor(4, thread_name_prefix="kv-disk")   # batched reads: files in parallel
        self._scan()

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + SUFFIX)

    def _scan(self):
        """Index the files a previous run (or another writer) left, oldest first."""
        names = [n for n in os.listdir(self.path) if n.endswith(SUFFIX)]
        for name in sorted(names, key=lambda n: self._mtime(os.path.join(self.path, n))):
            try:
                self._index_file(bytes.fromhex(name[:-len(SUFFIX)]))
            except ValueError:
                pass                                     # not one of ours: left alone

    @staticmethod
    def _mtime(path):
        try:
            return os.stat(path).st_mtime
        except OSError:
            return 0.0

    def _index_file(self, key: bytes) -> Entry | None:
        """Read a file's header; a foreign or unreadable file is removed and logged once."""
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 4)
                if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
                    raise ValueError("not a KV block file")
                header = json.loads(f.read(struct.unpack("<I", head[len(MAGIC):])[0]))
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError) as e:
            return self._reject(path, "unreadable", f"{path}: {e}; removed, its blocks are recomputed")
        if header.get("meta") != self.meta or header.get("key") != key.hex():
            return self._reject(path, "foreign", f"{path} is from another model, dtype, block size or layer shape "
                                                 f"({header.get('meta')}); removed, its blocks are recomputed")
        entry = Entry(key, header["uid"], header["parent"], tuple(header["tokens"]), header["salt"], nbytes=size)
        self._forget(key)
        self.index[key] = entry
        self.used += size
        return entry

    def _reject(self, path, kind, message):
        self.stats.errors += 1
        _log_once(self.logged, kind, message)
        try:
            os.remove(path)
        except OSError:
            pass
        return None

    def _forget(self, key):
        entry = self.index.pop(key, None)
        if entry is not None:
            self.used -= entry.nbytes

    def get(self, key: bytes) -> Entry | None:
        """The index's entry, or a file another writer has added since (one stat per miss)."""
        entry = self.index.get(key)
        if entry is None and os.path.exists(self._file(key)):
            entry = self._index_file(key)
        return entry

    # -------------------------------------------------------------- write
    def put(self, entry: Entry, block: torch.Tensor) -> bool:
        """Write one block [*block_shape] (host memory) to its file. A failure (full disk, read-only
        directory) drops the block: it is recomputed when next asked for."""
        old = self.index.get(entry.key)
        if old is not None and old.uid == entry.uid:
            self.policy.touch(self.index, entry.key)
            return True
        header = json.dumps({"meta": self.meta, "key": entry.key.hex(), "uid": entry.uid, "parent": entry.parent,
                             "tokens": list(entry.tokens), "salt": entry.salt}).encode()
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        body = MAGIC + struct.pack("<I", len(header)) + header + payload
        blob = body + struct.pack("<I", zlib.crc32(body))
        self._forget(entry.key)
        while self.index and self.used + len(blob) > self.budget:
            self._remove(self.policy.victim(self.index))
        if len(blob) > self.budget:
            return False
        t0 = time.perf_counter()
        if not self._write_atomic(self._file(entry.key), blob):
            return False
        self.stats.write_s += time.perf_counter() - t0
        self.stats.bytes_written += len(blob)
        entry.nbytes = len(blob)
        self.index[entry.key] = entry
        self.used += len(blob)
        return True

    def _write_atomic(self, path: str, blob: bytes) -> bool:
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=".part")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            return True
        except OSError as e:
            self.stats.errors += 1
            _log_once(self.logged, "write", f"cannot write to {self.path} ({e}); evicted blocks are dropped")
            if tmp is not None:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
            return False

    def _remove(self, key: bytes):
        self._forget(key)
        self.stats.evictions += 1
        try:
            os.remove(self._file(key))
        except OSError:
            pass

    # -------------------------------------------------------------- read
    def read(self, entries: list[Entry]) -> list[torch.Tensor | None]:
        """Each entry's block [*block_shape], or None where its file is gone, changed or corrupt (that
        file is removed). The files are read in parallel."""
        t0 = time.perf_counter()
        blocks = list(self.reader.map(self._read_one, entries))
        self.stats.read_s += time.perf_counter() - t0
        return blocks

    def _read_one(self, entry: Entry) -> torch.Tensor | None:
        path = self._file(entry.key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError as e:
            self.stats.errors += 1
            _log_once(self.logged, "read", f"cannot read {path} ({e}); its blocks are recomputed")
            return None
        body, crc = blob[:-4], blob[-4:]
        if len(blob) < len(MAGIC) + 8 or struct.pack("<I", zlib.crc32(body)) != crc:
            self._reject(path, "checksum", f"{path} fails its checksum (truncated or corrupt); "
                                           "removed, its blocks are recomputed")
            return None
        hlen = struct.unpack("<I", body[len(MAGIC):len(MAGIC) + 4])[0]
        header = json.loads(body[len(MAGIC) + 4:len(MAGIC) + 4 + hlen])
        if (header["uid"], header["parent"], tuple(header["tokens"]), header["salt"], header["meta"]) != \
                (entry.uid, entry.parent, entry.tokens, entry.salt, self.meta):
            return None                                  # replaced since indexed (another writer): a miss
        payload = bytearray(body[len(MAGIC) + 4 + hlen:])
        self.stats.bytes_read += len(blob)
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(self.block_shape)

    def check_invariants(self):
        assert self.used == sum(e.nbytes for e in self.index.values()), "disk tier: bytes miscounted"
        assert self.used <= self.budget, "disk tier: over its budget"
        assert all(k == e.key for k, e in self.index.items())


@dataclass(eq=False)
class Restore:
    """A block op: staged KV ([n, *block_shape], host memory) into device blocks dst, in one copy."""
    data: torch.Tensor
    dst: tuple
    offloader: "Offloader" = field(repr=False)

    @staticmethod
    def run_all(pool, ops: list["Restore"]):
        """KVCachePool.run's hook for a run of Restore ops: one host-to-device copy for all of them."""
        dst = [b for op in ops for b in op.dst]
        if pool.pool.device.type == "cpu":              # block by block: no thread-pool handoff (copy_block)
            for block, data in zip(dst, (block for op in ops for block in op.data)):
                copy_block(pool.pool[:, :, block], data)
        else:                                            # one upload, one scatter kernel
            data = torch.cat([op.data for op in ops]) if len(ops) > 1 else ops[0].data    # [n, L, 2, bs, h, d]
            index = torch.tensor(dst, device=pool.pool.device)
            pool.pool[:, :, index] = data.to(pool.pool.device, non_blocking=True).movedim(0, 2)
        for op in ops:
            op.offloader.pending_restore.difference_update(op.dst)


class Offloader:
    """The tiers under one device pool. KVCachePool.pool is [L, 2, num_blocks, bs, h, d]; a tier
    block is [L, 2, bs, h, d]."""

    def __init__(self, pool, host_bytes: int, disk_dir: str | None, disk_bytes: int, meta: dict,
                 policy: TierPolicy | None = None):
        self.pool, self.policy = pool, policy or TierPolicy()
        t = pool.pool
        self.block_shape = (t.shape[0], t.shape[1]) + tuple(t.shape[3:])
        self.block_bytes = t[:, :, 0].numel() * t.element_size()
        pin = t.device.type == "cuda"                    # pinned: device<->host copies at full PCIe speed
        self.host = HostTier(host_bytes // self.block_bytes, self.block_shape, t.dtype, pin, self.policy)
        self.disk = DiskTier(disk_dir, disk_bytes, meta, self.block_shape, t.dtype, self.policy) if disk_dir else None
        self.pending_restore: set[int] = set()           # device blocks whose Restore has not run yet
        self.restored_total = self.restored_last_step = 0

    # -------------------------------------------------------------- device -> tiers
    def evicted(self, block: int, key: bytes, uid: int, parent, tokens, salt):
        """The block manager reclaims device block `block` (a full, registered block): keep its KV."""
        if block in self.pending_restore:
            return                                       # its KV has not arrived yet; the tier it comes from keeps it
        old = self.host.get(key)
        if old is not None and old.uid == uid:
            self.policy.touch(self.host.index, key)
            return
        entry = Entry(key, uid, parent, tuple(tokens), salt)
        if self.host.num_slots == 0 or not self.policy.admit("host", entry):
            return
        slot, victim = self.host.take_slot(key)
        if victim is not None and self.disk is not None and self.policy.admit("disk", victim):
            self.disk.put(victim, self.host.data[victim.slot])
        self.host.put(entry, slot, self.pool.pool[:, :, block])

    # -------------------------------------------------------------- tiers -> device
    def lookup(self, hashes, start: int, parent, token_ids, salt, block_size: int, max_blocks: int) -> list[Entry]:
        """The tier entries that continue a prefix whose first `start` blocks are on the device (the
        last with content id `parent`): each matches its block's tokens, the salt and its parent."""
        found = []
        for i in range(start, max_blocks):
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            entry = self.host.get(hashes[i])
            if entry is None or not entry.matches(parent, tokens, salt):
                entry = self.disk.get(hashes[i]) if self.disk else None
                if entry is None or not entry.matches(parent, tokens, salt):
                    break
            found.append(entry)
            parent = entry.uid
        return found

    def fetch(self, entries: list[Entry]) -> torch.Tensor:
        """The KV of the leading entries that could be read, [k, *block_shape] (k <= len(entries)), staged
        in host memory (pinned on a GPU): host entries copied, disk ones read in one parallel batch; a
        file that cannot be used ends the run there."""
        on_disk = [e for e in entries if self.host.index.get(e.key) is not e]
        read = dict(zip(map(id, on_disk), self.disk.read(on_disk))) if on_disk else {}
        out = torch.empty((len(entries),) + self.block_shape, dtype=self.host.data.dtype,
                          pin_memory=self.host.data.is_pinned())
        t0, k = time.perf_counter(), 0
        for e in entries:
            if id(e) not in read:                        # on the host
                copy_block(out[k], self.host.data[e.slot])
                self.policy.touch(self.host.index, e.key)
                self.host.stats.hits += 1
                self.host.stats.bytes_read += self.block_bytes
            elif read[id(e)] is not None:
                copy_block(out[k], read[id(e)])
                self.policy.touch(self.disk.index, e.key)
                self.disk.stats.hits += 1
            else:
                self.disk._forget(e.key)
                break
            k += 1
        self.host.stats.read_s += time.perf_counter() - t0
        self._promote([e for e in entries[:k] if id(e) in read], read)
        return out[:k]

    def _promote(self, entries: list[Entry], blocks: dict):
        for e in entries:
            if self.host.num_slots and self.policy.promote(e) and self.host.get(e.key) is None:
                slot, victim = self.host.take_slot(e.key)
                if victim is not None and self.policy.admit("disk", victim):
                    self.disk.put(victim, self.host.data[victim.slot])
                self.host.put(Entry(e.key, e.uid, e.parent, e.tokens, e.salt), slot, blocks[id(e)])

    def restore_op(self, data: torch.Tensor, dst: list[int]) -> Restore:
        self.pending_restore.update(dst)
        self.restored_total += len(dst)
        return Restore(data, tuple(dst), self)

    # -------------------------------------------------------------- introspection
    def step_done(self, block_ops):
        """Engine.schedule's hook: note how many blocks this step brings back."""
        self.restored_last_step = sum(len(op.dst) for op in block_ops if isinstance(op, Restore))

    def stats(self) -> dict:
        tiers = {"host": self.host} if self.disk is None else {"host": self.host, "disk": self.disk}
        out = {name: {**asdict(t.stats), "blocks": len(t.index)} for name, t in tiers.items()}
        out["host"]["capacity_blocks"] = self.host.num_slots
        return {**out, "restored_blocks_total": self.restored_total,
                "restored_blocks_last_step": self.restored_last_step}

    def check_invariants(self):
        assert not self.pending_restore, "a Restore op never ran"
        self.host.check_invariants()
        if self.disk is not None:
            self.disk.check_invariants()


def merge_stats(per_core: list[dict]) -> dict:
    """Offloader.stats() of several engine cores (data parallelism) summed, figure by figure."""
    out = {}
    for stats in per_core:
        for k, v in stats.items():
            out[k] = merge_stats([out.get(k, {}), v]) if isinstance(v, dict) else out.get(k, 0) + v
    return out


def build(config, pool, blocks, model_id: str, dtype, tensor_parallel: bool,
          policy: TierPolicy | None = None) -> Offloader | None:
    """Engine's seam: the tiers config asks for (kv_offload_memory, kv_offload_dir, kv_offload_disk),
    hung under `blocks`, or None. Raises InvalidRequest naming the field that cannot be honoured."""
    host = parse_memory(config.kv_offload_memory or 0)
    if not host:
        need(config.kv_offload_dir is None, "kv_offload_dir", "None without kv_offload_memory (the disk tier sits "
                                                               "under the host tier)", config.kv_offload_dir)
        return None
    need(config.enable_prefix_caching, "kv_offload_memory", "0 without prefix caching", config.kv_offload_memory)
    need(not tensor_parallel, "kv_offload_memory", "0 under tensor parallelism", config.kv_offload_memory)
    need(config.preemption_mode != "swap", "kv_offload_memory",
         "0 with preemption_mode 'swap' (both would keep host copies of one block)", config.kv_offload_memory)
    disk = parse_memory(config.kv_offload_disk or 0)
    need(not config.kv_offload_dir or disk > 0, "kv_offload_disk", "a size (e.g. '20GiB') with kv_offload_dir",
         config.kv_offload_disk)
    meta = {"model": model_id, "dtype": str(dtype).removeprefix("torch."), "block_size": config.block_size,
            "layer_shape": [pool.pool.shape[0], pool.pool.shape[1], *pool.pool.shape[3:]]}
    offloader = Offloader(pool, host, config.kv_offload_dir, disk, meta, policy)
    need(offloader.host.num_slots > 0, "kv_offload_memory", f"at least one block ({offloader.block_bytes} bytes)",
         config.kv_offload_memory)
    blocks.offload = offloader
    return offloader
