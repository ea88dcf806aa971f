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


# ---- chapter 05 ----

def test_05_expected_tokens_solution():
    from mini_infer.exercises_05 import check_expected_tokens
    assert check_expected_tokens(solution("05_speculative.ipynb", "Exercise 5.1")["prediction"]).ok is True


def test_05_expected_tokens_wrong():
    from mini_infer.exercises_05 import check_expected_tokens
    wrong = check_expected_tokens(1 + 0.7 * 4)   # every guess counted on its own
    assert wrong.ok is False and "before it" in wrong.message
    short = check_expected_tokens(2.773 - 1)     # the model's own token forgotten
    assert short.ok is False and "own" in short.message
    assert check_expected_tokens(None).ok is None


COSTS = {0: 1.0, 1: 1.10, 2: 1.17, 3: 1.19, 4: 1.25, 5: 1.34, 6: 1.39, 7: 1.45, 8: 2.31}   # a measured c(k)


def test_05_best_k_solution():
    from mini_infer.exercises_05 import check_best_k
    from mini_infer.speculative import expected_tokens
    ns = solution("05_speculative.ipynb", "Exercise 5.2", expected_tokens=expected_tokens, costs=COSTS)
    assert check_best_k(ns["answer"], COSTS).ok is True


def test_05_best_k_wrong():
    from mini_infer.exercises_05 import check_best_k
    wrong = check_best_k((8, 1.0), COSTS)        # "more guesses, more speed"
    assert wrong.ok is False and "c(k)" in wrong.message
    assert check_best_k(None, COSTS).ok is None


def test_05_acceptance_rate_solution():
    from mini_infer.exercises_05 import check_acceptance_rate
    ns = solution("05_speculative.ipynb", "Exercise 5.3")
    assert check_acceptance_rate(ns["acceptance_rate"]).ok is True


def test_05_acceptance_rate_wrong():
    import torch
    from mini_infer.exercises_05 import check_acceptance_rate
    wrong = check_acceptance_rate(lambda p, q: (p * q).sum(-1))   # the chance that two draws agree
    assert wrong.ok is False and "rejection_sample kept" in wrong.message
    def stub(p, q): raise NotImplementedError
    assert check_acceptance_rate(stub).ok is None


# ---- chapter 08 ----

def _heavy_tailed(seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=g)
    w[3, 5], w[40, 100] = 40.0, -25.0          # outliers, as real weights have
    return w


def test_08_rounding_rms_solution():
    from mini_infer.exercises_08 import check_rounding_rms
    from mini_infer.quant import quantize_int8
    W = _heavy_tailed()
    ns = solution("08_quantization.ipynb", "Exercise 8.1", quantize_int8=quantize_int8, W=W)
    assert check_rounding_rms(ns["rms_prediction"], W).ok is True


def test_08_rounding_rms_wrong():
    from mini_infer.exercises_08 import check_rounding_rms
    from mini_infer.quant import quantize_int8
    W = _heavy_tailed()
    _, s = quantize_int8(W, 64)
    half_step = (s.pow(2).mean().sqrt() / 2).item()          # the bound, not the typical error
    wrong = check_rounding_rms(half_step, W)
    assert wrong.ok is False and "√12" in wrong.message
    mean_s = (s.mean() / 12 ** 0.5).item() * 0.8             # a plainly low guess
    assert check_rounding_rms(mean_s, W).ok is False
    assert check_rounding_rms(None, W).ok is None


def test_08_per_tensor_solution():
    from mini_infer.exercises_08 import check_per_tensor
    ns = solution("08_quantization.ipynb", "Exercise 8.2")
    v = check_per_tensor(ns["quantize_per_tensor"], _heavy_tailed())
    assert v.ok is True and "one scale" in v.message


def test_08_per_tensor_wrong():
    from mini_infer.exercises_08 import check_per_tensor
    from mini_infer.quant import quantize_int8
    wrong = check_per_tensor(lambda w: quantize_int8(w), _heavy_tailed())   # per output channel
    assert wrong.ok is False and "one scale for the whole tensor" in wrong.message
    def stub(w): raise NotImplementedError
    assert check_per_tensor(stub, _heavy_tailed()).ok is None


def _tiny_int8_model():
    import torch
    from mini_infer.model import CausalLM, ModelConfig
    from mini_infer.quant import quantize_model
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, architecture="LlamaForCausalLM", tie_word_embeddings=True, max_position_embeddings=64)
    torch.manual_seed(0)
    return cfg, quantize_model(CausalLM(cfg, max_positions=64).eval())


def test_08_int8_floor_solution():
    from mini_infer.exercises_08 import check_int8_floor
    from mini_infer.memory_plan import count_parameters
    cfg, qmodel = _tiny_int8_model()
    bw = 20e9
    ns = solution("08_quantization.ipynb", "Exercise 8.3", n_weights=count_parameters(cfg), bw=bw)
    assert check_int8_floor(ns["floor_ms"], qmodel, bw).ok is True


def test_08_int8_floor_wrong():
    from mini_infer.exercises_08 import check_int8_floor
    from mini_infer.memory_plan import count_parameters
    cfg, qmodel = _tiny_int8_model()
    bw = 20e9
    wrong = check_int8_floor(count_parameters(cfg) / bw * 1e3, qmodel, bw)   # the scales forgotten
    assert wrong.ok is False and "scales" in wrong.message
    assert check_int8_floor(None, qmodel, bw).ok is None

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
