"""`mini-infer doctor` run for real on this machine, then with one thing broken at a time: each
broken line says what to do, and the exit status is 1 exactly when a line fails."""
import os, re, subprocess
import pytest
from mini_infer import doctor
from mini_infer.doctor import FAIL, OK, WARN

NAMES = ["torch", "device", "cpu", "kernels", "prompts", "model", "hub", "memory"]


def run_doctor(**env) -> tuple[int, dict[str, tuple[str, str]]]:
    "The exit status and each line, {name: (status, rest)}; the Hub is not asked (HF_HUB_OFFLINE)."
    r = subprocess.run(["mini-infer", "doctor"], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"HF_HUB_OFFLINE": "1"} | env)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("mini-infer doctor"), r.stdout + r.stderr
    assert len(lines) == 1 + len(NAMES), r.stdout + r.stderr
    found = {}
    for line in lines[1:]:
        status, name, rest = re.match(r"(ok|warn|FAIL) +(\w+) +(.*)", line).groups()
        found[name] = (status, rest)
    assert list(found) == NAMES
    assert r.returncode == any(s == FAIL for s, _ in found.values()), r.stdout
    return r.returncode, found


def test_doctor_on_this_machine():
    "What CI gives the course: torch, the kernels built, the bundled model (fetched first); offline, the Hub warns."
    from mini_infer.model.bundled import bundled_gguf_path
    bundled_gguf_path()
    rc, found = run_doctor()
    assert rc == 0
    for name in ("torch", "device", "kernels", "model", "memory"):
        assert found[name][0] == OK, (name, found[name])
    assert re.match(r"2\.\d+\.\d+.*, (CPU|CUDA [\d.]+|ROCm [\w.]+) build", found["torch"][1])
    assert re.match(r"(cpu|cuda|mps).*, (float32|bfloat16|float16)", found["device"][1])
    assert "AVX2" in found["cpu"][1] and "AMX" in found["cpu"][1]
    assert found["hub"][0] == WARN and "-> " in found["hub"][1]     # offline: what to do about it


def test_kernels_switched_off():
    rc, found = run_doctor(MINI_INFER_NO_KERNELS="1")
    status, rest = found["kernels"]
    assert rc == 0 and status == WARN and "-> unset MINI_INFER_NO_KERNELS" in rest


def test_kernels_cache_not_writable(tmp_path):
    (tmp_path / "a-file").write_text("")
    rc, found = run_doctor(MINI_INFER_CACHE=str(tmp_path / "a-file" / "cache"))
    status, rest = found["kernels"]
    assert rc == 1 and status == FAIL and "-> set MINI_INFER_CACHE to a folder you can" in rest


def test_no_compiler(tmp_path):
    "A fresh cache (nothing built yet) and no compiler: the line says to install one."
    rc, found = run_doctor(CC="no-such-compiler", MINI_INFER_CACHE=str(tmp_path))
    status, rest = found["kernels"]
    assert rc == 1 and status == FAIL
    assert "no C compiler" in rest and "-> install a C compiler" in rest


def test_model_missing(monkeypatch, tmp_path):
    "Neither the package nor a fetched copy: a warning that says the first load fetches it, and what to run offline."
    from mini_infer.model import bundled
    monkeypatch.setattr(bundled, "installed_gguf", lambda: None)
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path))
    c = doctor.check_model()
    assert c.status == WARN and "not fetched yet" in c.found and bundled.OFFLINE_HINT in c.todo


def test_a_check_that_breaks_is_a_failing_line(monkeypatch, capsys):
    def broken(): raise ImportError("no module named 'torch'")
    monkeypatch.setattr(doctor, "CHECKS", [broken])
    assert doctor.doctor() == 1
    assert capsys.readouterr().out.splitlines()[1].startswith("FAIL  broken   ImportError")


@pytest.mark.parametrize("flags, found", [
    ("fpu avx2 avx512f avx512_bf16 amx_tile", "AVX2 yes, AVX-512 yes, AVX512_BF16 yes, AMX yes"),
    ("fpu sse4_2 avx2", "AVX2 yes, AVX-512 no, AVX512_BF16 no, AMX no"),
])
def test_cpu_features_from_cpuinfo(flags, found, monkeypatch, tmp_path):
    cpuinfo = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
    assert doctor.cpu_flags(cpuinfo) == set(flags.split())
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    real = doctor.Path
    fake = lambda p: tmp_path / "cpuinfo" if p == "/proc/cpuinfo" else real(p)
    monkeypatch.setattr(doctor, "Path", fake)
    c = doctor.check_cpu()
    assert c.found == f"Some CPU: {found}" and c.status == OK
