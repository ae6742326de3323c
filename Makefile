# make demo   set up (venv, dependencies, data) and run the main job on the embedded default
# make test   set up and run the whole test suite
# make bench  set up and run the side-by-side benchmarks (see BENCHMARKS.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GPT2 := $(VENV)/bin/gpt2
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(GPT2) info gpt2
	@echo
	@echo "The weights below are RANDOM (no training yet): the text is noise, the machinery is real."
	$(PY) -c "import torch; from gpt2 import GPT, GPTConfig; m = GPT(GPTConfig.preset('gpt2')).eval(); \
	  ids = torch.tensor([[464, 1893, 286]]); print('logits', tuple(m(ids).shape))"

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
