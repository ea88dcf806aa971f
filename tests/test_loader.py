"Weight loading: safetensors checkpoints saved by transformers, the bundled GGUF against transformers' GGUF loading, bad input."
import json, os, time
import pytest
import torch
from mini_infer.model.model import ContiguousKVCache, ContiguousStep
from mini_infer.model.loader import (load_model, load_safetensors, resolve_model, bundled_gguf_path, gguf_cache_dir,
                               CheckpointError, ModelNotFoundError, DEFAULT_MODEL, _hub_snapshot)
from mini_infer.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    "A fresh conversion cache for this module, so the first-load path is exercised."
    old = os.environ.get("MINI_INFER_CACHE")
    d = tmp_path_factory.mktemp("mini_infer_cache")
    os.environ["MINI_INFER_CACHE"] = str(d)
    yield d
    if old is None: os.environ.pop("MINI_INFER_CACHE", None)
    else: os.environ["MINI_INFER_CACHE"] = old


def our_logits(model, ids):
    ids = torch.as_tensor(ids)
    return model(ContiguousStep.tokens(ids, 0, last_only=False), ContiguousKVCache(model.config, len(ids), dtype=model.dtype))


def tiny_hf(arch, heads, kv, tied, seed=0):
    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM), "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[arch]
    cfg = cls[0](vocab_size=101, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
                 num_key_value_heads=kv, max_position_embeddings=64, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                 rope_theta=10000.0)
    torch.manual_seed(seed)
    m = cls[1](cfg).eval()
    with torch.no_grad():  # weights big enough that a mistake shows in the logits
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.15 * torch.randn_like(p))
    return m


CASES = [("qwen2", 4, 2, True), ("qwen2", 4, 1, False), ("qwen2", 2, 2, True),
         ("llama", 4, 4, False), ("llama", 6, 2, True), ("llama", 8, 2, False)]


@pytest.mark.parametrize("arch,heads,kv,tied", CASES)
def test_safetensors_matches_transformers(tmp_path, arch, heads, kv, tied):
    hf = tiny_hf(arch, heads, kv, tied)
    hf.save_pretrained(tmp_path)
    model = load_safetensors(tmp_path, "cpu", torch.float32)
    assert model.config.attention_bias == (arch == "qwen2")
    assert (model.model.embed_tokens is None) == tied   # tied: the LM head's weight is the embedding's too
    ids = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): ref = hf(ids[None]).logits[0]
    assert (our_logits(model, ids) - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint(tmp_path):
    hf = tiny_hf("qwen2", 4, 2, False)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    model = load_safetensors(tmp_path, "cpu", torch.float32)
    ids = torch.arange(17) * 5
    with torch.no_grad(): ref = hf(ids[None]).logits[0]
    assert (our_logits(model, ids) - ref).abs().max().item() <= 1e-4


def test_load_model_from_folder_with_dtype(tmp_path):
    hf = tiny_hf("llama", 4, 2, True)
    hf.save_pretrained(tmp_path)
    Tokenizer.from_gguf(bundled_gguf_path()).save(tmp_path)  # any tokenizer will do for this folder
    model, tok = load_model(str(tmp_path), device="cpu", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and tok.eos_token_ids
    ids = torch.arange(11)
    with torch.no_grad(): ref = hf(ids[None]).logits[0]
    assert (our_logits(model, ids) - ref).abs().max().item() < 0.1 * ref.abs().max().item()


# ---- the bundled GGUF against transformers' own GGUF loading ----

PROMPTS = ["The capital of France is", "def fibonacci(n):", None]  # None: a chat prompt
CHAT = [{"role": "user", "content": "Give me three tips for staying healthy."}]


@pytest.fixture(scope="module")
def gguf_pair():
    # Decoding one token is a chain of small mat-vecs: one thread is as fast, and immune to a busy machine's oversubscription.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    p = bundled_gguf_path()
    t0 = time.perf_counter()
    ours, tok = load_model("smollm2-135m", device="cpu")
    first = time.perf_counter() - t0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    yield ours, tok, hf, first
    torch.set_num_threads(threads)


def greedy(model, ids, n):
    cache = ContiguousKVCache(model.config, len(ids) + n)
    logits = model(ContiguousStep.tokens(torch.tensor(ids), 0), cache)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        pos = len(ids) + len(out) - 1
        logits = model(ContiguousStep.tokens(torch.tensor(out[-1:]), pos), cache)
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_gguf_greedy_matches_transformers(gguf_pair, prompt):
    ours, tok, hf, _ = gguf_pair
    ids = tok.encode_chat(CHAT) if prompt is None else tok.encode(prompt)
    mine = greedy(ours, ids, 32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32,
                          do_sample=False, min_new_tokens=32, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert mine == ref, (tok.decode(mine), tok.decode(ref))


def test_gguf_logits_close_and_cache(gguf_pair):
    ours, tok, hf, first = gguf_pair
    ids = tok.encode("Once upon a time, in a land far away")
    with torch.no_grad(): ref = hf(torch.tensor([ids])).logits[0]
    assert (our_logits(ours, ids) - ref).abs().max().item() < 1e-3
    assert (gguf_cache_dir(bundled_gguf_path()) / "model.safetensors").exists()
    t0 = time.perf_counter()
    again, _ = load_model("smollm2-135m", device="cpu")
    cached = time.perf_counter() - t0
    print(f"GGUF load: first {first:.1f}s, cached {cached:.1f}s")
    assert cached < first
    # bit for bit: both loads copy the same cached file's numbers, computing nothing
    assert torch.equal(again.model.layers[3].self_attn.qkv_proj.weight, ours.model.layers[3].self_attn.qkv_proj.weight)


# ---- bad input ----

def test_unknown_name_fails_fast():
    t0 = time.perf_counter()
    for name in ("no-such-model", "/no/such/dir", "some-org/not-a-model-xyz"):
        with pytest.raises(ModelNotFoundError, match="tried") as e:
            resolve_model(name)
        assert isinstance(e.value, FileNotFoundError)
    assert time.perf_counter() - t0 < 10


def test_default_falls_back_to_bundled(monkeypatch, capsys):
    if _hub_snapshot(DEFAULT_MODEL, local_only=True)[0] is not None: pytest.skip(f"{DEFAULT_MODEL} is in the local HF cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    assert resolve_model(None) == bundled_gguf_path()
    assert time.perf_counter() - t0 < 3
    assert "bundled" in capsys.readouterr().out


def test_truncated_and_corrupt_safetensors(tmp_path):
    tiny_hf("qwen2", 4, 2, True).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"): load_safetensors(tmp_path, "cpu")
    f.write_bytes(b"\x00garbage" * 50)
    with pytest.raises(CheckpointError, match="not a valid safetensors"): load_safetensors(tmp_path, "cpu")


def test_missing_tensor_and_bad_arch(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny_hf("llama", 4, 2, False).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="up_proj"): load_safetensors(tmp_path, "cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"): load_safetensors(tmp_path, "cpu")


def test_truncated_and_corrupt_gguf(tmp_path, cache_dir):
    data = bundled_gguf_path().read_bytes()
    for name, blob in [("truncated.gguf", data[:-64]), ("junk.gguf", b"GGUF" + b"\x07" * 4000)]:
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(CheckpointError, match=name):
            load_model(str(tmp_path / name), device="cpu")
        assert not gguf_cache_dir(tmp_path / name).exists()
    assert not [p for p in cache_dir.iterdir() if ".tmp" in p.name]  # no half-written cache entries


def test_converted_model_cache_follows_the_converter_code(monkeypatch):
    "A converter that would write the folder differently never reuses a folder an older one wrote."
    import mini_infer.model.loader as loader
    before = gguf_cache_dir(bundled_gguf_path())
    assert gguf_cache_dir(bundled_gguf_path()) == before                       # stable while nothing changes
    monkeypatch.setattr(loader, "unpermute", lambda w, n_heads: w[::-1])       # a changed converter step...
    assert gguf_cache_dir(bundled_gguf_path()) != before                       # ...gets a folder of its own
