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
    from mini_infer.plugins.speculative import expected_tokens
    ns = solution("05_speculative.ipynb", "Exercise 5.2", expected_tokens=expected_tokens, costs=COSTS)
    assert check_best_k(ns["answer"], COSTS).ok is True


def test_05_best_k_wrong():
    from mini_infer.course.exercises.ch05 import check_best_k
    wrong = check_best_k((8, 1.0), COSTS)        # "more guesses, more speed"
    assert wrong.ok is False and "c(k)" in wrong.message
    assert check_best_k(None, COSTS).ok is None


def test_05_acceptance_rate_solution():
    from mini_infer.course.exercises.ch05 import check_acceptance_rate
    ns = solution("05_speculative.ipynb", "Exercise 5.3")
    assert check_acceptance_rate(ns["acceptance_rate"]).ok is True


def test_05_acceptance_rate_wrong():
    import torch
    from mini_infer.course.exercises.ch05 import check_acceptance_rate
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
    mean_s = (s.mean() / 12 ** 0.5).item() * 0.8             # a plainly low guess
    assert check_rounding_rms(mean_s, W).ok is False
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


def test_ch07_kv_read():
    from mini_infer.course.exercises.ch07b import check_kv_read
    args = dict(rows=32, context=1000, kv_heads=3, head_dim=64, bytes_per_value=2)
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.4")
    assert check_kv_read(ns["prediction"], **args).ok is True
    float32 = check_kv_read(2 * 32 * 1000 * 3 * 64 * 4 / 1e6, **args)
    assert float32.ok is False and "factor of 2" in float32.message
    assert check_kv_read(5.0, **args).ok is False
    assert check_kv_read(None, **args).ok is None


def test_ch07_online_softmax():
    import torch
    from mini_infer.course.exercises.ch07b import check_online_softmax
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
    from mini_infer.course.exercises.ch07b import check_plan
    lens = [1, 1, 1, 5, 9, 10, 40]
    ns = solution("07b_cpu_attention.ipynb", "Exercise 7.6")
    assert check_plan(ns["prediction"], lens).ok is True
    rows_not_tokens = check_plan((5, 2), lens)
    assert rows_not_tokens.ok is False and "SHORT_ROW" in rows_not_tokens.message
    assert check_plan((3, 4), lens).ok is False
    assert check_plan(None, lens).ok is None


def test_ch07_rms_norm():
    import torch
    from mini_infer.course.exercises.ch07c import check_rms_norm
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
    from mini_infer.course.exercises.ch07c import check_replayed
    steps = [[1] * 16, [1] * 17, [4, 4, 4, 4], [10], [1, 1, 9, 5], [3] * 6, [5] * 13, [1] * 70]
    ns = solution("07c_step_replay.ipynb", "Exercise 7.8")
    assert check_replayed(ns["prediction"], steps).ok is True
    rows_only = check_replayed([True, True, True, True, True, True, False, False], steps)   # forgot a limit
    assert rows_only.ok is False and "no row of more than 9" in rows_only.message
    assert check_replayed([True] * 3, steps).ok is False
    assert check_replayed(None, steps).ok is None


def test_ch07_recorded_calls():
    from mini_infer.course.exercises.ch07c import check_recorded_calls
    ns = solution("07c_step_replay.ipynb", "Exercise 7.9")
    assert check_recorded_calls(ns["prediction"], n_layers=30).ok is True
    per_token = check_recorded_calls((360, 16 * 360), n_layers=30)
    assert per_token.ok is False and "does not grow" in per_token.message
    products_only = check_recorded_calls((7 * 30, 7 * 30), n_layers=30)
    assert products_only.ok is False and "count every C call" in products_only.message
    assert check_recorded_calls(None, n_layers=30).ok is None

# ---- chapter 02 ----

def test_02_slot():
    from mini_infer.course.exercises.ch02 import check_slot
    assert check_slot(solution("02_paged_cache.ipynb", "Exercise 2.1")["slot"]).ok is True
    wrong = check_slot(lambda blocks, p, S: blocks[p // S] + p % S)
    assert wrong.ok is False and "b * S" in wrong.message
    assert check_slot(lambda blocks, p, S: blocks[p % S] * S + p // S).ok is False

    def stub(blocks, p, S):
        raise NotImplementedError
    assert check_slot(stub).ok is None


def test_02_kv_bytes():
    import torch
    from mini_infer.model.model import ModelConfig
    from mini_infer.course.exercises.ch02 import check_kv_bytes
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
    from mini_infer.course.exercises.ch02 import check_utilisation
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
    from mini_infer.course.exercises.ch03 import check_shortest_prompt_first
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
    assert check_hit_rate(solution("04_prefix_cache.ipynb", "Exercise 4.2")["prediction"]).ok is True
    naive = check_hit_rate(100 / 120)   # the whole prefix, as if partial blocks were shared
    assert naive.ok is False and "full blocks" in naive.message
    assert check_hit_rate(80).ok is False
    assert check_hit_rate(None).ok is None


def test_04_unsalted_hits():
    from mini_infer.course.exercises.ch04 import check_unsalted_hits, cached_tokens
    assert check_unsalted_hits(solution("04_prefix_cache.ipynb", "Exercise 4.3")["prediction"]).ok is True
    whole = check_unsalted_hits(260)   # B's own last tokens counted too
    assert whole.ok is False and "last tokens" in whole.message
    assert check_unsalted_hits(0).ok is False   # as if the cache were salted
    assert check_unsalted_hits(None).ok is None
    secret = list(range(1000, 1256))
    assert cached_tokens([secret + [7] * 4, secret + [9] * 4], salts=["a", "b"])[1] == 0   # a salt per tenant closes it

# ---- chapter 01 ----

def smol_cfg():
    from mini_infer.model.model import ModelConfig
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5, tie_word_embeddings=True)


def test_01_relative_score():
    import torch
    from mini_infer.course.exercises.ch01 import check_relative_score
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
    from mini_infer.model.model import ModelConfig
    from mini_infer.course.exercises.ch01 import check_kv_ratio
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
    from mini_infer.course.exercises.ch01 import check_param_count
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
    from mini_infer.model.loader import bundled_gguf_path
    from mini_infer.model.tokenizer import Tokenizer
    reader = gguf.GGUFReader(str(bundled_gguf_path()))
    return reader, Tokenizer.from_gguf(reader)


def test_01b_chatml(smol_gguf):
    from mini_infer.course.exercises.ch01b import check_chatml
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
    from mini_infer.course.exercises.ch01b import check_gguf_bytes
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
    from mini_infer.course.exercises.ch01b import check_q8_0
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
    from mini_infer.course.exercises.ch01c import check_top_p
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
    from mini_infer.course.exercises.ch01c import check_entropy_limit
    demo = -torch.log(torch.arange(1, 51.0))
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.8", check_entropy_limit=check_entropy_limit, demo=demo)
    assert check_entropy_limit(ns["prediction"], demo).ok is True
    wrong = check_entropy_limit(0.0, demo)
    assert wrong.ok is False and "greedy" in wrong.message
    wrong = check_entropy_limit(math.log2(50), demo)
    assert wrong.ok is False and "bits" in wrong.message
    assert check_entropy_limit(None, demo).ok is None


def test_01c_recompute_tokens():
    from mini_infer.course.exercises.ch01c import check_recompute_tokens
    prompt = list(range(5))
    ns = solution("01c_sampling_and_generate.ipynb", "Exercise 1.9", check_recompute_tokens=check_recompute_tokens, prompt=prompt)
    assert ns["prediction"] == 12 * 5 + 66 and check_recompute_tokens(ns["prediction"], 5, 12).ok is True
    wrong = check_recompute_tokens(12 * 5, 5, 12)
    assert wrong.ok is False and "grows" in wrong.message
    wrong = check_recompute_tokens(5 + 12 - 1, 5, 12)
    assert wrong.ok is False and "cached" in wrong.message
    assert check_recompute_tokens(None, 5, 12).ok is None

# ---- chapter 06 ----

from mini_infer.course.exercises.ch06 import check_last_event, check_sse_events, check_kv_usage_metric, check_max_num_seqs


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

# ---- chapter 09 ----

def _smollm_cfg():
    from mini_infer.model.model import ModelConfig
    return ModelConfig(49152, 576, 1536, 30, 9, 3, tie_word_embeddings=True)


def _qwen7b_cfg():
    from mini_infer.model.model import ModelConfig
    return ModelConfig(152064, 3584, 18944, 28, 28, 4, attention_bias=True, architecture="Qwen2ForCausalLM")


def test_09_masked_lookup():
    import torch
    from mini_infer.course.exercises.ch09 import check_masked_lookup
    ns = solution("09_scaling_out.ipynb", "Exercise 9.1", torch=torch)
    assert check_masked_lookup(ns["lookup"]).ok is True
    wrong = check_masked_lookup(lambda ids, rows, start: rows[(ids - start).clamp(0, rows.shape[0] - 1)])  # no mask
    assert wrong.ok is False and "zeros" in wrong.message
    def stub(ids, rows, start):
        raise NotImplementedError
    assert check_masked_lookup(stub).ok is None


def test_09_all_reduce_count():
    from mini_infer.course.exercises.ch09 import check_all_reduce_count
    ns = solution("09_scaling_out.ipynb", "Exercise 9.2")
    assert check_all_reduce_count(ns["prediction"], _smollm_cfg()).ok is True
    wrong = check_all_reduce_count(60, _smollm_cfg())
    assert wrong.ok is False and "embedding" in wrong.message
    assert check_all_reduce_count(None, _smollm_cfg()).ok is None


def test_09_kv_ratio():
    from mini_infer.course.exercises.ch09 import check_kv_ratio
    ns = solution("09_scaling_out.ipynb", "Exercise 9.3")
    assert check_kv_ratio(ns["kv_ratio"], _qwen7b_cfg()).ok is True
    wrong = check_kv_ratio(0.5, _qwen7b_cfg())
    assert wrong.ok is False and "replicated" in wrong.message
    assert check_kv_ratio(None, _qwen7b_cfg()).ok is None

# ---- chapter 10 ----

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from mini_infer.model.loader import resolve_model
    from mini_infer.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf(str(resolve_model()))


def test_ch10_allowed_tokens():
    from mini_infer.course.exercises.ch10 import check_allowed
    ns = solution("10_structured_outputs.ipynb", "Exercise 10.1")
    assert check_allowed(ns["allowed"]).ok is True
    from mini_infer.course.grammars import walk
    # a plausible mistake: allowing a token if its FIRST character has an edge
    first_only = lambda dfa, acc, s, vocab: [t for t in vocab if (s in acc if t == "<eos>" else walk(dfa, s, t[0]) is not None)]
    wrong = check_allowed(first_only)
    assert wrong.ok is False and "ALL its characters" in wrong.message
    def stub(dfa, accept, state, vocab):
        raise NotImplementedError
    assert check_allowed(stub).ok is None


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
    from mini_infer.course.exercises.ch10b import check_recomputed
    ns = solution("10b_repomap.ipynb", "Exercise 10b.2", check_recomputed=check_recomputed, ids=[0] * 1030, cached=[0, 1008])
    assert ns["check_recomputed"](ns["prediction"], 1030, 1008).ok is True
    wrong = check_recomputed(1030, 1030, 1008)  # as if nothing were cached
    assert wrong.ok is False and "off by more than" in wrong.message
    assert check_recomputed(None, 1030, 1008).ok is None


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
