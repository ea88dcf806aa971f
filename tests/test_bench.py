"Offline benchmark: the functions run on a tiny workload and return sane structures (no timing assertions)."
import pytest, torch
from mini_infer.model.model import ModelConfig, CausalLM, ContiguousKVCache, ContiguousStep
from mini_infer.bench.offline import make_workload, to_transformers, workload_flops, weight_split, measure_machine, run_offline_bench, format_table


def test_make_workload_is_reproducible_and_in_range():
    p, n = make_workload(20, (5, 9), 3, vocab_size=500, seed=1)
    assert (p, n) == make_workload(20, [5, 9], (3, 3), vocab_size=500, seed=1)   # argparse gives lists
    assert len(p) == len(n) == 20 and all(5 <= len(x) <= 9 for x in p) and n == [3] * 20
    assert all(100 <= t < 500 for x in p for t in x)
    with pytest.raises(ValueError): make_workload(2, (9, 5))


def test_workload_flops_counts_weights_attention_and_head():
    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    body, head = weight_split(cfg)
    assert head == 800 and body == sum(p.numel() for p in CausalLM(cfg).parameters()) - 800
    # prompt 3, output 2: 4 tokens fed (contexts 1..4), 2 sampled
    assert workload_flops(cfg, [3], [2]) == 2 * body * 4 + 4 * 2 * 2 * 4 * (1 + 2 + 3 + 4) + 2 * head * 2


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_to_transformers_matches_our_logits(arch):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, architecture=arch, tie_word_embeddings=arch == "Qwen2ForCausalLM",
                      attention_bias=arch == "Qwen2ForCausalLM", max_position_embeddings=64)
    ours = CausalLM(cfg)
    for p in ours.parameters(): torch.nn.init.normal_(p, std=0.1)
    hf = to_transformers(ours)
    ids = torch.randint(0, 256, (10,))
    expect = ours(ContiguousStep.tokens(ids, 0, last_only=False), ContiguousKVCache(cfg, 10))
    with torch.no_grad(): got = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)


def test_measure_machine_is_positive():
    m = measure_machine("cpu", n=128, reps=1, read_mb=8)
    assert m["matmul_gflops"] > 0 and m["read_gb_s"] > 0 and m["device"]


def test_the_gemm_peak_is_the_faster_of_torch_and_the_engines_layer():
    from mini_infer.model.layers import ColumnLinear
    layer = ColumnLinear(64, [96, 96])
    torch.nn.init.normal_(layer.weight)
    m = measure_machine("cpu", n=128, reps=2, read_mb=8, linear=layer)
    assert set(m["gemm_gflops"]) == {"torch", "engine"} and m["matmul_gflops"] == max(m["gemm_gflops"].values()) > 0


def test_run_offline_bench_tiny():
    r = run_offline_bench("smollm2-135m", num_requests=3, input_len=(4, 12), output_len=(2, 5), batch_size=2, num_threads=1,
                          max_num_batched_tokens=16, max_prefill_chunk=8)
    assert list(r["systems"]) == ["ours", "ours_static", "hf_continuous", "hf_static"]
    for s in r["systems"].values():
        assert s["wall_s"] > 0 and s["output_tok_s"] > 0 and s["total_tok_s"] > s["output_tok_s"]
        assert s["output_tokens"] == r["systems"]["ours"]["output_tokens"]
    assert r["systems"]["ours_static"]["matches"] == 3
    assert all(r["systems"][k]["matches"] == 3 for k in ("hf_continuous", "hf_static"))   # a few tokens: no near-ties
    assert set(r["ratios"]) == {"ours_static", "hf_continuous", "hf_static"}
    assert r["limits"]["decode_ms"] > 0 and 0 < r["limits"]["fraction_of_ceiling"]
    assert r["limits"]["probe_reliable"] == (r["limits"]["fraction_of_ceiling"] <= 1)
    assert r["engine"]["max_num_batched_tokens"] == 16
    text = format_table(r)
    assert "transformers continuous batching" in text and "ms/token" in text


def test_run_offline_bench_without_peers():
    r = run_offline_bench("smollm2-135m", num_requests=2, input_len=6, output_len=3, peers=False, num_threads=1)
    assert list(r["systems"]) == ["ours", "ours_static"] and "transformers" not in format_table(r)
