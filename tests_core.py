import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch: 2 shared cores, no spinning

import json

import pytest
import torch

import model as M
from engine import LLM, Engine, SamplingParams
from scheduler import Status

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


def assert_all_blocks_free(engine: Engine):
    """The invariant every engine test ends with: nothing held, everything accounted for."""
    engine.check_invariants()
    b = engine.blocks
    assert not engine.has_unfinished_requests()
    assert all(r == 0 for r in b.ref_counts), "a block is still referenced after all requests finished"
    assert b.num_free_blocks() == b.num_blocks
    assert len(b.free_host_blocks) == b.num_host_blocks


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=SMALL_KV)


@pytest.fixture(scope="module")
def hf_smollm():
    """The oracle: transformers reads the GGUF itself (its own dequantization and RoPE un-permute)."""
    transformers = pytest.importorskip("transformers", reason="transformers is the logit oracle")
    path = M.embedded_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def ragged_forward(net, seqs, block_size=16):
    """Run several sequences as one packed batch through our model; logits of every position."""
    cfg = net.config
    total = sum(len(s) for s in seqs)
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 1
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    # blocks handed out in reverse so tables are not contiguous
    free = list(range(num_blocks - 1, -1, -1))
    tables, slots, positions = [], [], []
    for s in seqs:
        table = [free.pop() for _ in range(-(-len(s) // block_size))][::-1]
        tables.append(table + [0] * (num_blocks - len(table)))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(len(s))]
        positions += range(len(s))
    qsl = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).int()
    meta = M.AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                               torch.tensor([len(s) for s in seqs], dtype=torch.int32), qsl)
    ids = torch.tensor([t for s in seqs for t in s])
    return net(ids, torch.tensor(positions), kv, meta, torch.arange(total))


# ============================================================================ model.py

def test_logits_match_transformers_on_embedded_smollm2(hf_smollm):
    net, cfg, _ = M.load_model(None)
    seqs = [[1, 504, 3458, 282, 4649, 314], [28, 9, 4433, 18, 19, 20, 21, 22, 23, 24, 25, 1001, 3],
            [7], list(range(100, 140))]
    ours = ragged_forward(net, seqs)
    start = 0
    for s in seqs:
        with torch.no_grad():
            ref = hf_smollm(torch.tensor([s])).logits[0]
        diff = (ours[start:start + len(s)] - ref).abs().max().item()
        assert diff <= 1e-3, f"max abs logit diff {diff} for a sequence of {len(s)} tokens"
        start += len(s)


@pytest.mark.parametrize("arch", ["llama3_gqa", "qwen2_bias"])
def test_logits_match_transformers_on_tiny_random_configs(tmp_path, arch):
    transformers = pytest.importorskip("transformers", reason="transformers is the logit oracle")
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama3_gqa":
        cfg = transformers.LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        ref_model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        ref_model = transformers.Qwen2ForCausalLM(cfg)
    ref_model.eval().save_pretrained(tmp_path, safe_serialization=True)
    net, _, _ = M.load_model(str(tmp_path))
    seqs = [list(range(3, 40)), [5, 6, 7], list(range(200, 290))]   # positions past original_max (32)
    ours = ragged_forward(net, seqs, block_size=8)
    start = 0
    for s in seqs:
        with torch.no_grad():
            ref = ref_model(torch.tensor([s])).logits[0]
        assert (ours[start:start + len(s)] - ref).abs().max().item() <= 1e-3
        start += len(s)


# ============================================================================ engine.py / scheduler.py

def test_continuous_batch_greedy_matches_alone_and_transformers(llm, hf_smollm):
    together = token_ids(llm.generate(PROMPTS, greedy(24)))
    alone = [token_ids(llm.generate([p], greedy(24)))[0] for p in PROMPTS]
    assert together == alone
    for prompt, ours in zip(PROMPTS, together):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        ref = hf_smollm.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)
        assert ours == ref[0, ids.shape[1]:].tolist(), f"differs from transformers for {prompt!r}"
    assert_all_blocks_free(llm.engine)


@pytest.fixture(scope="module")
def expected_32(llm):
    """Greedy outputs of PROMPTS[:6] with a pool large enough that nothing is preempted."""
    return token_ids(llm.generate(PROMPTS[:6], greedy(32)))


def test_preemption_keeps_outputs_identical(expected_32):
    # 9 blocks of 16 tokens for 6 sequences growing to ~40 tokens (3 blocks) each: must preempt
    tiny = LLM(kv_cache_memory=9 * 737280, max_num_batched_tokens=64)
    outs = tiny.generate(PROMPTS[:6], greedy(32))
    assert tiny.engine.scheduler.num_preemptions >= 3
    assert token_ids(outs) == expected_32
    assert all(o.finished and len(o.outputs[0].token_ids) == 32 for o in outs)   # nothing lost
    assert_all_blocks_free(tiny.engine)


def test_swap_preemption_keeps_outputs_identical(expected_32):
    swap = LLM(kv_cache_memory=9 * 737280, max_num_batched_tokens=64, preemption_mode="swap",
               swap_space="64MiB")
    outs = swap.generate(PROMPTS[:6], greedy(32))
    assert swap.engine.scheduler.num_preemptions >= 3
    assert swap.engine.blocks.num_swapped_out == swap.engine.scheduler.num_preemptions   # none recomputed
    assert token_ids(outs) == expected_32
    assert_all_blocks_free(swap.engine)


@pytest.mark.parametrize("budget", [1, 7, 64, 100_000])
def test_chunked_prefill_budgets_give_identical_outputs(budget):
    prompts = PROMPTS[:3] + ["A long prompt that needs chunking: " + "alpha beta gamma delta " * 12]
    expected = token_ids(LLM(kv_cache_memory=SMALL_KV, max_num_batched_tokens=100_000)
                         .generate(prompts, greedy(12)))
    llm = LLM(kv_cache_memory=SMALL_KV, max_num_batched_tokens=budget)
    assert token_ids(llm.generate(prompts, greedy(12))) == expected
    assert_all_blocks_free(llm.engine)


def test_chunked_prefill_mixes_decode_and_prefill_in_one_step():
    llm = LLM(kv_cache_memory=SMALL_KV, max_num_batched_tokens=32)
    eng = llm.engine
    eng.add_request("short", "Hello", greedy(20))
    for _ in range(3):
        eng.step()                                            # "short" is now decoding
    eng.add_request("long", list(range(1000, 1200)), greedy(2))
    eng.step()
    assert eng.last_step == {"num_seqs": 2, "num_batched_tokens": 32}   # 1 decode + a 31-token chunk
    while eng.has_unfinished_requests():
        eng.step()
    assert_all_blocks_free(eng)


def test_static_and_continuous_give_identical_outputs():
    params = [greedy(4 + 3 * i) for i in range(len(PROMPTS))]
    cont = LLM(kv_cache_memory=SMALL_KV)
    static = LLM(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=3)
    assert token_ids(static.generate(PROMPTS, params)) == token_ids(cont.generate(PROMPTS, params))
    assert_all_blocks_free(static.engine)


def test_static_mode_admits_nothing_until_the_batch_finishes():
    eng = LLM(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=2).engine
    for i, n in enumerate([2, 10, 3]):
        eng.add_request(f"r{i}", PROMPTS[i], greedy(n))
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        seen.append(sorted(s.request.request_id for s in eng.scheduler.running))
    # r0 finishes after 2 tokens but r2 waits until r1 is done too
    assert ["r1"] in seen and ["r1", "r2"] not in seen and ["r2"] in seen
    assert_all_blocks_free(eng)


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
    eng = LLM(kv_cache_memory="100MiB").engine
    per_block = 2 * 30 * 16 * 3 * 64 * 4          # K and V, 30 layers, 16 tokens, 3 heads x 64, float32
    assert eng.blocks.num_blocks == 100 * 2**20 // per_block
    assert tuple(eng.kv_pool.kv_caches[0][0].shape) == (eng.blocks.num_blocks, 16, 3, 64)


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
def test_kernel_backend_gives_the_reference_backends_greedy_outputs(llm, kv_cache_dtype):
    import paged_attention
    if paged_attention.resolve_backend("auto", "cpu") == "torch":
        pytest.skip("no C++ compiler: the CPU kernel could not be built, only the reference runs")
    kernel = LLM(kv_cache_memory=SMALL_KV, attention_backend="cpu", kv_cache_dtype=kv_cache_dtype)
    ref = LLM(kv_cache_memory=SMALL_KV, attention_backend="torch", kv_cache_dtype=kv_cache_dtype)
    assert kernel.engine.kv_pool.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert token_ids(kernel.generate(PROMPTS, greedy(16))) == token_ids(ref.generate(PROMPTS, greedy(16)))
    assert_all_blocks_free(kernel.engine)


# ============================================================================ sampler.py

def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Tell me a story"], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    batch = llm.generate(["Tell me a story", "Hi", "Zebra", "Numbers: 1"], [p] + others)
    assert batch[0].outputs[0].token_ids == alone
    different = llm.generate(["Tell me a story"], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                                 max_tokens=20, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm.engine)


def test_top_k_1_equals_greedy(llm):
    g = token_ids(llm.generate(PROMPTS[:4], greedy(16)))
    k1 = token_ids(llm.generate(PROMPTS[:4], SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True)))
    assert g == k1


def test_top_p_and_min_p_keep_only_the_allowed_tokens():
    from sampler import apply_top_k_top_p_min_p
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p_min_p(logits.clone(), [SamplingParams(top_p=0.7), SamplingParams(min_p=0.5)])
    # top_p 0.7: 0.5 alone < 0.7, so 0.5 and 0.3 stay; min_p 0.5: keep p >= 0.25
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]


def test_stop_string_cuts_text_exactly_before_it(llm):
    free = llm.generate(["1, 2, 3, 4,"], greedy(20))[0].outputs[0].text
    assert " 7," in free
    out = llm.generate(["1, 2, 3, 4,"], greedy(20, stop=[" 7,"]))[0].outputs[0]
    assert out.text == free[:free.index(" 7,")] and out.finish_reason == "stop" and out.stop_reason == " 7,"


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


# ============================================================================ bad input

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


# ============================================================================ kv_cache.py: prefix caching, copy-on-write

SYSTEM = "You are a careful assistant. " * 30          # ~180 tokens shared by every request
QUESTIONS = ["What is 2+2?", "Name a color.", "Where is Paris?", "Say hello.", "Count to three."]


def test_prefix_caching_gives_identical_outputs_and_skips_prefill():
    prompts = [SYSTEM + q for q in QUESTIONS]
    off = LLM(kv_cache_memory=SMALL_KV, enable_prefix_caching=False)
    expected = token_ids(off.generate(prompts, greedy(10)))
    on = LLM(kv_cache_memory=SMALL_KV)
    first = on.generate(prompts[:1], greedy(10))              # warms the cache with the system prompt
    rest = on.generate(prompts[1:], greedy(10))
    assert token_ids(first + rest) == expected
    shared = len(on.tokenizer.encode(SYSTEM)) // 16 * 16      # whole blocks of the common prefix
    assert all(o.metrics.num_cached_tokens >= shared - 16 for o in rest) and shared >= 160
    assert on.engine.totals["prompt_tokens"] < off.engine.totals["prompt_tokens"] - 3 * shared
    assert on.engine.stats()["prefix_cache_hit_rate"] > 0.5
    assert on.engine.blocks.evictable                          # cached blocks outlive their requests
    assert_all_blocks_free(on.engine)


def test_prefix_cache_eviction_mid_workload_keeps_outputs_identical():
    prompts = [f"Document {i}: " + "lorem ipsum dolor sit amet " * 20 + q for i in range(3) for q in QUESTIONS[:2]]
    expected = token_ids(LLM(kv_cache_memory=SMALL_KV, enable_prefix_caching=False).generate(prompts, greedy(8)))
    small = LLM(kv_cache_memory=16 * 737280, max_num_seqs=2)  # too small to keep every document cached
    outs = []
    for p in prompts:
        outs += small.generate([p], greedy(8))
        small.engine.check_invariants()
    assert token_ids(outs) == expected
    assert small.engine.blocks.prefix_hits > 0 and small.engine.blocks.num_evictions > 0
    assert_all_blocks_free(small.engine)


def test_n_samples_copy_on_write_costs_one_prompt_plus_n_tails():
    llm = LLM(kv_cache_memory=SMALL_KV, enable_prefix_caching=False)
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


# ============================================================================ scheduler.py: policies

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
    llm = LLM(kv_cache_memory=SMALL_KV, max_num_seqs=1)
    reqs = [("c", "three", 0, 3.0), ("a", "one", 5, 1.0), ("b", "two", 0, 2.0)]
    assert run_order(llm, sorted(reqs, key=lambda r: r[3])) == ["a", "b", "c"]


def test_priority_policy_serves_lower_value_first_ties_by_arrival():
    llm = LLM(kv_cache_memory=SMALL_KV, max_num_seqs=1, scheduling_policy="priority")
    reqs = [("low", "one", 5, 1.0), ("high", "two", 0, 2.0), ("mid_late", "three", 2, 4.0), ("mid", "four", 2, 3.0)]
    assert run_order(llm, reqs) == ["high", "mid", "mid_late", "low"]


def test_priority_request_preempts_a_running_lower_priority_one():
    prompts = ["A story about a cat:", "Important:"]
    expected = token_ids(LLM(kv_cache_memory=SMALL_KV).generate(prompts, greedy(40)))
    llm = LLM(kv_cache_memory=5 * 737280, scheduling_policy="priority")   # 5 blocks: room for one
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
    assert [done["background"].outputs[0].token_ids, done["urgent"].outputs[0].token_ids] == expected
    assert_all_blocks_free(eng)


def test_lpm_prefers_cached_prefixes_without_starving_others():
    doc = "Shared document: " + "the river flows to the sea " * 20
    llm = LLM(kv_cache_memory=SMALL_KV, max_num_seqs=1, scheduling_policy="lpm")
    llm.engine.scheduler.config.lpm_max_waited_steps = 12
    llm.generate([doc + "warm"], greedy(2))                     # the document is now cached
    reqs = [("cold1", "An unrelated question about trees", 0, 1.0),
            ("cold2", "Another unrelated question about rivers", 0, 2.0)]
    reqs += [(f"hot{i}", doc + f" question {i}", 0, 3.0 + i) for i in range(5)]
    order = run_order(llm, reqs)
    # cached-prefix requests jump the queue, but the cold ones are served once they waited 12 steps
    assert order[0].startswith("hot") and set(order) == {r[0] for r in reqs}
    assert order.index("cold1") < len(order) - 1 and order.index("cold1") < order.index("cold2")
    fcfs = run_order(LLM(kv_cache_memory=SMALL_KV, max_num_seqs=1), reqs)
    assert fcfs[:2] == ["cold1", "cold2"]
