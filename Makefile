# Two commands from a fresh clone:  `make demo`  and  `make test`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
STAMP      := $(VENV)/.treadle-installed
SOURCES    := $(shell find csrc triton_kernels python -name '*.py' -o -name '*.cpp' -o -name '*.cu' -o -name '*.h' 2>/dev/null) setup.py pyproject.toml MANIFEST.in CMakeLists.txt requirements-dev.txt

.PHONY: setup demo test bench bench-guard check-cuda dist clean mutate docs docs-build

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) $(SOURCES)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -r requirements-dev.txt
	# the GPU image's triton, for bench/gpu_aot.py's sm_90a compile only (kept off the venv's import path)
	$(PIP) install -q --no-deps --target $(VENV)/aot-triton "triton==3.6.0"
	$(PIP) install -q --no-deps "verl==0.9.1" "bfcl-eval==2026.3.23"
	# --no-build-isolation: treadle._C is compiled against the torch installed above (see pyproject.toml)
	$(PIP) install -q --no-build-isolation -e .
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/treadle demo

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

# The docs site: build/site, served on http://127.0.0.1:8000 (docs-build: build only, strict)
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict

docs-build: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: setup
	$(VENV)/bin/treadle bench --report

bench-guard: setup
	$(PY) bench/guard.py

# sdist + wheel in dist/, the wheel built from the sdist against the installed torch (needs `build`)
dist: setup
	$(PY) -m build --no-isolation --outdir dist .

# Mutation testing (not part of `make test`; tests/MUTATION.md): mutmut on the core modules, one area at a
# time in build/mutate/<area>/ with that area's fast tests. `make mutate AREAS="grpo reference"` picks areas.
AREAS ?=
mutate: setup
	$(PIP) install -q "mutmut==3.8.1"
	$(PY) tests/mutation/mutate.py $(AREAS)

check-cuda:
	bash tests/build/nvcc_check.sh

clean:
	rm -rf build dist python/treadle/_C*.so $(STAMP)
