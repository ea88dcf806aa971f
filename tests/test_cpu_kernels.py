"Chapter 7's CPU kernels: against transformers on Qwen2 (q/k/v bias) and Llama, repacking after weight changes, rejected input."
import copy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mini_infer.cpu_kernels import (cpu_kernels, pack_weight, pack_glu, linear_packed, linear_glu_packed, PackedLinear, KernelApplyRope,
                                    KernelRMSNorm, use_cpu_kernels)
from mini_infer.model import ApplyRope, RotaryEmbedding, ModelConfig
from mini_infer.loader import load_safetensors
from test_loader import tiny_hf, our_logits

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler for the CPU kernels")

@pytest.mark.parametrize("arch,heads,kv,tied", [("qwen2", 4, 2, True), ("qwen2", 4, 1, False), ("llama", 6, 2, True)])
def test_kernel_model_matches_transformers(tmp_path, arch, heads, kv, tied):
    hf = tiny_hf(arch, heads, kv, tied)
    hf.save_pretrained(tmp_path)
    model = load_safetensors(tmp_path, "cpu", torch.float32)
    plain = copy.deepcopy(model)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert use_cpu_kernels(model) == n_linear + 5 * model.config.num_hidden_layers + 1   # linears; 2 norms, RoPE, attention and MLP a layer; final norm
    ids = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): ref = hf(ids[None]).logits[0]
    ours = our_logits(model, ids)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (ours - our_logits(plain, ids)).abs().max().item() <= 1e-4

def test_repacks_after_load_state_dict():
    lin = nn.Linear(40, 70)   # 70 outputs: a partial last panel
    pl = PackedLinear(lin)
    x = torch.randn(5, 40)
    with torch.inference_mode(): before = pl(x)
    new = nn.Linear(40, 70).state_dict()
    lin.load_state_dict(new)
    with torch.inference_mode(): after = pl(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, F.linear(x, new["weight"], new["bias"]), rtol=1e-5, atol=1e-5)

def test_grad_and_other_dtypes_take_pytorch_path():
    pl = PackedLinear(nn.Linear(16, 32))
    x = torch.randn(3, 16, requires_grad=True)
    pl(x).sum().backward()   # autograd works: the kernel is only used for inference
    assert pl.weight.grad is not None
    xb = torch.randn(3, 16, dtype=torch.bfloat16)
    assert PackedLinear(nn.Linear(16, 32).to(torch.bfloat16))(xb).dtype == torch.bfloat16

def test_linear_packed_rejects_bad_input():
    nb = cpu_kernels().packed_block()
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
    nb = cpu_kernels().packed_block()
    g = torch.Generator().manual_seed(0)
    Ws = [torch.randn(n, 48, generator=g) for n in (70, 32, 5)]
    bs = [torch.randn(70, generator=g), None, torch.randn(5, generator=g)]
    pad = lambda b, n: F.pad(b if b is not None else torch.zeros(n), (0, -n % nb))
    packed, bias = torch.cat([pack_weight(W, nb) for W in Ws]), torch.cat([pad(b, W.shape[0]) for W, b in zip(Ws, bs)])
    for M in (19, 300):   # 300 rows: panels in pairs, an odd one left over
        x = torch.randn(M, 48, generator=g)
        outs = linear_packed(x, packed, [70, 32, 5], bias)
        for out, W, b in zip(outs, Ws, bs):
            assert torch.equal(out, linear_packed(x, pack_weight(W, nb), W.shape[0], pad(b, W.shape[0])))
            torch.testing.assert_close(out, F.linear(x, W, b), rtol=1e-5, atol=1e-4)
        assert all(torch.equal(a[:1], c) for a, c in zip(outs, linear_packed(x[:1], packed, [70, 32, 5], bias)))   # the same bits as one row
    with pytest.raises(ValueError): linear_packed(x, packed, [70, 32, 5, 1], bias)   # at most three
    with pytest.raises(ValueError): linear_packed(x, packed, [70, 32], bias)         # panels left over


def test_glu_kernel_matches_pytorch_and_rejects_bad_input():
    nb = cpu_kernels().packed_block()
    for M, N, K in [(1, 64, 32), (13, 100, 48), (300, 96, 16)]:
        x, Wg, Wu = torch.randn(M, K), torch.randn(N, K) / 4, torch.randn(N, K) / 4
        packed = pack_glu(Wg, Wu, nb)
        ours = linear_glu_packed(x, packed, N)
        torch.testing.assert_close(ours, F.silu(F.linear(x, Wg)) * F.linear(x, Wu), rtol=1e-5, atol=1e-5)
        assert torch.equal(linear_glu_packed(x[:1], packed, N), ours[:1])   # batch invariant
    big = torch.full((2, 16), 100.0)   # e^-g under- and overflow: silu(g) = g for g >> 0, 0 for g << 0
    out = linear_glu_packed(big, pack_glu(torch.eye(16), torch.eye(16), nb), 16)
    torch.testing.assert_close(out, torch.full((2, 16), 100.0 * 100.0))
    out = linear_glu_packed(-big, pack_glu(torch.eye(16), -torch.eye(16), nb), 16)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-30
    with pytest.raises(ValueError): linear_glu_packed(x, pack_weight(Wg, nb), N)    # not a gate/up packing
    with pytest.raises(ValueError): linear_glu_packed(x.double(), packed, N)


def test_kernel_model_repacks_after_load_state_dict(tmp_path):
    "The fused q/k/v and gate/up copies follow a weight change, as a PackedLinear's does."
    hf = tiny_hf("qwen2", 4, 2, False)
    hf.save_pretrained(tmp_path)
    model = load_safetensors(tmp_path, "cpu", torch.float32)
    plain = copy.deepcopy(model)
    use_cpu_kernels(model)
    ids = torch.randint(0, 101, (9,), generator=torch.Generator().manual_seed(2))
    before = our_logits(model, ids)
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in plain.state_dict().items()}
    model.load_state_dict(new); plain.load_state_dict(new)
    after = our_logits(model, ids)
    assert (after - before).abs().max() > 1e-2
    assert (after - our_logits(plain, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("M,N", [(1, 576), (300, 576), (7, 33), (2, 8), (130, 1536)])
def test_rms_norm_kernel_matches_pytorch(M, N):
    "Widths with and without a partial vector at the end; enough rows for both threads."
    norm = KernelRMSNorm(N, 1e-5)
    with torch.no_grad(): norm.weight.copy_(torch.randn(N))
    x = torch.randn(M, N) * 3
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (N,), norm.weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,H,D", [(1, 9, 64), (37, 4, 16), (300, 2, 128)])
def test_rope_kernel_matches_pytorch(T, H, D):
    cfg = ModelConfig(vocab_size=10, hidden_size=H * D, intermediate_size=8, num_hidden_layers=1, num_attention_heads=H,
                      num_key_value_heads=H, head_dim=D, max_position_embeddings=4096)
    cos, sin = RotaryEmbedding(cfg)(torch.randint(0, 4096, (T,)))
    x = torch.randn(T, H, D)
    with torch.inference_mode(): got = KernelApplyRope()(x, cos, sin)
    torch.testing.assert_close(got, ApplyRope()(x, cos, sin), rtol=1e-6, atol=1e-6)   # FMA rounding only
    assert not torch.equal(got, x)
    xb = x.bfloat16()   # other dtypes take PyTorch's path
    assert torch.equal(KernelApplyRope()(xb, cos.bfloat16(), sin.bfloat16()), ApplyRope()(xb, cos.bfloat16(), sin.bfloat16()))
