"""The runtime chosen once (syncdrop.runtime): device and backend from flags and the environment.

The GPU count is the one input this CPU-only machine cannot vary, so these tests set it
(``syncdrop.runtime._cuda_count``) together with the ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` that
torchrun and ``--launch`` set; everything else runs the real code.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import syncdrop.runtime as runtime
from syncdrop.errors import SyncdropError
from syncdrop.parallel import dist
from syncdrop.runtime import choose_runtime, resolve_backend, resolve_device


@pytest.fixture
def node(monkeypatch):
    """``node(gpus, local_rank, local_world)``: this process as rank ``local_rank`` of
    ``local_world`` on a node with ``gpus`` GPUs (``local_rank=None``: a single process)."""

    def set_node(gpus: int, local_rank: int | None = None, local_world: int = 1) -> None:
        monkeypatch.setattr(runtime, "_cuda_count", lambda: gpus)
        for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK", "MASTER_ADDR"):
            monkeypatch.delenv(k, raising=False)
        if local_rank is not None:
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
            monkeypatch.setenv("WORLD_SIZE", str(local_world))

    return set_node


@pytest.mark.parametrize("spec,gpus,local,world,want", [
    ("auto", 0, None, 1, "cpu"),
    ("cpu", 4, None, 1, "cpu"),
    ("auto", 2, None, 1, "cuda:0"),
    ("cuda", 1, None, 1, "cuda:0"),
    ("cuda:1", 2, None, 1, "cuda:1"),
    ("auto", 4, 3, 4, "cuda:3"),       # one GPU per local rank: rank r takes cuda:LOCAL_RANK
    ("cuda", 4, 2, 4, "cuda:2"),
    ("auto", 1, 1, 2, "cpu"),          # fewer GPUs than local ranks: auto stays on CPU
    ("cuda", 2, 3, 4, "cuda:1"),       # ... and an explicit cuda shares them round-robin (gloo only)
])
def test_device_choice(node, spec: str, gpus: int, local: int | None, world: int, want: str) -> None:
    node(gpus, local, world)
    assert resolve_device(spec, distributed=local is not None) == torch.device(want)


@pytest.mark.parametrize("spec,gpus,local,world,match", [
    ("cuda", 0, None, 1, "no CUDA device is available"),
    ("cuda:2", 2, None, 1, "this machine has 2 CUDA device"),
    ("cuda:0", 2, 0, 2, "every rank would use the same GPU"),
    ("tpu", 2, None, 1, "must be auto | cpu | cuda | cuda:N, got 'tpu'"),
])
def test_device_errors_name_the_flag(node, spec, gpus, local, world, match) -> None:
    node(gpus, local, world)
    with pytest.raises(SyncdropError, match=match) as e:
        resolve_device(spec, distributed=local is not None)
    assert e.value.field == "device"


@pytest.mark.parametrize("spec,device,gpus,world,want", [
    ("auto", "cpu", 0, 2, "gloo"),
    ("auto", "cuda:1", 2, 2, "nccl"),     # every local rank has its own GPU
    ("auto", "cuda:0", 1, 2, "gloo"),     # ranks share a GPU: NCCL cannot
    ("gloo", "cuda:1", 2, 2, "gloo"),
    ("nccl", "cuda:0", 2, 2, "nccl"),
])
def test_backend_choice(node, spec, device, gpus, world, want) -> None:
    node(gpus, 0, world)
    assert resolve_backend(spec, torch.device(device)) == want


@pytest.mark.parametrize("device,gpus", [("cpu", 0), ("cpu", 2), ("cuda:0", 1)])
def test_nccl_without_a_gpu_per_rank_is_an_error(node, device: str, gpus: int) -> None:
    node(gpus, 0, 2)
    with pytest.raises(SyncdropError, match="nccl needs a CUDA device per local rank.*use --backend gloo") as e:
        resolve_backend("nccl", torch.device(device))
    assert e.value.field == "backend"
    with pytest.raises(SyncdropError, match="must be one of auto, gloo, nccl, got 'mpi'"):
        resolve_backend("mpi", torch.device(device))


def test_distributed_rank_needs_local_rank(node, monkeypatch) -> None:
    """On several nodes the global rank is not the local one: without LOCAL_RANK it is an error, not a guess."""
    node(2)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SyncdropError, match="LOCAL_RANK is not set"):
        dist.local_rank()
    with pytest.raises(SyncdropError, match="LOCAL_RANK is not set"):
        resolve_device("auto", distributed=True)


def test_single_process_runtime(node) -> None:
    node(0)
    rt = choose_runtime(device="auto", backend="nccl", dtype="bfloat16")  # backend: no effect in one process
    assert (rt.executor, rt.device, rt.backend, rt.dtype) == ("simulated", torch.device("cpu"), None, torch.bfloat16)
    assert rt.describe()["device"] == "cpu"
    with pytest.raises(SyncdropError, match="must be one of simulated|must be one of auto") as e:
        choose_runtime(executor="tpu")
    assert e.value.field == "executor"


@pytest.mark.parametrize("args,match", [
    (["--launch", "--backend", "nccl"], "--backend nccl needs a CUDA device per rank; this machine has 0 GPU"),
    (["--launch", "--device", "cuda"], "--device cuda: no CUDA device is available"),
    (["--device", "cuda:0"], "--device cuda:0: no CUDA device is available"),
    (["--device", "gpu"], "--device must be auto | cpu | cuda | cuda:N, got 'gpu'"),
])
def test_cli_refuses_devices_this_machine_lacks(tiny_llama_dir, text_file, args: list[str], match: str) -> None:
    """On this CPU-only machine: exit 2, one line naming the flag, no traceback, no rank started. An explicit
    --dataset: the default (auto) logs a fallback warning first where WikiText-2 is absent (a newcomer's clone)."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    r = subprocess.run([sys.executable, "-m", "syncdrop.cli", "ppl", "--model", str(tiny_llama_dir), "--tp", "2",
                        "--dataset", str(text_file), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and match in lines[0], r.stderr
