"""Every exercise's check, held to its solution (it must say correct) and to a plausible wrong answer (it must
say what is wrong, helpfully), and to the untouched stub (it must report itself and raise nothing). Solutions are
read from the folded <details> blocks of the notebooks, so the tests run the code a learner unfolds.
One section per chapter, below the shared helpers."""
from pathlib import Path
import pytest
from mini_infer.exercise import solutions, exercise_headings

NBS = Path(__file__).parent.parent / "nbs"
NOTEBOOKS = sorted(p for p in NBS.glob("[0-9][0-9]*_*.ipynb"))


def solution(notebook: str, heading_start: str, **names) -> dict:
    """Runs the solution under the exercise heading of `notebook` (a file name in nbs/) that starts with
    `heading_start`, in a namespace holding `names`; returns that namespace."""
    found = [code for h, code in solutions(NBS / notebook).items() if h.startswith(heading_start)]
    assert len(found) == 1, f"{notebook}: {len(found)} solutions under a heading starting {heading_start!r}"
    ns = dict(names)
    exec(found[0], ns)
    return ns


@pytest.mark.parametrize("p", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_has_a_solution(p):
    missing = set(exercise_headings(p)) - set(solutions(p))
    assert not missing, f"{p.name}: exercises without a <details> solution: {sorted(missing)}"


# ---- the mechanism (nbs/98_exercises.ipynb) ----

def test_check_own_check():
    from mini_infer.exercise import exercise_check, expect
    ns = solution("98_exercises.ipynb", "Exercise 1", exercise_check=exercise_check, expect=expect)
    assert ns["check_cube"](lambda x: x ** 3).ok is True
    wrong = ns["check_cube"](lambda x: 3 * x)
    assert wrong.ok is False and "expected" in wrong.message
    assert ns["check_cube"](None).ok is None


# ---- chapter 02 ----

def test_02_slot():
    from mini_infer.exercises_02 import check_slot
    assert check_slot(solution("02_paged_cache.ipynb", "Exercise 2.1")["slot"]).ok is True
    wrong = check_slot(lambda blocks, p, S: blocks[p // S] + p % S)
    assert wrong.ok is False and "b * S" in wrong.message
    assert check_slot(lambda blocks, p, S: blocks[p % S] * S + p // S).ok is False

    def stub(blocks, p, S):
        raise NotImplementedError
    assert check_slot(stub).ok is None


def test_02_kv_bytes():
    import torch
    from mini_infer.model import ModelConfig
    from mini_infer.exercises_02 import check_kv_bytes
    llama8b = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8)
    ns = solution("02_paged_cache.ipynb", "Exercise 2.2")
    assert check_kv_bytes(ns["prediction"], llama8b, torch.bfloat16).ok is True
    gqa = check_kv_bytes(2 * 32 * 32 * 128 * 2, llama8b, torch.bfloat16)   # every query head counted
    assert gqa.ok is False and "KV heads" in gqa.message
    half = check_kv_bytes(32 * 8 * 128 * 2, llama8b, torch.bfloat16)      # K only
    assert half.ok is False and "K and V" in half.message
    assert check_kv_bytes(ns["prediction"], llama8b, torch.float32).ok is False   # the dtype counts
    assert check_kv_bytes(None, llama8b).ok is None


def test_02_utilisation():
    from mini_infer.exercises_02 import check_utilisation
    ns = solution("02_paged_cache.ipynb", "Exercise 2.3")
    assert check_utilisation(ns["prediction"], ns["workload"], ns["S"]).ok is True
    assert check_utilisation(520 / 704, ns["workload"], 64).ok is True
    pct = check_utilisation(92.9, ns["workload"], 16)
    assert pct.ok is False and "fraction" in pct.message
    whole = check_utilisation(1.0, ns["workload"], 16)   # as if pages wasted nothing
    assert whole.ok is False and "last block" in whole.message
    assert check_utilisation(520 / 704, ns["workload"], 16).ok is False
    assert check_utilisation(None, ns["workload"], 16).ok is None


# ---- chapter 03 ----

def test_03_shortest_prompt_first():
    from collections import deque
    from mini_infer.exercises_03 import check_shortest_prompt_first
    ns = solution("03_continuous_batching.ipynb", "Exercise 3.1", deque=deque)
    assert check_shortest_prompt_first(ns["shortest_prompt_first"]).ok is True
    longest = check_shortest_prompt_first(lambda w, kv: deque(sorted(w, key=lambda s: -len(s.prompt_ids))))
    assert longest.ok is False and "shortest prompts first" in longest.message
    unstable = check_shortest_prompt_first(lambda w, kv: deque(sorted(w, key=lambda s: (len(s.prompt_ids), -ord(s.request_id)))))   # later arrivals first among equals
    assert unstable.ok is False and "first come first served" in unstable.message

    def stub(waiting, kv):
        raise NotImplementedError
    assert check_shortest_prompt_first(stub).ok is None


def test_03_spf_ttft():
    from mini_infer.exercises_03 import check_spf_ttft, ttft_in_steps
    from mini_infer.scheduler import fcfs
    ns = solution("03_continuous_batching.ipynb", "Exercise 3.2")
    assert check_spf_ttft(ns["prediction"]).ok is True
    wrong = check_spf_ttft(("down", "down"))   # as if nobody paid for the better mean
    assert wrong.ok is False and "long prompt" in wrong.message
    assert check_spf_ttft(("up", "up")).ok is False
    assert check_spf_ttft("down").ok is False
    assert check_spf_ttft(None).ok is None
    assert ttft_in_steps(fcfs)[0] == min(ttft_in_steps(fcfs))   # FCFS: the long prompt, first in line, starts first


def test_03_static_padding():
    from mini_infer.exercises_03 import check_static_padding
    ns = solution("03_continuous_batching.ipynb", "Exercise 3.3")
    assert check_static_padding(ns["prediction"], ns["lens"], ns["B"]).ok is True
    steps = check_static_padding(60, ns["lens"], ns["B"])   # the steps, not the padded slots
    assert steps.ok is False and "steps" in steps.message
    assert check_static_padding(90, ns["lens"], ns["B"]).ok is False
    assert check_static_padding(None, ns["lens"], ns["B"]).ok is None


# ---- chapter 04 ----

def test_04_block_keys():
    from mini_infer.prefix_cache import hash_block
    from mini_infer.exercises_04 import check_block_keys
    assert check_block_keys(solution("04_prefix_cache.ipynb", "Exercise 4.1", hash_block=hash_block)["block_keys"]).ok is True

    def salt_everywhere(token_ids, S, salt=None):
        keys = []
        for j in range(len(token_ids) // S):
            extra = (("cache_salt", salt),) if salt is not None else ()
            keys.append(hash_block(keys[-1] if keys else None, token_ids[j * S:(j + 1) * S], extra))
        return keys
    wrong = check_block_keys(salt_everywhere)
    assert wrong.ok is False and "first block only" in wrong.message

    def with_partial(token_ids, S, salt=None):
        keys = salt_everywhere(token_ids[:len(token_ids) // S * S], S, None)
        return keys + [hash_block(keys[-1], token_ids[len(keys) * S:])]
    partial = check_block_keys(with_partial)
    assert partial.ok is False and "partial block" in partial.message

    def stub(token_ids, S, salt=None):
        raise NotImplementedError
    assert check_block_keys(stub).ok is None


def test_04_hit_rate():
    from mini_infer.exercises_04 import check_hit_rate
    assert check_hit_rate(solution("04_prefix_cache.ipynb", "Exercise 4.2")["prediction"]).ok is True
    naive = check_hit_rate(100 / 120)   # the whole prefix, as if partial blocks were shared
    assert naive.ok is False and "full blocks" in naive.message
    assert check_hit_rate(80).ok is False
    assert check_hit_rate(None).ok is None


def test_04_unsalted_hits():
    from mini_infer.exercises_04 import check_unsalted_hits, cached_tokens
    assert check_unsalted_hits(solution("04_prefix_cache.ipynb", "Exercise 4.3")["prediction"]).ok is True
    whole = check_unsalted_hits(260)   # B's own last tokens counted too
    assert whole.ok is False and "last tokens" in whole.message
    assert check_unsalted_hits(0).ok is False   # as if the cache were salted
    assert check_unsalted_hits(None).ok is None
    secret = list(range(1000, 1256))
    assert cached_tokens([secret + [7] * 4, secret + [9] * 4], salts=["a", "b"])[1] == 0   # a salt per tenant closes it
