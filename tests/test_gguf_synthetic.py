"""Tiny GGUF files written here (random weights in every supported tensor type, a qwen2, llama or qwen3 architecture, a
byte-level BPE tokenizer with the `qwen2` pre-tokenizer), loaded by our loader and by transformers' GGUF loading."""
import math
import numpy as np
import pytest
import torch
import gguf
from gguf import GGMLQuantizationType as T
from mini_infer.model.loader import load_model
from mini_infer.model.model import ContiguousKVCache, ContiguousStep
from mini_infer.model.tokenizer import _byte_alphabet

transformers = pytest.importorskip("transformers")

H, I, HEADS, KV, LAYERS = 256, 512, 4, 2, 2   # rows of 256 so K-quants fit
TEXTS = ["Hello world, the theory of 12345 things!", "  spaces\tand\nnew lines \n\n", "中文 and 👋🏽 émojis",
         "<|im_start|>user\nhi<|im_end|>\n", "don't stop 3.14159 it's"]
# byte-level spelling: ' ' is 'Ġ'; merges are learned pairs in priority order
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "o r", "Ġ s", "e s", "i n", "Ġ w", "o r", "l d", "Ġw or", "Ġwor ld", "H e", "He l",
          "Hel l", "Hell o", "Ġthe or", "Ġ 1", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "t h", "th in", "thin g", "thing s", "i t", "' s"]
TYPES = {"token_embd": T.Q8_0, "attn_q": [T.Q4_0, T.Q4_K], "attn_k": [T.Q4_1, T.Q6_K], "attn_v": [T.F16, T.Q8_0],
         "attn_output": [T.BF16, T.Q5_K], "ffn_gate": [T.Q4_K, T.Q4_0], "ffn_up": [T.Q6_K, T.F16],
         "ffn_down": [T.Q5_K, T.Q4_1], "output": T.Q6_K}
KQUANT_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of fp16 scales in each block


def vocab():
    toks = list(_byte_alphabet().values())
    for m in dict.fromkeys(MERGES):
        if (t := m.replace(" ", "")) not in toks: toks.append(t)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return toks + specials, [1] * len(toks) + [3] * len(specials)


def tensor(rng, shape, qtype):
    "Random weights in `qtype`, as (data, raw_shape) for GGUFWriter.add_tensor; K-quant blocks get random bytes with sane scales."
    x = rng.standard_normal(shape).astype(np.float32) * 0.3
    if qtype == T.F32: return x, None
    if qtype in KQUANT_SCALES:
        bsize, bbytes = gguf.GGML_QUANT_SIZES[qtype]
        b = rng.integers(0, 256, (shape[0], shape[1] // bsize, bbytes), dtype=np.uint8)
        for off in KQUANT_SCALES[qtype]:
            b[..., off:off + 2] = (rng.uniform(0.002, 0.01, b.shape[:2]).astype(np.float16)).view(np.uint8).reshape(*b.shape[:2], 2)
        return b.reshape(shape[0], -1), qtype
    return gguf.quants.quantize(x, qtype), qtype


def add_tokenizer(w):
    "The byte-level BPE vocabulary above, its merges, special tokens and a ChatML template, as GGUF metadata."
    toks, types = vocab()
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen2"); w.add_token_list(toks); w.add_token_types(types)
    w.add_token_merges(list(dict.fromkeys(MERGES))); w.add_bos_token_id(len(toks) - 3); w.add_eos_token_id(len(toks) - 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_gguf(path, arch, tied, seed=0):
    rng = np.random.default_rng(seed)
    toks, _ = vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS); w.add_context_length(128); w.add_embedding_length(H); w.add_feed_forward_length(I)
    w.add_head_count(HEADS); w.add_head_count_kv(KV); w.add_layer_norm_rms_eps(1e-6); w.add_rope_freq_base(10000.0)
    D = 128 if arch == "qwen3" else H // HEADS   # Qwen3's head_dim is given (heads x head_dim != hidden)
    w.add_rope_dimension_count(D); w.add_key_length(D); w.add_value_length(D)
    add_tokenizer(w)
    V = len(toks)
    def add(name, shape, qtype):
        data, raw = tensor(rng, shape, qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    add("token_embd.weight", (V, H), TYPES["token_embd"])
    for l in range(LAYERS):
        dims = {"attn_q": (HEADS * D, H), "attn_k": (KV * D, H), "attn_v": (KV * D, H), "attn_output": (H, HEADS * D),
                "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}
        for n, shape in dims.items(): add(f"blk.{l}.{n}.weight", shape, TYPES[n][l])
        if arch == "qwen2":
            for n in ("attn_q", "attn_k", "attn_v"): add(f"blk.{l}.{n}.bias", (dims[n][0],), T.F32)
        if arch == "qwen3":  # an RMSNorm gain over each head's query and key
            for n in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{l}.{n}.weight", (1 + 0.3 * rng.standard_normal(D)).astype(np.float32))
        for n in ("attn_norm", "ffn_norm"): w.add_tensor(f"blk.{l}.{n}.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    if not tied: add("output.weight", (V, H), TYPES["output"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True), ("qwen3", True)])
def test_synthetic_gguf_matches_transformers(tmp_path, arch, tied):
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tied)
    ours, tok = load_model(str(path), device="cpu")
    assert ours.config.attention_bias == (arch == "qwen2") and ours.config.tie_word_embeddings == tied
    assert ours.config.architecture == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    ids = tok.encode(" ".join(TEXTS))
    with torch.no_grad(): ref = hf(torch.tensor([ids])).logits[0]
    got = ours(ContiguousStep.tokens(torch.tensor(ids), 0, last_only=False), ContiguousKVCache(ours.config, len(ids)))
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_dequantize_matches_transformers_kernels(qtype):
    "gguf-py's numpy dequantization (what we use) against transformers' independent torch kernels."
    dq = pytest.importorskip("transformers.integrations.gguf.dequant")
    data, _ = tensor(np.random.default_rng(1), (8, 512), qtype)
    ref = dq.dequantize(torch.from_numpy(data.reshape(-1).copy()), int(qtype)).reshape(8, 512)
    np.testing.assert_allclose(gguf.quants.dequantize(data, qtype), ref.numpy(), rtol=1e-6, atol=1e-6)


def llama_cpp_rope_freqs(hparams: dict) -> np.ndarray:
    "What llama.cpp's convert_hf_to_gguf.py writes as `rope_freqs` for a `llama3` rope_scaling (its loop, as it is)."
    rs, base, dim = hparams["rope_scaling"], hparams["rope_theta"], hparams["head_dim"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low_freq_factor, high_freq_factor = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_context_len = rs["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    "llama.cpp's Q/K row order: each head's two rotated halves interleaved."
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("factor,low,high", [(32.0, 1.0, 4.0), (8.0, 1.0, 4.0), (16.0, 2.0, 8.0)])
def test_llama3_gguf_reads_back_its_rope_scaling(tmp_path, factor, low, high):
    """A Llama 3.2-shaped model (random weights, `llama3` RoPE scaling, tied embeddings) written as llama.cpp writes it
    (Q/K rows permuted, the scaling as `rope_freqs`): our loader reads the four numbers back and gives the safetensors
    model's logits over 300 positions, where the scaled slow frequencies matter."""
    rs = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
          "original_max_position_embeddings": 8192}
    toks, _ = vocab()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(toks), hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_scaling=dict(rs))).eval()   # a copy: transformers adds to it
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(tmp_path / "llama32.gguf"), "llama")
    w.add_block_count(LAYERS); w.add_context_length(131072); w.add_embedding_length(H); w.add_feed_forward_length(I)
    w.add_head_count(HEADS); w.add_head_count_kv(KV); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(64)
    add_tokenizer(w)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(dict(rope_scaling=rs, rope_theta=500000.0, head_dim=64)))
    names = {v: k for k, v in {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}.items()}
    for l in range(LAYERS):
        for hf_part, g in names.items():
            t = sd[f"model.layers.{l}.{hf_part}.weight"]
            if g in ("attn_q", "attn_k"): t = llama_cpp_permute(t, HEADS if g == "attn_q" else KV)
            w.add_tensor(f"blk.{l}.{g}.weight", t)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    ours, _ = load_model(str(tmp_path / "llama32.gguf"), device="cpu")
    assert ours.config.rope_scaling == rs
    ids = torch.randint(0, len(toks), (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): ref = hf(ids[None]).logits[0]
    got = ours(ContiguousStep.tokens(ids, 0, last_only=False), ContiguousKVCache(ours.config, len(ids)))
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_rope_freqs_that_are_not_llama3_scaling_are_refused():
    from mini_infer.model.loader import CheckpointError, llama3_scaling
    rs = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    good = llama_cpp_rope_freqs(dict(rope_scaling=rs, rope_theta=500000.0, head_dim=64)).astype(np.float64)
    assert llama3_scaling(good, 500000.0, 64) == rs
    bent = good.copy(); bent[16] *= 1.1   # one blended pair off the line
    with pytest.raises(CheckpointError, match="not Llama 3's frequency scaling"):
        llama3_scaling(bent, 500000.0, 64)
    with pytest.raises(CheckpointError, match="needs two"):
        llama3_scaling(np.where(good > 1, 32.0, 1.0), 500000.0, 64)
