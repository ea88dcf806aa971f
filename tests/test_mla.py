"""Chapter 2b's latent attention against transformers' DeepSeek-V2/V3 (random weights): logits and every
layer's output, naive and absorbed; the engine's greedy tokens against `generate` on a batch, with prefix
caching, preemption and chunked prefill; the pool sized by the latent; the options it refuses, by name."""
import shutil
import pytest
import torch
transformers = pytest.importorskip("transformers")
from mini_infer import LLM, SamplingParams
from mini_infer.engine.engine import LLMEngine
from mini_infer.model.layers import Shard
from mini_infer.model.loader import (
    CheckpointError, bundled_gguf_path, gguf_cache_dir, load_model, load_safetensors,
)
from mini_infer.model.model import ContiguousStep
from mini_infer.plugins.mla import (
    ContiguousLatentCache, LatentKVCache, MLAConfig, absorbed_attention, naive_attention, set_attention,
)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            first_k_dense_replace=3, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def tiny_hf(version: int, q_lora_rank=48, scale: float = 4.0, **over):
    "A random DeepSeek-V2 or V3 with dense MLPs, weights scaled up for decisive argmaxes."
    cfg_cls, model_cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if version == 3
                          else (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    extra = {"num_mtp_layers": 0} if version == 3 else {}
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**(TINY | extra | {"q_lora_rank": q_lora_rank} | over))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(scale)
    return hf


def our_forward(model, ids, split: int):
    "Logits of every token and each layer's output, the prompt fed in two chunks through the contiguous cache."
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append(o.clone())) for layer in model.model.layers]
    cache = ContiguousLatentCache(model.config, 64)
    logits = torch.cat([model(ContiguousStep.tokens(ids[:split], 0, False), cache),
                        model(ContiguousStep.tokens(ids[split:], split, False), cache)])
    for h in hooks:
        h.remove()
    L = len(model.model.layers)
    return logits, [torch.cat([outs[i], outs[i + L]]) for i in range(L)]


@pytest.mark.parametrize("version,q_lora_rank,interleave", [(3, 48, True), (3, None, True), (3, 48, False),
                                                            (2, 48, True), (2, None, True)])
@pytest.mark.parametrize("attend", [naive_attention, absorbed_attention], ids=["naive", "absorbed"])
def test_logits_and_layers_match_transformers(tmp_path, version, q_lora_rank, interleave, attend):
    over = {} if version == 2 else {"rope_interleave": interleave}
    hf = tiny_hf(version, q_lora_rank, **over)
    hf.save_pretrained(tmp_path)
    model = load_safetensors(tmp_path, "cpu", torch.float32)
    assert isinstance(model.config, MLAConfig) and model.config.rope_interleave == interleave
    set_attention(model, attend)
    ids = torch.randint(0, 256, (27,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    logits, layers = our_forward(model, ids, 11)
    scale = ref.logits.abs().max().item()
    assert scale > 1                                    # not a model whose outputs are all near zero
    assert (logits - ref.logits[0]).abs().max().item() <= 1e-5 * scale
    for i, h in enumerate(layers[:-1]):                 # transformers' last hidden state is after the norm
        want = ref.hidden_states[i + 1][0]
        assert (h - want).abs().max().item() <= 1e-5 * want.abs().max().item(), f"layer {i}"


def test_the_forms_agree_on_random_inputs():
    "The absorbed form is the naive one, rearranged: decode rows of different lengths and a causal prompt chunk."
    g = torch.Generator().manual_seed(0)
    H, n, R, r, v = 4, 16, 8, 32, 12
    w_uk, w_uv = torch.randn(H, n, r, generator=g), torch.randn(H, v, r, generator=g)
    for groups, t, L in ((5, 1, 20), (1, 9, 9), (1, 6, 14)):
        q_nope, q_pe = torch.randn(groups, t, H, n, generator=g), torch.randn(groups, t, H, R, generator=g)
        lat = torch.randn(groups, L, r + R, generator=g)
        mask = torch.arange(L)[None, None] <= (L - t + torch.arange(t))[None, :, None]
        mask = mask.expand(groups, t, L).clone()
        if t == 1:
            mask[0, 0, L // 2:] = False                 # a shorter row in the group
        args = (q_nope, q_pe, lat, mask, w_uk, w_uv, (n + R) ** -0.5)
        want, got = naive_attention(*args), absorbed_attention(*args)
        assert got.shape == (groups, t, H, v)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    "A tiny DeepSeek-V3 folder with the bundled model's tokenizer (its vocabulary), and transformers' model."
    load_model("smollm2-135m")                          # converts the GGUF once, tokenizer files included
    out = tmp_path_factory.mktemp("dsv3")
    hf = tiny_hf(3, vocab_size=49152)
    hf.save_pretrained(out)
    for f in gguf_cache_dir(bundled_gguf_path()).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out, hf


PROMPTS = ([[(7 * i + 3 * j) % 49000 + 5 for j in range(n)] for i, n in enumerate((5, 17, 30, 9, 23, 12, 40, 3))]
           + [[(11 * j) % 49000 + 7 for j in range(21)] + [100 + i] * (i + 1) for i in range(6)])


def hf_greedy(hf, prompts, n: int) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]


@pytest.mark.parametrize("engine_kwargs", [dict(), dict(num_blocks=24, max_prefill_chunk=8)],
                         ids=["roomy", "preempting-chunked"])
def test_engine_greedy_equals_transformers(checkpoint, engine_kwargs):
    folder, hf = checkpoint
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(folder), device="cpu", dtype=torch.float32, block_size=4, **engine_kwargs) as llm:
        assert isinstance(llm.engine.cache, LatentKVCache) and llm.engine.config.backend == "torch"
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == hf_greedy(hf, PROMPTS, 10)
        assert sum(o.num_cached_tokens for o in outs) >= 5 * 20     # the shared prefix came from the cache
        set_attention(llm.engine.model, naive_attention)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in outs]


def test_the_pool_is_sized_by_the_latent(checkpoint):
    folder, _ = checkpoint
    with LLM(str(folder), device="cpu", dtype=torch.float32, block_size=16, kv_cache_memory_gb=0.01) as llm:
        cfg, plan = llm.engine.model.config, llm.engine.memory
        per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
        assert plan.block_bytes == 16 * per_token
        assert llm.engine.cache.kv.nbytes == plan.num_blocks * plan.block_bytes
        gqa = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) * 4
        assert per_token <= gqa / 4
        assert plan.num_blocks == int(0.01 * 1024**3 // plan.block_bytes)


def test_mixture_of_experts_is_refused_by_name(tmp_path):
    hf = tiny_hf(3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        load_safetensors(tmp_path, "cpu", torch.float32)


def test_an_unknown_architecture_names_the_known(tmp_path):
    hf = tiny_hf(3)
    hf.save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace("DeepseekV3ForCausalLM", "MysteryForCausalLM")
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="unknown architecture 'MysteryForCausalLM'.*DeepseekV3ForCausalLM"):
        load_safetensors(tmp_path, "cpu", torch.float32)


@pytest.mark.parametrize("option,value", [("backend", "cpu"), ("quantization", "int8"), ("kv_cache_dtype", "int8"),
                                          ("tensor_parallel_size", 2)])
def test_engine_options_it_cannot_run_are_refused_by_name(checkpoint, option, value):
    "Chapter 7's C kernels, chapter 8's int8 and chapter 9's tensor parallelism are written for chapter 1's attention."
    folder, _ = checkpoint
    model, tok = load_model(str(folder), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=f"{option}=.*latent attention"):
        LLMEngine(model, tok, block_size=4, num_blocks=16, **{option: value})


def test_auto_falls_back_to_torch_and_ranks_are_refused(checkpoint):
    folder, _ = checkpoint
    model, tok = load_model(str(folder), device="cpu", dtype=torch.float32)
    assert LLMEngine(model, tok, block_size=4, num_blocks=16, backend="auto").config.backend == "torch"
    with pytest.raises((ValueError, CheckpointError), match="tensor_parallel_size=1"):
        load_model(str(folder), device="cpu", dtype=torch.float32, shard=Shard(0, 2))
