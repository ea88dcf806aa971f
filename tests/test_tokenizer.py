"Tokenizer parity with transformers' own tokenizer for the bundled SmolLM2 GGUF, chat templates, streaming detokenization."
import jinja2
import pytest
from hypothesis import given, settings, strategies as st
from mini_infer.model.loader import bundled_gguf_path
from mini_infer.model.tokenizer import Tokenizer, IncrementalDetokenizer, compile_chat_template

CORPUS = [
    "Hello, world!",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159; }",
    "Numbers: 0 7 42 1234567890 3.14 -12,345.67 1e-9 2024-11-29",
    "Emoji 👋🏽👨‍👩‍👧‍👦 🤗🚀 and flags 🇫🇷",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "Ünïcödé àçcéñts, Ελληνικά, русский, العربية, עברית",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\r\n\r\nand    runs     of      spaces",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>special in the <|im_end|>middle<|im_start|>",
    "don't won't they're I'm you've we'll he'd IT'S",
    "https://example.com/path?query=1&b=2#frag user@mail.com",
    "",
    " ",
    "\n\n\n",
    "a" * 300,
    "🙂" * 20,
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "日本語で？"}],
]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_gguf(bundled_gguf_path())


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    p = bundled_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def _ids(x):
    return list(x["input_ids"] if hasattr(x, "keys") else x)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_parity(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False) == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single(ours):
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_end|>") == [2]
    assert ours.eos_token_ids == [2, 0]
    assert ours.vocab_size == 49152
    assert ours.encode("12345")[-5:] == [ours.tok.token_to_id(c) for c in "12345"]  # smollm splits digits


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_parity(ours, hf, chat, gen):
    text = ours.apply_chat_template(chat, add_generation_prompt=gen)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert ours.encode_chat(chat, add_generation_prompt=gen) == _ids(hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen))


def test_from_dir_roundtrip_and_hf_saved(ours, hf, tmp_path):
    ours.save(tmp_path / "ours")
    again = Tokenizer.from_dir(tmp_path / "ours")
    hf.save_pretrained(tmp_path / "hf")
    from_hf = Tokenizer.from_dir(tmp_path / "hf")
    for t in CORPUS:
        assert again.encode(t) == from_hf.encode(t) == ours.encode(t)
    for chat in CHATS:
        assert again.apply_chat_template(chat) == from_hf.apply_chat_template(chat) == ours.apply_chat_template(chat)
    assert again.eos_token_ids == ours.eos_token_ids
    assert from_hf.eos_token_ids[0] == 2 and set(from_hf.eos_token_ids) == {0, 2}


def test_chat_template_sandbox():
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{{ messages.append(1) }}").render(messages=[])
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        compile_chat_template("{{ raise_exception('no system') }}").render()
    assert compile_chat_template("{{ x | tojson }}").render(x={"a": "é👋"}) == '{"a": "é👋"}'
    assert compile_chat_template("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}").render() == "01"


def test_no_template_is_a_clear_error(ours):
    bare = Tokenizer(ours.tok)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])


def _stream(tok, ids, chunk=1):
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, d.flush(), d


@pytest.mark.parametrize("text", CORPUS)
def test_detokenizer_valid_text(ours, text):
    ids = ours.encode(text)
    for chunk in (1, 3):
        deltas, rest, d = _stream(ours, ids, chunk)
        assert rest == "" and "".join(deltas) == d.text == ours.decode(ids)
        assert not any("\ufffd" in x for x in deltas)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), chunk=st.integers(1, 4))
def test_detokenizer_random_ids(ours, ids, chunk):
    deltas, rest, d = _stream(ours, ids, chunk)
    assert "".join(deltas) + rest == d.text == ours.decode(ids)
    assert not any(x.endswith("\ufffd") for x in deltas)


def test_detokenizer_holds_partial_emoji(ours):
    ids = ours.encode("🤗")
    assert len(ids) > 1
    d = IncrementalDetokenizer(ours)
    assert [d.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🤗"]
