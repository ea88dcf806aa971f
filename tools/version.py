"""The version lives in one place: `__version__` in nbs/index.ipynb, which nbdev exports to
mini_infer/__init__.py and pyproject.toml reads. Every other place that names it derives from it
here: the chapters' setup cells (they install the tag `v<version>`), the landing page's Colab and
Kaggle badges (they open the chapters at that tag), its install line and BibTeX, and CITATION.cff.

    python tools/version.py 0.2.0   # set it; rewrite what derives from it, README.md, mini_infer/
    python tools/version.py         # rewrite what derives from the version already set
    python tools/version.py --check-tag v0.2.0   # fails unless the tag is v<version>

tests/test_packaging.py holds every derived place equal to the version; the release workflow
refuses a tag that is not `v<version>`."""
import json, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "nbs" / "index.ipynb"
CITATION = ROOT / "CITATION.cff"
_VERSION = re.compile(r'^(__version__ = ")([^"]+)(")', re.M)
# the places that name the version, each with the version as group 2
DERIVED = [
    re.compile(r"(github\.com/mini-infer/mini-infer@v)([\w.+-]+)"),  # pip install ...@v<version>
    re.compile(r"(/mini-infer/mini-infer/blob/v)([\w.+-]+)(/nbs/)"),  # a badge's chapter at the tag
    re.compile(r"(version += \{)([^}]+)(\})"),  # the BibTeX entry
    re.compile(r"(first release will be `v)([^`]+)(`)"),
    re.compile(r'^(version: ")([^"]+)(")', re.M),  # CITATION.cff
]


def chapter_notebooks() -> list[Path]:
    "Every notebook with a setup cell (its first code cell): the chapters, the contracts, the CLI's."
    def has_setup(p: Path) -> bool:
        code = [c for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code"]
        return bool(code) and "".join(code[0]["source"]).startswith("#@title Setup")

    return sorted(p for p in (ROOT / "nbs").glob("[0-9]*.ipynb") if has_setup(p))


def setup_cell(nb: dict) -> dict:
    "A chapter's setup cell: its first code cell, collapsed, titled `#@title Setup`."
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert "".join(cell["source"]).startswith("#@title Setup"), "no setup cell comes first"
    return cell


def _version_cells(nb: dict) -> list[dict]:
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    return [c for c in code if _VERSION.search("".join(c["source"]))]


def current() -> str:
    "The version, as nbs/index.ipynb sets it."
    (cell,) = _version_cells(json.loads(INDEX.read_text()))
    return _VERSION.search("".join(cell["source"])).group(2)


def derive(text: str, version: str) -> str:
    "`text` with every place that names the version naming `version`."
    for pat in DERIVED:
        text = pat.sub(lambda m: m.group(1) + version + "".join(m.groups()[2:]), text)
    return text


def _rewrite_cells(path: Path, cells_of, edit):
    nb = json.loads(path.read_text())
    for cell in cells_of(nb):
        cell["source"] = edit("".join(cell["source"])).splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def set_version(version: str):
    "Set the version in nbs/index.ipynb; rewrite what derives from it, README.md, mini_infer/."
    _rewrite_cells(INDEX, _version_cells, lambda s: _VERSION.sub(rf"\g<1>{version}\g<3>", s))
    markdown = lambda nb: [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    _rewrite_cells(INDEX, markdown, lambda s: derive(s, version))
    for p in chapter_notebooks():  # the setup cell alone: nothing else of a chapter names it
        _rewrite_cells(p, lambda nb: [setup_cell(nb)], lambda s: derive(s, version))
    CITATION.write_text(derive(CITATION.read_text(), version))
    subprocess.run([sys.executable, str(ROOT / "tools" / "readme.py")], check=True)
    subprocess.run(["nbdev-export"], check=True, cwd=ROOT)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-tag"]:  # the release workflow: is this tag the version's?
        if sys.argv[2] != f"v{current()}":
            sys.exit(f"the tag {sys.argv[2]} is not v{current()}, the version in nbs/index.ipynb")
    else:
        set_version(sys.argv[1] if len(sys.argv) > 1 else current())
