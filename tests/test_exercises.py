"""Every exercise's check, held to its solution (it must say correct) and to a plausible wrong answer (it must
say what is wrong, helpfully), and to the untouched stub (it must report itself and raise nothing). Solutions are
read from the folded <details> blocks of the notebooks, so the tests run the code a learner unfolds.
One section per chapter, below the shared helpers."""
from pathlib import Path
import pytest
from mini_infer.course.exercise import solutions, exercise_headings

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
    from mini_infer.course.exercise import exercise_check, expect
    ns = solution("98_exercises.ipynb", "Exercise 1", exercise_check=exercise_check, expect=expect)
    assert ns["check_cube"](lambda x: x ** 3).ok is True
    wrong = ns["check_cube"](lambda x: 3 * x)
    assert wrong.ok is False and "expected" in wrong.message
    assert ns["check_cube"](None).ok is None


# ---- chapter 05 ----

def test_05_expected_tokens_solution():
    from mini_infer.course.exercises.ch05 import check_expected_tokens
    assert check_expected_tokens(solution("05_speculative.ipynb", "Exercise 5.1")["prediction"]).ok is True


def test_05_expected_tokens_wrong():
    from mini_infer.course.exercises.ch05 import check_expected_tokens
    wrong = check_expected_tokens(1 + 0.7 * 4)   # every guess counted on its own
    assert wrong.ok is False and "before it" in wrong.message
    short = check_expected_tokens(2.773 - 1)     # the model's own token forgotten
    assert short.ok is False and "own" in short.message
    assert check_expected_tokens(None).ok is None


COSTS = {0: 1.0, 1: 1.10, 2: 1.17, 3: 1.19, 4: 1.25, 5: 1.34, 6: 1.39, 7: 1.45, 8: 2.31}   # a measured c(k)


def test_05_best_k_solution():
    from mini_infer.course.exercises.ch05 import check_best_k
    from mini_infer.plugins.speculative.plan import expected_tokens
    ns = solution("05_speculative.ipynb", "Exercise 5.2", expected_tokens=expected_tokens, costs=COSTS)
    assert check_best_k(ns["answer"], COSTS).ok is True


def test_05_best_k_wrong():
    from mini_infer.course.exercises.ch05 import check_best_k
    wrong = check_best_k((8, 1.0), COSTS)        # "more guesses, more speed"
    assert wrong.ok is False and "c(k)" in wrong.message
    assert check_best_k(None, COSTS).ok is None


def _residual_draw(p, j, x, q, generator, normalise=True):
    "A draw after guess x at position j was rejected: from max(0, p - q), normalised or (wrongly) not."
    import torch
    r = p[j].clone() if q is None else (p[j] - q[j]).clamp(min=0)
    if q is None:
        r[x] = 0
    if normalise:
        return int(torch.multinomial(r / r.sum(), 1, generator=generator))
    u = torch.rand(1, generator=generator)   # an inverse-CDF draw, which needs the residual to sum to 1
    return min(int((r.cumsum(-1) < u).sum()), len(r) - 1)


def _verifier(keep, after_reject, bonus=True):
    "verify_row written with the pieces a learner may get wrong."
    import torch

    def verify_row(p, guesses, q=None, generator=None):
        for j, x in enumerate(guesses):
            qx = 1.0 if q is None else float(q[j, x])
            if keep(float(p[j, x]), qx, generator):
                continue
            return j, after_reject(p, j, x, q, generator)
        k = len(guesses)
        return k, int(torch.multinomial(p[k] if bonus else p[k - 1], 1, generator=generator))
    return verify_row


def _keep_exact(px, qx, generator):
    import torch
    return torch.rand(1, generator=generator).item() < min(1.0, px / qx)


def test_05_verify_row():
    import torch
    from mini_infer.course.exercises.ch05 import check_verify_row
    assert check_verify_row(solution("05_speculative.ipynb", "Exercise 5.3")["verify_row"]).ok is True

    def vectorised(p, guesses, q=None, generator=None):   # a correct variant: every uniform at once, accept_probs-style
        k, x = len(guesses), torch.tensor(guesses, dtype=torch.long)
        px = p[torch.arange(k), x]
        a = px if q is None else (px / q[torch.arange(k), x]).clamp(max=1)
        ok = torch.rand(k, generator=generator) < a
        kept = int(ok.long().cumprod(0).sum())
        if kept == k:
            return k, int(torch.multinomial(p[k], 1, generator=generator))
        r = p[kept].scatter(0, x[kept:kept + 1], 0.0) if q is None else (p[kept] - q[kept]).clamp(min=0)
        return kept, int(torch.multinomial(r, 1, generator=generator))   # multinomial normalises
    assert check_verify_row(vectorised).ok is True

    no_residual = _verifier(_keep_exact, lambda p, j, x, q, g: int(torch.multinomial(p[j], 1, generator=g)))
    wrong = check_verify_row(no_residual)   # a rejection draws from p: the rejected guess comes back too often
    assert wrong.ok is False and "residual" in wrong.message and "chi-square" in wrong.message

    p_above_q = _verifier(lambda px, qx, g: px >= qx, _residual_draw)   # keeps x when p(x) >= q(x), no uniform
    wrong = check_verify_row(p_above_q)
    assert wrong.ok is False and "min(1, p(x)/q(x))" in wrong.message

    unnormalised = _verifier(_keep_exact, lambda p, j, x, q, g: _residual_draw(p, j, x, q, g, normalise=False))
    wrong = check_verify_row(unnormalised)
    assert wrong.ok is False and "normalised" in wrong.message

    no_bonus = _verifier(_keep_exact, _residual_draw, bonus=False)   # every guess kept: drawn from the last guess's p
    wrong = check_verify_row(no_bonus)
    assert wrong.ok is False and "bonus" in wrong.message

    def unseeded(p, guesses, q=None, generator=None):   # exact, but ignores the request's generator
        return vectorised(p, guesses, q, None)
    wrong = check_verify_row(unseeded)
    assert wrong.ok is False and "generator" in wrong.message

    def stub(p, guesses, q=None, generator=None):
        raise NotImplementedError
    assert check_verify_row(stub).ok is None


def test_05_prompt_lookup():
    from mini_infer.course.exercises.ch05 import check_prompt_lookup
    assert check_prompt_lookup(solution("05_speculative.ipynb", "Exercise 5.4")["prompt_lookup"]).ok is True

    def by_string(tokens, k, n_max=4, n_min=2):   # a correct variant: find the suffix in the text with rfind
        text = "," + ",".join(map(str, tokens)) + ","
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            suffix = "," + ",".join(map(str, tokens[-n:])) + ","
            at = text.rfind(suffix, 0, len(text) - 1)    # an occurrence ending before the end of the text
            if at >= 0:
                start = text[:at + 1].count(",") - 1 + n
                return tokens[start:start + k]
        return []
    assert check_prompt_lookup(by_string).ok is True

    def search(tokens, n, positions):
        return next((i for i in positions if tokens[i:i + n] == tokens[-n:]), None)

    def earliest(tokens, k, n_max=4, n_min=2):   # the first occurrence instead of the latest
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            i = search(tokens, n, range(len(tokens) - n))
            if i is not None:
                return tokens[i + n:i + n + k]
        return []
    wrong = check_prompt_lookup(earliest)
    assert wrong.ok is False and "latest at position" in wrong.message

    def shortest_first(tokens, k, n_max=4, n_min=2):   # n from n_min up: a short, common suffix wins
        for n in range(n_min, min(n_max, len(tokens) - 1) + 1):
            i = search(tokens, n, range(len(tokens) - n - 1, -1, -1))
            if i is not None:
                return tokens[i + n:i + n + k]
        return []
    wrong = check_prompt_lookup(shortest_first)
    assert wrong.ok is False and "the last 3 tokens" in wrong.message

    def finds_itself(tokens, k, n_max=4, n_min=2):   # the suffix matches itself: nothing follows it
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            i = search(tokens, n, range(len(tokens) - n, -1, -1))
            if i is not None:
                return tokens[i + n:i + n + k]
        return []
    wrong = check_prompt_lookup(finds_itself)
    assert wrong.ok is False and "you guessed []" in wrong.message

    def stub(tokens, k, n_max=4, n_min=2):
        raise NotImplementedError
    assert check_prompt_lookup(stub).ok is None


# ---- chapter 08 ----

def _heavy_tailed(seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=g)
    w[3, 5], w[40, 100] = 40.0, -25.0          # outliers, as real weights have
    return w


def test_08_rounding_rms_solution():
    from mini_infer.course.exercises.ch08 import check_rounding_rms
    from mini_infer.plugins.quant import quantize_int8
    W = _heavy_tailed()
    ns = solution("08_quantization.ipynb", "Exercise 8.1", quantize_int8=quantize_int8, W=W)
    assert check_rounding_rms(ns["rms_prediction"], W).ok is True


def test_08_rounding_rms_wrong():
    from mini_infer.course.exercises.ch08 import check_rounding_rms
    from mini_infer.plugins.quant import quantize_int8
    W = _heavy_tailed()
    _, s = quantize_int8(W, 64)
    half_step = (s.pow(2).mean().sqrt() / 2).item()          # the bound, not the typical error
    wrong = check_rounding_rms(half_step, W)
    assert wrong.ok is False and "√12" in wrong.message
    mean_s = check_rounding_rms((s.mean() / 12 ** 0.5).item(), W)    # the mean of s, not of s²
    assert mean_s.ok is False and "s²" in mean_s.message
    assert check_rounding_rms((s.pow(2).mean() / 12).sqrt().item(), W).ok is True   # written differently
    assert check_rounding_rms(None, W).ok is None


def test_08_per_tensor_solution():
    from mini_infer.course.exercises.ch08 import check_per_tensor
    ns = solution("08_quantization.ipynb", "Exercise 8.2")
    v = check_per_tensor(ns["quantize_per_tensor"], _heavy_tailed())
    assert v.ok is True and "one scale" in v.message


def test_08_per_tensor_wrong():
    from mini_infer.course.exercises.ch08 import check_per_tensor
    from mini_infer.plugins.quant import quantize_int8
    wrong = check_per_tensor(lambda w: quantize_int8(w), _heavy_tailed())   # per output channel
    assert wrong.ok is False and "one scale for the whole tensor" in wrong.message
    def stub(w): raise NotImplementedError
    assert check_per_tensor(stub, _heavy_tailed()).ok is None


def _tiny_int8_model():
    import torch
    from mini_infer.model.model import CausalLM, ModelConfig
    from mini_infer.plugins.quant import quantize_model
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, architecture="LlamaForCausalLM", tie_word_embeddings=True, max_position_embeddings=64)
    torch.manual_seed(0)
    return cfg, quantize_model(CausalLM(cfg, max_positions=64).eval())


def test_08_int8_floor_solution():
    from mini_infer.course.exercises.ch08 import check_int8_floor
    from mini_infer.engine.memory_plan import count_parameters
    cfg, qmodel = _tiny_int8_model()
    bw = 20e9
    ns = solution("08_quantization.ipynb", "Exercise 8.3", n_weights=count_parameters(cfg), bw=bw)
    assert check_int8_floor(ns["floor_ms"], qmodel, bw).ok is True


def test_08_int8_floor_wrong():
    from mini_infer.course.exercises.ch08 import check_int8_floor
    from mini_infer.engine.memory_plan import count_parameters
    cfg, qmodel = _tiny_int8_model()
    bw = 20e9
    wrong = check_int8_floor(count_parameters(cfg) / bw * 1e3, qmodel, bw)   # the scales forgotten
    assert wrong.ok is False and "scales" in wrong.message
    assert check_int8_floor(None, qmodel, bw).ok is None


def test_08_awq():
    "The AWQ-style search in the engine's int8 layers: solution and a variant lower the KL; two classic mistakes do not."
    import torch
    from mini_infer.course.exercises.ch08 import check_awq
    from mini_infer.plugins.quant import dequantize_int8, quantize_int8
    ns = solution("08_quantization.ipynb", "Exercise 8.4")
    v = check_awq(ns["search_scales"])
    assert v.ok is True and "KL" in v.message

    def search(W, X, magnitude, divide=True, grid=10):
        y, best = X @ W.T, None
        for i in range(grid):
            s = magnitude.pow(i / grid).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            q, sc = quantize_int8(W * s)
            err = (((X / s) if divide else X) @ dequantize_int8(q, sc).T - y).pow(2).mean().item()
            best = (err, s) if best is None or err < best[0] else best
        return best[1]
    # written differently: the root mean square of each channel, a finer grid
    assert check_awq(lambda W, X: search(W, X, X.pow(2).mean(0).sqrt(), grid=20)).ok is True
    alpha_one = check_awq(lambda W, X: X.abs().mean(0).clamp(min=1e-4))          # no search: alpha = 1
    assert alpha_one.ok is False and "worse" in alpha_one.message
    no_divide = check_awq(lambda W, X: search(W, X, X.abs().mean(0), divide=False))
    assert no_divide.ok is False and "divide X by s" in no_divide.message
    def stub(W, X): raise NotImplementedError
    assert check_awq(stub).ok is None


def test_08_smooth_model_keeps_the_float_model():
    "Smoothing folds 1/s into the norms and the up rows: in float the model computes the same."
    import copy, torch
    from mini_infer.model.model import CausalLM, ModelConfig, ContiguousKVCache, ContiguousStep
    from mini_infer.plugins.quant import smooth_model
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, architecture="Qwen2ForCausalLM", max_position_embeddings=64)
    torch.manual_seed(0)
    model = CausalLM(cfg, max_positions=64).eval()
    g = torch.Generator().manual_seed(1)
    scales = {f"layers.{i}.{name}": torch.rand(n, generator=g) + 0.5 for i in range(2)
              for name, n in (("self_attn.qkv_proj", 64), ("mlp.gate_up_proj", 64), ("mlp.down_proj", 96))}
    smoothed = smooth_model(copy.deepcopy(model), scales)
    ids = torch.arange(10)
    run = lambda m: m(ContiguousStep.tokens(ids, 0, last_only=False), ContiguousKVCache(cfg, 16))
    torch.testing.assert_close(run(smoothed), run(model), rtol=1e-4, atol=1e-4)
    assert not torch.equal(smoothed.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)

# ---- chapter 07 ----

def test_ch07_weight_floor():
    from mini_infer.course.exercises.ch07 import check_weight_floor
    wb, bw = 85_000_000, 12.5
    ns = solution("07_cpu_kernels.ipynb", "Exercise 7.1", weight_bytes=wb, bandwidth=bw)
    assert check_weight_floor(ns["prediction"], wb, bw).ok is True
    elements = check_weight_floor(wb / 4 / (bw * 1e9) * 1e3, wb, bw)     # weights counted, not bytes
    assert elements.ok is False and "4 bytes" in elements.message
    seconds = check_weight_floor(wb / (bw * 1e9), wb, bw)
    assert seconds.ok is False and "ms" in seconds.message
    assert check_weight_floor(None, wb, bw).ok is None


def test_ch07_intensity():
    from mini_infer.course.exercises.ch07 import check_intensity
    ns = solution("07_cpu_kernels.ipynb", "Exercise 7.2", bandwidth=12.5, peak=300.0)
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
    from mini_infer.course.exercises.ch07 import check_pack
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


def test_ch07_tile():
    "The register tile, built into chapter 7's library and run by the engine: the solution and a variant are right."
    from mini_infer.course.exercises.ch07 import check_tile
    ns = solution("07_cpu_kernels.ipynb", "Exercise 7.4")
    v = check_tile(ns["MY_TILE_C"])
    assert v.ok is True and "same" in v.message
    rows_outside = r"""
static inline void tile(int R, const float *x, int64_t K, const float *w, float *y) {
    for (int r = 0; r < R; r++) {           /* rows outside, k inside: each weight loaded R times */
        vf a = {0}, b = {0};
        for (int64_t k = 0; k < K; k++) {
            vf w0, w1;
            memcpy(&w0, w + k * NB, sizeof w0);
            memcpy(&w1, w + k * NB + VL, sizeof w1);
            a += x[r * K + k] * w0;
            b += x[r * K + k] * w1;
        }
        memcpy(y + r * NB, &a, sizeof a);
        memcpy(y + r * NB + VL, &b, sizeof b);
    }
}
"""
    assert check_tile(rows_outside).ok is True


def test_ch07_tile_wrong():
    "The mistakes of a first tile: one row stored, x read across rows, C that does not build; the stub."
    from mini_infer.course.exercises.ch07 import check_tile
    ns = solution("07_cpu_kernels.ipynb", "Exercise 7.4")
    only_row0 = check_tile(ns["MY_TILE_C"].replace("memcpy(y, acc, R * sizeof acc[0]);", "memcpy(y, acc, sizeof acc[0]);"))
    assert only_row0.ok is False and "row 1" in only_row0.message
    strided = check_tile(ns["MY_TILE_C"].replace("x[r * K + k]", "x[k * R + r]"))
    assert strided.ok is False and "x[r * K + k]" in strided.message
    broken = check_tile("static inline void tile(int R) { }")
    assert broken.ok is False and "does not build" in broken.message and "error" in broken.message
    assert check_tile(None).ok is None


def test_ch07_kv_read():
    from mini_infer.course.exercises.ch07b import check_kv_read
    args = dict(rows=32, context=1000, kv_heads=3, head_dim=64, bytes_per_value=2)
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.5")
    assert check_kv_read(ns["prediction"], **args).ok is True
    float32 = check_kv_read(2 * 32 * 1000 * 3 * 64 * 4 / 1e6, **args)
    assert float32.ok is False and "factor of 2" in float32.message
    assert check_kv_read(5.0, **args).ok is False
    assert check_kv_read(None, **args).ok is None


def test_ch07_online_softmax():
    "The online softmax over tiles, as the engine's attention: solution and a variant right, two mistakes wrong."
    import torch
    from mini_infer.course.exercises.ch07b import check_online_softmax
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.6")
    v = check_online_softmax(ns["attend_tiled"])
    assert v.ok is True and "same" in v.message
    def by_logsumexp(q, tiles):      # written differently: each tile's log-sum-exp, merged
        lse = o = None
        for K, V in tiles:
            s = K @ q
            t, po = torch.logsumexp(s, 0), torch.softmax(s, 0) @ V
            if lse is None:
                lse, o = t, po
            else:
                new = torch.logaddexp(lse, t)
                o, lse = o * torch.exp(lse - new) + po * torch.exp(t - new), new
        return o
    assert check_online_softmax(by_logsumexp).ok is True
    def no_rescale(q, tiles):    # a running maximum, but the old sums are not rescaled when it rises
        m, l, o = float("-inf"), 0.0, 0.0
        for K, V in tiles:
            s = K @ q
            m = max(m, s.max().item())
            p = torch.exp(s - m)
            l, o = l + p.sum(), o + p @ V
        return o / l
    wrong = check_online_softmax(no_rescale)
    assert wrong.ok is False and "old max" in wrong.message
    def all_at_once(q, tiles):   # the plain formula over the tiles kept: they share one buffer
        K, V = (torch.cat(t) for t in zip(*tiles))
        return torch.softmax(K @ q, 0) @ V
    wrong = check_online_softmax(all_at_once)
    assert wrong.ok is False and "overwrites" in wrong.message
    def stub(q, tiles):
        raise NotImplementedError
    assert check_online_softmax(stub).ok is None


def test_ch07_plan():
    from mini_infer.course.exercises.ch07b import check_plan
    lens = [1, 1, 1, 5, 9, 10, 40]
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.7")
    assert check_plan(ns["prediction"], lens).ok is True
    rows_not_tokens = check_plan((5, 2), lens)
    assert rows_not_tokens.ok is False and "SHORT_ROW" in rows_not_tokens.message
    assert check_plan((3, 4), lens).ok is False
    assert check_plan(None, lens).ok is None


def test_ch07_rms_norm():
    import torch
    from mini_infer.course.exercises.ch07c import check_rms_norm
    ns = solution("07c_step_replay.ipynb", "Exercise 7.8")
    assert check_rms_norm(ns["rms_norm"]).ok is True
    no_eps = check_rms_norm(lambda x, w, eps: x / x.pow(2).mean(-1, keepdim=True).sqrt() * w)
    assert no_eps.ok is False and "eps" in no_eps.message
    layer_norm = check_rms_norm(lambda x, w, eps: torch.nn.functional.layer_norm(x, x.shape[-1:], w, eps=eps))
    assert layer_norm.ok is False and "subtract nothing" in layer_norm.message
    def stub(x, w, eps):
        raise NotImplementedError
    assert check_rms_norm(stub).ok is None


def test_ch07_replayed():
    from mini_infer.course.exercises.ch07c import check_replayed
    steps = [[1] * 16, [1] * 17, [4, 4, 4, 4], [10], [1, 1, 9, 5], [3] * 6, [5] * 13, [1] * 70]
    ns = solution("07c_step_replay.ipynb", "Exercise 7.9")
    assert check_replayed(ns["prediction"], steps).ok is True
    rows_only = check_replayed([True, True, True, True, True, True, False, False], steps)   # forgot a limit
    assert rows_only.ok is False and "no row of more than 9" in rows_only.message
    assert check_replayed([True] * 3, steps).ok is False
    assert check_replayed(None, steps).ok is None


def test_ch07_fill():
    "A step into a recording, replayed by the engine's cpu backend: solution and a variant right, two mistakes wrong."
    from mini_infer.course.exercises.ch07c import check_fill
    ns = solution("07c_step_replay.ipynb", "Exercise 7.10")
    v = check_fill(ns["fill"])
    assert v.ok is True and "same greedy tokens" in v.message

    def copies(inputs, x, cos, sin, step, scratch, pad=True, lens=True):
        gx, gcos, gsin, cache, gstep = inputs
        T, p, gp = len(x), step.attn, gstep.attn
        gx[:T], gcos[:T], gsin[:T] = x, cos, sin
        gstep.slot_mapping[:T] = step.slot_mapping
        gp.decode_tables[:T].zero_()
        gp.decode_tables[:T, : p.decode_tables.shape[1]] = p.decode_tables
        if lens:
            gp.decode_lens[:T] = p.decode_lens
        if pad:
            for r in range(T, len(gx)):          # written differently: row by row
                gstep.slot_mapping[r], gp.decode_tables[r, 0], gp.decode_lens[r] = scratch * cache.block_size, scratch, 1
    assert check_fill(copies).ok is True
    no_padding = check_fill(lambda *a: copies(*a, pad=False))
    assert no_padding.ok is False and "padding rows" in no_padding.message and "scratch" in no_padding.message
    no_lens = check_fill(lambda *a: copies(*a, lens=False))
    assert no_lens.ok is False and "decode_lens" in no_lens.message
    def stub(inputs, x, cos, sin, step, scratch):
        raise NotImplementedError
    assert check_fill(stub).ok is None


def test_ch07_recorded_calls():
    from mini_infer.course.exercises.ch07c import check_recorded_calls
    ns = solution("07c_step_replay.ipynb", "Exercise 7.11")
    assert check_recorded_calls(ns["prediction"], n_layers=30).ok is True
    per_token = check_recorded_calls((360, 16 * 360), n_layers=30)
    assert per_token.ok is False and "does not grow" in per_token.message
    products_only = check_recorded_calls((7 * 30, 7 * 30), n_layers=30)
    assert products_only.ok is False and "count every C call" in products_only.message
    assert check_recorded_calls(None, n_layers=30).ok is None

# ---- chapter 02 ----

def test_02_append():
    import torch
    from mini_infer.course.exercises.ch02 import check_append
    assert check_append(solution("02_paged_cache.ipynb", "Exercise 2.1")["append"]).ok is True

    def one_block_at_a_time(table, n_new, allocator):   # a correct variant: blocks one by one, rolled back
        got = []
        while (len(table.blocks) + len(got)) * table.block_size < table.num_tokens + n_new:
            b = allocator.allocate(1)
            if b is None:
                allocator.free(got)
                return False
            got += b
        table.blocks, table.num_tokens = table.blocks + got, table.num_tokens + n_new
        return True
    assert check_append(one_block_at_a_time).ok is True

    def ignores_the_last_block(table, n_new, allocator):   # a fresh block for every append
        new = allocator.allocate(-(-n_new // table.block_size))
        if new is None:
            return False
        table.blocks += new
        table.num_tokens += n_new
        return True
    wrong = check_append(ignores_the_last_block)
    assert wrong.ok is False and "room for 2 more" in wrong.message

    def not_all_or_nothing(table, n_new, allocator):    # counts the tokens before it knows
        table.num_tokens += n_new
        need = -(-table.num_tokens // table.block_size) - len(table.blocks)
        new = allocator.allocate(max(need, 0))
        if new is None:
            return False
        table.blocks += new
        return True
    wrong = check_append(not_all_or_nothing)
    assert wrong.ok is False and "change nothing" in wrong.message

    def leaks_when_short(table, n_new, allocator):      # keeps the blocks it got before failing
        need = table.blocks_needed(n_new)
        new = [b for _ in range(need) for b in (allocator.allocate(1) or [])]
        if len(new) < need:
            return False
        table.blocks += new
        table.num_tokens += n_new
        return True
    wrong = check_append(leaks_when_short)
    assert wrong.ok is False and "change nothing" in wrong.message

    def floor(table, n_new, allocator):                 # rounds the blocks down
        need = (table.num_tokens + n_new) // table.block_size - len(table.blocks)
        new = allocator.allocate(max(need, 0))
        if new is None:
            return False
        table.blocks += new
        table.num_tokens += n_new
        return True
    assert check_append(floor).ok is False

    def stub(table, n_new, allocator):
        raise NotImplementedError
    assert check_append(stub).ok is None


def test_02_append_in_generate_paged_catches_a_leak():
    "A leak the small-table probe cannot see (only past 20 blocks) is caught at the call where it happens."
    from mini_infer.course.exercises import ch02
    from mini_infer.engine.block_manager import BlockTable
    calls = []

    def leaks_later(table, n_new, allocator):
        calls.append(1)
        ok = BlockTable.append(table, n_new, allocator)
        if ok and len(calls) == 40:
            allocator.allocate(1)   # one block taken and never put in a table
        return ok
    wrong = ch02.check_append(leaks_later)
    assert wrong.ok is False and "1 block(s) leaked" in wrong.message
    assert "after 36 calls" in wrong.message   # the 40th call, after the probe's 4


def test_02_gather():
    import torch
    from mini_infer.course.exercises.ch02 import check_gather
    assert check_gather(solution("02_paged_cache.ipynb", "Exercise 2.2", torch=torch)["gather"]).ok is True
    by_block = lambda pool, blocks, n: torch.cat([pool[b] for b in blocks.tolist()])[:n]   # a correct variant
    assert check_gather(by_block).ok is True
    uncut = check_gather(lambda pool, blocks, n: pool[blocks].flatten(0, 1))            # the last block's tail too
    assert uncut.ok is False and "cut at n" in uncut.message
    first_blocks = check_gather(lambda pool, blocks, n: pool[: len(blocks)].flatten(0, 1)[:n])   # ignores the table
    assert first_blocks.ok is False and "offset p % S" in first_blocks.message
    transposed = check_gather(lambda pool, blocks, n: pool[blocks].transpose(0, 1).flatten(0, 1)[:n])
    assert transposed.ok is False

    def stub(pool, blocks, n):
        raise NotImplementedError
    assert check_gather(stub).ok is None


def test_02_online_softmax():
    import torch
    from mini_infer.course.exercises.ch02 import check_online_softmax
    assert check_online_softmax(solution("02_paged_cache.ipynb", "Exercise 2.3", torch=torch)["update"]).ok is True

    def two_steps(m, l, acc, s, v):                     # a correct variant: rescale first, then add
        m_new = torch.max(torch.cat([m, s], -1), -1, keepdim=True).values
        scale = torch.exp(m - m_new)
        l, acc = l * scale, acc * scale
        p = torch.exp(s - m_new)
        return m_new, l + p.sum(-1, keepdim=True), acc + torch.matmul(p, v)
    assert check_online_softmax(two_steps).ok is True

    def no_rescale(m, l, acc, s, v):                    # forgets that the old sums were taken against m
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        return m_new, l + p.sum(-1, keepdim=True), acc + p @ v
    wrong = check_online_softmax(no_rescale)
    assert wrong.ok is False and "rescale" in wrong.message

    def no_max(m, l, acc, s, v):                        # plain exp: overflows on large scores
        p = torch.exp(s)
        return m, l + p.sum(-1, keepdim=True), acc + p @ v
    wrong = check_online_softmax(no_max)
    assert wrong.ok is False and "subtract the running max" in wrong.message

    def rescales_l_only(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p, corr = torch.exp(s - m_new), torch.exp(m - m_new)
        return m_new, l * corr + p.sum(-1, keepdim=True), acc + p @ v
    assert check_online_softmax(rescales_l_only).ok is False

    def stub(m, l, acc, s, v):
        raise NotImplementedError
    assert check_online_softmax(stub).ok is None


# ---- chapter 02b ----

def test_02b_latent_bytes():
    import torch
    from mini_infer.course.exercises.ch02b import check_latent_bytes
    assert check_latent_bytes(solution("02b_latent_attention.ipynb", "Exercise 2b.1", torch=torch)["latent_bytes"]).ok is True
    from mini_infer.plugins.mla import latent_bytes_per_token
    assert check_latent_bytes(latent_bytes_per_token).ok is True                       # a correct variant: ours
    kv_twice = check_latent_bytes(lambda cfg, dtype: 2 * latent_bytes_per_token(cfg, dtype))   # K and V, as GQA
    assert kv_twice.ok is False and "not a K and a V" in kv_twice.message
    no_rope = check_latent_bytes(lambda cfg, dtype: cfg.num_hidden_layers * cfg.kv_lora_rank * dtype.itemsize)
    assert no_rope.ok is False and "RoPE part" in no_rope.message

    def stub(cfg, dtype):
        raise NotImplementedError
    assert check_latent_bytes(stub).ok is None


def test_02b_absorbed():
    import torch
    from mini_infer.course.exercises.ch02b import check_absorbed
    from mini_infer.plugins.mla import absorbed_attention
    ns = solution("02b_latent_attention.ipynb", "Exercise 2b.2", torch=torch)
    assert check_absorbed(ns["absorbed"]).ok is True
    assert check_absorbed(absorbed_attention).ok is True                                 # a correct variant: ours

    def scaled_by_latent(q_nope, q_pe, latents, mask, w_uk, w_uv, scale):             # 1/sqrt(r + R): the absorbed width
        return absorbed_attention(q_nope, q_pe, latents, mask, w_uk, w_uv, latents.shape[-1] ** -0.5)
    wrong = check_absorbed(scaled_by_latent)
    assert wrong.ok is False and "qk_nope_head_dim + qk_rope_head_dim" in wrong.message

    def no_rope(q_nope, q_pe, latents, mask, w_uk, w_uv, scale):                       # forgets q_pe . k_pe
        return absorbed_attention(q_nope, q_pe * 0, latents, mask, w_uk, w_uv, scale)
    wrong = check_absorbed(no_rope)
    assert wrong.ok is False and "RoPE parts" in wrong.message

    def stub(q_nope, q_pe, latents, mask, w_uk, w_uv, scale):
        raise NotImplementedError
    assert check_absorbed(stub).ok is None


def test_02b_fold_output():
    import torch
    from mini_infer.course.exercises.ch02b import check_fold_output
    assert check_fold_output(solution("02b_latent_attention.ipynb", "Exercise 2b.3", torch=torch)["fold"]).ok is True

    def by_loop(w_uv, w_o):                                                            # a correct variant: head by head
        H, v, r = w_uv.shape
        return torch.cat([w_o[:, h * v:(h + 1) * v] @ w_uv[h] for h in range(H)], 1)
    assert check_fold_output(by_loop).ok is True
    heads_last = check_fold_output(lambda w_uv, w_o: torch.einsum("ohv,hvr->orh", w_o.view(-1, *w_uv.shape[:2]),
                                                                  w_uv).reshape(w_o.shape[0], -1))   # [r, H] order
    assert heads_last.ok is False and "head h's columns" in heads_last.message
    shape = check_fold_output(lambda w_uv, w_o: w_o)                                     # nothing folded
    assert shape.ok is False and "shape" in shape.message

    def stub(w_uv, w_o):
        raise NotImplementedError
    assert check_fold_output(stub).ok is None


# ---- chapter 03 ----

def test_03_policy_in_the_engine():
    from collections import deque
    from mini_infer.engine.registry import register
    from mini_infer.course.exercises.ch03 import check_policy
    solution("03_continuous_batching.ipynb", "Exercise 3.1", deque=deque, register=register)
    right = check_policy("shortest_prompt_first")
    assert right.ok is True and "preemptions" in right.message and not right.message.startswith("0 ")

    def pick_shortest(waiting, kv):                      # a correct variant: selection, not sorted()
        rest, out = list(waiting), deque()
        while rest:
            best = min(range(len(rest)), key=lambda i: (len(rest[i].prompt_ids), i))
            out.append(rest.pop(best))
        return out
    register("policy", "test_pick_shortest")(pick_shortest)
    assert check_policy("test_pick_shortest").ok is True

    register("policy", "test_list")(lambda w, kv: sorted(w, key=lambda s: len(s.prompt_ids)))
    as_list = check_policy("test_list")                  # passes a sort check, crashes at the first preemption
    assert as_list.ok is False and "appendleft" in as_list.message
    register("policy", "test_longest")(lambda w, kv: deque(sorted(w, key=lambda s: -len(s.prompt_ids))))
    longest = check_policy("test_longest")
    assert longest.ok is False and "shortest prompts first" in longest.message
    register("policy", "test_unstable")(lambda w, kv: deque(sorted(w, key=lambda s: (len(s.prompt_ids), -ord(s.request_id[0])))))
    unstable = check_policy("test_unstable")             # later arrivals first among equals
    assert unstable.ok is False and "first come first served" in unstable.message

    def sorts_in_place(waiting, kv):                     # sorts, but returns nothing
        items = sorted(waiting, key=lambda s: len(s.prompt_ids))
        waiting.clear(); waiting.extend(items)
    register("policy", "test_none")(sorts_in_place)
    assert check_policy("test_none").ok is False

    def stub(waiting, kv):
        raise NotImplementedError
    register("policy", "test_stub")(stub)
    assert check_policy("test_stub").ok is None
    assert check_policy("never_registered").ok is False


def test_03_policy_order_is_checked_in_the_engine():
    "A policy right on the small probe but FCFS on longer queues is caught by the engine's admission order."
    from collections import deque
    from mini_infer.engine.registry import register
    from mini_infer.course.exercises.ch03 import check_policy
    register("policy", "test_short_queues_only")(
        lambda w, kv: deque(sorted(w, key=lambda s: len(s.prompt_ids))) if len(w) <= 5 else w)
    wrong = check_policy("test_short_queues_only")
    assert wrong.ok is False and "admitted the requests" in wrong.message and "r4 (5)" in wrong.message


def test_03_spf_ttft():
    from mini_infer.course.exercises.ch03 import check_spf_ttft, ttft_in_steps
    from mini_infer.engine.scheduler import fcfs
    ns = solution("03_continuous_batching.ipynb", "Exercise 3.2")
    assert check_spf_ttft(ns["prediction"]).ok is True
    wrong = check_spf_ttft(("down", "down"))   # as if nobody paid for the better mean
    assert wrong.ok is False and "long prompt" in wrong.message
    assert check_spf_ttft(("up", "up")).ok is False
    assert check_spf_ttft("down").ok is False
    assert check_spf_ttft(None).ok is None
    assert ttft_in_steps(fcfs)[0] == min(ttft_in_steps(fcfs))   # FCFS: the long prompt, first in line, starts first


def test_03_static_padding():
    from mini_infer.course.exercises.ch03 import check_static_padding
    ns = solution("03_continuous_batching.ipynb", "Exercise 3.3")
    assert check_static_padding(ns["prediction"], ns["lens"], ns["B"]).ok is True
    steps = check_static_padding(60, ns["lens"], ns["B"])   # the steps, not the padded slots
    assert steps.ok is False and "steps" in steps.message
    assert check_static_padding(90, ns["lens"], ns["B"]).ok is False
    assert check_static_padding(None, ns["lens"], ns["B"]).ok is None


# ---- chapter 04 ----

def test_04_block_keys():
    from mini_infer.plugins.prefix_cache import hash_block
    from mini_infer.course.exercises.ch04 import check_block_keys
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
    from mini_infer.course.exercises.ch04 import check_hit_rate
    assert check_hit_rate(solution("04_prefix_cache.ipynb", "Exercise 4.3")["prediction"]).ok is True
    naive = check_hit_rate(90 / 120)   # the whole prefix, as if partial blocks were shared
    assert naive.ok is False and "full blocks" in naive.message
    assert check_hit_rate(80).ok is False
    assert check_hit_rate(None).ok is None


def test_04_unsalted_hits():
    from mini_infer.course.exercises.ch04 import check_unsalted_hits, cached_tokens
    assert check_unsalted_hits(solution("04_prefix_cache.ipynb", "Exercise 4.4")["prediction"]).ok is True
    whole = check_unsalted_hits(210)   # B's own last tokens counted too
    assert whole.ok is False and "last tokens" in whole.message
    assert check_unsalted_hits(208).ok is False   # the partial block counted as shared
    assert check_unsalted_hits(0).ok is False   # as if the cache were salted
    assert check_unsalted_hits(None).ok is None
    secret = list(range(1000, 1200))
    assert cached_tokens([secret + [7] * 10, secret + [9] * 10], salts=["a", "b"])[1] == 0   # a salt per tenant closes it


def _walk(kv, seq, start, stop, parent, take=False):
    "The walk over a sequence's full blocks start..stop-1 from `parent`, as the wrong answers below vary it."
    hits = []
    for i in range(start, stop):
        block = kv.allocator.lookup(parent, *kv.full_block(seq, i))
        if block is None:
            break
        hits.append(block)
        parent = block
    if take:
        kv.allocator.incref(hits)
    return hits


def test_04_match():
    from mini_infer.course.exercises.ch04 import check_match
    assert check_match(solution("04_prefix_cache.ipynb", "Exercise 4.2")["match"]).ok is True

    def last(seq):
        return seq.block_table.blocks[-1] if seq.block_table.blocks else None

    def recursive(kv, seq, i=None, parent=...):   # a correct variant, written as a recursion
        i = seq.num_computed_tokens // kv.block_size if i is None else i
        parent = last(seq) if parent is ... else parent
        if i >= (seq.num_tokens - 1) // kv.block_size:
            return []
        block = kv.allocator.lookup(parent, *kv.full_block(seq, i))
        return [] if block is None else [block] + recursive(kv, seq, i + 1, block)
    assert check_match(recursive).ok is True

    def whole_prompt(kv, seq):   # takes the block of the last token too
        S = kv.block_size
        return _walk(kv, seq, seq.num_computed_tokens // S, seq.num_tokens // S, last(seq))
    wrong = check_match(whole_prompt)
    assert wrong.ok is False and "last token" in wrong.message and "request C" in wrong.message

    def from_the_start(kv, seq):   # ignores what the sequence has computed
        return _walk(kv, seq, 0, (seq.num_tokens - 1) // kv.block_size, None)
    wrong = check_match(from_the_start)
    assert wrong.ok is False and "64 computed" in wrong.message

    def unchained(kv, seq):   # every lookup without its parent
        S, hits = kv.block_size, []
        for i in range(seq.num_computed_tokens // S, (seq.num_tokens - 1) // S):
            block = kv.allocator.lookup(None, *kv.full_block(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits
    wrong = check_match(unchained)
    assert wrong.ok is False and "request B found 16" in wrong.message

    def takes_them(kv, seq):   # gives the blocks an owner as well: computed_tokens does that
        S = kv.block_size
        return _walk(kv, seq, seq.num_computed_tokens // S, (seq.num_tokens - 1) // S, last(seq), take=True)
    wrong = check_match(takes_them)
    assert wrong.ok is False and "leaked" in wrong.message and "after step" in wrong.message

    def stub(kv, seq):
        raise NotImplementedError
    assert check_match(stub).ok is None


# ---- chapter 01 ----

def smol_cfg():
    from mini_infer.model.model import ModelConfig
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, tie_word_embeddings=True)


def test_01_relative_score():
    import torch
    from mini_infer.course.exercises.ch01 import check_relative_score
    cfg = smol_cfg()
    ns = solution("01_model.ipynb", "Exercise 1.1:", check_relative_score=check_relative_score, smol_cfg=cfg)
    assert check_relative_score(ns["relative_score"], cfg).ok is True
    flipped = lambda q, k, delta, inv_freq: ns["relative_score"](q, k, -delta, inv_freq)   # the sin term's sign flipped
    wrong = check_relative_score(flipped, cfg)
    assert wrong.ok is False and "sign" in wrong.message
    wrong = check_relative_score(lambda q, k, delta, inv_freq: (q * k).sum(), cfg)   # ignores the rotation
    assert wrong.ok is False and "distance" in wrong.message
    def stub(q, k, delta, inv_freq): raise NotImplementedError
    assert check_relative_score(stub, cfg).ok is None


def test_01_kv_ratio():
    from mini_infer.model.model import ModelConfig
    from mini_infer.course.exercises.ch01 import check_kv_ratio
    cfg = smol_cfg()
    mha = ModelConfig(**{**vars(cfg), "num_key_value_heads": 9})
    ns = solution("01_model.ipynb", "Exercise 1.2:", check_kv_ratio=check_kv_ratio, smol_cfg=cfg, mha_cfg=mha)
    assert check_kv_ratio(ns["prediction"], cfg, mha).ok is True
    wrong = check_kv_ratio(1 / 3, cfg, mha)
    assert wrong.ok is False and "shrinks" in wrong.message
    wrong = check_kv_ratio(9.0, cfg, mha)
    assert wrong.ok is False and "off by" in wrong.message
    assert check_kv_ratio(None, cfg, mha).ok is None


def test_01_param_count():
    from mini_infer.course.exercises.ch01 import check_param_count
    cfg = smol_cfg()
    ns = solution("01_model.ipynb", "Exercise 1.3:", check_param_count=check_param_count, smol_cfg=cfg)
    assert ns["prediction"] == 134_515_008 and check_param_count(ns["prediction"], cfg).ok is True
    wrong = check_param_count(134_515_008 + 49152 * 576, cfg)   # the tied table counted twice
    assert wrong.ok is False and "twice" in wrong.message
    wrong = check_param_count(135_000_000 * 1.1, cfg)
    assert wrong.ok is False and "off by" in wrong.message
    named = check_param_count(135_000_000, cfg)                 # the model's name: a rounding, not the count
    assert named.ok is False and "name" in named.message
    assert check_param_count(134_515_008 - 61 * 576, cfg).ok is True   # the norm gains forgotten: within 0.1%
    assert check_param_count(None, cfg).ok is None


@pytest.fixture(scope="module")
def smol_gguf():
    import gguf
    from mini_infer.model.loader import bundled_gguf_path
    from mini_infer.model.tokenizer import Tokenizer
    reader = gguf.GGUFReader(str(bundled_gguf_path()))
    return reader, Tokenizer.from_gguf(reader)


def test_01b_chatml(smol_gguf):
    from mini_infer.course.exercises.ch01b import check_chatml
    tok = smol_gguf[1]
    ns = solution("01b_weights_and_tokens.ipynb", "Exercise 1.4:", check_chatml=check_chatml, smol_tok=tok)
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
    from mini_infer.course.exercises.ch01b import check_gguf_bytes
    reader = smol_gguf[0]
    ns = solution("01b_weights_and_tokens.ipynb", "Exercise 1.5:", check_gguf_bytes=check_gguf_bytes, reader=reader)
    assert check_gguf_bytes(ns["prediction"], reader).ok is True
    wrong = check_gguf_bytes(134_515_008 // 2, reader)   # 4 bits per weight, no scales
    assert wrong.ok is False and "scale" in wrong.message
    wrong = check_gguf_bytes(134_515_008 * 5 // 8, reader)   # all Q4_1
    assert wrong.ok is False and "Q8_0" in wrong.message
    assert check_gguf_bytes(None, reader).ok is None


def test_01b_q8_0_table_in_the_model(smol_gguf):
    "Build it: the learner's Q8_0 decoder makes SmolLM2's table, loaded through `load_weights`; greedy tokens compared."
    import numpy as np
    import torch
    from mini_infer.course.exercises.ch01b import check_q8_0
    from mini_infer.course.exercises.ch01b import smollm2
    reader = smol_gguf[0]
    model, _ = smollm2()
    table = model.lm_head.weight.detach().clone()
    ns = solution("01b_weights_and_tokens.ipynb", "Exercise 1.6:", check_q8_0=check_q8_0, reader=reader, np=np)
    assert check_q8_0(ns["dequant_q8_0"], reader).ok is True
    def variant(blocks):   # float64, the scale read with frombuffer, the sign taken by hand
        scale = np.frombuffer(blocks[:, :2].tobytes(), dtype="<f2").astype(np.float64)[:, None]
        q = blocks[:, 2:].astype(np.int16)
        return scale * np.where(q > 127, q - 256, q)
    assert check_q8_0(variant, reader).ok is True
    unsigned = lambda b: b[:, :2].view(np.float16).astype(np.float32) * b[:, 2:].astype(np.float32)
    wrong = check_q8_0(unsigned, reader)
    assert wrong.ok is False and "signed" in wrong.message and "token 0" in wrong.message
    wrong = check_q8_0(lambda b: b[:, 2:].view(np.int8).astype(np.float32), reader)   # no scale
    assert wrong.ok is False and "scale" in wrong.message
    wrong = check_q8_0(lambda b: ns["dequant_q8_0"](b).reshape(-1), reader)   # flat, not [n, 32]
    assert wrong.ok is False and "[18, 32]" in wrong.message
    def stub(blocks): raise NotImplementedError
    assert check_q8_0(stub, reader).ok is None
    assert torch.equal(model.lm_head.weight, table)   # gguf's table is back after each check (copied back: the same bits)


def test_01b_rms_norm_in_the_model():
    "Build it: the learner's RMSNorm runs in SmolLM2's 61 norms through `set_ops`; greedy tokens compared."
    import torch
    from mini_infer.course.exercises.ch01b import check_rms_norm, smollm2
    from mini_infer.model.model import TorchOps
    ns = solution("01b_weights_and_tokens.ipynb", "Exercise 1.7:", check_rms_norm=check_rms_norm, torch=torch)
    assert check_rms_norm(ns["rms_norm"]).ok is True
    # a correct variant, written differently: divide by the square root of sum / d
    variant = lambda x, w, eps: w * (x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps))
    assert check_rms_norm(variant).ok is True
    def layer_norm(x, w, eps):   # the mistake the chapter warns about: RMSNorm does not centre
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * w
    wrong = check_rms_norm(layer_norm)
    assert wrong.ok is False and "LayerNorm" in wrong.message and "token" in wrong.message
    wrong = check_rms_norm(lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w)   # no eps
    assert wrong.ok is False and "eps" in wrong.message
    wrong = check_rms_norm(lambda x, w, eps: x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).mul_(w))
    assert wrong.ok is False and "in place" in wrong.message and "differs" in wrong.message
    def stub(x, weight, eps): raise NotImplementedError
    assert check_rms_norm(stub).ok is None
    model, _ = smollm2()   # the engine's ops are back, and its tokens with them
    assert all(type(m.ops) is TorchOps for m in model.ops_modules())


def test_01c_top_p_in_the_sampler():
    "Build it: the learner's top-p runs inside the engine's Sampler; masks and seeded sampled tokens compared."
    import torch
    from mini_infer.course.exercises.ch01c import check_top_p
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.8:", check_top_p=check_top_p, torch=torch)
    assert check_top_p(ns["nucleus"]).ok is True
    def variant(logits, p):   # vLLM's way: drop the least likely tokens while their mass stays <= 1 - p
        asc, order = logits.softmax(-1).sort(dim=-1)
        drop = asc.cumsum(-1) <= (1 - p)[:, None]
        drop[:, -1] = False
        return ~torch.zeros_like(drop).scatter(-1, order, drop)
    assert check_top_p(variant).ok is True
    def without_crossing(logits, p):   # keeps tokens while the mass *including* them is < p
        probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
        keep = (probs.cumsum(-1) < p[:, None]) | (p[:, None] >= 1)
        return torch.zeros_like(keep).scatter(-1, order, keep)
    wrong = check_top_p(without_crossing)
    assert wrong.ok is False and "crosses" in wrong.message and "token 0 differs" in wrong.message
    wrong = check_top_p(lambda logits, p: ns["nucleus"](logits, p[:1].expand(len(p))))   # one p for all rows
    assert wrong.ok is False and "row 0's p" in wrong.message
    def unsorted(logits, p):   # the cumulative mass taken in vocabulary order
        probs = logits.softmax(-1)
        return ((probs.cumsum(-1) - probs) < p[:, None]) | (p[:, None] >= 1)
    wrong = check_top_p(unsorted)
    assert wrong.ok is False and "the batch" in wrong.message
    def no_softmax(logits, p):   # the logits summed as if they were probabilities
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        keep = ((sorted_logits.cumsum(-1) - sorted_logits) < p[:, None]) | (p[:, None] >= 1)
        return torch.zeros_like(keep).scatter(-1, order, keep)
    wrong = check_top_p(no_softmax)
    assert wrong.ok is False and "the batch" in wrong.message
    def stub(logits, p): raise NotImplementedError
    assert check_top_p(stub).ok is None


def test_01c_entropy_limit():
    import math, torch
    from mini_infer.course.exercises.ch01c import check_entropy_limit
    demo = -torch.log(torch.arange(1, 51.0))
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.9:", check_entropy_limit=check_entropy_limit, demo=demo)
    assert check_entropy_limit(ns["prediction"], demo).ok is True
    wrong = check_entropy_limit(0.0, demo)
    assert wrong.ok is False and "greedy" in wrong.message
    wrong = check_entropy_limit(math.log2(50), demo)
    assert wrong.ok is False and "bits" in wrong.message
    at_t4 = -((demo / 4).softmax(-1) * (demo / 4).log_softmax(-1)).sum().item()   # the sweep's last line
    assert check_entropy_limit(round(at_t4, 3), demo).ok is False
    assert check_entropy_limit(None, demo).ok is None


def test_01c_recompute_tokens():
    from mini_infer.course.exercises.ch01c import check_recompute_tokens
    prompt = list(range(5))
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.10:", check_recompute_tokens=check_recompute_tokens, prompt=prompt)
    assert ns["prediction"] == 12 * 5 + 66 and check_recompute_tokens(ns["prediction"], 5, 12).ok is True
    wrong = check_recompute_tokens(12 * 5, 5, 12)
    assert wrong.ok is False and "grows" in wrong.message
    wrong = check_recompute_tokens(5 + 12 - 1, 5, 12)
    assert wrong.ok is False and "cached" in wrong.message
    assert check_recompute_tokens(None, 5, 12).ok is None

# ---- chapter 06 ----

from mini_infer.course.exercises.ch06 import check_sse_events, check_chat_stream, check_kv_usage_metric, check_max_num_seqs


def _stub(*args):
    raise NotImplementedError


def _chat_stream(role=True, deltas="step", finish=True, usage_at="end", done=True):
    """chat_stream written with the pieces a learner may get wrong: the role chunk, the deltas (each step's, or
    the text so far), the finish chunk, where the usage goes, [DONE]."""
    from mini_infer.serve.openai_api import sse

    async def chat_stream(s):
        chunk = lambda choice, **more: sse({**s.head, "choices": [choice], **more})
        if role:
            yield sse({**s.head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}
                                             for i in range(s.n)]})
        text, usage = {}, None
        async for step in s.steps:
            more = {"usage": step.usage} if usage_at == "every chunk" else {}
            for d in step.deltas:
                text[step.index] = text.get(step.index, "") + d.get("content", "")
                delta = {"content": text[step.index]} if deltas == "so far" else d
                yield chunk({"index": step.index, "delta": delta, "finish_reason": None}, **more)
            if finish and step.finish_reason is not None:
                yield chunk({"index": step.index, "delta": {}, "finish_reason": step.finish_reason}, **more)
            usage = step.usage
        if s.include_usage:
            yield sse({**s.head, "choices": [], "usage": usage})
        if done:
            yield sse("[DONE]")
    return chat_stream


def test_06_chat_stream_solution_and_stub():
    from mini_infer.serve.openai_api import sse
    ns = solution("06_server.ipynb", "Exercise 6.2", sse=sse)
    assert check_chat_stream(ns["chat_stream"]).ok is True
    assert check_chat_stream(_stub).ok is None


def test_06_chat_stream_variant():
    "Written differently: a role chunk per choice, the finish on the step's last delta, 'usage': null until the end."
    import json

    def line(obj):
        return "data: " + json.dumps(obj) + "\n\n"

    async def chat_stream(s):
        null = {"usage": None} if s.include_usage else {}
        for i in range(s.n):
            yield line({**s.head, **null, "choices": [{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}]})
        last = None
        async for step in s.steps:
            last = step.usage
            choices = [{"index": step.index, "delta": d, "finish_reason": None} for d in step.deltas]
            if step.finish_reason and choices:
                choices[-1]["finish_reason"] = step.finish_reason
            elif step.finish_reason:
                choices = [{"index": step.index, "delta": {}, "finish_reason": step.finish_reason}]
            for c in choices:
                yield line({**s.head, **null, "choices": [c]})
        if s.include_usage:
            yield line({**s.head, "choices": [], "usage": last})
        yield "data: [DONE]\n\n"
    assert check_chat_stream(chat_stream).ok is True
    assert check_chat_stream(_chat_stream()).ok is True   # the pieces of the wrong ones below, put right


@pytest.mark.parametrize("mistake, says", [
    (dict(role=False), "role"),
    (dict(deltas="so far"), "not the text so far"),
    (dict(finish=False), "no finish_reason"),
    (dict(usage_at="every chunk"), "carries a usage"),
    (dict(done=False), "[DONE]"),
], ids=["no role chunk", "text so far", "no finish chunk", "usage on every chunk", "no [DONE]"])
def test_06_chat_stream_wrong(mistake, says):
    wrong = check_chat_stream(_chat_stream(**mistake))
    assert wrong.ok is False and says in wrong.message, wrong.message


def test_06_sse_events():
    ns = solution("06_server.ipynb", "Exercise 6.1")
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

# ---- chapter 09 ----

def _smollm_cfg():
    from mini_infer.model.model import ModelConfig
    return ModelConfig(49152, 576, 1536, 30, 9, 3, tie_word_embeddings=True)


def _qwen3b_cfg():
    from mini_infer.model.model import ModelConfig
    return ModelConfig(151936, 2048, 11008, 36, 16, 2, tie_word_embeddings=True, attention_bias=True,
                       architecture="Qwen2ForCausalLM")


def test_09_all_reduce_count():
    from mini_infer.course.exercises.ch09 import check_all_reduce_count
    ns = solution("09_scaling_out.ipynb", "Exercise 9.1", check_all_reduce_count=lambda *a: None)
    assert check_all_reduce_count(ns["prediction"], _smollm_cfg()).ok is True
    assert check_all_reduce_count(61, _smollm_cfg()).ok is True                 # written as the number
    for wrong, says in ((60, "embedding"), (30, "two column-then-row pairs"), (62, "gathered")):
        verdict = check_all_reduce_count(wrong, _smollm_cfg())
        assert verdict.ok is False and says in verdict.message, (wrong, verdict)
    assert check_all_reduce_count(None, _smollm_cfg()).ok is None


def test_09_masked_lookup():
    import torch
    from mini_infer.course.exercises.ch09 import check_masked_lookup
    ns = solution("09_scaling_out.ipynb", "Exercise 9.2", torch=torch)
    assert check_masked_lookup(ns["lookup"]).ok is True
    def with_where(ids, rows, start):                                           # a variant
        inside = (ids >= start) & (ids < start + len(rows))
        return torch.where(inside[:, None], rows[(ids - start).clamp(0, len(rows) - 1)], 0.0)
    assert check_masked_lookup(with_where).ok is True
    no_mask = check_masked_lookup(lambda ids, rows, start: rows[(ids - start).clamp(0, rows.shape[0] - 1)])
    assert no_mask.ok is False and "zeros" in no_mask.message
    def no_shift(ids, rows, start):                                             # global ids into local rows
        inside = (ids >= start) & (ids < start + len(rows))
        return torch.where(inside[:, None], rows[ids.clamp(0, len(rows) - 1)], 0.0)
    assert check_masked_lookup(no_shift).ok is False
    def stub(ids, rows, start):
        raise NotImplementedError
    assert check_masked_lookup(stub).ok is None


def test_09_kv_per_rank():
    from mini_infer.course.exercises.ch09 import check_kv_per_rank
    ns = solution("09_scaling_out.ipynb", "Exercise 9.3")
    assert check_kv_per_rank(ns["kv_kb"], _qwen3b_cfg()).ok is True
    assert check_kv_per_rank({1: 36, 2: 18, 3: None, 4: 18, 8: 18}, _qwen3b_cfg()).ok is True   # ints
    halving = check_kv_per_rank({1: 36, 2: 18, 3: None, 4: 9, 8: 4.5}, _qwen3b_cfg())
    assert halving.ok is False and "replicated" in halving.message
    keys_only = check_kv_per_rank({1: 18, 2: 9, 3: None, 4: 9, 8: 9}, _qwen3b_cfg())
    assert keys_only.ok is False and "a key AND a value" in keys_only.message
    three = check_kv_per_rank({1: 36, 2: 18, 3: 12, 4: 18, 8: 18}, _qwen3b_cfg())
    assert three.ok is False and "do not split over 3 ranks" in three.message
    assert check_kv_per_rank(None, _qwen3b_cfg()).ok is None


# exercise 9.4's plausible implementations; module-level functions, as the workers rebuild them from source
import torch  # noqa: E402


def _ring_one_loop(x, rank, size, send_recv):
    "Correct, written differently: one loop of 2(size - 1) steps, chunks by index arithmetic."
    flat = x.view(-1)
    bounds = [len(flat) * k // size for k in range(size + 1)]
    def chunk(k):
        k %= size
        return flat[bounds[k]:bounds[k + 1]]
    for s in range(2 * (size - 1)):
        out, into = chunk(rank - s), chunk(rank - s - 1)
        received = torch.empty_like(into)
        send_recv(out.clone(), received)
        if s < size - 1:
            into += received
        else:
            into.copy_(received)
    return x


def _ring_scatter_only(x, rank, size, send_recv):
    "Wrong: the reduce-scatter without the all-gather."
    chunks = x.view(-1).tensor_split(size)
    for step in range(size - 1):
        send, add = (rank - step) % size, (rank - step - 1) % size
        received = torch.empty_like(chunks[add])
        send_recv(chunks[send], received)
        chunks[add].add_(received)
    return x


def _ring_off_by_one(x, rank, size, send_recv):
    "Wrong: adds what it receives into the chunk it sent, not the previous rank's."
    chunks = x.view(-1).tensor_split(size)
    for step in range(size - 1):
        send = add = (rank - step) % size
        received = torch.empty_like(chunks[add])
        send_recv(chunks[send], received)
        chunks[add].add_(received)
    for step in range(size - 1):
        send_recv(chunks[(rank + 1 - step) % size], chunks[(rank - step) % size])
    return x


def _ring_whole_tensor(x, rank, size, send_recv):
    "Right sums, not a ring: the whole tensor passed around size - 1 times."
    passing = x.clone()
    for _ in range(size - 1):
        received = torch.empty_like(x)
        send_recv(passing, received)
        x += received
        passing = received
    return x


def _ring_uneven_calls(x, rank, size, send_recv):
    "Wrong: ranks call send_recv different numbers of times (it would hang the engine)."
    for _ in range(rank):
        send_recv(x, torch.empty_like(x))
    return x


def _ring_solution():
    "Exercise 9.4's folded solution, defined with its source known (the workers define it again from it)."
    import linecache
    [code] = [c for h, c in solutions(NBS / "09_scaling_out.ipynb").items() if h.startswith("Exercise 9.4")]
    filename = "<exercise 9.4 solution>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    ns = {"torch": torch, "check_ring_all_reduce": lambda fn: None}
    exec(compile(code, filename, "exec"), ns)
    return ns["ring_all_reduce"]



@pytest.mark.parametrize("ring", [_ring_solution, lambda: _ring_one_loop], ids=["solution", "variant"])
def test_09_ring_all_reduce_right(ring):
    "TP = 3 on SmolLM2 summing with the ring gives TP = 1's greedy tokens (two engines: ~20 s)."
    from mini_infer.course.exercises.ch09 import check_ring_all_reduce
    verdict = check_ring_all_reduce(ring(), max_tokens=6)
    assert verdict.ok is True, verdict.message


@pytest.mark.parametrize("ring, says", [(_ring_scatter_only, "reduce-scatter"), (_ring_off_by_one, "chunk")],
                         ids=["scatter-only", "off-by-one"])
def test_09_ring_all_reduce_wrong(ring, says):
    "The engine runs it and names the first diverging token; the thread ranks say what went wrong."
    from mini_infer.course.exercises.ch09 import check_ring_all_reduce
    verdict = check_ring_all_reduce(ring, max_tokens=4)
    assert verdict.ok is False and says in verdict.message, verdict.message
    assert "first differs from TP = 1 at prompt 'The capital of France is', generated token" in verdict.message


def test_09_ring_all_reduce_caught_before_the_engine():
    "Not a ring, a hang, a missing return, the stub: judged on thread ranks, no engine started."
    from mini_infer.course.exercises.ch09 import check_ring_all_reduce
    whole = check_ring_all_reduce(_ring_whole_tensor)
    assert whole.ok is False and "2(N-1)/N" in whole.message
    hang = check_ring_all_reduce(_ring_uneven_calls)
    assert hang.ok is False and "the same number of times" in hang.message
    no_return = check_ring_all_reduce(lambda x, rank, size, send_recv: None)
    assert no_return.ok is False and "return the summed tensor" in no_return.message
    def stub(x, rank, size, send_recv):
        raise NotImplementedError
    assert check_ring_all_reduce(stub).ok is None

# ---- chapter 10 ----

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from mini_infer.model.loader import resolve_model
    from mini_infer.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf(str(resolve_model()))


def _bits(logits, bitmask):
    "Shift-and-and over arange(32): the allowed tokens [rows, V] (a helper for the wrong answers below)."
    import torch
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, : logits.shape[-1]].bool()


def test_ch10_apply_bitmask_wrong():
    "Plausible mistakes, each named in the learner's terms before the engine runs; the stub is not attempted."
    import torch
    from mini_infer.course.exercises.ch10 import check_apply_bitmask
    ninf = float("-inf")

    def reversed_bits(logits, bitmask):   # bit 31 - j read for token 32 i + j
        bits = (bitmask.unsqueeze(-1) >> (31 - torch.arange(32, dtype=torch.int32))) & 1
        logits.masked_fill_(~bits.flatten(1)[:, : logits.shape[-1]].bool(), ninf)
    wrong = check_apply_bitmask(reversed_bits)
    assert wrong.ok is False and "bit 31 - j" in wrong.message
    wrong = check_apply_bitmask(lambda logits, bm: logits.masked_fill_(~_bits(logits, bm), 0.0))
    assert wrong.ok is False and "-inf, not 0" in wrong.message
    wrong = check_apply_bitmask(lambda logits, bm: logits.masked_fill_(_bits(logits, bm), ninf))
    assert wrong.ok is False and "a set bit (1) allows" in wrong.message

    def sign_bit(logits, bitmask):        # `& (1 << j) > 0`: bit 31 is the sign, so never > 0
        bits = (bitmask.unsqueeze(-1) & (1 << torch.arange(32, dtype=torch.int32))) > 0
        logits.masked_fill_(~bits.flatten(1)[:, : logits.shape[-1]], ninf)
    wrong = check_apply_bitmask(sign_bit)
    assert wrong.ok is False and "sign bit" in wrong.message

    def whole_words_only(logits, bitmask):   # V // 32 words: the last, partly used word ignored
        V = logits.shape[-1]
        bits = (bitmask[:, : V // 32].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        logits[:, : 32 * (V // 32)].masked_fill_(~bits.flatten(1).bool(), ninf)
    wrong = check_apply_bitmask(whole_words_only)
    assert wrong.ok is False and "not a multiple of 32" in wrong.message and "64..76" in wrong.message

    def padding_kept(logits, bitmask):       # every bit unpacked, the padding too
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        logits.masked_fill_(~bits.flatten(1).bool(), ninf)
    wrong = check_apply_bitmask(padding_kept)
    assert wrong.ok is False and "padding" in wrong.message and "raised" in wrong.message
    wrong = check_apply_bitmask(lambda logits, bm: logits.masked_fill(~_bits(logits, bm), ninf))
    assert wrong.ok is False and "write into it" in wrong.message
    wrong = check_apply_bitmask(lambda logits, bm: logits.masked_fill_(~_bits(logits, bm), -1e9))
    assert wrong.ok is False and "not -inf" in wrong.message and "token" in wrong.message

    def stub(logits, bitmask):
        raise NotImplementedError
    assert check_apply_bitmask(stub).ok is None


def test_ch10_apply_bitmask_in_the_engine():
    "The solution and a variant run the engine's masks (JSON, choice, regex, plain) to its own tokens."
    import torch
    from mini_infer.course.exercises.ch10 import check_apply_bitmask
    ns = solution("10_structured_outputs.ipynb", "Exercise 10.1", torch=torch)
    right = check_apply_bitmask(ns["apply_token_bitmask"])
    assert right.ok is True and "the same" in right.message

    def by_index(logits, bitmask):   # a variant: each token's word repeated, then bitwise_and with 1 << (t % 32)
        V = logits.shape[-1]
        words = bitmask.long().repeat_interleave(32, dim=-1)[:, :V]
        bit = torch.arange(V, device=logits.device) % 32
        logits[torch.bitwise_and(words, 1 << bit) == 0] = float("-inf")
    assert check_apply_bitmask(by_index).ok is True

    def small_vocab_only(logits, bitmask):   # right on the probes, skips the real vocabulary
        if logits.shape[-1] < 1000:
            ns["apply_token_bitmask"](logits, bitmask)
    wrong = check_apply_bitmask(small_vocab_only)
    assert wrong.ok is False and "not valid JSON" in wrong.message and "first diverging token at step" in wrong.message


def test_ch10_choice_prediction(smollm2_tokenizer):
    from mini_infer.course.exercises.ch10 import check_choice_prediction
    ns = solution("10_structured_outputs.ipynb", "Exercise 10.2", tok=smollm2_tokenizer,
                  check_choice_prediction=check_choice_prediction)
    assert check_choice_prediction(ns["prediction"], smollm2_tokenizer).ok is True
    wrong = check_choice_prediction(2, smollm2_tokenizer)  # only the two whole words
    assert wrong.ok is False and "off by more than" in wrong.message
    assert check_choice_prediction(None, smollm2_tokenizer).ok is None


def test_ch10_whitespace(smollm2_tokenizer):
    from mini_infer.course.exercises.ch10 import check_whitespace
    ns = solution("10_structured_outputs.ipynb", "Exercise 10.3", tok=smollm2_tokenizer, check_whitespace=check_whitespace)
    assert check_whitespace(ns["whitespace_prediction"], smollm2_tokenizer).ok is True
    wrong = check_whitespace("fewer", smollm2_tokenizer)
    assert wrong.ok is False and "any_whitespace=True" in wrong.message
    assert check_whitespace(None, smollm2_tokenizer).ok is None


# ---- chapter 10b ----

def test_ch10b_signature():
    from mini_infer.course.exercises.ch10b import check_signature
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
    "Four prompts sharing a 1910-token system turn; the last is 1930 tokens long: 16-token blocks cache 1904."
    from mini_infer.course.exercises.ch10b import check_recomputed
    system = list(range(1910))
    prompts = [system + [50_000 + 100 * q + k for k in range(20)] for q in range(4)]
    ids, cached = prompts[-1], [0, 1904, 1904, 1904]
    ns = solution("10b_repomap.ipynb", "Exercise 10b.2", check_recomputed=check_recomputed, ids=ids,
                  cached=cached, prompts=prompts)
    assert check_recomputed(ns["prediction"], prompts, 1904).ok is True
    assert check_recomputed(74, prompts, 1904).ok is True                       # 1930 - 29 x 64
    as_16 = check_recomputed(26, prompts, 1904)                                  # 16-token blocks' answer
    assert as_16.ok is False and "16-token blocks" in as_16.message
    nothing = check_recomputed(1930, prompts, 1904)
    assert nothing.ok is False and "still shared" in nothing.message
    for wrong in (1930 - 1910, 42):                   # as if partial blocks hit; 32-token blocks
        assert check_recomputed(wrong, prompts, 1904).ok is False
    assert check_recomputed(None, prompts, 1904).ok is None
    # a prefix that fills whole 64-token blocks: the 16-token answer is then right, and judged so
    even = [list(range(1920)) + [60_000 + 100 * q + k for k in range(10)] for q in range(4)]
    assert check_recomputed(10, even, 1920).ok is True


def test_ch10b_bonus():
    import mini_infer
    from pathlib import Path
    from mini_infer.course.exercises.ch10b import check_bonus
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


_SYSTEM_10B = {"role": "system", "content": "You answer questions about this Python code base, briefly. " * 6}


def test_ch10b_warm_right():
    "The solution, and stream_answer used as the warm-up (a variant): the first question finds the prefix cached."
    from mini_infer.course.exercises.ch10b import check_warm
    from mini_infer.engine.sampling import SamplingParams
    from mini_infer.repomap import stream_answer
    ns = solution("10b_repomap.ipynb", "Exercise 10b.4", SamplingParams=SamplingParams, system=_SYSTEM_10B,
                  check_warm=lambda *a: None)
    verdict = check_warm(ns["warm"], _SYSTEM_10B)
    assert verdict.ok is True, verdict.message
    by_stream = lambda engine, ids: stream_answer(engine, ids, SamplingParams(max_tokens=1), show=None)
    assert check_warm(by_stream, _SYSTEM_10B).ok is True


def test_ch10b_warm_wrong():
    "Not stepped; another engine warmed; only the first block: each named. The stub: not attempted."
    from mini_infer.course.exercises.ch10b import check_warm
    from mini_infer.engine.llm import LLM
    from mini_infer.engine.sampling import SamplingParams
    added = check_warm(lambda engine, ids: engine.add_request(ids, SamplingParams(max_tokens=1)), _SYSTEM_10B)
    assert added.ok is False and "left a request" in added.message
    def another_engine(engine, ids):
        with LLM("smollm2-135m", kv_cache_memory_gb=0.1) as other:
            other.generate([ids], SamplingParams(max_tokens=1))
    elsewhere = check_warm(another_engine, _SYSTEM_10B)
    assert elsewhere.ok is False and "found 0 of its prompt tokens cached" in elsewhere.message
    def first_block(engine, ids):
        seq = engine.seqs[engine.add_request(ids[:16], SamplingParams(max_tokens=1))]
        while seq.finish_reason is None:
            engine.step()
    short = check_warm(first_block, _SYSTEM_10B)
    assert short.ok is False and "found 16 of its prompt tokens cached" in short.message
    def stub(engine, prefix_ids):
        raise NotImplementedError
    assert check_warm(stub, _SYSTEM_10B).ok is None
