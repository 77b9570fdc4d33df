"""The distributed runtime (gloo, one process per rank) against the simulated executor, and faults.

Every test here starts real worker processes on this machine, as torchrun would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from syncdrop.models.loading import resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.parallel.launch import free_port, launch
from syncdrop.plan import parse_plan

WORKER = str(Path(__file__).parent / "workers" / "dist_logits.py")
PLANS = ["none", "all", "blocks:0"]


def _check_parity(model_spec: str, tp: int, plans: list[str], tmp_path: Path, exact: bool = True,
                  tol: float = 1e-5) -> None:
    out = tmp_path / f"logits_tp{tp}.safetensors"
    assert launch([model_spec, str(tp), "1" if exact else "0", str(out), *plans], tp, program=[WORKER]) == 0
    got = load_file(str(out))
    src = resolve_model(model_spec)
    ids = torch.randint(0, src.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    sim = simulated_model(src.config, src.reader, tp)
    for spec in plans:
        sim.plan = parse_plan(spec, src.config.num_layers)
        ref = sim(ids)
        diff = (got[spec] - ref).abs().max().item()
        assert diff <= tol, f"{model_spec} tp={tp} plan={spec}: max abs diff {diff:.3g}"
    # the distributed comm really ran: one all-reduce per kept sync point, per plan
    L = src.config.num_layers
    expected = sum(2 * L - len(parse_plan(p, L).dropped) for p in plans)
    assert int(got["calls"][0]) == expected


@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_distributed_equals_simulated(tp: int, tmp_path: Path) -> None:
    """TP=2 is the uneven split (5 + 4 heads, KV head 1 on both ranks); plans none, all-SPD, mixed.
    With --exact-reduce the runtime sums partials in rank order, as the simulation does."""
    _check_parity("smollm2", tp, [*PLANS, "blocks:3,7,29"], tmp_path)


def test_smollm2_ring_all_reduce_matches_to_rounding(tmp_path: Path) -> None:
    """The default ring all-reduce sums in a chunk-dependent order: equal up to float rounding."""
    _check_parity("smollm2", 3, PLANS, tmp_path, exact=False, tol=1e-3)


def test_tiny_opt_distributed_equals_simulated(tiny_opt_dir, tmp_path: Path) -> None:
    """Biases: row-parallel biases added once after the sum, on every rank."""
    _check_parity(str(tiny_opt_dir), 2, [*PLANS, "all"], tmp_path)


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def long_text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "long.txt"
    p.write_text("the quick brown fox jumps over the lazy dog and keeps running. " * 20000)
    return p


def test_dead_rank_makes_the_others_fail_fast(tiny_llama_dir, long_text) -> None:
    """torchrun-style start (no launcher): SIGKILL rank 1 mid-run; rank 0 must exit non-zero with a
    message naming the failure, well within 60 s."""
    port = free_port()
    cmd = [sys.executable, "-m", "syncdrop", "-v", "ppl", "--model", str(tiny_llama_dir), "--tp", "2",
           "--dataset", str(long_text), "--seq-len", "16", "--dist-timeout", "30"]
    procs = [subprocess.Popen(cmd, env=_rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        for line in procs[1].stderr:  # wait until rank 1 is computing
            if "ready" in line:
                break
        time.sleep(1.0)
        assert procs[0].poll() is None, "rank 0 finished before the fault was injected"
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode not in (0, None)
    assert elapsed < 60, f"rank 0 took {elapsed:.1f}s to notice"
    assert "peer rank died" in err and "Traceback" not in err


def test_launcher_names_the_rank_that_died(tiny_llama_dir, long_text) -> None:
    cmd = [sys.executable, "-m", "syncdrop", "-v", "ppl", "--launch", "--model", str(tiny_llama_dir), "--tp", "2",
           "--dataset", str(long_text), "--seq-len", "16", "--dist-timeout", "30"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in launcher.stderr:  # both ranks log "ready"
            if "rank 1 ready" in line:
                break
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(children) == 2
        os.kill(int(children[1]), signal.SIGKILL)
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode not in (0, None) and elapsed < 60
    assert "rank 1 was killed by SIGKILL" in err


def test_ranks_that_disagree_refuse_to_start(tiny_llama_dir, long_text) -> None:
    port = free_port()
    base = [sys.executable, "-m", "syncdrop", "ppl", "--model", str(tiny_llama_dir), "--tp", "2", "-q",
            "--dataset", str(long_text), "--seq-len", "16", "--max-windows", "2"]
    procs = [subprocess.Popen(base + ["--plan", plan], env=_rank_env(r, 2, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, plan in enumerate(["none", "all"])]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2 and "disagree with rank 0" in err and "Traceback" not in err


def test_tp_must_match_world_size(tiny_llama_dir, long_text) -> None:
    port = free_port()
    base = [sys.executable, "-m", "syncdrop", "ppl", "--model", str(tiny_llama_dir), "--tp", "3", "-q",
            "--dataset", str(long_text), "--seq-len", "16", "--max-windows", "2"]
    procs = [subprocess.Popen(base, env=_rank_env(r, 2, port), stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and "--tp 3 but the job has 2 ranks" in err


def test_bench_and_generate_under_launch(tiny_llama_dir, long_text, tmp_path: Path) -> None:
    """bench writes the documented fields; generate prints only on rank 0; all ranks agree."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "syncdrop", "bench", "--launch", "--model", str(tiny_llama_dir),
                        "--tp", "2", "--plans", "none,blocks:0,all", "--prompt-len", "16", "--decode-tokens", "3",
                        "--reps", "2", "--warmup", "0", "--dataset", str(long_text), "--link-latency", "20us",
                        "--json", str(out), "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import json

    res = json.loads(out.read_text())
    assert [p["plan"] for p in res["plans"]] == ["none", "blocks:0", "all"]
    for p in res["plans"]:
        for key in ("plan", "spd_fraction", "ttft_ms", "decode_ms", "ideal_saving_ms", "realised_over_ideal"):
            assert key in p
        assert len(p["ttft_samples_ms"]) == 2
    assert res["settings"]["link"]["latency_s"] == pytest.approx(2e-5)
    assert res["memory"]["ranks"][1]["weights_mb"] < res["memory"]["full_copy_mb"]
    assert (tmp_path / "bench.md").is_file()

    g = subprocess.run([sys.executable, "-m", "syncdrop", "generate", "--launch", "--model", str(tiny_llama_dir),
                        "--tp", "2", "--plan", "all", "--prompt", "the quick brown fox", "--max-new-tokens", "8",
                        "--temperature", "0.8", "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert g.returncode == 0, g.stderr
    assert g.stdout.count("the quick brown fox") == 1  # rank 0 only


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--tp", "2"], "add --launch"),
        (["bench", "--launch", "--tp", "2", "--link-bandwidth", "fast"], "--link-bandwidth 'fast'"),
        (["bench", "--launch", "--tp", "2", "--link-latency", "soon"], "--link-latency 'soon'"),
        (["bench", "--launch", "--tp", "2", "--plans", "none,sideways"], "malformed plan"),
        (["bench", "--launch", "--tp", "2", "--plans", "none,model"], "has no plan of its own"),
        (["generate", "--launch", "--tp", "9", "--prompt", "x"], "exceeds the model's 6 query heads"),
    ],
)
def test_bad_distributed_flags_exit_2(tiny_llama_dir, args, message) -> None:
    r = subprocess.run([sys.executable, "-m", "syncdrop", *args, "--model", str(tiny_llama_dir)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
