"Helpers shared by the test files."
import ctypes, gc, shutil, sys
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_file():
    """After each test file, collect cycles (an engine, its runner and its threads' closures refer to each other,
    so a finished test's engine waits for the cyclic collector) and hand freed heap back to the OS (glibc keeps
    it otherwise). The course's checks cache their models and engines (`functools.cache`) for the tests of one
    file; they are dropped here too. Without this a worker's RSS only grows across files: 15 GB by the end of the
    suite on a 24 GB machine, and the kernel kills it."""
    yield
    for name, module in list(sys.modules.items()):
        if name.startswith("mini_infer.course"):
            for f in vars(module).values():
                if callable(getattr(f, "cache_clear", None)): f.cache_clear()
    gc.collect()
    if sys.platform.startswith("linux"):
        try: ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError: pass                        # not glibc (musl): nothing to trim


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
