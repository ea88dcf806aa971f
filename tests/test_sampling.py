"""Tests for mini_infer.engine.sampling: exact masks and penalties against hand-written references, seeds, statistics, validation."""
import math
from collections import Counter

import pytest
import torch

from mini_infer.engine.sampling import (Sampler, SamplingBatch, SamplingParams, TokenHistory, TokenLogprob, apply_penalties,
                                 min_p_mask, top_k_mask, top_p_mask)


def histories(hist, V):
    "`TokenHistory`s of (prompt ids, output ids) pairs."
    if hist is None: return None
    out = []
    for prompt, output in hist:
        h = TokenHistory(prompt, V); h.add(output); out.append(h)
    return out


def draw(sampler, logits, params, gens, hist=None):
    "`sampler.sample` over a `SamplingBatch` built from lists, as the runner builds it from its requests."
    return sampler.sample(logits, SamplingBatch(params, gens, histories(hist, logits.shape[-1])))


# ---- hand-written references: one row at a time, plain Python ----
def ref_top_k(row, k):
    if k <= 0: return set(range(len(row)))
    return set(sorted(range(len(row)), key=lambda i: -row[i])[:k])


def ref_top_p(row, p):
    probs = torch.tensor(row, dtype=torch.float64).softmax(-1).tolist()
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i); mass += probs[i]
        if mass >= p: break
    return kept


def ref_min_p(row, m):
    probs = torch.tensor(row, dtype=torch.float64).softmax(-1).tolist()
    return {i for i, q in enumerate(probs) if q >= m * max(probs)}


def ref_penalties(row, prompt, output, rep, pres, freq):
    row = list(row)
    for t in set(prompt) | set(output):
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t, c in Counter(output).items():
        row[t] -= freq * c + pres
    return row


def kept(mask_row): return set(torch.nonzero(mask_row).flatten().tolist())


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 50, generator=g) * 2


# ---- masks ----
def test_top_k_exact(logits):
    ks = torch.tensor([1, 3, 10, 50, 0, -1])
    m = top_k_mask(logits, ks)
    for i, k in enumerate(ks.tolist()):
        assert kept(m[i]) == ref_top_k(logits[i].tolist(), k)
    assert m[:4].sum(-1).tolist() == [1, 3, 10, 50]


def test_top_k_larger_than_vocab(logits):
    assert top_k_mask(logits[:1], torch.tensor([1000])).all()


def test_top_p_exact(logits):
    ps = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.95, 1.0])
    m = top_p_mask(logits, ps)
    for i, p in enumerate(ps.tolist()):
        assert kept(m[i]) == ref_top_p(logits[i].tolist(), p), p
    assert m[0].sum() >= 1 and m[5].all()


def test_top_p_keeps_nothing_past_an_exact_cutoff():
    "When the mass of the kept tokens reaches top_p exactly, the next token is out: probs [0.5, 0.25, 0.25], top_p 0.5."
    m = top_p_mask(torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 2.0]]).log(), torch.tensor([0.5, 0.75]))
    assert m.tolist() == [[True, False, False], [True, False, True]]
    assert kept(m[0]) == ref_top_p([2.0, 1.0, 1.0], 0.5)


def test_min_p_exact(logits):
    ms = torch.tensor([0.0, 0.01, 0.1, 0.3, 0.9, 1.0])
    m = min_p_mask(logits, ms)
    for i, mp in enumerate(ms.tolist()):
        assert kept(m[i]) == ref_min_p(logits[i].tolist(), mp), mp
    assert m[0].all() and m[5].sum() == 1


def test_sampled_tokens_stay_inside_masks(logits):
    "Through the sampler: every draw lies in min-p ∩ top-k ∩ top-p (vLLM's order: top-p renormalised over the others' survivors)."
    sampler, torch_seed = Sampler(), torch.manual_seed(1)
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2),
              SamplingParams(top_k=8, top_p=0.6, min_p=0.05, temperature=0.7)]
    rows = logits[:4]
    allowed = [ref_top_k(rows[0].tolist(), 5), ref_top_p(rows[1].tolist(), 0.5), ref_min_p(rows[2].tolist(), 0.2)]
    r3 = (rows[3] / 0.7).tolist()
    kept = ref_min_p(r3, 0.05) & ref_top_k(r3, 8)
    masked = [x if i in kept else -math.inf for i, x in enumerate(r3)]
    allowed.append(kept & ref_top_p(masked, 0.6))
    for _ in range(200):
        tok, _ = draw(sampler, rows, params, [None] * 4)
        for i, t in enumerate(tok.tolist()): assert t in allowed[i]


# ---- penalties ----
def test_penalties_exact(logits):
    hist = [([1, 2, 3], [4, 4, 5]), ([], [7, 7, 7, 1]), ([0, 0, 9], []), ([10], [11]), ([1, 2], [3])]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=-0.5),
              SamplingParams(repetition_penalty=2.0, presence_penalty=1.5, frequency_penalty=2.0),
              SamplingParams()]                                   # no penalty: untouched whatever its history
    out = apply_penalties(logits[:5], SamplingBatch(params, [None] * 5, histories(hist, logits.shape[-1])).penalties)
    for i, (p, (pr, o)) in enumerate(zip(params, hist)):
        ref = ref_penalties(logits[i].tolist(), pr, o, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        torch.testing.assert_close(out[i], torch.tensor(ref), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[4], logits[4])   # no penalty: the row is left as it was, not recomputed


def test_penalised_greedy_avoids_repeats():
    row = torch.tensor([[5.0, 4.9, 1.0, -2.0]])
    tok, _ = draw(Sampler(), row, [SamplingParams(temperature=0, repetition_penalty=1.5)], [None], [([], [0])])
    assert tok.item() == 1
    tok, _ = draw(Sampler(), row, [SamplingParams(temperature=0, frequency_penalty=0.06)], [None], [([], [0, 0])])
    assert tok.item() == 1
    with pytest.raises(ValueError, match="histories"):
        draw(Sampler(), row, [SamplingParams(presence_penalty=1.0)], [None])


# ---- greedy, seeds, statistics ----
def test_greedy_is_argmax(logits):
    s = Sampler()
    tok, lps = draw(s, logits, [SamplingParams(temperature=0)] * 6, [None] * 6)
    assert torch.equal(tok, logits.argmax(-1)) and lps == [None] * 6
    # greedy rows mixed with sampled rows (general path) are still argmax
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    tok, _ = draw(s, logits, params, [None] * 6)
    assert torch.equal(tok[::2], logits[::2].argmax(-1))


def _seeded_run(batch, row, seed, steps=8, others=None):
    s = Sampler()
    g = torch.Generator().manual_seed(seed)
    params = list(others or [SamplingParams(top_p=0.9, temperature=1.3)] * len(batch))
    params[row] = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=seed)
    gens = [None] * len(batch); gens[row] = g
    return [draw(s, batch, params, gens)[0][row].item() for _ in range(steps)]


def test_seeded_reproducible_and_batch_independent(logits):
    target = logits[2:3]
    alone = _seeded_run(target, 0, seed=42)
    assert alone == _seeded_run(target, 0, seed=42)
    assert alone != _seeded_run(target, 0, seed=43)            # another seed, another sequence (8 draws)
    torch.manual_seed(5)
    assert alone == _seeded_run(logits, 2, seed=42)            # same row inside a batch of 6
    big = torch.cat([torch.randn(9, 50), target, torch.randn(3, 50)])
    mixed = [SamplingParams(temperature=0), SamplingParams(seed=7), SamplingParams(top_k=3)] * 4 + [SamplingParams()]
    assert alone == _seeded_run(big, 9, seed=42, others=mixed)  # other params, a greedy row, another seeded row


def test_every_seeded_row_draws_from_its_own_generator(logits):
    "Several seeded rows in one batch: each gives the tokens it gives alone, wherever it sits and whatever its neighbours."
    s, steps = Sampler(), 6
    params = [SamplingParams(temperature=1.0, seed=x) for x in (11, 22, 33)]

    def run(batch, rows):   # params[j] at row rows[j], with a fresh generator of its seed; the other rows unseeded
        ps, gens = [SamplingParams(temperature=1.2)] * len(batch), [None] * len(batch)
        for r, p in zip(rows, params): ps[r], gens[r] = p, torch.Generator().manual_seed(p.seed)
        draws = [draw(s, batch, ps, gens)[0].tolist() for _ in range(steps)]
        return [[d[r] for d in draws] for r in rows]

    alone = []
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(p.seed)
        alone.append([draw(s, logits[i:i + 1], [p], [g])[0].item() for _ in range(steps)])
    assert len({tuple(a) for a in alone}) == 3
    assert run(logits[:3], [0, 1, 2]) == alone
    assert run(torch.cat([logits[5:6], logits[2:3], logits[4:5], logits[0:1], logits[1:2]]), [3, 4, 1]) == alone


def test_temperature_one_matches_softmax():
    probs = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05])
    N = 30_000
    torch.manual_seed(0)
    tok, _ = draw(Sampler(), probs.log().expand(N, -1) + 3.0, [SamplingParams()] * N, [None] * N)
    counts = torch.bincount(tok, minlength=7).double()
    expected = probs.double() * N
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 22.46, chi2                                      # df = 6, p = 0.001


def test_seeded_draws_match_softmax():
    "A seeded row, sampled step after step with its own generator, also follows the (top-k renormalised) softmax."
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -5.0]])
    p = SamplingParams(top_k=4, seed=3)
    g = torch.Generator().manual_seed(3)
    s = Sampler()
    N = 3000
    toks = [draw(s, logits, [p], [g])[0].item() for _ in range(N)]
    counts = torch.bincount(torch.tensor(toks), minlength=6).double()
    assert counts[4:].sum() == 0
    expected = logits[0, :4].double().softmax(-1) * N
    chi2 = ((counts[:4] - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.27, chi2                                      # df = 3, p = 0.001


# ---- logprobs ----
def test_logprobs_from_raw_logits(logits):
    params = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5), SamplingParams(logprobs=0),
              SamplingParams(), SamplingParams(temperature=0, logprobs=2)]
    hist = [([0, 1, 2], [3])] + [([], [])] * 3
    tok, lps = draw(Sampler(), logits[:4], params, [None] * 4, hist)
    raw = logits[:4].log_softmax(-1)
    assert lps[2] is None and all(isinstance(x, TokenLogprob) for i, x in enumerate(lps) if i != 2)
    for i in (0, 1, 3):
        assert lps[i].token_id == tok[i].item()
        assert math.isclose(lps[i].logprob, raw[i, tok[i]].item(), abs_tol=1e-6)
    top = raw[0].topk(5)
    assert list(lps[0].top) == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(list(lps[0].top.values())), top.values)
    assert lps[1].top == {} and len(lps[3].top) == 2 and lps[3].token_id == logits[3].argmax().item()


# ---- validation ----
@pytest.mark.parametrize("name,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2),
    ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.1), ("max_tokens", 0), ("logprobs", -1), ("logprobs", 21), ("stop", ""),
    ("stop", ["a", ""]), ("stop", [3]), ("stop_token_ids", [1, "2"]), ("stop_token_ids", 5), ("seed", "x")])
def test_validation_names_parameter(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_valid_params_normalised():
    p = SamplingParams(stop="###", stop_token_ids=(1, 2), top_k=-1, logprobs=20, seed=0, temperature=0)
    assert p.stop == ["###"] and p.stop_token_ids == [1, 2] and p.greedy
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"] and SamplingParams().stop == []
    assert not SamplingParams().greedy and not SamplingParams().has_penalties
