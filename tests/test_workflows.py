"""The three GitHub workflows: tests on push and pull request, the site to GitHub Pages, a release
on a version tag by trusted publishing. They lint clean, offline: actionlint, and zizmor under the
policy of .github/zizmor.yml."""
import shutil, subprocess, sys
from pathlib import Path
import yaml

ROOT = Path(__file__).parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"


def tool(name: str) -> str:
    "A command of the dev extra: beside this interpreter, else on PATH."
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[dev]'"
    return found


def workflow(name: str) -> tuple[dict, str]:
    text = (WORKFLOWS / name).read_text()
    return yaml.safe_load(text), text


def test_the_three_workflows():
    names = sorted(p.name for p in WORKFLOWS.glob("*.yml"))
    assert names == ["release.yml", "site.yml", "tests.yml"]
    tests, text = workflow("tests.yml")
    assert set(tests[True]) == {"push", "pull_request"}                  # YAML reads `on:` as True
    assert "bash .ci/run" in text and "download.pytorch.org/whl/cpu" in text
    site, text = workflow("site.yml")
    assert "run: python tools/build_site.py" in text                     # the README's command
    assert "actions/upload-pages-artifact@" in text and "actions/deploy-pages@" in text
    assert site["jobs"]["deploy"]["permissions"] == {"pages": "write", "id-token": "write"}
    release, text = workflow("release.yml")
    assert release[True] == {"push": {"tags": ["v*"]}}
    assert "python -m build" in text and "twine check --strict dist/*" in text
    assert release["jobs"]["publish"]["permissions"] == {"id-token": "write"}   # trusted publishing
    assert "pypa/gh-action-pypi-publish@" in text
    for name in ("tests.yml", "site.yml", "release.yml"):
        text = workflow(name)[1]
        assert "secrets." not in text and "password" not in text, f"{name}: no token in the repo"


def test_actionlint():
    r = subprocess.run([tool("actionlint"), *sorted(map(str, WORKFLOWS.glob("*.yml")))],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_zizmor():
    config = ROOT / ".github" / "zizmor.yml"   # actions pinned by version tag, and why
    r = subprocess.run([tool("zizmor"), "--offline", "--no-progress", "--config", str(config),
                        str(WORKFLOWS)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
