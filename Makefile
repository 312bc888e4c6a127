# Two commands do everything on a fresh machine (README):  make book   ·   make test
# The virtual environment is created and filled on first use; torch is pinned to the CPU build.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# uv installs .venv's packages but torch (pip takes that: uv does not read the local wheel).
# .venv-floor too (its torch is linked from .venv, its metadata copied so that uv sees it).
UV_PIN ?= uv==0.13.9
UV     := $(VENV)/bin/uv
TORCH_PIN ?= torch==2.13.0
# Where the CPU build of torch comes from when no local wheel satisfies TORCH_PIN (PyPI's
# default torch for Linux is the multi-GB CUDA build). Empty: plain pip (whatever it resolves).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# Exact versions CI uses (pyproject.toml keeps ranges). Empty: resolve the ranges afresh.
CONSTRAINTS ?= constraints.txt
# pytest-xdist workers. The main pass runs three on two cores: its workers wait on
# kernels starting and pages settling, and a third one fills those waits (measured on
# 2 cores: 448 s with three, 490-500 s with two). make floor alone runs two.
JOBS   ?= 3
FLOOR_JOBS ?= 2
# The CPU kernel path nbval checks the stored outputs on (make nb stores them from the
# native path). auto: coursekit.kernelpath probes the candidates below the native level
# (AVX2, then the generic kernels; ATen, oneDNN and MKL capped together) and takes the
# first that works on this CPU.
# A path name (generic, avx2, native) or VAR=value pairs force one, still probed first;
# empty means native. `make nbval NB=... NBVAL_ENV=` checks on the native path.
NBVAL_ENV ?= auto
KERNEL_ARGS := $(VENV)/kernel-path.args
NBVAL_OPTS = --nbval-sanitize-with tests/nbval_sanitize.cfg -p tests.nbval_plugin \
             $$(cat $(KERNEL_ARGS))
# Per-stage wall times of make test (tests/stages.py), printed at the end.
STAGE_LOG := $(VENV)/test-stages.jsonl
export PYTHONHASHSEED := 0

.PHONY: book test unit nbval browser venv nb labs labs-check lab clean browser-deps bench tidy floor floor-venv \
        kernel-path sandbox-deps

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch first: a local wheel if there is one, else PyTorch's CPU wheel index,
	# else plain pip (an unpinned torch from PyPI would be the multi-GB CUDA build).
	$(PY) -m pip install -q --no-index --no-deps "$(TORCH_PIN)" 2>/dev/null \
	  || { [ -n "$(TORCH_INDEX)" ] && $(PY) -m pip install -q --retries 1 --timeout 30 \
	         --index-url "$(TORCH_INDEX)" "$(TORCH_PIN)"; } \
	  || $(PY) -m pip install -q "$(TORCH_PIN)"
	# The rest with uv (seconds; pip takes most of a minute), pip where uv cannot be had.
	# --compile-bytecode as pip does: uv leaves no .pyc by default, and where
	# PYTHONDONTWRITEBYTECODE is set (CI machines) every process would then compile
	# transformers, peft and sympy from source on import (importing torch,
	# transformers, peft and ipykernel: 8.1 s of CPU against 5.4 s; make test starts
	# that many kernels and workers a hundred times and more).
	{ $(PY) -m pip install -q "$(UV_PIN)" && $(UV) pip install -q --compile-bytecode \
	    --python $(PY) -e ".[dev]" "$(TORCH_PIN)" $(if $(CONSTRAINTS),-c $(CONSTRAINTS)); } \
	  || $(PY) -m pip install -q -e ".[dev]" "$(TORCH_PIN)" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course)" >/dev/null
	touch $(STAMP)

venv: $(STAMP)

# The floor environment: transformers, peft, numpy, IPython, ipykernel, ipywidgets at the lower bounds
# pyproject.toml declares (older Colab images), read by coursekit.floor. It reuses .venv's CPU torch
# through symlinks: torch is never downloaded or reinstalled there.
FLOOR_VENV  := .venv-floor
FLOOR_PY    := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed
$(FLOOR_STAMP): $(STAMP) pyproject.toml coursekit/floor.py
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(PY) -m coursekit.floor link-torch $(FLOOR_VENV)
	$(PY) -m coursekit.floor constraints > $(FLOOR_VENV)/constraints.txt
	{ test -x $(UV) && $(UV) pip install -q --compile-bytecode --python $(FLOOR_PY) \
	    -c $(FLOOR_VENV)/constraints.txt $$($(PY) -m coursekit.floor requirements); } \
	  || $(FLOOR_PY) -m pip install -q -c $(FLOOR_VENV)/constraints.txt \
	       $$($(PY) -m coursekit.floor requirements)
	$(FLOOR_PY) -m pip check
	$(FLOOR_PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course, floor)" >/dev/null
	touch $(FLOOR_STAMP)

floor-venv: $(FLOOR_STAMP)

## make floor — every chapter and solution executed top to bottom in a kernel started from
## .venv-floor (errors only outside cells tagged raises-exception fail; outputs are not
## compared: that is nbval's job). Its own pass after make test's main one.
floor: $(FLOOR_STAMP)
	COURSE_FLOOR_VENV=$(CURDIR)/$(FLOOR_VENV) $(PY) -m pytest -n $(FLOOR_JOBS) --dist loadfile \
	    -p tests.schedule -q tests/test_floor.py --timeout=900 -p no:cacheprovider --durations=5

## make book — build the HTML book from the stored notebook outputs (warnings are errors).
## npm ci installs Pyodide (package-lock.json) for the in-page calculator; the site serves it.
node_modules/.package-lock.json: package.json package-lock.json
	npm ci --no-audit --no-fund

book: $(STAMP) node_modules/.package-lock.json
	$(VENV)/bin/jupyter-book build . -W --keep-going
	@echo "book: $(CURDIR)/_build/html/index.html"

## make test — everything: unit tests, nbval over book/ and solutions/ (exact outputs as text,
## declared measured numbers within their tolerance; on the kernel path the probe chose; GPU
## cells run in place at CPU size, COURSE_GPU=cpu, and checked), labs regenerated, grader, book build with -W, browser tests
## (one pytest pass whose units tests/schedule.py queues heaviest first); then the same
## chapters and solutions executed at the declared floor versions (make floor). Both passes
## saturate two cores: one pass running both took as long (715 s against 546 + 159 s).
## Ends with the wall time of each stage and the slowest test files.
# The published rows' estimates are replayed once per run and shared by the processes
# that show them (coursekit.published: keyed by trainmem's code, the model's Shape as
# each process's transformers builds it, and the options); emptied at the start.
ESTIMATE_CACHE := $(VENV)/estimate-cache
test: export COURSE_ESTIMATE_CACHE = $(CURDIR)/$(ESTIMATE_CACHE)
# .venv-floor is set up before the timed stages, like .venv (set-up, not a test stage)
test: $(STAMP) $(FLOOR_STAMP) browser-deps sandbox-deps
	@rm -f $(STAGE_LOG); rm -rf $(ESTIMATE_CACHE)
	@t0=$$(date +%s); $(MAKE) --no-print-directory kernel-path \
	  && $(PY) -m tests.stages since $(STAGE_LOG) "kernel-path probe" $$t0
	@t0=$$(date +%s); set -x; COURSE_STAGE_LOG=$(CURDIR)/$(STAGE_LOG) $(PY) -m pytest -n $(JOBS) \
	    --dist loadfile --no-loadscope-reorder -q tests book solutions -m "not floor" \
	    --nbval --timeout=1200 --nbval-cell-timeout=600 -p tests.stages -p tests.schedule \
	    $(NBVAL_OPTS) --durations=15; \
	  rc=$$?; set +x; $(PY) -m tests.stages since $(STAGE_LOG) "main pass (pytest -n $(JOBS))" $$t0; \
	  exit $$rc
	@t0=$$(date +%s); $(MAKE) --no-print-directory floor \
	  && $(PY) -m tests.stages since $(STAGE_LOG) "floor pass (make floor)" $$t0
	@echo "make test: wall time per stage"; $(PY) -m tests.stages show $(STAGE_LOG)

## make kernel-path — print the CPU, probe the kernel path nbval validates on (NBVAL_ENV),
## and write nbval's --kernel-env arguments for it.
kernel-path: $(STAMP)
	@$(PY) -m coursekit.kernelpath --force "$(or $(NBVAL_ENV),native)" --args-file $(KERNEL_ARGS)

unit: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

## make nbval NB=book/01_number_formats.ipynb — validate one notebook against its stored outputs
## (on the NBVAL_ENV kernel path; NBVAL_ENV= for the native one).
nbval: $(STAMP) kernel-path
	$(PY) -m pytest -q --nbval $(NB) $(NBVAL_OPTS)

## make nb NB=book/01_number_formats.ipynb — re-execute a notebook in place (refresh stored outputs;
## native kernel path, COURSE_GPU=auto with GPUs hidden: see coursekit/execute.py).
nb: $(STAMP)
	$(PY) -m coursekit execute $(NB)

## make tidy — authoring plumbing off the page (coursekit tidy) and code formatted to 88 columns
## (ruff) in book/ and solutions/ and in the Python packages, tests and benchmarks. Then
## re-execute what changed (make nb) and run make labs.
RUFF_PATHS = book solutions trainmem coursekit tests benchmarks _ext
tidy: $(STAMP)
	$(PY) -m coursekit tidy book solutions
	$(VENV)/bin/ruff format $(RUFF_PATHS)
	$(VENV)/bin/ruff check --fix --output-format concise $(RUFF_PATHS) || true
	$(VENV)/bin/ruff format $(RUFF_PATHS)

labs: $(STAMP)
	$(PY) -m coursekit labs

labs-check: $(STAMP)
	$(PY) -m coursekit labs --check

## make lab — the labs in JupyterLab on the course's .venv, for a student without Colab.
## JupyterLab (the optional extra `lab` in pyproject.toml) is installed on first use, with
## the same constraints as .venv; the default install (and CI) never pulls it. The labs are
## copied once into $(LAB_DIR)/ (not tracked by git), where the student's work lives: a
## later `git pull` or `make labs` never touches it, and only labs not there yet are added.
LAB_DIR   ?= my-labs
LAB_STAMP := $(VENV)/.lab-installed
LAB_ARGS  ?=
$(LAB_STAMP): $(STAMP) pyproject.toml
	{ test -x $(UV) && $(UV) pip install -q --compile-bytecode --python $(PY) -e ".[lab]" \
	    "$(TORCH_PIN)" $(if $(CONSTRAINTS),-c $(CONSTRAINTS)); } \
	  || $(PY) -m pip install -q -e ".[lab]" "$(TORCH_PIN)" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(LAB_STAMP)

lab: $(LAB_STAMP)
	mkdir -p $(LAB_DIR)
	cp -n labs/*.ipynb $(LAB_DIR)/
	$(VENV)/bin/jupyter lab --notebook-dir="$(CURDIR)/$(LAB_DIR)" $(LAB_ARGS)

## Chromium and a CJK font for the browser tests (Debian packages; needs root or sudo). Skipped
## if present. Under CI=true a failed install is an error: the browser tests never skip there.
browser-deps:
	@missing=""; command -v chromium >/dev/null 2>&1 || missing="chromium chromium-driver"; \
	  fc-list :lang=zh 2>/dev/null | grep -q . || missing="$$missing fonts-noto-cjk"; \
	  [ -z "$$missing" ] || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing $$missing (browser tests)"; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null \
	  || { if [ "$$CI" = true ]; then \
	         echo "ERROR: could not install $$missing; the browser tests need them." \
	              "Fix: apt-get install -y chromium chromium-driver fonts-noto-cjk"; exit 1; \
	       else echo "WARNING: could not install $$missing; browser tests will be skipped" \
	              "(apt-get install -y chromium chromium-driver fonts-noto-cjk)"; fi; }; }

## bubblewrap for the grader's sandbox (Debian package; needs root or sudo). Skipped if present;
## without it the sandbox tests fail under CI=true (and are skipped elsewhere).
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq bubblewrap >/dev/null \
	  || { if [ "$$CI" = true ]; then \
	         echo "ERROR: could not install bubblewrap; the grader's sandbox tests need it." \
	              "Fix: apt-get install -y bubblewrap"; exit 1; \
	       else echo "WARNING: could not install bubblewrap (sudo apt-get install bubblewrap)"; fi; }; }

## Benchmarks print tables (ours vs a reference, measured in the same run); never timed tests.
bench: $(STAMP)
	$(PY) benchmarks/memory_accuracy.py
	$(PY) benchmarks/grading_bench.py
	$(PY) benchmarks/process_start.py
	$(PY) benchmarks/dev_loop.py --skip-setup
	$(PY) benchmarks/calculator_load.py

clean:
	rm -rf _build
