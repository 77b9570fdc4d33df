# The research experiments behind results/ (included from the top-level Makefile, which defines BIN and STAMP).
# Each target runs the command recorded in the `provenance` of the file it writes, with the thread count recorded
# there (OMP_NUM_THREADS=1 where `provenance.threads` is 1; otherwise torch's default, 2 on the 2-core machine that
# made them). Which target writes which file, and roughly how long it takes: experiments/README.md.
# Most of them need the data folder (../shared/data, or SYNCDROP_DATA) and take from minutes to hours on 2 cores.

EXP := experiments

.PHONY: ablation ablation-64 spd-sweep spd-profile recovery-zs lr-scan caat-ablation caat-ablation-seed1 \
	caat-latency lm-eval-parity \
	zero-shot-spd zero-shot-recovery zero-shot-gutenberg cost-model \
	recovery recovery-tp2 recovery-lr-scan recovery-calib recovery-e2e512 recovery-e2e1024 recovery-e2e \
	recovery-e2e-gutenberg recovery-e2e512-gutenberg recovery-e2e-gutenberg-only recovery-lora-scan \
	recovery-full recovery-order recovery-gap recovery-compare recovery-order-spread spd-compressed \
	compressed-ppl compressed-recovery compression-profile compressed-speed wire-codec memory

# ---- SPD block design, SPD fraction sweeps, B2B learning rate ------------------------------------------------

# residual placement of the SPD block, full WikiText-2 test set (resumes)
ablation: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/ablation_residual.py --tp 3 --seq-len 1024 \
		--variants dense,none,drop,naive,desync --resume --out results/ablation_residual_full

# the first 64 windows only (results/ablation_residual.{json,md})
ablation-64: $(STAMP)
	$(BIN)/python $(EXP)/ablation_residual.py --tp 3 --seq-len 1024 --max-windows 64 \
		--variants dense,none,drop,naive,desync --out results/ablation_residual

# --last-epoch: the committed sweeps keep the last epoch of each block, not the best one (docs/spd.md)
spd-sweep: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/spd_sweep.py --tp 3 --lr 1e-3 --variants b2b,hg+b2b --last-epoch \
		--out results/spd_sweep_tp3
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/spd_sweep.py --tp 2 --lr 1e-3 --variants b2b --last-epoch \
		--fractions 0,0.2,0.4,0.6,0.8,1.0 \
		--out results/spd_sweep_tp2
	$(BIN)/python $(EXP)/spd_sweep.py --tp 3 --lr 1e-3 --variants hg-head-channel+b2b --last-epoch \
		--fractions 0,0.5,1.0 --out results/spd_sweep_tp3_hg
	$(BIN)/python $(EXP)/bank_stats.py results/spd_sweep_tp3 results/spd_sweep_tp2 results/spd_sweep_tp3_hg

lr-scan: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/distill_lr_scan.py --tp 3 --blocks 3,20 --lrs 5e-5,3e-4,1e-3,3e-3 \
		--out results/distill_lr_scan

# ---- Recovery of dropped blocks (SmolLM2, TP=3 unless named) -------------------------------------------------

# zero-shot, B2B, HG+B2B, HG+B2B + end-to-end KL distillation and sequential HG+B2B at SPD 25/50/70/100%,
# WikiText-2 test (64 windows of 1024) with paired bootstrap intervals against dense; model directories in
# runs/recovery/tp3, every stage resumable (results/recovery/tp3/{recovery.json,recovery.md,recovery.png,times.json})
recovery: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.25,0.5,0.7,1.0 --methods zs,b2b,hg+b2b,hg+b2b+e2e,hg+seq \
		--windows 64 --block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-lr 3e-5 --out results/recovery/tp3
	for f in 0.7 1; do $(BIN)/python $(EXP)/recovery_scan_summary.py --work runs/recovery/tp3 --fraction $$f \
		--scan results/recovery/tp3 --out results/recovery/tp3/e2e_f$$f || exit 1; done

# the TP=3 zero-shot profile alone (the drop order of every TP=3 recovery run; spd-sweep computes it too, in
# results/spd_sweep_tp3/profile.json: the same order), and the zero-shot rows of `make recovery` alone
# (64 test windows, per-window NLLs equal to results/recovery/tp3/nll/'s), each in minutes
spd-profile: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m syncdrop profile --model smollm2 --tp 3 --calib wikitext2:valid --samples 4 \
		--seq-len 512 --out results/spd_profile_tp3/profile.json --no-png
recovery-zs: $(STAMP)
	$(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5,0.7 --methods zs --windows 64 \
		--out results/recovery/tp3_zs --work runs/recovery/tp3_zs

# the same sweep at TP=2 (syncdrop's uneven layout: 5 + 4 query heads), its own profile and banks
# (runs/recovery/tp2, results/recovery/tp2)
recovery-tp2: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 2 --fractions 0.25,0.5,0.7,1.0 --methods zs,b2b,hg+b2b,hg+b2b+e2e,hg+seq \
		--windows 64 --block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-lr 3e-5 --out results/recovery/tp2

# the end-to-end learning-rate scan at SPD 50% (the bank and the dense evaluation of `make recovery` reused)
recovery-lr-scan: $(STAMP)
	for lr in 1e-5 3e-5 1e-4; do \
		$(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b,hg+b2b+e2e --windows 64 \
			--block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-lr $$lr --work runs/recovery/tp3 \
			--out results/recovery/tp3_e2e_scan/full_lr$$lr || exit 1; done
	$(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b,hg+b2b+e2e --windows 64 \
		--block-samples 8 --block-epochs 10 --e2e-samples 64 --e2e-epochs 2 --e2e-lr 3e-5 --work runs/recovery/tp3 \
		--out results/recovery/tp3_e2e_scan/full_lr3e-5_ep2
	$(BIN)/python $(EXP)/recovery_scan_summary.py --work runs/recovery/tp3 --fraction 0.5 \
		--scan results/recovery/tp3_e2e_scan results/recovery/tp3 --out results/recovery/tp3_e2e_scan/scan

# calibration size beside `make recovery` (its dense evaluation reused): the block stage at SPD 50% (32 windows x 3
# epochs, 96 x 1, against 8 x 10), then end to end from the 32-window bank on 64 and on 128 valid windows (50% and 70%)
recovery-calib: $(STAMP)
	for n in 32 96; do mkdir -p results/recovery/tp3_bank$$n/nll; test -e results/recovery/tp3_bank$$n/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank$$n/nll/ || exit 1; done
	$(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b,hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 64 --e2e-lr 3e-5 --out results/recovery/tp3_bank32
	$(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b --windows 64 \
		--block-samples 96 --block-epochs 1 --out results/recovery/tp3_bank96
	mkdir -p results/recovery/tp3_bank32_e2e128/nll; test -e results/recovery/tp3_bank32_e2e128/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2e128/nll/
	$(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5,0.7 --methods hg+b2b,hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 128 --e2e-lr 3e-5 --out results/recovery/tp3_bank32_e2e128

# end to end on 512 WikiText-2 valid windows (534 windows of 512 in valid, 4 held out) from the 32-window bank, SPD
# 50%, 70% and 100%, on 64 test windows, then on all 304 (a committed result stands for its model directory: only
# missing points are trained)
recovery-e2e512: $(STAMP)
	$(MAKE) recovery-e2e ES=512 EN=512 EF=0.5,0.7,1.0 EOUT=e2e512

# the same text (WikiText-2 valid, 256 windows of 1024 tokens: the 512-token windows above, two by two) trained at
# the test window length, SPD 50%
recovery-e2e1024: $(STAMP)
	$(MAKE) recovery-e2e ES=1024 EN=256 EF=0.5 EOUT=e2e1024

# one end-to-end recipe from the 32 x 3 bank on 64 test windows, then on all 304 (ES: window length, EN: windows,
# EF: SPD fractions, EOUT: the results directories' suffix; EW: which of the two steps run, e.g. EW=64)
EW ?= 64 304
recovery-e2e: $(STAMP)
	for n in $(EW); do w=$$(echo "64:bank32_$(EOUT):tp3 304:full_$(EOUT):tp3_full" | tr ' ' '\n' | grep "^$$n:"); \
		r=$${w#*:}; d=$${r%%:*}; src=$${r#*:}; \
		mkdir -p results/recovery/tp3_$$d/nll; test -e results/recovery/tp3_$$d/nll/dense.json \
			|| cp results/recovery/$$src/nll/dense.json results/recovery/tp3_$$d/nll/ || exit 1; \
		OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions $(EF) --methods hg+b2b+e2e --windows $$n \
			--block-samples 32 --block-epochs 3 --e2e-samples $(EN) --e2e-seq-len $(ES) --e2e-lr 3e-5 \
			--out results/recovery/tp3_$$d || exit 1; done

# Gutenberg text for the end-to-end stage: SPD 70%, 512 windows of 512, the first 256 WikiText-2 valid windows and
# 256 Gutenberg windows (round robin over the 16 books)
recovery-e2e-gutenberg: $(STAMP)
	mkdir -p results/recovery/tp3_bank32_e2e256g256/nll; test -e results/recovery/tp3_bank32_e2e256g256/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2e256g256/nll/
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.7 --methods hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 256 --e2e-gutenberg 256 --e2e-lr 3e-5 \
		--out results/recovery/tp3_bank32_e2e256g256

# Gutenberg added to the 512 WikiText-2 valid windows: SPD 50%, 768 windows of 512 (the 512 valid ones of
# recovery-e2e512, then the 256 Gutenberg windows of recovery-e2e-gutenberg). EGF=0.5,0.7 adds the same mix at 70%
# (no committed result for it); two calls with one fraction each can run side by side into the same OUT
EGF ?= 0.5
recovery-e2e512-gutenberg: $(STAMP)
	mkdir -p results/recovery/tp3_bank32_e2e512g256/nll; test -e results/recovery/tp3_bank32_e2e512g256/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2e512g256/nll/
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions $(EGF) --methods hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 512 --e2e-gutenberg 256 --e2e-lr 3e-5 \
		--out results/recovery/tp3_bank32_e2e512g256

# Gutenberg books only (512 windows of 512, the first 256 being recovery-e2e-gutenberg's), SPD 70%
recovery-e2e-gutenberg-only: $(STAMP)
	mkdir -p results/recovery/tp3_bank32_e2eg512/nll; test -e results/recovery/tp3_bank32_e2eg512/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_bank32_e2eg512/nll/
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.7 --methods hg+b2b+e2e --windows 64 \
		--block-samples 32 --block-epochs 3 --e2e-samples 0 --e2e-gutenberg 512 --e2e-lr 3e-5 \
		--out results/recovery/tp3_bank32_e2eg512

# LoRA for the end-to-end stage (rank 8, alpha 16) at SPD 50% from the 32 x 3 bank on 64 valid windows, three
# learning rates (chosen by held-out KL); against full weights on the same windows (tp3_bank32) in recovery-compare
LORA_LRS ?= 1e-4 3e-4 1e-3
recovery-lora-scan: $(STAMP)
	for lr in $(LORA_LRS); do d=results/recovery/tp3_lora_scan/lora_lr$$lr; mkdir -p $$d/nll; \
		test -e $$d/nll/dense.json || cp results/recovery/tp3/nll/dense.json $$d/nll/ || exit 1; \
		OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5 --methods hg+b2b+e2e --windows 64 \
			--block-samples 32 --block-epochs 3 --e2e-samples 64 --e2e-adapter lora --e2e-lr $$lr --out $$d \
			|| exit 1; done
	$(BIN)/python $(EXP)/recovery_scan_summary.py --work runs/recovery/tp3 --fraction 0.5 \
		--scan results/recovery/tp3_lora_scan --out results/recovery/tp3_lora_scan/scan

# all 304 WikiText-2 test windows of 1024: HG+B2B bank 32 x 3, then e2e on 128 valid windows, at SPD 50% and 70%
# (models from `make recovery-calib`)
recovery-full: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --fractions 0.5,0.7 --methods hg+b2b+e2e --windows 304 \
		--block-samples 32 --block-epochs 3 --e2e-samples 128 --e2e-lr 3e-5 --out results/recovery/tp3_full

# the recovered drop order: a profile of the HG+B2B bank on valid windows 8-15 (not trained on), then HG+B2B in
# that order
recovery-order: $(STAMP)
	$(BIN)/syncdrop profile --model runs/recovery/tp3/bank_hg+b2b --tp 3 --calib wikitext2:valid --skip 8 --samples 8 \
		--seq-len 512 --out results/recovery/tp3_order/profile_recovered.json
	mkdir -p results/recovery/tp3_order/progressive/nll
	test -e results/recovery/tp3_order/progressive/nll/dense.json \
		|| cp results/recovery/tp3/nll/dense.json results/recovery/tp3_order/progressive/nll/
	$(BIN)/python $(EXP)/recovery_sweep.py --tp 3 --profile results/recovery/tp3_order/profile_recovered.json \
		--fractions 0.5,0.7,0.25 --methods hg+b2b --windows 64 --block-samples 8 --block-epochs 10 \
		--out results/recovery/tp3_order/progressive

# what limits recovery at SPD 50%: the same models on their calibration windows, on unseen valid windows (512 and
# 1024 tokens over the same text) and on test (results/recovery/tp3_gap/gap.{json,md})
recovery-gap: $(STAMP)
	$(BIN)/python $(EXP)/recovery_gap.py --tp 3 --out results/recovery/tp3_gap/gap --configs \
		"hg+b2b 8x10=runs/recovery/tp3/bank_hg+b2b@0.5,hg+b2b 32x3=runs/recovery/tp3/bank_hg+b2b_n32_ep3_s512@0.5,hg+b2b 8x10 + e2e=runs/recovery/tp3/hg+b2b+e2e_f0.5_full_lr3e-05_n64_ep1"

# paired comparisons of the runs above on the same test windows (64; all 304 where named; TP=3, and TP=2 where
# named; "first 64 windows": a 304-window evaluation's first 64, the 64-window runs' windows)
# (results/recovery/tp3_compare.{json,md})
R3 := results/recovery/tp3
R2 := results/recovery/tp2
recovery-compare: $(STAMP)
	$(BIN)/python $(EXP)/recovery_compare.py --out $(R3)_compare \
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

# ---- Zero-shot accuracy (lm-evaluation-harness on the local task files) ---------------------------------------

# lm-eval's own `hf` model against syncdrop at TP=1 and TP=3, first 20 documents of every task
lm-eval-parity: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/lm_eval_parity.py --limit 20 --out results/lm_eval_parity

zero-shot-spd: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/zero_shot_spd.py --tp 3 --limit 100 --mmlu-limit 5 \
		--out results/zero_shot_spd

# dense and the recovered models at SPD 50% and 70% (models from `make recovery-calib`: e2e on 128 windows; and
# SPD 70% from `make recovery-e2e512`: e2e on 512 windows) on the 8 local tasks, 500 documents each (MMLU: 9 per
# subject, 513), paired per-document differences; resumable per task (results/zero_shot_recovery/runs/<config>/)
zero-shot-recovery: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/zero_shot_spd.py --tp 3 --fractions "" --limit 500 --mmlu-limit 9 \
		--model-dirs "best 50%=runs/recovery/tp3/hg+b2b+e2e_f0.5_full_lr3e-05_n128_ep1_n32_ep3_s512,best 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n128_ep1_n32_ep3_s512,e2e512 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n512_ep1_n32_ep3_s512" \
		--out results/zero_shot_recovery

# dense, SPD 50% without training, and the SPD 70% models trained end to end on Gutenberg text (recovery-e2e-gutenberg:
# half of it; recovery-e2e-gutenberg-only: all of it) on the same 500 documents per task as zero-shot-recovery; the
# per-task files under results/zero_shot_gutenberg/runs/ hold every document's accuracy, so the table rebuilds from
# them on a clone that has no model directories
ZS_G256 := e2e256+g256 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n256_ep1_g256_n32_ep3_s512
ZS_G512 := e2e g512 70%=runs/recovery/tp3/hg+b2b+e2e_f0.7_full_lr3e-05_n0_ep1_g512_n32_ep3_s512
zero-shot-gutenberg: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/zero_shot_spd.py --tp 3 --fractions 0.5 --variants zs --limit 500 --mmlu-limit 9 \
		--model-dirs "$(ZS_G256),$(ZS_G512)" --out results/zero_shot_gutenberg

# ---- Partial channel reduce (CAAT-Net) ------------------------------------------------------------------------

caat-ablation: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/caat_ablation.py --steps 400 --warmup 40 --out results/caat_ablation

# the second seed: 4 of the 8 variants
caat-ablation-seed1: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/caat_ablation.py --steps 400 --warmup 40 --seed 1 \
		--variants "p=1,p=0.5,p=0,p=0.5 no sqrt(N)" --out results/caat_ablation_seed1

# reuses the raw files committed under results/caat_latency/ (train.json, ppl_*.json, bench_*.json) and
# only rebuilds results/caat_latency.{json,md} from them; delete them to retrain and remeasure
caat-latency: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python $(EXP)/caat_latency.py --out results/caat_latency

# ---- Cost model -----------------------------------------------------------------------------------------------

# the cost model per TP degree, calibrated and checked inside one run: `syncdrop bench --links` interleaves the
# un-emulated link and two emulated ones like the plans (every rep runs every plan on every link), so machine drift
# hits calibration and check alike (results/cost_model_runs/tp{2,3}_<link>.json); then the LLaMA2-70B / 8 x A100
# prediction beside the paper (seconds)
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

# how much end-to-end recovery moves with the window order, count and held-out window (docs/spd.md); needs the
# block stage of `make demo` (runs/demo)
recovery-order-spread: $(STAMP)
	$(BIN)/python $(EXP)/recovery_order_spread.py --run runs/demo --fraction 0.5 \
		--out results/recovery_order_spread/demo_spd050

# ---- Compressed sync points -----------------------------------------------------------------------------------

# Compressed sync points (docs/compression.md): perplexity of wire formats, SPD and both against dense, paired per
# window (SmolLM2 TP=3, zero-shot; 16 windows for every configuration and the Hadamard-rotated int4, all 304 for
# int8 and fp8), and zero-shot accuracy of int8 and fp8 against dense on 500 documents of three tasks
compressed-ppl: $(STAMP)
	$(BIN)/python benchmarks/compressed_ppl.py --tp 3 --windows 16 --out results/compressed_ppl/tp3
	$(BIN)/python benchmarks/compressed_ppl.py --tp 3 --windows 16 --configs int4,int4:g32,int4h,int4h:g32,spd:0.7+int4h:g32 \
		--out results/compressed_ppl/tp3_hadamard
	$(BIN)/python benchmarks/compressed_ppl.py --tp 3 --windows 304 --configs int8,fp8 --out results/compressed_ppl/tp3_all304
	$(BIN)/python benchmarks/compressed_zero_shot.py --tp 3 --configs int8,fp8 \
		--tasks arc_easy,piqa,lambada_openai --limit 500 --out results/compressed_zero_shot/tp3_500

# recovery through the compressed all-reduce: every block of SmolLM2 TP=3 trained end to end under int4 (plain, then
# Hadamard-rotated) in groups of 32 (64 WikiText-2 valid windows of 512, one epoch), then scored on the 16 test
# windows of compressed-ppl; the rotated one also on all 304 and on 500 zero-shot documents of three tasks
compressed-recovery: $(STAMP)
	$(BIN)/syncdrop distill --model smollm2 --tp 3 --plan int4:g32 --method e2e --samples 64 --heldout 2 \
		--seq-len 512 --calib wikitext2:valid --out runs/int4g32_e2e
	$(BIN)/python benchmarks/compressed_ppl.py --model runs/int4g32_e2e --tp 3 --windows 16 --configs int4:g32 \
		--out results/compressed_ppl/tp3_int4g32_e2e
	$(BIN)/syncdrop distill --model smollm2 --tp 3 --plan int4h:g32 --method e2e --samples 64 --heldout 2 \
		--seq-len 512 --calib wikitext2:valid --out runs/int4hg32_e2e
	$(BIN)/python benchmarks/compressed_ppl.py --model runs/int4hg32_e2e --tp 3 --windows 16 --configs int4h:g32 \
		--out results/compressed_ppl/tp3_int4hg32_e2e
	$(BIN)/python benchmarks/compressed_ppl.py --model runs/int4hg32_e2e --tp 3 --windows 304 --configs int4h:g32 \
		--out results/compressed_ppl/tp3_int4hg32_e2e304
	$(BIN)/python benchmarks/compressed_zero_shot.py --model runs/int4hg32_e2e --tp 3 --configs int4h:g32 \
		--tasks arc_easy,piqa,lambada_openai --limit 500 --out results/compressed_zero_shot/tp3_500_int4hg32_e2e

# every sync point's sensitivity to int8 and to int4 in groups of 32 (SmolLM2 TP=3, 8 WikiText-2 valid windows of 512)
compression-profile: $(STAMP)
	$(BIN)/syncdrop profile --model smollm2 --tp 3 --wire int8 --out results/compression_profile/tp3_int8.json
	$(BIN)/syncdrop profile --model smollm2 --tp 3 --wire int4:g32 --out results/compression_profile/tp3_int4g32.json

# compressed sync side by side (docs/compression.md): dense with fp32 and bf16 wires, SPD 70%, int8, int4 and both
# combined, in vLLM with the plugin, stock vLLM and syncdrop's runtime (TP=2: synthetic 8-head model; TP=3: SmolLM2)
COMPRESSED_PLANS = none,bf16,frac:0.7,int8,int4,frac:0.7+int8,frac:0.7+int4
compressed-speed: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/vllm_latency.py --model runs/synthetic_8h --synthetic --tp 2 --decode-tokens 4 \
		--link-bandwidth 100MB/s --link-latency 50us --plans $(COMPRESSED_PLANS) --out results/compressed_speed/tp2_100MBps
	$(BIN)/python benchmarks/vllm_latency.py --model runs/synthetic_8h --synthetic --tp 2 --decode-tokens 4 \
		--link-bandwidth 1GB/s --link-latency 50us --plans $(COMPRESSED_PLANS) --out results/compressed_speed/tp2_1GBps
	$(BIN)/python benchmarks/vllm_latency.py --model runs/synthetic_8h --synthetic --tp 2 --decode-tokens 4 \
		--link-bandwidth 100MB/s --link-latency 50us --plans $(BUDGET_PLANS) --parts vllm,syncdrop \
		--out results/compressed_speed/tp2_100MBps_budget
	$(BIN)/python benchmarks/vllm_latency.py --tp 3 --decode-tokens 4 --link-bandwidth 100MB/s --link-latency 50us \
		--plans $(COMPRESSED_PLANS) --out results/compressed_speed/tp3_100MBps
	$(BIN)/python benchmarks/vllm_latency.py --tp 3 --decode-tokens 4 --link-bandwidth 1GB/s --link-latency 50us \
		--plans $(COMPRESSED_PLANS) --out results/compressed_speed/tp3_1GBps

# the plans that hold (or come nearest) the accuracy budget of docs/compression.md, beside dense with a bf16 wire
BUDGET_PLANS = none,bf16,int8,frac:0.25+int8,frac:0.5+int8,int4h:g32

# one rank's encode/decode time per sync point against the link time its bytes save
wire-codec: $(STAMP)
	$(BIN)/python benchmarks/wire_codec.py --out results/wire_codec/cpu

# ---- SPD with compressed sync points on the rest -------------------------------------------------------------

# SPD 25%, 50% and 70% of SmolLM2 TP=3 (the profile's order) recovered as `recovery-full` does (head grouping + B2B,
# 32 windows x 3 epochs at lr 1e-3, one bank for all fractions; then end to end on 128 WikiText-2 valid windows of 512
# at 3e-5) but trained end to end through int8 on every sync point kept, every block trained; scored on all 304
# test windows and on 500 documents of three zero-shot tasks (dense's caches reused from compressed-ppl)
SC := runs/spd_compressed
SC_FRACTIONS := 025 050 070
spd-compressed: $(STAMP)
	mkdir -p $(SC)
	$(foreach f,$(SC_FRACTIONS),$(BIN)/syncdrop plan --profile results/spd_sweep_tp3/profile.json --spd 0.$(f:0%=%) \
		--out $(SC)/spd$(f).json &&) true
	$(BIN)/syncdrop distill --model smollm2 --tp 3 --plan $(SC)/spd070.json --tier hg+b2b --samples 32 --epochs 3 \
		--lr 1e-3 --heldout 4 --seq-len 512 --calib wikitext2:valid --out $(SC)/bank
	$(foreach f,$(SC_FRACTIONS),$(BIN)/syncdrop distill --model $(SC)/bank --tp 3 --plan $(SC)/spd$(f).json+int8 \
		--method e2e --samples 128 --heldout 4 --seq-len 512 --calib wikitext2:valid --out $(SC)/spd$(f)_int8_e2e &&) true
	$(foreach f,$(SC_FRACTIONS),mkdir -p results/compressed_ppl/tp3_spd$(f)_int8_e2e304_nll \
		results/compressed_zero_shot/tp3_500_spd$(f)_int8_e2e_docs \
		&& cp -n results/compressed_ppl/tp3_all304_nll/f769d3d60a0757b4.json results/compressed_ppl/tp3_spd$(f)_int8_e2e304_nll/ \
		&& cp -n results/compressed_zero_shot/tp3_500_docs/fc162c4fdf23f9ef.json \
			results/compressed_zero_shot/tp3_500_spd$(f)_int8_e2e_docs/ \
		&& $(BIN)/python benchmarks/compressed_ppl.py --model $(SC)/spd$(f)_int8_e2e --tp 3 --windows 304 \
			--configs spd:0.$(f:0%=%)+int8 --out results/compressed_ppl/tp3_spd$(f)_int8_e2e304 \
		&& $(BIN)/python benchmarks/compressed_zero_shot.py --model $(SC)/spd$(f)_int8_e2e --tp 3 \
			--configs spd:0.$(f:0%=%)+int8 --tasks arc_easy,piqa,lambada_openai --limit 500 \
			--out results/compressed_zero_shot/tp3_500_spd$(f)_int8_e2e &&) true
	$(BIN)/python $(EXP)/recovery_compare.py --out results/compressed_ppl/tp3_spd_int8_vs_spd \
		$(foreach f,050 070,--pair "SPD 0.$(f:0%=%) + int8 (all blocks e2e through int8) / SPD 0.$(f:0%=%) (dropped blocks e2e), \
			128 windows each=results/compressed_ppl/tp3_spd$(f)_int8_e2e304.json#spd:0.$(f:0%=%)+int8:$\
			results/recovery/tp3_full/nll/hg+b2b+e2e_f0.$(patsubst %0,%,$(f:0%=%)).json")

# ---- memory -------------------------------------------------------------------------------------------------

# peak memory of export, and of profile / distill / ppl streamed, on random-weight bfloat16 Llamas (docs/memory.md);
# the models (2.9-4.3 GB each) are written under MEMORY_WORK, outside the repository
MEMORY_WORK ?= /tmp/syncdrop_memory
memory: $(STAMP)
	$(BIN)/python benchmarks/memory_export.py --out results/memory/export
	$(BIN)/python benchmarks/memory_pipeline.py --work $(MEMORY_WORK)/32l --layers 32 --seq-len 32 \
		--out results/memory/pipeline
	$(BIN)/python benchmarks/memory_pipeline.py --work $(MEMORY_WORK)/48l --layers 48 --seq-len 32 \
		--out results/memory/pipeline_48l
