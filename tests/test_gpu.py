"""The CUDA paths, on a machine with a GPU (skipped elsewhere): fused SDPA kernels in float16 with grouped heads, the
default dtype for the GPU's compute capability, and the engine's greedy tokens against chapter 1's loop on the GPU."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@pytest.mark.parametrize("T,S,q_start", [(1, 300, 299), (64, 64, 0), (40, 200, 160)])
def test_attention_stays_on_fused_kernels_in_float16(T, S, q_start):
    "With only the flash and memory-efficient backends allowed, SDPA would raise if our calls needed the math path."
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from mini_infer.model.model import causal_attention
    q, k, v = torch.randn(T, 14, 64, device="cuda", dtype=torch.float16), *torch.randn(2, S, 2, 64, device="cuda", dtype=torch.float16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]): fused = causal_attention(q, k, v, q_start)
    with sdpa_kernel([SDPBackend.MATH]): math = causal_attention(q.float(), k.float(), v.float(), q_start)
    torch.testing.assert_close(fused.float(), math, atol=2e-3, rtol=2e-3)


def test_default_dtype_follows_compute_capability():
    from mini_infer.model.loader import default_dtype
    want = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    assert default_dtype("cuda") == want


def test_engine_on_cuda_matches_chapter_1_up_to_near_ties():
    from mini_infer.model.model import CausalLM, ModelConfig
    from mini_infer.engine.engine import LLMEngine
    from mini_infer.engine.llm import run_to_completion
    from mini_infer.engine.reference import generate
    from mini_infer.engine.sampling import SamplingParams
    from mini_infer.bench.offline import assert_greedy_close
    cfg = ModelConfig(vocab_size=151, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, architecture="Qwen2ForCausalLM", attention_bias=True, max_position_embeddings=512)
    torch.manual_seed(0)
    model = CausalLM(cfg).to("cuda", torch.float16).eval()
    class NoText:
        eos_token_ids = []
        def decode(self, ids, skip_special_tokens=True): return ""
    prompts = [torch.randint(0, 151, (n,)).tolist() for n in (3, 17, 40, 90)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)] * 4
    eng = LLMEngine(model, NoText(), num_blocks=64, block_size=16, max_num_batched_tokens=64)
    assert type(eng.backend).__name__ == "TorchBackend"
    assert_greedy_close(generate(model, NoText(), prompts, params), run_to_completion(eng, prompts, params))


def test_speculative_engine_on_cuda_matches_plain_up_to_near_ties():
    "n-gram and draft-model guesses on the GPU (float16): greedy tokens those of plain decoding, near-ties aside; the draft's blocks freed."
    from mini_infer.model.model import CausalLM, ModelConfig
    from mini_infer.engine.engine import LLMEngine
    from mini_infer.engine.llm import run_to_completion
    from mini_infer.engine.sampling import SamplingParams
    from mini_infer.bench.offline import assert_greedy_close
    cfg = ModelConfig(vocab_size=151, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, architecture="Qwen2ForCausalLM", attention_bias=True, max_position_embeddings=512)
    torch.manual_seed(0)
    model = CausalLM(cfg).to("cuda", torch.float16).eval()
    draft = CausalLM(ModelConfig(**{**cfg.__dict__, "num_hidden_layers": 1})).to("cuda", torch.float16).eval()
    class NoText:
        eos_token_ids = []
        def decode(self, ids, skip_special_tokens=True): return ""
    prompts = [(torch.arange(n) % 7).tolist() for n in (5, 17, 40)] + [torch.randint(0, 151, (30,)).tolist()]   # repeats invite n-gram hits
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)] * 4
    plain = run_to_completion(LLMEngine(model, NoText(), num_blocks=64, block_size=16), prompts, params)
    for spec in (dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, adaptive=False),
                 dict(method="draft_model", model=draft, num_speculative_tokens=3, adaptive=False)):
        eng = LLMEngine(model, NoText(), num_blocks=64, block_size=16, speculative_config=spec)
        assert_greedy_close(plain, run_to_completion(eng, prompts, params))
        assert eng.stats()["spec_decode_num_draft_tokens_total"] > 0 and eng.kv.allocator.num_free == eng.kv.allocator.num_blocks
