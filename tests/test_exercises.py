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


# ---- chapter 09 ----

def _smollm_cfg():
    from mini_infer.model import ModelConfig
    return ModelConfig(49152, 576, 1536, 30, 9, 3, tie_word_embeddings=True)


def _qwen7b_cfg():
    from mini_infer.model import ModelConfig
    return ModelConfig(152064, 3584, 18944, 28, 28, 4, attention_bias=True, architecture="Qwen2ForCausalLM")


def test_09_masked_lookup():
    import torch
    from mini_infer.exercises_09 import check_masked_lookup
    ns = solution("09_scaling_out.ipynb", "Exercise 9.1", torch=torch)
    assert check_masked_lookup(ns["lookup"]).ok is True
    wrong = check_masked_lookup(lambda ids, rows, start: rows[(ids - start).clamp(0, rows.shape[0] - 1)])  # no mask
    assert wrong.ok is False and "zeros" in wrong.message
    def stub(ids, rows, start):
        raise NotImplementedError
    assert check_masked_lookup(stub).ok is None


def test_09_all_reduce_count():
    from mini_infer.exercises_09 import check_all_reduce_count
    ns = solution("09_scaling_out.ipynb", "Exercise 9.2")
    assert check_all_reduce_count(ns["prediction"], _smollm_cfg()).ok is True
    wrong = check_all_reduce_count(60, _smollm_cfg())
    assert wrong.ok is False and "embedding" in wrong.message
    assert check_all_reduce_count(None, _smollm_cfg()).ok is None


def test_09_kv_ratio():
    from mini_infer.exercises_09 import check_kv_ratio
    ns = solution("09_scaling_out.ipynb", "Exercise 9.3")
    assert check_kv_ratio(ns["kv_ratio"], _qwen7b_cfg()).ok is True
    wrong = check_kv_ratio(0.5, _qwen7b_cfg())
    assert wrong.ok is False and "replicated" in wrong.message
    assert check_kv_ratio(None, _qwen7b_cfg()).ok is None
