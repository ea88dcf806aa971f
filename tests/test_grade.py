"""`mini-infer grade`: a learner's notebooks run as they stand, each exercise's verdict read back.
(nbs/98_exercises.ipynb checks the verdict parsing on a tiny notebook made on the spot.)"""
import json, shutil, subprocess, sys
from pathlib import Path
from mini_infer.course.exercise import solutions
from mini_infer.course.grade import chapter_notebooks

NBS = Path(__file__).parent.parent / "nbs"


def solve(nb_path: Path, stub_start: str, heading_start: str):
    """As a learner would: the code cell starting with `stub_start` keeps its imports and gets the
    folded solution under the heading in place of its stub."""
    nb = json.loads(nb_path.read_text())
    code = next(c for h, c in solutions(nb_path).items() if h.startswith(heading_start))
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).startswith(stub_start))
    imports = [l for l in cell["source"] if l.startswith(("from ", "import "))]
    cell["source"] = imports + code.splitlines(keepends=True)
    nb_path.write_text(json.dumps(nb))


def test_grade_a_copy_with_one_exercise_solved(tmp_path):
    "Chapter 10b with exercise 10b.1 solved: correct, the two others not attempted; the file unchanged."
    nb = tmp_path / "10b_repomap.ipynb"
    shutil.copy(NBS / "10b_repomap.ipynb", nb)
    solve(nb, "from mini_infer.course.exercises.ch10b import", "Exercise 10b.1")
    (tmp_path / "README.md").write_text("not a notebook")
    assert [p.name for p in chapter_notebooks([tmp_path])] == ["10b_repomap.ipynb"]
    before = nb.read_text()
    out = subprocess.run([sys.executable, "-c", "from mini_infer.cli import main; main()", "grade", "--quick", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert nb.read_text() == before
    rows = {l.split()[2]: l for l in out.stdout.splitlines() if l.startswith("10b_repomap")}
    assert "correct" in rows["10b.1:"] and "not attempted" in rows["10b.2:"] and "not attempted" in rows["10b.3:"], out.stdout
