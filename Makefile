# Two commands for a new user: `make demo` and `make test`.
#
# Three stacks and a lane, each in its own venv, built the same way:
#   .venv           pinned stack: Python 3.11, torch/torch_xla 2.9.0, torchvision 0.24.0 (requirements.txt)
#   .venv-kaggle    Kaggle's TPU image: Python 3.12, torch/torch_xla 2.8.0, torchvision 0.23.0
#                   (requirements-kaggle.txt)
#   .venv-colab     Colab's TPU runtime: Python 3.13, torch/torch_xla 2.9.0, torchvision 0.24.0
#                   (requirements-colab.txt)
#   .venv-torchtpu  the TorchTPU lane: Python 3.11, torch 2.13 + torch-tpu 0.2.0 + libtpu, no torch_xla
#                   (requirements-torchtpu.txt); runs the native-backend and TorchTPU tests only
# A venv is rebuilt from scratch when its requirements change (the stamp holds their
# checksum); a change to pyproject.toml or setup.py only re-runs the editable install.
#
# `make test` builds the docs strictly, runs the whole suite on every stack and the lane's tests
# (CI calls it); `make test-pinned`, `test-kaggle`, `test-colab`, `test-torchtpu` run one, `make docs`
# the docs alone. The interpreters are found on PATH, in pyenv or in uv;
# PYTHON311=/path/to/python3.11 (or PYTHON312, PYTHON313) choose one by hand.

export PJRT_DEVICE ?= CPU

PINNED := .venv
KAGGLE := .venv-kaggle
COLAB := .venv-colab
TORCHTPU := .venv-torchtpu
# what the TorchTPU lane runs: the code that lane has (no torch_xla there)
TORCHTPU_TESTS := tests/test_native.py tests/test_torchtpu.py
PYTEST_ARGS ?= -q

.PHONY: venv venv-kaggle venv-colab venv-torchtpu demo test test-pinned test-kaggle test-colab test-torchtpu docs bench stress dist clean

# $(call find-python,3.12,$(PYTHON312)): prints the first interpreter of that version.
define find-python
for p in $(2) python$(1) $$(pyenv root 2>/dev/null)/versions/$(1)*/bin/python$(1) \
	$$HOME/.pyenv/versions/$(1)*/bin/python$(1) $$(uv python find $(1) 2>/dev/null); do \
	if [ -n "$$p" ] && "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(1))))' 2>/dev/null; then \
		echo "$$p"; break; fi; done
endef
comma := ,

# $(call build-venv,DIR,PYTHON_VERSION,REQUIREMENTS,OVERRIDE): (re)builds DIR when needed.
define build-venv
	@set -e; \
	req_sum=$$(cat $(3) requirements-dev.txt | sha256sum | cut -c1-16); \
	pkg_sum=$$(cat pyproject.toml setup.py | sha256sum | cut -c1-16); \
	if [ ! -x $(1)/bin/python ] || [ "$$(cat $(1)/.requirements.sha256 2>/dev/null)" != "$$req_sum" ]; then \
		py=$$($(call find-python,$(2),$(4))); \
		if [ -z "$$py" ]; then \
			echo "error: no Python $(2) found (tried PYTHON$(subst .,,$(2)), python$(2) on PATH, pyenv, uv)." >&2; \
			echo "  Install one with 'uv python install $(2)' or 'pyenv install $(2)'," >&2; \
			echo "  or point to it: make PYTHON$(subst .,,$(2))=/path/to/python$(2) ..." >&2; \
			exit 1; \
		fi; \
		echo "Setting up $(1) with $$py ($(3) changed or venv missing)"; \
		rm -rf $(1); \
		"$$py" -m venv $(1); \
		$(1)/bin/python -m pip install -q --upgrade pip; \
		$(1)/bin/python -m pip install -q -r $(3); \
		echo "$$req_sum" > $(1)/.requirements.sha256; \
	fi; \
	if [ "$$(cat $(1)/.package.sha256 2>/dev/null)" != "$$pkg_sum" ]; then \
		$(1)/bin/python -m pip install -q --no-deps -e .; \
		echo "$$pkg_sum" > $(1)/.package.sha256; \
	fi
endef

venv:
	$(call build-venv,$(PINNED),3.11,requirements.txt,$(PYTHON311))

venv-kaggle:
	$(call build-venv,$(KAGGLE),3.12,requirements-kaggle.txt,$(PYTHON312))

venv-colab:
	$(call build-venv,$(COLAB),3.13,requirements-colab.txt,$(PYTHON313))

venv-torchtpu:
	$(call build-venv,$(TORCHTPU),3.11,requirements-torchtpu.txt,$(PYTHON311))

demo: venv
	$(PINNED)/bin/python -m tpu_utility.demo

# The docs, every stack and the lane, even when one fails; fails if any failed.
test:
	@status=0; start=$$(date +%s); \
	for target in docs test-colab test-kaggle test-torchtpu test-pinned; do \
		t0=$$(date +%s); $(MAKE) --no-print-directory $$target || status=1; \
		echo "make test: $$target took $$(( $$(date +%s) - t0 )) s"; \
	done; \
	echo "make test: $$(( $$(date +%s) - start )) s in all"; \
	[ $$status -eq 0 ] && echo "make test: the docs and every stack passed" || echo "make test: the docs or a stack FAILED (see above)"; \
	exit $$status

test-pinned: venv
	@echo "== pinned stack: $$($(PINNED)/bin/python -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
	$(PINNED)/bin/python -m pytest $(PYTEST_ARGS) tests

test-kaggle: venv-kaggle
	@echo "== Kaggle stack: $$($(KAGGLE)/bin/python -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
	$(KAGGLE)/bin/python -m pytest $(PYTEST_ARGS) tests

# The Colab stack has the pinned stack's torch/torch_xla trio on a newer Python: it runs the suite
# but the longest files that run the same code on the same trio in the pinned stack (the README/docs
# blocks, the notebook, the kill-and-resume runs, the gloo multi-process runs, which the TorchTPU
# lane runs on torch 2.13 too); that keeps make test inside CI's 90 minutes (a fresh clone: docs
# 3.3 min, Colab 22.5 min with everything, Kaggle 28.2 min).
COLAB_SKIPS := --ignore=tests/test_readme.py --ignore=tests/test_notebook.py --ignore=tests/test_resume_safety.py \
	--ignore=tests/test_native.py

test-colab: venv-colab
	@echo "== Colab stack: $$($(COLAB)/bin/python -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
	$(COLAB)/bin/python -m pytest $(PYTEST_ARGS) $(COLAB_SKIPS) tests

test-torchtpu: venv-torchtpu
	@echo "== TorchTPU lane: $$(TPU_SKIP_MDS_QUERY=1 $(TORCHTPU)/bin/python -c 'import sys, torch; from importlib.metadata import version; print("Python", sys.version.split()[0], "torch", torch.__version__, "torch-tpu", version("torch-tpu"))')"
	TPU_SKIP_MDS_QUERY=1 $(TORCHTPU)/bin/python -m pytest $(PYTEST_ARGS) -p no:cacheprovider $(TORCHTPU_TESTS)

bench: venv
	$(PINNED)/bin/python -m pip install -q -r bench/requirements.txt
	$(PINNED)/bin/python bench/run.py
	$(PINNED)/bin/python bench/resnet_bench.py
	$(PINNED)/bin/python bench/text_bench.py
	$(PINNED)/bin/python bench/predict_bench.py
	$(PINNED)/bin/python bench/cache_bench.py

# The multi-device tests (pytest -m multidevice: 4 XLA:CPU devices, several gloo processes) STRESS_ROUNDS
# times in a row on the pinned stack while `stress` keeps STRESS_CPUS cores busy: they must not flake on a
# loaded host. Not part of make test (it is a soak, not a check of a change); needs `apt-get install stress`.
STRESS_ROUNDS ?= 10
STRESS_CPUS ?= 2
STRESS_TESTS ?= tests

stress: venv
	@command -v stress >/dev/null || { echo "make stress needs the stress tool: apt-get install stress" >&2; exit 1; }
	@stress --cpu $(STRESS_CPUS) --quiet & load=$$!; trap "kill $$load" EXIT; start=$$(date +%s); \
	for i in $$(seq $(STRESS_ROUNDS)); do \
		t0=$$(date +%s); \
		$(PINNED)/bin/python -m pytest -q -p no:cacheprovider -m multidevice $(STRESS_TESTS) \
			|| { echo "make stress: round $$i of $(STRESS_ROUNDS) FAILED"; exit 1; }; \
		echo "make stress: round $$i of $(STRESS_ROUNDS) passed in $$(( $$(date +%s) - t0 )) s, load $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	done; \
	echo "make stress: $(STRESS_ROUNDS) rounds in a row passed under stress --cpu $(STRESS_CPUS) in $$(( $$(date +%s) - start )) s"

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, a page left out
# of the nav or a docstring griffe cannot parse fails the build.
docs: venv
	$(PINNED)/bin/python -m mkdocs build --strict

# The wheel and sdist a notebook installs (docs/release.md); built offline from the venv's setuptools.
dist: venv
	rm -rf dist
	$(PINNED)/bin/python -m build --no-isolation --outdir dist .

clean:
	rm -rf $(PINNED) $(KAGGLE) $(COLAB) $(TORCHTPU) demo_out bench/out build dist site
