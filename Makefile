# make demo   set up (venv, dependencies, data) and run the main job on the embedded default
# make test   set up and run the whole test suite
# make bench  set up and run the side-by-side benchmarks (see BENCHMARKS.md); builds llama.cpp once
# make bench-cpu   just the CPU inference benchmark: ours vs llama.cpp vs Transformers
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GPT2 := $(VENV)/bin/gpt2
STAMP := $(VENV)/.installed

BENCH_VENV := .bench-venv
BENCH_STAMP := $(BENCH_VENV)/.installed
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36

.PHONY: setup demo test bench bench-cpu clean

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

# On a CPU with AMX, llama.cpp is compiled without its AMX kernels: in 0.3.36 they die with a general
# protection fault at `ldtilecfg` (ggml_backend_amx_mul_mat, every Q8_0 and Q4_0 model; seen on an Intel
# Xeon with AMX-BF16/INT8, 2026-12-03; llama.cpp PR 26954). -march=native stays, so it keeps every other
# path (AVX-512, VNNI, BF16, its repacked Q4_0/Q8_0); GCC lets an explicit -mno-* win over -march.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS := $(if $(shell grep -m1 -ow amx_tile /proc/cpuinfo 2>/dev/null),-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)')

# The benchmark venv: llama-cpp-python compiled from source (~6 min on 2 cores, once), and llama.cpp's
# GGUF converter (convert_hf_to_gguf.py, gguf-py) unpacked from the same sdist. Never used by tests.
# --no-cache-dir: pip's wheel cache would hand back a build made with other flags.
$(BENCH_STAMP): Makefile
	rm -rf $(BENCH_VENV)
	$(PYTHON) -m venv $(BENCH_VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BENCH_VENV)/bin/pip install -q --disable-pip-version-check --no-cache-dir \
		$(LLAMA_CPP_PYTHON) numpy
	rm -rf $(BENCH_VENV)/sdist $(BENCH_VENV)/llama.cpp && mkdir -p $(BENCH_VENV)/sdist $(BENCH_VENV)/llama.cpp
	$(BENCH_VENV)/bin/pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
		$(LLAMA_CPP_PYTHON) -d $(BENCH_VENV)/sdist
	tar xzf $(BENCH_VENV)/sdist/*.tar.gz -C $(BENCH_VENV)/llama.cpp --strip-components=3 \
		--wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/gguf-py' \
		'*/vendor/llama.cpp/conversion'
	touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

bench-cpu: $(STAMP) $(BENCH_STAMP)
	$(PY) benchmarks/bench_cpu_inference.py --rounds 3

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache
