"""
router.py: which engine replica serves a request, when several serve one model (data parallel).

Policies (the names vLLM and SGLang use): round_robin | least_loaded | cache_aware.
cache_aware keeps one approximate radix tree per worker of the token ids it sent there (what that
worker's prefix cache probably holds). A request goes to the worker with the longest match when the
match is long enough, else to the least loaded one; a balance guard overrides the match when loads
drift too far apart. A tree forgets what its worker reports evicted, and keeps at most
max_tree_tokens (least recently routed leaves go first), so it never outgrows the cache it mirrors.
A worker reports an evicted block by the KV cache's own key (kv_cache.block_hash: a sha256 chain over
full blocks, salted); a BlockIndex, filled from the prompts routed, maps that key back to the prefix
the tree holds.

Load contract: load[w] = requests routed to w and not yet finished. route() adds one, finish() takes
one away; update_load(w, n) replaces it with what the worker itself reports (its running + waiting).
Owns the workers' loads, their trees and the decision counts. Does not talk to workers, start them or
retry requests: the caller does (the server's engine client, simulate_cluster.py). Thread-safe: every
public method holds one lock.
"""
import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

from kv_cache import block_hash
from sequence import need

POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass
class RouterConfig:
    policy: str = "cache_aware"
    min_match_fraction: float = 0.5     # cache_aware routes by prefix when matched / prompt tokens >= this
    min_match_tokens: int = 1           # ... and at least this many tokens matched
    balance_rel: float = 2.0            # loads are imbalanced when max > balance_rel * min + balance_abs;
    balance_abs: int = 16               # then the least loaded worker wins whatever the match
    max_tree_tokens: int = 1 << 20      # per worker; about its KV pool's tokens
    block_size: int = 0                 # the workers' KV block size: > 0 lets evicted_blocks() map reports

    def validate(self):
        for name, ok, allowed in [
                ("policy", self.policy in POLICIES, " | ".join(POLICIES)),
                ("min_match_fraction", 0 <= self.min_match_fraction <= 1, "in [0, 1]"),
                ("min_match_tokens", self.min_match_tokens >= 1, ">= 1"),
                ("balance_rel", self.balance_rel >= 1, ">= 1"),
                ("balance_abs", self.balance_abs >= 0, ">= 0"),
                ("max_tree_tokens", self.max_tree_tokens >= 1, ">= 1"),
                ("block_size", self.block_size >= 0, ">= 0")]:
            need(ok, name, allowed, getattr(self, name))


# ------------------------------------------------------------------ one worker's prefix tree
class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: tuple, parent, last_used: int):
        self.edge = edge                  # the token ids on the edge from parent to this node
        self.children = {}                # first token of the child's edge -> child
        self.parent = parent
        self.last_used = last_used        # logical time of the last insert through this node


def _common(edge: tuple, tokens, start: int, end: int) -> int:
    """How many of edge's tokens equal tokens[start:end], from the front."""
    n = 0
    while n < len(edge) and start + n < end and edge[n] == tokens[start + n]:
        n += 1
    return n


def _size(node: _Node) -> int:
    return len(node.edge) + sum(_size(c) for c in node.children.values())


class PrefixTree:
    """A radix tree of token ids: edges hold runs of tokens, so a 500-token system prompt is one edge."""

    def __init__(self):
        self.root = _Node((), None, 0)
        self.num_tokens = 0               # tokens on all edges
        self.clock = itertools.count(1)

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of tokens the tree holds. Reads only: LRU order is not touched."""
        node, i = self.root, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            n = _common(child.edge, tokens, i, len(tokens))
            i += n
            if n < len(child.edge):
                break
            node = child
        return i

    def insert(self, tokens: Sequence[int]):
        """Add tokens' path; every node on it becomes the most recently used."""
        depth = self.match(tokens)
        node = self._descend(tokens, depth)
        if depth < len(tokens):
            leaf = _Node(tuple(tokens[depth:]), node, 0)
            node.children[tokens[depth]] = leaf
            self.num_tokens += len(leaf.edge)
            node = leaf
        now = next(self.clock)
        while node is not None:
            node.last_used, node = now, node.parent

    def forget(self, tokens: Sequence[int]):
        """The worker evicted tokens' cached KV (at least its last block): drop tokens' last token and
        everything under it, so no match runs through it."""
        if not tokens:
            return
        node = self._descend(tokens, len(tokens) - 1)
        child = node.children.pop(tokens[-1], None) if node is not None else None
        if child is not None:
            self.num_tokens -= _size(child)

    def shrink(self, max_tokens: int, low_water: float = 0.9):
        """Past max_tokens, drop least recently used leaves down to low_water * max_tokens (so the sort
        of all leaves runs once per many inserts, not on every one)."""
        if self.num_tokens <= max_tokens:
            return
        target = int(low_water * max_tokens)
        while self.num_tokens > target:
            leaves = sorted(self._leaves(), key=lambda n: n.last_used)
            for leaf in leaves:           # parents that become leaves wait for the next round
                if self.num_tokens <= target:
                    break
                del leaf.parent.children[leaf.edge[0]]
                self.num_tokens -= len(leaf.edge)

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    def _descend(self, tokens, depth: int):
        """The node exactly `depth` tokens down tokens' path, splitting an edge to make one; None when
        the tree holds a shorter prefix."""
        node, i = self.root, 0
        while i < depth:
            child = node.children.get(tokens[i])
            if child is None:
                return None
            n = _common(child.edge, tokens, i, depth)
            if n < len(child.edge):
                if i + n < depth:
                    return None                            # the path leaves this edge before depth
                child = self._split(child, n)
            node, i = child, i + n
        return node

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n tokens; returns the new middle node."""
        middle = _Node(child.edge[:n], child.parent, child.last_used)
        child.parent.children[middle.edge[0]] = middle
        child.edge, child.parent = child.edge[n:], middle
        middle.children[child.edge[0]] = child
        return middle


# ------------------------------------------------------------------ evicted block -> tree entry
class BlockIndex:
    """Block hash -> the routed prompt and the block's number in it: how a block a worker evicted (named
    by the KV cache's hash chain) finds its path in the trees. The same hash means the same prefix on
    every worker, so one index serves them all. Least recently routed entries go first past capacity."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.where: OrderedDict[bytes, tuple[tuple, int]] = OrderedDict()

    def add(self, token_ids: Sequence[int], cache_salt: str | None, capacity: int):
        tokens, parent, bs = tuple(token_ids), None, self.block_size
        for k in range(len(tokens) // bs):                # full blocks only: the cache keys no other
            parent = block_hash(parent, tokens[k * bs:(k + 1) * bs], cache_salt)
            self.where[parent] = (tokens, k)
            self.where.move_to_end(parent)
        while len(self.where) > capacity:
            self.where.popitem(last=False)

    def first_lost(self, h: bytes) -> tuple | None:
        """The prefix that ends at the evicted block's first token (what the tree must forget from);
        None for a block no routed prompt holds (generated tokens', or one the index dropped)."""
        if (entry := self.where.get(h)) is None:
            return None
        tokens, k = entry
        return tokens[:k * self.block_size + 1]


# ------------------------------------------------------------------ the router
class Router:
    def __init__(self, config: RouterConfig | None = None, workers: Sequence[Hashable] = ()):
        self.config = config or RouterConfig()
        self.config.validate()
        self.lock = threading.Lock()
        self.workers: list[Hashable] = []         # join order: round_robin's cycle and the tie-break
        self.load: dict[Hashable, int] = {}
        self.trees: dict[Hashable, PrefixTree] = {}
        self.next_rr = 0
        self.left: set = set()                    # workers that left: their late reports are ignored
        self.decisions = Counter()                # (policy, reason, worker) -> requests
        self.routed_tokens = self.matched_tokens = 0
        self.index = BlockIndex(self.config.block_size) if self.config.block_size else None
        self.forgotten_blocks = 0                 # evicted blocks that cut a tree
        for w in workers:
            self.add_worker(w)

    # ---------------------------------------------------------------- membership and reports
    def add_worker(self, worker: Hashable):
        with self.lock:
            need(worker not in self.load, "worker", "not already routed to", worker)
            self.workers.append(worker)
            self.left.discard(worker)
            self.load[worker] = 0
            self.trees[worker] = PrefixTree()

    def remove_worker(self, worker: Hashable):
        """The worker left (or died): its tree and load go and later requests route among the rest;
        its late finish/update_load/evicted reports are ignored. It may join again (add_worker)."""
        with self.lock:
            if not self._known(worker):
                return
            i = self.workers.index(worker)
            self.workers.remove(worker)
            if i < self.next_rr:
                self.next_rr -= 1                 # the cycle goes on from the same next worker
            del self.load[worker], self.trees[worker]
            self.left.add(worker)

    def finish(self, worker: Hashable):
        """A request routed to worker finished (or failed)."""
        with self.lock:
            if self._known(worker):
                self.load[worker] = max(0, self.load[worker] - 1)

    def update_load(self, worker: Hashable, n: int):
        """The worker reports its own load (running + waiting sequences); it replaces the count."""
        need(n >= 0, "load", ">= 0", n)
        with self.lock:
            if self._known(worker):
                self.load[worker] = n

    def evicted(self, worker: Hashable, token_ids: Sequence[int]):
        """The worker's prefix cache dropped token_ids' last block: its tree forgets that path's tail."""
        with self.lock:
            if self._known(worker):
                self.trees[worker].forget(token_ids)

    def evicted_blocks(self, worker: Hashable, hashes: Sequence[bytes]):
        """The worker's prefix cache evicted these blocks (kv_cache.block_hash keys): its tree forgets
        each one's tokens and all after them. Needs config.block_size; unknown hashes are ignored."""
        with self.lock:
            if self.index is None or not self._known(worker):
                return
            tree = self.trees[worker]
            for h in hashes:
                lost = self.index.first_lost(h)
                if lost is not None and tree.match(lost) == len(lost):
                    tree.forget(lost)
                    self.forgotten_blocks += 1

    # ---------------------------------------------------------------- the decision
    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> Hashable:
        """The worker for a request with this prompt. Counts it in the worker's load (see finish).
        cache_salt: the request's, so the index computes the same block hashes as the worker's cache."""
        with self.lock:
            need(bool(self.workers), "workers", "at least one", 0)
            policy = self.config.policy
            if policy == "round_robin":
                self.next_rr %= len(self.workers)
                worker, reason = self.workers[self.next_rr], "round_robin"
                self.next_rr += 1
            elif policy == "least_loaded":
                worker, reason = self._least_loaded(), "least_loaded"
            else:
                worker, reason = self._cache_aware(token_ids, cache_salt)
            self.load[worker] += 1
            self.decisions[(policy, reason, worker)] += 1
            return worker

    def _least_loaded(self, among=None) -> Hashable:
        return min(among or self.workers, key=self.load.__getitem__)   # ties: the earliest to join

    def _cache_aware(self, token_ids, cache_salt) -> tuple[Hashable, str]:
        cfg = self.config
        matched = {w: self.trees[w].match(token_ids) for w in self.workers}
        best = max(matched.values())
        loads = self.load.values()
        if max(loads) > cfg.balance_rel * min(loads) + cfg.balance_abs:
            worker, reason = self._least_loaded(), "balance_guard"
        elif best >= cfg.min_match_tokens and best >= cfg.min_match_fraction * len(token_ids):
            worker, reason = self._least_loaded([w for w in self.workers if matched[w] == best]), "prefix_match"
        elif max(loads) == 0:   # idle (requests one at a time): load says nothing; the smaller tree takes
            worker = min(self.workers, key=lambda w: self.trees[w].num_tokens)   # the new prefix, as SGLang's
            reason = "least_loaded"
        else:
            worker, reason = self._least_loaded(), "least_loaded"
        tree = self.trees[worker]
        tree.insert(token_ids)
        tree.shrink(cfg.max_tree_tokens)
        if self.index is not None:
            self.index.add(token_ids, cache_salt, len(self.workers) * cfg.max_tree_tokens // cfg.block_size)
        self.routed_tokens += len(token_ids)
        self.matched_tokens += matched[worker]
        return worker, reason

    # ---------------------------------------------------------------- what /metrics shows
    def decision_counts(self) -> dict:
        """{(policy, reason, worker): requests}; reason is the branch taken: round_robin, least_loaded,
        prefix_match or balance_guard."""
        with self.lock:
            return dict(self.decisions)

    def loads(self) -> dict:
        with self.lock:
            return dict(self.load)

    def tree_tokens(self) -> dict:
        with self.lock:
            return {w: t.num_tokens for w, t in self.trees.items()}

    def expected_hit_rate(self) -> float:
        """cache_aware: prompt tokens its trees matched on the chosen worker / prompt tokens routed."""
        with self.lock:
            return self.matched_tokens / self.routed_tokens if self.routed_tokens else 0.0

    def _known(self, worker) -> bool:
        """True for a current worker, False for one that left (a late report); anything else is an error."""
        need(worker in self.load or worker in self.left, "worker", f"one of {self.workers}", worker)
        return worker in self.load
