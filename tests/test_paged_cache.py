"Tests of chapter 2: block allocator, block tables, memory plan, paged attention, generation through the paged cache."
import os, shutil
from collections import Counter, deque

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_infer.loader import load_model
from mini_infer.model import CausalLM, ContiguousKVCache, ModelConfig, causal_attention
from mini_infer.paged_cache import (BlockAllocator, BlockTable, PagedKVCache, generate_paged, paged_attention_ref,
                                    paged_decode, paged_decode_flash, plan_memory, step_inputs, count_parameters,
                                    kv_bytes_per_token, info_table, cpu_attention_kernels, paged_decode_kernel,
                                    paged_prefill_kernel, pool_zeros)

# The C kernel where this machine can build it; every kernel case is reported as skipped where it cannot, and
# test_kernels_build_where_a_compiler_exists fails if a machine with a compiler could not build it.
needs_kernels = pytest.mark.skipif(cpu_attention_kernels() is None, reason="no C compiler: the PyTorch paths only")
IMPLS = ["reference", "gather", "flash", pytest.param("kernel", marks=needs_kernels)]


def test_kernels_build_where_a_compiler_exists():
    if os.environ.get("MINI_INFER_NO_KERNELS") or shutil.which(os.environ.get("CC", "cc")) is None: pytest.skip("no compiler")
    assert cpu_attention_kernels() is not None, "a C compiler is here but the paged-attention kernels did not build"


def attn_cfg(n_q=9, n_kv=3, d=64, layers=2):
    return ModelConfig(vocab_size=8, hidden_size=n_q * d, intermediate_size=8, num_hidden_layers=layers,
                       num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=d)


def random_step(cfg, n_rows, block_size, ctx_range, chunk_frac, seed, **cache_kw):
    """A packed step over `n_rows` sequences with random contexts already partly in a cache whose blocks are shuffled.
    Returns (cache, q, k, v, per-row full K/V, query_lens); the earlier context is written straight into the pool."""
    g = torch.Generator().manual_seed(seed)
    H, Hq, D = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    ctx = torch.randint(*ctx_range, (n_rows,), generator=g).tolist()
    qlens = [int(torch.randint(1, c + 1, (1,), generator=g)) if torch.rand(1, generator=g) < chunk_frac else 1 for c in ctx]
    num_blocks = sum(-(-c // block_size) for c in ctx) + 5
    cache = PagedKVCache(cfg, num_blocks, block_size, **cache_kw)
    alloc = BlockAllocator(num_blocks)
    alloc.free_blocks = deque(torch.randperm(num_blocks, generator=g).tolist())
    tables, full = [], []
    for c, n in zip(ctx, qlens):
        tb = BlockTable(block_size)
        assert tb.append(c - n, alloc)
        kv = [torch.randn(cfg.num_hidden_layers, c, H, D, generator=g) for _ in range(2)]
        old = torch.tensor(tb.slots(0, c - n), dtype=torch.long)
        for layer in range(cfg.num_hidden_layers):
            cache.k[layer].view(-1, H, D)[old] = kv[0][layer, :c - n].to(cache.k.dtype)
            cache.v[layer].view(-1, H, D)[old] = kv[1][layer, :c - n].to(cache.v.dtype)
        assert tb.append(n, alloc)
        tables.append(tb); full.append(kv)
    T = sum(qlens)
    q = torch.randn(cfg.num_hidden_layers, T, Hq, D, generator=g)
    k = torch.stack([torch.cat([kv[0][l, -n:] for kv, n in zip(full, qlens)]) for l in range(cfg.num_hidden_layers)])
    v = torch.stack([torch.cat([kv[1][l, -n:] for kv, n in zip(full, qlens)]) for l in range(cfg.num_hidden_layers)])
    cache.prepare(*step_inputs(tables, qlens), qlens)
    return cache, q, k, v, full, qlens


def expected(layer, q, full, qlens):
    out, t = [], 0
    for (kk, vv), n in zip(full, qlens):
        out.append(causal_attention(q[t:t + n], kk[layer], vv[layer], kk.shape[1] - n)); t += n
    return torch.cat(out)


# ---------------------------------------------------------------- paged attention == contiguous attention
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed,block_size,heads", [(0, 16, (9, 3)), (1, 4, (4, 1)), (2, 1, (6, 6)), (3, 7, (8, 2)), (4, 16, (2, 2))])
def test_paged_attention_matches_contiguous(impl, seed, block_size, heads):
    cfg = attn_cfg(*heads, d=32)
    cache, q, k, v, full, qlens = random_step(cfg, 11, block_size, (1, 70), 0.3, seed, attn_impl=impl, decode_group=4)
    assert any(n > 1 for n in qlens) and any(n == 1 for n in qlens)
    for layer in range(cfg.num_hidden_layers):
        got = cache.attend(layer, q[layer], k[layer], v[layer])
        torch.testing.assert_close(got, expected(layer, q[layer], full, qlens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_prefill_and_all_decode_steps(impl):
    cfg = attn_cfg(4, 2, 16, layers=1)
    for frac in (0.0, 1.0):
        cache, q, k, v, full, qlens = random_step(cfg, 6, 8, (1, 40), frac, 7, attn_impl=impl)
        torch.testing.assert_close(cache.attend(0, q[0], k[0], v[0]), expected(0, q[0], full, qlens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_fast_decode_paths_equal_reference(seed):
    "paged_decode (one batched SDPA) and paged_decode_flash (online softmax) == the per-row reference, decode rows only."
    cfg = attn_cfg(9, 3, 64, layers=1)
    cache, q, k, v, full, qlens = random_step(cfg, 24, 16, (1, 300), 0.0, seed)
    kp, vp = cache.k[0], cache.v[0]
    kp.view(-1, 3, 64)[cache.slot_mapping] = k[0]; vp.view(-1, 3, 64)[cache.slot_mapping] = v[0]
    ref = paged_attention_ref(q[0], kp, vp, cache.block_tables, cache.context_lens, qlens)
    nb = -(-int(cache.context_lens.max()) // 16)
    blocks = cache.block_tables[:, :nb]
    mask = torch.arange(nb * 16)[None] < cache.context_lens[:, None]
    torch.testing.assert_close(paged_decode(q[0], kp, vp, blocks, mask), ref, atol=1e-5, rtol=1e-5)
    for chunk in (1, 3, 64):
        torch.testing.assert_close(paged_decode_flash(q[0], kp, vp, blocks, mask, chunk), ref, atol=1e-5, rtol=1e-5)
    if cpu_attention_kernels():   # rows in a shuffled order, reading tables wider than they need
        perm = torch.randperm(24, generator=torch.Generator().manual_seed(seed))
        out = torch.full_like(q[0], float("nan"))
        paged_decode_kernel(q[0], kp, vp, out, perm, cache.block_tables[perm].contiguous(), cache.context_lens[perm].contiguous())
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_kernel_default_and_rejections():
    cfg = attn_cfg(4, 2, 16, layers=1)
    cache = PagedKVCache(cfg, 4, 4)
    assert cache.attn_impl == ("kernel" if cpu_attention_kernels() else "gather")
    assert PagedKVCache(cfg, 4, 4, dtype=torch.float16).attn_impl == "gather"   # the kernel is float32 and bfloat16 only
    if not cpu_attention_kernels(): pytest.skip("no C compiler here")
    assert PagedKVCache(cfg, 4, 4, dtype=torch.bfloat16).attn_impl == "kernel"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PagedKVCache(cfg, 4, 4, dtype=torch.float16, attn_impl="kernel")
    with pytest.raises(ValueError, match="outside the pool"):   # a bad table must not reach the kernel's raw reads
        cache.prepare(torch.tensor([0]), torch.tensor([[7]]), torch.tensor([1]), [1])
    with pytest.raises(ValueError, match="does not fit"):
        cache.prepare(torch.tensor([0]), torch.tensor([[1]]), torch.tensor([5]), [1])
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        paged_decode_kernel(q, cache.k[0], cache.v[0], q.clone(), torch.tensor([0], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        paged_decode_kernel(q.bfloat16(), cache.k[0], cache.v[0], q.clone(), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))


@needs_kernels
@pytest.mark.parametrize("heads,d,block_size", [((9, 3), 64, 16), ((14, 2), 64, 16), ((4, 4), 128, 5), ((6, 2), 80, 16), ((3, 1), 24, 1)])
def test_prefill_kernel_long_prompts(heads, d, block_size):
    "Prompt chunks longer than the kernel's 32-token tiles, some continuing earlier context, GQA groups of 1 to 7, head sizes that are not multiples of 16."
    cfg = attn_cfg(*heads, d=d, layers=1)
    cache, q, k, v, full, qlens = random_step(cfg, 5, block_size, (40, 300), 1.0, 11, attn_impl="kernel")
    assert max(qlens) > 64 and any(n < kk.shape[1] for (kk, _), n in zip(full, qlens))
    torch.testing.assert_close(cache.attend(0, q[0], k[0], v[0]), expected(0, q[0], full, qlens), atol=1e-5, rtol=1e-5)


@needs_kernels
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
    whole = run([n])
    for chunks in ([40, 70, 40], [2, 33, 115], [31] * 4 + [26]):
        assert torch.equal(run(chunks), whole)
    both = torch.empty_like(q)   # two chunks in one call: the same again
    paged_prefill_kernel(q, kp, vp, both, torch.tensor([[0, 70, 70], [70, 80, 150]]), table.expand(2, -1).contiguous())
    assert torch.equal(both, whole)


@needs_kernels
def test_prefill_kernel_rejects_bad_rows():
    q, pool, table = torch.zeros(10, 4, 16), torch.zeros(4, 4, 2, 16), torch.zeros(1, 4, dtype=torch.long)
    for bad in ([0, 11, 11], [0, 0, 5], [0, 5, 3], [0, 5, 17], [-1, 5, 5], [6, 5, 5]):   # past q, empty, n > ctx, past the table, t0 < 0, t0 + n > T
        with pytest.raises(ValueError, match="seqs"):
            paged_prefill_kernel(q, pool, pool.clone(), q.clone(), torch.tensor([bad]), table)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        paged_prefill_kernel(q, pool, pool.clone(), q.clone(), torch.tensor([[0, 5, 5]], dtype=torch.int32), table)


@needs_kernels
@pytest.mark.parametrize("seed", range(3))
def test_bfloat16_kernel_equals_float32_attention_of_the_same_numbers(seed):
    "A bfloat16 pool: the kernel reads 16-bit K/V and computes in float32, so it matches float32 attention over the same (rounded) values to bfloat16 output precision."
    cfg = attn_cfg(9, 3, 64, layers=1)
    cache, q, k, v, full, qlens = random_step(cfg, 24, 16, (1, 300), 0.0, seed, dtype=torch.bfloat16)
    assert cache.attn_impl == "kernel"
    got = cache.attend(0, q[0].bfloat16(), k[0].bfloat16(), v[0].bfloat16())
    assert got.dtype == torch.bfloat16
    round16 = lambda t: t.bfloat16().float()
    want = torch.cat([causal_attention(round16(q[0][i:i + 1]), round16(kk[0]), round16(vv[0]), kk.shape[1] - 1)
                      for i, (kk, vv) in enumerate(full)])
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)   # bfloat16 has 8 significant bits
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@needs_kernels
def test_bfloat16_prefill_kernel_equals_float32_attention_of_the_same_numbers():
    cfg = attn_cfg(9, 3, 64, layers=1)
    cache, q, k, v, full, qlens = random_step(cfg, 4, 16, (40, 200), 1.0, 5, dtype=torch.bfloat16)
    got = cache.attend(0, q[0].bfloat16(), k[0].bfloat16(), v[0].bfloat16())
    round16 = lambda t: t.bfloat16().float()
    want = expected(0, round16(q[0]), [(round16(kk), round16(vv)) for kk, vv in full], qlens)
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


def test_prepare_groups_decode_rows_by_length():
    cfg = attn_cfg(4, 2, 16, layers=1)
    cache, *_ = random_step(cfg, 20, 4, (1, 100), 0.0, 3, attn_impl="gather", decode_group=8)
    assert [len(tok) for tok, _, _ in cache.decode_groups] == [8, 8, 4]
    widths = [blocks.shape[1] for _, blocks, _ in cache.decode_groups]
    assert widths == sorted(widths) and widths[-1] == -(-int(cache.context_lens.max()) // 4)


def test_prepare_rejects_bad_layouts():
    cfg = attn_cfg(4, 2, 16, layers=1)
    cache = PagedKVCache(cfg, 4, 4)
    with pytest.raises(ValueError, match="mismatch"):
        cache.prepare(torch.arange(3), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3]), [2])
    with pytest.raises(ValueError, match="context of only"):
        cache.prepare(torch.arange(3), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2]), [3])
    for slot in (16, -1):   # the C store writes wherever the slots say, so a slot outside the pool never reaches it
        with pytest.raises(ValueError, match="slots outside the pool"):
            cache.prepare(torch.tensor([slot]), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), [1])
    with pytest.raises(ValueError, match="attn_impl"):
        PagedKVCache(cfg, 4, 4, attn_impl="magic")


# ---------------------------------------------------------------- generation through the paged cache
def generate_contiguous(model, prompt, n):
    cache = ContiguousKVCache(model.config, len(prompt) + n, model.device, model.dtype)
    logits = model(torch.tensor(prompt), torch.arange(len(prompt)), cache.prepare(0, len(prompt)))
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        p = len(prompt) + len(out) - 1
        logits = model(torch.tensor([out[-1]]), torch.tensor([p]), cache.prepare(p, 1))
    return out


@pytest.mark.parametrize("arch,heads,block_size,chunk,impl", [
    ("Qwen2ForCausalLM", (4, 2), 4, 8, "gather"), ("Qwen2ForCausalLM", (6, 1), 16, None, "gather"),
    ("LlamaForCausalLM", (4, 4), 3, 5, "flash"), ("Qwen2ForCausalLM", (4, 2), 8, 7, "reference"),
    *[pytest.param(a, h, b, c, "kernel", marks=needs_kernels) for a, h, b, c in [("Qwen2ForCausalLM", (4, 2), 4, 8), ("LlamaForCausalLM", (4, 1), 5, None)]]])
def test_generate_paged_equals_contiguous(arch, heads, block_size, chunk, impl):
    cfg = ModelConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads[0],
                      num_key_value_heads=heads[1], architecture=arch, attention_bias=arch == "Qwen2ForCausalLM")
    torch.manual_seed(block_size)
    model = CausalLM(cfg, max_positions=128).eval()
    with torch.no_grad():  # random init is small; larger weights make the greedy paths diverge on real differences
        for p in model.parameters(): p.mul_(4)
    prompts = [torch.randint(0, 301, (n,)).tolist() for n in (1, 9, 23, 40, 4)]
    n_blocks = sum(-(-(len(p) + 16) // block_size) for p in prompts)
    cache = PagedKVCache(cfg, n_blocks, block_size, attn_impl=impl, decode_group=2)
    got = generate_paged(model, prompts, 16, block_size, chunk_size=chunk, cache=cache)
    assert got == [generate_contiguous(model, p, 16) for p in prompts]


def test_generate_paged_bundled_model():
    model, tok = load_model("smollm2-135m")
    prompts = [tok.encode(s) for s in ("The capital of France is", "Hi")]
    got = generate_paged(model, prompts, 5, chunk_size=3)   # the longer prompt is chunked while the other decodes
    assert got == [generate_contiguous(model, p, 5) for p in prompts]


# ---------------------------------------------------------------- allocator and block tables
def test_allocator_basics_and_bad_input():
    a = BlockAllocator(6)
    x = a.allocate(4)
    assert (len(set(x)), a.num_free, a.num_used) == (4, 2, 4)
    free_before, refs_before = list(a.free_blocks), list(a.ref_counts)
    assert a.allocate(3) is None                                   # over-allocation: None, nothing changed
    assert (list(a.free_blocks), a.ref_counts) == (free_before, refs_before)
    assert a.allocate(0) == []
    with pytest.raises(ValueError): a.allocate(-1)
    a.free(x[:2])
    with pytest.raises(ValueError, match="already free"): a.free(x[:1])  # double free
    with pytest.raises(ValueError, match="not a block"): a.free([6])
    with pytest.raises(ValueError, match="not a block"): a.free([-1])
    with pytest.raises(ValueError): a.free([x[2], x[2]])             # freeing twice in one call
    assert a.ref_counts[x[2]] == 1                                  # ... and the failed call changed nothing
    with pytest.raises(ValueError): a.incref([x[0]])                # sharing a free block
    a.incref([x[2]]); a.free([x[2]]); assert a.ref_counts[x[2]] == 1 and x[2] not in a.free_blocks
    a.free([x[2], x[3]])
    assert a.num_free == 6 and sorted(a.free_blocks) == list(range(6))
    with pytest.raises(ValueError): BlockAllocator(0)


def test_block_table_append_slots_free():
    a = BlockAllocator(5)
    t = BlockTable(4)
    assert t.append(10, a) and len(t.blocks) == 3 and t.num_tokens == 10
    assert t.slots(8, 2) == [t.blocks[2] * 4, t.blocks[2] * 4 + 1]
    assert t.blocks_needed(2) == 0 and t.blocks_needed(3) == 1 and t.blocks_needed(11) == 3
    before = (list(t.blocks), t.num_tokens, a.num_free)
    assert not t.append(11, a) and (list(t.blocks), t.num_tokens, a.num_free) == before   # can't: unchanged
    with pytest.raises(ValueError): t.slots(9, 2)
    t.free(a)
    assert (t.blocks, t.num_tokens, a.num_free) == ([], 0, 5)


class AllocatorMachine(RuleBasedStateMachine):
    "Random interleavings of sequences growing, sharing blocks, and finishing."
    @initialize(num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.alloc, self.block_size, self.tables, self.shared = BlockAllocator(num_blocks), block_size, [], []

    @rule(n=st.integers(0, 40))
    def new_sequence(self, n):
        t = BlockTable(self.block_size)
        free = self.alloc.num_free
        need = t.blocks_needed(n)
        ok = t.append(n, self.alloc)
        assert ok == (need <= free)
        if ok: self.tables.append(t)
        else: assert self.alloc.num_free == free and t.blocks == [] and t.num_tokens == 0

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), n=st.integers(1, 20))
    def grow(self, i, n):
        t = self.tables[i % len(self.tables)]
        before, free = (list(t.blocks), t.num_tokens), self.alloc.num_free
        need = t.blocks_needed(n)
        ok = t.append(n, self.alloc)
        assert ok == (need <= free)
        if not ok: assert (list(t.blocks), t.num_tokens, self.alloc.num_free) == (*before, free)
        else: assert len(t.blocks) == -(-t.num_tokens // self.block_size)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def share_prefix(self, i):
        "What chapter 4 will do: another owner takes a reference on a sequence's full blocks."
        t = self.tables[i % len(self.tables)]
        full = t.blocks[:t.num_tokens // self.block_size]
        self.alloc.incref(full)
        self.shared.append(full)

    @precondition(lambda self: self.shared)
    @rule()
    def release_share(self):
        self.alloc.free(self.shared.pop())

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        t = self.tables.pop(i % len(self.tables))
        t.free(self.alloc)
        with pytest.raises(ValueError): self.alloc.free([self.alloc.num_blocks])

    @rule(b=st.integers(0, 39))
    def double_free_raises_when_free(self, b):
        if b < self.alloc.num_blocks and self.alloc.ref_counts[b] == 0:
            state = (list(self.alloc.free_blocks), list(self.alloc.ref_counts))
            with pytest.raises(ValueError): self.alloc.free([b])
            assert state == (list(self.alloc.free_blocks), list(self.alloc.ref_counts))

    @invariant()
    def consistent(self):
        if not hasattr(self, "alloc"): return
        a = self.alloc
        owners = Counter(b for t in self.tables for b in t.blocks) + Counter(b for s in self.shared for b in s)
        assert all(n == 1 for n in Counter(b for t in self.tables for b in t.blocks).values())  # no block in two tables
        assert a.num_free + a.num_used == a.num_blocks
        assert all(r >= 0 for r in a.ref_counts)
        assert len(set(a.free_blocks)) == len(a.free_blocks)
        assert all(a.ref_counts[b] == 0 for b in a.free_blocks)
        assert all(a.ref_counts[b] == n for b, n in owners.items())
        assert a.num_used == len(owners)

    def teardown(self):
        if not hasattr(self, "alloc"): return
        while self.shared: self.alloc.free(self.shared.pop())
        for t in self.tables: t.free(self.alloc)
        assert self.alloc.num_free == self.alloc.num_blocks and not any(self.alloc.ref_counts)  # nothing leaked


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- memory plan
def test_memory_plan_numbers_and_check():
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, tie_word_embeddings=True)
    for tie, arch in ((True, "LlamaForCausalLM"), (False, "Qwen2ForCausalLM")):
        c = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                        num_key_value_heads=2, tie_word_embeddings=tie, architecture=arch, attention_bias=arch.startswith("Qwen"))
        assert count_parameters(c) == sum(p.numel() for p in CausalLM(c, max_positions=8).parameters())
    assert count_parameters(smol) == 134_515_008
    assert kv_bytes_per_token(smol, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    plan = plan_memory(smol, "cpu", torch.float32, kv_cache_memory_gb=0.5, block_size=16)
    assert plan.num_blocks == int(0.5 * 1024**3 // (16 * 2 * 30 * 3 * 64 * 4))
    assert plan.num_tokens == plan.num_blocks * 16 and plan.kv_bytes <= 0.5 * 1024**3
    assert plan_memory(smol, "cpu").num_blocks == 1024**3 // plan.block_bytes       # CPU default: 1 GB
    text = plan.table()
    assert "weights" in text and "KV pool" in text and f"{plan.num_blocks} blocks" in text and "safety" in text
    plan.check(plan.num_tokens)
    with pytest.raises(ValueError, match=r"max_model_len=\d+"): plan.check(plan.num_tokens + 1)
    tiny = plan_memory(smol, "cpu", kv_cache_memory_gb=0.001)
    with pytest.raises(ValueError, match="cannot hold one sequence"): tiny.check(2048)
    model = CausalLM(attn_cfg(4, 2, 16), max_positions=8)
    info = info_table(model, plan_memory(model.config, "cpu"), name="tiny")
    assert "tiny" in info and "torch" in info and "KV pool" in info
    cache = PagedKVCache.from_plan(model.config, plan_memory(model.config, "cpu", kv_cache_memory_gb=0.001))
    assert cache.k.shape[1] == cache.num_blocks > 0


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
    if hasattr(mmap, "MADV_HUGEPAGE"): assert PagedKVCache(attn_cfg(), 10, 4).k.data_ptr() % (2 << 20) == 0   # the cache uses it
