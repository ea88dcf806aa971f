"Helpers shared by the test files."
import shutil
import pytest
import torch


def save_tiny_qwen(out, **config) -> str:
    """A random Qwen2 (`config` overrides the Qwen2Config fields) with the bundled model's tokenizer, saved as a
    Hugging Face folder in `out`; returns its path."""
    transformers = pytest.importorskip("transformers")
    from mini_infer.model.loader import bundled_gguf_path, gguf_cache_dir, load_model
    load_model("smollm2-135m")                      # converts the GGUF once, tokenizer files included
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=49152, num_hidden_layers=2, **config)).save_pretrained(out)
    for f in gguf_cache_dir(bundled_gguf_path()).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return str(out)
