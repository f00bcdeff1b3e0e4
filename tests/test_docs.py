"""The documentation site builds in strict mode, and what it is made of holds: every public
name has a docstring (functions with an Example), every page is in the nav, the README stays short.
The pages' code blocks run in test_readme.py."""

import inspect
import json
import os
import subprocess
import sys

import pytest

import tpu_utility
from conftest import ROOT


def test_every_public_name_has_a_docstring_and_every_function_an_example():
    missing = [name for name in tpu_utility.__all__ if not inspect.getdoc(getattr(tpu_utility, name))]
    assert not missing, f"public names without a docstring (the API reference would be empty there): {missing}"
    functions = [name for name in tpu_utility.__all__ if inspect.isfunction(getattr(tpu_utility, name))]
    no_example = [name for name in functions if "Example" not in inspect.getdoc(getattr(tpu_utility, name))]
    assert not no_example, f"public functions whose docstring shows no Example: {no_example}"


def test_the_api_reference_lists_every_public_name():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        listed = {line.split("tpu_utility.", 1)[1].strip() for line in f if line.startswith("::: tpu_utility.")}
    assert listed == set(tpu_utility.__all__), set(tpu_utility.__all__) ^ listed


def test_the_readme_is_short_and_links_every_user_guide_page():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) < 200
    pages = [n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md") and n not in ("index.md", "api.md")]
    assert not [p for p in pages if f"(docs/{p})" not in readme], "a docs page the README does not link"
    assert "## Layout" not in readme and "(design note)" not in readme  # design notes live in docs/design.md


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    pytest.importorskip("mkdocs_jupyter")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "one_cycle_fit" in api and "Seeds the random ops during training" in api  # made from the docstrings
    notebook = (tmp_path / "site" / "kaggle_quickstart" / "index.html").read_text()
    with open(os.path.join(ROOT, "notebooks", "kaggle_quickstart.ipynb")) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    assert len(cells) > 3 and notebook.count('class="jp-Cell jp-CodeCell') >= len(cells)  # every code cell, rendered
    assert "one_cycle_fit" in notebook and "setup_tpu" in notebook


def test_a_broken_link_fails_the_strict_build(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](guide.md).\n")
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        config = f.read()
    head, rest = config.split("nav:\n", 1)
    (tmp_path / "mkdocs.yml").write_text(head + "nav:\n  - Home: index.md\n" + rest[rest.index("plugins:"):])  # this site's settings
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], capture_output=True, text=True,
                       cwd=str(tmp_path), timeout=300)  # fmt: skip
    assert r.returncode != 0 and "guide.md" in r.stderr
