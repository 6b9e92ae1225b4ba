"""
Tensor parallelism: one model split across ranks (Megatron style) over torch.distributed.

Each rank holds a slice of every layer: qkv_proj and gate_up_proj are column-parallel (a rank
computes its own heads and its own part of the MLP, no communication), o_proj and down_proj are
row-parallel (a rank's partial sums are all-reduced), the embedding is vocabulary-parallel (a rank
looks up the ids it owns, zeros elsewhere, all-reduce) and lm_head gathers each rank's slice of the
vocabulary on rank 0. KV heads are split with the query heads that read them; when ranks outnumber
KV heads each KV head is replicated (vLLM's rule). Attention runs unchanged on each rank's heads.
Rank 0 is the engine: it schedules, owns the block manager, broadcasts each step's inputs and block
copies to the other ranks on a gloo group, and alone samples. The other ranks run worker_loop.
Launch: torch.multiprocessing (from a fork server, never re-running the user's __main__) on one machine, or
torchrun's environment (vLLM's external launcher); one GPU per rank, checked before any rank starts.
gloo on CPUs (device="cpu" runs them there on a GPU machine too), NCCL on GPUs; collectives have a
timeout, and a dead rank ends the engine.
Owns the process groups, the sharded layers and the shard plan; weights.py reads the slices, and
model.py, the scheduler and the kernels do not know about ranks.
"""
import contextlib
import ctypes
import datetime
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from builder import EngineBuilder
from cpu_linear import Linear
from kv_cache import KVCachePool
from model import ModelConfig
from model_runner import ModelRunner, StepInputs
from sequence import EngineError, InvalidRequest, need
from weights import load_model, read_config

# A collective that waits this long has lost a rank that is alive but stuck (a dead one is noticed at
# once: its sockets close). The first step does no lazy work that could take this long: every rank
# builds its kernels (model.prepare) before the first collective.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("NANOSERVE_TP_TIMEOUT_S", 30)))
# The step broadcast waits as long as the server is idle, so its group never times out; rank 0's
# death still ends a waiting worker at once (its socket closes) and PR_SET_PDEATHSIG backs that up.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# Starting ranks import torch and load their shards, slowly where many share few cores (8 ranks on 2
# cores: over 30 s); rank 0 polls its spawned workers meanwhile, so a dead one is still seen at once.
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)
SIZE_ALIGN = 16     # MLP and vocabulary slices in multiples of this: cpu_linear's panels take 16 columns


class WorkerDied(EngineError):
    """A rank failed or a collective broke: the group is out of step for good and the engine must end.
    engine_core.py ends the core on it (fatal) instead of retrying the step."""
    fatal = True

    def __reduce__(self):
        return WorkerDied, (str(self), self.code)


# ---------------------------------------------------------------------------- the shard plan

def sizes_that_work(num_heads: int, num_kv_heads: int) -> list[int]:
    """vLLM's rule: query heads divide evenly; KV heads either divide evenly or each is replicated
    on tp / num_kv_heads ranks. (The MLP and the vocabulary split unevenly where they must.)"""
    return [tp for tp in range(1, num_heads + 1)
            if num_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)]


def check_size(tp: int, cfg: ModelConfig):
    ok = sizes_that_work(cfg.num_attention_heads, cfg.num_key_value_heads)
    if tp not in ok:
        raise InvalidRequest("tensor_parallel_size", f"tensor_parallel_size={tp} does not split this model's "
                             f"{cfg.num_attention_heads} query and {cfg.num_key_value_heads} KV heads; sizes that "
                             f"work: {', '.join(map(str, ok))}")


def split(n: int, parts: int, index: int, align: int = 1) -> tuple[int, int]:
    """[lo, hi) of part `index` when n splits into `parts` nearly equal parts of whole `align` units
    (the last unit may be short): 1536 in 9 parts of 16s -> 176, ..., 176, 160, 160, 160."""
    if -(-n // align) < parts:              # fewer units than parts: split finer rather than leave a rank empty
        align = 1
    units = -(-n // align)
    lo = index * (units // parts) + min(index, units % parts)
    hi = lo + units // parts + (index < units % parts)
    return min(lo * align, n), min(hi * align, n)


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds, in the model's own (unsharded) coordinates."""
    rank: int
    size: int
    q_heads: tuple[int, int]          # [lo, hi) query heads
    kv_heads: tuple[int, int]         # [lo, hi) KV heads (one, replicated, when size > num_kv_heads)
    intermediate: tuple[int, int]     # [lo, hi) MLP columns
    vocab: tuple[int, int]            # [lo, hi) vocabulary rows this rank owns
    vocab_rows: int                   # rows it stores: the largest slice, so every rank's logits gather alike

    @staticmethod
    def of(cfg: ModelConfig, size: int, rank: int) -> "ShardPlan":
        check_size(size, cfg)
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        per_rank = nh // size
        kv = (rank * nkv // size, rank * nkv // size + 1) if size > nkv else split(nkv, size, rank)
        vocab_rows = max(hi - lo for lo, hi in (split(cfg.vocab_size, size, r, SIZE_ALIGN) for r in range(size)))
        return ShardPlan(rank, size, (rank * per_rank, (rank + 1) * per_rank), kv,
                         split(cfg.intermediate_size, size, rank, SIZE_ALIGN),
                         split(cfg.vocab_size, size, rank, SIZE_ALIGN), vocab_rows)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config model.py builds this rank's layers from: its heads, its MLP slice, its vocabulary rows."""
        width = lambda r: r[1] - r[0]
        return replace(cfg, num_attention_heads=width(self.q_heads), num_key_value_heads=width(self.kv_heads),
                       intermediate_size=width(self.intermediate), vocab_size=self.vocab_rows)

    def slice(self, name: str, read, shape: tuple[int, ...], head_dim: int) -> torch.Tensor:
        """This rank's part of the Hugging Face tensor `name` of `shape`; read(rows, cols) reads a
        slice (weights.py passes safetensors' get_slice, so the rest is never read)."""
        all_rows, all_cols = (0, shape[0]), ((0, shape[1]) if len(shape) > 1 else None)
        heads = lambda r: (r[0] * head_dim, r[1] * head_dim)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return read(heads(self.q_heads), all_cols)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return read(heads(self.kv_heads), all_cols)
        if name.endswith("o_proj.weight"):
            return read(all_rows, heads(self.q_heads))
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return read(self.intermediate, all_cols)
        if name.endswith("down_proj.weight"):
            return read(all_rows, self.intermediate)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = read(self.vocab, all_cols)                              # [owned, hidden]
            return F.pad(rows, (0, 0, 0, self.vocab_rows - rows.shape[0]))   # zero rows up to vocab_rows
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            raise ValueError(f"{name}: a bias on a row-parallel layer is not supported under tensor parallelism")
        return read(all_rows, all_cols)                                    # norms: every rank holds them


# ---------------------------------------------------------------------------- the sharded layers

class Comm:
    """The collectives the layers call, on the compute group, timed (bench.py reports the seconds)."""

    def __init__(self, group=None):
        self.group, self.seconds, self.calls = group, 0.0, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's x (same shape on all) in rank order; the others get None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))] \
            if dist.get_rank(self.group) == 0 else None
        t0 = time.perf_counter()
        dist.gather(x, parts, dst=0, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return parts


class ColumnParallelLinear(Linear):
    """qkv_proj, gate_up_proj: this rank's output columns (its heads, its MLP slice). Each rank's
    output is whole for the columns it has, so nothing is communicated."""


class RowParallelLinear(Linear):
    """o_proj, down_proj: this rank's input columns, so its output is a partial sum over them;
    the all-reduce adds the ranks' parts (one per attention block, one per MLP)."""
    comm: Comm

    def forward(self, x, float_out=False):
        return self.comm.all_reduce(super().forward(x, float_out))      # [T, hidden]


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + num_owned) of the embedding (padded to the largest rank's count): ids
    outside them look up zeros, and the all-reduce assembles each token's row from its owner."""

    def __init__(self, weight: torch.Tensor, start: int, num_owned: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)        # [vocab_rows, hidden]
        self.start, self.num_owned, self.comm = start, num_owned, comm

    def forward(self, input_ids):
        local = input_ids - self.start                                  # [T]
        outside = (local < 0) | (local >= self.num_owned)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)    # [T, hidden]
        return self.comm.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0))


class ParallelLMHead(Linear):
    """lm_head over this rank's vocabulary rows; rank 0 gathers the slices and drops the padding."""
    comm: Comm

    vocab_slices: list[tuple[int, int]]      # every rank's [lo, hi), in rank order

    def forward(self, x, float_out=False):
        mine = super().forward(x, float_out)                              # [T, vocab_rows]
        parts = self.comm.gather(mine)
        if parts is None:                                                 # a worker: rank 0 samples
            return mine
        # each rank's slice ends in padding rows: keep the rows it owns
        return torch.cat([p[..., :hi - lo] for p, (lo, hi) in zip(parts, self.vocab_slices)], dim=-1)   # [T, vocab]


def shard_model(net: nn.Module, plan: ShardPlan, cfg: ModelConfig, comm: Comm):
    """Swap the sharded layer classes into a model built (on the meta device) from plan.local_config:
    the shapes are already this rank's; the classes add the collectives. In place, like gpt-fast's tp.py."""
    def swap(parent, name, cls):
        old = getattr(parent, name)
        new = cls(old.in_features, old.out_features, bias=old.bias is not None, device=old.weight.device)
        new.comm = comm
        setattr(parent, name, new)
        return new
    for layer in net.layers:
        swap(layer.self_attn, "qkv_proj", ColumnParallelLinear)
        swap(layer.self_attn, "o_proj", RowParallelLinear)
        swap(layer.mlp, "gate_up_proj", ColumnParallelLinear)
        swap(layer.mlp, "down_proj", RowParallelLinear)
    lo, hi = plan.vocab
    net.embed_tokens = VocabParallelEmbedding(net.embed_tokens.weight, lo, hi - lo, comm)
    head = swap(net, "lm_head", ParallelLMHead)
    head.vocab_slices = [split(cfg.vocab_size, plan.size, r, SIZE_ALIGN) for r in range(plan.size)]
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight


# ---------------------------------------------------------------------------- process groups

@dataclass
class WorkerSetup:
    """Rank 0 -> every worker, once: what to load (the dtype and backend rank 0 resolved)."""
    model_dir: str
    dtype: torch.dtype
    device_type: str
    attention_backend: str
    num_threads: int | None


@dataclass
class PoolSpec:
    """Rank 0 -> every worker, once the weights are in: the KV pool, so block ids mean the same everywhere."""
    num_blocks: int
    block_size: int
    num_host_blocks: int
    kv_dtype: torch.dtype


@dataclass
class Step:
    """Rank 0 -> every worker, each forward: the block copies since the last one, then the inputs."""
    block_ops: list
    inputs: StepInputs


def torchrun_address(rank: int) -> tuple[str, int, bool]:
    """torchrun's store: its agent hosts it (TORCHELASTIC_USE_AGENT_STORE), else rank 0 does."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank == 0 and not agent


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """This process's place in the tensor-parallel group: rank, device, the two groups (compute: the
    layers' collectives, with a timeout; control: rank 0's broadcasts, gloo, no timeout) and, on rank 0
    under torch.multiprocessing, the worker processes. One per process (torch.distributed's world)."""
    broken: str | None = None        # why the group is down, once it is
    closed: bool = False

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int, device_type: str,
                 num_threads: int | None, address: tuple[str, int, bool], procs: list = ()):
        """address: (host, port, whether this process hosts the TCPStore); procs: rank 0's spawned workers."""
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process; shut it down first "
                               "(Engine.shutdown) or use one process per engine")
        self.rank, self.size, self.local_rank, self.local_size = rank, size, local_rank, local_size
        self.procs = list(procs)
        self.device = torch.device(f"cuda:{local_rank}") if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(self.device)
        self.saved_threads = (torch.get_num_threads(), _affinity())
        self.why_threads = set_threads(local_rank, local_size, num_threads)
        host, port, is_master = address
        store = dist.TCPStore(host, port, size, is_master, timeout=STARTUP_TIMEOUT, wait_for_workers=False)
        joined = f"nanoserve_tp_joined_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"   # a torchrun restart counts anew
        store.add(joined, 1)
        while rank == 0 and store.add(joined, 0) < size:
            self.check_workers()                 # a worker that died starting: say so now, not in 10 minutes
            time.sleep(0.05)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=size, timeout=COLLECTIVE_TIMEOUT)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.comm = Comm()

    def plan(self, cfg: ModelConfig) -> ShardPlan:
        return ShardPlan.of(cfg, self.size, self.rank)

    def shard(self, net: nn.Module, plan: ShardPlan, cfg: ModelConfig):
        """weights.load_model calls this on the meta-device model: its layers become this rank's slices."""
        shard_model(net, plan, cfg, self.comm)

    def send(self, message):
        """Rank 0: broadcast one message (a pickled object) to every worker."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def check_workers(self):
        """Rank 0: raise WorkerDied if a worker process has exited (a cheap poll before each step)."""
        if self.broken:
            raise WorkerDied(f"tensor-parallel group is down: {self.broken}")
        dead = [(p.name, p.exitcode) for p in self.procs if p.exitcode is not None]
        if dead:
            self.broken = ", ".join(f"{name} exited with code {code}" for name, code in dead)
            raise WorkerDied(f"tensor-parallel group is down: {self.broken}")

    def watch(self, on_death):
        """Rank 0 under torch.multiprocessing: call on_death(reason) from a thread as soon as a worker
        exits while the group is open, even while the engine is idle (serve.py's core then ends)."""
        def wait():
            multiprocessing.connection.wait([p.sentinel for p in self.procs])
            if not self.closed:
                on_death(", ".join(f"{p.name} exited with code {p.exitcode}" for p in self.procs
                                   if p.exitcode is not None))
        if self.procs:
            threading.Thread(target=wait, name="tp-watch", daemon=True).start()

    def shutdown(self):
        """Rank 0: stop the workers (a None step), reap them, leave the group, give back the threads."""
        if self.closed or not dist.is_initialized():
            return
        self.closed = True
        if not self.broken:
            try:
                self.send(None)
            except Exception:       # a worker already gone: the kill below reaps the rest
                pass
        _reap(self.procs)
        dist.destroy_process_group()
        torch.set_num_threads(self.saved_threads[0])
        if self.saved_threads[1] is not None:
            os.sched_setaffinity(0, self.saved_threads[1])


def _affinity():
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def _reap(procs, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


def set_threads(local_rank: int, local_size: int, num_threads: int | None) -> str:
    """Each rank on a machine gets its share of that machine's cores (num_threads: all ranks' total),
    pinned to its own cores where the OS lets us and there are enough of them. -> a line for the log."""
    cpus = sorted(_affinity() or range(os.cpu_count()))
    per_rank = max(1, (num_threads or len(cpus)) // local_size)
    torch.set_num_threads(per_rank)
    if not hasattr(os, "sched_setaffinity"):
        return f"{per_rank} threads per rank, unpinned (this OS has no sched_setaffinity)"
    if per_rank * local_size > len(cpus):
        return f"{per_rank} threads per rank, unpinned ({local_size} ranks share {len(cpus)} cores)"
    mine = cpus[local_rank * per_rank:(local_rank + 1) * per_rank]
    os.sched_setaffinity(0, mine)
    return f"{per_rank} threads per rank, rank pinned to cores {mine}"


def check_devices(tp: int, local_size: int, device_type: str):
    """Each rank on a machine takes its own GPU (cuda:LOCAL_RANK): refuse, before any rank joins the
    group, ranks per machine that outnumber the GPUs this process sees. Ranks on the CPU (gloo) share it."""
    seen = torch.cuda.device_count() if device_type == "cuda" else 0
    if device_type == "cuda" and local_size > seen:
        raise InvalidRequest("tensor_parallel_size", (
            f"--tensor-parallel-size / tensor_parallel_size={tp} puts {local_size} ranks per node on this machine, "
            f"one GPU each, but {seen} CUDA device{'s' * (seen != 1)} seen (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use at most {seen} ranks per node, or run the "
            f"ranks on the CPU: --device cpu / device=\"cpu\""))


def launch(config, model_dir: str, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
           attention_backend: str) -> TPGroup:
    """Rank 0 (the engine): check the size and the devices, start or join the group, and tell the workers
    what to load. Under torchrun the other ranks are already running (serve.py calls run_worker on them);
    otherwise they are spawned here with torch.multiprocessing."""
    tp = config.tensor_parallel_size
    check_size(tp, model_config)
    if launched_by_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != tp or rank != 0:
            raise InvalidRequest("tensor_parallel_size", f"torchrun started {world} ranks (this is rank {rank}); "
                                 f"tensor_parallel_size={tp} needs {tp}, with the engine on rank 0")
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
        check_devices(tp, local_size, device.type)
        group = TPGroup(0, tp, int(os.environ.get("LOCAL_RANK", 0)), local_size, device.type, config.num_threads,
                        torchrun_address(0))
    else:
        check_devices(tp, tp, device.type)
        address = ("127.0.0.1", free_port())
        procs = spawn_workers(tp, address, device.type, config.num_threads)
        try:
            group = TPGroup(0, tp, 0, tp, device.type, config.num_threads, address + (True,), procs)
        except BaseException:
            _reap(procs, 0)
            raise
    weakref.finalize(group, _reap, group.procs, 0)     # an engine dropped without shutdown leaves no workers
    group.send(WorkerSetup(model_dir, dtype, device.type, attention_backend, config.num_threads))
    return group


def spawn_workers(tp: int, address: tuple[str, int], device_type: str, num_threads: int | None) -> list:
    # Never fork a process that may hold OpenMP threads; a fork server is a clean process that imports
    # torch and this file once, then forks each worker from there: no worker imports torch again (on
    # 2 busy cores 3 spawned workers took 20 s to import it), and later engines start sooner still.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["scaleout.parallel"])
    # serve.py runs the engine in a daemonic process, and multiprocessing refuses a daemon children of
    # its own (lest they be orphaned). Ours cannot be: the fork server exits when we do, PR_SET_PDEATHSIG
    # kills each worker with the fork server, and a closed group ends them. So the flag is lifted to start them.
    me, was_daemon = mp.current_process(), mp.current_process().daemon
    me.daemon = False
    try:
        procs = [context.Process(target=worker_main, args=(rank, tp, address, device_type, num_threads),
                                 name=f"nanoserve-tp-rank-{rank}", daemon=True) for rank in range(1, tp)]
        with main_module_left_out():
            for p in procs:
                p.start()
    finally:
        me.daemon = was_daemon
    return procs


@contextlib.contextmanager
def main_module_left_out():
    """multiprocessing runs the parent's __main__ again in each child it starts (spawn and forkserver alike),
    before the target: a plain script (vLLM's examples, no `if __name__ == "__main__":` guard) would run its
    top-level code, LLM(...) included, in every rank. A worker needs nothing from __main__ (its target is
    worker_main, pickled by this module's name), so while the workers start multiprocessing sees a __main__
    with no file and no module name, and the child runs no part of the user's script."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


# ---------------------------------------------------------------------------- rank 0's side of a step

class TensorParallelBuilder(EngineBuilder):
    """What llm.builder_for gives the engine under tensor parallelism: load_model starts (or joins) the
    group and loads rank 0's shard; the pool and runner are the Driver ones below. shutdown stops the
    workers and leaves the group, also when the engine's start fails after they started."""

    def load_model(self, config, dtype: torch.dtype, device: torch.device, attention_backend: str,
                   loaded_model=None) -> tuple:
        need(loaded_model is None, "loaded_model", "None under tensor parallelism", "a model")
        model_dir, mc = read_config(config.model)
        self.tp = launch(config, model_dir, mc, dtype, device, attention_backend)
        print(f"nanoserve: tensor parallel over {self.tp.size} ranks; {self.tp.why_threads}", file=sys.stderr,
              flush=True)
        return load_model(config.model, dtype, device, self.tp, config.quantization)

    def kv_pool(self, *args) -> "DriverKVPool":
        return DriverKVPool(*args)

    def runner(self, *args, num_speculative_tokens: int = 0) -> "DriverRunner":
        return DriverRunner(*args, self.tp)     # eager: verify steps run ragged, no graph to pad them for

    def shutdown(self):
        if self.tp is not None:
            self.tp.shutdown()


class DriverKVPool(KVCachePool):
    """Rank 0's pool: runs each block copy here and keeps it for the next Step, so every rank's pool
    changes alike before the forward that reads it (a step that only swaps sends its copies later)."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending = []                   # block ops run here since the last Step

    def run(self, ops):
        self.pending += ops
        super().run(ops)


class DriverRunner(ModelRunner):
    """Rank 0's model runner: before its own forward, broadcast the step to the workers; a failure
    anywhere in it ends the group (WorkerDied), since the ranks are then out of step."""

    def __init__(self, model, kv_pool: DriverKVPool, block_size, device, attention_backend, max_num_seqs,
                 max_num_batched_tokens, max_model_len, enforce_eager, group: TPGroup):
        # eager only: a CUDA graph replays rank 0's launches alone, while each rank must run its own
        super().__init__(model, kv_pool, block_size, device, attention_backend, max_num_seqs,
                         max_num_batched_tokens, max_model_len, enforce_eager=True)
        self.group = group
        group.send(PoolSpec(kv_pool.kv_caches[0][0].shape[0], block_size,
                            len(kv_pool.host_caches) and kv_pool.host_caches[0][0].shape[0],
                            kv_pool.kv_caches[0][0].dtype))
        # every rank has loaded and built its pool: from here on a collective that waits means a lost rank
        dist.barrier(group=group.control)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        self.group.check_workers()
        try:
            ops, self.kv_pool.pending = self.kv_pool.pending, []
            self.group.send(Step(ops, to_device(inputs, torch.device("cpu"))))
            return super().forward(inputs)
        except Exception as exc:
            self.group.broken = repr(exc)
            raise WorkerDied(f"tensor-parallel step failed: {exc!r}") from exc


def to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """A step's inputs on `device`: copies, never views of the runner's persistent buffers (which the
    next step overwrites, and which would pickle whole)."""
    m, plan = inputs.meta, inputs.meta.cuda_plan
    meta = replace(m, slot_mapping=m.slot_mapping.to(device, copy=True), block_tables=m.block_tables.to(device, copy=True),
                   context_lens=m.context_lens.to(device, copy=True),
                   query_start_loc=m.query_start_loc.to(device, copy=True),
                   cuda_plan=plan and replace(plan, plan=plan.plan.to(device, copy=True)))
    return StepInputs(inputs.input_ids.to(device, copy=True), inputs.positions.to(device, copy=True), meta,
                      inputs.logits_rows.to(device, copy=True), inputs.num_logits)


# ---------------------------------------------------------------------------- the workers

def _die_with_parent():
    """Linux: the kernel sends us SIGKILL when our parent (the fork server) ends, however it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def worker_main(rank: int, size: int, address: tuple[str, int], device_type: str, num_threads: int | None):
    """A worker's main under torch.multiprocessing: rank `rank` on this machine."""
    _die_with_parent()
    group = TPGroup(rank, size, rank, size, device_type, num_threads, address + (False,))
    worker_loop(group)


def run_worker(device: str = "auto"):
    """A torchrun rank other than 0 (serve.py calls this with its --device, so every rank picks rank 0's:
    auto is CUDA where there is a GPU): join the group from torchrun's environment and serve rank 0's steps
    until it says stop."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_type = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")).type
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_devices(world, local_size, device_type)
    group = TPGroup(rank, world, int(os.environ.get("LOCAL_RANK", 0)), local_size, device_type, None,
                    torchrun_address(rank))
    worker_loop(group)


def worker_loop(group: TPGroup):
    """Load this rank's shard, build its KV pool like rank 0's, then run each Step rank 0 sends:
    its block copies, then the forward (whose collectives meet rank 0's). A None step ends it."""
    try:
        setup: WorkerSetup = group.recv()
        if setup is None:
            return
        if setup.num_threads:            # a torchrun rank learns rank 0's --num-threads only now
            set_threads(group.local_rank, group.local_size, setup.num_threads)
        model, cfg, _ = load_model(setup.model_dir, setup.dtype, group.device, tp=group)
        model.prepare()
        spec: PoolSpec = group.recv()
        if spec is None:
            return
        local = model.config
        pool = KVCachePool(cfg.num_hidden_layers, spec.num_blocks, spec.block_size, local.num_key_value_heads,
                           local.head_dim, spec.kv_dtype, group.device, spec.num_host_blocks)
        runner = ModelRunner(model, pool, spec.block_size, group.device, setup.attention_backend)
        dist.barrier(group=group.control)
        while (step := group.recv()) is not None:
            pool.run(step.block_ops)
            runner.forward(to_device(step.inputs, group.device))
    except Exception as exc:     # rank 0 gone or a collective broken: nothing to serve any more
        print(f"nanoserve tp rank {group.rank}: exiting: {exc!r}", file=sys.stderr, flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
