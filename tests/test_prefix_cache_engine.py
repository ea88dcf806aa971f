"""The prefix cache on the real model: greedy tokens and their logprobs (top 5, within 1e-4) are those of the same engine
with the cache off, for a full hit at an exact multiple of 16, a partial tail, sharing inside one batch, hits after
preemption, chunks not aligned to blocks, and eviction in the middle of a run; also with a hash that always collides."""
import random
import pytest
from mini_infer.engine.engine import LLMEngine, InvalidRequest
from mini_infer.engine.llm import LLM, run_to_completion
from mini_infer.plugins.prefix_cache import PrefixCachingAllocator
from mini_infer.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", num_blocks=64)


def rand_ids(rng, n): return [rng.randrange(100, 40000) for _ in range(n)]


def engine(llm, **kw): return LLMEngine(llm.model, llm.tokenizer, **{"num_blocks": 64, **kw})


def same_outputs(got, want):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.top.keys() == b.top.keys() and max(abs(a.top[t] - b.top[t]) for t in a.top) <= 1e-4


def check_against_uncached(llm, batches, **kw):
    "Run the batches one after another on a caching engine and on one without the cache; return the caching engine."
    on, off = engine(llm, **kw), engine(llm, enable_prefix_caching=False, **kw)
    for prompts in batches:
        same_outputs(run_to_completion(on, prompts, [GREEDY] * len(prompts)), run_to_completion(off, prompts, [GREEDY] * len(prompts)))
        on.kv.allocator.check()
    assert off.stats().get("prefix_cache_hits_total") is None and on.kv.allocator.num_free == on.kv.allocator.num_blocks
    return on


def test_full_hit_at_a_multiple_of_16_recomputes_the_last_block(llm):
    prompt = rand_ids(random.Random(1), 64)
    on = check_against_uncached(llm, [[prompt], [prompt]])
    first, again = (run_to_completion(on, [prompt], [GREEDY])[0] for _ in range(2))
    assert first.num_cached_tokens == again.num_cached_tokens == 48      # 4 blocks cached, the 4th recomputed for its logits


def test_partial_tail_and_sharing_inside_one_batch(llm):
    rng = random.Random(2)
    system = rand_ids(rng, 40)
    batch = [system + rand_ids(rng, k) for k in (1, 7, 16, 30)]
    on = check_against_uncached(llm, [batch, batch])
    s = on.stats()
    # batch 1: 32 tokens (2 blocks) shared by the three later prompts; batch 2: every prompt's full blocks but never its last token
    assert s["prefix_cache_hits_total"] == 3 * 32 + sum((len(p) - 1) // 16 * 16 for p in batch)


def test_hits_after_preemption_are_counted_apart(llm):
    rng = random.Random(3)
    prompts = [rand_ids(rng, 40) for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    on, off = engine(llm, num_blocks=12, block_size=8), engine(llm, num_blocks=12, block_size=8, enable_prefix_caching=False)
    same_outputs(run_to_completion(on, prompts, [params] * 4), run_to_completion(off, prompts, [params] * 4))
    s = on.stats()
    assert s["preemptions_total"] > 0 and s["prefix_cache_preempted_hits_total"] > 0 and s["prefix_cache_hits_total"] == 0


def test_cached_tokens_of_preempted_requests_are_those_found_at_admission(llm):
    """A request's `num_cached_tokens` counts the prompt tokens found cached when it was admitted; a preempted request
    that resumes on (its own) cached blocks does not count them again."""
    rng = random.Random(13)
    system = rand_ids(rng, 24)
    prompts = [system + rand_ids(rng, 16) for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    on, off = engine(llm, num_blocks=12, block_size=8), engine(llm, num_blocks=12, block_size=8, enable_prefix_caching=False)
    run_to_completion(on, [system + rand_ids(rng, 3)], [params])                     # the system prompt's 3 blocks cached
    same_outputs(run_to_completion(on, prompts, [params] * 4), run_to_completion(off, prompts, [params] * 4))
    s, outs = on.stats(), None
    assert s["preemptions_total"] > 0 and s["prefix_cache_preempted_hits_total"] > 0
    outs = run_to_completion(engine(llm, num_blocks=12, block_size=8), [system + rand_ids(rng, 3)] + prompts, [params] * 5)
    assert [o.num_cached_tokens for o in outs[1:]] == [24] * 4


def test_a_fully_cached_prompt_is_still_scheduled(llm):
    """A prompt of whole blocks seen before: every block but the one holding its last token is a hit, since the last
    token must run for its logits. (Were it a hit too, nothing would be left to schedule: the scheduler would raise.)"""
    prompt = rand_ids(random.Random(14), 64)
    eng = engine(llm)
    first = run_to_completion(eng, [prompt], [GREEDY], max_steps=20)[0]
    again = run_to_completion(eng, [prompt], [GREEDY], max_steps=20)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 48


def test_chunks_not_aligned_to_blocks(llm):
    rng = random.Random(4)
    system = rand_ids(rng, 70)
    batch = [system + rand_ids(rng, k) for k in (3, 21, 40)]
    check_against_uncached(llm, [batch[:1], batch], max_prefill_chunk=23, max_num_batched_tokens=40)


def test_eviction_in_the_middle_of_a_run(llm):
    rng = random.Random(5)
    systems = [rand_ids(rng, 48) for _ in range(4)]
    batches = [[s + rand_ids(rng, 5)] for s in systems] + [[systems[0] + rand_ids(rng, 9), systems[3] + rand_ids(rng, 2)]]
    on = check_against_uncached(llm, batches, num_blocks=12)
    assert on.stats()["prefix_cache_evictions_total"] > 0


def test_a_hash_that_always_collides_changes_nothing(llm):
    rng = random.Random(6)
    system = rand_ids(rng, 50)
    batches = [[system + rand_ids(rng, k) for k in (2, 20)], [system + rand_ids(rng, 3)]]
    on, off = engine(llm), engine(llm, enable_prefix_caching=False)
    on.kv.allocator.hash_fn = lambda *a: b"collision"
    for prompts in batches:
        same_outputs(run_to_completion(on, prompts, [GREEDY] * len(prompts)), run_to_completion(off, prompts, [GREEDY] * len(prompts)))
    on.kv.allocator.check()


def test_salts_isolate_and_bad_salts_are_rejected(llm):
    prompt = rand_ids(random.Random(7), 40)
    eng = engine(llm)
    outs = [run_to_completion_salted(eng, prompt, salt) for salt in ("a", "a", "b", None)]
    assert [o.num_cached_tokens for o in outs] == [0, 32, 0, 0]
    assert len({tuple(o.token_ids) for o in outs}) == 1
    for bad in ("", 3, ["x"]):
        with pytest.raises(InvalidRequest, match="cache_salt") as e: eng.add_request(prompt, GREEDY, cache_salt=bad)
        assert e.value.param == "cache_salt"


def run_to_completion_salted(eng, prompt, salt):
    rid = eng.add_request(prompt, GREEDY, cache_salt=salt)
    seq = eng.seqs[rid]
    while eng.has_unfinished(): eng.step()
    return seq.output()


def test_a_pool_full_of_cached_blocks_still_admits(llm):
    eng = engine(llm, num_blocks=8)
    rng = random.Random(8)
    run_to_completion(eng, [rand_ids(rng, 60)], [GREEDY])
    assert eng.kv.allocator.num_cached_free >= 3
    out = run_to_completion(eng, [rand_ids(rng, 100)], [GREEDY])[0]     # needs 7 of the 8 blocks: evicts
    assert len(out.token_ids) == 6 and eng.stats()["prefix_cache_evictions_total"] > 0
    assert isinstance(eng.kv.allocator, PrefixCachingAllocator)


def test_longest_prefix_admission_keeps_outputs_and_computes_less(llm):
    rng = random.Random(9)
    heads = [rand_ids(rng, 96) for _ in range(3)]
    arrivals = [heads[i % 3] + rand_ids(rng, 5) for i in range(9)]
    runs = {}
    for policy in ("fcfs", "longest_prefix"):
        eng = engine(llm, num_blocks=16, max_num_seqs=2, policy=policy)
        runs[policy] = (run_to_completion(eng, arrivals, [GREEDY] * len(arrivals)), eng)
        eng.kv.allocator.check()
    same_outputs(runs["longest_prefix"][0], runs["fcfs"][0])
    hits = {p: e.stats()["prefix_cache_hits_total"] for p, (_, e) in runs.items()}
    assert hits["longest_prefix"] > hits["fcfs"]


def test_admission_policy_is_checked():
    from mini_infer.engine.engine import EngineConfig
    with pytest.raises(ValueError, match="unknown policy"): EngineConfig(policy="lifo")


def test_longest_prefix_needs_the_cache(llm):
    with pytest.raises(ValueError, match="needs the prefix cache"): engine(llm, policy="longest_prefix", enable_prefix_caching=False)
