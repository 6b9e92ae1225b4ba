"""
The paged KV cache: a preallocated pool of fixed-size blocks and the bookkeeping around it.

Owns: the K/V tensors (per layer [num_blocks, block_size, num_kv_heads, head_dim]), the
block allocator (free list + reference counts), each sequence's block table, the prefix
cache (full blocks keyed by a sha256 chained over their tokens and the request's cache_salt,
and verified token for token on a hit, kept evictable in LRU order once nobody holds them),
copy-on-write for blocks shared by forked samples, and the host pool that swap preemption
copies blocks into.
Does not decide *when* to allocate, evict or swap: scheduler.py does, by calling in here.
Methods that move data (copy-on-write, swap) return block operations (CopyBlock, SwapOut,
SwapIn) for the engine to run on the tensors (KVCachePool.run) before the next forward pass;
they copy nothing themselves.
The invariants are written down as code in check_invariants().
"""
import array
import ctypes
import hashlib
import itertools
import math
import os
import re
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch


def parse_memory(value) -> int:
    """'2GiB', '512MiB', '1.5GB', or a plain number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory/swap_space: cannot parse {value!r}; use bytes or e.g. '512MiB', '2GiB'")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))


def block_hash(parent_hash: bytes | None, token_ids, cache_salt: str | None) -> bytes:
    """A full block's lookup key: sha256 of its tokens and everything before them (through the
    parent's hash; the first block starts from the request's cache_salt, so tenants with different
    salts never share a chain). Python's hash() would let a crafted prompt collide with another
    user's block (vLLM's advisory GHSA-rm76-4mrf-v9r8); a hit is still verified token for token."""
    h = hashlib.sha256(parent_hash or repr(cache_salt).encode())
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def cache_salt_of(seq) -> str | None:
    # getattr: sequences built outside the engine (simulate.py, tests) carry requests without a salt
    return getattr(seq.request, "cache_salt", None)


@dataclass(frozen=True)
class CopyBlock:
    """Copy-on-write: device block src's contents into device block dst."""
    src: int
    dst: int


@dataclass(frozen=True)
class SwapOut:
    """Swap preemption: device block src into host block dst."""
    src: int
    dst: int


@dataclass(frozen=True)
class SwapIn:
    """Back from the host: host block src into device block dst."""
    src: int
    dst: int


BlockOp = CopyBlock | SwapOut | SwapIn


HUGE_PAGE = 2 << 20          # x86-64's transparent huge page
MADV_HUGEPAGE = 14


def transparent_huge_pages() -> str:
    """Linux's transparent-huge-page mode for anonymous memory: 'always', 'madvise' or 'never'
    ('unavailable' off Linux)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return "unavailable"


def zeros_on_huge_pages(shape, dtype) -> tuple[torch.Tensor, str]:
    """A zeroed CPU tensor whose memory starts on a 2 MiB boundary, with Linux asked (madvise) to
    back it with huge pages, and a note of what it got. Decode attention hops from block to
    scattered block; on 4 KiB pages most hops miss the TLB, on 2 MiB pages a 16-token block's
    neighbours share its page. Where Linux offers none, plain pages, and the note says why."""
    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        return torch.zeros(shape, dtype=dtype), f"4 KiB pages (transparent huge pages: {mode})"
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)    # a fresh mapping: no page touched yet
    start = -raw.data_ptr() % HUGE_PAGE
    region = raw[start:start + nbytes]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(region.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) != 0:
        return torch.zeros(shape, dtype=dtype), f"4 KiB pages (madvise failed, errno {ctypes.get_errno()})"
    # the first touch (zero_) is what maps the pages, now 2 MiB at a time
    return region.view(dtype).view(shape).zero_(), f"2 MiB pages asked for (transparent huge pages: {mode})"


class KVCachePool:
    """The tensors: one K and one V per layer on the device, and an optional host copy for swapping.
    On a CPU all of them are views of one buffer on huge pages (zeros_on_huge_pages); `pages` says
    what the pool got (the engine logs it)."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                 num_host_blocks=0):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            pool, self.pages = zeros_on_huge_pages((num_layers, 2) + shape, dtype)
        else:
            pool, self.pages = torch.zeros((num_layers, 2) + shape, dtype=dtype, device=device), "device memory"
        self.pool = pool                                 # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        # per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = [(pool[layer, 0], pool[layer, 1]) for layer in range(num_layers)]
        host_shape = (num_host_blocks,) + shape[1:]
        # pinned memory would make GPU<->host copies asynchronous; on CPU it is just a second tensor
        self.host_caches = [(torch.zeros(host_shape, dtype=dtype), torch.zeros(host_shape, dtype=dtype))
                            for _ in range(num_layers)] if num_host_blocks else []

    def run(self, ops: list[BlockOp]):
        """Execute block operations in the order the block manager issued them, a run of the same
        kind at a time. Order matters: a block freed by one op may be the destination of a later one."""
        device, host = self.kv_caches, self.host_caches or self.kv_caches
        for kind, group in itertools.groupby(ops, key=type):
            group = list(group)
            if hasattr(kind, "run_all"):             # a wing's op (kv_offload.Restore) brings its own copy
                kind.run_all(self, group)
                continue
            src = torch.tensor([op.src for op in group])
            dst = torch.tensor([op.dst for op in group])
            for (dk, dv), (hk, hv) in zip(device, host):
                src_kv = (hk, hv) if kind is SwapIn else (dk, dv)
                dst_kv = (hk, hv) if kind is SwapOut else (dk, dv)
                for a, b in zip(src_kv, dst_kv):
                    b[dst.to(b.device)] = a[src.to(a.device)].to(b.device)


    def read_block(self, block: int) -> torch.Tensor:
        """A copy of one block's K and V in every layer, [num_layers, 2, block_size, num_kv_heads, head_dim]:
        what kv_transfer.py sends (bytes_per_block bytes)."""
        return torch.stack([torch.stack((k[block], v[block])) for k, v in self.kv_caches])

    def empty_block(self) -> torch.Tensor:
        k = self.kv_caches[0][0]
        return torch.empty((len(self.kv_caches), 2) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)

    def write_block(self, block: int, data: torch.Tensor):
        """data: [num_layers, 2, block_size, num_kv_heads, head_dim], as read_block gives it."""
        for layer, (k, v) in enumerate(self.kv_caches):
            k[block].copy_(data[layer, 0])
            v[block].copy_(data[layer, 1])


def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def rollback_num_blocks(num_computed_tokens: int, num_accepted: int, block_size: int, num_blocks: int) -> int:
    """Tail blocks to release after verification. num_computed_tokens counts the row's computed
    tokens without its drafts (finish_step adds only the non-draft tokens); the accepted drafts'
    K/V are now valid too. The table was grown for every draft; blocks that only rejected drafts
    reached go back (when the rollback crosses a block boundary)."""
    keep = -(-(num_computed_tokens + num_accepted) // block_size)
    assert num_blocks >= keep, "the block table does not cover the accepted tokens"
    return num_blocks - keep


class BlockManager:
    """Block allocator with reference counts, per-sequence block tables and the prefix cache.

    A sequence (scheduler.Sequence) carries its own `block_table` (list of block ids),
    `num_computed_tokens`, `token_ids` and `block_hashes`; this class edits those fields.
    """

    def __init__(self, num_blocks, block_size, enable_prefix_caching=True, num_host_blocks=0):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.cached_hash = [None] * num_blocks        # hash of a full, registered block
        # What a registered block holds, checked on every hit so that a hash collision can never hand
        # out another request's KV: (parent's registration id, its tokens, cache_salt). A registration id
        # names one content for ever, so a child whose parent block was evicted and refilled no longer
        # matches. Ids start at a random 64-bit offset, so engines sharing an offload directory never
        # reuse one another's (a block restored from a tier takes back the id it left with).
        self.cached_content = [None] * num_blocks
        self.registration_id = [None] * num_blocks
        self.registrations = itertools.count(int.from_bytes(os.urandom(8), "little") << 64)
        # kv_offload.Offloader, when the prefix cache has tiers below the device: evicted blocks go
        # there, prefix lookups continue there, and restores come back as block ops (pending_ops)
        self.offload = None
        self.pending_ops: list = []
        self.hash_to_block = {}                       # prefix cache: hash -> block id
        self.evictable = OrderedDict()                # refcount-0 cached blocks, least recently used first
        self.num_host_blocks = num_host_blocks
        self.num_swapped_out = 0                      # sequences moved to the host pool, ever
        self.free_host_blocks = deque(range(num_host_blocks))
        self.prefix_queries = self.prefix_hits = 0    # tokens asked for / served from the cache
        self.num_evictions = 0                        # cached blocks reclaimed for new data
        # hashes of the cached blocks reclaimed since take_evicted() last ran: an engine core reports them
        # so a data-parallel router forgets them (router.py); bounded, since nothing may ever read them
        self.evicted_hashes = deque(maxlen=num_blocks)

    # ------------------------------------------------------------------ allocation
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:                                         # reclaim the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            self.num_evictions += 1
            self.evicted_hashes.append(self.cached_hash[block])
            if self.offload is not None:
                parent, tokens, salt = self.cached_content[block]
                self.offload.evicted(block, self.cached_hash[block], self.registration_id[block], parent, tokens, salt)
            del self.hash_to_block[self.cached_hash[block]]
            self.cached_hash[block] = self.cached_content[block] = self.registration_id[block] = None
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int):
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.cached_hash[block] is not None:
                self.evictable[block] = None          # keep its contents for a later prefix hit
            else:
                self.free_blocks.append(block)

    def new_blocks_for(self, seq, num_new_tokens: int) -> int:
        """Blocks to add (plus one copy-on-write) so seq can write num_new_tokens more tokens."""
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table)) + (1 if self._needs_copy(seq) else 0)

    def _needs_copy(self, seq) -> bool:
        """Writing into a block that another fork also holds must copy it first: a partly filled one
        (forks share the prompt's last block), or one reserved ahead (static batching's forks)."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1

    def can_allocate(self, seq, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.new_blocks_for(seq, num_new_tokens) + reserve <= self.num_free_blocks()

    def allocate_slots(self, seq, num_new_tokens: int) -> list[BlockOp]:
        """Grow seq's block table (one block at a time, as tokens arrive) to hold num_new_tokens more.
        Returns the copy-on-write op, if the block written next was shared, after any restore from a
        tier that take_cached_prefix left pending."""
        ops, self.pending_ops = self.pending_ops, []
        if self._needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            old = seq.block_table[i]
            seq.block_table[i] = self._take_block()
            ops.append(CopyBlock(old, seq.block_table[i]))
            self._release(old)
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_block())
        return ops

    def free(self, seq):
        """Return a sequence's blocks in the step it ends or is preempted. Blocks are released
        tail first so that, once evictable, a prefix's leaves are reclaimed before its root."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def free_tail(self, seq, num_blocks: int):
        """Speculative decoding's rollback: release seq's last num_blocks blocks (reached only by
        rejected drafts: allocated this step, never registered in the prefix cache)."""
        for _ in range(num_blocks):
            self._release(seq.block_table.pop())

    def fork(self, parent, child):
        """Child shares all of parent's blocks (n > 1 sampling); copy-on-write splits them later."""
        child.block_table = self._share(parent.block_table)

    def _share(self, blocks: list[int]) -> list[int]:
        for block in blocks:
            self.ref_counts[block] += 1
        return list(blocks)

    # ------------------------------------------------------------------ a request moving between cores
    def hold_for_export(self, seq, holder, num_tokens: int):
        """Disaggregation's export: holder takes a share of the blocks of seq's first num_tokens tokens,
        so they outlive seq (which leaves this core) until they are sent and holder is freed."""
        holder.block_table = self._share(seq.block_table[:self.blocks_needed(num_tokens)])

    def allocate_for_import(self, seq) -> int | None:
        """Disaggregation's import: blocks for all of seq's tokens, whose KV another core computed: the
        cached prefix first, fresh blocks for the rest. -> the number of leading blocks the cache already
        holds (the others are to be received), or None, holding nothing, when the pool cannot take them."""
        if self.admission_cost(seq, len(seq.token_ids) - self.num_cached_tokens(seq)) > self.num_free_blocks():
            return None
        hits = self.take_cached_prefix(seq) // self.block_size
        # a prefix restored from an offload tier comes as a block op: the importer runs take_pending_ops()
        self.pending_ops = self.allocate_slots(seq, len(seq.token_ids) - seq.num_computed_tokens)
        return hits

    def take_pending_ops(self) -> list[BlockOp]:
        """Block ops issued outside a step (allocate_for_import's restores), to run now."""
        ops, self.pending_ops = self.pending_ops, []
        return ops

    def finish_import(self, seq):
        """The imported KV arrived: all of seq's tokens are computed, and its full blocks join the cache."""
        seq.num_computed_tokens = len(seq.token_ids)
        self.cache_full_blocks(seq)

    # ------------------------------------------------------------------ prefix cache
    def update_hashes(self, seq):
        """Extend seq.block_hashes over every full block of its tokens (computed or not)."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= len(seq.token_ids):
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], cache_salt_of(seq)))

    def num_cached_tokens(self, seq) -> int:
        """How much of seq's prefix the cache holds; at least one token is always left to compute,
        because the last one's logits are needed to sample."""
        hits = self._cached_prefix_blocks(seq)
        return (len(hits) + len(self._tier_hits(seq, hits))) * self.block_size

    def _cached_prefix_blocks(self, seq) -> list[int]:
        """The cached blocks that hold seq's prefix: found by hash, accepted only if their tokens, salt
        and parent are seq's own (a colliding hash ends the match, it never returns foreign KV)."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(seq)
        bs, salt = self.block_size, cache_salt_of(seq)
        max_blocks = (len(seq.token_ids) - 1) // bs
        blocks, parent = [], None
        while len(blocks) < max_blocks:
            i = len(blocks)
            block = self.hash_to_block.get(seq.block_hashes[i])
            if block is None or self.cached_content[block] != (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), salt):
                break
            blocks.append(block)
            parent = self.registration_id[block]
        return blocks

    def _tier_hits(self, seq, hits: list[int]) -> list:
        """The offload tiers' entries that continue the device hits along seq's prefix."""
        if self.offload is None:
            return []
        parent = self.registration_id[hits[-1]] if hits else None
        return self.offload.lookup(seq.block_hashes, len(hits), parent, seq.token_ids, cache_salt_of(seq),
                                   self.block_size, (len(seq.token_ids) - 1) // self.block_size)

    def admission_cost(self, seq, num_new_tokens: int) -> int:
        """Free blocks consumed to admit seq and compute num_new_tokens after its cached prefix.
        Reviving an evictable cached block takes it off the free count too; a block restored from a
        tier takes a fresh one."""
        hits = self._cached_prefix_blocks(seq)
        restored = len(self._tier_hits(seq, hits))
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        return self.blocks_needed((len(hits) + restored) * self.block_size + num_new_tokens) - len(hits) + revived

    def take_cached_prefix(self, seq) -> int:
        """On admission: take every cached block that matches seq's prefix and skip its prefill."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits = self._cached_prefix_blocks(seq)
        entries = self._tier_hits(seq, hits)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        if entries:
            self._restore(seq, entries)
        num_tokens = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = num_tokens
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += num_tokens
        return num_tokens

    def _restore(self, seq, entries):
        """Fresh device blocks for the tier entries that continue seq's prefix, registered under the
        ids they left with; their KV arrives by a Restore op that the next allocate_slots returns.
        An entry whose KV cannot be read (a bad file) ends the restore there: the rest is computed."""
        data = self.offload.fetch(entries)               # [k, L, 2, block_size, kv_heads, head_dim], k <= len
        bs, salt, register, restored = self.block_size, cache_salt_of(seq), True, []
        parent = self.registration_id[seq.block_table[-1]] if seq.block_table else None
        for entry in entries[:len(data)]:
            block = self._take_block()
            i = len(seq.block_table)
            register = register and seq.block_hashes[i] not in self.hash_to_block
            if register:                                 # as cache_full_blocks would, under the entry's id
                self.cached_hash[block], self.hash_to_block[seq.block_hashes[i]] = seq.block_hashes[i], block
                self.cached_content[block] = (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), salt)
                self.registration_id[block] = entry.uid
            parent = entry.uid
            seq.block_table.append(block)
            restored.append(block)
        if restored:
            self.pending_ops.append(self.offload.restore_op(data, restored))

    def cache_full_blocks(self, seq):
        """After a step: register seq's newly computed full blocks so later requests can share them.
        A block whose hash is taken (the same prefix computed twice at once, or a collision) is not
        registered, and neither is anything after it: a child is only ever registered under its parent."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        bs, salt, parent = self.block_size, cache_salt_of(seq), None
        for i in range(seq.num_computed_tokens // bs):
            block, h = seq.block_table[i], seq.block_hashes[i]
            if self.cached_hash[block] is None:
                if h in self.hash_to_block:
                    return
                self.cached_hash[block], self.hash_to_block[h] = h, block
                self.cached_content[block] = (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), salt)
                self.registration_id[block] = next(self.registrations)
            parent = self.registration_id[block]

    def take_evicted(self) -> list[bytes]:
        """The hashes of the cached blocks evicted since the last call (oldest first), and forget them."""
        hashes = list(self.evicted_hashes)
        self.evicted_hashes.clear()
        return hashes

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq) -> bool:
        return len(seq.block_table) <= len(self.free_host_blocks)

    def swap_out(self, seq) -> list[BlockOp]:
        """Move seq's blocks to host blocks; returns the copies to run."""
        seq.host_block_table = [self.free_host_blocks.popleft() for _ in seq.block_table]
        self.num_swapped_out += 1
        ops = [SwapOut(d, h) for d, h in zip(seq.block_table, seq.host_block_table)]
        self.free(seq)
        return ops

    def can_swap_in(self, seq, reserve: int = 0) -> bool:
        return len(seq.host_block_table) + reserve <= self.num_free_blocks()

    def swap_in(self, seq) -> list[BlockOp]:
        """Bring seq back into fresh device blocks (no token is recomputed); returns the copies to run."""
        seq.block_table = [self._take_block() for _ in seq.host_block_table]
        ops = [SwapIn(h, d) for h, d in zip(seq.host_block_table, seq.block_table)]
        self.free_host(seq)
        return ops

    def free_host(self, seq):
        """Return the host blocks of a swapped-out sequence (swapped back in, finished or aborted)."""
        self.free_host_blocks.extend(seq.host_block_table)
        seq.host_block_table = []

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, seqs):
        """free + evictable + used == total; every refcount equals the number of tables holding
        the block; an evictable block is cached and in no table; the hash index is consistent."""
        holders = [0] * self.num_blocks
        for seq in seqs:
            for block in seq.block_table:
                holders[block] += 1
        assert holders == self.ref_counts, "a block's refcount differs from the tables holding it"
        used = sum(1 for r in self.ref_counts if r > 0)
        free, evictable = set(self.free_blocks), set(self.evictable)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        assert len(free) + len(evictable) + used == self.num_blocks, "blocks leaked or double counted"
        for block in evictable:
            assert self.ref_counts[block] == 0 and self.cached_hash[block] is not None
        for block in free:
            assert self.ref_counts[block] == 0 and self.cached_hash[block] is None
        for h, block in self.hash_to_block.items():
            assert self.cached_hash[block] == h, "prefix-cache index out of sync"
        for block in range(self.num_blocks):
            registered = self.cached_hash[block] is not None
            assert registered == (self.cached_content[block] is not None) == (self.registration_id[block] is not None)
        host_used = sum(len(s.host_block_table) for s in seqs)
        assert host_used + len(self.free_host_blocks) == self.num_host_blocks, "host blocks leaked"
        assert len(set(self.free_host_blocks)) == len(self.free_host_blocks)
        assert not self.pending_ops, "a restore was never handed to the engine"
        if self.offload is not None:
            self.offload.check_invariants()
