"""Chapter 8's int8 prompt rows (W8A8: int8 activations on AVX-512 VNNI's int8 dot products), decode rows with float32
activations. The oracle of the kernel is `w8a8_reference`: the same quantized activations, each group's integer dot
products summed exactly in float64, then added up in float32 in the kernel's order, so equal to the bit. (It must be:
a last-bit difference before a layer moves an activation across a rounding boundary of the next layer's int8 grid,
and from there the two runs differ by a quantization step, not a rounding.) The oracle of the engine is the same
engine with its prompt rows on that reference, and the engine one request at a time."""
import pytest
import torch
from mini_infer import LLM, SamplingParams
from mini_infer.model.layers import LinearBase, LinearMethod
from mini_infer.model.model import DecoderLayer, ModelConfig
from mini_infer.plugins.cpu import prompt as P
from mini_infer.plugins.cpu.backend import give_prompt_rows
from mini_infer.plugins.quant import Int8Method, Int8Prompts, choose_int8_prompts, linear_int8, w8a8_reference

pytestmark = pytest.mark.skipif(not Int8Prompts.available(), reason="no AVX-512 VNNI on this CPU: int8 prompt rows off")
PROMPTS = ["The capital of France is", "def fib(n):", "List three colours:", "1, 2, 3, 4,",
           "Once upon a time", "The opposite of hot is", "import numpy as np\n", "Q: What is 2+2?\nA:"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=5)
SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3)


def int8_layer(N, K, g, bias, seed=0):
    torch.manual_seed(seed)
    layer = LinearBase(K, [N], bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    layer.set_method(Int8Method(g))
    return layer


@pytest.mark.parametrize("N,K,g,bias", [(37, 64, 64, True), (3072, 576, 64, False), (576, 1536, 64, True),
                                        (50, 96, None, True), (40, 128, 32, False)])
@pytest.mark.parametrize("M", [1, 5, 6, 7, 13, 64])
def test_kernel_equals_exact_integer_sums(N, K, g, bias, M):
    "Every tile height (1-6 rows and remainders), partial panels, per-channel and smaller groups, an outlier input."
    layer = int8_layer(N, K, g, bias)
    x = torch.randn(M, K) * torch.logspace(-2, 1, K)[torch.randperm(K)]
    x[:, 7] *= 40
    y, want = Int8Prompts()(layer, x, "one"), w8a8_reference(layer, x)
    assert torch.equal(y, want)                                   # the same sums, added in the same order
    w8a16 = linear_int8(x, layer)
    assert (y - w8a16).abs().max().item() > 1e-4 * want.abs().max().item()   # the activations really were rounded


def test_each_row_keeps_its_precision_in_any_batch():
    "Decode rows: the int8 kernel's bits. Prompt rows: the W8A8 bits of that row alone. Every product kind."
    torch.manual_seed(0)
    rows = P.PromptRows([1, 1, 5, 3, 1], [0, 0, 5, 1, 1])     # decodes, a chunk, a recomputed row, a lone prompt token
    prompt, other = [2, 3, 4, 5, 6, 7, 10], [0, 1, 8, 9]
    for layer in (m for m in DecoderLayer(SMOL, 0).modules() if isinstance(m, LinearBase)):
        layer.set_method(Int8Method(64))
        layer.method.prompt = Int8Prompts()
        kind, x = P.product_kind(layer), torch.randn(11, layer.in_features)
        run = (lambda v: layer.split(v)) if kind == "split" else layer
        flat = lambda y: torch.cat(y, -1) if isinstance(y, list) else y
        with P.prompt_rows(rows):
            mixed = flat(run(x))
        own = flat(run(x))                                       # no prompt rows set: the int8 kernel for all
        with P.prompt_rows(P.PromptRows([7], [7])):
            alone = flat(run(x[prompt]))
        assert torch.equal(mixed[other], own[other]), kind
        assert torch.equal(mixed[prompt], alone), kind
        assert not torch.equal(mixed[prompt], own[prompt]), f"{kind}: the prompt rows' activations were not rounded"


class Reference(Int8Prompts):
    "The prompt rows' products by `w8a8_reference`, in float32: the engine's oracle."

    def __call__(self, layer, x, kind):
        y = w8a8_reference(layer, x)
        if kind == "glu":
            return LinearMethod.apply_glu(layer.method, layer, x, y)
        return list(y.split(layer.output_sizes, -1)) if kind == "split" else y


def engine(path=Int8Prompts, **kw):
    "The int8 engine with every decoder layer's prompt rows on `path`, whatever the tuning chose."
    llm = LLM("smollm2-135m", device="cpu", quantization="int8", kv_cache_memory_gb=0.05,
              **{"enable_prefix_caching": False, **kw})
    model = llm.engine.model
    for m in model.model.modules():
        if isinstance(m, LinearBase):
            m.method.prompt = path()
    give_prompt_rows(model)
    return llm


def outputs(llm, prompts):
    return [(o.token_ids, [lp.top for lp in o.logprobs]) for o in llm.generate(prompts, GREEDY)]


def test_engine_equals_the_reference_products_batched_and_alone():
    with engine() as llm:
        batched = outputs(llm, PROMPTS * 2)
        alone = [out for p in PROMPTS for out in outputs(llm, [p])]
    with engine(Reference) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert batched == alone * 2
    assert [t for t, _ in alone] == reference


def test_chunks_preemption_prefix_hits_and_speculation_change_nothing():
    long = [p * 6 for p in PROMPTS]
    with engine() as llm:
        ref = outputs(llm, long)
    for kw in (dict(max_num_batched_tokens=16, max_num_seqs=4), dict(num_blocks=12), dict(enable_prefix_caching=True),
               dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4})):
        with engine(**kw) as llm:
            if kw.get("enable_prefix_caching"):
                llm.generate([p[: len(p) // 2] for p in long], SamplingParams(temperature=0, max_tokens=1))
            got = outputs(llm, long)
            preempted = llm.engine.scheduler.num_preemptions
        assert got == ref, kw
        if "num_blocks" in kw:
            assert preempted > 0, "the pool was meant to preempt"


def test_auto_follows_the_tuning_and_float32_keeps_float_activations(monkeypatch, tmp_path):
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path))
    layers = [m for m in DecoderLayer(SMOL, 0).modules() if isinstance(m, LinearBase)]
    for layer in layers:
        layer.set_method(Int8Method(64))
    chosen, said = choose_int8_prompts(layers, "auto")
    speeds = P.tuned_speeds(layers, [Int8Prompts()])
    for layer, path in chosen.items():
        assert (path is not None) == (speeds[P._shape(layer)][Int8Prompts.name] >= P.PAYS), (said, speeds)
    assert choose_int8_prompts(layers, "auto")[1] == said
    for dtype in ("float32", "bfloat16"):
        chosen, said = choose_int8_prompts(layers, dtype)
        assert not any(chosen.values()) and "float32 activations" in said
    with LLM("smollm2-135m", device="cpu", quantization="int8", prefill_dtype="float32", kv_cache_memory_gb=0.05) as llm:
        assert all(m.method.prompt is None for m in llm.engine.model.modules() if isinstance(m, LinearBase))
