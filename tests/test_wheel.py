"""The wheel people install: `python -m build` makes one that `twine check` accepts, and installed from it (not
editable) in a fresh venv, the quickstart runs offline, C kernels included."""
import os, subprocess, sys, zipfile
from pathlib import Path
import pytest

ROOT = Path(__file__).parent.parent
QUICKSTART = """
import mini_infer, sys
from mini_infer import LLM, SamplingParams
assert mini_infer.__file__.startswith(sys.prefix), mini_infer.__file__   # the wheel, not the checkout
llm = LLM("smollm2-135m", max_model_len=256)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
print("backend:", type(llm.engine.backend).__name__, "text:", repr(out.text))
assert out.text.strip()
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("*.whl")
    return whl


def test_twine_accepts_the_wheel(wheel):
    r = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0 and "PASSED" in r.stdout, r.stdout + r.stderr
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name.startswith("mini_infer_course-") and "mini_infer/plugins/cpu/build.py" in names


def sees_these_site_packages(venv: Path):
    """Let `venv` import what this interpreter has installed (torch and the other dependencies), after its
    own site-packages. `--system-site-packages` would not do: from inside a venv it exposes the base
    interpreter's packages, not the venv's. The folders are added as plain paths, so their .pth files (the
    editable checkout's among them) are not run: the venv's own mini_infer, the wheel, is the one imported."""
    dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    (purelib,) = {Path(p) for p in venv.glob("lib/python*/site-packages")}
    (purelib / "_outer_site_packages.pth").write_text("\n".join(dirs) + "\n")


def test_quickstart_from_the_wheel_offline(wheel, tmp_path):
    venv = tmp_path / "venv"
    # a checkout on PYTHONPATH would be imported instead of the wheel (and its egg-info would tell pip that
    # mini-infer-course is installed already)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300, env=env)
    sees_these_site_packages(venv)   # after the install: pip would take an outer mini-infer-course as installed
    env |= {"HF_HUB_OFFLINE": "1", "MINI_INFER_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([str(py), "-c", QUICKSTART], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "CPUBackend" in r.stdout, r.stdout     # the C sources came with the wheel and compiled
