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


# ---- chapter 01 ----

def smol_cfg():
    from mini_infer.model import ModelConfig
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, tie_word_embeddings=True)


def test_01_relative_score():
    import torch
    from mini_infer.exercises_01 import check_relative_score
    cfg = smol_cfg()
    ns = solution("01_model.ipynb", "Exercise 1.1", check_relative_score=check_relative_score, smol_cfg=cfg)
    assert check_relative_score(ns["relative_score"], cfg).ok is True
    flipped = lambda q, k, delta, inv_freq: ns["relative_score"](q, k, -delta, inv_freq)   # the sin term's sign flipped
    wrong = check_relative_score(flipped, cfg)
    assert wrong.ok is False and "sign" in wrong.message
    wrong = check_relative_score(lambda q, k, delta, inv_freq: (q * k).sum(), cfg)   # ignores the rotation
    assert wrong.ok is False and "distance" in wrong.message
    def stub(q, k, delta, inv_freq): raise NotImplementedError
    assert check_relative_score(stub, cfg).ok is None


def test_01_kv_ratio():
    from mini_infer.model import ModelConfig
    from mini_infer.exercises_01 import check_kv_ratio
    cfg = smol_cfg()
    mha = ModelConfig(**{**vars(cfg), "num_key_value_heads": 9})
    ns = solution("01_model.ipynb", "Exercise 1.2", check_kv_ratio=check_kv_ratio, smol_cfg=cfg, mha_cfg=mha)
    assert check_kv_ratio(ns["prediction"], cfg, mha).ok is True
    wrong = check_kv_ratio(1 / 3, cfg, mha)
    assert wrong.ok is False and "shrinks" in wrong.message
    wrong = check_kv_ratio(9.0, cfg, mha)
    assert wrong.ok is False and "off by" in wrong.message
    assert check_kv_ratio(None, cfg, mha).ok is None


def test_01_param_count():
    from mini_infer.exercises_01 import check_param_count
    cfg = smol_cfg()
    ns = solution("01_model.ipynb", "Exercise 1.3", check_param_count=check_param_count, smol_cfg=cfg)
    assert ns["prediction"] == 134_515_008 and check_param_count(ns["prediction"], cfg).ok is True
    wrong = check_param_count(134_515_008 + 49152 * 576, cfg)   # the tied table counted twice
    assert wrong.ok is False and "twice" in wrong.message
    wrong = check_param_count(135_000_000 * 1.1, cfg)
    assert wrong.ok is False and "off by" in wrong.message
    assert check_param_count(None, cfg).ok is None


@pytest.fixture(scope="module")
def smol_gguf():
    import gguf
    from mini_infer.loader import bundled_gguf_path
    from mini_infer.tokenizer import Tokenizer
    reader = gguf.GGUFReader(str(bundled_gguf_path()))
    return reader, Tokenizer.from_gguf(reader)


def test_01b_chatml(smol_gguf):
    from mini_infer.exercises_01b import check_chatml
    tok = smol_gguf[1]
    ns = solution("01b_weights_and_tokens.ipynb", "Exercise 1.4", check_chatml=check_chatml, smol_tok=tok)
    assert check_chatml(ns["chatml"], tok).ok is True
    no_default = lambda ms: "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in ms) + "<|im_start|>assistant\n"
    wrong = check_chatml(no_default, tok)
    assert wrong.ok is False and "system message" in wrong.message
    no_prompt = lambda ms: ns["chatml"](ms)[: -len("<|im_start|>assistant\n")]
    wrong = check_chatml(no_prompt, tok)
    assert wrong.ok is False and "generation prompt" in wrong.message
    def stub(messages): raise NotImplementedError
    assert check_chatml(stub, tok).ok is None


def test_01b_gguf_bytes(smol_gguf):
    from mini_infer.exercises_01b import check_gguf_bytes
    reader = smol_gguf[0]
    ns = solution("01b_weights_and_tokens.ipynb", "Exercise 1.5", check_gguf_bytes=check_gguf_bytes, reader=reader)
    assert check_gguf_bytes(ns["prediction"], reader).ok is True
    wrong = check_gguf_bytes(134_515_008 // 2, reader)   # 4 bits per weight, no scales
    assert wrong.ok is False and "scale" in wrong.message
    wrong = check_gguf_bytes(134_515_008 * 5 // 8, reader)   # all Q4_1
    assert wrong.ok is False and "Q8_0" in wrong.message
    assert check_gguf_bytes(None, reader).ok is None


def test_01b_q8_0(smol_gguf):
    import numpy as np
    from mini_infer.exercises_01b import check_q8_0
    reader = smol_gguf[0]
    ns = solution("01b_weights_and_tokens.ipynb", "Exercise 1.6", check_q8_0=check_q8_0, reader=reader, np=np)
    assert check_q8_0(ns["dequant_q8_0"], reader).ok is True
    unsigned = lambda b: b[:2].view(np.float16).astype(np.float32)[0] * b[2:].astype(np.float32)
    wrong = check_q8_0(unsigned, reader)
    assert wrong.ok is False and "signed" in wrong.message
    wrong = check_q8_0(lambda b: b[2:].view(np.int8).astype(np.float32), reader)   # no scale
    assert wrong.ok is False and "block 0" in wrong.message
    def stub(block): raise NotImplementedError
    assert check_q8_0(stub, reader).ok is None


def test_01c_top_p():
    import torch
    from mini_infer.exercises_01c import check_top_p
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.7", check_top_p=check_top_p, torch=torch)
    assert check_top_p(ns["top_p_keep"]).ok is True
    def without_crossing(probs, p):   # keeps tokens while the mass *including* them is < p
        sorted_probs, order = probs.sort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[sorted_probs.cumsum(0) < p]] = True
        return keep
    wrong = check_top_p(without_crossing)
    assert wrong.ok is False and "crosses" in wrong.message
    def unsorted(probs, p):   # the right count, taken in vocabulary order
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[: int(ns["top_p_keep"](probs, p).sum())] = True
        return keep.flip(0)
    wrong = check_top_p(unsorted)
    assert wrong.ok is False and "most likely" in wrong.message
    def stub(probs, p): raise NotImplementedError
    assert check_top_p(stub).ok is None


def test_01c_entropy_limit():
    import math, torch
    from mini_infer.exercises_01c import check_entropy_limit
    demo = -torch.log(torch.arange(1, 51.0))
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.8", check_entropy_limit=check_entropy_limit, demo=demo)
    assert check_entropy_limit(ns["prediction"], demo).ok is True
    wrong = check_entropy_limit(0.0, demo)
    assert wrong.ok is False and "greedy" in wrong.message
    wrong = check_entropy_limit(math.log2(50), demo)
    assert wrong.ok is False and "bits" in wrong.message
    assert check_entropy_limit(None, demo).ok is None


def test_01c_recompute_tokens():
    from mini_infer.exercises_01c import check_recompute_tokens
    prompt = list(range(5))
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.9", check_recompute_tokens=check_recompute_tokens, prompt=prompt)
    assert ns["prediction"] == 12 * 5 + 66 and check_recompute_tokens(ns["prediction"], 5, 12).ok is True
    wrong = check_recompute_tokens(12 * 5, 5, 12)
    assert wrong.ok is False and "grows" in wrong.message
    wrong = check_recompute_tokens(5 + 12 - 1, 5, 12)
    assert wrong.ok is False and "cached" in wrong.message
    assert check_recompute_tokens(None, 5, 12).ok is None
