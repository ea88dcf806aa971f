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


# ---- chapter 07 ----

def test_ch07_weight_floor():
    from mini_infer.exercises_07 import check_weight_floor
    wb, bw = 85_000_000, 12.5
    ns = solution("07_cpu_kernels.ipynb", "Exercise 7.1", weight_bytes=wb, bandwidth=bw)
    assert check_weight_floor(ns["prediction"], wb, bw).ok is True
    elements = check_weight_floor(wb / 4 / (bw * 1e9) * 1e3, wb, bw)     # weights counted, not bytes
    assert elements.ok is False and "4 bytes" in elements.message
    seconds = check_weight_floor(wb / (bw * 1e9), wb, bw)
    assert seconds.ok is False and "ms" in seconds.message
    assert check_weight_floor(None, wb, bw).ok is None


def test_ch07_intensity():
    from mini_infer.exercises_07 import check_intensity
    ns = solution("07_cpu_kernels.ipynb", "Exercise 7.2", bandwidth=12.5)
    assert check_intensity(ns["intensity"]).ok is True
    one_flop = check_intensity(lambda M, N, K: M * N * K / (4 * (N * K + M * K + M * N)))
    assert one_flop.ok is False and "2 FLOPs" in one_flop.message
    weight_only = check_intensity(lambda M, N, K: 2 * M * N * K / (4 * N * K))
    assert weight_only.ok is False and "W, x and y" in weight_only.message

    def stub(M, N, K):
        raise NotImplementedError
    assert check_intensity(stub).ok is None


def test_ch07_pack():
    import torch
    from mini_infer.exercises_07 import check_pack
    ns = solution("07_cpu_kernels.ipynb", "Exercise 7.3")
    assert check_pack(ns["pack"]).ok is True
    def no_transpose(W, block):
        return torch.cat([W, W.new_zeros(-len(W) % block, W.shape[1])]).view(-1, block, W.shape[1])
    wrong = check_pack(no_transpose)
    assert wrong.ok is False and "panels of shape" in wrong.message
    def no_padding(W, block):      # right layout, but a partial last panel left out
        return ns["pack"](W[: len(W) // block * block], block)
    wrong = check_pack(no_padding)
    assert wrong.ok is False and "panels of shape" in wrong.message


def test_ch07_kv_read():
    from mini_infer.exercises_07b import check_kv_read
    args = dict(rows=32, context=1000, kv_heads=3, head_dim=64, bytes_per_value=2)
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.4")
    assert check_kv_read(ns["prediction"], **args).ok is True
    float32 = check_kv_read(2 * 32 * 1000 * 3 * 64 * 4 / 1e6, **args)
    assert float32.ok is False and "factor of 2" in float32.message
    assert check_kv_read(5.0, **args).ok is False
    assert check_kv_read(None, **args).ok is None


def test_ch07_online_softmax():
    import torch
    from mini_infer.exercises_07b import check_online_softmax
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.5")
    assert check_online_softmax(ns["attend_tiled"]).ok is True
    def no_rescale(q, K, V, tile):    # a running maximum, but the old sums are not rescaled when it rises
        m, l, o = float("-inf"), 0.0, torch.zeros(V.shape[1])
        for j in range(0, len(K), tile):
            s = K[j : j + tile] @ q
            m = max(m, s.max().item())
            p = torch.exp(s - m)
            l, o = l + p.sum(), o + p @ V[j : j + tile]
        return o / l
    wrong = check_online_softmax(no_rescale)
    assert wrong.ok is False and "old max" in wrong.message
    def stub(q, K, V, tile):
        raise NotImplementedError
    assert check_online_softmax(stub).ok is None


def test_ch07_plan():
    from mini_infer.exercises_07b import check_plan
    lens = [1, 1, 1, 5, 8, 9, 40]
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.6")
    assert check_plan(ns["prediction"], lens).ok is True
    rows_not_tokens = check_plan((5, 2), lens)
    assert rows_not_tokens.ok is False and "SHORT_ROW" in rows_not_tokens.message
    assert check_plan((3, 4), lens).ok is False
    assert check_plan(None, lens).ok is None


def test_ch07_rms_norm():
    import torch
    from mini_infer.exercises_07c import check_rms_norm
    ns = solution("07c_step_replay.ipynb", "Exercise 7.7")
    assert check_rms_norm(ns["rms_norm"]).ok is True
    no_eps = check_rms_norm(lambda x, w, eps: x / x.pow(2).mean(-1, keepdim=True).sqrt() * w)
    assert no_eps.ok is False and "eps" in no_eps.message
    layer_norm = check_rms_norm(lambda x, w, eps: torch.nn.functional.layer_norm(x, x.shape[-1:], w, eps=eps))
    assert layer_norm.ok is False and "subtract nothing" in layer_norm.message
    def stub(x, w, eps):
        raise NotImplementedError
    assert check_rms_norm(stub).ok is None


def test_ch07_replayed():
    from mini_infer.exercises_07c import check_replayed
    steps = [[1] * 16, [1] * 17, [4, 4, 4, 4], [9], [1, 1, 8, 6], [3] * 6]
    ns = solution("07c_step_replay.ipynb", "Exercise 7.8")
    assert check_replayed(ns["prediction"], steps).ok is True
    rows_only = check_replayed([True, False, True, True, True, True], steps)   # forgot a limit
    assert rows_only.ok is False and "no row of more than 8" in rows_only.message
    assert check_replayed([True] * 3, steps).ok is False
    assert check_replayed(None, steps).ok is None


def test_ch07_recorded_calls():
    from mini_infer.exercises_07c import check_recorded_calls
    ns = solution("07c_step_replay.ipynb", "Exercise 7.9")
    assert check_recorded_calls(ns["prediction"], n_layers=30).ok is True
    per_token = check_recorded_calls((360, 16 * 360), n_layers=30)
    assert per_token.ok is False and "does not grow" in per_token.message
    products_only = check_recorded_calls((7 * 30, 7 * 30), n_layers=30)
    assert products_only.ok is False and "count every C call" in products_only.message
    assert check_recorded_calls(None, n_layers=30).ok is None
