"""The scheduler on its own, with no model: every step's work respects the budget, the seats, the chunk size and the
pool; decodes come first; preemption takes the newest request and frees its blocks; everything finishes and every
block comes back. Property-tested over random workloads (hypothesis)."""
from hypothesis import given, settings, strategies as st

from mini_infer.engine.block_manager import BlockAllocator
from mini_infer.engine.sampling import SamplingParams
from mini_infer.engine.scheduler import KVManager, RunnerOutput, Scheduler, SchedulerConfig, Sequence, SeqStatus


class CharTok:
    "Token id = a character: the scheduler never looks at text."
    eos_token_ids = []
    def decode(self, ids, skip_special_tokens=True): return "".join(map(chr, ids))


def fake_runner(out) -> RunnerOutput:
    "A model that always emits token 48 ('0'), for every row that wants logits (guesses all rejected)."
    rows = [r for r in out.scheduled if r.num_logits]
    return RunnerOutput([r.request_id for r in rows], [[48] for _ in rows], [[None] for _ in rows])


def run(prompt_lens, out_lens, num_blocks, block_size=4, max_steps=10_000, **cfg):
    "Drive the scheduler with a fake runner; check each step's plan; return the steps' work."
    kv = KVManager(num_blocks, block_size)
    config = SchedulerConfig(**cfg)
    sched = Scheduler(config, kv)
    seqs = [Sequence(str(i), [1] * n, SamplingParams(max_tokens=m), CharTok(), 10**6, block_size)
            for i, (n, m) in enumerate(zip(prompt_lens, out_lens))]
    for s in seqs: sched.add(s)
    steps = []
    while sched.has_unfinished():
        assert len(steps) < max_steps, "no progress"
        out = sched.schedule()
        work = [(sched.requests[r.request_id], len(r.token_ids)) for r in out.scheduled]
        preempted = [sched.requests[rid] for rid in out.preempted_ids]
        steps.append(([(s.request_id, n, s.is_decoding) for s, n in work], out.preempted_ids))
        check_step(work, preempted, config, kv.allocator, sched, block_size)
        sched.update(out, fake_runner(out))
    assert kv.allocator.num_free == num_blocks and all(len(s.output_ids) == s.params.max_tokens for s in seqs)
    return steps


def check_step(work, preempted, config, alloc, sched, block_size):
    tokens = sum(n for _, n in work)
    decoding = [s.is_decoding for s, _ in work]
    assert decoding == sorted(decoding, reverse=True), "decodes come first"
    assert all(n == 1 for (s, n), d in zip(work, decoding) if d)
    assert len({s.request_id for s, _ in work}) == len(work) <= config.max_num_seqs
    if config.enable_chunked_prefill or len(work) > 1: assert tokens <= config.max_num_batched_tokens
    if config.enable_chunked_prefill: assert all(n <= config.max_prefill_chunk for s, n in work)
    else: assert all(s.num_computed_tokens == 0 and n == s.num_pending or d for (s, n), d in zip(work, decoding))
    for s, n in work:   # every scheduled token has a slot in the sequence's blocks
        assert s.status is SeqStatus.RUNNING and s.block_table.num_tokens == s.num_computed_tokens + n
        assert len(s.block_table.blocks) == -(-(s.num_computed_tokens + n) // block_size)
    for s in preempted:
        assert s.status is SeqStatus.PREEMPTED and s.num_computed_tokens == 0 and s.block_table.blocks == [] and s in sched.waiting
    held = sum(len(s.block_table.blocks) for s in sched.running)
    assert held == alloc.num_used <= alloc.num_blocks


def test_chunked_prefill_and_decodes_share_a_step():
    steps = run([10, 6, 9], [8, 8, 8], num_blocks=12, max_num_batched_tokens=8, max_prefill_chunk=8)
    assert steps[0] == ([("0", 8, False)], [])                       # the first prompt, chunked to the budget
    assert steps[1] == ([("0", 2, False), ("1", 6, False)], [])      # its rest, then the next prompt in the same step
    assert steps[2][0][:2] == [("0", 1, True), ("1", 1, True)]       # decodes first, then the next prompt's chunk


def test_finish_prompts_first_starts_no_prompt_with_a_sliver_of_the_budget():
    first = run([5, 5, 5, 5], [2, 2, 2, 2], num_blocks=64, max_num_batched_tokens=8, finish_prompts_first=True)
    assert first[0] == ([("0", 5, False)], [])                       # 1 would get 3 of its 5 tokens: it waits
    assert first[1] == ([("0", 1, True), ("1", 5, False)], [])        # decodes keep running; the next prompt whole
    fill = run([5, 5, 5, 5], [2, 2, 2, 2], num_blocks=64, max_num_batched_tokens=8)
    assert fill[0] == ([("0", 5, False), ("1", 3, False)], [])       # the default: fill the budget to the last token
    # a prompt longer than the budget still starts, chunked, in a step that holds no other prompt
    long = run([4, 20], [3, 3], num_blocks=64, max_num_batched_tokens=8, finish_prompts_first=True)
    assert long[1] == ([("0", 1, True), ("1", 7, False)], [])


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
       st.integers(1, 12), st.integers(1, 8), st.booleans(), st.integers(1, 4), st.booleans())
def test_random_workloads_finish_within_the_rules(reqs, budget, chunk, seats, chunked, block_size, whole):
    longest = max(n + m for n, m in reqs)
    num_blocks = -(-longest // block_size) + 2                       # room for the longest request, little more
    run([n for n, _ in reqs], [m for _, m in reqs], num_blocks, block_size, max_num_batched_tokens=budget,
        max_prefill_chunk=chunk, max_num_seqs=seats, enable_chunked_prefill=chunked, finish_prompts_first=whole)


def test_proposed_tokens_are_scheduled_with_the_decode_within_the_budget():
    "A decoding sequence with k proposed tokens runs 1 + k tokens in one step; the budget trims the proposals, never the decode."
    kv = KVManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4), kv)
    a, b = (Sequence(x, [1, 2, 3], SamplingParams(max_tokens=9), CharTok(), 10**6, 4) for x in "ab")
    for s in (a, b): sched.add(s)
    out = sched.schedule()                                            # a's prompt (3) and one token of b's
    sched.update(out, fake_runner(out))
    a.spec_token_ids = [51, 52, 53, 54]
    out = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in out.scheduled] == [("a", 4)] and a.spec_token_ids == [51, 52, 53]
    assert out.scheduled[0].token_ids == [48, 51, 52, 53] and out.scheduled[0].guesses == [51, 52, 53]
    assert out.scheduled[0].num_logits == 4 and a.block_table.num_tokens == 7
    sched.update(out, RunnerOutput(["a"], [[51, 60]], [[None, None]]))   # one guess kept, then a new token
    assert a.output_ids == [48, 51, 60] and a.num_computed_tokens == 5 and a.block_table.num_tokens == 5


def test_truncate_rolls_back_computed_tokens_and_blocks():
    kv = KVManager(8, 4)
    s = Sequence("a", list(range(10)), SamplingParams(max_tokens=4), CharTok(), 10**6, 4)
    assert kv.allocate_slots(s, 10) == 10
    s.num_computed_tokens = 10
    s.truncate(5, kv)
    assert (s.num_computed_tokens, s.block_table.num_tokens, len(s.block_table.blocks), kv.allocator.num_used) == (5, 5, 2, 2)
    s.truncate(0, kv)
    assert (s.num_computed_tokens, s.block_table.blocks, kv.allocator.num_used) == (0, [], 0)


def test_a_plan_that_can_start_nothing_raises_instead_of_looping():
    "The progress check: requests wait, nothing runs, and the KV manager will not let any start (a planted bug)."
    class Stuck(KVManager):
        def allocate_slots(self, seq, num_tokens, num_lookahead=0): return 0
    sched = Scheduler(SchedulerConfig(), Stuck(8, 4))
    sched.add(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=2), CharTok(), 10**6, 4))
    import pytest
    with pytest.raises(RuntimeError, match="cannot start"): sched.schedule()


# ---- one writer: the structure of the package (an AST check, no engine run) ----

import ast
from pathlib import Path
import pytest

PACKAGE = Path(__file__).parent.parent / "mini_infer"
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popleft", "appendleft", "clear", "sort",
            "reverse", "update", "setdefault", "add", "discard"}


def writes(tree, fields):
    """(line, class, written expression) of every write to an attribute named in `fields`: assigned,
    augmented, deleted, item-assigned, `setattr`, or changed in place by a list/dict/set method."""
    found, classes = [], {}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            for node in ast.walk(cls):
                classes.setdefault(id(node), cls.name)
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in fields:
                found.append((node.lineno, classes.get(id(node)), ast.unparse(node.args[0]), name.value))
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and t.attr in fields:
                found.append((node.lineno, classes.get(id(node)), ast.unparse(t.value), t.attr))
    return found


def modules():
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name != "_modidx.py":
            yield p.relative_to(PACKAGE).as_posix(), ast.parse(p.read_text())


def sequence_fields() -> set[str]:
    return set(vars(Sequence("r", [1], SamplingParams(), CharTok(), 10, 4)))


# where a Sequence field may be written: the scheduler's module (Sequence's own methods, the
# Scheduler, its KV manager); chapter 1's Request, Sequence's base, in its own methods; and a
# write to a field of the same name of another class, named here
SEQUENCE_WRITERS = {"engine/scheduler.py": None, "engine/outputs.py": {"Request"}}
NOT_A_SEQUENCE = {("engine/sampling.py", "new", "params")}  # `SamplingBatch.of` builds a batch


def test_only_the_scheduler_writes_a_sequence():
    """No module but the scheduler's assigns (or changes in place) a `Sequence` field after it is
    made: `seq.x = `, `+=`, `del`, `seq.x[i] = `, `setattr`, `seq.x.append(...)`. A class of
    another module writes only its own fields (`self.x`), unless it is a Sequence or a Request."""
    fields, bad = sequence_fields(), []
    assert {"num_computed_tokens", "spec_token_ids", "status", "finish_reason", "output_ids"} <= fields
    for mod, tree in modules():
        allowed = SEQUENCE_WRITERS.get(mod, set())
        if allowed is None:
            continue
        request_like = {c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                        and any(getattr(b, "id", None) in ("Sequence", "Request") for b in c.bases)}
        for line, cls, obj, field in writes(tree, fields):
            if obj == "self" and (cls not in request_like and cls not in ("Sequence", "Request")
                                  or cls in allowed):
                continue
            if (mod, obj, field) not in NOT_A_SEQUENCE:
                bad.append(f"{mod}:{line}: {obj}.{field}" + (f" (in {cls})" if cls else ""))
    assert not bad, "Sequence fields written outside the scheduler:\n" + "\n".join(bad)


def test_the_structure_check_can_fail():
    "The AST check sees the ways a field is written."
    code = """
def f(seq, other):
    seq.status = 1
    seq.num_computed_tokens += 2
    seq.spec_token_ids.clear()
    seq.output_ids[0] = 3
    del seq.finish_reason
    setattr(seq, "priority", 0)
    a, seq.text = 1, 2
    other.unrelated = 4
"""
    got = {f for *_, f in writes(ast.parse(code), sequence_fields())}
    assert got == {"status", "num_computed_tokens", "spec_token_ids", "output_ids", "finish_reason",
                   "priority", "text"}


def test_only_block_table_methods_change_a_block_table():
    "A block table's `blocks` and `num_tokens` change only through `BlockTable`'s own methods."
    bad = [f"{mod}:{line}: {obj}.{field}" for mod, tree in modules() if mod != "engine/block_manager.py"
           for line, cls, obj, field in writes(tree, {"blocks", "num_tokens"}) if obj != "self"]
    assert not bad, "block tables changed outside BlockTable:\n" + "\n".join(bad)
