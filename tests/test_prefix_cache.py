"""Prefix caching without a model: chained sha256 keys, the allocator's map and LRU, and a hypothesis state machine that
drives the caching scheduler with a shadow KV pool. After every step the pool's invariants hold, every block's
reference count equals the tables that hold it, no write lands in a shared or cached block, and every position a
sequence attends to holds exactly the token (after exactly the prefix) it should, also when the hash function returns
a constant."""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
import pytest

from mini_infer.plugins.prefix_cache import PrefixCachingAllocator, PrefixCachingKVManager, hash_block
from mini_infer.engine.sampling import SamplingParams
from mini_infer.engine.scheduler import RunnerOutput, Scheduler, SchedulerConfig, Sequence, SeqStatus


class CharTok:
    eos_token_ids = []
    def decode(self, ids, skip_special_tokens=True): return "".join(map(chr, ids))


def test_keys_chain_and_tag_their_extras():
    a, b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [1, 2, 3, 5])
    assert len(a) == 32 and a != b and a == hash_block(None, (1, 2, 3, 4))
    assert hash_block(a, [9] * 4) != hash_block(b, [9] * 4)               # same tokens, different prefix: different key
    salted = hash_block(None, [1, 2, 3, 4], (("cache_salt", "x"),))
    assert salted != a and salted != hash_block(None, [1, 2, 3, 4], (("lora", "x"),))   # kinds never collide
    assert hash_block(None, [12, 3]) != hash_block(None, [1, 23])          # token boundaries are part of the key


def test_lru_keeps_cached_blocks_until_a_fresh_block_is_needed():
    alloc = PrefixCachingAllocator(4)
    blocks = alloc.allocate(3)
    keys = []
    for i, b in enumerate(blocks):
        keys.append(hash_block(keys[-1] if keys else None, [i] * 4))
        assert alloc.cache_block(b, blocks[i - 1] if i else None, keys[-1], [i] * 4) == b
    alloc.free(blocks[::-1])                                             # a table frees its tail first
    alloc.check()
    assert (alloc.num_free, alloc.num_cached_free, alloc.num_used) == (4, 3, 0)
    assert alloc.lookup(None, keys[0], [0] * 4) == blocks[0]
    assert alloc.lookup(None, keys[0], [0, 0, 0, 1]) is None                 # tokens are compared: a collision is a miss
    assert alloc.allocate(2) is not None                                 # the never-cached block, then the LRU: the tail
    assert alloc.num_evictions == 1 and alloc.lookup(blocks[1], keys[2], [2] * 4) is None
    assert alloc.lookup(blocks[0], keys[1], [1] * 4) == blocks[1]
    alloc.incref([blocks[0]])                                            # a hit brings a cached-free block back into use
    assert alloc.ref_counts[blocks[0]] == 1 and alloc.num_cached_free == 1
    alloc.check()


def test_cache_block_returns_an_identical_block_and_refuses_a_colliding_key():
    alloc = PrefixCachingAllocator(4, hash_fn=lambda *a: b"k")
    x, y, z = alloc.allocate(3)
    assert alloc.cache_block(x, None, b"k", [1, 2]) == x
    assert alloc.cache_block(y, None, b"k", [1, 2]) == x                    # the owner of y should hold x instead
    assert alloc.ref_counts[x] == alloc.ref_counts[y] == 1 and y not in alloc.entries
    assert alloc.cache_block(z, None, b"k", [3, 4]) is None                 # the key holds other tokens
    alloc.check()


def test_table_edits_keep_reference_counts():
    "`BlockTable.share` appends blocks computed elsewhere (each gains an owner); `remap` points a block at its twin."
    from mini_infer.engine.block_manager import BlockTable
    alloc = PrefixCachingAllocator(6)
    a, b = BlockTable(4), BlockTable(4)
    assert a.append(8, alloc)
    b.share(a.blocks, alloc)
    assert b.blocks == a.blocks and b.num_tokens == 8 and all(alloc.ref_counts[x] == 2 for x in a.blocks)
    assert b.append(2, alloc)
    with pytest.raises(ValueError, match="partly filled"): b.share(a.blocks[:1], alloc)
    twin = alloc.allocate(1)[0]
    alloc.incref([twin]); alloc.free([a.blocks[1]]); a.remap(1, twin)   # the owner moves to the twin
    assert a.blocks[1] == twin and alloc.ref_counts[twin] == 2 and alloc.ref_counts[b.blocks[1]] == 1
    with pytest.raises(ValueError, match="no logical block"): b.remap(5, twin)
    alloc.free([twin]); a.free(alloc); b.free(alloc)
    assert alloc.num_used == 0
    alloc.check()


def test_a_reused_parent_never_passes_for_the_old_one():
    "A child entry names its parent's registration, not just its block number: keys here ignore the parent."
    alloc = PrefixCachingAllocator(2)
    p, c = alloc.allocate(2)
    alloc.cache_block(p, None, b"p1", [1]); alloc.cache_block(c, p, b"c2", [2])
    assert alloc.lookup(p, b"c2", [2]) == c
    alloc.free([p, c])                                   # p is the least recently freed: evicted first
    assert alloc.allocate(1) == [p] and alloc.lookup(p, b"c2", [2]) is None
    alloc.cache_block(p, None, b"p7", [7])                  # block p now holds another prefix
    assert alloc.lookup(p, b"c2", [2]) is None           # c still names p's old registration



# ---------------------------------------------------------------- the scheduler, driven with a shadow pool

BLOCK = 4

class CachingMachine(RuleBasedStateMachine):
    "Random requests over a few shared prefixes; the fake model writes (token, prefix) into a shadow pool."
    @initialize(num_blocks=st.integers(6, 40), budget=st.integers(1, 24), chunk=st.integers(1, 16),
                seats=st.integers(1, 6), chunked=st.booleans(), constant_hash=st.booleans())
    def setup(self, num_blocks, budget, chunk, seats, chunked, constant_hash):
        self.kv = PrefixCachingKVManager(num_blocks, BLOCK, hash_fn=(lambda *a: b"c") if constant_hash else hash_block)
        self.alloc = self.kv.allocator
        self.config = SchedulerConfig(max_num_batched_tokens=budget, max_prefill_chunk=chunk, max_num_seqs=seats, enable_chunked_prefill=chunked)
        self.sched = Scheduler(self.config, self.kv)   # raises if requests wait, none runs and none can start
        self.pool, self.seqs, self.capacity, self.n = {}, [], num_blocks * BLOCK, 0

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5,) * 13]),
          tail=st.lists(st.integers(1, 3), max_size=6), out=st.integers(1, 6), salt=st.sampled_from([None, None, "a"]))
    def add(self, prefix, tail, out, salt):
        prompt = list(prefix) + tail or [1]
        if len(prompt) + out > self.capacity: return
        seq = Sequence(str(self.n), prompt, SamplingParams(max_tokens=out), CharTok(), 10**6, BLOCK, cache_salt=salt)
        self.n += 1; self.seqs.append(seq); self.sched.add(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        seq.finish_reason = "abort"
        self.sched.finish(seq)

    @precondition(lambda self: self.seqs)
    @rule()
    def step(self):
        out = self.sched.schedule()
        wanted = []
        for row in out.scheduled:
            seq, n = self.sched.requests[row.request_id], len(row.token_ids)
            table, start = seq.block_table, seq.num_computed_tokens
            if not self.config.enable_chunked_prefill: assert n == seq.num_pending, "a prompt split with chunked prefill off"
            expected = [(t, seq.cache_salt, tuple(seq.token_slice(0, p))) for p, t in enumerate(seq.token_slice(0, start + n))]
            for p in range(start):                           # what the sequence attends to is what it would have computed
                assert self.pool[table.slots(p, 1)[0]] == expected[p], f"position {p} of {seq.request_id} holds another token"
            for p, slot in enumerate(table.slots(start, n), start):
                block = slot // BLOCK
                assert self.alloc.ref_counts[block] == 1 and block not in self.alloc.entries, "a write into a shared or cached block"
                self.pool[slot] = expected[p]
            if row.num_logits: wanted.append((row.request_id, [len(seq.output_ids) % 2 + 1]))
        self.sched.update(out, RunnerOutput([r for r, _ in wanted], [t for _, t in wanted], [[None] for _ in wanted]))
        self.seqs = [s for s in self.seqs if s.finish_reason is None]

    @invariant()
    def blocks_add_up(self):
        if not hasattr(self, "alloc"): return
        self.alloc.check()
        held = {}
        for s in self.sched.running + list(self.sched.waiting):
            for b in s.block_table.blocks: held[b] = held.get(b, 0) + 1
        assert all(self.alloc.ref_counts[b] == held.get(b, 0) for b in range(self.alloc.num_blocks))


TestCachingMachine = CachingMachine.TestCase
TestCachingMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_shared_prompts_in_one_batch_compute_the_prefix_once():
    kv = PrefixCachingKVManager(32, BLOCK)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    seqs = [Sequence(str(i), list(range(1, 17)) + [20 + i], SamplingParams(max_tokens=1), CharTok(), 10**6, BLOCK) for i in range(3)]
    for s in seqs: sched.add(s)
    first = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in first.scheduled] == [("0", 17)]     # the others wait for its blocks
    sched.update(first, RunnerOutput(["0"], [[5]], [[None]]))
    second = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in second.scheduled] == [("1", 1), ("2", 1)]
    assert seqs[1].block_table.blocks[:4] == seqs[2].block_table.blocks[:4] == second.scheduled[0].block_ids[:4]
    assert sched.stats()["prefix_cache_hits_total"] == 32 and seqs[1].num_cached_tokens == 16
