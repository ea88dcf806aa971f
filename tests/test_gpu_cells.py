"""Every `#| gpu` cell's code, run on the CPU: no GPU runs them here, so this catches a renamed API or a shape
error in them. The cell runs as written except that `torch.cuda` is a stand-in that says two T4s are there (Kaggle's machine), "cuda"
is "cpu", the Hub's Qwen2.5 models are a tiny random Qwen2 (14 heads, 2 KV heads, as Qwen2.5-0.5B), and an
`assert` is evaluated but not required to hold (random weights do not answer "Paris")."""
import ast, json, types
from pathlib import Path
import pytest
import torch
from conftest import save_tiny_qwen

ROOT = Path(__file__).parent.parent
HUB_MODELS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct")


def gpu_cells():
    for nb in sorted((ROOT / "nbs").glob("[0-9]*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        for i, c in enumerate(cells):
            src = "".join(c["source"])
            if c["cell_type"] == "code" and src.startswith("#| gpu"):
                yield pytest.param(nb, cells[:i], src, id=f"{nb.stem}-{c.get('id')}")


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    "A random Qwen2 with 14 heads and 2 KV heads (as Qwen2.5-0.5B) and the bundled model's tokenizer."
    return save_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen2"), hidden_size=112, intermediate_size=160,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
                          tie_word_embeddings=True)


class OnCPU(ast.NodeTransformer):
    "`torch.cuda` -> the stand-in; 'cuda' -> 'cpu'; Hub names -> the tiny model; assert -> evaluated only."
    def __init__(self, model_dir): self.model_dir = model_dir
    def visit_Attribute(self, node):
        node = self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr == "cuda":
            return ast.copy_location(ast.Name("fake_cuda", ast.Load()), node)
        return node
    def visit_Constant(self, node):
        if node.value == "cuda": return ast.copy_location(ast.Constant("cpu"), node)
        if node.value in HUB_MODELS: return ast.copy_location(ast.Constant(self.model_dir), node)
        return node
    def visit_Assert(self, node):
        node = self.generic_visit(node)
        call = ast.Call(ast.Name("evaluated", ast.Load()), [node.test], [])
        return ast.copy_location(ast.Expr(call), node)


def prelude(cells_before) -> dict:
    "The notebook's imports, its modules' names (what its export cells define), its lesson functions, IN_TEST, DEVICE."
    ns = {"IN_TEST": True, "DEVICE": torch.device("cpu")}
    modules = set()
    for c in cells_before:
        if c["cell_type"] != "code": continue
        src = "".join(c["source"])
        for line in src.splitlines():
            if line.startswith(("#| default_exp ", "#| export ")) and len(line.split()) == 3:
                modules.add(line.split()[2])
            elif line.strip() == "#| export" and "default" in ns: modules.add(ns["default"])
            if line.startswith("#| default_exp "): ns["default"] = line.split()[2]
        try: tree = ast.parse(src)
        except SyntaxError: continue
        exported = src.startswith("#| export")
        for node in tree.body:   # imports, and the functions and classes of lesson cells
            if isinstance(node, (ast.Import, ast.ImportFrom)) or (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not exported):
                try: exec(compile(ast.Module([node], []), "<prelude>", "exec"), ns)
                except NameError: pass   # a lesson function annotated with a lesson class: the cells don't use it
    for m in modules:
        exec(f"from mini_infer.{m} import *", ns)
    return ns


@pytest.mark.parametrize("nb,cells_before,src", list(gpu_cells()))
def test_gpu_cell_runs_on_cpu(nb, cells_before, src, tiny_qwen, capsys):
    ns = prelude(cells_before)
    ns["fake_cuda"] = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2, synchronize=lambda: None,
                                            empty_cache=lambda: None, get_device_capability=lambda: (7, 5))
    ns["evaluated"] = lambda ok: None
    tree = ast.fix_missing_locations(OnCPU(tiny_qwen).visit(ast.parse(src)))
    exec(compile(tree, f"{nb.name}:gpu", "exec"), ns)
    assert "skipped" not in capsys.readouterr().out
