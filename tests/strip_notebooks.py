"""Copy notebooks with outputs stripped, for nbval (which rejects nbdev-cleaned notebooks), plus a conftest
that skips cells flagged `#| gpu` when CUDA is absent and `#| slow` cells (as nbdev-test does).
Usage: python tests/strip_notebooks.py SRC_DIR DEST_DIR"""
import sys
from pathlib import Path
import nbformat

CONFTEST = r'''
import re, pytest, torch
_SKIP = {"slow", "notest"} | (set() if torch.cuda.is_available() else {"gpu"})
def pytest_collection_modifyitems(items):
    for item in items:
        src = getattr(getattr(item, "cell", None), "source", "")
        flags = set(re.findall(r"^#\|\s*(\w+)\s*$", src, flags=re.M))
        if flags & _SKIP: item.add_marker(pytest.mark.skip(reason=f"flagged {sorted(flags & _SKIP)}"))
'''

def strip(src: Path, dest: Path):
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("[0-9]*.ipynb")):
        nb = nbformat.read(p, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code": c.outputs, c.execution_count = [], None
        nb.metadata.setdefault("kernelspec", {"display_name": "python3", "language": "python", "name": "python3"})
        nbformat.write(nb, dest / p.name)
    (dest / "conftest.py").write_text(CONFTEST)

if __name__ == "__main__": strip(Path(sys.argv[1]), Path(sys.argv[2]))
