"""README.md is the landing page, nbs/index.ipynb, as markdown: its title, its summary line and its
markdown cells (nbdev's `nbdev-readme` would make it through Quarto, which this does not need).
`python tools/readme.py` writes it; tests/test_packaging.py checks that it is not stale."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_text(index: Path = ROOT / "nbs" / "index.ipynb") -> str:
    cells = json.loads(index.read_text())["cells"]
    # "# mini-infer", "> A teaching-first ..."
    title, summary = "".join(cells[0]["source"]).split("\n\n", 1)
    body = ["".join(c["source"]) for c in cells[1:] if c["cell_type"] == "markdown"]
    return "\n\n".join([title, summary.removeprefix("> "), *body]) + "\n"


if __name__ == "__main__":
    (ROOT / "README.md").write_text(readme_text())
