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


# ---- chapter 06 ----

from mini_infer.exercises_06 import check_last_event, check_sse_events, check_kv_usage_metric, check_max_num_seqs


def _stub(*args):
    raise NotImplementedError


def test_06_last_event():
    ns = solution("06_server.ipynb", "Exercise 6.1")
    assert check_last_event(ns["last_event"]).ok is True
    no_total = lambda r, p, c: {"choices": [{"index": 0, "text": "", "finish_reason": r}],
                                "usage": {"prompt_tokens": p, "completion_tokens": c}}
    wrong = check_last_event(no_total)
    assert wrong.ok is False and "total_tokens" in wrong.message
    swapped = lambda r, p, c: {"choices": [{"index": 0, "text": "", "finish_reason": r}],
                               "usage": {"prompt_tokens": c, "completion_tokens": p, "total_tokens": p + c}}
    assert check_last_event(swapped).ok is False
    assert check_last_event(_stub).ok is None


def test_06_sse_events():
    ns = solution("06_server.ipynb", "Exercise 6.2")
    assert check_sse_events(ns["prediction"], 5).ok is True
    only_tokens = check_sse_events(5, 5)
    assert only_tokens.ok is False and "role" in only_tokens.message
    no_usage = check_sse_events(8, 5)
    assert no_usage.ok is False and "usage" in no_usage.message
    assert check_sse_events(None, 5).ok is None


def test_06_kv_usage_metric():
    ns = solution("06_server.ipynb", "Exercise 6.3")
    assert check_kv_usage_metric(ns["kv_usage_metric"]).ok is True
    name = "mini_infer_kv_cache_usage_perc"
    by_free = lambda s: f"# TYPE {name} gauge\n{name} {s['kv_blocks_used'] / max(s['kv_blocks_free'], 1)}\n"
    wrong = check_kv_usage_metric(by_free)
    assert wrong.ok is False and "used + free" in wrong.message
    untyped = lambda s: f"{name} {s['kv_blocks_used'] / (s['kv_blocks_used'] + s['kv_blocks_free'])}\n"
    no_type = check_kv_usage_metric(untyped)
    assert no_type.ok is False and "TYPE" in no_type.message
    assert check_kv_usage_metric(_stub).ok is None


def test_06_max_num_seqs():
    knob = dict(n_requests=8, n_tokens=8, max_num_seqs=4)
    ns = solution("06_server.ipynb", "Exercise 6.4", N_PROMPTS=8, OUT_LEN=8)
    assert check_max_num_seqs(ns["answer"], **knob).ok is True
    one_batch = check_max_num_seqs({"steps": 8, "ttft": "up", "tpot": "down"}, **knob)
    assert one_batch.ok is False and "waves" in one_batch.message
    ttft_down = check_max_num_seqs({"steps": 16, "ttft": "down", "tpot": "down"}, **knob)
    assert ttft_down.ok is False and "queue" in ttft_down.message
    assert check_max_num_seqs(None, **knob).ok is None
