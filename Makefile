# The README's two commands: `make demo` and `make test`. Both set up .venv on first use.
VENV   ?= .venv
PYTHON ?= python3
# The CPU wheel of torch. A GPU machine sets TORCH_SPEC to its CUDA build, e.g. `make demo TORCH_SPEC=torch==2.13.0`
# with the PyTorch CUDA index configured for pip; everything else resolves against what is installed.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install demo test test-all bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: install data/corpus
	$(PY) examples/elastic_resume.py --recipe recipes/demo.toml

# The demo's real-text corpus: stdlib docstrings and sources, written once (deterministic per Python version).
data/corpus: | install
	$(VENV)/bin/zephon-ray corpus $@.tmp && mv $@.tmp $@

test: install
	$(PY) -m pytest -q -ra

# Long chaos, soak and slow end-to-end runs (see README).
test-all: install
	$(PY) -m pytest -q -ra -m ''

bench: install
	$(PY) benchmarks/bench_core.py && $(PY) benchmarks/bench_service.py && $(PY) benchmarks/bench_loader.py

clean:
	rm -rf $(VENV) *.egg-info
