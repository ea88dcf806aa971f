"""The scheduler on its own, with no model: every step's work respects the budget, the seats, the chunk size and the
pool; decodes come first; preemption takes the newest request and frees its blocks; everything finishes and every
block comes back. Property-tested over random workloads (hypothesis)."""
from hypothesis import given, settings, strategies as st

from mini_infer.block_manager import BlockAllocator
from mini_infer.sampling import SamplingParams
from mini_infer.scheduler import Scheduler, SchedulerConfig, Sequence, SeqStatus


class CharTok:
    "Token id = a character: the scheduler never looks at text."
    eos_token_ids = []
    def decode(self, ids, skip_special_tokens=True): return "".join(map(chr, ids))


def run(prompt_lens, out_lens, num_blocks, block_size=4, max_steps=10_000, **cfg):
    "Drive the scheduler with a fake model (every finished row emits token 0); check each step; return the steps' work."
    alloc = BlockAllocator(num_blocks)
    config = SchedulerConfig(**cfg)
    sched = Scheduler(config, alloc)
    seqs = [Sequence(str(i), [1] * n, SamplingParams(max_tokens=m), CharTok(), 10**6, block_size) for i, (n, m) in enumerate(zip(prompt_lens, out_lens))]
    for s in seqs: sched.add(s)
    steps = []
    while sched.has_unfinished():
        assert len(steps) < max_steps, "no progress"
        step = sched.schedule()
        work = [(s.request_id, n, s.is_decoding) for s, n in step.work]
        steps.append((work, [s.request_id for s in step.preempted]))
        check_step(step, config, alloc, sched, block_size)
        for seq, n in step.work:
            seq.num_computed_tokens += n
            if seq.num_pending == 0:
                seq.append(48)
                if seq.finish_reason: sched.finish(seq)
    assert alloc.num_free == num_blocks and all(len(s.output_ids) == s.params.max_tokens for s in seqs)
    return steps


def check_step(step, config, alloc, sched, block_size):
    tokens = sum(n for _, n in step.work)
    decoding = [s.is_decoding for s, _ in step.work]
    assert decoding == sorted(decoding, reverse=True), "decodes come first"
    assert all(n == 1 for (s, n), d in zip(step.work, decoding) if d)
    assert len({s.request_id for s, _ in step.work}) == len(step.work) <= config.max_num_seqs
    if config.enable_chunked_prefill or len(step.work) > 1: assert tokens <= config.max_num_batched_tokens
    if config.enable_chunked_prefill: assert all(n <= config.max_prefill_chunk for s, n in step.work)
    else: assert all(s.num_computed_tokens == 0 and n == s.num_pending or d for (s, n), d in zip(step.work, decoding))
    for s, n in step.work:   # every scheduled token has a slot in the sequence's blocks
        assert s.status is SeqStatus.RUNNING and s.block_table.num_tokens == s.num_computed_tokens + n
        assert len(s.block_table.blocks) == -(-(s.num_computed_tokens + n) // block_size)
    for s in step.preempted:
        assert s.status is SeqStatus.PREEMPTED and s.num_computed_tokens == 0 and s.block_table.blocks == [] and s in sched.waiting
    held = sum(len(s.block_table.blocks) for s in sched.running)
    assert held == alloc.num_used <= alloc.num_blocks


def test_chunked_prefill_and_decodes_share_a_step():
    steps = run([10, 6, 9], [8, 8, 8], num_blocks=12, max_num_batched_tokens=8, max_prefill_chunk=8)
    assert steps[0] == ([("0", 8, False)], [])                       # the first prompt, chunked to the budget
    assert steps[1] == ([("0", 2, False), ("1", 6, False)], [])      # its rest, then the next prompt in the same step
    assert steps[2][0][:2] == [("0", 1, True), ("1", 1, True)]       # decodes first, then the next prompt's chunk


def test_preemption_takes_the_newest_request_and_recomputes_it():
    steps = run([10, 6, 9], [8, 8, 8], num_blocks=12, max_num_batched_tokens=8, max_prefill_chunk=8)
    pre = [p for _, ps in steps for p in ps]
    assert pre and set(pre) == {"2"}                                 # the last admitted request is the victim
    i = next(i for i, (_, ps) in enumerate(steps) if ps)
    assert "2" not in [r for r, _, _ in steps[i][0]]
    assert any(r == "2" and not d for w, _ in steps[i + 1:] for r, n, d in w)   # later prefilled again from scratch


def test_seats_and_fcfs():
    steps = run([4] * 6, [3] * 6, num_blocks=64, max_num_seqs=2)
    admitted = [r for w, _ in steps for r, _, d in w if not d]
    assert admitted == [str(i) for i in range(6)]                    # first come, first served
    assert max(len(w) for w, _ in steps) == 2


def test_whole_prompts_when_chunking_is_off():
    steps = run([3, 20, 5], [2, 2, 2], num_blocks=64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    prefills = [(r, n) for w, _ in steps for r, n, d in w if not d]
    assert prefills == [("0", 3), ("1", 20), ("2", 5)]               # the 20-token prompt runs alone, over the budget
    assert [w for w, _ in steps if ("1", 20, False) in w] == [[("1", 20, False)]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=10), st.integers(1, 32),
       st.integers(1, 12), st.integers(1, 8), st.booleans(), st.integers(1, 4))
def test_random_workloads_finish_within_the_rules(reqs, budget, chunk, seats, chunked, block_size):
    longest = max(n + m for n, m in reqs)
    num_blocks = -(-longest // block_size) + 2                       # room for the longest request, little more
    run([n for n, _ in reqs], [m for _, m in reqs], num_blocks, block_size, max_num_batched_tokens=budget,
        max_prefill_chunk=chunk, max_num_seqs=seats, enable_chunked_prefill=chunked)


def test_proposed_tokens_are_scheduled_with_the_decode_within_the_budget():
    "A decoding sequence with k proposed tokens runs 1 + k tokens in one step; the budget trims the proposals, never the decode."
    alloc = BlockAllocator(32)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4), alloc)
    a, b = (Sequence(x, [1, 2, 3], SamplingParams(max_tokens=9), CharTok(), 10**6, 4) for x in "ab")
    for s in (a, b): sched.add(s)
    for seq, n in sched.schedule().work: seq.num_computed_tokens += n      # a's prompt (3) and one token of b's
    a.append(50); a.spec_token_ids = [51, 52, 53, 54]
    work = sched.schedule().work
    assert [(s.request_id, n) for s, n in work] == [("a", 4)] and a.spec_token_ids == [51, 52, 53]   # 1 + 3 fill the budget of 4
    assert a.token_slice(3, 4) == [50, 51, 52, 53] and a.block_table.num_tokens == 7


def test_truncate_rolls_back_computed_tokens_and_blocks():
    alloc = BlockAllocator(8)
    s = Sequence("a", list(range(10)), SamplingParams(max_tokens=4), CharTok(), 10**6, 4)
    assert s.block_table.append(10, alloc)
    s.num_computed_tokens = 10
    s.truncate(5, alloc)
    assert (s.num_computed_tokens, s.block_table.num_tokens, len(s.block_table.blocks), alloc.num_used) == (5, 5, 2, 2)
    s.truncate(0, alloc)
    assert (s.num_computed_tokens, s.block_table.blocks, alloc.num_used) == (0, [], 0)
