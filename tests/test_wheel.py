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


def test_quickstart_from_the_wheel_offline(wheel, tmp_path):
    venv = tmp_path / "venv"
    # the venv sees torch and the other dependencies already installed here, but not the editable checkout's
    # mini_infer: the wheel installed into the venv comes first on sys.path
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINI_INFER_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([str(py), "-c", QUICKSTART], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "CPUBackend" in r.stdout, r.stdout     # the C sources came with the wheel and compiled
