"""Byte-level BPE tokenizer: text <-> token ids, chat templates, streaming detokenization.

Owns everything between a checkpoint's vocabulary files and token ids: loading a Hugging Face
`tokenizer.json` or the `gguf_tokenizer.json` written from a GGUF (`write_gguf_tokenizer`),
encoding (tiktoken does the BPE; we supply ranks and the pre-tokenizer regex), decoding,
rendering the checkpoint's jinja chat template, and `IncrementalDetokenizer` for streaming.
It must not touch model weights, sampling or the engine's state; callers pass ids in and get text out.
"""
import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
import unicodedata

import jinja2
import regex  # the stdlib `re` has no \p{L}/\p{N}; tiktoken's patterns need them
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Pre-tokenizer regexes (what HF's ByteLevel / Split steps and llama.cpp's `pre` names mean).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# HF Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)] as ONE regex. Digits cuts
# the text at every \p{N} before the GPT-2 regex runs, so (1) numbers are single characters and
# never take a leading space, and (2) a digit acts like end-of-text for `\s+(?!\S)`: "a  1" keeps
# "  " whole. Hence `\p{N}` and `\s+(?![^\s\p{N}])`; the other branches never cross a digit anyway.
# test_all.py fuzzes this against the HF two-step pipeline (test_single_regex_equals_two_step_digit_split_on_fuzzed_text).
DIGITS_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
GGUF_PRE_PATTERNS = {  # tokenizer.ggml.pre -> regex, as llama.cpp defines them
    "gpt-2": GPT2_PATTERN, "smollm": DIGITS_GPT2_PATTERN, "starcoder": DIGITS_GPT2_PATTERN,
    "refact": DIGITS_GPT2_PATTERN, "llama-bpe": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN,
}
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp token types that are matched as whole strings


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (vocab strings are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def token_to_bytes(token: str) -> bytes:
    """A vocab string's bytes; strings outside the byte alphabet are raw UTF-8 (as HF's decoder does)."""
    to_byte = unicode_to_byte()
    if all(c in to_byte for c in token):
        return bytes(to_byte[c] for c in token)
    return token.encode("utf-8")


class Tokenizer:
    """Byte-level BPE over tiktoken. Ids are the checkpoint's ids; tiktoken works in merge ranks."""

    def __init__(self, tokens: list[str | None], merges: list[tuple[str, str]], added_tokens: dict[str, int],
                 special_ids: set[int], pattern: str, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None, prefix_ids: tuple[int, ...] = (),
                 suffix_ids: tuple[int, ...] = (), normalizer: str | None = None, ignore_merges: bool = False):
        self.vocab_size = len(tokens)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template = chat_template
        self.added_tokens = added_tokens
        self.special_tokens = {t: i for t, i in added_tokens.items() if i in special_ids}
        self._special_ids = frozenset(special_ids)
        self._prefix_ids, self._suffix_ids = list(prefix_ids), list(suffix_ids)
        self._normalizer = normalizer
        self._id_to_bytes = [b"" if t is None else token_to_bytes(t) for t in tokens]
        self._build_bpe(tokens, merges, pattern, ignore_merges)
        # Longest first so that a special token that is a prefix of another never wins (HF: leftmost-longest).
        alternatives = sorted(added_tokens, key=len, reverse=True)
        self._added_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None

    def _build_bpe(self, tokens, merges, pattern, ignore_merges):
        """Ranks = merge order (tiktoken merges the adjacent pair whose concatenation ranks lowest)."""
        token_id = {t: i for i, t in enumerate(tokens) if t is not None}
        byte_tokens = [byte_to_unicode()[b] for b in range(256)]
        ordered = [t for t in byte_tokens if t in token_id] + [a + b for a, b in merges if a + b in token_id]
        if ignore_merges:  # HF looks the whole pre-token up in the vocab first, as tiktoken always does
            ordered += [t for t in tokens if t is not None and t not in self.added_tokens]
        ranks: dict[bytes, int] = {}
        self._rank_to_id: list[int] = []
        for t in ordered:
            data = self._id_to_bytes[token_id[t]]
            if data not in ranks:  # the first (highest-priority) merge that makes these bytes wins
                ranks[data] = len(ranks)
                self._rank_to_id.append(token_id[t])
        self._bpe = tiktoken.Encoding("nanoserve", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        self._pattern = regex.compile(pattern)
        # Bytes with no token (here e.g. 0x04, 0xF1) are dropped inside their pre-token, as HF's BPE does
        # with no unk token; tiktoken would panic on them, so such text takes a slower Python path.
        missing = bytes(b for b in range(256) if bytes([b]) not in ranks)
        self._missing_bytes = missing
        self._missing_re = re.compile(b"[" + re.escape(missing) + b"]") if missing else None

    # ---- loading -------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load from `tokenizer.json` (HF layout) or `gguf_tokenizer.json` (written by write_gguf_tokenizer).
        One tokenizer per directory and process while its files are unchanged: a Tokenizer never
        changes once built, and building SmolLM2's (49k tokens' bytes, the BPE ranks) takes seconds,
        which every engine started in one process (tests, bench.py) would pay again."""
        model_dir = Path(model_dir).resolve()
        files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(model_dir.glob("*.json")))
        return cls._from_dir_cached(model_dir, files)

    @classmethod
    @lru_cache(maxsize=8)
    def _from_dir_cached(cls, model_dir: Path, files: tuple) -> "Tokenizer":
        if (model_dir / "tokenizer.json").exists():
            return cls._from_hf(model_dir)
        if (model_dir / "gguf_tokenizer.json").exists():
            return cls._from_gguf_json(json.loads((model_dir / "gguf_tokenizer.json").read_text(encoding="utf-8")))
        raise ValueError(f"model_dir {model_dir} has neither tokenizer.json nor gguf_tokenizer.json")

    @classmethod
    def _from_gguf_json(cls, spec: dict) -> "Tokenizer":
        if spec["pre"] not in GGUF_PRE_PATTERNS:
            raise ValueError(f"GGUF tokenizer.ggml.pre={spec['pre']!r} is not supported; "
                             f"supported: {sorted(GGUF_PRE_PATTERNS)}")
        tokens, types = spec["tokens"], spec["token_types"]
        added = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (GGUF_CONTROL, GGUF_USER_DEFINED)}
        bos, eos = spec["bos_token_id"], spec["eos_token_id"]
        return cls(tokens, [tuple(m.split(" ", 1)) for m in spec["merges"]], added,
                   special_ids={i for i, ty in enumerate(types) if ty == GGUF_CONTROL},
                   pattern=GGUF_PRE_PATTERNS[spec["pre"]], bos_token_id=bos, eos_token_id=eos,
                   chat_template=spec["chat_template"],
                   prefix_ids=(bos,) if spec.get("add_bos_token") and bos is not None else (),
                   suffix_ids=(eos,) if spec.get("add_eos_token") and eos is not None else ())

    @classmethod
    def _from_hf(cls, model_dir: Path) -> "Tokenizer":
        spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
        model = spec["model"]
        if model["type"] != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
                or model.get("end_of_word_suffix") or (spec.get("decoder") or {}).get("type") != "ByteLevel":
            raise ValueError(f"tokenizer.json model type {model['type']!r} (decoder "
                             f"{(spec.get('decoder') or {}).get('type')!r}) is not supported; supported: "
                             "byte-level BPE (model BPE without byte_fallback, decoder ByteLevel)")
        added = {}
        for tok in spec.get("added_tokens", []):
            if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
                raise ValueError(f"added token {tok['content']!r}: lstrip/rstrip/single_word are not supported")
            added[tok["content"]] = tok["id"]
        id_of = {**model["vocab"], **added}
        tokens: list[str | None] = [None] * (max(id_of.values()) + 1)
        for t, i in id_of.items():
            tokens[i] = t
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        config = _read_json(model_dir / "tokenizer_config.json")
        bos, eos = (id_of.get(_token_content(config.get(k))) for k in ("bos_token", "eos_token"))
        prefix, suffix = _hf_post_processor_ids(spec.get("post_processor"), id_of)
        return cls(tokens, merges, added,
                   special_ids={t["id"] for t in spec.get("added_tokens", []) if t.get("special")},
                   pattern=_hf_pre_tokenizer_pattern(spec.get("pre_tokenizer")), bos_token_id=bos,
                   eos_token_id=eos, chat_template=_hf_chat_template(model_dir, config),
                   prefix_ids=prefix, suffix_ids=suffix, normalizer=_hf_normalizer(spec.get("normalizer")),
                   ignore_merges=bool(model.get("ignore_merges")))

    # ---- encode / decode -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Added/special token strings in the text become their ids (as HF does)."""
        text = _replace_lone_surrogates(text)
        ids = list(self._prefix_ids) if add_special_tokens else []
        parts = self._added_re.split(text) if self._added_re else [text]
        for i, part in enumerate(parts):  # split() with a group alternates: ordinary, added, ordinary, ...
            if i % 2:
                ids.append(self.added_tokens[part])
            elif part:
                ids += self._encode_ordinary(part)
        return ids + (self._suffix_ids if add_special_tokens else [])

    def _encode_ordinary(self, text: str) -> list[int]:
        if self._normalizer:  # HF normalizes only the text between added tokens
            text = unicodedata.normalize(self._normalizer, text)
        if self._missing_re and self._missing_re.search(text.encode("utf-8")):
            ranks = []
            for piece in self._pattern.findall(text):
                piece_bytes = piece.encode("utf-8").translate(None, self._missing_bytes)
                if piece_bytes:
                    ranks += self._bpe._encode_single_piece(piece_bytes)
        else:
            ranks = self._bpe.encode_ordinary(text)
        rank_to_id = self._rank_to_id
        return [rank_to_id[r] for r in ranks]

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return self._id_to_bytes[token_id]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD (as HF does)."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # ---- chat ----------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """Render the checkpoint's jinja chat template (or chat_template, in the same sandbox) the way
        transformers does; kwargs go to the template."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; pass a plain prompt instead of messages")
        special = {name: None if i is None else self.decode([i])
                   for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))}
        return _compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs)


class IncrementalDetokenizer:
    """Streams text token by token. Holds back only the bytes of an unfinished UTF-8 character, so
    each step is O(token length) and the pieces (plus flush()) concatenate to decode(ids)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pending = b""

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still unfinished)."""
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""
        data = self._pending + self.tokenizer.token_bytes(token_id)
        cut = _complete_prefix_len(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """End of stream: whatever is held back, with U+FFFD for an unfinished character."""
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text


def _complete_prefix_len(data: bytes) -> int:
    """Length of `data` without a trailing unfinished UTF-8 sequence (a lead byte missing continuations).
    Cutting just before a lead byte never changes how the bytes before it decode."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: this is where the last character starts
            need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


def _replace_lone_surrogates(text: str) -> str:
    """Lone surrogates (possible from JSON "\\ud800") cannot be UTF-8; make them U+FFFD like tiktoken."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# ---- chat template rendering (mirrors transformers' environment) ----------------------------------------

def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    # Sandboxed: the template comes from a downloaded checkpoint. trim/lstrip_blocks as HF sets them.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# ---- Hugging Face tokenizer.json pieces ----------------------------------------------------------------

def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_content(token) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(model_dir: Path, config: dict) -> str | None:
    if (model_dir / "chat_template.jinja").exists():  # newer transformers save it beside the config
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _hf_pre_tokenizer_pattern(pre: dict | None) -> str:
    """The single regex equivalent to the supported HF pre-tokenizer pipelines."""
    pre = pre or {}
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    byte_level = steps[-1] if kinds[-1] == "ByteLevel" else None
    if byte_level and not byte_level.get("add_prefix_space"):
        use_regex = byte_level.get("use_regex", True)
        if kinds == ["ByteLevel"] and use_regex:
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and use_regex:
            return DIGITS_GPT2_PATTERN
        split = steps[0]
        if kinds == ["Split", "ByteLevel"] and not use_regex and "Regex" in split["pattern"] \
                and split.get("behavior") == "Isolated" and not split.get("invert"):
            return split["pattern"]["Regex"]
    raise ValueError(f"pre_tokenizer {json.dumps(pre)[:200]} is not supported; supported: ByteLevel, "
                     "Sequence[Digits(individual_digits), ByteLevel], Sequence[Split(Regex, Isolated), "
                     "ByteLevel(use_regex=false)], all with add_prefix_space=false")


def _hf_normalizer(normalizer: dict | None) -> str | None:
    kind = normalizer and normalizer.get("type")
    if kind in (None, "NFC", "NFKC", "NFD", "NFKD"):
        return kind
    raise ValueError(f"normalizer {kind!r} is not supported; supported: none, NFC, NFKC, NFD, NFKD")


def _hf_post_processor_ids(post: dict | None, id_of: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ids that add_special_tokens=True puts before/after the text (e.g. Llama-3's <|begin_of_text|>)."""
    steps = (post or {}).get("processors", []) if (post or {}).get("type") == "Sequence" else [post]
    template = next((s for s in steps if s and s.get("type") == "TemplateProcessing"), None)
    if template is None:
        return (), ()
    items = template["single"]
    at = next(i for i, item in enumerate(items) if "Sequence" in item)
    ids = [[id_of[item["SpecialToken"]["id"]] for item in part] for part in (items[:at], items[at + 1:])]
    return tuple(ids[0]), tuple(ids[1])


# ---- GGUF -> gguf_tokenizer.json ------------------------------------------------------------------------

def write_gguf_tokenizer(reader, out_dir: str | Path) -> Path:
    """Write the GGUF's tokenizer.ggml.* fields (and chat template) as out_dir/gguf_tokenizer.json."""
    fields = reader.fields

    def get(name, default=None):
        return fields[name].contents() if name in fields else default

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={model!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    spec = {
        "tokens": get("tokenizer.ggml.tokens"), "token_types": get("tokenizer.ggml.token_type"),
        "merges": get("tokenizer.ggml.merges", []), "pre": get("tokenizer.ggml.pre", "default"),
        "bos_token_id": get("tokenizer.ggml.bos_token_id"), "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "chat_template": get("tokenizer.chat_template"),
        "add_bos_token": bool(get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(get("tokenizer.ggml.add_eos_token", False)),
    }
    path = Path(out_dir) / "gguf_tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return path
