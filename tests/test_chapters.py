"""The frame every chapter follows (issue 24): a setup cell, what you will build and learn, prerequisites,
an honest reading time, a recap, at least three exercises, and at most ~75 minutes of reading.
Run `python tests/test_chapters.py` for a table of every chapter's reading time."""
import json, re
from pathlib import Path
import pytest

NBS = Path(__file__).parent.parent / "nbs"
CHAPTERS = sorted(NBS.glob("[0-9][0-9]*_*.ipynb"))
CHAPTERS = [p for p in CHAPTERS if 0 < int(p.name[:2]) < 90]
WORDS_PER_MIN, CODE_LINES_PER_MIN, MAX_MINUTES = 200, 10, 75


def cells(p):
    return json.loads(p.read_text())["cells"]


def src(c):
    return "".join(c["source"])


def collapsed(c):
    "A cell that arrives with its code folded in Jupyter (`jupyter.source_hidden`) and Colab (`cellView: form`)."
    md = c.get("metadata", {})
    return bool(md.get("jupyter", {}).get("source_hidden")) and md.get("cellView") == "form"


def folded(c):
    "Code a reader does not see open: Colab folds `cellView: form` cells, Jupyter `source_hidden` ones."
    md = c.get("metadata", {})
    return bool(md.get("jupyter", {}).get("source_hidden")) or md.get("cellView") == "form"


def reading_minutes(p) -> float:
    """As Colab shows the chapter: its words / 200 per minute + the non-empty lines of the code cells
    it shows open (`#|` lines included: Colab shows them) / 10 per minute."""
    words = sum(len(src(c).split()) for c in cells(p) if c["cell_type"] == "markdown")
    lines = sum(
        sum(1 for line in src(c).splitlines() if line.strip())
        for c in cells(p)
        if c["cell_type"] == "code" and not folded(c)
    )
    return words / WORDS_PER_MIN + lines / CODE_LINES_PER_MIN


def markdown(p) -> str:
    return "\n".join(src(c) for c in cells(p) if c["cell_type"] == "markdown")


@pytest.mark.parametrize("p", CHAPTERS, ids=lambda p: p.stem)
def test_reading_time(p):
    assert reading_minutes(p) <= MAX_MINUTES, f"{p.name}: {reading_minutes(p):.1f} min of reading"


@pytest.mark.parametrize("p", CHAPTERS, ids=lambda p: p.stem)
def test_frame(p):
    md = markdown(p)
    first = src(cells(p)[0])
    assert first.startswith("# ") and "\n> " in first, "an H1 title and a `>` summary first"
    code = [src(c) for c in cells(p) if c["cell_type"] == "code"][:3]
    assert any("pip install" in s and "DEVICE" in s for s in code), "a setup cell among the first code cells"
    assert re.search(r"^## What you will (build|learn)", md, re.M | re.I), "a 'What you will build and learn' section"
    assert re.search(r"\*\*Prerequisites", md), "prerequisites"
    stated = re.search(r"\*\*Reading time\*\*: about (\d+) min", md)
    assert stated, "a stated reading time ('**Reading time**: about N min')"
    assert abs(int(stated.group(1)) - reading_minutes(p)) <= max(10, 0.25 * reading_minutes(p)), (
        f"stated {stated.group(1)} min, the formula gives {reading_minutes(p):.0f}"
    )
    assert re.search(r"^## Recap", md, re.M), "a recap at the end"
    assert len(re.findall(r"^#+ .*exercise", md, re.M | re.I)) >= 3, "at least three exercises"


def test_landing_page_reading_times():
    "The landing page's course table gives every chapter the reading time the chapter states."
    index = "\n".join(src(c) for c in cells(NBS / "index.ipynb") if c["cell_type"] == "markdown")
    for p in CHAPTERS:
        row = re.search(r"\]\(nbs/" + re.escape(p.name) + r"\)[^\n]*\| ~(\d+) min \|", index)
        assert row, f"{p.name}: a row with its reading time in the landing page's course table"
        stated = re.search(r"\*\*Reading time\*\*: about (\d+) min", markdown(p)).group(1)
        assert row.group(1) == stated, f"{p.name}: the landing page says ~{row.group(1)} min, the chapter {stated}"


if __name__ == "__main__":
    for p in CHAPTERS:
        print(f"{p.name:40s} {reading_minutes(p):5.0f} min")


@pytest.mark.parametrize("p", CHAPTERS, ids=lambda p: p.stem)
def test_hidden_cells_arrive_collapsed(p):
    "A `#| hide` cell is plumbing: it arrives collapsed in Jupyter and Colab, as it is dropped from the site."
    open_hidden = [src(c).splitlines()[0:3] for c in cells(p)
                   if c["cell_type"] == "code" and re.search(r"^#\|\s*hide\s*$", src(c), re.M) and not collapsed(c)]
    assert not open_hidden, f"{p.name}: {len(open_hidden)} `#| hide` cells open: {open_hidden[:3]}"
