"""Recovery beyond block-wise B2B (issue 16): sequential B2B and end-to-end KL distillation, on a tiny model,
against the dense model they distil (the teacher) and the simulated executor that runs their output."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from syncdrop.cli import main
from syncdrop.errors import SyncdropError
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.sharding import distilled_layouts
from syncdrop.plan import SyncPlan
from syncdrop.runtime import choose_runtime
from syncdrop.spd.distill import DistillSettings, distill
from syncdrop.spd.e2e import ADAPTER_FILE, STATE_FILE, E2ESettings, Student, e2e_distill, kl_to_teacher

TP = 2


def _windows(vocab: int, n: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _held_kl(model_spec: str, dense_spec: str, windows: torch.Tensor) -> float:
    """Mean KL(dense || model) over ``windows``: both run by the simulated executor, the model under its own plan."""
    m = choose_runtime("simulated", "cpu").build(model_spec, TP, None, progress=False).model
    d = choose_runtime("simulated", "cpu").build(dense_spec, TP, "none", progress=False).model
    with torch.inference_mode():
        return sum(kl_to_teacher(m.logits(m.hidden_states(w[None])), d.logits(d.hidden_states(w[None]))).item()
                   for w in windows) / len(windows)


def test_sequential_b2b_is_at_least_as_good_as_blockwise(tiny_llama_dir, tmp_path) -> None:
    """Both blocks dropped; the second block's student sees the first's error in sequential B2B. On held-out
    windows the whole SPD model is closer to the dense one (KL) after sequential than after block-wise B2B."""
    src = resolve_model(str(tiny_llama_dir))
    plan = SyncPlan.uniform(src.config.num_layers, "drop")
    w = _windows(src.config.vocab_size, 12, 32, seed=0)
    held = _windows(src.config.vocab_size, 6, 32, seed=99)
    kl = {}
    for method in ("b2b", "sequential"):
        out = tmp_path / method
        distill(src, TP, plan, {0: "b2b", 1: "b2b"}, w[:10], w[10:], out,
                DistillSettings(lr=3e-3, epochs=6, keep_best=False, method=method), {"dataset": "ids"}, progress=False)
        kl[method] = _held_kl(str(out), str(tiny_llama_dir), held)
    assert kl["sequential"] <= kl["b2b"], kl


def test_sequential_resume_reuses_blocks_and_recomputes_the_stream(tiny_llama_dir, tmp_path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    plan = SyncPlan.uniform(src.config.num_layers, "drop")
    w = _windows(src.config.vocab_size, 6, 16, seed=1)
    s = DistillSettings(lr=3e-3, epochs=2, method="sequential")
    first = distill(src, TP, plan, {0: "b2b", 1: "b2b"}, w[:4], w[4:], tmp_path / "a", s, {"d": 1}, progress=False)
    (tmp_path / "a" / "blocks" / "block_001.safetensors").unlink()  # as if interrupted during block 1
    again = distill(src, TP, plan, {0: "b2b", 1: "b2b"}, w[:4], w[4:], tmp_path / "a", s, {"d": 1}, progress=False)
    assert again["blocks"]["1"]["stats"]["heldout_loss"] == first["blocks"]["1"]["stats"]["heldout_loss"]


def _e2e(start: str, out, stop_after=None, adapter="full", epochs=2, lr=2e-3, n_train=4, seq=24, schedule="constant"):
    src = resolve_model(start)
    w = _windows(src.config.vocab_size, n_train + 4, seq, seed=2)
    plan = SyncPlan.uniform(src.config.num_layers, "drop")
    s = E2ESettings(lr=lr, epochs=epochs, adapter=adapter, rank=4, alpha=8.0, ckpt_every=3, lr_schedule=schedule)
    return e2e_distill(start, TP, plan, w[:n_train], w[n_train:], out, s, {"dataset": "ids"}, progress=False,
                       stop_after=stop_after)


def test_e2e_lowers_held_out_kl(tiny_llama_dir, tmp_path) -> None:
    """From the zero-shot SPD model (every block dropped), 3 epochs over 16 windows: the held-out KL to the
    dense model falls, as the run reports it and as the simulated executor measures it on the output."""
    m = _e2e(str(tiny_llama_dir), tmp_path / "e2e", epochs=3, lr=3e-4, n_train=16, seq=32)
    st = m["distill"]["e2e"]
    assert st["heldout_kl"] < 0.95 * st["heldout_kl_start"], st["heldout_curve"]
    held = _windows(resolve_model(str(tiny_llama_dir)).config.vocab_size, 20, 32, seed=2)[16:]
    zero_shot = tmp_path / "zs_plan.json"
    SyncPlan.uniform(2, "drop").save(zero_shot)
    dense = str(tiny_llama_dir)
    m_zs = choose_runtime("simulated", "cpu").build(dense, TP, str(zero_shot), progress=False).model
    d = choose_runtime("simulated", "cpu").build(dense, TP, "none", progress=False).model
    with torch.inference_mode():
        kl_zs = sum(kl_to_teacher(m_zs.logits(m_zs.hidden_states(x[None])), d.logits(d.hidden_states(x[None]))).item()
                    for x in held) / len(held)
    assert abs(kl_zs - st["heldout_kl_start"]) < 1e-6
    assert abs(_held_kl(str(tmp_path / "e2e"), dense, held) - st["heldout_kl"]) < 1e-6


def test_e2e_keeps_the_head_grouping_of_its_b2b_start(tiny_llama_dir, tmp_path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    plan = SyncPlan.uniform(src.config.num_layers, "drop")
    w = _windows(src.config.vocab_size, 8, 24, seed=2)
    distill(src, TP, plan, {0: "hg+b2b", 1: "b2b"}, w[:4], w[4:], tmp_path / "b2b",
            DistillSettings(lr=1e-3, epochs=2), {"dataset": "ids"}, progress=False)
    m = _e2e(str(tmp_path / "b2b"), tmp_path / "e2e", epochs=1)
    assert m["distill"]["e2e"]["heldout_kl"] <= m["distill"]["e2e"]["heldout_kl_start"]  # never worse: best epoch
    out = resolve_model(str(tmp_path / "e2e")).spd
    start = resolve_model(str(tmp_path / "b2b")).spd
    assert out.blocks[0]["head_order"] == start.blocks[0]["head_order"]
    assert out.blocks[0]["ffn_order"] == start.blocks[0]["ffn_order"]
    assert {e["tier"] for e in out.blocks.values()} == {"e2e"} and not (tmp_path / "e2e" / STATE_FILE).exists()


def test_merged_lora_adapters_give_the_unmerged_logits(tiny_qwen2_dir, tmp_path) -> None:
    m = _e2e(str(tiny_qwen2_dir), tmp_path / "lora", adapter="lora")
    assert m["distill"]["e2e"]["adapter"] == "lora"
    factors = load_file(str(tmp_path / "lora" / ADAPTER_FILE))
    assert any(v.abs().max() > 0 for k, v in factors.items() if k.endswith("lora_B"))  # the update is not nothing
    src = resolve_model(str(tiny_qwen2_dir))
    from syncdrop.models.config import layer_names, model_names

    plan = SyncPlan.uniform(src.config.num_layers, "drop")
    base = {n: src.reader.get(n) for n in model_names(src.config)}
    trainable = [n for i in plan.dropped for n in layer_names(i, src.config)]
    student = Student(base, trainable, E2ESettings(adapter="lora", rank=4, alpha=8.0), src.config, TP, plan, {},
                      torch.device("cpu"))
    with torch.no_grad():
        for k, p in student.params.items():
            p.copy_(factors[k])
    ids = _windows(src.config.vocab_size, 1, 20, seed=5)
    merged = choose_runtime("simulated", "cpu").build(str(tmp_path / "lora"), TP, None, progress=False).model
    with torch.no_grad():
        unmerged = student.logits(ids)
    with torch.inference_mode():
        got = merged.logits(merged.hidden_states(ids))
    torch.testing.assert_close(got, unmerged, atol=1e-5, rtol=0)
    assert distilled_layouts(resolve_model(str(tmp_path / "lora")).spd, src.config) == {}


def test_interrupted_e2e_resumes_to_the_same_result(tiny_llama_dir, tmp_path) -> None:
    whole = _e2e(str(tiny_llama_dir), tmp_path / "whole")
    assert _e2e(str(tiny_llama_dir), tmp_path / "cut", stop_after=5) == {"stopped_at": 5}
    assert (tmp_path / "cut" / STATE_FILE).is_file() and not (tmp_path / "cut" / "syncdrop.json").exists()
    resumed = _e2e(str(tiny_llama_dir), tmp_path / "cut")
    assert resumed["distill"]["e2e"]["train_curve"] == whole["distill"]["e2e"]["train_curve"]
    for i in ("0", "1"):
        a = load_file(str(tmp_path / "whole" / whole["blocks"][i]["file"]))
        b = load_file(str(tmp_path / "cut" / resumed["blocks"][i]["file"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_linear_lr_schedule_decays_to_zero_and_resumes_exactly(tiny_llama_dir, tmp_path) -> None:
    """``lr_schedule="linear"``: step k of n trains at lr (1 - k / n); it changes the result (against the
    constant rate), and an interrupted run resumes to the same weights (the rate follows the global step)."""
    s = E2ESettings(lr=1e-3, lr_schedule="linear")
    assert [s.lr_at(k, 4) for k in range(4)] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert E2ESettings(lr=1e-3).lr_at(3, 4) == 1e-3
    with pytest.raises(SyncdropError, match="e2e_lr_schedule"):
        E2ESettings(lr_schedule="cosine").check()
    whole = _e2e(str(tiny_llama_dir), tmp_path / "whole", schedule="linear")
    const = _e2e(str(tiny_llama_dir), tmp_path / "const")
    assert whole["distill"]["e2e"]["train_curve"][1:] != const["distill"]["e2e"]["train_curve"][1:]
    assert _e2e(str(tiny_llama_dir), tmp_path / "cut", stop_after=5, schedule="linear") == {"stopped_at": 5}
    resumed = _e2e(str(tiny_llama_dir), tmp_path / "cut", schedule="linear")
    assert resumed["distill"]["e2e"]["train_curve"] == whole["distill"]["e2e"]["train_curve"]
    for i in ("0", "1"):
        a = load_file(str(tmp_path / "whole" / whole["blocks"][i]["file"]))
        b = load_file(str(tmp_path / "cut" / resumed["blocks"][i]["file"]))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_distill_cli_methods_and_bad_input(tiny_llama_dir, text_file, tmp_path, capsys) -> None:
    base = ["distill", "--model", str(tiny_llama_dir), "--tp", "2", "--plan", "all", "--calib", str(text_file),
            "--samples", "2", "--heldout", "1", "--seq-len", "16", "--epochs", "1", "-q"]
    assert main([*base, "--method", "sequential+e2e", "--e2e-adapter", "lora", "--out", str(tmp_path / "x")]) == 0
    assert "end to end (lora): held-out KL" in capsys.readouterr().out
    assert resolve_model(str(tmp_path / "x")).spd.blocks[0]["tier"] == "e2e"
    assert resolve_model(str(tmp_path / "x" / "blockwise")).spd.blocks[0]["tier"] == "b2b"
    for args, message in ((["--method", "magic"], "--method: invalid choice"),
                          (["--method", "b2b+e2e", "--e2e-epochs", "0"], "--e2e-epochs must be at least 1"),
                          (["--method", "b2b+e2e", "--e2e-lr", "-1"], "--e2e-lr must be a positive number")):
        try:
            code = main([*base, *args, "--out", str(tmp_path / "bad")])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        assert code == 2 and message in capsys.readouterr().err, args


# ---------------------------------------------------------------------------- recovery within a time budget


def test_recovery_budget_parsing_and_bad_budgets_exit_2(capsys) -> None:
    from syncdrop.errors import SyncdropError
    from syncdrop.spd.recovery import parse_duration

    assert parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400 and parse_duration("90s") == 90
    assert parse_duration("0") == 0
    for bad in ("soon", "-5m", "30 parsecs", ""):
        try:
            parse_duration(bad)
            raise AssertionError(bad)
        except SyncdropError as e:
            assert "--recovery-budget" in str(e)
    for args, message in ((["--recovery-budget", "soon"], "--recovery-budget 'soon'"),
                          (["--e2e-samples", "0"], "--e2e-samples must be at least 1"),
                          (["--e2e-samples", "many"], "--e2e-samples 'many': expected a number of windows or auto"),
                          (["--e2e-lr", "0"], "--e2e-lr must be a positive number")):
        assert main(["auto", *args, "--out", "/tmp/never"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, args


def test_allocate_spends_the_budget_on_the_largest_candidates_first() -> None:
    """The block stage first (else all zero-shot); then end to end for the candidates that drop most."""
    from syncdrop.spd.recovery import Candidate, E2ECost, allocate

    cands = [Candidate("0", 0, 0), Candidate("0.5", 3, 2), Candidate("1", 6, 4)]
    # block stage 100 s, each end-to-end run 50 s (8 windows + 2 held-out forwards, 5 s each)
    cost = E2ECost(5.0, epochs=1, held=1)
    full = allocate(200, cands, 100, 1.0, cost, 8, 64)
    assert full.methods == {"0": "zs", "0.5": "b2b+e2e", "1": "b2b+e2e"} and full.total_s == 200
    assert full.e2e_windows == {"0.5": 8, "1": 8}
    one = allocate(170, cands, 100, 1.0, cost, 8, 64)
    assert one.methods == {"0": "zs", "0.5": "b2b", "1": "b2b+e2e"} and one.total_s == 150
    assert any("0.5" in n for n in one.notes)
    none = allocate(99, cands, 100, 1.0, cost, 8, 64)
    assert set(none.methods.values()) == {"zs"} and not none.block_stage and "over the" in none.notes[0]
    # nothing tiered for B2B: end to end from the zero-shot blocks
    zs_only = allocate(60, [Candidate("1", 6, 0)], 0, 0.0, cost, 8, 64)
    assert zs_only.methods == {"1": "e2e"} and not zs_only.block_stage


def test_auto_windows_spend_what_the_block_stage_leaves() -> None:
    """windows=None: the candidates that drop most get the stage while each can have MIN_E2E_WINDOWS, then
    share the time left equally (as many windows as fit, never more than there are), within the budget."""
    from syncdrop.spd.recovery import MIN_E2E_WINDOWS, Candidate, E2ECost, allocate

    cands = [Candidate("0", 0, 0), Candidate("0.5", 3, 2), Candidate("1", 6, 4)]
    cost = E2ECost(2.0, epochs=1, held=1)  # n windows: (n + 2) x 2 s
    both = allocate(100 + 2 * 2.0 * (40 + 2), cands, 100, 1.0, cost, None, 500)
    assert both.e2e_windows == {"0.5": 40, "1": 40} and both.total_s == pytest.approx(both.budget_s)
    # room for one candidate's minimum only: the one dropping most gets it all
    one = allocate(100 + 2.0 * (MIN_E2E_WINDOWS + 2) + 10, cands, 100, 1.0, cost, None, 500)
    assert one.e2e_windows == {"1": MIN_E2E_WINDOWS + 5} and one.methods["0.5"] == "b2b"
    assert any("0.5" in n and f"{MIN_E2E_WINDOWS} windows" in n for n in one.notes)
    # capped at the calibration windows there are; the rest of the budget is not spent
    capped = allocate(10_000, cands, 100, 1.0, cost, None, 25)
    assert capped.e2e_windows == {"0.5": 25, "1": 25} and capped.total_s < capped.budget_s
    # fewer windows than the minimum: every one of them, and still within the budget
    few = allocate(10_000, cands, 100, 1.0, cost, None, 3)
    assert few.e2e_windows == {"0.5": 3, "1": 3}
    for plan in (both, one, capped, few):
        assert plan.total_s <= plan.budget_s + 1e-9


def test_probes_run_real_steps(tiny_llama_dir, tmp_path) -> None:
    """The probes run real training steps (of block 0, of the whole plan) and return a time (no timing is
    asserted beyond being a duration: timing belongs in benchmarks)."""
    from syncdrop.spd.e2e import probe_step_s
    from syncdrop.spd.recovery import probe_block_step_s

    source = resolve_model(str(tiny_llama_dir))
    w = _windows(source.config.vocab_size, 1, 32, 0)
    block = probe_block_step_s(source, TP, w, torch.device("cpu"))
    e2e = probe_step_s(str(tiny_llama_dir), TP, SyncPlan.uniform(source.config.num_layers, "drop"), w)
    assert all(math.isfinite(t) and t > 0 for t in (block, e2e))


def _benchmark(name: str = "recovery_sweep"):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_result_outlives_its_model_directory(tiny_llama_dir, tmp_path) -> None:
    """experiments/recovery_sweep.py: the per-window NLL its ``evaluate`` wrote for a distilled directory stands
    for that directory once the directory is gone (a fresh clone), and only then; other windows or another
    plan never match."""
    import shutil

    sweep = _benchmark()
    src = resolve_model(str(tiny_llama_dir))
    plan = SyncPlan.uniform(src.config.num_layers, "drop")
    w = _windows(src.config.vocab_size, 8, 16, seed=5)
    model = tmp_path / "runs" / "b2b"
    distill(src, TP, plan, {0: "b2b", 1: "b2b"}, w[:4], w[4:6], model, DistillSettings(lr=1e-3, epochs=1),
            {"dataset": "ids"}, progress=False)
    nll_path = tmp_path / "nll.json"
    test = _windows(src.config.vocab_size, 3, 16, seed=6)
    nll = sweep.evaluate(str(model), TP, plan, test, nll_path, chunk=2)
    assert sweep.kept_result(str(model), TP, plan, test, nll_path) is None  # the directory decides while it exists
    shutil.rmtree(model)
    assert sweep.kept_result(str(model), TP, plan, test, nll_path) == nll
    assert sweep.kept_result(str(model), TP, plan, test[:2], nll_path) is None
    assert sweep.kept_result(str(model), TP, SyncPlan.dropping(2, [0]), test, nll_path) is None
    assert sweep.kept_result(str(tmp_path / "other"), TP, plan, test, nll_path) is None


def test_compare_on_the_first_windows_of_a_longer_evaluation(tiny_llama_dir, tmp_path, capsys) -> None:
    """experiments/recovery_compare.py ``@N``: the first N windows of a longer evaluation are the windows of an
    N-window one (the model's ratio to itself there is exactly 1); against another model the ratio is its own;
    files of other lengths, and N beyond a file, exit with the reason."""
    import json

    import pytest

    sweep, compare = _benchmark(), _benchmark("recovery_compare")
    src = resolve_model(str(tiny_llama_dir))
    dense, drop = SyncPlan.uniform(2), SyncPlan.uniform(2, "drop")
    test = _windows(src.config.vocab_size, 5, 16, seed=7)
    long, short, other = tmp_path / "long.json", tmp_path / "short.json", tmp_path / "drop.json"
    sweep.evaluate(str(tiny_llama_dir), TP, dense, test, long, chunk=2)
    sweep.evaluate(str(tiny_llama_dir), TP, dense, test[:3], short, chunk=2)
    sweep.evaluate(str(tiny_llama_dir), TP, drop, test[:3], other, chunk=2)
    assert compare.main(["--out", str(tmp_path / "cmp"), "--pair", f"same={long}:{short}@3",
                         "--pair", f"drop={other}:{long}@3"]) == 0
    rows = json.loads((tmp_path / "cmp.json").read_text())["rows"]
    assert rows[0]["ratio"] == pytest.approx(1.0, abs=1e-12) and not rows[0]["significant"]
    a, b = (json.loads(p.read_text())["window_nll"][:3] for p in (other, long))
    assert rows[1]["ratio"] == pytest.approx(math.exp((sum(a) - sum(b)) / 3), rel=1e-9)
    for bad in (f"x={long}:{short}", f"x={long}:{short}@4", f"x={long}:{short}@0"):
        with pytest.raises(SystemExit, match="--pair"):
            compare.main(["--out", str(tmp_path / "bad"), "--pair", bad])


def test_sweep_rows_carry_the_e2e_curve_and_the_scan_summary_keeps_its_file(tiny_llama_dir, tmp_path) -> None:
    """experiments/recovery_sweep.py ``e2e_curve``: an end-to-end directory's held-out KL curve as its manifest
    records it (start, then one value per epoch), None once the directory is gone; and
    experiments/recovery_scan_summary.py leaves an existing summary alone when it finds no curve at all."""
    import json
    import shutil

    sweep, summary = _benchmark(), _benchmark("recovery_scan_summary")
    made = _e2e(str(tiny_llama_dir), tmp_path / "work" / "b2b+e2e_f1_full")
    # a model directory that no scanned sweep trained is another recipe's: not listed
    (tmp_path / "results").mkdir()
    assert summary.main(["--work", str(tmp_path / "work"), "--fraction", "1", "--scan", str(tmp_path / "results"),
                         "--out", str(tmp_path / "other")]) == 0
    assert json.loads((tmp_path / "other.json").read_text())["rows"] == []
    shutil.move(tmp_path / "work" / "b2b+e2e_f1_full", tmp_path / "e2e")
    curve = sweep.e2e_curve(tmp_path / "e2e")
    st = made["distill"]["e2e"]
    assert curve["heldout_curve"] == st["heldout_curve"]
    assert len(curve["heldout_curve"]) == made["distill"]["epochs"] + 1
    assert curve["selected_epoch"] == st["selected_epoch"] and curve["adapter"] == made["distill"]["adapter"]
    shutil.rmtree(tmp_path / "e2e")
    assert sweep.e2e_curve(tmp_path / "e2e") is None
    out = tmp_path / "scan"
    (tmp_path / "scan.json").write_text(json.dumps({"rows": ["earlier"]}))
    assert summary.main(["--work", str(tmp_path / "none"), "--scan", str(tmp_path), "--out", str(out)]) == 0
    assert json.loads((tmp_path / "scan.json").read_text()) == {"rows": ["earlier"]}


def test_two_sweeps_into_one_out_keep_both_stage_times(tmp_path) -> None:
    """experiments/recovery_sweep.py ``Times``: two sweeps that share an OUT (two fractions side by side) both
    read the files before either stage ends; each stage's time survives the other's write, and a stage that is
    already on disk is not timed again."""
    import json

    sweep = _benchmark()
    a, b = sweep.Times(tmp_path / "times.json"), sweep.Times(tmp_path / "times.json")
    a.run("e2e:f0.7", lambda: None)
    b.run("e2e:f0.5", lambda: None)
    times = json.loads((tmp_path / "times.json").read_text())
    cond = json.loads((tmp_path / "times_conditions.json").read_text())
    assert set(times) == set(cond) == {"e2e:f0.7", "e2e:f0.5"}
    first = times["e2e:f0.7"]
    b.run("e2e:f0.7", lambda: None)  # b has read a's stage: kept as it was
    assert json.loads((tmp_path / "times.json").read_text())["e2e:f0.7"] == first


def test_zero_shot_keeps_a_gone_model_directory_from_its_task_files(tmp_path) -> None:
    """experiments/zero_shot_spd.py: a ``--model-dirs`` configuration whose directory is gone is rebuilt from
    its per-task files only when every task is there, scored from that directory at these limits."""
    import json

    zs = _benchmark("zero_shot_spd")
    spec, tasks = "runs/gone", ["sciq", "mmlu"]
    for task, lim in (("sciq", 500), ("mmlu", 9)):
        path = tmp_path / "runs" / "cfg" / f"{task}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": {"spec": spec, "task": task, "limit": lim},
                                    "metrics": {"acc": 0.5, "n": 2, "doc_acc": {"0": 1, "1": 0}}, "seconds": 1.0,
                                    "plan": {"blocks": [{"attn": "drop"}, {}]}, "plan_summary": "1/2 dropped"}))
    kept = zs._kept_config("cfg", spec, tasks, 500, 9, tmp_path)
    assert kept is not None and set(kept["tasks"]) == set(tasks) and kept["plan_summary"] == "1/2 dropped"
    assert SyncPlan.from_dict(kept["plan"], 2).dropped == [0]
    assert zs._kept_config("cfg", "runs/other", tasks, 500, 9, tmp_path) is None  # another directory's
    assert zs._kept_config("cfg", spec, tasks, 100, 9, tmp_path) is None  # another limit
    assert zs._kept_config("cfg", spec, [*tasks, "piqa"], 500, 9, tmp_path) is None  # a task missing


def test_bf16_e2e_trains_float32_masters(tiny_llama_dir, tmp_path) -> None:
    """End to end in bfloat16: the KL falls, the block files hold float32 masters, and the held-out KL it
    reports is what the bfloat16 simulated executor measures on the written directory."""
    src = resolve_model(str(tiny_llama_dir))
    w = _windows(src.config.vocab_size, 20, 32, seed=2)
    plan = SyncPlan.uniform(src.config.num_layers, "drop")
    m = e2e_distill(str(tiny_llama_dir), TP, plan, w[:16], w[16:], tmp_path / "e2e",
                    E2ESettings(lr=3e-4, epochs=3), {"dataset": "ids"}, progress=False, dtype=torch.bfloat16)
    st = m["distill"]["e2e"]
    assert st["heldout_kl"] < 0.95 * st["heldout_kl_start"], st["heldout_curve"]
    from safetensors.torch import load_file

    blocks = sorted((tmp_path / "e2e" / "blocks").glob("*.safetensors"))
    assert blocks and all(t.dtype == torch.float32 for f in blocks for t in load_file(f).values())
    rt = choose_runtime("simulated", "cpu", dtype="bfloat16")
    mdl = rt.build(str(tmp_path / "e2e"), TP, None, progress=False).model
    dense = rt.build(str(tiny_llama_dir), TP, "none", progress=False).model
    with torch.inference_mode():
        kl = sum(kl_to_teacher(mdl.logits(mdl.hidden_states(x[None])), dense.logits(dense.hidden_states(x[None])))
                 .item() for x in w[16:]) / 4
    assert kl == pytest.approx(st["heldout_kl"], rel=1e-5)


def test_e2e_trains_through_a_compressed_wire(tiny_llama_dir, tmp_path) -> None:
    """Plan int4:g8 (every sync point in int4, nothing dropped): end-to-end distillation trains every block
    through the two-step all-reduce (its straight-through gradient reaches every block's weights), and the
    held-out KL it reports is what the simulated executor measures on its output run under the same plan.
    (Whether training lowers that KL is a question for a real model: on this random one the int4 error is
    rounding noise of KL 0.003 that held-out windows of random tokens do not teach away.) The output's blocks
    run only under the modes they were trained for: under any other plan the model is the base model."""
    from safetensors.torch import load_file as load

    from syncdrop.plan import parse_plan

    src = resolve_model(str(tiny_llama_dir))
    L = src.config.num_layers
    w = _windows(src.config.vocab_size, 20, 32, seed=2)
    plan = parse_plan("int4:g8", L)
    out = tmp_path / "int4"
    settings = E2ESettings(lr=1e-3, epochs=1, ckpt_every=1000)
    stopped = e2e_distill(str(tiny_llama_dir), TP, plan, w[:16], w[16:], out, settings, {"dataset": "ids"},
                          progress=False, stop_after=4)
    assert stopped == {"stopped_at": 4}
    state = load(out / STATE_FILE)
    for i in range(L):  # after 4 steps every block's matrices moved: the gradient went through the compressed sums
        names = [n for n in src.reader.names() if n.startswith(f"layers.{i}.") and n.endswith("weight") and
                 src.reader.get(n).dim() == 2]
        assert names and all(not torch.equal(state[f"param/{n}"], src.reader.get(n).float()) for n in names), i
    m = e2e_distill(str(tiny_llama_dir), TP, plan, w[:16], w[16:], out, settings, {"dataset": "ids"}, progress=False)
    st = m["distill"]["e2e"]
    assert m["distill"]["trained_blocks"] == list(range(L)) and set(m["blocks"]) == {str(i) for i in range(L)}
    kept = st["heldout_kl"] if st["selected_epoch"] else st["heldout_kl_start"]
    assert abs(_held_kl(str(out), str(tiny_llama_dir), w[16:]) - kept) < 1e-6  # run under its own plan, int4:g8

    rt = choose_runtime("simulated", "cpu")
    ids = w[:2]
    from syncdrop.runtime import for_plan

    trained = resolve_model(str(out))
    for spec in ("none", "int4:g8", "int8:g8", "all"):
        runs = for_plan(trained, parse_plan(spec, L), warn=False).spd.blocks
        assert sorted(runs) == (list(range(L)) if spec == "int4:g8" else []), spec
        if spec != "int4:g8":  # any other form of the blocks: the base model's weights, exactly
            with torch.inference_mode():
                got = rt.build(str(out), TP, spec, progress=False).model.hidden_states(ids)
                want = rt.build(str(tiny_llama_dir), TP, spec, progress=False).model.hidden_states(ids)
                assert torch.equal(got, want), spec


def test_distill_cli_e2e_method_for_a_compressed_plan(tiny_llama_dir, text_file, tmp_path, capsys) -> None:
    """`syncdrop distill --method e2e --plan int8:g8` trains end to end from --model; the block-wise methods
    refuse a plan that drops nothing, naming --method e2e."""
    out = tmp_path / "cli"
    base = ["distill", "--model", str(tiny_llama_dir), "--tp", "2", "--calib", str(text_file), "--seq-len", "16",
            "--samples", "2", "--heldout", "1", "-q", "--out", str(out)]
    assert main([*base, "--plan", "int8:g8", "--method", "e2e"]) == 0
    assert "trained blocks [0, 1] end to end" in capsys.readouterr().out
    assert (out / "syncdrop.json").is_file()
    assert main([*base[:-1], str(tmp_path / "b2b"), "--plan", "int8:g8"]) == 2
    assert "--method e2e" in capsys.readouterr().err
    assert main([*base[:-1], str(tmp_path / "none"), "--plan", "none", "--method", "e2e"]) == 2
    assert "drops or compresses" in capsys.readouterr().err


def test_scan_summary_lists_a_model_once_and_keeps_its_file_when_a_curve_is_missing(tmp_path) -> None:
    """experiments/recovery_scan_summary.py: a model that two scanned sweeps evaluated is one row, not two, named
    by the directory the sweep evaluated (as rows read from a model directory are); and when a model a scanned
    sweep trained has no curve anywhere (its directory gone, its results row older than recorded curves), an
    existing summary is kept rather than rewritten without that model."""
    import json

    summary = _benchmark("recovery_scan_summary")
    e2e = {"adapter": "full", "lr": 3e-5, "epochs": 1, "train_windows": [64, 512], "heldout_curve": [0.1, 0.07],
           "selected_epoch": 1, "seconds": 60.0}
    model = "hg+b2b+e2e_f0.5_full_lr3e-05_n64_ep1"
    for sweep_dir in ("a", "b"):
        d = tmp_path / "results" / sweep_dir
        (d / "nll").mkdir(parents=True)
        (d / "nll" / "hg+b2b+e2e_f0.5.json").write_text(json.dumps({"key": {"model": f"runs/{model}"}}))
        row = {"fraction": 0.5, "method": "hg+b2b+e2e", "ratio": 1.03, "ratio_ci": [1.02, 1.04], "e2e": e2e}
        (d / "recovery.json").write_text(json.dumps({"rows": [row], "times": {f"e2e:{model}": 60.0}}))
    out = tmp_path / "scan"
    args = ["--work", str(tmp_path / "gone"), "--fraction", "0.5", "--scan", str(tmp_path / "results"),
            "--out", str(out)]
    assert summary.main(args) == 0
    rows = json.loads((tmp_path / "scan.json").read_text())["rows"]
    assert [r["dir"] for r in rows] == [f"runs/{model}"]
    # a third sweep trained another model whose curve nothing holds: the summary above stays as it is
    d = tmp_path / "results" / "c"
    d.mkdir()
    other = "e2e:hg+b2b+e2e_f0.5_full_lr1e-04_n64_ep1"
    (d / "recovery.json").write_text(json.dumps({"rows": [], "times": {other: 1.0}}))
    before = (tmp_path / "scan.json").read_text()
    assert summary.main(args) == 0
    assert (tmp_path / "scan.json").read_text() == before
