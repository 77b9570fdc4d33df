"""``--launch``: start N worker processes on this machine, as ``torchrun --nproc-per-node N`` would.

Each worker runs ``python -m syncdrop <same arguments>`` with the rendezvous environment set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``) and
``OMP_NUM_THREADS = cores // N`` unless already set.

The rendezvous store lives in the launcher, as torchrun's agent store does
(``TORCHELASTIC_USE_AGENT_STORE=True``: every rank, rank 0 included, connects as a client). The
launcher binds it to port 0 and passes the port it got, so no other process can take the port
between choosing and binding it (a "free port" probed and released would race), and the store
outlives every rank, so the order in which ranks exit does not matter. Only rank 0's standard output is shown. If a
worker fails, the others get ``grace_s`` seconds to exit on their own (they notice through their
collective timeouts), then are terminated; the launcher names the failed rank and exits non-zero.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable


def host_store(world: int, timeout_s: float = 300.0):
    """A rendezvous store served from this process on an OS-chosen port of 127.0.0.1 (held until the
    returned object is dropped); ``.port`` is the port to hand to the ranks."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s))


def rank_env(rank: int, world: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world`` local ranks joining the store at ``port``."""
    return dict(os.environ if base is None else base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_USE_AGENT_STORE="True")


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(argv: list[str], nprocs: int, grace_s: float = 15.0, poll_s: float = 0.05,
           program: list[str] | None = None, on_failure: Callable[[str], None] | None = None) -> int:
    """Run ``python -m syncdrop *argv`` (or ``python *program *argv``) as ``nprocs`` ranks; return
    the job's exit code. ``on_failure``: receives the failure line (which ranks failed and how)
    instead of standard error, for a caller that raises it (:func:`syncdrop.bench.run.run_bench`)."""
    program = program if program is not None else ["-m", "syncdrop"]
    store = host_store(nprocs)
    threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    procs: list[subprocess.Popen] = []
    for rank in range(nprocs):
        env = rank_env(rank, nprocs, store.port)
        env.setdefault("OMP_NUM_THREADS", threads)
        out = None if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, *program, *argv], env=env, stdout=out))
    first: list[tuple[int, int]] = []  # ranks that failed on their own, in order of detection
    stopped: list[int] = []
    try:
        while True:
            codes = [p.poll() for p in procs]
            first += [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in dict(first)]
            if all(c is not None for c in codes):
                break
            if first:
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(poll_s)
                codes = [p.poll() for p in procs]
                first += [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in dict(first)]
                stopped = [r for r, c in enumerate(codes) if c is None]
                _stop(procs)
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    codes = [p.wait() for p in procs]
    if not first:
        return 0
    if codes[0] == 2:  # a usage error: rank 0 already printed it
        return 2
    what = "; ".join(f"rank {r} {_describe(c)}" for r, c in first)
    if stopped:
        what += f"; stopped rank(s) {stopped} still running after {grace_s:.0f}s"
    if on_failure is not None:
        on_failure(what)
    else:
        print(f"syncdrop: distributed job failed: {what}", file=sys.stderr)
    return first[0][1] if first[0][1] > 0 else 1


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
