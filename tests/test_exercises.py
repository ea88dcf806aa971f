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


# ---- chapter 10 ----

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from mini_infer.loader import resolve_model
    from mini_infer.tokenizer import Tokenizer
    return Tokenizer.from_gguf(str(resolve_model()))


def test_ch10_allowed_tokens():
    from mini_infer.exercises_10 import check_allowed
    ns = solution("10_structured_outputs.ipynb", "Exercise 10.1")
    assert check_allowed(ns["allowed"]).ok is True
    from mini_infer.structured import walk
    # a plausible mistake: allowing a token if its FIRST character has an edge
    first_only = lambda dfa, acc, s, vocab: [t for t in vocab if (s in acc if t == "<eos>" else walk(dfa, s, t[0]) is not None)]
    wrong = check_allowed(first_only)
    assert wrong.ok is False and "ALL its characters" in wrong.message
    def stub(dfa, accept, state, vocab):
        raise NotImplementedError
    assert check_allowed(stub).ok is None


def test_ch10_choice_prediction(smollm2_tokenizer):
    from mini_infer.exercises_10 import check_choice_prediction
    ns = solution("10_structured_outputs.ipynb", "Exercise 10.2", tok=smollm2_tokenizer,
                  check_choice_prediction=check_choice_prediction)
    assert check_choice_prediction(ns["prediction"], smollm2_tokenizer).ok is True
    wrong = check_choice_prediction(2, smollm2_tokenizer)  # only the two whole words
    assert wrong.ok is False and "off by more than" in wrong.message
    assert check_choice_prediction(None, smollm2_tokenizer).ok is None


def test_ch10_whitespace(smollm2_tokenizer):
    from mini_infer.exercises_10 import check_whitespace
    ns = solution("10_structured_outputs.ipynb", "Exercise 10.3", tok=smollm2_tokenizer, check_whitespace=check_whitespace)
    assert check_whitespace(ns["whitespace_prediction"], smollm2_tokenizer).ok is True
    wrong = check_whitespace("fewer", smollm2_tokenizer)
    assert wrong.ok is False and "any_whitespace=True" in wrong.message
    assert check_whitespace(None, smollm2_tokenizer).ok is None


# ---- chapter 10b ----

def test_ch10b_signature():
    from mini_infer.exercises_10b import check_signature
    ns = solution("10b_repomap.ipynb", "Exercise 10b.1", check_signature=check_signature)
    assert check_signature(ns["signature"]).ok is True
    import ast
    no_async = lambda node: f"def {node.name}({ast.unparse(node.args)})" + (f" -> {ast.unparse(node.returns)}" if node.returns else "")
    wrong = check_signature(no_async)
    assert wrong.ok is False and "async" in wrong.message
    def stub(node):
        raise NotImplementedError
    assert check_signature(stub).ok is None


def test_ch10b_recomputed():
    from mini_infer.exercises_10b import check_recomputed
    ns = solution("10b_repomap.ipynb", "Exercise 10b.2", check_recomputed=check_recomputed, ids=[0] * 1030, cached=[0, 1008])
    assert ns["check_recomputed"](ns["prediction"], 1030, 1008).ok is True
    wrong = check_recomputed(1030, 1030, 1008)  # as if nothing were cached
    assert wrong.ok is False and "off by more than" in wrong.message
    assert check_recomputed(None, 1030, 1008).ok is None


def test_ch10b_bonus():
    import mini_infer
    from pathlib import Path
    from mini_infer.exercises_10b import check_bonus
    from mini_infer.repomap import model_tokenizer, repo_map
    tok = model_tokenizer()
    count = lambda text: len(tok.encode(text))
    pkg = Path(mini_infer.__file__).parent
    ns = solution("10b_repomap.ipynb", "Exercise 10b.3", check_bonus=check_bonus, repo_map=repo_map, PKG=pkg, count=count)
    assert check_bonus(ns["bonus_prediction"], pkg, count).ok is True
    other = "no" if ns["bonus_prediction"] == "yes" else "yes"
    wrong = check_bonus(other, pkg, count)
    assert wrong.ok is False and "bonus" in wrong.message
    assert check_bonus(None, pkg, count).ok is None
