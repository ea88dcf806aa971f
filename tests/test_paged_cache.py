"Tests of chapter 2: block allocator and tables, memory plan, paged attention in PyTorch, StepInputs, generation through the paged cache."
from collections import Counter

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_infer.model.loader import load_model
from mini_infer.model.model import CausalLM, ModelConfig
from mini_infer.engine.block_manager import BlockAllocator, BlockTable
from mini_infer.engine.memory_plan import plan_memory, count_parameters, kv_bytes_per_token, info_table
from mini_infer.engine.attention import TorchAttention, paged_attention_ref, paged_decode, paged_decode_flash
from mini_infer.engine.kv_cache import PagedKVCache
from mini_infer.course.teaching import generate_paged, random_paged_step, attention_by_row
from mini_infer.engine.reference import generate
from mini_infer.engine.sampling import SamplingParams

IMPLS = ["reference", "gather", "flash"]


def attn_cfg(n_q=9, n_kv=3, d=64, layers=2):
    return ModelConfig(vocab_size=8, hidden_size=n_q * d, intermediate_size=8, num_hidden_layers=layers,
                       num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=d)


# ---------------------------------------------------------------- paged attention == contiguous attention
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed,block_size,heads", [(0, 16, (9, 3)), (1, 4, (4, 1)), (2, 1, (6, 6)), (3, 7, (8, 2)), (4, 16, (2, 2))])
def test_paged_attention_matches_contiguous(impl, seed, block_size, heads):
    cfg = attn_cfg(*heads, d=32)
    cache, rows, q, k, v, fk, fv = random_paged_step(cfg, 11, block_size, (1, 70), chunk_rows=(1, 4, 8), seed=seed,
                                                     backend=TorchAttention(impl, decode_group=4))
    step = cache.make_step(rows)
    assert 0 < step.num_decodes < len(rows)
    for layer in range(cfg.num_hidden_layers):   # every layer's pool holds the same context here
        torch.testing.assert_close(cache.attend(layer, q, k, v, step), attention_by_row(q, fk, fv, rows), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_prefill_and_all_decode_steps(impl):
    cfg = attn_cfg(4, 2, 16, layers=1)
    for chunk_rows in ((), range(6)):
        cache, rows, q, k, v, fk, fv = random_paged_step(cfg, 6, 8, (2, 40), chunk_rows=chunk_rows, seed=7, backend=TorchAttention(impl))
        step = cache.make_step(rows)
        assert step.num_decodes == (6 if not chunk_rows else 0)
        torch.testing.assert_close(cache.attend(0, q, k, v, step), attention_by_row(q, fk, fv, rows), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_fast_decode_paths_equal_reference(seed):
    "paged_decode (one batched SDPA) and paged_decode_flash (online softmax) == the per-row reference, decode rows only."
    cfg = attn_cfg(9, 3, 64, layers=1)
    cache, rows, q, k, v, fk, fv = random_paged_step(cfg, 24, 16, (1, 300), seed=seed)
    step = cache.make_step(rows)
    kp, vp = cache.k[0], cache.v[0]
    kp.view(-1, 3, 64)[step.slot_mapping] = k; vp.view(-1, 3, 64)[step.slot_mapping] = v
    ref = paged_attention_ref(q, kp, vp, step.block_tables, step.seq_lens, step.query_lens)
    nb = -(-max(step.seq_lens) // 16)
    blocks = step.block_tables[:, :nb]
    mask = torch.arange(nb * 16)[None] < step.context_lens[:, None]
    torch.testing.assert_close(paged_decode(q, kp, vp, blocks, mask), ref, atol=1e-5, rtol=1e-5)
    for chunk in (1, 3, 64):
        torch.testing.assert_close(paged_decode_flash(q, kp, vp, blocks, mask, chunk), ref, atol=1e-5, rtol=1e-5)


def test_torch_attention_takes_a_decode_function():
    "A function with `paged_decode_flash`'s first five arguments serves the decode rows (the exercises plug theirs in)."
    from functools import partial
    cfg = attn_cfg(9, 3, 64, layers=1)
    calls = []

    def decode(q, k_pool, v_pool, blocks, mask):
        calls.append(len(q))
        return paged_decode_flash(q, k_pool, v_pool, blocks, mask, 1)
    cache, rows, q, k, v, fk, fv = random_paged_step(cfg, 12, 16, (1, 100), chunk_rows=(3,), seed=5,
                                                     backend=TorchAttention(decode))
    step = cache.make_step(rows)
    out = cache.attend(0, q, k, v, step)
    torch.testing.assert_close(out, attention_by_row(q, fk, fv, rows), atol=1e-5, rtol=1e-5)
    assert sum(calls) == step.num_decodes < len(rows)            # every decode row, no prompt chunk
    with pytest.raises(ValueError, match="or a function"): TorchAttention("flashy")


def test_torch_plan_groups_decode_rows_by_length():
    cfg = attn_cfg(4, 2, 16, layers=1)
    cache, rows, *_ = random_paged_step(cfg, 20, 4, (1, 100), seed=3, backend=TorchAttention("gather", decode_group=8))
    step = cache.make_step(rows)
    assert [len(r) for r, _, _ in step.attn.decode_groups] == [8, 8, 4] and step.attn.prefills == []
    widths = [blocks.shape[1] for _, blocks, _ in step.attn.decode_groups]
    assert widths == sorted(widths) and widths[-1] == -(-max(step.seq_lens) // 4)


def test_make_step_layout_and_rejections():
    "One StepInputs per step: tokens, positions, slots, tables and logits rows as the rows say; bad rows never reach attention."
    cfg = attn_cfg(4, 2, 16, layers=1)
    cache, alloc = PagedKVCache(cfg, 6, 4), BlockAllocator(6)
    a, b = BlockTable(4), BlockTable(4)
    assert a.append(6, alloc) and b.append(3, alloc)
    step = cache.make_step([([7], 5, a.blocks, 1), ([1, 2, 3], 0, b.blocks, 2)])   # a decodes its 6th token; b's prompt wants 2 logits
    assert step.input_ids.tolist() == [7, 1, 2, 3] and step.positions.tolist() == [5, 0, 1, 2]
    assert step.slot_mapping.tolist() == a.slots(5, 1) + b.slots(0, 3) and step.logits_indices.tolist() == [0, 2, 3]
    assert step.block_tables.tolist() == [a.blocks, b.blocks + [0]] and step.context_lens.tolist() == [6, 3]
    assert (step.query_lens, step.seq_lens, step.num_decodes, step.block_tables.dtype) == ([1, 3], [6, 3], 1, torch.int64)
    with pytest.raises(ValueError, match="outside the row's 2 blocks"): cache.make_step([([1, 2, 3], 6, a.blocks, 1)])   # slots a does not hold
    with pytest.raises(ValueError, match="outside the pool"): cache.make_step([([1], 0, [8], 1)])


def test_attention_backend_rejects_unknown_impl():
    with pytest.raises(ValueError, match="impl"): TorchAttention("magic")


# ---------------------------------------------------------------- generation through the paged cache
class NoText:
    "Tokens only: chapter 1's generate wants a tokenizer for the text, which these tests do not look at."
    eos_token_ids = []
    def decode(self, ids, skip_special_tokens=True): return ""


def generate_contiguous(model, prompt, n, tok=NoText()):
    return generate(model, tok, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("arch,heads,block_size,chunk,impl", [
    ("Qwen2ForCausalLM", (4, 2), 4, 8, "gather"), ("Qwen2ForCausalLM", (6, 1), 16, None, "gather"),
    ("LlamaForCausalLM", (4, 4), 3, 5, "flash"), ("Qwen2ForCausalLM", (4, 2), 8, 7, "reference")])
def test_generate_paged_equals_contiguous(arch, heads, block_size, chunk, impl):
    cfg = ModelConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads[0],
                      num_key_value_heads=heads[1], architecture=arch, attention_bias=arch == "Qwen2ForCausalLM")
    torch.manual_seed(block_size)
    model = CausalLM(cfg, max_positions=128).eval()
    with torch.no_grad():  # random init is small; larger weights make the greedy paths diverge on real differences
        for p in model.parameters(): p.mul_(4)
    prompts = [torch.randint(0, 301, (n,)).tolist() for n in (1, 9, 23, 40, 4)]
    n_blocks = sum(-(-(len(p) + 16) // block_size) for p in prompts)
    cache = PagedKVCache(cfg, n_blocks, block_size, backend=TorchAttention(impl, decode_group=2))
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
    kept = t.blocks[:2]
    t.truncate(6, a)                                             # back to 6 tokens: the third block is freed
    assert (t.blocks, t.num_tokens, a.num_free) == (kept, 6, 3)
    t.truncate(6, a); assert a.num_free == 3                      # nothing more to free
    with pytest.raises(ValueError): t.truncate(7, a)              # cannot grow by truncating
    t.free(a)
    assert (t.blocks, t.num_tokens, a.num_free) == ([], 0, 5)


def test_block_table_share_and_remap():
    "`share` appends full blocks that hold the next tokens (one more owner each); `remap` swaps a twin in."
    a, S = BlockAllocator(6), 4
    first, second = BlockTable(S), BlockTable(S)
    assert first.append(8, a)                                    # two full blocks
    second.share(first.blocks, a)                                # a second sequence starts after them
    assert (second.blocks, second.num_tokens) == (first.blocks, 8)
    assert [a.ref_counts[b] for b in first.blocks] == [2, 2] and a.num_used == 2
    assert second.append(3, a) and len(second.blocks) == 3       # then grows on its own
    with pytest.raises(ValueError, match="partly filled"): second.share(first.blocks[:1], a)
    with pytest.raises(ValueError, match="already free"): BlockTable(S).share([5], a)   # a free block
    twin = a.allocate(1)[0]                                       # an identical copy of its third block
    a.free([second.blocks[2]]); second.remap(2, twin)             # the caller moves the reference
    assert second.blocks[2] == twin and a.num_used == 3
    with pytest.raises(ValueError, match="no logical block"): second.remap(3, twin)
    second.free(a); first.free(a)
    assert a.num_free == 6


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
    @rule(i=st.integers(0, 100), keep=st.floats(0, 1))
    def roll_back(self, i, keep):
        "Preemption and rejected guesses: keep the first tokens, free the blocks past them."
        t = self.tables[i % len(self.tables)]
        n = int(t.num_tokens * keep)
        t.truncate(n, self.alloc)
        assert t.num_tokens == n and len(t.blocks) == -(-n // self.block_size)

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


