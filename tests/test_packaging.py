"""`python -m build` makes an sdist whose own tests run and a wheel that imports."""

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

import tpu_utility
from conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    PROJECT = tomllib.load(f)["project"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist and the wheel built from it, as a user's `python -m build` makes them."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the test venv has setuptools, so nothing is downloaded
    r = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), ROOT],
        capture_output=True, text=True, timeout=300, cwd=str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def test_version_comes_from_the_installed_metadata():
    assert tpu_utility.__version__ == importlib.metadata.version("tpu_utility") == PROJECT["version"]


def test_metadata_says_what_users_need():
    assert PROJECT["requires-python"] == ">=3.10"
    extras = PROJECT["optional-dependencies"]
    for name in ("xla", "tpu", "xla28", "tpu28"):
        pins = {req.split("==")[0].split("[")[0]: req.split("==")[1] for req in extras[name]}
        assert set(pins) == {"torch", "torch_xla", "torchvision"}, (name, extras[name])
        # one release: torch_xla X.Y with torch X.Y.*, torchvision 0.(Y+15) (torchvision's numbering)
        major, minor = pins["torch"].split(".")[:2]
        assert pins["torch_xla"].startswith(f"{major}.{minor}."), (name, pins)
        assert pins["torchvision"].startswith(f"0.{int(minor) + 15}."), (name, pins)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        markers = tomllib.load(f)["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("cuda:") for m in markers)


def test_sdist_holds_the_package_and_its_tests_and_they_run(dist, tmp_path):
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(tmp_path, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp_path)
    for needed in ("pyproject.toml", "setup.py", "LICENSE", "README.md", "tpu_utility/__init__.py",
                   "tpu_utility/py.typed", "tests/conftest.py", "tests/test_packaging.py",
                   "notebooks/kaggle_quickstart.ipynb", "requirements.txt"):  # fmt: skip
        assert needed in names, f"{needed} is missing from the sdist"
    (unpacked,) = tmp_path.iterdir()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_schedule.py",
         "tests/test_import.py::test_import_does_not_import_torch_xla", "tests/test_setup.py::test_suggested_workers_leave_a_cpu_per_process"],
        capture_output=True, text=True, timeout=300, cwd=str(unpacked),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
    r = subprocess.run([sys.executable, "-c", "import tpu_utility; print(tpu_utility.__file__)"],
                       capture_output=True, text=True, cwd=str(unpacked))  # fmt: skip
    assert r.stdout.startswith(str(unpacked)), r.stdout + r.stderr  # the sdist's copy was tested


def test_wheel_holds_the_package_and_imports(dist, tmp_path):
    _, wheel = dist
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    info = f"tpu_utility-{PROJECT['version']}.dist-info"
    for needed in ("tpu_utility/__init__.py", "tpu_utility/backend/xla.py", "tpu_utility/py.typed",
                   f"{info}/METADATA", f"{info}/licenses/LICENSE"):  # fmt: skip
        assert needed in names, f"{needed} is missing from the wheel"
    assert not [n for n in names if n.startswith("tests/")], "the wheel must not install a top-level tests package"
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(f"{info}/METADATA").decode()
    assert "Requires-Python: >=3.10" in metadata and "Provides-Extra: xla" in metadata
    assert "License-Expression: MIT" in metadata
    r = subprocess.run(
        [sys.executable, "-c", "import sys, tpu_utility; print(tpu_utility.__file__, tpu_utility.__version__,"
         " 'torch_xla' in sys.modules)"],
        capture_output=True, text=True, cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    path, version, xla_loaded = r.stdout.split()
    assert path.startswith(str(tmp_path / "site")) and version == PROJECT["version"] and xla_loaded == "False"


@pytest.mark.parametrize("extra, requirements", [("xla", "requirements.txt"), ("xla28", "requirements-kaggle.txt")])
def test_each_tested_stack_is_an_extra(extra, requirements):
    with open(os.path.join(ROOT, requirements)) as f:
        pins = {line.strip() for line in f if line.startswith(("torch==", "torch_xla==", "torchvision=="))}
    assert pins == set(PROJECT["optional-dependencies"][extra]), "CI's stack and the extra users install differ"
