"""Engine equivalence and robustness: batched == alone (chapter 1's sequential path is the oracle), chunked == unchunked,
preempted == not, seeded sampling independent of the batch, stop strings, aborts, bad input, no leaked blocks."""
import random
import pytest, torch
from mini_infer.engine import LLM, LLMEngine, run_to_completion
from mini_infer.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m")


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 70))] for _ in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 20), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def alone(llm, workload):
    "Each request run alone through chapter 1's contiguous-cache loop: the oracle."
    prompts, params = workload
    return [llm._generate_one(str(i), p, sp).token_ids for i, (p, sp) in enumerate(zip(prompts, params))]


def engine(llm, **kw):
    return LLMEngine(llm.model, llm.tokenizer, **kw)


@pytest.mark.parametrize("kw", [
    dict(),                                                              # defaults: 512-token budget, chunked prefill on
    dict(max_num_batched_tokens=4096),                                   # a big budget: every prompt in the first step
    dict(max_num_batched_tokens=64, max_prefill_chunk=16),               # prompts split into many chunks
    dict(max_num_batched_tokens=256, enable_chunked_prefill=False),      # whole prompts only
    dict(max_num_batched_tokens=32, enable_chunked_prefill=False, trace=True),  # prompts over the budget run alone
    dict(num_blocks=14, block_size=8, max_prefill_chunk=32),             # a pool for ~2 requests: forced preemption
    dict(max_num_seqs=5),                                                # few seats
], ids=["default", "big-budget", "chunked", "unchunked", "unchunked-long", "preempt", "few-seats"])
def test_batched_equals_alone(llm, workload, alone, kw):
    prompts, params = workload
    eng = engine(llm, **kw)
    outs = run_to_completion(eng, prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.allocator.num_free == eng.allocator.num_blocks
    if "num_blocks" in kw: assert eng.stats()["preemptions_total"] > 0
    if kw.get("trace"):   # whole prompts: every prefill step is one prompt, or prompts that fit the budget together
        for st in eng.trace:
            assert st.num_prefill_tokens <= 32 or [n for _, n, d in st.work] == [st.num_prefill_tokens]
        assert max(st.num_prefill_tokens for st in eng.trace) == max(map(len, prompts))


def test_seeded_sampling_independent_of_batch(llm, workload):
    prompts, _ = workload
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True)
    target = prompts[0]
    alone = run_to_completion(engine(llm), [target], [sp])[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=None)] * 7
    mixed = run_to_completion(engine(llm, max_num_batched_tokens=48, max_prefill_chunk=16), prompts[1:8] + [target] , others + [sp])
    assert mixed[-1].token_ids == alone
    preempted = run_to_completion(engine(llm, num_blocks=8, block_size=8), [target] + prompts[1:4], [sp] + others[:3])
    assert preempted[0].token_ids == alone


def test_stop_string_split_across_tokens(llm):
    eng = engine(llm)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    full = run_to_completion(eng, [prompt], [SamplingParams(temperature=0, max_tokens=40)])[0].text
    assert "5" in full
    stop = full[full.index("4"):full.index("5") + 1]          # e.g. "4, 5": spans several tokens
    assert len(llm.tokenizer.encode(stop)) > 1
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    deltas, reason = [], None
    while eng.has_unfinished():
        for o in eng.step():
            deltas.append(o.text_delta); reason = o.finish_reason or reason
    text = "".join(deltas)
    assert reason == "stop" and text == full[:full.index(stop)] and stop not in text
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_abort_frees_blocks(llm, workload):
    prompts, _ = workload
    eng = engine(llm, max_num_batched_tokens=64)
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for p in prompts[:6]]
    for _ in range(3): eng.step()
    assert eng.allocator.num_used > 0
    for rid in ids: eng.abort(rid)
    eng.abort(ids[0]); eng.abort("no-such-request")          # harmless
    outs = eng.step()
    assert {o.request_id for o in outs if o.finish_reason == "abort"} == set(ids)
    assert not eng.has_unfinished() and eng.allocator.num_free == eng.allocator.num_blocks


def test_bad_input_rejected_before_taking_blocks(llm):
    eng = engine(llm, num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="prompt"): eng.add_request([5] * 40, SamplingParams())       # longer than the pool
    with pytest.raises(ValueError, match="empty"): eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"): eng.add_request([5, 6], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="token ids"): eng.add_request([10**7], SamplingParams())
    big = engine(llm)
    with pytest.raises(ValueError, match="context"): big.add_request([5] * (llm.model.config.max_position_embeddings + 1))
    assert eng.allocator.num_free == 4 and not eng.has_unfinished()
    with pytest.raises(ValueError, match="KV pool too small"):    # a budget too small for one sequence: rejected at start-up
        engine(llm, kv_cache_memory_gb=0.001, max_model_len=4096)


def test_llm_generate_runs_on_engine(llm):
    "The API's results, batched on the engine, are the reference loop's: tokens, text and finish reasons."
    prompts = ["The capital of France is", [1, 2, 3], "def fib(n):"]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop=["\n\n"])]
    outs = llm.generate(prompts, params)
    refs = [llm._generate_one(str(i), llm.encode(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [(r.token_ids, r.text, r.finish_reason) for r in refs]
    assert outs[0].text and outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_seeded_rows_with_different_seeds_in_one_batch(llm, workload):
    "Each seeded request draws from its own generator: batched together they give what each gives alone."
    prompts, _ = workload
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2, 3)]
    alone = [run_to_completion(engine(llm), [p], [sp])[0].token_ids for p, sp in zip(prompts, sps)]
    assert len({tuple(a) for a in alone}) == 3
    assert [o.token_ids for o in run_to_completion(engine(llm), prompts[:3], sps)] == alone


def test_text_held_back_at_max_tokens_is_released(llm):
    "A request that reaches max_tokens while its text ends in a prefix of a stop string still gets that text."
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    full = run_to_completion(engine(llm), [prompt], [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)])[0]
    stop = full.text[-2:] + "\x00never"                          # its start is the text's tail; the rest never comes
    eng = engine(llm)
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]))
    deltas, last = [], None
    while eng.has_unfinished():
        for o in eng.step(): deltas.append(o.text_delta); last = o
    assert "".join(deltas) == full.text and last.finished and last.finish_reason == "length"
