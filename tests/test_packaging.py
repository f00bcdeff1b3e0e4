"""`python -m build` makes an sdist whose own tests run and a wheel that imports."""

import importlib.metadata
import os
import re
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
    """The sdist and the wheel built from it, as a user's `python -m build` makes them.

    Built once for the whole run: the tests that need it may land on several xdist workers, and two
    builds at once race in the tree (setuptools lays out tpu_utility-<version>/ and build/ beside
    setup.py and removes them after), so a lock in the temp root every worker shares guards one build.
    """
    pytest.importorskip("build")
    filelock = pytest.importorskip("filelock")  # a dependency of torch
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's root, above each worker's own
    out = shared / "dist"
    with filelock.FileLock(str(shared / "dist.lock")):
        if not out.exists():
            building = shared / "dist.partial"
            building.mkdir(exist_ok=True)
            # --no-isolation: the test venv has setuptools, so nothing is downloaded
            r = subprocess.run(
                [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(building), ROOT],
                capture_output=True, text=True, timeout=300, cwd=str(building),
            )  # fmt: skip
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            building.rename(out)
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
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_schedule.py::test_one_cycle_shape",
         "tests/test_schedule.py::test_steps_per_epoch_is_what_each_core_iterates",
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


# ----------------------------------------------------------- what a new user reads and installs
# URLs a user is sent to, each opened by hand before it was listed here. The project has no
# public home page or repository yet, so pyproject.toml has no [project.urls] (docs/release.md).
REAL_URLS = {"https://pypi.org/simple"}  # PyPI's index, queried for the name check in docs/release.md
PLACEHOLDER = re.compile(
    r"<(this|your|the|my)[ _-][^>\n]*>"  # <this repository>, <your-dataset>
    r"|git\+<|\b(YOUR|MY)_[A-Z]+\b|your-(org|user|name|repo)|example\.(com|org)|\bOWNER/REPO\b|\bTODO\b|\bFIXME\b",
    re.I,
)


def _user_facing_files() -> list[str]:
    found = [os.path.join(ROOT, name) for name in ("README.md", "pyproject.toml")]
    for folder, suffix in (("docs", ".md"), ("notebooks", ".ipynb")):
        path = os.path.join(ROOT, folder)
        if os.path.isdir(path):
            found += [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(suffix)]
    return found


def test_no_placeholder_or_unchecked_url_is_shown_to_users():
    problems = []
    for path in _user_facing_files():
        with open(path) as f:
            text = f.read()
        name = os.path.relpath(path, ROOT)
        problems += [f"{name}: placeholder {m.group(0)!r}" for m in PLACEHOLDER.finditer(text)]
        problems += [f"{name}: URL {u!r} is not in REAL_URLS" for u in re.findall(r"https?://[^\s)\"'>`\]]+", text)
                     if u.rstrip(".,") not in REAL_URLS]  # fmt: skip
        # the wheel's file name as the README and notebook show it carries this version
        problems += [f"{name}: {w} is not version {PROJECT['version']}" for w in re.findall(r"tpu_utility-[0-9][^-\s]*-py3", text)
                     if w != f"tpu_utility-{PROJECT['version']}-py3"]  # fmt: skip
    assert not problems, "\n".join(problems)
    assert set(PROJECT.get("urls", {}).values()) <= REAL_URLS, PROJECT.get("urls")


@pytest.mark.parametrize("text", ['pip install "tpu_utility @ git+<this repository>"', "see https://github.com/your-org/tpu_utility"])
def test_the_placeholder_check_catches_what_issue_19_found(text):
    assert PLACEHOLDER.search(text) or any(u not in REAL_URLS for u in re.findall(r"https?://\S+", text))


def test_every_install_line_works_without_a_clone_or_an_index():
    with open(os.path.join(ROOT, "README.md")) as f:
        install = f.read().split("## Install", 1)[1].split("\n## ", 1)[0]
    lines = [line.split("#")[0].strip() for line in install.splitlines() if line.startswith("pip install")]
    notebook = [line.strip("# !").split("#")[0].strip() for line in _notebook_install_cell().splitlines() if "pip install" in line]
    for line in [*lines[:2], *notebook]:  # the notebook lines: a wheel file, no clone, no index
        assert "--no-deps" in line and line.split()[-1].endswith(".whl") and "git+" not in line, line
    assert any("/kaggle/input/" in line for line in lines) and any("/kaggle/input/" in line for line in notebook)


def _notebook_install_cell() -> str:
    import nbformat

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "kaggle_quickstart.ipynb"), as_version=4)
    (cell,) = [c.source for c in nb.cells if c.cell_type == "code" and "pip install" in c.source]
    return cell


def _kaggle_python() -> str | None:
    """An interpreter of Kaggle's TPU stack (Python 3.12, torch/torch_xla 2.8): this one under
    `make test-kaggle`, else the repository's .venv-kaggle, else $KAGGLE_PYTHON."""
    import torch

    if sys.version_info[:2] == (3, 12) and torch.__version__.startswith("2.8."):
        return sys.executable
    for candidate in (os.path.join(ROOT, ".venv-kaggle", "bin", "python"), os.environ.get("KAGGLE_PYTHON", "")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def test_the_wheel_installs_offline_into_the_kaggle_stack_and_trains(dist, tmp_path):
    """A fresh venv that sees Kaggle's packages (as the image's Python does) but not this tree,
    with no network at all: `pip install --no-deps --no-index` the wheel, then the README's
    setup_tpu() and one-call block."""
    python = _kaggle_python()
    if python is None:
        pytest.skip("no Kaggle-stack interpreter (.venv-kaggle, or KAGGLE_PYTHON=/path/to/python3.12)")
    _, wheel = dist
    offline = ["unshare", "-rn"] if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0 else []
    venv = tmp_path / "kaggle-like"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    stack_paths = subprocess.run([python, "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
    (site_dir,) = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                                 capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    with open(os.path.join(site_dir, "kaggle_stack.pth"), "w") as f:
        f.write(stack_paths)  # plain path lines: the stack's packages, not its editable install of this tree
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_CONFIG_FILE=os.devnull, PJRT_DEVICE="CPU")
    r = subprocess.run([*offline, str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    from test_readme import PRELUDE, one_call_block

    work = tmp_path / "work"
    work.mkdir()
    code = (PRELUDE.format(tmp=str(work)) + one_call_block()
            + "\nimport tpu_utility; print('FROM', tpu_utility.__file__)\n"
            "print('STOP', history.stop_reason)\n")  # fmt: skip
    r = subprocess.run([*offline, str(venv / "bin" / "python"), "-c", code],
                       capture_output=True, text=True, env=env, timeout=900, cwd=str(work))  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"FROM {site_dir}/tpu_utility/__init__.py" in r.stdout  # the wheel's copy, not this tree's
    assert "via XLA" in r.stdout or "tpu_utility on" in r.stdout, r.stdout[-2000:]
    assert "STOP " in r.stdout and "epoch 1/5" in r.stdout, r.stdout[-2000:]
    assert os.path.exists(work / "submission.csv") and os.path.exists(work / "ckpt" / "best.pt")
