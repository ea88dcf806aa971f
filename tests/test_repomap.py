"""The repo map (chapter 10b): the token budget holds, a file that does not parse is skipped with a warning, the
map of mini_infer names its main classes, and the command line writes it."""
import re
from pathlib import Path

import pytest

import mini_infer
from mini_infer.cli import main
from mini_infer.repomap import model_tokenizer, outline_file, repo_map

PKG = Path(mini_infer.__file__).parent


@pytest.fixture(scope="module")
def count():
    tok = model_tokenizer()
    return lambda text: len(tok.encode(text))


@pytest.mark.parametrize("budget", [150, 600, 2000])
def test_budget_respected_within_2_percent(count, budget):
    text = repo_map(PKG, budget, count)
    assert count(text) <= budget * 1.02
    if budget >= 600:  # a budget this size is mostly used, not wasted
        assert count(text) >= 0.8 * budget


def test_syntax_error_skipped_with_a_warning(tmp_path, count):
    (tmp_path / "good.py").write_text('"""Good."""\n__all__ = ["f"]\ndef f(x: int) -> int:\n    return x\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_text("class Broken(:\n")
    with pytest.warns(UserWarning, match="bad.py"):
        text = repo_map(tmp_path, 200, count)
    assert "good.py: Good." in text and "def f(x: int) -> int" in text and "Broken" not in text


def test_map_of_mini_infer_names_llm_and_engine(count):
    text = repo_map(PKG, 2000, count)
    assert "class LLMEngine" in text and re.search(r"\bclass LLM\b", text)   # LLM itself, not only LLMEngine


def test_outline_is_typed_and_reads_exports():
    o = outline_file(PKG / "engine" / "llm.py", PKG)
    assert "LLM" in o.exports
    assert any(sig.strip().startswith("def generate(self") and "->" in sig for _, sig in o.symbols)


def test_cli_writes_the_map(tmp_path, count, capsys):
    out = tmp_path / "map.txt"
    main(["repomap", str(PKG), "--max-tokens", "500", "--output", str(out)])
    text = out.read_text()
    assert 0 < count(text) <= 510 and "wrote" in capsys.readouterr().err
