"""The distributed runtime (gloo, one process per rank) against the simulated executor, and faults.

Every test here starts real worker processes on this machine, as torchrun would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from syncdrop.cli import main
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.parallel.launch import host_store, launch, rank_env
from syncdrop.plan import parse_plan

WORKER = str(Path(__file__).parent / "workers" / "dist_logits.py")
PLANS = ["none", "all", "blocks:0"]


def _check_parity(model_spec: str, tp: int, plans: list[str], tmp_path: Path, ring_plans: tuple[str, ...] = (),
                  tol: float = 1e-5, ring_tol: float = 1e-3) -> None:
    """One launch: every plan with ``--exact-reduce`` semantics (equal to the simulation to ``tol``),
    then ``ring_plans`` again with the backend's own all-reduce (equal to float rounding)."""
    out = tmp_path / f"logits_tp{tp}.safetensors"
    assert launch([model_spec, str(tp), ",".join(plans), ",".join(ring_plans), str(out)], tp, program=[WORKER]) == 0
    got = load_file(str(out))
    src = resolve_model(model_spec)
    ids = torch.randint(0, src.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    sim = simulated_model(src.config, src.reader, tp)
    refs = {}
    for spec in dict.fromkeys([*plans, *ring_plans]):
        sim.plan = parse_plan(spec, src.config.num_layers)
        refs[spec] = sim(ids)
    for mode, specs, bound in (("exact", plans, tol), ("ring", ring_plans, ring_tol)):
        for spec in specs:
            diff = (got[f"{mode}/{spec}"] - refs[spec]).abs().max().item()
            assert diff <= bound, f"{model_spec} tp={tp} plan={spec} ({mode}): max abs diff {diff:.3g}"
    # the distributed comm really ran: one all-reduce per kept sync point, per plan
    L = src.config.num_layers
    expected = sum(2 * L - len(parse_plan(p, L).dropped) for p in [*plans, *ring_plans])
    assert int(got["calls"][0]) == expected


def test_smollm2_distributed_equals_simulated_tp2(tmp_path: Path) -> None:
    """TP=2 is the uneven split (5 + 4 heads, KV head 1 on both ranks); plans none, all-SPD, mixed.
    With --exact-reduce the runtime sums partials in rank order, as the simulation does."""
    _check_parity("smollm2", 2, [*PLANS, "blocks:3,7,29"], tmp_path)


def test_smollm2_distributed_equals_simulated_tp3(tmp_path: Path) -> None:
    """TP=3, exact reduce; and the default ring all-reduce, which sums in a chunk-dependent order:
    equal up to float rounding. Both from one launch (one model load per rank)."""
    _check_parity("smollm2", 3, [*PLANS, "blocks:3,7,29"], tmp_path, ring_plans=tuple(PLANS))


def test_tiny_opt_distributed_equals_simulated(tiny_opt_dir, tmp_path: Path) -> None:
    """Biases: row-parallel biases added once after the sum, on every rank."""
    _check_parity(str(tiny_opt_dir), 2, [*PLANS, "all"], tmp_path)


def test_tiny_phi3_distributed_equals_simulated(tiny_phi3_dir, tmp_path: Path) -> None:
    """Phi-3: each rank reads only its rows of the fused qkv_proj and gate_up_proj; over 2 gloo ranks the runtime
    gives the simulated executor's logits, dense, all-SPD and mixed. (Qwen3's q/k norms are the same (d,)
    vectors on every rank, read as whole tensors as the other norms are.)"""
    _check_parity(str(tiny_phi3_dir), 2, ["none", "all", "blocks:0"], tmp_path)


def test_compressed_plans_distributed_equal_simulated_bit_for_bit(tiny_llama_dir, tmp_path: Path) -> None:
    """The two-step compressed all-reduce (all-to-all, then all-gather, over gloo) sums each chunk in rank
    order on its rank, as the simulation sums its rank axis: the same bits at TP=2 and TP=3, alone and on the
    SPD block's one sync point (bf16:g48 at TP=3: 26 groups of one token each, chunks padded to 27), and with
    the Hadamard rotation (int4h: its butterflies are elementwise, so chunking does not change its bits)."""
    for tp in (2, 3):
        _check_parity(str(tiny_llama_dir), tp,
                      ["none+int8:g16", "all+int4:g16", "blocks:0+fp8:g8", "bf16:g48", "int4h:g16"], tmp_path, tol=0.0)


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return rank_env(rank, world, port) | {"OMP_NUM_THREADS": "1"}


def _rank_of(pid: int) -> int:
    """The RANK a worker process was started with (from its environment, not from start order)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=", 1)[1])


HANG_GUARD_S = 120  # a test that waits longer than this has hung: it fails, it is not a measurement


@pytest.fixture(scope="module")
def long_text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "long.txt"
    p.write_text("the quick brown fox jumps over the lazy dog and keeps running. " * 20000)
    return p


def test_dead_rank_makes_the_others_fail_fast(tiny_llama_dir, long_text) -> None:
    """torchrun-style start (no launcher; the test hosts the store): SIGKILL rank 1 mid-run; rank 0
    must exit 1 with the one-line message naming the failure, and no traceback."""
    store = host_store(2)
    cmd = [sys.executable, "-m", "syncdrop", "-v", "ppl", "--model", str(tiny_llama_dir), "--tp", "2",
           "--dataset", str(long_text), "--seq-len", "16", "--dist-timeout", "30"]
    procs = [subprocess.Popen(cmd, env=_rank_env(r, 2, store.port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        for line in procs[1].stderr:  # wait until rank 1 is computing
            if "ready" in line:
                break
        assert procs[0].poll() is None, "rank 0 finished before the fault was injected"
        procs[1].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=HANG_GUARD_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 1, err
    assert "peer rank died" in err and "Traceback" not in err


def test_launcher_names_the_rank_that_died(tiny_llama_dir, long_text) -> None:
    cmd = [sys.executable, "-m", "syncdrop", "-v", "ppl", "--launch", "--model", str(tiny_llama_dir), "--tp", "2",
           "--dataset", str(long_text), "--seq-len", "16", "--dist-timeout", "30"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = set()
        for line in launcher.stderr:  # both ranks log "rank N ready"
            ready |= {r for r in (0, 1) if f"rank {r} ready" in line}
            if ready == {0, 1}:
                break
        children = [int(c) for c in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
        assert sorted(_rank_of(c) for c in children) == [0, 1]
        os.kill(next(c for c in children if _rank_of(c) == 1), signal.SIGKILL)
        _, err = launcher.communicate(timeout=HANG_GUARD_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, err
    assert "rank 1 was killed by SIGKILL" in err
    assert "rank 0 was killed" not in err  # rank 0 noticed and exited on its own


def test_ranks_that_disagree_refuse_to_start(tiny_llama_dir, long_text) -> None:
    store = host_store(2)
    base = [sys.executable, "-m", "syncdrop", "ppl", "--model", str(tiny_llama_dir), "--tp", "2", "-q",
            "--dataset", str(long_text), "--seq-len", "16", "--max-windows", "2"]
    procs = [subprocess.Popen(base + ["--plan", plan], env=_rank_env(r, 2, store.port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, plan in enumerate(["none", "all"])]
    outs = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2 and "disagree with rank 0" in err and "Traceback" not in err


def test_tp_must_match_world_size(tiny_llama_dir, long_text) -> None:
    store = host_store(2)
    base = [sys.executable, "-m", "syncdrop", "ppl", "--model", str(tiny_llama_dir), "--tp", "3", "-q",
            "--dataset", str(long_text), "--seq-len", "16", "--max-windows", "2"]
    procs = [subprocess.Popen(base, env=_rank_env(r, 2, store.port), stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=HANG_GUARD_S)
        assert p.returncode == 2 and "--tp 3 but the job has 2 ranks" in err


def test_bench_under_launch(tiny_llama_dir, long_text, tmp_path: Path) -> None:
    """bench writes the documented fields, one file per interleaved link (--links), and every rank exits 0."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "syncdrop", "bench", "--launch", "--model", str(tiny_llama_dir),
                        "--tp", "2", "--plans", "none,blocks:0,all", "--prompt-len", "16", "--decode-tokens", "3",
                        "--reps", "2", "--warmup", "0", "--dataset", str(long_text), "--links", "none,inf+20us",
                        "--json", str(out), "-q"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr
    assert not out.exists() and (tmp_path / "bench_none.md").is_file()
    bare = json.loads((tmp_path / "bench_none.json").read_text())
    res = json.loads((tmp_path / "bench_inf+20us.json").read_text())
    for d in (bare, res):
        assert d["settings"]["interleaved_links"] == ["none", "inf+20us"] and d["reps_run"] == 2
    assert bare["settings"]["link"]["bandwidth_Bps"] is None and bare["settings"]["link"]["latency_s"] == 0
    assert [p["plan"] for p in res["plans"]] == ["none", "blocks:0", "all"]
    for p in res["plans"]:
        for key in ("plan", "spd_fraction", "ttft_ms", "decode_ms", "ideal_saving_ms", "realised_over_ideal"):
            assert key in p
        assert len(p["ttft_samples_ms"]) == 2
    assert res["settings"]["link"]["latency_s"] == pytest.approx(2e-5)
    sync = res["sync_points"]
    assert len(sync["points"]) == 4 and len(sync["prefill_samples_ms"]) == 2
    # each sync point inside the forward includes the emulated ring's wait, 2 (N - 1) x 20 us, at least
    assert min(min(t) for t in sync["prefill_samples_ms"] + sync["decode_samples_ms"]) >= 0.04
    assert res["memory"]["ranks"][1]["weights_mb"] < res["memory"]["full_copy_mb"]
    assert (tmp_path / "bench_inf+20us.md").is_file()


@pytest.mark.parametrize("extra", [
    ["--plan", "all", "--temperature", "0.8", "--top-k", "50", "--seed", "3"],
    # naive drops: the ranks' streams diverge, so rank 0's tokens are broadcast to the others
    ["--plan", "all", "--drop-variant", "naive"],
], ids=["sampled", "naive-broadcast"])
def test_generate_under_launch_equals_simulation(tiny_llama_dir, capsys, extra: list[str]) -> None:
    """Distributed generate (exact reduce) prints the prompt once (rank 0 only) and the same tokens
    as the simulated executor in this process."""
    args = ["generate", "--model", str(tiny_llama_dir), "--tp", "2", "--prompt", "the quick brown fox",
            "--max-new-tokens", "8", "--ignore-eos", "--exact-reduce", *extra]
    assert main([*args, "--executor", "simulated"]) == 0
    expected = capsys.readouterr().out
    g = subprocess.run([sys.executable, "-m", "syncdrop", *args, "--launch"], capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert g.returncode == 0, g.stderr
    assert g.stdout.count("the quick brown fox") == 1
    assert g.stdout == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--tp", "2"], "add --launch"),
        (["bench", "--launch", "--tp", "2", "--link-bandwidth", "fast"], "--link-bandwidth 'fast'"),
        (["bench", "--launch", "--tp", "2", "--link-latency", "soon"], "--link-latency 'soon'"),
        (["bench", "--launch", "--tp", "2", "--plans", "none,sideways"], "malformed plan"),
        (["bench", "--launch", "--tp", "2", "--plans", "none,model"], "has no plan of its own"),
        (["bench", "--launch", "--tp", "2", "--links", "none,fast"], "--links 'fast'"),
        (["bench", "--launch", "--tp", "2", "--links", "none,inf+20us,inf+0.02ms"], "same link as 'inf+20us'"),
        (["bench", "--launch", "--tp", "2", "--links", "none", "--link-latency", "20us"], "drop --link-bandwidth"),
        (["generate", "--launch", "--tp", "9", "--prompt", "x"], "exceeds the model's 6 query heads"),
    ],
)
def test_bad_distributed_flags_exit_2(tiny_llama_dir, capsys, args, message) -> None:
    """Checked in the launching process before any worker starts (so in-process here)."""
    assert main([*args, "--model", str(tiny_llama_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
