"""Prompt rows on the CPU's bf16 products (chapter 7), decode rows in float32: per row, whatever shares the step.

A prompt row is a token whose position lies inside its request's prompt: a prefill chunk, the lone last prompt token
after a prefix-cache hit, the prompt part of a request recomputed after preemption. Generated tokens (decode rows,
verify rows of speculation, the generated part of a recomputed request) stay float32. Each path is checked on its own
(the tuner would pick one); the token-for-token oracle is the same engine run one request at a time (the same products
at the same precision, the same attention kernels); chapter 1c's one-request loop on the engine's model (its prompt
forward on the same path, PyTorch's attention) agrees up to near-ties. Bitwise comparisons below compare the same kernel on the same rows: a row-invariant product gives a row
the same bits in any batch on any CPU, which is what `row_invariant` checks and the tuner requires."""
import pytest
import torch
from mini_infer import LLM, SamplingParams
from mini_infer.engine.reference import generate
from mini_infer.model.layers import LinearBase
from mini_infer.model.model import DecoderLayer, ModelConfig
from mini_infer.plugins.cpu import prompt as P
from mini_infer.plugins.cpu.packed import PackedMethod

PATHS = [p for p in P.PROMPT_PATHS if p.available()]
pytestmark = pytest.mark.skipif(not PATHS, reason="no bf16 dot products on this CPU: prompt rows stay float32")
PROMPTS = ["The capital of France is", "def fib(n):", "List three colours:", "1, 2, 3, 4,",
           "Once upon a time", "The opposite of hot is", "import numpy as np\n", "Q: What is 2+2?\nA:"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=5)
SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3)


def test_prompt_rows_index_the_tokens():
    r = P.PromptRows([1, 1, 5, 3], [0, 0, 5, 1])
    assert r.prompt == slice(2, 8) and r.other.tolist() == [0, 1, 8, 9] and not r.all and r.tokens == 10
    assert P.PromptRows([4, 2], [4, 2]).all
    assert P.PromptRows([1, 6], [0, 6]).other == slice(0, 1)
    step = type("Step", (), {"query_lens": [1, 1], "prompt_counts": [0, 0]})
    assert P.PromptRows.of(step) is None                      # a decode step: every row float32
    step.prompt_counts = None
    assert P.PromptRows.of(step) is None                      # counts not known (a draft model's steps)
    one = type("Step", (), {"input_ids": torch.zeros(7), "prompt_counts": [7]})   # chapter 1's contiguous step
    assert P.PromptRows.of(one).all


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.__name__)
def test_each_row_keeps_its_precision_in_any_batch(path):
    "Decode rows: the float32 tile's bits. Prompt rows: the path's bits for that row alone. Every product kind."
    torch.manual_seed(0)
    rows = P.PromptRows([1, 1, 5, 3, 1], [0, 0, 5, 1, 1])     # decodes, a chunk, a recomputed row, a lone prompt token
    prompt, other = [2, 3, 4, 5, 6, 7, 10], [0, 1, 8, 9]
    for layer in (m for m in DecoderLayer(SMOL, 0).modules() if isinstance(m, LinearBase)):
        layer.set_method(PackedMethod(path()))
        kind, x = P.product_kind(layer), torch.randn(11, layer.in_features)
        run = (lambda v: layer.split(v)) if kind == "split" else layer
        flat = lambda y: torch.cat(y, -1) if isinstance(y, list) else y
        with P.prompt_rows(rows):
            mixed = flat(run(x))
        float32 = flat(run(x))                                  # no prompt rows set: all float32
        with P.prompt_rows(P.PromptRows([7], [7])):
            alone = flat(run(x[prompt]))                        # the prompt rows on their own, all prompt
        assert torch.equal(mixed[other], float32[other]), kind
        assert torch.equal(mixed[prompt], alone), kind
        assert not torch.equal(mixed[prompt], float32[prompt]), f"{kind}: the prompt rows were not rounded"
        assert torch.allclose(mixed, float32, rtol=0.05, atol=0.05), kind   # bf16 inputs: ~2^-8 relative each


@pytest.fixture(params=PATHS, ids=lambda p: p.__name__)
def one_path(request, monkeypatch, tmp_path):
    "The engine with prompt rows on this path alone (a tuning of its own, in a fresh cache)."
    monkeypatch.setattr(P, "PROMPT_PATHS", (request.param,))
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path))
    return request.param


def engine(**kw):
    return LLM("smollm2-135m", device="cpu", prefill_dtype="bfloat16", kv_cache_memory_gb=0.05, **kw)


def outputs(llm, prompts):
    "Each output's tokens and top-5 logprobs: equal outputs have the same bits."
    return [(o.token_ids, [lp.top for lp in o.logprobs]) for o in llm.generate(prompts, GREEDY)]


def test_batched_equals_alone_and_the_reference_up_to_near_ties(one_path):
    """The oracle: the same engine, one request at a time (the same products and the same attention kernels). Chapter
    1c's loop attends with PyTorch's SDPA, whose float32 sums differ in the last bits; rounded to bf16 at the next
    product, they can move a logit by ~2^-8 relative, so against it only near-ties may differ."""
    from mini_infer.bench.offline import assert_greedy_close
    with engine(enable_prefix_caching=False) as llm:
        assert any(isinstance(m.method, PackedMethod) and m.method.prompt is not None
                   for m in llm.engine.model.modules() if isinstance(m, LinearBase))
        batched = outputs(llm, PROMPTS * 2)                                     # 16 rows in one batch
        alone = [out for p in PROMPTS for out in outputs(llm, [p])]
        ours = llm.generate(PROMPTS, GREEDY)
        reference = generate(llm.engine.model, llm.tokenizer, PROMPTS, GREEDY)
    assert batched == alone * 2
    assert_greedy_close(reference, ours)


def test_chunks_preemption_prefix_hits_and_speculation_change_nothing(one_path):
    """Each of these moves prompt tokens between steps, or recomputes them: tokens and logprobs keep their bits. A
    prompt token always takes the prefill attention kernel, however its prompt was cut (chapter 7b's plan)."""
    long = [p * 6 for p in PROMPTS]                               # 30-60 tokens: chunks of 16 or 7 split them
    with engine(enable_prefix_caching=False) as llm:
        ref = outputs(llm, long)
    variants = [dict(max_num_batched_tokens=16, max_num_seqs=4),   # chunked prefill
                dict(max_num_batched_tokens=20, max_prefill_chunk=7),   # chunks shorter than a verify row
                dict(num_blocks=12),                               # too few blocks: preemption, recompute
                dict(enable_prefix_caching=True),
                dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4})]
    for kw in variants:
        with engine(**{"enable_prefix_caching": False, **kw}) as llm:
            if kw.get("enable_prefix_caching"):   # the second run hits the cache mid-prompt, on prompt tokens only
                llm.generate([p[: len(p) // 2] for p in long], SamplingParams(temperature=0, max_tokens=1))
            got = outputs(llm, long)
            preempted = llm.engine.scheduler.num_preemptions
        assert got == ref, kw
        if "num_blocks" in kw:
            assert preempted > 0, "the pool was meant to preempt"


def test_float32_is_exact_and_auto_follows_the_tuning(monkeypatch, tmp_path):
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path))
    with LLM("smollm2-135m", device="cpu", prefill_dtype="float32", kv_cache_memory_gb=0.05) as llm:
        methods = [m.method for m in llm.engine.model.modules() if isinstance(m, LinearBase)]
        assert all(getattr(m, "prompt", None) is None for m in methods)
        f32 = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM("smollm2-135m", device="cpu", backend="torch", kv_cache_memory_gb=0.05) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == f32   # the plain PyTorch engine agrees
    layers = [m for m in DecoderLayer(SMOL, 0).modules() if isinstance(m, LinearBase)]
    for layer in layers:
        layer.set_method(PackedMethod())
    chosen, said = P.choose_prompt_paths(layers, "auto")
    speeds = P.tuned_speeds(layers)
    for layer, path in chosen.items():
        best = max((s for s in speeds[P._shape(layer)].values() if s is not None), default=0)
        assert (path is not None) == (best >= P.PAYS), (said, speeds)
    assert P.choose_prompt_paths(layers, "auto")[1] == said              # kept: the same choice every run
    with pytest.raises(ValueError, match="choose from float32, bfloat16, auto"):
        P.choose_prompt_paths(layers, "fp8")
