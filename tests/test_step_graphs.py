"""Chapter 7's step graphs: a decode step's kernel calls recorded once and replayed from C. The oracle is the same engine
with `enforce_eager=True`, every step in Python: the same tokens and the same logprobs, bit for bit. Bitwise is
right on any CPU: a replay makes the very kernel calls the Python step makes, on the same inputs, in the same order
(a step that PyTorch would compute in is refused, not recorded)."""
import dataclasses, warnings
import pytest, torch

from mini_infer.plugins.cpu.build import recording
from mini_infer.plugins.cpu.linear import linear_kernels, linear_packed, pack_weight
from mini_infer.plugins.cpu.replay import GRAPH_MAX_TOKENS, StepGraph, StepGraphs, call_runner
from mini_infer.plugins.cpu.backend import KernelOps
from mini_infer.engine.engine import LLMEngine
from mini_infer.engine.llm import run_to_completion
from mini_infer.model.model import CausalLM, ModelConfig
from mini_infer.engine.sampling import SamplingParams
from test_quant import NoText, TINY, tiny_model

pytestmark = pytest.mark.skipif(linear_kernels() is None or call_runner() is None, reason="no C compiler for the CPU kernels")
ops = KernelOps()


def test_a_replay_computes_on_the_new_values():
    torch.manual_seed(0)
    a, b, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(40, 64)
    packed, gain = pack_weight(w, linear_kernels().packed_block()), torch.rand(64)
    def f(a, b): return linear_packed(ops.rms_norm(ops.add(a, b), gain, 1e-6), packed, 40)
    with torch.inference_mode():
        g = StepGraph(f, a, b)
        assert len(g) == 3 and torch.equal(g.output, f(a, b))
        for _ in range(3):
            a.copy_(torch.randn(5, 64)); b.copy_(torch.randn(5, 64))
            assert torch.equal(g.replay(), f(a, b))


def test_recording_refuses_what_pytorch_computes():
    a = torch.randn(4, 64)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="a replay would skip it"): StepGraph(lambda a: ops.add(a * 2, a), a)
        with pytest.raises(RuntimeError, match="a replay would skip it"): StepGraph(lambda a: ops.add(a.t().reshape(4, 64), a), a)  # a copying reshape
    assert getattr(recording, "calls", None) is None      # nothing is left recording
    assert torch.equal(ops.add(a, a), a * 2)   # a + a is exactly 2a in IEEE arithmetic


def _run(model, prompts, params, **kw):
    eng = LLMEngine(model, NoText(), **kw)
    outs = [run_to_completion(eng, prompts[:n], params[:n]) for n in (1, 2, len(prompts))]   # alone, in twos, all together
    return [[(o.token_ids, o.logprobs) for o in batch] for batch in outs], eng


@pytest.mark.parametrize("kw", [dict(), dict(quantization="int8"), dict(quantization="int8", kv_cache_dtype="int8"), dict(kv_cache_dtype="int8"),
                                dict(max_num_batched_tokens=16, max_prefill_chunk=8), dict(num_blocks=20), dict(enable_prefix_caching=False)])
def test_replayed_steps_equal_python_steps(kw):
    "Greedy and seeded sampling, logprobs included; int8 weights and KV, chunked prefill, preemption (20 blocks), no prefix cache."
    model = tiny_model()
    torch.manual_seed(1)
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in (3, 17, 40, 9, 25, 6, 11, 30, 4, 14)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=14, ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    kw = dict(num_blocks=64, block_size=4) | kw
    replayed, eng = _run(model, prompts, params, **kw)
    python, _ = _run(model, prompts, params, enforce_eager=True, **kw)
    assert replayed == python
    rows = {rows for rows, *_ in eng.runner.model.graphs}
    assert isinstance(eng.runner.model, StepGraphs) and {1, 2} <= rows and max(rows) <= GRAPH_MAX_TOKENS
    assert all(g is not None for g in eng.runner.model.graphs.values())


def test_a_step_that_cannot_be_recorded_runs_in_python_with_a_warning():
    "int8 q/k/v that are not whole panels come out of one product as strided views: copying them is PyTorch's work."
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, hidden_size=40, num_attention_heads=2, num_key_value_heads=1)    # q 40, k and v 20 columns
    model = CausalLM(cfg).eval()
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in (5, 12, 7)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replayed, eng = _run(model, prompts, params, num_blocks=64, block_size=4, quantization="int8")
    assert any("cannot be recorded and run in Python" in str(w.message) for w in caught)
    by_rows = {rows: g for (rows, *_), g in eng.runner.model.graphs.items()}
    assert by_rows[1] is not None and by_rows[2] is None     # one row records; two do not
    assert replayed == _run(model, prompts, params, num_blocks=64, block_size=4, quantization="int8", enforce_eager=True)[0]


def test_enforce_eager_records_nothing():
    eng = LLMEngine(tiny_model(), NoText(), num_blocks=64, block_size=4, enforce_eager=True)
    assert eng.runner.model is eng.model and eng.backend.replay_limits is None


def test_a_weight_changed_in_place_is_seen_by_the_replays():
    "The packed weights are the model's: a weight changed in place is read, as it is now, by the replays."
    model = tiny_model()
    torch.manual_seed(2)
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in (4, 9)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)] * 2
    graphed, eager = (LLMEngine(model, NoText(), num_blocks=64, block_size=4, enforce_eager=e) for e in (False, True))
    def run(eng): return [(o.token_ids, o.logprobs) for o in run_to_completion(eng, prompts, params)]
    before = run(graphed)
    assert before == run(eager)
    with torch.no_grad(): model.model.layers[0].mlp.down_proj.weight.mul_(-1)
    after = run(graphed)
    assert after == run(eager) and after != before
    assert all(g is not None for g in graphed.runner.model.graphs.values())


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_steps_replay_too(method):
    "Verify rows (1 + k tokens) go to the decode kernel one query at a time: recorded by their number of tokens, same results."
    model = tiny_model()
    spec = dict(method=method, num_speculative_tokens=3, adaptive=False) | (dict(prompt_lookup_min=1) if method == "ngram" else dict(model=model))
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12]]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1), SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True)]
    runs = {}
    for eager in (False, True):
        eng = LLMEngine(model, NoText(), num_blocks=64, block_size=4, enforce_eager=eager, speculative_config=spec)
        runs[eager] = [[(o.token_ids, o.logprobs) for o in run_to_completion(eng, prompts[:n], params[:n])] for n in (1, 2)]
        if not eager: replayed = eng
    assert runs[False] == runs[True] and replayed.scheduler.proposer.counters["drafts"] > 0
    assert max(tokens for tokens, *_ in replayed.runner.model.graphs) > 2     # a step with guesses was recorded


def test_padded_steps_equal_python_steps_and_keep_padding_in_the_scratch_block():
    """Steps of sizes that were not recorded (17-20 decode rows, verify rows of 1 + 7 at batch 6) run
    padded up to the next recorded size; their tokens are Python's, and the padding rows write only
    the scratch block past the pool's end."""
    from mini_infer.plugins.cpu.replay import GRAPH_SIZES, scratch_block
    model = tiny_model()
    torch.manual_seed(3)
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in range(3, 23)]          # 20 requests
    params = [SamplingParams(temperature=0 if i % 4 else 0.7, seed=i, max_tokens=12, ignore_eos=True, logprobs=1) for i in range(20)]
    spec = dict(method="ngram", num_speculative_tokens=7, adaptive=False, prompt_lookup_min=1, disable_by_batch_size=None)
    copy = [[5, 6, 7, 8, 9, 10, 11, 12] * 4] * 6                                    # verify rows of 8 tokens, 48 in a step
    copy_params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 6
    runs, engines = {}, {}
    for eager in (False, True):
        engines[eager] = (plain := LLMEngine(model, NoText(), num_blocks=200, block_size=4, enforce_eager=eager),
                          spec_eng := LLMEngine(model, NoText(), num_blocks=200, block_size=4, enforce_eager=eager, speculative_config=spec))
        runs[eager] = ([(o.token_ids, o.logprobs) for o in run_to_completion(plain, prompts, params)],
                       [o.token_ids for o in run_to_completion(spec_eng, copy, copy_params)])
    assert runs[False] == runs[True]   # padding rows change no real row: every kernel computes a row alone
    plain, spec_eng = engines[False]
    for eng in (plain, spec_eng):
        assert scratch_block(eng.cache) == eng.cache.num_blocks
        sizes = {size for size, *_ in eng.runner.model.graphs}
        assert sizes <= set(GRAPH_SIZES) and max(sizes) > 16                             # a padded size was recorded
        k, n = eng.cache.k, eng.cache.num_blocks
        scratch = k.as_strided((len(k), *k.shape[2:]), (k.stride(0), *k.stride()[2:]), k.storage_offset() + n * k.stride(1))
        assert torch.signbit(scratch).any()                 # the padding rows wrote there (-0.0: K of their zeroed hidden states)
    assert spec_eng.scheduler.proposer.counters["drafts"] > 0


def test_recordings_share_one_activation_area_counted_by_the_memory_plan():
    "Every recording's activations lie in one area, sized for the largest replayed step before the pool; the plan counts it."
    from mini_infer.engine.memory_plan import plan_memory
    model = tiny_model()
    torch.manual_seed(4)
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in range(3, 23)] * 2
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(prompts)
    eng = LLMEngine(model, NoText(), num_blocks=200, block_size=4)
    for n in (1, 2, 5, 20, 40): run_to_completion(eng, prompts[:n], params[:n])     # decode steps of several sizes
    area, graphs = eng.runner.model.area, [g for g in eng.runner.model.graphs.values() if g is not None]
    # the plan's reserve is this area plus the bf16 weight copies of the prompt paths (none where prompts run in float32)
    copies = sum(path.held_bytes(layer) for layer, path in getattr(eng.backend, "prompt_paths", {}).items())
    assert area.nbytes > 0 and eng.memory.safety_bytes == area.nbytes + copies and len(graphs) > 3
    base = area.buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for g in graphs for t in g.tensors)
    assert max(g.activation_bytes for g in graphs) <= area.nbytes < sum(g.activation_bytes for g in graphs)
    with torch.inference_mode():     # the largest replayed step fits: GRAPH_MAX_TOKENS one-token rows, recorded in the area
        eng.runner.model(eng.cache.make_step([([1], 0, [0], 1)] * GRAPH_MAX_TOKENS), eng.cache)
    largest = eng.runner.model.graphs[GRAPH_MAX_TOKENS, eng.cache.k.data_ptr(), torch.get_num_threads()]
    assert largest is not None and largest.activation_bytes <= area.nbytes
    cfg = model.config       # a budget the plan derives (the CPU's default 1 GB) is what is left after the area
    plain, counted = (plan_memory(cfg, block_size=4, activation_bytes=b) for b in (0, 2**27))
    assert counted.num_blocks < plain.num_blocks and counted.safety_bytes == 2**27
    assert plan_memory(cfg, kv_cache_memory_gb=0.01, activation_bytes=2**27).num_blocks == plan_memory(cfg, kv_cache_memory_gb=0.01).num_blocks


def test_verify_rows_of_eight_guesses_replay():
    "A verify row of 1 + 8 tokens is a short row (`SHORT_ROW`): its step is recorded and replayed, with Python's tokens."
    from mini_infer.plugins.cpu.attention import SHORT_ROW
    assert SHORT_ROW >= 9 and StepGraphs.replay_limits[1] == SHORT_ROW
    model = tiny_model()
    spec = dict(method="ngram", num_speculative_tokens=8, adaptive=False, prompt_lookup_min=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13] * 4]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)]
    runs = {}
    for eager in (False, True):
        eng = LLMEngine(model, NoText(), num_blocks=64, block_size=4, enforce_eager=eager, speculative_config=spec)
        runs[eager] = [(o.token_ids, o.logprobs) for o in run_to_completion(eng, prompts, params)]
        if not eager: replayed = eng
    assert runs[False] == runs[True]
    graphs = replayed.runner.model.graphs
    assert any(size == 9 and g is not None for (size, *_), g in graphs.items())   # a step of one row of 1 + 8, recorded
    assert replayed.scheduler.proposer.counters["drafts"] > 0
