"""Chapter 8: int8 weights and the int8 KV cache. The PyTorch dequantize-then-matmul path is the oracle for the C kernel,
float attention over the dequantized pool is the oracle for int8-KV attention, and chapter 1's loop is the oracle for
the engine with int8 weights."""
import pytest, torch
from hypothesis import given, settings, strategies as st

from mini_infer.engine.block_manager import BlockAllocator, BlockTable
from mini_infer.engine.engine import EngineConfig, LLMEngine
from mini_infer.engine.kv_cache import PagedKVCache
from mini_infer.engine.llm import LLM, run_to_completion
from mini_infer.model.model import CausalLM, ModelConfig
from mini_infer.engine.attention import TorchAttention
from mini_infer.model.layers import GateUpLinear, LinearBase, QKVLinear
from mini_infer.plugins.cpu.linear import linear_packed, pack_weight, linear_glu_packed, pack_glu, unpack_panels
from mini_infer.plugins.cpu.attention import paged_decode_kernel
from mini_infer.plugins.cpu.int8 import int8_attention_kernels, int8_kernels, paged_decode_int8
from mini_infer.plugins.quant import (Int8KVAttention, Int8Method, dequantize_int8, dequantize_kv, linear_int8, panel_width,
                                      quantize_int8, quantize_kv, quantize_model)
from mini_infer.engine.reference import generate
from mini_infer.engine.sampling import SamplingParams

TINY = ModelConfig(vocab_size=151, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, architecture="Qwen2ForCausalLM", attention_bias=True, max_position_embeddings=256)


class NoText:
    eos_token_ids = []
    def decode(self, ids, skip_special_tokens=True): return ""


def tiny_model(tied=False):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": tied})).eval()
    with torch.no_grad():
        for p in model.parameters(): p.mul_(4)     # decisive argmaxes
    return model


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 9), groups=st.integers(1, 4), g=st.sampled_from([None, 4, 16]), scale=st.floats(1e-3, 1e3),
       outlier=st.booleans(), seed=st.integers(0, 2**16))
def test_round_trip_within_half_a_step(n, groups, g, scale, outlier, seed):
    "Every dequantized weight is within half a quantization step (scale / 2) of the original; zero rows stay zero."
    K = groups * (g or 8)
    w = torch.randn(n, K, generator=torch.Generator().manual_seed(seed)) * scale
    if outlier: w[0, 0] = 100 * scale
    w[-1] = 0
    q, s = quantize_int8(w, g)
    assert q.dtype == torch.int8 and s.shape == (n, K // (g or K)) and q.abs().max() <= 127
    step = s.repeat_interleave(K // s.shape[1], 1)
    assert ((dequantize_int8(q, s) - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert (dequantize_int8(q, s)[-1] == 0).all()   # exactly: 0 times any scale is 0
    p = quantize_kv(w.view(n, -1, 4))
    kv_step = w.view(n, -1, 4).abs().amax(-1, keepdim=True) / 127
    assert ((dequantize_kv(p) - w.view(n, -1, 4)).abs() <= kv_step / 2 * (1 + 1e-6) + 1e-30).all()


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="must divide"): quantize_int8(torch.randn(4, 96), 64)


needs_kernel = pytest.mark.skipif(int8_kernels() is None, reason="the int8 C kernel does not build here")


def int8_layer(w, b=None, g=None, layer=None, use_kernels=True):
    "A layer holding weight `w` (and bias `b`), quantized to int8 in place."
    layer = layer or LinearBase(w.shape[1], [w.shape[0]], b is not None)
    layer.set_weights(w, b)
    layer.set_method(Int8Method(g, use_kernels))
    return layer


def dequantized(layer): return layer.method.dense(layer)[0]


@needs_kernel
@pytest.mark.parametrize("g", [None, 64])
@pytest.mark.parametrize("N,K,bias", [(37, 64, True), (256, 576, False), (101, 1536, True), (50, 100, True)])
def test_kernel_equals_dequantize_then_matmul(N, K, bias, g):
    """`linear_int8` equals F.linear over the dequantized weight within float32 summation error: |y - ref| <=
    2 K 2^-24 (|x| @ |W|.T), both sums being K products each rounded once; and chapter 7's `linear_packed` over the
    dequantized weight bit for bit, for row counts on both sides of the direct/dequantized switch (24 rows with AVX-512).
    Rows are computed alike in any batch: bit-equal."""
    if g and K % g: pytest.skip("group does not divide K")
    torch.manual_seed(N + K)
    layer = int8_layer(torch.randn(N, K), torch.randn(N) if bias else None, g)
    w = dequantized(layer)
    packed, nb = pack_weight(w, panel_width()), panel_width()
    for M in (1, 2, 3, 4, 5, 13, 24, 25, 64, 65, 130, 300):
        x = torch.randn(M, K)
        y, ref = linear_int8(x, layer), torch.nn.functional.linear(x, w, layer.bias)
        assert ((y - ref).abs() <= 2 * K * 2**-24 * (x.abs() @ w.abs().T) + 1e-6).all()
        b = torch.nn.functional.pad(layer.bias, (0, -N % nb)) if bias else None
        # bit for bit on any CPU: float(q) * scale is the number `dequantize_int8` computes (two correctly rounded
        # operations), then the same FMA chain over k as chapter 7's tile, a row alone
        assert torch.equal(y, linear_packed(x, packed, N, b))
        assert torch.equal(y[-1], linear_int8(x[-1:], layer)[0]) and torch.equal(y[:3], linear_int8(x[:3], layer))


@needs_kernel
@pytest.mark.parametrize("g", [None, 64])
def test_glu_kernel_equals_chapter_7s(g):
    """An int8 gate/up layer's SwiGLU in one kernel pass equals chapter 7's `linear_glu_packed` over the dequantized
    halves bit for bit (the direct path up to 4 rows, the dequantized copy with chapter 7's wide tile beyond), and
    PyTorch's silu(g) * u within float rounding."""
    N, K = 3 * panel_width(), 128
    torch.manual_seed(5)
    layer = int8_layer(torch.randn(2 * N, K) / 8, None, g, GateUpLinear(K, N))
    wg, wu = dequantized(layer).chunk(2)
    packed = pack_glu(wg, wu, panel_width())
    with torch.inference_mode():
        for M in (1, 2, 3, 4, 5, 7, 13, 40):
            x = torch.randn(M, K)
            y = layer(x)
            assert torch.equal(y, linear_glu_packed(x, packed, N))   # the same FMA chains on the same float weights
            torch.testing.assert_close(y, torch.nn.functional.silu(x @ wg.T) * (x @ wu.T), atol=1e-5, rtol=1e-4)
            assert torch.equal(y[-1:], layer(x[-1:]))   # a row alone: the same chains


@pytest.mark.parametrize("N", [3 * 32, 3 * 32 + 2])
def test_plain_pytorch_int8_glu_is_silu_gate_times_up(N):
    "Without the kernel (other devices, or gate halves that are not whole panels), PyTorch over the dequantized weights."
    K = 64
    torch.manual_seed(6)
    layer = int8_layer(torch.randn(2 * N, K) / 8, None, 64, GateUpLinear(K, N), use_kernels=False)
    wg, wu = dequantized(layer).chunk(2)
    x = torch.randn(5, K)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.silu(x @ wg.T) * (x @ wu.T), atol=1e-5, rtol=1e-5)
    assert isinstance(layer.method, Int8Method) and layer.weight.dtype == torch.int8


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 30])
def test_qkv_come_out_of_one_kernel_call_as_tensors_of_their_own(M):
    "Stacked q/k/v weights, q and k whole panels: one call writes three contiguous tensors, the same bits as the stacked product split."
    nb = panel_width()
    torch.manual_seed(M)
    layer = QKVLinear(3 * nb, nb // 1, 3, 1, bias=True)
    int8_layer(layer.weight.data.clone(), layer.bias.data.clone(), 32, layer)
    x = torch.randn(M, 3 * nb)
    with torch.inference_mode():
        q, k, v = layer.split(x)
        assert all(t.is_contiguous() for t in (q, k, v)) and [t.shape[-1] for t in (q, k, v)] == [3 * nb, nb, nb]
        assert torch.equal(torch.cat([q, k, v], -1), layer.method.apply(layer, x))   # one kernel call, written in three places


def test_panels_round_trip():
    "An int8 layer keeps q and the scales in chapter 7's panel order; `dense` gives back the [N, K] weight."
    w = torch.randn(45, 128)
    layer = int8_layer(w, None, 64)
    q, s = quantize_int8(w, 64)
    assert layer.weight.shape == (-(-45 // panel_width()), 128, panel_width()) and layer.scale.shape[1] == 2
    # bit for bit: unpacking only moves numbers, and both dequantize with the same elementwise product
    assert torch.equal(unpack_panels(layer.weight, 45), q) and torch.equal(dequantized(layer), dequantize_int8(q, s))


def test_quantized_model_shares_the_tied_table_in_place():
    "quantize_model replaces the float weights by int8 ones: the tied table is the LM head's, looked up dequantized."
    model = tiny_model(tied=True)
    quantize_model(model)
    assert model.model.embed_tokens is None and isinstance(model.lm_head.method, Int8Method)
    assert all(m.weight.dtype == torch.int8 for m in model.linear_layers())
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    ids = torch.tensor([3, 150, 7])
    torch.testing.assert_close(model.embed(ids), dequantized(model.lm_head)[ids])


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("tied", [False, True])
def test_int8_engine_batched_equals_alone(backend, tied):
    "Greedy tokens of the engine with int8 weights, batched and chunked, equal chapter 1's loop over the same quantized model."
    model = tiny_model(tied)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in (3, 17, 40, 9, 25)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(prompts)
    ref = [o.token_ids for o in generate(quantize_model(model), NoText(), prompts, params)]
    for kw in (dict(), dict(max_num_batched_tokens=16, max_prefill_chunk=8)):
        # float32 prompt activations: the products of chapter 1's loop (int8 ones: tests/test_int8_prompts.py)
        eng = LLMEngine(model, NoText(), num_blocks=64, block_size=4, quantization="int8", backend=backend,
                        prefill_dtype="float32", **kw)
        assert [o.token_ids for o in run_to_completion(eng, prompts, params)] == ref


def test_int8_smollm_batched_equals_alone():
    "The bundled SmolLM2 with int8 weights: each request's greedy tokens are the same in a batch of 8 as alone."
    llm = LLM("smollm2-135m", quantization="int8", kv_cache_memory_gb=0.1)
    torch.manual_seed(2)
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (5, 30, 12, 60, 8, 21, 3, 44)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * len(prompts)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert batched == [llm.generate([p], params[0])[0].token_ids for p in prompts]



@pytest.mark.parametrize("inner", ["torch", "cpu"])
def test_int8_kv_attention_equals_float_attention_over_dequantized(inner):
    """Attention through an int8 pool equals chapter 2's float attention over a pool holding the dequantized values,
    for a step mixing decode rows and prompt chunks (one starting its sequence, one continuing)."""
    from mini_infer.engine.backend import load_backend
    try: backend = load_backend(inner, "cpu", torch.float32)
    except ValueError: pytest.skip(f"the {inner} backend does not run here")
    cfg, B = TINY, 4
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q8 = PagedKVCache(cfg, 24, B, backend=Int8KVAttention(backend.attention()))
    alloc, tables, gen = BlockAllocator(24), [], torch.Generator().manual_seed(4)
    rows = []   # (new tokens, start): two decodes with context, a chunk continuing a sequence, a chunk starting one
    for n, start in ((1, 9), (1, 14), (6, 5), (7, 0)):
        t = BlockTable(B); t.append(start + n, alloc); tables.append(t)
        rows.append(([0] * n, start, t.blocks, 1))
    # fill the earlier positions of each sequence through a first step
    first = [([0] * s, 0, t, 1) for (_, s, t, _) in rows if s]
    step0 = q8.make_step(first)
    T0 = sum(s for _, s, _, _ in rows)
    k0, v0 = (torch.randn(T0, Hkv, D, generator=gen) * 3 for _ in range(2))
    for layer in range(cfg.num_hidden_layers): q8.backend.store(q8.k[layer], q8.v[layer], k0, v0, step0)
    step = q8.make_step(rows)
    T = sum(len(r[0]) for r in rows)
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
    out = q8.attend(0, q, k, v, step)
    ref = PagedKVCache(cfg, 24, B, backend=TorchAttention())
    ref.k[0], ref.v[0] = dequantize_kv(q8.k[0]), dequantize_kv(q8.v[0])   # the int8 pool now holds this step's K/V too
    ref_step = ref.make_step(rows)
    expected = TorchAttention().attend(q, ref.k[0], ref.v[0], dequantize_kv(quantize_kv(k)), dequantize_kv(quantize_kv(v)), ref_step)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_int8_kv_engine_matches_float_mostly_and_holds_more_tokens():
    "With the int8 KV cache the pool holds (D + 4) / (4 D) of the bytes a token: 3.76x the tokens for head_dim 64."
    f = LLM("smollm2-135m", kv_cache_memory_gb=0.05)
    i = LLM("smollm2-135m", kv_cache_memory_gb=0.05, kv_cache_dtype="int8", quantization="int8")
    assert f.engine.memory.block_bytes / i.engine.memory.block_bytes == 4 * 64 / (64 + 4)
    assert i.engine.memory.num_tokens >= 3.7 * f.engine.memory.num_tokens and "int8" in str(i.engine.memory)
    assert i.engine.memory.weights_bytes < 0.3 * f.engine.memory.weights_bytes
    p = SamplingParams(temperature=0, max_tokens=8)
    assert i.generate("The capital of France is", p)[0].text.strip().startswith("Paris")


@pytest.mark.parametrize("kw,match", [(dict(quantization="int4"), "unknown quantization 'int4'; choose from None, int8"),
                                      (dict(quantization="INT8"), "choose from None, int8"),
                                      (dict(kv_cache_dtype="fp8"), "unknown kv_cache_dtype 'fp8'; choose from auto, int8")])
def test_bad_values_name_what_is_supported(kw, match):
    with pytest.raises(ValueError, match=match): EngineConfig(**kw)
    with pytest.raises(ValueError, match=match): LLM("smollm2-135m", **kw)


def test_serving_int8_with_the_openai_client(tmp_path_factory):
    "A server started with int8 weights and KV cache answers the openai client with what `LLM` answers offline."
    from openai import OpenAI
    from test_server import MSGS, _start
    proc, url = _start(tmp_path_factory, quantization="int8", kv_cache_dtype="int8", kv_cache_memory_gb=0.1)
    try:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=12, temperature=0)
        offline = LLM("smollm2-135m", quantization="int8", kv_cache_dtype="int8", kv_cache_memory_gb=0.1)
        assert r.choices[0].message.content == offline.chat(MSGS, SamplingParams(temperature=0, max_tokens=12))[0].text
        assert "Paris" in r.choices[0].message.content
    finally:
        proc.terminate(); proc.wait(timeout=30)


needs_attention_kernel = pytest.mark.skipif(int8_attention_kernels() is None, reason="the int8 attention kernels do not build here")


@needs_attention_kernel
@pytest.mark.parametrize("D", [64, 72, 128])
def test_int8_store_and_decode_kernels_equal_the_pytorch_path(D):
    """`store_kv_int8` writes what `quantize_kv` computes, bit for bit (zero rows and exact halves included), and
    `paged_decode_int8` over the int8 pools gives chapter 7's float32 decode kernel over the dequantized pools: bit for
    bit when head_dim is whole vectors (64, 128), within float32 rounding otherwise."""
    g = torch.Generator().manual_seed(D)
    blocks, B, Hq, Hkv, T = 12, 4, 6, 2, 20
    k, v = (torch.randn(T, Hkv, D, generator=g) * 3 for _ in range(2))
    k[0, 0] = 0; v[1, 1, :2] = torch.tensor([127.0, 0.5])   # an all-zero row; a row whose values fall on halves of a step
    slots = torch.randperm(blocks * B, generator=g)[:T]
    pools = [torch.zeros(blocks, B, Hkv, D + 4, dtype=torch.int8) for _ in range(2)]
    int8_attention_kernels().store_kv_int8(k.data_ptr(), v.data_ptr(), pools[0].data_ptr(), pools[1].data_ptr(), slots.data_ptr(), T, Hkv, D)
    # bit for bit on any CPU: IEEE division and rounding half to even are exactly defined, in C as in PyTorch
    for pool, x in zip(pools, (k, v)): assert torch.equal(pool.view(-1, Hkv, D + 4)[slots], quantize_kv(x))
    pools = [torch.randint(-127, 128, (blocks, B, Hkv, D + 4), dtype=torch.int8, generator=g) for _ in range(2)]
    for p in pools: p[..., -4:] = (torch.rand(blocks, B, Hkv, 1, generator=g) / 10).view(torch.int8)   # valid scales
    q = torch.randn(3, Hq, D, generator=g)
    tok, tables, lens = torch.tensor([2, 0, 1]), torch.randint(0, blocks, (3, 5), generator=g), torch.tensor([17, 1, 9])
    out = paged_decode_int8(q, *pools, torch.empty_like(q), tok, tables, lens)
    ref = paged_decode_kernel(q, *(dequantize_kv(p) for p in pools), torch.empty_like(q), tok, tables, lens)
    if D % 16 == 0: assert torch.equal(out, ref)   # whole vectors: both kernels are one macro, the same FMA order
    else: torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)   # the scalar tail of each dot product: GCC orders it its own way


@needs_attention_kernel
def test_int8_kv_engine_on_the_kernel_equals_the_dequantizing_path():
    "Greedy tokens with the int8 KV cache are the same whether decode steps read the pool in C or dequantize it for PyTorch."
    model = tiny_model()
    torch.manual_seed(3)
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in (3, 17, 40, 9)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(prompts)
    outs = []
    for backend in ("cpu", "torch"):
        # float32 prompts on both: the torch backend has no bf16 prompt rows (chapter 7)
        eng = LLMEngine(model, NoText(), num_blocks=64, block_size=4, kv_cache_dtype="int8", backend=backend,
                        prefill_dtype="float32")
        assert eng.cache.backend.kernel == (backend == "cpu")
        outs.append([o.token_ids for o in run_to_completion(eng, prompts, params)])
    assert outs[0] == outs[1]
