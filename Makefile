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
	$(GPT2) prepare shakespeare --out data/shakespeare
	rm -rf runs/quickstart
	$(GPT2) train --preset quickstart --data data/shakespeare --out runs/quickstart
	$(GPT2) generate --model runs/quickstart --max-new-tokens 80 --temperature 0.8 --top-k 200 --seed 0 --num-samples 2 "ROMEO:"
	@echo
	@echo "checkpoint: runs/quickstart/$$(cat runs/quickstart/LATEST)   (gpt2 generate --model runs/quickstart ...)"
	@echo "loss curve: runs/quickstart/loss.png   metrics: runs/quickstart/metrics.jsonl"

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
