# Two commands for a new user: `make demo` and `make test`. CI runs `make test-all`.
#
#   make test       the pinned stack (.venv): builds it if needed, runs the whole suite (three pytest
#                   workers), the strict docs build among its tests. 492 s from a fresh clone here.
#   make test-all   CI's matrix: `make test`, then one lane per other stack, each running only what
#                   can differ there (below). 1,534 s from a fresh clone here (4 min of it a hung fork, killed); each part's time printed.
#
# The stacks, each in its own venv, built the same way:
#   .venv           pinned: Python 3.11, torch/torch_xla 2.9.0, torchvision 0.24.0 (requirements.txt)
#   .venv-kaggle    Kaggle's TPU image: Python 3.12, torch/torch_xla 2.8.0, torchvision 0.23.0, and
#                   transformers 5.0.0, the oldest supported
#                   (requirements-kaggle.txt)
#   .venv-colab     Colab's TPU runtime: Python 3.13, torch/torch_xla 2.9.0, torchvision 0.24.0,
#                   transformers 5.15.0, accelerate 1.14.0, datasets 4.8.5 as Colab ships them
#                   (requirements-colab.txt)
#   .venv-torchtpu  TorchTPU: Python 3.11, torch 2.13 + torch-tpu 0.2.0 + libtpu, no torch_xla
#                   (requirements-torchtpu.txt)
# What each lane runs, and why (the files and a reason for each are listed in tests/conftest.py):
#   both lanes      also -m hf_release: the Hugging Face files (masks, LLM losses and peft, generate's
#                   cache, export, meta models, HF ports) on their lane's transformers
#   test-kaggle     -m torch_release: torch/torch_xla 2.8, so every test whose result can move with the
#                   release: the backend and setup, compile counts and host syncs, SPMD and launch,
#                   torch.compile with inductor's C++ build (TPU_UTILITY_TEST_INDUCTOR=1; the pinned stack
#                   compiles those runs through aot_eager: tests/test_compile.py says why),
#                   autocast, checkpoint formats, transformers' torch-version branches, the README/docs
#                   blocks and the notebook. Its Python 3.12 lies between the pinned 3.11 and Colab's 3.13.
#   test-colab      -m python_release: the pinned trio on Python 3.13, so what the Python version can
#                   change: imports, packaging, the notebook's kernel, progress bars, spawned and forked
#                   processes, file writes, the README/docs blocks.
#   test-torchtpu   tests/test_native.py, test_replicas.py and test_torchtpu.py: the code that lane has (no
#                   torch_xla there), the native multi-process suite on torch 2.13 with torch-tpu.
#   Left to the pinned stack alone: logic on the host and over the backend (schedule, data, buckets,
#   monitor, epoch metrics, errors, disk-full, remote files, layout, docs), the
#   hand-loop ports and the platform check (their backend calls are in the lanes), and gloo on torch 2.8
#   (torch 2.9 here, 2.13 in the TorchTPU lane). tests/conftest.py gives each listed file's reason; a test
#   narrows its file's lanes with @pytest.mark.lanes(...), the reason beside it (the porter's ported CUDA
#   loops, 130 s with their plain-CPU originals, run on the pinned stack alone).
# A venv is rebuilt from scratch when its requirements change (the stamp holds their
# checksum); a change to pyproject.toml or setup.py only re-runs the editable install.
#
# One stack, one file or one test: make test-pinned (the suite alone), test-kaggle,
# test-colab, test-torchtpu, docs; .venv/bin/python -m pytest tests/test_fit.py -k find_lr.
# PYTEST_ARGS adds pytest options (PYTEST_ARGS="-x -k fit"), PYTEST_JOBS sets the workers (0: none, the suite in one process).
# The interpreters are found on PATH, in pyenv or in uv;
# PYTHON311=/path/to/python3.11 (or PYTHON312, PYTHON313) choose one by hand.

export PJRT_DEVICE ?= CPU

PINNED := .venv
KAGGLE := .venv-kaggle
COLAB := .venv-colab
TORCHTPU := .venv-torchtpu
# what the TorchTPU lane runs: the code that lane has (no torch_xla there)
TORCHTPU_TESTS := tests/test_native.py tests/test_replicas.py tests/test_torchtpu.py tests/test_fsdp_native.py
KAGGLE_TESTS := -m "torch_release or hf_release" tests
COLAB_TESTS := -m "python_release or hf_release" tests
PYTEST_ARGS ?= -q
# pytest-xdist workers: a test spends much of its time in one-threaded XLA compiles, starting
# interpreters and waiting on its child processes; three workers keep both cores of a 2-core host
# busy. --dist load hands tests out in collection order, the long ones first (tests/conftest.py).
PYTEST_JOBS ?= 3
PYTEST := -m pytest -n $(PYTEST_JOBS) --dist load $(PYTEST_ARGS)

.PHONY: venv venv-kaggle venv-colab venv-torchtpu demo test test-all test-pinned test-kaggle test-colab test-torchtpu docs bench gpu-check stress dist clean

# $(call find-python,3.12,$(PYTHON312)): prints the first interpreter of that version.
define find-python
for p in $(2) python$(1) $$(pyenv root 2>/dev/null)/versions/$(1)*/bin/python$(1) \
	$$HOME/.pyenv/versions/$(1)*/bin/python$(1) $$(uv python find $(1) 2>/dev/null); do \
	if [ -n "$$p" ] && "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(1))))' 2>/dev/null; then \
		echo "$$p"; break; fi; done
endef
comma := ,

# $(call build-venv,DIR,PYTHON_VERSION,REQUIREMENTS,OVERRIDE): (re)builds DIR when needed. uv installs the
# requirements: 31 s for the pinned stack's 7.6 GB where pip took 3 min 26 s (both with nothing cached);
# pip's find-links (wheels on this disk, such as a CPU torch) are passed on to it. --compile-bytecode, as pip
# does: without .pyc files the first import compiles each module, and on Python 3.12+ a library's invalid
# escape then prints a SyntaxWarning into a notebook's output (test_progress's kernel caught one).
UV_FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
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
		$(1)/bin/python -m pip install -q --upgrade pip uv; \
		$(1)/bin/python -m uv pip install -q --compile-bytecode --python $(1)/bin/python $(UV_FIND_LINKS) -r $(3); \
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

# $(call timed,TARGETS,LABEL): runs each target even when one fails, prints each one's time; fails if any failed.
define timed
	@status=0; start=$$(date +%s); \
	for target in $(1); do \
		t0=$$(date +%s); $(MAKE) --no-print-directory $$target || status=1; \
		echo "$(2): $$target took $$(( $$(date +%s) - t0 )) s"; \
	done; \
	echo "$(2): $$(( $$(date +%s) - start )) s in all"; \
	[ $$status -eq 0 ] && echo "$(2): $(1) passed" || echo "$(2): $(1): one FAILED (see above)"; \
	exit $$status
endef

# The README's test command: the pinned venv and the whole suite, which builds the docs strictly too
# (tests/test_docs.py runs `mkdocs build --strict`, as `make docs` does).
test:
	$(call timed,venv test-pinned,make test)

# CI's matrix: make test, then the lanes of the other stacks (what each runs: the top of this file).
test-all:
	$(call timed,test test-kaggle test-colab test-torchtpu,make test-all)

test-pinned: venv
	@echo "== pinned stack: $$($(PINNED)/bin/python -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
	$(PINNED)/bin/python $(PYTEST) tests

test-kaggle: venv-kaggle
	@echo "== Kaggle lane: $$($(KAGGLE)/bin/python -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
	TPU_UTILITY_TEST_INDUCTOR=1 $(KAGGLE)/bin/python $(PYTEST) $(KAGGLE_TESTS)

test-colab: venv-colab
	@echo "== Colab lane: $$($(COLAB)/bin/python -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
	$(COLAB)/bin/python $(PYTEST) $(COLAB_TESTS)

test-torchtpu: venv-torchtpu
	@echo "== TorchTPU lane: $$(TPU_SKIP_MDS_QUERY=1 $(TORCHTPU)/bin/python -c 'import sys, torch; from importlib.metadata import version; print("Python", sys.version.split()[0], "torch", torch.__version__, "torch-tpu", version("torch-tpu"))')"
	TPU_SKIP_MDS_QUERY=1 $(TORCHTPU)/bin/python $(PYTEST) -p no:cacheprovider $(TORCHTPU_TESTS)

# the peers' packages installed as the venv's are, bytecode compiled: pip compiles none under PYTHONDONTWRITEBYTECODE,
# and transformers then imports accelerate from source in every test process afterwards
bench: venv
	$(PINNED)/bin/python -m uv pip install -q --compile-bytecode --python $(PINNED)/bin/python $(UV_FIND_LINKS) -r bench/requirements.txt
	$(PINNED)/bin/python bench/run.py
	$(PINNED)/bin/python bench/host_bench.py
	$(PINNED)/bin/python bench/native_bench.py
	$(PINNED)/bin/python bench/compile_bench.py
	$(PINNED)/bin/python bench/scan_bench.py
	$(PINNED)/bin/python bench/instructions.py xla
	$(PINNED)/bin/python bench/instructions.py native
	$(PINNED)/bin/python bench/resnet_bench.py
	$(PINNED)/bin/python bench/text_bench.py
	$(PINNED)/bin/python bench/packing_bench.py
	$(PINNED)/bin/python bench/predict_bench.py
	$(PINNED)/bin/python bench/generate_bench.py
	$(PINNED)/bin/python bench/cache_bench.py
	PJRT_DEVICE=CPU $(PINNED)/bin/python bench/port_bench.py
	$(PINNED)/bin/python bench/memory_bench.py
	$(PINNED)/bin/python bench/memory_bench.py xla

# Every check that needs a GPU in one command and one table, under 8 minutes on an H200 (bench/gpu_check.py: the
# CUDA-marked tests, the compile bench's 300M Llama, the memory plans against measured peaks, generate against
# model.generate). Run it whenever a GPU is lent (docs/developers.md). A lent machine has its image's Python with
# torch and transformers and cannot install anything, so a python3 that sees CUDA is used as it is; elsewhere the
# pinned venv runs the dry run (the same code on the CPU at small shapes, exit 0).
gpu-check:
	@if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then \
		python3 bench/gpu_check.py; \
	else \
		$(MAKE) --no-print-directory venv && $(PINNED)/bin/python bench/gpu_check.py; \
	fi

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
		TPU_UTILITY_EXIT_RUNS=2 $(PINNED)/bin/python -m pytest -q -p no:cacheprovider -m multidevice $(STRESS_TESTS) \
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
