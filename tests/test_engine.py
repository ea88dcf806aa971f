"""Engine equivalence and robustness: batched == alone (chapter 1's sequential path is the oracle), chunked == unchunked,
preempted == not, seeded sampling independent of the batch, stop strings, aborts, bad input, no leaked blocks.
The engines here compute every token in float32 (`prefill_dtype="float32"`), as the oracle does: with bf16 prompt
rows (the default on CPUs that have them) the engine and chapter 1c's loop round different attention sums to bf16,
so they agree only to near-ties; tests/test_prompt_products.py checks that mode against the engine run alone."""
import gc, random, weakref
import pytest, torch
from mini_infer.engine.engine import LLMEngine, InvalidRequest
from mini_infer.engine.llm import LLM, run_to_completion
from mini_infer.engine.reference import generate
from mini_infer.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", kv_cache_memory_gb=0.25, prefill_dtype="float32")


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
    return [o.token_ids for o in generate(llm.model, llm.tokenizer, prompts, params)]


def engine(llm, **kw):
    return LLMEngine(llm.model, llm.tokenizer, **{"kv_cache_memory_gb": 0.25, "prefill_dtype": "float32", **kw})


@pytest.mark.parametrize("kw", [
    dict(),                                                              # defaults: 512-token budget, chunked prefill on
    dict(max_num_batched_tokens=4096),                                   # a big budget: every prompt in the first step
    dict(max_num_batched_tokens=64, max_prefill_chunk=16),               # prompts split into many chunks
    dict(max_num_batched_tokens=64, max_prefill_chunk=16, finish_prompts_first=True),  # a step's prompts finish first
    dict(max_num_batched_tokens=256, enable_chunked_prefill=False),      # whole prompts only
    dict(max_num_batched_tokens=32, enable_chunked_prefill=False, trace=True),  # prompts over the budget run alone
    dict(num_blocks=14, block_size=8, max_prefill_chunk=32),             # a pool for ~2 requests: forced preemption
    dict(max_num_seqs=5),                                                # few seats
], ids=["default", "big-budget", "chunked", "chunked-finish-first", "unchunked", "unchunked-long", "preempt", "few-seats"])
def test_batched_equals_alone(llm, workload, alone, kw):
    prompts, params = workload
    eng = engine(llm, **kw)
    outs = run_to_completion(eng, prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks
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
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks


def test_abort_frees_blocks(llm, workload):
    prompts, _ = workload
    eng = engine(llm, max_num_batched_tokens=64)
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for p in prompts[:6]]
    for _ in range(3): eng.step()
    assert eng.kv.allocator.num_used > 0
    for rid in ids: eng.abort(rid)
    eng.abort(ids[0]); eng.abort("no-such-request")          # harmless
    outs = eng.step()
    assert {o.request_id for o in outs if o.finish_reason == "abort"} == set(ids)
    assert not eng.has_unfinished() and eng.kv.allocator.num_free == eng.kv.allocator.num_blocks


def test_bad_input_rejected_before_taking_blocks(llm):
    eng = engine(llm, num_blocks=4, block_size=8)
    def rejects(param, code=None, **match):
        return pytest.raises(InvalidRequest, **match), param, code
    for call, (ctx, param, code) in [
            (lambda: eng.add_request([5] * 40, SamplingParams()), rejects("prompt", "context_length_exceeded", match="prompt")),  # longer than the pool
            (lambda: eng.add_request([], SamplingParams()), rejects("prompt", match="empty")),
            (lambda: eng.add_request([5, 6], SamplingParams(max_tokens=0)), rejects("max_tokens", match="max_tokens")),
            (lambda: eng.add_request([10**7], SamplingParams()), rejects("prompt", match="token ids")),
            (lambda: eng.add_request([5], {"max_tokens": 3}), rejects(None, match="SamplingParams"))]:
        with ctx as e: call()
        assert (e.value.param, e.value.code) == (param, code)
    rid = eng.add_request([5], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="already in use"): eng.add_request([5], request_id=rid)
    eng.abort(rid); eng.step()
    big = engine(llm)
    with pytest.raises(ValueError, match="context"): big.add_request([5] * (llm.model.config.max_position_embeddings + 1))
    assert eng.kv.allocator.num_free == 4 and not eng.has_unfinished()
    with pytest.raises(ValueError, match="KV pool too small"):    # a budget too small for one sequence: rejected at start-up
        engine(llm, kv_cache_memory_gb=0.001, max_model_len=4096)


def test_llm_generate_runs_on_engine(llm):
    "The API's results, batched on the engine, are the reference loop's: tokens, text and finish reasons."
    prompts = ["The capital of France is", [1, 2, 3], "def fib(n):"]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop=["\n\n"])]
    outs = llm.generate(prompts, params)
    refs = generate(llm.model, llm.tokenizer, prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [(r.token_ids, r.text, r.finish_reason) for r in refs]
    assert outs[0].text and outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    assert llm.engine.kv.allocator.num_free == llm.engine.kv.allocator.num_blocks


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


def test_engine_takes_its_model_over_with_one_copy_of_the_weights_and_frees_its_pool(llm):
    "The backend sets the model's layers up in place (chapter 7 packs the weights): one copy; deleting the engine frees its pool."
    from mini_infer.model.loader import load_model
    from mini_infer.engine.memory_plan import weights_bytes
    model, tok = load_model("smollm2-135m")
    dense = weights_bytes(model)
    eng = LLMEngine(model, tok, kv_cache_memory_gb=0.05)
    assert eng.model is model and eng.memory.weights_bytes == weights_bytes(model)
    assert dense <= eng.memory.weights_bytes < 1.05 * dense                  # packed in place of the loaded weights
    assert len({m.method.__class__.__name__ for m in model.linear_layers()}) == 1
    pool = weakref.ref(eng.cache.k)
    run_to_completion(eng, [[1, 2, 3]], [SamplingParams(max_tokens=2)])
    del eng; gc.collect()
    assert pool() is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_engine_equals_its_reference(dtype):
    """Half types on the CPU (tiny random Qwen2): with PyTorch's attention, greedy tokens batched through the engine equal
    chapter 1's loop in the same dtype. bfloat16 on the C attention, which computes in float32 where PyTorch rounds to
    bfloat16, may differ at near-ties only."""
    from mini_infer.model.model import CausalLM, ModelConfig
    from mini_infer.bench.offline import assert_greedy_close
    cfg = ModelConfig(vocab_size=151, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, architecture="Qwen2ForCausalLM", attention_bias=True, max_position_embeddings=256)
    torch.manual_seed(0)
    model = CausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters(): p.mul_(4)     # bigger weights than the random init: decisive argmaxes
    class NoText:
        eos_token_ids = []
        def decode(self, ids, skip_special_tokens=True): return ""
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in (3, 17, 40, 9)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)] * 4
    ref = generate(model, NoText(), prompts, params)
    for kw in (dict(), dict(max_num_batched_tokens=16, max_prefill_chunk=8)):
        eng = LLMEngine(model, NoText(), num_blocks=64, block_size=4, backend="torch", **kw)
        assert [o.token_ids for o in run_to_completion(eng, prompts, params)] == [o.token_ids for o in ref]
        if dtype == torch.bfloat16:
            eng = LLMEngine(model, NoText(), num_blocks=64, block_size=4, backend="cpu", **kw)
            assert_greedy_close(ref, run_to_completion(eng, prompts, params))

def test_kv_manager_by_name(llm):
    "The KV manager is a plug-in chosen by name; by default the prefix cache's, or the plain one without it."
    from mini_infer.engine.engine import EngineConfig
    from mini_infer.engine.scheduler import KVManager
    assert type(engine(llm, kv_manager="plain").kv) is KVManager
    assert type(engine(llm, enable_prefix_caching=False).kv) is KVManager
    assert type(engine(llm).kv) is not KVManager
    with pytest.raises(ValueError, match="unknown kv_manager 'lifo'; choose from (.*, )?plain, prefix_caching$"): EngineConfig(kv_manager="lifo")


def test_chapter_3s_naive_loop_equals_the_reference():
    "The 30-line continuous-batching loop that chapter 3 grows into the scheduler: chapter 1's tokens, seats reused."
    from mini_infer.course.teaching import continuous_batching, tiny_model, TokenIds
    model = tiny_model()
    prompts = [[(5 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((7, 20, 3, 15, 9))]
    lens = [5, 12, 8, 3, 10]
    ref = generate(model, TokenIds(), prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lens])
    got = continuous_batching(model, prompts, lens, num_blocks=20, block_size=4, max_running=2)
    assert got == [r.token_ids for r in ref]
    with pytest.raises(RuntimeError, match="cannot hold"):
        continuous_batching(model, prompts, lens, num_blocks=2, block_size=4)
