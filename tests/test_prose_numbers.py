"""A measured number in a chapter's prose is either printed by a cell (it appears in the notebook's stored
outputs) or labelled as a full-size run, with machine and date, in the same markdown cell. The test looks at the
numbers that are measurements by their units (ratios like 1.06x, times, throughputs, percentages), so a prose
figure that contradicts, or was never in, the stored output is caught."""
import json, re
from pathlib import Path
import pytest

NBS = Path(__file__).parent.parent / "nbs"
CHAPTERS = [p for p in sorted(NBS.glob("[0-9][0-9]*_*.ipynb")) if int(p.name[:2]) < 90]
# 1.06x, 12 ms, 0.8 s, 301 tok/s, 95.3%: not "49152 x 576" (a shape), not "$2x$" (algebra)
MEASURED = re.compile(r"(?<![\w.$^/{])(\d+(?:\.\d+)?)\s?(x|×|ms|s|tok/s|tokens/s|%)(?![\w/$]|\s*\d)")
LABEL = re.compile(r"full-size run|\b20\d\d-\d\d-\d\d\b", re.I)


def stored_outputs(cells) -> str:
    def text(o):
        return "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
    return "\n".join(text(o) for c in cells for o in c.get("outputs", []))


def unsupported_numbers(p: Path) -> list[str]:
    cells = json.loads(p.read_text())["cells"]
    printed = stored_outputs(cells)
    found = []
    for c in cells:
        md = "".join(c["source"])
        if c["cell_type"] != "markdown" or LABEL.search(md):
            continue
        for m in MEASURED.finditer(md):
            if m.group(1) not in printed:
                found.append(f"{m.group(0)!r} in: ...{md[max(0, m.start() - 70):m.end() + 20]}...".replace("\n", " "))
    return found


@pytest.mark.parametrize("p", CHAPTERS, ids=lambda p: p.stem)
def test_prose_numbers_are_printed_or_labelled(p):
    found = unsupported_numbers(p)
    assert not found, f"{p.name}: measured numbers in prose that no stored output prints and no label covers:\n" + "\n".join(found)
