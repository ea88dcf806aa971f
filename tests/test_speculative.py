"""Speculative decoding (chapter 5): the rejection sampler is exact (analytically on a vocabulary of 8, and by seeded
chi-square tests), and the engine with guesses emits exactly the tokens of plain greedy decoding, batched and alone, with
chunked prefill, preemption and prefix caching; logprobs are the target's; bad configurations fail at start-up."""
import random
from collections import Counter
import pytest, torch
from mini_infer.engine.engine import LLMEngine
from mini_infer.engine.llm import LLM, run_to_completion
from mini_infer.model.model import CausalLM, ModelConfig
from mini_infer.engine.reference import generate
from mini_infer.engine.sampling import SamplingParams
from mini_infer.plugins.speculative.config import SpeculativeConfig
from mini_infer.plugins.speculative.plan import expected_tokens, plan_guesses
from mini_infer.plugins.speculative.proposers import NgramProposer
from mini_infer.plugins.speculative.verify import accept_probs, rejection_sample, residual


# ---------------------------------------------------------------- the rejection sampler

def test_analytic_exactness_vocab_8():
    "For every p and q: sum_x q(x) [a(x) 1{y=x} + (1 - a(x)) r_x(y)] = p(y), with the sampler's own a and r."
    torch.manual_seed(0)
    for _ in range(20):
        p, q = torch.distributions.Dirichlet(torch.full((8,), 0.3)).sample((2,)).double()
        xs = torch.arange(8)
        a = accept_probs(p.expand(8, 8), xs, q.expand(8, 8))                  # one row per possible guess x
        r = residual(p.expand(8, 8), xs, q.expand(8, 8))
        out = (q.unsqueeze(-1) * (a.unsqueeze(-1) * torch.eye(8, dtype=p.dtype) + (1 - a).unsqueeze(-1) * r)).sum(0)
        assert torch.allclose(out, p, atol=1e-12), (out, p)
        accepted_mass = (q * a).sum()                                       # sum_x min(q(x), p(x))
        assert torch.allclose(accepted_mass, torch.minimum(p, q).sum(), atol=1e-12)
        # a deterministic guess x: kept with p(x), else drawn from p without x
        a, r = accept_probs(p.expand(8, 8), xs), residual(p.expand(8, 8), xs)
        for x in range(8): assert torch.allclose(a[x] * torch.eye(8, dtype=p.dtype)[x] + (1 - a[x]) * r[x], p, atol=1e-12)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    "Pearson's chi-square test of `counts` against `probs` (cells with expected count < 5 pooled)."
    n = counts.sum()
    exp = probs.double() * n
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    assert df > 0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("deterministic", [False, True])
def test_chi_square_every_position(k, deterministic):
    "N rows with the same p and q: the token at every position j (among rows that reach it) is distributed as p_j."
    torch.manual_seed(k + 10 * deterministic)
    V, N = 12, 40_000
    p = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((k + 1,))
    q = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((k,))
    if deterministic:   # a fixed guess per position, as from an n-gram table: the second most likely token
        draft, qq = p[:k].topk(2, -1).indices[:, 1].expand(N, k), None
    else:
        draft, qq = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(k)], -1), q.expand(N, k, V)
    accepted, nxt = rejection_sample(p.expand(N, k + 1, V), draft, torch.full((N,), k), qq)
    emitted = torch.cat([draft, torch.full((N, 1), -1)], -1)
    emitted[torch.arange(N), accepted] = nxt
    for j in range(k + 1):
        reached = accepted >= j
        if reached.sum() < 1000: continue          # too few rows get this far for the test to say anything
        counts = torch.bincount(emitted[reached, j], minlength=V)
        assert _chi2_pvalue(counts, p[j]) > 1e-3, (j, counts, p[j] * reached.sum())
    # the acceptance length follows from the per-position acceptance rates
    rate = p[0, draft[0, 0]] if deterministic else torch.minimum(p[0], q[0]).sum()
    assert abs((accepted >= 1).float().mean() - rate) < 0.02


def test_scripted_guesses_right_for_exactly_j():
    "Greedy rows (one-hot p): guesses right for exactly j tokens, every j in 0..k in one batch, keep exactly j."
    V, k = 10, 4
    target = torch.tensor([3, 1, 4, 1, 5])
    p = torch.nn.functional.one_hot(target, V).float().expand(k + 1, k + 1, V)
    draft = torch.stack([torch.where(torch.arange(k) < j, target[:k], (target[:k] + 1) % V) for j in range(k + 1)])
    accepted, nxt = rejection_sample(p, draft, torch.full((k + 1,), k))
    assert accepted.tolist() == list(range(k + 1))
    assert nxt.tolist() == target.tolist()               # the correction on a miss, the bonus token after k hits


def test_seeded_rejection_sampling_is_reproducible():
    torch.manual_seed(0)
    p = torch.randn(3, 4, 50).softmax(-1); q = torch.randn(3, 3, 50).softmax(-1)
    draft = torch.multinomial(q.flatten(0, 1), 1).view(3, 3)
    run = lambda: rejection_sample(p, draft, torch.tensor([3, 1, 0]), q, [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    a, b = run(), run()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_plan_guesses():
    assert plan_guesses([1.0], [8], 0.1) == [8] and plan_guesses([0.0], [8], 0.1) == [0]
    assert expected_tokens(0.5, 2) == 1.75   # 1 + 0.5 + 0.25: powers of 2, exact in binary
    assert plan_guesses([1.0], [8], 1.1) == [0]            # a draft as costly as the target never pays, even when always right
    assert plan_guesses([0.9, 0.3], [4, 4], 0.08) == [4, 1]  # the likelier guesses first
    one, many = plan_guesses([0.8], [8], 0.08)[0], plan_guesses([0.8] * 32, [8] * 32, 0.08)
    assert all(k < one for k in many)                        # in a big batch a guess must be likelier to pay


def test_ngram_lookup():
    ng = NgramProposer(n_max=3, n_min=1)
    assert ng.lookup([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert ng.lookup([5, 6, 7, 8, 5, 6], 4) == [7, 8, 5, 6]          # the longest suffix (5, 6) wins
    assert ng.lookup([1, 2, 3, 4], 2) == []                         # nothing repeats
    assert ng.lookup([4, 1, 2, 4, 3, 4], 2) == [3, 4]               # the latest earlier occurrence


def test_lookup_ceiling():
    from mini_infer.bench.spec import lookup_ceiling
    ng = NgramProposer(n_max=2, n_min=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert lookup_ceiling(prompt, [1, 2, 3, 4, 5, 6, 7], ng.lookup, 8) == 7 / 3   # [1], [2], then 3..7 guessed in one step
    assert lookup_ceiling(prompt, [9, 8, 9, 8, 7], ng.lookup, 8) == 1.0          # nothing to copy: a token per step (n / n)
    assert lookup_ceiling(prompt, [1, 2, 3, 4, 5, 6, 7], ng.lookup, 2) == 7 / 4  # k caps each step's guesses


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def llm(): return LLM("smollm2-135m", kv_cache_memory_gb=0.25)


@pytest.fixture(scope="module")
def workload(llm):
    "Chat prompts that invite copying (guesses hit), and random-token prompts (guesses miss)."
    tok, rng = llm.tokenizer, random.Random(0)
    text = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
    chats = [f"Repeat exactly: {text}", "List the days of the week.", f"{text} Quote the first sentence.", "Count from 1 to 20."]
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in chats]
    prompts += [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 40), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def alone(llm, workload):
    "Chapter 1's loop, one request at a time: the oracle."
    return [o.token_ids for o in generate(llm.model, llm.tokenizer, *workload)]


def engine(llm, **kw): return LLMEngine(llm.model, llm.tokenizer, **{"kv_cache_memory_gb": 0.25, **kw})


NGRAM = dict(method="ngram", num_speculative_tokens=5, prompt_lookup_min=1, adaptive=False, disable_by_batch_size=None)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_batched_tokens=64, max_prefill_chunk=16),             # chunked prefill, and guesses trimmed to the budget
    dict(num_blocks=14, block_size=8, max_prefill_chunk=32),           # forced preemption, in the middle of speculation
    dict(enable_prefix_caching=False),
    dict(max_num_seqs=1),                                              # every request alone
], ids=["default", "chunked", "preempt", "no-prefix-cache", "alone"])
def test_ngram_greedy_equals_plain(llm, workload, alone, kw):
    eng = engine(llm, speculative_config=NGRAM, **kw)
    outs = run_to_completion(eng, *workload)
    assert [o.token_ids for o in outs] == alone
    st = eng.stats()
    assert st["spec_decode_num_draft_tokens_total"] > 0 and 0 < st["spec_decode_num_accepted_tokens_total"] < st["spec_decode_num_draft_tokens_total"]
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks
    if "num_blocks" in kw: assert st["preemptions_total"] > 0


@pytest.fixture(scope="module")
def tiny_draft(llm):
    "A random 2-layer Llama with SmolLM2's vocabulary: a cheap draft that is mostly wrong (the rejection path)."
    cfg = ModelConfig(vocab_size=llm.model.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    return CausalLM(cfg).eval()


@pytest.mark.parametrize("draft", ["same", "tiny"])
@pytest.mark.parametrize("kw", [dict(), dict(num_blocks=14, block_size=8, max_prefill_chunk=32)], ids=["default", "preempt"])
def test_draft_model_greedy_equals_plain(llm, workload, alone, tiny_draft, draft, kw):
    model = (llm.model, llm.tokenizer) if draft == "same" else tiny_draft
    eng = engine(llm, speculative_config=dict(method="draft_model", model=model, num_speculative_tokens=3, adaptive=False), **kw)
    outs = run_to_completion(eng, *workload)
    assert [o.token_ids for o in outs] == alone
    st, draft_pool = eng.stats(), eng.scheduler.proposer.proposer.allocator
    # the target guessing for itself is always right: chapter 7's kernels compute each row alone, so its 1-token draft
    # rows and 1 + k verify rows give the same logits bit for bit, and the rate is a ratio of equal counts
    if draft == "same": assert st["spec_decode_draft_acceptance_rate"] == 1.0
    assert st["spec_decode_num_draft_tokens_total"] > 0
    assert draft_pool.num_free == draft_pool.num_blocks and not eng.scheduler.proposer.proposer.state   # freed with the target's


def test_guesses_never_enter_the_prefix_cache(llm, workload):
    "Right after each forward (guesses computed, not yet verified) the cache has registered only blocks of final tokens."
    eng = engine(llm, speculative_config=NGRAM)
    cache_blocks, seen = eng.kv.cache_blocks, []
    def checked(seq):
        cache_blocks(seq)
        assert eng.kv.num_cached_blocks[seq] * seq.block_table.block_size <= seq.num_tokens
        seen.append(bool(seq.spec_token_ids) and seq.num_computed_tokens > seq.num_tokens)
    eng.kv.cache_blocks = checked
    run_to_completion(eng, *workload)
    assert any(seen) and eng.stats()["prefix_cache_queries_total"] > 0    # guesses were in the cache's pool, unregistered


def test_scripted_proposer_in_engine(llm, workload, alone):
    """A proposer that knows the answer and is right for exactly j tokens (j cycling 0..k): how often each number of
    kept guesses occurs is what it scripted; after each verification the sequence decodes on at once, with the next
    guesses (none recomputed: each request runs its uncached prompt + output - 1 tokens, plus one per rejected guess)."""
    prompts, params = workload
    truth = {tuple(p): a for p, a in zip(prompts, alone)}
    k, log = 4, []
    class Scripted:
        def __init__(self): self.j = 0
        def propose(self, seqs, ks):
            out = []
            for s, kk in zip(seqs, ks):
                right = truth[tuple(s.prompt_ids)][len(s.output_ids):len(s.output_ids) + kk]
                j, self.j = self.j % (kk + 1), self.j + 1
                log.append((s.request_id, kk, j))
                out.append((right[:j] + [(t + 1) % 49152 for t in right[j:]], None))
            return out
        def free(self, seq): pass
    eng = engine(llm, speculative_config=dict(NGRAM, num_speculative_tokens=k), trace=True)
    eng.scheduler.proposer.proposer = Scripted()
    outs = run_to_completion(eng, prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert eng.scheduler.proposer.accepted_lengths == Counter(j for _, _, j in log)   # a verifier that rejects fails here
    rids = {o.request_id: o for o in outs}
    for rid, o in rids.items():
        decodes = [n for step in eng.trace for r, n, d in step.work if r == rid and d]
        guesses = [kk for r, kk, _ in log if r == rid]
        assert decodes == [1 + kk for kk in guesses] + [1] * (len(decodes) - len(guesses))  # guesses whenever proposed
        assert all(n == 1 for n in decodes[len(guesses):])
        rejected = sum(kk - j for r, kk, j in log if r == rid)
        ran = sum(n for step in eng.trace for r, n, _ in step.work if r == rid)
        assert ran == len(o.prompt_token_ids) - o.num_cached_tokens + len(o.token_ids) - 1 + rejected


def test_draft_blocks_are_freed_at_preemption(llm, workload):
    "A preempted sequence's draft blocks go back at once, not when it finishes: the draft holds blocks only for running ones."
    eng = engine(llm, num_blocks=14, block_size=8, max_prefill_chunk=32,
                 speculative_config=dict(method="draft_model", model=(llm.model, llm.tokenizer), num_speculative_tokens=3))
    draft, preempted = eng.scheduler.proposer.proposer, 0
    for p, sp in zip(*workload): eng.add_request(p, sp)
    while eng.has_unfinished():
        eng.step()
        running = set(eng.scheduler.running)
        preempted += sum(s.num_preemptions > 0 for s in eng.scheduler.waiting)
        assert set(draft.state) <= running
        assert draft.allocator.num_used == sum(len(st["table"].blocks) for st in draft.state.values())
    assert eng.stats()["preemptions_total"] > 0 and preempted > 0


def test_logprobs_and_penalties_are_the_targets(llm, workload):
    prompts, _ = workload
    sp = [SamplingParams(temperature=0, max_tokens=30, logprobs=3, repetition_penalty=1.3, frequency_penalty=0.5)] * 4
    plain = run_to_completion(engine(llm), prompts[:4], sp)
    # the model guessing for itself without penalties: right where the penalties do not change the argmax
    eng = engine(llm, speculative_config=dict(method="draft_model", model=(llm.model, llm.tokenizer), num_speculative_tokens=3, adaptive=False))
    spec = run_to_completion(eng, prompts[:4], sp)
    st = eng.stats()
    assert 0 < st["spec_decode_num_accepted_tokens_total"] < st["spec_decode_num_draft_tokens_total"]
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert list(x.top) == list(y.top) and all(abs(x.top[t] - y.top[t]) < 1e-4 for t in x.top)


@pytest.mark.parametrize("draft, adaptive", [("tiny", False), ("same", False), ("tiny", True)])
def test_the_draft_rolls_its_cache_back_exactly(llm, workload, tiny_draft, draft, adaptive, monkeypatch):
    """After a verification the draft keeps exactly the tokens of its own cache that are still the
    sequence's, and runs only the rest: each proposal's first draft forward starts at the first
    position where what the draft has cached (shadowed here, position by position) differs from the
    sequence, or at its last token (whose logits it needs). One position too far back recomputes a
    kept token for nothing; one too few keeps a rejected guess's K/V: both only slow speculation
    down, so only this test sees them. A mostly wrong draft rejects at the first guess; the target
    guessing for itself, with penalties only the target applies, keeps some guesses and rejects
    the next; with adaptive k a sequence skips proposals and the draft catches up several tokens
    (only there does a roll-back one short show: after a verification, the last token bounds it)."""
    from mini_infer.plugins.speculative import proposers
    model = tiny_draft if draft == "tiny" else (llm.model, llm.tokenizer)
    eng = engine(llm, speculative_config=dict(method="draft_model", model=model, num_speculative_tokens=3, adaptive=adaptive))
    prop = eng.scheduler.proposer.proposer
    cached, base, wrong, rollbacks, fed = {}, {}, [], Counter(), Counter()   # per draft table: its cached tokens, the length at its last proposal
    first, propose, draft_forward = [False], prop.propose, proposers.draft_forward
    def proposing(seqs, ks):
        first[0] = True
        return propose(seqs, ks)
    def recording(run_step, cache, sampler, rows, params, gens):
        seq_of = {st["table"]: s for s, st in prop.state.items()}
        for tokens, start, table, _ in rows:
            held, seq = cached.setdefault(table, []), seq_of[table]
            if first[0]:
                final = seq.token_slice(0, seq.num_tokens)
                kept = next((i for i, (a, b) in enumerate(zip(held, final)) if a != b), min(len(held), len(final)))
                if start != min(kept, seq.num_tokens - 1):
                    wrong.append(f"{seq.request_id}: the draft ran from position {start}, its cache holds the first {kept}")
                if kept < len(held):
                    rollbacks[kept - base[table]] += 1   # a rejection, after this many kept guesses
                if table in base:
                    fed[len(tokens)] += 1   # the tokens of a catch-up after an earlier proposal
                base[table] = seq.num_tokens
            assert start <= len(held), f"{seq.request_id}: the draft ran from {start}, past what it has cached ({len(held)})"
            held[start:] = tokens
        first[0] = False
        return draft_forward(run_step, cache, sampler, rows, params, gens)
    monkeypatch.setattr(prop, "propose", proposing)
    monkeypatch.setattr(proposers, "draft_forward", recording)
    prompts, _ = workload
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
    run_to_completion(eng, prompts[:6], [sp] * 6)
    assert not wrong, wrong[:5]
    assert rollbacks[0] > 0 and (draft == "tiny" or sum(n for kept, n in rollbacks.items() if kept > 0) > 0), rollbacks
    assert max(fed) <= 2 if not adaptive else max(fed) > 2, fed   # 1 after a rejection, 2 after none; more after skipped proposals


def test_stop_strings_when_tokens_arrive_together(llm):
    tok = llm.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Repeat exactly: one, two, three, four, five, six, seven, eight."}])
    full = run_to_completion(engine(llm), [prompt], [SamplingParams(temperature=0, max_tokens=40)])[0].text
    stop = full[full.index("five"):full.index("six") + 3]
    sp = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    plain = run_to_completion(engine(llm), [prompt], [sp])[0]
    eng = engine(llm, speculative_config=NGRAM)
    rid = eng.add_request(prompt, sp)
    deltas, sizes = [], []
    while eng.has_unfinished():
        for o in eng.step(): deltas.append(o.text_delta); sizes.append(len(o.new_token_ids))
    assert "".join(deltas) == plain.text and stop not in plain.text and plain.finish_reason == "stop"
    assert max(sizes) > 1                                    # several tokens did arrive in one step


def test_seeded_sampling_reproducible(llm, workload):
    prompts, _ = workload
    sp = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=24, ignore_eos=True) for i in range(4)]
    cfg = dict(method="draft_model", model=(llm.model, llm.tokenizer), num_speculative_tokens=3, adaptive=False)
    runs = []
    for _ in range(2):
        eng = engine(llm, speculative_config=cfg)
        runs.append([o.token_ids for o in run_to_completion(eng, prompts[:4], sp)])
    assert runs[0] == runs[1]
    assert eng.stats()["spec_decode_draft_acceptance_rate"] == 1.0   # q = p bit for bit (rows computed alone): all kept


def test_adaptive_switches_off(llm, workload, tiny_draft):
    prompts, params = workload
    eng = engine(llm, speculative_config=dict(method="ngram", disable_by_batch_size=2))
    run_to_completion(eng, prompts[:4], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4)
    assert eng.stats()["spec_decode_num_draft_tokens_total"] == 0          # 4 decoding sequences > 2: no guesses
    # a draft that is almost always wrong: its k drops to 0, with a probe now and then
    eng = engine(llm, speculative_config=dict(method="draft_model", model=tiny_draft, num_speculative_tokens=4))
    run_to_completion(eng, prompts[4:5], [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)])
    assert eng.stats()["spec_decode_num_draft_tokens_total"] < 0.4 * 4 * 60


def test_abort_frees_draft_blocks(llm, workload):
    prompts, params = workload
    eng = engine(llm, speculative_config=dict(method="draft_model", model=(llm.model, llm.tokenizer), num_speculative_tokens=3, adaptive=False))
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50)) for p in prompts[:3]]
    for _ in range(4): eng.step()
    pool = eng.scheduler.proposer.proposer.allocator
    assert pool.num_used > 0
    for r in rids: eng.abort(r)
    eng.step()
    assert pool.num_free == pool.num_blocks and eng.kv.allocator.num_free == eng.kv.allocator.num_blocks


@pytest.mark.parametrize("cfg, msg", [
    (dict(method="medusa"), "unknown speculative method 'medusa'; choose from"),   # the engine looks the method up by name
    (dict(method="ngram", num_speculative_tokens=0), "1..16"),
    (dict(method="ngram", num_speculative_tokens=17), "1..16"),
    (dict(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(method="ngram", lookahead=3), "unknown speculative_config keys"),
    (dict(num_speculative_tokens=3), "needs a 'method'"),
    (dict(method="draft_model"), "needs a 'model'"),
])
def test_bad_config(llm, cfg, msg):
    with pytest.raises(ValueError, match=msg): engine(llm, speculative_config=cfg)


def test_draft_with_another_vocabulary(llm):
    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="vocabulary"):
        engine(llm, speculative_config=dict(method="draft_model", model=CausalLM(cfg)))
    assert SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3


def test_server_with_speculation(llm):
    "The real `openai` client against a server whose engine guesses: greedy answers, streamed or not, are plain decoding's; /metrics moves."
    import httpx
    from openai import OpenAI
    from mini_infer.serve.server import build_app, ServerThread
    spec = LLM(engine=engine(llm, speculative_config=dict(method="ngram", num_speculative_tokens=4)))
    msgs = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the dog sat on the log."}]
    want = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40))[0].text
    srv = ServerThread(build_app(spec, model_name="smol"))
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smol", messages=msgs, temperature=0, max_tokens=40)
        assert r.choices[0].message.content == want
        chunks = client.chat.completions.create(model="smol", messages=msgs, temperature=0, max_tokens=40, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        metrics = httpx.get(srv.url + "/metrics").text
        line = lambda name: float(next(l for l in metrics.splitlines() if l.startswith(f"mini_infer_{name} ")).split()[-1])
        assert line("spec_decode_num_accepted_tokens_total") > 0 and 0 < line("spec_decode_draft_acceptance_rate") <= 1
    finally: srv.stop()
