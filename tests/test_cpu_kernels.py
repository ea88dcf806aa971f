"""Chapter 7's CPU kernels: the build and its fallbacks, the matrix kernels against transformers on Qwen2 (q/k/v bias)
and Llama, the paged-attention kernels against chapter 2's PyTorch, repacking after weight changes, rejected input."""
import os, shutil, subprocess, sys, textwrap
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mini_infer.plugins.cpu.build import native_target
from mini_infer.plugins.cpu.linear import linear_kernels, pack_weight, pack_glu, linear_packed, linear_glu_packed
from mini_infer.plugins.cpu.bf16 import bf16_kernels, pack_bf16, linear_bf16
from mini_infer.plugins.cpu.packed import PackedMethod
from mini_infer.plugins.cpu.attention import CPUAttention, paged_decode_kernel, paged_prefill_kernel, pool_zeros
from mini_infer.plugins.cpu.backend import CPUBackend, KernelOps
from mini_infer.engine.engine import EngineConfig
from mini_infer.model.layers import LinearBase, ColumnLinear, GateUpLinear, LinearMethod
from mini_infer.model.model import CausalLM, RotaryEmbedding, ModelConfig, TORCH_OPS
from mini_infer.engine.memory_plan import weights_bytes
from mini_infer.model.loader import load_safetensors
from mini_infer.engine.kv_cache import PagedKVCache
from mini_infer.course.teaching import random_paged_step, attention_by_row
from test_loader import tiny_hf, our_logits

pytestmark = pytest.mark.skipif(linear_kernels() is None, reason="no C compiler for the CPU kernels")


def attn_cfg(n_q=9, n_kv=3, d=64, layers=1):
    return ModelConfig(vocab_size=8, hidden_size=n_q * d, intermediate_size=8, num_hidden_layers=layers,
                       num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=d)


# ---------------------------------------------------------------- the build and its fallbacks
def _fresh_process(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    "Run `code` in a new Python (nothing built or cached yet) with its own kernel cache folder."
    env = {**os.environ, "MINI_INFER_CACHE": str(tmp_path / "cache"), "PYTHONWARNINGS": "always", **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300)

CHECK = """
    import torch
    from mini_infer.plugins.cpu.linear import linear_kernels
    from mini_infer.plugins.cpu.attention import cpu_attention_kernels
    from mini_infer.engine.backend import load_backend
    print("kernels", linear_kernels() is not None, cpu_attention_kernels() is not None)
    print("auto backend", type(load_backend("auto", "cpu", torch.float32)).__name__)
"""

def test_no_compiler_falls_back_to_pytorch_with_a_warning(tmp_path):
    r = _fresh_process(CHECK, tmp_path, CC="false")
    assert r.returncode == 0, r.stderr
    assert "kernels False False" in r.stdout and "auto backend TorchBackend" in r.stdout
    assert "unavailable, PyTorch's path is used instead" in r.stderr

def test_off_switch(tmp_path):
    r = _fresh_process(CHECK, tmp_path, MINI_INFER_NO_KERNELS="1")
    assert r.returncode == 0 and "kernels False False" in r.stdout and "auto backend TorchBackend" in r.stdout, r.stderr

def test_failed_build_shows_the_compiler_error(tmp_path):
    from mini_infer.plugins.cpu.build import load_library
    os.environ["MINI_INFER_CACHE"], old = str(tmp_path / "cache"), os.environ.get("MINI_INFER_CACHE")
    try:
        with pytest.warns(UserWarning, match="(?s)unavailable.*error.*not_a_type"):
            assert load_library("not_a_type f(void) { return 0; }", "broken", {}) is None
    finally:
        if old is None: del os.environ["MINI_INFER_CACHE"]
        else: os.environ["MINI_INFER_CACHE"] = old

def test_without_openmp_the_kernels_run_single_threaded(tmp_path):
    "A compiler without OpenMP (Apple's clang): the kernels still build, without -fopenmp, with a warning saying so."
    cc = tmp_path / "cc-no-openmp"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "unsupported option -fopenmp" >&2; exit 1; }}; done\nexec {shutil.which("cc")} "$@"\n')
    cc.chmod(0o755)
    r = _fresh_process(CHECK, tmp_path, CC=str(cc))
    assert r.returncode == 0 and "kernels True True" in r.stdout and "auto backend CPUBackend" in r.stdout, r.stderr
    assert "built without OpenMP: they run on one thread" in r.stderr and "unsupported option -fopenmp" in r.stderr

def test_the_cache_key_follows_the_cpu(tmp_path, monkeypatch):
    "A library built for one CPU is never loaded on another: the file name hashes what -march=native means here."
    import mini_infer.plugins.cpu.build as ck
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path / "cache"))
    here = ck.compile_library("int f(void) { return 1; }", ["-O1", "-shared", "-fPIC"], "key")
    assert "__x86_64__" in native_target(os.environ.get("CC", "cc")) or "__aarch64__" in native_target(os.environ.get("CC", "cc"))
    monkeypatch.setattr(ck, "native_target", lambda cc: "#define __AVX512F__ 1")   # another machine
    there = ck.compile_library("int f(void) { return 1; }", ["-O1", "-shared", "-fPIC"], "key")
    assert here != there and here.exists() and there.exists()

@pytest.mark.parametrize("arch,heads,kv,tied", [("qwen2", 4, 2, True), ("qwen2", 4, 1, False), ("llama", 6, 2, True)])
def test_kernel_model_matches_transformers(tmp_path, arch, heads, kv, tied):
    hf = tiny_hf(arch, heads, kv, tied)
    hf.save_pretrained(tmp_path)
    model = load_safetensors(tmp_path, "cpu", torch.float32)
    ids = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(1))
    plain, dense_bytes = our_logits(model, ids), weights_bytes(model)
    CPUBackend().prepare(model, EngineConfig(enforce_eager=True))
    layers = model.linear_layers()
    L = model.config.num_hidden_layers
    assert all(isinstance(m.method, PackedMethod) for m in layers) and len(layers) == 4 * L + 1   # and the LM head
    assert all(m.ops.__class__ is KernelOps for m in model.modules() if hasattr(m, "ops"))
    assert dense_bytes <= weights_bytes(model) < 1.2 * dense_bytes   # packed in place: one copy, plus panel padding
    with torch.no_grad(): ref = hf(ids[None]).logits[0]
    ours = our_logits(model, ids)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (ours - plain).abs().max().item() <= 1e-4


@pytest.mark.parametrize("layer", [lambda: ColumnLinear(40, [70, 32, 5], bias=True), lambda: GateUpLinear(48, 70),
                                   lambda: LinearBase(40, [70], bias=False)])
def test_packing_is_lossless_and_reversible(layer):
    "A layer packed and unpacked again holds the same numbers; packed, it computes what the plain layer does."
    layer = layer()
    x = torch.randn(5, layer.in_features)
    w, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    with torch.inference_mode(): want = layer(x)
    layer.set_method(PackedMethod())
    assert layer.weight.shape != w.shape
    with torch.inference_mode(): torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    layer.set_method(LinearMethod())
    # bit for bit on any CPU: packing and unpacking move the numbers and compute nothing
    assert torch.equal(layer.weight, w) and (b is None or torch.equal(layer.bias, b))


def test_packed_weight_changed_in_place_is_read_as_it_is():
    "The packed panels are the layer's weight: a change made to them in place is what the next product reads."
    layer = LinearBase(16, [32], bias=False)
    layer.set_method(PackedMethod())
    x = torch.randn(3, 16)
    with torch.inference_mode(): before = layer(x)
    with torch.no_grad(): layer.weight.mul_(-1)
    with torch.inference_mode(): torch.testing.assert_close(layer(x), -before)


def test_linear_packed_rejects_bad_input():
    nb = linear_kernels().packed_block()
    W = torch.randn(64, 32)
    Wp = pack_weight(W, nb)
    with pytest.raises(ValueError): linear_packed(torch.randn(4, 31), Wp, 64)                  # wrong K
    with pytest.raises(ValueError): linear_packed(torch.randn(4, 32).double(), Wp, 64)         # wrong dtype
    with pytest.raises(ValueError): linear_packed(torch.randn(32, 4).T, Wp, 64)                # not contiguous
    with pytest.raises(ValueError): linear_packed(torch.randn(4, 32), Wp, 64 + nb)             # more outputs than panels
    with pytest.raises(ValueError): linear_packed(torch.randn(4, 32), Wp, 64, torch.zeros(3))  # bias not padded
    torch.testing.assert_close(linear_packed(torch.randn(0, 32), Wp, 64), torch.empty(0, 64))  # no rows: nothing to do


def test_linear_packed_several_outputs_in_one_call():
    "Up to three weights packed one after another: each result is the bits of its own single call (partial panels, one bias missing)."
    nb = linear_kernels().packed_block()
    g = torch.Generator().manual_seed(0)
    Ws = [torch.randn(n, 48, generator=g) for n in (70, 32, 5)]
    bs = [torch.randn(70, generator=g), None, torch.randn(5, generator=g)]
    pad = lambda b, n: F.pad(b if b is not None else torch.zeros(n), (0, -n % nb))
    packed, bias = torch.cat([pack_weight(W, nb) for W in Ws]), torch.cat([pad(b, W.shape[0]) for W, b in zip(Ws, bs)])
    for M in (19, 300):   # 300 rows: panels in pairs, an odd one left over
        x = torch.randn(M, 48, generator=g)
        outs = linear_packed(x, packed, [70, 32, 5], bias)
        for out, W, b in zip(outs, Ws, bs):
            # bit for bit on any CPU: an output is one FMA chain over k in order, whichever call holds its panels
            assert torch.equal(out, linear_packed(x, pack_weight(W, nb), W.shape[0], pad(b, W.shape[0])))
            torch.testing.assert_close(out, F.linear(x, W, b), rtol=1e-5, atol=1e-4)
        # the same bits as one row, on any CPU: a row's FMA chain does not depend on the rows beside it (our kernel, no BLAS)
        assert all(torch.equal(a[:1], c) for a, c in zip(outs, linear_packed(x[:1], packed, [70, 32, 5], bias)))
    with pytest.raises(ValueError): linear_packed(x, packed, [70, 32, 5, 1], bias)   # at most three
    with pytest.raises(ValueError): linear_packed(x, packed, [70, 32], bias)         # panels left over


def test_glu_kernel_matches_pytorch_and_rejects_bad_input():
    nb = linear_kernels().packed_block()
    for M, N, K in [(1, 64, 32), (13, 100, 48), (300, 96, 16)]:
        x, Wg, Wu = torch.randn(M, K), torch.randn(N, K) / 4, torch.randn(N, K) / 4
        packed = pack_glu(Wg, Wu, nb)
        ours = linear_glu_packed(x, packed, N)
        torch.testing.assert_close(ours, F.silu(F.linear(x, Wg)) * F.linear(x, Wu), rtol=1e-5, atol=1e-5)
        assert torch.equal(linear_glu_packed(x[:1], packed, N), ours[:1])   # batch invariant: a row's FMA chains, in any tile
    big = torch.full((2, 16), 100.0)   # e^-g under- and overflow: silu(g) = g for g >> 0, 0 for g << 0
    out = linear_glu_packed(big, pack_glu(torch.eye(16), torch.eye(16), nb), 16)
    torch.testing.assert_close(out, torch.full((2, 16), 100.0 * 100.0))
    out = linear_glu_packed(-big, pack_glu(torch.eye(16), -torch.eye(16), nb), 16)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-30
    with pytest.raises(ValueError): linear_glu_packed(x, pack_weight(Wg, nb), N)    # not a gate/up packing
    with pytest.raises(ValueError): linear_glu_packed(x.double(), packed, N)


@pytest.mark.parametrize("M,N", [(1, 576), (300, 576), (7, 33), (2, 8), (130, 1536)])
def test_rms_norm_kernel_matches_pytorch(M, N):
    "Widths with and without a partial vector at the end; enough rows for both threads."
    weight, x = torch.randn(N), torch.randn(M, N) * 3
    with torch.inference_mode():
        torch.testing.assert_close(KernelOps().rms_norm(x, weight, 1e-5), F.rms_norm(x, (N,), weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,H,D", [(1, 9, 64), (37, 4, 16), (300, 2, 128)])
def test_rope_kernel_matches_pytorch(T, H, D):
    cfg = ModelConfig(vocab_size=10, hidden_size=H * D, intermediate_size=8, num_hidden_layers=1, num_attention_heads=H,
                      num_key_value_heads=H, head_dim=D, max_position_embeddings=4096)
    cos, sin = RotaryEmbedding(cfg)(torch.randint(0, 4096, (T,)))
    x = torch.randn(T, H, D)
    with torch.inference_mode(): got = KernelOps().rope(x, cos, sin)
    torch.testing.assert_close(got, TORCH_OPS.rope(x, cos, sin), rtol=1e-6, atol=1e-6)   # FMA rounding only
    assert not torch.equal(got, x)
    xb = x.bfloat16()   # other dtypes take PyTorch's path: the same function on the same inputs, so the same bits
    assert torch.equal(KernelOps().rope(xb, cos.bfloat16(), sin.bfloat16()), TORCH_OPS.rope(xb, cos.bfloat16(), sin.bfloat16()))


# ---------------------------------------------------------------- paged attention in C
@pytest.mark.parametrize("seed,block_size,heads", [(0, 16, (9, 3)), (1, 4, (4, 1)), (2, 1, (6, 6)), (3, 7, (8, 2)), (4, 16, (2, 2))])
def test_cpu_attention_matches_contiguous(seed, block_size, heads):
    cfg = attn_cfg(*heads, d=32, layers=2)
    cache, rows, q, k, v, fk, fv = random_paged_step(cfg, 11, block_size, (1, 70), chunk_rows=(1, 4, 8), seed=seed, backend=CPUAttention())
    step = cache.make_step(rows)
    for layer in range(2):
        torch.testing.assert_close(cache.attend(layer, q, k, v, step), attention_by_row(q, fk, fv, rows), atol=1e-5, rtol=1e-5)


def test_cpu_attention_where_it_applies():
    assert CPUAttention.supports("cpu", torch.float32) and CPUAttention.supports("cpu", torch.bfloat16)
    assert not CPUAttention.supports("cpu", torch.float16) and not CPUAttention.supports("meta", torch.float32)
    assert CPUBackend.available("cpu", torch.float32) and not CPUBackend.available("cpu", torch.float16)


@pytest.mark.parametrize("seed", range(3))
def test_decode_kernel_rows_in_any_order(seed):
    "Rows in a shuffled order, reading tables wider than they need."
    cfg = attn_cfg(9, 3, 64)
    cache, rows, q, k, v, fk, fv = random_paged_step(cfg, 24, 16, (1, 300), seed=seed)
    step = cache.make_step(rows)
    kp, vp = cache.k[0], cache.v[0]
    kp.view(-1, 3, 64)[step.slot_mapping] = k; vp.view(-1, 3, 64)[step.slot_mapping] = v
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(seed))
    out = torch.full_like(q, float("nan"))
    paged_decode_kernel(q, kp, vp, out, perm, step.block_tables[perm].contiguous(), step.context_lens[perm].contiguous())
    torch.testing.assert_close(out, attention_by_row(q, fk, fv, rows), atol=1e-5, rtol=1e-5)


def test_decode_kernel_rejects_bad_input():
    cache = PagedKVCache(attn_cfg(4, 2, 16), 4, 4, backend=CPUAttention())
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        paged_decode_kernel(q, cache.k[0], cache.v[0], q.clone(), torch.tensor([0], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        paged_decode_kernel(q.bfloat16(), cache.k[0], cache.v[0], q.clone(), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))


@pytest.mark.parametrize("heads,d,block_size", [((9, 3), 64, 16), ((14, 2), 64, 16), ((4, 4), 128, 5), ((6, 2), 80, 16), ((3, 1), 24, 1)])
def test_prefill_kernel_long_prompts(heads, d, block_size):
    "Prompt chunks longer than the kernel's 32-token tiles, some continuing earlier context, GQA groups of 1 to 7, head sizes that are not multiples of 16."
    cfg = attn_cfg(*heads, d=d)
    cache, rows, q, k, v, fk, fv = random_paged_step(cfg, 5, block_size, (40, 300), chunk_rows=range(5), seed=11, backend=CPUAttention())
    assert max(len(t) for t, *_ in rows) > 64 and any(start > 0 for _, start, *_ in rows)
    torch.testing.assert_close(cache.attend(0, q, k, v, cache.make_step(rows)), attention_by_row(q, fk, fv, rows), atol=1e-5, rtol=1e-5)


def test_prefill_kernel_result_does_not_depend_on_chunking():
    "A token's attention is the same bits whether its prompt runs in one chunk or in several, and whatever else shares the call."
    g = torch.Generator().manual_seed(0)
    B, n, (Hq, Hkv, D) = 16, 150, (9, 3, 64)
    kp, vp = torch.randn(20, B, Hkv, D, generator=g), torch.randn(20, B, Hkv, D, generator=g)
    q = torch.randn(n, Hq, D, generator=g)
    table = torch.randperm(20, generator=g)[:-(-n // B)][None]
    def run(chunks):
        out, t = torch.empty_like(q), 0
        for c in chunks:
            paged_prefill_kernel(q, kp, vp, out, torch.tensor([[t, c, t + c]]), table); t += c
        return out
    whole = run([n])   # bit for bit on any CPU: each query walks its keys in the same order, whatever chunk it is in
    for chunks in ([40, 70, 40], [2, 33, 115], [31] * 4 + [26]):
        assert torch.equal(run(chunks), whole)
    both = torch.empty_like(q)   # two chunks in one call: the same again
    paged_prefill_kernel(q, kp, vp, both, torch.tensor([[0, 70, 70], [70, 80, 150]]), table.expand(2, -1).contiguous())
    assert torch.equal(both, whole)


def test_prefill_kernel_rejects_bad_rows():
    q, pool, table = torch.zeros(10, 4, 16), torch.zeros(4, 4, 2, 16), torch.zeros(1, 4, dtype=torch.long)
    for bad in ([0, 11, 11], [0, 0, 5], [0, 5, 3], [0, 5, 17], [-1, 5, 5], [6, 5, 5]):   # past q, empty, n > ctx, past the table, t0 < 0, t0 + n > T
        with pytest.raises(ValueError, match="seqs"):
            paged_prefill_kernel(q, pool, pool.clone(), q.clone(), torch.tensor([bad]), table)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        paged_prefill_kernel(q, pool, pool.clone(), q.clone(), torch.tensor([[0, 5, 5]], dtype=torch.int32), table)


@pytest.mark.parametrize("seed,chunk_rows", [(0, ()), (1, ()), (2, ()), (5, range(4))])
def test_bfloat16_kernels_equal_float32_attention_of_the_same_numbers(seed, chunk_rows):
    "A bfloat16 pool: the kernels read 16-bit K/V and compute in float32, so they match float32 attention over the same (rounded) values to bfloat16 output precision."
    cfg = attn_cfg(9, 3, 64)
    n = 4 if chunk_rows else 24
    cache, rows, q, k, v, fk, fv = random_paged_step(cfg, n, 16, (40, 200), chunk_rows=chunk_rows, seed=seed, dtype=torch.bfloat16, backend=CPUAttention())
    got = cache.attend(0, q, k, v, cache.make_step(rows))
    assert got.dtype == torch.bfloat16
    want = attention_by_row(q.float(), [t.float() for t in fk], [t.float() for t in fv], rows)
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


def test_pool_zeros():
    "The pool's memory: zeros of the asked shape and dtype, 2 MB aligned where huge pages can be asked for, alive as long as the tensor."
    import gc, mmap
    for dtype in (torch.float32, torch.bfloat16):
        t = pool_zeros((2, 300, 16, 3, 64), dtype)
        gc.collect()
        assert t.shape == (2, 300, 16, 3, 64) and t.dtype == dtype and t.is_contiguous() and not t.any()
        if hasattr(mmap, "MADV_HUGEPAGE"): assert t.data_ptr() % (2 << 20) == 0
        t[1, -1] = 1
        assert t.sum() == 16 * 3 * 64
    if hasattr(mmap, "MADV_HUGEPAGE"): assert PagedKVCache(attn_cfg(), 10, 4, backend=CPUAttention()).k.data_ptr() % (2 << 20) == 0


# ---------------------------------------------------------------- bf16 products for long steps
needs_bf16 = pytest.mark.skipif(bf16_kernels() is None, reason="no bf16 dot products (AVX512_BF16) on this CPU")


def _bf16_bound(x, W, b=None):
    "Rounding both inputs of each product to bf16, then float32 sums: the elementwise error bound."
    K, u, ub = x.shape[-1], 2.0 ** -24, 2.0 ** -8
    mag = x.double().abs() @ W.double().abs().T + (0 if b is None else b.double().abs())
    return ((1 + ub) ** 2 * (1 + K * u / (1 - K * u)) - 1) * mag


@needs_bf16
@pytest.mark.parametrize("M,N,K", [(1, 70, 33), (64, 100, 48), (300, 197, 576), (193, 32, 1536)])
def test_bf16_products_within_their_error_bound(M, N, K):
    "Odd K, partial panels, an odd panel left over, a partial block of rows: within the bound; SwiGLU as from rounded inputs."
    nb = linear_kernels().packed_block()
    g = torch.Generator().manual_seed(M)
    x, W, Wu, b = (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, K, generator=g),
                   torch.randn(N, generator=g))
    y = linear_bf16(x, pack_bf16(pack_weight(W, nb)), N, F.pad(b, (0, -N % nb)))
    exact = torch.addmm(b.double(), x.double(), W.double().T)
    assert ((y.double() - exact).abs() <= _bf16_bound(x, W, b)).all()
    glu = linear_bf16(x, pack_bf16(pack_glu(W, Wu, nb)), N, glu=True)
    xb, Wb, Wub = (t.bfloat16().double() for t in (x, W, Wu))
    want = F.silu(xb @ Wb.T) * (xb @ Wub.T)
    torch.testing.assert_close(glu.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())   # float32 sums of exact products


@needs_bf16
def test_bf16_several_outputs_and_bad_input():
    nb = linear_kernels().packed_block()
    Ws = [torch.randn(n, 48) for n in (70, 32, 5)]
    packed = pack_bf16(torch.cat([pack_weight(W, nb) for W in Ws]))
    x = torch.randn(100, 48)
    for y, W in zip(linear_bf16(x, packed, [70, 32, 5]), Ws):
        assert ((y.double() - x.double() @ W.double().T).abs() <= _bf16_bound(x, W)).all()
    with pytest.raises(ValueError): linear_bf16(torch.randn(4, 50), packed, [70, 32, 5])          # wrong K
    with pytest.raises(ValueError): linear_bf16(x.double(), packed, [70, 32, 5])                  # wrong dtype
    with pytest.raises(ValueError): linear_bf16(x, packed.float(), [70, 32, 5])                   # not bf16 panels
    with pytest.raises(ValueError): linear_bf16(x, packed, [70, 32])                              # panels left over
    with pytest.raises(ValueError): linear_bf16(x, packed, [70, 32, 5], glu=True)                 # glu: one output


@needs_bf16
def test_packed_method_gives_prompt_rows_their_path_and_sees_a_weight_change():
    "Without prompt rows set: the float32 bits; with: bf16 within the bound; a replaced weight's copy made anew."
    from mini_infer.plugins.cpu.prompt import Bf16Tile, PromptRows, prompt_rows
    layer = LinearBase(96, [80], bias=False)
    W = layer.weight.detach().clone()
    layer.set_method(PackedMethod(Bf16Tile()))
    x, every = torch.randn(70, 96), PromptRows([70], [70])
    with torch.inference_mode():
        assert torch.equal(layer(x), linear_packed(x, layer.weight, 80))   # the same kernel on the same inputs
        with prompt_rows(every):
            y = layer(x)
        assert not torch.equal(y, linear_packed(x, layer.weight, 80))
        assert ((y.double() - x.double() @ W.double().T).abs() <= _bf16_bound(x, W)).all()
        with torch.no_grad(): layer.weight.mul_(-1)
        layer.weights_version += 1   # what set_weights and the quantizers do
        with prompt_rows(every):
            torch.testing.assert_close(layer(x), -y)


def test_prefill_dtype_is_an_engine_option():
    "`prefill_dtype`: auto by default; float32 gives no layer a prompt path; the engine refuses other names."
    from mini_infer.plugins.cpu.backend import prefill_dtype
    assert prefill_dtype(None) == "float32" and prefill_dtype(EngineConfig()) == "auto"
    with pytest.raises(ValueError, match="choose from float32, bfloat16, auto"): EngineConfig(prefill_dtype="fp8")
    torch.manual_seed(0)
    model = CausalLM(attn_cfg(layers=2), max_positions=64).eval()
    CPUBackend().prepare(model, EngineConfig(enforce_eager=True, prefill_dtype="float32"))
    assert all(layer.method.prompt is None for layer in model.linear_layers())